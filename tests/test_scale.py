"""One coordinator for many ranks (issue 15): more pushed parts than the coordinator has concurrency
slots, pushed from a few host actors that each push for hundreds of ranks (as ranks share nodes)."""
import sys
import time

import pytest
import ray
import torch

import ray_ckpt as rc

pytestmark = pytest.mark.timeout(300)

STATES = ("params", "optim")


def state_of(rank: int, name: str, step: int) -> dict:
    """A tiny, deterministic per-rank state: the test knows every rank's bytes without asking."""
    base = torch.arange(4, dtype=torch.float32) + rank * 10.0 + step * 100_000.0
    return {"w": base if name == "params" else -base, "rank": rank, "step": step}


class Host:
    """One process holding many ranks (a node's worth): one engine, a submit() per rank and state.

    Started once per module and pointed at each test's run by ``reset()``: each host process imports
    torch (seconds of CPU on a 2-core machine), the same cost for every test."""

    def __init__(self):
        self.run, self.ranks = None, []
        self.engine = None
        self.handles = {}

    def reset(self, run: str, ranks) -> int:
        """Detach from the previous run (a connected engine only detaches) and hold ``ranks`` of ``run``."""
        if self.engine is not None:
            self.engine.shutdown()
        self.run, self.ranks = run, list(ranks)
        self.engine = None
        self.handles = {}
        return self.pid()

    def push(self, step: int, ranks=None) -> float:
        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        t0 = time.perf_counter()
        for r in self.ranks if ranks is None else ranks:
            for name in STATES:
                self.handles[(step, name, r)] = self.engine.submit(step, name, state_of(r, name, step), rank=r)
        return time.perf_counter() - t0

    def wait(self, step: int, timeout: float = 120):
        """Every handle of ``step``: ("ok", version) when all committed, else the first error."""
        deadline = time.monotonic() + timeout
        versions = set()
        for (s, _name, _r), h in self.handles.items():
            if s != step:
                continue
            try:
                versions.add(h.wait(timeout=max(0.1, deadline - time.monotonic())).version)
            except rc.SaveError as exc:
                return ("error", str(exc))
        return ("ok", sorted(versions))

    def pid(self):
        import os

        return os.getpid()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable in workers


def host_actor():
    return ray.remote(num_cpus=0.05)(Host).remote()


def point(hosts, run, groups):
    """Every host at its group of ranks of ``run``; returns once each has answered."""
    ray.get([h.reset.remote(run, ranks) for h, ranks in zip(hosts, groups)], timeout=120)


@pytest.fixture(scope="module")
def hosts(ray_session):
    """Four host processes for the module, created before any test's engine (they import torch while
    the coordinator starts) and not waited for here; a test that kills one puts its replacement in
    this list, so every host made is killed at the end."""
    made = [host_actor() for _ in range(4)]
    yield made
    for h in made:
        ray.kill(h)


def split(world: int, hosts: int):
    per = world // hosts
    return [range(h * per, (h + 1) * per) for h in range(hosts)]


