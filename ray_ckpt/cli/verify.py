"""``ray-ckpt verify URI [VERSION | --all] [--progress | --no-progress] [--json]``: re-read every
file the manifest(s) list and check its size and checksum (exit status 1 if anything is wrong)."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.fs as pafs

from ..storage.checkpoint_io import stray_files
from ..errors import CheckpointError, IntegrityError, one_line
from ..formats.checksum import ALGORITHM, STRIDE, HashingSink
from ..formats.manifest import FileEntry, Manifest
from ..storage import layout
from ..storage.tier import VERIFY_THREADS, Tier
from .common import EXIT_OK, CliError, add_json_flag, human, plural, print_json, rank_order, say
from .progress import AUTO_BYTES, Progress, add_progress_flags
from .run_view import Run, command_parser, add_version_argument



SUMMARY = "re-read files and check sizes and checksums"
DESCRIPTION = ("Re-read every file listed by the manifest(s) and check its size and "
               "checksum. Exit status 1 if anything is wrong.")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "verify", SUMMARY, DESCRIPTION, run)
    g = s.add_mutually_exclusive_group()
    add_version_argument(g, "verify")
    g.add_argument("--all", action="store_true", help="verify every committed version")
    add_progress_flags(s, auto="only from 256 MiB on")
    add_json_flag(s)


# ---------------------------------------------------------------- checking files
def hash_file(tier: Tier, rel: str, progress: Progress) -> Tuple[int, str]:
    """(size, digest) of ``rel``: a local file by blocks in parallel, a remote one streamed in STRIDE
    strides."""
    if tier.is_local:  # checksum blocks read in parallel
        return tier.hash_file(rel, VERIFY_THREADS, progress.add)
    sink = HashingSink()
    with tier.fs.open_input_stream(tier.abspath(rel)) as f:
        while True:
            data = f.read(STRIDE)
            if not data:
                break
            sink.write(data)
            progress.add(len(data))
    return sink.size, sink.digest()


def check_file(tier: Tier, f: FileEntry, progress: Progress) -> Optional[Tuple[str, str]]:
    """None when ``f`` matches its manifest entry, else (KIND, what is wrong)."""
    try:
        info = tier.fs.get_file_info(tier.abspath(f.path))
        if info.type == pafs.FileType.NotFound:
            progress.add(f.size)
            return "MISSING", "the file does not exist"
        if info.type != pafs.FileType.File:
            progress.add(f.size)
            return "MISSING", "not a regular file"
        if info.size is not None and info.size != f.size:
            progress.add(f.size)
            return "SIZE", f"{info.size} bytes, the manifest says {f.size}"
        size, digest = hash_file(tier, f.path, progress)
    except FileNotFoundError:
        return "MISSING", "the file does not exist"
    except (OSError, IntegrityError) as exc:  # IntegrityError: a link or special file in its place (NotOurs)
        return "UNREADABLE", one_line(exc)
    if size != f.size:
        return "SIZE", f"{size} bytes, the manifest says {f.size}"
    if digest != f.checksum:
        return "CORRUPT", f"{ALGORITHM} checksum mismatch (the bytes differ from what was written)"
    return None


def check_files(tier: Tier, manifests: Dict[int, Manifest], progress_flag: Optional[bool]
                ) -> Tuple[Dict[str, Optional[Tuple[str, str]]], int]:
    """Every distinct file of ``manifests`` checked once, even when several versions refer to it (a
    RELOADABLE state): path -> problem or None; and the bytes they hold."""
    unique: Dict[str, FileEntry] = {}
    conflicts: Dict[str, Tuple[str, str]] = {}
    for v, m in manifests.items():
        for f in (f for e in m.states.values() for f in e.all_files()):
            seen = unique.setdefault(f.path, f)
            if (seen.size, seen.checksum) != (f.size, f.checksum):
                conflicts[f.path] = ("CONFLICT", f"manifests disagree about its size or checksum (see version {v})")
    total = sum(f.size for f in unique.values())
    enabled = (progress_flag is True) or (progress_flag is None and total >= AUTO_BYTES)
    progress = Progress(total, enabled, "verify")
    results: Dict[str, Optional[Tuple[str, str]]] = {}
    try:
        for path, f in unique.items():
            results[path] = conflicts.get(path) or check_file(tier, f, progress)
    finally:
        progress.finish()
    return results, total


# ---------------------------------------------------------------- the report
def _targets(run: Run, args: argparse.Namespace) -> Tuple[List[int], List[str]]:
    """The versions to verify, and notes on the version directories that are not verified."""
    if not args.all:
        return [run.manifest(args.version).version], []
    run.require_committed()
    notes = []
    for v, u in run.uncommitted().items():
        if u["kind"] == "retired":
            notes.append(f"note: {layout.version_dir(v)} has no manifest of its own; its files were verified as "
                         f"part of the versions that refer to them")
        else:
            why = "probably being written" if u["kind"] == "in_flight" else "a save that never committed"
            notes.append(f"note: {layout.version_dir(v)} has no manifest ({why}); not verified")
    return run.with_manifest, notes


def _version_report(m: Manifest, results: Dict[str, Optional[Tuple[str, str]]]) -> Dict[str, Any]:
    problems, notes = [], []
    files = 0
    for name in sorted(m.states):
        e = m.states[name]
        if e.status in ("missing", "pending"):
            notes.append({"state": name, "note": f"state {name!r} is {e.status} in the manifest"
                          + (f" ({e.detail})" if e.detail else "") + " - nothing to verify"})
        for rank in rank_order(e.files):
            for f in e.files[rank]:
                files += 1
                problem = results.get(f.path)
                if problem:
                    problems.append({"kind": problem[0], "path": f.path, "state": name, "rank": rank,
                                     "detail": problem[1]})
    return {"version": m.version, "step": m.step, "status": "failed" if problems else "ok", "files": files,
            "bytes": sum(f.size for e in m.states.values() for f in e.all_files()), "problems": problems,
            "notes": notes}


def _print_version(r: Dict[str, Any]) -> None:
    if r["status"] == "bad_manifest":
        say(f"version {r['version']}: BAD MANIFEST: {r['error']}")
        return
    if r["problems"]:
        say(f"version {r['version']} (step {r['step']}): FAILED, {len(r['problems'])} of "
            f"{plural(r['files'], 'file')} bad")
    else:
        say(f"version {r['version']} (step {r['step']}): OK, {plural(r['files'], 'file')}, "
            f"{human(r['bytes'])} verified")
    for p in sorted(r["notes"] + r["problems"], key=lambda x: (x["state"], "kind" in x)):  # by state, notes first
        if "note" in p:
            say(f"  note: {p['note']}")
        else:
            say(f"  {p['kind']:<10} {p['path']}  (state {p['state']!r}, rank {p['rank']}): {p['detail']}")


def run(args: argparse.Namespace) -> int:
    run = Run.open(args)
    targets, notes = _targets(run, args)
    reports: Dict[int, Dict[str, Any]] = {}
    manifests: Dict[int, Manifest] = {}
    for v in targets:
        m = run.load(v)
        if m is None:
            reports[v] = {"version": v, "status": "bad_manifest", "error": run.error(v)}
        elif m.checksum_algorithm != ALGORITHM:
            reports[v] = {"version": v, "status": "bad_manifest", "error": (
                f"unsupported checksum algorithm {m.checksum_algorithm!r} (this ray-ckpt checks {ALGORITHM})")}
        else:
            manifests[v] = m
    results, total = check_files(run.tier, manifests, args.progress)
    reports.update({v: _version_report(m, results) for v, m in manifests.items()})
    for v, m in manifests.items():  # leftovers a killed writer left inside a committed version
        try:
            strays = stray_files(run.tier, v, m)
        except (CheckpointError, OSError) as exc:
            strays = [f"(cannot list: {one_line(exc)})"]
        reports[v]["notes"] += [{"state": "", "note": f"{path} is not named by the manifest (a leftover of an "
                                 f"interrupted write, or put there by hand); not verified, never restored"}
                                for path in strays]
    versions = [reports[v] for v in targets]
    n_bad = sum(len(r["problems"]) if "problems" in r else 1 for r in versions)
    if args.json:
        print_json({"uri": run.uri, "ok": not n_bad, "checksum_algorithm": ALGORITHM, "versions": versions,
                    "distinct_files": len(results), "bytes": total, "problems": n_bad, "notes": notes})
    else:
        for r in versions:
            _print_version(r)
        for note in notes:
            say(note)
    if n_bad:
        raise CliError(f"verification failed: {plural(n_bad, 'problem')} in {plural(len(targets), 'version')} of "
                       f"{run.uri} (listed above)")
    if not args.json:
        say(f"OK: {plural(len(targets), 'version')}, {plural(len(results), 'distinct file')}, {human(total)} "
            f"verified ({ALGORITHM})")
    return EXIT_OK
