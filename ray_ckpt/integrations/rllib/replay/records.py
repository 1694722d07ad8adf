"""The ``replay_meta`` log's records as bytes: a nested state as a structure JSON and its arrays'
bytes (:func:`_raw`, now :func:`..journal.records.state_bytes`), compressed against a dictionary and cut into rows (:func:`_encode`), and back.

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

import zlib
from typing import Any, List, Mapping, Optional

import numpy as np

from ....errors import RestoreError
from ..journal.records import (AS_IS, NARROW, NARROW_DIFF, SHUFFLED, bytes_state as _unraw,  # noqa: F401
                               state_bytes as _raw, state_bytes_generic as _raw_generic)

CHUNK = 256  # bytes of a record per row of the ``replay_meta`` log


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
