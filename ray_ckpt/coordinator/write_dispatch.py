"""Parts to writers: which writer writes each snapshot, and in which call (the coordinator's step 2-3).

Parts that arrive together (thousands of ranks' pushes) go to writers in batches: one writer call
and one durable sync per batch instead of per part (a Ray call per part would be the
coordinator's largest cost). A version's parts arriving within ``BATCH_WINDOW_S`` are gathered,
and, while every critical writer still has a call queued, for longer (up to ``MAX_HOLD_S``): a
call sent then would only queue behind the others, and meanwhile the batch grows, so the number of
writer calls adapts to how fast the writers go. The batch is
grouped by the node that holds each snapshot (critical parts: node affinity, a shared-memory read;
best-effort ones: their own pool, anywhere), and spread over that pool's writers in calls of at most
``BATCH_PARTS`` parts (``WriterActor.write_parts``). A RELOADABLE part goes alone
(``WriterActor.write_part``): the writer first looks its content up among stored ones; so does an
append-only part, which the writer writes over the newest committed version's segments.

The coordinator holds one :class:`WriteDispatch`; what a writer answers (a WrittenPart or the error
that stopped a part) goes back through ``record``, and each call that ends moves its version on
through ``progress`` (commit, fail, finish: the coordinator's business, not this module's).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from .catalogue import Catalogue
from ..types import Strategy
from ..writers.pools import WriterPools

BATCH_WINDOW_S = 0.005  # a part waits at most this long for others of its version to join its batch
BATCH_PARTS = 256       # parts per writer call at most (spread over the pool's writers)
MAX_HOLD_S = 1.0        # a batch waits at most this long for a critical writer to be free

Item = Tuple[Any, Any, int]  # (catalogue Part, snapshot ref, bytes)


class WriteDispatch:
    """Sends each part's snapshot ref (inside a list: never resolved in the coordinator) to a writer."""

    def __init__(self, pools: WriterPools, catalogue: Catalogue, compression: Optional[str],
                 record: Callable[[int, str, int, Any], None], progress: Callable[[int], Awaitable[None]],
                 in_background: Callable[[Any], Any]):
        self.pools, self.catalogue, self.compression = pools, catalogue, compression
        self._record, self._progress, self._in_background = record, progress, in_background
        self._outbox: Dict[int, List[Item]] = {}  # version -> parts gathered for its next batch
        self.counts: Dict[str, int] = {"written_parts": 0, "write_calls": 0}
        self._call_ended: Optional[asyncio.Event] = None  # set when a writer call ends (see _hold)

    def dispatch(self, version: int, name: str, rank: int, ref: Any, size: int) -> None:
        """Send one part to a writer: gathered with the version's other parts arriving within
        ``BATCH_WINDOW_S`` (a RELOADABLE part alone)."""
        part = self.catalogue.pending[version].parts[(name, rank)]
        part.submitted = True
        if part.strategy is Strategy.RELOADABLE or part.append_only:
            self._in_background(self._write_one(version, part, ref, size))
            return
        box = self._outbox.setdefault(version, [])
        box.append((part, ref, size))
        if len(box) == 1:  # the first part of a batch starts its flush
            self._in_background(self._write_batch(version))

    async def _write_batch(self, version: int) -> None:
        """Send the parts gathered for ``version``: best-effort ones to the best-effort pool,
        critical ones to the critical pool of the node that holds each snapshot, each group
        spread over its pool's writers in calls of at most ``BATCH_PARTS`` parts."""
        await asyncio.sleep(BATCH_WINDOW_S)
        await self._hold()
        items = self._outbox.pop(version, [])
        if not items:
            return
        anywhere = [it for it in items if it[0].strategy is Strategy.BEST_EFFORT and self.pools.best_effort]
        placed = [it for it in items if not (it[0].strategy is Strategy.BEST_EFFORT and self.pools.best_effort)]
        groups = [(self.pools.best_effort, anywhere)] if anywhere else []
        if placed:
            try:
                by_node: Dict[Optional[str], List[Item]] = {}
                for it, node in zip(placed, await self.pools.locate_many([ref for _, ref, _ in placed])):
                    by_node.setdefault(node, []).append(it)
                groups += [(pool, its) for pool, its in
                           [(await self.pools.critical_placed(node), its) for node, its in by_node.items()]]
            except Exception as exc:  # no writer for them: their parts fail (the handles say why), never hang
                for p, _, _ in placed:
                    self._record(version, p.name, p.rank, exc)
                await self._progress(version)
        # each writer call moves the version on when it ends: a critical one never waits for a best-effort one
        await asyncio.gather(*[self._write_call(version, writer, call_items)
                               for pool, its in groups for writer, call_items in self.pools.spread(pool, its, BATCH_PARTS)])

    async def _hold(self) -> None:
        """Wait, at most ``MAX_HOLD_S``, while every critical writer has a call queued."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAX_HOLD_S
        writers = self.pools.critical
        while writers and all(self.pools.queued_parts.get(id(w), 0) > 0 for w in writers):
            left = deadline - loop.time()
            if left <= 0:
                return
            if self._call_ended is None:
                self._call_ended = asyncio.Event()
            try:
                await asyncio.wait_for(self._call_ended.wait(), left)
            except asyncio.TimeoutError:
                return

    def _ended(self) -> None:
        if self._call_ended is not None:
            self._call_ended.set()
            self._call_ended = None

    async def _write_call(self, version: int, writer: Any, call_items: List[Item]) -> None:
        size = sum(s for _, _, s in call_items)
        self.pools.add_queued(writer, size, len(call_items))
        self.counts["write_calls"] += 1
        self.counts["written_parts"] += len(call_items)
        try:
            try:
                results = await writer.write_parts.remote(version, [(p.name, p.rank) for p, _, _ in call_items],
                                                          [ref for _, ref, _ in call_items], compression=self.compression)
            except Exception as exc:  # the writer died or the call failed: every part of the call failed
                results = [exc] * len(call_items)
            for (p, _, _), result in zip(call_items, results):
                self._record(version, p.name, p.rank, result)
        finally:
            self.pools.add_queued(writer, -size, -len(call_items))
            self._ended()
        await self._progress(version)

    async def _write_one(self, version: int, part: Any, ref: Any, size: int) -> None:
        if part.strategy is Strategy.BEST_EFFORT and self.pools.best_effort:
            pool = self.pools.best_effort  # may run anywhere: reads the snapshot over the network if needed
        else:
            try:
                pool = await self.pools.critical_placed(await self.pools.locate(ref))  # node affinity: shared memory
            except Exception as exc:  # no writer for it: the part fails (its handle says why), never hangs
                self._record(version, part.name, part.rank, exc)
                await self._progress(version)
                return
        writer = self.pools.least_busy(pool)
        self.pools.add_queued(writer, size)
        reuse = self.catalogue.reuse_for(part) if part.strategy is Strategy.RELOADABLE else None
        base = self.catalogue.append_base_for(part) if part.append_only else None
        try:
            try:
                result = await writer.write_part.remote(version, part.name, part.rank, [ref], reuse=reuse,
                                                        compression=self.compression, append_base=base)
            except Exception as exc:
                result = exc
            self._record(version, part.name, part.rank, result)
        finally:
            self.pools.add_queued(writer, -size)
        await self._progress(version)
