"""torch.distributed.checkpoint interop (issue 29, item 9): ``rc.dcp.reader`` / ``rc.dcp.writer``,
tested against DCP itself with FSDP2 on gloo.

Three Ray rank actors (num_cpus=0.1) are started once and join fresh gloo groups of 2 or 3 ranks
(as in test_fsdp2.py). Two runs: "dcp-engine", whose ranks push FSDP2 model / AdamW states with
``engine.submit`` (and a rank-local plain state and a replicated one), and "dcp-writer", whose only
declared state is the one ``rc.dcp.writer`` stores (a version holds every state its ranks are
declared to push).

* an engine-saved sharded version loads through ``dcp.load`` with our reader on the saving world
  size and on another one: every parameter, both AdamW moments, the step counters and the param
  groups bit-equal / equal to the saved ones;
* ``dcp.save`` and ``dcp.async_save`` with our writer on 2 ranks commit ONE version each, listed by
  ``engine.all_steps()``; ``engine.load(..., rank=None)``, ``engine.load_into`` and ``dcp.load``
  with our reader on 3 ranks give back the saved state bit for bit;
* a replicated (single-copy) state loads by name, plain tensors and Python values;
* a plain process (no process group, no Ray engine: just the tier paths) reads through DCP; one
  flipped byte of a stored chunk makes ``dcp.load`` raise instead of returning wrong data (and the
  remote tier's good copy is used when both tiers are given);
* bad input raises a clear error before anything is read or written.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import ray
import torch

import gloo_util
import ray_ckpt as rc
from ray_ckpt.ray_internals import actor_ready
from gloo_util import group, leave, mlp, same_bits

pytestmark = [pytest.mark.timeout(300),
              # DCP's no_dist calls (the driver as a plain process) say so each time
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gloo_util)

ENGINE_RUN, WRITER_RUN, ASYNC_RUN = "dcp-engine", "dcp-writer", "dcp-async"
SAVED, WRITTEN, ASYNC = 10, 20, 21  # steps: pushed by the engine, dcp.save, dcp.async_save


@ray.remote(num_cpus=0.1)
class Rank:
    """One rank actor; ``join`` puts it in a new gloo group of any world size."""

    def __init__(self):
        torch.set_num_threads(1)
        self.engines = {}
        self.model = self.opt = None

    def engine(self, run: str):
        if run not in self.engines:
            self.engines[run] = rc.CheckpointEngine.connect(run)
        return self.engines[run]

    def join(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def leave(self) -> None:
        import torch.distributed as dist

        self.model = self.opt = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def build(self, seed: int, steps: int) -> None:
        """The FSDP2 MLP with AdamW after ``steps`` steps (0: AdamW's state made by a step that
        changes nothing, with other lr / weight_decay: both to come from the checkpoint)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.world,))
        self.model = mlp(seed)
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(steps):
            self.train_step(s)
        if not steps:
            for g in self.opt.param_groups:
                g["lr"] = 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            for g in self.opt.param_groups:
                g["lr"], g["weight_decay"] = 0.5, 0.0

    def train_step(self, s: int) -> None:
        """One FSDP2 + AdamW step: all-gathers and reduce-scatters on the default group."""
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1000 * s + self.rank))
        self.model(x).pow(2).sum().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def async_save(self, step: int, pg, planner=None, timeout: float = 120):
        """dcp.async_save with our writer on process group ``pg``; its upload future."""
        import torch.distributed.checkpoint as dcp

        fut = dcp.async_save(self.state(), storage_writer=rc.dcp.writer(self.engine(ASYNC_RUN), step, timeout=timeout),
                             planner=planner, process_group=pg)
        return getattr(fut, "upload_completion", fut)  # an AsyncSaveResponse or a Future

    def save_while_training(self, step: int, steps: int) -> dict:
        """The docs' pattern: dcp.async_save on its own gloo group, ``steps`` training steps (their
        collectives on the default group) while it runs, then its result."""
        import torch.distributed as dist

        want = self.full()
        pg = dist.new_group(backend="gloo")
        fut = self.async_save(step, pg)
        running = []
        for s in range(steps):
            running.append(not fut.done())
            self.train_step(100 + s)
        fut.result(timeout=120)
        dist.destroy_process_group(pg)
        return {"want": want, "running": running, "after": self.full()}

    def two_async_saves(self, first: int, second: int) -> dict:
        """A second dcp.async_save before the first's .result() (a training step between them)."""
        import torch.distributed as dist

        pg = dist.new_group(backend="gloo")
        want = {first: self.full()}
        fut = self.async_save(first, pg)
        self.train_step(200)
        want[second] = self.full()
        fut2 = self.async_save(second, pg)  # rc.dcp.writer waits until the first save ended
        first_done = fut.done()
        fut.result(timeout=120), fut2.result(timeout=120)
        dist.destroy_process_group(pg)
        return {"want": want, "first_done": first_done}

    def next_save_while_one_is_held(self, held: int, nxt: int) -> str:
        """A save held in its planning (a planner that waits for a gate), then a writer for the next
        step with a 3 s timeout: its error; then the gate opens and the held save ends."""
        import threading

        import torch.distributed as dist
        from torch.distributed.checkpoint import DefaultSavePlanner

        gate = threading.Event()

        class Held(DefaultSavePlanner):
            def create_local_plan(self):
                if not gate.wait(60):
                    raise RuntimeError("the gate never opened")
                return super().create_local_plan()

        pg = dist.new_group(backend="gloo")
        fut = self.async_save(held, pg, planner=Held())
        try:
            rc.dcp.writer(self.engine(ASYNC_RUN), nxt, timeout=3)
            msg = "no error"
        except rc.errors.SaveTimeoutError as exc:
            msg = str(exc)
        finally:
            gate.set()
        fut.result(timeout=120)
        dist.destroy_process_group(pg)
        return msg

    def full(self) -> dict:
        """Every parameter's and AdamW moment's full tensor by its DCP key, the step counters and
        param groups (a collective: every rank calls it; rank 0 answers)."""
        out = {f"model.{n}": p.full_tensor() for n, p in self.model.named_parameters()}
        sd = self.opt.state_dict()
        for i, st in sd["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim.state.{i}.{k}"] = st[k].full_tensor()
            out[f"optim.state.{i}.step"] = st["step"].clone()
        out["groups"] = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
        return out if self.rank == 0 else {}

    def push(self, step: int) -> list:
        eng = self.engine(ENGINE_RUN)
        hs = [eng.submit(step, "model", self.model.state_dict(), rank=self.rank),
              eng.submit(step, "optim", self.opt.state_dict(), rank=self.rank),
              eng.submit(step, "plain", {"w": torch.full((3,), float(self.rank))}, rank=self.rank),
              eng.submit(step, "meta", {"lr": 0.1, "count": torch.tensor(5), "rows": [1, 2]}, rank=self.rank)]
        versions = [h.wait(timeout=120).version for h in hs]
        if self.rank == 0:  # the corruption test reads the remote copy: uploaded before it runs
            hs[0].wait(timeout=120, durability="remote")
        return versions

    def dcp_save(self, step: int, asynchronous: bool = False) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        w = rc.dcp.writer(self.engine(WRITER_RUN), step, timeout=120)
        if asynchronous:
            fut = dcp.async_save(self.state(), storage_writer=w)
            getattr(fut, "upload_completion", fut).result(timeout=120)  # an AsyncSaveResponse or a Future
        else:
            dcp.save(self.state(), storage_writer=w)
        return time.perf_counter() - t0

    def dcp_load(self, run: str, step: int, state) -> dict:
        """dcp.load of a fresh model and AdamW from our reader (in place), then their full tensors."""
        import torch.distributed.checkpoint as dcp

        sd = self.state()
        reader = rc.dcp.reader(run, step, state=state)  # inside the Ray job: the run's tiers are asked
        dcp.load(sd, storage_reader=reader)
        self.opt.load_state_dict(sd["optim"])
        return {"bytes": reader.bytes_read}


    def load_into(self, run: str, step: int, state: str) -> str:
        """ray_ckpt's own in-place load of what the DCP writer stored, on this world size."""
        sd = self.state()
        rep = self.engine(run).load_into(state, sd, step=step, rank=self.rank)
        self.opt.load_state_dict(sd["optim"])
        return rep.status


