"""Deleting versions on every node and tier: the coordinator's step 7 (retention), ``rewind``, the
files of a failed version, and the temporary files a killed writer left.

The plans are the Ray-free bookkeeping's (``Catalogue.plan_retention`` / ``kept_paths``,
``UploadPlan.plan_retention`` / ``plan_rewind``); this module carries them out: on the local tier of
the coordinator's node directly, on other nodes' local tiers through one of their writers (each
node's local tier is its own disk), on the remote tier directly. Files another version still refers
to (``keep``) stay. The coordinator holds one :class:`Deletions`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Dict, List, Optional, Set

from .catalogue import Catalogue
from ..storage.checkpoint_io import delete_version
from ..storage.layout import in_version
from ..config import EngineConfig
from ..errors import SaveError, one_line
from ..storage.tier import Tier
from ..types import step_label
from .upload_plan import UploadPlan
from ..writers.pools import WriterPools

log = logging.getLogger("ray_ckpt.coordinator")
SWEEP_TIMEOUT_S = 60.0  # removing a finished version's temporary files (a writer busy with later batches)


class Deletions:
    """Carries out the deletions the catalogue and the upload plan decide."""

    def __init__(self, cfg: EngineConfig, local: Tier, remote: Optional[Tier], catalogue: Catalogue,
                 uploads: UploadPlan, pools: WriterPools, file_nodes: Dict[str, str]):
        self.cfg, self.local, self.remote, self.catalogue = cfg, local, remote, catalogue
        self.uploads, self.pools, self.file_nodes = uploads, pools, file_nodes

    async def everywhere(self, version: int, keep: Set[str], referenced: List[str]) -> None:
        """Delete a version from every node's local tier (each node's local tier is its own disk)."""
        await asyncio.to_thread(delete_version, self.local, version, keep, referenced)
        results = await asyncio.gather(*[w.delete_version.remote(version, keep, referenced)
                                         for w in self.pools.other_nodes()], return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("version %d: deleting on another node failed: %s", version, one_line(r))
        for path in [p for p in self.file_nodes if in_version(p, version) or p in referenced]:
            if path not in keep:
                self.file_nodes.pop(path, None)

    async def apply_retention(self) -> None:
        """The local policy (versions being uploaded are held back)."""
        doomed = self.catalogue.plan_retention(self.cfg.local_policy(), protect=self.uploads.uploading)
        if not doomed:
            return
        keep = self.catalogue.kept_paths(set(doomed))
        referenced = {v: self.catalogue.committed[v].referenced_paths() for v in doomed}
        for v in doomed:
            self.catalogue.forget(v)
        for v in doomed:
            await self.everywhere(v, keep, referenced[v])
            log.info("retention: deleted version %d from the local tier", v)

    async def apply_remote_retention(self) -> None:
        for d in self.uploads.plan_retention(self.cfg.remote_policy(), self.catalogue.committed):
            await asyncio.to_thread(delete_version, self.remote, d.version, set(d.keep), list(d.referenced))

    async def rewind(self, version: int) -> List[int]:
        """Delete every committed version after ``version`` from both tiers (see the coordinator's
        ``rewind``); refused while saves are in flight. Returns the versions deleted."""
        busy = sorted(v for v in self.catalogue.pending if v > version)
        if busy:
            m = self.catalogue.committed.get(version)  # busy: saves, whose versions are their steps
            raise SaveError(f"cannot rewind run {self.cfg.run!r} to {step_label(m.step if m else version, version)}"
                            f": steps {busy} are still being written; wait for their handles first")
        newer_local = sorted(v for v in self.catalogue.committed if v > version)
        keep = self.catalogue.kept_paths(set(newer_local))
        for v in newer_local:
            referenced = self.catalogue.committed[v].referenced_paths()
            self.catalogue.forget(v)
            await self.everywhere(v, keep, referenced)
        newer_remote = self.uploads.plan_rewind(version)
        for d in newer_remote:
            await asyncio.to_thread(delete_version, self.remote, d.version, set(d.keep), list(d.referenced))
        gone = sorted(set(newer_local) | {d.version for d in newer_remote})
        if gone:
            log.warning("rewind to version %d deleted versions %s", version, gone)
        return gone

    async def sweep_temporaries(self, version: int) -> None:
        """Every part of ``version`` ended: remove the ``*.tmp-*`` files a writer killed mid-batch
        left in it (one call to a writer of each node that holds its files)."""
        alive = await asyncio.to_thread(self.pools._alive_nodes)
        nodes = [n for n in self.pools.critical_by_node if n in alive]  # a lost node's writer would not answer
        calls = [self.pools.critical_on(n)[0].remove_temporaries.remote(version) for n in nodes]
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), SWEEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("version %d: removing temporary files did not end within %gs", version, SWEEP_TIMEOUT_S)
            return
        for node, r in zip(nodes, results):
            if isinstance(r, Exception):
                log.warning("version %d: removing temporary files on node %s failed: %s", version, node[:12],
                            one_line(r))
            elif r:
                log.warning("version %d: removed %d temporary file(s) a killed writer left on node %s",
                            version, len(r), node[:12])
