"""The self-describing stored-chunk format shared by the persistent tiers (fs, obj).

::

    offset 0     ┌─────────────────────────────── header (HEADER_BYTES = 4096) ───────────────────────┐
                 │ magic "KVOCHUNK" │ format version u16 │ key length u16 │ flags u32                 │
                 │ namespace id (16 bytes, xxh3-128) │ payload length u64 │ payload xxh3-64 u64       │
                 │ header xxh3-64 u64 (of the 48 bytes before it) │ key bytes │ zero padding           │
    offset 4020  │ encrypted chunks only (flags bit 1, format 2): salt 16 │ nonce 12 │ tag 16, else zeros│
    offset 4064  │ keyed chunks only (flags bit 0): HMAC-SHA256 (32 bytes), else zeros               │
    offset 4096  ├─────────────────────────────── payload (one arena row) ────────────────────────────┤

The header is a whole page so the payload starts page-aligned in the file: a load can read it straight
into the (page-aligned) arena slot, with O_DIRECT where the filesystem allows. A reader verifies the
magic, version, namespace, key, declared and actual length, and the payload checksum; any mismatch is
*verified corruption* and the copy is removed.

Format versions. 1: every chunk stored in the clear (flags 0 or :data:`FLAG_MAC`): the payload
checksum is xxh3-64 of the payload. 2: an encrypted chunk (:data:`FLAG_SEALED`,
:mod:`kvoffload.workers.chunkseal`): the payload is the ciphertext, the header holds the seal
record (the chunk's key-derivation salt, its nonce and its tag) at :data:`SEAL_OFFSET`, and the
checksum is xxh3-64 of the seal record followed by the ciphertext, so damage anywhere in what
decryption reads is ``corrupt`` (a checksum failure), and a tag that fails under a good checksum
is a forgery (:func:`record_checksum`). Chunks in the clear stay format 1, so the namespace (which
names the format version) did not change and no plain chunk was lost. An encrypted chunk of
format 1 (written before format 2: one key per tenant, nonce and tag outside the checksum) is
refused as corrupt (:class:`ChunkFormatError`): removed, a counted miss, never decrypted.

Keyed integrity (optional, a tier's ``integrity_key_env``): a writer that holds the integrity key
sets flag bit 0 (:data:`FLAG_MAC`) and puts an HMAC-SHA256 in the header's last 32 bytes, over the
header's first 4064 bytes (every field above, the key and the padding) and the payload, under a key
derived from the secret (:func:`mac_key`). A reader that holds the key accepts only a chunk whose
MAC verifies (:func:`mac_problem`); anything else is *forged*: the unkeyed xxh3 checksums prove
only that bytes were not damaged, and anyone who can write the storage can compute them. Unkeyed
chunks are the same bytes as before the key existed (flags 0, zeros at the MAC's place): the format
version did not change. HMAC-SHA256 rather than keyed BLAKE2b: OpenSSL's SHA-256 (SHA-NI) hashes
2 MiB in ~1.6 ms here, CPython's BLAKE2b in 3-4.3 ms (BENCHMARKS.md §1c); both are in the standard
library and release the GIL.

Names are content-based:
``<namespace id>/<hh>/<hh>/<key hex>.kv`` with the two shard levels taken from xxh3-64 of the key, so no
directory holds more than a few thousand entries below ~10^8 chunks. A tenant's chunks (a request with
a ``cache_salt``, :mod:`kvoffload.tenants`) sit one level lower, in their tenant's directory:
``<namespace id>/t-<tenant id>/<hh>/<hh>/<key hex>.kv`` (:func:`tenant_dir`), so a tenant can be
erased as a whole (``kvoffload purge``); unsalted chunks stay where they always were.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import xxhash

MAGIC = b"KVOCHUNK"
FORMAT_VERSION = 1
"""The format version of a chunk stored in the clear, and the one a namespace names."""
SEALED_FORMAT_VERSION = 2
"""The format version of an encrypted chunk (module docstring)."""
HEADER_BYTES = 4096
_FIXED = struct.Struct(
    "<8sHHI16sQQ"
)  # magic, version, key_len, reserved, ns, payload_len, checksum
_HCHECK = struct.Struct("<Q")
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size - _HCHECK.size
FLAG_MAC = 1
"""Header flag: the chunk carries an HMAC-SHA256 in the header's last :data:`MAC_BYTES` bytes."""
MAC_BYTES = 32
MAC_OFFSET = HEADER_BYTES - MAC_BYTES
FLAG_SEALED = 2
"""Header flag: the payload is AES-GCM ciphertext (:mod:`kvoffload.workers.chunkseal`); its seal
record (salt, nonce, tag) is the :data:`SEAL_BYTES` bytes at :data:`SEAL_OFFSET` (format 2)."""
KNOWN_FLAGS = FLAG_MAC | FLAG_SEALED
"""Every header flag this version reads: a header with any other is refused (ChunkFormatError),
not read as if the flag meant nothing."""
SEAL_BYTES = 16 + 12 + 16
"""Bytes of an encrypted chunk's seal record: key-derivation salt, nonce, tag."""
SEAL_OFFSET = MAC_OFFSET - SEAL_BYTES
MIN_SECRET_BYTES = 16
"""An integrity key shorter than this (bytes, as the environment variable holds it) is refused."""
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class ChunkFormatError(ValueError):
    """A stored chunk failed verification (bad magic, version, namespace, key, length or checksum)."""


