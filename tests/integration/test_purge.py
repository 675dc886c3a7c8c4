"""``kvoffload purge`` on real tiers while an engine runs: an fs root and an obj bucket (moto on
loopback) that three tenants (two salts and the unsalted) share, each storing the same engine keys
with its own bytes. ``--salt`` removes that tenant's chunks from both tiers and nothing of the
others, the running engine then misses them cleanly and still serves the others' bytes;
``--namespace`` removes a namespace from both tiers and nothing of another."""

from __future__ import annotations

import json
import os
import secrets
import time

import numpy as np
import pytest
import xxhash
from helpers import HIT, MISS, PENDING, RETRY, ROW, Rig, fs_tier, keys_for, namespace, patience
from s3 import client, new_bucket, obj_tier, start_moto
from unit.test_ops_commands import run_cli

from kvoffload.tenants import tenant_id
from kvoffload.workers.chunkfile import HEADER_BYTES, tenant_dir
from kvoffload.workers.obj_io import object_prefix

FILE_BYTES = HEADER_BYTES + ROW
KEYS = keys_for(3, seed=41)


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def row_of(key: bytes, who: str) -> np.ndarray:
    """Tenant ``who``'s bytes for ``key`` (each tenant stores the same keys, its own bytes)."""
    seed = xxhash.xxh3_64_intdigest(key + who.encode())
    return np.random.default_rng(seed).integers(0, 256, ROW, dtype=np.uint8)


def store_as(rig: Rig, req: str, salt: str | None, who: str) -> None:
    rig.tm.set_cache_salt(req, salt)
    plan = rig.tm.prepare_store(KEYS, req)
    assert plan is not None and plan.keys == KEYS
    for k, s in zip(plan.keys, plan.slots):
        rig.arena.rows[s] = row_of(k, who)
    rig.tm.complete_store(plan.keys, True, req)
    assert rig.tm.wait_idle(patience(120)), "tier jobs did not finish"


def resolve(rig: Rig, req: str) -> list:
    deadline = time.monotonic() + patience(120)
    while True:
        res = [rig.tm.lookup(k, req) for k in KEYS]
        if not any(r in (RETRY, PENDING) for r in res):
            return res
        assert time.monotonic() < deadline, "lookups did not settle"
        rig.tm.step()
        time.sleep(0.002)


def fs_chunks(ns_dir: str) -> dict[str, int]:
    """Chunk files below ``ns_dir`` by where they sit: ``""`` (unsalted) or ``t-<tenant id>``."""
    out: dict[str, int] = {}
    for d, _, names in os.walk(ns_dir):
        rel = os.path.relpath(d, ns_dir).split(os.sep)
        where = rel[0] if rel[0].startswith("t-") else ""
        out[where] = out.get(where, 0) + sum(n.endswith(".kv") for n in names)
    return {k: v for k, v in out.items() if v}


def obj_chunks(endpoint: str, bucket: str, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    pages = client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) :]
            if rel.endswith(".kv"):
                where = rel.split("/", 1)[0] if rel.startswith("t-") else ""
                out[where] = out.get(where, 0) + 1
    return out


