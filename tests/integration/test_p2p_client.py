"""The p2p tier's client role (kvoffload.tiers.p2p.client.PeerClient) without sockets: its handshake,
lookups, lease/load parts and offers against a real serving role (PeerServer over a real
TieringManager and arena), every message type at every handshake state, and a hypothesis fuzz of a
hostile peer (malformed, reordered, replayed and duplicated messages) beside an honest one.

The client is socket-free: frames go in as bytes, and what it asks its node to do comes back as
Open / Send / Close / Trusted / Restarted, which :class:`Harness` applies as the node thread would
(a frame for the honest peer is handed to its PeerServer, whose replies come back only while the
socket that sent it is still open). Where the node's peer worker would READ a leased slot,
:class:`FakeWorker` keeps to PeerWorkerHandle's contract (the same refusals of a bad pair, each
transfer settled exactly once, each grant and revocation answered once) and the test copies the
honest instance's row itself; the honest instance's own worker grants its leases
(``test_p2p_server.Grants``, answered at once).
"""

from __future__ import annotations

import itertools
import typing
from collections import Counter, defaultdict

import msgspec
import numpy as np
import pytest
from helpers import Rig, keys_for, payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from integration.test_p2p_server import Grants
from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.p2p.client import (
    LEASE_CHUNKS,
    MAX_INFLIGHT_CHUNKS,
    Close,
    Open,
    PeerClient,
    Restarted,
    Send,
    Trusted,
)
from kvoffload.tiers.p2p.commands import (
    Connect,
    Load,
    LoadDone,
    PeerDown,
    Probe,
    Push,
    PushDone,
    Verdict,
)
from kvoffload.tiers.p2p.server import PeerServer

SECRET = b"s3cret-shared-by-the-peers"
HONEST, HOSTILE = "10.0.0.2:5710", "10.0.0.3:5710"
HEARTBEAT_S, PEER_TIMEOUT_S, DEADLINE_S, LEASE_TTL_S = 0.5, 2.0, 0.5, 3.0
LOCAL_SLOTS = 1 << 20
MAX_PAIRS = 1024  # kvoffload.workers.p2p_transport.MAX_PAIRS (its transport is not needed here)


TOKEN = b"T" * pm.TOKEN_BYTES  # a scripted peer's session data token


def lease_reply(req: int, lease: int, slots: list[int], ttl_s: float = LEASE_TTL_S):
    """A LeaseReply granting ``ttl_s`` with a digest per slot."""
    return pm.LeaseReply(req, lease, slots, ttl_s, bytes(pm.DIGEST_BYTES * len(slots)))


def descriptor(num_slots: int, who: str) -> bytes:
    """A transport descriptor :class:`FakeWorker` accepts: the peer arena's slot count."""
    return f"desc:{num_slots}:{who}".encode()


