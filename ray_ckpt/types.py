"""The typed public vocabulary: strategies and the result records users read."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


class Strategy(str, enum.Enum):
    """How a state is treated.

    CRITICAL: must be durable before a version is visible; restored bit-exact or the restore fails.
    BEST_EFFORT: written on the low-priority pool; never delays a commit; a missing one is reported.
    RELOADABLE: stored once and referenced by later versions while its content is unchanged, or not
    stored at all when a ``loader`` rebuilds it.
    """

    CRITICAL = "critical"
    BEST_EFFORT = "best_effort"
    RELOADABLE = "reloadable"

    @classmethod
    def parse(cls, value: "Strategy | str") -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            for s in cls:
                if value.lower() in (s.value, s.name.lower()):
                    return s
        raise ValueError(
            f"unknown strategy {value!r}; expected one of "
            + ", ".join(f"rc.Strategy.{s.name}" for s in cls)
        )


class OnBusy(str, enum.Enum):
    """What ``save()`` does when ``max_in_flight`` saves are already in flight."""

    WAIT = "wait"    # block until one finishes (bounded memory; the default)
    SKIP = "skip"    # return a handle marked skipped; nothing is captured
    QUEUE = "queue"  # capture now anyway (memory grows with the queue)

    @classmethod
    def parse(cls, value: "OnBusy | str") -> "OnBusy":
        try:
            return value if isinstance(value, OnBusy) else cls(value)
        except ValueError:
            raise ValueError(f"on_busy must be 'wait', 'skip' or 'queue', got {value!r}") from None


class _StrEnum(str, enum.Enum):
    """An enum whose members are their strings: ``status == "restored"`` holds, JSON writes the
    string, and formatting prints the value (as ``Strategy`` members do)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Durability(_StrEnum):
    """Where a SaveResult's version is committed."""

    LOCAL = "local"
    REPLICATED = "replicated"  # local, and held in the memory of peer_replicas other nodes
    REMOTE = "remote"
    SKIPPED = "skipped"  # on_busy="skip": nothing was captured


class StateStatus(_StrEnum):
    """What a restore (or load_into) did with one state."""

    RESTORED = "restored"   # read, verified and loaded
    RELOADED = "reloaded"   # rebuilt by its loader (a RELOADABLE state stored as 'loader')
    SKIPPED = "skipped"     # not loaded on purpose (no loader, a pushed state without rank providers)
    MISSING = "missing"     # not in the version, or it did not verify (a best-effort state: not fatal)


class TierName(_StrEnum):
    """The tier a state was read from: the node-local disk, a peer replica or the remote store.
    A state read from a peer reports ``TierName.PEER`` and, in ``StateReport.node``, the
    holder's node (its first 12 characters)."""

    LOCAL = "local"
    PEER = "peer"
    REMOTE = "remote"


def step_label(step: int, version: Optional[int] = None) -> str:
    """How a message names a version to a person: by its step, the public id ("step 7"), and by its
    directory's number too only where that differs ("step 70 (version 7)": runs written before every
    version was numbered by its step)."""
    return f"step {step}" if version is None or version == step else f"step {step} (version {version})"


@dataclass(frozen=True)
class SaveResult:
    """What a save's handle resolves to once its version is committed on a tier.

    ``version`` and ``step`` (equal: versions are steps), ``bytes_written``, ``durability``
    (``"local"``, ``"remote"``, or ``"skipped"`` for ``save(on_busy="skip")``), the ``states`` stored,
    ``seconds`` from the coordinator accepting the version to its commit on that tier, and ``stages``
    (``snapshot_wait_s``, ``write_s``, ``manifest_s``: where the local commit's time went). Best-effort
    states are reported, not fatal: ``missing`` failed, ``pending`` were still being written when the
    version committed. ``rank_zero_only``: this was a replica rank's push (``replicated=True``) and rank
    0's copy is the one stored."""

    version: Optional[int]
    step: int
    bytes_written: int
    durability: str  # "local" | "remote" | "skipped"
    states: Tuple[str, ...] = ()
    seconds: float = 0.0  # from the coordinator accepting the version to its commit on this tier
    # where the time went (local commit only): snapshot_wait_s — the slowest writer's wait for its
    # snapshot; write_s — its serialise + checksum + fsync; manifest_s — writing the manifest
    stages: Dict[str, float] = field(default_factory=dict)
    missing: Tuple[str, ...] = ()   # best-effort states that failed (reported, not fatal)
    pending: Tuple[str, ...] = ()   # best-effort states still being written when the version committed
    rank_zero_only: bool = False    # a replica rank's push (replicated=True): rank 0's copy is the one stored

    def __post_init__(self):
        object.__setattr__(self, "durability", Durability(self.durability))

    @property
    def skipped(self) -> bool:
        """Whether ``save(on_busy="skip")`` skipped this save (nothing was captured)."""
        return self.durability == "skipped"