class IntegrityKeyError(ValueError):
    """The integrity key's environment variable is unset, empty or too short (the message names the
    variable and the fix, never the value)."""


def secret_from_env(env_name: str, setting: str = "integrity_key_env") -> bytes:
    """The secret held by environment variable ``env_name`` (its bytes as given), named by
    setting ``setting`` (``integrity_key_env``, ``encryption_key_env``) in messages.

    Raises:
        IntegrityKeyError: unset, empty, or shorter than :data:`MIN_SECRET_BYTES`.
    """
    what = {
        "encryption_key_env": "encryption master key",
        "tenant_key_env": "tenant id key",
    }.get(setting, "integrity key")
    value = os.environb.get(env_name.encode())
    if not value:
        raise IntegrityKeyError(
            f"{setting}: the environment variable {env_name} is "
            f"{'empty' if value == b'' else 'not set'}; set it to the {what} (at least "
            f"{MIN_SECRET_BYTES} random bytes, e.g. the output of `openssl rand -hex 32`) in the "
            f"environment of every instance that shares the tier, or remove {setting}"
        )
    if len(value) < MIN_SECRET_BYTES:
        raise IntegrityKeyError(
            f"{setting}: the key in {env_name} is {len(value)} bytes; use at least "
            f"{MIN_SECRET_BYTES} random bytes (e.g. the output of `openssl rand -hex 32`)"
        )
    return value


def header_flags(header) -> int:
    """The flags of a header already checked by :func:`parse_header`."""
    (flags,) = struct.unpack_from("<I", memoryview(header), 12)
    return flags


def mac_key(secret: bytes) -> bytes:
    """The 32-byte key chunk MACs are computed with, derived from the integrity secret (so the
    secret itself keys nothing else than derivations)."""
    return hmac.digest(secret, b"kvoffload chunk MAC v1", "sha256")


def key_id(secret: bytes) -> str:
    """16 hex digits naming the integrity secret without revealing it (an HMAC of a constant):
    part of a keyed namespace, so instances with different keys, or none, never share one."""
    return hmac.digest(secret, b"kvoffload integrity key id v1", "sha256")[:8].hex()


def _mac(key: bytes, header, payload) -> bytes:
    h = hmac.new(key, memoryview(header)[:MAC_OFFSET], hashlib.sha256)
    h.update(payload)
    return h.digest()


def payload_checksum(payload) -> int:
    """xxh3-64 of the payload (any buffer)."""
    return xxhash.xxh3_64_intdigest(payload)


