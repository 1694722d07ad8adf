"""Ranks' pushes travel in batches (issue 15, push_batch.py): one coordinator call carries many
parts of one version, and a part the coordinator refuses fails only its own rank's handle, with the
message a call of its own would have raised."""
import time

import numpy as np
import pytest
import ray

import ray_ckpt as rc
from ray_ckpt.client.handle import shared_wait
from ray_ckpt.client.push_batch import PushedPart, Pusher
from ray_ckpt.capture.snapshot import capture

pytestmark = pytest.mark.timeout(120)


def state(rank: int) -> dict:
    return {"w": np.full(8, rank, np.float32)}


def test_a_refused_part_fails_only_its_own_handle(engine_factory, run_name):
    eng = engine_factory(critical_writers=1, best_effort_writers=0, remote_uri=None)
    eng.register("s", world_size=3)
    a, b = rc.CheckpointEngine.connect(run_name), rc.CheckpointEngine.connect(run_name)  # two host processes' engines
    ha = [a.submit(1, "s", state(r), rank=r) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while eng.status()["in_flight"].get(1, {}).get("parts", {}).get("s/rank0") != "written":
        assert time.monotonic() < deadline, eng.status()
        time.sleep(0.05)
    # b's engine cannot know that a pushed rank 0: the coordinator refuses it, inside b's batch
    dup = b.submit(1, "s", {"w": np.full(8, 99, np.float32)}, rank=0)
    good = b.submit(1, "s", state(2), rank=2)
    with pytest.raises(rc.SaveError, match=r"^state 's' rank 0 was already submitted for step 1$"):
        dup.wait(timeout=60)
    assert dup.done() and isinstance(dup.exception(timeout=10), rc.SaveError)
    assert good.wait(timeout=60).version == 1  # the batch's other part went on
    assert [h.wait(timeout=60).version for h in ha] == [1, 1]
    assert np.array_equal(eng.load("s", step=1, rank=0)["w"], state(0)["w"])  # a's bytes, not the refused ones
    assert np.array_equal(eng.load("s", step=1, rank=2)["w"], state(2)["w"])
    a.shutdown()
    b.shutdown()


def test_one_call_carries_a_batch_and_names_the_entry_it_refuses(engine_factory, run_name):
    world = 100
    eng = engine_factory(critical_writers=1, best_effort_writers=0, remote_uri=None)
    eng.register("s", world_size=world)
    coord = eng._coordinator
    before = ray.get(coord.call_counts.remote())
    pusher = Pusher(lambda: coord, lambda c, v: shared_wait(c, v, fresh=True), window_s=600.0)  # sent by hand
    ref = ray.put(capture(state(0), "s", False))
    slots = [pusher.add(1, PushedPart("s", r, ref if r == 0 else ray.put(capture(state(r), "s", False)), 32, False, -1))
             for r in range(world)]
    bad = pusher.add(1, PushedPart("s", world, ref, 32, False, -1))  # out of range on the coordinator's side
    assert pusher.pending_versions() == [1]
    pusher.send_all()
    with pytest.raises(rc.SaveError, match=rf"^rank {world} is out of range for state 's' \(world_size {world}\)$"):
        bad.check(60)
    for s in slots:
        s.check(60)  # accepted
    outcome = ray.get(slots[0].commit_ref(), timeout=60)
    assert outcome.version == 1 and outcome.states == ("s",)
    after = ray.get(coord.call_counts.remote())
    assert after["submit_calls"] - before["submit_calls"] == 1  # 101 parts, one call
    assert after["pushed_parts"] - before["pushed_parts"] == world + 1
    pusher.close()
    for r in (0, world - 1):
        assert np.array_equal(eng.load("s", step=1, rank=r)["w"], state(r)["w"])


def test_pushed_versions_carry_metrics_and_keep_best_ranks_them(engine_factory, run_name):
    """``submit(..., metrics=...)`` (what the Ray Train checkpointer sends from rank 0): the metrics
    land in the version's manifest, and ``keep_best`` keeps the best pushed versions by them."""
    eng = engine_factory(critical_writers=1, best_effort_writers=0, remote_uri=None, keep_best=("reward", "max", 2))
    eng.register("s", world_size=2)
    with pytest.raises(rc.InvalidArgumentError, match="metrics must map str -> finite number; bad entry 'reward': nan"):
        eng.submit(1, "s", state(0), rank=0, metrics={"reward": float("nan")})
    rewards = {1: 5.0, 2: 9.0, 3: 1.0, 4: 7.0, 5: 2.0}
    for step, reward in rewards.items():
        hs = [eng.submit(step, "s", state(r), rank=r, metrics={"reward": reward} if r == 0 else None) for r in (0, 1)]
        [h.wait(timeout=60) for h in hs]
    want = {2: 9.0, 4: 7.0, 5: 2.0}  # the best two and the newest
    deadline = time.monotonic() + 30  # retention runs after each commit, in the background
    while (listed := {m.step: m.metrics["reward"] for m in eng.list_checkpoints()}) != want:
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)
