"""Purging a persistent tier's storage of a tenant or a namespace: the fs and obj tiers'
:meth:`~kvoffload.tiers.base.SecondaryTierManager.purge_storage`, which ``kvoffload purge``
(:mod:`kvoffload.tools.purge`) calls for every tier of a config.

::

    --salt S   ──tenant id (kvoffload.tenants)──▶ every namespace's t-<tenant id>/ in each root/bucket
    --namespace N ─────────────────────────────▶ <root>/<N>/ (tenants included), <prefix><N>/
        fs : root_dir resolved as the engine resolves it (a link to it is followed), then walked
             by descriptor (nothing below followed; at most _MAX_DEPTH directories deep: chunks
             are 3 levels below a namespace), each file unlinked, then its directories
        obj: ListObjectsV2 under the prefix, DeleteObjects 1000 at a time; a bucket with
             versioning (enabled or suspended): every version and delete marker under the
             prefix too (ListObjectVersions), or an error saying they remain

Why it is safe while engines run: :mod:`kvoffload.tools.purge`. Nothing is held per chunk but the
running totals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgspec

from kvoffload.workers import chunkfile as cf
from kvoffload.workers.fs_io import DIR_FLAGS

_NS_HEX = 32
_DELETE_BATCH = 1000
_MAX_DEPTH = 6
"""Directories below a removed directory that :func:`_empty` descends into (a namespace's chunks
are 3 below it: ``t-<tenant>/<aa>/<bb>/``); anything deeper is no chunk's and is left, reported."""


class PurgeError(ValueError):
    """Bad input (the file, the options) or a tier that cannot be reached; says which and why."""


class TierPurge(msgspec.Struct, kw_only=True):
    """What was removed from one tier.

    Attributes:
        tier: the tier's name in the config.
        type: its type (``fs``, ``obj``, an out-of-tree tier's class name).
        target: the root directory, or ``s3://bucket/prefix``.
        namespaces: namespaces that held something removed.
        chunks: chunk files or objects removed.
        bytes: their bytes.
        other_files: other files removed (temporary files of writers, ``config.json``).
        old_versions: object versions and delete markers removed from a versioned bucket.
        errors: what could not be removed or reached, each with its cause (at most 20 kept).
    """

    tier: str
    type: str
    target: str
    namespaces: int = 0
    chunks: int = 0
    bytes: int = 0
    other_files: int = 0
    old_versions: int = 0
    errors: list[str] = []


def _is_hex(value: str, digits: int) -> bool:
    return len(value) == digits and not value.strip("0123456789abcdef")


# -- fs -------------------------------------------------------------------------------------------


def purge_fs(
    tier: str, root: str, *, tenant: str | None = None, namespace: str | None = None
) -> TierPurge:
    """Remove ``tenant``'s directories (``<ns>/t-<tenant>/`` of every namespace) or namespace
    directory ``namespace`` from fs root ``root`` (resolved as the engine resolves it: a link to
    the root is followed, nothing below it); a missing root removes nothing, one that cannot be
    opened is an error in the report."""
    out = TierPurge(tier=tier, type="fs", target=root)
    try:
        root_fd = os.open(os.path.realpath(root), DIR_FLAGS)
    except FileNotFoundError:
        return out
    except OSError as e:
        _error(out, f"root_dir {root}: {e.strerror}: nothing removed from this tier")
        return out
    try:
        if namespace is not None:
            names = [namespace]
        else:
            with os.scandir(root_fd) as entries:
                names = [
                    e.name
                    for e in entries
                    if _is_hex(e.name, _NS_HEX) and e.is_dir(follow_symlinks=False)
                ]
        for ns in names:
            sub = cf.tenant_dir(tenant) if tenant is not None else None
            if _remove_tree(root_fd, ns, sub, f"{root}/{ns}", out):
                out.namespaces += 1
    finally:
        os.close(root_fd)
    return out


