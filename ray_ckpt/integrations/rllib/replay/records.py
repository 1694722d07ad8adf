"""The ``replay_meta`` log's records as bytes: a nested state as a structure JSON and its arrays'
bytes (:func:`_raw`), compressed against a dictionary and cut into rows (:func:`_encode`), and back.

Why not safetensors or plain zlib: a save appends an episode batch of a few dozen episodes (~45
small arrays), a priority record and a meta record whose structure JSON (the buffer's metrics,
the running episodes' table) is ~12 KB and the same from one save to the next. Each record alone
compresses poorly: the JSON is new to zlib every time, and small integer arrays stored as int64
are mostly zero bytes between the values. So, before compressing:

* integer arrays are stored as the narrowest signed integers that hold either their values or their
  differences (episode keys and row ids increase by small steps), then byte-shuffled (all first
  bytes, then all second bytes...); other arrays wider than a byte are byte-shuffled (a float's
  sign and exponent bytes then sit together and repeat). Both are exact: the original bytes come back;
* records are compressed with a *dictionary* (zlib's preset dictionary): the bytes of the log's live
  static record, which ends with a sample of the records of the save that wrote it. A record then
  costs what differs from that sample. zlib names the dictionary in the stream's header (its
  Adler-32), so a record says itself which one it needs.
"""
from __future__ import annotations

import base64
import collections
import json
import zlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ....errors import RestoreError, UnsupportedTypeError
from ....formats.nodes import enc_key, float_node, structure_to_json

CHUNK = 256  # bytes of a record per row of the ``replay_meta`` log
_WIDTHS = (1, 2, 4)
# a stored array's form: as it is; byte-shuffled; integer values narrowed; integer differences narrowed
AS_IS, SHUFFLED, NARROW, NARROW_DIFF = 0, 1, 2, 3


def _shuffle(b: np.ndarray, width: int) -> bytes:
    return np.ascontiguousarray(b.reshape(-1, width).T).tobytes() if width > 1 else b.tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    b = np.frombuffer(data, np.uint8)
    return np.ascontiguousarray(b.reshape(width, -1).T).tobytes() if width > 1 else bytes(data)


def _pack_array(a: np.ndarray) -> Tuple[List[int], bytes]:
    """([form, item size, stored width], stored bytes) of one array (see the module docstring)."""
    a = np.ascontiguousarray(a)
    size = a.dtype.itemsize
    raw = a.reshape(-1).view(np.uint8)
    if size == 1 or a.size == 0:
        return [AS_IS, size, size], raw.tobytes()
    if a.dtype.kind not in "iu" or size > 8:
        return [SHUFFLED, size, size], _shuffle(raw, size)
    v = raw.view(f"<i{size}")
    best = (size, SHUFFLED, v)
    d = np.empty_like(v)  # np.diff(v, prepend=0) without its broadcasting and concatenation
    d[0] = v[0]
    np.subtract(v[1:], v[:-1], out=d[1:])
    for form, x in ((NARROW, v), (NARROW_DIFF, d)):  # wraps: exact
        if len(x) <= 256:  # most arrays of a record are short: Python's min/max cost less than numpy's
            xs = x.tolist()
            lo, hi = min(xs), max(xs)
        else:
            lo, hi = int(x.min()), int(x.max())
        w = next((w for w in _WIDTHS if w < best[0] and -(1 << (8 * w - 1)) <= lo and hi < (1 << (8 * w - 1))), None)
        if w is not None:
            best = (w, form, x)
    w, form, x = best
    return [form, size, w], _shuffle(x.astype(f"<i{w}").view(np.uint8), w)


def _unpack_array(form: int, size: int, width: int, data: bytes) -> bytes:
    if form == AS_IS:
        return bytes(data)
    if form not in (SHUFFLED, NARROW, NARROW_DIFF) or width not in (1, 2, 4, 8) or size not in (1, 2, 4, 8, 16) \
            or len(data) % width:
        raise ValueError(f"array form {[form, size, width]}")
    plain = _unshuffle(data, width)
    if form == SHUFFLED:
        return plain
    x = np.frombuffer(plain, f"<i{width}").astype(f"<i{size}")
    if form == NARROW_DIFF:
        x = np.cumsum(x, dtype=f"<i{size}")
    return x.tobytes()


