"""Least privilege for the processes kvoffload starts: tier workers and the arena janitor get an
allow-listed environment (``kvoffload.ipc.childenv``), read back from ``/proc/<pid>/environ`` of
the real processes, which still do their work with it."""

from __future__ import annotations

import fnmatch

import numpy as np
import psutil
import pytest
from helpers import HIT, Rig, fs_tier, keys_for, payload, wait_until
from s3 import new_bucket, obj_tier, start_moto

from kvoffload.config import parse_config, secret_env_names
from kvoffload.ipc.childenv import BASE_ENV, CLOUD_ENV, child_environment, withhold
from kvoffload.ipc.names import WORKER_MARKER_FD_ENV, WORKER_SPEC_ENV

#: What an engine's environment holds beside what its children need.
SECRETS = {
    "KVOFFLOAD_P2P_SECRET": "p2p-shared-secret",
    "HF_TOKEN": "hf_not_for_workers",
    "OPENAI_API_KEY": "sk-not-for-workers",
}
CLOUD = {
    "AWS_ACCESS_KEY_ID": "AKIAENGINEONLY",
    "AWS_SECRET_ACCESS_KEY": "engine-cloud-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
PLAIN = {"PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8", "KVOFFLOAD_LOG_LEVEL": "INFO"}
OWN = (WORKER_SPEC_ENV, WORKER_MARKER_FD_ENV)


@pytest.fixture
def engine_env(monkeypatch):
    for k, v in {**SECRETS, **CLOUD, **PLAIN}.items():
        monkeypatch.setenv(k, v)


def environ_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if item)


def admitted(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def janitor_of(arena_name: str) -> int:
    """The pid of the janitor process watching arena ``arena_name``."""

    def find():
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "kvoffload.ipc.janitor" in cmd and arena_name in cmd:
                return p.pid
        return None

    return wait_until(find, what=f"the janitor of {arena_name}")


def round_trip(rig: Rig) -> None:
    """Store 4 chunks, push them out of the host tier, and load them back (from the first tier
    that holds them), bit-exact."""
    keys = keys_for(4)
    rig.store(keys)
    rig.evict_all()
    assert rig.resolve(keys) == [HIT] * 4
    for k, row in zip(keys, rig.read(keys)):
        assert np.array_equal(row, payload(k))


def test_fs_workers_and_the_janitor_get_no_secret_and_no_cloud_credentials(engine_env, tmp_path):
    """An engine whose environment holds the p2p secret, cloud credentials and other tokens:
    its fs workers and its arena's janitor see none of them, only the base allow-list (the
    interpreter's, locale, kvoffload's log level) and the worker's own variables; the workers
    store and load chunks with it."""
    with Rig([fs_tier(tmp_path / "fs")]) as rig:
        rig.wait_workers_ready()
        pids = [p for ps in rig.fs.worker_pids().values() for p in ps]
        assert len(pids) == 2
        children = {pid: environ_of(pid) for pid in pids}
        children[janitor_of(rig.arena.name)] = janitor = environ_of(janitor_of(rig.arena.name))
        for pid, env in children.items():
            leaked = sorted(set(env) & {*SECRETS, *CLOUD})
            assert not leaked, f"process {pid} got {leaked}"
            assert all(admitted(k, BASE_ENV) or k in OWN for k in env), sorted(env)
            assert {k: env.get(k) for k in PLAIN} == PLAIN
        assert not set(janitor) & set(OWN)
        for pid in pids:
            assert WORKER_SPEC_ENV in children[pid]
        round_trip(rig)


def test_obj_workers_get_cloud_credentials_and_still_no_p2p_secret(engine_env, tmp_path):
    """Beside an fs tier, an obj tier's workers get the boto3 chain's variables from the engine's
    environment (and store and load, the obj tier first); neither tier's workers get the p2p
    secret or any other variable outside their allow-list, and the fs workers get no cloud
    credential."""
    srv, endpoint = start_moto()
    try:
        tiers = [obj_tier(endpoint, new_bucket(endpoint)), fs_tier(tmp_path / "fs")]
        with Rig(tiers) as rig:
            wait_until(lambda: all(t.workers_ready() for t in rig.tm.tiers), step=rig.tm.poll)
            obj, fs_tier_ = rig.tm.tiers
            for pid in [p for ps in obj.worker_pids().values() for p in ps]:
                env = environ_of(pid)
                assert {k: env.get(k) for k in CLOUD} == CLOUD
                assert not set(env) & set(SECRETS)
                assert all(admitted(k, (*BASE_ENV, *CLOUD_ENV)) or k in OWN for k in env)
            for pid in [p for ps in fs_tier_.worker_pids().values() for p in ps]:
                assert not set(environ_of(pid)) & {*SECRETS, *CLOUD}
            round_trip(rig)
    finally:
        srv.stop()


def test_a_p2p_tiers_secret_env_is_withheld_even_where_a_pattern_admits_it():
    """A p2p tier whose ``secret_env`` names a variable an obj worker's patterns admit
    (``AWS_...``): the configuration names it, and once withheld (as the tiering manager does at
    start) no child environment carries it; the default ``KVOFFLOAD_P2P_SECRET`` never."""
    cfg = parse_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [{"type": "p2p", "peers": ["node-b:5710"], "secret_env": "AWS_P2P"}],
        }
    )
    assert secret_env_names(cfg) == ["AWS_P2P"]
    withhold(*secret_env_names(cfg))
    engine = {"AWS_P2P": "x", "AWS_REGION": "eu-west-1", "KVOFFLOAD_P2P_SECRET": "y", "PATH": "/b"}
    assert child_environment(CLOUD_ENV, {"SPEC": "z"}, environ=engine) == {
        "AWS_REGION": "eu-west-1",
        "PATH": "/b",
        "SPEC": "z",
    }
    assert child_environment(environ=engine) == {"PATH": "/b"}


def test_an_integrity_key_reaches_its_own_tiers_workers_only(engine_env, monkeypatch, tmp_path):
    """A tier's integrity key is withheld from every child (its variable is a ``*_env`` key) but
    that tier's own workers, which compute the chunks' MACs: a keyed fs tier beside an unkeyed
    one stores and loads with its key; the unkeyed tier's workers and the janitor never see it."""
    monkeypatch.setenv("KVOFFLOAD_TEST_INTEGRITY_KEY", "k" * 32)
    keyed = fs_tier(tmp_path / "keyed", integrity_key_env="KVOFFLOAD_TEST_INTEGRITY_KEY")
    with Rig([keyed, {**fs_tier(tmp_path / "plain"), "name": "plain"}]) as rig:
        wait_until(lambda: all(t.workers_ready() for t in rig.tm.tiers), step=rig.tm.poll)
        keyed_tier, plain_tier = rig.tm.tiers
        for pid in [p for ps in keyed_tier.worker_pids().values() for p in ps]:
            env = environ_of(pid)
            assert env.get("KVOFFLOAD_TEST_INTEGRITY_KEY") == "k" * 32
            assert not set(env) & {*SECRETS, *CLOUD}
        others = [p for ps in plain_tier.worker_pids().values() for p in ps]
        for pid in [*others, janitor_of(rig.arena.name)]:
            assert "KVOFFLOAD_TEST_INTEGRITY_KEY" not in environ_of(pid)
        round_trip(rig)
