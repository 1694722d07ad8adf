"""What ``RayCkptDeepspeedStrategy`` keeps per save_dir on a rank: the run (its engine, what it
declared, the saves in flight and the failures not raised yet) and each save until it commits."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..committed import UsedSteps


@dataclass
class Save:
    step: int
    tag: str
    tag_dir: str
    handles: List[Any]
    save_latest: bool
    metric: Optional[Tuple[Any, Any]]
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


class Run:
    """One save_dir's run on this rank: its engine, what it declared, its saves in flight."""

    def __init__(self, name: str, engine: Any, rank: int):
        self.name, self.engine = name, engine
        self.declared: Optional[tuple] = None
        self.kept: Optional[int] = None
        self.saves: List[Save] = []
        self.failures: List[str] = []
        self.jobs: "queue.Queue[Save]" = queue.Queue()
        self.used = UsedSteps(name, logging.getLogger("ray_ckpt"), rank)  # steps of lost versions: not saved again
