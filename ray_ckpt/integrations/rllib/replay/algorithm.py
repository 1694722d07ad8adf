"""The entry points the RLlib callback and restore call: which strategy the replay states are saved
with, capturing the algorithm's buffer into a save (format /4 single-agent, /5 multi-agent), keeping
the engine's registrations in step, and restoring a version's buffer into the algorithm.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ....errors import InvalidArgumentError, RestoreError, SaveError
from ....types import Strategy
from ..base.conversion import from_storable
from ..base.names import REPLAY, REPLAY_JOURNAL, REPLAY_META, log
from ..journal.journal import journal_of, supported as journal_supported
from ..journal.restore import read_meta, restore_journal
from .buffers import META_FORMAT, replay_buffer_of
from .row_ids import RowIds, row_ids_of
from .incremental_ma_restore import log_to_v1, seed_log
from .incremental_state import LOG_FORMATS, LOG_LAYOUT, META_FORMAT2
from .two_state import capture_log_states, restore_replay


REPLAY_STRATEGIES = ("auto", "critical", "best_effort", "off")


def check_replay_strategy(setting: Any) -> None:
    if setting not in REPLAY_STRATEGIES:
        raise InvalidArgumentError(f"replay_strategy must be one of {', '.join(map(repr, REPLAY_STRATEGIES))}, "
                                   f"got {setting!r}")


def replay_strategy(setting: str, algorithm: Any):
    """The Strategy the replay states are saved with (None: not saved). ``"auto"``: CRITICAL when the
    algorithm has a local replay buffer (off-policy: DQN, SAC, APPO...), which on-policy algorithms
    (PPO) have not -- after a preemption an off-policy run that lost its buffer restarts from an empty
    one, so a version without it is not a resumable version."""
    check_replay_strategy(setting)
    if setting == "off" or replay_buffer_of(algorithm) is None:
        return None
    return Strategy.BEST_EFFORT if setting == "best_effort" else Strategy.CRITICAL


def _row_floor(engine: Any, rid: RowIds) -> Optional[int]:
    """Where the ids of a buffer about to be saved into ``engine``'s run must start so that no id
    of the run's newest version is given to another row (None: the ids are that version's own).
    The ids are the run's own only after a restore of its newest version; a buffer restored from an
    older version or another run (a PBT exploit), or a new buffer on a run that has versions, gets
    new ids for all its rows (its next save writes them all once); so does a buffer whose run's
    newest version is not a log (format /1 or /2: rows without ``prio`` columns), and the
    ``replay_meta`` log starts at that version's next ids."""
    metas = sorted(engine.list_checkpoints(), key=lambda m: m.version)
    if not metas:
        return None
    newest = metas[-1]
    if REPLAY_META not in newest.states:
        return None  # the engine checks new rows against the newest version only
    meta = from_storable(engine.load(name=REPLAY_META, version=newest.version))
    fmt = meta.get("format")
    if rid.restored_from == (engine.run, newest.version) and fmt in LOG_FORMATS:
        return None
    # ids of another run / version, or the stored rows have other columns (format /1, /2): all anew
    if fmt in LOG_FORMATS:
        rid.floors = {"chunk": int(meta["next_chunk"])}
        return int(meta["next_row_id"])
    if fmt == META_FORMAT2:  # the log's ids start above both of /2's logs' (they were its segments' ids)
        ids = meta["next_ids"]
        rid.floors = {"chunk": max(int(ids["chunk"]), int(ids["log"]))}
        return int(ids["row"])
    rid.floors = None
    return int(meta["rows"]["next_row_id"])


# 6: buffers are saved as a journal (state ``replay_journal``, :mod:`..journal`); 5: as ``replay`` +
# ``replay_meta`` (formats /4 and /5: what versions written before the journal hold; kept writable
# for the tests and benchmarks that compare the two until ``ray-ckpt migrate`` replaces them). A
# restore reads whichever the version holds.
REPLAY_FORMAT = 6


def _journaled(buf: Any) -> bool:
    return REPLAY_FORMAT == 6 and buf is not None and journal_supported(buf)


def prepare_replay(algorithm: Any) -> None:
    """At the algorithm's start: a journaled buffer gets its recorders now, so the first save
    writes what arrived since, not the whole buffer."""
    buf = replay_buffer_of(algorithm)
    if _journaled(buf):
        journal_of(buf)