def test_purge_salt_removes_that_tenant_from_every_tier_and_nothing_else(tmp_path, moto):
    bucket = new_bucket(moto)
    tiers = [fs_tier(tmp_path / "fs"), obj_tier(moto, bucket)]
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers}))
    salts = {"a": "a-" + secrets.token_hex(8), "b": "b-" + secrets.token_hex(8)}
    ta, tb = tenant_dir(tenant_id(salts["a"])), tenant_dir(tenant_id(salts["b"]))
    with Rig(tiers, num_slots=16) as rig:
        rig.wait_workers_ready()
        for who in ("a", "b", ""):
            store_as(rig, f"{who}-store", salts.get(who), who)
        ns_dir = os.path.join(tmp_path / "fs", rig.ns.id())
        prefix = object_prefix("", rig.ns.id())
        assert fs_chunks(ns_dir) == {ta: 3, tb: 3, "": 3}
        assert obj_chunks(moto, bucket, prefix) == {ta: 3, tb: 3, "": 3}
        res = run_cli("inspect", str(tmp_path / "fs"), "--json")  # tenants' chunks counted
        assert res.exit_code == 0, res.output
        (ns,) = json.loads(res.output)["namespaces"]
        assert (ns["chunks"], ns["bytes"]) == (9, 9 * FILE_BYTES)

        res = run_cli("purge", str(cfg), "--json", env={"KVOFFLOAD_PURGE_SALT": salts["a"]})
        assert res.exit_code == 0, res.output
        assert salts["a"] not in res.output  # the salt is a secret: only its tenant id shows
        report = json.loads(res.output)
        assert report["what"] == "tenant" and report["id"] == tenant_id(salts["a"])
        by_type = {t["type"]: t for t in report["tiers"]}
        for t in by_type.values():
            assert (t["namespaces"], t["chunks"], t["bytes"], t["errors"]) == (
                1,
                3,
                3 * FILE_BYTES,
                [],
            )
        assert fs_chunks(ns_dir) == {tb: 3, "": 3}
        assert not os.path.exists(os.path.join(ns_dir, ta))
        assert obj_chunks(moto, bucket, prefix) == {tb: 3, "": 3}

        # the running engine: A's chunks (the tiers still believe they hold them) are a clean
        # miss; B's and the unsalted ones are served with exactly their bytes
        rig.tm.host.remove(list(rig.tm.host.index))  # served by the tiers from here on
        rig.tm.set_cache_salt("a-read", salts["a"])
        assert resolve(rig, "a-read") == [MISS] * 3
        for who in ("b", ""):
            req = f"{who}-read"
            rig.tm.set_cache_salt(req, salts.get(who))
            assert resolve(rig, req) == [HIT] * 3
            slots = rig.tm.prepare_load(KEYS, req)
            for k, s in zip(KEYS, slots):
                assert np.array_equal(rig.arena.rows[s], row_of(k, who))
            rig.tm.complete_load(KEYS, req)


def test_purge_namespace_removes_it_from_every_tier_and_no_other(tmp_path, moto):
    bucket = new_bucket(moto)
    tiers = [fs_tier(tmp_path / "fs"), obj_tier(moto, bucket)]
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers}))
    ids = []
    for model in ("test/one", "test/two"):
        with Rig(tiers, num_slots=16, ns=namespace(model=model)) as rig:
            rig.wait_workers_ready()
            store_as(rig, "t", "salt-" + model, "t")
            store_as(rig, "u", None, "u")
            ids.append(rig.ns.id())
    gone, kept = ids
    res = run_cli("purge", str(cfg), "--namespace", gone, "--json")
    assert res.exit_code == 0, res.output
    for t in json.loads(res.output)["tiers"]:
        assert (t["namespaces"], t["chunks"], t["bytes"], t["errors"]) == (1, 6, 6 * FILE_BYTES, [])
        assert t["other_files"] == 1  # the namespace's config.json
    assert not os.path.exists(tmp_path / "fs" / gone)
    assert obj_chunks(moto, bucket, object_prefix("", gone)) == {}
    assert sum(fs_chunks(str(tmp_path / "fs" / kept)).values()) == 6
    assert sum(obj_chunks(moto, bucket, object_prefix("", kept)).values()) == 6


