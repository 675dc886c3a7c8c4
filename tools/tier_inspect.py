"""``kvoffload inspect``: what a persistent tier root holds, per namespace, without reading chunks.

::

    fs root  ──os.scandir──▶ <namespace id>/config.json      identity fields (a few hundred bytes)
                             <namespace id>/<hh>/<hh>/*.kv   stat only: count, bytes, mtime range
                             .../*.tmp                       temporary files: count, bytes, oldest
    s3://bucket/prefix ──ListObjectsV2──▶ <prefix>/<namespace id>/config.json   one small GET
                                          <prefix>/<namespace id>/**.kv        listing only

Layouts are the tiers' own (:mod:`kvoffload.workers.fs_io`, :mod:`kvoffload.workers.obj_io`). No
chunk payload is read and nothing is held per chunk: a scan keeps running totals, so a root of 10^8 chunks
costs one directory walk (or one listing) and constant memory.

"Use" times are the ones the tiers go by: a chunk file's mtime (fs; the time it was written: chunks
are written once and never rewritten, reads do not change it, and the fs tier orders the chunks it
adopts at start by it) and an object's LastModified (obj). Times are seconds since the epoch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from typing import Any, Literal

import msgspec

from kvoffload.workers import chunkfile as cf
from kvoffload.workers import fs_io

_NS_RE = re.compile(r"^[0-9a-f]{32}$")
_CONFIG = "config.json"
_CONFIG_MAX_BYTES = 1 << 20


class InspectError(ValueError):
    """The target is missing, unreachable or not a tier root; the message says which and why."""


class TempFiles(msgspec.Struct, kw_only=True):
    """Temporary files of one fs namespace (chunks being written, or orphans of dead writers).

    Attributes:
        count: temporary files found.
        bytes: their total size (bytes).
        oldest: mtime of the oldest (seconds since the epoch); None when there are none.
        stale: how many are older than the orphan age (``kvoffload sweep --fs-root`` removes them).
    """

    count: int = 0
    bytes: int = 0
    oldest: float | None = None
    stale: int = 0


class NamespaceReport(msgspec.Struct, kw_only=True):
    """One namespace of a tier root.

    Attributes:
        id: the namespace id (32 hex digits; its directory or key prefix name).
        location: its directory (fs) or ``s3://bucket/prefix`` URL (obj).
        identity: the fields of its ``config.json`` (model, revision, kv_dtype, layout,
            tokens_per_chunk, row_bytes, groups, geometry, format_version, cache_salt, ...); None
            when it cannot be read.
        problem: what is wrong with ``config.json`` (missing, not JSON, fields that do not hash to
            the namespace id); None when it is sound.
        chunks: chunk files (objects) found.
        bytes: their total size (bytes, headers included).
        oldest_use, newest_use: oldest and newest chunk mtime (obj: LastModified), seconds since
            the epoch; None without chunks.
        temp: temporary files (fs only; None for obj, whose PUTs are atomic).
        other_files: files that are neither chunks, temporary files nor ``config.json``.
    """

    id: str
    location: str
    identity: dict[str, Any] | None = None
    problem: str | None = None
    chunks: int = 0
    bytes: int = 0
    oldest_use: float | None = None
    newest_use: float | None = None
    temp: TempFiles | None = None
    other_files: int = 0


class TierReport(msgspec.Struct, kw_only=True):
    """Everything ``kvoffload inspect`` found (``--json`` prints this).

    Attributes:
        root: the directory or ``s3://bucket/prefix`` inspected.
        kind: ``fs`` or ``obj``.
        scanned_at: when the scan started (seconds since the epoch).
        stale_temp_age_s: temporary files older than this count as stale (fs only).
        namespaces: one report per namespace, by id.
    """

    root: str
    kind: Literal["fs", "obj"]
    scanned_at: float
    stale_temp_age_s: float | None
    namespaces: list[NamespaceReport]


def _check_identity(ns_id: str, raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """Decode a namespace's ``config.json``; a problem when it is not the namespace's own. A
    keyed namespace's (``integrity_key_id``: its tier has an integrity key) is decoded as such."""
    from kvoffload.namespace import EncryptedNamespace, KeyedNamespace, Namespace

    try:
        fields = json.loads(raw)
    except ValueError as e:
        return None, f"config.json is not JSON: {e}"
    if not isinstance(fields, dict):
        return None, "config.json is not a JSON object"
    kind = (
        EncryptedNamespace
        if "encryption_key_id" in fields
        else KeyedNamespace
        if "integrity_key_id" in fields
        else Namespace
    )
    try:
        ns = msgspec.convert(fields, kind)
    except msgspec.ValidationError as e:
        return fields, f"config.json does not describe a namespace of this version: {e}"
    if ns.id() != ns_id:
        return fields, f"config.json hashes to {ns.id()}, not to its directory name"
    return fields, None


