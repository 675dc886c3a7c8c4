"""The p2p tier's serving role (kvoffload.tiers.p2p.server.PeerServer) over a real TieringManager and
arena: handshake and refusals, leases and their expiry, restarts, push admission within the quota,
and fuzzed frames and hostile messages that must never raise nor leak a pin.

The server is socket-free: frames go in as bytes and replies come back as (identity, bytes), which
is exactly what the node thread moves over its ROUTER socket. Where a pull's READ would write the
pushed bytes (the peer worker), the test writes them into the reserved slots itself; where the
peer worker grants leased slots to a session and acknowledges their revocation, :class:`Grants`
keeps its contract (digests of the real rows, each grant and revocation answered once), answering
at once unless a test holds its answers back.
"""

from __future__ import annotations

import itertools
import os
import time

import msgspec
import numpy as np
import pytest
from helpers import Rig, fs_tier, keys_for, payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.host import WRITING
from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.p2p.server import PeerServer
from kvoffload.workers.p2p_transport import digest_seed, rows_digests

SECRET = b"s3cret-shared-by-the-peers"
SERVER_ADDR = "10.0.0.1:5710"  # where the clients dial the server
SERVER_DESC = b"server-transport-descriptor"
CLIENT_DESC = b"client-transport-descriptor"


def refs_of(tm) -> dict[int, int]:
    return {s: r for s, r in enumerate(tm.host.refs) if r}


class Grants:
    """The serving role's peer worker (:class:`~kvoffload.tiers.p2p.server.Grants`), keeping to
    PeerWorkerHandle's contract: each grant answered once with the digests of the granted rows as
    they are when it is answered, each revocation once; what it holds, by session."""

    def __init__(self, rig: Rig):
        self.rig = rig
        self.sessions: set[bytes] = set()
        self.live: dict[int, tuple[bytes, list[int], float]] = {}  # gid -> (token, slots, until)
        self.asked: list[int] = []  # grants not answered yet
        self.revoking: list[int] = []  # revocations not answered yet
        self.gids = itertools.count(1)

    def add_session(self, token: bytes) -> None:
        assert len(token) == pm.TOKEN_BYTES
        self.sessions.add(token)

    def drop_session(self, token: bytes) -> None:
        self.sessions.discard(token)

    def grant(self, token: bytes, slots: list[int], until: float) -> int:
        assert token in self.sessions and slots
        gid = next(self.gids)
        self.live[gid] = (token, list(slots), until)
        self.asked.append(gid)
        return gid

    def revoke(self, gid: int) -> None:
        assert gid in self.live and gid not in self.revoking, gid
        self.revoking.append(gid)

    def digests(self, gid: int) -> bytes:
        token, slots, _ = self.live[gid]
        return rows_digests(self.rig.arena, slots, digest_seed(token))


class Server:
    """A PeerServer over a rig, recording the pulls it asks for; its grants and revocations are
    answered as soon as it asks (``auto``), else when the test calls :meth:`answer`."""

    def __init__(self, rig: Rig, secret: bytes = SECRET, auto: bool = True, **kw):
        self.rig = rig
        self.auto = auto
        self.grants = Grants(rig)
        self.pulls: list[tuple[bytes, bytes, int, list[tuple[int, int]]]] = []
        self.pull_args: list[tuple] = []
        kw.setdefault("quota_chunks", 4)
        self.server = PeerServer(
            rig.tm,
            secret=secret,
            namespace_id=rig.ns.id(),
            incarnation=b"S" * pm.INCARNATION_BYTES,
            addresses=[SERVER_ADDR],
            descriptor=lambda: SERVER_DESC,
            grants=self.grants,
            pull=self._pull,
            **kw,
        )

    def _pull(self, ident, desc, token, lease, pairs, digests, ttl_s) -> None:
        self.pulls.append((ident, desc, lease, pairs))
        self.pull_args.append((ident, token, lease, pairs, digests, ttl_s))

    def handle(
        self, identity: bytes, frame: bytes, now: float, source: str = ""
    ) -> list[tuple[bytes, bytes]]:
        return self.then(self.server.handle(identity, frame, now, source), now)

    def tick(self, now: float) -> list[tuple[bytes, bytes]]:
        return self.then(self.server.tick(now), now)

    def then(self, replies: list, now: float) -> list[tuple[bytes, bytes]]:
        return replies + (self.answer(now) if self.auto else [])

    def answer(self, now: float = 0.0, grants: bool = True, revokes: bool = True) -> list:
        """Answer the grants and revocations asked so far (and those they lead to)."""
        out = []
        g = self.grants
        while (grants and g.asked) or (revokes and g.revoking):
            while grants and g.asked:
                gid = g.asked.pop(0)
                out += self.server.granted(gid, g.digests(gid), now)
            while revokes and g.revoking:
                gid = g.revoking.pop(0)
                del g.live[gid]
                out += self.server.revoked(gid, now)
        return out