def test_with_tenant_key_env_ids_depend_on_the_secret_and_purge_needs_it(tmp_path, monkeypatch):
    """With ``tenant_key_env``, a tenant's directory is named by an id keyed by the secret (not the
    one anyone can compute from a guessed salt); ``purge`` without the variable is refused, naming
    the setting, and with it removes the tenant."""
    env = "KVOFFLOAD_TEST_TENANT_KEY"
    secret = secrets.token_hex(32)
    monkeypatch.setenv(env, secret)
    tiers = [fs_tier(tmp_path / "fs")]
    cfg = tmp_path / "kv.json"
    cfg.write_text(
        json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers, "tenant_key_env": env})
    )
    salt = "s-" + secrets.token_hex(8)
    keyed = tenant_dir(tenant_id(salt, secret.encode()))
    assert keyed != tenant_dir(tenant_id(salt))
    with Rig(tiers, num_slots=16, tenant_key_env=env) as rig:
        rig.wait_workers_ready()
        store_as(rig, "w", salt, "w")
        ns_dir = os.path.join(tmp_path / "fs", rig.ns.id())
        assert fs_chunks(ns_dir) == {keyed: 3}
    monkeypatch.delenv(env)
    with pytest.raises(ValueError, match=f"tenant_key_env: the environment variable {env}"):
        Rig(tiers, num_slots=16, tenant_key_env=env)  # an engine does not start without it
    res = run_cli("purge", str(cfg), "--salt", salt)
    assert res.exit_code == 2 and f"tenant_key_env: the environment variable {env}" in res.output
    monkeypatch.setenv(env, secret)
    res = run_cli("purge", str(cfg), "--salt", salt, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["tiers"][0]["chunks"] == 3
    assert fs_chunks(ns_dir) == {}


def test_purge_bad_input_exits_2(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": []}))
    for args, message in (
        ([], "exactly one of --salt"),
        (["--salt", "s", "--namespace", "0" * 32], "exactly one of --salt"),
        (["--namespace", "../x"], "32 lowercase hex digits"),
        (["--salt", "s"], "no persistent tier"),
    ):
        res = run_cli("purge", str(cfg), *args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)


def test_purge_follows_a_linked_root_as_the_engine_does(tmp_path):
    """Review 6: the engine resolves a root_dir that is a link; purge refused it (exit 2)."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    tiers = [fs_tier(link)]
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers}))
    salt = "s-" + secrets.token_hex(8)
    with Rig(tiers, num_slots=16) as rig:
        store_as(rig, "s-store", salt, "s")
        ns_dir = os.path.join(real, rig.ns.id())
        assert fs_chunks(ns_dir) == {tenant_dir(tenant_id(salt)): 3}
    res = run_cli("purge", str(cfg), "--json", env={"KVOFFLOAD_PURGE_SALT": salt})
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.output)["tiers"]
    assert (t["chunks"], t["errors"]) == (3, [])
    assert fs_chunks(ns_dir) == {}


def test_a_tier_purge_cannot_reach_is_reported_and_the_others_are_purged(tmp_path, moto):
    """Review 6: one tier's failure aborted the purge of the tiers after it."""
    bad_file = tmp_path / "not-a-dir"
    bad_file.write_text("x")
    good = tmp_path / "fs"
    tiers = [fs_tier(good)]
    salt = "s-" + secrets.token_hex(8)
    with Rig(tiers, num_slots=16) as rig:
        store_as(rig, "s-store", salt, "s")
        ns_dir = os.path.join(good, rig.ns.id())
    bad_obj = obj_tier(moto, "no-such-bucket-" + secrets.token_hex(4))
    listed = [fs_tier(bad_file), bad_obj, *tiers]
    for i, t in enumerate(listed):
        t["name"] = f"t{i}"
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": listed}))
    res = run_cli("purge", str(cfg), "--json", env={"KVOFFLOAD_PURGE_SALT": salt})
    assert res.exit_code == 1, res.output
    bad_fs, bad_bucket, fine = json.loads(res.output)["tiers"]
    assert bad_fs["errors"] and "not-a-dir" in bad_fs["errors"][0]
    assert bad_bucket["errors"] and "NoSuchBucket" in bad_bucket["errors"][0]
    assert (fine["chunks"], fine["errors"]) == (3, [])
    assert fs_chunks(ns_dir) == {}


def test_purge_of_a_directory_nested_past_any_chunk_neither_recurses_nor_stops(tmp_path):
    """Review 6: 1,200 directories nested below a tenant's directory made purge die of a
    RecursionError mid-purge. The chunks are removed; what is deeper than any chunk is left and
    reported."""
    from kvoffload.tools.purge import purge_fs

    tid = tenant_id("victim")
    tdir = tmp_path / ("1" * 32) / tenant_dir(tid)
    (tdir / "aa" / "bb").mkdir(parents=True)
    (tdir / "aa" / "bb" / ("00" * 20 + ".kv")).write_bytes(b"x" * 10)
    fd = os.open(tdir, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1200):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    try:
        out = purge_fs("fs", str(tmp_path), tenant=tid)
        assert (out.chunks, out.bytes) == (1, 10)
        assert out.errors and "nested deeper than any chunk" in out.errors[0]
        assert not (tdir / "aa").exists()
    finally:  # pytest's own removal recurses: take the chain down from its deepest end
        for depth in range(1200, 0, -1):
            path = os.path.join(tdir, *(["d"] * depth))
            if os.path.isdir(path):
                os.rmdir(path)


def test_purge_removes_every_version_from_a_versioned_bucket(tmp_path, moto):
    """Review 6: on a bucket with versioning, DeleteObjects without version ids only adds delete
    markers: the tenant's chunks stayed readable as older versions."""
    bucket = new_bucket(moto)
    client(moto).put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    tiers = [obj_tier(moto, bucket)]
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers}))
    salt = "s-" + secrets.token_hex(8)
    with Rig(tiers, num_slots=16) as rig:
        rig.wait_workers_ready()
        store_as(rig, "s-store", salt, "s")
        prefix = object_prefix("", rig.ns.id()) + tenant_dir(tenant_id(salt)) + "/"
    res = run_cli("purge", str(cfg), "--json", env={"KVOFFLOAD_PURGE_SALT": salt})
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.output)["tiers"]
    assert (t["chunks"], t["errors"]) == (3, [])
    assert t["old_versions"] >= 3
    left = client(moto).list_object_versions(Bucket=bucket, Prefix=prefix)
    assert not left.get("Versions") and not left.get("DeleteMarkers")


