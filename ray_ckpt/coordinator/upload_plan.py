"""What is owed to the remote tier, free of Ray: which committed versions are uploaded, what a
restarted coordinator still owes, what failed and why, what remote retention may delete.

The coordinator asks this plan and carries out its answers (uploads through writers, deletions on
the remote tier); everything here is plain bookkeeping, unit-tested without Ray or storage.

Turns: the engine counts its ``save()`` calls (a rank its ``submit()`` calls) and marks every
``remote_every``-th as due, because the coordinator, an async actor, may run concurrent calls in
any order. A due version that fails, or whose upload cannot be made, passes its turn to the next
version to commit (``owed``): the remote tier never waits ``remote_every`` more versions for a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

from ..formats.manifest import FileEntry, Manifest
from ..storage.retention import RetentionPolicy, VersionInfo, plan_deletions


@dataclass(frozen=True)
class RemoteDeletion:
    """A version remote retention or a rewind removes: ``keep`` are paths other versions still use."""

    version: int
    keep: frozenset
    referenced: Tuple[str, ...]


class UploadPlan:
    def __init__(self, every: int, enabled: bool, remote_committed: Optional[Mapping[int, Manifest]] = None,
                 local_committed: Union[Iterable[int], Mapping[int, Manifest]] = ()):
        self.every = every
        self.enabled = enabled
        self.committed: Dict[int, Manifest] = dict(remote_committed or {})  # on the remote tier now
        self.paths: Set[str] = {p for m in self.committed.values() for p in m.referenced_paths()}
        self.due: Set[int] = set()          # saves marked for upload by the engine, until committed
        self.owed = False                   # a due version failed: the next to commit goes instead
        self.uploading: Set[int] = set()    # uploads in progress (held back from local retention)
        self.errors: Dict[int, str] = {}    # the last error of an upload still being retried
        self.given_up: Set[int] = set()     # uploads that cannot be made (the local copy is bad)
        self.bytes: Dict[int, int] = {}     # bytes uploaded per version (files + manifest)
        # a restarted coordinator uploads the newest local version if at least ``every`` versions are
        # newer than the remote's newest: an upload its predecessor was killed before finishing
        newest_remote = max(self.committed, default=0)
        newer = sorted(v for v in local_committed if v > newest_remote)
        self.resume: List[int] = [newer[-1]] if enabled and len(newer) >= every else []
        # ... and re-syncs a remote copy whose manifest is older than the local one: best-effort parts
        # that joined the local manifest after the upload, whose re-sync its predecessor never made
        if enabled and isinstance(local_committed, Mapping):
            stale = [v for v, m in local_committed.items()
                     if v in self.committed and m.to_json() != self.committed[v].to_json()]
            self.resume = sorted(set(self.resume) | set(stale))
        self.uploading.update(self.resume)

    # ------------------------------------------------------------------ turns
    def opened(self, version: int, due: bool) -> None:
        """A version was accepted; ``due``: the engine counted it as an upload turn."""
        if self.enabled and due:
            self.due.add(version)

    def on_commit(self, version: int) -> Optional[str]:
        """``version`` committed locally: None when it is to be uploaded now (it is then marked as
        uploading), else why not (the text its remote handle raises; a save's version is its step)."""
        if not self.enabled:
            return "no remote tier"
        if version not in self.due and not self.owed:
            e = self.every
            return (f"step {version} is not uploaded: remote_every={e} uploads one in every {e} versions "
                    f"saved: save() calls number {e}, {2 * e}, {3 * e}, ... (or the next to commit after such "
                    f"a one failed)")
        self.due.discard(version)
        self.owed = False
        self.uploading.add(version)
        return None

    def missed(self, version: int, due: bool = False) -> None:
        """``version`` failed (or its upload did): if it was due, the next version to commit is owed."""
        if self.enabled and (due or version in self.due):
            self.owed = True
        self.due.discard(version)

    def take_resume(self) -> List[int]:
        versions, self.resume = self.resume, []
        return versions

    # ------------------------------------------------------------------ one upload
    def is_current(self, version: int, local: Optional[Manifest]) -> bool:
        """Whether the remote copy of ``version`` already equals ``local`` (nothing to upload)."""
        uploaded = self.committed.get(version)
        return local is not None and uploaded is not None and uploaded.to_json() == local.to_json()

    def needs_resync(self, version: int, local: Optional[Manifest]) -> bool:
        """Best-effort parts that landed after the upload began changed the local manifest."""
        if version in self.uploading:
            return True
        uploaded = self.committed.get(version)
        return uploaded is not None and local is not None and uploaded.to_json() != local.to_json()

    def should_stop(self, version: int, local: Optional[Manifest]) -> bool:
        """An upload sequence ends (without error) when the version is gone locally, was given up,
        or is already uploaded as it is now."""
        if local is None or version in self.given_up or self.is_current(version, local):
            self.uploading.discard(version)
            return True
        return False

    def files_to_upload(self, manifest: Manifest) -> List[FileEntry]:
        """The files of ``manifest`` the remote tier does not hold yet (a RELOADABLE state's files
        stored once are uploaded once)."""
        return [f for s in manifest.states.values() for f in s.all_files() if f.path not in self.paths]

    def files_uploaded(self, files: Iterable[FileEntry]) -> None:
        self.paths.update(f.path for f in files)

    def succeeded(self, version: int, manifest: Manifest, files: Iterable[FileEntry]) -> int:
        """The manifest was written remotely; returns the bytes this attempt uploaded."""
        uploaded = sum(f.size for f in files) + len(manifest.to_json())
        self.committed[version] = manifest
        self.errors.pop(version, None)
        self.bytes[version] = self.bytes.get(version, 0) + uploaded
        self.uploading.discard(version)
        return uploaded

    def failed(self, version: int, error: str, permanent: bool) -> None:
        """An attempt failed: retried later unless ``permanent`` (the local copy is bad)."""
        self.errors[version] = error
        if permanent:
            self.given_up.add(version)
            self.uploading.discard(version)
            self.missed(version, due=True)

    def kept_paths(self, local_committed: Mapping[int, Manifest], doomed: Iterable[int] = ()) -> Set[str]:
        """Remote paths still referenced by a remote version not in ``doomed`` or an upload in progress."""
        skip = set(doomed)
        keep = {p for v, m in self.committed.items() if v not in skip for p in m.referenced_paths()}
        for v in self.uploading:
            if v in local_committed:
                keep.update(local_committed[v].referenced_paths())
        return keep

    # ------------------------------------------------------------------ retention, rewind
    def plan_retention(self, policy: RetentionPolicy, local_committed: Mapping[int, Manifest]) -> List[RemoteDeletion]:
        """Remote versions ``policy`` lets go (never one being uploaded); forgotten here at once."""
        if not self.enabled:
            return []
        infos = [VersionInfo(v, m.step, m.metrics) for v, m in self.committed.items()]
        doomed = plan_deletions(policy, infos, self.uploading)
        return self._forget(doomed, self.kept_paths(local_committed, doomed))

    def plan_rewind(self, version: int) -> List[RemoteDeletion]:
        """Every remote version after ``version`` (a roll-back); forgotten here at once."""
        doomed = sorted(v for v in self.committed if v > version)
        keep = {p for v, m in self.committed.items() if v <= version for p in m.referenced_paths()}
        self.uploading.difference_update(doomed)
        return self._forget(doomed, keep)

    def _forget(self, doomed: Iterable[int], keep: Set[str]) -> List[RemoteDeletion]:
        out = []
        for v in doomed:
            m = self.committed.pop(v)
            self.paths -= set(m.referenced_paths()) - keep
            out.append(RemoteDeletion(v, frozenset(keep), tuple(m.referenced_paths())))
        return out

    def upload_state(self, version: int) -> str:
        """How ``status()`` shows an upload in progress."""
        err = self.errors.get(version)
        return "uploading" + (f" (last error: {err})" if err else "")
