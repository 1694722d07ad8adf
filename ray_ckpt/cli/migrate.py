"""``ray-ckpt migrate URI [--remote URI] [--dry-run] [--force] [--json]``: rewrite every version of a
run whose RLlib replay buffer is stored in the old two-state form (``replay`` + ``replay_meta``,
formats ``ray_ckpt.rllib.replay/1``, ``/3``, ``/4``, ``/5``) as one ``replay_journal`` state (format
``/6``); the RLlib integration reads only the journal, and this command alone reads the old forms
(through the frozen :mod:`.legacy_replay`).

For each committed version, oldest first, that holds both old states: the two states are read
verified (``read_files`` + ``decode_files``, from the first tier holding a good copy), restored into
a fresh buffer of the stored type exactly as the integration restored them before the journal
(``log_to_v1`` then ``restore_replay``; format /1 straight), captured by a new journal whose row ids start at the
previous journal's ``next_row_id`` (a version's append-only files are written over the previous
version's: an id must never name two rows), and written with ``write_append_only`` over the
previous journal version's files. The version's manifest then lists ``replay_journal`` (same
strategy) instead of the two old states; everything else is kept as it was.

Manifests and tiers:

* The manifest chain (``previous``: the predecessor's ``chain_digest``) covers critical states, so
  a rewritten manifest changes its successor's ``previous``: every manifest whose predecessor
  changed is rewritten too, oldest first, re-signed when the run signs its manifests (the key ring
  from ``RAY_CKPT_SIGNING_KEY`` / ``RAY_CKPT_VERIFY_KEYS``, as every command verifies; a signed run
  without the key is refused). The head records name steps only and stay valid.
* With ``--remote URI`` the run's other tier is migrated in the same pass: a version both tiers
  hold must have the same manifest on both (as the engine uploads it); its new files are written
  once and copied, so both tiers hold the same bytes and the same new manifest. A version only one
  tier holds is migrated from that tier.
* Order: (1) every new file is written (no manifest changes yet: the files are strays of committed
  versions); (2) ``migrate_progress.json`` is written in each run root naming each rewritten
  version's old and new chain digests; (3) the manifests are swapped oldest first, each atomically;
  (4) the old ``replay`` / ``replay_meta`` files that no manifest on the tier lists any more are
  deleted; (5) the progress record is removed. A migration stopped between (2) and (5) leaves at
  most one link of the chain broken, which the progress record explains: a second run of
  ``migrate`` finishes it (and only it accepts that break).

Refused while the run's owner (a live engine) holds a fresh lease, unless ``--force``. A version in
format ``/2`` is refused by name. ``--dry-run`` reads, restores and captures (writing the captures to
a temporary directory to count their bytes) and changes nothing in the run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..config import signing_key_from_env
from ..errors import CheckpointError, one_line
from ..formats.manifest import FileEntry, Manifest, StateEntry, chain_digest, sign_manifest
from ..storage import layout
from ..storage.checkpoint_io import decode_files, rank_files, read_files, write_append_only, write_manifest
from ..storage.tier import Tier
from .common import EXIT_OK, CliError, UsageError, add_json_flag, human, plural, print_json, say, vlist, warn
from .gc import refuse_live_owner
from .run_view import Run, command_parser, open_tier

REPLAY, REPLAY_META, REPLAY_JOURNAL = "replay", "replay_meta", "replay_journal"
OLD_STATES = (REPLAY, REPLAY_META)
PROGRESS_FILE = "migrate_progress.json"
PROGRESS_FORMAT = "ray_ckpt.migrate/1"

SUMMARY = "rewrite old-format RLlib replay buffers as replay journals"
DESCRIPTION = ("Rewrite every committed version whose RLlib replay buffer is stored as 'replay' + "
               "'replay_meta' (formats ray_ckpt.rllib.replay/1, /3, /4, /5) as one 'replay_journal' state "
               "(format /6), oldest first: new files are written, then each manifest is swapped atomically "
               "(the manifest chain and signatures rewritten consistently), then the old files no manifest lists "
               "are deleted. Re-running on a migrated run does nothing. Refused while a live engine owns the run, "
               "unless --force. Needs RLlib installed (no Ray cluster).")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = command_parser(sub, common, "migrate", SUMMARY, DESCRIPTION, run)
    s.add_argument("--remote", metavar="URI",
                   help="the run's root on its other tier (e.g. the remote_uri's run directory): migrated in the "
                        "same pass, with the same files and manifests (--endpoint-override applies to it too)")
    s.add_argument("--dry-run", "-n", action="store_true", help="print what would change; change nothing")
    s.add_argument("--force", action="store_true",
                   help="migrate even while the run's owner (a live engine, owner.json) holds a fresh lease")
    add_json_flag(s)


# ---------------------------------------------------------------- the plan
@dataclass
class Item:
    """One version of the union of the tiers' committed versions, oldest first."""

    version: int
    holders: List[Tuple[Run, Manifest]]  # the tiers that hold it committed, URI's tier first
    kind: str  # "old": to migrate; "journal": already one; "none": no replay states; "skip": left alone
    note: str = ""
    fmt: str = ""
    new: Optional[Manifest] = None  # the manifest it gets (None: unchanged)
    rows: int = 0  # the journal's rows (records of 256 bytes)
    timesteps: int = 0  # the buffer's stored timesteps
    written: int = 0
    next_row_id: Optional[int] = None
    journal_files: List[FileEntry] = field(default_factory=list)

    @property
    def old(self) -> Manifest:
        return self.holders[0][1]

    @property
    def tiers(self) -> List[Tier]:
        return [r.tier for r, _ in self.holders]

    @property
    def final(self) -> Manifest:
        return self.new if self.new is not None else self.old


