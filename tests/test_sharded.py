"""Sharded state end to end (issue 14): real Ray rank actors, each in a real gloo process group on
CPU, train an FSDP2 (``fully_shard``) MLP with AdamW and push ``model.state_dict()`` and
``optim.state_dict()`` (DTensors) through ``engine.submit``; the manifest indexes every chunk; the
driver assembles full tensors with ``engine.load(name, rank=None)`` and fills plain targets with
``load_into`` (strict key / shape / dtype errors); a corrupt local piece is read from the remote
tier; plain per-rank parts refuse another world size before anything changes; one rank of an 8-way
restore reads about its own share (same code path as load_into, without Ray); export and show.
Restores into FSDP2 models on other world sizes (2, 3, 8) and the 2-D mesh: tests/test_fsdp2.py. Helpers both use: tests/gloo_util.py."""
from __future__ import annotations

import json
import re
import time

import pytest
import ray
import torch

import gloo_util
import ray_ckpt as rc
from gloo_util import free_port, mlp, same_bits

pytestmark = pytest.mark.timeout(300)

# tests/ is not importable in Ray workers: ship this module's actor and helpers by value
import sys as _sys  # noqa: E402

ray.cloudpickle.register_pickle_by_value(_sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gloo_util)

MiB = 1 << 20
BIG_ROWS = 16384  # "big": a [16384, 1024] float32 DTensor, 64 MiB: 16 MiB per saving rank, 8 MiB per rank of 8


@ray.remote(num_cpus=0.1)
class FsdpRank:
    def __init__(self, run: str, rank: int, world: int, port: int, seed: int = 0, big: bool = False):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        self.run, self.rank, self.world = run, rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.mesh = init_device_mesh("cpu", (world,))
        self.model = mlp(seed)
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.big = None
        if big:
            from torch.distributed.tensor import Shard, distribute_tensor

            g = torch.Generator().manual_seed(7)
            full = torch.randn(BIG_ROWS, 1024, generator=g)
            self.big = {"w": distribute_tensor(full, self.mesh, [Shard(0)]), "note": "big"}
        self.engine = None
        self.held = {"w": torch.ones(4, 4), "step": 7}  # its state as a rank provider of "shard"

    def train(self, steps: int) -> None:
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * s + self.rank)
            x = torch.randn(6, 12, generator=g)
            self.model(x).pow(2).sum().backward()
            self.opt.step()
            self.opt.zero_grad()

    def push(self, step: int) -> list:
        """Submit model, optim (and big); rank 0 also waits until the version is on the remote tier."""
        self.engine = self.engine or rc.CheckpointEngine.connect(self.run)
        hs = [self.engine.submit(step, "model", self.model.state_dict(), rank=self.rank),
              self.engine.submit(step, "optim", self.opt.state_dict(), rank=self.rank)]
        if self.big is not None:
            hs.append(self.engine.submit(step, "big", self.big, rank=self.rank))
        versions = [h.wait(timeout=120).version for h in hs]
        if self.rank == 0:
            hs[0].wait(timeout=120, durability="remote")
        return versions

    def full(self) -> dict:
        """key -> full tensor of every parameter and both AdamW moments (a collective call)."""
        out = {}
        for name, p in self.model.named_parameters():
            out[f"model/{name}"] = p.full_tensor().clone()
        ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/state/{ids[id(p)]}/{k}"] = st[k].full_tensor().clone()
        return out

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
        self.model = self.opt = self.big = None

    # -- a plain rank provider (test_plain_per_rank_parts_refuse_another_world_size)
    def ckpt_get_state(self, name):
        return self.held

    def ckpt_set_state(self, name, state):
        self.held = state

    def get(self):
        return self.held


