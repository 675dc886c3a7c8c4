"""Encryption at rest (``encryption_key_env``) on real fs and obj tiers with real workers: chunks
round-trip bit-exact (unsalted and a tenant's), each under a key of its own that the documented
derivation rebuilds from the stored salt, the stored bytes hold no plaintext, and every tampering
is a counted miss, never wrong bytes: a flipped byte anywhere in what decryption reads (payload,
salt, nonce, tag: the checksum), a chunk with a valid checksum written under another master key,
or with a byte changed and the checksum recomputed (the AES-GCM tag: forged), a chunk moved to
another tenant's directory or key. A chunk encrypted in the format before per-chunk keys is a
counted miss, removed, and stored anew."""

from __future__ import annotations

import os
import secrets
import struct
import time

import numpy as np
import pytest
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from helpers import HIT, MISS, PENDING, RETRY, ROW, Rig, fs_tier, keys_for, patience, payload
from s3 import client, new_bucket, obj_tier, start_moto

from kvoffload.tenants import tenant_id, tenant_key
from kvoffload.workers import chunkfile as cf
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name, tenant_dir
from kvoffload.workers.chunkseal import SEAL_OFFSET, Sealer
from kvoffload.workers.obj_io import object_prefix

ENV = "KVOFFLOAD_TEST_ENCRYPTION_KEY"
KEYS = keys_for(3, seed=57)


@pytest.fixture
def master_key(monkeypatch):
    monkeypatch.setenv(ENV, secrets.token_hex(32))


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def store(rig: Rig, req: str, keys=KEYS) -> None:
    plan = rig.tm.prepare_store(list(keys), req)
    assert plan is not None and plan.keys == list(keys)
    for k, s in zip(plan.keys, plan.slots):
        rig.arena.rows[s] = payload(k, ROW)
    rig.tm.complete_store(plan.keys, True, req)
    assert rig.tm.wait_idle(patience(120)), "tier jobs did not finish"
    rig.tm.host.remove(list(rig.tm.host.index))  # the tier alone holds them now


def resolve(rig: Rig, req: str, keys=KEYS) -> list:
    deadline = time.monotonic() + patience(120)
    while True:
        res = [rig.tm.lookup(k, req) for k in keys]
        if not any(r in (RETRY, PENDING) for r in res):
            return res
        assert time.monotonic() < deadline, "lookups did not settle"
        rig.tm.step()
        time.sleep(0.002)


def served(rig: Rig, req: str, keys=KEYS) -> list[np.ndarray]:
    slots = rig.tm.prepare_load(list(keys), req)
    out = [rig.arena.rows[s].copy() for s in slots]
    rig.tm.complete_load(list(keys), req)
    return out


def counts(rig: Rig) -> dict[str, float]:
    rig.tm.poll()
    return dict(rig.tm.tiers[0].counters)


@pytest.mark.parametrize("kind", ["fs", "obj"])
def test_encrypted_chunks_round_trip_and_what_is_stored_holds_no_plaintext(
    kind, tmp_path, master_key, request
):
    if kind == "fs":
        tier = fs_tier(tmp_path / "fs", encryption_key_env=ENV)
    else:
        endpoint = request.getfixturevalue("moto")
        bucket = new_bucket(endpoint)
        tier = obj_tier(endpoint, bucket, encryption_key_env=ENV)
    with Rig([tier]) as rig:
        rig.wait_workers_ready()
        salt = "tenant-" + secrets.token_hex(8)
        rig.tm.set_cache_salt("t-store", salt)
        store(rig, "plain-store")
        store(rig, "t-store")
        for req, who in (("plain-read", None), ("t-read", salt)):
            rig.tm.set_cache_salt(req, who)
            assert resolve(rig, req) == [HIT] * 3
            for k, row in zip(KEYS, served(rig, req)):
                assert np.array_equal(row, payload(k, ROW))
        ns_id = rig.tm.tiers[0].ns_id
        assert ns_id != rig.ns.id()  # the master key's id is part of the namespace
        tenant = tenant_id(salt)
        stored = {}
        for k in KEYS:
            for where, name in (
                ("", relative_name(k)),
                (tenant, relative_name(tenant_key(k, tenant))),
            ):
                sub = f"{tenant_dir(where)}/" if where else ""
                if kind == "fs":
                    with open(tmp_path / "fs" / ns_id / f"{sub}{name}", "rb") as f:
                        data = f.read()
                else:
                    obj = object_prefix("", ns_id) + sub + name
                    data = client(endpoint).get_object(Bucket=bucket, Key=obj)["Body"].read()
                stored[(where, k)] = data
        for (_, k), data in stored.items():
            assert len(data) == HEADER_BYTES + ROW
            assert cf.header_flags(data[:HEADER_BYTES]) & cf.FLAG_SEALED
            plain = payload(k, ROW).tobytes()
            assert plain[:64] not in data and data[HEADER_BYTES:] != plain
        # a random nonce per write: the same bytes under two keys (two tenants) differ everywhere
        a, b = stored[("", KEYS[0])], stored[(tenant, KEYS[0])]
        assert a[HEADER_BYTES:] != b[HEADER_BYTES:]


