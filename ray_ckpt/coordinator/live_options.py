"""The options of a live run: what ``create()`` on a run whose coordinator already runs compares,
and which options ``create(..., reconfigure=True)`` may change without a new run.

Which options are compared. ``create()`` compares the options its caller *passed* with the
options the running coordinator has: every keyword option given (a value equal to the default still
counts: the caller asked for it), and ``keep_last``, ``keep_every``, ``critical_writers``,
``best_effort_writers`` (named parameters of ``create()``) when they are not ``create()``'s
defaults; ``local_dir`` and ``remote_uri`` are always compared (as before), and ``signing_key``
counts as passed when the ``RAY_CKPT_SIGNING_KEY`` environment variable supplies it. Options left
out take the running run's values. Why not compare every field against its default: a restarted
driver, a Tune trial relaunched or ``integrations.rllib.restore(run, local_dir=...)`` attach to a
run without restating every option, and must keep attaching; a caller that states an option
either gets it or an error naming it, never a silent keep.

Which options change live (``LIVE``), and why each:

- ``keep_last``, ``keep_every``, ``keep_best`` and the ``remote_keep_*`` ones: the coordinator's
  retention reads its configuration at every commit (``deletions.py``); the new rule prunes at once
  (in the background, as after a commit) and at every commit after, on both tiers.
- ``rank_timeout_s``: read by the coordinator when a pushed version opens (``_deadline``) and by its
  waits; versions already waiting keep the deadline they started with.
- ``signing_key``: the catalogue signs every manifest committed from then on with the new key.
  Versions already listed stay listed; a process that reads the run later with only the new key
  (a restarted coordinator, the CLI) treats the old-key versions as untrusted.
- ``max_in_flight``: engine-side backpressure: the creating engine and engines created or
  connected afterwards use the new value; ranks connected before keep theirs.
- ``compression``: the coordinator passes it with every buffer write; Arrow IPC files describe
  their own compression, so versions of both kinds restore.

Everything else needs a new run (``NOT_LIVE_WHY``): the tiers (``local_dir``, ``remote_uri``,
``remote_options``) are the run's identity; writer counts, CPUs, priorities, threads, direct I/O,
rate limits and ``upload_retries`` are fixed in writer actors when they start; ``remote_every`` is
counted by every engine and by the coordinator's upload plan at once; ``overlap``,
``overlap_check`` and the prefault options are set up when states are registered; ``extra`` is
unknown to the engine. Plain Python, no Ray.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..config import EngineConfig
from ..errors import InvalidArgumentError

LIVE = frozenset({"keep_last", "keep_every", "keep_best", "remote_keep_last", "remote_keep_every",
                  "remote_keep_best", "rank_timeout_s", "signing_key", "max_in_flight", "compression"})
SECRET = frozenset({"signing_key", "remote_options"})  # their values are never shown
ALWAYS = ("local_dir", "remote_uri")  # compared whether passed or not

NOT_LIVE_WHY = {
    "local_dir": "the run's local tier", "remote_uri": "the run's remote tier",
    "remote_options": "the remote tier's settings",
    "extra": "not known to the engine",
    "remote_every": "counted by every engine and the coordinator's upload plan",
    "overlap": "set up when states are registered", "overlap_check": "set up when states are registered",
    "prefault_object_store": "set up when states are registered",
    "prefault_needed": "set up when states are registered",
}  # the rest: "fixed in the writer actors when they start"

Difference = Tuple[str, Any, Any]  # (option, running value, asked value)


def option_names() -> List[str]:
    """Every option of EngineConfig but the run's name, in declaration order."""
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name != "run"]


def _norm(name: str, value: Any) -> Any:
    """A value as compared: lists as tuples (``keep_best`` comes back from Ray as it was given),
    a directory or URI without a trailing slash."""
    if isinstance(value, list):
        return tuple(_norm(name, v) for v in value)
    if name in ALWAYS and isinstance(value, str) and len(value) > 1:
        return value.rstrip("/") or value
    return value