OUT_OF_TREE_TIERS = '''
from kvoffload.tiers.memory import MemoryTier
from kvoffload.tiers.purging import TierPurge


class VaultTier(MemoryTier):
    """A persistent out-of-tree tier: its storage is a directory of files named by tenant."""

    @classmethod
    def purge_storage(cls, name, config, *, tenant, namespace):
        import os

        vault = os.environ["VAULT_DIR"]
        out = TierPurge(tier=name, type="VaultTier", target=vault)
        for f in sorted(os.listdir(vault)):
            if f.startswith((tenant or namespace) + "-"):
                out.bytes += os.path.getsize(os.path.join(vault, f))
                os.unlink(os.path.join(vault, f))
                out.chunks += 1
        return out


class BrokenTier(MemoryTier):
    @classmethod
    def purge_storage(cls, name, config, *, tenant, namespace):
        raise RuntimeError("the vault is sealed")


class LyingTier(MemoryTier):
    @classmethod
    def purge_storage(cls, name, config, *, tenant, namespace):
        return {"chunks": 99}
'''


def test_purge_asks_each_out_of_tree_tier_its_own_way_and_reports_a_broken_one(
    tmp_path, monkeypatch
):
    """An out-of-tree tier is purged through its class's ``purge_storage``: one that answers is
    counted beside the fs tier; one whose hook raises, or answers something else than a
    TierPurge, is that tier's error (exit 1), not a traceback, and the others are purged all the
    same; the built-in memory tier is skipped (nothing of it outlives an engine)."""
    (tmp_path / "vault_tiers.py").write_text(OUT_OF_TREE_TIERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    salt = "v-" + secrets.token_hex(8)
    tid = tenant_id(salt)
    vault = tmp_path / "vault"
    vault.mkdir()
    for name in (f"{tid}-1", f"{tid}-2", "another-1"):
        (vault / name).write_bytes(b"x" * 100)
    monkeypatch.setenv("VAULT_DIR", str(vault))
    ours = {"module_path": "vault_tiers", "max_bytes": 1 << 20}
    tiers = [
        {**ours, "type": "VaultTier", "name": "vault"},
        {**ours, "type": "BrokenTier", "name": "broken"},
        {**ours, "type": "LyingTier", "name": "lying"},
        {"type": "memory", "name": "mem", "max_bytes": 1 << 20},
        {**fs_tier(tmp_path / "fs"), "name": "disk"},
    ]
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 16 * ROW, "secondary_tiers": tiers}))
    with Rig(tiers[-1:], num_slots=16) as rig:
        store_as(rig, "v-store", salt, "v")
        ns_dir = os.path.join(tmp_path / "fs", rig.ns.id())
        res = run_cli("purge", str(cfg), "--json", env={"KVOFFLOAD_PURGE_SALT": salt})
    assert res.exit_code == 1, res.output
    report = json.loads(res.output)
    by_name = {t["tier"]: t for t in report["tiers"]}
    assert (by_name["vault"]["chunks"], by_name["vault"]["bytes"]) == (2, 200)
    assert os.listdir(vault) == ["another-1"]
    assert "RuntimeError: the vault is sealed" in by_name["broken"]["errors"][0]
    assert "not a TierPurge" in by_name["lying"]["errors"][0]
    assert (by_name["disk"]["chunks"], by_name["disk"]["errors"]) == (3, [])
    assert fs_chunks(ns_dir) == {}
    assert report["skipped"] == ["mem (memory)"]