def fs_chunk(tmp_path, rig: Rig, key: bytes, tenant: str = "") -> str:
    sub = f"{tenant_dir(tenant)}/" if tenant else ""
    return str(tmp_path / "fs" / rig.tm.tiers[0].ns_id / f"{sub}{relative_name(key)}")


def rewrite(path: str, *, flip_at: int | None = None, key: bytes | None = None) -> bytes:
    """Change a chunk file as someone without the key can: flip a payload byte and/or name
    another key in its header, with the header's checksums recomputed (they are unkeyed), so
    only the AES-GCM tag can tell. Returns the new file's bytes."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    head, body = bytes(data[:HEADER_BYTES]), data[HEADER_BYTES:]
    if flip_at is not None:
        body[flip_at] ^= 0x01
    key_len = int.from_bytes(head[10:12], "little")
    old_key = head[56 : 56 + key_len]
    seal = head[cf.SEAL_OFFSET : cf.SEAL_OFFSET + cf.SEAL_BYTES]
    new = cf.build_header(head[16:32], key or old_key, body, None, seal) + bytes(body)
    return new


def test_a_changed_byte_is_a_counted_miss_never_wrong_bytes(tmp_path, master_key):
    with Rig([fs_tier(tmp_path / "fs", encryption_key_env=ENV)]) as rig:
        rig.wait_workers_ready()
        store(rig, "w")
        damaged, forged, _ = KEYS
        p = fs_chunk(tmp_path, rig, damaged)
        with open(p, "r+b") as f:  # damage: the checksum sees it first
            f.seek(HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        p = fs_chunk(tmp_path, rig, forged)
        data = rewrite(p, flip_at=100)
        with open(p, "wb") as f:  # a change that passes the checksums: only the tag sees it
            f.write(data)
        assert resolve(rig, "r") == [MISS, MISS, HIT]
        assert np.array_equal(served(rig, "r", KEYS[2:])[0], payload(KEYS[2], ROW))
        c = counts(rig)
        assert c.get("corrupt_removed") == 1
        assert c.get("decrypt_failures") == 1 and c.get("forged_removed") == 1
        assert not os.path.exists(fs_chunk(tmp_path, rig, damaged))
        assert not os.path.exists(fs_chunk(tmp_path, rig, forged))
        assert resolve(rig, "r3", [forged]) == [MISS]


def test_a_chunk_moved_to_another_tenant_or_key_is_a_miss(tmp_path, master_key):
    with Rig([fs_tier(tmp_path / "fs", encryption_key_env=ENV)]) as rig:
        rig.wait_workers_ready()
        salts = {"a": "a-" + secrets.token_hex(8), "b": "b-" + secrets.token_hex(8)}
        ta, tb = tenant_id(salts["a"]), tenant_id(salts["b"])
        rig.tm.set_cache_salt("a", salts["a"])
        store(rig, "a", KEYS[:1])
        # tenant A's chunk of KEYS[0] copied to where B's chunk of that key would be
        src = fs_chunk(tmp_path, rig, tenant_key(KEYS[0], ta), ta)
        dst = fs_chunk(tmp_path, rig, tenant_key(KEYS[0], tb), tb)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(rewrite(src, key=tenant_key(KEYS[0], tb)))
        # and to A's own place for another key
        other = fs_chunk(tmp_path, rig, tenant_key(KEYS[1], ta), ta)
        os.makedirs(os.path.dirname(other), exist_ok=True)
        with open(other, "wb") as f:
            f.write(rewrite(src, key=tenant_key(KEYS[1], ta)))
        rig.tm.set_cache_salt("b-read", salts["b"])
        assert resolve(rig, "b-read", KEYS[:1]) == [MISS]
        rig.tm.set_cache_salt("a-read", salts["a"])
        assert resolve(rig, "a-read", KEYS[1:2]) == [MISS]
        assert counts(rig).get("decrypt_failures") == 2
        assert not os.path.exists(dst) and not os.path.exists(other)
        rig.tm.set_cache_salt("a-again", salts["a"])
        assert resolve(rig, "a-again", KEYS[:1]) == [HIT]  # the original is untouched
        assert np.array_equal(served(rig, "a-again", KEYS[:1])[0], payload(KEYS[0], ROW))


def test_an_encryption_key_env_that_holds_a_key_or_is_unset_is_refused(tmp_path, monkeypatch):
    from kvoffload.config import parse_config

    with pytest.raises(Exception, match="encryption_key_env: must name the environment variable"):
        parse_config(
            {"cpu_bytes_to_use": 16 * ROW,
             "secondary_tiers": [fs_tier(tmp_path, encryption_key_env="0123456789abcdef=")]}
        )  # fmt: skip
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(Exception, match=f"encryption_key_env: the environment variable {ENV}"):
        Rig([fs_tier(tmp_path / "fs", encryption_key_env=ENV)])


class Stored:
    """The stored bytes of chunks of a Rig's one fs or obj tier, read and written behind its back
    (as someone with write access to the root or bucket can)."""

    def __init__(self, kind: str, rig: Rig, root=None, endpoint: str = "", bucket: str = ""):
        self.kind, self.ns_id = kind, rig.tm.tiers[0].ns_id
        self.root, self.endpoint, self.bucket = root, endpoint, bucket

    def _name(self, key: bytes, tenant: str) -> str:
        sub = f"{tenant_dir(tenant)}/" if tenant else ""
        return f"{self.ns_id}/{sub}{relative_name(key)}"

    def get(self, key: bytes, tenant: str = "") -> bytes | None:
        if self.kind == "fs":
            try:
                with open(f"{self.root}/{self._name(key, tenant)}", "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        s3 = client(self.endpoint)
        try:
            return s3.get_object(Bucket=self.bucket, Key=self._name(key, tenant))["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    def put(self, key: bytes, data: bytes, tenant: str = "") -> None:
        if self.kind == "fs":
            path = f"{self.root}/{self._name(key, tenant)}"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        else:
            client(self.endpoint).put_object(
                Bucket=self.bucket, Key=self._name(key, tenant), Body=data
            )


def rig_and_stored(kind: str, tmp_path, request, encrypts: bool = True) -> tuple[Rig, Stored]:
    key_env = {"encryption_key_env": ENV} if encrypts else {}
    if kind == "fs":
        rig = Rig([fs_tier(tmp_path / "fs", **key_env)])
        return rig, Stored(kind, rig, root=tmp_path / "fs")
    endpoint = request.getfixturevalue("moto")
    bucket = new_bucket(endpoint)
    rig = Rig([obj_tier(endpoint, bucket, **key_env)])
    return rig, Stored(kind, rig, endpoint=endpoint, bucket=bucket)


SALT, NONCE, TAG = 16, 12, 16
LABEL = b"kvoffload chunk seal v2\x00"


def chunk_aead(secret: bytes, ns_id: str, tenant: str, salt: bytes) -> AESGCM:
    """The AES-GCM of one stored chunk as DESIGN.md ("Encryption at rest") documents its key:
    HKDF-SHA256 of the master key, salt "kvoffload chunk seal v2", info the label, namespace id,
    tenant and the chunk's own salt: rebuilt here with cryptography's HKDF, not the tier's code."""
    info = LABEL + bytes.fromhex(ns_id) + tenant.encode() + b"\x00" + salt
    kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvoffload chunk seal v2", info=info)
    return AESGCM(kdf.derive(secret))


