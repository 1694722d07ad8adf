"""Peer replicas and node loss: where each committed version's critical files are held besides the
disk of the node that wrote them, and what a lost node costs.

With ``create(..., peer_replicas=N)`` every committed version's critical files (CRITICAL and
RELOADABLE states) are sent, right after the commit, from the writer on the node that wrote them
to the replica holders (``writers/replicas.py``) of N other nodes (another failure domain when
``peer_domain_label`` names a node label), least loaded first. ``wait(durability="replicated")``
answers once every such file is held by N live holders.

The coordinator polls Ray's node table. When a node dies:

* its holder's copies are forgotten, and the newest versions that lost a copy are sent again (from
  the writer's disk if that node lives, else from a surviving holder), so that a second loss is
  survived too; a pass also runs when a node joins, for versions that had nowhere to go;
* a version committed only locally (not uploaded) with a critical file that now exists nowhere (its
  node gone, no live replica, not on this node's disk either) is no longer listed: it is reported in
  ``status()["skipped_versions"]`` with the node that took it, and its number is never reused. So
  is one whose last replica the holders drop (older than the newest ``peer_keep``) after its
  writer's node died.

Without peer replicas the second rule still holds. Lost versions are recorded on this node's local
tier (``storage/lost.py``): a restarted coordinator and ``ray-ckpt ls`` do not list them either.
Holders are detached: a coordinator that Ray restarts adopts them and the copies whose checksums
its manifests name; the manifests say which node wrote each file (``FileEntry.node``), so it judges
a node's loss as before, those that died while no coordinator watched included.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import ray

from ..config import EngineConfig
from ..errors import SaveError, one_line
from ..formats.manifest import FileEntry, Manifest
from ..storage.lost import LostVersion, record_lost
from ..storage.tier import Tier
from ..writers.pools import WriterPools
from ..capture.peer_reads import INDEX_TIMEOUT_S, holder_handles
from ..writers.replicas import start_holder
from .catalogue import Catalogue
from .priority_lock import PriorityLock
from .upload_plan import UploadPlan

log = logging.getLogger("ray_ckpt.coordinator")

NODE_POLL_S = 1.0  # how often the node table is read (a node loss is acted on within about this)
RECONCILE_EVERY = 5  # polls between two checks of what each holder really holds (a restarted one is empty)
HELD_STATES = ("critical", "reloadable")


def held_files(m: Manifest) -> List[FileEntry]:
    """The files a restore cannot do without: every stored CRITICAL or RELOADABLE state's, once each."""
    seen: Dict[str, FileEntry] = {}
    for e in m.states.values():
        if e.status == "stored" and e.strategy in HELD_STATES:
            for f in e.all_files():
                seen.setdefault(f.path, f)
    return list(seen.values())


