"""``ray-ckpt demo [ARGS...]``: run the preemption demo that ships in the package (``ray_ckpt/cli/demo_run.py``)."""
from __future__ import annotations

import argparse
from typing import Any

from .common import EXIT_OK, CliError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("demo", help="run the preemption demo (python -m ray_ckpt.demo)",
                       description="Run the preemption demo shipped in the package (ray_ckpt.demo); extra "
                                   "arguments are passed to it.")
    s.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="ARGS")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .demo_run import main  # ray and torch are imported here, only when the demo runs

    try:
        return main(list(args.demo_args or []))
    except SystemExit as exc:  # argparse: --help, bad arguments
        code = exc.code
        if code is None or code == 0:
            return EXIT_OK
        if isinstance(code, int):
            return code
        raise CliError(f"demo: {code}") from None
