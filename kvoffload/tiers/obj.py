"""The object-store tier (``type: "obj"``): one object per chunk in any S3-compatible store.

Same worker-pool machinery as the fs tier (:mod:`kvoffload.tiers.process`): readers GET and probe
(HEAD), writers PUT and delete, in worker processes that move bytes between arena slots and objects
with boto3 (:mod:`kvoffload.workers.obj_io`); the same content-based names and namespace
``config.json`` under ``prefix``; the same self-describing header and checksum, verified on every
load. Instances that share a bucket and prefix share chunks.

At start the tier checks the bucket from the engine process (one HeadBucket): a bucket that does not
exist, refused credentials or an unreachable endpoint fail the start with a message naming the key to
fix. A circuit breaker (on by default here) stops hammering a dead or throttling endpoint: lookups
miss and stores are dropped and counted until the endpoint answers again.

Capacity: unbounded by default (the store's own quota, lifecycle rules or bucket size bound it).
With ``max_bytes`` the tier counts its objects' bytes (headers included) in an LRU index, as the fs
tier does its files (:mod:`kvoffload.tiers.capacity`): the namespace's objects found under the
prefix at start are listed and adopted, oldest first; the least recently used objects are deleted
through the writer workers to stay within the cap; a delete that fails keeps its object counted
and is retried when it next comes up for eviction. The cap applies per namespace, as seen by this
instance: objects another instance writes under the same prefix later are not counted here.

Integrity key (``integrity_key_env``, as for the fs tier): every object is written with a keyed
MAC, and one without a valid MAC is a miss, counted as ``forged`` and deleted; the key's id is part
of the namespace, so keyed and unkeyed instances never share a prefix. Without a key, anyone who can
write the bucket prefix can forge chunks. Sizes are untrusted (CASES C45): a GET whose
Content-Length is not exactly one object's size is not read, and a body without one is read at
most one byte past that size; either is ``corrupt``.

Credentials: explicit ``access_key_id`` / ``secret_access_key`` / ``session_token`` fields, or the
standard boto3 chain (environment, shared config and credentials files, instance or container role).
They are never logged (the effective configuration shows them masked).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
from typing_extensions import override

from kvoffload.config import Bytes, Positive, apply_aliases, closest
from kvoffload.ipc.channels import LOADS, STORES
from kvoffload.namespace import for_encryption_key, for_integrity_key
from kvoffload.tiers.process import (
    ProcessTierConfig,
    ProcessTierManager,
    Seconds,
    encryption_key_env_problems,
    integrity_key_env_problems,
)
from kvoffload.validation import ConfigIssue, RenamedWithErrors, raise_problems
from kvoffload.workers import chunkfile as cf
from kvoffload.workers.obj_io import ObjIOConfig, classify, make_client, object_prefix

_START_TIMEOUT_S = 5.0
_SCAN_TIMEOUT_S = 600.0  # listing the namespace's objects at start (a bounded tier)


class ObjTierConfig(ProcessTierConfig, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "obj", "bucket": ..., ...}`` (plus :class:`ProcessTierConfig`'s fields).

    Attributes:
        bucket: the bucket (must exist).
        prefix: key prefix for this deployment's chunks ("" for the bucket root).
        endpoint_override: endpoint URL of an S3-compatible store (``http://host:port``); None for
            AWS S3.
        region: region name (None: from the boto3 chain).
        access_key_id, secret_access_key, session_token: explicit credentials (None: boto3 chain).
        io_workers: reader and writer processes each (overrides ``read_workers``/``write_workers``).
        max_attempts: attempts per request, retries with exponential backoff and jitter (botocore
            "standard" mode) for throttling, 5xx and connection errors.
        connect_timeout_s, read_timeout_s: per attempt (seconds, at most 86400).
        verify_tls: check the endpoint's TLS certificate.
        ca_bundle: path of a PEM bundle of CA certificates to check it against (None: the system's).
        addressing_style: ``auto``, ``path`` (MinIO and most self-hosted stores) or ``virtual``.
        max_bytes: cap on this namespace's object bytes (bytes, headers included); the least
            recently used objects are deleted to stay under it, and the objects found under the
            prefix at start are counted. None (default): unbounded, nothing is deleted.
        integrity_key_env: name of an environment variable holding an integrity key (at least 16
            bytes; never the key itself here): objects carry a keyed MAC (HMAC-SHA256), and one
            whose MAC is missing or wrong is a miss (``forged``) and deleted; the key's id is part
            of the namespace. None: no MAC; anyone who can write the prefix can forge chunks.
        encryption_key_env: name of an environment variable holding an encryption master key
            (as for the fs tier): objects are stored AES-256-GCM encrypted, a key per namespace
            and tenant; a tag that does not verify is a miss (``forged``) and the object deleted.
            None: objects are stored as they are.

    vLLM 0.33's obj-tier keys are accepted too (see :meth:`from_vllm_keys`): its nested
    ``store_config`` (``bucket``, ``endpoint_override`` as a bare host, ``scheme``, ``access_key``,
    ``secret_key``, ``session_token``, ``region``, ``ca_bundle``), the same names at the tier's
    top level, and ``io_threads``, ``prefix``, ``locality``, ``enable_kv_events``.
    """

    vllm_aliases: ClassVar[dict[str, str]] = {
        **ProcessTierConfig.vllm_aliases,
        "access_key": "access_key_id",
        "secret_key": "secret_access_key",
    }
    unset_means: ClassVar[dict[str, str]] = {
        **ProcessTierConfig.unset_means,
        "endpoint_override": "auto: AWS S3, unless the boto3 chain names one (AWS_ENDPOINT_URL)",
        "region": "auto: from the boto3 chain",
        "access_key_id": "auto: from the boto3 chain (environment, shared config, instance role)",
        "secret_access_key": "auto: from the boto3 chain",
        "session_token": "auto: from the boto3 chain",
        "io_workers": "none: read_workers / write_workers apply",
        "ca_bundle": "auto: the system's CA certificates",
        "max_bytes": "unbounded: nothing is deleted",
        "integrity_key_env": "off: objects carry no keyed MAC; anyone who can write the "
        "prefix can forge them",
        "encryption_key_env": "off: objects are stored as they are; anyone who can read the "
        "prefix reads them",
    }
    # vLLM's ObjStoreConfig fields (vllm/v1/kv_offload/tiering/obj/config.py); "" means unset there.
    store_config_keys: ClassVar[tuple[str, ...]] = (
        "bucket",
        "endpoint_override",
        "access_key",
        "secret_key",
        "session_token",
        "region",
        "scheme",
        "ca_bundle",
    )

    bucket: str
    prefix: str = ""
    endpoint_override: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    io_workers: Positive | None = None
    max_attempts: Positive = 3
    connect_timeout_s: Seconds = 2.0
    read_timeout_s: Seconds = 10.0
    verify_tls: bool = True
    ca_bundle: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    max_bytes: Bytes | None = None
    breaker_failures: Positive | None = 5
    job_timeout_s: Seconds = 60.0
    integrity_key_env: str | None = None
    encryption_key_env: str | None = None

    @classmethod
    def from_vllm_keys(cls, body: dict[str, Any], where: str) -> tuple[dict, dict[str, str]]:
        """Turn vLLM 0.33's obj-tier keys into ours.

        ``store_config`` is flattened into the tier's keys; ``access_key`` / ``secret_key`` become
        ``access_key_id`` / ``secret_access_key``; a bare-host ``endpoint_override`` gets
        ``scheme`` (vLLM's default ``http`` when it comes from ``store_config``); vLLM's empty
        strings for unset credentials, region, endpoint and CA bundle mean unset.

        Raises:
            RenamedWithErrors: a setting given twice (under two names or in and out of
                ``store_config``), an unknown ``store_config`` key, a bad ``scheme``; the other
                keys renamed (so they are checked too).
        """
        body = dict(body)
        renamed: dict[str, str] = {}
        issues: list[ConfigIssue] = []
        vllm_given: set[str] = set()
        nested = body.pop("store_config", None)
        if nested is not None and not isinstance(nested, dict):
            issues.append(
                ConfigIssue(
                    f"{where}.store_config",
                    f"expected an object (dict), got {type(nested).__name__}",
                )
            )
            nested = None
        for key, value in (nested or {}).items():
            if key not in cls.store_config_keys:
                close = closest(key, list(cls.store_config_keys))
                hint = f" (did you mean {close!r}?)" if close else ""
                issues.append(
                    ConfigIssue(
                        f"{where}.store_config",
                        f"unknown key {key!r}{hint}; allowed keys: "
                        f"{', '.join(cls.store_config_keys)}",
                    )
                )
                continue
            ours = cls.vllm_aliases.get(key, key)
            if key in body or ours in body:
                other = key if key in body else ours
                issues.append(
                    ConfigIssue(
                        where,
                        f"{'store_config.' + key!r} and {other!r} set the same thing; keep one",
                    )
                )
                continue
            body[ours] = value
            renamed[ours] = f"store_config.{key}"
            vllm_given.add(ours)
        for alias, ours in cls.vllm_aliases.items():
            if alias in body:
                vllm_given.add(ours)
        apply_aliases(body, cls.vllm_aliases, where, renamed, issues=issues)
        for ours in (
            "access_key_id",
            "secret_access_key",
            "session_token",
            "region",
            "ca_bundle",
            "endpoint_override",
        ):
            if ours in vllm_given and body.get(ours) == "":
                del body[ours]
        scheme_given = "scheme" in body
        scheme = body.pop("scheme", "http" if nested is not None else None)
        if scheme is not None:
            given = renamed.get("scheme", "scheme")
            endpoint = body.get("endpoint_override")
            if scheme not in ("http", "https"):
                issues.append(ConfigIssue(f"{where}.{given}", f"'http' or 'https', got {scheme!r}"))
            elif isinstance(endpoint, str) and endpoint:
                if "://" not in endpoint:
                    body["endpoint_override"] = f"{scheme}://{endpoint}"
                elif scheme_given and not endpoint.startswith(f"{scheme}://"):
                    issues.append(
                        ConfigIssue(
                            f"{where}.{given}",
                            f"{scheme!r} contradicts endpoint_override {endpoint!r}",
                        )
                    )
        if issues:
            raise RenamedWithErrors(issues, body, renamed)
        return body, renamed

    def validate(self) -> None:
        """Check settings that depend on each other.

        Raises:
            Problems: naming each key (``bucket``, ``io_workers``, ``ca_bundle``...).
        """
        problems = []
        if not self.bucket:
            problems.append("bucket: required, the name of an existing bucket")
        workers = self.io_workers
        problems += self.io_thread_problems(
            workers or self.read_workers, workers or self.write_workers
        )
        if self.ca_bundle is not None and not self.verify_tls:
            problems.append("ca_bundle: set, but verify_tls is false (nothing would be checked)")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            problems.append(
                "access_key_id: set both access_key_id and secret_access_key, or "
                "neither (to use the boto3 credential chain)"
            )
        if self.endpoint_override is not None and not self.endpoint_override.startswith(
            ("http://", "https://")
        ):
            problems.append(f"endpoint_override: {self.endpoint_override!r} is not an http(s) URL")
        problems += self.breaker_problems()
        problems += self.tenant_quota_problems(
            "max_bytes is not set: set max_bytes" if self.max_bytes is None else None
        )
        problems += integrity_key_env_problems(self.integrity_key_env)
        problems += encryption_key_env_problems(self.encryption_key_env)
        raise_problems(problems)


