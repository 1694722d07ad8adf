"""Format /4: single-agent replay buffers (``EpisodeReplayBuffer``, ``PrioritizedEpisodeReplayBuffer``)
saved incrementally, so that a save converts, and writes, only what changed since the previous one.
This module holds the format's names and tags, the per-buffer cache of the previous capture
(:class:`Incremental`) and the leaf encodings that capture and restore share (a record's bytes:
:mod:`.records`).

Two states, both registered ``append_only=True`` (``formats/segments.py``), so a version writes two
small files beside its new rows' segment, not one per kind of record (each file carries its own
Arrow schema and index):

``replay``       one row per stored timestep (the package docstring's layout), plus for prioritized
                 buffers ``prio`` / ``prio_k``: the row's sum-tree leaf *when the row was first
                 captured* (value as float64, type code in :data:`KINDS`). Never changes.
``replay_meta``  a log of *records*, each a nested state compressed against a dictionary
                 (:mod:`.records`) and cut into rows of :data:`CHUNK` bytes (columns ``row_id``,
                 ``blob``) beside plain scalars (the format, the buffer type, the row count, the next
                 ids, ``meta_at``, where the newest dictionary record lies: ``dict_at``/``dict_rows``).
                 A save appends up to five records, each starting on a row of its own:

                 * a *dictionary record* at the first save of a buffer (and when the meta record
                   compressed with it has grown to twice what it was then, and the dictionary
                   no longer halves it): a sample of this save's records, what the
                   records after it are compressed against. It stays live while a live record
                   after it (and before the next dictionary) needs it;

                 * an *episode batch*: the episodes that became done since the previous save, as the
                   columnar episode table of :mod:`.episode_parts` (RLlib only ever concatenates to
                   running episodes, so a done episode never changes). It leaves the live rows once
                   all its episodes are evicted;
                 * prioritized only, a *priority record*: the tree leaves that changed since the
                   previous save (``row``: the replay row ids, delta-coded; ``which``: 0 both trees /
                   1 the sum tree / 2 the min tree; ``v``; ``k``). The changes are recorded by wrapping
                   the buffer instance's ``update_priorities`` (the only RLlib path that changes a
                   stored row's leaf) and spot-checked against the trees each capture; a buffer whose
                   trees were replaced, or whose recorder is gone, is compared row by row once. When
                   the live records hold more than twice as many entries as the buffer has rows they
                   are compacted: one record with an entry per row whose leaves differ from its
                   ``prio`` replaces them all;
                 * a *static record* when what seldom changes did (the config, the spaces table, the
                   fields' structures, a subclass's extra attributes): live until the next one;
                 * the *meta record* (from row ``meta_at`` to the end; live in its own version only):
                   counters, sampling generator, metrics, the running episodes' table, the live
                   records' places and the trees' scalars.

                 The records of one save are written together, so that a version's own bytes are its
                 new rows' segment, one log segment and two index files. Episode batches, priority
                 records and meta records repeat most of their structure from save to save: against
                 the dictionary they cost what differs (the meta record ~0.35 KB instead of ~1.5 KB).

A restore turns the two back into the two-state form ``(replay, replay_meta)`` of format /1
(:func:`.incremental_restore.states_to_v1`) and restores that; it then seeds the caches so the next
save goes on appending to the same log. Format /3 (the same log without dictionaries) is read and
continued; format /2 (four states, written by earlier versions of this package) is not read.
Multi-agent buffers are saved in format /5 (:mod:`.incremental_multi_agent`): this log with *env
records* (kind :data:`ENV`) and, prioritized, *key-order records* (kind :data:`ORDER`,
:mod:`.key_order`) beside the others.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from .records import CHUNK, _encode, _raw
from .values import _kind_of, _type_name

META_FORMAT2 = "ray_ckpt.rllib.replay/2"  # four states; no longer read (its name is recognised)
META_FORMAT3 = "ray_ckpt.rllib.replay/3"  # records without a dictionary: read, no longer written
META_FORMAT4 = "ray_ckpt.rllib.replay/4"
META_FORMAT5 = "ray_ckpt.rllib.replay/5"  # multi-agent buffers: format /4's log with env-step records
LOG_FORMATS = (META_FORMAT3, META_FORMAT4, META_FORMAT5)
LOG_LAYOUT = "rllib_replay_log/1"
# the record kinds, as the first byte of a record's payload
EPISODES, PRIORITIES, META, STATIC, DICT, ENV, ORDER = 1, 2, 3, 4, 5, 6, 7
SAMPLE_LIMITS = (16384, 4096, 12288)  # a dictionary's sample: bytes of the episode batch, priorities, meta
STATIC_KEYS = ("config", "spaces", "extra_attrs", "module_counters")  # with the templates: a STATIC record
KINDS = ("float", "np:<f8", "np:<f4", "int", "np:<f2", "bool")  # a tree leaf's exact type, by code
_CODE = {k: i for i, k in enumerate(KINDS)}


@dataclass
class Incremental:
    """What the previous capture of one buffer produced, kept beside it (``RowIds.inc``)."""

    ids: np.ndarray                                 # row ids of the live rows, in order
    cols: Dict[str, np.ndarray]                     # every replay column of those rows (ids aside)
    sig: Dict[str, Tuple[Any, Tuple[int, ...]]]     # column -> (dtype, per-row shape)
    templates: Dict[str, Any]
    open_keys: Set[int] = field(default_factory=set)  # episodes that were running when captured
    max_key: int = -1                                 # highest episode index captured
    logged: Set[int] = field(default_factory=set)     # episode indices in the episodes log
    evicted: int = 0
    log: Dict[str, np.ndarray] = field(default_factory=dict)  # the log's live rows but the meta record
    batches: List[List[int]] = field(default_factory=list)  # [batch, highest episode index, first row, rows]
    next_chunk: int = 0
    next_batch: int = 0
    # prioritized
    leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # sv, sk, mv, mk per live row
    tree_to_row: Dict[int, np.ndarray] = field(default_factory=dict)  # per group: tree index -> row id, -1
    precs: List[List[int]] = field(default_factory=list)  # live priority records: [first row, rows, entries]
    static: List[int] = field(default_factory=list)  # the live static record: [first row, rows]
    static_raw: bytes = b""                           # its bytes before compression
    dicts: List[List[int]] = field(default_factory=list)  # live dictionary records [first row, rows], oldest first
    zdict: bytes = b""                                # the newest one's bytes: what records are compressed with
    refresh: bool = False                             # the next save writes a new dictionary
    dict_base: int = 0                                # the meta record's compressed bytes when it was written
    touched: List[Tuple[Any, List[int]]] = field(default_factory=list)  # (module id or None, tree indices)
    trees: Dict[int, Tuple[Any, ...]] = field(default_factory=dict)  # per group: (sum, min, their value lists)
    # multi-agent (format /5)
    ep_agents: Dict[int, List[int]] = field(default_factory=dict)   # episode index -> its agents' codes
    running_ma: Dict[int, Any] = field(default_factory=dict)        # running episode -> its own state
    env_keys: Optional[np.ndarray] = None                           # the live env-step index entries
    env_leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # their env-tree leaves (sv, sk, mv, mk)
    env_recs: List[List[int]] = field(default_factory=list)  # live env-step records: [first row, rows, top episode]
    next_env: int = 0                                        # the next env-step entry's cache id
    s2t_keys: Optional[np.ndarray] = None  # _sample_idx_to_tree_idx's keys in order (prioritized)
    s2t_recs: List[List[int]] = field(default_factory=list)  # live key-order records: [first row, rows, runs]

    @property
    def log_entries(self) -> int:
        """Entries in the live priority records."""
        return sum(n for _, _, n in self.precs)

    def append(self, kind: int, state: Any) -> Tuple[int, int]:
        """Append a record to the log: (its first row id, its rows)."""
        return self.append_raw(kind, _raw(state))

    def append_raw(self, kind: int, raw: bytes) -> Tuple[int, int]:
        """Append a record (compressed with the newest dictionary; a dictionary record without one)."""
        blob = _encode(kind, raw, zdict=None if kind == DICT else (self.zdict or None))
        m = len(blob)
        first = self.next_chunk
        add = {"row_id": np.arange(first, first + m, dtype=np.int64), "blob": blob}
        self.log = {k: np.concatenate([self.log[k], add[k]]) for k in add}
        self.next_chunk += m
        return first, m

    def keep_rows(self, spans: List[Tuple[int, int]]) -> None:
        """Keep only the log rows inside the [first, first + rows) spans (the live records) and the
        dictionaries they were compressed with: a record's is the newest dictionary before it."""
        starts = [d[0] for d in self.dicts]
        used = {len(self.dicts) - 1}
        for first, _ in spans:
            i = int(np.searchsorted(starts, first)) - 1
            if i >= 0:
                used.add(i)
        self.dicts = [d for i, d in enumerate(self.dicts) if i in used]
        spans = list(spans) + [tuple(d) for d in self.dicts]
        ids = self.log["row_id"]
        alive = np.zeros(len(ids), bool)
        for first, m in spans:
            alive |= (ids >= first) & (ids < first + m)
        if not alive.all():
            self.log = {k: v[alive] for k, v in self.log.items()}


