"""Capturing a provider's state into parts that the object store moves without copies (bringing
restored state back into a provider is ``restored.py``).

The functions whose first argument is ``actor`` run *inside* the provider actor through Ray's
``__ray_call__``: the driver submits them itself, so Ray's per-caller ordering runs the snapshot
right after that actor's training call for the same step, and the state's tensors leave the actor
as flat numpy views (one memcpy into the object store, no pickling of tensor data).
"""
from __future__ import annotations

import os
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import ray

from ..formats.flat import Flat, Pieces, pieces_of
from ..formats.tree import flatten
from .object_store import grow_needed, prefault_needed, start_prefault, state_nbytes
from .fence_hooks import candidates, install_hooks
from .overlap import OverlapCopier, process_copier, process_hooks
from .mailbox import PendingSnapshot, deliver, pending_refs, self_handle_ref

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
        from ..errors import InvalidArgumentError

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


def actor_get(actor: Any, prov_get: str, attribute: Optional[str], name: str) -> Any:
    """Inside a provider actor: the state ``name`` from its getter, or from its ``attribute``'s."""
    if attribute is None:
        return getattr(actor, prov_get)(name)
    obj = getattr(actor, attribute)
    get = prov_get or (stateful_methods(obj) or ("state_dict",))[0]
    return getattr(obj, get)()


def actor_set(actor: Any, prov_set: str, attribute: Optional[str], name: str, state: Any) -> None:
    """Inside a provider actor: load ``state`` through its setter, or its ``attribute``'s."""
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

    def record_events(self) -> List[Any]:
        """Overlapped snapshots: one CUDA event per side stream, marking the end of this snapshot's
        device->host copies (waited for by the copy thread and by fences, not here)."""
        import sys

        torch = sys.modules.get("torch")
        events = []
        for stream in self.streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return events


def capture(state: Any, name: str, allow_pickle: bool = False, staging: Optional[HostStaging] = None) -> Flat:
    flat = flatten(state, state_name=name, allow_pickle=allow_pickle, to_host=staging)
    if staging is not None:
        staging.synchronize()  # every device->host copy has landed before the bytes leave
    return flat


def snapshot_in_actor(actor: Any, getter: str, name: str, allow_pickle: bool, prefault: bool = False,
                      attribute: Optional[str] = None, run: Optional[str] = None, needed: bool = False) -> Flat:
    """Runs in the provider actor: call its getter and flatten (CPU tensor memory is not copied
    here; Ray copies it once into the object store when this returns; device tensors go through
    the actor's reused pinned staging buffers). ``prefault``: make sure this process maps the
    object store (an actor that Ray restarted is a new process that ``register`` never saw)."""
    if prefault:
        start_prefault()
    t0 = time.perf_counter()
    staging = actor.__dict__.setdefault("_ray_ckpt_host_staging", HostStaging())
    flat = capture(actor_get(actor, getter, attribute, name), name, allow_pickle, staging)
    if needed and not prefault:  # a restarted actor is a new process: its next saves find the pages mapped
        prefault_needed(flat.nbytes, name)
    if run:  # the capture in the actor (Ray's copy of the result into the object store follows it)
        from ..metrics import for_run

        for_run(run).snapshot_pause(time.perf_counter() - t0, state=name)
    return flat


# ---------------------------------------------------------------------------- overlapped snapshots
def _readback(result: Any) -> List[Any]:
    flat = ray.get(result)
    return [np.concatenate(pieces_of(a)) if isinstance(a, Pieces) else a for a in flat.arrays]


def _put(flat: Flat) -> Any:
    """``ray.put`` of a snapshot; one that met pages of the store this process had never touched
    (over 1/8 of its bytes faulted in) maps more of the store ahead, for the next ones."""
    import resource

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ref = ray.put(flat)
    if (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) * resource.getpagesize() * 8 > flat.nbytes > (1 << 20):
        grow_needed(flat.nbytes)
    return ref