def io_config_of(c: ObjTierConfig, **fields: Any) -> ObjIOConfig:
    """The worker I/O config of tier config ``c``; ``fields``: the namespace's (``namespace_id``,
    ``row_bytes``), ``max_connections``, and overrides of ``c``'s own (``max_attempts``, the
    timeouts)."""
    base: dict[str, Any] = dict(
        bucket=c.bucket,
        prefix=c.prefix,
        endpoint_url=c.endpoint_override,
        region=c.region,
        access_key_id=c.access_key_id,
        secret_access_key=c.secret_access_key,
        session_token=c.session_token,
        max_attempts=c.max_attempts,
        connect_timeout_s=c.connect_timeout_s,
        read_timeout_s=c.read_timeout_s,
        verify_tls=c.verify_tls,
        ca_bundle=c.ca_bundle,
        addressing_style=c.addressing_style,
        integrity_key_env=c.integrity_key_env,
        encryption_key_env=c.encryption_key_env,
    )
    base.update(fields)
    return ObjIOConfig(**base)


def bucket_problem(client: Any, c: ObjTierConfig) -> str | None:
    """One HeadBucket of ``c.bucket`` with ``client`` (the tier at start, ``kvoffload check
    --online``): None when the bucket exists and the credentials are accepted, else
    ``"<key>: <why>"`` naming the key to fix."""
    from botocore.exceptions import NoCredentialsError

    where = c.endpoint_override or "AWS S3"
    try:
        client.head_bucket(Bucket=c.bucket)
    except NoCredentialsError:
        return (
            f"access_key_id: no credentials for {where}: set access_key_id and "
            "secret_access_key, or give them to the boto3 chain (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, a profile, an instance role)"
        )
    except Exception as e:
        _, status, detail = classify(e)
        if status == 404:
            return f"bucket: {c.bucket!r} does not exist at {where}"
        if status in (400, 401, 403):
            return (
                f"access_key_id: the credentials were refused by {where} for bucket "
                f"{c.bucket!r} (HTTP {status}); check access_key_id / secret_access_key or the "
                "boto3 credential chain"
            )
        return f"endpoint_override: cannot use {where} for bucket {c.bucket!r}: {detail}"
    return None


