"""The chunk sealer (kvoffload.workers.chunkseal): what a tag that does not verify leaves behind."""

import os

import numpy as np

from kvoffload.workers.chunkseal import TAG_BYTES, Sealer


def test_a_tag_that_does_not_verify_leaves_the_destination_zeroed_not_plaintext():
    """Review 7: decrypt_into may write the unauthenticated plaintext into the destination (an
    arena row) before the tag fails; it was left there. Now the row is zeroed."""
    sealer = Sealer(os.urandom(32), "ab" * 16, "cd" * 16)
    key = bytes(20)
    row = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    out = bytearray(row.nbytes + TAG_BYTES)
    record = sealer.seal(key, row, memoryview(out))
    dst = np.full(row.nbytes, 0xFF, dtype=np.uint8)
    assert sealer.open(key, record, memoryview(out), memoryview(dst))
    assert np.array_equal(dst, row)
    out[-1] ^= 1  # the tag changed: the ciphertext itself is intact
    assert not sealer.open(key, record, memoryview(out), memoryview(dst))
    assert not dst.any()


def test_a_header_with_a_flag_this_version_does_not_know_is_refused():
    """A header whose checksum is good but which sets a flag bit beyond FLAG_MAC and FLAG_SEALED
    (a newer format's, or a writer's probe) was read as if the bit meant nothing; it is refused,
    which the tiers count as corrupt (a miss), naming the bits."""
    import struct

    import pytest
    import xxhash

    from kvoffload.workers import chunkfile as cf

    ns, key, payload = bytes(range(16)), b"k" * 20, os.urandom(4096)
    head = bytearray(cf.build_header(ns, key, payload))
    assert cf.parse_header(bytes(head), ns, key, len(payload)) == cf.payload_checksum(payload)
    for bit in (4, 1 << 31):
        bad = bytearray(head)
        (flags,) = struct.unpack_from("<I", bad, 12)
        struct.pack_into("<I", bad, 12, flags | bit)
        fixed = bytes(bad[:48])  # magic, version, key length, flags, namespace, length, checksum
        struct.pack_into("<Q", bad, 48, xxhash.xxh3_64_intdigest(fixed))  # a good header check
        with pytest.raises(cf.ChunkFormatError, match=f"unknown header flags {bit:#x}"):
            cf.parse_header(bytes(bad), ns, key, len(payload))