def build_header(
    namespace_id: bytes,
    key: bytes,
    payload,
    mac_with: bytes | None = None,
    seal: bytes | None = None,
) -> bytes:
    """The 4096-byte header for ``payload`` (a buffer of the arena row, or of its ciphertext)
    stored under ``key``; with ``mac_with`` (a :func:`mac_key`), a keyed header carrying the
    chunk's MAC; with ``seal`` (the seal record: salt, nonce, tag, :data:`SEAL_BYTES` bytes,
    :mod:`kvoffload.workers.chunkseal`), an encrypted chunk's header (format 2, flag
    :data:`FLAG_SEALED`, the record just before the MAC's place, the checksum over the record
    and the payload).

    Raises:
        ValueError: a key too long for the header, or a seal record of another length.
    """
    limit = MAX_KEY_BYTES - (MAC_BYTES if mac_with is not None or seal is not None else 0)
    limit -= SEAL_BYTES if seal is not None else 0
    if len(key) > limit:
        raise ValueError(f"chunk key of {len(key)} bytes exceeds {limit}")
    if seal is not None and len(seal) != SEAL_BYTES:
        raise ValueError(f"seal record of {len(seal)} bytes, expected {SEAL_BYTES}")
    nbytes = memoryview(payload).nbytes
    flags = (0 if mac_with is None else FLAG_MAC) | (0 if seal is None else FLAG_SEALED)
    version = FORMAT_VERSION if seal is None else SEALED_FORMAT_VERSION
    checksum = payload_checksum(payload) if seal is None else _sealed_checksum(seal, payload)
    fixed = _FIXED.pack(MAGIC, version, len(key), flags, namespace_id, nbytes, checksum)
    head = fixed + _HCHECK.pack(xxhash.xxh3_64_intdigest(fixed)) + key
    header = head + bytes(HEADER_BYTES - len(head))
    if seal is not None:
        header = header[:SEAL_OFFSET] + bytes(seal) + header[MAC_OFFSET:]
    if mac_with is None:
        return header
    return header[:MAC_OFFSET] + _mac(mac_with, header, payload)


def _sealed_checksum(record, payload) -> int:
    h = xxhash.xxh3_64(record)
    h.update(payload)
    return h.intdigest()


def record_checksum(header, payload) -> int:
    """The checksum of a stored chunk as its header (already checked by :func:`parse_header`)
    declares it, computed over what it covers: xxh3-64 of ``payload`` (format 1), or of the seal
    record then ``payload`` (format 2: an encrypted chunk, so damage to its salt, nonce or tag
    is a checksum failure, never taken for a forgery)."""
    (version,) = struct.unpack_from("<H", memoryview(header), 8)
    if version == SEALED_FORMAT_VERSION:
        return _sealed_checksum(memoryview(header)[SEAL_OFFSET:MAC_OFFSET], payload)
    return payload_checksum(payload)


def mac_problem(header, payload, mac_with: bytes) -> str | None:
    """Why a chunk (``header`` already checked by :func:`parse_header`, ``payload`` its bytes) is
    not one written with the integrity key ``mac_with`` (a :func:`mac_key`); None when its MAC
    verifies. Compared in constant time."""
    head = memoryview(header)
    (flags,) = struct.unpack_from("<I", head, 12)
    if not flags & FLAG_MAC:
        return "written without the integrity key"
    if not hmac.compare_digest(_mac(mac_with, head, payload), head[MAC_OFFSET:HEADER_BYTES]):
        return "integrity MAC mismatch"
    return None


