"""``pyarrow.fs`` filesystems from URIs: S3 with short timeouts and bounded retries, settings from
the URI, the options or the usual AWS_* environment, and one-line hints for S3's usual failures."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional, Tuple
from urllib.parse import urlparse

import pyarrow.fs as pafs

from ..errors import InvalidArgumentError, one_line

# keys, not directories: "creating" a parent directory there writes an empty marker object per
# level (requests, and objects a plain listing shows)
OBJECT_STORES = tuple(c for c in (getattr(pafs, "S3FileSystem", None), getattr(pafs, "GcsFileSystem", None)) if c)

# S3: fail in seconds, not minutes, on a dead endpoint or wrong credentials (auth errors are not
# retried at all; connection errors are retried max_attempts - 1 times with the SDK's backoff).
# Anything given in ``options`` wins over these defaults.
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 20.0  # curl low-speed limit: fail when < 1 byte/s moves for this long
S3_MAX_ATTEMPTS = 3


def _s3_defaults() -> Dict[str, Any]:
    return {"connect_timeout": S3_CONNECT_TIMEOUT_S, "request_timeout": S3_REQUEST_TIMEOUT_S,
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)}


def _s3_env_endpoint() -> Dict[str, Any]:
    """``AWS_ENDPOINT_URL_S3`` (else ``AWS_ENDPOINT_URL``) as S3FileSystem arguments, or {}."""
    url = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "").strip()
    if not url:
        return {}
    parsed = urlparse(url if "://" in url else f"https://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"AWS_ENDPOINT_URL(_S3)={url!r} is not an http(s)://host[:port] URL")
    return {"endpoint_override": parsed.netloc, "scheme": parsed.scheme}


def _s3_filesystem(uri: str, options: Dict[str, Any]) -> Tuple[pafs.FileSystem, str]:
    parsed = urlparse(uri)
    path = (parsed.netloc + parsed.path).strip("/")
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise ValueError("no bucket in the URI")
    if not options and (parsed.query or "@" in parsed.netloc):
        # settings carried by the URI itself (?endpoint_override=..., key:secret@bucket): pyarrow's syntax
        fs, p = pafs.FileSystem.from_uri(uri)
        return fs, p.rstrip("/")
    kwargs = _s3_defaults()
    if "endpoint_override" not in options:
        kwargs.update(_s3_env_endpoint())
    kwargs.update(options)
    if not options and kwargs.get("region") is None:  # explicit options are passed on as given
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not region and kwargs.get("endpoint_override"):
            region = "us-east-1"  # S3-compatible servers: any region signs; skip the lookup
        if not region:
            with contextlib.suppress(OSError, ValueError):  # what from_uri does; may need network
                region = pafs.resolve_s3_region(bucket)
        if region:
            kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), path


def resolve_filesystem(uri: str, options: Optional[Dict[str, Any]] = None) -> Tuple[pafs.FileSystem, str]:
    """``uri`` -> (filesystem, path). ``options`` go to the filesystem's constructor (S3: endpoint_override,
    scheme, region, access_key, secret_key, ...), or are ``{"filesystem": fs}`` (see ``_given_filesystem``);
    without them the usual environment is read (AWS_* for S3, including AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible servers). S3 filesystems get
    short connect timeouts and a bounded retry strategy unless ``options`` set their own.

    Raises InvalidArgumentError (a ValueError) for a URI or options that cannot be used."""
    if not isinstance(uri, str) or not uri:
        raise InvalidArgumentError(f"storage URI must be a non-empty string, got {uri!r}")
    scheme = urlparse(uri).scheme if "://" in uri else ""
    if options and "filesystem" in options:
        return _given_filesystem(uri, options)
    try:
        if scheme == "s3":
            return _s3_filesystem(uri, dict(options or {}))
        if options:
            if scheme in ("gs", "gcs"):
                return pafs.GcsFileSystem(**options), uri.split("://", 1)[1].rstrip("/")
            raise ValueError(f"storage options are only understood for s3:// and gs:// URIs, not {uri!r}")
        if scheme == "":
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path.rstrip("/") or "/"
    except (ValueError, OSError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InvalidArgumentError(f"cannot open storage URI {uri!r}: {one_line(exc)}") from None


def _given_filesystem(uri: str, options: Dict[str, Any]) -> Tuple[pafs.FileSystem, str]:
    """``options={"filesystem": fs}``: a filesystem the caller built, for what no URI names (an
    fsspec filesystem: Azure through adlfs, OCI, SFTP, a custom one). A ``pyarrow.fs.FileSystem``
    is used as given; an fsspec ``AbstractFileSystem`` is wrapped in ``PyFileSystem(FSSpecHandler)``.
    ``uri`` is then the root's path inside that filesystem (a ``scheme://`` prefix is dropped). The
    filesystem travels to every writer actor, so it must pickle (pyarrow's and fsspec's do)."""
    fs = options["filesystem"]
    others = sorted(k for k in options if k != "filesystem")
    if others:
        raise InvalidArgumentError(f"storage options {others} cannot be combined with 'filesystem' (configure the "
                                   f"filesystem object itself)")
    if not isinstance(fs, pafs.FileSystem):
        try:
            import fsspec
        except ImportError:  # pragma: no cover - fsspec comes with torch
            fsspec = None
        if fsspec is None or not isinstance(fs, fsspec.AbstractFileSystem):
            raise InvalidArgumentError(f"options['filesystem'] must be a pyarrow.fs.FileSystem or an fsspec "
                                       f"filesystem, got {type(fs).__module__}.{type(fs).__qualname__}")
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    path = uri.split("://", 1)[1] if "://" in uri else uri
    if isinstance(fs, pafs.LocalFileSystem) or (isinstance(fs, pafs.PyFileSystem) and path.startswith("/")):
        path = path.rstrip("/") or "/"
    else:
        path = path.strip("/")
    if not path:
        raise InvalidArgumentError(f"storage URI {uri!r} names no path inside the given filesystem")
    return fs, path


def s3_hint(exc: BaseException) -> str:
    """A hint for the usual causes of an S3 failure, from the SDK's error text ('' if none)."""
    text = str(exc)
    if any(k in text for k in ("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH")):
        return (" (access denied: check access_key / secret_key in remote_options or the AWS_* "
                "environment, and that they may write to this bucket)")
    if any(k in text for k in ("NETWORK_CONNECTION", "Could not connect", "Couldn't connect", "curlCode: 7",
                               "curlCode: 28", "Timeout", "timed out")):
        return " (the S3 endpoint cannot be reached: check endpoint_override / scheme and that the server is up)"
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text or "Bucket" in text and "not found" in text:
        return " (the bucket does not exist: create it first)"
    return ""
