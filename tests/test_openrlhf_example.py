"""The OpenRLHF-style example: 2 FSDP2 learner ranks in a gloo group push DTensor state; rank 1 is
killed, the run resumes on 3 ranks (resharded, uneven), and right after the restore the new group's
full parameters and AdamW moments are bit-equal to what the old group held when it saved; the run
finishes; the frozen reference model is written once."""
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_openrlhf_style_example_resumes_on_another_world_size(ray_session, tmp_path, capsys):
    mod = runpy.run_path(str(ROOT / "examples" / "openrlhf_style" / "train.py"), run_name="openrlhf_under_test")
    rc_ = mod["main"](["--steps", "10", "--save-every", "3", "--kill-at", "7", "--ranks", "2",
                       "--resume-ranks", "3", "--rollout-workers", "1", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc_ == 0, out
    assert "preemption: killing learner rank 1" in out
    restored = re.search(r"restored version 6 \(step 6\) onto 3 ranks in [\d.]+s: (.*);", out)
    assert restored, out
    assert restored.group(1) == ("dataloader=restored/local, optim=restored/local, policy=restored/local, "
                                 "reference=restored/local")
    assert "after the restore = saved at step 6, bit for bit: yes" in out, out
    assert re.search(r"\| restored = saved, bit for bit\s+\|\s+yes \|", out), out

    res = mod["RESULTS"]
    assert res["restored_identical"] and res["mismatched"] == [] and res["restored_version"] == 6
    assert res["worlds"] == [2, 3] and res["steps_done"] == 10
    versions = res["versions"]
    assert sorted(versions) == [3, 6, 9]
    assert [versions[v]["policy_ranks"] for v in (3, 6, 9)] == [2, 2, 3]
    # the frozen reference model: written by the first version only, referenced by every later one
    assert res["reference_once"]
    assert all(v["reference_path"] == "v000000000003/reference/rank0.safetensors" for v in versions.values())
    assert versions[3]["reference_bytes"] > 0
    assert re.search(rf"reference model: {versions[3]['reference_bytes']:,} bytes written once \(v3\), "
                     r"referenced by v6, v9: yes", out)

    # the last version: every rank of the new group wrote its own shards of policy and optim
    run_dir = next((tmp_path / "local").iterdir())
    v9 = run_dir / "v000000000009"
    for name in ("policy", "optim"):
        assert sorted(p.name for p in (v9 / name).iterdir()) == [f"rank{r}.safetensors" for r in range(3)]
    assert not (v9 / "reference").exists()
    assert (run_dir / "v000000000003" / "reference" / "rank0.safetensors").exists()
    assert len(res["save_ms"]) == 3 and len(res["submit_ms"]) == 2 * 2 * 2 + 3 * 2
