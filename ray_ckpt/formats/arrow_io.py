"""Buffers (Arrow tables) as Arrow IPC files: columnar, memory-mappable, readable by any Arrow tool."""
from __future__ import annotations

from typing import Any, List, Optional

import pyarrow as pa

from ..errors import IntegrityError


def write(table: pa.Table, sink: Any, compression: Optional[str] = None) -> None:
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema, options=opts) as w:
        w.write_table(table)


class _Collect:
    """A sink that keeps what it is given: Arrow hands a sink the table's own column buffers."""

    closed = False

    def __init__(self):
        self.parts: List[Any] = []

    def write(self, data: Any) -> int:
        self.parts.append(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def segments(table: pa.Table) -> List[Any]:
    """The uncompressed IPC file of ``table`` as consecutive byte pieces, the column data among
    them being the table's own memory (no copies): for the block writer (threads, O_DIRECT), which
    takes a file as pieces. The bytes are those ``write(table, sink)`` streams."""
    sink = _Collect()
    write(table, sink)
    return sink.parts


def read(buf: Any, *, path: str = "<table>") -> pa.Table:
    """The table of an Arrow IPC file held in ``buf``, validated in full (offsets, lengths, UTF-8)
    before use. Raises IntegrityError naming ``path`` for anything that is not a valid IPC file."""
    try:
        return open_validated(buf)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, OSError, pa.ArrowException) as exc:
        raise IntegrityError(f"{path}: not a valid Arrow IPC file ({' '.join(str(exc).split())})") from None


def open_validated(buf: Any) -> pa.Table:
    """``pa.ipc.open_file(buf).read_all()`` followed by ``table.validate(full=True)``: every
    buffer, offset and length checked, so a crafted file is an error here, not a wild read later.
    Raises pyarrow's own errors (the caller names the file)."""
    table = pa.ipc.open_file(pa.py_buffer(buf)).read_all()
    table.validate(full=True)
    return table
