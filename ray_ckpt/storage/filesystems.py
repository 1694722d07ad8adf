"""``pyarrow.fs`` filesystems from URIs: S3 with short timeouts and bounded retries, settings from
the URI, the options or the usual AWS_* environment, and one-line hints for S3's usual failures."""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote, unquote, urlparse

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


# ------------------------------------------------------------------------- URIs in messages
REDACTED = "***"
# query parameters whose values are secrets (pyarrow's S3 URIs take access_key, secret_key,
# session_token; presigned URLs carry X-Amz-Signature / X-Amz-Credential / X-Amz-Security-Token)
_SECRET_PARAM = re.compile(r"secret|key|token|passw|session|credential|signature|auth", re.IGNORECASE)


def _split_uri(uri: str) -> Tuple[str, str, str, str]:
    """(scheme://, userinfo, rest of the location and path, ?query#fragment) of ``scheme://...``."""
    scheme, _, after = uri.partition("://")
    cut = min((i for i in (after.find("?"), after.find("#")) if i >= 0), default=len(after))
    head, tail = after[:cut], after[cut:]
    userinfo = ""
    at = head.rfind("@")
    if at >= 0 and ":" in head[:at]:  # key:secret@ (a raw secret may hold '/', '+', even '@')
        userinfo, head = head[:at], head[at + 1:]
    elif "@" in head and "/" not in head[:head.find("@")]:  # user@host (an '@' in a path is a path)
        at = head.find("@")
        userinfo, head = head[:at], head[at + 1:]
    return scheme + "://", userinfo, head, tail


def _redact_query(tail: str) -> str:
    query, hash_, fragment = tail.lstrip("?").partition("#")
    parts = []
    for item in query.split("&") if query else []:
        k, eq, v = item.partition("=")
        parts.append(f"{k}={REDACTED}" if eq and v and _SECRET_PARAM.search(unquote(k)) else item)
    out = ("?" + "&".join(parts)) if tail.startswith("?") else ""
    return out + (hash_ + fragment if hash_ else "")


def redact_uri(uri: str) -> str:
    """``uri`` fit for a message, a log line or a repr: ``user:password@`` becomes ``***@`` and
    the values of query parameters named like a secret (secret, key, token, password, session,
    credential, signature, auth) become ``***``; anything else (local paths, endpoint settings)
    is kept. Not for opening: use the URI itself for that."""
    if not isinstance(uri, str) or "://" not in uri:
        return uri
    scheme, userinfo, head, tail = _split_uri(uri)
    return scheme + (f"{REDACTED}@" if userinfo else "") + head + _redact_query(tail)


def _secrets(uri: str) -> List[str]:
    """The secret substrings of ``uri`` (raw and percent-decoded), longest first."""
    if not isinstance(uri, str) or "://" not in uri:
        return []
    _, userinfo, _, tail = _split_uri(uri)
    found = []
    if userinfo:
        user, _, password = userinfo.partition(":")
        found += [userinfo, password, user] if password else [userinfo]
    for item in tail.lstrip("?").partition("#")[0].split("&"):
        k, eq, v = item.partition("=")
        if eq and v and _SECRET_PARAM.search(unquote(k)):
            found.append(v)
    out = set()
    for f in found:
        if len(f) >= 3:  # a one- or two-letter "secret" would blank out ordinary words
            out.update({f, unquote(f), quote(unquote(f), safe="")})
    return sorted(out, key=len, reverse=True)


def scrub(text: str, uri: str) -> str:
    """``text`` (an error message that may quote ``uri``) with ``uri``'s secrets replaced by ***."""
    for secret in _secrets(uri):
        text = text.replace(secret, REDACTED)
    return text


def join_uri(base: str, name: str) -> str:
    """``base`` with the path component ``name`` appended: before any ``?query`` or ``#fragment``
    (``s3://bucket/prefix?endpoint_override=host:9000&scheme=http`` + ``run`` ->
    ``s3://bucket/prefix/run?endpoint_override=host:9000&scheme=http``); a plain path is joined
    as a path (``os.path.join``)."""
    if "://" not in base:
        return os.path.join(base, name)
    cut = min((i for i in (base.find("?"), base.find("#")) if i >= 0), default=len(base))
    head, tail = base[:cut], base[cut:]
    if head.endswith("://"):  # "file://" alone: the name is a relative path? keep it literal
        return head + name + tail
    return head.rstrip("/") + "/" + name + tail


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
    # key:secret@ (a raw '/' in the secret ends urlparse's netloc early: found by _split_uri)
    if not options and (parsed.query or "@" in parsed.netloc or _split_uri(uri)[1]):
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
        raise InvalidArgumentError(f"storage URI must be a non-empty string, got {redact_uri(uri)!r}")
    scheme = urlparse(uri).scheme if "://" in uri else ""
    if options and "filesystem" in options:
        return _given_filesystem(uri, options)
    try:
        if scheme == "s3":
            return _s3_filesystem(uri, dict(options or {}))
        if options:
            if scheme in ("gs", "gcs"):
                return pafs.GcsFileSystem(**options), uri.split("://", 1)[1].rstrip("/")
            raise ValueError(f"storage options are only understood for s3:// and gs:// URIs, not {redact_uri(uri)!r}")
        if scheme == "":
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path.rstrip("/") or "/"
    except (ValueError, OSError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InvalidArgumentError(f"cannot open storage URI {redact_uri(uri)!r}: {scrub(one_line(exc), uri)}") from None


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
        raise InvalidArgumentError(f"storage URI {redact_uri(uri)!r} names no path inside the given filesystem")
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