class FakeWorker:
    """The peer worker as the client role uses it (``Transfers``), keeping to PeerWorkerHandle's
    contract: a descriptor it refuses raises; a READ of a pair outside either arena, of no pairs
    or of a local slot twice raises ValueError and sends nothing; every READ is settled once, by
    the test (:meth:`Harness.settle`); removing a peer's last user dooms its transfers."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.generation = 1
        self.ready = True
        self.users: dict[str, int] = {}
        self.arenas: dict[str, int] = {}  # name -> the peer's slots
        self.inflight: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        self.reads: dict[int, tuple[float, bytes, float]] = {}  # tid -> (deadline, digests, end)
        self.tids = itertools.count(1)
        self.sessions: Counter[bytes] = Counter()
        self.grants: dict[int, tuple[bytes, list[int], float]] = {}  # gid -> token, slots, until
        self.granting: list[int] = []
        self.revoking: list[int] = []
        self.gids = itertools.count(1)

    @property
    def descriptor(self) -> bytes | None:
        return descriptor(LOCAL_SLOTS, f"client-{self.generation}") if self.ready else None

    def acquire_peer(self, desc: bytes, token: bytes) -> str:
        tag, _, rest = desc.partition(b":")
        slots = rest.partition(b":")[0]
        if tag != b"desc" or not slots.isdigit() or int(slots) == 0:
            raise ValueError(f"not a transport descriptor: {desc[:16]!r}")
        if len(token) != pm.TOKEN_BYTES:
            raise ValueError("a session token is 32 bytes")
        name = "peer#" + desc.hex()[:24] + token.hex()[:8]
        self.users[name] = self.users.get(name, 0) + 1
        self.arenas[name] = int(slots)
        return name

    def release_peer(self, name: str) -> None:
        n = self.users.get(name, 0)
        if n <= 1:
            self.users.pop(name, None)
            self.arenas.pop(name, None)
        else:
            self.users[name] = n - 1

    def read(
        self,
        name: str,
        pairs: list[tuple[int, int]],
        deadline_s: float,
        digests: bytes,
        not_after: float,
    ) -> int:
        if name not in self.arenas:
            raise ValueError(f"peer {name!r} was not added (or was removed)")
        if not 0 < len(pairs) <= MAX_PAIRS or not deadline_s > 0:
            raise ValueError("bad transfer")
        if len(digests) != pm.DIGEST_BYTES * len(pairs):
            raise ValueError("a digest per pair")
        for lo, re_ in pairs:
            if not 0 <= lo < LOCAL_SLOTS:
                raise ValueError(f"local slot {lo} is outside the arena")
            if not 0 <= re_ < self.arenas[name]:
                raise ValueError(f"peer slot {re_} is outside its arena")
        if len({lo for lo, _ in pairs}) != len(pairs):
            raise ValueError("a local destination slot is named twice in one transfer")
        tid = next(self.tids)
        self.inflight[tid] = (name, list(pairs))
        self.reads[tid] = (deadline_s, digests, not_after)
        return tid

    def add_session(self, token: bytes) -> None:
        assert len(token) == pm.TOKEN_BYTES
        self.sessions[token] += 1

    def drop_session(self, token: bytes) -> None:
        assert self.sessions[token] > 0, "a session dropped that was not added"
        self.sessions[token] -= 1

    def grant(self, token: bytes, slots: list[int], until: float) -> int:
        if not slots or not all(0 <= s < LOCAL_SLOTS for s in slots):
            raise ValueError("bad grant")
        gid = next(self.gids)
        self.grants[gid] = (token, list(slots), until)
        self.granting.append(gid)
        return gid

    def revoke(self, gid: int) -> None:
        assert gid in self.grants and gid not in self.revoking, gid
        self.revoking.append(gid)

    def restart(self) -> list[int]:
        """The worker died and a new one runs: every transfer failed, no peer, a new descriptor."""
        self.generation += 1
        self.users.clear()
        self.arenas.clear()
        dead = list(self.inflight)
        return dead


class HonestPeer:
    """A serving instance that follows the protocol: a real PeerServer over a rig."""

    def __init__(self, rig: Rig, addr: str, quota_chunks: int = 0):
        self.rig = rig
        self.pulls: list[tuple[bytes, bytes, int, list[tuple[int, int]]]] = []
        self.grants = Grants(rig)
        self.server = PeerServer(
            rig.tm,
            secret=SECRET,
            namespace_id=rig.ns.id(),
            incarnation=b"H" * pm.INCARNATION_BYTES,
            addresses=[addr],
            descriptor=lambda: descriptor(rig.arena.num_slots, "honest"),
            grants=self.grants,
            pull=lambda i, d, _t, lease, pairs, _d, _ttl: self.pulls.append((i, d, lease, pairs)),
            quota_chunks=quota_chunks,
            heartbeat_s=HEARTBEAT_S,
            peer_timeout_s=PEER_TIMEOUT_S,
            max_lease_s=LEASE_TTL_S,
            max_leased_chunks=rig.arena.num_slots,
        )

    def answer(self, now: float) -> list[tuple[bytes, bytes]]:
        """Its worker answers every grant and revocation asked so far (and those they lead to)."""
        g, out = self.grants, []
        while g.asked or g.revoking:
            while g.asked:
                gid = g.asked.pop(0)
                out += self.server.granted(gid, g.digests(gid), now)
            while g.revoking:
                gid = g.revoking.pop(0)
                del g.live[gid]
                out += self.server.revoked(gid, now)
        return out

    def handle(self, ident: bytes, frame: bytes, now: float) -> list[tuple[bytes, bytes]]:
        return self.server.handle(ident, frame, now) + self.answer(now)

    def tick(self, now: float) -> list[tuple[bytes, bytes]]:
        return self.server.tick(now) + self.answer(now)


class Harness:
    """One PeerClient and what its node would do with its outputs (see the module docstring)."""

    def __init__(self, rig: Rig, honest_quota: int = 0, **kw):
        self.rig = rig
        self.worker = FakeWorker(rig.row_bytes)
        self.counts: Counter[str] = Counter()
        nonces = itertools.count()
        kw.setdefault("lease_ttl_s", LEASE_TTL_S)
        kw.setdefault("static_peers", (HONEST, HOSTILE))  # configured: never forgotten when idle
        self.client = PeerClient(
            transfers=self.worker,
            incarnation=b"C" * pm.INCARNATION_BYTES,
            namespace_id=rig.ns.id(),
            secret=SECRET,
            heartbeat_s=HEARTBEAT_S,
            peer_timeout_s=PEER_TIMEOUT_S,
            transfer_deadline_s=DEADLINE_S,
            advertise="10.0.0.1:5710",
            count=lambda what, n=1: self.counts.update({what: n}),
            server_free_quota=lambda: 3,
            random_bytes=lambda n: next(nonces).to_bytes(n, "little"),
            **kw,
        )
        self.now = 100.0  # seconds, monotonic
        self.sockets: dict[str, bytes] = {}  # peer -> routing id of its open DEALER
        self.opened: Counter[str] = Counter()
        self.sent: defaultdict[str, list[pm.PeerMessage]] = defaultdict(list)
        self.trusted: list[str] = []
        self.restarted: list[str] = []
        self.honest: dict[str, HonestPeer] = {}
        self.inbox: list[tuple[str, bytes, bytes]] = []  # (peer, routing id, frame) for honest
        self.local: dict[int, bytes] = {}  # local slot -> the bytes a settled READ put there
        self.received: defaultdict[str, list[bytes]] = defaultdict(list)  # honest peers' frames
        self.results: list = []
        self.challenges: dict[str, pm.Challenge] = {}  # the last one made for each peer
        self.hold_worker = False  # True: our worker's grants and revocations wait for the test

    # -- the node's side ------------------------------------------------------------------------

    def apply(self, outs) -> None:
        for out in outs:
            match out:
                case Open():
                    host, _, port = out.peer.rpartition(":")
                    assert (out.host, out.port) == (host, int(port))
                    self.sockets[out.peer] = out.routing_id
                    self.opened[out.peer] += 1
                case Close():
                    self.sockets.pop(out.peer, None)
                case Send():
                    assert out.peer in self.sockets, "a frame for a peer with no socket"
                    self.sent[out.peer].append(pm.decode(out.frame))
                    if out.peer in self.honest:
                        self.inbox.append((out.peer, self.sockets[out.peer], out.frame))
                case Trusted():
                    self.trusted.append(out.peer)
                case Restarted():
                    self.restarted.append(out.peer)
        self._collect()
        if not self.hold_worker:
            self.answer_worker()

    def answer_worker(self) -> None:
        """Our worker answers the grants (zero digests: its rows are not modelled) and the
        revocations the client asked for."""
        w = self.worker
        while w.granting or w.revoking:
            if w.granting:
                gid = w.granting.pop(0)
                d = bytes(pm.DIGEST_BYTES * len(w.grants[gid][1]))
                self.apply(self.client.granted(gid, d, self.now))
            else:
                gid = w.revoking.pop(0)
                del w.grants[gid]
                self.apply(self.client.revoked(gid, self.now))

    def _collect(self) -> None:
        results = self.client.results
        while results:
            self.results.append(results.popleft())

    def pump(self) -> None:
        """Hand frames to the honest peers and their replies back, until quiet."""
        while self.inbox:
            peer, ident, frame = self.inbox.pop(0)
            for to, reply in self.honest[peer].handle(ident, frame, self.now):
                self.reply(peer, to, reply)

    def reply(self, peer: str, ident: bytes, frame: bytes) -> None:
        if self.sockets.get(peer) == ident:  # else that socket is closed: the frame is lost
            self.received[peer].append(frame)
            self.apply(self.client.on_frame(peer, frame, self.now))

    # -- driving it -----------------------------------------------------------------------------

    def command(self, *cmds) -> None:
        self.apply(self.client.commands(cmds, self.now))
        self.pump()

    def deliver(self, peer: str, msg_or_frame) -> None:
        frame = msg_or_frame if isinstance(msg_or_frame, bytes) else pm.encode(msg_or_frame)
        self.apply(self.client.on_frame(peer, frame, self.now))
        self.pump()

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        self.apply(self.client.tick(self.now))
        for peer, h in self.honest.items():
            for to, reply in h.tick(self.now):
                self.reply(peer, to, reply)
        self.pump()

    def settle(self, tid: int, ok: bool, reason: str = "", bad: tuple[int, ...] = ()) -> None:
        name, pairs = self.worker.inflight.pop(tid)
        if ok:
            rows = self.rig.arena.rows
            for lo, re_ in pairs:  # what the READ wrote (meaningful for the honest peer's rows)
                self.local[lo] = bytes(rows[re_ % self.rig.arena.num_slots])
        why = reason or "transfer_failed"
        self.apply(self.client.transfer_settled(tid, ok, why, self.now, bad))
        self.pump()

    def settle_honest(self) -> None:
        """The worker finishes every READ of an honest peer's slots."""
        honest_names = {
            link.worker_name for p, link in self.client.links.items() if p in self.honest
        }
        for tid, (name, _) in list(self.worker.inflight.items()):
            if name in honest_names:
                self.settle(tid, True)

    def settle_pulls(self, ok: bool = True) -> None:
        """The honest peers' workers finish their pulls of our offers."""
        for peer, h in self.honest.items():
            while h.pulls:
                ident, _, lease, pairs = h.pulls.pop(0)
                for s, _ in pairs:
                    if ok:
                        h.rig.arena.rows[s] = 7
                for to, reply in h.server.pull_settled(ident, lease, [ok] * len(pairs)):
                    self.reply(peer, to, reply)
                for to, reply in h.answer(self.now):
                    self.reply(peer, to, reply)
        self.pump()

    def add_honest(self, peer: str, quota_chunks: int = 0) -> HonestPeer:
        h = self.honest[peer] = HonestPeer(self.rig, peer, quota_chunks)
        return h

    def link(self, peer: str):
        return self.client.links[peer]

    def last(self, peer: str, kind: type):
        msgs = [m for m in self.sent[peer] if isinstance(m, kind)]
        return msgs[-1] if msgs else None

    def challenge(
        self,
        peer: str,
        *,
        secret: bytes = SECRET,
        incarnation: bytes = b"X" * 16,
        version: int = pm.PROTOCOL_VERSION,
    ) -> pm.Challenge:
        """The Challenge a server knowing ``secret`` answers the last Hello to ``peer`` with."""
        hello = self.last(peer, pm.Hello)
        ch = pm.Challenge(version, incarnation, peer, b"n" * pm.NONCE_BYTES, pm.ZERO_MAC)
        ch.mac = pm.handshake_mac(pm.transcript_key(secret), "server", hello, ch)
        self.challenges[peer] = ch
        return ch

    def welcome(
        self, peer: str, quota: int = 0, desc: bytes | None = None, secret: bytes = SECRET
    ) -> pm.Welcome:
        """The Welcome a server knowing ``secret`` answers our last Auth to ``peer`` with (after
        the last :meth:`challenge` made for it)."""
        w = pm.Welcome(
            descriptor(64, peer) if desc is None else desc, HEARTBEAT_S, quota, TOKEN, pm.ZERO_MAC
        )
        transcript = (self.last(peer, pm.Hello), self.challenges[peer], self.last(peer, pm.Auth))
        w.mac = pm.handshake_mac(pm.transcript_key(secret), "welcome", *transcript, w)
        return w

    def up(self, peer: str, quota: int = 0, desc: bytes | None = None) -> None:
        """Take a scripted (non-honest) peer's session up."""
        self.command(Connect(peer))
        self.deliver(peer, self.challenge(peer))
        self.deliver(peer, self.welcome(peer, quota, desc))
        assert self.link(peer).up

    def results_of(self, kind: type) -> list:
        return [r for r in self.results if isinstance(r, kind)]


