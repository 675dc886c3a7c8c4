"""The tier contract suite (:mod:`kvoffload.testing.tier_contract`) run for every built-in tier:
memory (the model for out-of-tree tiers), fs (real files), obj (moto on loopback) and p2p (a peer
instance in its own process on loopback, which every store is pushed to and every load read back
from), each with real worker processes where the tier has them. A new tier adds one branch to the
fixture."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TESTS_DIR
from pipe_commands import PipeClient
from s3 import client, new_bucket, obj_tier, start_moto

from kvoffload.testing.tier_contract import ROW_BYTES, WAIT_S, TierContract, TierUnderTest
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name
from kvoffload.workers.obj_io import object_prefix


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def memory_tier() -> TierUnderTest:
    def config(capacity_chunks=None):
        n = capacity_chunks or 1024
        return {"type": "memory", "max_bytes": n * 16384}

    def lose(tier, key):
        assert tier.lose(key)

    return TierUnderTest(config=config, medium="CPU", locality="LOCAL", evicts=True, lose=lose)


def fs_tier(root) -> TierUnderTest:
    def config(capacity_chunks=None):
        cfg = {
            "type": "fs",
            "root_dir": str(root),
            "read_workers": 1,
            "write_workers": 1,
            "job_timeout_s": 60.0,
            "min_free_fraction": 0.0,  # helpers.NO_FLOOR: not this disk's free space
        }
        if capacity_chunks is not None:
            cfg["max_bytes"] = capacity_chunks * (HEADER_BYTES + 16384)
        return cfg

    def lose(tier, key):
        os.remove(os.path.join(str(root), tier.namespace.id(), relative_name(key)))

    return TierUnderTest(
        config=config,
        medium="STORAGE",
        locality="LOCAL",
        runs_workers=True,
        evicts=True,
        lose=lose,
        chunk_bytes=HEADER_BYTES + 16384,  # a chunk file: header page and row
        persistent=True,
    )


def obj_tier_under_test(endpoint: str, bucket: str) -> TierUnderTest:
    def config(capacity_chunks=None):
        cfg = obj_tier(endpoint, bucket, job_timeout_s=60.0)
        if capacity_chunks is not None:  # objects are chunk files: header + payload
            cfg["max_bytes"] = capacity_chunks * (HEADER_BYTES + 16384)
        return cfg

    def lose(tier, key):
        name = object_prefix(tier.config.prefix, tier.namespace.id()) + relative_name(key)
        client(endpoint).delete_object(Bucket=bucket, Key=name)

    return TierUnderTest(
        config=config,
        medium="STORAGE",
        locality="REMOTE",
        runs_workers=True,
        evicts=True,
        lose=lose,
        chunk_bytes=HEADER_BYTES + 16384,  # an object: header page and row
        persistent=True,
    )


P2P_SECRET = "contract-" + secrets.token_hex(8)
P2P_INSTANCE = Path(TESTS_DIR) / "p2p_instance.py"


class PeerInstance(PipeClient):
    """The p2p tier's peer: a kvoffload instance with a p2p tier in its own process
    (``tests/p2p_instance.py``), in the contract engines' namespace, admitting pushes."""

    patience_s = WAIT_S

    def __init__(self, name: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(P2P_INSTANCE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        tier = {"type": "p2p", "port": 0, "transport": "tcp", "secret": P2P_SECRET}
        reply = self.ok(
            "init",
            tiers=[{**tier, "quota_chunks": 1024}],
            num_slots=64,
            row_bytes=ROW_BYTES,
            name=name,
            model="kvoffload/tier-contract",  # the contract engines' namespace
        )
        self.addr: str = reply["advertise"]
        self.worker_pid: int = reply["worker_pid"]
        self.tier = {**tier, "peers": [self.addr], "push": "always"}

    def stop(self) -> None:
        self.stop_process()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker_pid, signal.SIGKILL)


def p2p_tier(peer: PeerInstance) -> TierUnderTest:
    """Every store is pushed to ``peer`` (``push: always``; it pulls the chunks into its host
    tier), and a chunk dropped from the host tier is read back from it. No capacity bound of its
    own, no kvoffload worker pool (its peer worker is another kind)."""

    def config(capacity_chunks=None):
        return dict(peer.tier)

    def lose(tier, key):
        assert peer.ok("drop", keys=[key.hex()])["removed"] == 1

    return TierUnderTest(
        config=config,
        medium="PEER",
        locality="REMOTE",
        lose=lose,
        ready=lambda tier: bool(tier.peers_up()),  # type: ignore[attr-defined]
        counts_events=False,
        persistent=True,
        in_live_engines=True,
    )


@pytest.fixture
def p2p_peer():
    peer = PeerInstance(f"kvoffload_contract_peer_{os.getpid()}_{secrets.token_hex(3)}")
    yield peer
    peer.stop()


class TestTierContract(TierContract):
    @pytest.fixture(params=["memory", "fs", "obj", "p2p"])
    def tier_under_test(self, request, tmp_path) -> TierUnderTest:
        if request.param == "memory":
            return memory_tier()
        if request.param == "fs":
            return fs_tier(tmp_path / "fs")
        if request.param == "p2p":
            return p2p_tier(request.getfixturevalue("p2p_peer"))
        endpoint = request.getfixturevalue("moto")
        return obj_tier_under_test(endpoint, new_bucket(endpoint))


def test_the_readme_example_runs_the_contract_on_an_out_of_tree_tier(tmp_path):
    """README "Testing an out-of-tree tier": its example, copied out of the tree, passes as is."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("### Testing an out-of-tree tier", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "test_my_tier.py").write_text(example)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "test_my_tier.py", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