def pack_ids(table: Dict[str, Any]) -> Dict[str, Any]:
    """An episode table with its ids as 16 bytes each when they are all RLlib's default (``uuid4().hex``:
    32 lowercase hex digits, which come back exactly), else as they are."""
    ids = table["id"]
    if not ids or not all(isinstance(x, str) and len(x) == 32 and _is_hex(x) for x in ids):
        return table
    out = {k: v for k, v in table.items() if k != "id"}
    out["id_hex"] = np.frombuffer(b"".join(bytes.fromhex(x) for x in ids), np.uint8).reshape(len(ids), 16)
    return out


def unpack_ids(table: Dict[str, Any]) -> Dict[str, Any]:
    if "id_hex" not in table:
        return table
    out = {k: v for k, v in table.items() if k != "id_hex"}
    out["id"] = [bytes(r).hex() for r in np.asarray(table["id_hex"], np.uint8).reshape(-1, 16)]
    return out


def _is_hex(x: str) -> bool:
    return all(c in "0123456789abcdef" for c in x)


def _empty_log() -> Dict[str, np.ndarray]:
    return {"row_id": np.empty(0, np.int64), "blob": np.empty((0, CHUNK), np.uint8)}


def _leaf_codes(tree: Any, tidx: np.ndarray, what: str) -> Tuple[np.ndarray, np.ndarray]:
    """(value as float64, type code) of the leaves ``tidx`` of ``tree``."""
    if len(tidx) == 0:
        return np.empty(0, np.float64), np.empty(0, np.int8)
    got = operator.itemgetter(*(tidx + tree.capacity).tolist())(tree.value)
    vals = list(got) if len(tidx) > 1 else [got]
    # per distinct type, not per leaf (a save reads ~1000 leaves, nearly always of one or two types)
    types = list(map(type, vals))
    code_of: Dict[type, int] = {}
    for t in set(types):
        try:
            code_of[t] = _CODE[_kind_of(vals[types.index(t)])]
        except (TypeError, KeyError):
            code_of[t] = -1
    if min(code_of.values()) < 0:
        i = next(i for i, t in enumerate(types) if code_of[t] < 0)
        raise UnsupportedTypeError(f"replay buffer: {what} leaf {int(tidx[i])} is a {_type_name(vals[i])} "
                                   f"(stored: {', '.join(KINDS)})")
    if len(code_of) == 1:
        codes = np.full(len(vals), next(iter(code_of.values())), np.int8)
    else:
        codes = np.fromiter(map(code_of.__getitem__, types), np.int8, len(types))
    return np.array(vals, np.float64), codes