class Client:
    """One peer connection (a ZMQ identity) speaking the protocol to a Server."""

    def __init__(
        self,
        srv: Server,
        identity: bytes = b"client-1",
        secret: bytes = SECRET,
        advertise: str = "10.0.0.2:5710",
        incarnation: bytes = b"A" * pm.INCARNATION_BYTES,
        namespace_id: str | None = None,
        version: int = pm.PROTOCOL_VERSION,
        dialed: str = SERVER_ADDR,
        source: str = "10.0.0.99",
    ):
        self.srv = srv
        self.server = srv.server
        self.identity = identity
        self.key = pm.transcript_key(secret)
        self.source = source
        self.hello = pm.Hello(
            version,
            incarnation,
            advertise,
            dialed,
            srv.rig.ns.id() if namespace_id is None else namespace_id,
            os.urandom(pm.NONCE_BYTES),
        )
        self.frames: list[bytes] = []  # every frame this client received

    def send_frame(self, frame: bytes, now: float = 0.0) -> list[pm.PeerMessage]:
        replies = self.srv.handle(self.identity, frame, now, self.source)
        assert all(ident == self.identity for ident, _ in replies)
        self.frames.extend(f for _, f in replies)
        return [pm.decode(f) for _, f in replies]

    def send(self, msg: pm.PeerMessage, now: float = 0.0) -> list[pm.PeerMessage]:
        return self.send_frame(pm.encode(msg), now)

    def one(self, msg: pm.PeerMessage, now: float = 0.0):
        (reply,) = self.send(msg, now)
        return reply

    def challenge(self, now: float = 0.0) -> pm.Challenge:
        ch = self.one(self.hello, now)
        assert isinstance(ch, pm.Challenge), ch
        return ch

    def server_proved(self, ch: pm.Challenge) -> bool:
        return pm.mac_ok(pm.handshake_mac(self.key, "server", self.hello, ch), ch.mac)

    def auth(self, ch: pm.Challenge, descriptor: bytes = CLIENT_DESC) -> pm.Auth:
        auth = pm.Auth(pm.ZERO_MAC, descriptor)
        auth.mac = pm.handshake_mac(self.key, "client", self.hello, ch, auth)
        return auth

    def welcome_proved(self, ch: pm.Challenge, auth: pm.Auth, welcome: pm.Welcome) -> bool:
        want = pm.handshake_mac(self.key, "welcome", self.hello, ch, auth, welcome)
        return pm.mac_ok(want, welcome.mac)

    def handshake(self, now: float = 0.0) -> pm.PeerMessage:
        """Hello and Auth: the server's last answer (a Welcome whose MAC was checked, or a
        Refused)."""
        ch = self.one(self.hello, now)
        if not isinstance(ch, pm.Challenge):
            return ch
        assert self.server_proved(ch)
        auth = self.auth(ch)
        welcome = self.one(auth, now)
        if isinstance(welcome, pm.Welcome):
            assert self.welcome_proved(ch, auth, welcome)
        return welcome

    def connect(self, now: float = 0.0) -> pm.Welcome:
        welcome = self.handshake(now)
        assert isinstance(welcome, pm.Welcome), welcome
        return welcome


def offer(req: int, keys: list[bytes], lease: int, slots: list[int], ttl_s: float = 60.0):
    """An Offer with a digest per key (what the pusher's worker granted)."""
    return pm.Offer(req, keys, lease, slots, ttl_s, bytes(range(16)) * len(keys))


@pytest.fixture
def rig():
    with Rig(num_slots=16) as r:
        yield r


# -- handshake ----------------------------------------------------------------------------------


def test_a_client_that_proves_the_secret_is_welcomed_after_the_server_proved_it_first(rig):
    srv = Server(rig)
    c = Client(srv)
    ch = c.challenge()
    assert c.server_proved(ch) and ch.incarnation == b"S" * pm.INCARNATION_BYTES
    assert SERVER_DESC not in b"".join(c.frames)  # no descriptor before the client proved it
    auth = c.auth(ch)
    welcome = c.one(auth)
    assert isinstance(welcome, pm.Welcome) and c.welcome_proved(ch, auth, welcome)
    assert welcome.descriptor == SERVER_DESC and welcome.quota_chunks == 4
    assert srv.server.sessions() == [(b"client-1", "10.0.0.2:5710", b"A" * 16)]
    assert sum(srv.server.refused.values()) == 0


def test_a_client_with_another_secret_is_refused_and_sees_the_server_fail_its_check(rig):
    srv = Server(rig)
    c = Client(srv, secret=b"not-the-secret")
    ch = c.challenge()
    assert not c.server_proved(ch)  # what a client checks before sending anything more
    assert c.one(c.auth(ch)) == pm.Refused("bad_mac")
    assert srv.server.refused["bad_mac"] == 1
    assert srv.server.sessions() == []
    assert c.one(pm.Lookup(1, keys_for(1))) == pm.Refused("unauthenticated")
    assert SERVER_DESC not in b"".join(c.frames)


def test_a_server_with_another_secret_fails_the_clients_check(rig):
    srv = Server(rig, secret=b"an-impostor's-secret")
    c = Client(srv)
    assert not c.server_proved(c.challenge())


def test_a_replayed_auth_is_refused(rig):
    srv = Server(rig)
    first = Client(srv, identity=b"first")
    ch = first.challenge()
    recorded_hello, recorded_auth = first.hello, first.auth(ch)
    assert isinstance(first.one(recorded_auth), pm.Welcome)
    # an eavesdropper replays the whole exchange on a connection of its own
    thief = Client(srv, identity=b"thief", secret=b"", source="10.0.0.98")
    assert isinstance(thief.one(recorded_hello), pm.Challenge)  # a fresh server nonce
    assert thief.one(recorded_auth) == pm.Refused("bad_mac")
    # and an Auth with no handshake in progress is refused as unauthenticated
    assert thief.one(recorded_auth) == pm.Refused("unauthenticated")
    assert SERVER_DESC not in b"".join(thief.frames)
    assert [s[0] for s in srv.server.sessions()] == [b"first"]


def test_another_namespace_or_version_is_refused(rig):
    srv = Server(rig)
    other = Client(srv, namespace_id="00" * 16)
    assert other.one(other.hello) == pm.Refused("namespace")
    old = Client(srv, identity=b"old", version=pm.PROTOCOL_VERSION + 1)
    assert old.one(old.hello) == pm.Refused("version")
    r = srv.server.refused
    assert (r["namespace"], r["version"]) == (1, 1)