@pytest.fixture
def rig():
    with Rig(num_slots=16) as r:
        yield r


def refs_of(tm) -> dict[int, int]:
    return {s: r for s, r in enumerate(tm.host.refs) if r}


# -- handshake --------------------------------------------------------------------------------


def test_a_session_is_up_once_both_sides_proved_the_secret_and_queued_requests_go_then(rig):
    held = keys_for(2, seed=1)
    rig.store(held)
    h = Harness(rig)
    honest = h.add_honest(HONEST)
    # the probe opens the session; its Lookup waits for the handshake, which the server answers
    h.command(Probe(held[0], (HONEST,), None))
    kinds = [type(m) for m in h.sent[HONEST]]
    assert kinds == [pm.Hello, pm.Auth, pm.Lookup], kinds
    auth = h.last(HONEST, pm.Auth)
    assert auth.descriptor == h.worker.descriptor  # ours crosses only after the server proved
    assert h.link(HONEST).up and h.trusted == [HONEST]
    assert h.results == [Verdict(held[0], HONEST)]
    assert honest.server.sessions() == [(h.sockets[HONEST], "10.0.0.1:5710", b"C" * 16)]


def test_a_server_that_does_not_prove_the_secret_never_gets_our_descriptor(rig):
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE, secret=b"an-impostor's-secret"))
    assert h.link(HOSTILE).state == "down" and HOSTILE not in h.sockets
    assert [type(m) for m in h.sent[HOSTILE]] == [pm.Hello]
    assert h.counts["refused_bad_mac"] == 1
    assert h.results == [PeerDown(HOSTILE)]


def test_a_peer_that_does_not_answer_the_handshake_is_down_and_retried_with_backoff(rig):
    h = Harness(rig)
    h.command(Connect(HOSTILE), Probe(b"k" * 32, (HOSTILE,), None))
    h.tick(PEER_TIMEOUT_S + 0.1)
    link = h.link(HOSTILE)
    assert link.state == "down" and HOSTILE not in h.sockets
    assert h.results == [Verdict(b"k" * 32, None), PeerDown(HOSTILE)]
    # 0.5 s, then doubling: a new socket each time
    h.tick(0.4)
    assert h.opened[HOSTILE] == 1
    h.tick(0.2)
    assert h.opened[HOSTILE] == 2 and link.state == "hello"
    h.tick(PEER_TIMEOUT_S + 0.1)
    h.tick(0.9)
    assert h.opened[HOSTILE] == 2
    h.tick(0.2)
    assert h.opened[HOSTILE] == 3


def test_a_peer_whose_worker_is_starting_is_asked_again_soon(rig):
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE))
    h.deliver(HOSTILE, pm.Refused("not_ready"))
    link = h.link(HOSTILE)
    assert link.state == "down" and link.backoff == 0.0
    h.tick(0.06)
    assert h.opened[HOSTILE] == 2


def test_a_new_incarnation_at_the_same_address_is_a_new_peer(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    h.deliver(HOSTILE, pm.Refused("bye"))
    h.tick(1.0)  # reconnects
    assert h.link(HOSTILE).state == "hello"
    h.deliver(HOSTILE, h.challenge(HOSTILE, incarnation=b"Y" * 16))
    assert h.restarted == [HOSTILE]
    assert h.results.count(PeerDown(HOSTILE)) == 2  # once down, once restarted


def test_a_peer_no_socket_can_reach_is_down_and_its_probes_go_on(rig):
    """The node could not open the socket (ZMQ refuses the address): that session is down."""
    held = keys_for(1, seed=41)
    rig.store(held)
    h = Harness(rig)
    h.add_honest(HONEST)
    h.command(Connect(HONEST))
    h.client.where = lambda key: ["*:5710"]
    h.command(Probe(held[0], (), (HONEST,)))
    assert h.link("*:5710").state == "hello"  # its Lookup waits for the handshake
    h.apply(h.client.unreachable("*:5710", "Invalid argument", h.now))
    h.pump()
    assert h.link("*:5710").state == "down" and "*:5710" not in h.sockets
    assert h.results_of(Verdict) == [Verdict(held[0], HONEST)]
    assert PeerDown("*:5710") in h.results


def test_without_a_worker_descriptor_no_session_starts(rig):
    h = Harness(rig)
    h.worker.ready = False
    h.command(Connect(HOSTILE))
    assert h.opened[HOSTILE] == 0
    h.worker.ready = True
    h.tick(0.06)
    assert h.opened[HOSTILE] == 1


def test_c38_our_own_challenge_relayed_back_is_a_reflection_and_gets_no_descriptor(rig):
    """A Challenge carrying our own incarnation (our Hello went to our own server through a
    relay): the link goes down before Auth, so our descriptor never leaves; counted."""
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE, incarnation=b"C" * 16))
    assert h.link(HOSTILE).state == "down"
    assert [type(m) for m in h.sent[HOSTILE]] == [pm.Hello]
    assert h.client.handshake_failures["reflection"] == 1


def test_c38_our_hello_names_the_address_we_dialed(rig):
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    assert h.last(HOSTILE, pm.Hello).dialed == HOSTILE


def test_c38_a_challenge_of_an_older_version_is_refused_even_with_a_valid_mac(rig):
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE, version=1))
    assert h.link(HOSTILE).state == "down"
    assert [type(m) for m in h.sent[HOSTILE]] == [pm.Hello]
    assert h.client.handshake_failures["version"] == 1


def test_c38_a_welcome_is_used_only_when_its_mac_covers_our_handshake(rig):
    """A Welcome whose descriptor was swapped, or one replayed from an earlier session: its
    descriptor is never handed to our worker, and the session goes down."""
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE))
    good = h.welcome(HOSTILE, 1, descriptor(64, "good"))
    swapped = msgspec.structs.replace(good, descriptor=descriptor(64, "attacker"))
    h.deliver(HOSTILE, swapped)
    assert h.link(HOSTILE).state == "down" and h.worker.users == {}
    assert h.client.handshake_failures["bad_mac"] == 1
    h.tick(1.0)  # a new session: the old Challenge and Welcome replayed prove nothing in it
    old_challenge = h.challenges[HOSTILE]
    h.deliver(HOSTILE, old_challenge)
    assert h.link(HOSTILE).state == "down" and h.client.handshake_failures["bad_mac"] == 2
    h.tick(2.0)
    h.deliver(HOSTILE, h.challenge(HOSTILE))
    h.deliver(HOSTILE, good)
    assert h.link(HOSTILE).state == "down" and h.worker.users == {}
    assert h.client.handshake_failures["bad_mac"] == 3


