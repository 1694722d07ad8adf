"""``rc.dcp.writer``: a ``torch.distributed.checkpoint`` StorageWriter that stores ONE ray_ckpt version.

Why: code that already checkpoints with ``dcp.save`` / ``dcp.async_save`` (torchtitan, any FSDP2
trainer) gets ray_ckpt's tiers, checksums, commit protocol and retention by swapping the
storage writer; nothing else in the training loop changes.

How: DCP's default planner hands every rank the flattened state dict it saves (its DTensors as they
are). Each rank pushes its part of ONE declared state through the engine's rank push path
(``engine.submit(step, name, part, rank=r)``): every DTensor leaf (stored as that rank's local chunk,
indexed with piece digests, exactly like a state pushed by the ranks themselves) and, on rank 0
only, the plain tensors and other leaves (DCP assumes they are the same on every rank). The
version commits when every rank's part is durable; ``write_data`` waits for that (bounded), so a
``dcp.save`` that returns has a committed version and one that raises has none.

The state is nested back from DCP's flat keys with the plan's mappings, so ``engine.load(name,
step, rank=None)`` returns the state dict that was saved (full tensors), and
``rc.dcp.reader(run, step, state=name)`` gives DCP the same keys again.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ...errors import InvalidArgumentError, InvalidSaveError, SaveError, one_line
from ...formats.shard_index import itemsize_of
from .named_version import NamedVersion
from .saves_in_flight import SaveInFlight

__all__ = ["RayCkptStorageWriter", "check_dtype"]


def check_dtype(dtype: torch.dtype, fqn: str) -> None:
    """Refuse, before anything is written, a dtype whose chunks the shard index cannot describe as
    row-major boxes of whole elements (quantized tensors, sub-byte packed dtypes)."""
    name = str(dtype).replace("torch.", "")
    try:
        itemsize_of(name)
        ok = isinstance(dtype, torch.dtype) and not re.fullmatch(r"u?int[1-7]|bits.*|q.*", name)
    except ValueError:
        ok = False
    if not ok:
        raise InvalidSaveError(f"rc.dcp.writer: {fqn} has dtype {dtype}, which ray_ckpt's shard index cannot "
                               f"record; nothing was written")


def _world() -> Tuple[int, int]:
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RayCkptStorageWriter(NamedVersion, SaveInFlight, StorageWriter):
    """DCP StorageWriter of one ray_ckpt version (built by :func:`ray_ckpt.dcp.writer`)."""

    _role, _id_error = "writer", InvalidSaveError

    def __init__(self, engine: Any, step: int, name: str, world_size: int, timeout: float):
        self.engine, self.step, self.name, self.world_size, self.timeout = engine, step, name, world_size, timeout
        self.run = engine.run
        super().__init__()  # SaveInFlight: listed as this process's save until DCP ran it (saves_in_flight.py)
        self.checkpoint_id = f"{engine.run}@{step}"
        self.rank = 0
        self.is_coordinator = False
        self.result: Any = None

    # ------------------------------------------------------------------ DCP protocol
    # reset / validate_checkpoint_id: NamedVersion

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.started()
        self.is_coordinator = is_coordinator
        self.rank, world = _world()
        if world != self.world_size:
            self.ended()
            raise InvalidSaveError(
                f"rc.dcp.writer: state {self.name!r} of run {self.engine.run!r} is declared for {self.world_size} "
                f"ranks but DCP saves from {world}; declare it with engine.register({self.name!r}, "
                f"world_size={world}); nothing was written")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                    check_dtype(item.tensor_data.properties.dtype, item.index.fqn)
        except BaseException:
            self.ended()
            raise
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Push this rank's part, then wait (bounded) until the version is committed."""
        try:
            handle = self.engine.submit(self.step, self.name, self._part(plan, planner), rank=self.rank)
            self.result = handle.wait(timeout=self.timeout)
        except SaveError as exc:
            raise type(exc)(f"rc.dcp.writer: step {self.step} of run {self.engine.run!r} (state {self.name!r}, "
                            f"rank {self.rank}) was not committed: {one_line(exc)}") from None
        finally:
            self.ended()
        results = []
        for item in plan.items:
            nbytes = 0
            if item.tensor_data is not None:
                nbytes = item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _part(self, plan: SavePlan, planner: SavePlanner) -> Any:
        """This rank's part of the state: DTensors everywhere, everything else on rank 0 only,
        nested back by the plan's mappings (DCP's flat key -> path) when it has them."""
        from torch.distributed.tensor import DTensor

        flat = getattr(planner, "state_dict", None)
        if not isinstance(flat, dict):
            raise InvalidSaveError("rc.dcp.writer needs DCP's DefaultSavePlanner (or a subclass of it): it "
                                   "stores the planner's state dict as it is; nothing was written")
        part: Dict[str, Any] = {}
        for fqn, obj in flat.items():
            if type(obj).__name__ == "ShardedTensor":
                raise InvalidSaveError(f"rc.dcp.writer: {fqn} is a ShardedTensor; only DTensors and plain tensors "
                                       f"are stored (FSDP2 / DTensor state dicts); nothing was written")
            if isinstance(obj, DTensor):
                check_dtype(obj.dtype, fqn)
                part[fqn] = obj
            elif self.rank == 0:
                part[fqn] = obj
        mappings = plan.planner_data if isinstance(plan.planner_data, dict) else getattr(planner, "mappings", None)
        if isinstance(mappings, dict) and all(k in mappings for k in part):
            # the inverse of the planner's flatten_state_dict (private module, the one DCP uses)
            from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

            return unflatten_state_dict(part, {k: mappings[k] for k in part})
        return part

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """On the coordinator, after every rank's ``write_data`` waited (bounded) for the commit: the
        version must be committed and listed by the engine, else a SaveError saying which."""
        if self.result is None:
            raise SaveError(f"rc.dcp.writer: step {self.step} of run {self.engine.run!r} was not committed "
                            f"(this rank's write did not complete)")
        steps = self.engine.all_steps()
        if self.step not in steps:
            raise SaveError(f"rc.dcp.writer: step {self.step} of run {self.engine.run!r} committed but is no longer "
                            f"listed (retention deleted it?); committed steps: {steps[-8:]}")


def declared_world_size(engine: Any, name: str) -> int:
    """The world size ``name`` is declared with in the engine's run; a clear error when it is not
    declared for pushing (the driver's ``engine.register(name, world_size=N)``) or is replicated."""
    decl = engine.declarations().get(name)
    if decl is None:
        raise InvalidArgumentError(
            f"rc.dcp.writer: state {name!r} is not declared for pushing in run {engine.run!r}; the driver "
            f"declares it first with engine.register({name!r}, world_size=N) (N: the ranks that call dcp.save)")
    if decl.replicated:
        raise InvalidArgumentError(f"rc.dcp.writer: state {name!r} is declared replicated=True (rank 0's copy "
                                   f"only); DCP's ranks each hold their own shards: declare it without replicated")
    return int(decl.world_size)
