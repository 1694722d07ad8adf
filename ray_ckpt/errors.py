"""Exceptions. Every failure a user can see derives from ``CheckpointError``."""


class CheckpointError(Exception):
    """Base class of every error ray_ckpt raises on purpose."""


class SaveError(CheckpointError):
    """A save could not be accepted or did not become durable."""


class SaveTimeoutError(SaveError, TimeoutError):
    """A wait for a save ran out of time (the save may still end): a ``TimeoutError`` too, as
    ``concurrent.futures.Future.result(timeout)`` raises."""


class RestoreError(CheckpointError):
    """A restore or load could not bring the requested state back."""


class IntegrityError(CheckpointError):
    """Bytes read from storage do not match the manifest (size or checksum)."""


class UnsupportedTypeError(SaveError, TypeError):
    """A state holds an object that has no safe (non-pickle) format."""


class InvalidArgumentError(CheckpointError, ValueError):
    """Bad input at the call (unknown name, bad strategy, path-like name, ...); nothing was written."""


class InvalidSaveError(InvalidArgumentError, SaveError):
    """A ``save()`` call refused before any byte was written (step going backwards, ...)."""


def one_line(exc: BaseException) -> str:
    """An exception as one line of text (SDK errors span many), for error messages and reports."""
    return " ".join(str(exc).split()) or type(exc).__name__


def about(subject: str, exc: BaseException) -> str:
    """``exc``'s message prefixed with ``subject`` once (an inner reader's error may name it already)."""
    text = str(exc)
    return text if text.startswith(subject) else f"{subject}: {text}"


class OwnershipError(CheckpointError):
    """The run is owned by another live driver (job); ``create(..., takeover=True)`` takes it over."""