def test_c42_a_refusal_for_an_identity_collision_is_counted_and_names_our_address(rig, caplog):
    h = Harness(rig)
    h.command(Connect(HOSTILE))
    h.deliver(HOSTILE, h.challenge(HOSTILE))
    with caplog.at_level("ERROR", logger="kvoffload.p2p"):
        h.deliver(HOSTILE, pm.Refused("identity_collision"))
    assert h.client.handshake_failures["refused_identity_collision"] == 1
    assert "identity collision" in caplog.text and "10.0.0.1:5710" in caplog.text


def test_c38_links_requests_named_are_bounded_and_forgotten_when_unused(rig):
    """Links to peers only requests named: at most max_request_peers at once (the least
    recently used goes, its probes moving on), and none once unused for request_peer_idle_s;
    a configured peer's link stays."""
    h = Harness(rig, max_request_peers=4, request_peer_idle_s=5.0)
    h.add_honest(HONEST)
    named = [f"10.8.{i // 250}.{i % 250}:5710" for i in range(300)]
    for i, addr in enumerate(named):
        h.command(Probe(b"k%031d" % i, (addr,), None))
        assert len(h.client.links) <= 4 + 1  # + HONEST (configured) once connected
        assert len(h.sockets) <= 4
    h.command(Connect(HONEST))
    assert h.client.request_links_evicted == 296
    assert len(h.results_of(Verdict)) == 296  # each evicted probe ended: a miss
    for _ in range(21):  # 5.25 s in heartbeat-sized steps (the honest session stays up)
        h.tick(0.25)
    assert set(h.client.links) == {HONEST} and set(h.sockets) == {HONEST}
    assert len(h.results_of(Verdict)) == 300
    opened = sum(h.opened.values())
    for _ in range(40):  # nothing reconnects to a forgotten address
        h.tick(0.25)
    assert sum(h.opened.values()) == opened and h.link(HONEST).up


def test_c38_a_new_request_link_makes_an_idle_one_go_before_a_busy_one(rig):
    """At max_request_peers, a request naming one more address makes the least recently used
    *idle* link go: an older link with a lookup outstanding keeps it (requests naming many
    addresses cut no other request's work short); only when every link is busy does the least
    recently used go, its probe moving on."""
    h = Harness(rig, max_request_peers=2)
    busy, idle, new, newer = (f"10.8.9.{i}:5710" for i in range(4))
    h.up(busy)
    h.command(Probe(b"b" * 32, (busy,), None))  # its Lookup goes unanswered: busy
    assert h.last(busy, pm.Lookup) is not None and h.results_of(Verdict) == []
    h.command(Connect(idle))
    h.command(Connect(new))  # the least recently used is `busy`, yet `idle` goes
    assert set(h.client.links) == {busy, new}
    assert h.link(busy).up and h.results_of(Verdict) == []
    h.command(Probe(b"n" * 32, (new,), None))  # waits for `new`'s handshake: busy too
    assert h.results_of(Verdict) == []
    h.command(Connect(newer))  # every link busy: the least recently used (`busy`) goes
    assert set(h.client.links) == {new, newer}
    assert [v.key for v in h.results_of(Verdict)] == [b"b" * 32]  # its probe ended: a miss
    assert h.client.request_links_evicted == 2


# -- every message type at every handshake state ---------------------------------------------------

_K = b"k" * 32
_EVERY_MESSAGE = [
    pm.Hello(pm.PROTOCOL_VERSION, b"Z" * 16, "10.9.9.9:1", HOSTILE, "ns", b"z" * 32),
    pm.Challenge(pm.PROTOCOL_VERSION, b"Z" * 16, HOSTILE, b"z" * 32, b"m" * 32),
    pm.Auth(b"m" * 32, b"d"),
    pm.Welcome(descriptor(8, "w"), 0.5, 3, TOKEN, b"m" * 32),
    pm.Refused("nope"),
    pm.Lookup(999, [_K]),
    pm.LookupReply(999, b"\1"),
    pm.Lease(999, [_K], 1.0, ""),
    lease_reply(999, 1, [0]),
    pm.Release(1),
    pm.Offer(999, [_K], 1, [0], 1.0, bytes(pm.DIGEST_BYTES)),
    pm.OfferReply(999, b"\1"),
    pm.Pulled(999, b"\1"),
    pm.Heartbeat(7, 5),
    pm.HeartbeatAck(7, 6),
]
assert {type(m) for m in _EVERY_MESSAGE} == set(typing.get_args(pm.PeerMessage))


def _to_state(h: Harness, state: str) -> None:
    h.command(Connect(HOSTILE))
    if state == "down":
        h.deliver(HOSTILE, pm.Refused("gone"))
    if state in ("auth", "up"):
        h.deliver(HOSTILE, h.challenge(HOSTILE))
    if state == "up":
        h.deliver(HOSTILE, h.welcome(HOSTILE, 1, descriptor(8, "p")))
    assert h.link(HOSTILE).state == state


