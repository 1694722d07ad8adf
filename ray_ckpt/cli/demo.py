"""``ray-ckpt demo [OPTIONS]``: run the preemption demo that ships in the package (``ray_ckpt/cli/demo_run.py``).

The demo's options are declared here, with their help, so that ``ray-ckpt demo --help`` and a bad
option answer at once: Ray and torch are imported only once the arguments are known to be good.
"""
from __future__ import annotations

import argparse
from typing import Any, List

from .common import EXIT_OK, CliError

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


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("demo", help="run the preemption demo (python -m ray_ckpt.demo)",
                       description=DESCRIPTION + " Its options: 'ray-ckpt demo --help'.")
    s.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="OPTIONS",
                   help="the demo's options (--steps, --save-every, --kill-at, --dir)")
    s.set_defaults(func=run)


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None or code == 0:
        return EXIT_OK
    if isinstance(code, int):
        return code
    raise CliError(f"demo: {code}") from None


def run(args: argparse.Namespace) -> int:
    argv: List[str] = list(args.demo_args or [])
    try:
        parser().parse_args(argv)  # --help and bad options end here, before Ray and torch load
    except SystemExit as exc:
        return _exit_status(exc)
    from .demo_run import main  # ray and torch are imported here, only when the demo runs

    try:
        return main(argv)
    except SystemExit as exc:  # argparse inside the demo
        return _exit_status(exc)