def test_an_unauthenticated_client_gets_nothing(rig):
    srv = Server(rig)
    held = keys_for(3, seed=1)
    rig.store(held)
    c = Client(srv)
    messages = [
        pm.Lookup(1, held),
        pm.Lease(2, held, 10.0, ""),
        offer(3, keys_for(2, seed=2), 7, [0, 1]),
        pm.Heartbeat(1, 0),
        pm.Release(1),
    ]
    for msg in messages:
        assert c.one(msg) == pm.Refused("unauthenticated")
    c.challenge()  # a handshake started but not finished is no better
    for msg in messages:
        assert c.one(msg) == pm.Refused("unauthenticated")
    assert srv.server.refused["unauthenticated"] == 2 * len(messages)
    assert SERVER_DESC not in b"".join(c.frames)
    assert srv.pulls == [] and refs_of(rig.tm) == {}
    assert rig.tm.stats.peer_lookups == 0


def test_malformed_and_oversized_frames_are_refused_and_counted(rig):
    srv = Server(rig)
    c = Client(srv)
    c.connect()
    assert c.send_frame(b"\xc1 not msgpack") == [pm.Refused("malformed")]
    assert srv.server.sessions() == []  # the session is forgotten
    assert c.send_frame(b"\x00" * (pm.MAX_MESSAGE_BYTES + 1)) == [pm.Refused("too_large")]
    r = srv.server.refused
    assert (r["malformed"], r["too_large"]) == (1, 1)


def test_the_handshake_table_is_bounded(rig):
    srv = Server(rig, max_handshakes=8)
    for i in range(100):
        Client(srv, identity=b"x%d" % i, source=f"10.1.0.{i}").challenge()
    assert srv.server.counters["handshakes"] == 8
    assert srv.server.counters["handshake_drops"] == 92
    srv.tick(10.0)  # silent handshakes go too
    assert srv.server.counters["handshakes"] == 0


def test_c38_a_hello_carrying_the_servers_own_incarnation_is_refused_as_a_reflection(rig):
    """Our own client's Hello relayed back to our own server: refused before any Challenge."""
    srv = Server(rig)
    mirror = Client(srv, incarnation=b"S" * pm.INCARNATION_BYTES)
    assert mirror.send(mirror.hello) == [pm.Refused("reflection")]
    assert srv.server.refused["reflection"] == 1
    assert srv.server.counters["handshakes"] == 0


def test_c38_a_hello_naming_a_dialed_address_not_the_servers_is_refused_as_misrouted(rig):
    """A client that dialed another address (a relay there forwards to us) is refused, and the
    dialed address cannot be changed under the MACs: a relay that rewrites it breaks them."""
    srv = Server(rig)
    relayed = Client(srv, dialed="127.0.0.1:40000")
    assert relayed.send(relayed.hello) == [pm.Refused("misrouted")]
    assert srv.server.refused["misrouted"] == 1
    # the client computes its MAC over the Hello it sent (dialed: the relay); a relay that
    # rewrote dialed on the way (the server saw SERVER_ADDR) breaks the client's MAC
    c = Client(srv, identity=b"c2")
    ch = c.challenge()
    sent_hello = msgspec.structs.replace(c.hello, dialed="127.0.0.1:40000")
    auth = pm.Auth(pm.ZERO_MAC, CLIENT_DESC)
    auth.mac = pm.handshake_mac(c.key, "client", sent_hello, ch, auth)
    assert c.one(auth) == pm.Refused("bad_mac")
    assert srv.server.sessions() == [] and SERVER_DESC not in b"".join(c.frames)


def test_c38_every_field_of_the_handshake_is_under_the_macs(rig):
    """Each field of Hello, Challenge and Auth (its descriptor included) is covered: a value
    changed anywhere between the two ends fails the MAC, and Welcome's MAC covers its own fields
    (the descriptor, and whatever is added later) over the whole transcript."""
    srv = Server(rig)
    c = Client(srv)
    ch = c.challenge()
    for field, value in (
        ("version", 1),
        ("incarnation", b"Q" * 16),
        ("advertise", "10.9.9.9:1"),
        ("dialed", "10.9.9.9:2"),
        ("namespace_id", "00"),
        ("nonce", b"N" * 32),
    ):
        changed = msgspec.structs.replace(c.hello, **{field: value})
        assert not pm.mac_ok(pm.handshake_mac(c.key, "server", changed, ch), ch.mac), field
    for field, value in (
        ("version", 1),
        ("incarnation", b"Q" * 16),
        ("advertise", "x:1"),
        ("nonce", b"N" * 32),
    ):
        changed = msgspec.structs.replace(ch, **{field: value})
        assert not c.server_proved(changed), field
    auth = c.auth(ch)
    swapped = msgspec.structs.replace(auth, descriptor=b"an-attacker's-descriptor")
    assert c.one(swapped) == pm.Refused("bad_mac")  # the descriptor is under the client's MAC
    c2 = Client(srv, identity=b"c2")
    ch2 = c2.challenge()
    auth2 = c2.auth(ch2)
    welcome = c2.one(auth2)
    assert c2.welcome_proved(ch2, auth2, welcome)
    for field, value in (("descriptor", b"other"), ("heartbeat_s", 9.0), ("quota_chunks", 99)):
        changed = msgspec.structs.replace(welcome, **{field: value})
        assert not c2.welcome_proved(ch2, auth2, changed), field
    assert not c2.welcome_proved(ch, auth, welcome)  # bound to its own session


def test_c38_a_replayed_challenge_or_welcome_proves_nothing_to_a_new_session(rig):
    """Frames recorded from one session and replayed into another fail its MACs (nonces)."""
    srv = Server(rig)
    a = Client(srv, identity=b"a")
    ch_a = a.challenge()
    auth_a = a.auth(ch_a)
    welcome_a = a.one(auth_a)
    b = Client(srv, identity=b"b", incarnation=b"A" * 16)
    ch_b = b.challenge()
    assert not b.server_proved(ch_a)  # a's Challenge replayed to b
    auth_b = b.auth(ch_b)
    assert not b.welcome_proved(ch_b, auth_b, welcome_a)  # a's Welcome replayed to b
    assert b.one(auth_a) == pm.Refused("bad_mac")  # a's Auth replayed by b