class ObjTier(ProcessTierManager):
    """Object-store secondary tier; see the module docstring."""

    config_class = ObjTierConfig
    config: ObjTierConfig
    io_module = "kvoffload.workers.obj_io"
    medium = "STORAGE"
    locality = "REMOTE"
    shared = True

    @classmethod
    @override
    def purge_storage(
        cls, name: str, config: Any, *, tenant: str | None, namespace: str | None
    ) -> Any:
        from kvoffload.tiers.purging import purge_obj

        client = make_client(io_config_of(config, namespace_id="", row_bytes=0, max_connections=4))
        return purge_obj(name, config, client, tenant=tenant, namespace=namespace)

    def __init__(
        self,
        *,
        name: str,
        arena_view: memoryview,
        namespace: Any,
        config: ObjTierConfig,
        arena: Any,
    ):
        namespace = for_encryption_key(
            for_integrity_key(namespace, config.integrity_key_env), config.encryption_key_env
        )
        super().__init__(
            name=name, arena_view=arena_view, namespace=namespace, config=config, arena=arena
        )
        self.ns_id = namespace.id()
        self.base = object_prefix(config.prefix, self.ns_id)
        self.object_bytes = cf.HEADER_BYTES + self.row_bytes
        if config.max_bytes is not None:
            self.bound_capacity(config.max_bytes, self.object_bytes)
        self._check_bucket_and_write_namespace()
        self.start()
        if self.capacity.bounded:
            # Count the namespace's objects already there (earlier runs, other instances).
            self._scan_at_start(_SCAN_TIMEOUT_S, list_entries=True)

    @classmethod
    @override
    def effective_config(cls, config: Any) -> Any:
        """As :meth:`ProcessTierManager.effective_config`, after ``io_workers`` (when set) has
        replaced ``read_workers`` and ``write_workers``; ``io_workers`` itself shows the common
        count when the two are equal."""
        c: ObjTierConfig = config
        if c.io_workers is not None:
            c = msgspec.structs.replace(c, read_workers=c.io_workers, write_workers=c.io_workers)
        elif c.read_workers == c.write_workers:
            c = msgspec.structs.replace(c, io_workers=c.read_workers)
        return super().effective_config(c)

    @override
    def io_config(self) -> ObjIOConfig:
        return self._io_config()

    def _io_config(self, **overrides: Any) -> ObjIOConfig:
        fields: dict[str, Any] = dict(
            namespace_id=self.ns_id,
            row_bytes=self.row_bytes,
            max_connections=max(self._io_threads(LOADS), self._io_threads(STORES)) + 2,
        )
        fields.update(overrides)
        return io_config_of(self.config, **fields)

    def _check_bucket_and_write_namespace(self) -> None:
        c = self.config
        where = c.endpoint_override or "AWS S3"
        client = make_client(
            self._io_config(
                max_attempts=1, connect_timeout_s=_START_TIMEOUT_S, read_timeout_s=_START_TIMEOUT_S
            )
        )
        problem = bucket_problem(client, c)
        if problem is not None:
            raise ValueError(problem)
        config_key = self.base + "config.json"
        try:
            client.put_object(Bucket=c.bucket, Key=config_key, Body=self.namespace.to_json())
        except Exception as e:
            _, status, detail = classify(e)
            raise ValueError(
                f"bucket: cannot write {config_key!r} in {c.bucket!r} at {where} ({detail})"
            ) from None