def _journal_floor(engine: Any, journal: Any) -> Optional[int]:
    """Where the journal's row ids must start so that no id of the run's newest journal (the base
    the engine writes the next version over) names another row: None when that journal is the one
    this buffer was restored from (or there is none)."""
    metas = sorted((m for m in engine.list_checkpoints() if REPLAY_JOURNAL in m.states), key=lambda m: m.version)
    if not metas or journal.restored_from == (engine.run, metas[-1].version):
        return None
    return int(read_meta(engine.load(name=REPLAY_JOURNAL, version=metas[-1].version))["next_row_id"])


def capture_algorithm_replay(algorithm: Any, out: Dict[str, Any], strategy: Any, engine: Any = None,
                             errors: Optional[Dict[str, str]] = None) -> None:
    """Put the algorithm's buffer into ``out`` (``replay_journal``, or ``replay`` and
    ``replay_meta``: :data:`REPLAY_FORMAT`). A BEST_EFFORT one that cannot be captured is left out
    with its reason in ``errors``; a CRITICAL one raises."""
    buf = replay_buffer_of(algorithm)
    try:
        if _journaled(buf):
            j = journal_of(buf)
            floor = None
            if engine is not None and j.checked_run != engine.run:
                floor = _journal_floor(engine, j)
                if floor is not None:
                    log.info("ray_ckpt: run %r: the replay buffer is not the one the run's newest journal holds: "
                             "its rows get new ids from %d and this save writes all of them", engine.run, floor)
                j.checked_run = engine.run
            out[REPLAY_JOURNAL] = j.capture(buf, floor)
            return
        rid = row_ids_of(buf)
        if engine is not None and rid.checked_run != engine.run:
            floor = _row_floor(engine, rid)
            if floor is not None:
                log.info("ray_ckpt: run %r: the replay buffer's rows get new row ids from %d (its state is not "
                         "the run's newest version's): this save writes all of them", engine.run, floor)
                rid.renumber(floor, rid.floors)
            rid.checked_run = engine.run
        out.update(capture_log_states(buf, rid))
    except Exception as exc:  # best effort: this save goes on without the buffer, the reason logged
        if strategy is Strategy.CRITICAL or errors is None:
            raise
        for name in REPLAY_STATES:
            out.pop(name, None)
        errors[REPLAY] = f"{type(exc).__name__}: {exc}"


REPLAY_APPEND_ONLY = True  # ``replay`` (and the single-agent log) are registered append_only=True: a version writes what is new
REPLAY_STATES = (REPLAY, REPLAY_META, REPLAY_JOURNAL)


def _append_only(name: str, state: Any) -> bool:
    """``replay`` and ``replay_journal`` always; ``replay_meta`` when it is a log (formats /3, /4, /5; format /1's meta, no
    longer written, was a nested state written whole)."""
    return REPLAY_APPEND_ONLY and (name != REPLAY_META or (isinstance(state, dict)
                                                           and state.get("layout") == LOG_LAYOUT))


def sync_replay_registrations(engine: Any, algorithm: Any, setting: str, pending_now: Dict[str, Any],
                              pending: Callable[[], Dict[str, Any]]) -> None:
    """Register ``replay`` and ``replay_meta`` (append-only: :func:`_append_only`) when this save
    captured them (read from ``pending()`` when the engine snapshots), unregister them when it did not."""
    strat = replay_strategy(setting, algorithm)

    def getter(name: str) -> Callable[[], Any]:
        def get() -> Any:
            try:
                return pending()[name]
            except KeyError:
                raise SaveError(f"RLlib state {name!r} was not captured for this save") from None
        get.__name__ = f"rllib_{name}"
        return get

    for name in REPLAY_STATES:
        if name in pending_now and strat is not None:
            append_only = _append_only(name, pending_now[name])
            # the engine lists strategies only; its registration record says whether append-only
            reg = getattr(engine, "_registry", {}).get(name)
            if engine.registered.get(name) != strat or getattr(reg, "append_only", append_only) != append_only:
                # overlap: the copy into the object store runs on this process's copy thread while
                # train() goes on (for a buffer of N rows it is O(N) bytes, most of a save's pause);
                # no fence is needed: a capture's arrays are new ones, never changed afterwards
                # (the next capture builds new arrays from them), and the next save's snapshot of
                # the same state waits for this copy first
                engine.register(name, getter(name), strategy=strat, replace=True, append_only=append_only,
                                overlap=True)
        elif name in engine.registered:
            engine.unregister(name)