def test_c38_an_older_protocol_version_is_refused_as_a_downgrade(rig):
    """A Hello of version 1 (its shape had no dialed address) is refused ``version``, not
    taken as malformed, and gets no Challenge."""
    srv = Server(rig)
    c = Client(srv)
    v1 = msgspec.msgpack.encode(
        ["hello", 1, b"A" * 16, "10.0.0.2:5710", c.hello.namespace_id, b"n" * 32]
    )
    assert c.send_frame(v1) == [pm.Refused("version")]
    newer = msgspec.structs.replace(c.hello, version=pm.PROTOCOL_VERSION + 1)
    assert c.send(newer) == [pm.Refused("version")]
    assert srv.server.refused["version"] == 2 and srv.server.counters["handshakes"] == 0


def test_c41_one_source_cannot_fill_the_handshake_table_nor_push_out_anothers(rig):
    """Handshakes in progress: at most max_handshakes_per_source per source address (more are
    refused), and when the table is full the oldest of the source holding most goes; an honest
    peer from another source then completes its handshake."""
    srv = Server(rig, max_handshakes=8, max_handshakes_per_source=4)
    flood = [Client(srv, identity=b"f%d" % i, source="10.6.6.6") for i in range(20)]
    answers = [f.send(f.hello) for f in flood]
    assert [type(a[0]) for a in answers].count(pm.Challenge) == 4
    assert srv.server.refused["handshake_busy"] == 16
    spread = [Client(srv, identity=b"s%d" % i, source=f"10.7.0.{i}") for i in range(4)]
    for c in spread:
        c.challenge()
    assert srv.server.counters["handshakes"] == 8  # full: 4 of 10.6.6.6, 4 others
    honest = Client(srv, identity=b"honest", source="10.0.0.2")
    assert isinstance(honest.connect(), pm.Welcome)
    assert srv.server.counters["handshake_drops"] == 1  # the oldest of 10.6.6.6 went
    assert [s[0] for s in srv.server.sessions()] == [b"honest"]


def test_c42_a_second_live_instance_claiming_a_peers_address_is_refused_and_both_keep_theirs(
    rig,
):
    """Two instances advertise one address: the second, while the first's session lives, is
    refused ``identity_collision`` (counted, logged) and the first keeps its session and
    leases. Once the first's connection is gone, or it is silent for peer_timeout_s, a new
    incarnation there is a restart."""
    srv = Server(rig, peer_timeout_s=2.0)
    held = keys_for(2, seed=71)
    rig.store(held)
    first = Client(srv, identity=b"first", source="198.18.0.1")
    first.connect(now=0.0)
    lease = first.one(pm.Lease(1, held, 60.0, ""), now=0.0)
    second = Client(
        srv, identity=b"second", incarnation=b"B" * pm.INCARNATION_BYTES, source="198.18.0.2"
    )
    assert second.handshake(now=1.0) == pm.Refused("identity_collision")
    assert srv.server.refused["identity_collision"] == 1
    assert srv.server.counters["collisions"] == 1 and srv.server.counters["restarts"] == 0
    assert [s[0] for s in srv.server.sessions()] == [b"first"]
    assert len(refs_of(rig.tm)) == 2  # the first's lease holds
    assert first.one(pm.Lookup(2, held), now=1.5).states == bytes([pm.READY] * 2)
    first.send(pm.Release(lease.lease), now=1.5)
    assert refs_of(rig.tm) == {}
    # the first goes silent past peer_timeout_s: a new incarnation there is a restart
    assert isinstance(second.handshake(now=3.6), pm.Welcome)
    assert srv.server.counters["restarts"] == 1
    assert [s[0] for s in srv.server.sessions()] == [b"second"]
    # and one whose connection is gone (the node's ROUTER no longer routes it) at once
    srv.server._reachable = lambda identity: identity != b"second"
    third = Client(srv, identity=b"third", incarnation=b"C" * pm.INCARNATION_BYTES)
    assert isinstance(third.handshake(now=3.7), pm.Welcome)
    assert srv.server.counters["restarts"] == 2


def test_c42_a_peer_advertising_this_instances_own_address_is_refused_as_a_collision(rig, caplog):
    """A peer that proves the secret but advertises an address this instance is dialed at (two
    instances configured with one identity) is refused ``identity_collision``, counted and
    logged naming the address; it gets no session and no descriptor."""
    srv = Server(rig)
    claims = Client(srv, identity=b"twin", advertise=SERVER_ADDR, source="198.18.0.3")
    with caplog.at_level("ERROR", logger="kvoffload.p2p"):
        assert claims.handshake() == pm.Refused("identity_collision")
    assert srv.server.refused["identity_collision"] == 1
    assert srv.server.counters["collisions"] == 1
    assert srv.server.sessions() == []
    assert all(SERVER_DESC not in f for f in claims.frames)
    assert "identity collision" in caplog.text and SERVER_ADDR in caplog.text
    # a peer advertising an address of its own is welcomed as before
    assert isinstance(Client(srv, identity=b"other").connect(), pm.Welcome)


# -- lookups and leases -------------------------------------------------------------------------


def test_lookups_answer_host_states_and_leases_pin_until_released(rig):
    srv = Server(rig)
    tm = rig.tm
    held = keys_for(3, seed=3)
    rig.store(held)
    (absent,) = keys_for(1, seed=4)
    c = Client(srv)
    c.connect()
    reply = c.one(pm.Lookup(5, [*held, absent]))
    assert reply == pm.LookupReply(5, bytes([pm.READY] * 3 + [pm.MISS]))
    lr = c.one(pm.Lease(6, [*held, absent], 10.0, ""))
    assert isinstance(lr, pm.LeaseReply) and lr.req == 6
    assert lr.slots == [tm.host.index[k] for k in held] + [-1]
    for k, s in zip(held, lr.slots):
        assert np.array_equal(rig.arena.rows[s], payload(k, rig.row_bytes))
    assert tm.pins_held() == refs_of(tm) == {s: 1 for s in lr.slots[:3]}
    assert c.send(pm.Release(lr.lease)) == []
    assert tm.pins_held() == refs_of(tm) == {}
    assert c.send(pm.Release(lr.lease)) == []  # again: nothing more is released
    n = srv.server.counters
    assert (n["lookups_served"], n["hits_served"], n["unknown_releases"]) == (4, 3, 1)


