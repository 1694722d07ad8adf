"""Providers and handles as torch / concurrent.futures users already know them (real Ray, real torch)."""
import asyncio
import threading

import pytest
import ray
import torch

import ray_ckpt as rc
from actors import Learner, Weird, remote

pytestmark = pytest.mark.timeout(240)

# One critical writer and no best-effort pool where the pools' sizes are not the point (every
# writer is a process to start: seconds on a 2-core machine).
LEAN = {"critical_writers": 1, "best_effort_writers": 0}


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


def test_stateful_objects_register_as_they_are_and_restore_bit_exact(engine_factory):
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
    eng = engine_factory(remote_uri=None, **LEAN)
    for name, obj in (("model", model), ("optimizer", opt), ("sched", sched), ("data", loader)):
        eng.register(name, obj)
    eng.save(1).result(timeout=60)
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


def test_actor_method_saves_an_actor_attribute_through_its_state_dict(engine_factory):
    learner = remote(Learner).remote(seed=4)
    trained = learner.train.remote(3)  # the learner starts while the engine does
    eng = engine_factory(remote_uri=None, **LEAN)
    ray.get(trained)
    eng.register("model", rc.actor_method(learner, "model"))
    eng.register("optimizer", rc.actor_method(learner, "opt"))
    assert eng.save(1).result(timeout=60).states == ("model", "optimizer")
    want = ray.get(learner.snapshot.remote())
    ray.get(learner.train.remote(2))
    eng.restore()
    got = ray.get(learner.snapshot.remote())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(rc.InvalidArgumentError, match="attribute name"):
        rc.actor_method(learner, "../opt")


def test_save_handle_is_a_future_and_awaitable(engine_factory):
    learner, weird = remote(Learner).remote(seed=5), remote(Weird).remote()  # start while the engine does
    eng = engine_factory(remote_uri=None, critical_writers=1)
    eng.register("policy", learner)
    eng.register("replay", weird, strategy=rc.Strategy.BEST_EFFORT)
    h = eng.save(1)
    called = threading.Event()
    h.add_done_callback(lambda handle: called.set())
    assert h.result(timeout=60).version == 1 and h.exception(timeout=60) is None
    assert called.wait(30) and h.done()
    # what the coordinator knows of the version reaches the user's SaveResult
    assert h.wait(timeout=60, best_effort=True).missing == ("replay",)

    async def main():
        return await eng.save(2)

    assert asyncio.run(main()).version == 2


def test_load_by_name_step_and_rank(engine_factory):
    learner = remote(Learner).remote(seed=6)
    eng = engine_factory(remote_uri=None, **LEAN)
    eng.register("policy", learner)
    eng.save(10).result(timeout=60)
    ray.get(learner.train.remote())
    eng.save(20).result(timeout=60)
    latest, first = eng.load("policy"), eng.load("policy", step=10, rank=0)
    assert not torch.equal(latest["0.weight"], first["0.weight"])
    with pytest.warns(DeprecationWarning):
        assert torch.equal(eng.load(10, "policy")["0.weight"], first["0.weight"])
    with pytest.raises(rc.InvalidArgumentError, match="name is required"):
        eng.load(step=10)
    with pytest.raises(rc.RestoreError, match="no committed checkpoint at step 15"):
        eng.load("policy", step=15)


def test_restore_fallback_goes_to_the_newest_version_that_verifies(engine_factory, tmp_path, run_name):
    learner = remote(Learner).remote(seed=7)
    eng = engine_factory(remote_uri=None, **LEAN)
    eng.register("policy", learner)
    eng.save(1).result(timeout=60)
    want = ray.get(learner.snapshot.remote())
    ray.get(learner.train.remote())
    eng.save(2).result(timeout=60)
    f = tmp_path / "local" / run_name / "v000000000002" / "policy" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(rc.RestoreError, match="cannot restore version 2"):
        eng.restore()
    report = eng.restore(fallback=True)
    assert report.version == 1 and list(report.skipped_versions) == [2]
    assert "checksum" in report.skipped_versions[2] or "does not match" in report.skipped_versions[2]
    assert "skipped newer version 2" in str(report)
    got = ray.get(learner.snapshot.remote())
    assert all(torch.equal(want[k], got[k]) for k in want if k.startswith("p."))


class _Counters:
    """RLlib's Checkpointable protocol: get_state() / set_state(state)."""

    def __init__(self):
        self.state = {"env_steps": 0, "episodes": 0, "returns": torch.zeros(3)}

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_a_checkpointable_object_registers_as_it_is(engine_factory):
    counters = _Counters()
    counters.state.update(env_steps=1200, episodes=17, returns=torch.tensor([1.5, 2.5, -1.0]))
    eng = engine_factory(remote_uri=None, **LEAN)
    eng.register("counters", counters)
    eng.save(1).result(timeout=60)
    counters.state = {"env_steps": 0, "episodes": 0, "returns": torch.zeros(3)}
    assert eng.restore().states["counters"].status == "restored"
    assert counters.state["env_steps"] == 1200 and counters.state["episodes"] == 17
    assert torch.equal(counters.state["returns"], torch.tensor([1.5, 2.5, -1.0]))
