"""What a rank does through its engine: push its part of a declared state (``submit``), copied
synchronously or overlapped with its training, under the engine's backpressure.

A mixin of :class:`~ray_ckpt.client.engine.CheckpointEngine` (the state it uses -- ``_declared``,
``_last_pushed``, ``_pushes``, ``_pusher``, ``_in_flight``, ``_fence_owners``, ``_registry`` -- is
set up by the engine's ``__init__``), kept apart so the engine module holds the run's lifetime,
registration, saving and reading, and this one the rank side: declaring a state ranks push
(``register(..., world_size=N)``), and the pushes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import ray

from ..capture.mailbox import open_mailbox
from ..capture.object_store import start_prefault
from ..capture.snapshot import capture
from ..formats.flat import owned_copy
from ..capture.providers import Registration, rank_provider
from ..errors import InvalidArgumentError, InvalidSaveError
from ..protocol import Declaration, PushedPart, checked_metrics
from ..storage.layout import validate_name
from ..types import OnBusy
from .handle import SaveHandle

# a state flattened to at most this many bytes is copied at ``submit`` (a memcpy costs less than the
# object store's round trip) and put by the sender after the call returns (push_batch.py)
PUT_LATER_UP_TO = 1 << 20


class RankPushes:
    """``CheckpointEngine.submit`` and what it needs (see the module)."""

    def submit(self, step: int, name: str, state: Any, rank: int = 0, *,
               on_busy: Union[OnBusy, str] = OnBusy.WAIT,
               overlap_with: Optional[Iterable[Any]] = None,
               metrics: Optional[Dict[str, float]] = None) -> SaveHandle:
        """Push this rank's part of a declared state for ``step`` (from inside a rank actor).

        Returns at once with a handle (a bad push raises here: an undeclared state, a rank out of
        range, a step not after this rank's last); the version commits when every declared rank
        has pushed. One engine may push for many ranks (a host process of several ranks): the parts
        it pushes for a version within a few ms travel to the coordinator in ONE call
        (``push_batch.py``; sent at once when a handle is waited on, and by ``shutdown()``), and
        their handles share one wait call per version. What only the coordinator can refuse (a part
        another process already pushed, a version already committed) fails that part's handle
        alone, when it is waited on, with the coordinator's message.

        Backpressure: at most ``max_in_flight`` of this engine's versions are in flight (pushes
        for a version already in flight always go). ``on_busy``: "wait" (block until the oldest
        ends; push every rank of a version before the next version, or this waits for a version
        that cannot commit until ``rank_timeout_s``), "skip" (return a skipped handle, nothing
        captured) or "queue" (push anyway).

        ``overlap_with=(model, optimizer, ...)``: the copy of ``state`` into the object store runs on
        this process's copy thread while the rank trains on (``submit`` returns after flattening
        the state into views), as ``overlap=True`` does for registered states. The objects given are
        the ones whose in-place changes must wait for the copy: their optimizers' ``step`` and the
        forward of their modules that change buffers are fenced; any other in-place change of the
        pushed tensors needs ``rc.fence(name)`` first.

        ``metrics``: the version's metrics (str -> finite number), as ``save(metrics=...)`` takes
        them; one rank giving them is enough (ranks' metrics for one version are merged), and
        ``keep_best`` ranks pushed versions by them."""
        t0 = time.perf_counter()
        self._check_open()
        try:
            policy = OnBusy.parse(on_busy)
        except ValueError as exc:
            raise InvalidSaveError(str(exc)) from None
        clean_metrics = checked_metrics(metrics) or None
        decl = self._checked_push(step, name, rank)
        last = self._last_pushed.get((name, rank), -1)
        # backpressure is judged when this engine starts a version: pushes for one in flight always go
        new_version = step not in self._pusher.commits and step not in self._pusher.pending_versions()
        busy = [v for v in self._pushes_in_flight() if v != step] if new_version else []
        if len(busy) >= self.config.max_in_flight and policy is not OnBusy.QUEUE:
            if policy is OnBusy.SKIP:
                return SaveHandle(self, step, None, time.perf_counter() - t0, skipped=True)
            self._pusher.send_all()  # the versions it waits for must have reached the coordinator
            waits = self._pusher.commits
            refs = [waits[v] for v in busy if v in waits]
            ray.wait(refs, num_returns=max(0, min(len(refs), len(busy) - self.config.max_in_flight + 1)))
            self._pushes_in_flight()
        rank_zero_only = decl.replicated and rank != 0
        ref, nbytes, later = None, 0, None
        if not rank_zero_only:  # replicas: rank 0's copy is stored; this rank's handle follows the version
            if self.config.prefault_object_store:
                start_prefault()  # once per process; this rank's later copies land in mapped pages
            if overlap_with is not None:
                later = self._push_overlapped(name, state, decl.allow_pickle, overlap_with)
                nbytes = later.nbytes
            else:
                flat = capture(state, name, decl.allow_pickle)
                nbytes = flat.nbytes
                if nbytes <= PUT_LATER_UP_TO:  # its bytes copied now, put by the sender (push_batch.py)
                    later = owned_copy(flat)
                else:
                    ref = ray.put(flat)
        pushes = self._pushes[(name, rank)] = self._pushes.get((name, rank), 0) + 1
        # joins this engine's open batch of the version: one coordinator call per batch (push_batch.py)
        slot = self._pusher.add(step, PushedPart(name, rank, ref, nbytes, pushes % self.config.remote_every == 0,
                                                 last, clean_metrics), put=later)
        self._last_pushed[(name, rank)] = step
        handle = SaveHandle(self, step, None, time.perf_counter() - t0, push=slot, rank_zero_only=rank_zero_only)
        self._in_flight.append(handle)
        return handle

    def _checked_push(self, step: Any, name: str, rank: Any) -> Declaration:
        """The declaration of pushed state ``name``, once ``step`` and ``rank`` are valid for it
        (``InvalidSaveError`` otherwise, before anything is captured)."""
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidSaveError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidSaveError(f"rank must be a non-negative integer, got {rank!r}")
        decl = self._declared.get(name)
        if decl is None:
            self._declared = self._call(lambda c: c.declared.remote(), "the declared states")
            decl = self._declared.get(name)
        if decl is None:
            raise InvalidSaveError(f"state {name!r} is not declared for pushing in run {self.run!r}; the "
                                   f"driver registers it with engine.register({name!r}, world_size=N)")
        if rank >= decl.world_size:
            raise InvalidSaveError(f"rank {rank} is out of range for state {name!r} (world_size {decl.world_size})")
        last = self._last_pushed.get((name, rank), -1)
        if step <= last:
            raise InvalidSaveError(f"state {name!r} rank {rank}: step {step} is not after its last submitted "
                                   f"step {last}; steps must increase")
        return decl

    @contextlib.contextmanager
    def push_group(self) -> Iterator["RankPushes"]:
        """``with engine.push_group(): engine.submit(...); engine.submit(...)``: the pushes of the
        block begin their overlapped copies, and reach the coordinator, when the block ends.

        Why: a rank that pushes its model, then its optimizer, would otherwise flatten the optimizer
        while the model's copy (and Ray's copy threads under it) and the coordinator and writers
        that the first push wakes already take the cores, so on a machine with few cores each
        ``submit`` takes several times its own CPU. A fence or a handle's wait inside the block
        does not deadlock: it starts or sends what it needs first."""
        from ..capture.snapshot import process_copier_or_new

        with self._pusher.held(), process_copier_or_new().held():
            yield self

    def _push_overlapped(self, name: str, state: Any, allow_pickle: bool, objects: Iterable[Any]) -> Any:
        """The PendingSnapshot of ``state`` copied in the background (``submit``; the sender puts it)."""
        from ..capture.mailbox import mailbox_name, self_handle_ref
        from ..capture.snapshot import snapshot_overlapped

        objs = tuple(objects)
        if not objs:
            raise InvalidSaveError(f"state {name!r}: overlap_with names no object to fence (the model and "
                                   f"optimizer whose in-place changes must wait for the copy)")
        if not self._mailbox_open:
            open_mailbox(self.run)  # where the background copies announce their refs
            self._mailbox_open = True
        key = tuple(id(o) for o in objs)
        owner = self._fence_owners.get(key)
        if owner is None or any(a is not b for a, b in zip(owner.objects, objs)):  # ids reused by new objects
            owner = self._fence_owners[key] = FencedObjects(objs)
        in_actor = ray.get_runtime_context().get_actor_id() is not None
        pending = snapshot_overlapped(owner, lambda: state, name, allow_pickle, mailbox_name(self.run),
                                      self.config.overlap_check, self.run, self_handle_ref() if in_actor else None,
                                      self.config.prefault_needed)
        return pending

    def _pushes_in_flight(self) -> List[int]:
        """This engine's pushed versions not yet committed or failed (those with parts not sent yet
        included); forgets the others' handles. One ``ray.wait`` over at most ``max_in_flight`` + 1
        refs: O(1) per submit, however many ranks this engine pushes for."""
        waits = self._pusher.commits
        if waits:
            versions = list(waits)
            refs = [waits[v] for v in versions]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if ready:
                ended = {v for v, r in zip(versions, refs) if r in ready}
                for v in ended:
                    waits.pop(v, None)
                self._drop_ended(lambda h: h._push is None or h.version not in ended)
        return sorted(set(waits) | set(self._pusher.pending_versions()))

    def _expect_driver(self) -> None:
        """Tell the coordinator which states this (owning) engine's save() brings: a version that
        its ranks open by pushing first then waits for the driver's save instead of committing
        without it, so ``h = engine.save(step)`` then the ranks' ``submit(step, ...)`` needs no
        wait for the open in between, in whichever order the calls arrive."""
        if self._owner and any(r.world_size is not None for r in self._registry.values()):  # ranks push
            names = [n for n, r in self._registry.items() if r.world_size is None]
            self._call(lambda c: c.expect_driver.remote(names), "the driver-side states")

    def _register_pushed(self, name, provider, strat, world_size, replicated, allow_pickle,
                         append_only=False) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InvalidArgumentError(f"state {name!r}: world_size must be an integer >= 1, got {world_size!r}")
        handles = None
        if provider is not None:
            items = list(provider) if isinstance(provider, (list, tuple)) else None
            if items is None or len(items) != world_size:
                raise InvalidArgumentError(f"state {name!r}: with world_size={world_size}, provider must be "
                                           f"None or a list of {world_size} rank actor handles")
            handles = [rank_provider(name, h) for h in items]
        self._call(lambda c: c.declare.remote(name, strat.value, world_size, bool(replicated), bool(allow_pickle),
                                              append_only), f"declaring {name!r}")
        self._registry[name] = Registration(name, None, strat, bool(allow_pickle), world_size, handles,
                                            bool(replicated))
        self._expect_driver()
        # ranks push from their own processes: submit() starts their prefault

    def declarations(self) -> Dict[str, Declaration]:
        """The states ranks push in this run (``register(name, world_size=N)``), by name: each one's
        world size, strategy and whether it is replicated (rank 0's copy stored)."""
        self._declared = self._call(lambda c: c.declared.remote(), "the declared states")
        return dict(self._declared)


class FencedObjects:
    """What ``submit(..., overlap_with=objects)`` fences: the objects (their optimizers and modules
    are found as a registered provider's are), kept per engine so their copy buffers are reused."""

    def __init__(self, objects: Tuple[Any, ...]):
        self.objects = objects