def _copier() -> OverlapCopier:
    return process_copier(lambda: OverlapCopier(put=_put, deliver=deliver, readback=_readback))


def process_copier_or_new() -> OverlapCopier:
    """This process's copier of overlapped snapshots (created on first use; its thread starts at
    its first copy)."""
    return _copier()


def snapshot_overlapped(owner: Any, get: Callable[[], Any], name: str, allow_pickle: bool, mailbox: str,
                        check: bool, run: Optional[str] = None, actor: Any = None,
                        needed: bool = True, copy_now_below: int = 0) -> Union[PendingSnapshot, Flat]:
    """Capture ``get()`` as views, queue its copy on this process's copy thread, return at once.

    ``owner``: the object whose attributes hold the learner's model and optimizers (the actor, or
    the registered object itself): their torch hooks are installed here (once per object).
    ``copy_now_below``: a host-only state of fewer bytes is not queued: its Flat (views of the live
    state) is returned for the caller to copy now (see ``calls.OVERLAP_MIN_BYTES``)."""
    t0 = time.perf_counter()
    copier = _copier()
    copier.fence(name)  # the previous copy of this state is done (staging buffers are reused)
    staging = _staging_of(owner, actor is not None)
    flat = flatten(get(), state_name=name, allow_pickle=allow_pickle, to_host=staging)
    events = staging.record_events() if staging.streams else []
    if flat.nbytes < copy_now_below and not events:
        return flat
    if needed:
        prefault_needed(flat.nbytes, name)
    install_hooks(copier, candidates(owner), process_hooks())
    key = f"{name}/{uuid.uuid4().hex}"
    copier.start(name, key, flat, check=check, cuda_events=events, dest=mailbox)
    copier.call_s.append(time.perf_counter() - t0)
    del copier.call_s[:-1000]
    if run:
        from ..metrics import for_run

        for_run(run).snapshot_pause(time.perf_counter() - t0, state=name)
    return PendingSnapshot(name, key, mailbox, actor, os.getpid(), flat.nbytes)


_OWNER_STAGING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _staging_of(owner: Any, in_actor: bool = False) -> HostStaging:
    if in_actor:  # the actor's attribute, as snapshot_in_actor keeps it
        return owner.__dict__.setdefault("_ray_ckpt_host_staging", HostStaging())
    try:
        return _OWNER_STAGING.setdefault(owner, HostStaging())
    except TypeError:
        return HostStaging()


def snapshot_overlapped_in_actor(actor: Any, getter: str, name: str, allow_pickle: bool, attribute: Optional[str],
                                 run: str, mailbox: str, check: bool, needed: bool = True) -> PendingSnapshot:
    """Runs in the provider actor through ``__ray_call__`` (see :func:`snapshot_overlapped`)."""
    return snapshot_overlapped(actor, lambda: actor_get(actor, getter, attribute, name), name, allow_pickle,
                               mailbox, check, run, self_handle_ref(), needed)


def state_from_snapshot(snapshot: Any) -> Any:
    """A snapshot as its state: ``snapshot`` is an ObjectRef from ``SaveHandle.refs(name)`` (or what
    it holds). Tensors are read-only views of the object store's bytes (zero-copy on the node that
    holds them): ``model.load_state_dict(state)`` copies them into the model."""
    import warnings

    from ..formats.tree import unflatten

    if isinstance(snapshot, ray.ObjectRef):
        snapshot = ray.get(snapshot)
    if isinstance(snapshot, PendingSnapshot):
        snapshot = ray.get(pending_refs(snapshot)[0])
    if not isinstance(snapshot, Flat):
        raise TypeError(f"state_from_snapshot: expected a snapshot ObjectRef, got {type(snapshot).__name__}")
    arrays = [np.concatenate(pieces_of(a)) if isinstance(a, Pieces) else a for a in snapshot.arrays]
    with warnings.catch_warnings():  # torch warns that the object store's buffers are read-only
        warnings.simplefilter("ignore", UserWarning)
        return unflatten(snapshot.structure, arrays, snapshot.tables)


