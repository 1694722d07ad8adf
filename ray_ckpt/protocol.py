"""The messages that cross an actor boundary, as frozen dataclasses.

Engine, coordinator, writers and provider actors talk only through these records (Ray pickles
them like any other argument): no field is read from a dict by a string key on the other side, and
a field one side computes reaches the other or is not computed. The call order they belong to is
spelled out at the top of ``coordinator/actor.py``.

    engine      --PartPlan-->          coordinator    save(): what each snapshot ref is
    engine      --Declaration-->       coordinator    register(world_size=N): a state ranks push
    coordinator --(ref, reuse)-->      writer         write_part()
    writer      --WrittenPart-->       coordinator    the files one part became
    coordinator --SubmitAck-->         engine         submit(): a rank's part accepted (not committed)
    engine      --[PushedPart]-->      coordinator    submit_parts(): ranks' parts pushed in one call
    coordinator --SubmitBatchResult--> engine         which entries of that call were refused
    coordinator --SaveOutcome-->       engine         a version's outcome on one tier (-> SaveResult)
    coordinator --CoordinatorStatus--> engine         status()
    coordinator --StoredState-->       engine         load() / load_into(): one state's manifest entry
    provider    --StagedState-->       engine         restore(): a state read and verified in the actor

A part with DTensor leaves carries its :class:`ShardRecord` in ``WrittenPart.shards``. That record
(and its :class:`ShardHead`) is defined in ``formats.shard_record``, because the storage layer that
builds it may not import this module; it is named here as one of the messages.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Tuple

from .errors import InvalidSaveError
from .formats.manifest import FileEntry, StateEntry
from .formats.shard_record import ShardHead, ShardRecord  # noqa: F401 (messages named here)
from .types import SaveResult, Strategy

NAMESPACE = "ray_ckpt"  # the Ray namespace of a run's named actors (coordinator, mailbox)


def actor_name(run: str) -> str:
    """The name of a run's coordinator actor."""
    return f"ray_ckpt.coordinator.{run}"


@dataclass(frozen=True)
class PartPlan:
    """One part of a save as the engine plans it: a snapshot ref follows it, unless ``loader``."""

    name: str
    strategy: Strategy
    rank: int = 0
    nbytes: int = 0           # bytes of an in-process snapshot (0: not known to the driver)
    loader: bool = False      # a RELOADABLE state rebuilt by its loader: no bytes, no ref
    replicated: bool = False  # DDP-style replicas: rank 0's copy is the one stored
    append_only: bool = False  # a buffer that only grows: rows added since the last version (formats.segments)


@dataclass(frozen=True)
class Declaration:
    """A state that ``world_size`` rank actors push themselves with ``engine.submit``."""

    name: str
    strategy: Strategy
    world_size: int
    replicated: bool = False
    allow_pickle: bool = False
    append_only: bool = False

    def to_json(self) -> Dict[str, Any]:
        d = {"strategy": self.strategy.value, "world_size": self.world_size,
             "replicated": self.replicated, "allow_pickle": self.allow_pickle}
        if self.append_only:  # absent otherwise: declarations stay what earlier versions wrote
            d["append_only"] = True
        return d

    @classmethod
    def from_json(cls, name: str, d: Dict[str, Any]) -> "Declaration":
        return cls(name, Strategy.parse(d["strategy"]), int(d["world_size"]), bool(d.get("replicated", False)),
                   bool(d.get("allow_pickle", False)), bool(d.get("append_only", False)))

    def parts(self) -> Tuple[PartPlan, ...]:
        ranks = [0] if self.replicated else range(self.world_size)
        return tuple(PartPlan(self.name, self.strategy, r, replicated=self.replicated, append_only=self.append_only)
                     for r in ranks)


@dataclass(frozen=True)
class WrittenPart:
    """What a writer made of one (state, rank) part."""

    files: Tuple[FileEntry, ...]
    written: int                          # bytes written now (0 when ``reused``)
    content_hash: Optional[str] = None    # RELOADABLE: the digest that lets later versions reuse it
    reused: bool = False                  # referred to an older version's files instead of writing
    node: str = ""                        # the node whose local tier holds the files
    snapshot_wait_s: float = 0.0          # the writer's wait for the snapshot to be ready
    write_s: float = 0.0                  # serialise + checksum + fsync
    shards: Optional[ShardRecord] = None  # a part with DTensor leaves: its chunks and header (checkpoint_io.shard_record)
    # written by a writer process Ray restarted (killed, then its call retried): the killed try may
    # have left temporary files in the version, which the coordinator then removes
    after_restart: bool = False

    def with_node(self, node: str, snapshot_wait_s: float, after_restart: bool = False) -> "WrittenPart":
        return dataclasses.replace(self, node=node, snapshot_wait_s=snapshot_wait_s, after_restart=after_restart)


@dataclass(frozen=True)
class SaveOutcome:
    """A version committed on one tier, as the coordinator knows it; becomes the user's SaveResult."""

    version: int
    step: int
    durability: str                       # "local" | "replicated" | "remote"
    bytes_written: int
    states: Tuple[str, ...] = ()
    seconds: float = 0.0                  # from the coordinator accepting the version to this commit
    stages: Dict[str, float] = field(default_factory=dict)
    missing: Tuple[str, ...] = ()         # best-effort states that failed (reported, not fatal)
    pending: Tuple[str, ...] = ()         # best-effort states still being written at the commit
    rank_zero_only: bool = False          # a replica rank's push: rank 0's copy is the one stored

    def result(self) -> SaveResult:
        return SaveResult(self.version, self.step, self.bytes_written, self.durability, self.states,
                          self.seconds, dict(self.stages), self.missing, self.pending, self.rank_zero_only)


