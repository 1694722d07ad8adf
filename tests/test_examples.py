"""The README demo runs and resumes bit-identically after its simulated preemption."""
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_demo_resumes_bit_identically(ray_session, tmp_path, capsys):
    demo = runpy.run_path(str(ROOT / "examples" / "demo.py"), run_name="demo_under_test")
    rc_ = demo["main"](["--steps", "12", "--save-every", "3", "--kill-at", "8", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "restored version 6 (step 6)" in out
    assert "bit-identical" in out and "| bit-identical      |              yes |" in out
    assert rc_ == 0
