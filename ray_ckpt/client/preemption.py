"""The engine's side of preemption notices: ``preemption()`` and ``save_if_preempted()``.

The coordinator watches Ray's draining nodes and copies what only a drained node holds elsewhere
(``coordinator/evacuation.py``); what is left to the trainer is one more save at its next step
boundary, so that the step in progress at the notice is not lost either. Training loops (and the
integrations: the RLlib callback each iteration) call ``save_if_preempted(step)`` each step: it
asks the coordinator at most once per ``NOTICE_MAX_AGE_S`` (a call between is a dict lookup) and
saves once per notice, with ``on_busy="queue"`` so that the last save never waits for room.

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
    _notice_read: Tuple[float, Optional[PreemptionNotice]] = (float("-inf"), None)
    _notice_saved: Optional[float] = None  # noticed_at of the notice this engine saved for

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
            node = ray.get_runtime_context().get_node_id()  # a drain of this process's node is the run's
            notice = self._call(lambda c: c.preemption.remote(node), "the preemption notice")
            self._notice_read = (now, notice)
        return notice

    def save_if_preempted(self, step: Optional[int] = None, *,
                          metrics: Optional[Dict[str, float]] = None) -> Optional[Any]:
        """Save at ``step`` if a preemption notice is in force and this engine has not saved for it
        yet, with ``create(..., on_preemption="save")`` (the default); returns the save's handle,
        else None. Call it at each step boundary, whatever the saving cadence: the run copies the
        new version away before the deadline like the others (wait with
        ``handle.wait(timeout=notice.seconds_left())``). A step already saved is not saved again."""
        if self.preemption_save_due() is None:
            return None
        if step is not None and step <= self._last_saved:
            return None  # saved at this step already (the loop's own cadence came first)
        return self.save(step, on_busy=OnBusy.QUEUE, metrics=metrics)

    def preemption_save_due(self) -> Optional[PreemptionNotice]:
        """The notice in force if this engine has not taken its last save for it yet (and marks it
        taken), else None; always None unless ``on_preemption="save"``. For integrations whose save is
        more than ``engine.save()`` (the RLlib callback captures the algorithm first)."""
        if OnPreemption.parse(self.config.on_preemption) is not OnPreemption.SAVE:
            return None
        notice = self.preemption()
        if notice is None or self._notice_saved == notice.noticed_at:
            return None
        self._notice_saved = notice.noticed_at
        return notice