@pytest.mark.parametrize("kind", ["fs", "obj"])
def test_each_chunk_is_encrypted_under_a_key_of_its_own(kind, tmp_path, master_key, request):
    """Review of issue 27: one AES-GCM key per namespace and tenant with random 96-bit nonces
    reaches NIST SP 800-38D's bound (2^32 writes per key) on a busy tenant. Each stored chunk now
    carries a random salt that its key is derived from (HKDF with namespace and tenant): the
    derivation rebuilt from the stored salt decrypts each chunk, and no other chunk's key does."""
    rig, stored = rig_and_stored(kind, tmp_path, request)
    with rig:
        rig.wait_workers_ready()
        salt = "tenant-" + secrets.token_hex(8)
        rig.tm.set_cache_salt("t-store", salt)
        store(rig, "plain-store")
        store(rig, "t-store")
        tenant = tenant_id(salt)
        secret = os.environb[ENV.encode()]
        aeads = {}
        for who in ("", tenant):
            for k in KEYS:
                name = tenant_key(k, who) if who else k
                data = stored.get(name, who)
                assert data is not None
                head = data[:HEADER_BYTES]
                assert struct.unpack_from("<H", head, 8)[0] == 2  # format 2: encrypted
                record = head[SEAL_OFFSET : SEAL_OFFSET + SALT + NONCE + TAG]
                aad = LABEL + bytes.fromhex(stored.ns_id) + who.encode() + b"\x00" + name
                nonce, sealed = record[SALT : SALT + NONCE], data[HEADER_BYTES:] + record[-TAG:]
                aead = chunk_aead(secret, stored.ns_id, who, record[:SALT])
                assert aead.decrypt(nonce, sealed, aad) == payload(k, ROW).tobytes()
                aeads[(who, k)] = (aead, nonce, sealed, aad)
        # the same (tenant, chunk) under every other chunk's key: the tag never verifies
        for mine, (_, nonce, sealed, aad) in aeads.items():
            for other, (aead, _, _, _) in aeads.items():
                if other != mine:
                    with pytest.raises(InvalidTag):
                        aead.decrypt(nonce, sealed, aad)


