"""Ray Train: ray_ckpt as the checkpoint layer of a real TorchTrainer (ray_ckpt.integrations.ray_train)."""
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