@dataclass(frozen=True)
class StateReport:
    """What a restore did with one state: ``status`` (``"restored"``, ``"reloaded"``, ``"skipped"`` or
    ``"missing"``), the ``tier`` it was read from (a :class:`TierName`, None when nothing was read),
    whether its checksums were ``verified``, a ``detail`` saying why when it was not restored from
    the local tier, the ``bytes`` read, and for the peer tier the ``node`` whose replica holder
    served it (first 12 characters). ``"peer:<node>"`` given as ``tier`` (the form before ``node``
    existed) is read as ``tier="peer"`` and that node."""

    status: str  # "restored" | "reloaded" | "skipped" | "missing"
    tier: Optional[str]  # TierName: "local" | "peer" | "remote"; None
    verified: bool
    detail: str = ""
    bytes: int = 0
    node: Optional[str] = None  # tier "peer": the node whose replica holder served the bytes

    def __post_init__(self):
        object.__setattr__(self, "status", StateStatus(self.status))
        if self.tier is not None:
            kind, colon, node = str(self.tier).partition(":")
            if colon and kind == TierName.PEER and self.node is None:
                object.__setattr__(self, "node", node)
            object.__setattr__(self, "tier", TierName(kind if colon else self.tier))

    @property
    def source(self) -> str:
        """Where the bytes came from, for a person: the tier, and the node for the peer tier."""
        if self.tier is None:
            return "-"
        return f"{self.tier}:{self.node}" if self.node else str(self.tier)


@dataclass(frozen=True)
class RestoreReport:
    """What ``restore()`` returns: the ``version`` and ``step`` restored, a ``StateReport`` per
    state in ``states``, the ``seconds`` it took, the versions ``rewound`` (deleted by
    ``restore(..., rewind=True)``) and ``skipped_versions``: newer versions passed over
    (``restore(fallback=True)``, unreadable or mis-signed manifests), each with why. ``str(report)`` is
    a table a person can read."""

    version: int
    step: int
    states: Dict[str, StateReport]
    seconds: float = 0.0
    rewound: Tuple[int, ...] = ()  # newer versions deleted by restore(..., rewind=True)
    # newer versions passed over (restore(fallback=True), or unreadable manifests): version -> why
    skipped_versions: Dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:  # a table a person can read
        lines = [f"restored {step_label(self.step, self.version)} in {self.seconds:.3f}s"]
        for name, r in sorted(self.states.items()):
            lines.append(
                f"  {name:<20} {r.status:<9} tier={r.source:<6} verified={'yes' if r.verified else 'no':<3}"
                + (f" {r.detail}" if r.detail else "")
            )
        for v, why in sorted(self.skipped_versions.items()):
            lines.append(f"  skipped newer version {v}: {why}")
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckpointMeta:
    """One committed version, as ``list_checkpoints()`` lists it: ``version`` and ``step``,
    ``created_at`` (unix time), the ``states`` it holds, its ``bytes``, the ``tiers`` it is committed
    on, the ``metrics`` passed to ``save(step, metrics=...)``, and the best-effort states ``missing``
    or still ``pending``."""

    version: int
    step: int
    created_at: float
    states: Tuple[str, ...]
    bytes: int
    tiers: Tuple[str, ...]
    metrics: Dict[str, float] = field(default_factory=dict)
    missing: Tuple[str, ...] = ()   # best-effort states that failed (reported, not fatal)
    pending: Tuple[str, ...] = ()   # best-effort states still being written


