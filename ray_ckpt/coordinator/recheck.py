"""A restore found no good copy of a listed version's critical file: does any copy still verify?

The listing promises that every listed version has a copy that restores. A restore that finds
otherwise (every tier it can read refused a critical file: a damaged local file, a corrupt replica,
a remote object that changed) asks the coordinator to look again at every copy it can reach
(:func:`recheck`): its own node's disk (or a ``local_dir`` the nodes share), each peer replica
(the holder hashes its bytes again) and the remote tier. If a critical file has no copy that
verifies, the version leaves the list as a version lost with a node does (recorded in
``lost_versions.json``, reported in ``status()["skipped_versions"]`` with why, its number never
reused), and the restore goes on to the newest version still listed, naming the one it skipped.

A copy this process cannot check counts as good: a file on another live node's disk (only a
process there reads it), a holder that does not answer, a remote tier that is down. So a version
leaves the list only on evidence that each of its copies is bad or gone, never on a reader's bad day.
"""
from __future__ import annotations

import asyncio
import logging
from typing import List, Optional

from ..errors import IntegrityError, one_line
from ..formats.manifest import FileEntry
from ..capture.peer_reads import INDEX_TIMEOUT_S
from ..storage.lost import LostVersion
from ..storage.tier import Tier
from ..types import step_label
from .replication import Replication, held_files

log = logging.getLogger("ray_ckpt.coordinator")


class _Unknown(Exception):
    """A copy that cannot be checked from here: it counts as good."""


async def recheck(version: int, r: Replication, remote: Optional[Tier]) -> Optional[str]:
    """Why ``version`` cannot be restored, after it left the list for that reason; None when each
    of its critical files has a copy that verifies (or that cannot be checked from here) or the
    version is not a listed, settled one."""
    m = r.catalogue.committed.get(version) or r.uploads.committed.get(version)
    if m is None or version in r.catalogue.pending or version in r.uploads.uploading:
        return None
    bad = {}
    for f in held_files(m):
        try:
            errors = await _why_no_copy(f, version, r, remote)
        except _Unknown:
            return None
        if errors:
            bad[f.path] = errors
    if not bad:
        return None
    first = next(iter(bad))
    why = (f"no copy of {len(bad)} critical file(s) verifies (e.g. {first}: {'; '.join(bad[first])}); found by a "
           f"restore")
    await r.unlist({version: LostVersion(why, float(m.created_at))}, f"a restore of {step_label(m.step, version)} "
                                                                       f"found no copy that verifies")
    r.uploads.committed.pop(version, None)  # its remote copy is one of those that failed: kept as found
    return why


async def _why_no_copy(f: FileEntry, version: int, r: Replication, remote: Optional[Tier]) -> List[str]:
    """Why each copy of ``f`` fails ([] when one verifies); raises _Unknown when one cannot be checked."""
    errors: List[str] = []
    node = r.file_nodes.get(f.path, r.node_id)
    if node == r.node_id or await asyncio.to_thread(r.local.exists, f.path):
        why = await asyncio.to_thread(_check, r.local, f)
        if why is None:
            return []
        errors.append(f"local: {why}")
    elif node in r.dead:
        errors.append(f"local: its node {node[:12]} is lost")
    else:
        raise _Unknown(f"on node {node[:12]}'s disk")
    for n in sorted(r.copies.get(version, {}).get(f.path, set())):
        holder = r.holders.get(n)
        if holder is None:
            raise _Unknown(f"peer:{n[:12]}")
        try:
            why = (await asyncio.wait_for(holder.verify.remote({f.path: f.checksum}), INDEX_TIMEOUT_S)).get(f.path)
        except Exception as exc:
            raise _Unknown(f"peer:{n[:12]}: {one_line(exc)}") from None
        if why is None:
            return []
        errors.append(f"peer:{n[:12]}: {why}")
    if remote is not None and version in r.uploads.committed:
        why = await asyncio.to_thread(_check, remote, f)
        if why is None:
            return []
        errors.append(f"remote: {why}")
    return errors


def _check(tier: Tier, f: FileEntry) -> Optional[str]:
    """Why ``tier``'s copy of ``f`` is not good (None: it verifies); _Unknown when the tier cannot say."""
    try:
        tier.read_verified(f.path, f.size, f.checksum)
        return None
    except FileNotFoundError:
        return "missing"
    except IntegrityError as exc:
        return tier.scrub(one_line(exc))
    except OSError as exc:  # e.g. the remote store down: not evidence against the copy
        raise _Unknown(f"{tier.name}: {tier.scrub(one_line(exc))}") from None
