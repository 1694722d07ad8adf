"""Dtype names across torch, numpy and safetensors, and torch's lazy import.

torch is imported on first use, not when this package is: the command line lists, verifies and
shows checkpoints without it (importing torch is ~1 s of its start-up). A tensor or a torch.dtype
can only exist once torch is imported, so ``tree.flatten`` looks in ``sys.modules``; only code that
builds tensors calls :func:`import_torch`.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np


def import_torch() -> Any:
    """The torch module, imported now if no one has yet."""
    import torch

    return torch


@functools.lru_cache(maxsize=1)
def torch_to_st() -> dict:
    """torch dtype -> safetensors dtype name (what other tools read); anything else is stored as U8."""
    torch = import_torch()
    out = {}
    for name, st in [
        ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
        ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"),
        ("bool", "BOOL"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("complex64", "C64"),
    ]:
        if hasattr(torch, name):
            out[getattr(torch, name)] = st
    return out


_NP_TO_ST = {
    "f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
    "u1": "U8", "b1": "BOOL", "u2": "U16", "u4": "U32", "u8": "U64", "c8": "C64",
}


def st_dtype_of_numpy(dt: np.dtype) -> str:
    """The safetensors dtype name for a little-endian numpy dtype (U8 when it has none)."""
    if dt.byteorder == ">":
        return "U8"
    return _NP_TO_ST.get(f"{dt.kind}{dt.itemsize}", "U8")


# numpy has no bfloat16: a bf16 tensor read without torch comes back as its raw 16-bit words
_TORCH_NAME_TO_NP = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?", "uint16": "<u2", "uint32": "<u4",
    "uint64": "<u8", "complex64": "<c8", "complex128": "<c16", "bfloat16": "<u2",
}


def numpy_view(buf: Any, torch_dtype_name: str, shape: list) -> np.ndarray:
    """A tensor leaf's bytes as a numpy array of the nearest dtype (flat where the shape does not fit)."""
    dt = np.dtype(_TORCH_NAME_TO_NP.get(torch_dtype_name, "u1"))
    a = np.frombuffer(buf, dtype=dt) if len(buf) else np.empty(0, dt)
    try:
        return a.reshape(shape)
    except ValueError:
        return a