def restore_algorithm_replay(algorithm: Any, engine: Any, meta: Any, loaded: Dict[str, Any], states: Dict[str, str],
                             *, strict: bool, enabled: bool) -> None:
    """Restore the version's replay buffer into the algorithm's (called before anything else of the
    algorithm is changed: a buffer that does not fit raises RestoreError with nothing changed). A
    replay state that the version committed but that cannot be read raises with ``strict``; one the
    version does not hold (saved with replay_strategy="off", or a best-effort one that failed) is
    reported in ``states`` and the buffer is left as it is."""
    buf = replay_buffer_of(algorithm)
    if REPLAY_JOURNAL in meta.states:
        _restore_journaled(buf, engine, meta, loaded, states, strict=strict, enabled=enabled,
                           mapping_fn=getattr(algorithm.config, "policy_mapping_fn", None))
        return
    committed = [n for n in (REPLAY, REPLAY_META) if n in meta.states]
    if not enabled:
        for n in committed:
            states[n] = "not restored: restore_replay=False"
        return
    if buf is None:
        for n in committed:
            states[n] = "not restored: the algorithm has no local replay buffer"
        return
    if not committed:
        missing = [n for n in (REPLAY, REPLAY_META, REPLAY_JOURNAL) if n in (getattr(meta, "missing", ()) or ())
                   or n in (getattr(meta, "pending", ()) or ())]
        states[REPLAY] = (f"missing: version {meta.version} lists {missing} as not written (best-effort)" if missing
                          else f"missing: version {meta.version} has no replay buffer "
                               f"(saved with replay_strategy='off'?)")
        log.warning("ray_ckpt: run %r version %d: %s; the replay buffer stays empty", engine.run, meta.version,
                    states[REPLAY])
        return
    absent = [n for n in (REPLAY, REPLAY_META) if n not in loaded]
    if absent:
        why = "; ".join(f"{n}: {states.get(n, 'not read')}" for n in absent)
        if strict:
            raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r}: its replay buffer "
                               f"could not be read ({why}); nothing was changed")
        for n in (REPLAY, REPLAY_META):
            states[n] = f"not restored: {why}"
        return
    fn = getattr(algorithm.config, "policy_mapping_fn", None)
    fmt = from_storable(loaded[REPLAY_META]).get("format") if isinstance(loaded[REPLAY_META], dict) else None
    if fmt == META_FORMAT:
        restore_replay(buf, loaded[REPLAY], loaded[REPLAY_META], agent_to_module_mapping_fn=fn)
    else:  # formats /3, /4 and /5 (:mod:`.incremental_state`): the rows and the replay_meta log
        replay, meta_v1, seeds = log_to_v1({REPLAY: loaded[REPLAY], REPLAY_META: loaded[REPLAY_META]})
        restore_replay(buf, replay, meta_v1, agent_to_module_mapping_fn=fn)
        seed_log(row_ids_of(buf), seeds, buf)
    row_ids_of(buf).restored_from = (engine.run, int(meta.version))


def _restore_journaled(buf: Any, engine: Any, meta: Any, loaded: Dict[str, Any], states: Dict[str, str], *,
                       strict: bool, enabled: bool, mapping_fn: Any) -> None:
    """:func:`restore_algorithm_replay` of a version that holds ``replay_journal``."""
    name = REPLAY_JOURNAL
    if not enabled or buf is None:
        states[name] = ("not restored: restore_replay=False" if not enabled
                        else "not restored: the algorithm has no local replay buffer")
        return
    if name not in loaded:
        why = states.get(name, "not read")
        if strict:
            raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r}: its replay buffer "
                               f"could not be read ({name}: {why}); nothing was changed")
        states[name] = f"not restored: {why}"
        return
    restore_journal(buf, loaded[name], agent_to_module_mapping_fn=mapping_fn)
    journal_of(buf).restored_from = (engine.run, int(meta.version))
