"""A version whose parts do not all arrive: what ``rank_timeout_s`` fails, and the message it gives.

A version opened by ranks' pushes (or by the driver's save) waits for every declared rank's part,
and for the driver's own states when its ranks opened it. A rank that never pushes must not leave
the version pending for ever, nor later versions behind it: after ``rank_timeout_s`` its missing
parts are failed, and the version with them when one blocks the commit (a missing best-effort part
is only reported missing). Ray-free: the coordinator sleeps, this decides, on the catalogue.
"""
from __future__ import annotations

from typing import Optional, Tuple

from .catalogue import Catalogue

SHOWN = 8  # missing parts named in the error; the rest are counted


def expire_missing(catalogue: Catalogue, version: int, timeout_s: float) -> Optional[Tuple[str, bool]]:
    """Fail the parts of pending ``version`` not submitted yet. Returns None when none is missing,
    else ``(what, fails)``: the message naming the missing ranks (and the driver's save if it did
    not come), and whether the version now fails with it (a commit-blocking part is missing and
    the version had not failed already: its error names the missing ranks, not the last part)."""
    pv = catalogue.pending.get(version)
    if pv is None or not pv.missing_submits():
        return None
    missing = [p for p in pv.parts.values() if not p.submitted]
    driver = sorted(p.name for p in missing if p.placeholder)
    critical = [p for p in missing if p.blocks_commit and not p.placeholder]
    named = sorted(critical or [p for p in missing if not p.placeholder], key=lambda p: (p.name, p.rank))
    shown = ", ".join(f"{p.name!r} rank {p.rank}" for p in named[:SHOWN])
    more = f"+{len(named) - SHOWN} more; " if len(named) > SHOWN else ""
    what = "; ".join(
        ([f"ranks did not push within rank_timeout_s={timeout_s:g}s: {shown} "
          f"({more}{len(named)} of {len(pv.parts)} parts)"] if named else [])
        + ([f"the driver's save(step={pv.step}) did not arrive within rank_timeout_s="
            f"{timeout_s:g}s (driver-side states {driver}: a version its ranks open "
            f"commits only with them)"] if driver else []))
    critical = critical or [p for p in missing if p.placeholder]
    failed_before = pv.error
    why = f"no part arrived within rank_timeout_s={timeout_s:g}s"
    for p in missing:
        p.submitted = True
        catalogue.part_failed(version, p.name, p.rank, why)
    fails = bool(critical) and not failed_before
    if fails:
        pv.error = what
    return what, fails