@pytest.fixture(scope="module")
def pool(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    actors = [Rank.remote() for _ in range(3)]  # first: their processes start while the engines' do
    dirs = {run: {"local_dir": str(tmp / run / "local"), "remote_uri": f"file://{tmp / run / 'remote'}"}
            for run in (ENGINE_RUN, WRITER_RUN, ASYNC_RUN)}
    engines = {run: rc.CheckpointEngine.create(run, critical_writers=1, best_effort_writers=0, **dirs[run])
               for run in dirs}
    for name in ("model", "optim", "plain"):
        engines[ENGINE_RUN].register(name, world_size=2)
    engines[ENGINE_RUN].register("meta", world_size=2, replicated=True)  # stored once: a single-copy state
    engines[WRITER_RUN].register("dcp", world_size=2)
    engines[ASYNC_RUN].register("dcp", world_size=2)
    ray.get([actor_ready(a) for a in actors], timeout=120)
    yield {"actors": actors, "engines": engines, "dirs": dirs}
    for a in actors:
        ray.kill(a)
    for eng in engines.values():
        eng.shutdown()


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if k == "groups":
            assert got[k] == want[k]
        else:
            assert same_bits(got[k], want[k]), k


@pytest.fixture(scope="module")
def pushed(pool):
    """2 FSDP2 ranks, 3 AdamW steps; model, optim, a rank-local plain state and a replicated one
    pushed by the engine at SAVED."""
    ranks = group(pool, 2)
    ray.get([r.build.remote(0, 3) for r in ranks], timeout=60)
    assert ray.get([r.push.remote(SAVED) for r in ranks], timeout=180) == [[SAVED] * 4] * 2
    want = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    return want


@pytest.mark.parametrize("world", [2, 3])
def test_engine_saved_version_loads_through_dcp(pool, pushed, world):
    ranks = group(pool, world, reverse=True)
    ray.get([r.build.remote(7 + world, 0) for r in ranks], timeout=60)
    before = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    assert not same_bits(before["model.0.weight"], pushed["model.0.weight"])
    rep = ray.get([r.dcp_load.remote(ENGINE_RUN, SAVED, None) for r in ranks], timeout=120)
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    assert_same(got, pushed)  # 6 parameters, 12 moments, 6 step counters, lr / weight_decay 0.01 / 0.1 back
    assert got["groups"][0]["lr"] == 1e-2 and got["groups"][0]["weight_decay"] == 0.1
    assert all(r["bytes"] > 0 for r in rep)


@pytest.fixture(scope="module")
def written(pool):
    """dcp.save (WRITTEN) then dcp.async_save (ASYNC, one more AdamW step) with rc.dcp.writer on 2 ranks."""
    ranks = group(pool, 2)
    ray.get([r.build.remote(0, 3) for r in ranks], timeout=60)
    ray.get([r.dcp_save.remote(WRITTEN) for r in ranks], timeout=180)
    want = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    # the version is committed when dcp.save returns: the next save goes straight on
    ray.get([r.build.remote(0, 4) for r in ranks], timeout=60)
    ray.get([r.dcp_save.remote(ASYNC, True) for r in ranks], timeout=180)
    want_async = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    return {WRITTEN: want, ASYNC: want_async}


def _as_full(loaded: dict) -> dict:
    """engine.load(..., rank=None) of the writer's state, keyed as ``Rank.full``."""
    out = {f"model.{k}": v for k, v in loaded["model"].items()}
    for i, st in loaded["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim.state.{i}.{k}"] = st[k]
    out["groups"] = loaded["optim"]["param_groups"]
    return out


def test_dcp_save_with_our_writer_is_one_committed_version(pool, written):
    eng = pool["engines"][WRITER_RUN]
    assert eng.all_steps() == [WRITTEN, ASYNC]
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.storage.tier import Tier

    d = pool["dirs"][WRITER_RUN]
    tier = Tier(f"{d['local_dir']}/{WRITER_RUN}")
    assert sorted(v for v, has in tier.version_dirs().items() if has) == [WRITTEN, ASYNC]  # one version each
    m = read_manifest(tier, WRITTEN)
    assert list(m.states) == ["dcp"] and m.states["dcp"].shards is not None and sorted(m.states["dcp"].files) == ["0", "1"]
    for step in (WRITTEN, ASYNC):  # our own reader: full tensors, param groups as saved
        assert_same(_as_full(eng.load("dcp", step=step, rank=None)), written[step])
    assert not same_bits(written[WRITTEN]["model.0.weight"], written[ASYNC]["model.0.weight"])


@pytest.mark.parametrize("step,how", [(WRITTEN, "dcp.load"), (ASYNC, "dcp.load"), (WRITTEN, "load_into")])
def test_what_our_writer_stored_loads_on_another_world_size(pool, written, step, how):
    ranks = group(pool, 3, reverse=True)
    ray.get([r.build.remote(99, 0) for r in ranks], timeout=60)
    if how == "dcp.load":
        ray.get([r.dcp_load.remote(WRITER_RUN, step, "dcp") for r in ranks], timeout=120)
    else:
        assert ray.get([r.load_into.remote(WRITER_RUN, step, "dcp") for r in ranks], timeout=120) == ["restored"] * 3
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    leave(ranks)
    assert_same(got, written[step])


def causes(err: BaseException) -> list:
    """The errors behind a DCP failure: its ranks' exceptions (``CheckpointException``, a
    BaseException), or the error itself where DCP raised it directly."""
    from torch.distributed.checkpoint.api import CheckpointException

    return [e for e, _trace in err.failures.values()] if isinstance(err, CheckpointException) else [err]


def _plain_target(want: dict) -> dict:
    """A plain (no process group) target of the model's full tensors, zero-filled."""
    return {"model": {k[len("model."):]: torch.zeros_like(v) for k, v in want.items() if k.startswith("model.")}}


def test_bad_input_is_refused_before_anything_is_read_or_written(pool, pushed, written):
    import torch.distributed.checkpoint as dcp

    eng, weng = pool["engines"][ENGINE_RUN], pool["engines"][WRITER_RUN]
    d = pool["dirs"][ENGINE_RUN]
    with pytest.raises(rc.RestoreError, match=r"no committed version at step 999 .*committed steps: \[10\]"):
        rc.dcp.reader(ENGINE_RUN, 999, **d)
    with pytest.raises(rc.RestoreError, match="'plain' of step 10 is not sharded: its 2 ranks pushed rank-local"):
        rc.dcp.reader(ENGINE_RUN, SAVED, state="plain", **d)
    with pytest.raises(rc.RestoreError, match="passed over: .*manifest is not signed"):  # a key: signed manifests only
        rc.dcp.reader(ENGINE_RUN, SAVED, signing_key="k", **d)
    with pytest.raises(rc.RestoreError, match="has no state 'nope'"):
        rc.dcp.reader(eng, SAVED, state="nope")
    with pytest.raises(rc.InvalidArgumentError, match="run must be a run name or a CheckpointEngine"):
        rc.dcp.reader(42, SAVED)
    with pytest.raises(rc.InvalidArgumentError, match="step must be"):
        rc.dcp.reader(eng, "10")
    with pytest.raises(rc.InvalidArgumentError, match="'undeclared' is not declared for pushing"):
        rc.dcp.writer(weng, 30, state="undeclared")
    with pytest.raises(rc.InvalidArgumentError, match="not after the run's newest committed step 21"):
        rc.dcp.writer(weng, ASYNC)
    with pytest.raises(rc.InvalidArgumentError, match="timeout must be"):
        rc.dcp.writer(weng, 30, timeout=0)
    # one process (DCP's no_dist) for a state declared for 2 ranks: refused at set-up, nothing stored
    from torch.distributed.checkpoint.api import CheckpointException

    w = rc.dcp.writer(weng, 30)
    with pytest.raises(CheckpointException, match="declared for 2 ranks but DCP saves from 1") as err:
        dcp.save({"x": torch.ones(3)}, storage_writer=w, no_dist=True)
    assert [type(e) for e in causes(err.value)] == [rc.errors.InvalidSaveError]
    # a dtype the shard index cannot record as boxes of whole elements: refused in the plan
    weng.register("solo", world_size=1)
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(CheckpointException, match="dtype torch.qint8, which ray_ckpt's shard index cannot") as err:
        dcp.save({"q": q}, storage_writer=rc.dcp.writer(weng, 30, state="solo"), no_dist=True)
    assert [type(e) for e in causes(err.value)] == [rc.errors.InvalidSaveError]
    assert weng.all_steps() == [WRITTEN, ASYNC]
    # a target key the version does not hold: DCP's own error, nothing filled
    target = _plain_target(pushed)
    with pytest.raises(BaseException, match="nope"):
        dcp.load({**target, "nope": torch.zeros(2)}, storage_reader=rc.dcp.reader(eng, SAVED), no_dist=True)


def test_a_single_copy_state_loads_by_name(pool, pushed):
    import torch.distributed.checkpoint as dcp

    target = {"lr": 0.0, "count": torch.tensor(0), "rows": []}
    dcp.load(target, storage_reader=rc.dcp.reader(pool["engines"][ENGINE_RUN], SAVED, state="meta"), no_dist=True)
    assert target["lr"] == 0.1 and target["count"].item() == 5 and target["rows"] == [1, 2]


def test_plain_process_reads_verified_and_a_flipped_byte_fails_the_load(pool, pushed):
    """The driver without a process group and without its engine: only the tiers' paths."""
    import torch.distributed.checkpoint as dcp
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.storage.tier import Tier

    d = pool["dirs"][ENGINE_RUN]
    local_only = {"local_dir": d["local_dir"]}
    target = _plain_target(pushed)
    reader = rc.dcp.reader(ENGINE_RUN, SAVED, **local_only)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in target["model"].items():
        assert same_bits(v, pushed[f"model.{k}"]), k
    open_files = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert not [p for p in open_files if p.startswith(os.path.realpath(d["local_dir"]))]  # closed after the load

    # flip one byte in the last chunk of rank 1's model file on the local tier
    tier = Tier(f"{d['local_dir']}/{ENGINE_RUN}")
    entry = read_manifest(tier, SAVED).states["model"]
    f = entry.files["1"][0]
    path = tier.abspath(f.path)
    with open(path, "r+b") as fh:
        fh.seek(f.size - 3)
        b = fh.read(1)
        fh.seek(f.size - 3)
        fh.write(bytes([b[0] ^ 0x01]))
    target = _plain_target(pushed)
    with pytest.raises(BaseException) as err:
        dcp.load(target, storage_reader=rc.dcp.reader(ENGINE_RUN, SAVED, **local_only), no_dist=True)
    [cause] = causes(err.value)
    assert isinstance(cause, rc.RestoreError), repr(err.value)
    assert "checksum mismatch" in str(cause) and "rank1" in str(cause), str(cause)
    # both tiers: the corrupt local range is passed over, the remote copy is read and verified
    target = _plain_target(pushed)
    dcp.load(target, storage_reader=rc.dcp.reader(ENGINE_RUN, SAVED, **d), no_dist=True)
    for k, v in target["model"].items():
        assert same_bits(v, pushed[f"model.{k}"]), k


def _on_two_ranks(pool, seed: int, method: str, *args) -> list:
    """Two ranks in a new group build the MLP (``seed``, two AdamW steps) and call ``method(*args)``:
    their answers."""
    ranks = group(pool, 2)
    try:
        ray.get([r.build.remote(seed, 2) for r in ranks], timeout=60)
        return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=240)
    finally:
        leave(ranks)