@dataclass(frozen=True)
class SubmitAck:
    """A rank's part accepted and sent to a writer (``coordinator.submit`` returns at once with it;
    the commit is learnt through ``coordinator.wait``, one call per version and process)."""

    version: int
    rank_zero_only: bool = False          # a replica rank's push: nothing stored, rank 0's copy is


@dataclass(frozen=True)
class PartStatus:
    state: str
    rank: int
    status: str                           # pending | written | failed


@dataclass(frozen=True)
class VersionStatus:
    version: int
    step: Optional[int]
    stage: str                            # "writing (k/n parts)" | "committed" | "failed"
    parts: Tuple[PartStatus, ...] = ()
    upload: Optional[str] = None          # "uploading" (+ the last error) while an upload is owed


@dataclass(frozen=True)
class CoordinatorStatus:
    run: str
    in_flight: Tuple[VersionStatus, ...]
    queued_bytes_critical: int
    queued_bytes_best_effort: int
    committed: int
    remote_committed: int
    commits: int
    failures: int
    last_error: Optional[str]
    started_at: float
    node: str
    writer_nodes: Dict[str, int]
    upload_owed: bool
    skipped_versions: Dict[int, str] = field(default_factory=dict)  # found in storage, not trusted: why
    # nodes where no critical writer could be placed (their parts are written elsewhere): why
    unplaced_writers: Dict[str, str] = field(default_factory=dict)
    # peer replicas (create(..., peer_replicas=N)): version -> the nodes whose holders have its files
    replicas: Dict[int, Tuple[str, ...]] = field(default_factory=dict)
    # listed versions held by fewer peer replicas than asked (a send failed, no node to hold a copy,
    # a replica that failed verification): version -> why
    replica_problems: Dict[int, str] = field(default_factory=dict)
    # a preemption notice (coordinator/evacuation.py): the one in force, else the last (None: never)
    preemption: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        """The form ``engine.status()`` returns to users (a dict a person or a dashboard reads)."""
        in_flight: Dict[int, Dict[str, Any]] = {}
        for v in self.in_flight:
            d: Dict[str, Any] = {"stage": v.stage}
            if v.step is not None:  # a version still being written (not only an upload)
                d["step"] = v.step
                d["parts"] = {f"{p.state}/rank{p.rank}": p.status for p in v.parts}
            if v.upload is not None:
                d["remote"] = v.upload
            in_flight[v.version] = d
        return {"run": self.run, "in_flight": in_flight,
                "queued_bytes": {"critical": self.queued_bytes_critical, "best_effort": self.queued_bytes_best_effort},
                "committed": self.committed, "remote_committed": self.remote_committed, "commits": self.commits,
                "failures": self.failures, "last_error": self.last_error, "started_at": self.started_at,
                "node": self.node, "writer_nodes": dict(self.writer_nodes), "upload_owed": self.upload_owed,
                "skipped_versions": dict(self.skipped_versions), "unplaced_writers": dict(self.unplaced_writers),
                "replicas": {v: list(nodes) for v, nodes in self.replicas.items()},
                "replica_problems": dict(self.replica_problems), "preemption": self.preemption}


@dataclass(frozen=True)
class StagedState:
    """A state read and verified inside its provider actor, held there until the restore applies it."""

    ok: bool
    tier: Optional[str] = None
    detail: str = ""
    bytes: int = 0
    unreadable: bool = False  # no tier held a copy of one of its files that verified (storage: NoGoodCopy)


@dataclass(frozen=True)
class StoredState:
    """One state of a committed version, as ``load`` / ``load_into`` need it: the version, its step,
    the names of all its states (for a clear error) and the one entry asked for (None if absent).

    Why not the whole manifest: a version pushed by thousands of ranks has a manifest of megabytes
    (~176 bytes per part); a rank loading its states one by one would fetch and parse all of it once
    per state. This carries one state's entry: a process loading every state of a version moves
    about one manifest's bytes in all."""

    version: int
    step: int
    names: Tuple[str, ...]
    entry: Optional[StateEntry]


def checked_metrics(metrics: Optional[Dict[str, float]]) -> Dict[str, float]:
    """A version's metrics (``save(metrics=...)``, ``submit(metrics=...)``) checked before anything
    is sent: a dict of str -> finite number (they go into the manifest's JSON and rank versions for
    ``keep_best``)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise InvalidSaveError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidSaveError(f"metrics must map str -> finite number; bad entry {k!r}: {v!r}")
        out[k] = float(v)
    return out


class PushedPart(NamedTuple):
    """One rank's part inside a ``submit_parts`` call (a tuple on the wire: cheap to serialise).
    ``ref`` is the snapshot's ObjectRef (None for a replica rank, whose rank 0 stores the copy);
    ``upload`` and ``after`` as ``coordinator.submit`` documents them; ``metrics``: the version's
    metrics (``submit(..., metrics=...)``), merged into its manifest (what ``keep_best`` ranks)."""

    name: str
    rank: int
    ref: Optional[Any]
    nbytes: int
    upload: bool
    after: int
    metrics: Optional[Dict[str, float]] = None


@dataclass(frozen=True)
class SubmitBatchResult:
    """The coordinator's answer to one ``submit_parts`` call: ``rejected`` maps the index of each
    refused entry to its error (the same text ``submit`` raised for it alone); every other entry
    was accepted and sent to a writer."""

    version: int
    rejected: Dict[int, str] = field(default_factory=dict)
