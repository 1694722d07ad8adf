"""The documented rank flow needs no polling: the driver calls ``h = engine.save(step)``, its ranks
``submit(step, ...)``, the driver ``h.result()`` — whichever call reaches the coordinator first.

Ray orders calls per caller, not across callers, so the ranks' pushes may open the version before
the driver's save arrives. A version its ranks open waits for the driver's save when the run has
driver-side states (it would otherwise commit without them and refuse the driver's save)."""
import pytest
import ray
import torch

import ray_ckpt as rc
from test_ranks import pooled_ranks, wait_until

pytestmark = pytest.mark.timeout(180)

# one critical writer, no best-effort pool: nothing best-effort is registered here, and every writer
# is a process to start (seconds on a 2-core machine)
LEAN = {"critical_writers": 1, "best_effort_writers": 0}


def test_ranks_that_push_first_wait_for_the_drivers_save(engine_factory, run_name, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(**LEAN)
    table = {"step": torch.arange(4)}
    eng.register("driver_table", lambda: table, loader=lambda s: None)
    eng.register("shard", ranks, world_size=2)
    # the ranks push first, on purpose, and their parts are written ...
    ray.get([r.train_and_submit.remote(3) for r in ranks])
    wait_until(lambda: 3 in eng.status()["in_flight"]
               and eng.status()["in_flight"][3]["parts"].get("shard/rank1") == "written"
               and eng.status()["in_flight"][3]["parts"].get("shard/rank0") == "written", timeout=60)
    # ... and still the version is not visible: the driver's state is not in it yet
    assert eng.status()["in_flight"][3]["parts"]["driver_table/rank0"] == "pending"
    assert eng.list_checkpoints() == []
    res = eng.save(3).result(timeout=60)     # joins the version the ranks opened
    assert res.version == 3 and set(res.states) == {"driver_table", "shard"}
    assert ray.get([r.wait_saved.remote(3) for r in ranks]) == [("ok", 3), ("ok", 3)]
    assert torch.equal(eng.load("driver_table", step=3)["step"], table["step"])
    # the usual order works the same, with no wait for the open in between
    h = eng.save(4)
    ray.get([r.train_and_submit.remote(4) for r in ranks])
    assert set(h.result(timeout=60).states) == {"driver_table", "shard"}
    assert [m.step for m in eng.list_checkpoints()] == [3, 4]


def test_a_drivers_save_that_never_comes_fails_the_version_naming_it(engine_factory, run_name, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(rank_timeout_s=2.0, **LEAN)
    eng.register("driver_table", lambda: {"x": torch.ones(2)})
    eng.register("shard", ranks, world_size=2)
    ray.get([r.train_and_submit.remote(7) for r in ranks])
    status, msg = ray.get(ranks[0].wait_saved.remote(7, timeout=30))
    assert status == "error" and "driver's save(step=7) did not arrive" in msg and "driver_table" in msg, msg
    assert eng.list_checkpoints() == []
    h = eng.save(8)  # later versions commit normally
    ray.get([r.train_and_submit.remote(8) for r in ranks])
    assert h.result(timeout=60).version == 8


def test_a_run_of_pushed_states_only_gets_one_handle_for_the_whole_version(engine_factory, run_name, provider):
    ranks = pooled_ranks(provider, run_name)
    eng = engine_factory(**LEAN)
    eng.register("shard", ranks, world_size=2)
    h = eng.save(1)  # nothing of its own: opens the version (or joins it) and waits for every rank
    ray.get([r.train_and_submit.remote(1) for r in ranks])
    assert h.result(timeout=60).states == ("shard",)
    ray.get([r.train_and_submit.remote(2) for r in ranks])  # ranks first, the driver's call after
    assert ray.get([r.wait_saved.remote(2) for r in ranks]) == [("ok", 2), ("ok", 2)]
    assert eng.save(2).result(timeout=60).version == 2   # already committed by the ranks: its outcome
    eng.unregister("shard")
    with pytest.raises(rc.InvalidArgumentError, match="nothing to save"):
        eng.save(3)