def test_c18_a_chunk_this_instance_moved_to_its_fs_tier_is_served_while_the_engine_is_idle(
    tmp_path,
):
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        srv = Server(rig)
        k1, *others = keys_for(5, seed=21)
        for k in [k1, *others]:  # k1 ends up in the fs tier only
            rig.store([k])
        assert k1 not in rig.tm.host.index
        c = Client(srv)
        c.connect()
        now = 0.0
        states = []
        deadline = time.monotonic() + 120  # a stuck run, never what is tested
        while True:  # the engine is not stepped: only the server's tick polls
            (state,) = c.one(pm.Lookup(1, [k1]), now).states
            states.append(state)
            if state != pm.PENDING:
                break
            assert time.monotonic() < deadline, "k1 never landed"
            now += 0.001
            srv.tick(now)
            time.sleep(0.001)
        assert states[0] == pm.PENDING and states[-1] == pm.READY
        lease = c.one(pm.Lease(2, [k1], 10.0, ""), now)
        assert np.array_equal(rig.arena.rows[lease.slots[0]], payload(k1, rig.row_bytes))
        c.send(pm.Release(lease.lease), now)
        assert rig.tm.pins_held() == refs_of(rig.tm) == {}
        assert not srv.server.wants_poll()


def test_a_lease_expires_at_its_ttl_capped_by_max_lease_s(rig):
    srv = Server(rig, max_lease_s=5.0, peer_timeout_s=100.0)
    tm = rig.tm
    held = keys_for(2, seed=5)
    rig.store(held)
    c = Client(srv)
    c.connect(now=0.0)
    short = c.one(pm.Lease(1, held[:1], 1.0, ""), now=0.0)
    long = c.one(pm.Lease(2, held[1:], 3600.0, ""), now=0.0)
    assert srv.server.counters["leases_held"] == 2
    srv.tick(0.5)
    assert refs_of(tm) == {short.slots[0]: 1, long.slots[0]: 1}
    srv.tick(1.0)
    assert refs_of(tm) == {long.slots[0]: 1}
    srv.tick(4.9)
    assert refs_of(tm) == {long.slots[0]: 1}
    srv.tick(5.0)
    assert tm.pins_held() == refs_of(tm) == {}
    assert srv.server.counters["lease_expiries"] == 2
    c.send(pm.Release(short.lease), now=6.0)  # too late: counted, nothing released twice
    assert srv.server.counters["unknown_releases"] == 1


def test_a_silent_session_is_dropped_with_its_leases(rig):
    srv = Server(rig, peer_timeout_s=2.0)
    tm = rig.tm
    held = keys_for(2, seed=6)
    rig.store(held)
    c = Client(srv)
    c.connect(now=0.0)
    c.one(pm.Lease(1, held, 60.0, ""), now=0.0)
    assert c.one(pm.Heartbeat(1, 0), now=1.5) == pm.HeartbeatAck(1, 4)
    assert srv.tick(3.0) == []  # heard from at 1.5
    assert refs_of(tm) != {}
    replies = srv.tick(3.5)
    assert [pm.decode(f) for _, f in replies] == [pm.Refused("timeout")]
    assert tm.pins_held() == refs_of(tm) == {}
    assert srv.server.sessions() == []
    assert c.one(pm.Lookup(2, held), now=3.6) == pm.Refused("unauthenticated")


def test_a_restarted_client_drops_the_old_sessions_leases_and_a_reconnect_keeps_them(rig):
    srv = Server(rig)
    tm = rig.tm
    held = keys_for(2, seed=7)
    rig.store(held)
    a = Client(srv, identity=b"conn-1")
    a.connect()
    lease = a.one(pm.Lease(1, held[:1], 60.0, ""))
    # the same instance reconnects on a new connection: its lease goes on
    again = Client(srv, identity=b"conn-2")
    again.connect()
    assert refs_of(tm) == {lease.slots[0]: 1}
    assert again.send(pm.Release(lease.lease)) == []
    assert refs_of(tm) == {}
    lease2 = again.one(pm.Lease(2, held, 60.0, ""))
    assert len(refs_of(tm)) == 2
    # the instance restarts: same advertise, new incarnation, and its old connection is gone;
    # the old leases go
    srv.server._reachable = lambda identity: identity != b"conn-2"
    restarted = Client(srv, identity=b"conn-3", incarnation=b"B" * pm.INCARNATION_BYTES)
    restarted.connect()
    assert tm.pins_held() == refs_of(tm) == {}
    assert srv.server.counters["restarts"] == 1
    assert [s[0] for s in srv.server.sessions()] == [b"conn-3"]
    assert restarted.send(pm.Release(lease2.lease)) == []  # not its lease
    assert srv.server.counters["unknown_releases"] == 1


def test_peers_never_lease_more_than_max_leased_chunks(rig):
    srv = Server(rig, max_leased_chunks=3)
    held = keys_for(5, seed=8)
    rig.store(held)
    c = Client(srv)
    c.connect()
    first = c.one(pm.Lease(1, held[:2], 60.0, ""))
    second = c.one(pm.Lease(2, held[2:], 60.0, ""))
    assert -1 not in first.slots
    assert second.slots[0] >= 0 and second.slots[1:] == [pm.LEASE_BUSY] * 2
    c.send(pm.Release(first.lease))
    third = c.one(pm.Lease(3, held[3:], 60.0, ""))
    assert -1 not in third.slots
    assert rig.tm.pins_held() == refs_of(rig.tm)


