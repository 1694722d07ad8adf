"""A verified ranged read of one state's files across tiers: :class:`RangeReader`.

``read_checked(file, begin, end, check)`` returns the bytes of the first tier (local, then a peer
replica, then remote) whose copy passes ``check``; before the first range of a file is used, the
file's safetensors header is read and checked against the manifest's head record and the shard
index (``shard_header``). Each tier's file is opened once for every range (``range_source``).
Used by ``sharded_io``'s loads and by ``rc.dcp.reader``; no Ray, no torch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .checkpoint_io import NoGoodCopy
from ..errors import IntegrityError, RestoreError, one_line
from ..formats import safetensors_io
from ..formats.manifest import ROLE_TENSORS, StateEntry
from ..formats.shard_record import HEADS_KEY, ShardHead
from .shard_header import check_header_chunks, digest_check, parse_header
from .tier import Tier, farther

__all__ = ["RangeReader"]


class RangeReader:
    """``read_range(file, begin, end)`` over the files of one state entry on ``tiers`` (in order).

    ``read_checked(file, begin, end, check)`` returns the first tier's bytes for which ``check``
    (raising IntegrityError) passes: a corrupt or missing local copy falls back to the remote tier.
    A file id that is not one of the entry's files is refused (the index comes from storage).
    ``bytes`` counts every byte read (failed attempts too); ``tier`` is "remote" once any range
    came from there; ``problems`` lists what was passed over."""

    def __init__(self, tiers: Sequence[Tier], entry: StateEntry, name: str):
        if not tiers:
            raise RestoreError("no storage tier to read from")
        self.tiers = list(tiers)
        self.name = name
        self.paths = {f.path for f in entry.all_files()}
        self.bytes = 0
        self.calls = 0
        self.tier = self.tiers[0].name
        self.problems: List[str] = []
        self.sizes = {f.path: f.size for f in entry.all_files()}
        heads = (entry.shards or {}).get(HEADS_KEY)
        self.heads = {f.path: h for r, h in (heads.items() if isinstance(heads, dict) else ())
                      for f in entry.files.get(r, ()) if f.role == ROLE_TENSORS}  # raw: parsed when used
        self.index: Any = None  # set: the header of every file a chunk is read from is checked first
        self.headers_checked: set = set()
        self._sources: Dict[Tuple[int, str], Any] = {}  # (tier, file) -> its RangeSource, opened once

    def close(self) -> None:
        """Close the files kept open for ranged reads (also done when the reader is dropped)."""
        sources, self._sources = self._sources, {}
        for src in sources.values():
            src.close()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _source(self, t: int, tier: Tier, file: str) -> Any:
        src = self._sources.get((t, file))
        if src is None:
            src = self._sources[(t, file)] = tier.open_ranges(file)
        return src

    def __call__(self, file: str, begin: int, end: int) -> Any:
        return self.read_checked(file, begin, end, None)

    def check_header(self, file: str) -> None:
        """Read ``file``'s safetensors header (verified against its "head" record when the manifest
        has one) and cross-check the chunks the index places in it (:func:`check_header_chunks`);
        a tier whose copy does not agree is passed over like a corrupt one."""
        self.headers_checked.add(file)
        size = self.sizes.get(file, 0)
        n = want = None  # no record (only rank 0's file has one): the length prefix is read
        if file in self.heads:
            try:
                head = ShardHead.from_json(self.heads[file])
            except (KeyError, TypeError, ValueError) as exc:
                raise IntegrityError(f"{file}: the manifest's shard head is malformed ({exc})") from None
            n, want = head.nbytes, head.xxh3
        if n is None:
            if size < 8:
                raise IntegrityError(f"{file}: {size} bytes: not a safetensors file")
            try:
                n = safetensors_io.header_length(bytes(self.read_checked(file, 0, 8, None)), size) + 8
            except ValueError as exc:
                raise IntegrityError(f"{file}: {exc}") from None
        if not 8 <= n <= min(size, safetensors_io.MAX_HEADER):
            raise IntegrityError(f"{file}: header length {n} does not fit the file ({size} bytes)")

        def check(head_bytes: Any) -> None:
            if want is not None:
                digest_check(want, f"{file}: header")(head_bytes)
            structure, header, names, offsets, sizes = parse_header(file, head_bytes, n, size)
            check_header_chunks(self.index, file, structure, header, names, offsets, sizes)

        self.read_checked(file, 0, n, check)

    def read_checked(self, file: str, begin: int, end: int, check: Optional[Callable[[Any], None]]) -> Any:
        def fetch(t: int, tier: Tier) -> Any:
            if hasattr(tier, "open_ranges"):
                buf = bytearray(end - begin)
                self._source(t, tier, file).read_into(begin, buf)
                return buf
            return tier.read_range(file, begin, end)

        return self._first_good(file, begin, end, check, fetch)

    def read_checked_into(self, file: str, begin: int, out: Any, check: Optional[Callable[[Any], None]]) -> None:
        """``read_checked`` of bytes ``[begin, begin + len(out))`` straight into the writable
        buffer ``out`` (the memory of the tensor they restore: no second copy); ``check(out)`` runs
        on it after each tier's read, and a tier whose bytes fail it is passed over like in
        ``read_checked`` (``out`` then holds the next tier's bytes, or unverified ones on failure)."""
        mv = memoryview(out).cast("B")

        def fetch(t: int, tier: Tier) -> Any:
            if hasattr(tier, "open_ranges"):
                self._source(t, tier, file).read_into(begin, mv)
            else:  # a tier that only hands out fresh buffers (a peer replica)
                data = memoryview(tier.read_range(file, begin, begin + len(mv))).cast("B")
                if len(data) != len(mv):
                    raise IntegrityError(f"{file}: read {len(data)} bytes at {begin}, expected {len(mv)}")
                mv[:] = data
            return mv

        self._first_good(file, begin, begin + len(mv), check, fetch)

    def _drop(self, t: int, file: str) -> None:
        src = self._sources.pop((t, file), None)
        if src is not None:
            src.close()

    def _first_good(self, file: str, begin: int, end: int, check: Optional[Callable[[Any], None]],
                    fetch: Callable[[int, Tier], Any]) -> Any:
        if file not in self.paths:
            raise IntegrityError(f"state {self.name!r}: the shard index names {file!r}, which is not one of the "
                                 f"state's files in the manifest: refused")
        if not 0 <= begin <= end <= self.sizes.get(file, 0):
            raise IntegrityError(f"{file}: bytes {begin}..{end} lie outside the file ({self.sizes.get(file)} "
                                 f"bytes in the manifest): refused")
        if self.index is not None and file not in self.headers_checked:
            self.check_header(file)
        errors = []
        for t, tier in enumerate(self.tiers):
            try:
                data = fetch(t, tier)
                self.bytes += len(data)
                self.calls += 1
                if check is not None:
                    check(data)
            except FileNotFoundError:
                errors.append(f"{tier.name}: {file} missing")
                continue
            except IntegrityError as exc:
                errors.append(f"{tier.name}: {one_line(exc)}")
                continue
            except OSError as exc:
                errors.append(f"{tier.name}: {tier.scrub(one_line(exc))}")
                self._drop(t, file)  # a failing descriptor is not reused
                continue
            if tier is not self.tiers[0]:
                self.tier = farther(self.tier, tier.name)
            self.problems.extend(errors)
            return data
        raise NoGoodCopy(f"no good copy of bytes {begin}..{end} of {file} ({'; '.join(errors)})")