def _raw(state: Any) -> bytes:
    """A nested state as bytes: a 4-byte length, the JSON of ray_ckpt's structure of it, of its
    arrays' stored lengths and forms, then the arrays' stored bytes. Not a safetensors file: its
    header names, types and places every array again beside the structure (an episode table has
    ~45 small arrays).

    Built by :func:`_structure` (a walk that knows only the leaves replay records hold, and keeps
    the arrays with their dtypes), which gives the bytes :func:`_raw_generic` (ray_ckpt's
    ``flatten``) gives, at a fraction of its cost: a save encodes a ~30 KB meta record, and
    ``flatten`` builds a key path and a leaf name per node and the dtypes are read back by a
    second walk. A state holding any other leaf takes :func:`_raw_generic` (which names it if
    it cannot be stored)."""
    arrays: List[np.ndarray] = []
    try:
        structure = _structure(state, arrays)
    except _Other:
        return _raw_generic(state)
    forms, body = [], []
    for a in arrays:
        form, data = _pack_array(a.reshape(-1) if a.dtype.isnative else a.reshape(-1).view(np.uint8))
        forms.append(form)
        body.append(data)
    head = structure_to_json({"s": structure, "n": [len(b) for b in body], "x": forms}).encode()
    return b"".join([len(head).to_bytes(4, "little"), head] + body)


class _Other(Exception):
    """A leaf :func:`_structure` does not know: the state takes :func:`_raw_generic`."""


def _structure(x: Any, arrays: List[np.ndarray]) -> Any:
    """The node ray_ckpt's ``flatten`` gives ``x`` (``formats/tree.py``: the same JSON, the same
    array order); the arrays, C-contiguous, appended to ``arrays``. Raises _Other for any other
    leaf than None, bool, int, str, float, dict / OrderedDict with str / int / None / bool keys,
    list, tuple, numpy array / scalar and bytes."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return {"f": x.hex()} if x == x else float_node(x)
    if t is dict or t is collections.OrderedDict:
        items = []
        for k, v in x.items():
            tk = type(k)
            if tk is not str and tk is not int:
                k = enc_key(k)
                if k is None:
                    raise _Other
            items.append([k, _structure(v, arrays)])
        return {"d": items, "o": 1} if t is collections.OrderedDict else {"d": items}
    if t is list:
        return {"l": [_structure(v, arrays) for v in x]}
    if t is tuple:
        return {"u": [_structure(v, arrays) for v in x]}
    if t is np.ndarray:
        if x.dtype.hasobject or x.dtype.fields is not None:
            raise _Other
        a = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        arrays.append(a)
        return {"N": len(arrays) - 1, "dt": a.dtype.str, "sh": list(x.shape)}
    if isinstance(x, np.generic) and not isinstance(x, (np.object_, np.ndarray)):
        return {"ns": x.dtype.str, "h": x.tobytes().hex()}
    if t is bytes:
        return {"b": base64.b64encode(x).decode("ascii")}
    raise _Other


def _raw_generic(state: Any) -> bytes:
    """:func:`_raw` through ray_ckpt's own ``flatten`` (any state it can store)."""
    from ....formats.flat import pieces_of
    from ....formats.tree import flatten
    flat = flatten(state, state_name="replay_meta")
    if flat.tables:
        raise UnsupportedTypeError("replay buffer: an Arrow table in the replay meta is not supported")
    dtypes: Dict[int, str] = {}
    _leaf_dtypes(flat.structure, dtypes)
    forms, body = [], []
    for i, a in enumerate(flat.arrays):
        b = np.frombuffer(b"".join(bytes(memoryview(p).cast("B")) for p in pieces_of(a)), np.uint8)
        dt = np.dtype(dtypes.get(i, "|u1"))
        form, data = _pack_array(b.view(dt) if dt.isnative and len(b) % dt.itemsize == 0 else b)
        forms.append(form)
        body.append(data)
    head = structure_to_json({"s": flat.structure, "n": [len(b) for b in body], "x": forms}).encode()
    return b"".join([len(head).to_bytes(4, "little"), head] + body)


def _leaf_dtypes(node: Any, out: Dict[int, str]) -> None:
    """Leaf index -> numpy dtype of every array leaf of a structure (tree.flatten's JSON)."""
    if isinstance(node, dict):
        if isinstance(node.get("N"), int) and isinstance(node.get("dt"), str):
            out[node["N"]] = node["dt"]
            return
        for v in node.values():
            _leaf_dtypes(v, out)
    elif isinstance(node, list):
        for v in node:
            _leaf_dtypes(v, out)


