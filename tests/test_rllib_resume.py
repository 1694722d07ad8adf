"""make_callback(..., resume=True): the setting is checked at the call. What it does -- a Tune trial
restarted by FailureConfig resumes from its own run's latest version in on_algorithm_init, with its
counters -- is tested in test_rllib_tune.py (the grid search with one injected failure per trial)."""
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402


def test_resume_setting_is_validated(tmp_path):
    with pytest.raises(rc.InvalidArgumentError, match="resume"):
        rr.make_callback("r1", local_dir=str(tmp_path), resume="yes")
    assert rr.make_callback("r1", local_dir=str(tmp_path), resume=True).settings.resume is True
