"""What the verl and OpenRLHF integrations share about their ``ray_ckpt`` settings block: the
``CheckpointEngine.create`` options it carries, split from the integration's own settings and
checked before any engine is created. No framework import here."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from ..errors import InvalidArgumentError


def engine_create_options(block: Mapping[str, Any], create_keys: Sequence[str], own_keys: Sequence[str],
                          where: str) -> Dict[str, Any]:
    """The ``create()`` options of ``block`` (``where`` names it in errors): its ``create_keys`` that
    are set, merged with its ``engine_options`` (any other ``create()`` option). A key that is
    neither a create key nor one of ``own_keys``, an ``engine_options`` that is not a mapping, or an
    option given both ways is an InvalidArgumentError."""
    known = list(create_keys) + list(own_keys)
    unknown = sorted(set(block) - set(known))
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known)} (other "
                                   f"CheckpointEngine.create options go in engine_options)")
    create = {k: block[k] for k in create_keys if block.get(k) is not None}
    extra = block.get("engine_options") or {}
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(f"{where}.engine_options must be a mapping")
    clash = sorted(set(extra) & set(create))
    if clash:
        raise InvalidArgumentError(f"{where}: {clash} given both directly and in engine_options")
    create.update(extra)
    return create