@pytest.mark.parametrize("state", ["down", "hello", "auth", "up"])
@pytest.mark.parametrize("msg", _EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_type_at_every_handshake_state_is_taken_or_ends_the_session(rig, state, msg):
    """What each state accepts: hello a proving Challenge, auth a proving Welcome, up the replies
    to its own requests, heartbeats, Pulled and Refused; anything else before up ends the session
    (these messages prove nothing: their MACs are not over our handshake), and once up is counted
    and dropped. A frame for a link that is down changes nothing."""
    h = Harness(rig)
    _to_state(h, state)
    sent_before, results_before = len(h.sent[HOSTILE]), len(h.results)
    h.deliver(HOSTILE, msg)
    link = h.link(HOSTILE)
    name = type(msg).__name__
    if state == "down":
        want = "down"
    elif state == "hello":
        want = "down"  # this Challenge's MAC proves nothing
    elif state == "auth":
        want = "down"  # this Welcome's MAC proves nothing
    else:
        want = "down" if name == "Refused" else "up"
    assert link.state == want
    assert h.counts["internal_errors"] == 0
    if state == "down":
        assert len(h.sent[HOSTILE]) == sent_before and len(h.results) == results_before
    if state == "up" and want == "up":
        new = h.sent[HOSTILE][sent_before:]
        if name == "Heartbeat":
            assert new == [pm.HeartbeatAck(7, 3)] and link.free_quota == 5
        else:
            assert new == []
            if name == "HeartbeatAck":
                assert link.free_quota == 6
            else:
                assert h.counts["unknown_replies"] == 1


# -- lookups ----------------------------------------------------------------------------------


def test_a_probe_asks_its_peers_in_order_and_skips_those_that_are_down(rig):
    held = keys_for(2, seed=2)
    rig.store(held)
    h = Harness(rig)
    h.add_honest(HONEST)
    h.up(HOSTILE)
    h.command(Probe(held[0], (), (HOSTILE, HONEST)), Probe(held[1], (), (HOSTILE, HONEST)))
    lookup = h.last(HOSTILE, pm.Lookup)
    assert lookup.keys == held  # one Lookup for both
    h.deliver(HOSTILE, pm.LookupReply(lookup.req, bytes([pm.MISS, pm.READY])))
    assert h.results_of(Verdict) == [Verdict(held[1], HOSTILE), Verdict(held[0], HONEST)]
    # a peer that is down is skipped, without a round trip
    h.deliver(HOSTILE, pm.Refused("bye"))
    h.command(Probe(held[1], (HOSTILE,), (HONEST,)))
    assert h.results_of(Verdict)[-1] == Verdict(held[1], HONEST)


def test_a_probe_is_located_by_its_engine_key_and_asks_for_its_tenant_key_only(rig):
    """A salted request's chunk: the KV-event locations (which name engine keys) are asked with
    the Probe's ``located_as``; the peer they name is asked first, for the tenant key; the engine
    key never leaves this instance (no message to any peer carries it)."""
    held = keys_for(1, seed=43)  # what the honest peer holds: the tenant key
    rig.store(held)
    engine_key = bytes(range(32))
    h = Harness(rig)
    h.add_honest(HONEST)
    h.up(HOSTILE)
    asked_with = []
    h.client.where = lambda key: asked_with.append(key) or ([HONEST] if key == engine_key else [])
    h.command(Probe(held[0], (), (HOSTILE, HONEST), engine_key))
    assert asked_with == [engine_key]
    assert h.last(HOSTILE, pm.Lookup) is None  # the configured order was not followed
    assert h.last(HONEST, pm.Lookup).keys == held
    assert h.results_of(Verdict) == [Verdict(held[0], HONEST)]
    assert not any(engine_key in pm.encode(m) for sent in h.sent.values() for m in sent)


def test_a_pending_key_is_asked_again_until_the_peer_timeout(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    h.command(Probe(_K, (HOSTILE,), None))
    asked = 0
    while not h.results_of(Verdict):
        lookup = h.last(HOSTILE, pm.Lookup)
        asked += 1
        h.deliver(HOSTILE, pm.LookupReply(lookup.req, bytes([pm.PENDING])))
        h.deliver(HOSTILE, pm.Heartbeat(asked, 0))  # still alive
        h.tick(0.25)
    assert h.results_of(Verdict) == [Verdict(_K, None)]
    assert PEER_TIMEOUT_S / 0.25 <= asked <= PEER_TIMEOUT_S / 0.25 + 2


# -- loads ------------------------------------------------------------------------------------


def test_a_load_is_leased_in_parts_read_released_and_reported_once(rig):
    held = keys_for(6, seed=3)
    rig.store(held)
    h = Harness(rig)
    honest = h.add_honest(HONEST)
    h.command(Connect(HONEST))
    slots = [100 + i for i in range(len(held))]
    h.command(Load(7, HONEST, held, slots, "kvr-1"))
    leases = [m for m in h.sent[HONEST] if isinstance(m, pm.Lease)]
    assert [m.keys for m in leases] == [held] and leases[0].kv_request_id == "kvr-1"
    assert honest.server.counters["chunks_leased_now"] == len(held)
    assert h.results_of(LoadDone) == []  # not before the READ settled
    h.settle_honest()
    (done,) = h.results_of(LoadDone)
    assert (done.job_id, done.ok, done.failed) == (7, held, {})
    assert done.nbytes == len(held) * rig.row_bytes
    for k, s in zip(held, slots):  # each key read into its own slot
        assert np.array_equal(np.frombuffer(h.local[s], np.uint8), payload(k, rig.row_bytes))
    assert isinstance(h.sent[HONEST][-1], pm.Release)
    assert honest.server.counters["chunks_leased_now"] == 0
    assert rig.tm.pins_held() == refs_of(rig.tm) == {}


def test_a_large_load_is_leased_in_parts_with_at_most_max_inflight_chunks_at_a_peer(rig):
    h = Harness(rig)
    h.up(HOSTILE, desc=descriptor(4096, "big"))
    n = MAX_INFLIGHT_CHUNKS + LEASE_CHUNKS + 10
    keys = [i.to_bytes(32, "big") for i in range(n)]
    h.command(Load(1, HOSTILE, keys, list(range(n)), ""))
    leases = [m for m in h.sent[HOSTILE] if isinstance(m, pm.Lease)]
    assert sum(len(m.keys) for m in leases) == MAX_INFLIGHT_CHUNKS
    assert all(len(m.keys) <= LEASE_CHUNKS for m in leases)
    for lease in leases:  # the peer leases every key: its slots 0..
        h.deliver(HOSTILE, lease_reply(lease.req, lease.req, list(range(len(lease.keys)))))
    first = min(h.worker.inflight)
    h.settle(first, True)  # one part ends: the next waiting one goes
    leases = [m for m in h.sent[HOSTILE] if isinstance(m, pm.Lease)]
    assert sum(len(m.keys) for m in leases) == MAX_INFLIGHT_CHUNKS + LEASE_CHUNKS
    assert h.results_of(LoadDone) == []
    for lease in leases[-1:]:
        h.deliver(HOSTILE, lease_reply(lease.req, lease.req, list(range(len(lease.keys)))))
    for tid in sorted(h.worker.inflight):
        h.settle(tid, True)
    leases = [m for m in h.sent[HOSTILE] if isinstance(m, pm.Lease)]
    assert len(leases[-1].keys) == 10  # the last part went once room was made
    h.deliver(HOSTILE, lease_reply(leases[-1].req, 99, list(range(9)) + [pm.LEASE_BUSY]))
    (tid,) = h.worker.inflight
    h.settle(tid, True)
    (done,) = h.results_of(LoadDone)
    assert done.ok == keys[:-1] and done.failed == {keys[-1]: "busy"}
    assert h.link(HOSTILE).inflight_chunks == 0


def test_keys_a_peer_will_not_lease_fail_alone_and_the_lease_is_released(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    keys = keys_for(3, seed=4)
    h.command(Load(2, HOSTILE, keys, [0, 1, 2], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.deliver(HOSTILE, lease_reply(lease.req, 5, [3, -1, pm.LEASE_BUSY]))
    (tid,) = h.worker.inflight
    assert h.worker.inflight[tid][1] == [(0, 3)]
    h.settle(tid, True)
    (done,) = h.results_of(LoadDone)
    assert done.ok == keys[:1] and done.failed == {keys[1]: "missing", keys[2]: "busy"}
    assert h.last(HOSTILE, pm.Release) == pm.Release(5)


def test_a_lease_reply_naming_slots_beyond_the_peers_arena_fails_the_part_not_the_node(rig):
    """The worker refuses to READ a slot the peer's arena does not have (ValueError, nothing
    sent): the part fails as a bad reply and its lease is released; before, the error escaped
    the client role and ended the node thread (every later lookup and job of the tier hung)."""
    h = Harness(rig)
    h.up(HOSTILE, desc=descriptor(8, "small"))
    keys = keys_for(2, seed=30)
    h.command(Load(5, HOSTILE, keys, [0, 1], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.deliver(HOSTILE, lease_reply(lease.req, 4, [3, 8]))  # slot 8: past its 8 slots
    (done,) = h.results_of(LoadDone)
    assert done.ok == [] and done.failed == dict.fromkeys(keys, "bad_reply")
    assert h.last(HOSTILE, pm.Release) == pm.Release(4)
    assert h.worker.inflight == {} and h.counts["malformed_replies"] == 1
    link = h.link(HOSTILE)
    assert link.up and link.inflight_chunks == 0 and not link.pending


def test_a_failed_transfer_fails_its_part_and_takes_the_session_down(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    keys = keys_for(2, seed=5)
    h.command(Load(3, HOSTILE, keys, [0, 1], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.deliver(HOSTILE, lease_reply(lease.req, 5, [0, 1]))
    (tid,) = h.worker.inflight
    h.settle(tid, False, "timeout")
    (done,) = h.results_of(LoadDone)
    assert done.ok == [] and done.failed == dict.fromkeys(keys, "timeout")
    assert h.link(HOSTILE).state == "down" and h.counts["transfer_failures"] == 1
    assert h.worker.users == {}  # its worker name was released: its transfers settle failed


def test_a_silent_peer_fails_its_loads_and_its_pending_lookups_go_on(rig):
    held = keys_for(1, seed=6)
    rig.store(held)
    h = Harness(rig)
    h.add_honest(HONEST)
    h.up(HOSTILE)
    h.command(Connect(HONEST))
    h.command(
        Load(4, HOSTILE, keys_for(2, seed=7), [0, 1], ""), Probe(held[0], (HOSTILE, HONEST), None)
    )
    for _ in range(int(PEER_TIMEOUT_S / 0.25) + 2):
        h.tick(0.25)
    assert h.link(HOSTILE).state == "down" and h.link(HONEST).up
    (done,) = h.results_of(LoadDone)
    assert done.ok == [] and set(done.failed.values()) <= {"peer_down", "timeout"}
    assert h.results_of(Verdict) == [Verdict(held[0], HONEST)]


def test_c40_a_read_is_checked_against_the_digests_and_over_before_the_lease_may_end(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    keys = keys_for(3, seed=40)
    h.command(Load(8, HOSTILE, keys, [0, 1, 2], ""))
    lease = h.last(HOSTILE, pm.Lease)
    t0 = h.now  # when the Lease was sent: the server granted it later
    d = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
    h.tick(0.1)
    h.deliver(HOSTILE, pm.LeaseReply(lease.req, 6, [4, -1, 6], 0.4, b"".join(d)))
    ((tid, (deadline_s, digests, not_after)),) = h.worker.reads.items()
    assert digests == d[0] + d[2]  # those of the keys leased, in the order read
    assert not_after == pytest.approx(t0 + 0.4 - 0.04)  # reckoned from the request, less a margin
    assert deadline_s == pytest.approx(not_after - h.now) and deadline_s < DEADLINE_S
    # a chunk that failed its digest is a failed key; the others are served
    h.settle(tid, True, bad=(1,))
    (done,) = h.results_of(LoadDone)
    assert done.ok == [keys[0]]
    assert done.failed == {keys[1]: "missing", keys[2]: "digest_mismatch"}
    assert h.counts["digest_mismatches"] == 1 and h.link(HOSTILE).up
    assert h.last(HOSTILE, pm.Release) == pm.Release(6)


def test_c40_a_lease_that_may_have_ended_is_never_read_and_a_late_read_fails_lease_expired(rig):
    h = Harness(rig)
    h.up(HOSTILE)
    keys = keys_for(2, seed=41)
    h.command(Load(9, HOSTILE, keys, [0, 1], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.tick(0.5)  # the reply comes when the lifetime the server granted may be over
    h.deliver(HOSTILE, lease_reply(lease.req, 7, [0, 1], ttl_s=0.5))
    assert h.worker.inflight == {}
    (done,) = h.results_of(LoadDone)
    assert done.ok == [] and done.failed == dict.fromkeys(keys, "lease_expired")
    assert h.last(HOSTILE, pm.Release) == pm.Release(7)
    # the worker's read that was not over by the lease's end: failed, whatever it read
    h.command(Load(10, HOSTILE, keys, [2, 3], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.deliver(HOSTILE, lease_reply(lease.req, 8, [0, 1]))
    (tid,) = h.worker.inflight
    h.settle(tid, False, "lease_expired")
    done = h.results_of(LoadDone)[-1]
    assert done.ok == [] and done.failed == dict.fromkeys(keys, "lease_expired")
    assert h.counts["lease_expiries"] == 2
    # a reply without a digest per slot is a bad reply; its lease is released
    h.tick(1.0)  # the session, down since the failed read, starts again
    h.deliver(HOSTILE, h.challenge(HOSTILE))
    h.deliver(HOSTILE, h.welcome(HOSTILE, 0, descriptor(64, HOSTILE)))
    h.command(Load(11, HOSTILE, keys, [4, 5], ""))
    lease = h.last(HOSTILE, pm.Lease)
    h.deliver(HOSTILE, pm.LeaseReply(lease.req, 9, [0, 1], 1.0, bytes(pm.DIGEST_BYTES)))
    done = h.results_of(LoadDone)[-1]
    assert done.failed == dict.fromkeys(keys, "bad_reply")
    assert h.last(HOSTILE, pm.Release) == pm.Release(9)


def test_a_push_is_granted_to_the_peers_session_offered_with_its_digests_and_ends_once_revoked(
    rig,
):
    h = Harness(rig)
    h.hold_worker = True
    h.up(HOSTILE, quota=5)
    assert h.worker.sessions[TOKEN] == 1  # the peer may pull from our data server
    keys = keys_for(2, seed=42)
    h.command(Push(14, keys, [7, 8]))
    assert h.last(HOSTILE, pm.Offer) is None  # not before its slots are granted
    ((gid, (token, slots, until)),) = h.worker.grants.items()
    assert (token, slots, until) == (TOKEN, [7, 8], h.now + LEASE_TTL_S)
    h.answer_worker()
    offer = h.last(HOSTILE, pm.Offer)
    assert offer.digests == bytes(2 * pm.DIGEST_BYTES) and offer.ttl_s == LEASE_TTL_S
    h.deliver(HOSTILE, pm.OfferReply(offer.req, b"\1\1"))
    h.deliver(HOSTILE, pm.Pulled(14, b"\1\0"))
    assert h.worker.revoking == [gid] and h.results_of(PushDone) == []
    h.answer_worker()  # no row of it will be sent any more: the slots may go back
    assert h.results_of(PushDone) == [PushDone(14, HOSTILE, keys[:1], {keys[1]: "refused"})]
    h.deliver(HOSTILE, pm.Refused("bye"))
    assert h.worker.sessions[TOKEN] == 0


# -- pushes -----------------------------------------------------------------------------------


def test_a_push_goes_to_the_peer_with_the_most_free_quota_and_ends_when_it_pulled(rig):
    h = Harness(rig)
    h.add_honest(HONEST, quota_chunks=4)
    h.command(Connect(HONEST))
    h.up(HOSTILE, quota=1)
    keys = keys_for(3, seed=8)
    h.command(Push(11, keys, [5, 6, 7]))
    offer = h.last(HONEST, pm.Offer)
    assert offer.keys == keys and offer.lease == 11 and offer.slots == [5, 6, 7]
    assert h.results_of(PushDone) == []  # pinned until the receiver pulled
    h.settle_pulls()
    (done,) = h.results_of(PushDone)
    assert done == PushDone(11, HONEST, keys, {})
    # a push nobody can take fails at once
    h.link(HONEST).free_quota = h.link(HOSTILE).free_quota = 0
    h.command(Push(12, keys, [5, 6, 7]))
    assert h.results_of(PushDone)[-1] == PushDone(12, None, [], dict.fromkeys(keys, "no_peer"))


def test_a_pulled_naming_another_peers_push_neither_ends_nor_loses_it(rig):
    """Push job ids are small integers any peer can guess. A Pulled for a push offered to
    another peer is counted and dropped; the push still ends when its own receiver pulled it.
    Before, the push was forgotten: its job never ended and its host slots stayed pinned."""
    h = Harness(rig)
    h.add_honest(HONEST, quota_chunks=4)
    h.command(Connect(HONEST))
    h.up(HOSTILE, quota=1)
    keys = keys_for(2, seed=31)
    h.command(Push(21, keys, [3, 4]))  # to the honest peer: the most free quota
    assert h.last(HONEST, pm.Offer) is not None
    h.deliver(HOSTILE, pm.Pulled(21, b"\1\1"))
    assert h.results_of(PushDone) == [] and h.counts["unknown_replies"] == 1
    h.settle_pulls()
    assert h.results_of(PushDone) == [PushDone(21, HONEST, keys, {})]


def test_an_offer_never_pulled_ends_at_the_lease_ttl(rig):
    h = Harness(rig)
    h.up(HOSTILE, quota=5)
    keys = keys_for(2, seed=9)
    h.command(Push(13, keys, [1, 2]))
    offer = h.last(HOSTILE, pm.Offer)
    h.deliver(HOSTILE, pm.OfferReply(offer.req, b"\1\1"))
    for _ in range(int(LEASE_TTL_S / 0.25) + 2):
        h.deliver(HOSTILE, pm.Heartbeat(1, 5))
        h.tick(0.25)
    assert h.results_of(PushDone) == [PushDone(13, None, [], dict.fromkeys(keys, "timeout"))]


# -- fuzz ---------------------------------------------------------------------------------------

_HELD = keys_for(8, seed=20)  # the honest instance holds these
_OTHER = keys_for(8, seed=21)
_PUSHED = keys_for(6, seed=22)
_ANY_KEY = st.sampled_from(_HELD + _OTHER)
_id = st.integers(0, 40)
_slot = st.integers(-3, 70)
_desc = st.sampled_from([descriptor(64, "hostile"), descriptor(4, "tiny"), b"junk", b""])
_bytes = st.binary(max_size=12)
_message = st.one_of(  # every message type, well-formed, with hostile values
    st.builds(
        pm.Hello,
        st.integers(0, 3),
        st.just(b"X" * 16),
        st.just("h:1"),
        st.sampled_from([HOSTILE, HONEST, "h:1"]),
        st.text(max_size=4),
        st.just(b"n" * 32),
    ),
    st.builds(
        pm.Challenge,
        st.integers(0, 3),
        st.sampled_from([b"X" * 16, b"Y" * 16, b"C" * 16]),
        st.sampled_from([HOSTILE, HONEST]),
        st.just(b"n" * 32),
        st.binary(min_size=32, max_size=32),
    ),
    st.builds(pm.Auth, st.binary(min_size=32, max_size=32), _desc),
    st.builds(
        pm.Welcome,
        _desc,
        st.floats(0, 10),
        st.integers(0, 1 << 40),
        st.just(TOKEN),
        st.just(b"m" * 32),
    ),
    st.builds(pm.Refused, st.sampled_from(["not_ready", "busy", "x"])),
    st.builds(pm.Lookup, _id, st.lists(_ANY_KEY, max_size=3)),
    st.builds(pm.LookupReply, _id, _bytes),
    st.builds(pm.Lease, _id, st.lists(_ANY_KEY, max_size=3), st.floats(0, 10)),
    st.builds(
        pm.LeaseReply,
        _id,
        _id,
        st.lists(_slot, max_size=8),
        st.floats(0, 10) | st.just(0.0),
        st.binary(max_size=8 * pm.DIGEST_BYTES) | st.just(bytes(4 * pm.DIGEST_BYTES)),
    ),
    st.builds(pm.Release, _id),
    st.builds(
        pm.Offer,
        _id,
        st.lists(_ANY_KEY, max_size=3),
        _id,
        st.lists(_slot, max_size=3),
        st.floats(0, 10),
        st.binary(max_size=48),
    ),
    st.builds(pm.OfferReply, _id, _bytes),
    st.builds(pm.Pulled, _id, _bytes),
    st.builds(pm.Heartbeat, _id, st.integers(0, 1 << 40)),
    st.builds(pm.HeartbeatAck, _id, st.integers(0, 1 << 40)),
)
_state_bytes = st.lists(st.sampled_from([pm.MISS, pm.READY, pm.PENDING, 7]), max_size=8)
_load = st.tuples(
    st.just("load"), st.booleans(), st.lists(st.integers(0, 7), min_size=1, max_size=5)
)
_answer = st.tuples(
    st.just("answer"), st.integers(0, 30), st.tuples(_state_bytes, st.sampled_from([0, 0, 62, 999]))
)
_settle = st.tuples(st.just("settle"), st.integers(0, 30), st.booleans())
_probe = st.tuples(st.just("probe"), st.integers(0, 15), st.integers(0, 4))
_handshake = st.tuples(st.just("handshake"), _desc, st.integers(0, 6))


def _weight(s: st.SearchStrategy, n: int) -> list[st.SearchStrategy]:
    return [s.map(tuple) for _ in range(n)]  # distinct objects: one_of draws each branch alike


_action = st.one_of(
    # what a peer that knows the secret does, right or wrong (weighted up: they lead somewhere)
    *_weight(_probe, 2),
    *_weight(_load, 3),
    *_weight(_answer, 4),
    *_weight(_settle, 2),
    *_weight(_handshake, 2),
    st.tuples(st.just("push"), st.integers(1, 3), st.none()),
    *_weight(st.tuples(st.just("pulls"), st.none(), st.none()), 2),
    st.tuples(st.just("tick"), st.floats(0, 1.5), st.none()),
    # and everything else, once each
    st.tuples(st.just("challenge"), st.booleans(), st.booleans()),
    st.tuples(st.just("welcome"), _desc, st.integers(0, 9)),
    st.tuples(st.just("msg"), _message, st.none()),
    st.tuples(st.just("reply"), st.integers(0, 30), st.tuples(_bytes, st.lists(_slot, max_size=8))),
    st.tuples(st.just("pulled"), st.integers(0, 30), _bytes),
    st.tuples(st.just("replay"), st.integers(0, 200), st.none()),
    st.tuples(st.just("frame"), st.binary(max_size=48), st.none()),
    st.tuples(st.just("mangle"), _message, st.integers(0, 40)),
    st.tuples(st.just("restart"), st.none(), st.none()),
    st.tuples(st.just("refuse"), st.none(), st.none()),
)


@pytest.fixture(scope="module")
def fuzz_rig():
    with Rig(num_slots=32) as r:
        r.store(_HELD[:4])
        r.store(_HELD[4:])
        yield r


def _check(h: Harness) -> None:
    """What holds after every step: no error of its own, parts counted in flight exactly once,
    every pending request due to expire, every load transfer known to the worker."""
    c = h.client
    assert h.counts["internal_errors"] == 0
    for link in c.links.values():
        sent = [p.ctx for p in link.pending.values() if p.kind == "lease"]
        sent += [part for part in c.loads.values() if part.link is link]
        assert link.inflight_chunks == sum(len(part.keys) for part in sent)
        assert all(p.deadline <= h.now + PEER_TIMEOUT_S for p in link.pending.values())
        if link.state == "down":
            assert not link.pending and not link.waiting_loads and not link.queued
    assert set(c.loads) <= set(h.worker.inflight)
    assert h.rig.tm.pins_held() == refs_of(h.rig.tm)


@settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(up=st.booleans(), actions=st.lists(_action, min_size=10, max_size=80))
def test_a_hostile_peer_never_breaks_the_client_nor_an_honest_session_beside_it(
    fuzz_rig, up, actions
):
    """A peer that knows the secret but sends anything (every message type, valid or not, at any
    handshake state; answers right, wrong, late, twice, or to requests of the honest session;
    frames replayed from either session) beside an honest peer: the client never raises, counts
    every part in flight once, ends every job with exactly one result, and the honest session
    neither goes down nor loses a verdict, a load or a lease release."""
    h = Harness(fuzz_rig)
    honest = h.add_honest(HONEST, quota_chunks=4)
    try:
        _fuzz(h, up, actions)
    finally:  # nothing stays in the module's instance for the next run
        for ident, _, lease, pairs in honest.pulls:
            honest.server.pull_settled(ident, lease, [False] * len(pairs))
        honest.tick(h.now + 10_000.0)
        fuzz_rig.tm.host.remove(_PUSHED)
    assert fuzz_rig.tm.pins_held() == refs_of(fuzz_rig.tm) == {}
    assert fuzz_rig.tm.host.num_writing == 0
    assert honest.server.counters["internal_errors"] == 0


_ORDERS = [  # a probe's (head, tail): the honest peer first, the hostile one first, ...
    ((HONEST,), None),
    ((HOSTILE,), None),
    ((), (HOSTILE, HONEST)),
    ((), (HONEST, HOSTILE)),
    ((HONEST,), (HOSTILE,)),
]


def _fuzz(h: Harness, up: bool, actions: list) -> None:
    rig = h.rig
    honest = h.honest[HONEST]
    h.command(Connect(HONEST), Connect(HOSTILE))
    if up:  # half the runs start with the hostile peer's session up (it knows the secret)
        h.deliver(HOSTILE, h.challenge(HOSTILE))
        h.deliver(HOSTILE, h.welcome(HOSTILE, 5, descriptor(64, "hostile")))
    probes: Counter[bytes] = Counter()
    honest_probes: list[bytes] = []  # keys the honest peer holds, asked of it first
    loads: dict[int, tuple[str, list[bytes], list[int]]] = {}
    pushes: list[int] = []
    jobs = itertools.count(1)
    slots = itertools.count()
    seen: list[bytes] = []  # every frame the hostile peer sent, for replays
    restarted = False

    def hostile(msg_or_frame) -> None:
        frame = msg_or_frame if isinstance(msg_or_frame, bytes) else pm.encode(msg_or_frame)
        seen.append(frame)
        h.deliver(HOSTILE, frame)

    def step(dt: float) -> None:  # time passes; the honest worker's reads end as they do
        h.tick(dt)
        h.settle_honest()

    for kind, a, b in actions:
        if kind == "probe":
            key = (_HELD + _OTHER)[a]
            head, tail = _ORDERS[b]
            probes[key] += 1
            if key in _HELD and (head or tail or ("",))[0] == HONEST:
                honest_probes.append(key)
            h.command(Probe(key, head, tail))
        elif kind == "load":
            job = next(jobs)
            peer = HONEST if a else HOSTILE
            keys = list(dict.fromkeys((_HELD if a else _OTHER)[i] for i in b))
            local = [next(slots) for _ in keys]
            loads[job] = (peer, keys, local)
            h.command(Load(job, peer, keys, local, "kvr" if a else ""))
        elif kind == "push":
            job = next(jobs)
            pushes.append(job)
            keys = _PUSHED[a : a + 3]
            h.command(Push(job, keys, [next(slots) for _ in keys]))
        elif kind == "handshake":  # the hostile peer knows the secret: its session comes up
            link = h.link(HOSTILE)
            while link.state == "down":
                step(min(0.25, max(0.0, link.retry_at - h.now)))
            if link.state == "hello":
                hostile(h.challenge(HOSTILE))
            if link.state == "auth":
                hostile(h.welcome(HOSTILE, b, a))
        elif kind == "challenge":
            if h.last(HOSTILE, pm.Hello) is not None:
                inc = b"Y" * 16 if b else b"X" * 16
                hostile(h.challenge(HOSTILE, secret=SECRET if a else b"bad", incarnation=inc))
        elif kind == "welcome":  # one whose MAC proves nothing
            hostile(pm.Welcome(a, HEARTBEAT_S, b, TOKEN, b"m" * 32))
        elif kind == "msg":
            hostile(a)
        elif kind in ("answer", "reply"):  # an answer to one of our requests
            asked = [m for m in h.sent[HOSTILE] if isinstance(m, (pm.Lookup, pm.Lease, pm.Offer))]
            waiting = h.link(HOSTILE).pending
            asked = [m for m in asked if m.req in waiting] or asked  # mostly those still open
            if not asked:
                continue
            m = asked[a % len(asked)]
            if kind == "answer":  # well-formed: one entry per key, slots in its arena or beyond
                states, offset = b
                n = len(m.keys)
                given = (states * n)[:n] if states else [pm.READY] * n
                remote = [offset + i if s != pm.MISS else -1 for i, s in enumerate(given)]
                accepted = bytes(1 if s else 0 for s in given)
                given_b = bytes(given)
            else:  # any length
                given_b, remote = b
                accepted = given_b
            if isinstance(m, pm.Lookup):
                hostile(pm.LookupReply(m.req, given_b))
            elif isinstance(m, pm.Lease):
                hostile(lease_reply(m.req, m.req, remote))
            else:
                hostile(pm.OfferReply(m.req, accepted))
        elif kind == "pulled":  # naming any push, the honest peer's included
            if pushes:
                hostile(pm.Pulled(pushes[a % len(pushes)], b))
        elif kind == "replay":  # anything either peer sent before, on the hostile session
            frames = seen + h.received[HONEST]
            if frames:
                hostile(frames[a % len(frames)])
        elif kind == "frame":
            hostile(a)
        elif kind == "mangle":
            good = pm.encode(a)
            cut = b % (len(good) + 1)
            hostile(good[:cut] + b"\xc1\x00" + good[cut + 2 :])
        elif kind == "tick":
            h.tick(a)
        elif kind == "settle":
            hostile_tids = [t for t, (n, _) in h.worker.inflight.items() if _is_hostile(h, n)]
            if hostile_tids:
                h.settle(hostile_tids[a % len(hostile_tids)], b)
        elif kind == "pulls":  # the honest instance's worker finishes its pulls of our offers
            h.settle_pulls()
        elif kind == "restart":
            restarted = True
            dead = h.worker.restart()
            h.apply(h.client.worker_restarted(h.now))  # the node's order: restart, then reports
            for tid in dead:
                h.settle(tid, False, "worker_died")
        elif kind == "refuse":
            name = h.link(HOSTILE).worker_name
            if name:
                h.apply(h.client.transport_refused(name, "refused", h.now))
        h.settle_honest()  # its reads of the honest instance's slots end at once
        _check(h)

    # The hostile peer goes silent; the honest one keeps answering: everything ends.
    for _ in range(int((LEASE_TTL_S + PEER_TIMEOUT_S) / 0.25) + 4):
        step(0.25)
        for tid, (name, _) in list(h.worker.inflight.items()):
            if _is_hostile(h, name):
                h.settle(tid, False, "peer removed")
        h.settle_pulls()
        _check(h)

    # every job ended with exactly one result
    verdicts = h.results_of(Verdict)
    assert Counter(v.key for v in verdicts) == probes
    assert sorted(r.job_id for r in h.results_of(LoadDone)) == sorted(loads)
    assert sorted(r.job_id for r in h.results_of(PushDone)) == sorted(pushes)
    for r in h.results_of(LoadDone):
        keys = loads[r.job_id][1]
        assert sorted(r.ok + list(r.failed)) == sorted(keys) and not set(r.ok) & set(r.failed)
    c = h.client
    assert not c.loads and not c.pushes and not c.later
    if not restarted:
        # the honest session never noticed the hostile one
        assert h.link(HONEST).up and h.opened[HONEST] == 1
        for key in honest_probes:
            assert Verdict(key, HONEST) in verdicts
        for r in h.results_of(LoadDone):
            peer, keys, local = loads[r.job_id]
            if peer == HONEST:
                assert r.ok == keys and r.failed == {}, r
                for k, s in zip(keys, local):
                    row = np.frombuffer(h.local[s], np.uint8)
                    assert np.array_equal(row, payload(k, rig.row_bytes))
        assert honest.server.counters["chunks_leased_now"] == 0  # every lease released
    # and the sessions end with nothing outstanding
    h.tick(1000.0)
    assert all(not link.pending and link.inflight_chunks == 0 for link in c.links.values())


def _is_hostile(h: Harness, name: str) -> bool:
    honest = h.client.links.get(HONEST)
    return honest is None or name != honest.worker_name
