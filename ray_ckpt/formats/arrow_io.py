"""Buffers (Arrow tables) as Arrow IPC files: columnar, memory-mappable, readable by any Arrow tool."""
from __future__ import annotations

from typing import Any, List, Optional

import pyarrow as pa


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


def read(buf: Any) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(buf)).read_all()