class Replication:
    def __init__(self, cfg: EngineConfig, local: Tier, pools: WriterPools, catalogue: Catalogue, uploads: UploadPlan,
                 skipped: Dict[int, str], file_nodes: Dict[str, str], node_id: str,
                 in_background: Callable[[Any], Any], set_error: Callable[[str], None]):
        self.cfg, self.local, self.pools, self.catalogue, self.uploads = cfg, local, pools, catalogue, uploads
        self.skipped, self.file_nodes, self.node_id = skipped, file_nodes, node_id
        self._in_background, self._set_error = in_background, set_error
        self.holders: Dict[str, Any] = {}  # node -> its replica holder
        self.copies: Dict[int, Dict[str, Set[str]]] = {}  # version -> file -> nodes whose holder has it
        self.held_bytes: Dict[str, int] = {}  # node -> bytes sent to its holder (placement: least first)
        self.futures: Dict[int, asyncio.Future] = {}  # version -> its "replicated" outcome
        self.alive: Dict[str, Dict[str, str]] = {}  # node -> labels, as last read
        self.dead: Set[str] = set()  # nodes judged lost
        self.judging: Set[str] = set()  # nodes in self.dead whose versions nodes_lost() is still judging
        self.table_dead: Set[str] = set()  # nodes Ray's node table lists dead, as last read
        self.short: Dict[int, str] = {}  # version -> why it has fewer copies than asked (status() shows it)
        # (version, path) -> the nodes whose holders had a copy when they died: a lost version's reason
        self.died_with: Dict[Tuple[int, str], Set[str]] = {}
        self.left: Set[int] = set()  # listed versions whose copies the holders dropped (older than peer_keep)
        self.draining: Set[str] = set()  # nodes Ray drains (evacuation.py): no new copy goes there
        self._task: Optional[asyncio.Future] = None
        self._started = False  # the first node table read is done (unjudged_losses judges nothing before)
        self._table_at, self._table_dead = float("-inf"), set()  # unjudged_losses' own node table read
        # one pass of sends at a time, the most urgent first (priority_lock.py): taking over holders,
        # then a preemption's copies away, then repairs and new versions, newest first
        self._lock = PriorityLock()

    @property
    def enabled(self) -> bool:
        return self.cfg.peer_replicas > 0

    # ------------------------------------------------------------------ after a commit
    def on_commit(self, version: int) -> None:
        self.start()
        if self.enabled:
            self.future(version)
            self._in_background(self._replicate(version))

    def future(self, version: int) -> asyncio.Future:
        if version not in self.futures:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody awaited is not logged
            self.futures[version] = fut
        return self.futures[version]

    async def _replicate(self, version: int) -> None:
        async with self._lock.hold((0, version)):
            if not self.alive:
                await self._read_nodes()
            problems = await self._fill(version)
        self._settle(version, problems)
        dropped = self._prune()
        if dropped and self.dead:  # their last copies may have been the holders' (their writer's node gone)
            await self._judge(dropped, f"versions {dropped} left the peer replicas (peer_keep={self.cfg.peer_keep})")

    def _settle(self, version: int, problems: List[str]) -> None:
        fut = self.future(version)
        if problems:
            self.short[version] = "; ".join(problems)
        else:
            self.short.pop(version, None)
        if fut.done():
            if not problems and not fut.cancelled() and fut.exception() is not None:
                self.futures.pop(version)  # held now (a later repair): a new wait answers at once
                self.future(version).set_result(True)
            return
        if problems:
            fut.set_exception(SaveError(f"step {version} of run {self.cfg.run!r} is not held by "
                                        f"{self.cfg.peer_replicas} peer replica(s): {'; '.join(problems)}"))
        else:
            fut.set_result(True)

    async def _fill(self, version: int) -> List[str]:
        """Send ``version``'s files where copies are missing; returns what could not be done."""
        sends, problems = self._plan(version)
        return await self._carry_out(version, sends, problems)

    async def copy_away(self, version: int, draining: Set[str]) -> List[str]:
        """Give each of ``version``'s held files whose only copies are on ``draining`` nodes one copy
        on a holder of a node that stays (a preemption notice, without a remote tier); returns what
        could not be done."""
        async with self._lock.hold((2, version)):
            if not self.alive:
                await self._read_nodes()
            sends, problems = self._plan(version, away_from=set(draining))
            return await self._carry_out(version, sends, problems)

    async def _carry_out(self, version: int, sends: Dict[Tuple[str, str, str], List[FileEntry]],
                         problems: List[str]) -> List[str]:
        held = self.copies.get(version, {})
        calls = [(key, fs, self._send(version, key, fs)) for key, fs in sends.items()]
        for (how, src, target), fs, ref in calls:
            try:
                await ref
            except Exception as exc:
                problems.append(f"sending {len(fs)} file(s) from node {src[:12]} to node {target[:12]} failed: "
                                f"{one_line(exc)[:300]}")
                continue
            for f in fs:
                held[f.path].add(target)
            self.held_bytes[target] = self.held_bytes.get(target, 0) + sum(f.size for f in fs)
        return problems

    def _plan(self, version: int, away_from: Optional[Set[str]] = None
              ) -> Tuple[Dict[Tuple[str, str, str], List[FileEntry]], List[str]]:
        """The sends that give ``version``'s files their copies ((how, from, to) -> files), and the
        problems. ``away_from`` (drained nodes): instead, one copy outside them of each file whose
        only copies are on them."""
        m = self.catalogue.committed.get(version)
        if m is None:
            return {}, [f"step {version} is no longer listed"]
        held = self.copies.setdefault(version, {})
        sends: Dict[Tuple[str, str, str], List[FileEntry]] = {}
        problems: List[str] = []
        for f in held_files(m):
            have = held.setdefault(f.path, set())
            have.intersection_update(self.alive)
            src = self.file_nodes.get(f.path, self.node_id)
            # a file whose writer's disk is gone lost a copy: one more holder, so that the next loss
            # is survived too
            if away_from is None:
                want = self.cfg.peer_replicas + (0 if src in self.alive else 1) - len(have)
            else:
                want = 1 if src in away_from and not have - away_from else 0
            targets = self._targets(src, have, want)
            if len(targets) < want:
                problems.append(f"{f.path}: no node outside {self._domain_of(src)} that stays to hold a copy "
                                f"({len(self.alive)} node(s) alive, {len(self.draining)} drained)")
            if not targets:
                continue
            how = ("writer", src) if src in self.alive and src in self.pools.critical_by_node else \
                ("holder", sorted(have)[0]) if have else None
            if how is None:
                problems.append(f"{f.path}: no live copy to send (node {src[:12]} is gone)")
                continue
            for t in targets:
                sends.setdefault((how[0], how[1], t), []).append(f)
        return sends, problems

    def _send(self, version: int, key: Tuple[str, str, str], files: List[FileEntry]) -> Any:
        how, src, target = key
        holder = self._holder(target)
        if how == "writer":
            return self.pools.critical_by_node[src][0].replicate.remote(version, files, holder)
        return self.holders[src].copy_to.remote(version, holder)

    def _holder(self, node: str) -> Any:
        if node not in self.holders:
            self.holders[node] = start_holder(self.cfg, node)
        return self.holders[node]

    def _domain_of(self, node: str) -> str:
        label = self.cfg.peer_domain_label
        if label is None:
            return f"node {node[:12]}"
        return f"{label}={self.alive.get(node, {}).get(label)!r}"

    def _targets(self, src: str, have: Set[str], need: int) -> List[str]:
        """Up to ``need`` live nodes for a new copy of a file written on ``src``: not ``src``, not
        a node that has one, not ``src``'s failure domain; least loaded first."""
        if need <= 0:
            return []
        label = self.cfg.peer_domain_label
        domain = self.alive.get(src, {}).get(label) if label else None
        ok = [n for n in self.alive if n != src and n not in have and n not in self.draining
              and (label is None or (self.alive[n].get(label) is not None and self.alive[n].get(label) != domain))]
        return sorted(ok, key=lambda n: (self.held_bytes.get(n, 0), n))[:need]

    def _prune(self) -> List[int]:
        """Forget copies of versions older than the newest ``peer_keep`` (holders dropped them); returns them."""
        dropped = sorted(self.copies)[:-self.cfg.peer_keep]
        for v in dropped:
            self.copies.pop(v, None)
            self.short.pop(v, None)
        self.left = (self.left | set(dropped)) & set(self.catalogue.committed)
        self.died_with = {k: n for k, n in self.died_with.items() if k[0] in self.catalogue.committed}
        for v in sorted(self.futures)[:-32]:
            if self.futures[v].done():
                self.futures.pop(v)
        return dropped

    # ------------------------------------------------------------------ nodes
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def _read_nodes(self) -> Set[str]:
        """Read Ray's node table; returns the nodes that died since the last read."""
        nodes = await asyncio.to_thread(ray.nodes)
        self._started = True
        before = set(self.alive)
        self.alive = {n["NodeID"]: dict(n.get("Labels") or {}) for n in nodes if n.get("Alive")}
        self.table_dead = {n["NodeID"] for n in nodes if not n.get("Alive")} - set(self.alive)
        gone = (before - set(self.alive)) | {n["NodeID"] for n in nodes if not n.get("Alive") and n["NodeID"] in before}
        return gone - self.dead

    async def _adopt(self) -> None:
        """A restarted coordinator: take over the holders its predecessor started (detached, they
        outlived it) and what they hold, file by file where the checksum is the one our manifest
        names; what they hold of versions no longer listed is dropped."""
        async with self._lock.hold((3,)):
            await self._read_nodes()
            found = await asyncio.to_thread(holder_handles, self.cfg.run)
            by_key = {n[:12]: n for n in self.alive}
            found = {by_key[k]: h for k, h in found.items() if k in by_key}
            self._take_over(found, await self._ask(found))
        for v in list(self.copies):
            self._settle(v, [] if self.fully_replicated(v) else ["adopted copies are short"])

    async def _ask(self, found: Dict[str, Any]) -> List[Any]:
        return await asyncio.gather(*[asyncio.wait_for(h.checksums.remote(), INDEX_TIMEOUT_S)
                                      for h in found.values()], return_exceptions=True)

    def _take_over(self, found: Dict[str, Any], answers: List[Any]) -> None:
        adopted = 0
        for (node, handle), held in zip(found.items(), answers):
            if isinstance(held, BaseException):
                continue  # not answering: a new holder is started on that node when one is needed
            self.holders[node] = handle
            stale = [v for v in held if v not in self.catalogue.committed]
            if stale:
                handle.drop.remote(stale)
            for v, sums in held.items():
                m = self.catalogue.committed.get(v)
                if m is None:
                    continue
                for f in held_files(m):
                    if sums.get(f.path) == f.checksum:
                        self.copies.setdefault(v, {}).setdefault(f.path, set()).add(node)
                        self.held_bytes[node] = self.held_bytes.get(node, 0) + f.size
                        adopted += 1
        if adopted:
            log.info("run %r: adopted %d replica(s) held by %d holder(s) from before this coordinator started",
                     self.cfg.run, adopted, len(self.holders))

    async def _begin(self) -> None:
        """A (re)started coordinator: adopt the holders, then judge the nodes that died while no
        coordinator watched, those of them that hold files of this run (their manifests say)."""
        if self.enabled:
            await self._adopt()  # raises when it cannot: the copies are unknown, nothing is judged lost
        else:
            await self._read_nodes()
        if self.died_unwatched():
            await self.nodes_lost(self.died_unwatched())
            if self.enabled:
                await self.repair()

    def died_unwatched(self) -> Set[str]:
        """Nodes Ray's node table lists dead that wrote files of this run and that are not judged yet."""
        return (set(self.file_nodes.values()) & self.table_dead) - self.dead

    async def _watch(self) -> None:
        try:
            await self._begin()
        except Exception as exc:  # nothing adopted: the repair passes send the newest versions again
            log.warning("run %r: adopting the replica holders failed: %s", self.cfg.run, one_line(exc))
        tick = 0
        while True:
            await asyncio.sleep(NODE_POLL_S)
            tick += 1
            try:
                before = set(self.alive)
                gone = await self._read_nodes()
                if gone:
                    await self.nodes_lost(gone)
                emptied = await self._reconcile() if self.enabled and tick % RECONCILE_EVERY == 0 else False
                if self.enabled and (gone or emptied or set(self.alive) - before or self.short):
                    await self.repair()
            except Exception as exc:  # the next poll tries again
                log.warning("run %r: watching nodes failed: %s", self.cfg.run, one_line(exc))

    async def nodes_lost(self, gone: Set[str]) -> None:
        """Judge the versions that depended on ``gone``. Until that is done (the judgement awaits the
        holders' verifications), ``unjudged_losses`` keeps counting those nodes as unjudged, so a
        version being judged is neither listed nor missing from ``skipped_versions``."""
        self.judging |= gone
        try:
            await self._nodes_lost(gone)
        finally:
            self.judging -= gone

    async def _nodes_lost(self, gone: Set[str]) -> None:
        self.dead |= gone
        if self.pools is not None:  # (None: the bookkeeping alone, in a unit test)
            self.pools.forget_nodes(gone)
        for n in gone:
            self.holders.pop(n, None)
            self.held_bytes.pop(n, None)
        for v, held in self.copies.items():
            for path, nodes in held.items():
                if nodes & gone:  # remembered for the reason, should this version be judged lost
                    self.died_with.setdefault((v, path), set()).update(nodes & gone)
                nodes.difference_update(gone)
        names = ", ".join(n[:12] for n in sorted(gone))
        if not await self._judge(sorted(self.catalogue.committed), f"node(s) {names} lost"):
            log.warning("run %r: node(s) %s lost; every listed version still has a good copy of each critical "
                        "file (on a live node's disk, on the remote tier, or in a peer replica that verified just "
                        "now)", self.cfg.run, names)

    async def _judge(self, versions: List[int], cause: str) -> List[int]:
        """Stop listing those of ``versions`` that can no longer be restored (a critical file whose
        node is lost, not uploaded, with no peer replica that verifies), record them lost and report
        them; returns them."""
        lost: Dict[int, LostVersion] = {}
        for v in versions:
            m = self.catalogue.committed.get(v)
            if m is None or v in self.uploads.committed or v in self.catalogue.pending:
                continue
            fates = await self._fates(v, [f for f in held_files(m)
                                          if self.file_nodes.get(f.path, self.node_id) in self.dead])
            if fates:
                first = next(iter(fates))
                node = self.file_nodes.get(first, self.node_id)
                why = (f"lost with node {node[:12]}: {len(fates)} critical file(s) (e.g. {first}) were on its "
                       f"local disk only (not uploaded)")
                why += "".join(f"; {fate}" for fate in sorted(set(fates.values())) if fate)
                lost[v] = LostVersion(why, float(m.created_at))
        await self.unlist(lost, cause)
        return sorted(lost)

    async def unlist(self, lost: Dict[int, LostVersion], cause: str) -> None:
        """Stop listing ``lost`` (version -> why) on the local tier for good: recorded lost
        (``storage/lost.py``), reported in ``status()`` with why, their numbers never reused."""
        if not lost:
            return
        try:  # first, so that a restart right after the report does not list them again (nor ray-ckpt ls)
            await asyncio.to_thread(record_lost, self.local, lost)
        except Exception as exc:
            log.error("run %r: cannot record the lost versions on %s: %s", self.cfg.run, self.local.display,
                      one_line(exc))
        for v, e in lost.items():  # skipped first: the queries' thread never sees it neither listed nor skipped
            self.skipped[v] = e.why
            self.catalogue.forget(v)
            self.catalogue.reserved_through = max(self.catalogue.reserved_through, v)
            self.copies.pop(v, None)
            self.short.pop(v, None)
        msg = f"{cause}: versions {sorted(lost)} can no longer be restored and are no longer listed"
        self._set_error(msg)
        log.error("run %r: %s", self.cfg.run, msg)

    async def _fates(self, version: int, files: List[FileEntry]) -> Dict[str, str]:
        """Of ``files`` (their node is lost), those with no good copy left: path -> what became of
        its peer replicas ("" when replicas are off). A replica is asked to verify its bytes
        against the manifest's checksum first (memory and spill files can be damaged after they
        arrived); one that does not verify is no copy, and is forgotten (the repair pass sends a
        good one where one is left). A holder that does not answer in time is counted as holding:
        its node's loss, if that is why, is judged at the next poll."""
        held = self.copies.get(version, {})
        asks: Dict[str, Dict[str, str]] = {}  # holder node -> path -> checksum
        for f in files:
            for n in held.get(f.path, ()):
                asks.setdefault(n, {})[f.path] = f.checksum
        nodes = [n for n in asks if n in self.holders]
        answers = await asyncio.gather(*[asyncio.wait_for(self.holders[n].verify.remote(asks[n]), INDEX_TIMEOUT_S)
                                         for n in nodes], return_exceptions=True)
        bad: Dict[str, List[str]] = {}  # path -> "node X: why" of its copies that failed verification
        unsure: Set[str] = set()  # paths whose holder did not answer
        for n, answer in zip(nodes, answers):
            if isinstance(answer, BaseException):
                log.warning("run %r: the replica holder on node %s did not answer a verification: %s", self.cfg.run,
                            n[:12], one_line(answer))
                unsure.update(asks[n])
                continue
            for path, why in answer.items():
                if why is not None:
                    held.get(path, set()).discard(n)
                    bad.setdefault(path, []).append(f"node {n[:12]}: {why}")
                    self.short[version] = f"the peer replica of {path} on node {n[:12]} failed verification: {why}"
                    log.error("run %r: step %d: the peer replica of %s on node %s failed verification: %s",
                              self.cfg.run, version, path, n[:12], why)
        out: Dict[str, str] = {}
        for f in files:
            if held.get(f.path) or f.path in unsure or await asyncio.to_thread(self.local.exists, f.path):
                continue  # a verified replica, or a local_dir shared by the nodes (a network disk): still there
            if f.path in bad:
                out[f.path] = f"its peer replica failed verification ({'; '.join(bad[f.path])})"
            elif self.died_with.get((version, f.path)):
                names = ", ".join(sorted(n[:12] for n in self.died_with[(version, f.path)]))
                out[f.path] = f"the node(s) holding its peer replica ({names}) were lost too"
            elif version in self.left:
                out[f.path] = f"the replica holders dropped it (they keep the newest peer_keep={self.cfg.peer_keep})"
            else:
                out[f.path] = "no peer replica held it" if self.enabled else ""
        return out

    async def _reconcile(self) -> bool:
        """Ask every holder what it holds and forget the copies it lost (Ray restarted its process:
        it came back empty). True when one was forgotten (a repair pass sends them again)."""
        holders = dict(self.holders)
        answers = await asyncio.gather(*[h.index.remote() for h in holders.values()], return_exceptions=True)
        lost = False
        for node, index in zip(holders, answers):
            if isinstance(index, BaseException):
                continue  # a dead node's holder: the node table says so
            for v, held in self.copies.items():
                have = set(index.get(v, ()))
                for path, nodes in held.items():
                    if node in nodes and path not in have:
                        nodes.discard(node)
                        lost = True
        if lost:
            log.warning("run %r: a replica holder lost what it held (restarted); sending it again", self.cfg.run)
        return lost

    async def repair(self) -> None:
        """Send again what the newest ``peer_keep`` committed versions lack (a node lost or joined)."""
        async with self._lock.hold((1, max(self.catalogue.committed, default=0))):
            for v in sorted(self.catalogue.committed)[-self.cfg.peer_keep:]:
                problems = await self._fill(v)
                self._settle(v, problems)
                if not problems:
                    log.info("run %r: version %d is held by %d peer replica(s) again", self.cfg.run, v,
                             self.cfg.peer_replicas)

    # ------------------------------------------------------------------ listing (the queries' thread)
    def unjudged_losses(self) -> Dict[int, str]:
        """Versions that a node table read at most ``NODE_POLL_S`` ago says depend on a node that
        died and that the watch loop has not judged yet (its poll, or a repair pass it waits for,
        comes later): version -> why. ``list()`` leaves them out and ``status()`` names them, so
        a version whose only copy was on a dead node is never listed as if it were on the local
        tier. Called on the queries' thread: it reads the node table itself, never awaits the
        main loop. (A ``local_dir`` shared by the nodes keeps such a version: it is listed again
        once judged.)"""
        if not self.file_nodes or not self._started:
            return {}
        now = time.monotonic()
        if now - self._table_at >= NODE_POLL_S:
            try:
                nodes = ray.nodes()
            except Exception as exc:  # the GCS busy: the last read stands (a dead node never comes back)
                log.debug("run %r: cannot read the node table: %s", self.cfg.run, one_line(exc))
            else:
                alive = {n["NodeID"] for n in nodes if n.get("Alive")}
                self._table_dead, self._table_at = {n["NodeID"] for n in nodes if not n.get("Alive")} - alive, now
        # nodes that wrote files, dead and not judged yet (or being judged: nodes_lost() awaits meanwhile)
        fresh = ((self._table_dead - self.dead) | set(self.judging)) & set(list(self.file_nodes.values()))
        if not fresh:
            return {}
        out: Dict[int, str] = {}
        copies = dict(self.copies)
        for v, m in list(self.catalogue.committed.items()):
            if v in self.uploads.committed or v in self.catalogue.pending:
                continue
            for f in held_files(m):
                node = self.file_nodes.get(f.path, self.node_id)
                if node in fresh and not set(copies.get(v, {}).get(f.path, ())) - fresh - self.dead:
                    out[v] = (f"node {node[:12]} died and held {f.path} on its local disk (not uploaded, no peer "
                              f"replica on a live node): being judged")
                    break
        return out

    # ------------------------------------------------------------------ status
    def replicas(self) -> Dict[int, Tuple[str, ...]]:
        """version -> the nodes (first 12 characters) whose holders have its files."""
        return {v: tuple(sorted({n[:12] for nodes in held.values() for n in nodes}))
                for v, held in sorted(self.copies.items())}

    def fully_replicated(self, version: int) -> bool:
        held = self.copies.get(version)
        m = self.catalogue.committed.get(version)
        if not held or m is None:
            return False
        return all(len(held.get(f.path, ())) >= self.cfg.peer_replicas for f in held_files(m))

    def rewound(self, versions: List[int]) -> None:
        """Versions deleted by a rewind: their holders drop them (their numbers will be reused)."""
        for v in versions:
            self.copies.pop(v, None)
            self.futures.pop(v, None)
        for h in self.holders.values():
            h.drop.remote(list(versions))
