"""What other processes do to a live run's storage, as the coordinator sees it.

Two things change a run behind its coordinator's back: another job takes the run over (a newer
owner record, ``storage/ownership.py``), and ``ray-ckpt gc --force`` deletes versions of the live
run (``storage/gc_notice.py``). :class:`OwnerFence` keeps this coordinator from committing for a
job that no longer owns the run; :class:`GcNoticeWatch` forgets the versions gc announces, so the
run never lists a version that is gone. Both are plain objects the actor calls; neither imports Ray.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, List, Optional, Tuple

from ..errors import SaveError, one_line
from ..storage.gc_notice import POLL_S as GC_NOTICE_POLL_S, read_notice
from ..storage.ownership import fence_error
from ..storage.tier import Tier
from .catalogue import Catalogue
from .lease import read_owner
from .upload_plan import UploadPlan

log = logging.getLogger("ray_ckpt.coordinator")


class OwnerFence:
    """The run's fencing token as this coordinator knows it, and the checks made with it."""

    def __init__(self, run: str, local: Tier, identity: Callable[[], Tuple[str, str]]):
        self.run = run
        # the creating engine sets the token (set_owner); a coordinator Ray restarted takes it from
        # the owner record if that record is its own job's (``identity()``: this process's cluster, job)
        self.token: Optional[int] = None
        record = read_owner([local])
        if record is not None and record.same_job(*identity()):
            self.token = record.token

    def check_caller(self, token: Optional[int]) -> None:
        """Refuse a save from an engine whose token an owner since has superseded."""
        if token is not None and self.token is not None and token < self.token:
            raise SaveError(f"run {self.run!r} was taken over (token {self.token}); this engine's token "
                            f"{token} is stale, so its saves no longer commit")

    def __call__(self, tier: Tier) -> Optional[str]:
        """Why this coordinator must not commit on ``tier`` now: another job took the run over."""
        return fence_error(read_owner([tier]), self.token, self.run)


class GcNoticeWatch:
    """Polls each tier's gc notice every ``POLL_S`` and forgets the versions it names.

    Started once (:meth:`start`) on the main event loop, from the first call that can tell the loop
    runs (a coordinator Ray restarted gets no ready() call); it runs for the actor's lifetime and
    is not a background task quiesce() waits for."""

    def __init__(self, run: str, local: Tier, remote: Optional[Tier], catalogue: Catalogue, uploads: UploadPlan):
        self.run, self.local, self.remote = run, local, remote
        self.catalogue, self.uploads = catalogue, uploads
        self._task: Optional[asyncio.Future] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(GC_NOTICE_POLL_S)
            for tier in [t for t in (self.local, self.remote) if t is not None]:
                try:
                    removed = await asyncio.to_thread(read_notice, tier)
                except Exception as exc:  # e.g. the remote tier is down: the next poll tries again
                    log.debug("cannot read the gc notice on the %s tier: %s", tier.name, one_line(exc))
                    continue
                self.forget_removed(tier is self.local, removed)

    def forget_removed(self, local: bool, removed: List[Tuple[int, int, float]]) -> None:
        """Forget the versions of ``removed`` (version, step, created_at) that are the committed
        ones of that tier (not a newer version that reused the number) and not in flight."""
        committed = self.catalogue.committed if local else self.uploads.committed
        gone = [v for v, step, created in removed if v in committed and v not in self.catalogue.pending
                and committed[v].step == step and committed[v].created_at == created
                and (local or v not in self.uploads.uploading)]
        if not gone:
            return
        if local:
            for v in gone:
                self.catalogue.forget(v)
        else:
            self.uploads._forget(gone, self.uploads.kept_paths(self.catalogue.committed, set(gone)))
        # only that tier's copy is lost: a version the other tier holds stays listed, restored from there
        other = self.uploads.committed if local else self.catalogue.committed
        kept, unlisted = [v for v in gone if v in other], [v for v in gone if v not in other]
        log.warning("run %r: ray-ckpt gc --force deleted versions %s from the %s tier; %s", self.run, gone,
                    "local" if local else "remote", "; ".join(
                        ([f"{kept} are still listed (their {'remote' if local else 'local'} copies)"] if kept else [])
                        + ([f"{unlisted} are no longer listed (no other copy)"] if unlisted else [])))
