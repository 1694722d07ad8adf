"""Providers and handles as torch / concurrent.futures users already know them (real Ray, real torch).

The tests share one engine (``engine``: one run, local tier only), each with its own thousand steps
and with nothing registered at its start: none of them is about the run's own history, and an
engine is a coordinator and writer processes to start (~3 s each on a 2-core machine)."""
import asyncio
import concurrent.futures
import contextlib
import io
import threading
import uuid

import pytest
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.cli.main import main as cli
from actors import FreshFlaky, FreshLearner, FreshWeird

pytestmark = pytest.mark.timeout(240)

# One critical writer where the pools' sizes are not the point (every writer is a process to start:
# seconds on a 2-core machine); the best-effort pool is for test_save_handle_is_a_future_and_awaitable.
SHARED = {"remote_uri": None, "critical_writers": 1, "best_effort_writers": 1}


@pytest.fixture(scope="module")
def _shared_engine(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("conventions")
    eng = rc.CheckpointEngine.create(f"t{uuid.uuid4().hex[:10]}", local_dir=str(root / "local"), **SHARED)
    bases = iter(range(1000, 10 ** 9, 1000))
    yield eng, root, bases
    eng.shutdown()


@pytest.fixture
def engine(_shared_engine):
    """``(eng, base, root)``: the module's engine with nothing registered, the first of this test's
    thousand steps (steps increase along a run; ``base + 1`` stands for step 1), and the local
    tier's root (``root / eng.run / version dir``). States the test registered are unregistered
    after it."""
    eng, root, bases = _shared_engine
    for name in list(eng.registered):
        eng.unregister(name)
    yield eng, next(bases), root
    for name in list(eng.registered):
        eng.unregister(name)


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, n):
    for _ in range(n):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_stateful_objects_register_as_they_are_and_restore_bit_exact(engine):
    """A module, an optimizer and an LR scheduler are registered as themselves (state_dict /
    load_state_dict); a StatefulDataLoader's position resumes exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    model, opt, sched = _model_and_opt(0)
    loader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(3))
    it = iter(loader)
    for _ in range(3):
        next(it)
    _train(model, opt, sched, 3)
    eng, base, _ = engine
    for name, obj in (("model", model), ("optimizer", opt), ("sched", sched), ("data", loader)):
        eng.register(name, obj)
    eng.save(base + 1).result(timeout=60)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_lr, want_moment = sched.get_last_lr(), opt.state_dict()["state"][0]["exp_avg"].clone()
    want_next = [next(it).tolist() for _ in range(3)]  # what the loader yields after the save

    _train(model, opt, sched, 4)  # training goes on, then the process "restarts" from the save
    fresh = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                               generator=torch.Generator().manual_seed(99))
    eng.register("data", fresh, replace=True)
    report = eng.restore()
    assert {n: r.status for n, r in report.states.items()} == dict.fromkeys(("model", "optimizer", "sched", "data"),
                                                                              "restored")
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    assert sched.get_last_lr() == want_lr and torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_moment)
    it2 = iter(fresh)
    assert [next(it2).tolist() for _ in range(3)] == want_next


def test_actor_method_saves_an_actor_attribute_through_its_state_dict(engine, provider):
    learner = provider(FreshLearner, seed=4)  # the session's pooled actor (conftest.py), reset
    trained = learner.train.remote(3)
    eng, base, _ = engine
    ray.get(trained)
    eng.register("model", rc.actor_method(learner, "model"))
    eng.register("optimizer", rc.actor_method(learner, "opt"))
    assert eng.save(base + 1).result(timeout=60).states == ("model", "optimizer")
    want = ray.get(learner.snapshot.remote())
    ray.get(learner.train.remote(2))
    eng.restore()
    got = ray.get(learner.snapshot.remote())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(rc.InvalidArgumentError, match="attribute name"):
        rc.actor_method(learner, "../opt")


def test_save_handle_is_a_future_and_awaitable(engine, provider):
    learner, weird = provider(FreshLearner, seed=5), provider(FreshWeird)
    eng, base, _ = engine
    eng.register("policy", learner)
    eng.register("replay", weird, strategy=rc.Strategy.BEST_EFFORT)
    h = eng.save(base + 1)
    called = threading.Event()
    h.add_done_callback(lambda handle: called.set())
    assert h.result(timeout=60).version == base + 1 and h.exception(timeout=60) is None
    assert called.wait(30) and h.done()
    # what the coordinator knows of the version reaches the user's SaveResult
    assert h.wait(timeout=60, best_effort=True).missing == ("replay",)

    async def main():
        return await eng.save(base + 2)

    assert asyncio.run(main()).version == base + 2


def test_concurrent_futures_wait_and_as_completed_take_handles(engine, provider):
    learner = provider(FreshLearner, seed=8)
    eng, base, _ = engine
    eng.register("policy", learner)
    handles = [eng.save(base + i) for i in (1, 2, 3)]
    assert all(isinstance(h, concurrent.futures.Future) for h in handles)
    done, not_done = concurrent.futures.wait(handles, timeout=120)
    assert not not_done and done == set(handles)
    assert sorted(h.result().version for h in done) == [base + 1, base + 2, base + 3]
    seen = [h.result(timeout=0).version for h in concurrent.futures.as_completed(
        [eng.save(base + 4), eng.save(base + 5)], timeout=120)]
    assert sorted(seen) == [base + 4, base + 5]
    # a failed save is a finished future carrying its SaveError
    flaky = provider(FreshFlaky)
    ray.get(flaky.set_failing.remote(True))
    eng.register("counter", flaky)
    (finished,), _ = concurrent.futures.wait([eng.save(base + 6)], timeout=120)
    assert isinstance(finished.exception(timeout=0), rc.SaveError)
    with pytest.raises(rc.SaveError, match="capture failed on purpose"):
        eng.wait_until_finished(timeout=60)  # the engine reports it too, once


def test_load_by_name_step_and_rank(engine, provider):
    learner = provider(FreshLearner, seed=6)
    eng, base, _ = engine
    eng.register("policy", learner)
    eng.save(base + 10).result(timeout=60)
    ray.get(learner.train.remote())
    eng.save(base + 20).result(timeout=60)
    latest, first = eng.load("policy"), eng.load("policy", step=base + 10, rank=0)
    assert not torch.equal(latest["0.weight"], first["0.weight"])
    with pytest.warns(DeprecationWarning):
        assert torch.equal(eng.load(base + 10, "policy")["0.weight"], first["0.weight"])
    with pytest.raises(rc.InvalidArgumentError, match="name is required"):
        eng.load(step=base + 10)
    with pytest.raises(rc.RestoreError, match=f"no committed checkpoint at step {base + 15}"):
        eng.load("policy", step=base + 15)


def _damage(root, eng, version):
    """Flip the last byte of ``version``'s policy file on the local tier (its only copy here)."""
    f = root / "local" / eng.run / f"v{version:012d}" / "policy" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_plain_restore_passes_over_a_version_whose_only_copy_is_damaged_naming_it(engine, provider):
    learner = provider(FreshLearner, seed=7)
    eng, base, root = engine
    v1, v2 = base + 1, base + 2
    eng.register("policy", learner)
    eng.save(v1).result(timeout=60)
    want = ray.get(learner.snapshot.remote())
    ray.get(learner.train.remote())
    eng.save(v2).result(timeout=60)
    _damage(root, eng, v2)
    assert eng.list_checkpoints()[-1].step == v2  # nobody has looked at its bytes yet
    # issue 44: a plain restore finds v2's only copy damaged; the coordinator checks that copy itself,
    # v2 leaves the list, and the newest version listed then (v1) is restored, the report naming v2
    report = eng.restore()
    assert report.version == v1 and list(report.skipped_versions) == [v2], report
    why = report.skipped_versions[v2]
    assert "no copy of 1 critical file(s) verifies" in why and "local:" in why and "rank0.safetensors" in why, why
    assert f"skipped newer version {v2}" in str(report)
    got = ray.get(learner.snapshot.remote())
    assert all(torch.equal(want[k], got[k]) for k in want if k.startswith("p."))
    assert v2 not in [m.step for m in eng.list_checkpoints()] and eng.status()["skipped_versions"][v2] == why
    out = io.StringIO()  # storage says so too (lost_versions.json): a restarted coordinator, ray-ckpt ls
    with contextlib.redirect_stdout(out):
        assert cli(["ls", str(root / "local" / eng.run)]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in out.getvalue().splitlines() if line[:1].isdigit()}
    assert rows[str(v2)] == "lost" and rows[str(v1)] == "complete", out.getvalue()
    report = eng.restore(fallback=True)  # fallback=True as before: v2 named skipped, v1 restored
    assert report.version == v1 and list(report.skipped_versions) == [v2]


