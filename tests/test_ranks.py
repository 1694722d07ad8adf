"""Ranks that run their own loop push their parts (OpenRLHF / verl style).

The rank actors come from the session's pool (conftest.py's ``provider``, via ``pooled_ranks``) and
are reset at each test: each is a process that imports torch (~3.5 CPU-s on 2 cores)."""
import os
import sys
import time

import pytest
import ray
import torch

import ray_ckpt as rc

pytestmark = pytest.mark.timeout(240)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # RankActor, pooled, in the workers

# No best-effort state is pushed here: no best-effort pool; one critical writer where the order in
# which versions commit is not the point (every writer is a process to start).
LEAN = {"critical_writers": 1, "best_effort_writers": 0}


class RankActor:
    def __init__(self, run: str, rank: int, seed=None):
        self.run, self.rank = run, rank
        g = torch.Generator().manual_seed(rank if seed is None else seed)
        self.shard = {"w": torch.randn(64, 64, generator=g), "step": 0}
        self.engine = None
        self.handles = {}

    def train_and_submit(self, step: int, name: str = "shard"):
        self.shard["w"] += 1.0
        self.shard["step"] = step
        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        t = time.perf_counter()
        self.handles[(name, step)] = self.engine.submit(step, name, self.shard, rank=self.rank)
        return time.perf_counter() - t

    def wait_saved(self, step: int, name: str = "shard", timeout: float = 60):
        try:
            return ("ok", self.handles[(name, step)].wait(timeout=timeout).version)
        except rc.SaveError as exc:
            return ("error", str(exc))

    def ckpt_get_state(self, name):
        return self.shard

    def ckpt_set_state(self, name, state):
        self.shard = state

    def get(self):
        return {"w": self.shard["w"].clone(), "step": self.shard["step"]}

    def scramble(self):
        self.shard = {"w": torch.zeros(1), "step": -1}

    def reset(self, run: str, rank: int, seed=None):
        """A fresh rank of ``run`` in this process (the pool's reset): its connection to the last
        run and its handles are dropped."""
        self.__init__(run, rank, seed)
        return os.getpid()


Rank = ray.remote(num_cpus=0.1)(RankActor)


def pooled_ranks(provider, run: str, n: int = 2, seed=None):
    """``n`` rank actors of ``run`` from the session's pool, as ``Rank.remote(run, r, seed)`` makes them."""
    return [provider(RankActor, run, r, seed, _slot=r) for r in range(n)]


