"""``ray-ckpt gc URI --keep-last N [--keep-every K] [--keep-best METRIC:max|min:N] [--partial]
[--dry-run] [--force] [--progress | --no-progress] [--json]``: delete the committed versions a retention rule does not keep (the engine's
rules), never a file that a kept version refers to. Refused while the run's owner (a live engine,
``owner.json``) holds a fresh lease, unless ``--force``; ``--dry-run`` only lists."""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..storage.checkpoint_io import delete_version
from ..errors import IntegrityError, one_line
from ..storage.ownership import OWNER_FILE, OwnerRecord
from ..storage import layout
from ..storage.gc_notice import NOTICE_FILE, NOTICE_WAIT_S, write_notice
from ..storage.retention import RetentionPolicy, VersionInfo, plan_deletions
from .common import (EXIT_OK, CliError, UsageError, add_json_flag, human, plural, positive_int, print_json, say,
                     vlist, warn)
from .progress import Progress, add_progress_flags, wanted
from .run_view import Run, command_parser, dir_files

PROGRESS_AUTO_DIRS = 20  # gc shows progress by itself from this many directories to delete on

_vdir = layout.version_dir


def _keep_best(text: str) -> Tuple[str, str, int]:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or parts[1] not in ("max", "min") or not parts[2].isdigit() \
            or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected METRIC:max|min:N (e.g. reward:max:2), got {text!r}")
    return parts[0], parts[1], int(parts[2])


SUMMARY = "delete old versions by a retention rule"
DESCRIPTION = ("Delete committed versions that the retention rule does not keep (the "
               "same rules as the engine: newest N, every K-th step, best by a metric; "
               "the newest committed version is always kept). Files that kept versions "
               "refer to (a RELOADABLE state stored once) are never deleted. Versions "
               "recorded lost with a node (lost_versions.json) are not counted as kept and "
               "their leftover files are deleted. Refused while "
               "a live engine owns the run (a fresh lease in owner.json), naming it, unless --force.")


SWITCHES = (  # (flags, help) of gc's on/off options
    (("--partial",), "also remove version directories without a manifest that are older than the newest committed "
                     "version (abandoned saves); never newer ones, which may be in flight. Files that kept versions "
                     "refer to are never deleted; shared files that no kept version refers to any more are deleted "
                     "without this flag"),
    (("--dry-run", "-n"), "print what would be deleted; delete nothing"),
    (("--force",), "delete even while the run's owner (a live engine, owner.json) holds a fresh lease; without it "
                   "gc refuses, naming the owner. With it gc names the versions in the run's gc_notice.json and "
                   "waits a few seconds, so that the live engine stops listing them before they are deleted"),
    (("--verbose", "-v"), "list every file"),
)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "gc", SUMMARY, DESCRIPTION, run)
    s.add_argument("--keep-last", type=positive_int, metavar="N", help="keep the N newest versions")
    s.add_argument("--keep-every", type=positive_int, metavar="K",
                   help="also keep every version whose step is a multiple of K")
    s.add_argument("--keep-best", type=_keep_best, metavar="METRIC:max|min:N",
                   help="also keep the N best versions by a metric given to save(metrics=...)")
    for flags, text in SWITCHES:
        s.add_argument(*flags, action="store_true", help=text)
    add_progress_flags(s, auto=f"from {PROGRESS_AUTO_DIRS} directories to delete on")
    add_json_flag(s)


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    if args.keep_last is None and args.keep_every is None and args.keep_best is None:
        raise UsageError("gc needs a retention rule: --keep-last N and/or --keep-every K (or --keep-best)")
    try:
        return RetentionPolicy(args.keep_last, args.keep_every, args.keep_best)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