def test_restore_fallback_walks_past_a_version_whose_copy_is_bad_here(engine, provider):
    learner = provider(FreshLearner, seed=8)
    eng, base, root = engine
    v1, v2, v3 = base + 1, base + 2, base + 3
    eng.register("policy", learner)
    eng.save(v1).result(timeout=60)
    want = ray.get(learner.snapshot.remote())
    for v in (v2, v3):
        ray.get(learner.train.remote())
        eng.save(v).result(timeout=60)
        _damage(root, eng, v)
    # a restore of that very step: refused, saying it was checked and why it is no longer listed
    with pytest.raises(rc.RestoreError, match=f"cannot restore step {v3} of run .*; it is no longer listed: no copy "
                                              f"of 1 critical file"):
        eng.restore(step=v3)
    report = eng.restore(fallback=True)
    assert report.version == v1 and sorted(report.skipped_versions) == [v2, v3], report
    assert "checksum" in report.skipped_versions[v2] or "does not match" in report.skipped_versions[v2]
    assert f"skipped newer version {v2}" in str(report)
    got = ray.get(learner.snapshot.remote())
    assert all(torch.equal(want[k], got[k]) for k in want if k.startswith("p."))
    with pytest.raises(rc.RestoreError, match=f"no committed checkpoint at step {v2} \\(it is not listed: no copy of 1 "
                                              f"critical file\\(s\\) verifies .*checksum mismatch"):
        eng.restore(step=v2)


