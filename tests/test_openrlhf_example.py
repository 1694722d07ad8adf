"""The OpenRLHF-style example, both backends.

* fsdp2: 2 FSDP2 learner ranks in a gloo group push DTensor state; rank 1 is killed, the run
  resumes on 3 ranks (resharded, uneven), and right after the restore the new group's full
  parameters and AdamW moments are bit-equal to what the old group held when it saved; the run
  finishes; the frozen reference model is written once.
* deepspeed: 2 ranks of OpenRLHF's real DeepSpeed strategy (``RayCkptDeepspeedStrategy``, ZeRO-2,
  a tiny Qwen2) save with ``save_ckpt``; rank 1 is killed, the run resumes on 1 rank with
  ``load_ckpt`` (resharded); the full fp32 weights, Adam moments and 16-bit weights gathered with
  DeepSpeed's own calls are bit-equal to what the 2 ranks held; the dataloader comes back from the
  client_state; the new rank's save commits; docs/integrating.md's command is the example's."""
import importlib.util
import json
import re
import runpy
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


def _deepspeed_installed() -> bool:
    return importlib.util.find_spec("openrlhf") is not None and importlib.util.find_spec("deepspeed") is not None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_deepspeed_backend_resumes_openrlhf_strategy_on_another_rank_count(ray_session, tmp_path, capsys):
    if not _deepspeed_installed():
        pytest.skip("OpenRLHF / DeepSpeed are not installed: see docs/openrlhf.md (install)")
    mod = runpy.run_path(str(ROOT / "examples" / "openrlhf_style" / "train.py"), run_name="openrlhf_ds_under_test")
    rc_ = mod["main"](["--backend", "deepspeed", "--zero-stage", "2", "--steps", "9", "--save-every", "3",
                       "--kill-at", "7", "--ranks", "2", "--resume-ranks", "1", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc_ == 0, out
    assert "9 steps on 2 DeepSpeed ZeRO-2 ranks (OpenRLHF's strategy)" in out, out
    assert "preemption: killing rank 1; the group of 2 goes and comes back on 1 ranks" in out, out
    # step 6's version (the newest committed at the kill), the dataloader where it was: 6 steps x 12 sequences
    assert re.search(r"restored global_step6 onto 1 ranks with load_ckpt in [\d.]+ s; dataloader at epoch 0, "
                     r"72 sequences consumed", out), out
    assert "Adam moments and 16-bit weights after load_ckpt = saved at step 6, bit for bit: yes" in out, out
    assert re.search(r"\| restored = saved, bit for bit\s+\|\s+yes \|", out), out
    assert re.search(r"\| ranks\s+\|\s+2 -> 1 \|", out), out
    assert "committed versions kept (max_num=3): global_step3, global_step6, global_step9" in out, out

    res = mod["RESULTS"]
    assert res["backend"] == "deepspeed" and res["restored_identical"] and res["mismatched"] == []
    assert res["worlds"] == [2, 1] and res["steps_done"] == 9 and res["restored_step"] == 6
    assert res["versions"] == [3, 6, 9] and all(res["version_bytes"][v] > 0 for v in (3, 6, 9))
    assert res["client_state"]["data_loader_state_dict"] == {"epoch": 0, "consumed": 72, "total_consumed": 72,
                                                             "shuffle_seed": 0}
    # what OpenRLHF's resume reads: DeepSpeed's latest (moved at each commit) and each tag's pointer
    save_dir = Path(res["save_dir"])
    assert (save_dir / "latest").read_text().strip() == "global_step9"
    pointer = json.loads((save_dir / "global_step6" / "ray_ckpt.json").read_text())
    assert (pointer["run"], pointer["step"], pointer["world_size"]) == (res["run"], 6, 2)
    # each rank wrote its own ZeRO partition: 2 files before the kill, 1 after
    run_dir = tmp_path / "local" / res["run"]
    assert sorted(p.name for p in (run_dir / "v000000000006" / "optim").iterdir()) == ["rank0.safetensors",
                                                                                      "rank1.safetensors"]
    assert sorted(p.name for p in (run_dir / "v000000000009" / "optim").iterdir()) == ["rank0.safetensors"]


def test_integrating_docs_openrlhf_commands_are_the_examples():
    """docs/integrating.md's OpenRLHF section: each command it shows parses with the example's own
    parser (the test above runs that path); no placeholder is left."""
    text = (ROOT / "docs" / "integrating.md").read_text(encoding="utf-8")
    section = re.search(r"^## OpenRLHF$(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert any("--backend deepspeed" in c for c in commands), commands
    mod = runpy.run_path(str(ROOT / "examples" / "openrlhf_style" / "train.py"), run_name="openrlhf_docs_under_test")
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["python", "examples/openrlhf_style/train.py"], command
        mod["build_parser"]().parse_args(argv[2:])
    for stale in ("load_zero_optimizer_state", "placeholder", "Not run", "not run"):
        assert stale not in section, stale
