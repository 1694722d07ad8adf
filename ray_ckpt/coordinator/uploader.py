"""Committed versions to the remote tier (the coordinator's step 6): carrying out the UploadPlan.

:class:`~ray_ckpt.coordinator.upload_plan.UploadPlan` decides (whose turn, which files are owed, when to stop
or give up); this module does it with the writers: each file is uploaded by a writer on the node
whose local tier holds it, in calls of at most ``UPLOAD_FILES_PER_CALL`` files so that
``progress()`` moves; the remote manifest is written last (the remote commit marker), after a
fence check (a run taken over by another job is not written to). Transient errors retry with
backoff up to 30 s apart; a bad local copy (IntegrityError) gives the version up: what the attempts
left on the remote tier is removed and its remote handle fails. Uploads found owed at a restart
resume (``resume()``, from the coordinator's first async call).

The coordinator holds one :class:`Uploader`; ``futures[v]`` is what ``wait(v, "remote")`` awaits.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple

from .catalogue import Catalogue
from ..storage.checkpoint_io import delete_version, write_manifest
from ..errors import IntegrityError, SaveError, one_line
from ..metrics import Metrics
from ..protocol import SaveOutcome
from ..storage.tier import Tier
from ..types import step_label
from .upload_plan import UploadPlan
from ..writers.pools import URGENT_UPLOADS, WriterPools

log = logging.getLogger("ray_ckpt.coordinator")
UPLOAD_FILES_PER_CALL = 16  # files per writer upload call: the grain of progress()
PROGRESS_VERSIONS = 64      # upload progress is kept for the waits of this many recent versions
SLOW_COMMIT_S = 2.0         # a remote commit slower than this after its last byte is logged, with where the time went


async def timed_thread(fn: Callable[..., Any], *args: Any,
                       executor: Optional[concurrent.futures.Executor] = None) -> Tuple[Any, Tuple[float, float]]:
    """``fn(*args)`` on a thread (``executor``'s; None: the loop's default pool), and (seconds it
    waited for a thread, seconds it ran)."""
    called, started = time.perf_counter(), []

    def run() -> Any:
        started.append(time.perf_counter())
        return fn(*args)

    out = await asyncio.get_running_loop().run_in_executor(executor, contextvars.copy_context().run, run)
    return out, (started[0] - called, time.perf_counter() - started[0])


async def _awaited(ref: Any) -> Any:
    return await ref


def _seen(task: "asyncio.Future") -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a routine call overtaken by an urgent one may fail unheeded


def root_cause(exc: BaseException) -> BaseException:
    """A provider's or writer's error comes wrapped once per Ray task it crossed."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


