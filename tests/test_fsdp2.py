"""Real FSDP2 through Ray, sharded state end to end, resharded (issue 14).

A pool of 8 Ray rank actors (num_cpus=0.1 each) is started once; each test joins some of them in a
fresh gloo process group on CPU (``init_process_group`` on a free 127.0.0.1 port, destroyed after),
so the actors' start-up (Python, torch: ~4 CPU-s each here) is paid once for every world size and
every check of this file:

* 4 ranks wrap an MLP with ``fully_shard``, take 3 AdamW steps and push ``model.state_dict()``,
  ``optim.state_dict()`` and a 64 MiB ``Shard(0)`` DTensor ("big"), DTensors as they are, with
  ``engine.submit(step, name, state, rank=r)``; 2, 3 (uneven) and 8 ranks build the same FSDP2 model
  from another seed and fill it with ``engine.load_into``: every parameter's ``full_tensor()`` and
  both AdamW moments are bit-equal to the saved ones, the step counters and param groups equal;
  ``engine.restore()`` with 3 rank providers reshards the same way;
* 4 ranks on a 2 x 2 mesh (FSDP x TP: ``[Shard(0), Shard(1)]`` and friends, uneven sizes) push
  DTensors; 2 ranks on a 1-D mesh restore them, and the replicated mesh dim is stored once;
* read from the driver: the manifest indexes every chunk; ``engine.load(name, rank=None)`` assembles
  full tensors and ``load_into`` fills plain targets (strict key / shape / dtype errors); a corrupt
  local piece is read from the remote tier; one rank of an 8-way restore reads about its own share;
  plain per-rank parts refuse another world size before anything changes (3 pool actors as rank
  providers); export and show. (These were tests/test_sharded.py, which started 4 more rank
  processes to train and push the same checkpoint.)
"""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import ray
import torch

import gloo_util
import ray_ckpt as rc
from ray_ckpt.ray_internals import actor_ready
from gloo_util import group, leave, mlp, same_bits

pytestmark = pytest.mark.timeout(300)

# tests/ is not importable in Ray workers: ship this module's actor and helpers by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gloo_util)

POOL = 8
STEP = 3
MiB = 1 << 20
BIG_ROWS = 16384  # "big": a [16384, 1024] float32 DTensor, 64 MiB: 16 MiB per saving rank, 8 MiB per rank of 8

# the 2-D mesh state: key -> (global shape, placements on the 2 x 2 (dp, tp) mesh, on the 1-D mesh of 2)
MESH2D = {"w_rowwise": ((9, 7), ("S0", "S1"), "S0"),    # FSDP x TP row-wise: uneven on both dims
          "w_colwise": ((7, 5), ("S1", "S0"), "S1"),
          "w_both_dim0": ((6, 4), ("S0", "S0"), "S0"),  # two mesh dims sharding one tensor dim
          "bias": ((5,), ("R", "S0"), "R")}             # replicated across dp: stored once


