"""The p2p bulk transport between peers in two network namespaces: nothing rides on loopback.

Each test makes two fresh network namespaces joined by a veth pair with a /30 of their own
(``tests/netns_pair.py``) and runs one peer process (``tests/p2p_peer.py``) in each. The namespaces'
loopbacks are separate, so the peers can reach each other only over the veth addresses; the tests
check that (a loopback endpoint in one namespace is unreachable from the other) and that the bytes
really crossed the veth (its byte counters grew by at least what moved).

NIXL: both namespaces share the machine's /dev/shm and PID space, so UCX would otherwise take shared
memory or cross-memory attach between the two processes and never touch the network (seen: the
veth carried under 1 KiB for 640 KiB moved). The NIXL test therefore restricts UCX to TCP
(``UCX_TLS=tcp``) on each side's veth (``UCX_NET_DEVICES``). With TCP alone UCX picked the veth by
itself; pinned to ``lo`` it refuses the other side's metadata ("tcp/lo - different ... namespaces":
UCX knows a loopback does not reach across network namespaces).

Needs root and iproute2 (skipped with the reason otherwise; ``KVOFFLOAD_REQUIRE_NETNS=1`` makes that
a failure).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest
import xxhash
from helpers import TESTS_DIR
from netns_pair import NetnsPair, Side
from pipe_commands import PipeClient

from kvoffload.ipc.arena import list_arenas
from kvoffload.workers import p2p_transport as pt

pytestmark = pytest.mark.netns

PEER_SCRIPT = os.path.join(TESTS_DIR, "p2p_peer.py")
SLOTS = 32
ROW = 16 * 1024
# Generous upper bound for anything to happen (seconds): never a measure of speed.
PATIENCE_S = 60.0

NIXL_MISSING = pt.nixl_available()
KINDS = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            bool(NIXL_MISSING), reason=f"NIXL cannot be imported: {NIXL_MISSING}"
        ),
    ),
]


class NsPeer(PipeClient):
    """A ``tests/p2p_peer.py`` process inside one side of a :class:`NetnsPair`."""

    patience_s = PATIENCE_S

    def __init__(
        self,
        pair: NetnsPair,
        side: Side,
        kind: str,
        host: str,
        env: dict[str, str] | None = None,
    ):
        self.side = side
        self.name = f"kvoffload_p2pnetns_{os.getpid()}_{side}_{secrets.token_hex(3)}"
        self.proc = pair.python(
            side, [PEER_SCRIPT], env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        reply = self.ok(
            "init",
            name=self.name,
            num_slots=SLOTS,
            row_bytes=ROW,
            kind=kind,
            deadline_s=PATIENCE_S,
            host=host,
        )
        assert reply["kind"] == kind, reply
        self.descriptor: str = reply["descriptor"]
        self.sessions: dict[str, tuple[NsPeer, str]] = {}
        self.gid = 0
        # /dev/shm is the machine's in every network namespace: the session-end check sees it.
        assert self.name in {a.name for a in list_arenas()}

    def rows(self) -> list[str]:
        return self.ok("digest")["rows"]

    def connect(self, server: NsPeer, as_name: str) -> str:
        """A session for reading ``server``'s slots: its data token (hex), known to both."""
        token = secrets.token_hex(32)
        server.ok("add_session", token=token)
        self.ok("add_peer", name=as_name, descriptor=server.descriptor, token=token)
        self.sessions[as_name] = (server, token)
        return token

    def transfer(self, peer: str, pairs: list[tuple[int, int]]) -> dict:
        """READ ``pairs`` ((remote, local)) of ``peer``, granted to this session, to the end."""
        server, token = self.sessions[peer]
        server.gid += 1  # the serving side's grant ids
        slots = [r for r, _ in pairs]
        digests = server.ok("grant", gid=server.gid, token=token, slots=slots, ttl_s=PATIENCE_S)
        h = self.ok("read", peer=peer, pairs=pairs, digests=digests["digests"])["handle"]
        return self.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)

    def stop(self) -> None:
        """Close the transport and arena, and let the process exit."""
        self.stop_process()


