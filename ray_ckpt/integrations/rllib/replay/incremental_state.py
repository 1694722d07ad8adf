"""Format /2: single-agent replay buffers (``EpisodeReplayBuffer``, ``PrioritizedEpisodeReplayBuffer``)
saved incrementally, so that a save converts, and writes, only what changed since the previous one.
This module holds the format's names and tags, the per-buffer cache of the previous capture
(:class:`Incremental`), and the blob and leaf encodings that capture and restore share.

Four states (all but ``replay_meta`` registered ``append_only=True``, see ``formats/segments.py``):

``replay``            one row per stored timestep (the package docstring's layout), plus for prioritized
                      buffers ``prio`` / ``prio_k``: the row's sum-tree leaf *when the row was first
                      captured* (value as float64, type code in :data:`KINDS`). Never changes.
``replay_episodes``   a log of the episodes that are done (RLlib only ever concatenates to running
                      episodes, so a done episode never changes): each capture appends one *batch*
                      holding the episodes that became done since the previous one, as the columnar
                      episode table of :mod:`.episode_parts` serialised with ray_ckpt's own safetensors
                      format and cut into rows of :data:`CHUNK` bytes (``row_id``, ``batch``,
                      ``blob``). A batch leaves the live set once all its episodes are evicted.
``replay_priorities`` prioritized only: a change log of tree leaves (``row``: the replay row id,
                      ``which``: 0 both trees / 1 the sum tree / 2 the min tree, ``v``, ``k``), one
                      entry per leaf that changed since the previous capture. The changes are
                      recorded by wrapping the buffer instance's ``update_priorities`` (the only
                      RLlib path that changes a stored row's leaf) and spot-checked against the
                      trees each capture; a buffer whose trees were replaced, or whose recorder is
                      gone, is compared row by row once. When the log holds more than twice as many
                      entries as the buffer has rows it is compacted: one entry per row whose leaves
                      differ from its ``prio``, under new ids (the older entries leave the live set).
``replay_meta``       small, written whole: the format, the buffer type, the row count, the next ids
                      of the rows and the two logs (read to decide whether a buffer's ids are the
                      run's, :func:`.algorithm._row_floor`), and ``packed``: config, counters, sampling
                      generator, metrics, the spaces table, the running episodes' table, the live
                      batches and the trees' scalars, as one zlib-compressed safetensors blob (it is
                      mostly structure JSON, most of it the metrics logger's windows).

A restore turns the four back into the two-state form ``(replay, replay_meta)`` of format /1
(:func:`.incremental_restore.states_to_v1`) and restores that; it then seeds the caches so the next
save goes on appending to the same logs. Multi-agent buffers are saved in format /1
(:mod:`.multi_agent`).
"""
from __future__ import annotations

import io
import operator
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from ....errors import RestoreError, UnsupportedTypeError
from .values import _kind_of, _type_name

REPLAY_EPISODES = "replay_episodes"
REPLAY_PRIORITIES = "replay_priorities"
META_FORMAT2 = "ray_ckpt.rllib.replay/2"
EPISODE_LOG = "rllib_episode_log/1"
PRIORITY_LOG = "rllib_priority_log/1"
CHUNK = 256  # bytes of a serialised episode batch per row of ``replay_episodes``
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
    ep_log: Dict[str, np.ndarray] = field(default_factory=dict)
    batches: List[List[int]] = field(default_factory=list)  # [batch, highest episode index in it]
    next_chunk: int = 0
    next_batch: int = 0
    # prioritized
    leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # sv, sk, mv, mk per live row
    tree_to_row: Optional[np.ndarray] = None
    plog: Dict[str, np.ndarray] = field(default_factory=dict)
    next_log: int = 0
    touched: List[List[int]] = field(default_factory=list)
    trees: Tuple[Any, ...] = ()


def _empty_ep_log() -> Dict[str, np.ndarray]:
    return {"row_id": np.empty(0, np.int64), "batch": np.empty(0, np.int64), "blob": np.empty((0, CHUNK), np.uint8)}


def _empty_plog() -> Dict[str, np.ndarray]:
    return {"row_id": np.empty(0, np.int64), "row": np.empty(0, np.int64), "which": np.empty(0, np.int8),
            "v": np.empty(0, np.float64), "k": np.empty(0, np.int8)}


def _leaf_codes(tree: Any, tidx: np.ndarray, what: str) -> Tuple[np.ndarray, np.ndarray]:
    """(value as float64, type code) of the leaves ``tidx`` of ``tree``."""
    if len(tidx) == 0:
        return np.empty(0, np.float64), np.empty(0, np.int8)
    got = operator.itemgetter(*(tidx + tree.capacity).tolist())(tree.value)
    vals = list(got) if len(tidx) > 1 else [got]
    codes = np.empty(len(vals), np.int8)
    kind_of: Dict[type, int] = {}
    for i, x in enumerate(vals):
        t = type(x)
        c = kind_of.get(t)
        if c is None:
            try:
                c = kind_of[t] = _CODE[_kind_of(x)]
            except (TypeError, KeyError):
                raise UnsupportedTypeError(f"replay buffer: {what} leaf {int(tidx[i])} is a {_type_name(x)} "
                                           f"(stored: {', '.join(KINDS)})") from None
        codes[i] = c
    return np.array(vals, np.float64), codes


def _encode(state: Any, width: int = CHUNK) -> np.ndarray:
    """A nested state as rows of ``width`` bytes: an 8-byte length, then ray_ckpt's safetensors bytes
    of it, zlib-compressed (an episode table is mostly the structure's JSON: it compresses ~5x)."""
    from ....formats import safetensors_io
    from ....formats.tree import flatten
    sink = io.BytesIO()
    safetensors_io.write(flatten(state, state_name=REPLAY_EPISODES), sink)
    packed = zlib.compress(sink.getvalue(), 6)
    raw = len(packed).to_bytes(8, "little") + packed
    raw += b"\0" * (-len(raw) % width)
    return np.frombuffer(raw, np.uint8).reshape(-1, width)


def _decode(rows: np.ndarray, where: str) -> Any:
    from ....formats import safetensors_io
    from ....formats.tree import unflatten
    raw = np.ascontiguousarray(rows).reshape(-1).tobytes()
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise RestoreError(f"{where}: says {n} bytes but has {len(raw) - 8}")
    try:
        data = zlib.decompress(raw[8:8 + n])
    except zlib.error as exc:
        raise RestoreError(f"{where}: {exc}") from None
    structure, views = safetensors_io.read(bytearray(data), path=where)
    return unflatten(structure, views, [])