def _unraw(data: bytes, where: str) -> Any:
    """The state of :func:`_raw`'s bytes (RestoreError naming ``where`` for anything else). Bytes
    without array forms (format /3's records) are read as stored as they are."""
    from ....formats.tree import unflatten
    try:
        n = int.from_bytes(data[:4], "little")
        head = json.loads(data[4:4 + n])
        sizes = [int(x) for x in head["n"]]
        forms = head.get("x") or [[AS_IS, 1, 1]] * len(sizes)
        if any(x < 0 for x in sizes) or 4 + n + sum(sizes) != len(data) or len(forms) != len(sizes):
            raise ValueError(f"{len(data) - 4 - n} bytes of arrays, the header says {sum(sizes)}")
        views, at = [], 4 + n
        for x, (form, size, width) in zip(sizes, forms):
            views.append(bytearray(_unpack_array(int(form), int(size), int(width), data[at:at + x])))
            at += x
        return unflatten(head["s"], views, [])
    except RestoreError:
        raise
    except Exception as exc:  # a damaged record: its verified file holds other bytes than written
        raise RestoreError(f"{where}: not a replay log record ({type(exc).__name__}: {exc})") from None


def dict_id(zdict: bytes) -> int:
    """The id zlib writes into a stream compressed with ``zdict`` (its Adler-32)."""
    return zlib.adler32(zdict)


def _compress(data: bytes, zdict: Optional[bytes]) -> bytes:
    c = zlib.compressobj(9, zdict=zdict) if zdict else zlib.compressobj(9)
    return c.compress(data) + c.flush()


def _encode(kind: int, raw: bytes, width: int = CHUNK, zdict: Optional[bytes] = None) -> np.ndarray:
    """A record as rows of ``width`` bytes: a 4-byte length, then the kind byte and ``raw`` (a state's
    :func:`_raw` bytes), zlib-compressed, with ``zdict`` as the preset dictionary if given."""
    packed = _compress(bytes([kind]) + raw, zdict)
    raw = len(packed).to_bytes(4, "little") + packed
    raw += b"\0" * (-len(raw) % width)
    return np.frombuffer(raw, np.uint8).reshape(-1, width)


def _decode_raw(rows: np.ndarray, kind: int, where: str, dicts: Optional[Mapping[int, bytes]] = None) -> bytes:
    """The bytes :func:`_raw` made of a record (its rows, in order), checked to be of ``kind``; a
    record compressed with a dictionary takes it from ``dicts`` (id -> bytes, :func:`dict_id`)."""
    rows = np.asarray(rows, np.uint8)
    raw = np.ascontiguousarray(rows).reshape(-1).tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 <= len(raw) - 4 - n < rows.shape[-1]:  # its rows, no fewer and no more
        raise RestoreError(f"{where}: says {n} bytes but has {len(raw) - 4}")
    stream = raw[4:4 + n]
    zdict = None
    if len(stream) >= 6 and stream[1] & 0x20:  # FDICT: the dictionary's id follows the 2-byte header
        want = int.from_bytes(stream[2:6], "big")
        zdict = (dicts or {}).get(want)
        if zdict is None:
            raise RestoreError(f"{where}: compressed with dictionary {want:#010x}, which no live static "
                               f"record of the log holds")
    try:
        d = zlib.decompressobj(zdict=zdict) if zdict else zlib.decompressobj()
        data = d.decompress(stream) + d.flush()
        if not d.eof or d.unused_data:
            raise zlib.error("the stream is cut short or followed by other bytes")
    except zlib.error as exc:
        raise RestoreError(f"{where}: {exc}") from None
    if not data or data[0] != kind:
        raise RestoreError(f"{where}: a record of kind {data[:1].hex() or 'none'}, expected {kind}")
    return data[1:]


def _decode(rows: np.ndarray, kind: int, where: str, dicts: Optional[Mapping[int, bytes]] = None) -> Any:
    """The state of a record (its rows, in order), checked to be of ``kind``."""
    return _unraw(_decode_raw(rows, kind, where, dicts), where)


def sample_of(raws: List[bytes], limits: List[int]) -> np.ndarray:
    """A dictionary sample: the start of each record's bytes (at most ``limits`` bytes each), the
    last one (the meta record: the same from save to save) nearest the end, where zlib looks first."""
    return np.frombuffer(b"".join(r[:lim] for r, lim in zip(raws, limits)), np.uint8).copy()
