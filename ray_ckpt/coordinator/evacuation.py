"""Preemption notices: when Ray drains a node that holds part of the run, copy what only that node
holds elsewhere before its deadline.

Clouds warn before they take a spot node (30 s to 2 min); Ray passes the warning on by draining the
node with a deadline (the autoscaler's preemption drain, or ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``). The coordinator reads Ray's draining
nodes every ``DRAIN_POLL_S`` (``ray_internals.draining_nodes``) and, for a drained node that holds
anything of the run (files of committed versions on its local tier, a replica holder, writers):

* **evacuates**: every committed version with a critical or reloadable file whose only copies are on
  draining nodes (not uploaded, no replica on a node that stays) is copied away, newest first, one
  at a time so that the newest make it when time runs short: to the remote tier whatever
  ``remote_every`` says, else to a replica holder on a node that stays. Versions that commit during
  the notice (the trainer's saves) are taken as they come, newest first again. The run's newest
  version, if its upload has not landed within ``HEDGE_AFTER_S``, also gets a replica on a node
  that stays, and is safe when either lands (the upload goes on): a remote store slower than the
  notice (a saturated link, a slow S3 endpoint, a state of many GB) then still keeps the newest
  step, which is what a restore takes and what the trainer's next save waits for. Only the newest:
  the holders keep the newest ``peer_keep`` versions in memory;
* **reports** it: ``engine.preemption()`` / ``status()["preemption"]`` hold the notice (nodes,
  deadline, the states and ranks whose newest parts were written there, what was moved, what is
  moving, what could not be moved and why); the metrics count moved and lost versions;
* lets the trainer **keep saving**: ``engine.save_if_preempted(step)`` (client side) saves when a
  notice is active and ``on_preemption="save"``, and again each time its newest save is no longer
  at risk (``PreemptionNotice.at_risk``, from :meth:`Evacuation.notice`).

What the deadline leaves unmoved is reported lost; once the node is gone the node watch of
``replication.py`` stops listing such versions (their files are on its disk only), as for any node
lost without notice. A drain Ray ends while the node stays (cancelled) ends the notice and changes
nothing. The writers on a draining node keep serving until it goes: they are the only processes
that can read its disk, so the evacuation uploads through them; replicas are never placed on a
draining node (``Replication.draining``).

An idle-termination drain is accepted by Ray only for a node that runs nothing, so a node that runs
a learner or a writer of the run is drained this way only for a preemption (or by an operator):
every notice is treated alike, and the last save is the trainer's call.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from ..errors import one_line
from ..formats.manifest import Manifest
from ..metrics import Metrics
from ..ray_internals import draining_nodes
from ..types import OnPreemption, PreemptionNotice
from .catalogue import Catalogue
from .replication import Replication, held_files
from .upload_plan import UploadPlan
from .uploader import Uploader
from ..writers.pools import URGENT_UPLOADS

log = logging.getLogger("ray_ckpt.coordinator")

DRAIN_POLL_S = 1.0  # how often Ray's draining nodes are read (a notice is acted on within about this)
RETRY_S = 1.0  # a version whose move failed is tried again after this, while the deadline allows
HEDGE_AFTER_S = 2.0  # an upload of the newest version not landed by then: a replica on a node that stays too
MOVES_IN_FLIGHT = URGENT_UPLOADS  # moves at once: a newer version never waits behind a stalled move (nor, on a
# writer, behind another move's upload: each writer has as many urgent upload slots)


def at_risk(committed: Mapping[int, Manifest], file_nodes: Mapping[str, str], default_node: str,
            draining: Set[str], uploaded: Set[int], replicas: Mapping[int, Mapping[str, Set[str]]],
            alive: Optional[Set[str]] = None) -> List[int]:
    """The committed versions, newest first, that a loss of the ``draining`` nodes would cost: a
    critical or reloadable file of theirs was written on a draining node (``file_nodes``; a file
    without a node is on ``default_node``'s disk) and has no copy that stays (not ``uploaded``, no
    replica on a live node outside ``draining``)."""
    out = []
    for v in sorted(committed, reverse=True):
        if v in uploaded:
            continue
        held = replicas.get(v, {})
        for f in held_files(committed[v]):
            if file_nodes.get(f.path, default_node) not in draining:
                continue
            elsewhere = set(held.get(f.path, ())) - draining
            if alive is not None:
                elsewhere &= alive
            if not elsewhere:
                out.append(v)
                break
    return out


def affected(manifest: Optional[Manifest], file_nodes: Mapping[str, str], default_node: str,
             draining: Set[str]) -> Tuple[Tuple[str, ...], Dict[str, Tuple[int, ...]]]:
    """The states (and their ranks) of ``manifest`` whose parts were written on a ``draining`` node:
    the learners that stand to go with it."""
    ranks: Dict[str, Set[int]] = {}
    for name, entry in (manifest.states.items() if manifest is not None else ()):
        for rank, files in entry.files.items():
            if any(file_nodes.get(f.path, f.node or default_node) in draining for f in files):
                ranks.setdefault(name, set()).add(int(rank))
    return tuple(sorted(ranks)), {n: tuple(sorted(r)) for n, r in sorted(ranks.items())}


class Evacuation:
    """The coordinator's watch of Ray's draining nodes, and the copies it makes before a deadline."""

    def __init__(self, policy: OnPreemption, catalogue: Catalogue, uploads: UploadPlan, uploader: Optional[Uploader],
                 replication: Replication, file_nodes: Dict[str, str], node_id: str, pools: Any, metrics: Metrics,
                 in_background: Callable[[Any], Any], set_error: Callable[[str], None]):
        self.policy, self.catalogue, self.uploads, self.uploader = policy, catalogue, uploads, uploader
        self.replication, self.file_nodes, self.node_id, self.pools = replication, file_nodes, node_id, pools
        self.metrics, self._in_background, self._set_error = metrics, in_background, set_error
        self.draining: Dict[str, float] = {}  # node -> deadline (unix time), nodes that hold part of the run
        # nodes whose processes asked for the run's notice (engine.preemption(): a trainer that may save
        # there): part of the run before its first save places a writer or a file there
        self.asking: Set[str] = set()
        self.noticed_at: Optional[float] = None  # when the current notice began
        self.moved: Set[int] = set()
        self.moving: Set[int] = set()
        self.hedged: Set[int] = set()  # moved as a replica while their upload still ran (HEDGE_AFTER_S)
        self.lost: Dict[int, str] = {}
        self.failed: Dict[int, Tuple[float, str]] = {}  # version -> (when, why) its last move failed
        self.last: Optional[PreemptionNotice] = None  # the newest notice, kept for status() once it ended
        self.poll_error: Optional[str] = None
        self._mover: Optional[asyncio.Future] = None
        self._task: Optional[asyncio.Future] = None

    # ------------------------------------------------------------------ the watch
    def start(self) -> None:
        if self._task is None and self.policy != OnPreemption.IGNORE:
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.poll(await asyncio.to_thread(draining_nodes))
                self.poll_error = None
            except Exception as exc:  # the next poll tries again; status() says why meanwhile
                if self.poll_error is None:
                    log.warning("reading Ray's draining nodes failed: %s", one_line(exc))
                self.poll_error = f"reading Ray's draining nodes failed: {one_line(exc)}"
            await asyncio.sleep(DRAIN_POLL_S)

    def holds(self, node: str) -> bool:
        """Whether ``node`` holds anything of the run: files on its local tier, writers, a replica holder,
        or a process that asks for the run's notices (a trainer whose last save would be lost with it:
        before its first save, nothing else of the run is there)."""
        return (node in self.pools.critical_by_node or node in self.replication.holders
                or node in set(self.file_nodes.values()) or node in self.asking)

    def asked_from(self, node: Optional[str]) -> None:
        """A process on ``node`` asked for the notice (``engine.preemption()``): the next poll
        counts the node as the run's."""
        if node:
            self.asking.add(node)

    async def poll(self, found: Mapping[str, float]) -> None:
        """One reading of Ray's draining nodes (node -> deadline): begin, extend or end the notice,
        and keep the mover going while something is at risk."""
        ours = {n: d for n, d in found.items() if self.holds(n)}
        ended = set(self.draining) - set(ours)
        if ended:
            gone = self._gone(ended)
            stayed = sorted(n[:12] for n in ended - gone)
            if stayed:
                log.warning("the drain of node(s) %s ended before its deadline and the node(s) stay (cancelled); "
                            "the notice ends", ", ".join(stayed))
            if gone:
                self._node_went(gone)
                self.asking -= gone
        new = set(ours) - set(self.draining)
        if new:
            left = min(ours[n] for n in new) - time.time()
            log.warning("preemption notice: node(s) %s drained (%s); copying what only they hold elsewhere",
                        ", ".join(n[:12] for n in sorted(new)), "no deadline" if left == float("inf") else
                        f"{left:.0f}s left")
            if not self.draining:
                self.noticed_at, self.moved, self.lost, self.failed = time.time(), set(), {}, {}
                self.hedged = set()
        self.draining = dict(ours)
        self.replication.draining = set(found)  # any drained node, ours or not, takes no new copy
        self.pools.draining = set(found)  # nor a new writer pool (Ray would refuse its actors)
        if new or ended:
            self.metrics.preemption(min(ours.values()) if ours else None)
        if self.draining:
            if self._mover is None or self._mover.done():
                if self.pending():
                    self._mover = self._in_background(self._move_all())
                else:
                    self._lose_the_rest()
            self.last = self.notice()
        elif ended:
            self.last = self.notice(ended=True)

    def _gone(self, ended: Set[str]) -> Set[str]:
        """Of the nodes whose drain just ended, those that go: judged dead, no longer in Ray's node
        table, or ended at their deadline (Ray removes a preempted node then; its node table shows
        it dead only a moment later). The others were drained and stay (a cancelled drain)."""
        now = time.time()
        alive = set(self.replication.alive)
        return {n for n in ended if n in self.replication.dead or n not in alive
                or self.draining.get(n, float("inf")) <= now + DRAIN_POLL_S}

    def _node_went(self, nodes: Set[str]) -> None:
        """The drained ``nodes`` are gone: every version that only they held and that no move
        copied away is lost, with why (a move still running when they went, or none begun)."""
        for v in at_risk(self.catalogue.committed, self.file_nodes, self.node_id, nodes,
                         set(self.uploads.committed), self.replication.copies):
            if v in self.moved or v in self.lost:
                continue
            why = ("its node went with its copy still in progress" if v in self.moving else
                   self.failed.get(v, (0.0, "its node went before its turn to be copied"))[1])
            self._lose(v, why)

    def pending(self) -> List[int]:
        """The versions still at risk that no move has taken up yet, newest first. A version
        uploaded once is not uploaded again (remote retention may delete its copy as soon as it
        lands); one whose replica went to a node drained since is copied again; one whose move
        failed is tried again ``RETRY_S`` later, while the deadline allows."""
        now = time.time()
        again = self.uploader is None  # replicas: at risk again only if their holder's node is drained now
        return [v for v in self.risky() if v not in self.moving and v not in self.lost and not self.overdue(v)
                and (again or v not in self.moved) and now - self.failed.get(v, (float("-inf"), ""))[0] >= RETRY_S]

    def risky(self) -> List[int]:
        return at_risk(self.catalogue.committed, self.file_nodes, self.node_id, set(self.draining),
                       set(self.uploads.committed), self.replication.copies, set(self.replication.alive) or None)

    def deadline_of(self, version: int) -> float:
        """When ``version`` is lost if not moved: the first moment one of its at-risk files has no
        copy left (each file's copies go with the last of their drained nodes)."""
        m = self.catalogue.committed.get(version)
        held = self.replication.copies.get(version, {})
        out = float("inf")
        for f in held_files(m) if m is not None else ():
            src = self.file_nodes.get(f.path, self.node_id)
            if src in self.draining:
                nodes = ({src} | set(held.get(f.path, ()))) & set(self.draining)
                out = min(out, max(self.draining[n] for n in nodes))
        return out

    def overdue(self, version: int) -> bool:
        return self.deadline_of(version) <= time.time()

    # ------------------------------------------------------------------ moving
    async def _move_all(self) -> None:
        """Move at-risk versions one at a time, newest first, until none is left or the deadline
        passes (what is left then is reported lost). A version newer than every move in flight (one
        committed during the notice) does not wait behind them: it starts at once, beside them (up
        to ``MOVES_IN_FLIGHT``), so that a move that stalls (an upload stuck until the deadline)
        never holds back a newer version. The list is read again every ``DRAIN_POLL_S``."""
        running: Dict[asyncio.Task, int] = {}
        try:
            while self.draining or running:  # a move in flight ends (by its deadline) even if the drain did
                self._lose_the_rest()
                for v in self.pending() if self.draining else ():
                    if len(running) >= MOVES_IN_FLIGHT or (running and v < max(running.values())):
                        break
                    self.moving.add(v)
                    running[asyncio.ensure_future(self._move(v, self.deadline_of(v) - time.time()))] = v
                if not running:
                    return
                done, _ = await asyncio.wait(set(running), timeout=DRAIN_POLL_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    v = running.pop(task)
                    self.moving.discard(v)
                    self._moved_or_not(v, task.result())
        finally:
            for task, v in running.items():
                task.cancel()
                self.moving.discard(v)

    def _moved_or_not(self, v: int, why_not: Optional[str]) -> None:
        if why_not is None:
            self.lost.pop(v, None)  # reported lost when its node went, copied as it went: kept
            self.moved.add(v)
            self.failed.pop(v, None)
            self.metrics.evacuated("moved")
            log.warning("preemption: step %d copied away from node(s) %s%s", v,
                        ", ".join(n[:12] for n in sorted(self.draining)),
                        " (a replica on a node that stays; its upload goes on)" if v in self.hedged else "")
        elif v in self.lost:  # its node went meanwhile (reported then): nothing is left to try
            self.lost[v] = why_not
        elif self.overdue(v):
            self._lose(v, why_not)
        else:  # e.g. a target node drained meanwhile: tried again, elsewhere, while time is left
            self.failed[v] = (time.time(), why_not)
            log.warning("preemption: copying step %d away failed, trying again: %s", v, why_not)

    def _lose_the_rest(self) -> None:
        """Every version still at risk, not moving, whose deadline passed is lost, with why."""
        for v in self.risky():
            if v not in self.moving and v not in self.lost and self.overdue(v):
                self.moved.discard(v)  # a replica it had went with a node drained after it was sent
                self._lose(v, self.failed.get(v, (0.0, "the deadline passed before its turn to be copied"))[1])

    def _lose(self, version: int, why: str) -> None:
        if version not in self.lost:
            self.metrics.evacuated("lost")
        self.lost[version] = why
        msg = f"preemption: step {version} could not be copied away before the deadline: {why}"
        self._set_error(msg)
        log.error(msg)

    async def _move(self, version: int, left: float) -> Optional[str]:
        """Copy ``version`` away within ``left`` seconds; None when done, else why not. With a remote
        tier: its upload; if that has not landed within ``HEDGE_AFTER_S`` and the version is the
        run's newest, a replica on a node that stays too, whichever lands first (the module says
        why)."""
        if self.uploader is None:
            return await self._replicate(version, left)
        task = self.uploader.upload_now(version)
        end = time.monotonic() + left
        done, _ = await asyncio.wait({task}, timeout=min(left, HEDGE_AFTER_S))
        if not done and version == max(self.catalogue.committed, default=None):
            why_not = await self._hedge(version, task, end)
            if why_not is None:
                return None
        if not task.done():
            await asyncio.wait({task}, timeout=max(0.0, end - time.monotonic()))
        if version in self.uploads.committed:
            return None
        if not task.done():  # it goes on: if it ends before the node goes, the version is kept after all
            task.add_done_callback(lambda _t, v=version: self._late(v))
            got, total = self.uploader.progress(version) or (0, 0)
            err = self.uploads.errors.get(version)
            return (f"the deadline passed with its upload at {got} of {total} bytes"
                    + (f" (last error: {err})" if err else ""))
        return self.uploads.errors.get(version) or "its upload ended without a remote copy"

    async def _hedge(self, version: int, upload: asyncio.Future, end: float) -> Optional[str]:
        """A replica of ``version`` on a node that stays, sent beside its upload: None as soon as
        either has landed (the upload goes on), else why the replica was not sent (the upload is
        then all that is left)."""
        log.warning("preemption: step %d not on the remote tier %.0fs after its upload began: sending a replica "
                    "to a node that stays as well", version, HEDGE_AFTER_S)
        replica = asyncio.ensure_future(self._replicate(version, max(0.0, end - time.monotonic())))
        pending, why_not = {upload, replica}, "the deadline passed before its replica was sent"
        while pending and time.monotonic() < end:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, end - time.monotonic()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if version in self.uploads.committed:
                break
            if replica in done:
                why_not = replica.result()
                if why_not is None:
                    self.hedged.add(version)
                    return None
            if not done:
                break
        if not replica.done():
            replica.cancel()
        return None if version in self.uploads.committed else why_not

    async def _replicate(self, version: int, left: float) -> Optional[str]:
        try:
            problems = await asyncio.wait_for(self.replication.copy_away(version, set(self.draining)), left)
        except asyncio.TimeoutError:
            return "the deadline passed before its replica was sent"
        return "; ".join(problems) if problems else None

    def _late(self, version: int) -> None:
        if version in self.uploads.committed and version in self.lost:
            self.lost.pop(version)
            self.moved.add(version)
            log.warning("preemption: step %d reached the remote tier after all", version)

    # ------------------------------------------------------------------ what users read
    def notice(self, ended: bool = False) -> Optional[PreemptionNotice]:
        nodes = set(self.draining) if not ended else {n for n in (self.last.nodes if self.last else ())}
        if not nodes:
            return None
        newest = self.catalogue.committed.get(max(self.catalogue.committed)) if self.catalogue.committed else None
        states, ranks = affected(newest, self.file_nodes, self.node_id, nodes)
        since = self.noticed_at or time.time()
        saved = [m.step for m in list(self.catalogue.committed.values()) if float(m.created_at) >= since]
        deadline = min(self.draining.values()) if self.draining else (self.last.deadline if self.last else 0.0)
        # a version reported lost whose upload (the evacuation's, or the run's own remote_every one)
        # landed after all is on the remote tier: kept, not lost
        uploaded = set(self.uploads.committed)
        lost = {v: why for v, why in sorted(self.lost.items()) if v not in uploaded}
        moved = self.moved | (set(self.lost) & uploaded)
        risky = [v for v in self.risky() if v not in lost] if self.draining and not ended else []
        return PreemptionNotice(nodes=tuple(sorted(nodes)), deadline=deadline, noticed_at=since, states=states,
                                ranks=ranks, moved=tuple(sorted(moved)), moving=tuple(sorted(self.moving)),
                                lost=lost, saved_step=max(saved, default=None), at_risk=tuple(sorted(risky)))

    def active(self) -> Optional[PreemptionNotice]:
        """The notice in force (None when no node of the run is being drained). Asked from the
        queries' thread while the main loop may commit a version."""
        return self._read(lambda: self.notice() if self.draining else None)

    def _read(self, notice: Callable[[], Optional[PreemptionNotice]]) -> Optional[PreemptionNotice]:
        """``notice()`` from the queries' thread: read again if the main loop changed a dict meanwhile
        (a commit, an upload landing)."""
        for attempt in range(5):
            try:
                return notice()
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == 4:
                    raise
                time.sleep(0.01)
        return None

    def status(self) -> Optional[Dict[str, Any]]:
        """``status()["preemption"]``: the notice in force, else the last one (marked ended)."""
        n = self.active()
        if n is not None:
            return {**n.to_dict(), "active": True}
        if self.last is not None:  # read again: a late upload turns a version reported lost into kept
            return {**(self._read(lambda: self.notice(ended=True)) or self.last).to_dict(), "active": False}
        return {"error": self.poll_error} if self.poll_error else None