def test_a_lease_is_answered_once_granted_with_the_digests_and_the_lifetime_the_server_decided(
    rig,
):
    srv = Server(rig, auto=False, max_lease_s=5.0, peer_timeout_s=100.0)
    held = keys_for(3, seed=30)
    rig.store(held)
    (absent,) = keys_for(1, seed=31)
    c = Client(srv)
    welcome = c.connect(now=0.0)
    assert srv.grants.sessions == {welcome.data_token}
    # the reply waits for the worker's grant: no peer learns a slot before it is granted
    assert c.send(pm.Lease(1, [*held, absent], 3600.0, ""), now=1.0) == []
    ((gid, (token, slots, until)),) = srv.grants.live.items()
    assert token == welcome.data_token and until == 6.0  # capped by max_lease_s
    assert slots == [rig.tm.host.index[k] for k in held]
    rig.arena.rows[slots[0]] = 3  # digests are taken when granted, not when leased
    replies = srv.answer(now=2.0)
    (lr,) = [pm.decode(f) for _, f in replies]
    assert isinstance(lr, pm.LeaseReply) and lr.req == 1 and lr.slots == [*slots, -1]
    assert lr.ttl_s == 4.0  # what is left of the lifetime granted at 1.0
    d = pm.DIGEST_BYTES
    assert lr.digests == srv.grants.digests(gid) + bytes(d)
    # a grant the worker could not make is answered as nothing leased, and its pins go
    assert c.send(pm.Lease(2, held[1:], 10.0, ""), now=2.0) == []
    (gid2,) = srv.grants.asked
    srv.grants.asked.clear()
    (lr2,) = [pm.decode(f) for _, f in srv.server.granted(gid2, None, 2.0)]
    assert lr2.slots == [-1, -1] and srv.server.counters["grants_refused"] == 1
    srv.answer(now=2.0)
    assert rig.tm.pins_held() == refs_of(rig.tm) == {s: 1 for s in slots}


def test_a_leases_pins_go_only_once_the_worker_acknowledged_its_revocation(rig):
    srv = Server(rig, auto=False, peer_timeout_s=2.0)
    tm = rig.tm
    held = keys_for(3, seed=32)
    rig.store(held)
    c = Client(srv)
    welcome = c.connect(now=0.0)
    leases = []
    for i, k in enumerate(held):
        c.send(pm.Lease(i, [k], 1.0 + i, ""), now=0.0)
        (lr,) = [pm.decode(f) for _, f in srv.answer(now=0.0)]
        leases.append(lr)
    assert len(refs_of(tm)) == 3
    # released, expired, its session gone: each is revoked, and its pins stay until answered
    c.send(pm.Release(leases[0].lease), now=0.5)
    assert srv.grants.revoking and len(refs_of(tm)) == 3
    srv.answer(now=0.5)
    assert len(refs_of(tm)) == 2
    srv.tick(2.1)  # the second lease expires
    assert len(srv.grants.revoking) == 1 and len(refs_of(tm)) == 2
    srv.answer(now=2.1)
    srv.tick(2.6)  # the session is silent
    assert welcome.data_token not in srv.grants.sessions
    assert len(srv.grants.revoking) == 1 and len(refs_of(tm)) == 1
    srv.answer(now=2.6)
    assert tm.pins_held() == refs_of(tm) == {}
    assert srv.grants.live == {}


def test_c46_a_peer_leasing_all_it_can_and_never_reading_leaves_the_other_peer_its_share(rig):
    srv = Server(rig, max_leased_chunks=8, max_lease_s=30.0, stale_lease_s=2.0)
    held = keys_for(12, seed=33)
    rig.store(held)
    greedy = Client(srv, identity=b"greedy", advertise="10.0.0.9:5710")
    honest = Client(srv, identity=b"honest", incarnation=b"H" * 16)
    greedy.connect(now=0.0)
    honest.connect(now=0.0)
    # the greedy peer asks everything with a huge lifetime, and again: half the cap, 30 s
    first = greedy.one(pm.Lease(1, held[:8], 86400.0, ""), now=0.0)
    again = greedy.one(pm.Lease(2, held[8:], 86400.0, ""), now=0.0)
    assert sum(s >= 0 for s in first.slots) == 4 and first.ttl_s == 30.0
    assert again.slots == [pm.LEASE_BUSY] * 4
    # the other peer is served its share
    lr = honest.one(pm.Lease(3, held[4:8], 10.0, ""), now=0.1)
    assert all(s >= 0 for s in lr.slots), lr
    assert rig.tm.pins_held() == refs_of(rig.tm)


def test_c46_leases_a_peer_holds_without_reading_are_taken_back_for_another_peer(rig):
    srv = Server(rig, max_leased_chunks=8, max_lease_s=30.0, stale_lease_s=2.0, peer_timeout_s=10.0)
    held = keys_for(12, seed=34)
    rig.store(held)
    greedy = Client(srv, identity=b"greedy", advertise="10.0.0.9:5710")
    greedy.connect(now=0.0)
    # alone, it takes the whole cap, in leases it never releases
    for i in range(4):
        lr = greedy.one(pm.Lease(i, held[2 * i : 2 * i + 2], 86400.0, ""), now=0.0)
        assert all(s >= 0 for s in lr.slots)
    assert srv.server.counters["chunks_leased_now"] == 8
    honest = Client(srv, identity=b"honest", incarnation=b"H" * 16)
    honest.connect(now=3.0)
    # held past the transfer deadline: taken back, oldest first, just enough; the other is served
    lr = honest.one(pm.Lease(9, held[8:11], 10.0, ""), now=3.0)
    assert all(s >= 0 for s in lr.slots), lr
    n = srv.server.counters
    assert n["leases_reclaimed"] == 2 and n["chunks_leased_now"] == 7
    assert rig.tm.pins_held() == refs_of(rig.tm)
    # what was taken back is gone for the greedy peer (a Release of it is unknown)
    assert greedy.send(pm.Release(first_lease_of(greedy)), now=3.1) == []
    assert srv.server.counters["unknown_releases"] == 1