def test_training_goes_on_while_async_save_runs_on_its_own_group(pool):
    """docs/dcp.md's pattern: the save on its own gloo group, FSDP2 steps on the default group
    meanwhile; the version holds the state at the call, training moved on."""
    eng = pool["engines"][ASYNC_RUN]
    out = _on_two_ranks(pool, 3, "save_while_training", 1, 6)[0]
    assert out["running"][0], "the first training step ran after the save had ended: nothing overlapped"
    assert 1 in eng.all_steps()
    assert_same(_as_full(eng.load("dcp", step=1, rank=None)), out["want"])
    assert not same_bits(out["after"]["model.0.weight"], out["want"]["model.0.weight"])


def test_a_second_async_save_before_the_firsts_result_waits_for_it(pool):
    """Without the wait the two saves' collectives interleave and both ranks hang."""
    eng = pool["engines"][ASYNC_RUN]
    outs = _on_two_ranks(pool, 4, "two_async_saves", 2, 3)
    assert [o["first_done"] for o in outs] == [True, True]
    assert {2, 3} <= set(eng.all_steps())
    for step in (2, 3):
        assert_same(_as_full(eng.load("dcp", step=step, rank=None)), outs[0]["want"][step])


def test_a_save_that_does_not_end_is_an_error_at_the_next_writer(pool):
    eng = pool["engines"][ASYNC_RUN]
    for msg in _on_two_ranks(pool, 5, "next_save_while_one_is_held", 4, 5):
        assert "step 5 of run 'dcp-async' cannot start: the save of step 4" in msg, msg
        assert "has not ended after 3s" in msg and "new_group(backend='gloo')" in msg, msg
    assert 4 in eng.all_steps() and 5 not in eng.all_steps()  # the held save ended once let go