def parse_header(header: bytes, namespace_id: bytes, key: bytes, payload_len: int) -> int:
    """Verify a header against what the reader expects; returns the checksum it declares (to
    compare with :func:`record_checksum` of the header and the payload read).

    Raises:
        ChunkFormatError: any mismatch, naming it (an encrypted chunk of format 1 included).
    """
    if len(header) < HEADER_BYTES:
        raise ChunkFormatError(f"short header ({len(header)} bytes)")
    fixed = header[: _FIXED.size]
    magic, version, key_len, flags, ns, plen, checksum = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic")
    if version not in (FORMAT_VERSION, SEALED_FORMAT_VERSION):
        raise ChunkFormatError(
            f"format version {version}, expected {FORMAT_VERSION} or {SEALED_FORMAT_VERSION}"
        )
    (hcheck,) = _HCHECK.unpack_from(header, _FIXED.size)
    if hcheck != xxhash.xxh3_64_intdigest(fixed):
        raise ChunkFormatError("header checksum mismatch")
    if flags & ~KNOWN_FLAGS:
        raise ChunkFormatError(
            f"unknown header flags {flags & ~KNOWN_FLAGS:#x} (written by a newer format this "
            "version cannot read)"
        )
    if bool(flags & FLAG_SEALED) != (version == SEALED_FORMAT_VERSION):
        raise ChunkFormatError(
            "encrypted in format 1 (a key per tenant, nonce and tag outside the checksum), "
            "which this version no longer reads"
            if version == FORMAT_VERSION
            else f"format {version} without the encryption flag"
        )
    if ns != namespace_id:
        raise ChunkFormatError("namespace mismatch")
    start = _FIXED.size + _HCHECK.size
    if key_len != len(key) or header[start : start + key_len] != key:
        raise ChunkFormatError("key mismatch")
    if plen != payload_len:
        raise ChunkFormatError(f"payload length {plen}, expected {payload_len}")
    return checksum


def shard_dirs(key: bytes) -> tuple[str, str]:
    """The two shard directory names (2 hex digits each) for ``key``."""
    h = xxhash.xxh3_64_intdigest(key)
    return f"{h >> 56:02x}", f"{(h >> 48) & 0xFF:02x}"


TENANT_DIR_PREFIX = "t-"
"""A tenant directory's name is this followed by the tenant id (:func:`tenant_dir`)."""
TENANT_ID_HEX = 32
"""Hex digits of a tenant id (:func:`kvoffload.tenants.tenant_id`)."""


def is_tenant_id(value: str) -> bool:
    """True when ``value`` is a tenant id: exactly :data:`TENANT_ID_HEX` lowercase hex digits
    (what names a tenant directory; anything else could name another path)."""
    return (
        isinstance(value, str)
        and len(value) == TENANT_ID_HEX
        and not value.strip("0123456789abcdef")
    )


def tenant_dir(tenant: str) -> str:
    """``t-<tenant id>``: the directory (or key prefix component) of a tenant's chunks below its
    namespace's.

    Raises:
        ValueError: ``tenant`` is not a tenant id (:func:`is_tenant_id`).
    """
    if not is_tenant_id(tenant):
        raise ValueError(
            f"tenant id {tenant[:40]!r} is not {TENANT_ID_HEX} lowercase hex digits "
            "(kvoffload.tenants.tenant_id of a cache_salt)"
        )
    return TENANT_DIR_PREFIX + tenant


def tenant_from_dir(name: str) -> str | None:
    """The tenant id a directory name ``t-<tenant id>`` names, None for any other name."""
    if name.startswith(TENANT_DIR_PREFIX) and is_tenant_id(name[len(TENANT_DIR_PREFIX) :]):
        return name[len(TENANT_DIR_PREFIX) :]
    return None


def relative_name(key: bytes) -> str:
    """``<hh>/<hh>/<key hex>.kv``: the chunk's name below its namespace directory/prefix."""
    a, b = shard_dirs(key)
    return f"{a}/{b}/{key.hex()}{SUFFIX}"


def key_from_name(filename: str) -> bytes | None:
    """The key encoded in a chunk file name, or None if the name is not a chunk name."""
    if not filename.endswith(SUFFIX) or filename.startswith("."):
        return None
    try:
        return bytes.fromhex(filename[: -len(SUFFIX)])
    except ValueError:
        return None