# -- fs ------------------------------------------------------------------------------------------


def _fs_root_problem(root: str) -> str:
    """Why ``root`` holds no namespace directory (a message for the user)."""
    names = set(os.listdir(root))
    if _CONFIG in names and any(re.fullmatch(r"[0-9a-f]{2}", n) for n in names):
        return (
            f"{root} is a namespace directory, not a tier root; inspect its parent "
            f"{os.path.dirname(os.path.abspath(root))}"
        )
    return (
        f"{root} is not an fs tier root: it holds no namespace directory "
        f"(<32 hex digits>/config.json, written by an engine at start)"
    )


def _scan_fs_namespace(entry: os.DirEntry, stale_age_s: float, now: float) -> NamespaceReport:
    rep = NamespaceReport(id=entry.name, location=entry.path, temp=TempFiles())
    temp = rep.temp
    oldest = newest = None

    def add_file(f: fs_io.NsFile) -> None:
        nonlocal oldest, newest
        try:
            st = f.stat(follow_symlinks=False)
        except OSError:
            return  # removed while we looked (evicted, renamed, swept)
        name = f.name
        if fs_io.is_temp_name(name):
            temp.count += 1
            temp.bytes += st.st_size
            if temp.oldest is None or st.st_mtime < temp.oldest:
                temp.oldest = st.st_mtime
            if now - st.st_mtime > stale_age_s:
                temp.stale += 1
        elif cf.key_from_name(name) is not None:
            rep.chunks += 1
            rep.bytes += st.st_size
            t = st.st_mtime
            if oldest is None or t < oldest:
                oldest = t
            if newest is None or t > newest:
                newest = t
        else:
            rep.other_files += 1

    has_config = False
    for f in fs_io.namespace_files(entry.path, tenants=True):
        if f.name == _CONFIG:
            has_config = True
        else:
            add_file(f)
    rep.oldest_use, rep.newest_use = oldest, newest
    if not has_config:
        rep.problem = "no config.json (not written by an engine, or removed)"
        return rep
    _read_fs_identity(rep, entry)
    return rep


def _read_fs_identity(rep: NamespaceReport, entry: os.DirEntry) -> None:
    """Fill ``rep.identity`` (or ``rep.problem``) from the namespace's ``config.json``, read
    without following a symbolic link (a co-tenant's link could point at any file: CASES C43)."""
    try:
        raw = _read_config_json(entry.path)
    except FileNotFoundError:
        rep.problem = "no config.json (not written by an engine, or removed)"
        return
    except OSError as e:
        rep.problem = f"config.json cannot be read: {e}"
        return
    rep.identity, rep.problem = _check_identity(entry.name, raw)


def _read_config_json(ns_dir: str) -> bytes:
    """At most :data:`_CONFIG_MAX_BYTES` of ``<ns_dir>/config.json``, the directory and the file
    opened with ``O_NOFOLLOW``.

    Raises:
        FileNotFoundError: no such file.
        OSError: a symbolic link or not a regular file (naming it), or unreadable.
    """
    d = os.open(ns_dir, fs_io.DIR_FLAGS)
    try:
        fd = os.open(_CONFIG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, "a symbolic link (not followed)") from None
        raise
    finally:
        os.close(d)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (not read)")
        return f.read(_CONFIG_MAX_BYTES)


def namespace_identities(root: str) -> list[NamespaceReport]:
    """The namespaces of an fs tier root with their identity only (``config.json``: model,
    tokens per chunk, row bytes...); no chunk is listed, so this is cheap however large the root
    (``kvoffload check`` reads the chunk size from it). Counts and times stay empty.

    Raises:
        InspectError: ``root`` is missing, not a directory, unreadable, or holds no namespace.
    """
    out = []
    for entry in namespace_dirs(root):
        rep = NamespaceReport(id=entry.name, location=entry.path)
        _read_fs_identity(rep, entry)
        out.append(rep)
    return out


def namespace_dirs(root: str) -> list[os.DirEntry]:
    """The namespace directories (``<32 hex digits>/``) of an fs tier root, by name.

    Raises:
        InspectError: ``root`` is missing, not a directory, unreadable, or holds no namespace.
    """
    if not os.path.exists(root):
        raise InspectError(f"{root}: no such directory")
    if not os.path.isdir(root):
        raise InspectError(f"{root}: not a directory")
    try:
        with os.scandir(root) as it:
            entries = sorted(
                (e for e in it if _NS_RE.match(e.name) and e.is_dir(follow_symlinks=False)),
                key=lambda e: e.name,
            )
        if not entries:
            raise InspectError(_fs_root_problem(root))
    except PermissionError:
        raise InspectError(f"{root}: cannot read it: permission denied") from None
    return entries


