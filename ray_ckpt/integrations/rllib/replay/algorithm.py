"""The entry points the RLlib callback and restore call: which strategy the buffer is saved with,
capturing the algorithm's buffer into a save as its journal, keeping the engine's registration in
step, and restoring a version's journal into the algorithm's buffer.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from ....errors import InvalidArgumentError, RestoreError, SaveError
from ....types import Strategy
from ..base.names import REPLAY, REPLAY_JOURNAL, REPLAY_META, log
from .journal import family_of, journal_of
from .restore import read_meta, restore_journal

REPLAY_STRATEGIES = ("auto", "critical", "best_effort", "off")
# what versions written before the journal hold (formats /1-/5): ``ray-ckpt migrate`` rewrites them
OLD_STATES = (REPLAY, REPLAY_META)


def replay_buffer_of(algorithm: Any) -> Optional[Any]:
    """The algorithm's local replay buffer (None for on-policy algorithms)."""
    return getattr(algorithm, "local_replay_buffer", None)


def check_replay_strategy(setting: Any) -> None:
    if setting not in REPLAY_STRATEGIES:
        raise InvalidArgumentError(f"replay_strategy must be one of {', '.join(map(repr, REPLAY_STRATEGIES))}, "
                                   f"got {setting!r}")


def replay_strategy(setting: str, algorithm: Any):
    """The Strategy the buffer is saved with (None: not saved). ``"auto"``: CRITICAL when the
    algorithm has a local replay buffer (off-policy: DQN, SAC, APPO...), which on-policy algorithms
    (PPO) have not -- after a preemption an off-policy run that lost its buffer restarts from an empty
    one, so a version without it is not a resumable version."""
    check_replay_strategy(setting)
    if setting == "off" or replay_buffer_of(algorithm) is None:
        return None
    return Strategy.BEST_EFFORT if setting == "best_effort" else Strategy.CRITICAL


def prepare_replay(algorithm: Any) -> None:
    """At the algorithm's start: the buffer gets its recorders now, so the first save writes what
    arrived since, not the whole buffer."""
    buf = replay_buffer_of(algorithm)
    if buf is not None and family_of(buf) is not None:
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
    """Put the algorithm's buffer into ``out`` as ``replay_journal``. A BEST_EFFORT one that cannot
    be captured is left out with its reason in ``errors``; a CRITICAL one raises."""
    buf = replay_buffer_of(algorithm)
    try:
        j = journal_of(buf)  # an unsupported buffer raises UnsupportedTypeError naming its type
        floor = None
        if engine is not None and j.checked_run != engine.run:
            floor = _journal_floor(engine, j)
            if floor is not None:
                log.info("ray_ckpt: run %r: the replay buffer is not the one the run's newest journal holds: "
                         "its rows get new ids from %d and this save writes all of them", engine.run, floor)
            j.checked_run = engine.run
        out[REPLAY_JOURNAL] = j.capture(buf, floor)
    except Exception as exc:  # best effort: this save goes on without the buffer, the reason logged
        if strategy is Strategy.CRITICAL or errors is None:
            raise
        out.pop(REPLAY_JOURNAL, None)
        errors[REPLAY] = f"{type(exc).__name__}: {exc}"


def sync_replay_registrations(engine: Any, algorithm: Any, setting: str, pending_now: Dict[str, Any],
                              pending: Callable[[], Dict[str, Any]]) -> None:
    """Register ``replay_journal`` (append-only) when this save captured it (read from ``pending()``
    when the engine snapshots), unregister it when it did not."""
    strat = replay_strategy(setting, algorithm)

    def get() -> Any:
        try:
            return pending()[REPLAY_JOURNAL]
        except KeyError:
            raise SaveError(f"RLlib state {REPLAY_JOURNAL!r} was not captured for this save") from None
    get.__name__ = f"rllib_{REPLAY_JOURNAL}"

    if REPLAY_JOURNAL in pending_now and strat is not None:
        if engine.registered.get(REPLAY_JOURNAL) != strat:
            # overlap: the copy into the object store runs on this process's copy thread while
            # train() goes on; no fence is needed: a capture's arrays are new ones, never changed
            # afterwards, and the next save's snapshot of the same state waits for this copy first
            engine.register(REPLAY_JOURNAL, get, strategy=strat, replace=True, append_only=True, overlap=True)
    elif REPLAY_JOURNAL in engine.registered:
        engine.unregister(REPLAY_JOURNAL)
    for name in OLD_STATES:  # the two states of the format before the journal: never saved any more
        if name in engine.registered:
            engine.unregister(name)


def restore_algorithm_replay(algorithm: Any, engine: Any, meta: Any, loaded: Dict[str, Any], states: Dict[str, str],
                             *, strict: bool, enabled: bool) -> None:
    """Restore the version's replay buffer into the algorithm's (called before anything else of the
    algorithm is changed: a buffer that does not fit raises RestoreError with nothing changed). A
    journal that the version committed but that cannot be read raises with ``strict``; one the
    version does not hold (saved with replay_strategy="off", or a best-effort one that failed) is
    reported in ``states`` and the buffer is left as it is. A version saved before the journal
    (``replay`` + ``replay_meta``) is refused, naming ``ray-ckpt migrate``."""
    buf = replay_buffer_of(algorithm)
    name = REPLAY_JOURNAL
    old = [n for n in OLD_STATES if n in meta.states]
    if old and name not in meta.states:
        why = (f"version {meta.version} of run {engine.run!r} holds its replay buffer in a format written "
               f"before the replay journal ({' + '.join(old)}); run `ray-ckpt migrate <run directory or URI>` "
               f"once to rewrite the run's versions as journals")
        if enabled and buf is not None and strict:
            raise RestoreError(f"cannot restore {why}; nothing was changed")
        for n in old:
            states[n] = f"not restored: {why}"
        return
    if not enabled or buf is None:
        if name in meta.states:
            states[name] = ("not restored: restore_replay=False" if not enabled
                            else "not restored: the algorithm has no local replay buffer")
        return
    if name not in meta.states:
        missing = name in (getattr(meta, "missing", ()) or ()) or name in (getattr(meta, "pending", ()) or ())
        states[REPLAY] = (f"missing: version {meta.version} lists {[name]} as not written (best-effort)" if missing
                          else f"missing: version {meta.version} has no replay buffer "
                               f"(saved with replay_strategy='off'?)")
        log.warning("ray_ckpt: run %r version %d: %s; the replay buffer stays empty", engine.run, meta.version,
                    states[REPLAY])
        return
    if name not in loaded:
        why = states.get(name, "not read")
        if strict:
            raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r}: its replay buffer "
                               f"could not be read ({name}: {why}); nothing was changed")
        states[name] = f"not restored: {why}"
        return
    restore_journal(buf, loaded[name], agent_to_module_mapping_fn=getattr(algorithm.config, "policy_mapping_fn", None))
    journal_of(buf).restored_from = (engine.run, int(meta.version))