def v1_sealed_chunk(secret: bytes, ns_id: str, key: bytes, row: np.ndarray) -> bytes:
    """A chunk as the first encrypting version stored it (format 1, flag 2): AES-GCM under the
    key HKDF gave the namespace and tenant (salt "kvoffload chunk seal v1"), nonce and tag in the
    header at 4036, the checksum over the ciphertext only."""
    aead = AESGCM(
        HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=b"kvoffload chunk seal v1",
            info=f"{ns_id}/-".encode(),
        ).derive(secret)
    )
    nonce = os.urandom(12)
    aad = b"kvoffload chunk seal v1\x00" + bytes.fromhex(ns_id) + b"\x00" + key
    sealed = aead.encrypt(nonce, row.tobytes(), aad)
    body, tag = sealed[:-16], sealed[-16:]
    fixed = struct.pack(
        "<8sHHI16sQQ", b"KVOCHUNK", 1, len(key), cf.FLAG_SEALED, bytes.fromhex(ns_id),
        len(body), xxhash.xxh3_64_intdigest(body),
    )  # fmt: skip
    head = fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed)) + key
    head += bytes(4036 - len(head)) + nonce + tag
    return head + bytes(HEADER_BYTES - len(head)) + body


@pytest.mark.parametrize("kind", ["fs", "obj"])
def test_a_chunk_encrypted_in_the_format_before_per_chunk_keys_is_a_counted_miss_then_stored_anew(
    kind, tmp_path, master_key, request
):
    """Chunks the first encrypting version wrote (one key per tenant, format 1) are not read:
    each is a miss counted corrupt and removed, never an exception or its bytes; the chunk is
    then stored again in the current format and read back exact."""
    rig, stored = rig_and_stored(kind, tmp_path, request)
    with rig:
        rig.wait_workers_ready()
        secret = os.environb[ENV.encode()]
        for k in KEYS:
            stored.put(k, v1_sealed_chunk(secret, stored.ns_id, k, payload(k, ROW)))
        assert resolve(rig, "old") == [MISS] * 3
        c = counts(rig)
        assert c.get("corrupt_removed") == 3 and c.get("checksum_failures") == 3
        assert not c.get("decrypt_failures") and not c.get("forged_removed")
        assert all(stored.get(k) is None for k in KEYS)
        store(rig, "again")
        assert all(struct.unpack_from("<H", stored.get(k), 8)[0] == 2 for k in KEYS)
        assert resolve(rig, "new") == [HIT] * 3
        for k, row in zip(KEYS, served(rig, "new")):
            assert np.array_equal(row, payload(k, ROW))


