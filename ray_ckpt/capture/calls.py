"""The driver's calls that take, warm up and hand on the snapshots of registered states.

``save()`` captures every registered state where it lives: an in-process callable here (at once, or
overlapped: views captured, the copy on this process's copy thread), an actor provider through
``__ray_call__`` in the actor (Ray's per-caller ordering runs it right after that actor's training
call for the same step). ``register()`` warms the object store up for the process that will copy
(``prefault``), and ``publish()`` hands a save's snapshot to other actors. Kept apart from the
engine because this is where the overlap machinery (``snapshot.py``, ``overlap.py``) meets the
engine: one place to read which process copies what, and with which options.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

import ray

from ..config import EngineConfig
from ..errors import InvalidArgumentError
from ..formats.flat import Flat, owned_copy
from ..metrics import for_run as metrics_for_run
from .object_store import prefault_in_actor, prefault_needed, start_prefault, state_nbytes
from ..protocol import PartPlan
from .providers import Registration
from .snapshot import (ActorProvider, CallableProvider, capture, prefault_needed_in_actor, prepare_in_actor,
                       receive_in_actor, snapshot_in_actor, snapshot_overlapped, snapshot_overlapped_in_actor,
                       stateful_methods)
from .mailbox import PendingSnapshot, mailbox_name


INLINE_MAX = 64 << 10  # an in-process snapshot with at most this many array bytes travels inline
# An in-process overlapped state smaller than this is copied in the save call instead, as if not
# overlapped. Why: the copy of a few MiB takes about a millisecond, while the overlapped path costs
# the copy thread's put, the run's mailbox announcing it, the writer's take and the borrowing of
# its ref: ~7-15 ms of CPU per state in other processes (the mailbox alone, RLlib PPO/DQN on a
# 2-core VM: 15-29 ms per save of two ~0.5 MB states, benchmarks/rllib_rate.py), taken from
# training on a machine whose cores it fills. 4 MiB: where Ray's put starts copying with threads.
OVERLAP_MIN_BYTES = 4 << 20


def _sendable(flat: Any) -> Any:
    """A snapshot as the save call carries it: a small one (counters, RNG states, connector
    statistics, metrics, an overlapped state's announcement) inline, by value in the coordinator's
    call; a larger one as an ObjectRef. Why: each ``ray.put`` is a round trip to the object store
    (~0.5 ms on a loaded 2-core node), and a save of small states paid one per state inside the
    training loop; inline, Ray carries them in the call itself."""
    if isinstance(flat, PendingSnapshot):
        return flat
    if isinstance(flat, Flat) and flat.nbytes <= INLINE_MAX:
        return owned_copy(flat)  # the state's bytes now, as a put would copy them (views change with it)
    return ray.put(flat)


def announced(reg: Registration, snapshot: Any) -> bool:
    """Whether ``take_snapshots``' snapshot of ``reg`` is announced in the run's mailbox once copied
    (``SaveHandle.refs`` waits there): an actor's overlapped snapshot call, or an in-process
    state's :class:`PendingSnapshot` -- not a small in-process one copied in the call."""
    return isinstance(snapshot, PendingSnapshot) or (reg.overlap and isinstance(reg.provider, ActorProvider))


def take_snapshots(registry: Mapping[str, Registration], run: str, config: EngineConfig
                   ) -> Tuple[List[PartPlan], List[Any]]:
    """A save's parts and their snapshots (``parts`` with ``loader=True`` have none): each an
    ObjectRef, or a small one inline (:func:`_sendable`; the writer, ``locate`` and
    ``SaveHandle.refs`` take either). In-process states first: an unsupported object raises here,
    before anything is submitted. States its ranks push are left out: the coordinator expects
    those parts itself."""
    parts: List[PartPlan] = []
    refs: List[Any] = []
    for reg in registry.values():
        prov = reg.provider
        if reg.world_size is not None:
            continue  # pushed by its ranks; the coordinator expects those parts itself
        if isinstance(prov, CallableProvider):
            if prov.fn is None:
                parts.append(PartPlan(reg.name, reg.strategy, loader=True))
                continue
            t_pause = time.perf_counter()
            if reg.overlap:  # the copy runs on this process's copy thread; fences guard the state
                pending = snapshot_overlapped(getattr(prov.fn, "__self__", prov.fn), prov.fn, reg.name,
                                              reg.allow_pickle, mailbox_name(run), config.overlap_check,
                                              needed=config.prefault_needed, copy_now_below=OVERLAP_MIN_BYTES)
                parts.append(PartPlan(reg.name, reg.strategy, nbytes=pending.nbytes, append_only=reg.append_only))
                refs.append(_sendable(pending))  # a small one (a Flat, not pending) is copied here, now
                metrics_for_run(run).snapshot_pause(time.perf_counter() - t_pause, state=reg.name)
                continue
            flat = capture(prov.fn(), reg.name, reg.allow_pickle)
            parts.append(PartPlan(reg.name, reg.strategy, nbytes=flat.nbytes, append_only=reg.append_only))
            refs.append(_sendable(flat))
            metrics_for_run(run).snapshot_pause(time.perf_counter() - t_pause, state=reg.name)
    for reg in registry.values():
        prov = reg.provider
        if isinstance(prov, ActorProvider) and reg.overlap:
            parts.append(PartPlan(reg.name, reg.strategy, append_only=reg.append_only))
            refs.append(prov.handle.__ray_call__.options(name=f"ray_ckpt.snapshot:{run}/{reg.name}").remote(
                snapshot_overlapped_in_actor, prov.get, reg.name, reg.allow_pickle, prov.attribute, run,
                mailbox_name(run), config.overlap_check, config.prefault_needed))
        elif isinstance(prov, ActorProvider):
            parts.append(PartPlan(reg.name, reg.strategy, append_only=reg.append_only))
            refs.append(prov.handle.__ray_call__.options(name=f"ray_ckpt.snapshot:{run}/{reg.name}").remote(
                snapshot_in_actor, prov.get, reg.name, reg.allow_pickle, config.prefault_object_store,
                prov.attribute, run, config.prefault_needed))
    return parts, refs


def prefault(config: EngineConfig, prov: Union[ActorProvider, CallableProvider], name: Optional[str] = None,
             overlap: bool = False) -> None:
    """With ``prefault_object_store``: the process that will copy this state's snapshots into the
    object store (the provider actor; this one for an in-process callable) maps it now, in the
    background. With ``prefault_needed`` only the pages its first saves use. Either way, the run's
    metrics (and, with ``overlap``, the copy thread, the hooks and the process's own handle ref:
    ``snapshot.prepare_in_actor``) are made in that process now rather than in its first save's
    pause. The calls' results are not awaited: register() does not wait for the provider."""
    if isinstance(prov, ActorProvider):
        if config.prefault_object_store or not config.prefault_needed or name is None:
            prov.handle.__ray_call__.remote(prepare_in_actor, config.run, overlap)
    else:
        metrics_for_run(config.run)
    if not config.prefault_object_store:
        if config.prefault_needed and name is not None:
            if isinstance(prov, ActorProvider):
                prov.handle.__ray_call__.remote(prefault_needed_in_actor, prov.attribute, name, overlap, config.run)
            elif prov.fn is not None and stateful_methods(getattr(prov.fn, "__self__", None)):
                try:  # a torch Stateful object's state_dict() has no side effects
                    prefault_needed(state_nbytes(prov.fn()), name)
                except Exception:  # not ready yet: nothing mapped ahead
                    pass
        return
    if isinstance(prov, ActorProvider):
        prov.handle.__ray_call__.remote(prefault_in_actor)  # returns at once; no answer needed
    elif prov.fn is not None:
        start_prefault()


def publish_calls(handle: Any, name: str, to: Iterable[Any], method: str) -> List[ray.ObjectRef]:
    """``CheckpointEngine.publish``: ``actor.<method>(state)`` on each actor of ``to``, with the
    snapshot of state ``name`` that the save of ``handle`` (a SaveHandle, None: no save yet) holds,
    read from the object store."""
    if not isinstance(method, str) or not method.isidentifier():
        raise InvalidArgumentError(f"publish: method must be a method name, got {method!r}")
    if handle is None:
        raise InvalidArgumentError(f"publish({name!r}): no save of this engine to publish yet")
    entry = handle._snapshots.get(name)
    if entry is None:
        raise InvalidArgumentError(f"publish: the save of step {handle.step} has no snapshot of state {name!r} "
                                   f"(it has: {', '.join(sorted(handle._snapshots)) or 'none'})")
    actors = list(to)
    for a in actors:
        if not isinstance(a, ray.actor.ActorHandle):
            raise InvalidArgumentError(f"publish: 'to' must hold actor handles, got {type(a).__name__}")
    return [a.__ray_call__.remote(receive_in_actor, method, [entry[0]]) for a in actors]
