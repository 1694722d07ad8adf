"""``rc.dcp.reader``: a ``torch.distributed.checkpoint`` StorageReader over a committed ray_ckpt version.

Why: torchtitan and any other DCP user load with ``dcp.load(state_dict, storage_reader=...)``; with
this reader they read ray_ckpt's sharded versions directly, on any world size and mesh (DCP's
planner intersects the target's chunks with the stored ones; this reader fills each overlap).

What a version looks like to DCP: the tree ``{state name: state}`` of its sharded (DTensor) states,
or one state's tree with ``state=NAME`` (what ``rc.dcp.writer`` stores: a DCP state dict under one
name). That tree is flattened by DCP's own ``flatten_state_dict``, so the keys are exactly those
DCP computes for a target of the same structure ("model.0.weight", "optim.state.0.exp_avg").
Sharded leaves become ``TensorStorageMetadata`` with every stored chunk of the shard index; plain
tensor leaves (AdamW's ``step``) one chunk covering the tensor; other leaves (scalars, strings,
param groups) ``BytesStorageMetadata``.

Every byte comes through the engine's verified sharded read path (``storage.sharded_io``): rank 0's
header and plain leaves against their recorded digests, each chunk's header against the shard
index, each ranged read widened to whole pieces and checked against the piece digests, local tier
first, then remote. A range with no good copy is a :class:`~ray_ckpt.errors.RestoreError`; DCP
wraps it (``CheckpointException``) and the target is never filled with unverified bytes.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...errors import IntegrityError, InvalidArgumentError, RestoreError, one_line
from ...formats.manifest import Manifest, StateEntry
from ...formats.shards import load_chunk
from ...formats.tree import unflatten
from ...storage import sharded_io
from ...storage.range_reader import RangeReader
from ...storage.checkpoint_io import decode_files, rank_files, read_files, read_manifest
from ...storage.tier import Tier
from .named_version import NamedVersion

__all__ = ["RayCkptStorageReader", "dcp_states", "find_version", "single_copy", "torch_dtype"]


def torch_dtype(name: str, what: str) -> torch.dtype:
    """The torch dtype named ``name`` (from a manifest); a clear error for anything else."""
    t = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() and not name.startswith("_") else None
    if not isinstance(t, torch.dtype):
        raise RestoreError(f"{what}: dtype {name!r} is not a torch dtype; it cannot be read through DCP")
    return t


def find_version(tiers: Sequence[Tier], run: str, step: Optional[int], key: Any) -> Manifest:
    """The committed manifest of ``step`` (None: the newest) on the first tier that has one.

    Versions are steps, so the version directory of ``step`` is tried first; a manifest whose step
    differs (or a tier without that directory) falls back to reading the others. A manifest that
    does not verify (malformed, mis-signed with ``key``) is passed over and named if nothing is found."""
    problems: List[str] = []
    found: Dict[int, Manifest] = {}
    tiers = [t for t in tiers if hasattr(t, "version_dirs")]  # peer replicas hold files, not manifests
    for tier in tiers:
        try:
            dirs = tier.version_dirs()
        except OSError as exc:
            problems.append(f"{tier.name}: {tier.scrub(one_line(exc))}")
            continue
        order = sorted((v for v, has in dirs.items() if has), reverse=True)
        if step is not None and step in order:
            order.remove(step)
            order.insert(0, step)
        for v in order:
            if v in found:
                continue
            try:
                m = read_manifest(tier, v, key)
            except (IntegrityError, OSError) as exc:
                problems.append(f"{tier.name} version {v}: {one_line(exc)}")
                continue
            found[v] = m
            if step is None or m.step == step:
                break
    hits = [m for m in found.values() if step is None or m.step == step]
    if not hits:
        what = "no committed version" if step is None else f"no committed version at step {step}"
        have = sorted({m.step for m in found.values()})
        raise RestoreError(f"run {run!r} has {what} on {', '.join(t.display for t in tiers)}"
                           f" (committed steps: {have or 'none'})"
                           + (f"; passed over: {'; '.join(problems[:4])}" if problems else ""))
    return max(hits, key=lambda m: m.version)


def single_copy(entry: StateEntry) -> bool:
    """A state stored once for every rank (replicated, or saved by the driver): no shard index, but
    the same value whatever the reader's rank, so DCP may read it as replicated."""
    return entry.shards is None and (entry.replicated or list(entry.files) == ["0"])