def test_c46_leases_being_read_are_not_taken_back_the_other_peer_waits_for_room(rig):
    srv = Server(rig, max_leased_chunks=4, stale_lease_s=100.0, peer_timeout_s=4.0)
    held = keys_for(6, seed=35)
    rig.store(held)
    busy = Client(srv, identity=b"busy", advertise="10.0.0.9:5710")
    busy.connect(now=0.0)
    lr = busy.one(pm.Lease(1, held[:4], 10.0, ""), now=0.0)
    other = Client(srv, identity=b"other", incarnation=b"H" * 16)
    other.connect(now=0.5)
    # the cap is reached and the busy peer's lease is fresh: the other peer's Lease waits...
    assert other.send(pm.Lease(2, held[4:6], 10.0, ""), now=0.5) == []
    assert srv.server.counters["leases_reclaimed"] == 0
    # ...until the busy peer releases it (its read settled)
    ((to, frame),) = srv.handle(busy.identity, pm.encode(pm.Release(lr.lease)), 1.0)
    reply = pm.decode(frame)
    assert to == other.identity and isinstance(reply, pm.LeaseReply), reply
    assert all(s >= 0 for s in reply.slots), reply
    # a wait that no room ends is answered with what fits by peer_timeout_s / 2
    busy.one(pm.Lease(3, held[:2], 10.0, ""), now=1.0)  # the cap is reached again
    third = Client(srv, identity=b"third", incarnation=b"T" * 16, advertise="10.0.0.7:5710")
    third.connect(now=1.0)
    assert third.send(pm.Lease(4, held[2:3], 10.0, ""), now=1.0) == []
    assert [pm.decode(f) for _, f in srv.tick(2.0)] == []
    (late,) = [pm.decode(f) for _, f in srv.tick(3.1)]
    assert late.req == 4 and late.slots == [pm.LEASE_BUSY], late


def first_lease_of(c: Client) -> int:
    return next(m.lease for m in map(pm.decode, c.frames) if isinstance(m, pm.LeaseReply))


# -- pushes -------------------------------------------------------------------------------------


def test_offers_are_admitted_within_the_quota_pulled_and_published(rig):
    srv = Server(rig, quota_chunks=3)
    tm = rig.tm
    c = Client(srv)
    c.connect()
    offered = keys_for(5, seed=9)
    reply = c.one(offer(1, offered, 77, [10, 11, -1, 13, 14]))
    # the third offered key has no leased slot on the pusher: not admitted
    assert reply == pm.OfferReply(1, bytes([1, 1, 0, 1, 0]))
    ((ident, desc, lease, pairs),) = srv.pulls
    assert (ident, desc, lease) == (b"client-1", CLIENT_DESC, 77)
    # pulled with the session's token, checked against the offered keys' digests, in its time
    ((_, token, _, _, digests, ttl_s),) = srv.pull_args
    assert token in srv.grants.sessions and ttl_s == 60.0
    assert digests == bytes(range(16)) * 3
    assert [r for _, r in pairs] == [10, 11, 13]
    local = [s for s, _ in pairs]
    assert all(tm.host.state[s] == WRITING for s in local)
    assert srv.server.free_quota() == 0
    assert c.one(offer(2, keys_for(1, seed=10), 78, [20])) == pm.OfferReply(2, b"\x00")
    # the READ lands (what the peer worker does), then settles: two keys ok, one failed
    pulled = [offered[0], offered[1], offered[3]]
    for k, s in zip(pulled, local):
        rig.arena.rows[s] = payload(k, rig.row_bytes)
    replies = srv.server.pull_settled(b"client-1", 77, [True, True, False])
    assert [(i, pm.decode(f)) for i, f in replies] == [
        (b"client-1", pm.Pulled(77, bytes([1, 1, 0, 0, 0])))
    ]
    assert np.array_equal(rig.read(pulled[:1])[0], payload(pulled[0], rig.row_bytes))
    assert pulled[2] not in tm.host.index
    assert srv.server.free_quota() == 1  # two pushed chunks held count against the quota
    assert srv.server.pull_settled(b"client-1", 77, [True]) == []  # not in flight any more
    n = srv.server.counters
    assert (n["chunks_admitted"], n["chunks_pulled"], n["pull_failures"]) == (3, 2, 1)
    assert n["bytes_offered"] == 6 * rig.row_bytes and n["unknown_pulls"] == 1
    # once the host tier evicts the pushed chunks, the quota is free again
    rig.evict_all()
    assert srv.server.free_quota() == 3
    assert tm.pins_held() == refs_of(tm) == {}


def test_a_pull_outlives_its_session_and_its_slots_stay_reserved_until_it_settles(rig):
    srv = Server(rig, peer_timeout_s=1.0)
    tm = rig.tm
    c = Client(srv)
    c.connect(now=0.0)
    offered = keys_for(2, seed=11)
    c.one(offer(1, offered, 5, [0, 1]), now=0.0)
    ((_, _, _, pairs),) = srv.pulls
    srv.tick(5.0)  # the pusher went silent
    assert srv.server.sessions() == []
    assert all(tm.host.state[s] == WRITING for s, _ in pairs)  # a READ may still write them
    rig.evict_all()  # a full store around them never takes them
    assert all(tm.host.state[s] == WRITING for s, _ in pairs)
    assert srv.server.pull_settled(b"client-1", 5, [False, False]) == []  # nobody to tell
    assert not any(k in tm.host.index for k in offered)
    assert tm.host.num_writing == 0


def test_an_offer_that_does_not_add_up_is_answered_not_accepted(rig):
    srv = Server(rig, quota_chunks=8)
    c = Client(srv)
    c.connect()
    keys = keys_for(3, seed=12)
    assert c.one(offer(1, keys, 9, [1, 2])) == pm.OfferReply(1, b"\x00\x00\x00")
    assert c.one(offer(2, keys[:1], 9, [1])) == pm.OfferReply(2, b"\x01")
    assert c.one(offer(3, keys[1:], 9, [2, 3])) == pm.OfferReply(3, b"\x00\x00")  # lease 9 busy
    assert srv.server.counters["bad_offers"] == 2
    srv.server.pull_settled(b"client-1", 9, [True])


