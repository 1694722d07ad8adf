"""Keep a run's snapshot mailbox alive for as long as its coordinator, across rank restarts.

Overlapped copies announce themselves in the run's mailbox actor (``capture/mailbox.py``). It is
created inside the coordinator's process, but the coordinator keeps no handle of it: the handle
goes to the rank that asked first, and Ray stops an actor once the handles counted for it are
gone. When the ranks' processes end (a job preempted and resumed on another number of GPUs, the
example's kill and resume), the mailbox goes with them while the writers still hold the old
handle, and every later overlapped save of the run fails ("its run's mailbox stopped").

:func:`hold_mailbox`, called by the rank that creates or first connects to the run before any
rank pushes, has the coordinator create the mailbox and keep that handle on itself: the mailbox
then lives as long as the coordinator. No OpenRLHF or DeepSpeed import here (the function runs in
the coordinator's process)."""
from __future__ import annotations

from typing import Any

import ray

from ...capture.mailbox import _spawn_mailbox, mailbox_name
from ...protocol import NAMESPACE, actor_name

_ATTRIBUTE = "_ray_ckpt_openrlhf_mailbox"


def _hold(coordinator: Any, name: str) -> bool:
    """Runs in the coordinator (``__ray_call__``): create (or get) the mailbox, keep its handle."""
    if getattr(coordinator, _ATTRIBUTE, None) is None:
        setattr(coordinator, _ATTRIBUTE, _spawn_mailbox(coordinator, name))
    return True


def hold_mailbox(run: str, timeout: float = 60.0) -> None:
    """Have ``run``'s coordinator hold its mailbox (idempotent). A mailbox some rank created
    before this call is held by the handle Ray gives back for it, which may not count."""
    coordinator = ray.get_actor(actor_name(run), namespace=NAMESPACE)
    ray.get(coordinator.__ray_call__.remote(_hold, mailbox_name(run)), timeout=timeout)