def _read_state(item: Item, name: str) -> Any:
    entry = item.old.states[name]
    files = rank_files(entry, name, 0)
    try:
        bufs, _, _ = read_files(item.tiers, files)
        return decode_files(files, bufs, name=name)
    except CheckpointError as exc:
        raise CliError(f"version {item.version}: cannot read state {name!r}: {one_line(exc)}; nothing was "
                       f"changed") from None


def _meta_format(meta: Any) -> Optional[str]:
    from ..integrations.rllib.base.conversion import from_storable
    return from_storable(meta).get("format") if isinstance(meta, dict) else None


def _classify(item: Item) -> None:
    states = item.old.states
    has = [n for n in OLD_STATES if n in states]
    if REPLAY_JOURNAL in states:
        item.kind = "journal" if not has else "skip"
        item.note = "" if not has else f"holds both {REPLAY_JOURNAL!r} and {has}: left alone"
        if item.kind == "journal" and states[REPLAY_JOURNAL].status != "stored":
            item.kind, item.note = "skip", f"{REPLAY_JOURNAL!r} is {states[REPLAY_JOURNAL].status}"
        return
    if not has:
        item.kind = "none"
        return
    bad = [n for n in OLD_STATES if n not in states or states[n].status != "stored"]
    if bad:
        item.kind = "skip"
        item.note = "; ".join(f"{n!r} is {states[n].status if n in states else 'absent'}" for n in bad) + \
                    ": the version has no whole buffer to migrate (left alone)"
        return
    item.kind = "old"


def _union(runs: List[Run]) -> List[Item]:
    committed = [r.committed() for r in runs]
    items = []
    for v in sorted(set().union(*committed)):
        holders = [(r, c[v]) for r, c in zip(runs, committed) if v in c]
        if len(holders) > 1 and holders[0][1].to_json() != holders[1][1].to_json():
            raise CliError(f"version {v}: its manifests on {holders[0][0].uri} and {holders[1][0].uri} differ (a "
                           f"re-sync the engine has not made yet?): start the engine once to re-sync the remote tier, "
                           f"or migrate each tier on its own; nothing was changed")
        item = Item(v, holders, "none")
        _classify(item)
        items.append(item)
    return items