@pytest.fixture(scope="module")
def saved(ray_session, tmp_path_factory):
    """4 FSDP2 ranks, 3 AdamW steps, model / optim / big pushed at step 3 (committed on both tiers).

    The rank actors start first (their processes start while the engine's do) and stay alive, out of
    their process group, for the module: test_plain_per_rank_parts_refuse_another_world_size uses 3
    of them as plain rank providers (each actor process costs ~4 CPU-s here: Python, torch)."""
    t0 = time.perf_counter()
    tmp = tmp_path_factory.mktemp("sharded")
    run = "sharded-e2e"
    port = free_port()
    ranks = [FsdpRank.remote(run, r, 4, port, big=True) for r in range(4)]
    # no best-effort pool: nothing best-effort is registered, and a writer is a process to start
    eng = rc.CheckpointEngine.create(run, local_dir=str(tmp / "local"), remote_uri=f"file://{tmp / 'remote'}",
                                     best_effort_writers=0)
    for name in ("model", "optim", "big"):
        eng.register(name, world_size=4)
    ray.get([r.train.remote(3) for r in ranks], timeout=120)
    assert ray.get([r.push.remote(3) for r in ranks], timeout=180) == [[3, 3, 3]] * 4
    want = ray.get([r.full.remote() for r in ranks], timeout=60)[0]
    ray.get([r.shutdown.remote() for r in ranks], timeout=60)
    assert any(m.version == 3 and "remote" in m.tiers for m in eng.list_checkpoints()), eng.list_checkpoints()
    print(f"\n4 FSDP2 ranks started, trained, pushed; committed on both tiers: {time.perf_counter() - t0:.2f} s")
    yield {"engine": eng, "run": run, "tmp": tmp, "want": want, "ranks": ranks}
    eng.shutdown()
    for r in ranks:
        ray.kill(r)


def test_manifest_indexes_the_sharded_states(saved):
    from ray_ckpt.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import ShardIndex
    from ray_ckpt.storage.tier import Tier

    m = read_manifest(Tier(str(saved["tmp"] / "local" / saved["run"])), 3)
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


def test_load_full_tensors_and_strict_keys(saved):
    eng = saved["engine"]
    model = eng.load("model", step=3, rank=None)
    optim = eng.load("optim", step=3, rank=None)
    want = saved["want"]
    for k, v in model.items():
        assert same_bits(v, want[f"model/{k}"]), k
    for i, st in optim["state"].items():
        assert same_bits(st["exp_avg"], want[f"optim/state/{i}/exp_avg"])
        assert same_bits(st["exp_avg_sq"], want[f"optim/state/{i}/exp_avg_sq"])
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


def test_corrupt_local_piece_falls_back_to_remote(saved):
    from ray_ckpt.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import ShardIndex
    from ray_ckpt.storage.tier import Tier

    eng = saved["engine"]
    root = saved["tmp"] / "local" / saved["run"]
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


def test_eight_way_rank_reads_about_its_share(saved):
    """One rank of an 8-way Shard(0) restore of "big" (saved by 4 ranks): its box is filled
    through the same RangeReader and load path as load_into, reading <= 1.25x its own bytes."""
    from ray_ckpt.checkpoint_io import read_manifest
    from ray_ckpt.formats.shards import load_chunk
    from ray_ckpt.sharded_io import RangeReader, index_of_entry, read_head
    from ray_ckpt.storage.tier import Tier

    tier = Tier(str(saved["tmp"] / "local" / saved["run"]))
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


def test_plain_per_rank_parts_refuse_another_world_size(saved, tmp_path, ray_session):
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

        holders = saved["ranks"][:3]  # 3 live actors of the module, out of their gloo group, holding w=1, step=7
        eng.register("shard", holders, world_size=3, replace=True)
        with pytest.raises(rc.RestoreError, match=r"saved by 2 ranks.*3 rank providers"):
            eng.restore(step=1)
        for h in ray.get([h.get.remote() for h in holders]):
            assert torch.equal(h["w"], torch.ones(4, 4)) and h["step"] == 7
    finally:
        eng.shutdown()


def test_cli_exports_full_tensors_and_shows_dtensor_leaves(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from ray_ckpt.cli.main import main

    root = saved["tmp"] / "local" / saved["run"]
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
    assert same_bits(merged["state/0/exp_avg"], want["optim/state/0/exp_avg"])
    assert float(merged["state/0/step"]) == 3.0
    capsys.readouterr()
    assert main(["show", str(root), "3"]) == 0
    text = capsys.readouterr().out
    assert "sharded: 6 DTensor leaves" in text
    assert re.search(r"0\.weight\s+float32\s+\[10, 12\]\s+4 chunks in 4 files", text), text
    assert re.search(r"4\.bias\s+float32\s+\[5\]\s+3 chunks in 3 files", text), text
    assert "(dtensor chunk)" in text
