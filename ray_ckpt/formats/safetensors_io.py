"""The tensor part of a state as a standard safetensors file, written and read without extra copies.

The file is plain safetensors (``safetensors.torch.load_file`` reads it); ray_ckpt's nested
structure and non-tensor leaves live in the header's ``__metadata__`` under ``ray_ckpt.structure``.
Leaves are laid out by decreasing item size after an 8-aligned header, so every tensor is aligned
to its own item size when the file is read into memory.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..errors import IntegrityError
from .flat import Flat, pieces_of
from .nodes import structure_to_json

# the keys of ray_ckpt's entries in a file's metadata (buffer_io writes the same into Arrow's)
STRUCTURE_KEY = "ray_ckpt.structure"
LEAVES_KEY = "ray_ckpt.leaves"
FORMAT_KEY = "ray_ckpt.format"
FORMAT_VERSION = "1"


def file_header(flat: Flat) -> Tuple[bytes, List[int]]:
    """(the file's first bytes: length prefix and JSON header, the order its arrays follow in):
    deterministic, so a writer knows every array's offset without reading the file back."""
    order = sorted(range(len(flat.arrays)), key=lambda i: -flat.leaf_info[i]["itemsize"])
    header: dict = {
        "__metadata__": {
            "format": "pt",
            FORMAT_KEY: FORMAT_VERSION,
            STRUCTURE_KEY: structure_to_json(flat.structure),
            LEAVES_KEY: json.dumps([flat.leaf_info[i]["name"] for i in range(len(flat.arrays))]),
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


def file_views(flat: Flat) -> List[Any]:
    """The file as consecutive byte views: the header, then each tensor's bytes (no copies)."""
    head, order = file_header(flat)
    return [head] + [piece for i in order for piece in pieces_of(flat.arrays[i])]


def write(flat: Flat, sink: Any) -> None:
    """Stream the file into ``sink`` (anything with ``write(bytes-like)``)."""
    for view in file_views(flat):
        sink.write(view)


# safetensors dtype -> item size in bytes (sub-byte F4/F6 types are not written by ray_ckpt: refused)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER = 512 << 20  # a sane bound (safetensors itself allows 100 MB; ray_ckpt's structure can be large)


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_header(header: Any, data_len: int) -> None:
    """Structural checks of a parsed safetensors header against a data section of ``data_len``
    bytes: a JSON object of tensors, each with a known dtype, a shape of non-negative integers and
    ``data_offsets`` [begin, end] with 0 <= begin <= end <= data_len and end - begin equal to the
    number of elements times the item size; no two tensors overlap. ``__metadata__``, if present,
    maps strings to strings. Raises ValueError naming the key."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise ValueError("__metadata__ is not an object of strings")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name!r}: its entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_nonneg_int(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > data_len:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} run past the data section ({data_len} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * ITEMSIZE[dtype]:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} hold {end - begin} bytes, but {dtype} "
                             f"{shape} needs {numel * ITEMSIZE[dtype]}")
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"tensor {n1!r}: data_offsets [{b1}, {e1}] overlap those of tensor {n0!r} [{b0}, {e0}]")


def header_length(prefix: Any, size: int) -> int:
    """The JSON header's length, from the first 8 bytes of a file of ``size`` bytes; a length that
    cannot fit the file (or exceeds ``MAX_HEADER``) raises ValueError."""
    if len(prefix) < 8:
        raise ValueError(f"{size} bytes: too short for a header length")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n < 2 or n > size - 8 or n > MAX_HEADER:
        raise ValueError(f"header length {n} does not fit a file of {size} bytes")
    return n


@dataclass(frozen=True)
class Header:
    """A ray_ckpt safetensors file's header, parsed: ``names[i]`` is the tensor of ``Flat.arrays[i]``
    (from ``ray_ckpt.leaves``), ``tensors`` the header's tensor entries, ``base`` where the data
    section starts in the file."""

    structure: Any
    tensors: Dict[str, Any]
    names: List[str]
    base: int

    @property
    def offsets(self) -> List[int]:
        """Byte offset in the file of each array."""
        return [self.base + self.tensors[x]["data_offsets"][0] for x in self.names]

    @property
    def sizes(self) -> List[int]:
        """Byte size of each array."""
        return [self.tensors[x]["data_offsets"][1] - self.tensors[x]["data_offsets"][0] for x in self.names]


def parse_header(head: Any, size: int, *, path: str = "<buffer>") -> Header:
    """The one parser of a ray_ckpt safetensors header: ``head`` holds at least the file's first
    ``8 + header length`` bytes, ``size`` is the whole file's. The header is checked structurally
    (``check_header``) against the data section ``size`` implies, and its ray_ckpt metadata must
    name every array once; anything else is an IntegrityError naming ``path``."""
    mv = memoryview(head).cast("B")
    try:
        n = header_length(mv, size)
        if len(mv) < 8 + n:
            raise ValueError(f"header length {n} does not fit the {len(mv)} bytes read")
        tensors = json.loads(bytes(mv[8: 8 + n]))
        check_header(tensors, size - 8 - n)
        meta = tensors.pop("__metadata__", None) or {}
        if STRUCTURE_KEY not in meta or LEAVES_KEY not in meta:
            raise ValueError(f"no {STRUCTURE_KEY!r} in its __metadata__")
        structure = json.loads(meta[STRUCTURE_KEY])
        names = json.loads(meta[LEAVES_KEY])
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise ValueError(f"{LEAVES_KEY} is not a list of tensor names")
        if len(set(names)) != len(names):
            raise ValueError(f"{LEAVES_KEY} names a tensor twice")
        for name in names:
            if name not in tensors:
                raise ValueError(f"tensor {name!r} (a leaf) is not in the header")
    except (KeyError, ValueError, TypeError, struct.error, RecursionError) as exc:
        raise IntegrityError(f"{path}: not a ray_ckpt safetensors file ({exc})") from None
    return Header(structure, tensors, names, 8 + n)


def read(buf: Any, *, path: str = "<buffer>") -> Tuple[Any, List[memoryview]]:
    """Parse a file held in ``buf`` (bytes-like). Returns (structure, per-leaf memoryviews into buf).

    Every read is checked structurally first (``parse_header``: offsets inside the data section,
    sizes matching dtype and shape, no overlaps), whatever its checksum says: a header edited and
    re-checksummed is an IntegrityError naming the file and the key, never a stray exception."""
    mv = memoryview(buf).cast("B")
    h = parse_header(mv, len(mv), path=path)
    return h.structure, [mv[off: off + nb] for off, nb in zip(h.offsets, h.sizes)]