# -- fuzz ---------------------------------------------------------------------------------------

_KEYS = keys_for(24, seed=20)
_key = st.sampled_from(_KEYS) | st.binary(min_size=0, max_size=pm.MAX_KEY_BYTES)
_keys = st.lists(_key, max_size=12)
_slot = st.integers(-1, 40)
_id = st.integers(0, 6)
_stored = st.lists(st.sampled_from(_KEYS), min_size=1, max_size=6)
_valid = st.one_of(  # well-formed, so they reach the server's logic, with hostile values
    st.builds(pm.Lookup, _id, _keys),
    st.builds(pm.Lease, _id, _stored, st.floats(0, 100), st.text(max_size=8)),
    st.builds(pm.Lease, _id, _keys, st.floats(0, 100), st.just("")),
    st.builds(pm.Release, _id),
    st.builds(offer, _id, _stored, _id, st.lists(_slot, min_size=1, max_size=6), st.floats(0, 100)),
    st.builds(offer, _id, _keys, _id, st.lists(_slot, max_size=12), st.floats(0, 100)),
    st.builds(
        pm.Offer,
        _id,
        _keys,
        _id,
        st.lists(_slot, max_size=12),
        st.floats(0, 9),
        st.binary(max_size=40),
    ),
    st.builds(pm.Heartbeat, _id, st.integers(0, 10)),
)
_out_of_place = st.one_of(  # messages a server never expects from a client
    st.builds(pm.HeartbeatAck, _id, st.integers(0, 10)),
    st.builds(pm.Refused, st.text(max_size=8)),
    st.builds(
        pm.Challenge,
        st.integers(0, 3),
        st.just(b"C" * 16),
        st.just("h:1"),
        st.just(b"n" * 32),
        st.just(b"m" * 32),
    ),
    st.builds(
        pm.Welcome,
        st.binary(max_size=8),
        st.floats(0, 10),
        st.integers(0, 9),
        st.binary(min_size=32, max_size=32),
        st.just(b"m" * 32),
    ),
    st.builds(pm.Pulled, _id, st.binary(max_size=4)),
    st.builds(pm.Auth, st.binary(min_size=32, max_size=32), st.binary(max_size=8)),
)
_client = st.integers(0, 2)
_action = st.one_of(
    st.tuples(st.just("msg"), _client, _valid),
    st.tuples(st.just("msg"), _client, _valid),
    st.tuples(st.just("msg"), _client, _valid),
    st.tuples(st.just("release"), _client, st.integers(0, 5)),
    st.tuples(st.just("settle"), st.integers(0, 5), st.lists(st.booleans(), max_size=12)),
    st.tuples(st.just("store"), st.integers(0, 20), st.none()),
    st.tuples(st.just("tick"), st.floats(0, 3), st.none()),
    st.tuples(st.just("connect"), _client, st.integers(0, 2)),
    st.tuples(st.just("msg"), _client, _out_of_place),
    st.tuples(st.just("frame"), _client, st.binary(max_size=64)),
)


@pytest.fixture(scope="module")
def fuzz_rig():
    with Rig(num_slots=12) as r:
        yield r


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=st.lists(_action, max_size=60))
def test_fuzzed_frames_and_hostile_messages_never_raise_nor_leak_a_pin(fuzz_rig, actions):
    rig = fuzz_rig
    tm = rig.tm
    srv = Server(rig, quota_chunks=5, max_leased_chunks=6, max_handshakes=4)
    server = srv.server
    clients = [
        Client(
            srv,
            identity=b"peer-%d" % i,
            incarnation=bytes([65 + i]) * 16,
            advertise=f"10.0.0.{i + 2}:5710",  # 10.0.0.1 is the server's (SERVER_ADDR)
        )
        for i in range(3)
    ]
    now = 0.0
    for c in clients:
        c.connect(now)
    for kind, a, b in actions:
        if kind == "frame":
            srv.handle(clients[a].identity, b, now)
        elif kind == "msg":
            clients[a].send(b, now)
        elif kind == "release":
            leases = [
                m.lease for m in map(pm.decode, clients[a].frames) if isinstance(m, pm.LeaseReply)
            ]
            if leases:
                clients[a].send(pm.Release(leases[b % len(leases)]), now)
        elif kind == "connect":
            c = clients[a]
            c.hello = pm.Hello(
                pm.PROTOCOL_VERSION,
                c.hello.incarnation,
                f"10.0.0.{b + 1}:5710",
                SERVER_ADDR,
                c.hello.namespace_id,
                os.urandom(32),
            )
            # the server's own address or a live client's: refused identity_collision
            c.handshake(now)
        elif kind == "settle" and srv.pulls:
            ident, _, lease, pairs = srv.pulls.pop(a % len(srv.pulls))
            for (s, _r), ok in zip(pairs, b):
                if ok:  # the READ wrote these rows
                    rig.arena.rows[s] = 7
            server.pull_settled(ident, lease, b)
        elif kind == "tick":
            now += a
            srv.tick(now)
        elif kind == "store":
            plan = tm.prepare_store(_KEYS[a : a + 4])
            if plan is not None:
                tm.complete_store(plan.keys, True)
        assert tm.pins_held() == refs_of(tm)
    assert server.counters["internal_errors"] == 0
    # every pull still in flight settles; then every lease and session expires
    for ident, _, lease, pairs in srv.pulls:
        server.pull_settled(ident, lease, [False] * len(pairs))
    srv.tick(now + 10_000.0)
    assert server.counters["chunks_leased_now"] == 0 and server.counters["chunks_pulling"] == 0
    assert tm.pins_held() == refs_of(tm) == {}
    assert tm.host.num_writing == 0
    assert server.counters["internal_errors"] == 0