def differences(running: EngineConfig, asked: EngineConfig, passed: Iterable[str]) -> List[Difference]:
    """The options in ``passed`` (plus ``ALWAYS``) whose value in ``asked`` differs from ``running``'s.
    Values are compared as ``EngineConfig`` normalised them (a str signing key as bytes, ...) and
    ``_norm`` (lists as tuples, no trailing slash)."""
    wanted = set(passed) | set(ALWAYS)
    out = []
    for name in option_names():
        if name in wanted and _norm(name, getattr(running, name)) != _norm(name, getattr(asked, name)):
            out.append((name, getattr(running, name), getattr(asked, name)))
    return out


def describe(diff: Difference) -> str:
    name, old, new = diff
    if name in SECRET:
        return f"{name} differs"
    return f"{name}={old!r} (running) vs {new!r} (asked)"


def check(run: str, running: EngineConfig, asked: EngineConfig, passed: Iterable[str],
          reconfigure: bool) -> Dict[str, Any]:
    """What ``create()`` on a live run must change: ``{}`` when the passed options match; with
    ``reconfigure`` the live options' new values (``{name: value}``). Raises InvalidArgumentError
    naming every differing option (without a secret's value) otherwise, and, with ``reconfigure``,
    when any differing option cannot change live (then nothing is changed)."""
    diffs = differences(running, asked, passed)
    if not diffs:
        return {}
    fixed = [d for d in diffs if d[0] not in LIVE]
    if not reconfigure:
        raise InvalidArgumentError(
            f"run {run!r} is running with other options: {'; '.join(describe(d) for d in diffs)}. "
            f"Pass the run's options, connect() to it, or create(..., reconfigure=True) to change the options "
            f"that can change live ({', '.join(sorted(LIVE))}); the others need a new run")
    if fixed:
        raise InvalidArgumentError(
            f"run {run!r}: {'; '.join(f'{describe(d)} ({NOT_LIVE_WHY.get(d[0], _WRITERS)})' for d in fixed)}: "
            f"{'this option' if len(fixed) == 1 else 'these options'} cannot change on a live run and "
            f"need{'s' if len(fixed) == 1 else ''} a new run (shut it down first, or use another run name); "
            f"nothing was changed")
    return {name: new for name, _old, new in diffs}


_WRITERS = "fixed in the writer actors when they start"


def applied(config: EngineConfig, changes: Dict[str, Any]) -> EngineConfig:
    """``config`` with ``changes`` (live options only) set in place, validated first: the
    coordinator's helpers hold this very object, so they read the new values from now on."""
    bad = sorted(set(changes) - LIVE)
    if bad:
        raise InvalidArgumentError(f"options {bad} cannot change on a live run")
    trial = dataclasses.replace(config, **changes)  # validates (retention rules, ...)
    for name in changes:
        setattr(config, name, getattr(trial, name))
    return config


def shown(changes: Dict[str, Any]) -> List[str]:
    """``name=value`` per changed option, secrets as ``name (changed)``."""
    return [f"{n} (changed)" if n in SECRET else f"{n}={v!r}" for n, v in sorted(changes.items())]


# create()'s named options and their defaults: one left at its default counts as not passed (the
# others are in its **options only when given)
CREATE_DEFAULTS = {"critical_writers": 2, "best_effort_writers": 1, "keep_last": None, "keep_every": None}


def passed_options(named: Dict[str, Any], options: Iterable[str], env_key: Optional[str]) -> List[str]:
    """The options a create() call states: its ``named`` options not left at their defaults, its
    other ``options`` (the run and its tiers aside), and signing_key set by the environment."""
    names = {name for name, value in named.items() if value != CREATE_DEFAULTS[name]}
    names |= set(options) - {"run", "local_dir", "remote_uri"}
    if env_key:
        names.add("signing_key")
    return sorted(names)
