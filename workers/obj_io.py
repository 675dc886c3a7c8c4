"""Object-store tier I/O, run inside tier worker processes: arena slot ↔ one object per chunk (boto3).

::

    s3://<bucket>/<prefix><namespace id>/config.json               namespace fields (engine, at start)
    s3://<bucket>/<prefix><namespace id>/<hh>/<hh>/<key hex>.kv    header page + payload (chunkfile.py)

- Stores PUT header + payload straight from the arena slot (a file-like view over both, read by the
  SDK for signing and sending; no copy of the payload is made first).
- Loads GET the object, check the header (namespace, key, length) and the payload checksum, and copy
  the payload into the arena slot. A bad object is verified corruption: it is deleted and the load is
  a miss. A missing object is a miss; anything else (throttling, 5xx, timeouts, refused connections)
  is an I/O error that leaves the object alone. With an integrity key, an object whose MAC is
  missing or wrong is ``FORGED``, deleted, a miss; with an encryption key, so is one whose
  AES-GCM tag fails under a good checksum (which covers the seal record: damage there is corrupt).
- Sizes from the endpoint are untrusted (CASES C45): a response whose Content-Length is not exactly
  header plus row is corrupt and its body is never read (the connection is closed, not drained); a
  body without a Content-Length (chunked, or ended by closing) is read at most one byte past that
  size. So a worker never reads or holds more than one object (plus one byte), whatever the
  endpoint sends.
- Retries: botocore's "standard" retry mode (bounded attempts, exponential backoff with jitter, for
  throttling, 5xx and connection errors); timeouts bound every attempt; the engine bounds the whole
  task with the tier's job timeout.
- Every outcome carries the HTTP status where there is one (0 for connection-level failures).

One boto3 client per worker process, shared by its I/O threads (clients are thread-safe).
Credentials come from explicit config fields or the standard boto3 chain; they are never logged.
"""

from __future__ import annotations

import copy
import io

from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import counters
from kvoffload.workers.chunkio import OK_EMPTY, IOOutcome
from kvoffload.workers.chunkseal import TAG_BYTES, Sealer, unseal
from kvoffload.workers.faults import Faults
from kvoffload.workers.ioconfig import ObjIOConfig

IO_CONFIG = ObjIOConfig
"""This module's I/O config (tag ``obj``): what :func:`make_io` takes."""


def make_client(cfg: ObjIOConfig):
    """A boto3 S3 client for ``cfg`` (also used by the engine to check the bucket at start)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=cfg.access_key_id,
        aws_secret_access_key=cfg.secret_access_key,
        aws_session_token=cfg.session_token,
        region_name=cfg.region,
    )
    config = Config(
        retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},
        connect_timeout=cfg.connect_timeout_s,
        read_timeout=cfg.read_timeout_s,
        max_pool_connections=cfg.max_connections,
        signature_version="s3v4",
        s3={"addressing_style": cfg.addressing_style},
        # Payload integrity is ours (xxh3 in the header); SDK-side checksums cost a pass and some
        # S3-compatible servers reject or mangle them.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        config=config,
        verify=(cfg.ca_bundle or True) if cfg.verify_tls else False,
    )


def object_prefix(prefix: str, namespace_id: str) -> str:
    """``<prefix>/<namespace id>/`` with exactly one slash between parts."""
    p = prefix.strip("/")
    return f"{p}/{namespace_id}/" if p else f"{namespace_id}/"


def classify(exc: BaseException) -> tuple[int, int, str]:
    """``(code, HTTP status, detail)`` for an exception raised by a boto3 call."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        meta = exc.response.get("ResponseMetadata", {})
        status = int(meta.get("HTTPStatusCode") or 0)
        err = exc.response.get("Error", {}).get("Code", "")
        if status == 404 or err in ("NoSuchKey", "404", "NotFound"):
            return m.MISSING, status, f"{err or status}"
        if status in (400, 401, 403) or err in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
        ):
            return m.REJECTED, status, f"HTTP {status} {err}"
        return m.IO_ERROR, status, f"HTTP {status} {err}"
    if isinstance(exc, BotoCoreError):
        return m.IO_ERROR, 0, f"{type(exc).__name__}: {exc}"
    return m.IO_ERROR, 0, f"{type(exc).__name__}: {exc}"


class _Body(io.RawIOBase):
    """Read-only, seekable file over ``header + payload`` without joining them."""

    def __init__(self, header: bytes, payload: memoryview):
        self._parts = (memoryview(header), memoryview(payload).cast("B"))
        self._len = len(header) + self._parts[1].nbytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        return self._pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = 0
        head = self._parts[0]
        while n < out.nbytes and self._pos < self._len:
            if self._pos < head.nbytes:
                src = head[self._pos :]
            else:
                src = self._parts[1][self._pos - head.nbytes :]
            k = min(out.nbytes - n, src.nbytes)
            out[n : n + k] = src[:k]
            n += k
            self._pos += k
        return n

    def __len__(self) -> int:
        return self._len