def dcp_states(m: Manifest, state: Optional[str]) -> Dict[str, StateEntry]:
    """The states of ``m`` the reader exposes: ``state`` alone (sharded or single-copy), or every
    stored sharded one (a single-copy state is read whole by every rank: only when named)."""
    if state is not None:
        e = m.states.get(state)
        if e is None:
            raise RestoreError(f"version {m.version} (step {m.step}) of run {m.run!r} has no state {state!r} "
                               f"(it has: {', '.join(sorted(m.states)) or 'none'})")
        if e.status != "stored":
            raise RestoreError(f"state {state!r} of step {m.step} is {e.status}: {e.detail}")
        if e.shards is None and not single_copy(e):
            raise RestoreError(f"state {state!r} of step {m.step} is not sharded: its {len(e.files)} ranks pushed "
                               f"rank-local plain tensors (no DTensors), which DCP cannot reshard; read a rank's "
                               f"part with engine.load({state!r}, step={m.step}, rank=r)")
        return {state: e}
    out = {n: e for n, e in sorted(m.states.items()) if e.status == "stored" and e.shards is not None}
    if not out:
        raise RestoreError(f"step {m.step} of run {m.run!r} holds no sharded (DTensor) state: it is not a "
                           f"sharded version (states: {', '.join(sorted(m.states)) or 'none'}); name a "
                           f"single-copy state with state=NAME")
    return out


class _State:
    """One sharded state as the reader sees it: its verified range reader, shard index and the
    tree of rank 0's part, its DTensor leaves replaced by meta-device placeholders."""

    def __init__(self, tiers: Sequence[Tier], entry: StateEntry, name: str):
        self.name = name
        self.placeholders: Dict[int, str] = {}
        self.reader: Any = None
        if entry.shards is None:  # a single-copy state: its files read whole, each checked against the manifest
            files = rank_files(entry, name, 0)
            try:
                bufs, _tier, _problems = read_files(tiers, files)
            except (IntegrityError, OSError) as exc:
                raise RestoreError(f"state {name!r}: {one_line(exc)}") from None
            self.tree = decode_files(files, bufs, name=name, allow_pickle=False)
            return
        try:
            self.index = sharded_io.index_of_entry(entry, name)
            self.reader = RangeReader(tiers, entry, name)
            self.reader.index = self.index
            structure, arrays, tables = sharded_io.read_head(entry, name, self.reader, tiers, False, self.index)
        except IntegrityError as exc:
            raise RestoreError(f"state {name!r}: {one_line(exc)}") from None

        def placeholder(leaf: Any) -> Any:
            m = self.index.get(leaf.key)
            if m is None:
                raise RestoreError(f"state {name!r}: {leaf.key} is a sharded leaf without an entry in the shard index")
            t = torch.empty(tuple(m.global_shape), dtype=torch_dtype(m.dtype, f"state {name!r}: {leaf.key}"),
                            device="meta")
            self.placeholders[id(t)] = leaf.key
            return t

        self.tree = unflatten(structure, arrays, tables, allow_pickle=False, state_name=name, on_sharded=placeholder)


def _tensor_md(dtype: torch.dtype, size: Sequence[int], chunks: List[Tuple[Sequence[int], Sequence[int]]]
               ) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


