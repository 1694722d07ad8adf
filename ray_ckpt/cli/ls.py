"""``ray-ckpt ls URI [--json]``: the versions of a run, committed or not."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

from ..storage import layout
from .common import EXIT_OK, CliError, add_json_flag, human, iso_time, print_json, say, table
from .run_view import Run, command_parser, is_partial


SUMMARY = "list the versions of a run"
DESCRIPTION = ("List the versions of a run: version, step, creation time, size, "
               "states and status (complete / partial / retired / unreadable / lost with a node).")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "ls", SUMMARY, DESCRIPTION, run)
    add_json_flag(s)
    s.add_argument("--ray-address", metavar="ADDRESS", default=None,
                   help="also ask the run's live coordinator on this Ray cluster ('auto': the local one) "
                        "which nodes hold peer replicas of each version (a REPLICAS column) and whether a "
                        "preemption notice is in force (nodes drained, versions moved, lost)")


def _live_status(args: argparse.Namespace, run: Run) -> Any:
    """The run's live coordinator's status (``--ray-address``; None without the flag): peer
    replicas and preemption notices live in the coordinator, not in storage."""
    if not args.ray_address:
        return None
    import ray  # only with --ray-address: the command line starts without Ray

    from ..protocol import NAMESPACE, actor_name

    names = [m.run for m in (run.load(v) for v in reversed(run.versions) if run.dirs.get(v)) if m is not None]
    name = names[0] if names else run.tier.uri.rstrip("/").rsplit("/", 1)[-1]
    if not ray.is_initialized():
        ray.init(address=args.ray_address, logging_level="ERROR", log_to_driver=False)
    try:
        coordinator = ray.get_actor(actor_name(name), namespace=NAMESPACE)
    except ValueError:
        raise CliError(f"run {name!r} has no live coordinator on the Ray cluster at {args.ray_address}") from None
    return ray.get(coordinator.status.remote(), timeout=60)


def _notice_lines(notice: Dict[str, Any]) -> List[str]:
    """How ``ls`` shows ``status()["preemption"]`` under its table."""
    left = notice["seconds_left"]
    when = "no deadline" if left is None else f"{left:.0f}s left" if left >= 0 else "deadline passed"
    head = (f"preemption notice{'' if notice['active'] else ' (ended)'}: node(s) {', '.join(notice['nodes'])} "
            f"drained, {when}")
    lines = [head, f"  moved to safety: {notice['moved'] or '-'}; moving: {notice['moving'] or '-'}; "
                   f"still only on the drained node(s): {notice.get('at_risk') or '-'}"]
    lines += [f"  lost step {step}: {why}" for step, why in sorted(notice["lost"].items())]
    return lines


def _row(run: Run, v: int) -> Dict[str, Any]:
    row: Dict[str, Any] = {"version": v, "dir": layout.version_dir(v)}
    if not run.dirs[v]:
        u = run.uncommitted()[v]
        mtimes = [mtime for _rel, _size, mtime in u["files"] if mtime is not None]
        row.update(step=None, created_at=max(mtimes) if mtimes else None,
                   bytes=sum(size for _rel, size, _mtime in u["files"]), states={}, committed=False,
                   status="retired" if u["kind"] == "retired" else "partial", kind=u["kind"], detail=u["detail"])
        return row
    m = run.load(v)
    if m is None:
        row.update(step=None, created_at=None, bytes=None, states={}, committed=False,
                   status="unreadable", detail=run.error(v))
        return row
    states = sorted(m.states.items())
    lost = run.lost.get(v)
    if lost is not None and lost.matches(m):  # its node died with files nowhere else (storage/lost.py)
        row.update(step=m.step, created_at=m.created_at, bytes=m.bytes, states={n: e.status for n, e in states},
                   committed=False, status="lost", metrics=dict(m.metrics), detail=lost.why)
        return row
    row.update(step=m.step, created_at=m.created_at, bytes=m.bytes, states={n: e.status for n, e in states},
               committed=True, status="partial" if is_partial(m) else "complete", metrics=dict(m.metrics),
               detail="; ".join(f"{n}: {e.status}{' - ' + e.detail if e.detail else ''}"
                                for n, e in states if e.status in ("missing", "pending")))
    return row


def run(args: argparse.Namespace) -> int:
    run = Run.open(args)
    if not run.dirs:
        hint = run.no_versions_hint()
        if hint:  # a directory of runs, not a run: almost certainly the wrong URI
            raise CliError(f"{run.uri} holds no checkpoint versions{hint}")
    live = _live_status(args, run)
    replicas = None if live is None else {v: list(nodes) for v, nodes in live.replicas.items()}
    notice = None if live is None else live.preemption
    rows: List[Dict[str, Any]] = []
    for v in run.versions:
        row = _row(run, v)
        row["created"] = iso_time(row["created_at"])
        if replicas is not None:
            row["replicas"] = replicas.get(v, [])
        rows.append(row)
    if args.json:
        print_json({"uri": run.uri, "versions": rows, **({"preemption": notice} if live is not None else {})})
        return EXIT_OK
    if not rows:
        say(f"no checkpoint versions in {run.uri}{run.no_versions_hint()}")
        return EXIT_OK
    body = [[str(r["version"]), "-" if r["step"] is None else str(r["step"]), r["created"], human(r["bytes"]),
             ",".join(n if s in ("stored", "loader") else f"{n}({s})" for n, s in r["states"].items()) or "-",
             r["status"]] + ([",".join(r["replicas"]) or "-"] if replicas is not None else []) for r in rows]
    for line in table(body, ["VERSION", "STEP", "CREATED", "SIZE", "STATES", "STATUS"]
                      + (["REPLICAS"] if replicas is not None else [])):
        say(line)
    notes = [f"  {r['dir']}: {r['detail']}" for r in rows if r["status"] != "complete" and r.get("detail")]
    if notes:
        say("notes:")
        for note in notes:
            say(note)
    for line in _notice_lines(notice) if notice and "nodes" in notice else ():
        say(line)
    return EXIT_OK
