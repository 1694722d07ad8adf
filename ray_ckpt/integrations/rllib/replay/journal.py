"""A replay buffer's journal: recorders around ``add()`` and ``update_priorities()``, and the
capture of a save (the records of what arrived since the save before, the live rows, the meta).

Call sequence: :func:`journal_of` (at the algorithm's start, or at the first save: it installs the
recorders), then :meth:`Journal.capture` at each save, on the training thread between two calls of
the buffer (the RLlib callback's ``on_train_result``). A restore seeds a new journal
(:func:`..restore.restore_journal`), so the next save writes only what arrived after it.

The buffer's index lists are keyed: ``None`` is ``_indices`` (one entry per env step: ``(episode,
t[, leaf])``), a module id is that module's list in ``_module_to_indices`` (multi-agent: one entry
per agent step, ``(episode, agent, t[, leaf])``, stored with the agent as its code in the journal's
agent table). Prioritized, each list has its own pair of trees, whose leaves the last entry holds.
"""
from __future__ import annotations

import base64
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from ....errors import UnsupportedTypeError
from ..base import _rllib_internals as internals
from ..base.conversion import to_storable
from ..base.names import log
from .episodes import chunk_state
from .growth import kept, survivors
from .records import ROW_BYTES, encode, state_bytes
from .trees import free_nodes_state
from .values import Spaces, pack_one, pack_scalars, same_packed, type_name

FORMAT = "ray_ckpt.rllib.replay/6"
STATE_NAME = "replay_journal"
ADD, PRIO, STATE = 1, 2, 3
COMPACT_FACTOR = 2     # a STATE record is written when the live PRIO entries exceed this many per stored timestep
COMPACT_MIN = 4096     # ... plus this many
FULL_EPISODES = 32     # episodes per ADD record of a full capture (old data then leaves record by record)


@dataclass
class Record:
    """One live record: its kind, its rows ``first .. first + rows - 1``, its place in the order of
    events (``seq``), the highest buffer episode index it holds (-1: none) and, PRIO, how many
    leaf updates it holds."""

    kind: int
    first: int
    rows: int
    seq: int
    last_episode: int = -1
    entries: int = 0


@dataclass(frozen=True)
class Family:
    """What a buffer class holds: multi-agent (module lists), prioritized (trees)."""

    multi_agent: bool
    prioritized: bool
    cls: type  # RLlib's own class of the family

    def width(self, key: Any) -> int:
        """Columns of a stored entry of list ``key``."""
        return 2 + (key is not None) + self.prioritized


def family_of(buf: Any) -> Optional[Family]:
    from ray.rllib.utils.replay_buffers import (EpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,
                                                MultiAgentPrioritizedEpisodeReplayBuffer,
                                                PrioritizedEpisodeReplayBuffer)
    if not isinstance(buf, EpisodeReplayBuffer):
        return None
    ma = isinstance(buf, MultiAgentEpisodeReplayBuffer)
    per = isinstance(buf, MultiAgentPrioritizedEpisodeReplayBuffer if ma else PrioritizedEpisodeReplayBuffer)
    if ma and not per and isinstance(buf, PrioritizedEpisodeReplayBuffer):
        return None
    return Family(ma, per, {(False, False): EpisodeReplayBuffer, (False, True): PrioritizedEpisodeReplayBuffer,
                            (True, False): MultiAgentEpisodeReplayBuffer,
                            (True, True): MultiAgentPrioritizedEpisodeReplayBuffer}[ma, per])


def record_of(kind: int, first: int, rows: int, st: Dict[str, Any]) -> Record:
    """The Record of a record's state: its seq, highest episode index and, PRIO, leaf updates."""
    if kind == PRIO:
        calls = st["calls"]
        return Record(kind, first, rows, int(calls[-1]["seq"]), entries=sum(len(c["idx"]) for c in calls))
    eps = st["eps"] if kind == ADD else [x["indices"][:, 0].max() for x in st["lists"] if len(x["indices"])]
    return Record(kind, first, rows, int(st["seq"]), int(np.max(eps, initial=-1)))


_KNOWN_ATTRIBUTES: Dict[Family, frozenset] = {}