class RayCkptStorageReader(NamedVersion, StorageReader):
    """DCP StorageReader of one committed ray_ckpt version (built by :func:`ray_ckpt.dcp.reader`)."""

    _role, _id_error = "reader", InvalidArgumentError

    def __init__(self, tiers: Sequence[Tier], manifest: Manifest, names: Sequence[str], prefixed: bool):
        super().__init__()
        self.tiers, self.manifest, self.names, self.prefixed = list(tiers), manifest, list(names), prefixed
        self.checkpoint_id = f"{manifest.run}@{manifest.step}"
        self._sharded: Dict[str, Tuple[_State, Any]] = {}  # fqn -> (state, its ShardedTensorMeta)
        self._plain: Dict[str, torch.Tensor] = {}
        self._objects: Dict[str, Any] = {}
        self.bytes_read = 0

    @property
    def step(self) -> int:
        return self.manifest.step

    # ------------------------------------------------------------------ DCP protocol
    # reset / validate_checkpoint_id: NamedVersion

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the version. Every rank reads, verified, rank 0's header and small plain
        leaves of each sharded state (a few KiB) and a named single-copy state whole."""
        # DCP's own flattening (a private module, but the one its planners use): the keys match a
        # target of the same structure by construction
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        states = {n: _State(self.tiers, self.manifest.states[n], n) for n in self.names}
        view = {n: s.tree for n, s in states.items()} if self.prefixed else states[self.names[0]].tree
        flat, _ = flatten_state_dict(view)
        owner: Dict[int, _State] = {}
        for s in states.values():
            for pid in s.placeholders:
                owner[pid] = s
        md: Dict[str, Any] = {}
        self._sharded.clear(), self._plain.clear(), self._objects.clear()
        for fqn, v in flat.items():
            s = owner.get(id(v))
            if s is not None:
                meta = s.index[s.placeholders[id(v)]]
                self._sharded[fqn] = (s, meta)
                md[fqn] = _tensor_md(v.dtype, meta.global_shape,
                                     [(c.chunk.offsets, c.chunk.sizes) for c in meta.chunks])
            elif isinstance(v, torch.Tensor):
                self._plain[fqn] = v
                md[fqn] = _tensor_md(v.dtype, v.shape, [((0,) * v.dim(), tuple(v.shape))])
            else:
                self._objects[fqn] = v
                md[fqn] = BytesStorageMetadata()
        self._states = states
        for s in states.values():  # closed until read_data reopens what it reads: a load that fails in DCP's
            if s.reader is not None:  # planning (a key the version lacks) calls nothing else of the reader
                s.reader.close()
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._sharded and not self._plain and not self._objects:
            self.read_metadata()  # a metadata handed over from elsewhere: this process still needs the heads

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Fill each ReadItem: only the byte ranges of its box (whole pieces, each verified)."""
        try:
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    if fqn not in self._objects:
                        raise RestoreError(f"{self.checkpoint_id}: {fqn} is not a non-tensor leaf of the version")
                    buf = io.BytesIO()
                    torch.save(self._objects[fqn], buf)  # a value decoded from our JSON structure, not stored bytes
                    buf.seek(0)
                    planner.load_bytes(item, buf)
                    continue
                offsets = [a + b for a, b in zip(item.storage_index.offset, item.storage_offsets)]
                target = planner.resolve_tensor(item).detach()
                if list(target.shape) != list(item.lengths):
                    raise RestoreError(f"{fqn}: DCP asked for a box of sizes {list(item.lengths)} into a target of "
                                       f"shape {list(target.shape)}")
                self._fill(fqn, target, offsets, list(item.lengths))
                planner.commit_tensor(item, target)
        finally:  # DCP reads once per load: close the files the range readers keep open
            for s in getattr(self, "_states", {}).values():
                if s.reader is not None:
                    s.reader.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fill(self, fqn: str, target: torch.Tensor, offsets: List[int], sizes: List[int]) -> None:
        """Copy the box (global offsets, sizes) of tensor ``fqn``, read and verified, into ``target``."""
        if fqn in self._plain:
            with torch.no_grad():
                target.copy_(self._plain[fqn][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
            return
        if fqn not in self._sharded:
            raise RestoreError(f"{self.checkpoint_id}: {fqn} is not a tensor of the version")
        s, meta = self._sharded[fqn]
        dtype = torch_dtype(meta.dtype, fqn)
        # straight into DCP's target where it is a CPU tensor of the stored dtype (load_chunk copies
        # into views); else through a buffer, and DCP's copy_ casts or moves it
        direct = target.device.type == "cpu" and target.dtype == dtype
        out = target if direct else torch.empty(sizes, dtype=dtype)
        try:
            load_chunk(out, meta, offsets, sizes, s.reader, verify=True)
        except IntegrityError as exc:
            raise RestoreError(f"state {s.name!r} of step {self.step}: {one_line(exc)}; not loaded") from None
        if not direct:
            with torch.no_grad():
                target.copy_(out)
        self.bytes_read = sum(st.reader.bytes for st in self._states.values() if st.reader is not None)