def wait_until(pred, timeout=60):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_version_commits_when_every_rank_pushed_and_restores_per_rank(engine_factory, run_name, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(**LEAN)
    eng.register("shard", ranks, world_size=2)
    decl = eng.declarations()["shard"]
    assert decl.world_size == 2 and not decl.replicated
    assert ray.get(ranks[0].train_and_submit.remote(1)) < 2.0  # returns before rank 1 pushed: never waits for the commit
    wait_until(lambda: 1 in eng.status()["in_flight"])
    assert eng.status()["in_flight"][1]["parts"]["shard/rank1"] == "pending"
    assert eng.list_checkpoints() == []  # rank 1 has not pushed: not visible
    ray.get(ranks[1].train_and_submit.remote(1))
    assert ray.get([r.wait_saved.remote(1) for r in ranks]) == [("ok", 1), ("ok", 1)]
    assert [m.version for m in eng.list_checkpoints()] == [1]
    want = ray.get([r.get.remote() for r in ranks])
    ray.get([r.scramble.remote() for r in ranks])
    report = eng.restore()
    assert report.states["shard"].status == "restored"
    got = ray.get([r.get.remote() for r in ranks])
    for a, b in zip(want, got):
        assert torch.equal(a["w"], b["w"]) and a["step"] == b["step"] == 1
    assert not torch.equal(got[0]["w"], got[1]["w"])  # each rank got its own part
    assert torch.equal(eng.load(1, "shard", rank=1)["w"], want[1]["w"])


def test_pushed_versions_take_their_upload_turns_by_the_ranks_count(engine_factory, run_name, tmp_path, provider):
    """remote_every=2 with pushed states: the ranks' 2nd and 4th pushes (steps 20 and 40) are
    uploaded, whatever order the versions commit in."""
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(remote_every=2, keep_last=10, remote_keep_last=10, best_effort_writers=0)
    eng.register("shard", ranks, world_size=2)
    for step in (10, 20, 30, 40):
        ray.get([r.train_and_submit.remote(step) for r in ranks])
    for step in (10, 20, 30, 40):
        assert ray.get([r.wait_saved.remote(step) for r in ranks]) == [("ok", step)] * 2
    remote_dir = tmp_path / "remote" / run_name
    wait_until(lambda: sorted(m.version for m in eng.list_checkpoints() if "remote" in m.tiers) == [20, 40])
    assert sorted(p.name for p in remote_dir.iterdir() if not p.name.startswith(("owner.json", "head.json"))) == ["v000000000020", "v000000000040"]


def test_ranks_at_different_steps_fail_the_version(engine_factory, run_name, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(**LEAN)
    eng.register("shard", world_size=2)
    ray.get(ranks[0].train_and_submit.remote(2))
    wait_until(lambda: 2 in eng.status()["in_flight"])  # the coordinator runs calls from two callers in any order
    ray.get(ranks[1].train_and_submit.remote(3))  # rank 1 skipped step 2
    status, msg = ray.get(ranks[0].wait_saved.remote(2))
    assert status == "error" and "ranks disagree on the step" in msg and "rank 1" in msg
    ray.get(ranks[0].train_and_submit.remote(3))
    assert ray.get(ranks[0].wait_saved.remote(3)) == ("ok", 3)
    assert [m.version for m in eng.list_checkpoints()] == [3]


def test_missing_rank_times_out_loudly_without_blocking_later_versions(engine_factory, run_name, tmp_path, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(rank_timeout_s=2.0, **LEAN)
    eng.register("shard", world_size=2)
    ray.get(ranks[0].train_and_submit.remote(5))   # rank 1 is silent (hung, or lost)
    status, msg = ray.get(ranks[0].wait_saved.remote(5, timeout=30))
    assert status == "error" and "rank_timeout_s" in msg and "shard' rank 1" in msg
    ray.get([r.train_and_submit.remote(6) for r in ranks])
    assert ray.get([r.wait_saved.remote(6) for r in ranks]) == [("ok", 6), ("ok", 6)]
    assert [m.version for m in eng.list_checkpoints()] == [6]
    wait_until(lambda: not os.path.exists(tmp_path / "local" / run_name / "v000000000005"))


def test_replicated_state_is_stored_once_and_restored_to_every_rank(engine_factory, run_name, tmp_path, provider):
    ranks = pooled_ranks(provider, run_name, seed=0)  # same seed: DDP replicas
    eng = engine_factory(**LEAN)
    eng.register("shard", ranks, world_size=2, replicated=True)
    ray.get([r.train_and_submit.remote(1) for r in ranks])
    assert ray.get([r.wait_saved.remote(1) for r in ranks]) == [("ok", 1), ("ok", 1)]
    assert os.listdir(tmp_path / "local" / run_name / "v000000000001" / "shard") == ["rank0.safetensors"]
    want = ray.get(ranks[0].get.remote())
    ray.get([r.scramble.remote() for r in ranks])
    eng.restore()
    for got in ray.get([r.get.remote() for r in ranks]):
        assert torch.equal(got["w"], want["w"])


def test_submit_bad_input(engine_factory, run_name, provider):
    eng = engine_factory(**LEAN)
    eng.register("shard", world_size=2)
    with pytest.raises(rc.SaveError, match="not declared"):
        eng.submit(1, "other", {"x": torch.ones(1)}, rank=0)
    with pytest.raises(rc.SaveError, match="out of range"):
        eng.submit(1, "shard", {"x": torch.ones(1)}, rank=2)
    with pytest.raises(rc.InvalidArgumentError, match="list of 2 rank actor handles"):
        eng.register("shard2", pooled_ranks(provider, run_name, n=1), world_size=2)
