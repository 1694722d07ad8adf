"""Serialisation: what bytes a state becomes. Knows nothing of Ray or of where bytes go."""
from .manifest import FileEntry, Manifest, StateEntry
from .tree import Flat, flatten, unflatten

__all__ = ["Flat", "flatten", "unflatten", "Manifest", "StateEntry", "FileEntry"]