def test_1200_ranks_two_states_from_four_hosts_commit_and_load_per_rank(hosts, engine_factory, run_name):
    world, n_hosts = 1200, 4  # 2,400 parts: more than Ray's default 1,000 concurrency slots
    eng = engine_factory(critical_writers=2, best_effort_writers=0, keep_last=3)
    for name in STATES:
        eng.register(name, world_size=world)
    point(hosts, run_name, split(world, n_hosts))
    t0 = time.monotonic()
    pushes = [h.push.remote(1) for h in hosts]
    latencies = []
    while True:  # the coordinator answers while the parts arrive and are written
        t = time.monotonic()
        eng.list_checkpoints()
        latencies.append(time.monotonic() - t)
        if len(ray.wait(pushes, num_returns=len(pushes), timeout=0)[0]) == len(pushes):
            break
        time.sleep(0.1)
    push_s = ray.get(pushes)
    results = ray.get([h.wait.remote(1, 150) for h in hosts])
    commit_s = time.monotonic() - t0
    assert results == [("ok", [1])] * n_hosts, results
    # it answers throughout (before issue 15 it stopped answering: 60 s timeouts). The goal
    # of < 1 s is met by benchmarks/scale.py (worst 0.06-0.97 s up to 32,768 parts, pushes batched
    # per engine); a test shares the 2-core VM with other runs, hence only a bound that catches a hang
    assert max(latencies) < 30.0, f"list_checkpoints() latencies during the pushes: {sorted(latencies)}"
    metas = eng.list_checkpoints()
    assert [m.version for m in metas] == [1] and set(metas[0].states) == set(STATES)
    for r in (0, 1, world // 2, world - 1):
        for name in STATES:
            got = eng.load(name, step=1, rank=r)
            want = state_of(r, name, 1)
            assert torch.equal(got["w"], want["w"]) and got["w"].dtype == torch.float32
            assert (got["rank"], got["step"]) == (r, 1)
    print(f"\n{world} ranks x {len(STATES)} states from {n_hosts} hosts: pushes {max(push_s):.1f}s, "
          f"committed {commit_s:.1f}s after the first push; list_checkpoints() max {max(latencies):.3f}s "
          f"over {len(latencies)} calls")


def test_killed_host_fails_its_version_naming_missing_ranks_and_the_next_commits(hosts, engine_factory, run_name):
    world, n_hosts = 40, 4  # naming the missing ranks needs only a few: the 1,200-rank test is the scale
    # the timeout counts from the version's first push: it must cover the pushes of 80 parts
    # reaching the coordinator on 2 cores, not only the killed host's silence
    eng = engine_factory(critical_writers=2, best_effort_writers=0, rank_timeout_s=8.0, keep_last=3)
    for name in STATES:
        eng.register(name, world_size=world)
    groups = split(world, n_hosts)
    point(hosts, run_name, groups)
    doomed = hosts[-1]
    half = list(groups[-1])[: len(groups[-1]) // 2]
    ray.get([h.push.remote(2) for h in hosts[:-1]] + [doomed.push.remote(2, half)])

    def written():  # the doomed host's parts are on disk (its objects die with it when it is killed)
        parts = eng.status()["in_flight"].get(2, {}).get("parts", {})
        return all(parts.get(f"{n}/rank{r}") == "written" for n in STATES for r in half)

    deadline = time.monotonic() + 60
    while not written():
        st = eng.status()
        assert time.monotonic() < deadline, f"the pushed parts were not written in time: " \
            f"{st['in_flight'].get(2, {}).get('stage')}; last error {st['last_error']}"
        time.sleep(0.2)
    ray.kill(doomed)  # a node lost mid-push: half its ranks never push version 2

    status, msg = ray.get(hosts[0].wait.remote(2, 90))
    missing = len(STATES) * (len(groups[-1]) - len(half))  # 10 parts
    first = half[-1] + 1
    assert status == "error", msg
    assert "ranks did not push within rank_timeout_s=8s" in msg, msg
    assert f"'optim' rank {first}, 'optim' rank {first + 1}" in msg, msg  # the first few, by name
    assert f"(+{missing - 8} more; {missing} of {len(STATES) * world} parts)" in msg, msg
    assert "did not push" in (eng.status()["last_error"] or "")

    replacement = host_actor()
    hosts[-1] = replacement  # the module's list: the fixture kills it at the end
    point([replacement], run_name, [groups[-1]])
    # started and connected before the version opens: rank_timeout_s counts from its first push, and
    # a new worker process on a busy 2-core machine can take longer than that to start
    ray.get(replacement.push.remote(3, []), timeout=120)
    ray.get([h.push.remote(3) for h in hosts])
    assert ray.get([h.wait.remote(3, 120) for h in hosts]) == [("ok", [3])] * n_hosts
    assert [m.version for m in eng.list_checkpoints()] == [3]
    for r in (first, world - 1):
        assert torch.equal(eng.load("params", step=3, rank=r)["w"], state_of(r, "params", 3)["w"])
