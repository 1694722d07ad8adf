"""Capturing a provider's state into parts that the object store moves without copies, and bringing
restored state back into a provider.

The functions whose first argument is ``actor`` run *inside* the provider actor through Ray's
``__ray_call__``: the driver submits them itself, so Ray's per-caller ordering runs the snapshot
right after that actor's training call for the same step, and the state's tensors leave the actor
as flat numpy views (one memcpy into the object store, no pickling of tensor data).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .checkpoint_io import decode_files, read_files
from .errors import IntegrityError, RestoreError, one_line
from .formats.manifest import FileEntry
from .formats.tree import Flat, flatten
from .object_store import start_prefault
from .protocol import StagedState
from .storage.tier import Tier

_STAGED = "_ray_ckpt_staged"


@dataclass(frozen=True)
class ActorProvider:
    """A Ray actor handle whose ``get(name)`` returns a state and ``set(name, state)`` loads one.

    With ``attribute``, the state is that attribute of the actor instead, an object with torch's
    ``Stateful`` protocol (``state_dict()`` / ``load_state_dict(state)``: a module, an optimizer,
    an LR scheduler, a ``StatefulDataLoader``) or RLlib's ``Checkpointable`` one (``get_state()``
    / ``set_state(state)``); ``get`` / ``set`` then name those two methods."""

    handle: Any
    get: str = "ckpt_get_state"
    set: str = "ckpt_set_state"
    attribute: Optional[str] = None


@dataclass(frozen=True)
class CallableProvider:
    """An in-process function returning the state; ``loader(state)`` loads one back."""

    fn: Optional[Callable[[], Any]]
    loader: Optional[Callable[..., Any]] = None


def actor_provider(handle: Any, *, get: str = "ckpt_get_state", set: str = "ckpt_set_state") -> ActorProvider:
    """Use other method names than ``ckpt_get_state`` / ``ckpt_set_state`` on an actor."""
    return ActorProvider(handle, get, set)


def actor_method(handle: Any, attribute: str, *, get: Optional[str] = None, set: Optional[str] = None
                 ) -> ActorProvider:
    """The state of one attribute of an actor: ``rc.actor_method(learner, "opt")`` saves
    ``learner.opt.state_dict()`` inside the actor and restores with ``learner.opt.load_state_dict``.
    An attribute with RLlib's ``get_state`` / ``set_state`` (and no ``state_dict``) uses those;
    ``get`` / ``set`` name other methods."""
    if not isinstance(attribute, str) or not attribute.isidentifier():
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"actor_method: attribute must be an attribute name, got {attribute!r}")
    return ActorProvider(handle, get or "", set or "", attribute)


STATEFUL_METHODS = (("state_dict", "load_state_dict"), ("get_state", "set_state"))


def stateful_methods(obj: Any) -> Optional[tuple]:
    """The (get, set) method names of an object following torch's Stateful or RLlib's
    Checkpointable protocol, or None."""
    for get, set_ in STATEFUL_METHODS:
        if callable(getattr(obj, get, None)) and callable(getattr(obj, set_, None)):
            return get, set_
    return None


def _actor_get(actor: Any, prov_get: str, attribute: Optional[str], name: str) -> Any:
    if attribute is None:
        return getattr(actor, prov_get)(name)
    obj = getattr(actor, attribute)
    get = prov_get or (stateful_methods(obj) or ("state_dict",))[0]
    return getattr(obj, get)()


def _actor_set(actor: Any, prov_set: str, attribute: Optional[str], name: str, state: Any) -> None:
    if attribute is None:
        getattr(actor, prov_set)(name, state)
        return
    obj = getattr(actor, attribute)
    set_ = prov_set or (stateful_methods(obj) or (None, "load_state_dict"))[1]
    getattr(obj, set_)(state)


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


def snapshot_in_actor(actor: Any, getter: str, name: str, allow_pickle: bool, prefault: bool = False,
                      attribute: Optional[str] = None, run: Optional[str] = None) -> Flat:
    """Runs in the provider actor: call its getter and flatten (CPU tensor memory is not copied
    here; Ray copies it once into the object store when this returns; device tensors go through
    the actor's reused pinned staging buffers). ``prefault``: make sure this process maps the
    object store (an actor that Ray restarted is a new process that ``register`` never saw)."""
    if prefault:
        start_prefault()
    t0 = time.perf_counter()
    staging = actor.__dict__.setdefault("_ray_ckpt_host_staging", HostStaging())
    flat = capture(_actor_get(actor, getter, attribute, name), name, allow_pickle, staging)
    if run:  # the capture in the actor (Ray's copy of the result into the object store follows it)
        from .metrics import for_run

        for_run(run).snapshot_pause(time.perf_counter() - t0, state=name)
    return flat


def read_state(tiers: Sequence[Tier], files: List[FileEntry], name: str, allow_pickle: bool = False):
    """Read, verify and decode one part. Returns (state, tier used, problems seen)."""
    bufs, tier, problems = read_files(tiers, files)
    return decode_files(files, bufs, name=name, allow_pickle=allow_pickle), tier, problems


def stage_in_actor(actor: Any, name: str, config: Any, files: List[FileEntry],
                   allow_pickle: bool) -> StagedState:
    """Runs in the provider actor: read + verify the state from its node's tiers and hold it until
    every state of the restore is verified (so a failed restore changes nothing)."""
    if config.prefault_object_store:
        start_prefault()  # a restarted provider restores first: its next saves find the store mapped
    try:
        state, tier, problems = read_state(tiers_of(config), files, name, allow_pickle)
    except (IntegrityError, RestoreError, OSError) as exc:
        return StagedState(False, None, one_line(exc))
    actor.__dict__.setdefault(_STAGED, {})[name] = state
    return StagedState(True, tier, "; ".join(problems), sum(f.size for f in files))


def tiers_of(config: Any) -> List[Tier]:
    """The tiers as seen from this process: its node's local tier first, then the remote one."""
    remote = config.remote_tier()
    return [config.local_tier()] + ([remote] if remote is not None else [])


def apply_in_actor(actor: Any, setter: str, name: str, attribute: Optional[str] = None) -> None:
    state = actor.__dict__.get(_STAGED, {}).pop(name)
    _actor_set(actor, setter, attribute, name, state)


def discard_in_actor(actor: Any, name: str) -> None:
    actor.__dict__.get(_STAGED, {}).pop(name, None)
