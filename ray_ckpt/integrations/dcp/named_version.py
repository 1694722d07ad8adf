"""What ``rc.dcp.reader`` and ``rc.dcp.writer`` share of DCP's ``checkpoint_id`` protocol: each one
is made for one ray_ckpt version and names it itself (``checkpoint_id`` is ``"<run>@<step>"``), so
DCP never picks it for a bare path, and a different ``checkpoint_id`` handed to ``reset`` is refused
before anything is read or written."""
from __future__ import annotations

from typing import Any


class NamedVersion:
    """A mixin placed before DCP's ``StorageReader`` / ``StorageWriter``; the class sets ``_role``
    ("reader" or "writer") and ``_id_error`` (the error a wrong ``checkpoint_id`` raises), the
    instance ``checkpoint_id``."""

    _role: str
    _id_error: type
    checkpoint_id: str

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.checkpoint_id:
            raise self._id_error(f"rc.dcp.{self._role} of {self.checkpoint_id!r} was given checkpoint_id "
                                 f"{checkpoint_id!r}: pass checkpoint_id=None (the {self._role} names the version)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked for a bare path: rc.dcp.reader(run, step) / writer(engine, step) name one
