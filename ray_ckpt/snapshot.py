"""Capturing a provider's state into parts that the object store moves without copies, and bringing
restored state back into a provider.

The functions whose first argument is ``actor`` run *inside* the provider actor through Ray's
``__ray_call__``: the driver submits them itself, so Ray's per-caller ordering runs the snapshot
right after that actor's training call for the same step, and the state's tensors leave the actor
as flat numpy views (one memcpy into the object store, no pickling of tensor data).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .checkpoint_io import decode_files, read_files
from .errors import IntegrityError, RestoreError, one_line
from .formats.manifest import FileEntry
from .formats.tree import Flat, flatten
from .object_store import start_prefault
from .storage.tier import Tier

_STAGED = "_ray_ckpt_staged"


@dataclass(frozen=True)
class ActorProvider:
    """A Ray actor handle whose ``get(name)`` returns a state and ``set(name, state)`` loads one."""

    handle: Any
    get: str = "ckpt_get_state"
    set: str = "ckpt_set_state"


@dataclass(frozen=True)
class CallableProvider:
    """An in-process function returning the state; ``loader(state)`` loads one back."""

    fn: Optional[Callable[[], Any]]
    loader: Optional[Callable[..., Any]] = None


def actor_provider(handle: Any, *, get: str = "ckpt_get_state", set: str = "ckpt_set_state") -> ActorProvider:
    """Use other method names than ``ckpt_get_state`` / ``ckpt_set_state`` on an actor."""
    return ActorProvider(handle, get, set)


class HostStaging:
    """Device -> host copies for snapshots, into host buffers reused across saves.

    On CUDA the buffers are pinned and the copies run on a side stream with ``non_blocking=True``;
    the side stream first waits for the training stream's queued work (so the copy sees this
    step's values), and only the snapshotting thread waits for the copies, never the training
    stream. ``stage_cpu=True`` sends CPU tensors through the same path (how it is tested without
    a GPU, and a way to snapshot tensors that keep changing in place from other threads).
    """

    def __init__(self, stage_cpu: bool = False):
        self.stage_cpu = stage_cpu
        self.buffers: Dict[str, Any] = {}
        self.streams: Dict[Any, Any] = {}

    def __call__(self, tensor: Any, key: str) -> Any:
        import torch

        t = tensor.contiguous()
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self.buffers[key] = buf
        if t.is_cuda:
            stream = self.streams.get(t.device)
            if stream is None:
                stream = self.streams[t.device] = torch.cuda.Stream(device=t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ends
        else:
            buf.copy_(t)
        return buf

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


def capture(state: Any, name: str, allow_pickle: bool = False, staging: Optional[HostStaging] = None) -> Flat:
    flat = flatten(state, state_name=name, allow_pickle=allow_pickle, to_host=staging)
    if staging is not None:
        staging.synchronize()  # every device->host copy has landed before the bytes leave
    return flat


def snapshot_in_actor(actor: Any, getter: str, name: str, allow_pickle: bool, prefault: bool = False) -> Flat:
    """Runs in the provider actor: call its getter and flatten (CPU tensor memory is not copied
    here; Ray copies it once into the object store when this returns; device tensors go through
    the actor's reused pinned staging buffers). ``prefault``: make sure this process maps the
    object store (an actor that Ray restarted is a new process that ``register`` never saw)."""
    if prefault:
        start_prefault()
    staging = actor.__dict__.setdefault("_ray_ckpt_host_staging", HostStaging())
    return capture(getattr(actor, getter)(name), name, allow_pickle, staging)


def read_state(tiers: Sequence[Tier], files: List[FileEntry], name: str, allow_pickle: bool = False):
    """Read, verify and decode one part. Returns (state, tier used, problems seen)."""
    bufs, tier, problems = read_files(tiers, files)
    return decode_files(files, bufs, name=name, allow_pickle=allow_pickle), tier, problems


def stage_in_actor(actor: Any, name: str, config: Any, files: List[FileEntry],
                   allow_pickle: bool) -> Dict[str, Any]:
    """Runs in the provider actor: read + verify the state from its node's tiers and hold it until
    every state of the restore is verified (so a failed restore changes nothing)."""
    if config.prefault_object_store:
        start_prefault()  # a restarted provider restores first: its next saves find the store mapped
    try:
        state, tier, problems = read_state(tiers_of(config), files, name, allow_pickle)
    except (IntegrityError, RestoreError, OSError) as exc:
        return {"ok": False, "tier": None, "detail": one_line(exc)}
    actor.__dict__.setdefault(_STAGED, {})[name] = state
    return {"ok": True, "tier": tier, "detail": "; ".join(problems),
            "bytes": sum(f.size for f in files)}


def tiers_of(config: Any) -> List[Tier]:
    """The tiers as seen from this process: its node's local tier first, then the remote one."""
    remote = config.remote_tier()
    return [config.local_tier()] + ([remote] if remote is not None else [])


def apply_in_actor(actor: Any, setter: str, name: str) -> None:
    state = actor.__dict__.get(_STAGED, {}).pop(name)
    getattr(actor, setter)(name, state)


def discard_in_actor(actor: Any, name: str) -> None:
    actor.__dict__.get(_STAGED, {}).pop(name, None)
