"""Encryption at rest of stored chunks (a tier's ``encryption_key_env``): AES-256-GCM, one key per
chunk, derived from the master key, the namespace, the tenant and a random salt of the chunk's own.

::

    master key (the environment variable encryption_key_env names; never in a config)
      └─HKDF-SHA256(salt "kvoffload chunk seal v2",
                    info "kvoffload chunk seal v2" 0x00 ‖ namespace id (16 bytes) ‖ tenant id or ""
                         ‖ 0x00 ‖ chunk salt (16 random bytes, fresh per write))──▶ the chunk's key
    store: nonce = 12 random bytes per write
           ciphertext ‖ tag = AES-GCM(chunk key, nonce, row, AAD = namespace id ‖ tenant ‖ chunk key)
           the file (chunkfile format 2): header (flag FLAG_SEALED; the seal record: salt, nonce,
           tag at SEAL_OFFSET; a checksum over the record and the ciphertext) then the ciphertext
    load:  header, record and ciphertext checked as any chunk (checksum: damage; MAC with an
           integrity key), then decrypted straight into the arena row; a tag that does not verify
           under a good checksum is a miss (``FORGED``): written by someone without this master
           key (or a chunk moved to another tenant, key or namespace)

**Why a key per chunk.** With one key per namespace and tenant and random 96-bit nonces, a busy
tenant's key approached the bound NIST SP 800-38D sets for random nonces (at most 2^32 messages
under one key: beyond, a repeated nonce, which reveals the XOR of two rows and the key's GHASH
key, is no longer negligible). Each write now draws a 128-bit salt and encrypts under the key
HKDF derives with it, so every key encrypts one chunk (two writes share a key only if their salts
collide: about 2^64 writes for even odds, and then their nonces must collide too). The HKDF
derivation is ``cryptography``'s HKDF (two HMAC-SHA256 of under 100 bytes) and an AES key
schedule per chunk (a few µs, BENCHMARKS.md §1d), in the tier's workers, never on the engine's
threads.

The checksum covers the seal record as well as the ciphertext, so damage to any byte decryption
reads is ``corrupt`` before any decryption, as for a plain chunk, and ``forged`` counts only tag
failures under a good checksum. Encryption hides the bytes and binds each chunk to its place:
with the AAD and the keys derived per namespace and tenant a chunk cannot be replayed under
another tenant or key. What it does not hide: names (chunk keys are hashes), sizes, times, and
which tenant directories exist.
"""

from __future__ import annotations

import hmac
import os
from typing import NamedTuple

from kvoffload.workers import chunkfile as cf

SALT_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_BYTES = cf.SEAL_BYTES
"""Bytes of a seal record: salt, nonce, tag."""
SEAL_OFFSET = cf.SEAL_OFFSET
"""Where a sealed chunk's header keeps its seal record (just before the MAC's place)."""
assert SEAL_BYTES == SALT_BYTES + NONCE_BYTES + TAG_BYTES
KDF_SALT = b"kvoffload chunk seal v2"
"""HKDF's salt (the extract step's): a constant, the chunk's own salt goes into ``info``."""
_LABEL = b"kvoffload chunk seal v2\x00"


def key_id(secret: bytes) -> str:
    """16 hex digits naming the encryption master key without revealing it (an HMAC of a
    constant): part of an encrypting tier's namespace, so instances with different keys (or
    none) never share a directory or prefix."""
    return hmac.digest(secret, b"kvoffload encryption key id v1", "sha256")[:8].hex()


