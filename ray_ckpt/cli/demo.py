"""``ray-ckpt demo [OPTIONS]``: run the preemption demo that ships in the package (``ray_ckpt/cli/demo_run.py``).

The demo's options (``demo_options.py``, with their help) are parsed here first, so that ``ray-ckpt
demo --help`` and a bad option answer at once: Ray and torch are imported only once the arguments
are known to be good.
"""
from __future__ import annotations

import argparse
from typing import Any, List

from .common import EXIT_OK, CliError
from .demo_options import DESCRIPTION, parser


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
