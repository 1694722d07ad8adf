"""The small JSON encodings inside a flattened structure: floats, dict keys, leaf paths.

Shared by ``tree`` (which writes and reads whole structures) and ``sharded_leaf`` (which walks a
structure for its DTensor leaves without decoding it), so both name a leaf and decode a key alike.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any


def path_str(path: list) -> str:
    """A key path as an error message shows it: ``['optim']['state'][0]``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def unsupported_at(obj: Any, path: list, why: str = "") -> str:
    """How an unsupported-leaf error starts wherever a state is walked: the object's type, where it
    lies, and why when there is more to say than its type."""
    return (f"unsupported object of type {type(obj).__module__}.{type(obj).__qualname__} at {path_str(path)}"
            + (f" ({why})" if why else ""))


def leaf_key(path: list) -> str:
    """The key of the leaf at ``path`` (dict keys / list indices from the root) in a shard index:
    ``"optim/state/0/exp_avg"``. ``formats.shards`` walks a target state with the same function;
    it is also the leaf's name in a file's header (made unique there)."""
    return "/".join(str(k) for k in path) or "value"


def float_node(x: float) -> dict:
    if math.isnan(x):  # float.hex() writes every NaN as "nan": keep its sign and payload bits
        return {"f": "nan", "fb": struct.pack(">d", x).hex()}
    return {"f": x.hex()}


def float_of(node: dict) -> float:
    fb = node.get("fb")
    if fb is not None:
        return struct.unpack(">d", bytes.fromhex(fb))[0]
    return float.fromhex(node["f"])


def enc_key(k: Any) -> Any:
    """A dict key as JSON, or None when it has no encoding (only str, int, bool and None do)."""
    if type(k) in (str, int):
        return k
    if k is None:  # RLlib keys single-agent state by None
        return {"kn": 1}
    if type(k) is bool:
        return {"kb": k}
    return None


def dec_key(k: Any) -> Any:
    if isinstance(k, dict):
        return None if "kn" in k else bool(k["kb"])
    return k


def structure_to_json(structure: Any) -> str:
    return json.dumps(structure, separators=(",", ":"), allow_nan=False)
