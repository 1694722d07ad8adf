"""Buffers (Arrow tables) as Arrow IPC files: columnar, memory-mappable, readable by any Arrow tool.

A table whose schema metadata says it is an append-only buffer's segment (:data:`SEGMENT_FORMAT`)
is written in Arrow's IPC *stream* format instead (``pa.ipc.open_stream`` reads it): the file
format writes the schema twice (at the start and in the footer), and a segment that holds one
save's few hundred rows is small enough for that to be a tenth of its bytes. Segments are read
whole and in order, so the footer's random access is not needed. :func:`open_validated` reads both.
"""
from __future__ import annotations

from typing import Any, List, Optional

import pyarrow as pa

from ..errors import IntegrityError

FORMAT_KEY = b"ray_ckpt.format"
SEGMENT_FORMAT = b"segment/1"  # buffer_io's buffer, as one segment of an append-only state
_FILE_MAGIC = b"ARROW1"


def is_segment(schema: pa.Schema) -> bool:
    return (schema.metadata or {}).get(FORMAT_KEY) == SEGMENT_FORMAT


def write(table: pa.Table, sink: Any, compression: Optional[str] = None) -> None:
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    new = pa.ipc.new_stream if is_segment(table.schema) else pa.ipc.new_file
    with new(pa.PythonFile(sink, mode="w"), table.schema, options=opts) as w:
        w.write_table(table)


class _Collect:
    """A sink that keeps what it is given: Arrow hands a sink the table's own column buffers."""

    closed = False

    def __init__(self):
        self.views: List[Any] = []

    def write(self, data: Any) -> int:
        self.views.append(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def file_views(table: pa.Table) -> List[Any]:
    """The uncompressed IPC file of ``table`` as consecutive byte views, the column data among
    them being the table's own memory (no copies): for the block writer (threads, O_DIRECT), which
    takes a file as views. The bytes are those ``write(table, sink)`` streams."""
    sink = _Collect()
    write(table, sink)
    return sink.views


def read(buf: Any, *, path: str = "<table>") -> pa.Table:
    """The table of an Arrow IPC file held in ``buf``, validated in full (offsets, lengths, UTF-8)
    before use. Raises IntegrityError naming ``path`` for anything that is not a valid IPC file."""
    try:
        return open_validated(buf)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, OSError, pa.ArrowException) as exc:
        raise IntegrityError(f"{path}: not a valid Arrow IPC file ({' '.join(str(exc).split())})") from None


def open_validated(buf: Any) -> pa.Table:
    """``pa.ipc.open_file(buf).read_all()`` (``open_stream`` for a stream: no file magic at the
    start) followed by ``table.validate(full=True)``: every buffer, offset and length checked, so a
    crafted file is an error here, not a wild read later. Raises pyarrow's own errors (the caller
    names the file)."""
    data = pa.py_buffer(buf)
    stream = data.size < len(_FILE_MAGIC) or data[:len(_FILE_MAGIC)].to_pybytes() != _FILE_MAGIC
    table = (pa.ipc.open_stream if stream else pa.ipc.open_file)(data).read_all()
    table.validate(full=True)
    return table
