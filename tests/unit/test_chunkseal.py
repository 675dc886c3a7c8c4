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
