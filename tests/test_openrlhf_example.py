"""The OpenRLHF-style example: sharded learner ranks push their parts, one rank is killed, the group
restores and finishes bit-identically; the frozen reference model is written once."""
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_openrlhf_style_example_resumes_bit_identically(ray_session, tmp_path, capsys):
    mod = runpy.run_path(str(ROOT / "examples" / "openrlhf_style" / "train.py"), run_name="openrlhf_under_test")
    rc_ = mod["main"](["--steps", "10", "--save-every", "3", "--kill-at", "7", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc_ == 0, out
    assert re.search(r"\| bit-identical\s+\|\s+yes \|", out), out
    assert "preemption: killing learner rank 1" in out
    assert "restored version 6 (step 6)" in out
    restored = re.search(r"restored version 6 \(step 6\) in [\d.]+s: (.*);", out).group(1)
    assert restored == ("dataloader=restored/local, optim_shard=restored/local, policy=restored/local, "
                        "reference=restored/local")

    res = mod["RESULTS"]
    assert res["identical"] and res["restored_version"] == 6
    versions = res["versions"]
    assert sorted(versions) == [3, 6, 9]
    # the frozen reference model: written by the first version only, referenced by every later one
    assert res["reference_once"]
    assert all(v["reference_path"] == "v000000000003/reference/rank0.safetensors" for v in versions.values())
    ref_bytes = versions[3]["reference_bytes"]
    assert ref_bytes > 0
    for v in (6, 9):
        assert versions[v]["bytes"] < versions[3]["bytes"]
        # what a later version saves is everything but the reference (+/- a few manifest bytes; a
        # later manifest also records its predecessor's digest: "previous" and "previous_version")
        assert abs(versions[3]["bytes"] - versions[v]["bytes"] - ref_bytes) < 64 + 128
    assert re.search(rf"reference model: {ref_bytes:,} bytes written once \(v3\), referenced by v6, v9: yes", out)

    # every part of the last version is on disk: policy stored once (replicated), a shard per rank
    vdir = tmp_path / "b" / "local"
    run_dir = next(vdir.iterdir())
    v9 = run_dir / "v000000000009"
    assert sorted(p.name for p in (v9 / "policy").iterdir()) == ["rank0.safetensors"]
    assert sorted(p.name for p in (v9 / "optim_shard").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    assert not (v9 / "reference").exists()
    assert (run_dir / "v000000000003" / "reference" / "rank0.safetensors").exists()
    assert len(res["save_ms"]) == 3 and len(res["submit_ms"]) == 3 * 2 * 2
