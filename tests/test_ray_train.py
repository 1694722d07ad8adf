"""Ray Train: ray_ckpt as the checkpoint layer of a real TorchTrainer (ray_ckpt.integrations.ray_train)."""
import logging
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_package_imports_the_checkpointer_on_first_use():
    import ray_ckpt.integrations.ray_train as rt

    with pytest.raises(AttributeError):
        rt.NoSuchThing  # noqa: B018
    assert rt.Checkpointer.__name__ == "Checkpointer"  # imports with ray[train] installed


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_killed_worker_group_resumes_bit_exact_from_committed_versions_only(tmp_path):
    # its own process: the train function must live in __main__ so Ray ships it by value
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ray_train_scenario.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=960)
    out = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and "RAY TRAIN OK" in proc.stdout, out


def test_a_checkpoint_config_becomes_the_runs_retention():
    from ray.train import CheckpointConfig

    from ray_ckpt.integrations.ray_train import retention_options

    assert retention_options(None) == {}
    assert retention_options(CheckpointConfig()) == {}  # Ray Train keeps every checkpoint: so does the run
    assert retention_options(CheckpointConfig(num_to_keep=3)) == {"keep_last": 3}
    assert retention_options(CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="reward")) == \
        {"keep_best": ("reward", "max", 2)}
    assert retention_options(CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="loss",
                                              checkpoint_score_order="min")) == {"keep_best": ("loss", "min", 1)}


def test_a_notice_saves_at_the_next_report_then_again_once_the_newest_push_is_safe():
    """Unit (no Ray Train context): rank 0's decision at each report. Ray Train's notice alone (a
    worker's node that holds none of the run's files): the first report saves, the next ones not
    until that push committed, then again. The run's own notice: the engine's rule decides
    (``preemption_save_due``: off the drained node, not merely committed)."""
    from ray_ckpt.integrations.ray_train import Checkpointer

    class Engine:
        notice, due, committed = None, None, []

        def preemption(self):
            return self.notice

        def preemption_save_due(self):
            return self.due

        def all_steps(self):
            return list(self.committed)

    ckpt = Checkpointer.__new__(Checkpointer)
    ckpt.rank, ckpt.engine, ckpt._notice_step = 0, Engine(), None
    assert not ckpt._save_for_notice(preempted=False)
    assert ckpt._save_for_notice(preempted=True)
    ckpt._notice_step = 7  # report() pushed step 7 for it
    assert not ckpt._save_for_notice(preempted=True)  # 7 not committed
    ckpt.engine.committed = [7]
    assert ckpt._save_for_notice(preempted=True)
    ckpt._notice_step = 9
    assert not ckpt._save_for_notice(preempted=True)
    # the run's own notice (rank 0's node drained): committed is not enough, the engine says when
    ckpt.engine.notice, ckpt.engine.committed = "notice", [7, 9]
    assert not ckpt._save_for_notice(preempted=True)
    ckpt.engine.due = "notice"
    assert ckpt._save_for_notice(preempted=True)
    ckpt.rank = 1  # only rank 0 decides
    assert not ckpt._save_for_notice(preempted=True)


def test_a_step_the_run_used_for_a_lost_version_is_not_saved_again():
    """Unit (no Ray Train context): a group restored from step 20 after version 30 was lost with its
    node (no longer listed; no step up to it is used again: the coordinator refuses them) does not
    push steps 21-30 again; it saves from step 31 on. Without a lost version, a step below the
    run's newest that was never used is pushed as before (the coordinator takes it)."""
    from types import SimpleNamespace

    from ray_ckpt.integrations.committed import UsedSteps
    from ray_ckpt.integrations.ray_train import Checkpointer

    ckpt = Checkpointer.__new__(Checkpointer)
    ckpt.engine = SimpleNamespace(last_saved_step=30, skipped_versions=lambda: {30: "lost with a node"},
                                  all_steps=lambda: [10, 20])
    ckpt._used = UsedSteps("r", logging.getLogger("t"))
    assert not any(ckpt._step_free(s) for s in (21, 25, 30))
    assert ckpt._step_free(31)
    ckpt.engine = SimpleNamespace(last_saved_step=7, skipped_versions=lambda: {}, all_steps=lambda: [2, 6, 7])
    assert ckpt._step_free(4) and ckpt._step_free(8)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_a_train_runs_retention_and_preemption_notice_are_honoured(tmp_path):
    # its own process and cluster: two nodes, one of them drained for preemption
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ray_train_preemption_scenario.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=660)
    out = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0 and "RAY TRAIN PREEMPTION OK" in proc.stdout, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_guides_example_runs_as_written(tmp_path):
    """docs/ray-train.md's example, with its storage paths pointed at tmp_path and Ray started with
    room for the run's writers beside the two workers (the 2-core VM)."""
    import re

    text = open(os.path.join(HERE, "..", "docs", "ray-train.md"), encoding="utf-8").read()
    code = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)[0]
    for path in ("/mnt/nvme/ckpt", "s3://bucket/runs", "s3://bucket/ray-train"):
        assert path in code, f"the guide's example no longer uses {path}: update this test"
    code = (code.replace("/mnt/nvme/ckpt", str(tmp_path / "local"))
            .replace("s3://bucket/runs", f"file://{tmp_path / 'remote'}")
            .replace("s3://bucket/ray-train", str(tmp_path / "train")))
    script = tmp_path / "example.py"
    script.write_text("import ray\nray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)\n" + code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=560,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "ray_ckpt-step000000000020" in proc.stdout, proc.stdout[-2000:]  # Ray Train's checkpoint: step 20
    remote = sorted(n for n in os.listdir(tmp_path / "remote" / "ppo-ddp") if n.startswith("v"))
    assert remote == [f"v{s:012d}" for s in range(2, 21, 2)], remote  # every pushed step is on the remote tier