def _remove_tree(parent_fd: int, name: str, sub: str | None, path: str, out: TierPurge) -> bool:
    """Remove directory ``name`` of ``parent_fd`` (with ``sub``: only its subdirectory ``sub``)
    and everything below it, counting into ``out``; True when something was removed."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        _error(out, f"{path}: {e.strerror} (a link or not a directory: left alone)")
        return False
    try:
        if sub is not None:
            return _remove_tree(fd, sub, None, f"{path}/{sub}", out)
        before = out.chunks + out.other_files
        _empty(fd, path, out)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as e:  # a writer added a file meanwhile: what it wrote after stays
        _error(out, f"{path}: not removed: {e.strerror}")
    return out.chunks + out.other_files > before


def _empty(dir_fd: int, path: str, out: TierPurge, depth: int = 0) -> None:
    """Unlink every file below ``dir_fd`` and remove its subdirectories (depth-first, at most
    :data:`_MAX_DEPTH` deep: the recursion and the descriptors held are bounded whatever a
    directory holds; what is deeper is left and reported)."""
    with os.scandir(dir_fd) as entries:
        items = list(entries)
    for e in items:
        if e.is_dir(follow_symlinks=False):
            if depth >= _MAX_DEPTH:
                _error(out, f"{path}/{e.name}: nested deeper than any chunk: left alone")
                continue
            try:
                sub = os.open(e.name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # removed meanwhile, or replaced by a link (unlinked below next time)
            try:
                _empty(sub, f"{path}/{e.name}", out, depth + 1)
            finally:
                os.close(sub)
            try:
                os.rmdir(e.name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as err:
                _error(out, f"{path}/{e.name}: not removed: {err.strerror}")
            continue
        try:
            size = e.stat(follow_symlinks=False).st_size
            os.unlink(e.name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError as err:
            _error(out, f"{path}/{e.name}: {err.strerror}")
            continue
        if cf.key_from_name(e.name) is not None:
            out.chunks += 1
            out.bytes += size
        else:
            out.other_files += 1


def _error(out: TierPurge, what: str) -> None:
    if len(out.errors) < 20:
        out.errors.append(what)


# -- obj ------------------------------------------------------------------------------------------


def purge_obj(
    tier: str, c: Any, client: Any, *, tenant: str | None = None, namespace: str | None = None
) -> TierPurge:
    """Remove ``tenant``'s objects (``<prefix><ns>/t-<tenant>/`` of every namespace) or those of
    namespace ``namespace`` (``<prefix><ns>/``) from obj tier config ``c``'s bucket, through
    ``client`` (a boto3 S3 client for it: :meth:`kvoffload.tiers.obj.ObjTier.purge_storage`).

    Raises:
        PurgeError: the bucket cannot be listed (its cause: endpoint, credentials...).
    """
    from kvoffload.workers.obj_io import object_prefix

    out = TierPurge(
        tier=tier, type="obj", target=f"s3://{c.bucket}/{c.prefix.strip('/')}".rstrip("/")
    )
    try:
        if namespace is not None:
            prefixes = [object_prefix(c.prefix, namespace)]
        else:
            assert tenant is not None
            sub = cf.tenant_dir(tenant) + "/"
            prefixes = [p + sub for p in _obj_namespaces(client, c.bucket, c.prefix)]
        versioned = _versioning(client, c.bucket, out)
        for prefix in prefixes:
            before = out.chunks + out.other_files + out.old_versions
            _delete_under(client, c.bucket, prefix, out)
            if versioned:
                _delete_versions_under(client, c.bucket, prefix, out)
            if out.chunks + out.other_files + out.old_versions > before:
                out.namespaces += 1
    except Exception as e:  # botocore's errors: endpoint, credentials, permissions
        if type(e).__module__.startswith(("botocore", "boto3")):
            raise PurgeError(f"{tier}: s3://{c.bucket}: {type(e).__name__}: {e}") from None
        raise
    return out


def _obj_namespaces(client: Any, bucket: str, prefix: str) -> Iterator[str]:
    """``<prefix><namespace id>/`` of every namespace with objects in ``bucket``."""
    base = prefix.strip("/")
    base = f"{base}/" if base else ""
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=base, Delimiter="/"
    )
    for page in pages:
        for p in page.get("CommonPrefixes", []):
            if _is_hex(p["Prefix"][len(base) :].rstrip("/"), _NS_HEX):
                yield p["Prefix"]


def _delete_under(client: Any, bucket: str, prefix: str, out: TierPurge) -> None:
    """Delete every object whose name starts with ``prefix``, counting into ``out``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    batch: list[tuple[str, int]] = []
    for page in pages:
        for obj in page.get("Contents", []):
            batch.append((obj["Key"], int(obj["Size"])))
            if len(batch) == _DELETE_BATCH:
                _delete_batch(client, bucket, batch, out)
                batch = []
    if batch:
        _delete_batch(client, bucket, batch, out)


def _versioning(client: Any, bucket: str, out: TierPurge) -> bool:
    """Whether ``bucket`` keeps versions (versioning enabled or suspended: a delete without a
    version id only adds a delete marker, the data stays); one that cannot be asked is reported
    (its old versions, if any, may remain) and taken as unversioned."""
    try:
        status = client.get_bucket_versioning(Bucket=bucket).get("Status")
    except Exception as e:
        if not type(e).__module__.startswith(("botocore", "boto3")):
            raise
        _error(
            out,
            f"s3://{bucket}: versioning could not be checked ({type(e).__name__}): "
            "older versions of the removed objects may remain",
        )
        return False
    return status in ("Enabled", "Suspended")


def _delete_versions_under(client: Any, bucket: str, prefix: str, out: TierPurge) -> None:
    """Delete every version and delete marker of the objects under ``prefix`` (a versioned
    bucket), counting them into ``out.old_versions``."""
    pages = client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
    batch: list[dict[str, str]] = []
    for page in pages:
        for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
            batch.append({"Key": v["Key"], "VersionId": v["VersionId"]})
            if len(batch) == _DELETE_BATCH:
                _delete_version_batch(client, bucket, batch, out)
                batch = []
    if batch:
        _delete_version_batch(client, bucket, batch, out)


def _delete_version_batch(
    client: Any, bucket: str, batch: list[dict[str, str]], out: TierPurge
) -> None:
    resp = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
    errors = resp.get("Errors", [])
    for err in errors:
        _error(
            out,
            f"s3://{bucket}/{err.get('Key')} version {err.get('VersionId')}: "
            f"{err.get('Code')}: {err.get('Message', '')}",
        )
    out.old_versions += len(batch) - len(errors)


def _delete_batch(client: Any, bucket: str, batch: list[tuple[str, int]], out: TierPurge) -> None:
    resp = client.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": k} for k, _ in batch], "Quiet": True}
    )
    failed = {e.get("Key"): e for e in resp.get("Errors", [])}
    for name, size in batch:
        err = failed.get(name)
        if err is not None and err.get("Code") != "NoSuchKey":
            _error(out, f"s3://{bucket}/{name}: {err.get('Code')}: {err.get('Message', '')}")
            continue
        if cf.key_from_name(name.rsplit("/", 1)[-1]) is not None:
            out.chunks += 1
            out.bytes += size
        else:
            out.other_files += 1


# -- output ---------------------------------------------------------------------------------------
