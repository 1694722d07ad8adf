"""The best-effort writer pool starts with the run's first best-effort part, not at create(): a run
without best-effort states never starts its processes, and one that cannot start fails its parts by
name instead of leaving them waiting unreported."""
import asyncio

import pytest
import ray
import torch

import ray_ckpt as rc
from actors import Learner, Replay, remote


def test_the_best_effort_pool_starts_with_the_first_best_effort_part(engine_factory):
    learner = remote(Learner).remote(seed=3)
    eng = engine_factory(remote_uri=None, critical_writers=1)  # best_effort_writers=1 (the default)
    eng.register("policy", learner)
    eng.save(1).wait(timeout=60)
    assert eng.status()["best_effort_writers"] == 0  # only critical states so far: no process started

    buf = remote(Replay).remote(seed=4)
    ray.get(buf.add.remote(700))
    eng.register("replay", buf, strategy=rc.Strategy.BEST_EFFORT)
    h = eng.save(2)
    h.wait(timeout=60, best_effort=True)
    assert eng.status()["best_effort_writers"] == 1
    want = ray.get(buf.contents.remote())
    got = eng.load("replay", step=2)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    assert torch.equal(eng.load("policy", step=2)["0.weight"],
                       ray.get(learner.ckpt_get_state.remote("policy"))["0.weight"])


def test_best_effort_writers_that_cannot_start_fail_their_parts_by_name(ray_session, tmp_path):
    """The plain pool object in a real Ray: writers asking for more CPUs than the cluster has do not
    start, and the wait for them ends in an error that says what to check."""
    from ray_ckpt.config import EngineConfig
    from ray_ckpt.errors import CheckpointError
    from ray_ckpt.writers import WriterPools

    cfg = EngineConfig(run="beprobe", local_dir=str(tmp_path), critical_writers=1, critical_cpus=0.01,
                       best_effort_writers=1, best_effort_cpus=64.0)
    pools = WriterPools(cfg)
    try:
        assert pools.best_effort == [] and len(pools.all()) == 1
        with pytest.raises(CheckpointError, match=r"best-effort writers did not start within 1s.*best_effort_cpus=64"):
            asyncio.run(pools.best_effort_started(timeout=1.0))
        assert len(pools.best_effort) == 1  # asked for once; a later part waits for the same writers
    finally:
        for w in pools.all():
            ray.kill(w)
