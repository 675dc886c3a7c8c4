"""The self-describing stored-chunk format shared by the persistent tiers (fs, obj).

::

    offset 0     ┌─────────────────────────────── header (HEADER_BYTES = 4096) ───────────────────────┐
                 │ magic "KVOCHUNK" │ format version u16 │ key length u16 │ reserved u32              │
                 │ namespace id (16 bytes, xxh3-128) │ payload length u64 │ payload xxh3-64 u64       │
                 │ header xxh3-64 u64 (of the 56 bytes before it) │ key bytes │ zero padding           │
    offset 4096  ├─────────────────────────────── payload (one arena row) ────────────────────────────┤

The header is a whole page so the payload starts page-aligned in the file: a load can read it straight
into the (page-aligned) arena slot, with O_DIRECT where the filesystem allows. A reader verifies the
magic, version, namespace, key, declared and actual length, and the payload checksum; any mismatch is
*verified corruption* and the copy is removed. Names are content-based:
``<namespace id>/<hh>/<hh>/<key hex>.kv`` with the two shard levels taken from xxh3-64 of the key, so no
directory holds more than a few thousand entries below ~10^8 chunks.
"""

from __future__ import annotations

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
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class ChunkFormatError(ValueError):
    """A stored chunk failed verification (bad magic, version, namespace, key, length or checksum)."""


def payload_checksum(payload) -> int:
    """xxh3-64 of the payload (any buffer)."""
    return xxhash.xxh3_64_intdigest(payload)


def build_header(namespace_id: bytes, key: bytes, payload) -> bytes:
    """The 4096-byte header for ``payload`` (a buffer of the arena row) stored under ``key``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"chunk key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    nbytes = memoryview(payload).nbytes
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(key), 0, namespace_id, nbytes, payload_checksum(payload)
    )
    head = fixed + _HCHECK.pack(xxhash.xxh3_64_intdigest(fixed)) + key
    return head + bytes(HEADER_BYTES - len(head))


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
