"""The README demo runs and resumes bit-identically after its simulated preemption."""
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_resumes_bit_identically(ray_session, tmp_path, capsys):
    demo = runpy.run_path(str(ROOT / "examples" / "demo.py"), run_name="demo_under_test")
    # saves at steps 3 and 6, preempted at 7: the restore goes back to version 6 and replays step 7
    rc_ = demo["main"](["--steps", "8", "--save-every", "3", "--kill-at", "7", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "restored version 6 (step 6)" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ")}
    assert rows.get("bit-identical") == "yes", out
    assert rows.get("weights sent from saves", "").endswith("of 8 steps"), out  # engine.publish after saves
    assert rc_ == 0


@pytest.mark.slow  # 20-35 s: its own example process against the suite's S3 server
@pytest.mark.timeout(300)
def test_s3_example_restores_from_s3(ray_session, s3_server, capsys, run_name):
    ex = runpy.run_path(str(ROOT / "examples" / "s3_example.py"), run_name="s3_example_under_test")
    code = ex["main"](["--remote-uri", s3_server.uri("examples"), "--endpoint", s3_server.endpoint,
                       "--access-key", s3_server.access_key, "--secret-key", s3_server.secret_key,
                       "--run", run_name])
    out = capsys.readouterr().out
    assert "restored from remote; weights after replay bit-identical: yes" in out, out
    # remote_every=2: odd versions stay local; the remote keeps the uploaded ones
    assert "v6[local+remote]" in out and "v5[local]" in out, out
    assert code == 0
