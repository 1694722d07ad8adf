"""Buffers (Arrow tables) as Arrow IPC files: columnar, memory-mappable, readable by any Arrow tool."""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa


def write(table: pa.Table, sink: Any, compression: Optional[str] = None) -> None:
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema, options=opts) as w:
        w.write_table(table)


def read(buf: Any) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(buf)).read_all()
