"""Retention policies that compose: a version is kept if any policy keeps it (their union).

Pure functions over version metadata, shared by the coordinator and ``ray-ckpt gc``. Deletion never
touches the newest committed version, versions still being written, or files a kept version refers to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence, Set, Tuple


@dataclass(frozen=True)
class VersionInfo:
    version: int
    step: int
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class RetentionPolicy:
    """keep_last=N newest versions ∪ every version whose step is a multiple of keep_every ∪ the
    keep_best=(metric, "max"|"min", N) best by a metric given to ``save(step, metrics=...)``.
    All None keeps everything."""

    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_best: Optional[Tuple[str, str, int]] = None

    def __post_init__(self):
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.keep_best is not None:
            kb = self.keep_best
            if (not isinstance(kb, (tuple, list)) or len(kb) != 3 or not isinstance(kb[0], str)
                    or kb[1] not in ("max", "min") or not isinstance(kb[2], int) or kb[2] < 1):
                raise ValueError(f"keep_best must be (metric, 'max'|'min', N>=1), got {kb!r}")
            object.__setattr__(self, "keep_best", tuple(kb))

    @property
    def keeps_all(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def keep(self, versions: Sequence[VersionInfo]) -> Set[int]:
        """The versions this policy keeps among committed ``versions`` (the newest always)."""
        if not versions:
            return set()
        ordered = sorted(versions, key=lambda v: v.version)
        if self.keeps_all:
            return {v.version for v in ordered}
        kept = {ordered[-1].version}
        if self.keep_last:
            kept.update(v.version for v in ordered[-self.keep_last:])
        if self.keep_every:
            kept.update(v.version for v in ordered if v.step % self.keep_every == 0)
        if self.keep_best:
            metric, mode, n = self.keep_best
            scored = [v for v in ordered if metric in v.metrics]
            scored.sort(key=lambda v: v.metrics[metric], reverse=(mode == "max"))
            kept.update(v.version for v in scored[:n])
        return kept


def plan_deletions(policy: RetentionPolicy, committed: Sequence[VersionInfo],
                   in_flight: Iterable[int] = ()) -> List[int]:
    """Committed versions to delete now. In-flight versions are never candidates."""
    busy = set(in_flight)
    kept = policy.keep(committed)
    return sorted(v.version for v in committed if v.version not in kept and v.version not in busy)