def check_attributes(buf: Any, fam: Family) -> None:
    """Refuse, naming it, an attribute that RLlib's own class of this family does not set (a
    subclass's own state, or one added to the instance): the journal keeps what RLlib's classes hold,
    and would otherwise lose it without a word."""
    known = _KNOWN_ATTRIBUTES.get(fam)
    if known is None:
        known = _KNOWN_ATTRIBUTES[fam] = frozenset(vars(fam.cls(capacity=2))) | {"add", "update_priorities"}
    extra = sorted(set(vars(buf)) - known)
    if extra:
        raise UnsupportedTypeError(f"replay buffer of type {type_name(buf)}: attribute {extra[0]!r} is not one RLlib's "
                                   f"own buffer class sets, and the replay journal would not keep it (it keeps "
                                   f"what RLlib's EpisodeReplayBuffer classes hold); save it in a state of its own "
                                   f"(engine.register) and delete it from the buffer, or save with "
                                   f"replay_strategy='off'")


def base_state(buf: Any, fam: Family) -> Dict[str, Any]:
    """RLlib's ``get_state()`` of ``buf`` without its episodes, ``episode_id_to_index`` and trees: the
    counters and the index lists (RLlib's own lists, not copies) -- O(modules), not O(timesteps) or
    O(episodes): it runs at every add() (the prioritized classes' own get_state() copies the
    free-node deques: O(capacity))."""
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer
    episodes, where = buf.episodes, buf.episode_id_to_index
    buf.episodes, buf.episode_id_to_index = (), {}
    try:
        st = EpisodeReplayBuffer.get_state(buf)
        if fam.multi_agent:
            st.update(internals.multi_agent_state(buf))
        return st
    finally:
        buf.episodes, buf.episode_id_to_index = episodes, where


def index_lists(st: Dict[str, Any], fam: Family) -> Dict[Any, list]:
    """key -> RLlib's index list (see the module docstring)."""
    out: Dict[Any, list] = {None: st["_indices"]}
    if fam.multi_agent:
        out.update(st["_module_to_indices"])
    return out


def full_state(buf: Any) -> Dict[str, Any]:
    """The class's whole ``get_state()`` without episodes (the tree objects / value lists; O(capacity):
    only a full capture or a compaction calls it)."""
    episodes, where = buf.episodes, buf.episode_id_to_index
    buf.episodes, buf.episode_id_to_index = (), {}
    try:
        return type(buf).get_state(buf)
    finally:
        buf.episodes, buf.episode_id_to_index = episodes, where


