"""Engine configuration: one dataclass, validated at ``create()`` before anything is started."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

from .storage.layout import join_uri, validate_name
from .storage.retention import RetentionPolicy
from .storage.tier import Tier
from .types import OnPreemption

CHECK_ENV = "RAY_CKPT_OVERLAP_CHECK"


def check_enabled() -> bool:
    """Whether the overlapped copies' debug check (checksums before, in and after the copy) is on
    in this process: the default of ``EngineConfig.overlap_check``."""
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class EngineConfig:
    run: str
    local_dir: str
    remote_uri: Optional[str] = None
    remote_options: Optional[Dict[str, Any]] = field(default=None, repr=False)  # S3: endpoint_override, keys
    critical_writers: int = 2
    best_effort_writers: int = 1
    critical_cpus: float = 0.25
    # how long a node's critical writers may take to be placed on it; past that (no CPU left there)
    # the node's parts are written by the coordinator node's writers, reading over the network
    writer_placement_s: float = 20.0
    best_effort_cpus: float = 0.1
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_best: Optional[Tuple[str, str, int]] = None
    remote_keep_last: Optional[int] = None
    remote_keep_every: Optional[int] = None
    remote_keep_best: Optional[Tuple[str, str, int]] = None
    remote_every: int = 1
    max_in_flight: int = 2
    compression: Optional[str] = None  # Arrow IPC buffer compression: None | "zstd" | "lz4"
    write_threads: int = 2  # threads per writer for one large file (block-parallel write + checksum)
    direct_io: bool = True  # large local files bypass the page cache (O_DIRECT), where the filesystem allows
    # OS priority (nice, every thread) of the critical path's background processes -- the critical
    # writers, the coordinator and the run's snapshot mailbox: below training, above best-effort
    critical_nice: int = 5
    best_effort_nice: int = 10
    best_effort_max_mb_s: Optional[float] = None  # best-effort writers' local writes, MB/s (None: no limit)
    upload_max_mb_s: Optional[float] = None  # each writer's uploads to the remote tier, MB/s (None: no limit)
    prefault_object_store: bool = False  # providers map Ray's whole object store once (shorter pauses, more RAM)
    # providers map only the object-store pages their first saves use (~2 snapshots' bytes) ahead of
    # the first save, so that it is as fast as later ones (see object_store.prefault_needed)
    prefault_needed: bool = True
    # snapshots copied into the object store in the background while the learner goes on; fences
    # (optimizer step pre-hooks, BatchNorm forward pre-hooks, rc.fence(name)) wait before a change
    overlap: bool = False
    # debug: checksum every overlapped copy against its source after the copy; a torn one fails the
    # version (default: the RAY_CKPT_OVERLAP_CHECK environment variable of the creating process)
    overlap_check: Optional[bool] = None
    upload_retries: int = 1  # per upload call; the coordinator retries with backoff on top
    rank_timeout_s: float = 600.0  # a pushed version fails if a rank's part has not arrived by then
    # manifests carry an HMAC-SHA256 under this key and unsigned or mis-signed ones are refused
    # (default: the creating process's environment, see ``signing_key_from_env``). A list is a key
    # ring, so keys rotate without losing the versions signed before: the first key signs, every
    # key verifies
    signing_key: Union[None, bytes, Tuple[bytes, ...]] = field(default=None, repr=False)
    # each committed version's critical files also held in the memory of this many replica holders,
    # each on another node than the one that wrote the file (restore reads local -> peer -> remote)
    peer_replicas: int = 0
    peer_keep: int = 2  # versions each holder keeps (the newest)
    # each holder's memory budget; what does not fit spills to its node's local disk (None: a tenth
    # of the node's physical memory)
    peer_memory_mb: Optional[float] = None
    # a node label naming the failure domain (e.g. "zone"): replicas go to nodes whose value differs
    peer_domain_label: Optional[str] = None
    # what a preemption notice (Ray drains a node of the run with a deadline) does: "save" copies the
    # node's only copies away and lets save_if_preempted() save at the next step (and again once
    # that save is off the node: client/preemption.py); "evacuate" only copies;
    # "ignore" does neither (see coordinator/evacuation.py)
    on_preemption: str = "save"
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.signing_key = signing_key_from_env() if self.signing_key is None else _key_or_ring(self.signing_key)
        validate_name(self.run, "run name")
        if not isinstance(self.local_dir, str) or not self.local_dir:
            raise ValueError(f"local_dir must be a directory path or file:// URI, got {self.local_dir!r}")
        for name in ("critical_writers", "max_in_flight", "remote_every", "write_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.best_effort_writers, int) or self.best_effort_writers < 0:
            raise ValueError(f"best_effort_writers must be an integer >= 0, got {self.best_effort_writers!r}")
        for name in ("best_effort_max_mb_s", "upload_max_mb_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a number > 0 (MB/s) or None, got {v!r}")
        for name, low in (("peer_replicas", 0), ("peer_keep", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        v = self.peer_memory_mb
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise ValueError(f"peer_memory_mb must be a number >= 0 (MB) or None, got {v!r}")
        if self.peer_domain_label is not None and (not isinstance(self.peer_domain_label, str)
                                                   or not self.peer_domain_label):
            raise ValueError(f"peer_domain_label must be a node label's name or None, got {self.peer_domain_label!r}")
        if self.overlap_check is None:
            self.overlap_check = check_enabled()
        for name in ("direct_io", "prefault_object_store", "prefault_needed", "overlap", "overlap_check"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.on_preemption = OnPreemption.parse(self.on_preemption)
        if self.compression not in (None, "zstd", "lz4"):
            raise ValueError(f"compression must be None, 'zstd' or 'lz4', got {self.compression!r}")
        self.local_policy()  # validates retention arguments
        self.remote_policy()

    @property
    def may_hold_replicas(self) -> bool:
        """Whether replica holders may hold copies of this run's files: with ``peer_replicas``, and
        wherever a preemption notice may evacuate to a holder on a node that stays (without a remote
        tier; with one, the newest version whose upload lags: ``coordinator/evacuation.py``). Readers
        then ask the holders before the remote tier; ``shutdown()`` stops them."""
        return self.peer_replicas > 0 or self.on_preemption != OnPreemption.IGNORE

    def local_policy(self) -> RetentionPolicy:
        return RetentionPolicy(self.keep_last, self.keep_every, self.keep_best)

    def remote_policy(self) -> RetentionPolicy:
        if self.remote_keep_last is None and self.remote_keep_every is None and self.remote_keep_best is None:
            return self.local_policy()
        return RetentionPolicy(self.remote_keep_last, self.remote_keep_every, self.remote_keep_best)

    def local_root(self, node_id: Optional[str] = None) -> str:
        """The run's root on the local tier: ``local_dir`` (``{node_id}`` replaced by the first 12
        characters of ``node_id``, by default this process's Ray node) joined with the run name."""
        return join_uri(self.local_base(node_id), self.run)

    def remote_root(self) -> Optional[str]:
        """The run's root on the remote tier: the run name appended to the URI's path, before any
        ``?query`` settings (``s3://b/p?endpoint_override=h:9000&scheme=http`` ->
        ``s3://b/p/<run>?endpoint_override=h:9000&scheme=http``); None without a remote tier."""
        return join_uri(self.remote_uri, self.run) if self.remote_uri else None

    def local_base(self, node_id: Optional[str] = None) -> str:
        """``local_dir`` with ``{node_id}`` resolved as in :meth:`local_root` (without the run)."""
        base = self.local_dir
        if "{node_id}" in base:
            if node_id is None:
                import ray

                node_id = ray.get_runtime_context().get_node_id()
            base = base.replace("{node_id}", node_id[:12])
        return base

    def local_tier(self) -> Tier:
        return Tier(self.local_root(), "local")

    def remote_tier(self) -> Optional[Tier]:
        root = self.remote_root()
        return Tier(root, "remote", self.remote_options) if root else None