def receive_in_actor(actor: Any, method: str, refs: List[Any]) -> Any:
    """Runs in a consumer (rollout) actor through ``__ray_call__`` (``engine.publish``): the
    snapshot's state, straight from the object store, handed to ``actor.<method>(state)``."""
    return getattr(actor, method)(state_from_snapshot(refs[0]))


def actor_tensor_bytes(actor: Any) -> int:
    """Bytes of the tensors and arrays an actor holds (its modules' parameters and buffers, its
    optimizers' state, tensors and arrays among its attributes), each memory block counted once:
    an upper bound of what its states' snapshots put in the store, found without calling its getter
    (which may have side effects)."""
    import sys

    torch = sys.modules.get("torch")
    seen, total = set(), 0

    def add(x: Any) -> None:
        nonlocal total
        if torch is not None and isinstance(x, torch.Tensor):
            key, n = (x.data_ptr(), x.numel() * x.element_size())
        elif isinstance(x, np.ndarray):
            key, n = (x.__array_interface__["data"][0], x.nbytes)
        else:
            return
        if n and key not in seen:
            seen.add(key)
            total += n

    for obj in candidates(actor):
        if torch is not None and isinstance(obj, torch.nn.Module):
            for t in obj.state_dict().values():
                add(t)
        elif torch is not None and isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                for v in (st.values() if isinstance(st, dict) else ()):
                    add(v)
        else:
            add(obj)
    return total


def prepare_overlap(owner: Any) -> None:
    """Everything an overlapped snapshot sets up once per process, done ahead of the first save (at
    ``register``), so that the first snapshot call costs what the tenth does: this process's copier
    and its copy thread, and the torch hooks (optimizer step pre-hooks, BatchNorm forward
    pre-hooks) on the objects ``owner`` holds."""
    copier = _copier()
    copier.warm()
    install_hooks(copier, candidates(owner), process_hooks())


def prepare_in_actor(actor: Any, run: Optional[str], overlap: bool = False) -> List[Any]:
    """Runs in a provider actor at ``register``: what its first snapshot would otherwise set up
    inside the learner's pause, done ahead of it.

    - The run's metrics in this process (Ray's metric registration would otherwise lengthen the
      first pause).
    - With ``overlap``: the copier, its thread and the hooks (:func:`prepare_overlap`), and this
      process's own handle ref (:func:`self_handle_ref`), which is *returned*: an overlapped
      snapshot returns it to the caller inside its ``PendingSnapshot``, and the first such return
      from a process makes Ray set up its tracking of the caller's borrow, which delays the
      actor's next call; returning it here moves that cost out of the first pause. Returns ``[]``
      or ``[ObjectRef]``."""
    from ..metrics import for_run

    if run is not None:
        for_run(run)
    if not overlap:
        return []
    try:
        prepare_overlap(actor)
        return self_handle_ref()
    except Exception:  # the first snapshot sets it up instead
        return []


def prefault_needed_in_actor(actor: Any, attribute: Optional[str], name: str, overlap: bool = False,
                             run: Optional[str] = None) -> Tuple[int, List[Any]]:
    """Runs in a provider actor at ``register``: map the object-store pages its first saves will
    use (sized from what the actor holds, without calling its getter), in the background, after
    what :func:`prepare_in_actor` does. Returns the bytes mapped ahead, and prepare_in_actor's
    result (returned to the caller on purpose: see there)."""
    handle_ref = prepare_in_actor(actor, run, overlap)
    try:
        if attribute is not None:  # a torch Stateful attribute: its state_dict() has no side effects
            nbytes = state_nbytes(getattr(actor, attribute).state_dict())
            key = name
        else:
            nbytes, key = actor_tensor_bytes(actor), "__actor__"  # every state of this actor at once
    except Exception:  # its first snapshot maps the pages instead
        return 0, handle_ref
    prefault_needed(nbytes, key)
    return nbytes, handle_ref
