"""The p2p tier's control plane attacked the way CASES C38, C41 and C42 did: real instances in their
own processes on loopback (``tests/p2p_instance.py``), the instance under attack built in this
process where its tier must be inspected. The attacks the cases make across two network namespaces
(``tests/netns_pair.py``), so that nothing rides on loopback, are tests/netns/test_p2p_attacks.py.

- C38: a request's ``kv_transfer_params`` name an address that is no allowed peer (no socket is
  made; counted; a remote_prefiller refused is a miss); 300 request-named allowed addresses leave
  at most ``max_request_peers`` links and none once idle; a relay that knows no secret
  (``tests/p2p_relay.py``) between the victim's client and the victim's own server, or another
  peer, completes no session and sees only ciphertext; its recorded handshake replayed completes
  none either.
- C41: a flood of connections that never authenticate (a first frame and nothing more, oversized
  first frames, a first frame cut short) from many sources: the honest peer connects and loads
  during it, the victim keeps at most ``max_handshakes_per_source`` half-open per source and
  ``max_handshakes`` in all, its threads do not grow and its memory stays bounded.
- C42: a second live instance claiming an authenticated peer's address is refused on both sides
  (counted) and neither loses its session or leases; a restart at that address is told apart.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import xxhash
from helpers import TESTS_DIR, namespace, wait_until
from netns_pair import NetnsPair
from p2p_raw import RawClient
from pipe_commands import PipeClient

from integration.test_p2p_tier import (
    PATIENCE_S,
    ROW,
    SECRET,
    assert_serves,
    p2p,
    settle,
    tier,
)
from integration.test_p2p_tier import world as _world  # noqa: F401 (a fixture, taken by name)
from kvoffload.ipc import peer_messages as pm
from kvoffload.testing.tier_contract import keys_for, payload
from kvoffload.tiers.base import LookupResult
from kvoffload.tools.ports import free_port

HIT, MISS = LookupResult.HIT, LookupResult.MISS
RELAY_SCRIPT = Path(TESTS_DIR) / "p2p_relay.py"


@pytest.fixture
def world(_world):  # noqa: F811
    """tests/integration/test_p2p_tier.py's: serving instances and rigs, cleaned up and checked."""
    return _world


def route(addr: str, kvr: str = "kvr") -> dict:
    host, _, port = addr.rpartition(":")
    return {"remote_host": host, "remote_port": int(port), "kv_request_id": kvr}


