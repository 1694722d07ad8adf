"""The SkyRL integration's parts that need no SkyRL (issue 48): its settings (``ray_ckpt=`` or
``$RAY_CKPT_SKYRL``), when SkyRL's tracker may name a step, and that ``import
ray_ckpt.integrations.skyrl`` imports neither SkyRL nor flash_attn. Runs in every environment;
tests/test_skyrl.py runs SkyRL itself (make test-skyrl)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ray_ckpt as rc
from ray_ckpt.integrations.committed import write_pointer
from ray_ckpt.integrations.skyrl import ENV, TRACKER, read_settings
from ray_ckpt.integrations.skyrl.tracker import (LOST_PREFIX, advance_if_complete, lost_folders, read_tracker,
                                                 step_of_path, write_roles)


def test_settings_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert read_settings() is None and read_settings({"local_dir": "/x"}) is None  # no run: not switched on
    s = read_settings({"run": "ppo", "local_dir": "/ckpt", "rank_timeout_s": 30, "load_wait_s": 5})
    assert (s.run, s.create, s.load_wait_s, s.run_of("critic")) == \
        ("ppo", {"local_dir": "/ckpt", "rank_timeout_s": 30}, 5, "ppo-critic")
    monkeypatch.setenv(ENV, json.dumps({"run": "env", "remote_uri": "s3://b/p", "overlap": False}))
    s = read_settings()
    assert (s.run, s.create, s.overlap, s.creates) == ("env", {"remote_uri": "s3://b/p"}, False, False)
    for bad, words in [({"run": "x", "keep_lsat": 2}, "keep_lsat"), ({"run": "x", "tracker": "yes"}, "tracker")]:
        with pytest.raises(rc.InvalidArgumentError, match=words):
            read_settings(bad)
    monkeypatch.setenv(ENV, "{run: x")
    with pytest.raises(rc.InvalidArgumentError, match=ENV):
        read_settings()


def _commit(step_dir, role, step):
    write_pointer(os.path.join(step_dir, role), {"run": f"r-{role}", "step": step})


def test_the_tracker_names_a_step_once_every_listed_part_is_there(tmp_path):
    """With the trainer's list (roles + trainer_state.pt): not before the last of them; without
    it: every role folder committed. Never backwards."""
    ckpt = tmp_path / "ckpt"
    d3, d2 = str(ckpt / "global_step_3"), str(ckpt / "global_step_2")
    assert step_of_path(os.path.join(d3, "policy")) == 3 and step_of_path(str(tmp_path / "policy")) is None
    write_roles(d3, ["policy", "critic"], ["trainer_state.pt"])
    _commit(d3, "policy", 3)
    assert advance_if_complete(d3, 3) is None
    _commit(d3, "critic", 3)
    assert advance_if_complete(d3, 3) is None and not (ckpt / TRACKER).exists()  # trainer_state.pt not yet
    (ckpt / "global_step_3" / "trainer_state.pt").write_bytes(b"x")
    assert advance_if_complete(d3, 3) == 3 and read_tracker(str(ckpt)) == 3

    os.makedirs(os.path.join(d2, "policy"))  # the strategy alone: no list
    _commit(d2, "policy", 2)
    assert advance_if_complete(d2, 2) == 3 and read_tracker(str(ckpt)) == 3  # an older step never moves it back
    d4 = str(ckpt / "global_step_4")
    os.makedirs(os.path.join(d4, "policy"))
    os.makedirs(os.path.join(d4, "critic"))
    _commit(d4, "policy", 4)
    assert advance_if_complete(d4, 4) == 3
    _commit(d4, "critic", 4)
    assert advance_if_complete(d4, 4) == 4


def test_folders_moved_aside_go_once_a_step_past_them_is_complete(tmp_path):
    """What a resume past a lost version moved aside (``ray_ckpt_lost.[n.]global_step_M``) stays until
    the tracker names a complete step >= M, then is deleted; newer ones, the user's own folders and
    SkyRL's ``global_step_N`` stay."""
    ckpt = tmp_path / "ckpt"
    aside = [f"{LOST_PREFIX}global_step_2", f"{LOST_PREFIX}global_step_3", f"{LOST_PREFIX}1.global_step_3",
             f"{LOST_PREFIX}global_step_9"]
    for name in aside + ["global_step_3.mine", "global_step_1"]:
        os.makedirs(ckpt / name / "critic")
        _commit(str(ckpt / name), "critic", 1)  # a pointer, as a moved folder holds
    d4 = str(ckpt / "global_step_4")
    write_roles(d4, ["policy", "critic"], [])
    _commit(d4, "policy", 4)
    assert advance_if_complete(d4, 4) is None
    assert lost_folders(str(ckpt)) == sorted(aside)  # step 4 not complete: nothing removed
    _commit(d4, "critic", 4)
    assert advance_if_complete(d4, 4) == 4
    assert lost_folders(str(ckpt)) == [f"{LOST_PREFIX}global_step_9"]
    assert sorted(os.listdir(ckpt)) == sorted(["global_step_1", "global_step_3.mine", "global_step_4",
                                               f"{LOST_PREFIX}global_step_9", TRACKER])


def test_package_imports_neither_skyrl_nor_flash_attn():
    code = ("import sys, ray_ckpt.integrations.skyrl as s; s.read_settings(None); "
            "print(sorted(m for m in ('skyrl', 'flash_attn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