def read_at_most(body, limit: int) -> bytes:
    """Up to ``limit`` bytes of the response body ``body`` (a botocore ``StreamingBody``), fewer
    only at its end: never more, whatever the endpoint sends."""
    data = body.read(limit)
    while len(data) < limit:
        more = body.read(limit - len(data))
        if not more:
            break
        data += more
    return data


class ObjIO:
    """:class:`~kvoffload.workers.chunkio.ChunkIO` over one object per chunk (module docstring)."""

    def __init__(self, config: ObjIOConfig, faults: Faults):
        self.cfg = config
        self.faults = faults
        self.ns_bytes = bytes.fromhex(config.namespace_id)
        self.base = object_prefix(config.prefix, config.namespace_id)
        self.object_bytes = cf.HEADER_BYTES + config.row_bytes
        self._mac_key = (
            None
            if config.integrity_key_env is None
            else cf.mac_key(cf.secret_from_env(config.integrity_key_env))
        )
        self._sealer = (
            None
            if config.encryption_key_env is None
            else Sealer(
                cf.secret_from_env(config.encryption_key_env, "encryption_key_env"),
                config.namespace_id,
            )
        )
        self._client = make_client(config)
        from botocore.exceptions import BotoCoreError, ClientError

        # What the SDK raises for a failed request; anything else is a bug, which the worker loop
        # contains as ERROR with a traceback instead of passing it off as an I/O error.
        self._sdk_errors: tuple[type[Exception], ...] = (BotoCoreError, ClientError)
        self._io_errors: tuple[type[Exception], ...] = (OSError, BotoCoreError, ClientError)

    def name(self, key: bytes) -> str:
        """The object name of ``key`` (the tier prefix and namespace, then the chunk file name)."""
        return self.base + cf.relative_name(key)

    def store(self, key: bytes, src: memoryview) -> IOOutcome:
        """PUT one chunk; ``nbytes``: object bytes sent, ``status``: the HTTP status."""
        try:
            self.faults.hit("before_read_slot", key)
            payload: memoryview = src
            seal: bytes | None = None
            if self._sealer is not None:  # encrypted in the worker, off the engine's threads
                out = memoryview(bytearray(len(src) + TAG_BYTES))
                seal = self._sealer.seal(key, src, out)
                payload = out[: len(src)]
            header = cf.build_header(self.ns_bytes, key, payload, self._mac_key, seal)
            self.faults.hit("before_publish", key)
            body = _Body(header, payload)
            resp = self._client.put_object(
                Bucket=self.cfg.bucket, Key=self.name(key), Body=body, ContentLength=len(body)
            )
            meta = resp.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 200)
            if meta.get("RetryAttempts"):
                counters.count(names.RETRIES, meta["RetryAttempts"])
            return IOOutcome(m.OK, self.object_bytes, "", status)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"store {key.hex()[:16]}: {e}")
        except self._sdk_errors as e:
            code, status, detail = classify(e)
            return IOOutcome(code, 0, f"store {key.hex()[:16]}: {detail}", status)

    def load(self, key: bytes, dst: memoryview) -> IOOutcome:
        """GET one chunk into ``dst`` (an arena row), verified; ``nbytes``: object bytes read,
        ``status``: the HTTP status. At most one object plus one byte is read (module
        docstring)."""
        name = self.name(key)
        body = None
        status = 0
        data = None
        why: str | None = None
        try:
            resp = self._client.get_object(Bucket=self.cfg.bucket, Key=name)
            body = resp["Body"]
            meta = resp.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 200)
            if meta.get("RetryAttempts"):
                counters.count(names.RETRIES, meta["RetryAttempts"])
            self.faults.hit("after_metadata_before_read", key)
            self.faults.hit("read_payload", key)
            length = resp.get("ContentLength")
            if length is not None and length != self.object_bytes:
                why = f"Content-Length {length}, expected {self.object_bytes}; not read"
            else:
                data = read_at_most(body, self.object_bytes + 1)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"load {key.hex()[:16]}: {e}")
        except self._sdk_errors as e:
            code, status, detail = classify(e)
            return IOOutcome(code, 0, f"load {key.hex()[:16]}: {detail}", status)
        finally:
            if body is not None:
                # Closes the connection when the body was not read to its end: never drained.
                try:
                    body.close()
                except Exception:  # closing a broken connection: nothing left to release
                    pass
        code = m.CORRUPT
        if data is None:
            pass  # why: the Content-Length
        elif len(data) != self.object_bytes:
            got = f"more than {self.object_bytes}" if len(data) > self.object_bytes else len(data)
            why = f"body of {got} bytes, expected {self.object_bytes}"
        else:
            why, code = self._verify(data, key, dst)
        if why is not None:
            counters.count(names.FORGED_REMOVED if code == m.FORGED else names.CORRUPT_REMOVED)
            self._delete_quietly(name)
            return IOOutcome(code, 0, f"{key.hex()[:16]}: {why}", status)
        return IOOutcome(m.OK, self.object_bytes, "", status)

    def _verify(self, data: bytes, key: bytes, dst: memoryview) -> tuple[str | None, int]:
        """Check one object's bytes (``object_bytes`` long) and copy its payload into ``dst``:
        ``(None, OK)``, or why not and ``CORRUPT`` / ``FORGED``."""
        header = data[: cf.HEADER_BYTES]
        try:
            checksum = cf.parse_header(header, self.ns_bytes, key, self.cfg.row_bytes)
        except cf.ChunkFormatError as e:
            return str(e), m.CORRUPT
        payload = memoryview(data)[cf.HEADER_BYTES :]
        if cf.record_checksum(header, payload) != checksum:
            return "checksum mismatch", m.CORRUPT
        if self._mac_key is not None:
            why = cf.mac_problem(header, payload, self._mac_key)
            if why is not None:
                return why, m.FORGED
        if self._sealer is None and not cf.header_flags(header) & cf.FLAG_SEALED:
            memoryview(dst).cast("B")[:] = payload
            return None, m.OK
        row = len(payload)
        sealed = memoryview(bytearray(row + TAG_BYTES))
        sealed[:row] = payload
        failed = unseal(self._sealer, header, key, sealed, dst)
        if failed is None:
            return None, m.OK
        if not failed.forged:
            return failed.why, m.CORRUPT
        counters.count(names.DECRYPT_FAILURES)
        return failed.why, m.FORGED

    def _delete_quietly(self, name: str) -> None:
        try:
            self._client.delete_object(Bucket=self.cfg.bucket, Key=name)
        except Exception:
            pass

    def probe(self, key: bytes) -> IOOutcome:
        """HEAD ``key``'s object: ``OK`` when it exists, ``MISSING`` when not (ChunkIO)."""
        self.faults.hit("probe_key", key)
        try:
            self._client.head_object(Bucket=self.cfg.bucket, Key=self.name(key))
            return OK_EMPTY
        except self._io_errors as e:
            code, status, detail = classify(e)
            return IOOutcome(code, 0, f"probe {key.hex()[:16]}: {detail}", status)

    def delete(self, key: bytes) -> IOOutcome:
        """DELETE ``key``'s object (``OK`` also when it was already gone; ChunkIO)."""
        try:
            self._client.delete_object(Bucket=self.cfg.bucket, Key=self.name(key))
            return OK_EMPTY
        except self._io_errors as e:
            code, status, detail = classify(e)
            if code == m.MISSING:
                return OK_EMPTY
            return IOOutcome(code, 0, f"delete {key.hex()[:16]}: {detail}", status)

    def scan(self) -> list[tuple[bytes, int, float]]:
        """List this namespace's objects: ``(key, bytes, mtime seconds)`` each (the obj tier's ``max_bytes`` counts them at start)."""
        entries = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.cfg.bucket, Prefix=self.base
        )
        base = self.base
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"]
                if name[len(base) :].count("/") != 2:
                    continue  # not <hh>/<hh>/<key>.kv: a tenant's (t-<id>/...), config.json
                key = cf.key_from_name(name.rsplit("/", 1)[-1])
                if key is not None:
                    entries.append((key, int(obj["Size"]), obj["LastModified"].timestamp()))
        return entries

    def for_tenant(self, tenant: str) -> ObjIO:
        """This I/O for tenant ``tenant``'s chunks (a tenant id): the same objects, below
        ``<prefix><namespace>/t-<tenant id>/`` (``chunkfile.tenant_dir``).

        Raises:
            ValueError: ``tenant`` is not a tenant id.
        """
        sub = copy.copy(self)
        sub.base = self.base + cf.tenant_dir(tenant) + "/"
        if self._sealer is not None:  # the tenant's own key
            sub._sealer = self._sealer.for_tenant(tenant)
        return sub

    def tenant_ids(self) -> list[str]:
        """The tenants with objects in the namespace (their ids), for a scan."""
        out = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.cfg.bucket, Prefix=self.base, Delimiter="/"
        )
        for page in pages:
            for p in page.get("CommonPrefixes", []):
                t = cf.tenant_from_dir(p["Prefix"][len(self.base) :].rstrip("/"))
                if t is not None:
                    out.append(t)
        return out


def make_io(config: ObjIOConfig, faults: Faults) -> ObjIO:  # a chunkio.MakeIO
    """Entry point the worker calls with the tier's I/O config (decoded from
    ``WorkerSpec.io_config``)."""
    return ObjIO(config, faults)