class Uploader:
    """Uploads committed versions when the plan says so, and tells their remote handles."""

    def __init__(self, run: str, remote: Optional[Tier], plan: UploadPlan, catalogue: Catalogue,
                 pools: WriterPools, file_nodes: Dict[str, str], metrics: Metrics,
                 fence: Callable[[Tier], Optional[str]], outcome: Callable[..., SaveOutcome],
                 accepted_at: Dict[int, float], in_background: Callable[[Any], Any],
                 retention: Callable[[], Awaitable[None]], on_error: Callable[[str], None]):
        self.run, self.remote, self.plan, self.catalogue, self.pools = run, remote, plan, catalogue, pools
        self.file_nodes, self.metrics, self._fence, self._outcome = file_nodes, metrics, fence, outcome
        self.accepted_at, self._in_background, self._retention = accepted_at, in_background, retention
        self._on_error = on_error
        self.futures: Dict[int, asyncio.Future] = {}
        self.locks: Dict[int, asyncio.Lock] = {}  # one upload sequence per version at a time
        self.bytes: Dict[int, Tuple[int, int]] = {}  # version -> (uploaded, to upload) of the current attempt
        # versions a preemption notice copies away: their writer calls take the writers' urgent slot
        # and their remote commit a thread of its own (the default pool also runs the drain poll,
        # node reads and retention deletes), so routine work queued before them does not delay them
        self.urgent: Set[int] = set()
        self._turned_urgent: Dict[int, asyncio.Event] = {}  # set when a version in copy turns urgent
        self._urgent_threads: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def future(self, version: int) -> asyncio.Future:
        return self.futures.setdefault(version, asyncio.get_running_loop().create_future())

    def on_commit(self, version: int) -> None:
        """Upload ``version`` (just committed) if its turn has come (see UploadPlan.on_commit)."""
        if self.remote is None:
            return
        fut = self.future(version)
        why_not = self.plan.on_commit(version)
        if why_not is not None:
            fut.set_exception(SaveError(why_not))
            fut.exception()  # marked seen: it is an answer for a handle that asks, not an error to log
            return
        self.start(version)

    def start(self, version: int) -> None:
        self._in_background(self.upload(version))

    def upload_now(self, version: int) -> asyncio.Future:
        """Upload ``version`` now, whatever ``remote_every`` says (a preemption notice evacuates
        it); returns the upload's future. A remote handle that had failed because it was not this
        version's turn waits for this upload instead."""
        fut = self.futures.get(version)
        if fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None):
            del self.futures[version]
        self.future(version)
        self.plan.uploading.add(version)
        self.urgent.add(version)
        self._urgent_event(version).set()  # a routine attempt in copy sends its queued calls again, urgently
        return self._in_background(self.upload(version))

    def _urgent_event(self, version: int) -> asyncio.Event:
        return self._turned_urgent.setdefault(version, asyncio.Event())

    def _commit_threads(self, version: int) -> Optional[concurrent.futures.Executor]:
        if version not in self.urgent:
            return None
        if self._urgent_threads is None:
            self._urgent_threads = concurrent.futures.ThreadPoolExecutor(URGENT_UPLOADS,
                                                                        thread_name_prefix="ray_ckpt-urgent-commit")
        return self._urgent_threads

    def resume(self) -> None:
        """Start the uploads found undone at start-up (needs the event loop: first async call)."""
        for v in self.plan.take_resume():
            if v in self.plan.committed:
                log.warning("%s: its remote copy lacks parts its local manifest gained before a restart "
                            "(late best-effort parts); uploading them now", self.named(v))
            else:
                log.warning("%s: committed locally but not uploaded before a restart; uploading it now",
                            self.named(v))
            self.future(v)
            self.start(v)

    async def upload(self, version: int) -> None:
        """Upload ``version`` until it is on the remote tier or cannot be (its local copy is bad);
        transient errors retry with backoff (up to 30 s apart)."""
        backoff = 0.5
        untrusted = self.catalogue.untrusted.get(version)
        if untrusted is not None and version not in self.plan.committed:
            await self.refuse(version, untrusted)
            return
        try:
            async with self.locks.setdefault(version, asyncio.Lock()):
                while True:
                    manifest = self.catalogue.committed.get(version)
                    if self.plan.should_stop(version, manifest):  # e.g. a re-sync queued behind a failure
                        return
                    files = self.plan.files_to_upload(manifest)
                    self.note(version, 0, sum(f.size for f in files))
                    try:
                        await self.copy_files(files, version)
                        self.plan.files_uploaded(files)
                        threads = self._commit_threads(version)
                        taken_over, fence_t = await timed_thread(self._fence, self.remote, executor=threads)
                        if taken_over:
                            raise IntegrityError(taken_over)  # no retry helps: given up like a bad local copy
                        _, manifest_t = await timed_thread(write_manifest, self.remote, manifest, executor=threads)
                        self._slow_commit(version, fence_t, manifest_t)
                    except Exception as exc:
                        msg = one_line(getattr(exc, "cause", None) or exc)
                        permanent = isinstance(root_cause(exc), IntegrityError)  # the local copy is bad: no retry helps
                        self.plan.failed(version, msg, permanent)
                        self._on_error(f"{self.named(version)} upload: {msg}")
                        self.metrics.failed("upload")
                        if permanent:
                            await self.give_up(version, msg)
                            break
                        log.warning("%s: remote upload failed, retrying in %.1fs: %s", self.named(version), backoff,
                                    msg)
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 30.0)
                        continue
                    uploaded = self.plan.succeeded(version, manifest, files)
                    total = self.bytes[version][1]
                    self.note(version, total, total)
                    self.metrics.committed("remote", time.perf_counter() - self.accepted_at.get(version, 0.0), uploaded)
                    fut = self.future(version)
                    if not fut.done():
                        fut.set_result(self._outcome(manifest, "remote", self.plan.bytes.get(version, 0)))
                    break
        finally:
            fut = self.futures.get(version)
            if fut is None or fut.done():  # uploaded or given up; not a routine attempt an urgent one waits behind
                self.urgent.discard(version)
                self._turned_urgent.pop(version, None)
        await self._retention()

    def _slow_commit(self, version: int, fence_t: Tuple[float, float], manifest_t: Tuple[float, float]) -> None:
        """Say where the time went when a version's remote commit (after its bytes are up) was slow:
        a remote tier that answers slowly, or a coordinator whose threads are all busy."""
        total = sum(fence_t) + sum(manifest_t)
        if total >= SLOW_COMMIT_S:
            log.warning("%s: its remote commit took %.1fs after the last byte was uploaded (waiting for a thread "
                        "%.1fs + %.1fs; the owner check %.1fs; the manifest write %.1fs)", self.named(version), total,
                        fence_t[0], manifest_t[0], fence_t[1], manifest_t[1])

    async def copy_files(self, files: List[Any], version: Optional[int] = None) -> None:
        """Each file is uploaded by a writer on the node whose local tier holds it, in calls of at
        most ``UPLOAD_FILES_PER_CALL`` files, so that ``progress`` moves as they end."""
        by_node: Dict[str, list] = {}
        for f in files:
            by_node.setdefault(self.file_nodes.get(f.path, self.pools.node_id), []).append(f)

        async def one(node: str, fs: List[Any]) -> None:
            writer = self.pools.least_busy(self.pools.critical_on(node))
            if version is None or version in self.urgent:
                await (writer.upload_urgent if version in self.urgent else writer.upload).remote(fs)
            else:
                await self._routine_or_urgent(writer, fs, version)
            if version in self.bytes:
                done, total = self.bytes[version]
                self.note(version, done + sum(f.size for f in fs), total)

        await asyncio.gather(*[one(node, fs[i:i + UPLOAD_FILES_PER_CALL]) for node, fs in by_node.items()
                               for i in range(0, len(fs), UPLOAD_FILES_PER_CALL)])

    async def _routine_or_urgent(self, writer: Any, fs: List[Any], version: int) -> None:
        """A routine call for ``fs``; should ``version`` turn urgent (a preemption notice) before it
        ends, the same files go through the writer's urgent slots at once: Ray runs a concurrency
        group's calls in arrival order, so a routine call queued behind older versions' uploads
        could wait past the deadline. The routine call stays queued (Ray cannot take back an actor
        call reliably) and skips, when it runs, what the urgent one copied (``PartWriter.upload``)."""
        routine = asyncio.ensure_future(_awaited(writer.upload.remote(fs)))
        turned = asyncio.ensure_future(self._urgent_event(version).wait())
        try:
            await asyncio.wait({routine, turned}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            turned.cancel()
        if routine.done():
            routine.result()
            return
        routine.add_done_callback(_seen)  # its answer no longer matters: the urgent call's does
        await writer.upload_urgent.remote(fs)

    def named(self, version: int) -> str:
        """``version`` as messages name it: by its manifest's step (an upload resumed at start-up may
        be of a version written before versions were numbered by their steps)."""
        m = self.catalogue.committed.get(version)
        return step_label(version if m is None else m.step, version)

    def note(self, version: int, done: int, total: int) -> None:
        self.bytes[version] = (done, total)
        while len(self.bytes) > PROGRESS_VERSIONS:  # bookkeeping for the waits of recent versions only
            del self.bytes[min(self.bytes)]

    def progress(self, version: int) -> Optional[Tuple[int, int]]:
        """(bytes uploaded, bytes to upload) of ``version``'s current attempt, or None before it starts."""
        return self.bytes.get(version)

    async def give_up(self, version: int, msg: str) -> None:
        """Remove what the attempts left on the remote tier (never listed: no manifest), then fail
        the remote handle."""
        log.error("%s: not uploaded, its local copy cannot be: %s", self.named(version), msg)
        try:
            kept = {p for m in self.plan.committed.values() for p in m.referenced_paths()}
            await asyncio.to_thread(delete_version, self.remote, version, kept, [])
        except Exception as cleanup:
            log.warning("%s: removing its partial upload failed: %s", self.named(version), one_line(cleanup))
        fut = self.future(version)
        if not fut.done():
            fut.set_exception(SaveError(f"{self.named(version)} of run {self.run!r} cannot be uploaded: {msg}"))

    async def refuse(self, version: int, why: str) -> None:
        """The remote tier holds a copy of ``version`` that no key verifies (or that is damaged):
        it is kept as found, never uploaded over, and the version stays local only."""
        msg = (f"{self.named(version)} of run {self.run!r} is not uploaded: the remote tier holds a copy of it that "
               f"is not trusted ({why}); that copy is kept as found and never written over: inspect it "
               f"(ray-ckpt verify) and move it aside to upload this one")
        self.plan.failed(version, msg, True)
        self._on_error(msg)
        log.error(msg)
        fut = self.future(version)
        if not fut.done():
            fut.set_exception(SaveError(msg))

    def forget(self, version: int) -> None:
        """Drop the future and lock of an old, finished version (see the coordinator's pruning)."""
        self.futures.pop(version, None)
        self.locks.pop(version, None)
        self._turned_urgent.pop(version, None)
