"""``ray-ckpt demo [ARGS...]``: run ``examples/demo.py`` from a source checkout."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import EXIT_OK, CliError


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("demo", help="run examples/demo.py (from a source checkout)",
                       description="Run the example in examples/demo.py; extra arguments are passed to it.")
    s.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="ARGS")
    s.set_defaults(func=run)


def demo_path() -> Path:
    return Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def run(args: argparse.Namespace) -> int:
    import runpy

    path = demo_path()
    if not path.is_file():
        raise CliError(f"the demo script was not found at {path} (it ships with the source checkout of "
                       f"ray_ckpt, in examples/demo.py)")
    saved = sys.argv
    sys.argv = [str(path)] + list(args.demo_args or [])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return EXIT_OK
        if isinstance(code, int):
            return code
        raise CliError(f"demo: {code}") from None
    finally:
        sys.argv = saved
    return EXIT_OK
