"""Serialisation: what bytes a state becomes. Knows nothing of Ray or of where bytes go.

May import only the root's ``errors`` and ``types`` (never ``storage``, which imports this package)."""
from .manifest import FileEntry, Manifest, StateEntry
from .flat import Flat
from .tree import flatten, unflatten

__all__ = ["Flat", "flatten", "unflatten", "Manifest", "StateEntry", "FileEntry"]
