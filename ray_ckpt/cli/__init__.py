"""``ray-ckpt``: inspect, verify, prune and export the checkpoints of a run, without a Ray cluster.

    ray-ckpt ls      URI [--json]
    ray-ckpt show    URI VERSION [--json] [--max-leaves N]
    ray-ckpt verify  URI [VERSION | --all] [--progress | --no-progress] [--json]
    ray-ckpt gc      URI --keep-last N [--keep-every K] [--keep-best METRIC:max|min:N] [--partial] [--dry-run]
                     [--progress | --no-progress] [--json]
    ray-ckpt export  URI VERSION --state NAME --to DIR|FILE.safetensors [--rank R] [--max-shard-size SIZE]
                     [--force] [--progress | --no-progress] [--json]
    ray-ckpt migrate URI [--remote URI] [--dry-run] [--force] [--json]
    ray-ckpt demo    [ARGS...]

URI is a run's root on either tier: the directory or prefix that directly holds the version
directories (``v000000000100/``): a path, a ``file://`` URI or an ``s3://bucket/prefix`` URI (any
``pyarrow.fs`` URI). S3 credentials come from the usual ``AWS_*`` environment variables;
``--endpoint-override HOST:PORT`` (or a ``http(s)://`` URL) points at an S3-compatible server.
VERSION is a version number (``100``), a version directory name (``v000000000100``) or ``latest``.

Every error is one line on stderr starting with ``ray-ckpt: error:``; the exit status is 2 for
usage errors and 1 for failures (including a failed verification; with ``--json`` the document is
printed first). Human-readable output escapes control characters from storage (``\\x1b``); URIs are
shown without credentials.

Modules: ``main`` (parser, entry point, errors), ``run_view`` (a run root on any tier: versions,
manifests, VERSION arguments), ``common`` (exit codes, safe text output), one module per command
(``ls``, ``show``, ``verify``, ``gc``, ``export``, ``migrate``, ``demo``; the demo itself: ``demo_run``). May import
every layer below it, but uses the Ray-free ones (``storage``, ``formats``, ``client.progress``);
neither Ray nor torch is imported at start-up.
"""
from .main import build_parser, main

__all__ = ["main", "build_parser"]
