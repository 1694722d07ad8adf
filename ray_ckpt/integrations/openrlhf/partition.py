"""The ``optim`` state that ``save_ckpt`` pushes, flattened once and reused while its memory stays.

A rank pushes the same ranges at every save: the fp32 master and each moment range of every
trainable parameter, and its range of every frozen one (``zero.partition_state``,
``zero.frozen_state``), views of the same few flat buffers whose values, not places, change
between saves. Building those views and flattening them (one ``TensorChunk`` leaf each, three per
parameter) is most of what a save would block for, so :class:`PartitionCache` does it once per
layout and hands later saves the same :class:`~ray_ckpt.formats.flat.Flat`: views of host memory,
whose copy into the object store reads the values as they are when it runs, exactly as a freshly
flattened state's copy does.

The Flat is reused only while :func:`_signature` is unchanged (the flat fp32 buffers and moment
tensors the optimizer steps, each by identity and address; the frozen parameters' memory; which
parameters are frozen; rank, world size and stage) and only if every range was found to be a view
of those buffers on the CPU. Otherwise (device tensors, which flattening stages to host memory at
each save; a range that DeepSpeed hands out as a copy, e.g. from NVMe-swapped groups) the views are
flattened at every save, as before."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ray_ckpt.formats.tree import flatten

from . import zero


class _Entry:
    __slots__ = ("params", "signature", "frozen", "flat")

    def __init__(self, params: List[Tuple[str, Any]]):
        self.params = params  # DeepSpeed never replaces a prepared module's parameters
        self.signature: Optional[tuple] = None
        self.frozen: List[str] = []
        self.flat: Any = None


def _buffers(engine: Any, params: List[Tuple[str, Any]]) -> List[Any]:
    """The tensors every pushed range is a view of: the flat fp32 groups, their per-element
    optimizer states, the frozen parameters' local memory."""
    out = []
    state = engine.optimizer.optimizer.state
    for f in zero.flat_groups(engine):
        out.append(f)
        out.extend(v for _, v in sorted(state.get(f, {}).items()) if torch.is_tensor(v) and v.shape == f.shape)
    stage3 = zero.stage_of(engine) == 3
    out.extend(p.ds_tensor if stage3 else p for _, p in params if not p.requires_grad)  # (p.data: a new object each time)
    return out


def _signature(engine: Any, params: List[Tuple[str, Any]], buffers: List[Any]) -> tuple:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = engine.optimizer.optimizer.state
    keys = tuple(tuple(sorted(k for k, v in state.get(f, {}).items() if torch.is_tensor(v)))
                 for f in zero.flat_groups(engine))
    return (zero.stage_of(engine), rank, world, keys, tuple(p.requires_grad for _, p in params),
            tuple((id(b), b.data_ptr(), b.numel(), b.device.type) for b in buffers))


def _host_views(state: Dict[str, Dict[str, Any]], buffers: List[Any]) -> bool:
    """Whether every range in ``state`` is a view of one of ``buffers``' CPU memory."""
    owned = {b.untyped_storage().data_ptr() for b in buffers if b.device.type == "cpu"}
    return all(not c.local.numel() or (c.local.device.type == "cpu" and c.local.untyped_storage().data_ptr() in owned)
               for part in state.values() for c in part.values())


class PartitionCache:
    """Per engine (weakly held): the ``optim`` state to push and the frozen parameters' names."""

    def __init__(self) -> None:
        self._entries: "weakref.WeakKeyDictionary[Any, _Entry]" = weakref.WeakKeyDictionary()

    def get(self, engine: Any) -> Tuple[Any, List[str]]:
        """(this rank's ``optim`` state: the reused Flat, or a fresh dict of views; the names of
        the frozen parameters)."""
        entry = self._entries.get(engine)
        if entry is None:
            entry = self._entries[engine] = _Entry(list(engine.module.named_parameters()))
        buffers = _buffers(engine, entry.params)
        signature = _signature(engine, entry.params, buffers)
        if entry.signature == signature and entry.flat is not None:
            return entry.flat, entry.frozen
        frozen = [name for name, p in entry.params if not p.requires_grad]
        state = zero.partition_state(engine)
        if frozen:
            state[zero.FROZEN] = zero.frozen_state(engine)
        entry.signature, entry.frozen, entry.flat = signature, frozen, None
        if _host_views(state, buffers):
            entry.flat = flatten(state, state_name="optim")
            return entry.flat, frozen
        return state, frozen
