"""The ``ray-ckpt`` parser and entry point: one subcommand per module, one-line errors."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..errors import CheckpointError, one_line
from ..storage.filesystems import scrub
from . import demo, export, gc, ls, migrate, show, verify
from .common import EXIT_FAIL, EXIT_OK, PROG, CliError, UsageError, printable

COMMANDS = (ls, show, verify, gc, export, migrate, demo)
MAX_ERROR_CHARS = 600


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog=PROG, description="Inspect, verify, prune and export ray_ckpt checkpoints "
                                       "(no Ray cluster needed).",
                epilog="URI: a run's root (the directory or prefix holding v000000000100/ ...), as a "
                       "path, file:// or s3:// URI. VERSION: a number, a version directory name or 'latest'.")
    p.add_argument("--debug", action="store_true", help="show a traceback on unexpected errors")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("--endpoint-override", "--s3-endpoint", dest="endpoint_override", metavar="HOST:PORT",
                        help="S3-compatible endpoint for s3:// URIs (HOST:PORT is plain http; give "
                             "https://HOST:PORT for TLS). Credentials: AWS_ACCESS_KEY_ID / "
                             "AWS_SECRET_ACCESS_KEY; region: AWS_REGION")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for command in COMMANDS:
        command.register(sub, common)
    return p


def _error(message: str, uri: Optional[str] = None) -> None:
    """``ray-ckpt: error: ...`` on stderr: one line, escaped, without the secrets of ``uri`` (the
    URI given), at most MAX_ERROR_CHARS."""
    try:
        text = printable(" ".join((scrub(str(message), uri) if uri else str(message)).split()))
        if len(text) > MAX_ERROR_CHARS:
            text = text[: MAX_ERROR_CHARS - 3] + "..."
        sys.stderr.write(f"{PROG}: error: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PermissionError) and getattr(exc, "filename", None):
        return f"permission denied: {exc.filename}"
    return one_line(exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ray-ckpt``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[:1] or os.environ.get("RAY_CKPT_DEBUG") == "1"
    uri = None
    try:
        head = [a for a in argv[:2] if a == "--debug"]
        if argv[len(head):len(head) + 1] == ["demo"]:  # everything after 'demo' belongs to the demo
            debug = debug or bool(head)
            return demo.run(argparse.Namespace(demo_args=argv[len(head) + 1:]))
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        debug = debug or args.debug
        uri = getattr(args, "uri", None)
        return int(args.func(args) or 0)
    except CliError as exc:
        _error(str(exc), uri)
        return exc.code
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:  # e.g. `ray-ckpt ls URI | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_FAIL
    except (CheckpointError, OSError, ValueError) as exc:
        if debug:
            raise
        _error(_describe(exc), uri)
        return EXIT_FAIL
    except Exception as exc:  # never a traceback for the user; --debug shows it
        if debug:
            raise
        _error(f"unexpected {type(exc).__name__}: {one_line(exc)} (run with --debug for a traceback)", uri)
        return EXIT_FAIL
