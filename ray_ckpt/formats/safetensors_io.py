"""The tensor part of a state as a standard safetensors file, written and read without extra copies.

The file is plain safetensors (``safetensors.torch.load_file`` reads it); ray_ckpt's nested
structure and non-tensor leaves live in the header's ``__metadata__`` under ``ray_ckpt.structure``.
Leaves are laid out by decreasing item size after an 8-aligned header, so every tensor is aligned
to its own item size when the file is read into memory.
"""
from __future__ import annotations

import json
import struct
from typing import Any, List, Tuple

from ..errors import IntegrityError
from .tree import Flat, pieces_of, structure_to_json

STRUCTURE_KEY = "ray_ckpt.structure"
FORMAT_KEY = "ray_ckpt.format"
FORMAT_VERSION = "1"


def _header(flat: Flat) -> Tuple[bytes, List[int]]:
    order = sorted(range(len(flat.arrays)), key=lambda i: -flat.leaf_info[i]["itemsize"])
    header: dict = {
        "__metadata__": {
            "format": "pt",
            FORMAT_KEY: FORMAT_VERSION,
            STRUCTURE_KEY: structure_to_json(flat.structure),
            "ray_ckpt.leaves": json.dumps([flat.leaf_info[i]["name"] for i in range(len(flat.arrays))]),
        }
    }
    off = 0
    for i in order:
        info = flat.leaf_info[i]
        n = flat.arrays[i].nbytes
        shape = info["shape"] if info["dtype"] != "U8" or info["itemsize"] == 1 else [n]
        header[info["name"]] = {"dtype": info["dtype"], "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-(8 + len(raw))) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def segments(flat: Flat) -> List[Any]:
    """The file as consecutive byte pieces: the header, then each tensor's bytes (no copies)."""
    head, order = _header(flat)
    return [head] + [piece for i in order for piece in pieces_of(flat.arrays[i])]


def write(flat: Flat, sink: Any) -> None:
    """Stream the file into ``sink`` (anything with ``write(bytes-like)``)."""
    for piece in segments(flat):
        sink.write(piece)


def read(buf: Any, *, path: str = "<buffer>") -> Tuple[Any, List[memoryview]]:
    """Parse a file held in ``buf`` (bytes-like). Returns (structure, per-leaf memoryviews into buf)."""
    mv = memoryview(buf).cast("B")
    try:
        (n,) = struct.unpack_from("<Q", mv, 0)
        header = json.loads(bytes(mv[8: 8 + n]))
        meta = header.pop("__metadata__", {}) or {}
        structure = json.loads(meta[STRUCTURE_KEY])
        names = json.loads(meta["ray_ckpt.leaves"])
        base = 8 + n
        views = []
        for name in names:
            b, e = header[name]["data_offsets"]
            if base + e > len(mv):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            views.append(mv[base + b: base + e])
    except (KeyError, ValueError, struct.error) as exc:
        raise IntegrityError(f"{path}: not a ray_ckpt safetensors file ({exc})") from None
    return structure, views
