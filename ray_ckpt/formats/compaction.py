"""Which segments of an append-only state a version merges into its new segment (the writer's
policy; :mod:`.segments` holds the format).

Why merge at all: every version of an append-only state lists each live segment twice, as a file
entry in the manifest (path, size, checksum, node: a few hundred bytes of JSON) and in its index.
A buffer that keeps rows for L versions has ~L live segments if each version only adds one, so
over a long run a version's manifest outweighs its new rows by far. The writer holds every live
row at each save, so merging the youngest segments into the new one reads nothing back: the new
segment is a longer tail of the buffer (rows evicted from the merged segments are not written).

The policy is a binary counter in base :data:`FANOUT` over *levels*, stored per segment in the
index: rows added by a version form a level-0 segment; when the kept segments end with
``FANOUT - 1`` segments of level ``l`` (the youngest), they are merged with the new rows into one
segment of level ``l + 1``, which may carry on to the next level the same way. A segment written
without a base (the whole buffer, at a state's first version or when the base is unreadable), and
a segment of an index written before levels, has level :data:`UNMERGED`: it is never merged
(rewriting it would rewrite a whole buffer), and it goes when its rows are evicted.

What it bounds, and why the base is 16 (figures in benchmarks/RESULTS.md, ``append_only_long.py``):

* levels never increase from the oldest segment to the youngest (:data:`UNMERGED` ones first), and
  there are at most ``FANOUT - 1`` of each level: a version lists at most ``(FANOUT - 1)`` x (its
  highest level + 1) segments besides the unmerged ones. A level-``l`` segment holds rows of ``FANOUT**l``
  versions, so in a buffer whose rows live L versions the levels stop near ``log_FANOUT(L) + 1``
  (the segments of a higher level die before ``FANOUT - 1`` of them are there to merge);
* a row is rewritten once per level it climbs: per version, about ``(FANOUT - 1) / FANOUT`` of a
  version's rows per level, in merges of ``FANOUT**l`` versions' rows every ``FANOUT**l`` versions;
* a smaller base (8) rewrites rows more often for fewer entries, a larger one (32) lists more
  segments; with a replay buffer's rows and a log's, 16 cost the least of the three (a buffer whose
  rows live much longer than 16**2 versions would do better with a larger base: fewer levels).
"""
from __future__ import annotations

from typing import Sequence, Tuple

FANOUT = 16
UNMERGED = -1  # level of a segment the policy never merges (a whole buffer; an index without levels)
MAX_LEVEL = 64  # FANOUT**64 versions: a larger level in an index is a damaged one


def merge_plan(levels: Sequence[int], fanout: int = FANOUT) -> Tuple[int, int]:
    """(how many of the youngest kept segments the new rows' segment absorbs, its level), for kept
    segments of the given levels, oldest first. Call it only when the version adds rows: a version
    that adds none writes no segment and merges nothing."""
    if fanout < 2:
        raise ValueError(f"fanout must be at least 2, got {fanout}")
    level, absorbed, end = 0, 0, len(levels)
    while True:
        run = 0
        while run < fanout - 1 and run < end and levels[end - run - 1] == level:
            run += 1
        if run < fanout - 1:
            return absorbed, level
        end -= run
        absorbed += run
        level += 1