class Sealer:
    """AES-256-GCM of one namespace's (and tenant's) chunks, a key per chunk (module docstring).

    Args:
        secret: the master key's bytes (from the environment; at least
            :data:`kvoffload.workers.chunkfile.MIN_SECRET_BYTES`).
        namespace_id: the namespace's id (32 hex digits) as the tier stores it.
        tenant: the tenant id, "" for the unsalted chunks.
    """

    def __init__(self, secret: bytes, namespace_id: str, tenant: str = ""):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._cipher = AESGCM
        ns = bytes.fromhex(namespace_id)
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        self._hkdf, self._sha256 = HKDF, hashes.SHA256()
        self._info = _LABEL + ns + tenant.encode() + b"\x00"  # then the chunk's salt
        self._aad = _LABEL + ns + tenant.encode() + b"\x00"
        self.secret = secret
        self.namespace_id = namespace_id

    def for_tenant(self, tenant: str) -> Sealer:
        """The sealer of ``tenant``'s chunks of the same namespace (their own derived keys)."""
        return Sealer(self.secret, self.namespace_id, tenant)

    def chunk_key(self, salt: bytes) -> bytes:
        """The 32-byte AES key of the chunk whose salt is ``salt`` (:data:`SALT_BYTES` bytes):
        HKDF-SHA256 of the master key with salt :data:`KDF_SALT` and info
        ``"kvoffload chunk seal v2" 0x00 ‖ namespace id ‖ tenant ‖ 0x00 ‖ salt``."""
        hkdf = self._hkdf(algorithm=self._sha256, length=32, salt=KDF_SALT, info=self._info + salt)
        return hkdf.derive(self.secret)

    def _aead(self, salt: bytes):
        return self._cipher(self.chunk_key(salt))

    def seal(self, key: bytes, row, out: memoryview) -> bytes:
        """Encrypt ``row`` (the arena row, ``n`` bytes) for chunk ``key`` into ``out[:n]``
        (``out`` at least ``n + TAG_BYTES`` bytes; its last ``TAG_BYTES`` used get the tag),
        under a key of its own. Returns the seal record for the header: the salt and the nonce
        (random, fresh per write), then the tag (:data:`SEAL_BYTES` bytes)."""
        n = memoryview(row).nbytes
        salt_nonce = os.urandom(SALT_BYTES + NONCE_BYTES)
        aead = self._aead(salt_nonce[:SALT_BYTES])
        aead.encrypt_into(salt_nonce[SALT_BYTES:], row, self._aad + key, out[: n + TAG_BYTES])
        return salt_nonce + bytes(out[n : n + TAG_BYTES])

    def open(self, key: bytes, record: bytes, sealed: memoryview, dst: memoryview) -> bool:
        """Decrypt ``sealed`` (ciphertext followed by its tag, ``len(dst) + TAG_BYTES`` bytes)
        for chunk ``key`` with the key and nonce of seal ``record`` (salt, nonce, tag) into
        ``dst``; False when the tag does not verify: ``dst`` is then zeroed (decryption may
        have written unauthenticated plaintext into it: an arena row)."""
        from cryptography.exceptions import InvalidTag

        try:
            self._aead(record[:SALT_BYTES]).decrypt_into(
                record[SALT_BYTES : SALT_BYTES + NONCE_BYTES], sealed, self._aad + key, dst
            )
        except InvalidTag:
            dst[:] = bytes(dst.nbytes)
            return False
        return True


class Unsealable(NamedTuple):
    """Why :func:`unseal` served no bytes.

    Attributes:
        why: the reason, for the worker's log (never a key or plaintext).
        forged: True for a chunk this tier's key does not open (a tag that does not verify, or a
            chunk in the clear where the tier encrypts: written without this master key, or
            moved from another tenant, key or namespace; counted ``forged`` and
            ``decrypt_failures``); False for an encrypted chunk and a tier without a key (not
            this tier's to read: counted ``corrupt``).
    """

    why: str
    forged: bool


NO_KEY = Unsealable("encrypted chunk, and this tier has no encryption key", forged=False)
IN_THE_CLEAR = Unsealable("written without the encryption key", forged=True)
TAG_MISMATCH = Unsealable(
    "encryption tag mismatch (not this master key's, tenant's, key's or namespace's)", forged=True
)


def unseal(
    sealer: Sealer | None, header, key: bytes, sealed: memoryview | None, dst: memoryview
) -> Unsealable | None:
    """Decrypt a checked chunk (its checksum, over the seal record and the ciphertext, already
    verified) into ``dst`` when the tier encrypts (``sealer``; ``sealed``: its ciphertext in the
    scratch, ``TAG_BYTES`` to spare); None when ``dst`` now holds the chunk, else why not
    (:class:`Unsealable`: :data:`NO_KEY`, :data:`IN_THE_CLEAR` or :data:`TAG_MISMATCH`)."""
    flags = cf.header_flags(header)
    if sealer is None:
        return NO_KEY if flags & cf.FLAG_SEALED else None
    if not flags & cf.FLAG_SEALED:
        return IN_THE_CLEAR
    assert sealed is not None
    row = memoryview(dst).nbytes
    record = bytes(memoryview(header)[SEAL_OFFSET : SEAL_OFFSET + SEAL_BYTES])
    sealed[row : row + TAG_BYTES] = record[SALT_BYTES + NONCE_BYTES :]
    if not sealer.open(key, record, sealed[: row + TAG_BYTES], memoryview(dst).cast("B")):
        return TAG_MISMATCH
    return None