@pytest.mark.parametrize("kind", ["fs", "obj"])
def test_c06_damage_to_the_salt_nonce_or_tag_is_a_checksum_failure_not_a_forgery(
    kind, tmp_path, master_key, request
):
    """Review of issue 27: the checksum covered the ciphertext only, so bit rot in the nonce or
    tag was counted as forged (a tag failure), as if someone had written the storage. The
    checksum now covers the whole stored record: a bit flipped in the salt, the nonce or the tag
    is a checksum failure (corrupt), a miss; the copy is removed and serves no bytes."""
    rig, stored = rig_and_stored(kind, tmp_path, request)
    with rig:
        rig.wait_workers_ready()
        store(rig, "w")
        for k, at in zip(KEYS, (SEAL_OFFSET, SEAL_OFFSET + SALT + 5, SEAL_OFFSET + SALT + NONCE)):
            data = bytearray(stored.get(k))
            data[at] ^= 0x10  # salt, nonce, tag
            stored.put(k, bytes(data))
        rig.arena.rows[:] = 0  # the rows the chunks were stored from
        assert resolve(rig, "r") == [MISS] * 3
        c = counts(rig)
        assert c.get("checksum_failures") == 3 and c.get("corrupt_removed") == 3, c
        assert not c.get("decrypt_failures") and not c.get("forged_removed"), c
        assert all(stored.get(k) is None for k in KEYS)
        assert not any(np.array_equal(row, payload(k, ROW)) for k in KEYS for row in rig.arena.rows)


@pytest.mark.parametrize("kind", ["fs", "obj"])
def test_a_chunk_with_a_valid_checksum_under_another_master_key_is_forged(
    kind, tmp_path, master_key, request
):
    """Someone with write access who encrypts a chunk under another master key and computes its
    checksum (unkeyed): the checksum passes, the tag does not; counted forged (decrypt_failures),
    a miss, removed, its bytes never served."""
    rig, stored = rig_and_stored(kind, tmp_path, request)
    with rig:
        rig.wait_workers_ready()
        store(rig, "w", KEYS[:1])
        other = Sealer(secrets.token_bytes(32), stored.ns_id)  # another master key
        evil = np.full(ROW, 0x5A, dtype=np.uint8)
        ciphertext = memoryview(bytearray(ROW + 16))
        record = other.seal(KEYS[0], evil, ciphertext)
        body = ciphertext[:ROW]
        head = cf.build_header(bytes.fromhex(stored.ns_id), KEYS[0], body, None, record)
        stored.put(KEYS[0], head + bytes(body))
        rig.arena.rows[:] = 0
        assert resolve(rig, "r", KEYS[:1]) == [MISS]
        c = counts(rig)
        assert c.get("decrypt_failures") == 1 and c.get("forged_removed") == 1, c
        assert not c.get("checksum_failures") and not c.get("corrupt_removed"), c
        assert stored.get(KEYS[0]) is None
        assert not any(np.array_equal(row, evil) for row in rig.arena.rows)


@pytest.mark.parametrize("kind", ["fs", "obj"])
@pytest.mark.parametrize("tier_encrypts", [False, True])
def test_a_chunk_on_the_wrong_side_of_the_key_is_a_miss_counted_as_what_it_is(
    kind, tier_encrypts, tmp_path, master_key, request
):
    """Instances with and without an encryption key never share a place (the key's id is in the
    namespace), so such a chunk was put there by hand or by someone else. An encrypted chunk in
    a tier without a key: not this tier's to read, counted corrupt (no decrypt failure); a chunk
    in the clear in a tier that encrypts: written without the key, counted forged and a decrypt
    failure. Either way a miss, removed, its bytes never served."""
    rig, stored = rig_and_stored(kind, tmp_path, request, encrypts=tier_encrypts)
    with rig:
        rig.wait_workers_ready()
        ns = bytes.fromhex(stored.ns_id)
        row = np.full(ROW, 0x3C, dtype=np.uint8)
        if tier_encrypts:  # in the clear, with a good checksum
            chunk = cf.build_header(ns, KEYS[0], row) + row.tobytes()
        else:  # encrypted under the master key the test holds
            sealed = memoryview(bytearray(ROW + TAG))
            record = Sealer(os.environb[ENV.encode()], stored.ns_id).seal(KEYS[0], row, sealed)
            chunk = cf.build_header(ns, KEYS[0], sealed[:ROW], None, record) + bytes(sealed[:ROW])
        stored.put(KEYS[0], chunk)
        rig.arena.rows[:] = 0
        assert resolve(rig, "r", KEYS[:1]) == [MISS]
        c = counts(rig)
        if tier_encrypts:
            assert c.get("decrypt_failures") == 1 and c.get("forged_removed") == 1, c
            assert not c.get("corrupt_removed"), c
        else:
            assert c.get("corrupt_removed") == 1, c
            assert not c.get("decrypt_failures") and not c.get("forged_removed"), c
        assert stored.get(KEYS[0]) is None
        assert not any(np.array_equal(r, row) for r in rig.arena.rows)
