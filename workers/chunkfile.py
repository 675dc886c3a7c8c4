"""The self-describing stored-chunk format shared by the persistent tiers (fs, obj).

::

    offset 0     ┌─────────────────────────────── header (HEADER_BYTES = 4096) ───────────────────────┐
                 │ magic "KVOCHUNK" │ format version u16 │ key length u16 │ flags u32                 │
                 │ namespace id (16 bytes, xxh3-128) │ payload length u64 │ payload xxh3-64 u64       │
                 │ header xxh3-64 u64 (of the 48 bytes before it) │ key bytes │ zero padding           │
    offset 4064  │ keyed chunks only (flags bit 0): HMAC-SHA256 (32 bytes), else zeros               │
    offset 4096  ├─────────────────────────────── payload (one arena row) ────────────────────────────┤

The header is a whole page so the payload starts page-aligned in the file: a load can read it straight
into the (page-aligned) arena slot, with O_DIRECT where the filesystem allows. A reader verifies the
magic, version, namespace, key, declared and actual length, and the payload checksum; any mismatch is
*verified corruption* and the copy is removed.

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
directory holds more than a few thousand entries below ~10^8 chunks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import xxhash

MAGIC = b"KVOCHUNK"
FORMAT_VERSION = 1
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
MIN_SECRET_BYTES = 16
"""An integrity key shorter than this (bytes, as the environment variable holds it) is refused."""
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class ChunkFormatError(ValueError):
    """A stored chunk failed verification (bad magic, version, namespace, key, length or checksum)."""


class IntegrityKeyError(ValueError):
    """The integrity key's environment variable is unset, empty or too short (the message names the
    variable and the fix, never the value)."""


def secret_from_env(env_name: str) -> bytes:
    """The integrity secret held by environment variable ``env_name`` (its bytes as given).

    Raises:
        IntegrityKeyError: unset, empty, or shorter than :data:`MIN_SECRET_BYTES`.
    """
    value = os.environb.get(env_name.encode())
    if not value:
        raise IntegrityKeyError(
            f"integrity_key_env: the environment variable {env_name} is "
            f"{'empty' if value == b'' else 'not set'}; set it to the integrity key (at least "
            f"{MIN_SECRET_BYTES} random bytes, e.g. the output of `openssl rand -hex 32`) in the "
            "environment of every instance that shares the tier, or remove integrity_key_env"
        )
    if len(value) < MIN_SECRET_BYTES:
        raise IntegrityKeyError(
            f"integrity_key_env: the key in {env_name} is {len(value)} bytes; use at least "
            f"{MIN_SECRET_BYTES} random bytes (e.g. the output of `openssl rand -hex 32`)"
        )
    return value


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


def build_header(namespace_id: bytes, key: bytes, payload, mac_with: bytes | None = None) -> bytes:
    """The 4096-byte header for ``payload`` (a buffer of the arena row) stored under ``key``;
    with ``mac_with`` (a :func:`mac_key`), a keyed header carrying the chunk's MAC."""
    limit = MAX_KEY_BYTES if mac_with is None else MAX_KEY_BYTES - MAC_BYTES
    if len(key) > limit:
        raise ValueError(f"chunk key of {len(key)} bytes exceeds {limit}")
    nbytes = memoryview(payload).nbytes
    flags = 0 if mac_with is None else FLAG_MAC
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(key), flags, namespace_id, nbytes, payload_checksum(payload)
    )
    head = fixed + _HCHECK.pack(xxhash.xxh3_64_intdigest(fixed)) + key
    header = head + bytes(HEADER_BYTES - len(head))
    if mac_with is None:
        return header
    return header[:MAC_OFFSET] + _mac(mac_with, header, payload)


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
    """Verify a header against what the reader expects; returns the payload checksum it declares.

    Raises:
        ChunkFormatError: any mismatch, naming it.
    """
    if len(header) < HEADER_BYTES:
        raise ChunkFormatError(f"short header ({len(header)} bytes)")
    fixed = header[: _FIXED.size]
    magic, version, key_len, _, ns, plen, checksum = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"format version {version}, expected {FORMAT_VERSION}")
    (hcheck,) = _HCHECK.unpack_from(header, _FIXED.size)
    if hcheck != xxhash.xxh3_64_intdigest(fixed):
        raise ChunkFormatError("header checksum mismatch")
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
