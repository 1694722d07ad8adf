"""The preemption demo's options and their help: one declaration for ``ray-ckpt demo`` (``demo.py``)
and ``python -m ray_ckpt.demo`` (``demo_run.py``)."""
from __future__ import annotations

import argparse

DESCRIPTION = ("Train a small policy-gradient learner on CartPole with two rollout actors, saving every few "
               "steps without waiting; kill the learner and a rollout actor mid-run, restore the latest "
               "committed version, finish, and compare the final weights bit for bit with an uninterrupted "
               "run with the same seeds.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's options (``ray_ckpt.cli.demo_run.main`` takes the same)."""
    ap.add_argument("--steps", type=int, default=30, metavar="N",
                    help="training steps of each run, the uninterrupted one and the preempted one "
                         "(default: %(default)s)")
    ap.add_argument("--save-every", type=int, default=5, metavar="K",
                    help="save every K steps, without waiting for the save (default: %(default)s)")
    ap.add_argument("--kill-at", type=int, default=17, metavar="STEP",
                    help="at this step kill the learner and rollout actor 0, then restore the latest "
                         "committed version and go on (default: %(default)s)")
    ap.add_argument("--dir", default=None, metavar="DIR",
                    help="checkpoint root; the runs' versions are kept there (default: a new temporary "
                         "directory)")


def parser(prog: str = "ray-ckpt demo") -> argparse.ArgumentParser:
    """A parser of the demo's options alone."""
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(ap)
    return ap