@pytest.fixture
def ns_peers(netns_pair):
    """Start :class:`NsPeer`s in ``netns_pair``; stop them (before the namespaces go) and check no
    arena of theirs is left."""
    made: list[NsPeer] = []

    def make(side: Side, kind: str, host: str, env: dict[str, str] | None = None) -> NsPeer:
        p = NsPeer(netns_pair, side, kind, host, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()
    assert all(p.proc.returncode == 0 for p in made), [p.proc.returncode for p in made]
    names = {p.name for p in made}
    assert not [a.name for a in list_arenas() if a.name in names]


@pytest.mark.parametrize("kind", KINDS)
def test_transport_moves_chunks_bit_exact_across_the_veth(netns_pair, ns_peers, kind):
    pair = netns_pair
    if kind == "nixl":
        env_a, env_b = pair.ucx_tcp_env("a"), pair.ucx_tcp_env("b")
    else:
        env_a = env_b = {}
    a = ns_peers("a", kind, pair.addr_a, env_a)
    b = ns_peers("b", kind, pair.addr_b, env_b)
    if kind == "tcp":
        # the descriptors name the veth addresses, which is all the other side can use
        assert pt.decode_descriptor(bytes.fromhex(b.descriptor)).host == pair.addr_b
        assert pt.decode_descriptor(bytes.fromhex(a.descriptor)).host == pair.addr_a
    a.ok("fill", seed=1)
    b.ok("fill", seed=2)
    a.connect(b, "b")
    b.connect(a, "a")
    ra, rb = a.rows(), b.rows()
    rx_a0, tx_a0 = pair.link_bytes("a")
    rx_b0, tx_b0 = pair.link_bytes("b")

    # Granted reads both ways: A reads B's 0..15 into its 31..16 (reversed), B reads A's 0..15
    # into 16..31.
    read_ab = [(r, SLOTS - 1 - r) for r in range(16)]
    read_ba = [(i, 16 + i) for i in range(16)]
    assert a.transfer("b", read_ab)["state"] == "done"
    assert b.transfer("a", read_ba)["state"] == "done"
    ra2, rb2 = a.rows(), b.rows()
    assert [ra2[lo] for _, lo in read_ab] == [rb[r] for r, _ in read_ab]
    assert [rb2[lo] for _, lo in read_ba] == [ra[r] for r, _ in read_ba]
    assert ra2[:16] == ra[:16] and rb2[:16] == rb[:16]  # untouched rows stay as they were

    # The bytes crossed the veth: each direction carried at least the rows that went that way.
    moved_ab = 16 * ROW  # B's reads of A
    moved_ba = 16 * ROW
    rx_a1, tx_a1 = pair.link_bytes("a")
    rx_b1, tx_b1 = pair.link_bytes("b")
    assert tx_a1 - tx_a0 >= moved_ab and rx_b1 - rx_b0 >= moved_ab
    assert tx_b1 - tx_b0 >= moved_ba and rx_a1 - rx_a0 >= moved_ba


def test_tcp_peer_on_loopback_is_unreachable_from_the_other_namespace(netns_pair, ns_peers):
    """The veth test above could not have passed over loopback: a peer whose descriptor names its
    loopback serves its own namespace but not the other one."""
    pair = netns_pair
    a = ns_peers("a", "tcp", pair.addr_a)
    lo_b = ns_peers("b", "tcp", "127.0.0.1")
    veth_b = ns_peers("b", "tcp", pair.addr_b)
    lo_b.ok("fill", seed=3)
    rows = lo_b.rows()
    before = a.rows()
    a.connect(lo_b, "lo_b")
    st = a.transfer("lo_b", [(i, i) for i in range(4)])
    assert st["state"] == "failed" and st["settled"], st
    assert a.rows() == before  # nothing landed
    assert not a.ok("peer_up", name="lo_b")["up"]
    # The same descriptor works from B's own namespace: the peer itself is fine.
    veth_b.connect(lo_b, "lo_b")
    assert veth_b.transfer("lo_b", [(i, i) for i in range(4)])["state"] == "done"
    assert veth_b.rows()[:4] == rows[:4]


INSTANCE_SCRIPT = os.path.join(TESTS_DIR, "p2p_instance.py")
TIER_ROW = 64 * 1024
SECRET = "netns-" + secrets.token_hex(8)


class NsInstance(NsPeer):
    """A whole kvoffload instance with a p2p tier (``tests/p2p_instance.py``: arena, tiering
    manager, node thread, peer worker) inside one side of a :class:`NetnsPair`."""

    def __init__(self, pair: NetnsPair, side: Side, tier: dict, env: dict[str, str]):
        self.side = side
        self.name = f"kvoffload_p2pnetns_tier_{os.getpid()}_{side}_{secrets.token_hex(3)}"
        self.proc = pair.python(
            side, [INSTANCE_SCRIPT], env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        reply = self.ok("init", tiers=[tier], num_slots=SLOTS, row_bytes=TIER_ROW, name=self.name)
        self.addr: str = reply["advertise"]


@pytest.mark.parametrize("kind", KINDS)
def test_p2p_tier_serves_across_the_veth(netns_pair, kind):
    """Two instances, one per namespace, each with a p2p tier naming the other's veth address:
    each serves the other's lookups bit-exact, and the bytes cross the veth."""
    from kvoffload.testing.tier_contract import keys_for, payload
    from kvoffload.tools.ports import free_port

    pair = netns_pair
    envs = {s: pair.ucx_tcp_env(s) if kind == "nixl" else {} for s in ("a", "b")}
    port = free_port()  # each namespace has its own port space: the same number on both sides

    def tier(side: Side, peer: str) -> dict:
        return {
            "type": "p2p",
            "host": pair.addr(side),
            "port": port,
            "peers": [f"{pair.addr(peer)}:{port}"],
            "transport": kind,
            "secret": SECRET,
        }

    a = NsInstance(pair, "a", tier("a", "b"), envs["a"])
    b = NsInstance(pair, "b", tier("b", "a"), envs["b"])
    try:
        assert a.addr == f"{pair.addr_a}:{port}" and b.addr == f"{pair.addr_b}:{port}"
        ka, kb = keys_for(8, seed=31), keys_for(8, seed=32)
        a.ok("store", keys=[k.hex() for k in ka])
        b.ok("store", keys=[k.hex() for k in kb])
        deadline = time.monotonic() + PATIENCE_S
        while not (a.ok("state")["peers_up"] and b.ok("state")["peers_up"]):
            assert time.monotonic() < deadline, "the sessions across the veth never came up"
            time.sleep(0.05)
        rx0, tx0 = pair.link_bytes("a")
        assert b.ok("resolve", keys=[k.hex() for k in ka])["results"] == ["HIT"] * len(ka)
        assert a.ok("resolve", keys=[k.hex() for k in kb])["results"] == ["HIT"] * len(kb)
        want_a = [xxhash.xxh3_64_hexdigest(payload(k, TIER_ROW)) for k in ka]
        want_b = [xxhash.xxh3_64_hexdigest(payload(k, TIER_ROW)) for k in kb]
        assert b.ok("digest", keys=[k.hex() for k in ka])["digests"] == want_a
        assert a.ok("digest", keys=[k.hex() for k in kb])["digests"] == want_b
        rx1, tx1 = pair.link_bytes("a")
        # A sent B its 8 chunks and received B's 8, over the veth
        assert tx1 - tx0 >= len(ka) * TIER_ROW and rx1 - rx0 >= len(kb) * TIER_ROW
        for inst in (a, b):
            st = inst.ok("state")
            assert st["pins_match"], st
    finally:
        a.stop()
        b.stop()
    assert a.proc.returncode == 0 and b.proc.returncode == 0
