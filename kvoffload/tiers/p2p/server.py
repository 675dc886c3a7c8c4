"""The p2p tier's serving role: peers' control messages in, replies out, host-tier access through
the :class:`~kvoffload.tiering.TieringManager` (socket-free, so it is tested and fuzzed alone).

::

    PeerNode thread (owns the ROUTER socket)              PeerServer (this module)
      recv (identity, frame) ──────────────────────▶ handle(identity, frame, now) ──▶ replies
      every loop / at next_deadline() ─────────────▶ tick(now) ──▶ Refused("timeout") replies
                                                         │  expire leases and silent sessions,
                                                         │  poll the manager for promotions
                                                         │  started for peers (idle engine)
      Offer ──▶ handle ──▶ manager.admit ──▶ pull(identity, descriptor, lease, pairs)
                                                         │  the node has its peer worker READ the
                                                         ▼  pusher's leased slots into ours
      worker reports the READ SETTLED ─────────────▶ pull_settled(identity, lease, ok)
                                                     ──▶ manager.commit ──▶ Pulled reply

Sessions, one per ZMQ identity: ``Hello`` → ``Challenge`` (the server proves the shared secret
first, :func:`~kvoffload.ipc.peer_messages.handshake_mac` over the transcript) → ``Auth`` (the
client proves it over the whole transcript, its transport descriptor included) → ``Welcome``
(this instance's descriptor, MACed likewise: descriptors cross only now) or ``Refused``. Anything
else before that, a bad MAC, another protocol version (a downgrade), another namespace than this
instance's, a Hello carrying this instance's own incarnation (a reflection: our own client's Hello
relayed back to us), one naming a dialed address that is not one of :attr:`PeerServer.addresses`
(a relay or a misroute), an oversized or malformed frame: ``Refused(reason)``, counted by reason,
and the identity is forgotten. Handshakes in progress live in a bounded table: at most
``max_handshakes_per_source`` per source address (more are refused ``handshake_busy``), and when
it is full the oldest of the source holding most goes; any older than ``peer_timeout_s`` goes too.
So nothing grows per unauthenticated identity, and one source cannot push out another's.

Identity: a peer is named by its ``advertise`` address and proves a per-start ``incarnation``. A
Hello whose ``advertise`` an authenticated session already holds with another incarnation is a
restart only when that session is gone (its connection closed: ``reachable`` says no) or silent
for ``peer_timeout_s``; while it lives, the newcomer is a second instance claiming the same
address, refused ``identity_collision`` (logged with both incarnations and sources), and the live
session and its leases stay. A peer advertising one of this instance's own :attr:`addresses`
claims this instance's identity: refused ``identity_collision`` too.

Leases: each Lease message is one holder of pins in the manager (``lease:<id>``), granted to the
session on this instance's data plane (:class:`Grants`: the peer worker's data server serves the
session only those slots, until the lease's end, and returns their digests, which the LeaseReply
carries with the lifetime granted; the reply waits for them, so no read races its grant). A lease
ends at the client's Release, at its expiry (``min(ttl_s, max_lease_s)``: the server decides),
when its session goes silent for ``peer_timeout_s``, or when the same instance (same ``advertise``)
comes back with a new incarnation after its old session is gone (a restart: its transfers died
with it); its pins are released
only once the worker has acknowledged the grant's revocation (no row of it will be sent any more).
A reconnect of the same incarnation keeps its leases. At most ``max_leased_chunks`` host slots are
leased to peers at once, so peers can never pin the whole host tier.

Fair shares (CASES C46): each session may hold at most ``max_leased_chunks // sessions`` chunks
(all of them while it is the only session); a Lease asking more gets ``LEASE_BUSY`` for the rest.
A Lease that fits its session's share but not the cap waits (at most ``peer_timeout_s / 2``) for
room: leases of sessions above their share that are unreleased past ``stale_lease_s`` (a reader
releases as soon as its read settles, so these are held without reading) are taken back for it,
oldest first, and other sessions' releases and expiries free room too; then it is served with
what fits.

Lookups start promotions from this instance's own tiers (CASES C18) for at most
``max_leased_chunks`` chunks at once; beyond that a chunk found there is PENDING until they land.

Pushes (a push is a pull the receiver performs): an Offer is admitted within ``quota_chunks``
(per server: chunks being pulled plus pushed chunks still in the host tier, until they are
evicted), slots are reserved WRITING (``manager.admit``), and the node is asked to pull them,
checking each against the Offer's digests before the pusher's grant ends. The
slots stay reserved until the node reports the READ settled (:meth:`PeerServer.pull_settled`),
even when the pushing session is gone: a late write never lands in a reused slot.

Not thread-safe: the node thread drives it; every manager call takes the manager's lock.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.base import LookupResult, ServedHost

log = logging.getLogger("kvoffload.p2p")

Reply = tuple[bytes, bytes]
"""``(ZMQ identity, encoded message)`` to send on the ROUTER socket."""
_WIRE_STATE = {
    LookupResult.MISS: pm.MISS,
    LookupResult.HIT: pm.READY,
    LookupResult.HIT_PENDING: pm.PENDING,
}
"""A served lookup's verdict (:meth:`~kvoffload.tiering.TieringManager.serve_lookup`) as the state
byte a ``LookupReply`` carries."""

REFUSALS = (
    "unauthenticated",
    "bad_mac",
    "malformed",
    "too_large",
    "namespace",
    "version",
    "reflection",
    "misrouted",
    "identity_collision",
    "handshake_busy",
    "unexpected",
    "not_ready",
    "busy",
    "timeout",
    "internal",
)
"""Why the server refuses (``Refused.reason`` and the ``refused`` counter's keys): a message
before authentication, a wrong MAC, a frame that fails the schema, one over
:data:`~kvoffload.ipc.peer_messages.MAX_MESSAGE_BYTES`, another namespace, another protocol
version (a downgrade), a Hello carrying this instance's own incarnation, a Hello naming a dialed
address not this instance's, a second live instance claiming an authenticated peer's address,
too many handshakes in progress from one source, a message the session's state does not allow,
no transport descriptor yet (the peer worker is starting), the session table full, a silent
session, a bug (logged)."""


MAX_LEASE_WAITERS = 64
"""Lease requests waiting at once for leases taken back from peers over their share; more are
answered at once with what fits."""


class Grants(Protocol):
    """This instance's peer worker as the serving role uses it (the node's, over
    :class:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle`). Every call answers at once;
    :meth:`grant` is answered later through :meth:`PeerServer.granted`, :meth:`revoke` through
    :meth:`PeerServer.revoked`."""

    def add_session(self, token: bytes) -> None:
        """Accept data connections proving ``token``."""
        ...

    def drop_session(self, token: bytes) -> None:
        """Close ``token``'s data connections; serve none of its grants any more."""
        ...

    def grant(self, token: bytes, slots: list[int], until: float) -> int:
        """Let ``token``'s session read ``slots`` until ``until`` (the clock of ``now``): the
        grant's id."""
        ...

    def revoke(self, gid: int) -> None:
        """End grant ``gid``."""
        ...


class _Handshake:
    __slots__ = ("hello", "challenge", "since", "source")

    def __init__(self, hello: pm.Hello, challenge: pm.Challenge, since: float, source: str):
        self.hello = hello
        self.challenge = challenge
        self.since = since
        self.source = source


class _Lease:
    __slots__ = (
        "holder",
        "expires",
        "chunks",
        "kv_request_id",
        "keys",
        "req",
        "slots",
        "since",
        "gid",
    )

    def __init__(
        self,
        holder: str,
        expires: float,
        chunks: int,
        kv_request_id: str,
        keys: list[bytes],
        req: int,
        slots: list[int],
        since: float,
    ):
        self.holder = holder
        self.expires = expires
        self.chunks = chunks
        self.kv_request_id = kv_request_id
        self.keys = keys  # the leased keys, kept only for a lease naming a kv_request_id
        self.req = req  # the Lease's request id, for the reply sent once granted
        self.slots = slots  # the reply's slots (-1 / LEASE_BUSY for keys not leased)
        self.since = since  # when it was granted
        self.gid = -1  # its grant in the peer worker


class _Session:
    __slots__ = (
        "identity",
        "incarnation",
        "advertise",
        "descriptor",
        "last_seen",
        "leases",
        "name",
        "data_token",
        "source",
    )

    def __init__(
        self,
        identity: bytes,
        hello: pm.Hello,
        descriptor: bytes,
        now: float,
        data_token: bytes,
        source: str = "",
    ) -> None:
        self.identity = identity
        self.incarnation = hello.incarnation
        self.advertise = hello.advertise
        self.descriptor = descriptor
        self.last_seen = now
        self.leases: dict[int, _Lease] = {}
        self.name = f"peer:{hello.advertise}:{hello.incarnation.hex()}"
        self.source = source  # the address its connection comes from (for logs), "" unknown
        self.data_token = data_token  # its data connections prove it; its leases are granted to it

    def held(self) -> int:
        """Chunks this session holds leased now."""
        return sum(lease.chunks for lease in self.leases.values())


class _Pull:
    __slots__ = ("holder", "offered", "positions", "keys")

    def __init__(self, holder: str, offered: int, positions: list[int], keys: list[bytes]):
        self.holder = holder
        self.offered = offered  # keys in the Offer
        self.positions = positions  # where each pulled key is in the Offer
        self.keys = keys  # the pulled keys, in pull order


class PeerServer:
    """The serving role of one instance's p2p tier (see the module docstring).

    Args:
        manager: this instance's :class:`~kvoffload.tiering.TieringManager` (its host tier is
            what peers read and push into).
        secret: the shared secret (bytes; never logged). ``b""`` only for ``"auth": "none"``,
            which the tier's config allows on loopback only.
        namespace_id: this instance's namespace id (hex): a Hello naming another is refused.
        incarnation: this instance's identity for this start
            (:data:`~kvoffload.ipc.peer_messages.INCARNATION_BYTES` random bytes).
        addresses: the ``host:port`` names this instance is dialed at (its advertise address
            first, then its bind address): a Hello whose ``dialed`` is none of them is refused
            ``misrouted``. Settable (:attr:`addresses`) until the first frame, as the port may be
            known only once bound; none refuses every Hello.
        descriptor: returns this instance's transport descriptor, or None while the peer worker
            has not reported one (an Auth is then refused ``not_ready``; the client retries).
        grants: this instance's peer worker's grants (:class:`Grants`); answered through
            :meth:`granted` and :meth:`revoked`.
        pull: ``pull(identity, client_descriptor, data_token, lease, pairs, digests, ttl_s)`` asks
            the node to READ ``pairs`` (``[(local_slot, remote_slot)]``) from the client's granted
            slots, checking each against ``digests``, within ``ttl_s``; the node answers later
            with :meth:`pull_settled`. If it raises, the admitted slots are freed and the offer
            is answered as not accepted.
        quota_chunks: chunks this server admits from all peers' offers (0: no pushes).
        heartbeat_s: how often clients are asked to send a heartbeat (seconds, in Welcome).
        peer_timeout_s: a session (or handshake) silent this long is dropped (seconds).
        max_lease_s: the longest lease granted, whatever a Lease asks (seconds).
        max_leased_chunks: host slots leased to peers at once (default: half the host tier);
            also the most chunks promoted for peers' lookups at once. Each session may hold at
            most its share of them (see the module docstring).
        stale_lease_s: a lease unreleased this long is held without reading: the first taken
            back when another peer needs room (seconds; the tier's ``transfer_deadline_s``).
        max_sessions: authenticated sessions at once (more are refused ``busy``).
        max_handshakes: handshakes in progress at once (when full, the oldest of the source
            holding most goes).
        max_handshakes_per_source: handshakes in progress from one source address at once (more
            are refused ``handshake_busy``).
        reachable: ``reachable(identity)``: False once that identity's connection is gone (the
            node asks its ROUTER); a collision with a session whose connection is gone is a
            restart. Default: always True (judged by silence alone).
        random_bytes: ``n -> n random bytes`` for nonces (tests may pass a seeded one).
        on_fetched: ``on_fetched(kv_request_id, keys)`` when a client releases a lease that named
            a ``kv_request_id`` (a decoder has read a prefill's chunks; the p2p tier ends its hold).
    """

    def __init__(
        self,
        manager: ServedHost,
        *,
        secret: bytes,
        namespace_id: str,
        incarnation: bytes,
        addresses: Iterable[str] = (),
        descriptor: Callable[[], bytes | None],
        grants: Grants,
        pull: Callable[[bytes, bytes, bytes, int, list[tuple[int, int]], bytes, float], None],
        quota_chunks: int = 0,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 2.0,
        max_lease_s: float = 30.0,
        max_leased_chunks: int | None = None,
        stale_lease_s: float = 2.0,
        max_sessions: int = 64,
        max_handshakes: int = 64,
        max_handshakes_per_source: int = 8,
        reachable: Callable[[bytes], bool] | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
        on_fetched: Callable[[str, list[bytes]], None] | None = None,
    ):
        if len(incarnation) != pm.INCARNATION_BYTES:
            raise ValueError(
                f"incarnation: {len(incarnation)} bytes, expected {pm.INCARNATION_BYTES}"
            )
        self.manager = manager
        self._key = pm.transcript_key(secret)
        self.namespace_id = namespace_id
        self.incarnation = incarnation
        #: ``host:port`` names this instance is dialed at; the first is its advertise address.
        self.addresses: tuple[str, ...] = tuple(dict.fromkeys(addresses))
        self._descriptor = descriptor
        self._grants = grants
        self._pull = pull
        self.quota_chunks = max(0, quota_chunks)
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.max_lease_s = max_lease_s
        slots = manager.arena.num_slots
        self.max_leased_chunks = (
            max(1, slots // 2) if max_leased_chunks is None else max(0, max_leased_chunks)
        )
        self.stale_lease_s = stale_lease_s
        self.max_sessions = max_sessions
        self.max_handshakes = max(1, max_handshakes)
        self.max_handshakes_per_source = max(1, max_handshakes_per_source)
        self._reachable = reachable or (lambda identity: True)
        self._random = random_bytes
        self._on_fetched = on_fetched
        self._row_bytes = manager.arena.row_bytes
        self._handshakes: OrderedDict[bytes, _Handshake] = OrderedDict()
        self._per_source: Counter[str] = Counter()  # handshakes in progress per source
        self._sessions: dict[bytes, _Session] = {}
        #: Bumped whenever a session starts or ends (the node refreshes its peers' set then).
        self.session_changes = 0
        self._pulls: dict[tuple[bytes, int], _Pull] = {}
        self._pushed: dict[bytes, int] = {}  # pushed chunk -> its host slot, until evicted
        self._pulling = 0  # chunks admitted and being pulled
        self._leased = 0  # host slots leased to peers now (pinned: until revocations end)
        self._granting: dict[int, tuple[bytes, int]] = {}  # gid -> (identity, lease) to answer
        self._revoking: dict[int, _Lease] = {}  # gid -> lease whose pins go once it is revoked
        self._waiters: deque[tuple[bytes, pm.Lease, float]] = deque()  # (identity, Lease, since)
        self._ids = itertools.count(1)
        #: Refusals by reason (:data:`REFUSALS`).
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "lookups_served",  # keys looked up by peers
                "hits_served",  # of those, READY
                "pending_served",  # of those, PENDING
                "leases_granted",
                "chunks_leased",
                "lease_expiries",
                "leases_reclaimed",  # taken back from a peer over its share for another (C46)
                "lease_waits",  # Lease requests that waited for leases taken back
                "grants_refused",  # leases the peer worker could not grant (answered not leased)
                "unknown_releases",  # a Release of no lease this session holds
                "chunks_offered",
                "bytes_offered",
                "chunks_admitted",
                "chunks_pulled",  # admitted, pulled and published
                "pull_failures",  # admitted, pull failed: freed
                "pull_digest_mismatches",  # of those, pulled bytes that failed their digest
                "bad_offers",  # keys and slots of different lengths, a lease offered twice
                "unknown_pulls",  # pull_settled of no pull in flight
                "session_timeouts",
                "handshake_drops",  # handshakes dropped: table full, or silent
                "restarts",  # a peer came back with a new incarnation: its leases dropped
                "collisions",  # a second live instance claimed a peer's address: refused
                "internal_errors",
            ),
            0,
        )

    # -- state ----------------------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, int]:
        """Every counter, ``refused.<reason>`` included, plus the gauges ``sessions``,
        ``handshakes``, ``leases_held``, ``chunks_leased_now``, ``chunks_pulling``,
        ``chunks_pushed_held`` and ``free_quota`` (a copy, for metrics)."""
        out = dict(self._counts)
        out.update({f"refused.{r}": n for r, n in self.refused.items()})
        out.update(
            sessions=len(self._sessions),
            handshakes=len(self._handshakes),
            leases_held=sum(len(s.leases) for s in self._sessions.values()),
            chunks_leased_now=self._leased,
            leases_revoking=len(self._revoking),
            chunks_pulling=self._pulling,
            chunks_pushed_held=len(self._pushed),
            free_quota=self.quota_chunks - self._pulling - len(self._pushed),
        )
        return out

    def sessions(self) -> list[tuple[bytes, str, bytes]]:
        """``(identity, advertise, incarnation)`` of every authenticated session."""
        return [(s.identity, s.advertise, s.incarnation) for s in self._sessions.values()]

    def authenticated_peers(self) -> frozenset[str]:
        """The advertise addresses of the authenticated sessions now."""
        return frozenset(s.advertise for s in self._sessions.values())

    def wants_poll(self) -> bool:
        """True while promotions started for peers are in flight: call :meth:`tick` (which polls
        the manager) every few milliseconds meanwhile."""
        return self.manager.serving_promotions() > 0

    def next_deadline(self) -> float | None:
        """The earliest time (the clock of ``now``) at which :meth:`tick` has something to
        expire, or None."""
        times = [h.since + self.peer_timeout_s for h in self._handshakes.values()]
        times.extend(since + self.peer_timeout_s / 2 for _, _, since in self._waiters)
        for s in self._sessions.values():
            times.append(s.last_seen + self.peer_timeout_s)
            times.extend(lease.expires for lease in s.leases.values())
        return min(times) if times else None

    def free_quota(self) -> int:
        """Chunks this server would admit from offers now: the quota less the chunks being
        pulled and the pushed chunks still in the host tier (those evicted since are dropped)."""
        if self._pushed:
            keys = list(self._pushed)
            for k, slot in zip(keys, self.manager.slots_of(keys)):
                if slot != self._pushed[k]:
                    del self._pushed[k]
        return max(0, self.quota_chunks - self._pulling - len(self._pushed))

    # -- input ----------------------------------------------------------------------------------

    def handle(
        self, identity: bytes, frame: bytes | memoryview, now: float, source: str = ""
    ) -> list[Reply]:
        """One frame from ``identity`` at ``now`` (seconds, monotonic), its connection from
        ``source`` (the peer's IP address; "" unknown): the replies to send. Never raises (a
        failure of its own is logged, counted ``internal_errors`` and refused)."""
        try:
            return self._handle(identity, frame, now, source)
        except Exception:
            log.exception("kvoffload p2p: serving a peer's message failed")
            self._counts["internal_errors"] += 1
            try:
                return self._refuse(identity, "internal")
            except Exception:
                return []

    def _handle(
        self, identity: bytes, frame: bytes | memoryview, now: float, source: str
    ) -> list[Reply]:
        if len(frame) > pm.MAX_MESSAGE_BYTES:
            return self._refuse(identity, "too_large")
        try:
            msg = pm.decode(frame)
        except pm.BadMessage:
            version = pm.hello_version(frame)
            if version is not None and version != pm.PROTOCOL_VERSION:
                return self._refuse(identity, "version")  # a Hello of another version
            return self._refuse(identity, "malformed")
        if isinstance(msg, pm.Hello):
            return self._hello(identity, msg, now, source)
        if isinstance(msg, pm.Auth):
            return self._auth(identity, msg, now)
        session = self._sessions.get(identity)
        if session is None:
            if isinstance(msg, pm.Refused):  # the other side gave up a handshake
                self._drop_handshake(identity)
                return []
            return self._refuse(identity, "unauthenticated")
        session.last_seen = now
        if isinstance(msg, pm.Lookup):
            return [(identity, pm.encode(self._lookup(session, msg)))]
        if isinstance(msg, pm.Lease):
            return self._lease(session, msg, now)
        if isinstance(msg, pm.Release):
            self._release(session, msg.lease, fetched=True)
            return []
        if isinstance(msg, pm.Offer):
            return [(identity, pm.encode(self._offer(session, msg)))]
        if isinstance(msg, pm.Heartbeat):
            return [(identity, pm.encode(pm.HeartbeatAck(msg.seq, self.free_quota())))]
        if isinstance(msg, pm.HeartbeatAck):
            return []
        if isinstance(msg, pm.Refused):  # the client ends the session
            self._forget(identity)
            return []
        return self._refuse(identity, "unexpected")

    def _refuse(self, identity: bytes, reason: str) -> list[Reply]:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self._forget(identity)
        return [(identity, pm.encode(pm.Refused(reason)))]

    def _forget(self, identity: bytes) -> None:
        self._drop_handshake(identity)
        session = self._sessions.pop(identity, None)
        if session is not None:
            self.session_changes += 1
            self._drop_leases(session)
            self._grants.drop_session(session.data_token)

    def _drop_handshake(self, identity: bytes) -> _Handshake | None:
        hs = self._handshakes.pop(identity, None)
        if hs is not None:
            left = self._per_source[hs.source] - 1
            if left > 0:
                self._per_source[hs.source] = left
            else:
                del self._per_source[hs.source]
        return hs

    def _drop_leases(self, session: _Session) -> None:
        for lease_id in list(session.leases):
            self._end_lease(session, lease_id)

    # -- handshake ------------------------------------------------------------------------------

    def _hello(self, identity: bytes, hello: pm.Hello, now: float, source: str) -> list[Reply]:
        self._forget(identity)  # a Hello starts over, whatever came before
        if hello.version != pm.PROTOCOL_VERSION:
            return self._refuse(identity, "version")
        if hello.namespace_id != self.namespace_id:
            return self._refuse(identity, "namespace")
        if hello.incarnation == self.incarnation:  # our own client's Hello, relayed back to us
            return self._refuse(identity, "reflection")
        if hello.dialed not in self.addresses:  # dialed elsewhere and relayed here, or misrouted
            return self._refuse(identity, "misrouted")
        if self._per_source[source] >= self.max_handshakes_per_source:
            return self._refuse(identity, "handshake_busy")
        while len(self._handshakes) >= self.max_handshakes:
            # the oldest handshake of the source holding most goes: one source cannot push out
            # another's
            worst = max(self._per_source, key=self._per_source.__getitem__)
            victim = next(i for i, h in self._handshakes.items() if h.source == worst)
            self._drop_handshake(victim)
            self._counts["handshake_drops"] += 1
        challenge = pm.Challenge(
            version=pm.PROTOCOL_VERSION,
            incarnation=self.incarnation,
            advertise=self.addresses[0] if self.addresses else "",
            nonce=self._random(pm.NONCE_BYTES),
            mac=pm.ZERO_MAC,
        )
        challenge.mac = pm.handshake_mac(self._key, "server", hello, challenge)
        self._handshakes[identity] = _Handshake(hello, challenge, now, source)
        self._per_source[source] += 1
        return [(identity, pm.encode(challenge))]

    def _auth(self, identity: bytes, auth: pm.Auth, now: float) -> list[Reply]:
        hs = self._drop_handshake(identity)
        if hs is None:
            reason = "unexpected" if identity in self._sessions else "unauthenticated"
            return self._refuse(identity, reason)
        expected = pm.handshake_mac(self._key, "client", hs.hello, hs.challenge, auth)
        if not pm.mac_ok(expected, auth.mac):
            return self._refuse(identity, "bad_mac")
        mine = self._descriptor()
        if mine is None:
            return self._refuse(identity, "not_ready")
        hello = hs.hello
        if hello.advertise in self.addresses:  # another instance claims to be this one
            return self._own_address_claimed(identity, hs)
        same = [s for s in self._sessions.values() if s.advertise == hello.advertise]
        for other in same:
            if other.incarnation != hello.incarnation and self._alive(other, now):
                return self._collision(identity, hs, other)
        adopted: dict[int, _Lease] = {}
        for other in same:
            del self._sessions[other.identity]
            self.session_changes += 1
            if other.incarnation == hello.incarnation:  # a reconnect: its leases go on
                adopted.update(other.leases)  # (releasable; their reads died with the old one)
            else:  # a restart (the old session is gone or silent): its transfers died with it
                self._counts["restarts"] += 1
                self._drop_leases(other)
            self._grants.drop_session(other.data_token)
        token = self._random(pm.TOKEN_BYTES)
        session = _Session(identity, hello, auth.descriptor, now, token, hs.source)
        session.leases.update(adopted)
        if len(self._sessions) >= self.max_sessions:
            self._drop_leases(session)
            return self._refuse(identity, "busy")
        self._sessions[identity] = session
        self.session_changes += 1
        self._grants.add_session(session.data_token)
        log.info(
            "kvoffload p2p: peer %s (incarnation %s) authenticated",
            hello.advertise,
            hello.incarnation.hex()[:8],
        )
        welcome = pm.Welcome(
            mine, self.heartbeat_s, self.free_quota(), session.data_token, pm.ZERO_MAC
        )
        welcome.mac = pm.handshake_mac(self._key, "welcome", hello, hs.challenge, auth, welcome)
        return [(identity, pm.encode(welcome))]

    def _alive(self, session: _Session, now: float) -> bool:
        """Whether ``session`` still has a live instance behind it: heard from within
        ``peer_timeout_s`` and its connection still open."""
        return now - session.last_seen < self.peer_timeout_s and self._reachable(session.identity)

    def _collision(self, identity: bytes, hs: _Handshake, live: _Session) -> list[Reply]:
        """A second live instance claims ``live``'s advertise address: refused, ``live`` stays."""
        self._counts["collisions"] += 1
        log.error(
            "kvoffload p2p: refused a session: identity collision: a second instance "
            "(incarnation %s, connected from %s) claims the advertise address %s of a live peer "
            "(incarnation %s, connected from %s), whose session and leases stay. Two instances "
            "advertise the same address: give each an advertise_host:port peers reach it at",
            hs.hello.incarnation.hex()[:8],
            hs.source or "?",
            live.advertise,
            live.incarnation.hex()[:8],
            live.source or "?",
        )
        return self._refuse(identity, "identity_collision")

    def _own_address_claimed(self, identity: bytes, hs: _Handshake) -> list[Reply]:
        """A peer (its incarnation is not ours: that was refused as a reflection) advertises an
        address this instance is dialed at: two instances claim one identity, and peers dialing
        it may reach either. Refused, as a collision with this instance's own."""
        self._counts["collisions"] += 1
        log.error(
            "kvoffload p2p: refused a session: identity collision: a second instance "
            "(incarnation %s, connected from %s) claims the advertise address %s of this "
            "instance (incarnation %s). Two instances advertise the same address: give each an "
            "advertise_host:port peers reach it at",
            hs.hello.incarnation.hex()[:8],
            hs.source or "?",
            hs.hello.advertise,
            self.incarnation.hex()[:8],
        )
        return self._refuse(identity, "identity_collision")

    # -- reads ----------------------------------------------------------------------------------

    def _lookup(self, session: _Session, msg: pm.Lookup) -> pm.LookupReply:
        found = (
            self.manager.serve_lookup(msg.keys, session.name, self.max_leased_chunks)
            if msg.keys
            else []
        )
        states = bytes(map(_WIRE_STATE.__getitem__, found))
        c = self._counts
        c["lookups_served"] += len(msg.keys)
        c["hits_served"] += states.count(pm.READY)
        c["pending_served"] += states.count(pm.PENDING)
        return pm.LookupReply(msg.req, states)

    def _share(self) -> int:
        """Chunks one session may hold leased: the cap divided among the sessions (C46)."""
        return max(1, self.max_leased_chunks // max(1, len(self._sessions)))

    def _lease(self, session: _Session, msg: pm.Lease, now: float) -> list[Reply]:
        """Grant what fits of ``msg`` now, or, when the cap is reached and the session is below
        its share, wait for leases taken back from sessions over theirs; the reply goes once the
        worker has granted the slots (:meth:`granted`)."""
        if self._room_short(session, msg) > 0 and len(self._waiters) < MAX_LEASE_WAITERS:
            self._counts["lease_waits"] += 1
            self._waiters.append((session.identity, msg, now))
            return self._serve_waiters(now)
        return self._grant_lease(session, msg, now)

    def _room_short(self, session: _Session, msg: pm.Lease) -> int:
        """Chunks of ``msg`` that fit ``session``'s share but not the cap now (0: none)."""
        own_room = self._share() - session.held()
        cap_room = self.max_leased_chunks - self._leased
        return max(0, min(len(msg.keys), own_room) - max(0, cap_room))

    def _reclaim(self, asker: _Session, need: int, now: float) -> None:
        """Revoke leases held past ``stale_lease_s`` by sessions over their share (held without
        reading: a reader releases as soon as its read settles), oldest first, until ``need``
        chunks are coming back (counting the revocations already under way)."""
        need -= sum(lease.chunks for lease in self._revoking.values())
        if need <= 0:
            return
        share = self._share()
        over = {
            s.identity: s.held() - share
            for s in self._sessions.values()
            if s is not asker and s.held() > share
        }
        stale = sorted(
            (lease.since, lease_id, s)
            for s in self._sessions.values()
            if s.identity in over
            for lease_id, lease in s.leases.items()
            if now - lease.since >= self.stale_lease_s
        )
        for _since, lease_id, s in stale:
            if need <= 0:
                return
            if over[s.identity] <= 0:
                continue
            lease = s.leases[lease_id]
            over[s.identity] -= lease.chunks
            need -= lease.chunks
            self._counts["leases_reclaimed"] += 1
            self._end_lease(s, lease_id)

    def _grant_lease(self, session: _Session, msg: pm.Lease, now: float) -> list[Reply]:
        lease_id = next(self._ids)
        keys = msg.keys
        room = min(self._share() - session.held(), self.max_leased_chunks - self._leased)
        take = keys[: max(0, room)]
        holder = f"lease:{lease_id}"
        slots = self.manager.lease(take, holder) if take else []
        slots += [pm.LEASE_BUSY] * (len(keys) - len(take))
        pinned = [s for s in slots if s >= 0]
        if not pinned:
            digests = bytes(pm.DIGEST_BYTES * len(slots))
            return [
                (session.identity, pm.encode(pm.LeaseReply(msg.req, lease_id, slots, 0.0, digests)))
            ]
        ttl = min(msg.ttl_s, self.max_lease_s)  # the server decides, whatever the reader asks
        kvr = msg.kv_request_id
        leased = [k for k, s in zip(keys, slots) if s >= 0] if kvr else []
        lease = _Lease(holder, now + ttl, len(pinned), kvr, leased, msg.req, slots, now)
        session.leases[lease_id] = lease
        self._leased += len(pinned)
        self._counts["leases_granted"] += 1
        self._counts["chunks_leased"] += len(pinned)
        lease.gid = self._grants.grant(session.data_token, pinned, now + ttl)
        self._granting[lease.gid] = (session.identity, lease_id)
        return []

    def granted(self, gid: int, digests: bytes | None, now: float) -> list[Reply]:
        """The peer worker has granted ``gid`` (``digests``: one per granted slot, in order) or
        could not (None): the LeaseReply for its lease (none when the lease ended meanwhile, or
        the grant is not one of this role's). Never raises."""
        try:
            ref = self._granting.pop(gid, None)
            if ref is None:
                return []
            identity, lease_id = ref
            session = self._sessions.get(identity)
            lease = session.leases.get(lease_id) if session is not None else None
            if session is None or lease is None:
                return []
            slots = lease.slots
            pinned = sum(1 for s in slots if s >= 0)
            if digests is None or len(digests) != pm.DIGEST_BYTES * pinned:
                self._counts["grants_refused"] += 1
                self._end_lease(session, lease_id)
                reply = pm.LeaseReply(
                    lease.req,
                    lease_id,
                    [-1 if s >= 0 else s for s in slots],
                    0.0,
                    bytes(pm.DIGEST_BYTES * len(slots)),
                )
                return [(identity, pm.encode(reply))]
            out = bytearray(pm.DIGEST_BYTES * len(slots))
            it = iter(range(0, len(digests), pm.DIGEST_BYTES))
            for j, s in enumerate(slots):
                if s >= 0:
                    i = next(it)
                    out[j * pm.DIGEST_BYTES : (j + 1) * pm.DIGEST_BYTES] = digests[
                        i : i + pm.DIGEST_BYTES
                    ]
            left = max(0.0, lease.expires - now)
            reply = pm.LeaseReply(lease.req, lease_id, slots, left, bytes(out))
            return [(identity, pm.encode(reply))]
        except Exception:
            log.exception("kvoffload p2p: answering a granted lease failed")
            self._counts["internal_errors"] += 1
            return []

    def revoked(self, gid: int, now: float) -> list[Reply]:
        """The peer worker will send no row of grant ``gid`` any more: its lease's pins go, and
        Lease requests waiting for room are served. Never raises."""
        try:
            lease = self._revoking.pop(gid, None)
            if lease is None:
                return []
            self.manager.release(lease.holder)
            self._leased -= lease.chunks
            return self._serve_waiters(now)
        except Exception:
            log.exception("kvoffload p2p: releasing a revoked lease failed")
            self._counts["internal_errors"] += 1
            return []

    def _serve_waiters(self, now: float) -> list[Reply]:
        """Serve the Lease requests waiting for room, in order: each once its chunks fit, or once
        it has waited ``peer_timeout_s / 2`` (then with what fits: the client gives up on an
        answer after ``peer_timeout_s``). Meanwhile stale leases of sessions over their share are
        taken back for it."""
        out: list[Reply] = []
        while self._waiters:
            identity, msg, since = self._waiters[0]
            session = self._sessions.get(identity)
            if session is not None:
                short = self._room_short(session, msg)
                if short > 0 and now - since < self.peer_timeout_s / 2:
                    self._reclaim(session, short, now)
                    break
                out.extend(self._grant_lease(session, msg, now))
            self._waiters.popleft()
        return out

    def _release(self, session: _Session, lease_id: int, fetched: bool = False) -> None:
        lease = session.leases.get(lease_id)
        if lease is None:
            self._counts["unknown_releases"] += 1
            return
        self._end_lease(session, lease_id)
        if fetched and lease.kv_request_id and self._on_fetched is not None:
            # a decoder released what it read for kv_request_id: the prefill's hold may end
            self._on_fetched(lease.kv_request_id, lease.keys)

    def _end_lease(self, session: _Session, lease_id: int) -> None:
        """The lease ends: its grant is revoked; its pins go once that is acknowledged
        (:meth:`revoked`)."""
        lease = session.leases.pop(lease_id)
        self._granting.pop(lease.gid, None)
        self._revoking[lease.gid] = lease
        self._grants.revoke(lease.gid)

    # -- pushes ---------------------------------------------------------------------------------

    def _offer(self, session: _Session, msg: pm.Offer) -> pm.OfferReply:
        keys, remote = msg.keys, msg.slots
        accepted = bytearray(len(keys))
        c = self._counts
        c["chunks_offered"] += len(keys)
        c["bytes_offered"] += len(keys) * self._row_bytes
        pull_id = (session.identity, msg.lease)
        digests = msg.digests
        bad_shape = len(remote) != len(keys) or len(digests) != pm.DIGEST_BYTES * len(keys)
        if bad_shape or pull_id in self._pulls:
            c["bad_offers"] += 1
            return pm.OfferReply(msg.req, bytes(accepted))
        free = self.free_quota()
        wanted = [j for j, s in enumerate(remote) if s >= 0][:free]
        if not wanted or not session.descriptor:
            return pm.OfferReply(msg.req, bytes(accepted))
        holder = f"push:{next(self._ids)}"
        local = self.manager.admit([keys[j] for j in wanted], holder)
        positions = [j for j, s in zip(wanted, local) if s >= 0]
        pairs = [(s, remote[j]) for j, s in zip(wanted, local) if s >= 0]
        if not pairs:
            return pm.OfferReply(msg.req, bytes(accepted))
        pulled = [keys[j] for j in positions]
        d = pm.DIGEST_BYTES
        wanted_digests = b"".join(digests[j * d : (j + 1) * d] for j in positions)
        try:
            self._pull(
                session.identity,
                session.descriptor,
                session.data_token,
                msg.lease,
                pairs,
                wanted_digests,
                msg.ttl_s,
            )
        except Exception:
            log.exception("kvoffload p2p: starting a pull from %s failed", session.advertise)
            self.manager.commit(pulled, holder, False)
            c["pull_failures"] += len(pulled)
            return pm.OfferReply(msg.req, bytes(accepted))
        self._pulls[pull_id] = _Pull(holder, len(keys), positions, pulled)
        self._pulling += len(pulled)
        c["chunks_admitted"] += len(pulled)
        for j in positions:
            accepted[j] = 1
        return pm.OfferReply(msg.req, bytes(accepted))

    def pull_settled(
        self, identity: bytes, lease: int, ok: Sequence[bool], mismatched: int = 0
    ) -> list[Reply]:
        """The node's READ of the pull it was asked for ``(identity, lease)`` has SETTLED: ``ok``
        one flag per pair it was given (a shorter list fails the rest); ``mismatched`` of the
        failures were rows that did not match their digest. Publishes the chunks read, frees the
        others' slots, and returns the ``Pulled`` message for the pusher (none when its session
        is gone, or for a pull not in flight: counted ``unknown_pulls``). Never raises."""
        try:
            p = self._pulls.pop((identity, lease), None)
            if p is None:
                self._counts["unknown_pulls"] += 1
                return []
            self._counts["pull_digest_mismatches"] += mismatched
            self._pulling -= len(p.keys)
            flags = [bool(x) for x in ok[: len(p.keys)]]
            flags += [False] * (len(p.keys) - len(flags))
            good = [k for k, f in zip(p.keys, flags) if f]
            bad = [k for k, f in zip(p.keys, flags) if not f]
            published = set(self.manager.commit(good, p.holder, True)) if good else set()
            if bad:
                self.manager.commit(bad, p.holder, False)
            slots = self.manager.slots_of(list(published))
            self._pushed.update(zip(published, slots))
            self._counts["chunks_pulled"] += len(published)
            self._counts["pull_failures"] += len(p.keys) - len(published)
            out = bytearray(p.offered)
            for j, k in zip(p.positions, p.keys):
                out[j] = k in published
            if identity not in self._sessions:
                return []
            return [(identity, pm.encode(pm.Pulled(lease, bytes(out))))]
        except Exception:
            log.exception("kvoffload p2p: settling a pull failed")
            self._counts["internal_errors"] += 1
            return []

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Reply]:
        """Expire what is due at ``now`` (seconds, the clock of :meth:`handle`): leases past
        their ttl (their pins released), sessions silent for ``peer_timeout_s`` (their leases
        released; told ``Refused("timeout")``), handshakes as old; and poll the manager while
        promotions started for peers are in flight (an idle engine does not). Never raises."""
        try:
            out: list[Reply] = []
            limit = now - self.peer_timeout_s
            while self._handshakes:
                identity, hs = next(iter(self._handshakes.items()))
                if hs.since > limit:
                    break
                self._drop_handshake(identity)
                self._counts["handshake_drops"] += 1
            for session in list(self._sessions.values()):
                if session.last_seen <= limit:
                    self._counts["session_timeouts"] += 1
                    out.extend(self._refuse(session.identity, "timeout"))
                    continue
                for lease_id in [i for i, x in session.leases.items() if x.expires <= now]:
                    self._end_lease(session, lease_id)
                    self._counts["lease_expiries"] += 1
            if self._waiters:
                out.extend(self._serve_waiters(now))
            if self.manager.serving_promotions():
                # the engine's queued promotions wait for its step (TieringManager.poll)
                self.manager.submit_promotions(peers_only=True)
                self.manager.poll(submit=False)
            return out
        except Exception:
            log.exception("kvoffload p2p: expiring peer state failed")
            self._counts["internal_errors"] += 1
            return []

    def close(self) -> None:
        """Drop every session and revoke every lease (its pins go once :meth:`revoked`). Pulls
        in flight keep their slots reserved until :meth:`pull_settled` (a READ may still write
        them)."""
        for identity in list(self._sessions):
            self._forget(identity)
        self._handshakes.clear()
        self._per_source.clear()
        self._waiters.clear()