class _Counters:
    """RLlib's Checkpointable protocol: get_state() / set_state(state)."""

    def __init__(self):
        self.state = {"env_steps": 0, "episodes": 0, "returns": torch.zeros(3)}

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_a_checkpointable_object_registers_as_it_is(engine):
    counters = _Counters()
    counters.state.update(env_steps=1200, episodes=17, returns=torch.tensor([1.5, 2.5, -1.0]))
    eng, base, _ = engine
    eng.register("counters", counters)
    eng.save(base + 1).result(timeout=60)
    counters.state = {"env_steps": 0, "episodes": 0, "returns": torch.zeros(3)}
    assert eng.restore().states["counters"].status == "restored"
    assert counters.state["env_steps"] == 1200 and counters.state["episodes"] == 17
    assert torch.equal(counters.state["returns"], torch.tensor([1.5, 2.5, -1.0]))


def test_orbax_style_steps_and_wait_until_finished(engine, provider):
    learner, weird = provider(FreshLearner, seed=5), provider(FreshWeird)
    eng, base, _ = engine
    eng.register("policy", learner)
    eng.save(base + 1)
    eng.save(base + 2)
    assert [r.step for r in eng.wait_until_finished(timeout=120)] == [base + 1, base + 2]
    assert eng.latest_step() == base + 2 and eng.all_steps()[-2:] == [base + 1, base + 2]

    # a save that fails in the background, its handle ended and dropped by the engine before the
    # call: wait_until_finished() still raises it, after the later save committed
    eng.register("bad", weird)  # CRITICAL, and holds a Python object: the save fails in its snapshot
    failed = eng.save(base + 3)
    assert failed.exception(timeout=60) is not None
    eng.unregister("bad")
    eng.save(base + 4)  # the engine forgets the ended handle of step base + 3 here
    with pytest.raises(rc.SaveError, match="object"):
        eng.wait_until_finished(timeout=120)
    assert eng.latest_step() == base + 4 and base + 3 not in eng.all_steps()
    assert eng.wait_until_finished(timeout=10) == []  # reported once


class _Gated:
    """Its state is handed over only once ``gate`` exists (a file: the test opens it)."""

    def __init__(self, gate: str):
        self.gate = gate

    def ckpt_get_state(self, name):
        import os
        import time as _time

        deadline = _time.monotonic() + 60
        while not os.path.exists(self.gate) and _time.monotonic() < deadline:
            _time.sleep(0.05)
        return {"w": torch.arange(4.0)}

    def ckpt_set_state(self, name, state):
        pass


def test_a_wait_that_runs_out_of_time_is_a_timeout_error(engine, tmp_path):
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    eng, base, _ = engine
    gate = tmp_path / "gate"
    actor = ray.remote(num_cpus=0.1)(_Gated).remote(str(gate))
    eng.register("gated", actor)
    h = eng.save(base + 1)
    assert h.running() and not h.cancel() and not h.cancelled()
    with pytest.raises(TimeoutError, match="not durable on the local tier after 0.5s") as info:
        h.result(timeout=0.5)
    assert isinstance(info.value, rc.SaveError)  # a SaveTimeoutError: both, for old and new callers
    with pytest.raises(rc.SaveTimeoutError):
        h.exception(timeout=0.2)
    gate.touch()
    assert h.result(timeout=60).step == base + 1 and not h.running()
    ray.kill(actor)
