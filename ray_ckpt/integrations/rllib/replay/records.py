"""A journal record's bytes: a nested state as a structure JSON and its arrays' bytes
(:func:`state_bytes`), zlib-compressed and cut into rows of :data:`ROW_BYTES` (:func:`encode`), and back.

Why not safetensors: a record holds a few dozen small arrays (an add() call's episode chunks), and a
safetensors header names, types and places every array again beside the structure. Why not plain
zlib of the arrays: small integer arrays stored as int64 are mostly zero bytes between the values.
So, before compressing, integer arrays are stored as the narrowest signed integers that hold either
their values or their differences (episode keys and tree indices increase by small steps), then
byte-shuffled (all first bytes, then all second bytes...); other arrays wider than a byte are
byte-shuffled (a float's sign and exponent bytes then sit together and repeat). Both are exact:
the original bytes come back.

Why rows of 256 bytes: the core stores an append-only buffer as rows with a ``row_id`` (a replay
buffer's rows only grow and die); a record of any size is a run of consecutive rows, so a version
writes only its new records' rows, and a record that dies leaves with its rows.
"""
from __future__ import annotations

import base64
import collections
import json
import zlib
from typing import Any, Dict, List, Tuple

import numpy as np

from ....errors import RestoreError, UnsupportedTypeError
from ....formats.nodes import dec_key, enc_key, float_node, float_of, structure_to_json

ROW_BYTES = 256  # bytes of a record per row
RAW_ABOVE = 1 << 20  # a record longer than this is compressed at zlib's fastest level

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


def state_bytes(state: Any) -> bytes:
    """A nested state as bytes: a 4-byte length, the JSON of ray_ckpt's structure of it with its
    arrays' stored lengths and forms, then the arrays' stored bytes. :func:`_structure` gives the
    bytes ``flatten`` gives (:func:`state_bytes_generic`) at a fraction of its cost (a save encodes a
    ~30 KB meta record); a state holding any other leaf takes :func:`state_bytes_generic`."""
    arrays: List[np.ndarray] = []
    try:
        structure = _structure(state, arrays)
    except _Other:
        return state_bytes_generic(state)
    return _joined(structure, [_pack_array(a.reshape(-1) if a.dtype.isnative else a.reshape(-1).view(np.uint8))
                               for a in arrays])


def _joined(structure: Any, packed: List[Tuple[List[int], bytes]]) -> bytes:
    body = [b for _, b in packed]
    head = structure_to_json({"s": structure, "n": [len(b) for b in body], "x": [f for f, _ in packed]}).encode()
    return b"".join([len(head).to_bytes(4, "little"), head] + body)


class _Other(Exception):
    """A leaf :func:`_structure` does not know: the state takes :func:`state_bytes_generic`."""


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


def state_bytes_generic(state: Any) -> bytes:
    """:func:`state_bytes` through ray_ckpt's own ``flatten`` (any state it can store)."""
    from ....formats.flat import pieces_of
    from ....formats.tree import flatten
    flat = flatten(state, state_name="replay_journal")
    if flat.tables:
        raise UnsupportedTypeError("replay buffer: an Arrow table in the replay meta is not supported")
    dtypes: Dict[int, str] = {}
    _leaf_dtypes(flat.structure, dtypes)
    packed = []
    for i, a in enumerate(flat.arrays):
        b = np.frombuffer(b"".join(bytes(memoryview(p).cast("B")) for p in pieces_of(a)), np.uint8)
        dt = np.dtype(dtypes.get(i, "|u1"))
        packed.append(_pack_array(b.view(dt) if dt.isnative and len(b) % dt.itemsize == 0 else b))
    return _joined(flat.structure, packed)


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


def bytes_state(data: bytes, where: str) -> Any:
    """The state of :func:`state_bytes`'s bytes (RestoreError naming ``where`` for anything else). Bytes
    without array forms (format /3's records: cli/legacy_replay reads them) are read as they are."""
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
        try:
            return _unstructure(head["s"], views)
        except _Other:
            return unflatten(head["s"], views, [])
    except RestoreError:
        raise
    except Exception as exc:  # a damaged record: its verified file holds other bytes than written
        raise RestoreError(f"{where}: not a replay log record ({type(exc).__name__}: {exc})") from None


def _unstructure(x: Any, arrays: List[Any]) -> Any:
    """The inverse of :func:`_structure` (ray_ckpt's ``unflatten`` gives the same, at several times
    the cost: it builds a key path per node for its messages; a restore decodes every record).
    Raises _Other at a node :func:`_structure` does not write."""
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is list:
        raise _Other
    if "d" in x:
        items = [(k if type(k) is not dict else dec_key(k), _unstructure(v, arrays)) for k, v in x["d"]]
        return collections.OrderedDict(items) if x.get("o") else dict(items)
    if "l" in x:
        return [_unstructure(v, arrays) for v in x["l"]]
    if "u" in x:
        return tuple(_unstructure(v, arrays) for v in x["u"])
    if "N" in x:
        dt, buf = np.dtype(x["dt"]), arrays[x["N"]]
        return np.frombuffer(buf, dtype=dt).reshape(x["sh"]) if len(buf) else np.empty(x["sh"], dt)
    if "f" in x:
        return float_of(x)
    if "ns" in x:
        return np.frombuffer(bytes.fromhex(x["h"]), dtype=np.dtype(x["ns"]))[0]
    if "b" in x:
        return base64.b64decode(x["b"])
    raise _Other


def encode(kind: int, raw: bytes) -> np.ndarray:
    """A record as rows of :data:`ROW_BYTES`: a 4-byte length, then the kind byte and ``raw`` (a
    state's :func:`state_bytes`), zlib-compressed; the last row padded with zeros."""
    packed = zlib.compress(bytes([kind]) + raw, 1 if len(raw) > RAW_ABOVE else 6)
    out = len(packed).to_bytes(4, "little") + packed
    out += b"\0" * (-len(out) % ROW_BYTES)
    return np.frombuffer(out, np.uint8).reshape(-1, ROW_BYTES)


def decode(rows: np.ndarray, where: str) -> Tuple[int, bytes]:
    """(kind, the :func:`state_bytes` bytes) of a record's rows, in order (RestoreError naming
    ``where`` for rows that are not one whole record)."""
    raw = np.ascontiguousarray(np.asarray(rows, np.uint8)).reshape(-1).tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 <= len(raw) - 4 - n < ROW_BYTES:
        raise RestoreError(f"{where}: says {n} bytes but has {len(raw) - 4}")
    try:
        d = zlib.decompressobj()
        data = d.decompress(raw[4:4 + n]) + d.flush()
        if not d.eof or d.unused_data or not data:
            raise zlib.error("the stream is cut short or followed by other bytes")
    except zlib.error as exc:
        raise RestoreError(f"{where}: {exc}") from None
    return data[0], data[1:]


def rows_of(raw: bytes) -> int:
    """How many rows the record starting with ``raw`` (its first row at least) spans."""
    return (4 + int.from_bytes(bytes(raw[:4]), "little") + ROW_BYTES - 1) // ROW_BYTES
