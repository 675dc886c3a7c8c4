"""What a tier worker's I/O module is built from: a tagged union of msgspec structs, one per module.

::

    engine: tier.io_config() ──▶ FsIOConfig(...) ──JSON {"io": "fs", ...}──▶ WorkerSpec.io_config
    worker: decode_io_config(WorkerSpec.io_config, io_module.IO_CONFIG) ──▶ FsIOConfig
                                                                     ──▶ io_module.make_io(config, faults)

The tag (field ``io``) names the struct: ``fs`` (:class:`FsIOConfig`, ``kvoffload.workers.fs_io``),
``obj`` (:class:`ObjIOConfig`, ``kvoffload.workers.obj_io``). An out-of-tree I/O module declares its
own subclass of :class:`IOConfig` with a tag of its own and names it ``IO_CONFIG``; the worker
decodes the built-in structs and that one, so a config sent to the wrong module is an error naming
both, not a ``make_io`` fed the wrong fields.

Worker side: imports nothing of the project but :mod:`kvoffload.ipc` (never torch); the engine's
tiers import it to build the structs they send.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, ClassVar, Literal

import msgspec

from kvoffload.ipc.childenv import CLOUD_ENV

STALE_TEMP_AGE_S = 3600.0
"""Default age (seconds since its last write) past which a temporary file is an orphan: 120x the
default job deadline, with room for a writer stalled in fsync on a network filesystem and for clock
skew between the hosts that share one (a file's mtime comes from the file server's clock)."""


class IOConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="io"):
    """Base of every I/O module's config; subclasses set ``tag=`` (the value of field ``io``).

    Attributes:
        worker_env: (class attribute) environment variables, names or ``fnmatch`` patterns, that
            the module's worker processes get beyond the base allow-list
            (:data:`kvoffload.ipc.childenv.BASE_ENV`); nothing else of the engine's environment
            reaches them. An out-of-tree module that reads credentials from the environment
            names them here.
    """

    worker_env: ClassVar[tuple[str, ...]] = ()


class FsIOConfig(IOConfig, kw_only=True, tag="fs"):
    """What a worker needs to do filesystem-tier I/O (``kvoffload.workers.fs_io``).

    Attributes:
        root_dir: the tier's root directory.
        namespace_id: hex id of the namespace (its directory name).
        row_bytes: payload bytes per chunk (one arena row).
        fsync: fsync each chunk file and its directory before the chunk counts as stored.
        direct_io: which transfers bypass the page cache with O_DIRECT (where the filesystem
            supports it; otherwise they fall back to buffered I/O): ``none``, ``writes``, ``reads``
            or ``both``.
        stale_temp_age_s: scans remove temporary files last written longer ago than this
            (seconds); see ``kvoffload.workers.fs_io.stale_temp_age_s``.
        min_free_bytes: a store that would leave less free space than this (bytes) on the
            filesystem answers ``NO_SPACE`` without writing (0: no floor).
        dir_mode, file_mode: permission bits of the directories and chunk files the worker
            creates, exactly (not filtered by the umask): 0o700 / 0o600 by default, 0o2770 / 0o660
            for a root shared with a group (``share_with_group``).
        integrity_key_env: the environment variable holding the integrity key (chunks are written
            with, and must carry, a keyed MAC; see ``kvoffload.workers.chunkfile``); None: none.
        encryption_key_env: the environment variable holding the encryption master key (chunks
            are stored AES-GCM encrypted, a key per chunk; ``kvoffload.workers.chunkseal``);
            None: stored as they are.
    """

    root_dir: str
    namespace_id: str
    row_bytes: int
    fsync: bool = False
    direct_io: Literal["none", "writes", "reads", "both"] = "both"
    stale_temp_age_s: float = STALE_TEMP_AGE_S
    min_free_bytes: int = 0
    dir_mode: int = 0o700
    file_mode: int = 0o600
    integrity_key_env: str | None = None
    encryption_key_env: str | None = None


class ObjIOConfig(IOConfig, kw_only=True, tag="obj"):
    """What a worker needs to talk to the object store (``kvoffload.workers.obj_io``; meanings as in
    ``kvoffload.tiers.obj.ObjTierConfig``).

    Attributes:
        bucket, prefix: where the chunks are (``s3://<bucket>/<prefix><namespace id>/...``).
        namespace_id: hex id of the namespace.
        row_bytes: payload bytes per chunk (one arena row).
        endpoint_url: an S3-compatible endpoint (``http://host:port``); None for AWS S3.
        region, access_key_id, secret_access_key, session_token: None: the boto3 chain's.
        max_attempts: attempts per request (botocore "standard" retries).
        connect_timeout_s, read_timeout_s: per attempt (seconds).
        verify_tls, ca_bundle: TLS certificate checking.
        addressing_style: ``auto``, ``path`` or ``virtual``.
        max_connections: the client's connection pool size.
        integrity_key_env: the environment variable holding the integrity key (as for
            :class:`FsIOConfig`); None: none.
        encryption_key_env: the environment variable holding the encryption master key (as for
            :class:`FsIOConfig`); None: none.
        worker_env: (class attribute) :data:`kvoffload.ipc.childenv.CLOUD_ENV`: boto3's
            credentials chain and settings, proxies and CA bundles.
    """

    worker_env: ClassVar[tuple[str, ...]] = CLOUD_ENV

    bucket: str
    prefix: str = ""
    namespace_id: str
    row_bytes: int
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    verify_tls: bool = True
    ca_bundle: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    max_connections: int = 16
    integrity_key_env: str | None = None
    encryption_key_env: str | None = None


BUILTIN_IO_CONFIGS: tuple[type[IOConfig], ...] = (FsIOConfig, ObjIOConfig)
"""The built-in members of the union; an I/O module's ``IO_CONFIG`` joins them when decoding."""


def encode_io_config(config: IOConfig) -> msgspec.Raw:
    """``config`` as the JSON that ``WorkerSpec.io_config`` carries (its tag included)."""
    return msgspec.Raw(msgspec.json.encode(config))


def decode_io_config(raw: bytes | msgspec.Raw, module_config: type[IOConfig] | None) -> IOConfig:
    """Decode ``WorkerSpec.io_config`` as the union of the built-in configs and ``module_config``
    (the I/O module's ``IO_CONFIG``), and check that it is the module's.

    Raises:
        msgspec.ValidationError: not one of the union's structs (an unknown tag, a missing or
            unknown field, a wrong type), naming the field.
        TypeError: a valid config of another module than ``module_config``'s.
    """
    members = BUILTIN_IO_CONFIGS
    if module_config is not None and module_config not in members:
        members = (*members, module_config)
    union: Any = functools.reduce(operator.or_, members)
    config = msgspec.json.decode(raw, type=union)
    if module_config is not None and not isinstance(config, module_config):
        raise TypeError(
            f"the I/O module takes {module_config.__name__} (io: "
            f"{module_config.__struct_config__.tag!r}), got {type(config).__name__} (io: "
            f"{type(config).__struct_config__.tag!r})"
        )
    return config
