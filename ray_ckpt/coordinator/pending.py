"""A version in flight as the catalogue records it: its parts, their states, the counters that keep
the commit rule O(1), and its sharded states' records as they arrive.

Plain records and the few functions that must keep their counters consistent (a part leaving
"pending", a shard record joining its state's index); the :class:`~ray_ckpt.coordinator.catalogue.Catalogue`
decides with them. No Ray, no storage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from ..errors import IntegrityError, SaveError
from ..formats.manifest import FileEntry
from ..protocol import PartPlan, PartStatus, ShardRecord, VersionStatus
from ..types import Strategy

PartKey = Tuple[str, int]


@dataclass
class Part:
    name: str
    rank: int
    strategy: Strategy
    status: str = "pending"  # pending | written | failed
    submitted: bool = False  # data arrived (driver snapshot or rank push) and went to a writer
    files: List[FileEntry] = field(default_factory=list)
    written: int = 0
    content_hash: Optional[str] = None
    error: str = ""
    timings: Dict[str, float] = field(default_factory=dict)  # from the writer: snapshot_wait_s, write_s
    # files the writer may refer to instead of writing (RELOADABLE): kept while the part is pending
    reuse_paths: Set[str] = field(default_factory=set)
    # stands for a driver-side state in a version its ranks opened: the driver's save() replaces it
    placeholder: bool = False
    append_only: bool = False  # written as segments over the newest committed version's (append_base_for)

    @property
    def blocks_commit(self) -> bool:
        return self.strategy is not Strategy.BEST_EFFORT


@dataclass
class PendingVersion:
    version: int
    step: int
    created_at: float
    metrics: Dict[str, float]
    strategies: Dict[str, Strategy]
    loader_states: Set[str]
    replicated: Set[str]
    parts: Dict[PartKey, Part]
    committed: bool = False
    error: Optional[str] = None
    opened_by_push: bool = False
    # (previous_version, chain_digest) of the newest version committed before this one, fixed at
    # its first manifest so that rewrites for late best-effort parts keep the same link
    previous: Optional[Tuple[int, str]] = None
    # counters kept by the Catalogue as parts are added, written or failed, so that the commit rule
    # (ready_to_commit / settled), run after every part, is O(1) rather than O(parts)
    n_pending: int = 0            # parts not yet written or failed
    n_critical_pending: int = 0   # of those, parts that block the commit (not best-effort)
    n_failed: int = 0
    revision: int = 0             # bumped whenever a part ends: a manifest built at an older one is stale
    # sharded (DTensor) states: each written part's shard record (None: a part without DTensors);
    # once every part of a state is written, its index as the manifest stores it, or why it has none
    shard_records: Dict[str, Dict[int, Optional[ShardRecord]]] = field(default_factory=dict)
    shard_index: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    shard_error: Dict[str, str] = field(default_factory=dict)  # best-effort or late states: reported missing
    shard_expected: Dict[str, int] = field(default_factory=dict)  # parts of each sharded state

    def stages(self) -> Dict[str, float]:
        """Where the version's time went: the slowest part's wait for its snapshot and its write."""
        out: Dict[str, float] = {}
        for key in ("snapshot_wait_s", "write_s"):
            vals = [p.timings[key] for p in self.parts.values() if key in p.timings]
            if vals:
                out[key] = max(vals)
        return out

    def missing_submits(self) -> List[str]:
        return [f"{p.name}/rank{p.rank}" for p in self.parts.values() if not p.submitted]

    def status(self, upload: Optional[str] = None) -> VersionStatus:
        return VersionStatus(self.version, self.step, self.stage(),
                             tuple(PartStatus(p.name, p.rank, p.status) for p in self.parts.values()), upload)

    def stage(self) -> str:
        if self.error:
            return "failed"
        if self.committed:
            return "committed"
        return f"writing ({len(self.parts) - self.n_pending}/{len(self.parts)} parts)"


def end_part(pv: PendingVersion, part: Part, status: str) -> None:
    """A part leaves "pending" (written, failed, or replaced by a merge): keep the counters."""
    if part.status == "pending":
        pv.n_pending -= 1
        pv.n_critical_pending -= part.blocks_commit
    elif part.status == "failed":
        pv.n_failed -= 1  # counted again below if it fails again
    if status == "failed":
        pv.n_failed += 1
    if status != "replaced":
        part.status = status
    pv.revision += 1


def add_shard_record(pv: PendingVersion, name: str, rank: int, record: Optional[ShardRecord]) -> None:
    """Collect a written part's shard record; once every part of a state with DTensors is
    written, build its index (``formats.shard_record.index_of``) with rank 0's header record under
    ``"heads"``. Ranks that disagree on a tensor, chunks that do not tile it, or a rank without the
    DTensors the others have fail the version (a best-effort state is reported missing instead): it
    could not be restored."""
    recs = pv.shard_records.setdefault(name, {})
    recs[rank] = record
    if record is not None and name not in pv.shard_expected:  # once per sharded state
        pv.shard_expected[name] = sum(1 for (n, _r) in pv.parts if n == name)
    want = pv.shard_expected.get(name)
    if want is None or len(recs) < want or name in pv.shard_index or name in pv.shard_error:
        return
    plain = sorted(r for r, rec in recs.items() if rec is None)
    try:
        if plain:
            raise SaveError(f"ranks {plain} pushed no DTensor leaves while ranks "
                            f"{sorted(r for r in recs if r not in plain)} did")
        from ..formats.shard_record import HEADS_KEY, index_of

        first = sorted(recs)[0]
        head = recs[first].head
        if head is None:
            raise SaveError(f"rank {first}'s shard record has no header record")
        index = index_of(recs[r] for r in sorted(recs)).to_json()
        index[HEADS_KEY] = {str(first): head.to_json()}  # rank 0's header
        pv.shard_index[name] = index
    except (SaveError, IntegrityError) as exc:
        why = f"sharded state {name!r}: {exc}"
        if pv.strategies.get(name) is Strategy.BEST_EFFORT or pv.committed:
            pv.shard_error[name] = why
        elif not pv.error:
            pv.error = why


def plan_of(p: Union[PartPlan, dict]) -> PartPlan:
    if isinstance(p, PartPlan):
        return p
    return PartPlan(p["name"], Strategy.parse(p["strategy"]), int(p.get("rank", 0)), int(p.get("nbytes", 0)),
                    bool(p.get("loader", False)), bool(p.get("replicated", False)), bool(p.get("append_only", False)))
