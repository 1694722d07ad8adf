"""A single-agent buffer captured incrementally into the two states of format /4
(:mod:`.incremental_state`): a save splits only the running episodes and those added since the
previous one, gathers only the new rows, and appends to the log only the newly done episodes, the
changed leaves and the meta.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from ..base.names import REPLAY, REPLAY_META, log
from .buffers import _Kind, _attributes, buffer_kind, common_meta, extra_attrs, handled_attrs
from .episode_parts import LAYOUT, _EpisodeParts, _int32, _split_episode, _table
from ..journal.growth import count, kept, same_rows, survivors
from .incremental_priorities import _hook, _priorities, _priority_record, _priority_scalars, touched_by_group
from .incremental_state import (CHUNK, DICT, EPISODES, LOG_LAYOUT, META, META_FORMAT4, PRIORITIES, SAMPLE_LIMITS,
                                STATIC, STATIC_KEYS, Incremental, _empty_log, _encode, _raw, pack_ids)
from .records import _decode_raw, sample_of
from .row_ids import RowIds, _update_ids
from .values import _type_name


def capture_states(buffer: Any, rid: RowIds) -> Dict[str, Any]:
    """The states of a single-agent buffer (names: ``replay``, ``replay_meta``); advances the buffer's
    caches (``rid``)."""
    kind = buffer_kind(buffer)
    if kind.multi_agent:
        raise TypeError("capture_states is for single-agent buffers")
    attrs = _attributes(buffer)
    bname = _type_name(buffer)
    meta = common_meta(buffer, attrs, bname, META_FORMAT4)
    meta["module_counters"] = {}
    meta["extra_attrs"] = extra_attrs(attrs, handled_attrs(kind), bname)
    replay, log = with_retry(lambda: _capture(buffer, rid, kind, bname, dict(meta)), rid, bname)
    return {REPLAY: replay, REPLAY_META: log}


def with_retry(capture: Callable[[], Tuple[Any, Any]], rid: RowIds, bname: str) -> Tuple[Any, Any]:
    """``capture()``; where the caches no longer describe the buffer, once more after forgetting
    them (every row, episode and priority gets a new id: that save rewrites the buffer)."""
    try:
        return capture()
    except _Misaligned as exc:
        log.warning("ray_ckpt: replay buffer %s: %s: every row, episode and priority gets a new id "
                    "(this save rewrites the buffer)", bname, exc)
        rid.renumber(rid.next_id)
    try:
        return capture()
    except _Misaligned as exc:  # pragma: no cover - a full capture never misaligns
        raise UnsupportedTypeError(f"replay buffer {bname}: could not be captured ({exc})") from None


class _Misaligned(Exception):
    pass


def _capture(buffer: Any, rid: RowIds, kind: _Kind, bname: str, meta: Dict[str, Any]):
    """``(replay, replay_meta)`` of this save (``meta``: what every family's meta holds, packed into
    the log's meta record). Raises _Misaligned where the caches no longer describe the buffer."""
    evicted = int(buffer._num_episodes_evicted)
    full = rid.inc is None
    inc, newly_done = _split_changed(buffer, rid, evicted, bname)
    replay, entries = _new_rows(buffer, rid, inc, kind, full, evicted, bname)
    forget_parts(rid, [p.key for p in newly_done])
    n = len(replay["row_id"])
    newly_done.sort(key=lambda p: p.key)
    ep_raw = _raw(pack_ids(_table(newly_done, bname))) if newly_done else None
    prio = _priority_record(inc, entries, n) if kind.prioritized else None
    static = _static_of(inc, meta, rid)
    if inc.refresh or not inc.dicts:  # a dictionary first: this save's records are compressed with it
        provisional = _raw(_packed_meta(buffer, rid, inc, kind, dict(meta), n, bname))
        _append_dict(inc, [ep_raw or b"", prio[0] if prio else b"", provisional])
    append_records(inc, ep_raw, [p.key[0] for p in newly_done], prio, static, evicted)
    rid.spaces.prune()
    inc.keep_rows(live_spans(inc))
    rid.inc = inc
    rid.floors = None
    packed = _packed_meta(buffer, rid, inc, kind, meta, n, bname)
    return replay, _log_state(rid, inc, packed, n, bname, META_FORMAT4)


def forget_parts(rid: RowIds, keys: List[Tuple[int, int]]) -> None:
    """Drop the cached parts of episodes that became done: their rows are gathered and their batch
    is logged in this save, and a done episode never gets new rows (RLlib only concatenates to
    running ones), so no later save reads them. Why: kept, the parts of every live episode (~30
    small objects each) made a process's long-lived objects ~20 % more, and its full garbage
    collections (~0.4 s each at a 30k-row buffer) more frequent (benchmarks/RESULTS.md)."""
    for key in keys:
        rid.parts.pop(key, None)


def append_records(inc: Incremental, ep_raw: Any, done_keys: List[int], prio: Any, static: bytes,
                   evicted: int) -> None:
    """Append this save's episode batch (the episodes ``done_keys``), priority record and static
    record (when it changed) to the log; episode batches whose episodes are all evicted leave."""
    if ep_raw is not None:
        first, m = inc.append_raw(EPISODES, ep_raw)
        inc.batches.append([inc.next_batch, max(done_keys), first, m])
        inc.logged.update(done_keys)
        inc.next_batch += 1
    inc.batches = [x for x in inc.batches if x[1] >= evicted]  # all their episodes evicted: they leave
    if prio is not None:
        first, m = inc.append_raw(PRIORITIES, prio[0])
        inc.precs.append([first, m, prio[1]])
    if static != inc.static_raw or not inc.static:  # the live one leaves the log
        inc.static = list(inc.append_raw(STATIC, static))
        inc.static_raw = static


def live_spans(inc: Incremental) -> List[Tuple[int, int]]:
    """The log rows of the live records (the meta record aside): [first, rows) each."""
    return ([(a, m) for _, _, a, m in inc.batches] + [(a, m) for a, m, _ in inc.precs] +
            [(a, m) for a, m, _ in inc.env_recs] + [(a, m) for a, m, _ in inc.s2t_recs] + [tuple(inc.static)])


def _append_dict(inc: Incremental, raws: List[bytes]) -> None:
    """A dictionary record: a sample of this save's records (see :mod:`.records`)."""
    first, m = inc.append_raw(DICT, _raw({"sample": sample_of(raws, list(SAMPLE_LIMITS))}))
    inc.zdict = _decode_raw(inc.log["blob"][-m:], DICT, "the new dictionary record")
    inc.dicts.append([first, m])
    inc.refresh, inc.dict_base = False, 0


def changed_keys(buffer: Any, rid: RowIds, evicted: int, bname: str) -> Tuple[Incremental, List[int]]:
    """The cache to advance (a new one on a full capture: none yet) and the indices of the episodes
    that may have changed since the previous capture: all of them on a full capture, else the
    running ones and those added since."""
    inc = rid.inc
    E = len(buffer.episodes)
    if len(buffer.episode_id_to_index) != E:
        raise UnsupportedTypeError(f"{bname}: episode_id_to_index has {len(buffer.episode_id_to_index)} entries "
                                   f"for {E} episodes")
    if inc is None:
        inc = Incremental(np.empty(0, np.int64), {}, {}, {}, evicted=evicted)
        inc.log = _empty_log()
        inc.next_chunk = int((rid.floors or {}).get("chunk", 0))
        rid.parts = {}
        return inc, list(range(evicted, evicted + E))
    todo = sorted(k for k in inc.open_keys if k >= evicted)
    return inc, todo + list(range(max(inc.max_key + 1, evicted), evicted + E))


def _split_changed(buffer: Any, rid: RowIds, evicted: int, bname: str) -> Tuple[Incremental, List[_EpisodeParts]]:
    """Split the episodes that may have changed since the previous capture (all of them on a full
    capture; else the running ones and those added since), forget the evicted ones; returns the
    cache to advance and the episodes that became done (in no episode batch of the log yet)."""
    inc, todo = changed_keys(buffer, rid, evicted, bname)
    episodes = buffer.episodes
    E = len(episodes)
    for k in range(inc.evicted, evicted):  # forget evicted episodes
        rid.parts.pop((k, -1), None)
        inc.logged.discard(k)
        inc.open_keys.discard(k)
    newly_done: List[_EpisodeParts] = []
    for key in todo:
        ep = episodes[key - evicted]
        if buffer.episode_id_to_index.get(ep.id_) != key:
            raise UnsupportedTypeError(f"{bname}: episode_id_to_index[{ep.id_!r}] is "
                                       f"{buffer.episode_id_to_index.get(ep.id_)}, expected {key}")
        hit = rid.parts.get((key, -1))
        done = bool(ep.is_done)
        p = hit[1] if hit is not None and hit[0] is ep and hit[1].done and done else \
            _split_episode(ep, (key, -1), rid.spaces, f"{bname} episode {key}")
        rid.parts[(key, -1)] = (ep, p)
        if done:
            inc.open_keys.discard(key)
            if key not in inc.logged:
                newly_done.append(p)
        else:
            inc.open_keys.add(key)
    inc.max_key = max(inc.max_key, evicted + E - 1)
    return inc, newly_done


def _new_rows(buffer: Any, rid: RowIds, inc: Incremental, kind: _Kind, full: bool, evicted: int,
              bname: str) -> Tuple[Dict[str, Any], List[Dict[str, np.ndarray]]]:
    """The live rows (survivors keep their ids and columns, the new ones follow, gathered from their
    episodes) and the priority entries for the survivors whose leaves changed."""
    width = 3 if kind.prioritized else 2
    keys, ids = _update_ids(rid, buffer, [("_indices", buffer._indices, width, tuple)], evicted,
                            int(buffer._num_timesteps_added))
    n = len(ids)
    if n != int(buffer._num_timesteps):
        raise UnsupportedTypeError(f"{bname}: {n} index entries for {buffer._num_timesteps} timesteps")
    sel, s = surviving(inc, full, evicted)
    if not full and (n < s or not same_rows(ids[:s], inc.ids[sel])):
        raise _Misaligned("its index list changed other than by appends and evictions")
    new_keys = keys[s:]
    new = _gather(new_keys[:, 0], np.full(len(new_keys), -1, np.int64), new_keys[:, 1], rid.parts, inc, bname)
    new["episode"] = new_keys[:, 0].copy()
    new["t"] = _int32(new_keys[:, 1], "t")
    entries: List[Dict[str, np.ndarray]] = []
    if kind.prioritized:
        new["tree"] = _int32(new_keys[:, 2], "tree")
        hooked = _hook(buffer, inc)
        entries = _priorities({0: (buffer._sum_segment, buffer._min_segment)}, inc, sel, new, ids, s, full,
                              hooked, touched_by_group(inc, None), bname)
    merge_cols(inc, new, sel, full)
    inc.ids, inc.evicted = ids, evicted
    return {"row_id": ids, **inc.cols, "layout": LAYOUT}, entries


def surviving(inc: Incremental, full: bool, evicted: int) -> Tuple[Any, int]:
    """(the cached rows that survive the evictions since the previous capture, as an index
    (:func:`.growth.survivors`: a slice, nearly always), how many)."""
    if full:
        return slice(0, 0), 0
    sel = survivors(inc.cols["episode"] >= evicted)
    return sel, count(sel)


def merge_cols(inc: Incremental, new: Dict[str, np.ndarray], sel: Any, full: bool) -> None:
    """``inc.cols``: the surviving rows' columns (``sel``), then the new rows' (appended where there
    is room: :mod:`.growth`)."""
    cols = {}
    for c, v in new.items():
        cols[c] = v if full else kept(inc.cols[c], sel, v)
    if not full and set(cols) != set(inc.cols):
        raise _Misaligned(f"its columns changed ({sorted(set(cols) ^ set(inc.cols))})")
    inc.cols = cols


def _static_of(inc: Incremental, meta: Dict[str, Any], rid: RowIds, keys: Tuple[str, ...] = STATIC_KEYS) -> bytes:
    """What seldom changes, taken out of ``meta``, as a static record's bytes (a new record is
    appended only when they differ from the live one's)."""
    static = {k: meta.pop(k, None) for k in keys}
    static["spaces"] = rid.spaces.table
    static["templates"] = inc.templates
    return _raw(static)


def _packed_meta(buffer: Any, rid: RowIds, inc: Incremental, kind: _Kind, meta: Dict[str, Any], n: int,
                 bname: str) -> Dict[str, Any]:
    """The meta record's state: counters, generator, metrics, the running episodes, the live records."""
    running = [rid.parts[(k, -1)][1] for k in sorted(inc.open_keys)]
    meta["rows"] = {"next_row_id": int(rid.next_id), "n_rows": int(n), "agent_ids": [], "module_ids": []}
    meta["static"] = list(inc.static)
    meta["dicts"] = np.array(inc.dicts, np.int64).reshape(len(inc.dicts), 2)
    meta["running"] = _table(running, bname)
    meta["episode_log"] = {"batches": np.array(inc.batches, np.int64).reshape(len(inc.batches), 4),
                           "next_batch": inc.next_batch}
    if kind.prioritized:
        meta["priority"] = _priority_scalars(buffer, inc, bname)
    return {k: v for k, v in meta.items() if k not in ("format", "buffer_type")}


def _log_state(rid: RowIds, inc: Incremental, packed: Dict[str, Any], n: int, bname: str,
               fmt: str) -> Dict[str, Any]:
    """The ``replay_meta`` state: the log's live records and this save's meta record (``packed``)
    after them, and in the open (plain scalars) what is read without decoding a record: where the
    meta record and the dictionary it is compressed with start."""
    raw = _raw(packed)
    blob = _encode(META, raw, zdict=inc.zdict)  # not kept in inc.log: a meta record is live in its own version only
    packed_len = int.from_bytes(blob[0, :4].tobytes(), "little")
    if inc.dict_base <= 0:  # the save that wrote the dictionary: what the meta record costs with it
        inc.dict_base = packed_len
    # the dictionary no longer describes the meta record (what the buffer holds changed): a new one
    # next save; not when it never helped much (a meta record of mostly new numbers)
    inc.refresh = packed_len > 2 * inc.dict_base + CHUNK and \
        packed_len > 0.5 * len(zlib.compress(bytes([META]) + raw, 9))
    meta_at = inc.next_chunk
    ids = np.concatenate([inc.log["row_id"], np.arange(meta_at, meta_at + len(blob), dtype=np.int64)])
    inc.next_chunk += len(blob)
    return {"row_id": ids, "blob": np.concatenate([inc.log["blob"], blob]), "layout": LOG_LAYOUT,
            "format": fmt, "buffer_type": bname, "n_rows": int(n), "next_row_id": int(rid.next_id),
            "next_chunk": int(inc.next_chunk), "meta_at": int(meta_at), "dict_at": int(inc.dicts[-1][0]),
            "dict_rows": int(inc.dicts[-1][1]), "dict_base": int(inc.dict_base), "refresh": bool(inc.refresh),
            "chunk": CHUNK}


def _gather(e: np.ndarray, a: np.ndarray, t: np.ndarray, parts: Dict[Tuple[int, int], Any], inc: Incremental,
            bname: str) -> Dict[str, np.ndarray]:
    """The data columns of the new rows (episode ``e``, agent code ``a`` (-1: single-agent), step ``t``),
    read from their (agent) episodes' timesteps."""
    m = len(e)
    pieces: Dict[str, List[np.ndarray]] = {c: [] for c in inc.sig}
    if m == 0:
        return {c: np.empty((0,) + sh, dt) for c, (dt, sh) in inc.sig.items()}
    code = e.astype(np.int64) * (1 << 20) + (a.astype(np.int64) + 1)
    uniq, inv = np.unique(code, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv)
    start = 0
    for j, ck in enumerate(uniq.tolist()):
        ek, ak = ck >> 20, (ck & ((1 << 20) - 1)) - 1
        hit = parts.get((ek, ak))
        if hit is None:
            raise UnsupportedTypeError(f"{bname}: an index refers to episode {(ek, ak)}, which the buffer does not hold")
        p = hit[1]
        tt = t[order[start:start + counts[j]]]
        start += counts[j]
        if tt.max() >= p.n:
            raise UnsupportedTypeError(f"{bname}: an index refers to a timestep beyond episode {(ek, ak)}'s end")
        for f in p.fields:
            if f.template is None:
                continue
            old = inc.templates.setdefault(f.name, f.template)
            if old != f.template:
                raise UnsupportedTypeError(f"replay buffer {bname}: {f.name} of episode {ek} has the structure "
                                           f"{f.template!r}, other episodes {old!r}")
            for col, arr in f.body.items():
                sg = (arr.dtype, arr.shape[1:])
                first = inc.sig.setdefault(col, sg)
                if first != sg:
                    raise UnsupportedTypeError(
                        f"replay buffer {bname}: column {col!r} of episode {ek} is {sg[0]}{list(sg[1])}, other "
                        f"episodes' {first[0]}{list(first[1])}")
                pieces.setdefault(col, []).append(arr[tt])
    back = np.empty_like(order)
    back[order] = np.arange(m)
    out = {}
    for col, ps in pieces.items():
        if sum(len(x) for x in ps) != m:
            raise UnsupportedTypeError(f"replay buffer {bname}: column {col!r} is missing from some episodes "
                                       f"(extra_model_outputs keys differ between episodes)")
        out[col] = np.concatenate(ps)[back]
    return out
