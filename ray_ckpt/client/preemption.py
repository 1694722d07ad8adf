"""The engine's side of preemption notices: ``preemption()`` and ``save_if_preempted()``.

The coordinator watches Ray's draining nodes and copies what only a drained node holds elsewhere
(``coordinator/evacuation.py``); what is left to the trainer is to save at its step boundaries, so
that the steps made after the notice are not lost either. Training loops (and the integrations: the
RLlib callback each iteration) call ``save_if_preempted(step)`` each step: it asks the coordinator
at most once per ``NOTICE_MAX_AGE_S`` (a call between is a dict lookup) and saves

* at the first step boundary after the notice, whatever the cadence;
* again, while the notice lasts, at the first step boundary after this engine's newest save got a
  copy off the drained nodes (it is no longer in ``notice.at_risk``) -- when the notice is about
  the trainer's own parts (``notice.states``: its newest parts were written there) or its own node.

Why keep saving: the deadline (30 s to 2 min) is training time; a trainer that saved once at the
notice loses every step it made after it. Saving again only once the newest save is safe keeps
one save moving at a time: the saves follow the time a copy away takes, never pile up on the
node, and the newest safe step is at most one copy behind the step in progress when it goes.
Saves use ``on_busy="queue"`` so that they never wait for room.

A mixin of :class:`~ray_ckpt.client.engine.CheckpointEngine` (``_call``, ``config``, ``save``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Tuple

import ray

from ..types import OnBusy, OnPreemption, PreemptionNotice

NOTICE_MAX_AGE_S = 1.0  # how long a notice read from the coordinator is reused


class PreemptionNotices:
    """``preemption()`` / ``save_if_preempted()`` (see the module)."""

    config: Any
    _call: Callable[..., Any]
    save: Callable[..., Any]
    _last_saved: int
    _last_pushed: Dict[tuple, int]
    _notice_read: Tuple[float, Optional[PreemptionNotice]] = (float("-inf"), None)
    _notice_saved: Optional[float] = None  # noticed_at of the notice this engine saved for
    _notice_node: Optional[str] = None  # this process's node (hex id), read with the first notice

    def preemption(self, max_age: float = NOTICE_MAX_AGE_S) -> Optional[PreemptionNotice]:
        """The preemption notice in force for this run, or None: Ray drains a node that holds part
        of it (its local tier's files, writers, replicas, or a process that asked this before: this
        one's own node counts from the coordinator's next reading, within a second) with a
        deadline. The notice names the nodes, the ``deadline`` (``seconds_left()``), the states and
        ranks whose newest parts were written there, and what the run has ``moved`` away, is
        ``moving``, and ``lost`` (with why). Read from the coordinator at most once per ``max_age``
        seconds."""
        read_at, notice = self._notice_read
        now = time.monotonic()
        if now - read_at >= max_age:
            if self._notice_node is None:
                self._notice_node = ray.get_runtime_context().get_node_id()
            node = self._notice_node  # a drain of this process's node is the run's
            notice = self._call(lambda c: c.preemption.remote(node), "the preemption notice")
            self._notice_read = (now, notice)
        return notice

    def save_if_preempted(self, step: Optional[int] = None, *,
                          metrics: Optional[Dict[str, float]] = None) -> Optional[Any]:
        """Save at ``step`` if a preemption notice is in force and a save is due for it (see
        :meth:`preemption_save_due`), with ``create(..., on_preemption="save")`` (the default); returns
        the save's handle, else None. Call it at each step boundary, whatever the saving cadence: the
        run copies each new version away before the deadline like the others (wait with
        ``handle.wait(timeout=notice.seconds_left())``). A step already saved is not saved again."""
        if self.preemption_save_due() is None:
            return None
        if step is not None and step <= self._last_saved:
            return None  # saved at this step already (the loop's own cadence came first)
        return self.save(step, on_busy=OnBusy.QUEUE, metrics=metrics)

    def preemption_save_due(self) -> Optional[PreemptionNotice]:
        """The notice in force if a save is due for it, else None (always None unless
        ``on_preemption="save"``): at the first call after the notice began, and again at each call
        after this engine's newest save (or push) is committed and no longer at risk (it has a copy off the
        drained nodes), while the notice names the run's states or this process's node (the module
        says why). The caller saves when it gets a notice: for integrations whose save is more than
        ``engine.save()`` (the RLlib callback captures the algorithm first)."""
        if OnPreemption.parse(self.config.on_preemption) is not OnPreemption.SAVE:
            return None
        notice = self.preemption()
        if notice is None:
            return None
        if self._notice_saved != notice.noticed_at:
            self._notice_saved = notice.noticed_at
            return notice
        return notice if self._save_again(notice) else None

    def _save_again(self, notice: PreemptionNotice) -> bool:
        """Whether the trainer saves once more for a notice it already saved for: the notice is
        about its parts or its node, time is left, and its newest save is safe. Its newest save is
        the newest step this engine saved or pushed a part of (``submit``: Ray Train's checkpointer
        and OpenRLHF's strategy push from rank 0's engine)."""
        newest = max([self._last_saved, *self._last_pushed.values()])
        ours = bool(notice.states) or (self._notice_node is not None and self._notice_node in notice.nodes)
        return (ours and notice.seconds_left() > 0 and notice.saved_step == newest
                and newest not in notice.at_risk and newest not in notice.lost)