def inspect_fs(root: str, stale_temp_age_s: float = fs_io.STALE_TEMP_AGE_S) -> TierReport:
    """Scan an fs tier root.

    Args:
        root: the tier's ``root_dir``.
        stale_temp_age_s: temporary files last written longer ago than this (seconds) are counted
            as stale.

    Raises:
        InspectError: ``root`` is missing, not a directory, unreadable, or holds no namespace.
    """
    now = time.time()
    namespaces = []
    for entry in namespace_dirs(root):
        try:
            namespaces.append(_scan_fs_namespace(entry, stale_temp_age_s, now))
        except (FileNotFoundError, NotADirectoryError):
            continue  # the namespace directory was removed (or replaced) while we looked
        except PermissionError as e:
            raise InspectError(
                f"{root}: cannot read {e.filename or entry.path}: permission denied"
            ) from None
    return TierReport(
        root=root,
        kind="fs",
        scanned_at=now,
        stale_temp_age_s=stale_temp_age_s,
        namespaces=namespaces,
    )


# -- obj -----------------------------------------------------------------------------------------


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``(bucket, prefix)`` (prefix without slashes at either end).

    Raises:
        InspectError: no bucket name.
    """
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InspectError(f"{url}: no bucket name (expected s3://BUCKET[/PREFIX])")
    return bucket, prefix.strip("/")


def _s3_client(endpoint_url: str | None, region: str | None):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": 2, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
        signature_version="s3v4",
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        return boto3.session.Session(region_name=region).client(
            "s3", endpoint_url=endpoint_url, config=config
        )
    except ValueError as e:  # botocore: "Invalid endpoint: ..."
        raise InspectError(
            f"--endpoint-url {endpoint_url}: {e} (expected http(s)://host[:port])"
        ) from e


def _s3_problem(exc: BaseException, bucket: str, where: str) -> str:
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return (
            f"no credentials for {where}: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an "
            f"AWS profile"
        )
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code", "")
        if status == 404 or code in ("NoSuchBucket", "404", "NotFound"):
            return f"bucket {bucket!r} does not exist at {where}"
        if status in (401, 403):
            return f"access to bucket {bucket!r} at {where} was refused (HTTP {status} {code})"
        return f"bucket {bucket!r} at {where}: HTTP {status} {code}"
    return f"cannot reach {where}: {type(exc).__name__}: {exc}"


def inspect_obj(url: str, endpoint_url: str | None = None, region: str | None = None) -> TierReport:
    """Scan an obj tier: ``s3://bucket/prefix`` (the tier's ``bucket`` and ``prefix``).

    The endpoint is ``endpoint_url``, else the boto3 chain's (``AWS_ENDPOINT_URL``, the profile,
    AWS itself); credentials and region come from the boto3 chain (``region`` overrides it).

    Raises:
        InspectError: no bucket in ``url``, bucket missing, endpoint unreachable, credentials
            refused, or no namespace under the prefix.
    """
    bucket, prefix = parse_s3_url(url)
    client = _s3_client(endpoint_url, region)
    where = client.meta.endpoint_url
    base = f"{prefix}/" if prefix else ""
    now = time.time()
    try:
        ns_ids = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=base, Delimiter="/"
        ):
            for p in page.get("CommonPrefixes", []):
                name = p["Prefix"][len(base) :].rstrip("/")
                if _NS_RE.match(name):
                    ns_ids.append(name)
        if not ns_ids:
            raise InspectError(
                f"{url} is not an obj tier root: no namespace prefix "
                f"(<32 hex digits>/config.json) under it at {where}"
            )
        namespaces = [_scan_obj_namespace(client, bucket, base, ns_id) for ns_id in sorted(ns_ids)]
    except InspectError:
        raise
    except Exception as e:
        raise InspectError(_s3_problem(e, bucket, where)) from None
    return TierReport(
        root=url, kind="obj", scanned_at=now, stale_temp_age_s=None, namespaces=namespaces
    )


def _scan_obj_namespace(client, bucket: str, base: str, ns_id: str) -> NamespaceReport:
    from botocore.exceptions import ClientError

    ns_prefix = f"{base}{ns_id}/"
    rep = NamespaceReport(id=ns_id, location=f"s3://{bucket}/{ns_prefix}")
    oldest = newest = None
    has_config = False
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=ns_prefix):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(ns_prefix) :]
            if name == _CONFIG:
                has_config = True
                continue
            if cf.key_from_name(name.rsplit("/", 1)[-1]) is None:
                rep.other_files += 1
                continue
            rep.chunks += 1
            rep.bytes += int(obj["Size"])
            t = obj["LastModified"].timestamp()
            if oldest is None or t < oldest:
                oldest = t
            if newest is None or t > newest:
                newest = t
    rep.oldest_use, rep.newest_use = oldest, newest
    if not has_config:
        rep.problem = "no config.json (not written by an engine, or removed)"
        return rep
    try:
        body = client.get_object(
            Bucket=bucket, Key=ns_prefix + _CONFIG, Range=f"bytes=0-{_CONFIG_MAX_BYTES - 1}"
        )["Body"].read()
    except ClientError as e:
        rep.problem = f"config.json cannot be read: {e}"
        return rep
    rep.identity, rep.problem = _check_identity(ns_id, body)
    return rep


def inspect_target(
    target: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    stale_temp_age_s: float = fs_io.STALE_TEMP_AGE_S,
) -> TierReport:
    """:func:`inspect_obj` for ``s3://...`` targets, :func:`inspect_fs` for anything else."""
    if target.startswith("s3://"):
        return inspect_obj(target, endpoint_url=endpoint_url, region=region)
    return inspect_fs(target, stale_temp_age_s)


