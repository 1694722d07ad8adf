"""Stable row ids of one buffer across saves (how they are derived: the package docstring), kept beside
the buffer in a weak map so that each save converts only the index-list keys added since the last.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from ..base.names import log
from .episode_parts import _EpisodeParts
from ..journal.growth import appended, count, kept, positions, survivors
from .values import _Spaces, _type_name


class _IndexList:
    """The cached keys of one RLlib index list (``_indices``, or one module's ``_module_to_indices``)
    as of the last save, with their row ids: only the keys added since are converted each save."""

    def __init__(self, width: int):
        self.keys = np.empty((0, width), np.int64)
        self.ids = np.empty(0, np.int64)


class RowIds:
    """Row ids of one buffer across saves (see the package docstring). Kept beside the buffer in a
    weak map (:func:`row_ids_of`); seeded by :func:`.two_state.restore_replay`."""

    def __init__(self) -> None:
        self.lists: Dict[Any, _IndexList] = {}
        self.next_id = 0
        self.agents: List[Any] = []        # agent id table (multi-agent); codes are positions
        self.modules: List[Any] = []
        self._agent_code: Dict[Any, int] = {}
        self._module_code: Dict[Any, int] = {}
        self.full_rewrites = 0
        self.spaces = _Spaces()  # append-only table of the spaces met so far (codes stay valid)
        # (episode, agent) -> (episode object, its parts) of the last capture: a done episode never
        # changes (RLlib only concatenates to running ones), so its parts are reused, not re-split
        self.parts: Dict[Tuple[int, int], Tuple[Any, "_EpisodeParts"]] = {}
        self.restored_from: Optional[Tuple[str, int]] = None  # (run, version) restore_replay read
        self.checked_run: Optional[str] = None  # the run whose newest version these ids were checked against
        self.inc: Any = None  # single-agent buffers: the incremental_state.Incremental of the last capture
        self.floors: Optional[Dict[str, int]] = None  # where the replay_meta log's ids start anew

    def renumber(self, floor: int, floors: Optional[Dict[str, int]] = None) -> None:
        """Forget every row's id: the next capture gives all rows new ids, at or above ``floor`` (and
        writes the replay_meta log anew, its ids at or above ``floors``)."""
        self.lists.clear()
        self.next_id = max(self.next_id, int(floor))
        self.full_rewrites += 1
        inc = self.inc
        self.floors = {"chunk": max(int((floors or {}).get("chunk", 0)), inc.next_chunk if inc else 0)}
        self.inc = None

    def agent_code(self, aid: Any) -> int:
        return _code(self._agent_code, self.agents, aid)

    def module_code(self, mid: Any) -> int:
        return _code(self._module_code, self.modules, mid)

    def seed(self, agents: List[Any], modules: List[Any], next_id: int) -> None:
        for a in agents:
            self.agent_code(a)
        for m in modules:
            self.module_code(m)
        self.next_id = int(next_id)

    def update(self, name: Any, current: List[tuple], width: int, encode: Callable[[tuple], tuple],
               evicted: int) -> Tuple[np.ndarray, np.ndarray, Optional[int]]:
        """(keys (n, width), ids, known) of ``current``: where ``known`` is a number the ids are
        those of the first ``known`` keys (every later key is new), else (None) one per key, -1 for
        a new one."""
        lst = self.lists.setdefault(name, _IndexList(width))
        # the survivors as views (RLlib evicts oldest first), the new keys appended after them: no
        # copy of every key each save (.growth)
        sel = survivors(lst.keys[:, 0] >= evicted)
        s = count(sel)
        ends = lst.keys[positions(sel, np.array([0, s - 1]))] if s else None  # the first and last survivors
        ok = len(current) >= s and (s == 0 or (tuple(encode(current[0])) == tuple(ends[0])
                                               and tuple(encode(current[s - 1])) == tuple(ends[1])))
        if ok:
            tail = current[s:]
            new = np.array([encode(x) for x in tail], np.int64).reshape(len(tail), width)
            return kept(lst.keys, sel, new), lst.ids[sel], s
        # slow path: the list changed other than by RLlib's add (appends + evictions)
        allk = np.array([encode(x) for x in current], np.int64).reshape(len(current), width)
        known = {tuple(k): i for k, i in zip(lst.keys.tolist(), lst.ids.tolist())}
        got = np.array([known.get(tuple(k), -1) for k in allk.tolist()], np.int64)
        unknown = np.flatnonzero(got < 0)
        if len(unknown) and (unknown[0] != len(got) - len(unknown) or np.any(np.diff(got[got >= 0]) <= 0)):
            self.full_rewrites += 1
            log.warning("ray_ckpt: replay buffer index list %r was changed other than by appends and evictions: "
                        "all its %d rows get new row ids (this save rewrites them)", name, len(got))
            got[:] = -1
        return allk, got, None

    def commit(self, name: Any, keys: np.ndarray, ids: np.ndarray) -> None:
        lst = self.lists[name]
        lst.keys, lst.ids = keys, ids


_TRACKERS: "weakref.WeakKeyDictionary[Any, RowIds]" = weakref.WeakKeyDictionary()


def row_ids_of(buffer: Any) -> RowIds:
    """The row-id state kept for ``buffer`` (created empty on first use)."""
    try:
        return _TRACKERS.setdefault(buffer, RowIds())
    except TypeError:  # pragma: no cover - an unhashable / not weak-referenceable subclass
        raise UnsupportedTypeError(f"replay buffer of type {_type_name(buffer)} cannot be tracked (no weakref)")


def _update_ids(rid: RowIds, buffer: Any, lists: List[Tuple[Any, List[tuple], int, Callable]], evicted: int,
                added: int) -> Tuple[np.ndarray, np.ndarray]:
    """Keys and ids of the rows of ``lists`` (concatenated; new keys get new ids, list by list)."""
    got = [(name, *rid.update(name, cur, width, enc, evicted)) for name, cur, width, enc in lists]
    n_new = sum(len(keys) - known if known is not None else int(np.sum(ids < 0)) for _, keys, ids, known in got)
    start = max(rid.next_id, added - n_new)
    out_k, out_i = [], []
    for name, keys, ids, known in got:
        if known is not None:  # the known keys' ids, then new ones
            k = len(keys) - known
            ids = appended(ids, np.arange(start, start + k, dtype=np.int64))
        else:
            new = ids < 0
            k = int(np.sum(new))
            ids = ids.copy()
            ids[new] = np.arange(start, start + k, dtype=np.int64)
        start += k
        rid.commit(name, keys, ids)
        out_k.append(keys)
        out_i.append(ids)
    rid.next_id = start
    if len(out_k) == 1:  # one index list (single-agent): its arrays, not copies
        return out_k[0], out_i[0]
    keys = np.concatenate(out_k) if out_k else np.empty((0, 2), np.int64)
    ids = np.concatenate(out_i) if out_i else np.empty(0, np.int64)
    return keys, ids


def _code(codes: Dict[Any, int], order: List[Any], key: Any) -> int:
    """``key``'s small integer code, given in order of first use (``order[code] == key``)."""
    c = codes.get(key)
    if c is None:
        c = codes[key] = len(order)
        order.append(key)
    return c
