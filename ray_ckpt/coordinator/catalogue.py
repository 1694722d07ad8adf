"""The coordinator's bookkeeping, free of Ray: which versions exist, which parts each still awaits,
when a version may commit, what its manifest says, what retention may delete.

Everything here can be rebuilt from storage (the committed manifests), which is what the
coordinator does when it restarts.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from ..errors import InvalidArgumentError, SaveError
from ..formats.manifest import ROLE_INDEX, FileEntry, Manifest, StateEntry, chain_digest, sign_manifest
from ..protocol import Declaration, PartPlan, ShardRecord, WrittenPart
from ..storage.layout import validate_name
from ..storage.retention import RetentionPolicy, VersionInfo, plan_deletions
from ..types import CheckpointMeta, Strategy
from .pending import Part, PendingVersion, add_shard_record, end_part, plan_of


class Catalogue:
    def __init__(self, run: str, committed: Optional[Dict[int, Manifest]] = None):
        self.run = run
        self.committed: Dict[int, Manifest] = dict(committed or {})
        self.pending: Dict[int, PendingVersion] = {}
        self.signing_key: Any = None  # a key or a key ring: every manifest is signed (HMAC-SHA256)
        # versions found in storage but not trusted (mis-signed, edited, off the chain), with why:
        # kept as found for inspection, so a save of one of their steps is refused, never written over
        self.untrusted: Dict[int, str] = {}
        # a rollback found at recovery (storage/head.py): steps up to this one were committed before
        # and are not all there now; none is saved again, so a step never names two versions
        self.reserved_through = -1
        self.failed: Dict[int, str] = {}
        # states pushed by rank actors (engine.submit)
        self.declared: Dict[str, Declaration] = {}
        # states the driver's save() captures (the owning engine says which): a version its ranks
        # open waits for that save, so the driver need not win the race to open it
        self.driver_states: List[str] = []

    # ------------------------------------------------------------------ pushed states
    def declare(self, name: str, strategy: str, world_size: int, replicated: bool = False,
                allow_pickle: bool = False, append_only: bool = False) -> None:
        validate_name(name, "state name")  # also guards what a restarted coordinator reads back
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InvalidArgumentError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.declared[name] = Declaration(name, Strategy.parse(strategy), world_size, bool(replicated),
                                          bool(allow_pickle), bool(append_only))

    def expect_driver(self, names: List[str]) -> None:
        """The driver-side states of this run (``[]``: ranks' pushes alone make a version)."""
        for n in names:
            validate_name(n, "state name")
        self.driver_states = sorted(set(names))

    def pushed_parts(self) -> List[PartPlan]:
        return [p for d in self.declared.values() for p in d.parts()]

    def accept_push(self, version: int, step: int, name: str, rank: int) -> PendingVersion:
        """A rank pushed its part of ``name`` for ``step``: open the version if needed and check
        the barrier (every rank of a version is at one step)."""
        d = self.declared.get(name)
        if d is None:
            raise SaveError(f"state {name!r} was not declared for pushing; register it with "
                            f"world_size=N first (declared: {sorted(self.declared) or 'none'})")
        if not 0 <= rank < d.world_size:
            raise SaveError(f"rank {rank} is out of range for state {name!r} (world_size {d.world_size})")
        if version in self.committed and version not in self.pending:
            raise SaveError(f"step {step} of run {self.run!r} is already committed")
        pv = self.pending.get(version)
        if pv is None:
            pv = self.begin(version, step, [])
            pv.opened_by_push = True
            for n in self.driver_states:  # critical until the driver's save() says what they are
                if n not in self.declared:
                    pv.parts[(n, 0)] = Part(n, 0, Strategy.CRITICAL, placeholder=True)
                    pv.n_pending += 1
                    pv.n_critical_pending += 1
        part = pv.parts.get((name, rank))
        if part is None:
            raise SaveError(f"step {step} does not expect state {name!r} rank {rank}")
        if part.submitted:
            raise SaveError(f"state {name!r} rank {rank} was already submitted for step {step}")
        part.submitted = True
        return pv

    def barrier_violations(self, version: int, name: str, rank: int, after: int = -1) -> List[int]:
        """Open versions between ``after`` (the step this rank pushed before ``version``, as its
        engine says) and ``version`` that still wait for (name, rank): the rank skipped them, so
        the ranks disagree on the step and those versions can never be consistent. Versions up to
        ``after`` are not judged here: that push may still be on its way (Ray may run an async
        actor's calls out of order), and its own call judges the gap before it."""
        return [v for v, pv in self.pending.items()
                if after < v < version and not pv.committed and not pv.error
                and (name, rank) in pv.parts and not pv.parts[(name, rank)].submitted]

    # ------------------------------------------------------------------ versions
    @property
    def last_version(self) -> int:
        known = list(self.committed) + list(self.pending)
        return max(known + [self.reserved_through]) if known else self.reserved_through

    def begin(self, version: int, step: int, parts: List[Union[PartPlan, dict]],
              metrics: Optional[Dict[str, float]] = None) -> PendingVersion:
        """Open a version with the parts the engine planned (a dict with PartPlan's fields works too)."""
        parts = [plan_of(p) for p in parts]
        # Steps increasing is checked by each engine at the call; here only duplicates are refused,
        # because Ray may start an async actor's calls out of submission order.
        pv = self.pending.get(version)
        if pv is not None and pv.opened_by_push and not pv.committed and not pv.error:
            return self._merge(pv, parts, metrics)  # ranks pushed first; the driver's parts join them
        if version in self.untrusted and version not in self.committed:
            raise SaveError(f"step {step} of run {self.run!r} exists in storage but is not trusted "
                            f"({self.untrusted[version]}); it is kept as found and never written over: save "
                            f"a later step, or move it aside after inspecting it (ray-ckpt verify)")
        if version <= self.reserved_through and version not in self.committed and version not in self.pending:
            raise SaveError(f"step {step} of run {self.run!r}: steps up to {self.reserved_through} were "
                            f"committed before and are missing now (lost with a node, or rolled back behind the engine's back), and "
                            f"a step is never reused: save a step after {self.reserved_through}, or restore "
                            f"with rewind=True to go on from an older version with its step numbers")
        if version in self.committed or version in self.pending:
            raise SaveError(f"step {step} of run {self.run!r} already exists"
                            + (" and is committed" if version in self.committed else "")
                            + "; steps must increase")
        pv = PendingVersion(version, step, time.time(), dict(metrics or {}), {}, set(), set(), {})
        names = {p.name for p in parts}
        self._add_parts(pv, parts + [q for q in self.pushed_parts() if q.name not in names])
        self.pending[version] = pv
        return pv

    def _merge(self, pv: "PendingVersion", parts: List[PartPlan], metrics: Optional[Dict[str, float]]
               ) -> "PendingVersion":
        for key, part in list(pv.parts.items()):
            if part.placeholder:  # the driver's save arrived: its own parts (or none) take the place
                end_part(pv, part, "replaced")
                del pv.parts[key]
        both = sorted({p.name for p in parts} & set(pv.strategies))
        if both:
            raise SaveError(f"step {pv.step}: states {both} are both pushed and saved by the driver")
        pv.opened_by_push = False
        pv.metrics.update(metrics or {})
        self._add_parts(pv, parts)
        return pv

    @staticmethod
    def _add_parts(pv: "PendingVersion", parts: List[PartPlan]) -> None:
        for p in parts:
            pv.strategies[p.name] = p.strategy
            if p.replicated:
                pv.replicated.add(p.name)
            if p.loader:
                pv.loader_states.add(p.name)
                continue
            part = Part(p.name, p.rank, p.strategy, append_only=p.append_only)
            old = pv.parts.get((p.name, p.rank))
            if old is not None:
                end_part(pv, old, "replaced")
            pv.parts[(p.name, p.rank)] = part
            pv.n_pending += 1
            pv.n_critical_pending += part.blocks_commit

    def part_written(self, version: int, name: str, rank: int, result: Union[WrittenPart, dict]) -> None:
        if isinstance(result, dict):  # the plain form, for code and tests without writers
            shards = result.get("shards")
            result = WrittenPart(tuple(result["files"]), result.get("written", 0), result.get("content_hash"),
                                 shards=None if shards is None else ShardRecord.from_json(shards))
        pv = self.pending[version]
        part = pv.parts[(name, rank)]
        end_part(pv, part, "written")
        part.files = [f if isinstance(f, FileEntry) else FileEntry(**f) for f in result.files]
        part.written = result.written
        part.content_hash = result.content_hash
        part.timings = {"snapshot_wait_s": result.snapshot_wait_s, "write_s": result.write_s}
        part.reuse_paths = set()  # what it refers to is in part.files now
        add_shard_record(pv, name, rank, result.shards)

    def part_failed(self, version: int, name: str, rank: int, error: str) -> bool:
        """Record a failed part; returns True when the version can no longer commit."""
        pv = self.pending[version]
        part = pv.parts[(name, rank)]
        end_part(pv, part, "failed")
        part.error = error
        part.reuse_paths = set()
        if part.blocks_commit and not pv.committed:
            pv.error = f"critical state {name!r} rank {rank} failed: {error}"
            return True
        return False

    def ready_to_commit(self, version: int) -> bool:
        """Every critical part written (O(1): counters kept as parts end)."""
        pv = self.pending[version]
        return not pv.error and pv.n_critical_pending == 0

    def settled(self, version: int) -> bool:
        """Every part written or failed, best-effort ones too (O(1))."""
        return self.pending[version].n_pending == 0

    def manifest_for(self, version: int) -> Manifest:
        pv = self.pending[version]
        m = Manifest(self.run, pv.version, pv.step, pv.created_at, metrics=pv.metrics)
        if pv.previous is None:
            older = [v for v in self.committed if v < version]
            if older:
                pv.previous = (max(older), chain_digest(self.committed[max(older)]))
        if pv.previous is not None:
            m.previous_version, m.previous = pv.previous
        by_state: Dict[str, List[Part]] = {}  # grouped once: O(parts), not O(states x parts)
        for p in pv.parts.values():
            by_state.setdefault(p.name, []).append(p)
        for name, strategy in pv.strategies.items():
            if name in pv.loader_states:
                m.states[name] = StateEntry(strategy.value, "loader", detail="rebuilt by its loader on restore")
                continue
            parts = by_state.get(name, [])
            entry = StateEntry(strategy.value, "stored", replicated=name in pv.replicated)
            if any(p.status == "pending" for p in parts):
                entry.status, entry.detail = "pending", "best-effort part not written yet"
            elif any(p.status == "failed" for p in parts):
                entry.status = "missing"
                entry.detail = "; ".join(f"rank {p.rank}: {p.error}" for p in parts if p.status == "failed")
            else:
                entry.files = {str(p.rank): p.files for p in sorted(parts, key=lambda p: p.rank)}
                entry.bytes = sum(f.size for p in parts for f in p.files)
                entry.content_hash = parts[0].content_hash if len(parts) == 1 else None
                if name in pv.shard_error:
                    entry.status, entry.detail, entry.files, entry.bytes = "missing", pv.shard_error[name], {}, 0
                else:
                    entry.shards = pv.shard_index.get(name)
            m.states[name] = entry
        if self.signing_key:
            sign_manifest(m, self.signing_key)
        return m

    def mark_committed(self, version: int, manifest: Manifest) -> None:
        self.pending[version].committed = True
        self.committed[version] = manifest

    def finish(self, version: int) -> None:
        """Forget the in-flight record once nothing more will arrive for the version."""
        pv = self.pending.pop(version, None)
        if pv is not None and pv.error:
            self.failed[version] = pv.error

    def fail(self, version: int, error: str) -> None:
        pv = self.pending.get(version)
        if pv is not None and not pv.error:
            pv.error = error

    def bytes_written(self, version: int) -> int:
        return sum(p.written for p in self.pending[version].parts.values())

    # ------------------------------------------------------------------ reuse
    def reuse_for(self, part: Part) -> Dict[str, List[dict]]:
        """content hash -> files of a stored RELOADABLE state, from every committed version. Those
        files are kept (``kept_paths``) until the part is done: retention running while the writer
        hashes must not delete the file it is about to refer to."""
        out: Dict[str, List[dict]] = {}
        for v in sorted(self.committed):
            e = self.committed[v].states.get(part.name)
            if e and e.status == "stored" and e.content_hash and "0" in e.files:
                out[e.content_hash] = [f.__dict__ for f in e.files["0"]]
        part.reuse_paths = {f["path"] for fs in out.values() for f in fs}
        return out

    def append_base_for(self, part: Part) -> List[dict]:
        """The files of the newest committed version's part of an append-only state (none if no
        committed version stored it as segments): the writer writes only the rows added since.
        Kept while the part is pending, as ``reuse_for``'s files are."""
        for v in sorted(self.committed, reverse=True):
            e = self.committed[v].states.get(part.name)
            if e is None or e.status != "stored":
                continue
            files = e.files.get("0" if e.replicated else str(part.rank), [])
            if any(f.role == ROLE_INDEX for f in files):
                part.reuse_paths = {f.path for f in files}
                return [f.__dict__ for f in files]
            return []
        return []

    # ------------------------------------------------------------------ retention
    def plan_retention(self, policy: RetentionPolicy, protect: Set[int] = frozenset()) -> List[int]:
        """Committed versions retention may delete now (never in-flight or protected ones)."""
        infos = [VersionInfo(v, m.step, m.metrics) for v, m in self.committed.items()]
        return plan_deletions(policy, infos, set(self.pending) | set(protect))

    def kept_paths(self, doomed: Set[int]) -> Set[str]:
        paths: Set[str] = set()
        for v, m in self.committed.items():
            if v not in doomed:
                paths.update(m.referenced_paths())
        for pv in self.pending.values():
            paths.update(f.path for p in pv.parts.values() for f in p.files)
            paths.update(path for p in pv.parts.values() for path in p.reuse_paths)
        return paths

    def forget(self, version: int) -> None:
        self.committed.pop(version, None)


def meta_of(m: Manifest, tiers: Tuple[str, ...]) -> CheckpointMeta:
    return CheckpointMeta(
        version=m.version, step=m.step, created_at=m.created_at,
        states=tuple(sorted(n for n, e in m.states.items() if e.status in ("stored", "loader"))),
        bytes=m.bytes, tiers=tiers, metrics=dict(m.metrics),
        missing=tuple(sorted(n for n, e in m.states.items() if e.status == "missing")),
        pending=tuple(sorted(n for n, e in m.states.items() if e.status == "pending")),
    )
