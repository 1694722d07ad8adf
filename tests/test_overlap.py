"""Overlapped snapshots (issue 17): the copy into the object store runs while the learner trains on,
fenced by torch's own hooks; a debug check catches a mutation without a fence; a learner killed
mid-copy fails its version loudly and the next one commits; rollout actors fed by a save's refs see
the learner's weights of that step bit for bit.

The first tests need no Ray: the copier is a plain object (``ray_ckpt/capture/overlap.py``)."""
import os
import threading
import time

import pytest
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.formats.tree import flatten
from ray_ckpt.capture.fence_hooks import HookSet, install_hooks
from ray_ckpt.capture.overlap import OverlapCopier

pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------ the copier alone (no Ray)
class SlowStore:
    """A real copy (numpy) that the test releases: copies are in flight exactly as long as the test says."""

    def __init__(self):
        self.release = threading.Event()
        self.delivered = []

    def put(self, flat):
        self.release.wait(10)
        return [a.copy() for a in flat.arrays]

    def deliver(self, job):
        self.delivered.append((job.key, job.result, job.error))


def test_a_fence_waits_only_for_the_copy_of_the_tensors_about_to_change():
    store = SlowStore()
    copier = OverlapCopier(store.put, store.deliver, readback=lambda r: r)
    model = torch.nn.Linear(64, 64)
    other = torch.zeros(1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    install_hooks(copier, [opt, model], HookSet())
    want = {k: v.clone() for k, v in model.state_dict().items()}
    job = copier.start("policy", "k1", flatten(model.state_dict(), state_name="policy"), check=True)
    assert copier.fence(tensors=[other]) == 0.0  # unrelated memory: no wait
    stepped = threading.Event()

    def step():
        model(torch.ones(1, 64)).sum().backward()
        opt.step()  # the step pre-hook fences: waits for the copy of the parameters
        stepped.set()

    t = threading.Thread(target=step)
    t.start()
    assert not stepped.wait(0.3), "the optimizer step ran while its parameters were being copied"
    store.release.set()
    assert stepped.wait(10)
    t.join()
    assert job.error is None  # the debug check saw the copy and its source agree
    key, copied, error = store.delivered[0]
    assert (key, error) == ("k1", None)
    assert copied[0].tobytes() == want["weight"].numpy().tobytes()  # the values of the saved step
    assert copied[1].tobytes() == want["bias"].numpy().tobytes()
    assert not torch.equal(model.weight, want["weight"])  # the step did happen, after the copy


def test_the_debug_check_fails_a_copy_whose_source_changed_without_a_fence():
    store = SlowStore()
    copier = OverlapCopier(store.put, store.deliver, readback=lambda r: r)
    buf = torch.zeros(4096)
    job = copier.start("replay", "k2", flatten({"buf": buf}, state_name="replay"), check=True)
    buf.add_(1)  # no fence
    store.release.set()
    assert job.done.wait(10)
    assert job.error is not None and "'replay'" in job.error and "buf" in job.error and "rc.fence" in job.error
    # with the fence, the same change is safe
    store2 = SlowStore()
    copier2 = OverlapCopier(store2.put, store2.deliver, readback=lambda r: r)
    job2 = copier2.start("replay", "k3", flatten({"buf": buf}, state_name="replay"), check=True)
    threading.Timer(0.2, store2.release.set).start()
    assert copier2.fence("replay", timeout=10) > 0  # what rc.fence("replay") does in this process
    buf.add_(1)
    assert job2.done.is_set() and job2.error is None


def _nice_of(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_the_copy_and_the_threads_it_starts_run_below_the_learners_cpu_priority():
    """Ray's put copies with 6 threads of its own, started by the copy thread: they must leave the
    learner's core to the learner (a lower priority, inherited from the copy thread)."""
    seen = {}

    def put(flat):
        seen["copy"] = _nice_of(threading.get_native_id())
        t = threading.Thread(target=lambda: seen.setdefault("started_by_copy", _nice_of(threading.get_native_id())))
        t.start()
        t.join()
        return [a.copy() for a in flat.arrays]

    copier = OverlapCopier(put, lambda job: None, nice=10)
    learner = _nice_of(threading.get_native_id())
    job = copier.start("s", "k", flatten({"t": torch.zeros(8)}, state_name="s"))
    assert job.done.wait(10) and job.error is None
    assert seen == {"copy": min(19, learner + 10), "started_by_copy": min(19, learner + 10)}
    assert _nice_of(threading.get_native_id()) == learner  # the learner's own thread is untouched


def test_prepare_overlap_sets_up_the_copy_thread_and_the_hooks_before_the_first_snapshot():
    from ray_ckpt.capture import overlap, snapshot

    class Owner:
        def __init__(self):
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    owner = Owner()
    snapshot.prepare_overlap(owner)
    copier = overlap.process_copier()
    assert copier._thread is not None and copier._thread.is_alive()
    hooks = overlap.process_hooks()
    assert owner.opt in hooks and owner.model[1] in hooks
    assert owner.opt._optimizer_step_pre_hooks and owner.model[1]._forward_pre_hooks
    n = len(hooks.handles)
    snapshot.prepare_overlap(owner)  # idempotent: no second hook
    assert len(hooks.handles) == n


# ------------------------------------------------------------------ real Ray actors
class BigLearner:
    """A learner whose state takes tens of ms to copy, so that its next steps run during the copy."""

    def __init__(self, seed=0, width=2048, bn=True, replay_mb=4, optimizer=True):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
        if bn:
            layers.insert(1, torch.nn.BatchNorm1d(width))
        self.model = torch.nn.Sequential(*layers)
        # optimizer=False where no step runs: a process's first optimizer imports torch._dynamo (~2.5 CPU-s)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3) if optimizer else None
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.replay = torch.zeros(replay_mb << 18)
        self.steps = 0
        self.copying_at_start = None

    def train(self, n=1):
        from ray_ckpt.capture.overlap import process_copier

        c = process_copier()
        self.copying_at_start = bool(c and c.pending())
        for _ in range(n):
            x = torch.randn(16, self.model[0].in_features, generator=self.gen)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.steps += 1
        return self.steps

    def mutate_until_copied(self, seconds=10.0):
        """Change the 'replay' tensor in place, without a fence, until its copy is done."""
        from ray_ckpt.capture.overlap import process_copier

        copier = process_copier()
        was_copying = bool(copier.pending())
        deadline = time.time() + seconds
        while time.time() < deadline:
            self.replay.add_(1)
            if not copier.pending():
                break
        return was_copying

    def overlapped(self):
        """Whether the last train call began while a copy was in flight, and how many fences waited."""
        from ray_ckpt.capture.overlap import process_copier

        c = process_copier()
        return self.copying_at_start, len(c.fence_waits) if c else 0

    def ckpt_get_state(self, name):
        if name == "policy":
            return self.model.state_dict()
        if name == "optimizer":
            return self.opt.state_dict()
        if name == "replay":
            return {"replay": self.replay}
        raise KeyError(name)

    def ckpt_set_state(self, name, state):
        if name == "policy":
            self.model.load_state_dict(state)
        elif name == "optimizer":
            self.opt.load_state_dict(state)
        elif name == "replay":
            self.replay.copy_(state["replay"])

    def snapshot(self):
        out = {f"p.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"o.{pid}.{k}"] = v.clone()
        return out

    def exit_now(self):
        os._exit(1)

    def pid(self):
        return os.getpid()


def _actor(cls, **kw):
    opts = {"num_cpus": 0.1}
    opts.update(kw)
    return ray.remote(**opts)(cls)


ray.cloudpickle.register_pickle_by_value(__import__(__name__))

LEAN = {"critical_writers": 1, "best_effort_writers": 0}


def test_restore_after_a_save_that_overlapped_many_optimizer_steps_is_bit_equal(engine_factory):
    learner = _actor(BigLearner).remote()  # starts while the engine does
    eng = engine_factory(overlap=True, **LEAN)
    eng.register("policy", learner)
    eng.register("optimizer", learner)
    assert ray.get(learner.__ray_call__.remote(_prepared), timeout=60) == READY  # before the first save
    ray.get(learner.train.remote(3))
    for step in (3, 24, 45):  # the copy races the driver's next call: on a loaded machine it can end first
        want = ray.get(learner.snapshot.remote())
        h = eng.save(step)
        ray.get(learner.train.remote(20))  # queued right behind the snapshot: runs during its copy
        assert h.wait(120).version == step
        copying, _fenced = ray.get(learner.overlapped.remote())
        if copying:
            break
    assert copying, "in 3 saves the steps began after the copy was over: nothing overlapped"
    assert eng.restore(step=step).states["policy"].status == "restored"
    got = ray.get(learner.snapshot.remote())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # the writers took the overlapped snapshots without fetching the learner's handle, which makes Ray
    # import the learner's class, and so torch, in every writer (~3.5 CPU-s and ~300 MB each)
    writers = ray.get(eng._coordinator.__ray_call__.remote(lambda c: c.pools.all()), timeout=30)
    for pid in ray.get([w.pid.remote() for w in writers], timeout=30):
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), f"writer process {pid} loaded torch"


def _prepared(actor):
    """What register() set up in a provider for its first overlapped snapshot."""
    from ray_ckpt.capture import mailbox as snapshot_mailbox, overlap

    copier = overlap.process_copier()
    return {"copy thread": bool(copier and copier._thread and copier._thread.is_alive()),
            "hooks": actor.opt is not None and actor.opt in overlap.process_hooks(),
            "own handle ref": bool(snapshot_mailbox._SELF_REF)}


READY = {"copy thread": True, "hooks": True, "own handle ref": True}


def test_register_prepares_the_overlapped_copy_without_prefault_needed_too(engine_factory):
    learner = _actor(BigLearner).remote(width=16, bn=False, replay_mb=1)
    eng = engine_factory(overlap=True, prefault_needed=False, **LEAN)
    eng.register("policy", learner)
    # register() does not wait for the provider, but one caller's calls on an actor run in order
    assert ray.get(learner.__ray_call__.remote(_prepared), timeout=60) == READY
    eng.save(1).wait(60)
    assert eng.restore().states["policy"].status == "restored"


def test_a_mutation_without_a_fence_is_caught_by_the_debug_check(engine_factory):
    learner = _actor(BigLearner).remote(width=16, bn=False, replay_mb=96, optimizer=False)
    eng = engine_factory(overlap=True, overlap_check=True, **LEAN)
    eng.register("replay", learner)
    h = eng.save(1)
    assert ray.get(learner.mutate_until_copied.remote()), "the copy was over before the mutation began"
    with pytest.raises(rc.SaveError, match=r"'replay' changed in place while its overlapped snapshot"):
        h.wait(60)
    assert not eng.list_checkpoints()


def test_a_learner_killed_mid_copy_fails_that_version_loudly_and_the_next_commits(engine_factory):
    learner = _actor(BigLearner, max_restarts=1, max_task_retries=0).remote(bn=False)
    eng = engine_factory(overlap=True, **LEAN)
    eng.register("policy", learner)
    eng.register("optimizer", learner)
    ray.get(learner.train.remote(1))
    old_pid = ray.get(learner.pid.remote())
    h = eng.save(1)
    learner.exit_now.remote()  # runs right after the snapshot returned: its copy is in flight
    with pytest.raises(rc.SaveError, match=r"'(policy|optimizer)'"):
        h.wait(120)
    deadline = time.time() + 60
    while True:  # the restarted learner answers from a new process
        try:
            if ray.get(learner.pid.remote(), timeout=10) != old_pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.time() < deadline
        time.sleep(0.2)
    ray.get(learner.train.remote(2))
    want = ray.get(learner.snapshot.remote())
    assert eng.save(2).wait(120).version == 2
    assert [m.version for m in eng.list_checkpoints()] == [2]
    ray.get(learner.train.remote(1))
    eng.restore(step=2)
    got = ray.get(learner.snapshot.remote())
    assert all(torch.equal(want[k], got[k]) for k in want)


class Rollout:
    """A rollout actor that receives the policy's weights as the learner's snapshot."""

    def __init__(self):
        self.policy = None
        self.zero_copy = None

    def set_weights(self, state):
        from ray_ckpt.capture.object_store import store_regions

        regions = store_regions()
        t = state["0.weight"]
        self.zero_copy = any(lo <= t.data_ptr() < hi for lo, hi in regions)  # the store's own pages
        self.policy = {k: v.clone() for k, v in state.items()}
        return len(state)

    def weights(self):
        return self.policy, self.zero_copy


def test_rollout_actors_fed_by_a_saves_refs_see_the_weights_of_that_step_bit_for_bit(engine_factory):
    learner = _actor(BigLearner).remote(width=512, bn=False)
    rollouts = [_actor(Rollout).remote() for _ in range(2)]
    eng = engine_factory(overlap=True, **LEAN)
    eng.register("policy", learner)  # overlapped
    eng.register("optimizer", learner, overlap=False)  # the synchronous path hands out refs the same way
    ray.get(learner.train.remote(2))
    want = ray.get(learner.snapshot.remote())
    h = eng.save(2)
    calls = eng.publish("policy", to=rollouts, method="set_weights")
    ray.get(learner.train.remote(5))  # the learner moves on; the published weights are step 2's
    assert ray.get(calls, timeout=60) == [len([k for k in want if k.startswith("p.")])] * 2
    for r in rollouts:
        got, zero_copy = ray.get(r.weights.remote())
        assert zero_copy, "the rollout actor did not read the snapshot's pages in place"
        assert all(torch.equal(got[k[2:]], want[k]) for k in want if k.startswith("p."))
    opt_state = rc.state_from_snapshot(h.refs("optimizer")[0])
    assert all(torch.equal(opt_state["state"][int(k.split(".")[1])][k.split(".")[2]], want[k])
               for k in want if k.startswith("o."))
    pol = rc.state_from_snapshot(h.refs("policy")[0])
    assert all(torch.equal(pol[k[2:]], want[k]) for k in want if k.startswith("p."))
    with pytest.raises(rc.InvalidArgumentError, match="no snapshot of state 'replay'"):
        h.refs("replay")
    assert h.wait(120).version == 2


def _store_residency(actor, wait_s=30.0):
    """Runs in a provider: its needed-pages prefault status and the resident bytes of its store mapping."""
    from ray_ckpt.capture.object_store import prefix_status, store_regions

    deadline = time.time() + wait_s
    while prefix_status().running and time.time() < deadline:
        time.sleep(0.05)
    (lo, hi), = sorted(store_regions(), key=lambda r: r[1] - r[0])[-1:]
    rss, found = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == lo
            elif found and head == "Rss:":
                rss = int(line.split()[1]) * 1024
                break
    st = prefix_status()
    return {"target": st.target, "done": st.done, "error": st.error, "resident": rss, "size": hi - lo}


class Plain:
    def __init__(self, mb):
        self.t = torch.randn(mb << 18)

    def ckpt_get_state(self, name):
        return {"t": self.t}

    def ckpt_set_state(self, name, state):
        self.t.copy_(state["t"])


def test_a_provider_maps_only_the_pages_its_first_saves_use_ahead_of_the_first_save(engine_factory):
    learner = _actor(Plain).remote(32)
    eng = engine_factory(**LEAN)  # prefault_needed=True is the default; no overlap needed
    eng.register("policy", learner)
    before = ray.get(learner.__ray_call__.remote(_store_residency))
    if before["error"]:
        pytest.skip(before["error"])
    state = 32 << 20
    from ray_ckpt.capture.object_store import NEEDED_COPIES, PREFIX_MARGIN

    assert before["target"] == PREFIX_MARGIN + NEEDED_COPIES * state and before["done"] == before["target"]
    assert before["resident"] >= before["target"]
    assert before["resident"] < before["size"] // 2  # not the whole store
    eng.save(1).wait(60)
    eng.save(2).wait(60)
    after = ray.get(learner.__ray_call__.remote(_store_residency))
    # the two saves' copies landed in the pages mapped ahead (the mapping did not grow by a snapshot)
    assert after["resident"] - before["resident"] < state // 2, (before, after)
    # a copy that met untouched pages maps two more snapshots' bytes beyond what is mapped
    grown = ray.get(learner.__ray_call__.remote(_grow_and_wait, state))
    assert grown["target"] == after["done"] + 2 * state and grown["done"] == grown["target"], (after, grown)
    assert grown["resident"] - after["resident"] >= 2 * state - (1 << 20)


def _grow_and_wait(actor, nbytes):
    from ray_ckpt.capture.object_store import grow_needed

    grow_needed(nbytes)
    return _store_residency(actor)


def test_the_runs_mailbox_stops_with_engine_shutdown_and_a_new_engine_of_the_run_saves_again(engine_factory,
                                                                                            run_name):
    from ray_ckpt.capture.mailbox import MAILBOX_NAMESPACE, mailbox_name

    learner = _actor(Plain).remote(1)
    for attempt in range(2):  # the second engine of the same run opens a new mailbox
        eng = engine_factory(overlap=True, **LEAN)
        eng.register("policy", learner)
        want = ray.get(learner.__ray_call__.remote(lambda a: a.t.clone()))
        h = eng.save(attempt + 1)
        assert h.wait(60).version == attempt + 1
        got = rc.state_from_snapshot(h.refs("policy")[0])
        assert torch.equal(got["t"], want)
        ray.get_actor(mailbox_name(run_name), namespace=MAILBOX_NAMESPACE)  # it runs while the engine does
        eng.shutdown()
        deadline = time.time() + 30
        while True:  # the mailbox ends with the coordinator that owns it (bounded wait)
            try:
                ray.get_actor(mailbox_name(run_name), namespace=MAILBOX_NAMESPACE)
            except ValueError:
                break
            assert time.time() < deadline, "the run's mailbox was still running 30 s after engine.shutdown()"
            time.sleep(0.1)


class PushingLearner(BigLearner):
    """A rank that runs its own loop and pushes its state (``engine.submit``) with the copy overlapped."""

    def connect(self, run):
        self.engine = rc.CheckpointEngine.connect(run)
        return True

    def push_and_train(self, step, n):
        from ray_ckpt.capture.overlap import process_copier

        want = self.snapshot()
        fenced = (self.model, self.opt)
        handles = [self.engine.submit(step, "policy", self.model.state_dict(), overlap_with=fenced),
                   self.engine.submit(step, "optimizer", self.opt.state_dict(), overlap_with=fenced)]
        copying = bool(process_copier().pending())
        self.train(n)  # opt.step and BatchNorm's forward wait for the copy of what they change
        return want, copying, [h.result(timeout=120).version for h in handles]


def test_a_rank_push_overlapped_with_training_stores_the_state_of_its_step(engine_factory, run_name):
    learner = _actor(PushingLearner).remote()  # starts while the engine does
    eng = engine_factory(**LEAN)
    eng.register("policy", world_size=1)
    eng.register("optimizer", world_size=1)
    assert ray.get(learner.connect.remote(run_name), timeout=120)
    ray.get(learner.train.remote(2))
    for step in (1, 2, 3):  # on a loaded machine the copy can end before the next step starts
        want, copying, versions = ray.get(learner.push_and_train.remote(step, 10), timeout=300)
        assert versions == [step, step]
        if copying:
            break
    assert copying, "in 3 pushes the copy was over before training went on: nothing overlapped"
    policy = eng.load("policy", step=step, rank=0)
    assert all(torch.equal(policy[k[2:]], v) for k, v in want.items() if k.startswith("p."))
    opt = eng.load("optimizer", step=step, rank=0)["state"]
    moments = {f"o.{pid}.{k}": v for pid, st in opt.items() for k, v in st.items()}
    assert moments.keys() == {k for k in want if k.startswith("o.")}
    assert all(torch.equal(moments[k], want[k]) for k in moments)
    with pytest.raises(rc.SaveError, match="overlap_with names no object"):
        eng.submit(step + 1, "policy", {"x": torch.zeros(2)}, overlap_with=())


def test_overlapped_pushes_go_on_after_the_ranks_that_opened_the_mailbox_ended(engine_factory, run_name):
    """The run's mailbox (where overlapped copies announce their refs) outlives the rank processes
    that asked for it first: a job resumed with new ranks (another world size, after preemption)
    saves overlapped again."""
    eng = engine_factory(**LEAN)
    eng.register("policy", world_size=1)
    eng.register("optimizer", world_size=1)
    first = _actor(PushingLearner).remote()
    assert ray.get(first.connect.remote(run_name), timeout=120)
    assert ray.get(first.push_and_train.remote(1, 1), timeout=300)[2] == [1, 1]
    ray.kill(first)  # the rank that opened the mailbox is gone, with every handle it held
    second = _actor(PushingLearner).remote()
    assert ray.get(second.connect.remote(run_name), timeout=120)
    want, _copying, versions = ray.get(second.push_and_train.remote(2, 1), timeout=300)
    assert versions == [2, 2]
    policy = eng.load("policy", step=2, rank=0)
    assert all(torch.equal(policy[k[2:]], v) for k, v in want.items() if k.startswith("p."))


def test_a_fence_finds_the_memory_of_a_dtensor_shard():
    """FSDP2's parameters and moments are DTensors, whose own data_ptr() is 0: a fence must wait for
    the copy of the shard's memory all the same."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ray_ckpt.capture.overlap import _tensor_spans

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        dt = torch.nn.Parameter(distribute_tensor(torch.arange(64.0), init_device_mesh("cpu", (1,)), [Shard(0)]))
        local = dt.to_local()
        assert _tensor_spans([dt]) == ([(local.data_ptr(), local.data_ptr() + 64 * 4)], False)
    finally:
        if started:
            dist.destroy_process_group()


def test_a_small_in_process_state_is_copied_in_the_call_and_a_large_one_in_the_background(engine_factory):
    """Below ``OVERLAP_MIN_BYTES`` the overlapped path (copy thread, mailbox, the writer's take) costs
    more than the copy it would hide, so such a state is copied inside save(): a change made right
    after save() returns, without a fence, is not in its snapshot. A larger one is still copied on
    the copy thread (parked here by ``held()`` until the block ends) and announced in the mailbox."""
    from ray_ckpt.capture.calls import OVERLAP_MIN_BYTES
    from ray_ckpt.capture.snapshot import process_copier_or_new

    eng = engine_factory(overlap=True, **LEAN)
    small = {"t": torch.arange(1000, dtype=torch.float32)}
    big = {"t": torch.arange(OVERLAP_MIN_BYTES // 4 + 16, dtype=torch.float32)}
    eng.register("small", lambda: small)
    eng.register("big", lambda: big)
    copier = process_copier_or_new()
    with copier.held():  # nothing starts copying on the copy thread before the block ends
        h = eng.save(1)
        small["t"].add_(1)  # no fence: allowed for a state copied in the call
        copying = [j.name for j in copier.pending()]
    assert copying == ["big"]
    assert h.wait(60).version == 1
    assert torch.equal(eng.load("small", step=1)["t"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(eng.load("big", step=1)["t"], big["t"])
    for name, want in (("small", torch.arange(1000, dtype=torch.float32)), ("big", big["t"])):
        got = rc.state_from_snapshot(h.refs(name)[0])
        assert torch.equal(got["t"], want), name