class Relay(PipeClient):
    """``tests/p2p_relay.py`` in its own process (in a namespace side when ``pair`` is given)."""

    patience_s = PATIENCE_S

    def __init__(self, host: str, target: str, pair: NetnsPair | None = None, side: str = "b"):
        self.name = f"relay to {target}"
        if pair is None:
            self.proc = subprocess.Popen(
                [sys.executable, str(RELAY_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        else:
            self.proc = pair.python(
                side, [str(RELAY_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        self.addr = f"{host}:{self.ok('init', host=host, target=target)['port']}"

    def stats(self) -> dict:
        return self.ok("stats")

    def stop(self) -> None:
        self.stop_process()


def recorded(stats: dict) -> bytes:
    """Every byte the relay recorded, both ways, all connections."""
    return b"".join(
        bytes.fromhex(c["to_target"]) + bytes.fromhex(c["to_client"]) for c in stats["recorded"]
    )


def assert_only_ciphertext(stats: dict, *plaintexts: bytes) -> None:
    """The relay forwarded bytes both ways (the ZMQ handshake crossed it), yet none of the
    protocol's plaintext: CurveZMQ encrypted all of it."""
    assert stats["to_target"] > 0 and stats["to_client"] > 0, stats
    seen = recorded(stats)
    for p in plaintexts:
        assert p not in seen, f"the relay read {p[:40]!r}"
    assert b"hello" not in seen and b"challenge" not in seen  # message tags


# -- C38: routing from requests -----------------------------------------------------------------


def test_c38_a_request_naming_an_address_that_is_no_allowed_peer_makes_no_socket(world, caplog):
    """remote_kv_source naming a listener that is no allowed peer: no connection reaches it (the
    request is served by the configured peer), the refusal is counted and logged once; a
    remote_prefiller naming it leaves that request no peer: a miss, never an error."""
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(3, seed=380)
    a.store(keys)
    v = world.rig(p2p("tcp", free_port(), [a.addr]))
    wait_until(lambda: tier(v).peers_up() or None, PATIENCE_S, "V's session with A")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        bait = f"127.0.0.1:{listener.getsockname()[1]}"
        with caplog.at_level("WARNING", logger="kvoffload.p2p"):
            assert_serves(v, keys, "r1", {"remote_kv_source": route(bait)})
            v.tm.on_request("r2", {"remote_kv_source": route(bait)})
            v.tm.on_request("r3", {"remote_prefiller": route(bait)})
        assert settle(v, keys_for(2, seed=381), "r3") == [MISS, MISS]
        # the engine thread refused it before any command reached the node: nothing to wait for
        readable, _, _ = select.select([listener], [], [], 0)
        assert readable == [], "a connection reached the address a request named"
    t = tier(v)
    assert t.refused_routes["not_allowed"] == 3
    assert bait not in t._node.client.links
    assert caplog.text.count(repr(bait)) == 1  # logged once per address
    assert v.tm.refresh_metrics().get("kvoffload_p2p_refused_routes", t.name, "not_allowed") == 3


def test_c38_a_peer_authenticated_to_this_instance_may_be_named_by_a_request(world):
    """A names V as its peer, so A has authenticated to V: a request at V may then name A's
    advertise address (remote_prefiller), though V configures no peer and no allow-list."""
    v = world.rig(p2p("tcp", free_port()))
    a = world.instance(p2p("tcp", free_port(), [tier(v).advertise]))
    keys = keys_for(3, seed=382)
    a.store(keys)
    wait_until(
        lambda: a.addr in tier(v)._node.authenticated_peers or None,
        PATIENCE_S,
        "A authenticated to V",
    )
    assert_serves(v, keys, "r", {"remote_prefiller": route(a.addr)})
    assert not any(tier(v).refused_routes.values())


def test_c38_with_auth_none_a_session_claiming_an_address_allows_no_request_to_name_it(world):
    """With ``auth: none`` a session proves nothing: a local program that opens one advertising
    some address (here a listener of its own) does not make that address one a request may
    name: refused ``not_allowed`` before any socket, and the listener gets no connection."""
    v = world.rig(p2p("tcp", free_port(), auth="none", trust_local_users=True, secret=None))
    t = tier(v)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        bait = f"127.0.0.1:{listener.getsockname()[1]}"
        claim = RawClient(t.advertise, namespace(row_bytes=ROW).id(), None, advertise=bait)
        try:
            assert isinstance(claim.handshake(), pm.Welcome)
            wait_until(
                lambda: bait in t._node.authenticated_peers or None,
                PATIENCE_S,
                "the claiming session to be up",
            )
            v.tm.on_request("r", {"remote_prefiller": route(bait)})
            assert settle(v, keys_for(2, seed=386), "r") == [MISS, MISS]
            readable, _, _ = select.select([listener], [], [], 0)
            assert readable == [], "a connection reached the address a session claimed"
        finally:
            claim.close()
    assert t.refused_routes["not_allowed"] == 1
    assert bait not in t._node.client.links


def test_c38_a_listener_without_curvezmq_at_a_peers_address_gets_no_frame(world):
    """A downgrade from the client's side: V's configured peer address is taken by a plain ZMQ
    ROUTER (no CurveZMQ, as a program without the secret would run): V's client completes no
    ZMQ handshake with it, so the listener receives no frame (no Hello, no descriptor) and no
    session comes up."""
    import zmq

    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        port = plain.bind_to_random_port("tcp://127.0.0.1")
        bait = f"127.0.0.1:{port}"
        v = world.rig(p2p("tcp", free_port(), [bait], heartbeat_s=0.1, peer_timeout_s=0.5))
        t = tier(v)
        v.tm.on_request("r", {"remote_prefiller": route(bait)})
        assert settle(v, keys_for(2, seed=387), "r") == [MISS, MISS]
        wait_until(
            lambda: t._node.client.links[bait].connects >= 2 or None,
            PATIENCE_S,
            "V's client to have tried twice",
        )
        assert plain.poll(500) == 0, "the plain listener received a frame"
        assert t.peers_up() == []
    finally:
        plain.close()
        ctx.term()


def test_c38_300_request_named_allowed_addresses_leave_at_most_the_bound_and_none_when_idle(
    world,
):
    """300 requests each naming another allowed address (a listener that never answers the
    handshake): at most max_request_peers links (and sockets) exist at any time; once unused for
    request_peer_idle_s none is left, and this process holds no connection to any of them."""
    bound = 8
    v = world.rig(
        p2p(
            "tcp",
            free_port(),
            allowed_peers=["127.0.0.0/8"],
            max_request_peers=bound,
            request_peer_idle_s=1.0,
            negative_ttl_s=0,
        )
    )
    node = tier(v)._node
    with socket.create_server(("0.0.0.0", 0)) as listener:  # every 127.x reaches it
        port = listener.getsockname()[1]
        named = [f"127.0.{1 + i // 250}.{1 + i % 250}:{port}" for i in range(300)]
        for i, addr in enumerate(named):
            v.tm.on_request(f"r{i}", {"remote_kv_source": route(addr)})
            v.tm.lookup(keys_for(1, seed=10_000 + i)[0], f"r{i}")
            v.tm.step()
            links = [a for a in list(node.client.links) if a in named]
            assert len(links) <= bound, links
            assert len([a for a in list(node.socks) if a in named]) <= bound
        # the node thread takes the lookups in order and may lag behind this loop: once it has
        # dialled the last address, every earlier link beyond the bound was dropped
        wait_until(
            lambda: node.client.request_links_evicted >= 300 - bound or None,
            PATIENCE_S,
            "the node to have dialled every address a request named",
            step=v.tm.step,
        )
        for i in range(300):
            v.tm.on_request_finished(f"r{i}")
        wait_until(
            lambda: not [a for a in list(node.client.links) if a in named] or None,
            PATIENCE_S,
            "every link a request named to be forgotten",
            step=v.tm.step,
        )
        # the node thread forgets a link first and closes its socket after (the same loop, later)
        wait_until(
            lambda: not [a for a in list(node.socks) if a in named] or None,
            PATIENCE_S,
            "every socket of those links to be closed",
            step=v.tm.step,
        )

        def connections() -> list:
            return [
                c
                for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == port
            ]

        wait_until(lambda: not connections() or None, PATIENCE_S, "no connection left to them")


def test_c38_a_relay_without_the_secret_between_our_client_and_our_own_server_gets_nothing(
    world,
):
    """The case's attack on loopback: V allows the relay's address (so it does connect), the
    relay forwards bytes between V's client and V's own server. The ZMQ handshake crosses the
    relay, but it is CurveZMQ between V and V: the relay reads only ciphertext; the Hello it
    carries has V's own incarnation and names the relay's address, so V's server refuses it
    (counted); no session, no descriptor, no byte of V's arena read or written. Its recorded
    handshake, replayed on a new connection, completes nothing (counted)."""
    keys = keys_for(8, seed=383)
    relay = None
    v_port = free_port()
    try:
        relay = Relay("127.0.0.1", f"127.0.0.1:{v_port}")
        v = world.rig(p2p("tcp", v_port, allowed_peers=[relay.addr]))
        t = tier(v)
        v.store(keys)
        before = [xxhash.xxh3_64_hexdigest(v.arena.rows[v.tm.host.index.get(k)]) for k in keys]
        v.tm.on_request("attack", {"remote_kv_source": route(relay.addr)})
        assert settle(v, keys_for(2, seed=384), "attack") == [MISS, MISS]
        wait_until(
            lambda: t._node.server_counters.get("refused.reflection") or None,
            PATIENCE_S,
            "V's server to refuse its own Hello relayed back",
            step=v.tm.step,
        )
        wait_until(
            lambda: t._node.client.handshake_failures["refused_reflection"] or None,
            PATIENCE_S,
            "V's client to be told",
        )
        assert relay.addr not in t.peers_up()
        assert t._node.authenticated_peers == frozenset()
        stats = relay.stats()
        assert stats["connections"] >= 1
        assert_only_ciphertext(
            stats,
            t.advertise.encode(),
            t.namespace.id().encode(),
            t._worker.descriptor,
            t.incarnation,
        )
        # V's arena: nothing leased, nothing changed
        assert v.tm.host.num_pinned == 0
        after = [xxhash.xxh3_64_hexdigest(v.arena.rows[v.tm.host.index.get(k)]) for k in keys]
        assert after == before
        # the relay replays what it recorded from V's client on a connection of its own
        failed0 = t._node.refused_connections["handshake_failed"]
        stream = stats["recorded"][0]["to_target"]
        replay = relay.ok("replay", target=f"127.0.0.1:{v_port}", data=stream)
        assert replay["closed"], replay
        wait_until(
            lambda: t._node.refused_connections["handshake_failed"] > failed0 or None,
            PATIENCE_S,
            "the replayed handshake to fail, counted",
        )
        assert t._node.authenticated_peers == frozenset()
    finally:
        if relay is not None:
            relay.stop()


def test_c38_a_relay_to_another_peer_completes_no_session_there_either(world):
    """The relay forwards V's client to an honest peer H instead: H's server sees a Hello that
    dialed the relay, not H: refused ``misrouted`` on both sides, and H holds no session of V."""
    h = world.instance(p2p("tcp", free_port()))
    relay = Relay("127.0.0.1", h.addr)
    try:
        v = world.rig(p2p("tcp", free_port(), allowed_peers=[relay.addr]))
        t = tier(v)
        v.tm.on_request("attack", {"remote_prefiller": route(relay.addr)})
        assert settle(v, keys_for(2, seed=385), "attack") == [MISS, MISS]
        wait_until(
            lambda: h.ok("counters")["refused_messages"]["misrouted"] or None,
            PATIENCE_S,
            "H to refuse the relayed Hello",
        )
        wait_until(
            lambda: t._node.client.handshake_failures["refused_misrouted"] or None,
            PATIENCE_S,
            "V's client to be told",
        )
        assert h.ok("counters")["authenticated"] == []
        assert relay.addr not in t.peers_up()
        assert_only_ciphertext(relay.stats(), t.advertise.encode(), t._worker.descriptor)
    finally:
        relay.stop()


# -- C41: a flood before authentication ---------------------------------------------------------

_GREETING = (
    b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
)
"""A ZMTP 3.0 greeting asking for CURVE (64 bytes): what a client sends first."""


class Flood:
    """Connections from the test to the victim's control port that never authenticate, from
    source addresses of 127.0.0.0/8; tells which the victim has closed."""

    def __init__(self, addr: str):
        host, _, port = addr.rpartition(":")
        self.target = (host, int(port))
        self.socks: list[tuple[str, socket.socket]] = []
        self.closed: set[int] = set()

    def open(self, source: str, first: bytes) -> None:
        s = socket.create_connection(self.target, timeout=PATIENCE_S, source_address=(source, 0))
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.send(first)
        self.socks.append((source, s))

    def poll(self) -> None:
        """Notice the connections the victim closed (end of stream or reset)."""
        for i, (_, s) in enumerate(self.socks):
            if i in self.closed:
                continue
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        self.closed.add(i)
                        break
            except BlockingIOError:
                pass
            except OSError:
                self.closed.add(i)

    def open_from(self, source: str | None = None) -> int:
        """Connections still open (from ``source``)."""
        self.poll()
        return sum(
            1
            for i, (src, _) in enumerate(self.socks)
            if i not in self.closed and source in (None, src)
        )

    def close(self) -> None:
        for _, s in self.socks:
            s.close()


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_c41_a_flood_of_unauthenticated_connections_locks_no_honest_peer_out(world):
    """A bounded flood against the control port (the case: 128 sockets sending a first frame and
    nothing more; here also oversized first frames and first frames cut short, from 27 source
    addresses) while an honest peer connects and loads: the honest peer is served during it; the
    victim keeps at most max_handshakes_per_source of them per source and max_handshakes in all
    (the rest shut at once, counted); its threads do not grow, its memory stays bounded. The
    victim's handshake bound is 600 s here, so only those bounds can close the idle ones."""
    per_source, total = 8, 64
    victim = world.instance(
        p2p(
            "tcp",
            free_port(),
            peer_timeout_s=600.0,
            max_handshakes=total,
            max_handshakes_per_source=per_source,
        )
    )
    keys = keys_for(8, seed=410)
    victim.store(keys)
    pid = victim.proc.pid
    threads0, rss0 = psutil.Process(pid).num_threads(), rss(pid)
    flood = Flood(victim.addr)
    try:
        # one source, 40 connections sending a greeting and nothing more: at most 8 stay
        for _ in range(40):
            flood.open("127.0.0.2", _GREETING)
        wait_until(
            lambda: flood.open_from("127.0.0.2") <= per_source or None,
            PATIENCE_S,
            f"the victim to keep at most {per_source} half-open from one source",
            interval_s=0.05,
        )
        # 16 more sources, 8 each (128, the case's count), then oversized and cut-short first
        # frames from 10 more: at most 64 half-open in all
        for n in range(3, 19):
            for _ in range(per_source):
                flood.open(f"127.0.0.{n}", _GREETING)
        oversized = _GREETING + b"\x06" + (1 << 31).to_bytes(8, "big") + b"x" * 4096
        for n in range(19, 24):
            flood.open(f"127.0.0.{n}", oversized)
        for n in range(24, 29):
            flood.open(f"127.0.0.{n}", _GREETING[:10])  # slow first bytes: the rest never comes
        wait_until(
            lambda: flood.open_from() <= total or None,
            PATIENCE_S,
            f"the victim to keep at most {total} half-open in all",
            interval_s=0.05,
        )
        # the honest peer connects and loads while the flood's connections stay open
        b = world.rig(p2p("tcp", free_port(), [victim.addr]))
        wait_until(lambda: tier(b).peers_up() or None, PATIENCE_S, "the honest session")
        assert_serves(b, keys)
        assert flood.open_from() > 0, "the flood ended before the honest peer was served"
        assert flood.open_from("127.0.0.2") <= per_source and flood.open_from() <= total
        # counted by the victim's node thread as it reads its monitor's events: wait for them
        refused = wait_until(
            lambda: (
                (r := victim.ok("counters")["refused_connections"])["per_source"] >= 40 - per_source
                and r["total"] >= 1
                and r["handshake_failed"] >= 1
                and r
            ),
            PATIENCE_S,
            "the victim to count the refused connections",
            interval_s=0.05,
        )
        assert refused["per_source"] >= 40 - per_source, refused
        assert psutil.Process(pid).num_threads() <= threads0
        assert rss(pid) - rss0 < 128 << 20, "memory grew with the flood"
        want = [xxhash.xxh3_64_hexdigest(payload(k, ROW)) for k in keys]
        assert victim.ok("digest", keys=[k.hex() for k in keys])["digests"] == want
    finally:
        flood.close()


# -- C42: two instances, one identity ------------------------------------------------------------


def test_c42_a_second_instance_claiming_a_live_peers_address_is_refused_and_keeps_nothing_of_it(
    world,
):
    """A peer (here a hand-driven client that knows the secret) holds a session and a lease at S
    under the address 127.0.0.1:Q; a real instance then starts advertising that same address:
    S refuses it ``identity_collision`` (counted on both sides), the first keeps its session
    and lease. Once the first's connection is gone, the instance at that address is a restart:
    its session comes up."""
    # (a session silent this long is dropped: the test's own client heartbeats only between
    # its steps, and starting an instance takes a few seconds)
    s = world.instance(p2p("tcp", free_port(), peer_timeout_s=60.0))
    held = keys_for(4, seed=420)
    s.store(held)
    q = free_port()
    claimed = f"127.0.0.1:{q}"
    first = RawClient(s.addr, namespace(row_bytes=ROW).id(), SECRET.encode(), advertise=claimed)
    try:
        assert isinstance(first.handshake(), pm.Welcome)
        lease = first.ask(pm.Lease(req=1, keys=held, ttl_s=600.0))
        assert all(x >= 0 for x in lease.slots)
        second = world.instance(p2p("tcp", q, [s.addr]))
        assert second.addr == claimed
        beat = iter(range(1, 1 << 30))

        def refused_and_first_alive():
            assert isinstance(first.ask(pm.Heartbeat(next(beat), 0)), pm.HeartbeatAck)
            told = second.ok("counters")["failed_handshakes"]["refused_identity_collision"]
            counted = s.ok("counters")["refused_messages"]["identity_collision"]
            return (told and counted) or None

        wait_until(refused_and_first_alive, PATIENCE_S, "the second instance to be refused")
        assert s.ok("counters")["server"]["restarts"] == 0
        assert s.ok("state")["pinned"] == len(held)  # the first's lease holds
        reply = first.ask(pm.Lookup(req=2, keys=held))
        assert reply.states == bytes([pm.READY] * len(held))
        assert second.ok("state")["peers_up"] == []
    finally:
        first.close()  # the first's connection goes
    wait_until(
        lambda: second.ok("state")["peers_up"] == [s.addr] or None,
        PATIENCE_S,
        "the instance at that address to come up as a restart",
    )
    counters = s.ok("counters")
    assert counters["server"]["restarts"] == 1
    wait_until(lambda: s.ok("state")["pinned"] == 0 or None, PATIENCE_S, "the old lease dropped")
    reply = second.ok("resolve", keys=[k.hex() for k in held])
    assert reply["results"] == ["HIT"] * len(held)


def test_c42_a_restarted_peer_is_told_apart_from_a_second_instance(world):
    """The same address, a new incarnation, the old process gone (SIGKILL): a restart, not a
    collision; the restarted instance reads."""
    s = world.instance(p2p("tcp", free_port()))
    held = keys_for(4, seed=421)
    s.store(held)
    q = free_port()
    r1 = world.instance(p2p("tcp", q, [s.addr]))
    wait_until(lambda: r1.ok("state")["peers_up"] or None, PATIENCE_S, "R1's session")
    os.kill(r1.proc.pid, signal.SIGKILL)
    os.kill(r1.worker_pid, signal.SIGKILL)
    r1.proc.wait(PATIENCE_S)
    r2 = world.instance(p2p("tcp", q, [s.addr]))
    wait_until(lambda: r2.ok("state")["peers_up"] or None, PATIENCE_S, "R2's session")
    assert r2.ok("resolve", keys=[k.hex() for k in held])["results"] == ["HIT"] * len(held)
    counters = s.ok("counters")
    # R1's session ends once: replaced by R2's (a restart) or, where R2 took longer than
    # peer_timeout_s to come up (a loaded machine), dropped as silent first; never a collision
    server = counters["server"]
    assert server.get("restarts", 0) + server.get("session_timeouts", 0) == 1, server
    assert server.get("collisions", 0) == 0, server
    assert counters["refused_messages"]["identity_collision"] == 0
    assert r2.ok("counters")["failed_handshakes"]["refused_identity_collision"] == 0
