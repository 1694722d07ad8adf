"""Where overlapped snapshots announce their bytes, and how a reader waits for them.

An overlapped snapshot call (``snapshot.snapshot_overlapped``) returns a :class:`PendingSnapshot` at
once; the provider's copy thread puts the state into the object store and announces the ObjectRef
(or why the copy failed) in the run's :class:`SnapshotMailbox`. Writers (``resolve_snapshot``),
``SaveHandle.refs`` and ``engine.publish`` (``pending_refs``) wait for it there, and notice when the
provider died or was restarted meanwhile (:class:`_Liveness`). Kept apart from ``snapshot.py``
because this is a small protocol between processes (who creates the mailbox, who owns it, what
happens when it is gone), not capture.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import ray

from ..config import EngineConfig
from .priority import lower_process_priority
from ..ray_internals import actor_id_hex, actor_ready

MAILBOX_NAMESPACE = "ray_ckpt"


def mailbox_name(run: str) -> str:
    return f"ray_ckpt.mailbox.{run}"


@dataclass(frozen=True)
class PendingSnapshot:
    """What an overlapped snapshot call returns at once: where its bytes will be announced.

    The copy runs on a background thread of the provider's process (``overlap.OverlapCopier``), which
    puts the state into the object store and sends the ObjectRef (or the reason it failed) to the
    run's :class:`SnapshotMailbox` under ``key``; :func:`resolve_snapshot` waits for it there.
    ``actor`` / ``pid``: the provider actor's handle and the process that holds the copy, so a reader
    notices when it died or was restarted (None for an in-process state). The handle travels as
    ``[ObjectRef]`` of it (:func:`self_handle_ref`), fetched only by a reader whose wait runs long:
    fetching an actor handle makes Ray import the actor's class, so every writer that took a
    snapshot's handle would import the learner's module and torch (seconds of CPU and hundreds of
    MB per writer process) for a check it rarely needs."""

    name: str
    key: str
    mailbox: str
    actor: Optional[List[Any]]  # [ObjectRef of the provider actor's handle], or None
    pid: int
    nbytes: int


@ray.remote(num_cpus=0)
class SnapshotMailbox:
    """Where overlapped snapshots announce their ObjectRefs (one small async actor per run).

    An entry is kept until a writer took it and a newer snapshot of the same state arrived (the
    newest stays for ``SaveHandle.refs`` / ``engine.publish``); refs travel inside lists, so the
    bytes never pass through this actor: it only borrows the references."""

    def __init__(self, untaken_cap: int = 16, nice: int = 0):
        lower_process_priority(nice)  # bookkeeping beside training: below it (priority.py)
        self.slots: Dict[str, tuple] = {}  # key -> (name, refs, error)
        self.events: Dict[str, asyncio.Event] = {}
        self.taken: set = set()
        self.order: Dict[str, List[str]] = {}  # state name -> its keys, oldest first
        self.cap = untaken_cap

    def _event(self, key: str) -> "asyncio.Event":
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = asyncio.Event()
        return ev

    async def put(self, key: str, name: str, refs: List[Any], error: Optional[str] = None) -> None:
        self.slots[key] = (name, refs, error)
        keys = self.order.setdefault(name, [])
        keys.append(key)
        self._event(key).set()
        self._evict(name)

    def _evict(self, name: str) -> None:
        keys = self.order.get(name, [])
        older = keys[:-1]
        drop = [k for k in older if k in self.taken] + [k for k in older if k not in self.taken][:-self.cap]
        for k in set(drop):
            keys.remove(k)
            self.slots.pop(k, None)
            self.events.pop(k, None)
            self.taken.discard(k)

    async def get(self, key: str, timeout: float, take: bool = False) -> Optional[tuple]:
        """(refs, error) of ``key`` once announced, or None after ``timeout`` seconds."""
        if key not in self.slots:
            try:
                await asyncio.wait_for(self._event(key).wait(), timeout)
            except asyncio.TimeoutError:
                return None
        slot = self.slots.get(key)
        if slot is None:
            return ([], f"snapshot {key} is no longer held (superseded)")
        if take:
            self.taken.add(key)
            self._evict(slot[0])
        return slot[1], slot[2]


_MAILBOXES: Dict[str, Any] = {}


def _mailbox(name: str, wait_s: float = 10.0) -> Any:
    """The run's mailbox by name (ValueError if it is not there within ``wait_s``)."""
    mb = _MAILBOXES.get(name)
    deadline = time.monotonic() + wait_s
    while mb is None:
        try:
            mb = _MAILBOXES[name] = ray.get_actor(name, namespace=MAILBOX_NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return mb


def _spawn_mailbox(coordinator: Any, name: str, dead: Optional[str] = None) -> Any:
    """Runs in the run's coordinator (``__ray_call__``): the mailbox is created by, so owned by, the
    coordinator's process, and Ray stops it with that process (``engine.shutdown()``). The
    coordinator keeps the handle: Ray also stops an actor once no handle of it is left, and the one
    returned lives in the rank that asked first, so ranks that end (a job resumed on another number
    of GPUs) would take the mailbox with them while the writers still use it. Outside any
    placement group: called from a Tune trial's process (no coordinator), it must not take, or fail
    to fit, the trial's bundles. On the coordinator's node where it can: placed by Ray anywhere, it
    landed on a learner's node, went with that node's preemption, and the restarted learner found
    it dead (tests/mailbox_scenario.py). ``dead``: the id of a mailbox a caller found dead by its name
    (Ray can still hand out a dead named actor for a while): it is killed first, which frees the
    name."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    cfg = getattr(coordinator, "cfg", None)  # the run's EngineConfig, in its coordinator's process
    nice = (cfg or EngineConfig).critical_nice
    held = coordinator.__dict__.setdefault("_held_mailboxes", {}) if coordinator is not None else {}
    if dead is not None:
        try:
            stale = held[name] if name in held and actor_id_hex(held[name]) == dead else \
                ray.get_actor(name, namespace=MAILBOX_NAMESPACE)
            if actor_id_hex(stale) == dead:
                ray.kill(stale, no_restart=True)
        except (ValueError, ray.exceptions.RayError):
            pass
        held.pop(name, None)
    where = (NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
             if coordinator is not None else PlacementGroupSchedulingStrategy(placement_group=None))
    mb = SnapshotMailbox.options(name=name, namespace=MAILBOX_NAMESPACE, get_if_exists=True, max_restarts=0,
                                 scheduling_strategy=where).remote(nice=nice)
    if coordinator is not None:
        # keep the creating handle: the one get_if_exists gives for a mailbox that already runs
        # does not count as a reference, so replacing it would let Ray stop the mailbox
        if name not in held or actor_id_hex(held[name]) != actor_id_hex(mb):
            held[name] = mb
    return mb


def prepare_mailbox(coordinator: Any, run: str) -> None:
    """Have the run's coordinator start the mailbox now, without waiting for it: the first
    overlapped push (:func:`open_mailbox`) then finds its process running. Starting that process
    inside the first push paused it 0.9-1.6 s on the build VM (``benchmarks/ray_train_save.py``
    with ``overlap=True``). Nothing waits on this call; a failure shows at that first push."""
    coordinator.__ray_call__.remote(_spawn_mailbox, mailbox_name(run))


def open_mailbox(run: str, timeout: float = 120.0) -> Any:
    """Get or create the run's mailbox, started before this returns so that every process of the
    cluster finds it by name.

    Why it is created inside the run's coordinator: an actor is stopped with the process that owns
    it, so the mailbox ends with the coordinator, at ``engine.shutdown()`` (or if the coordinator
    dies, when the saves in flight fail anyway; the next snapshot's announcement opens a new one).
    Without a coordinator (a tool, a test) the caller owns it."""
    from ..protocol import NAMESPACE, actor_name

    name = mailbox_name(run)
    _MAILBOXES.pop(name, None)  # a handle kept from a run of the same name that was shut down
    try:
        coordinator = ray.get_actor(actor_name(run), namespace=NAMESPACE)
    except ValueError:
        coordinator = None
    dead = None
    for attempt in range(3):  # a mailbox found dead (its node went) is replaced
        mb = None
        if coordinator is not None:
            try:
                mb = ray.get(coordinator.__ray_call__.remote(_spawn_mailbox, name, dead), timeout=timeout)
            except ray.exceptions.RayError:  # the coordinator is going away: the caller owns the mailbox
                mb = None
        if mb is None:
            mb = _spawn_mailbox(None, name, dead)
        try:
            ray.get(actor_ready(mb), timeout=timeout)
        except ray.exceptions.RayActorError:
            if attempt == 2:
                raise
            dead = actor_id_hex(mb)
            continue
        _MAILBOXES[name] = mb
        return mb
    raise AssertionError("unreachable")


def close_mailbox(run: str) -> None:
    """Stop the run's mailbox (it also ends with the coordinator that owns it)."""
    name = mailbox_name(run)
    mb = _MAILBOXES.pop(name, None)
    try:
        ray.kill(mb or ray.get_actor(name, namespace=MAILBOX_NAMESPACE), no_restart=True)
    except (ValueError, ray.exceptions.RayError):
        pass


def _run_of(mailbox: str) -> str:
    return mailbox[len(mailbox_name("")):]


def deliver(job: Any, timeout: float = 60.0) -> None:
    """Announce a finished (or failed) copy in the run's mailbox, and wait until it is there: an
    announcement sent to a mailbox that is gone (its coordinator restarted) is sent again to a new
    one, once; a failure is raised (the copy thread logs it; the writer's wait fails the version)."""
    refs = [job.result] if job.error is None and job.result is not None else []
    for attempt in (1, 2):
        try:
            ray.get(_mailbox(job.dest).put.remote(job.key, job.name, refs, job.error), timeout=timeout)
            return
        except (ray.exceptions.RayActorError, ValueError):
            _MAILBOXES.pop(job.dest, None)
            if attempt == 2:
                raise
            open_mailbox(_run_of(job.dest), timeout)


def _pid_in_actor(actor: Any) -> int:
    return os.getpid()


_SELF_REF: List[Any] = []


def self_handle_ref() -> List[Any]:
    """``[ObjectRef]`` of the calling actor's own handle, put once per process (a restarted actor
    is a new process, so a new one). The process owns it: once it dies, fetching it fails, which
    is itself news of the death."""
    if not _SELF_REF:
        _SELF_REF.append(ray.put(ray.get_runtime_context().current_actor))
    return list(_SELF_REF)


class _Liveness:
    """Whether the provider holding a pending copy still runs, by public API only: a tiny call to
    the provider actor (its pid, one every ``every_s``, at most ``MAX_PINGS`` unanswered) fails once
    the actor died, or answers another pid once Ray restarted it. A call waits its turn behind the
    actor's work, which is harmless: it only has to fail (or answer) before the writer gives up.

    Why more than one: a call sent before the actor died can stay pending until Ray has restarted
    it (~7 s with a learner that imports torch), while one sent after the death fails at once
    (ActorUnavailableError): the writer then fails the version ~1-2 s after the death, not 7."""

    MAX_PINGS = 4

    def __init__(self, p: PendingSnapshot, every_s: float = 2.0, first_after_s: float = 0.0):
        self.p, self.every_s = p, every_s
        self.pings: List[Any] = []
        self.sent = time.monotonic() - every_s + first_after_s  # the first look: first_after_s from now
        self.handle: Any = None

    def _handle(self) -> Any:
        """The provider's handle, fetched on first need (see PendingSnapshot); raises RayError when
        the process that put it is gone."""
        if self.handle is None:
            self.handle = ray.get(self.p.actor[0], timeout=30)
        return self.handle

    def why_gone(self) -> Optional[str]:
        p = self.p
        if p.actor is None:
            return None
        if time.monotonic() - self.sent >= self.every_s and len(self.pings) < self.MAX_PINGS:
            try:
                actor = self._handle()
            except ray.exceptions.GetTimeoutError:
                return None  # ask again on the next look
            except ray.exceptions.RayError as exc:
                return f"its provider's process is gone ({type(exc).__name__}) while the overlapped snapshot was being copied"
            self.pings.append(actor.__ray_call__.remote(_pid_in_actor))
            self.sent = time.monotonic()
        answered = ray.wait(self.pings, num_returns=len(self.pings), timeout=0)[0] if self.pings else []
        for ping in answered:
            self.pings.remove(ping)
            try:
                pid = ray.get(ping)
            except ray.exceptions.RayActorError as exc:
                return f"its provider actor died ({type(exc).__name__}) while the overlapped snapshot was being copied"
            except ray.exceptions.RayError:  # not an answer about the actor: ask again later
                continue
            if pid != p.pid:
                return (f"its provider actor was restarted (pid {p.pid} -> {pid}) while the overlapped snapshot "
                        f"was being copied")
        return None


def resolve_snapshot(obj: Any, timeout: float = 600.0, take: bool = True) -> Any:
    """What a snapshot ref held, as the writer needs it: a Flat as it is; a :class:`PendingSnapshot`
    is waited for (its copy announced in the run's mailbox) and fetched — or SaveError naming the
    state when the copy failed, the debug check found it torn, or its process died."""
    if not isinstance(obj, PendingSnapshot):
        return obj
    refs = pending_refs(obj, timeout, take)
    return ray.get(refs[0])


def pending_refs(p: PendingSnapshot, timeout: float = 600.0, take: bool = False) -> List[Any]:
    """The ObjectRefs an overlapped snapshot's copy produced (waits for the copy)."""
    from ..errors import SaveError

    try:
        mb = _mailbox(p.mailbox)
    except ValueError:
        raise SaveError(f"snapshot of state {p.name!r}: its run's mailbox {p.mailbox!r} is gone") from None
    deadline = time.monotonic() + timeout
    ans = mb.get.remote(p.key, timeout, take)
    # the first look at the provider after a second of waiting (most copies are announced sooner, and
    # the look fetches its handle: see PendingSnapshot), then every second
    alive = _Liveness(p, every_s=1.0, first_after_s=1.0)
    while not ray.wait([ans], timeout=0.5)[0]:
        why = alive.why_gone()
        if why:
            raise SaveError(f"snapshot of state {p.name!r}: {why}; this version fails")
        if time.monotonic() > deadline + 5:
            break
    try:
        slot = ray.get(ans) if ray.wait([ans], timeout=0)[0] else None
    except ray.exceptions.RayActorError:
        raise SaveError(f"snapshot of state {p.name!r}: its run's mailbox stopped (the run was shut down or its "
                        f"coordinator restarted) before the overlapped copy was announced") from None
    if slot is None:
        why = alive.why_gone()
        raise SaveError(f"snapshot of state {p.name!r}: its overlapped copy was not announced within {timeout:g}s"
                        + (f" ({why})" if why else ""))
    refs, error = slot
    if error:
        raise SaveError(f"snapshot of state {p.name!r}: {error}")
    return refs