def _read_progress(run: Run) -> Dict[int, Tuple[str, str]]:
    """version -> (old chain digest, new chain digest) of a migration that stopped before its end."""
    if not run.tier.exists(PROGRESS_FILE):
        return {}
    try:
        d = json.loads(bytes(run.tier.read_bytes(PROGRESS_FILE)))
        if d.get("format") != PROGRESS_FORMAT:
            raise ValueError(f"format {d.get('format')!r}")
        return {int(v): (str(o), str(n)) for v, (o, n) in d["digests"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{run.uri}/{PROGRESS_FILE}: unreadable ({one_line(exc)}); nothing was changed") from None


def _chain(items: List[Item], progress: Dict[int, Tuple[str, str]], key: Any) -> None:
    """Set ``previous`` of every manifest whose predecessor changes (oldest first; re-signed with
    ``key``). A break already in the chain is refused, unless the progress record of a stopped
    migration explains it."""
    by_v = {it.version: it for it in items}
    problems = []
    for it in items:
        m = it.old
        pv = m.previous_version
        if m.previous is None or pv not in by_v:
            continue
        prev = by_v[pv]
        old_digest = chain_digest(prev.old)
        if m.previous != old_digest and progress.get(pv) != (m.previous, old_digest):
            problems.append(f"version {it.version}: its manifest was not committed after version {pv}'s "
                            f"(recorded {m.previous}, found {old_digest})")
            continue
        new_digest = chain_digest(prev.final)
        if new_digest != m.previous:
            if it.new is None:
                it.new = copy.deepcopy(m)
            it.new.previous = new_digest
    if problems:
        raise CliError(f"the manifest chain is broken ({'; '.join(problems[:3])}"
                       f"{'; ...' if len(problems) > 3 else ''}): run 'ray-ckpt verify --all' and inspect it; nothing "
                       f"was changed")
    for it in items:
        if it.new is None:
            continue
        if key:
            sign_manifest(it.new, key)
        elif it.old.signature is not None:
            raise CliError(f"version {it.version}: its manifest is signed and would have to be signed again: set "
                           f"RAY_CKPT_SIGNING_KEY (and RAY_CKPT_VERIFY_KEYS) as for the engine; nothing was changed")


# ---------------------------------------------------------------- one version
def _buffer_class(buffer_type: str, version: int) -> Any:
    from ray.rllib.utils.replay_buffers import (EpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,
                                                MultiAgentPrioritizedEpisodeReplayBuffer,
                                                PrioritizedEpisodeReplayBuffer)
    for cls in (EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,
                MultiAgentPrioritizedEpisodeReplayBuffer):
        if buffer_type == f"{cls.__module__}.{cls.__qualname__}":
            return cls
    raise CliError(f"version {version}: its replay buffer is a {buffer_type}, which migrate does not rebuild (it "
                   f"rebuilds RLlib's EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, "
                   f"MultiAgentEpisodeReplayBuffer and MultiAgentPrioritizedEpisodeReplayBuffer); nothing was changed "
                   f"from this version on")


def _fresh_buffer(meta_v1: Dict[str, Any], version: int) -> Any:
    cls = _buffer_class(str(meta_v1.get("buffer_type")), version)
    cfg = dict(meta_v1.get("config", {}))
    kw = {k: cfg[k] for k in ("batch_size_B", "batch_length_T") if k in cfg}
    if "_metrics_num_episodes_for_smoothing" in cfg:
        kw["metrics_num_episodes_for_smoothing"] = cfg["_metrics_num_episodes_for_smoothing"]
    if "_alpha" in cfg:
        kw["alpha"] = cfg["_alpha"]
    return cls(capacity=cfg["capacity"], **kw)


def restored_buffer(replay: Any, replay_meta: Any, version: int = -1) -> Tuple[Any, str]:
    """A fresh buffer of the stored type restored from the two old states exactly as the RLlib
    integration restored them before the journal (:mod:`.legacy_replay`), and the stored format."""
    from ..integrations.rllib.base.conversion import from_storable
    from .legacy_replay import LOG_FORMATS, META_FORMAT, log_to_v1, restore_replay
    fmt = _meta_format(replay_meta)
    if fmt == META_FORMAT:
        rows, meta_v1 = replay, replay_meta
    elif fmt in LOG_FORMATS:
        rows, meta_v1, _seeds = log_to_v1({REPLAY: replay, REPLAY_META: replay_meta})
    else:
        raise CliError(f"version {version}: its replay buffer is in format {fmt!r}, which migrate does not read "
                       f"(it reads ray_ckpt.rllib.replay/1, /3, /4 and /5); nothing was changed from this version on")
    buf = _fresh_buffer(from_storable(meta_v1), version)
    restore_replay(buf, rows, meta_v1)
    return buf, fmt


def _migrate_version(item: Item, floor: Optional[int], base: List[FileEntry], target: Tier) -> Dict[str, Any]:
    """Read, restore, capture and write ``item``'s journal on ``target``; returns the captured state."""
    from ..formats.tree import flatten
    from ..integrations.rllib.replay.journal import journal_of
    from ..integrations.rllib.replay.restore import read_meta
    meta = _read_state(item, REPLAY_META)
    replay = _read_state(item, REPLAY)
    try:
        buf, item.fmt = restored_buffer(replay, meta, item.version)
        del replay, meta
        item.timesteps = int(buf.get_num_timesteps())
        state = journal_of(buf).capture(buf, floor=floor)
        item.next_row_id = int(read_meta(state)["next_row_id"])
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"version {item.version}: its replay buffer cannot be rebuilt: {type(exc).__name__}: "
                       f"{one_line(exc)}; nothing was changed from this version on") from None
    item.rows = int(len(state["row_id"]))
    entries, written = write_append_only(target, item.version, REPLAY_JOURNAL, 0,
                                         flatten(state, state_name=REPLAY_JOURNAL), base)
    node = next((f.node for f in rank_files(item.old.states[REPLAY], REPLAY, 0) if f.node), None)
    item.journal_files = [FileEntry(f.path, f.size, f.checksum, f.role, node) for f in entries]
    item.written = written
    return state


def _new_manifest(item: Item) -> Manifest:
    m = copy.deepcopy(item.old)
    old = m.states[REPLAY]
    states = {n: e for n, e in m.states.items() if n not in OLD_STATES}
    states[REPLAY_JOURNAL] = StateEntry(old.strategy, "stored", {"0": list(item.journal_files)},
                                        sum(f.size for f in item.journal_files))
    m.states = dict(sorted(states.items()))
    return m


def _copy_files(src: Tier, dst: Tier, files: List[FileEntry]) -> int:
    """``files`` from ``src`` onto ``dst`` where ``dst`` has no good copy; returns the bytes copied."""
    copied = 0
    for f in files:
        with contextlib.suppress(FileNotFoundError, CheckpointError, OSError):
            dst.read_verified(f.path, f.size, f.checksum)
            continue
        size, digest = src.copy_to(dst, f.path)
        if (size, digest) != (f.size, f.checksum):
            raise CliError(f"copying {f.path} to {dst.display} gave {size} bytes with another checksum than "
                           f"written; no manifest was changed")
        copied += size
    return copied


# ---------------------------------------------------------------- the command
def _open_runs(args: argparse.Namespace) -> List[Run]:
    runs = [Run.open(args)]
    if args.remote:
        tier = open_tier(argparse.Namespace(uri=args.remote, endpoint_override=args.endpoint_override))
        tier.name = "remote" if runs[0].tier.name == "local" else "other"
        runs.append(Run(tier))
        if runs[1].tier.uri == runs[0].tier.uri:
            raise UsageError("--remote names the same run root as URI")
    for r in runs:
        r.require_committed()
        unreadable = [v for v in r.with_manifest if r.load(v) is None]
        if unreadable:
            raise CliError(f"{r.uri}: the manifests of {plural(len(unreadable), 'version')} cannot be read "
                           f"({r.error(unreadable[0])}): run 'ray-ckpt verify --all' and fix or remove them first; "
                           f"nothing was changed")
    return runs


def run(args: argparse.Namespace) -> int:
    runs = _open_runs(args)
    dry, text = args.dry_run, not args.json
    for r in runs:
        refuse_live_owner(r, "migrate", args.force, dry)
    try:
        key = signing_key_from_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    progress: Dict[int, Tuple[str, str]] = {}
    for r in runs:
        progress.update(_read_progress(r))
    items = _union(runs)
    todo = [it for it in items if it.kind == "old"]
    for it in todo:  # refuse format /2 (and anything unknown) before anything is written
        fmt = _meta_format(_read_state(it, REPLAY_META))
        if fmt == "ray_ckpt.rllib.replay/2":
            raise CliError(f"version {it.version} holds a replay buffer in format {fmt}, which migrate cannot read "
                           f"(no reader of it is left); nothing was changed")
        it.fmt = str(fmt)
    for it in items:
        if it.kind == "skip":
            warn(f"warning: version {it.version}: {it.note}")
    t0 = time.perf_counter()
    if todo:
        with tempfile.TemporaryDirectory(prefix="ray-ckpt-migrate-") as scratch:
            _write_journals(items, runs, Tier(scratch, "local") if dry else None)
    _chain(items, progress, key)
    changed = [it for it in items if it.new is not None]
    doc: Dict[str, Any] = {"uri": runs[0].uri, "tiers": [r.uri for r in runs], "dry_run": dry, "versions": [],
                           "manifests_rewritten": [it.version for it in changed]}
    for it in todo:
        row = {"version": it.version, "step": it.old.step, "format_before": it.fmt, "rows": it.rows,
               "timesteps": it.timesteps, "bytes_written": it.written}
        doc["versions"].append(row)
        if text:
            say(f"version {it.version} (step {it.old.step}): {it.fmt} -> ray_ckpt.rllib.replay/6, "
                f"{plural(it.timesteps, 'timestep')} in {plural(it.rows, 'journal row')}, {human(it.written)} "
                f"{'to write' if dry else 'written'}")
    if not changed and not progress:
        if text:
            n = sum(it.kind == "journal" for it in items)
            say(f"nothing to migrate: {runs[0].uri} holds no version in the old replay format "
                f"({plural(n, 'version')} already hold {REPLAY_JOURNAL!r})")
        else:
            print_json({**doc, "nothing_to_do": True})
        return EXIT_OK
    deleted: Dict[str, List[str]] = {}
    if not dry:
        _swap(runs, changed, progress)
        deleted = _delete_old(runs, todo)
        for r in runs:
            r.tier.delete_file(PROGRESS_FILE)
    n_deleted = sum(len(v) for v in deleted.values())
    total = sum(it.written for it in todo)
    if text:
        chain_only = [it.version for it in changed if it.kind != "old"]
        say(f"migrate{' (dry run)' if dry else ''}: {plural(len(todo), 'version')} "
            f"{'would be' if dry else ''}{' ' if dry else ''}rewritten as replay journals, {human(total)} "
            f"{'to write' if dry else 'written'}, {plural(len(changed), 'manifest')} "
            f"{'to rewrite' if dry else 'rewritten'}"
            + (f" (versions {vlist(chain_only)} for the manifest chain only)" if chain_only else "")
            + ("" if dry else f", {plural(n_deleted, 'old file')} deleted")
            + (f" on {plural(len(runs), 'tier')}" if len(runs) > 1 else "")
            + f" in {time.perf_counter() - t0:.1f}s")
    else:
        print_json({**doc, "bytes_written": total, "deleted": deleted})
    return EXIT_OK


def _write_journals(items: List[Item], runs: List[Run], scratch: Optional[Tier]) -> None:
    """Step 1: every old version's journal, oldest first, written on the first tier holding it
    (``scratch`` instead in a dry run) and copied to the others; its new manifest built."""
    prev: Optional[Item] = None  # the newest journal so far (migrated now or already there)
    for it in items:
        if it.kind == "journal":
            prev = it
            from ..integrations.rllib.replay.restore import read_meta
            it.next_row_id = int(read_meta(_read_state(it, REPLAY_JOURNAL))["next_row_id"])
            it.journal_files = rank_files(it.old.states[REPLAY_JOURNAL], REPLAY_JOURNAL, 0)
            continue
        if it.kind != "old":
            continue
        floor = prev.next_row_id if prev is not None else None
        base = list(prev.journal_files) if prev is not None else []
        target = scratch if scratch is not None else it.tiers[0]
        _migrate_version(it, floor, base, target)
        if scratch is None:
            for other in it.tiers[1:]:
                _copy_files(it.tiers[0], other, it.journal_files)
        it.new = _new_manifest(it)
        prev = it


def _swap(runs: List[Run], changed: List[Item], progress: Dict[int, Tuple[str, str]]) -> None:
    """Steps 2 and 3: the progress record (with what a stopped migration's record said), then each
    changed manifest, oldest first, on every tier that holds it."""
    digests = {str(v): list(d) for v, d in progress.items()}
    digests.update({str(it.version): [chain_digest(it.old), chain_digest(it.new)] for it in changed})
    record = {"format": PROGRESS_FORMAT, "digests": digests}
    for r in runs:
        try:
            r.tier.put_bytes(PROGRESS_FILE, json.dumps(record, indent=1, sort_keys=True).encode())
        except OSError as exc:
            raise CliError(f"cannot write {r.uri}/{PROGRESS_FILE}: {one_line(exc)}; no manifest was changed "
                           f"(the new journal files stay unlisted: 'migrate' again writes them anew)") from None
    done = 0
    for it in changed:
        for r, _ in it.holders:
            try:
                write_manifest(r.tier, it.new)
            except OSError as exc:
                raise CliError(f"writing the manifest of version {it.version} on {r.uri} failed: {one_line(exc)} "
                               f"({plural(done, 'manifest')} rewritten before it): run 'ray-ckpt migrate' again to "
                               f"finish") from None
            done += 1


def _delete_old(runs: List[Run], todo: List[Item]) -> Dict[str, List[str]]:
    """Step 4: the old states' files that no manifest on the tier lists any more: those the migrated
    manifests listed (in older version directories too), and whatever is left under ``replay/`` and
    ``replay_meta/`` of a committed version (a migration stopped before this step left them)."""
    out: Dict[str, List[str]] = {}
    for r in runs:
        fresh = Run(r.tier)
        listed = set()
        for v in fresh.with_manifest:  # every manifest, those of versions lost with a node too
            m = fresh.load(v)
            if m is None:
                raise CliError(f"{r.uri}: version {v}'s manifest cannot be read after the swap "
                               f"({fresh.error(v)}): old files left in place")
            listed.update(m.referenced_paths())
        old = {f.path for it in todo if any(h is r for h, _ in it.holders)
               for n in OLD_STATES for f in it.old.states[n].all_files()}
        for v in fresh.with_manifest:
            for n in OLD_STATES:
                old.update(r.tier.list_files(f"{layout.version_dir(v)}/{n}"))
        gone = [p for p in sorted(old - listed) if r.tier.delete_file(p)]
        for top in sorted({p.split("/", 1)[0] for p in gone}):
            r.tier.prune_empty_dirs(top)
        out[r.uri] = gone
    return out