class Journal:
    """What a buffer received since its last save, and the live records of its saves."""

    def __init__(self, buf: Any):
        self.fam = family_of(buf)
        self.spaces = Spaces()
        self.agent_codes: Dict[Any, int] = {}  # agent id -> code (multi-agent entries store the code)
        self.records: List[Record] = []
        self.ids = np.empty(0, np.int64)
        self.rows = np.empty((0, ROW_BYTES), np.uint8)
        self.next_row_id = 0
        self.seq = 0
        self.adds: List[Dict[str, Any]] = []
        self.prios: List[Dict[str, Any]] = []
        self.full_because: Optional[str] = "the journal has not seen this buffer fill"
        self.added = -1          # the buffer's timesteps-added counter after the last call recorded
        self.lengths: Dict[Any, int] = {}  # and the length of each index list
        self.timesteps = 0       # the buffer's stored timesteps then
        self.prio_entries = 0    # leaf updates in self.prios
        self.state_due = False   # self.prios outgrew the buffer: the next save writes a STATE record
        self.restored_from: Optional[tuple] = None  # (run, version) a restore seeded the journal from
        self.checked_run: Optional[str] = None
        self.metrics_warned = False

    def agent_code(self, aid: Any) -> int:
        return self.agent_codes.setdefault(aid, len(self.agent_codes))

    def _encode(self, key: Any, entries: list) -> np.ndarray:
        if key is None or not entries:
            return np.array(entries, np.int64).reshape(len(entries), self.fam.width(key))
        code = self.agent_code
        return np.array([(e[0], code(e[1])) + tuple(e[2:]) for e in entries], np.int64)

    def synced(self, st: Dict[str, Any]) -> None:
        self.added = st["_num_timesteps_added"]
        self.timesteps = st["_num_timesteps"]
        self.lengths = {k: len(v) for k, v in index_lists(st, self.fam).items()}

    # ------------------------------------------------------------------ the recorders
    def record_add(self, buf: Any, chunks: List[Any], added_before: int) -> None:
        if self.full_because is None and added_before != self.added:  # e.g. a restore not through the journal
            self.full_because = "the buffer changed other than through add()"
        if self.full_because is not None:
            return  # a full capture comes anyway
        st = base_state(buf, self.fam)
        index = buf.episode_id_to_index
        keep = [(c, index[c.id_]) for c in chunks if c.id_ in index and len(c)]
        counts: Dict[Any, int] = {None: sum(len(c) for c, _ in keep)}
        if self.fam.multi_agent:  # an agent's steps go to its module's list (RLlib's _add_new_module_indices)
            for c, _ in keep:
                for aid, a in c.agent_episodes.items():
                    mid = c.module_for(aid)
                    counts[mid] = counts.get(mid, 0) + len(a)
        lists = index_lists(st, self.fam)
        eps = np.array([e for _, e in keep], np.int64)
        want, live, tails = np.repeat(eps, [len(c) for c, _ in keep]), set(eps.tolist()), {}
        for key, n in counts.items():  # the env list's entries are the chunks' steps in order; a module's, theirs
            lst = lists.get(key, [])
            tails[key] = tail = self._encode(key, lst[len(lst) - n:] if n else [])
            ok = np.array_equal(tail[:, 0], want) if key is None else set(tail[:, 0].tolist()) <= live
            if len(lst) < n or not ok:
                self.full_because = "an add() call's index entries are not those of the chunks it kept"
                return
        self.seq += 1
        add = {"seq": self.seq, "chunks": [chunk_state(c, self.spaces) for c, _ in keep], "eps": eps,
               "tails": list(tails.items())}
        if self.fam.prioritized:  # the leaves' weight: add() never changes the maximum priorities it reads
            add["w"] = [(k, pack_one(internals.max_priority(buf, k), "add()'s weight")) for k in tails]
        self.adds.append(add)
        evicted = st["_num_episodes_evicted"]
        if int(self.adds[0]["eps"].max(initial=-1)) < evicted:  # between rare saves: what RLlib evicted goes
            self.adds = [a for a in self.adds if int(a["eps"].max(initial=-1)) >= evicted]
        self.synced(st)

    def record_priorities(self, key: Any, sampled: List[int], priorities: Any) -> None:
        if self.full_because is not None:
            return
        if isinstance(priorities, np.ndarray) and priorities.ndim == 1 and priorities.dtype.kind == "f":
            p: Any = {"array": priorities.copy()}
        else:
            p = pack_scalars(list(priorities), "update_priorities()'s priorities")
        self.seq += 1
        self.prios.append({"seq": self.seq, "key": key, "idx": np.array(sampled, np.int64), "p": p})
        self.prio_entries += len(sampled)
        if self.prio_entries > COMPACT_FACTOR * self.timesteps + COMPACT_MIN:
            # between rare saves: the next save writes every leaf (a STATE record) instead of these
            self.prios.clear()
            self.prio_entries = 0
            self.state_due = True

    # ------------------------------------------------------------------ a save
    def capture(self, buf: Any, floor: Optional[int] = None) -> Dict[str, Any]:
        """The ``replay_journal`` state of this save: every live row (the new records' rows after
        the ones kept), ``format`` and ``meta``. ``floor``: the run's newest version was written by
        another buffer (a restore from another run or an older version): every row gets a new id
        from ``floor`` and this save writes the whole buffer once (a full capture)."""
        check_attributes(buf, self.fam)
        st = base_state(buf, self.fam)
        if not hooked(buf, self):  # replaced behind the journal (e.g. wrapped by other code): put back
            install(buf, self)
            self.full_because = "its recorders had been replaced"
        if floor is not None:
            self.next_row_id = max(self.next_row_id, int(floor))
            self.full_because = f"its row ids start anew from {floor}"
        elif self.full_because is None and (st["_num_timesteps_added"] != self.added or self.lengths != {
                k: len(v) for k, v in index_lists(st, self.fam).items()}):
            self.full_because = "the buffer changed other than through add()"
        evicted = int(st["_num_episodes_evicted"])
        if self.full_because is not None:
            if self.records or self.added >= 0:
                (log.warning if "failed" in self.full_because else log.info)(
                    "ray_ckpt: replay journal: this save writes the whole buffer (%s)", self.full_because)
            self.spaces, self.agent_codes = Spaces(), {}
            new = self._full(buf, st, evicted)
            keep = np.zeros(len(self.records), bool)
        else:
            new = self._since(buf, st, evicted)
            newest_state = max((r.seq for r in self.records + [n for n, _ in new] if r.kind == STATE), default=-1)
            keep = np.array([(r.last_episode >= evicted) if r.kind == ADD else
                             (r.seq > newest_state) if r.kind == PRIO else
                             (r.seq == newest_state and r.last_episode >= evicted) for r in self.records], bool)
        self._keep(keep, new)
        self.adds.clear()
        self.prios.clear()
        self.prio_entries, self.state_due = 0, False
        self.full_because = None
        self.spaces.prune()  # the id cache pins every chunk's space objects: O(adds ever) without this
        self.synced(st)
        return {"row_id": self.ids, "blob": self.rows, "format": FORMAT, "meta": self._meta(buf, st)}

    def _since(self, buf: Any, st: Dict[str, Any], evicted: int) -> List[tuple]:
        new = []
        for a in self.adds:
            if len(a["eps"]) and int(a["eps"].max()) >= evicted:
                new.append(self._record(ADD, a))
        if self.prios:
            new.append(self._record(PRIO, {"calls": list(self.prios)}))
        live_prio = sum(r.entries for r in self.records if r.kind == PRIO) + sum(n.entries for n, _ in new)
        if self.fam.prioritized and (self.state_due or live_prio > COMPACT_FACTOR * st["_num_timesteps"] + COMPACT_MIN):
            # every leaf anew: this save's PRIO record and the older ones are superseded
            new = [n for n in new if n[0].kind != PRIO] + [self._state_record(buf, st)]
        return new

    def _full(self, buf: Any, st: Dict[str, Any], evicted: int) -> List[tuple]:
        """Every stored episode (whole, as one chunk each) and a STATE record: all rows new."""
        new = []
        eps = list(buf.episodes)
        for i in range(0, len(eps), FULL_EPISODES):
            group = eps[i:i + FULL_EPISODES]
            self.seq += 1
            idx = np.arange(evicted + i, evicted + i + len(group), dtype=np.int64)
            new.append(self._record(ADD, {"seq": self.seq, "chunks": [chunk_state(e, self.spaces) for e in group],
                                          "eps": idx, "tails": None}))
        new.append(self._state_record(buf, st))
        return new

    def _state_record(self, buf: Any, st: Dict[str, Any]) -> tuple:
        """Every index list whole and, prioritized, every live leaf of each list's trees."""
        self.seq += 1
        lists = []
        trees = internals.tree_values(full_state(buf), self.fam.multi_agent) if self.fam.prioritized else {}
        for key, lst in index_lists(st, self.fam).items():
            arr = self._encode(key, lst)
            entry: Dict[str, Any] = {"key": key, "indices": arr}
            if self.fam.prioritized:
                sums, mins = trees[key]
                at = (arr[:, -1] + len(sums) // 2).tolist()
                entry["sum"] = pack_scalars([sums[t] for t in at], "the sum tree's leaves")
                m = pack_scalars([mins[t] for t in at], "the min tree's leaves")
                if not same_packed(m, entry["sum"]):
                    entry["min"] = m
            lists.append(entry)
        return self._record(STATE, {"seq": self.seq, "lists": lists})

    def _record(self, kind: int, state: Dict[str, Any]) -> tuple:
        rows = encode(kind, state_bytes(state))
        self.next_row_id += len(rows)
        return record_of(kind, self.next_row_id - len(rows), len(rows), state), rows

    def _keep(self, keep: np.ndarray, new: List[tuple]) -> None:
        per_row = np.repeat(keep, [r.rows for r in self.records]) if self.records else np.zeros(0, bool)
        sel = survivors(per_row)
        rows = np.concatenate([r for _, r in new]) if new else np.empty((0, ROW_BYTES), np.uint8)
        ids = np.concatenate([np.arange(n.first, n.first + n.rows, dtype=np.int64) for n, _ in new]) if new \
            else np.empty(0, np.int64)
        self.rows = kept(self.rows, sel, rows)
        self.ids = kept(self.ids, sel, ids)
        self.records = [r for r, k in zip(self.records, keep.tolist()) if k] + [n for n, _ in new]

    def _meta(self, buf: Any, st: Dict[str, Any]) -> str:
        meta: Dict[str, Any] = {
            "format": FORMAT, "buffer_type": type_name(buf), "next_row_id": self.next_row_id, "seq": self.seq,
            "config": {"capacity": buf.capacity, "batch_size_B": buf.batch_size_B,
                       "batch_length_T": buf.batch_length_T},
            "state": {k: v for k, v in st.items() if k not in ("episodes", "episode_id_to_index", "_indices",
                                                               "_module_to_indices")},
            "modules": [k for k in index_lists(st, self.fam) if k is not None],
            "rng": buf.rng.bit_generator.state, "spaces": self.spaces.table, "agents": list(self.agent_codes),
            "not_saved": {}}
        if self.fam.prioritized:
            meta["config"]["alpha"] = internals.replay_alpha(buf)
            meta["per"] = _per_meta(internals.per_scalars(buf))
            if self.fam.multi_agent:
                meta["module_per"] = {k: [(m, _per_meta({k[len("_module_to"):]: v})) for m, v in items]
                                      for k, items in internals.module_per_scalars(buf).items()}
        try:  # not needed to sample: a metrics state that cannot be stored is reported, not fatal
            meta["metrics"] = to_storable(buf.metrics.get_state(), "replay_journal.metrics")
        except Exception as exc:  # e.g. RLlib's own get_state fails on int agent ids
            meta["metrics"] = None
            meta["not_saved"]["metrics"] = f"{type(exc).__name__}: {exc}"
            if not self.metrics_warned:
                self.metrics_warned = True
                log.warning("ray_ckpt: replay journal: the buffer's metrics are not saved (%s); a restore keeps "
                            "the restoring buffer's own", meta["not_saved"]["metrics"])
        return base64.b64encode(zlib.compress(state_bytes(meta), 6)).decode("ascii")


def _per_meta(scalars: Dict[str, Any]) -> Dict[str, Any]:
    """A prioritized list's scalars as stored: the maximum priority with its exact type, the free
    nodes as ``prefix + range``."""
    out = dict(scalars)
    if "_max_priority" in out:
        out["_max_priority"] = pack_one(out["_max_priority"], "_max_priority")
    if "_free_nodes" in out:
        out["_free_nodes"] = free_nodes_state(out["_free_nodes"])
    if "_last_sampled_indices" in out:
        out["_last_sampled_indices"] = list(out["_last_sampled_indices"])
    return out


# ---------------------------------------------------------------------- buffer -> journal
_JOURNALS: "weakref.WeakKeyDictionary[Any, Journal]" = weakref.WeakKeyDictionary()


def journal_of(buf: Any) -> Journal:
    """The buffer's journal, created with its recorders on first use (the first save is then a
    full capture of what the buffer already holds, unless it is still empty)."""
    j = _JOURNALS.get(buf)
    if j is None:
        if family_of(buf) is None:
            raise UnsupportedTypeError(f"replay buffer of type {type_name(buf)}: the replay journal keeps RLlib's "
                                       f"EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, "
                                       f"MultiAgentEpisodeReplayBuffer and MultiAgentPrioritizedEpisodeReplayBuffer "
                                       f"(and subclasses)")
        check_attributes(buf, family_of(buf))
        j = Journal(buf)
        st = base_state(buf, j.fam)
        if st["_num_timesteps_added"] == 0 and not st["_indices"]:  # it sees the buffer fill from empty
            j.full_because = None
            j.synced(st)
        install(buf, j)
    return j


def hooked(buf: Any, j: Journal) -> bool:
    """Whether the journal's recorders are the instance's ``add`` (and ``update_priorities``)."""
    names = ("add", "update_priorities") if j.fam.prioritized else ("add",)
    return all(getattr(buf.__dict__.get(n), "_ray_ckpt_journal", False) for n in names)


def install(buf: Any, j: Journal) -> None:
    """Make ``j`` the buffer's journal, with recorders around the instance's ``add`` (and
    ``update_priorities``): put there unless they are already (they find the journal at each call)."""
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer
    _JOURNALS[buf] = j
    if hooked(buf, j):
        return
    cls_add = type(buf).add.__get__(buf)

    def add(episodes: Any, *args: Any, **kw: Any) -> Any:
        chunks = list(episodes) if isinstance(episodes, (list, tuple)) else [episodes]
        if (args or kw.get("weight") is not None) and _JOURNALS[buf].fam.prioritized:
            _JOURNALS[buf].full_because = "add() was given a weight"  # rare: the next save writes the buffer
        added_before = EpisodeReplayBuffer.get_added_timesteps(buf)  # RLlib's _num_timesteps_added
        out = cls_add(episodes, *args, **kw)
        try:
            _JOURNALS[buf].record_add(buf, chunks, added_before)
        except Exception as exc:  # never fail training: the next save writes the whole buffer
            _JOURNALS[buf].full_because = f"recording an add() failed ({type(exc).__name__}: {exc})"
        return out
    add._ray_ckpt_hook = add._ray_ckpt_journal = True
    buf.add = add
    if not j.fam.prioritized:
        return
    cls_update = type(buf).update_priorities.__get__(buf)
    multi_agent = j.fam.multi_agent

    def update_priorities(priorities: Any, *args: Any, **kw: Any) -> Any:
        key = (kw["module_id"] if "module_id" in kw else args[0]) if multi_agent else None
        sampled = list(internals.last_sampled(buf, key))
        out = cls_update(priorities, *args, **kw)
        try:
            _JOURNALS[buf].record_priorities(key, sampled, priorities)
        except Exception as exc:
            _JOURNALS[buf].full_because = f"recording update_priorities() failed ({type(exc).__name__}: {exc})"
        return out
    update_priorities._ray_ckpt_hook = update_priorities._ray_ckpt_journal = True
    buf.update_priorities = update_priorities