def full_2d(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(*MESH2D[key][0], generator=g)


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


@ray.remote(num_cpus=0.1)
class Rank:
    """One rank actor; ``join`` puts it in a new process group of any world size."""

    def __init__(self, run: str):
        torch.set_num_threads(1)
        self.run = run
        self.engine = None
        self.model = self.opt = self.big = None
        self.held = {"w": torch.ones(4, 4), "step": 7}  # its state as a plain rank provider of "shard"

    def join(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world
        self.engine = self.engine or rc.CheckpointEngine.connect(self.run)

    def leave(self) -> None:
        import torch.distributed as dist

        self.model = self.opt = self.big = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- FSDP2
    def build(self, seed: int, big: bool = False) -> None:
        """The FSDP2 MLP and its AdamW; with ``big``, also a 64 MiB Shard(0) DTensor ("big")."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.world,))
        if big:
            from torch.distributed.tensor import Shard, distribute_tensor

            full = torch.randn(BIG_ROWS, 1024, generator=torch.Generator().manual_seed(7))
            self.big = {"w": distribute_tensor(full, mesh, [Shard(0)]), "note": "big"}
        self.model = mlp(seed)
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(self, steps: int) -> None:
        for s in range(steps):
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1000 * s + self.rank))
            self.model(x).pow(2).sum().backward()
            self.opt.step()
            self.opt.zero_grad()

    def push(self, step: int) -> list:
        """Submit model, optim (and big); rank 0 also waits until the version is on the remote tier."""
        hs = [self.engine.submit(step, "model", self.model.state_dict(), rank=self.rank),
              self.engine.submit(step, "optim", self.opt.state_dict(), rank=self.rank)]
        if self.big is not None:
            hs.append(self.engine.submit(step, "big", self.big, rank=self.rank))
        versions = [h.wait(timeout=120).version for h in hs]
        if self.rank == 0:
            hs[0].wait(timeout=120, durability="remote")
        return versions

    def full(self) -> dict:
        """Every parameter's and both AdamW moments' full tensor (a collective: all ranks call it)."""
        out = {f"model/{n}": p.full_tensor() for n, p in self.model.named_parameters()}
        ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{ids[id(p)]}/{k}"] = st[k].full_tensor()
        return out if self.rank == 0 else {}

    def optim_plain(self) -> dict:
        sd = self.opt.state_dict()
        return {"steps": {k: float(v["step"]) for k, v in sd["state"].items()},
                "groups": [dict(g) for g in sd["param_groups"]]}

    def _init_optim(self) -> None:
        """AdamW's state (moments, step) exists after a first step: take one that changes nothing."""
        if not self.opt.state:
            for g in self.opt.param_groups:
                g["lr"] = 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        for g in self.opt.param_groups:
            g["lr"], g["weight_decay"] = 0.5, 0.0  # both to be restored from the checkpoint

    def restore(self, step: int) -> dict:
        """Fill a fresh FSDP2 model and AdamW from the checkpoint with load_into, on this world size."""
        self._init_optim()
        msd, osd = self.model.state_dict(), self.opt.state_dict()
        reports = [self.engine.load_into("model", msd, step=step, rank=self.rank),
                   self.engine.load_into("optim", osd, step=step, rank=self.rank)]
        self.opt.load_state_dict(osd)
        return {"status": [r.status for r in reports], "tier": [r.tier for r in reports],
                "verified": all(r.verified for r in reports), "bytes": [r.bytes for r in reports]}

    # -- a rank provider for engine.restore()
    def ckpt_get_state(self, name: str):
        if name == "shard":
            return self.held
        if name == "model":
            return self.model.state_dict()
        self._init_optim()
        return self.opt.state_dict()

    def ckpt_set_state(self, name: str, state) -> None:
        if name == "shard":
            self.held = state
        else:
            (self.model if name == "model" else self.opt).load_state_dict(state)

    def get_held(self) -> dict:
        return self.held

    # -- 2-D mesh (FSDP x TP) -> 1-D mesh
    def push_2d(self, run: str, step: int) -> int:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        state = {k: distribute_tensor(full_2d(k), mesh, [_placement(p) for p in pl])
                 for k, (_, pl, _) in MESH2D.items()}
        state["step"] = step
        # a real FSDP x TP layer: row-wise tensor parallel (Shard(1)) on tp, then fully_shard on dp
        torch.manual_seed(5)
        layer = parallelize_module(torch.nn.Linear(7, 9, bias=False), mesh["tp"], RowwiseParallel())
        fully_shard(layer, mesh=mesh["dp"])
        state["fsdp_tp"] = layer.state_dict()
        placements = [str(p) for p in state["fsdp_tp"]["weight"].placements]
        full = state["fsdp_tp"]["weight"].full_tensor()
        self.engine2d = rc.CheckpointEngine.connect(run)  # a run of its own: a version holds every state
        version = self.engine2d.submit(step, "mesh2d", state, rank=self.rank).wait(timeout=60).version
        return {"version": version, "placements": placements, "fsdp_tp": full}

    def restore_1d(self, run: str, step: int) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (self.world,))
        state = {k: distribute_tensor(torch.zeros(shape), mesh, [_placement(p)])
                 for k, (shape, _, p) in MESH2D.items()}
        state["step"] = -1
        from torch.distributed.fsdp import fully_shard

        layer = fully_shard(torch.nn.Linear(7, 9, bias=False), mesh=mesh)  # plain FSDP2 on the 1-D mesh
        state["fsdp_tp"] = layer.state_dict()
        rep = rc.CheckpointEngine.connect(run).load_into("mesh2d", state, step=step, rank=self.rank)
        full = {k: v.full_tensor() for k, v in state.items() if k not in ("step", "fsdp_tp")}
        full["fsdp_tp"] = layer.weight.full_tensor()
        return {"status": rep.status, "step": state["step"], "full": full}

    def strided(self, run: str, step: int) -> list:
        """A _StridedShard DTensor (FSDP2 over a module TP-sharded on the same dim) cannot be saved
        nor filled: both errors name the placement."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = DTensor.from_local(torch.zeros(2, 4), mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                               shape=torch.Size([6, 4]), stride=(4, 1))
        eng = rc.CheckpointEngine.connect(run)
        errors = []
        for call in (lambda: eng.submit(step, "mesh2d", {"w_both_dim0": t, "step": step}, rank=self.rank),
                     lambda: eng.load_into("mesh2d", {"w_both_dim0": t}, step=7, rank=self.rank, strict=False)):
            try:
                call()
                errors.append(None)
            except rc.CheckpointError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        return errors


@pytest.fixture(scope="module")
def pool(ray_session, tmp_path_factory):
    t0 = time.perf_counter()
    tmp = tmp_path_factory.mktemp("fsdp2")
    run = "fsdp2-e2e"
    actors = [Rank.remote(run) for _ in range(POOL)]  # first: their processes start while the engine's do
    # one critical writer, no best-effort pool: the states are a few KiB, nothing best-effort is
    # registered, and each writer is a process to start
    eng = rc.CheckpointEngine.create(run, local_dir=str(tmp / "local"), remote_uri=f"file://{tmp / 'remote'}",
                                     critical_writers=1, best_effort_writers=0)
    for name in ("model", "optim", "big"):
        eng.register(name, world_size=4)
    ray.get([actor_ready(a) for a in actors], timeout=120)
    yield {"engine": eng, "actors": actors, "tmp": tmp, "run": run, "t0": t0}
    for a in actors:
        ray.kill(a)
    eng.shutdown()


@pytest.fixture(scope="module")
def saved(pool):
    """4 FSDP2 ranks, 3 AdamW steps, model, optim and big pushed at step 3 (committed on both tiers)."""
    t0 = time.perf_counter()
    ranks = group(pool, 4)
    print(f"\n{POOL} actors ready, 4 joined: {time.perf_counter() - pool['t0']:.2f} s")
    ray.get([r.build.remote(0, big=True) for r in ranks], timeout=60)
    ray.get([r.train.remote(STEP) for r in ranks], timeout=60)
    assert ray.get([r.push.remote(STEP) for r in ranks], timeout=180) == [[STEP] * 3] * 4
    want = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    plain = ray.get(ranks[0].optim_plain.remote())
    leave(ranks)
    print(f"4 FSDP2 ranks trained {STEP} steps, pushed and committed: {time.perf_counter() - t0:.2f} s")
    return {"want": want, "plain": plain}


@pytest.mark.parametrize("world", [2, 3, 8])
def test_fsdp2_restores_bit_exact_on_another_world_size(pool, saved, world):
    # other processes than the saving ones where the pool allows (the last actors first)
    ranks = group(pool, world, reverse=True)
    t0 = time.perf_counter()
    ray.get([r.build.remote(1000 + world) for r in ranks], timeout=60)
    reports = ray.get([r.restore.remote(STEP) for r in ranks], timeout=90)
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    plain = ray.get(ranks[0].optim_plain.remote())
    leave(ranks)
    want = saved["want"]
    assert got.keys() == want.keys() and len(want) == 6 + 2 * 6
    for k in want:
        assert same_bits(got[k], want[k]), k
    assert plain == saved["plain"] and set(plain["steps"].values()) == {float(STEP)}
    assert plain["groups"][0]["lr"] == 1e-2 and plain["groups"][0]["weight_decay"] == 0.1
    for rep in reports:
        assert rep["status"] == ["restored"] * 2 and rep["tier"] == ["local"] * 2 and rep["verified"]
    print(f"restore onto {world} ranks: {time.perf_counter() - t0:.2f} s")


def test_2d_mesh_restores_onto_1d_mesh(pool, tmp_path):
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import ShardIndex
    from ray_ckpt.storage.tier import Tier

    run = "fsdp2-mesh2d"
    eng = rc.CheckpointEngine.create(run, local_dir=str(tmp_path / "local"), critical_writers=1,
                                     best_effort_writers=0)
    try:
        eng.register("mesh2d", world_size=4)
        t0 = time.perf_counter()
        ranks = group(pool, 4)
        pushed = ray.get([r.push_2d.remote(run, 7) for r in ranks], timeout=90)
        leave(ranks)
        assert [p["version"] for p in pushed] == [7] * 4
        assert pushed[0]["placements"] == ["S(0)", "S(1)"]  # FSDP x TP row-wise
        fsdp_tp = pushed[0]["fsdp_tp"]
        assert fsdp_tp.shape == (9, 7) and fsdp_tp.abs().sum() > 0

        idx = ShardIndex.from_json(read_manifest(Tier(str(tmp_path / "local" / run)), 7).states["mesh2d"].shards)
        w = idx["w_rowwise"]
        assert w.global_shape == (9, 7) and w.mesh_shape == (2, 2)
        assert sorted((c.chunk.offsets, c.chunk.sizes) for c in w.chunks) == \
            [((0, 0), (5, 4)), ((0, 4), (5, 3)), ((5, 0), (4, 4)), ((5, 4), (4, 3))]
        assert len(idx["bias"].chunks) == 2  # replicated over dp: each tp chunk written once, not twice
        assert [c.chunk.sizes for c in sorted(idx["w_both_dim0"].chunks, key=lambda c: c.chunk.offsets)] == \
            [(2, 4), (1, 4), (2, 4), (1, 4)]  # 6 rows on 2 x 2 along one dim: 3 + 3, then 2 + 1 each

        ranks = group(pool, 2, reverse=True)
        out = ray.get([r.restore_1d.remote(run, 7) for r in ranks], timeout=60)
        leave(ranks)
        for o in out:
            assert o["status"] == "restored" and o["step"] == 7
            for k in MESH2D:
                assert same_bits(o["full"][k], full_2d(k)), k
            assert same_bits(o["full"]["fsdp_tp"], fsdp_tp)
        full = eng.load("mesh2d", step=7, rank=None)
        assert same_bits(full["fsdp_tp"]["weight"], fsdp_tp)
        assert full["step"] == 7 and all(same_bits(full[k], full_2d(k)) for k in MESH2D)

        ranks = group(pool, 4)
        errors = ray.get([r.strided.remote(run, 8) for r in ranks], timeout=60)
        leave(ranks)
        for save_error, load_error in errors:
            assert save_error and "w_both_dim0" in save_error and "_StridedShard" in save_error, save_error
            assert load_error and load_error.startswith("RestoreError") and "w_both_dim0" in load_error \
                and "_StridedShard" in load_error, load_error
        assert [m.version for m in eng.list_checkpoints()] == [7]
        print(f"2-D mesh of 4 -> 1-D mesh of 2: {time.perf_counter() - t0:.2f} s")
    finally:
        eng.shutdown()


def test_restore_with_rank_providers_reshards(pool, saved):
    """engine.restore() with 3 rank providers of a state saved by 4: each provider's own state
    (its ckpt_get_state: DTensors on its mesh) is filled with load_into semantics, then handed to
    its ckpt_set_state."""
    eng = pool["engine"]
    ranks = group(pool, 3)
    ray.get([r.build.remote(4242) for r in ranks], timeout=60)
    for name in ("model", "optim"):
        eng.register(name, ranks, world_size=3, replace=True)
    try:
        report = eng.restore(step=STEP)
    finally:
        for name in ("model", "optim"):
            eng.register(name, world_size=4, replace=True)
    got = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    plain = ray.get(ranks[0].optim_plain.remote())
    leave(ranks)
    for name in ("model", "optim"):
        st = report.states[name]
        assert st.status == "restored" and st.tier == "local" and st.verified, st
    assert got.keys() == saved["want"].keys()
    for k, v in saved["want"].items():
        assert same_bits(got[k], v), k
    assert plain == saved["plain"]


# -- the saved checkpoint read from the driver (these were tests/test_sharded.py)

def test_manifest_indexes_the_sharded_states(pool, saved):
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import ShardIndex
    from ray_ckpt.storage.tier import Tier

    m = read_manifest(Tier(str(pool["tmp"] / "local" / pool["run"])), 3)
    for name in ("model", "optim", "big"):
        e = m.states[name]
        assert e.shards is not None and sorted(e.files, key=int) == ["0", "1", "2", "3"]
        idx = ShardIndex.from_json(e.shards)
        assert e.shards["heads"]["0"]["n"] > 8
    idx = ShardIndex.from_json(m.states["model"].shards)
    w = idx["0.weight"]
    assert w.global_shape == (10, 12) and w.dtype == "float32" and len(w.chunks) == 4
    assert [c.chunk.sizes[0] for c in idx["4.bias"].chunks] == [2, 2, 1]  # 5 rows on 4 ranks: one empty
    assert all(c.digests for c in w.chunks)
    assert "state/0/exp_avg" in ShardIndex.from_json(m.states["optim"].shards)
    assert "state/0/step" not in ShardIndex.from_json(m.states["optim"].shards)  # a plain tensor


def test_load_full_tensors_and_strict_keys(pool, saved):
    eng = pool["engine"]
    model = eng.load("model", step=3, rank=None)
    optim = eng.load("optim", step=3, rank=None)
    want = saved["want"]
    for k, v in model.items():
        assert same_bits(v, want[f"model/{k}"]), k
    for i, st in optim["state"].items():
        assert same_bits(st["exp_avg"], want[f"optim/{i}/exp_avg"])
        assert same_bits(st["exp_avg_sq"], want[f"optim/{i}/exp_avg_sq"])
        assert float(st["step"]) == 3.0
    assert optim["param_groups"][0]["lr"] == 1e-2
    # load_into a plain (non-distributed) target: full tensors, in place
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    rep = eng.load_into("model", target, step=3)
    assert rep.status == "restored" and all(same_bits(target[k], model[k]) for k in model)
    # a key that does not match: named; strict=False skips it and says so
    bad = {**{k: torch.zeros_like(v) for k, v in model.items()}, "extra.weight": torch.zeros(2)}
    with pytest.raises(rc.RestoreError, match="extra.weight"):
        eng.load_into("model", bad, step=3)
    assert all(not v.any() for v in bad.values())  # nothing changed
    rep = eng.load_into("model", bad, step=3, strict=False)
    assert "extra.weight" in rep.detail and same_bits(bad["0.weight"], model["0.weight"])
    wrong = {k: torch.zeros_like(v) for k, v in model.items()}
    wrong["2.weight"] = torch.zeros(7, 11)
    with pytest.raises(rc.RestoreError, match=r"2\.weight.*\[7, 11\].*\[7, 10\]"):
        eng.load_into("model", wrong, step=3)
    assert not wrong["0.weight"].any()
    wrong["2.weight"] = torch.zeros(7, 10, dtype=torch.float64)
    with pytest.raises(rc.RestoreError, match="float64"):
        eng.load_into("model", wrong, step=3)


def test_corrupt_local_piece_falls_back_to_remote(pool, saved):
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import ShardIndex
    from ray_ckpt.storage.tier import Tier

    eng = pool["engine"]
    root = pool["tmp"] / "local" / pool["run"]
    m = read_manifest(Tier(str(root)), 3)
    c = ShardIndex.from_json(m.states["big"].shards)["w"].chunks[1]
    path = root / c.file
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[c.offset + 3 * MiB + 5] ^= 0xFF  # one byte in piece 3 of rank 1's chunk
    path.write_bytes(bytes(data))
    try:
        target = {"w": torch.zeros(BIG_ROWS, 1024), "note": ""}
        rep = eng.load_into("big", target, step=3)
        assert rep.tier == "remote" and "checksum mismatch in piece 3" in rep.detail
        full = torch.randn(BIG_ROWS, 1024, generator=torch.Generator().manual_seed(7))
        assert same_bits(target["w"], full) and target["note"] == "big"
        assert same_bits(eng.load("big", step=3, rank=None)["w"], full)
        # 4 x 16 MiB chunks, each read as one range; only the failed range (one chunk) is read again
        assert 80 * MiB <= rep.bytes < 81 * MiB
    finally:
        path.write_bytes(original)


def test_eight_way_rank_reads_about_its_share(pool, saved):
    """One rank of an 8-way Shard(0) restore of "big" (saved by 4 ranks): its box is filled
    through the same RangeReader and load path as load_into, reading <= 1.25x its own bytes."""
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import load_chunk
    from ray_ckpt.storage.range_reader import RangeReader
    from ray_ckpt.storage.sharded_io import index_of_entry, read_head
    from ray_ckpt.storage.tier import Tier

    tier = Tier(str(pool["tmp"] / "local" / pool["run"]))
    entry = read_manifest(tier, 3).states["big"]
    meta = index_of_entry(entry, "big")["w"]
    full = torch.randn(BIG_ROWS, 1024, generator=torch.Generator().manual_seed(7))
    rows = BIG_ROWS // 8
    for k in (0, 3, 5):
        reader = RangeReader([tier], entry, "big")
        read_head(entry, "big", reader, [tier])  # what load_into reads first: header + plain leaves
        local = torch.empty(rows, 1024)
        load_chunk(local, meta, [k * rows, 0], [rows, 1024], reader)
        own = local.numel() * 4
        assert same_bits(local, full[k * rows:(k + 1) * rows])
        assert own >= 1 * MiB and reader.bytes <= 1.25 * own, (k, reader.bytes, own)


def test_plain_per_rank_parts_refuse_another_world_size(pool, tmp_path):
    eng = rc.CheckpointEngine.create("plain-ranks", local_dir=str(tmp_path / "l"), critical_writers=1,
                                     best_effort_writers=0)  # two small parts: one writer process
    try:
        eng.register("shard", world_size=2)
        parts = [{"w": torch.full((4, 4), float(r)), "step": 1} for r in range(2)]
        hs = [eng.submit(1, "shard", parts[r], rank=r) for r in range(2)]
        [h.wait(timeout=60) for h in hs]
        state = {"w": torch.zeros(4, 4), "step": 0}
        with pytest.raises(rc.RestoreError, match=r"saved by 2 ranks.*world size 2 != 3"):
            eng.load_into("shard", state, rank=0, world_size=3)
        assert not state["w"].any() and state["step"] == 0  # nothing changed
        rep = eng.load_into("shard", state, rank=1, world_size=2)
        assert rep.status == "restored" and torch.equal(state["w"], parts[1]["w"]) and state["step"] == 1
        with pytest.raises(rc.InvalidArgumentError, match="rank-local"):
            eng.load("shard", rank=None)

        holders = pool["actors"][:3]  # 3 rank actors of the pool, in no process group, holding w=1, step=7
        eng.register("shard", holders, world_size=3, replace=True)
        with pytest.raises(rc.RestoreError, match=r"saved by 2 ranks.*3 rank providers"):
            eng.restore(step=1)
        for h in ray.get([h.get_held.remote() for h in holders]):
            assert torch.equal(h["w"], torch.ones(4, 4)) and h["step"] == 7
    finally:
        eng.shutdown()


def test_cli_exports_full_tensors_and_shows_dtensor_leaves(pool, saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from ray_ckpt.cli.main import main

    root = pool["tmp"] / "local" / pool["run"]
    want = saved["want"]
    out = tmp_path / "model.safetensors"
    assert main(["export", str(root), "3", "--state", "model", "--to", str(out)]) == 0
    got = load_file(str(out))
    assert sorted(got) == sorted(k[len("model/"):] for k in want if k.startswith("model/"))
    for k, v in got.items():
        assert same_bits(v, want[f"model/{k}"]), k
    # Hugging Face's sharded layout past --max-shard-size
    assert main(["export", str(root), "3", "--state", "optim", "--to", str(tmp_path / "hf" / "optim.safetensors"),
                 "--max-shard-size", "1KB"]) == 0
    index = json.loads((tmp_path / "hf" / "optim.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("optim-0000") for f in files)
    merged = {}
    for f in files:
        merged.update(load_file(str(tmp_path / "hf" / f)))
    assert set(merged) == set(index["weight_map"])
    assert same_bits(merged["state/0/exp_avg"], want["optim/0/exp_avg"])
    assert float(merged["state/0/step"]) == 3.0
    capsys.readouterr()
    assert main(["show", str(root), "3"]) == 0
    text = capsys.readouterr().out
    assert "sharded: 6 DTensor leaves" in text
    assert re.search(r"0\.weight\s+float32\s+\[10, 12\]\s+4 chunks in 4 files", text), text
    assert re.search(r"4\.bias\s+float32\s+\[5\]\s+3 chunks in 3 files", text), text
    assert "(dtensor chunk)" in text


def test_sharded_state_is_read_from_peer_replicas_by_ranges(pool, saved, tmp_path):
    """A sharded state whose files exist only in peer replica holders (its node's disk gone, no
    remote tier): assembled into full tensors and loaded into a plain target by byte ranges read
    from the holders, each piece verified; the report names the holder."""
    import uuid

    from ray_ckpt.capture.peer_reads import NAMESPACE, PeerCopies, holder_name
    from ray_ckpt.config import EngineConfig
    from ray_ckpt.storage import sharded_io
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.storage.tier import Tier
    from ray_ckpt.writers.replicas import ReplicaHolder

    local = Tier(str(pool["tmp"] / "local" / pool["run"]))
    m = read_manifest(local, STEP)
    run = f"fsdp2-peer-{uuid.uuid4().hex[:6]}"  # the holders' run: this test's own
    holder = ReplicaHolder.options(name=holder_name(run, "nodepeer0001"), namespace=NAMESPACE).remote(
        EngineConfig(run, str(tmp_path / "holder"), peer_replicas=1), "nodepeer0001")
    try:
        files = [f for name in ("model", "optim") for f in m.states[name].all_files()]
        blobs = [local.read_verified(f.path, f.size, f.checksum) for f in files]
        assert ray.get(holder.hold.remote(STEP, files, *blobs), timeout=60) == sum(f.size for f in files)
        tiers = [Tier(str(tmp_path / "gone")), PeerCopies(run)]  # this node's disk has none of them
        want = saved["want"]
        model, tier = sharded_io.load_full(tiers, m.states["model"], "model", False)
        assert tier.tier == "peer:nodepeer0001" and tier.bytes > 0, (tier.tier, tier.problems)
        assert all(same_bits(v, want[f"model/{k}"]) for k, v in model.items())
        target = {k: torch.zeros_like(v) for k, v in model.items()}
        rep = sharded_io.load_into_state([Tier(str(tmp_path / "gone")), PeerCopies(run)], m.states["model"],
                                         "model", target, strict=True, allow_pickle=False)
        assert rep.status == "restored" and rep.tier == "peer" and rep.node == "nodepeer0001", rep
        assert all(same_bits(target[k], want[f"model/{k}"]) for k in target)
    finally:
        ray.kill(holder)