# -- output --------------------------------------------------------------------------------------

_IDENTITY_ORDER = (
    "model",
    "revision",
    "model_path",
    "model_fingerprint",
    "kv_dtype",
    "layout",
    "tokens_per_chunk",
    "row_bytes",
    "groups",
    "tp_size",
    "pp_size",
    "pcp_size",
    "dcp_size",
    "tp_rank",
    "format_version",
    "cache_salt",
)


def to_json(report: TierReport) -> str:
    """The report as one JSON document (``kvoffload inspect --json``)."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2).decode()


def _when(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{stamp} ({format_age(now - t)} ago)"


def format_age(s: float) -> str:
    """``s`` seconds as ``12 s``, ``3.5 min``, ``1.0 h`` or ``2.3 d``."""
    s = max(0.0, s)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.0f} s"


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with the exact count (``1.5 MiB (1,572,864 B)``)."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit} ({n:,} B)"
    return f"{n} B"


def _identity_value(key: str, value: Any) -> str:
    if key == "groups" and isinstance(value, list):
        parts = [
            f"{g.get('kind', '?')}: {g.get('num_layers', '?')} layers x "
            f"{g.get('tokens_per_block', '?')} tok x {g.get('page_bytes', '?')} B"
            if isinstance(g, dict)
            else str(g)
            for g in value
        ]
        return "; ".join(parts) or "-"
    if value is None or value == "":
        return "-"
    return str(value)


def render(report: TierReport, console) -> None:
    """Print the report as rich tables: one per namespace, then a summary line."""
    from rich.table import Table

    now = report.scanned_at
    console.print(
        f"[bold]{report.kind} tier[/bold] {report.root}: {len(report.namespaces)} namespace(s)",
        highlight=False,
    )
    for ns in report.namespaces:
        t = Table(
            title=f"namespace {ns.id}",
            title_justify="left",
            show_header=False,
            box=None,
            padding=(0, 2),
        )
        t.add_column("field", style="cyan", no_wrap=True)
        t.add_column("value", overflow="fold")
        t.add_row("location", ns.location)
        if ns.problem:
            t.add_row("problem", f"[red]{ns.problem}[/red]")
        identity = ns.identity or {}
        for key in _IDENTITY_ORDER:
            if key in identity:
                t.add_row(key, _identity_value(key, identity[key]))
        for key in sorted(set(identity) - set(_IDENTITY_ORDER)):
            t.add_row(key, _identity_value(key, identity[key]))
        t.add_row("chunks", f"{ns.chunks:,}")
        t.add_row("bytes", format_bytes(ns.bytes))
        t.add_row("oldest use", _when(ns.oldest_use, now))
        t.add_row("newest use", _when(ns.newest_use, now))
        if ns.temp is not None:
            tmp = ns.temp
            text = f"{tmp.count:,} ({format_bytes(tmp.bytes)})"
            if tmp.count:
                text += f", oldest {_when(tmp.oldest, now)}"
            if tmp.stale:
                text += (
                    f", [yellow]{tmp.stale:,} stale[/yellow] (older than "
                    f"{format_age(report.stale_temp_age_s)}: "
                    f"kvoffload sweep --fs-root removes them)"
                )
            t.add_row("temp files", text)
        if ns.other_files:
            t.add_row("other files", f"{ns.other_files:,}")
        console.print()
        console.print(t)
    total = sum(ns.chunks for ns in report.namespaces)
    nbytes = sum(ns.bytes for ns in report.namespaces)
    console.print()
    console.print(f"total: {total:,} chunks, {format_bytes(nbytes)}", highlight=False)