class Plan:
    """What gc keeps, what it deletes (``targets``: (version, label, kind)) and what it leaves alone."""

    def __init__(self, run: Run, policy: RetentionPolicy, partial: bool):
        self.committed = committed = run.committed()
        self.lost = run.lost_here()  # lost with a node: not checkpoints, their files are deleted
        self.unreadable = [v for v in run.with_manifest if v not in committed and v not in self.lost]
        uncommitted = run.uncommitted()
        self.in_flight = [v for v, u in uncommitted.items() if u["kind"] == "in_flight"]
        self.abandoned = [v for v, u in uncommitted.items() if u["kind"] == "abandoned"]
        self.newest = max(committed) if committed else None
        self.kept: List[int] = []
        self.keep_paths: Set[str] = set()
        self.targets: List[Tuple[int, str, str]] = []
        if not committed:
            return
        doomed = plan_deletions(policy, [VersionInfo(v, m.step, m.metrics) for v, m in committed.items()])
        if self.newest in doomed:  # RetentionPolicy.keep always keeps the newest; never trust that blindly
            doomed.remove(self.newest)
        self.kept = sorted(v for v in committed if v not in doomed)
        self.keep_paths = {p for v in self.kept for p in committed[v].referenced_paths()}
        targets = [(v, f"version {v} (step {committed[v].step})", "version") for v in doomed]
        # directories that only held shared files (their own version was deleted earlier) whose files
        # no kept version refers to any more: complete files nobody can restore, never in flight
        targets += [(v, f"{_vdir(v)} (shared files of deleted versions)", "retired") for v, u in uncommitted.items()
                    if u["kind"] == "retired" and any(r not in self.keep_paths for r in u["rels"])]
        targets += [(v, f"version {v} ({why})", "lost") for v, why in self.lost.items()]
        if partial:
            targets += [(v, f"uncommitted {_vdir(v)} (no manifest)", "abandoned") for v in self.abandoned]
        self.targets = sorted(targets)


def _delete(run: Run, plan: Plan, v: int, dry: bool, done: int) -> Dict[str, Any]:
    """Delete (or with ``dry``, plan to delete) target ``v``: what went, what stayed, the bytes."""
    sizes = {rel: size for rel, size, _mtime in dir_files(run.tier, _vdir(v))}
    sizes.pop(layout.manifest_path(v), None)
    to_go = sorted(p for p in sizes if p not in plan.keep_paths)
    shared = sorted(p for p in sizes if p in plan.keep_paths)
    if not dry:
        try:
            to_go = sorted(delete_version(run.tier, v, plan.keep_paths))
        except OSError as exc:
            raise CliError(f"deleting {_vdir(v)} from {run.uri} failed: {one_line(exc)}"
                           + (f" (deleted {plural(done, 'version')} before it)" if done else "")) from None
    return {"files": to_go, "kept_shared": shared, "bytes": sum(sizes.get(p, 0) for p in to_go)}


def live_owner(run: Run, now: Optional[float] = None) -> Optional[Tuple[str, float]]:
    """(who, seconds until the lease expires) when the run's owner record (``owner.json`` in the
    run root) holds a lease that has not expired: an engine is saving into the run. None otherwise
    (no record, an expired lease, or a record that cannot be read: warned)."""
    now = time.time() if now is None else now
    try:
        raw = run.tier.read_bytes(OWNER_FILE) if run.tier.exists(OWNER_FILE) else None
        record = OwnerRecord.from_json(bytes(raw), f"{run.uri}/{OWNER_FILE}") if raw is not None else None
    except (OSError, IntegrityError) as exc:
        warn(f"warning: cannot read the run's owner record: {one_line(exc)}")
        return None
    if record is None or record.expired(now):
        return None
    return record.describe(now), max(0.0, record.lease_s - (now - record.renewed))


def refuse_live_owner(run: Run, command: str, force: bool, dry: bool) -> Optional[Dict[str, Any]]:
    """Every command that deletes calls this before deleting: on a run whose owner's lease is
    fresh it raises CliError naming the owner and when the lease expires, unless ``force`` (or
    ``dry``: nothing is deleted; a warning then). Returns the owner for JSON output (or None)."""
    live = live_owner(run)
    if live is None:
        return None
    who, left = live
    what = f"{run.uri} is owned by a live engine: {who}; the lease expires in {left:.0f}s unless renewed"
    if not (force or dry):
        raise CliError(f"{command} refused: {what}. A live engine lists, restores and prunes these versions "
                       f"itself (create(..., keep_last=N, reconfigure=True) changes its retention); stop it "
                       f"(engine.shutdown() frees the run at once) or wait for the lease to expire, or pass "
                       f"--force to delete anyway")
    warn(f"warning: {what}" + ("; --force: deleting anyway" if force and not dry else ""))
    return {"owner": who, "lease_expires_in_s": round(left, 1)}


def _notify_live_engine(run: Run, plan: Plan) -> None:
    """--force on a live run: name the versions about to go in the run's gc notice and give the
    live coordinator time to read it (``storage/gc_notice.py``), so that its catalogue stops
    listing them before their files are deleted."""
    removed = [(v, plan.committed[v].step, plan.committed[v].created_at)
               for v, _label, kind in plan.targets if kind == "version"]
    if not removed:
        return
    try:
        write_notice(run.tier, removed)
    except OSError as exc:
        raise CliError(f"cannot write {run.uri}/{NOTICE_FILE} to tell the live engine: {one_line(exc)}; "
                       f"nothing was deleted") from None
    warn(f"warning: told the live engine ({NOTICE_FILE}); deleting in {NOTICE_WAIT_S:.0f}s")
    time.sleep(NOTICE_WAIT_S)