SIGNING_KEY_ENV = "RAY_CKPT_SIGNING_KEY"
VERIFY_KEYS_ENV = "RAY_CKPT_VERIFY_KEYS"


def signing_key_from_env() -> Union[None, bytes, Tuple[bytes, ...]]:
    """The key ring the environment gives: ``RAY_CKPT_SIGNING_KEY`` signs (and verifies), and
    ``RAY_CKPT_VERIFY_KEYS``, older keys separated by commas, still verify (a rotation in progress).
    The engine's default and what every ``ray-ckpt`` command checks manifests with. A key holding a
    comma goes through the API's list instead."""
    key = os.environ.get(SIGNING_KEY_ENV) or None
    older = [k for k in os.environ.get(VERIFY_KEYS_ENV, "").split(",") if k.strip()]
    if older and key is None:
        raise ValueError(f"{VERIFY_KEYS_ENV} is set but {SIGNING_KEY_ENV} is not: the first key of a ring signs; "
                         f"set {SIGNING_KEY_ENV} to the current key")
    return _key_or_ring([key] + [k.strip() for k in older]) if key is not None else None


def _key_or_ring(key: Any) -> Union[None, bytes, Tuple[bytes, ...]]:
    """A signing key as bytes, a key ring (list or tuple, the first signs) as a tuple of bytes."""
    def one(k: Any) -> bytes:
        k = k.encode() if isinstance(k, str) else k
        if not isinstance(k, bytes) or not k:
            raise ValueError("signing_key must be non-empty bytes or str, a list of them (a key ring: the "
                             "first signs, all verify), or None")
        return k

    if key is None:
        return None
    if isinstance(key, (list, tuple)):
        if not key:
            raise ValueError("signing_key: an empty key ring; give at least one key (or None)")
        ring = tuple(one(k) for k in key)
        return ring[0] if len(ring) == 1 else ring
    return one(key)