class OnPreemption(_StrEnum):
    """What a run does when Ray drains a node that holds any of it with a deadline (a preemption
    notice; ``create(..., on_preemption=...)``).

    SAVE: copy that node's only copies away before the deadline, and ``save_if_preempted()`` (the
    integrations call it at each step boundary) saves at the next step whatever the cadence, and
    again each time the newest save is off the drained node (the default).
    EVACUATE: copy away only; no extra save. IGNORE: do nothing (the node's copies go with it)."""

    SAVE = "save"
    EVACUATE = "evacuate"
    IGNORE = "ignore"

    @classmethod
    def parse(cls, value: "OnPreemption | str") -> "OnPreemption":
        try:
            return value if isinstance(value, OnPreemption) else cls(value)
        except ValueError:
            raise ValueError(f"on_preemption must be 'save', 'evacuate' or 'ignore', got {value!r}") from None


@dataclass(frozen=True)
class PreemptionNotice:
    """A drain of nodes that hold part of this run, as ``engine.preemption()`` returns it.

    ``nodes``: the drained nodes (hex ids) that hold anything of the run (files of committed
    versions on their local tier, replica holders, writers); ``deadline``: unix time at which Ray
    may take the first of them (``inf``: the drain named no deadline); ``states``: the states whose
    newest stored parts were written on those nodes, with their ``ranks`` (the learners that will
    go); ``moved``: steps that got a copy elsewhere (the remote tier, else a replica on another
    node) since the notice; ``moving``: steps whose copy is under way; ``at_risk``: committed steps
    whose only copies are still on those nodes (``moving`` ones and those waiting their turn: what
    the node would take if it went now); ``lost``: steps that could not be moved in time, each with
    why (they are no longer listed once the node is gone); ``saved_step``: the newest step committed
    since the notice (``save_if_preempted`` saves again once it is no longer at risk)."""

    nodes: Tuple[str, ...]
    deadline: float
    noticed_at: float
    states: Tuple[str, ...] = ()
    ranks: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    moved: Tuple[int, ...] = ()
    moving: Tuple[int, ...] = ()
    lost: Dict[int, str] = field(default_factory=dict)
    saved_step: Optional[int] = None
    at_risk: Tuple[int, ...] = ()

    def seconds_left(self, now: Optional[float] = None) -> float:
        """Seconds until the deadline (negative once it passed; ``inf`` without one)."""
        import time

        return self.deadline - (time.time() if now is None else now)

    def to_dict(self) -> Dict[str, object]:
        """The form ``status()["preemption"]`` shows (node ids cut to 12 characters; a drain without
        a deadline has None for ``deadline`` and ``seconds_left``, so the dict is plain JSON)."""
        timed = self.deadline != float("inf")
        return {"nodes": [n[:12] for n in self.nodes], "deadline": self.deadline if timed else None,
                "seconds_left": round(self.seconds_left(), 1) if timed else None, "states": list(self.states),
                "ranks": {k: list(v) for k, v in self.ranks.items()}, "moved": list(self.moved),
                "moving": list(self.moving), "at_risk": list(self.at_risk), "lost": dict(self.lost),
                "saved_step": self.saved_step}

    def __str__(self) -> str:
        left = self.seconds_left()
        when = "no deadline" if left == float("inf") else f"{left:.0f}s left"
        out = [f"preemption notice: node(s) {', '.join(n[:12] for n in self.nodes)} drained, {when}"]
        if self.states:
            out.append(f"  states there: {', '.join(self.states)}")
        out.append(f"  moved: {list(self.moved) or '-'}; moving: {list(self.moving) or '-'}; "
                   f"still only on the drained node(s): {list(self.at_risk) or '-'}")
        for step, why in sorted(self.lost.items()):
            out.append(f"  lost step {step}: {why}")
        return "\n".join(out)