def run(args: argparse.Namespace) -> int:
    policy = _policy(args)
    run = Run.open(args)
    dry, text = args.dry_run, not args.json
    owner = refuse_live_owner(run, "gc", args.force, dry)  # before anything is deleted
    verb = "would delete" if dry else "deleted"
    plan = Plan(run, policy, args.partial)
    warnings = [f"leaving {_vdir(v)} alone: {run.error(v)}" for v in plan.unreadable]
    doc: Dict[str, Any] = {"uri": run.uri, "dry_run": dry, "newest": plan.newest, "kept": plan.kept,
                           "deleted": [], "in_flight": plan.in_flight, "abandoned": plan.abandoned,
                           "warnings": warnings, "live_owner": owner}
    if plan.newest is None:
        for w in warnings:
            warn(f"warning: {w}")
        if text:
            say(f"nothing to do: {run.uri} has no committed version"
                + (f" (versions without manifest: {vlist(run.without_manifest)}; gc never deletes those "
                   f"unless a newer version is committed)" if run.without_manifest else ""))
        else:
            print_json(doc)
        return EXIT_OK
    if plan.in_flight:
        warnings.append(f"leaving {vlist([_vdir(v) for v in plan.in_flight])} alone: newer than the newest "
                        f"committed version {plan.newest} and without manifest (a save may be in flight)")
    for w in warnings:
        warn(f"warning: {w}")
    if text:
        say(f"keeping {plural(len(plan.kept), 'version')}: {vlist(plan.kept)} (newest: {plan.newest})")
    if owner is not None and not dry and plan.targets:
        _notify_live_engine(run, plan)
    n_versions = 0
    # deleting from S3 is a few requests per file: hundreds of versions take minutes
    progress = Progress(len(plan.targets), not dry and wanted(args, len(plan.targets) >= PROGRESS_AUTO_DIRS),
                        "gc", unit="directories")
    try:
        for v, label, kind in plan.targets:
            d = _delete(run, plan, v, dry, n_versions)
            n_versions += kind == "version"
            doc["deleted"].append({"version": v, "kind": kind, **d})
            progress.add()
            if text and not (progress.enabled and progress.tty):  # a line per target would tear the bar
                _print_target(f"{verb} {label}", d, args.verbose)
    except CliError as exc:
        if not text:  # what was deleted before the failure
            print_json({**doc, "error": str(exc)})
        raise
    finally:
        progress.finish()
    totals = {"versions_deleted": n_versions, "directories_deleted": len(doc["deleted"]) - n_versions,
              "files_deleted": sum(len(d["files"]) for d in doc["deleted"]),
              "bytes_deleted": sum(d["bytes"] for d in doc["deleted"])}
    if text:
        _print_summary(plan, totals, dry, args.partial)
    else:
        print_json({**doc, **totals})
    return EXIT_OK


def _print_summary(plan: Plan, totals: Dict[str, int], dry: bool, partial: bool) -> None:
    if not partial and plan.abandoned:
        one = len(plan.abandoned) == 1
        say(f"note: {vlist([_vdir(v) for v in plan.abandoned])} (older than version {plan.newest}) "
            f"{'has' if one else 'have'} no manifest (a save that never committed, or leftovers); "
            f"pass --partial to remove {'it' if one else 'them'}")
    prefix = "gc (dry run): would delete" if dry else "gc: deleted"
    n_dirs = totals["directories_deleted"]
    dirs = f" and {n_dirs} other version director{'y' if n_dirs == 1 else 'ies'}" if n_dirs else ""
    say(f"{prefix} {plural(totals['versions_deleted'], 'version')}{dirs}, {plural(totals['files_deleted'], 'file')}, "
        f"{human(totals['bytes_deleted'])}")


def _print_target(head: str, d: Dict[str, Any], verbose: bool) -> None:
    shared = d["kept_shared"]
    keep_note = f"; kept {plural(len(shared), 'shared file')} that kept versions still refer to" if shared else ""
    say(f"{head}: {plural(len(d['files']), 'file')}, {human(d['bytes'])}{keep_note}")
    if verbose:
        for p in d["files"]:
            say(f"  {p}")
        for p in shared:
            say(f"  kept {p}")
