"""The p2p tier's client role, socket-free: this instance's sessions with its peers.

::

    PeerNode thread                                        PeerClient (this module)
      engine commands ─── commands(cmds, now) ─────────▶ Probe: Lookup at each peer in turn
      (Probe, Load,                                      Load:  Lease in parts, READ, Release
       Push, Connect)                                    Push:  Offer, wait for Pulled
      a peer's DEALER ─── on_frame(peer, frame, now) ──▶ one PeerLink per peer: handshake,
                                                         heartbeats, pending requests, parts
      every loop ──────── tick(now) ───────────────────▶ reconnects, heartbeats, deadlines
      worker reports ──── transfer_settled(tid, ...) ──▶ a part's READ settled: Release, result
                     ◀─── [Send | Open | Close | Trusted | Restarted] (in order)
      engine ◀─────────── results deque: Verdict, LoadDone, PushDone, PeerDown
      peer worker ◀────── Transfers.read / acquire_peer / release_peer (answer at once)

Frames in, ``(peer, frame)`` out and a ``tick(now)`` for timers, with no socket, thread or process
inside, so it is tested and fuzzed alone (``tests/integration/test_p2p_client.py``), as the serving role is.

**Commands in.** The node hands over the engine's commands as it pops them. A Probe's peers are
its ``head``, then (unless ``tail`` is None) the peers the KV-event locations show holding the key
(``where``, asked with the Probe's ``located_as``: the engine's key of a salted request's tenant
key, which peers' events name; the Lookups still name the tenant key alone), then ``tail``; the
probe asks them one at a time, skipping a peer whose session is down, until one answers READY;
probes bound for one peer in one call share Lookup messages. A Load is leased and read in parts
of at most :data:`LEASE_CHUNKS` keys, at most :data:`MAX_INFLIGHT_CHUNKS` chunks in flight per
peer (the rest wait). A Push goes, as an Offer, to the peer whose session is up with the most free
quota.

**Frames in.** One frame from a peer's socket. A link goes ``down`` → ``hello`` (Hello sent, naming
the address dialed) → ``auth`` (the peer's Challenge is of our protocol version, is not our own
(a reflection: our Hello relayed to our own server) and proved the secret over the transcript;
Auth and our transport descriptor sent) → ``up`` (Welcome's MAC over the whole handshake checked,
then the peer's descriptor added to our worker; queued requests sent). Before ``up`` any other
message fails the session, and a handshake that fails is counted by reason
(:attr:`PeerClient.handshake_failures`: what we found, or ``refused_<reason>`` the peer gave; an
``identity_collision`` is logged as an error naming our advertise address); once up, replies are
matched to pending requests by ``req`` (an
answer nobody asked for is counted ``unknown_replies``; one that does not fit its request
``malformed_replies``, and the request is treated as unanswered, or its part fails ``bad_reply``);
a Pulled ends a push only when it comes from the peer the offer went to; a Refused fails the
session. A frame for a link that is down is ignored (the node closes the socket as it goes down, so
none comes).

**Out, in order.** :class:`Send` a frame on the peer's socket (dropped when it has none or its send
queue is full: the request's deadline handles it); :class:`Open` a fresh DEALER socket to the peer
(closing its old one) with the routing id given, before the Hello that follows it (a socket ZMQ
cannot connect, as for a request naming host ``*``, comes back as :meth:`PeerClient.unreachable`:
that session is down); :class:`Close` the peer's socket (unsent frames dropped); :class:`Trusted`
the peer's server welcomed a Hello naming our namespace, so its KV events may be answered from;
:class:`Restarted` the address answered with a new incarnation, so what its events said is void.

**Bytes.** A part's leased slots are read by the peer worker through the :class:`Transfers` port
(the node's, over :class:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle`): ``read`` returns
a transfer id at once; the node reports each transfer back exactly once, settled, with
:meth:`PeerClient.transfer_settled`; only then is the lease released and the part's result given.
Each chunk read is checked by the worker against the digest the LeaseReply carries (taken by the
serving side when it granted the slots): one that does not match fails ``digest_mismatch``. The
read must be over before the lease the server granted may end, measured from when the Lease was
sent, less a margin (:func:`lease_margin_s`): its deadline is the shorter of that and
``transfer_deadline_s``, and a read not over by then fails ``lease_expired``, never a HIT.

**Pushes.** A Push's slots are first granted to the chosen peer's session on our own data plane
(``grant``: the worker answers with their digests, :meth:`PeerClient.granted`), then offered with
those digests and the grant's lifetime; when the peer says it pulled them (or the grant's time is
up) the grant is revoked, and the push ends only once the revocation is acknowledged
(:meth:`PeerClient.revoked`): the engine may reuse the slots then.

**Results out.** Into the deque the engine drains: one :class:`~.commands.Verdict` per Probe, one
:class:`~.commands.LoadDone` per Load (once all its parts ended), one :class:`~.commands.PushDone`
per Push, and :class:`~.commands.PeerDown` when a peer goes down or restarts (the engine drops the
verdicts naming it).

**Liveness.** A link heartbeats every ``heartbeat_s``; a peer not heard from for
``peer_timeout_s`` (or whose handshake does not finish within it) is down at once: its outstanding
lookups go to the next peer, its loads fail, its name is removed from the worker (its transfers
settle failed), the engine is told, and the link reconnects with backoff (0.5 s doubling up to
10 s). A peer that comes back with a new incarnation is a new peer.

**Links a request named.** A link to a peer that is not one of ``static_peers`` (the configured
``peers`` and ``peer_events``) exists because a request's routing named it (the tier checked it
against its allow-list first). Such a link is closed and forgotten once no command has used it
for ``request_peer_idle_s`` and nothing of it is outstanding; at most ``max_request_peers`` exist
at once (a new one makes the least recently used idle one go, or the least recently used when
none is idle), so requests naming many addresses leave neither sockets nor reconnects behind, and
cut no other request's transfers short while an idle link can go instead.

Not thread-safe: the node thread drives it. The engine thread reads only :meth:`peers_up`,
:meth:`can_push`, ``links`` and the statistics, as snapshots.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.p2p.commands import (
    Command,
    Connect,
    Load,
    LoadDone,
    PeerDown,
    Probe,
    Push,
    PushDone,
    Result,
    Verdict,
)
from kvoffload.tiers.p2p.config import parse_peer
from kvoffload.tiers.p2p.server import REFUSALS

log = logging.getLogger("kvoffload.p2p")

MAX_PEER_LABELS = 64
"""Peers with a ``peer`` label value of their own in metrics; later ones are counted as ``other``."""
LEASE_CHUNKS = 64
"""Keys per Lease: a large load is leased and read in parts of at most this many chunks."""
MAX_INFLIGHT_CHUNKS = 256
"""Chunks leased from one peer at once by this instance; further parts wait for those to end, so a
large load neither hits the peer's lease cap nor holds many of its slots at once."""
PENDING_RETRY_S = 0.01
"""A peer answered PENDING (promoting the chunk from its own fs tier): ask it again after this."""
BACKOFF_NOT_READY_S = 0.05
"""A peer whose worker is still starting (Refused ``not_ready``) is asked again after this."""
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
DESCRIPTOR_WAIT_S = 0.05
"""Our own worker has no transport descriptor yet: try to open the session again after this."""
HANDSHAKE_FAILURES = (
    "bad_mac",
    "reflection",
    "version",
    "unexpected",
    "timeout",
    "unusable_descriptor",
    *(f"refused_{r}" for r in REFUSALS),
    "refused_other",
)
"""Why a handshake of the client role failed (:attr:`PeerClient.handshake_failures`): the peer's
MAC did not prove the secret, its Challenge carried our own incarnation, another protocol version,
a message the handshake does not expect, no answer within ``peer_timeout_s``, a descriptor our
worker refused, or the peer refused the session (``refused_<its reason>``)."""
_WORKER_DIED = "worker_died"  # kvoffload.tiers.p2p.worker_handle.WORKER_DIED (not imported: heavy)
LEASE_EXPIRED = "lease_expired"  # kvoffload.workers.p2p_transport.LEASE_EXPIRED
DIGEST_MISMATCH = "digest_mismatch"


def lease_margin_s(ttl_s: float) -> float:
    """How long before the end of a lease of ``ttl_s`` seconds (as the reader reckons it, from
    when it sent the Lease) a read of it must be over: a tenth of it, at most a second."""
    return min(1.0, 0.1 * ttl_s)


_TRANSFER_REASONS = frozenset(
    (LEASE_EXPIRED, _WORKER_DIED, "timeout", "deadline", "peer_down", "transfer_failed")
)


def _failure(reason: str) -> str:
    """A failed transfer's reason as its chunks' failure reason: one of a bounded set of labels
    (``kvoffload/reasons.py``), never the transport's free text ("deadline passed", an
    exception's message), which is logged instead."""
    if reason in _TRANSFER_REASONS:
        return reason
    return "deadline" if "deadline" in reason else "transfer_failed"


# -- what the client asks of its node ----------------------------------------------------------


class Send(NamedTuple):
    """Send ``frame`` on ``peer``'s socket."""

    peer: str
    frame: bytes


class Open(NamedTuple):
    """Close ``peer``'s socket if it has one; open a DEALER with ZMQ routing id ``routing_id`` and
    connect it to ``tcp://host:port``."""

    peer: str
    host: str
    port: int
    routing_id: bytes


class Close(NamedTuple):
    """Close ``peer``'s socket (unsent frames are dropped)."""

    peer: str


class Trusted(NamedTuple):
    """``peer``'s server welcomed our namespace: its KV events may be answered from."""

    peer: str


class Restarted(NamedTuple):
    """``peer`` answered with a new incarnation: what its KV events said is void."""

    peer: str


Out = Send | Open | Close | Trusted | Restarted
"""One thing for the node to do, in the order given."""


class Transfers(Protocol):
    """The peer worker as the client role uses it (the node implements it over
    :class:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle`). Every call answers at once;
    a grant is answered later through :meth:`PeerClient.granted`, a revocation through
    :meth:`PeerClient.revoked`."""

    @property
    def descriptor(self) -> bytes | None:
        """Our worker's transport descriptor; None while it starts."""
        ...

    @property
    def row_bytes(self) -> int:
        """Bytes per chunk (one arena row)."""
        ...

    def acquire_peer(self, descriptor: bytes, token: bytes) -> str:
        """The worker's name for the peer behind ``descriptor``, reached with the session data
        ``token`` (counted: one per user).

        Raises:
            Exception: a descriptor the worker cannot use.
        """
        ...

    def release_peer(self, name: str) -> None:
        """One user of ``name`` is done; the last removes it (its transfers settle failed)."""
        ...

    def read(
        self,
        name: str,
        pairs: list[tuple[int, int]],
        deadline_s: float,
        digests: bytes,
        not_after: float,
    ) -> int:
        """Start a READ of ``(local slot, remote slot)`` pairs from ``name``, each checked
        against ``digests``, all in by ``not_after`` (the clock of ``now``): its transfer id.

        Raises:
            ValueError: a pair the worker refuses (e.g. a remote slot outside the peer's arena).
        """
        ...

    def add_session(self, token: bytes) -> None:
        """Our data server accepts the session holding ``token`` (the peer pulls our pushes)."""
        ...

    def drop_session(self, token: bytes) -> None:
        """Our data server no longer serves ``token``'s session."""
        ...

    def grant(self, token: bytes, slots: list[int], until: float) -> int:
        """Let ``token``'s session read our ``slots`` until ``until``: the grant's id."""
        ...

    def revoke(self, gid: int) -> None:
        """End grant ``gid``."""
        ...


# -- per-peer state ----------------------------------------------------------------------------


class _Pending:
    """An outstanding request of a link: what to do with the answer, and when to give up."""

    __slots__ = ("kind", "ctx", "deadline")

    def __init__(self, kind: str, ctx: Any, deadline: float):
        self.kind = kind
        self.ctx = ctx
        self.deadline = deadline


class _Probe:
    """Where to look for one key: its peers in order, the next one to ask, since when asked."""

    __slots__ = ("key", "peers", "idx", "since", "pending_since")

    def __init__(self, key: bytes, peers: tuple[str, ...], now: float):
        self.key = key
        self.peers = peers
        self.idx = 0
        self.since = now
        self.pending_since = 0.0  # when the peer asked now first answered PENDING


class _LoadGroup:
    """A load job's keys at one peer: its parts, reported to the engine as one result."""

    __slots__ = ("job_id", "remaining", "ok", "failed", "nbytes", "t0")

    def __init__(self, job_id: int, parts: int, now: float):
        self.job_id = job_id
        self.remaining = parts
        self.ok: list[bytes] = []
        self.failed: dict[bytes, str] = {}
        self.nbytes = 0
        self.t0 = now


class _Load:
    """A part of a load at one peer (at most :data:`LEASE_CHUNKS` keys): leased, then read by the
    worker, then released."""

    __slots__ = (
        "group",
        "keys",
        "slots",
        "kv_request_id",
        "lease",
        "tid",
        "ok",
        "refused",
        "t0",
        "link",
        "sent",
    )

    def __init__(
        self,
        group: _LoadGroup,
        keys: list[bytes],
        slots: list[int],
        kvr: str,
        link: PeerLink,
        now: float,
    ):
        self.group = group
        self.keys = keys
        self.slots = slots
        self.kv_request_id = kvr
        self.lease = -1
        self.tid = -1
        self.ok: list[bytes] = []
        self.refused: dict[bytes, str] = {}  # keys the peer would not lease, and why
        self.t0 = now
        self.link = link
        self.sent = False


class PeerLink:
    """The client role's state towards one peer (``host:port``): its session's handshake state,
    its outstanding requests, its load parts in flight and waiting."""

    def __init__(self, addr: str, label: str, static: bool = True):
        self.addr = addr
        self.label = label  # the ``peer`` label of its metrics
        self.host, self.port = parse_peer(addr, "peer")
        self.static = static  # a configured peer (else named by requests: forgotten when idle)
        self.last_used = 0.0  # when a command last used it
        self.state = "down"  # down -> hello -> auth -> up; a socket is open unless down
        self.retry_at = 0.0
        self.backoff = 0.0
        self.handshake: list[pm.PeerMessage] = []  # Hello, Challenge, Auth so far (MACed)
        self.peer_incarnation = b""
        self.worker_name = ""  # the peer's name in our worker's transport (per incarnation)
        self.last_heard = 0.0
        self.next_heartbeat = 0.0
        self.since = 0.0  # when the current handshake started
        self.free_quota = 0
        self.data_token = b""  # the session's data token (Welcome), while up
        self.pending: dict[int, _Pending] = {}
        self.queued: list[pm.PeerMessage] = []  # sent once up
        self.inflight_chunks = 0  # chunks of load parts sent and not yet done
        self.waiting_loads: deque[_Load] = deque()  # parts held back by MAX_INFLIGHT_CHUNKS
        self.connects = 0

    @property
    def up(self) -> bool:
        """True once authenticated, and until the peer is noticed down."""
        return self.state == "up"


# -- the role ----------------------------------------------------------------------------------


class PeerClient:
    """The client role of one instance's p2p tier (see the module docstring).

    Args:
        transfers: the peer worker (:class:`Transfers`).
        incarnation: this instance's identity for this start
            (:data:`~kvoffload.ipc.peer_messages.INCARNATION_BYTES` random bytes).
        namespace_id: hex id of the namespace the sessions read.
        secret: the shared secret (bytes; empty with ``auth: none``: no MAC is checked).
        heartbeat_s, peer_timeout_s, transfer_deadline_s, lease_ttl_s: seconds.
        advertise: ``host:port`` peers reach this instance at (sent in Hello; may be set later,
            before the first command).
        results: the deque the engine drains (a new one by default).
        count: ``count(counter, n=1)``: the tier's counters.
        server_free_quota: chunks our serving role would admit now (sent in heartbeats).
        where: ``where(key)``: peers the KV-event locations show holding ``key``, or None.
        static_peers: the configured peers (``peers``, ``peer_events``); a link to any other
            was named by a request (see the module docstring).
        request_peer_idle_s: a link a request named is forgotten after this long unused
            (seconds).
        max_request_peers: links requests named, at most, at once (LRU).
        random_bytes: ``n -> n random bytes`` for nonces (tests may pass a seeded one).
    """

    def __init__(
        self,
        *,
        transfers: Transfers,
        incarnation: bytes,
        namespace_id: str,
        secret: bytes,
        heartbeat_s: float,
        peer_timeout_s: float,
        transfer_deadline_s: float,
        lease_ttl_s: float,
        advertise: str = "",
        results: deque[Result] | None = None,
        count: Callable[..., None] | None = None,
        server_free_quota: Callable[[], int] | None = None,
        where: Callable[[bytes], Sequence[str]] | None = None,
        static_peers: Iterable[str] = (),
        request_peer_idle_s: float = 60.0,
        max_request_peers: int = 16,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ):
        self.transfers = transfers
        self.incarnation = incarnation
        self.namespace_id = namespace_id
        self._key = pm.transcript_key(secret)
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.transfer_deadline_s = transfer_deadline_s
        self.lease_ttl_s = lease_ttl_s
        self.advertise = advertise
        self.results: deque[Result] = deque() if results is None else results
        self.count: Callable[..., None] = count or (lambda *a: None)
        self.server_free_quota: Callable[[], int] = server_free_quota or (lambda: 0)
        self.where = where
        self.static_peers = frozenset(static_peers)
        self.request_peer_idle_s = request_peer_idle_s
        self.max_request_peers = max(1, max_request_peers)
        self._random = random_bytes
        self.links: dict[str, PeerLink] = {}
        # links requests named, least recently used first
        self._request_links: OrderedDict[str, PeerLink] = OrderedDict()
        #: Handshakes that failed, by reason (:data:`HANDSHAKE_FAILURES`); read by scrapes.
        self.handshake_failures: dict[str, int] = dict.fromkeys(HANDSHAKE_FAILURES, 0)
        #: Request links dropped to stay within ``max_request_peers`` (read by scrapes).
        self.request_links_evicted = 0
        self.next_req = 0
        self.heartbeat_seq = 0
        self.loads: dict[int, _Load] = {}  # transfer id -> load part
        # job id -> (link offered to, keys, end of its grant, grant id): offers being pulled
        self.pushes: dict[int, tuple[PeerLink, list[bytes], float, int]] = {}
        # grant id -> (job id, link, keys, slots, end of the grant): pushes waiting for digests
        self.push_grants: dict[int, tuple[int, PeerLink, list[bytes], list[int], float]] = {}
        self.push_ending: dict[int, PushDone] = {}  # grant id -> the push's result, once revoked
        self.later: list[tuple[float, _Probe]] = []  # probes to send again at a time
        # Per-peer statistics, written by this thread only, read by scrapes (P2PTier.report_metrics):
        # (peer label, statistic) -> total; load latencies (peer label, seconds) until taken.
        self.peer_stats: dict[tuple[str, str], float] = {}
        self.latencies: deque[tuple[str, float]] = deque(maxlen=65536)
        self._labels: dict[str, str] = {}
        self._out: list[Out] = []

    # -- inputs ---------------------------------------------------------------------------------

    def commands(self, cmds: Iterable[Command], now: float) -> list[Out]:
        """The engine's commands, in order (probes bound for one peer share Lookup messages)."""
        batches: dict[str, list[_Probe]] = {}
        for cmd in cmds:
            match cmd:
                case Probe():
                    peers = cmd.head
                    if cmd.tail is not None:
                        # by the engine's key: peers' KV events name it, not a tenant key
                        where = self.where
                        located = where(cmd.located_as or cmd.key) if where is not None else ()
                        peers = tuple(dict.fromkeys((*cmd.head, *located, *cmd.tail)))
                    self._probe_next(_Probe(cmd.key, peers, now), batches, now)
                case Load():
                    self._start_load(cmd, now)
                case Push():
                    self._start_push(cmd.job_id, cmd.keys, cmd.slots, now)
                case Connect():
                    self._link(cmd.peer, now)
        self._send_probes(batches, now)
        return self._take()

    def on_frame(self, peer: str, frame: bytes, now: float) -> list[Out]:
        """One frame from ``peer``'s socket at ``now`` (seconds, monotonic)."""
        link = self.links.get(peer)
        if link is None or link.state == "down":
            return self._take()  # no socket of ours: nothing can come (see the module)
        self._on_frame(link, frame, now)
        return self._take()

    def tick(self, now: float) -> list[Out]:
        """Timers: probes to ask again, reconnects, handshake deadlines, heartbeats, silence,
        request deadlines, offers never pulled."""
        if self.later:
            due = [p for t, p in self.later if t <= now]
            if due:
                self.later = [(t, p) for t, p in self.later if t > now]
                batches: dict[str, list[_Probe]] = {}
                for probe in due:
                    self._probe_next(probe, batches, now)
                self._send_probes(batches, now)
        for link in list(self.links.values()):
            self._tick_link(link, now)
        if self._request_links:
            limit = now - self.request_peer_idle_s
            for link in list(self._request_links.values()):
                if link.last_used > limit:
                    break  # least recently used first: the rest are younger
                if self._idle(link):
                    self._forget_link(link, now)
        for job_id, (_link, keys, deadline, gid) in list(self.pushes.items()):
            if deadline <= now:
                # The receiver never said it pulled, and the grant's time is up: revoked, the
                # slots can go back.
                del self.pushes[job_id]
                self._end_push(gid, PushDone(job_id, None, [], dict.fromkeys(keys, "timeout")))
        return self._take()

    def granted(self, gid: int, digests: bytes | None, now: float) -> list[Out]:
        """Our worker granted a push's slots (``digests`` one per slot) or could not (None): the
        Offer goes to the peer chosen. A grant that is not one of this role's is ignored."""
        pg = self.push_grants.pop(gid, None)
        if pg is None:
            return self._take()
        job_id, link, keys, slots, until = pg
        if digests is None or not link.up or until <= now:
            failed = dict.fromkeys(keys, "no_peer" if not link.up else "transfer_failed")
            self._end_push(gid, PushDone(job_id, None, [], failed))
            return self._take()
        offer = pm.Offer(
            req=0, keys=keys, lease=job_id, slots=slots, ttl_s=until - now, digests=digests
        )
        self._request(link, offer, "offer", (job_id, keys, slots, gid, until), now)
        return self._take()

    def revoked(self, gid: int, now: float) -> list[Out]:
        """Our worker will send no row of grant ``gid`` any more: its push ends."""
        done = self.push_ending.pop(gid, None)
        if done is not None:
            self.results.append(done)
        return self._take()

    def _end_push(self, gid: int, done: PushDone) -> None:
        """Revoke the push's grant; ``done`` is its result once that is acknowledged."""
        self.push_ending[gid] = done
        self.transfers.revoke(gid)

    def transfer_settled(
        self, tid: int, ok: bool, reason: str, now: float, bad: Sequence[int] = ()
    ) -> list[Out]:
        """The worker's READ ``tid`` has settled (``ok``, less the positions ``bad`` whose
        chunks failed their digest; or failed for ``reason``). A transfer that is not one of this
        role's load parts is ignored."""
        part = self.loads.pop(tid, None)
        if part is None:
            return self._take()
        self._release(part)
        if ok:
            wrong = {part.ok[i] for i in bad if 0 <= i < len(part.ok)}
            if wrong:
                self.count("digest_mismatches", len(wrong))
                log.warning(
                    "p2p: %d chunks read from peer %s did not match their digests",
                    len(wrong),
                    part.link.addr,
                )
            good = [k for k in part.ok if k not in wrong]
            self._load_done(
                part, good, {**part.refused, **dict.fromkeys(wrong, DIGEST_MISMATCH)}, now
            )
        else:
            self.count("transfer_failures")
            why = _failure(reason)
            if why == LEASE_EXPIRED:
                self.count("lease_expiries")
            self._load_done(part, [], why, now)
            # The transport marks a peer down on any failed transfer (its connection state is
            # unknown): the session goes down with it and starts again.
            if part.link.up and reason != _WORKER_DIED:
                self._fail(part.link, now, f"a transfer failed: {reason}")
        return self._take()

    def transport_refused(self, name: str, reason: str, now: float) -> list[Out]:
        """The worker refused the descriptor it knows as ``name``: its sessions go down."""
        for link in list(self.links.values()):
            if link.worker_name == name and link.state != "down":
                self._fail(link, now, f"the peer worker refused its descriptor: {reason}")
        return self._take()

    def unreachable(self, peer: str, why: str, now: float) -> list[Out]:
        """The node could not open a socket to ``peer`` (an address ZMQ refuses to connect to):
        its session is down, and retried with backoff like any peer down."""
        link = self.links.get(peer)
        if link is not None and link.state != "down":
            self._fail(link, now, f"cannot connect: {why}")
        return self._take()

    def worker_restarted(self, now: float) -> list[Out]:
        """Our worker was restarted (a new descriptor, no peers): every session starts again
        now."""
        for link in list(self.links.values()):
            if link.state != "down":
                self._fail(link, now, "our peer worker restarted")
            link.retry_at = now
        return self._take()

    # -- what the engine thread reads ----------------------------------------------------------

    def peers_up(self) -> list[str]:
        """The peers whose session is up now, sorted (a snapshot; any thread)."""
        return sorted(a for a, link in list(self.links.items()) if link.up)

    def can_push(self) -> bool:
        """True when some peer's session is up with free quota (a snapshot; any thread)."""
        return any(link.up and link.free_quota > 0 for link in list(self.links.values()))

    def label(self, peer: str) -> str:
        """The ``peer`` label value of ``peer`` in metrics (given when its link is made)."""
        label = self._labels.get(peer)
        if label is None:
            # bounded cardinality (and memory): the first MAX_PEER_LABELS peers by name, the rest
            # as "other"
            if len(self._labels) >= MAX_PEER_LABELS:
                return "other"
            label = self._labels[peer] = peer
        return label

    def stat(self, peer: str, what: str, n: float = 1) -> None:
        """Add ``n`` to a per-peer statistic."""
        k = (self.label(peer), what)
        self.peer_stats[k] = self.peer_stats.get(k, 0) + n

    # -- sessions -------------------------------------------------------------------------------

    def _take(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    def _link(self, addr: str, now: float) -> PeerLink:
        """The link to ``addr``, opened on first use; a link a request named is used now."""
        link = self.links.get(addr)
        if link is None:
            static = addr in self.static_peers
            if not static:
                while len(self._request_links) >= self.max_request_peers:
                    # the least recently used idle link goes; a busy one (its loads, probes and
                    # pushes would fail) only when none is idle, so requests naming many
                    # addresses cannot cut another request's transfers short
                    links = self._request_links.values()
                    victim = next((lk for lk in links if self._idle(lk)), None)
                    self.request_links_evicted += 1
                    self._forget_link(victim or next(iter(links)), now)
            link = PeerLink(addr, self.label(addr), static)
            self.links[addr] = link
            if not static:
                self._request_links[addr] = link
            self._connect(link, now)
        if not link.static:
            link.last_used = now
            self._request_links.move_to_end(addr)
        return link

    def _idle(self, link: PeerLink) -> bool:
        """Nothing of ``link`` is outstanding: no request, no load part, no push."""
        return (
            not link.pending
            and not link.inflight_chunks
            and not link.waiting_loads
            and not any(p[0] is link for p in self.pushes.values())
        )

    def _forget_link(self, link: PeerLink, now: float) -> None:
        """Close a link a request named and forget it: what it had outstanding fails as when
        its peer goes down (probes go on to their next peer), and nothing reconnects."""
        if link.state != "down":
            self._fail(link, now, "unused: closed", retry_s=0.0)
        self.links.pop(link.addr, None)
        self._request_links.pop(link.addr, None)
        for job_id in [j for j, p in self.pushes.items() if p[0] is link]:
            _, keys, _, gid = self.pushes.pop(job_id)
            self._end_push(gid, PushDone(job_id, None, [], dict.fromkeys(keys, "peer_down")))

    def _connect(self, link: PeerLink, now: float) -> None:
        """Open a fresh socket and say Hello (the previous socket, if any, is closed)."""
        if self.transfers.descriptor is None:
            link.retry_at = now + DESCRIPTOR_WAIT_S  # our worker has not said hello yet
            return
        link.connects += 1
        routing_id = self.incarnation + link.connects.to_bytes(4, "little")
        self._out.append(Open(link.addr, link.host, link.port, routing_id))
        link.state = "hello"
        link.since = now
        link.last_heard = now
        hello = pm.Hello(
            version=pm.PROTOCOL_VERSION,
            incarnation=self.incarnation,
            advertise=self.advertise,
            dialed=link.addr,
            namespace_id=self.namespace_id,
            nonce=self._random(pm.NONCE_BYTES),
        )
        link.handshake = [hello]
        self._send_now(link, hello)

    def _send_now(self, link: PeerLink, msg: pm.PeerMessage) -> None:
        if link.state != "down":  # a socket is open
            self._out.append(Send(link.addr, pm.encode(msg)))

    def _send(self, link: PeerLink, msg: pm.PeerMessage) -> None:
        """Send now when up, else once the handshake ends (or never, when it fails)."""
        if link.state == "up":
            self._send_now(link, msg)
        else:
            link.queued.append(msg)

    def _request(self, link: PeerLink, msg: Any, kind: str, ctx: Any, now: float) -> None:
        """Send a request with a ``req`` field and remember what its answer is for."""
        self.next_req += 1
        msg.req = self.next_req
        link.pending[msg.req] = _Pending(kind, ctx, now + self.peer_timeout_s)
        self._send(link, msg)

    def _handshake_failed(self, link: PeerLink, now: float, reason: str, why: str) -> None:
        """The handshake with ``link``'s peer failed for ``reason`` (counted): the link is down."""
        self.handshake_failures[reason] = self.handshake_failures.get(reason, 0) + 1
        link.handshake = []
        self._fail(link, now, why)

    def _refused(self, link: PeerLink, reason: str, now: float) -> None:
        """The peer refused our handshake for ``reason``."""
        if reason == "not_ready":  # its peer worker is still starting: try again soon
            self._fail(link, now, "its peer worker is starting", retry_s=BACKOFF_NOT_READY_S)
            return
        label = f"refused_{reason}" if reason in REFUSALS else "refused_other"
        self.handshake_failures[label] = self.handshake_failures.get(label, 0) + 1
        link.handshake = []
        if reason == "identity_collision":
            log.error(
                "p2p: peer %s refused our session: identity collision: another live instance "
                "already claims our advertise address %s. Two instances advertise the same "
                "address: give each an advertise_host:port peers reach it at",
                link.addr,
                self.advertise,
            )
        self._fail(link, now, f"refused the session: {reason[:64]!r}")

    def _on_frame(self, link: PeerLink, frame: bytes, now: float) -> None:
        try:
            msg = pm.decode(frame)
        except pm.BadMessage as e:
            self.count("malformed_replies")
            log.warning("p2p: malformed message from peer %s: %s", link.addr, e)
            return
        link.last_heard = now
        if link.state == "hello":
            if isinstance(msg, pm.Refused):
                self._refused(link, msg.reason, now)
                return
            if not isinstance(msg, pm.Challenge):
                why = f"answered Hello with {type(msg).__name__}"
                self._handshake_failed(link, now, "unexpected", why)
                return
            hello = link.handshake[0]
            expect = pm.handshake_mac(self._key, "server", hello, msg)
            if not pm.mac_ok(expect, msg.mac):
                self.count("refused_bad_mac")
                why = "its Challenge does not prove the shared secret"
                self._handshake_failed(link, now, "bad_mac", why)
                return
            if msg.version != pm.PROTOCOL_VERSION:
                why = f"it speaks protocol version {msg.version}, we {pm.PROTOCOL_VERSION}"
                self._handshake_failed(link, now, "version", why)
                return
            if msg.incarnation == self.incarnation:
                why = "it is this instance (our own Hello came back: a relay or a loop)"
                self._handshake_failed(link, now, "reflection", why)
                return
            if link.peer_incarnation and link.peer_incarnation != msg.incarnation:
                self._peer_restarted(link)  # a new instance at that address: forget the old one
            link.peer_incarnation = msg.incarnation
            auth = pm.Auth(mac=pm.ZERO_MAC, descriptor=self.transfers.descriptor or b"")
            auth.mac = pm.handshake_mac(self._key, "client", hello, msg, auth)
            link.handshake = [hello, msg, auth]
            link.state = "auth"
            self._send_now(link, auth)
            return
        if link.state == "auth":
            if isinstance(msg, pm.Welcome):
                expect = pm.handshake_mac(self._key, "welcome", *link.handshake, msg)
                if not pm.mac_ok(expect, msg.mac):
                    why = "its Welcome does not prove the shared secret over our handshake"
                    self._handshake_failed(link, now, "bad_mac", why)
                    return
                link.handshake = []
                try:
                    link.worker_name = self.transfers.acquire_peer(msg.descriptor, msg.data_token)
                    link.data_token = msg.data_token  # it pulls our pushes with it
                    self.transfers.add_session(msg.data_token)
                except Exception as e:  # a descriptor our transport cannot use
                    why = f"its transport descriptor is unusable: {e}"
                    self._handshake_failed(link, now, "unusable_descriptor", why)
                    return
                link.state = "up"
                link.backoff = 0.0
                self._out.append(Trusted(link.addr))  # it serves our namespace
                link.free_quota = msg.quota_chunks
                link.next_heartbeat = now + self.heartbeat_s
                log.info("p2p: peer %s is up", link.addr)
                queued, link.queued = link.queued, []
                for q in queued:
                    self._send_now(link, q)
                return
            if isinstance(msg, pm.Refused):
                self._refused(link, msg.reason, now)
            else:
                why = f"answered Auth with {type(msg).__name__}"
                self._handshake_failed(link, now, "unexpected", why)
            return
        # up
        if isinstance(msg, pm.HeartbeatAck):
            link.free_quota = msg.free_quota
            return
        if isinstance(msg, pm.Heartbeat):
            link.free_quota = msg.free_quota
            ack = pm.HeartbeatAck(seq=msg.seq, free_quota=self.server_free_quota())
            self._send_now(link, ack)
            return
        if isinstance(msg, pm.Pulled):
            self._on_pulled(link, msg)
            return
        if isinstance(msg, pm.Refused):
            self.count("refused_by_peer")
            log.warning("p2p: peer %s refused a message: %s", link.addr, msg.reason)
            self._fail(link, now, f"refused: {msg.reason}")
            return
        req = getattr(msg, "req", None)
        p = link.pending.pop(req, None) if req is not None else None
        if p is None:
            self.count("unknown_replies")
            return
        self._on_reply(link, p, msg, now)

    def _tick_link(self, link: PeerLink, now: float) -> None:
        """A link's timers: reconnect, handshake deadline, heartbeats, silence, request
        deadlines."""
        if link.state == "down":
            if now >= link.retry_at:
                self._connect(link, now)
            return
        if link.state != "up":
            if now - link.since > self.peer_timeout_s:
                why = "the handshake did not finish in time"
                self._handshake_failed(link, now, "timeout", why)
            return
        if now - link.last_heard > self.peer_timeout_s:
            self._fail(link, now, f"silent for {now - link.last_heard:.1f} s")
            return
        if now >= link.next_heartbeat:
            link.next_heartbeat = now + self.heartbeat_s
            self.heartbeat_seq += 1
            hb = pm.Heartbeat(seq=self.heartbeat_seq, free_quota=self.server_free_quota())
            self._send_now(link, hb)
        expired = [r for r, p in link.pending.items() if p.deadline <= now]
        for r in expired:
            self._on_unanswered(link, link.pending.pop(r), now)

    def _fail(self, link: PeerLink, now: float, why: str, retry_s: float | None = None) -> None:
        """The peer is down: fail everything outstanding, tell the engine, reconnect later
        (after ``retry_s``, or with the link's backoff)."""
        if retry_s is None:
            log.warning("p2p: peer %s is down: %s", link.addr, why)
            link.backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, link.backoff * 2))
            retry_s = link.backoff
        else:
            log.info("p2p: peer %s: %s", link.addr, why)
        self.count("peer_down")
        link.state = "down"
        self._out.append(Close(link.addr))
        link.retry_at = now + retry_s
        pending, link.pending = link.pending, {}
        for p in pending.values():
            self._on_unanswered(link, p, now)
        waiting, link.waiting_loads = link.waiting_loads, deque()
        for part in waiting:
            self._load_done(part, [], "peer_down", now)
        link.queued = []
        self._link_down(link)

    def _link_down(self, link: PeerLink) -> None:
        """``link``'s peer is down: cancel its transfers, tell the engine. (Pushes to it keep
        their pins until their deadline: the receiver's reads may still run.)"""
        if link.worker_name:
            name, link.worker_name = link.worker_name, ""
            try:
                self.transfers.release_peer(name)  # its transfers settle failed
            except Exception:
                log.exception("p2p: removing peer %s from the worker failed", link.addr)
        if link.data_token:
            token, link.data_token = link.data_token, b""
            try:
                self.transfers.drop_session(token)
            except Exception:
                log.exception("p2p: ending peer %s's data session failed", link.addr)
        self.results.append(PeerDown(link.addr))

    def _peer_restarted(self, link: PeerLink) -> None:
        """``link``'s address answers with a new incarnation: drop what we knew of the old one."""
        self.count("peer_restarts")
        self._out.append(Restarted(link.addr))
        self.results.append(PeerDown(link.addr))

    # -- lookups --------------------------------------------------------------------------------

    def _probe_next(self, probe: _Probe, batches: dict[str, list[_Probe]], now: float) -> None:
        """Ask the probe's next peer that is not down; none left: the key is nowhere."""
        peers = probe.peers
        while probe.idx < len(peers):
            addr = peers[probe.idx]
            probe.idx += 1
            link = self._link(addr, now)
            if link.state == "down":
                continue
            probe.since = now
            batches.setdefault(addr, []).append(probe)
            return
        self.results.append(Verdict(probe.key, None))

    def _send_probes(self, batches: dict[str, list[_Probe]], now: float) -> None:
        while batches:
            addr = next(iter(batches))
            probes = batches.pop(addr)
            link = self.links.get(addr)
            if link is None or link.state == "down":
                # forgotten (a link a request named, evicted for a later one) or down since
                # the probes were batched for it: they go on to their next peer
                for probe in probes:
                    self._probe_next(probe, batches, now)
                continue
            for i in range(0, len(probes), pm.MAX_KEYS):
                batch = probes[i : i + pm.MAX_KEYS]
                keys = [p.key for p in batch]
                self._request(link, pm.Lookup(req=0, keys=keys), "lookup", batch, now)

    # -- replies --------------------------------------------------------------------------------

    def _on_reply(self, link: PeerLink, p: _Pending, msg: Any, now: float) -> None:
        """A reply to one of ``link``'s requests."""
        if p.kind == "lookup" and isinstance(msg, pm.LookupReply):
            probes: list[_Probe] = p.ctx
            if len(msg.states) != len(probes):
                self.count("malformed_replies")
                self._on_unanswered(link, p, now)
                return
            self.stat(link.addr, "lookup_chunks", len(probes))
            batches: dict[str, list[_Probe]] = {}
            for probe, state in zip(probes, msg.states):
                if state == pm.READY:
                    self.stat(link.addr, "lookup_hits")
                    self.results.append(Verdict(probe.key, link.addr))
                elif state == pm.PENDING and (
                    not probe.pending_since or now - probe.pending_since < self.peer_timeout_s
                ):
                    # the peer is promoting it from its own fs/obj tier: ask that peer again soon
                    probe.pending_since = probe.pending_since or now
                    probe.idx -= 1
                    self.later.append((now + PENDING_RETRY_S, probe))
                else:
                    probe.pending_since = 0.0
                    self._probe_next(probe, batches, now)
            self._send_probes(batches, now)
            return
        if p.kind == "lease" and isinstance(msg, pm.LeaseReply):
            part: _Load = p.ctx
            d = pm.DIGEST_BYTES
            if len(msg.slots) != len(part.keys) or len(msg.digests) != d * len(part.keys):
                self.count("malformed_replies")
                part.lease = msg.lease
                self._release(part)
                self._load_done(part, [], "bad_reply", now)
                return
            part.lease = msg.lease
            pairs = []
            keys = []
            digests = []
            refused: dict[bytes, str] = {}
            for j, (key, local, remote) in enumerate(zip(part.keys, part.slots, msg.slots)):
                if 0 <= remote:
                    pairs.append((local, remote))
                    keys.append(key)
                    digests.append(msg.digests[j * d : (j + 1) * d])
                else:  # -2: the peer's lease cap is reached now (not a verdict on the key)
                    refused[key] = "busy" if remote == pm.LEASE_BUSY else "missing"
            part.refused = refused
            if not pairs:
                self._release(part)
                self._load_done(part, [], refused, now)
                return
            # The lease may end ttl_s after the server granted it, which was after we asked:
            # reckoned from when we asked (part.t0), less a margin, the read must be over.
            not_after = part.t0 + msg.ttl_s - lease_margin_s(msg.ttl_s)
            deadline_s = min(self.transfer_deadline_s, not_after - now)
            if deadline_s <= 0:
                self.count("lease_expiries")
                self._release(part)
                self._load_done(part, [], {**refused, **dict.fromkeys(keys, LEASE_EXPIRED)}, now)
                return
            part.ok = keys
            try:
                part.tid = self.transfers.read(
                    link.worker_name, pairs, deadline_s, b"".join(digests), not_after
                )
            except ValueError as e:  # e.g. a slot outside the peer's arena: nothing was sent
                self.count("malformed_replies")
                log.warning("p2p: peer %s leased slots that cannot be read: %s", link.addr, e)
                self._release(part)
                self._load_done(part, [], "bad_reply", now)
                return
            self.loads[part.tid] = part
            return
        if p.kind == "offer" and isinstance(msg, pm.OfferReply):
            job_id, keys, _slots, gid, until = p.ctx
            if len(msg.accepted) != len(keys) or not any(msg.accepted):
                reason = "bad_reply" if len(msg.accepted) != len(keys) else "refused"
                self.pushes.pop(job_id, None)
                self._end_push(gid, PushDone(job_id, None, [], dict.fromkeys(keys, reason)))
                return
            # wait for Pulled (the receiver reads our slots); the job keeps them pinned meanwhile
            self.pushes[job_id] = (link, keys, until, gid)
            return
        self.count("malformed_replies")
        self._on_unanswered(link, p, now)

    def _on_unanswered(self, link: PeerLink, p: _Pending, now: float) -> None:
        """A request of ``link`` got no (usable) answer: its peer is down or too slow."""
        if p.kind == "lookup":
            batches: dict[str, list[_Probe]] = {}
            for probe in p.ctx:
                self._probe_next(probe, batches, now)
            self._send_probes(batches, now)
        elif p.kind == "lease":
            self._load_done(p.ctx, [], "peer_down" if link.state == "down" else "timeout", now)
        elif p.kind == "offer":
            job_id, keys, _slots, gid, _until = p.ctx
            self._end_push(gid, PushDone(job_id, None, [], dict.fromkeys(keys, "timeout")))

    def _on_pulled(self, link: PeerLink, msg: pm.Pulled) -> None:
        """The receiver of our offer has read it: the push job ends."""
        push = self.pushes.get(msg.lease)
        if push is None or push[0] is not link:  # not an offer to this peer: it stays
            self.count("unknown_replies")
            return
        del self.pushes[msg.lease]
        _, keys, _, gid = push
        if len(msg.ok) != len(keys):
            self.count("malformed_replies")
            self._end_push(gid, PushDone(msg.lease, None, [], dict.fromkeys(keys, "bad_reply")))
            return
        ok = [k for k, b in zip(keys, msg.ok) if b]
        failed = {k: "refused" for k, b in zip(keys, msg.ok) if not b}
        self.stat(link.addr, "push_chunks", len(ok))
        self.stat(link.addr, "push_bytes", len(ok) * self.transfers.row_bytes)
        self._end_push(gid, PushDone(msg.lease, link.addr, ok, failed))

    # -- loads and pushes -----------------------------------------------------------------------

    def _start_load(self, cmd: Load, now: float) -> None:
        keys, slots = cmd.keys, cmd.slots
        link = self._link(cmd.peer, now)
        n = LEASE_CHUNKS
        group = _LoadGroup(cmd.job_id, (len(keys) + n - 1) // n, now)
        for i in range(0, len(keys), n):
            part = _Load(group, keys[i : i + n], slots[i : i + n], cmd.kv_request_id, link, now)
            if link.state == "down":
                self._load_done(part, [], "peer_down", now)
            elif (
                link.inflight_chunks + len(part.keys) > MAX_INFLIGHT_CHUNKS and link.inflight_chunks
            ):
                link.waiting_loads.append(part)
            else:
                self._send_lease(part, now)

    def _send_lease(self, part: _Load, now: float) -> None:
        part.sent = True
        part.link.inflight_chunks += len(part.keys)
        part.t0 = now
        lease = pm.Lease(
            req=0, keys=part.keys, ttl_s=self.lease_ttl_s, kv_request_id=part.kv_request_id
        )
        self._request(part.link, lease, "lease", part, now)

    def _release(self, part: _Load) -> None:
        if part.lease >= 0 and part.link.state == "up":
            self._send(part.link, pm.Release(lease=part.lease))
        part.lease = -1

    def _load_done(
        self, part: _Load, ok: list[bytes], failed: str | dict[bytes, str], now: float
    ) -> None:
        """A part ended: ``ok`` its keys now in host slots; every other key failed, with the
        reason ``failed`` names for it (one reason for all, or per key)."""
        ok_set = set(ok)
        if isinstance(failed, str):
            why = {k: failed for k in part.keys if k not in ok_set}
        else:
            why = {k: failed.get(k, "transfer_failed") for k in part.keys if k not in ok_set}
        link = part.link
        nbytes = len(ok) * self.transfers.row_bytes
        peer = link.addr
        self.stat(peer, "load_bytes", nbytes)
        self.stat(peer, "load_chunks", len(ok))
        if why:
            self.stat(peer, "load_failed_chunks", len(why))
        if ok:
            self.latencies.append((link.label, now - part.t0))
        group = part.group
        group.ok.extend(ok)
        group.failed.update(why)
        group.nbytes += nbytes
        group.remaining -= 1
        if group.remaining == 0:
            self.results.append(
                LoadDone(group.job_id, group.ok, group.failed, group.nbytes, now - group.t0)
            )
        if part.sent:  # it counted in flight (a part that failed before leaving did not)
            part.sent = False
            link.inflight_chunks -= len(part.keys)
        while link.waiting_loads and link.up:
            nxt = link.waiting_loads[0]
            if link.inflight_chunks and link.inflight_chunks + len(nxt.keys) > MAX_INFLIGHT_CHUNKS:
                break
            link.waiting_loads.popleft()
            self._send_lease(nxt, now)

    def _start_push(self, job_id: int, keys: list[bytes], slots: list[int], now: float) -> None:
        best = None
        for link in self.links.values():
            if (
                link.up
                and link.free_quota > 0
                and (best is None or link.free_quota > best.free_quota)
            ):
                best = link
        if best is None:
            self.results.append(PushDone(job_id, None, [], dict.fromkeys(keys, "no_peer")))
            return
        best.free_quota -= len(keys)
        until = now + self.lease_ttl_s
        try:
            gid = self.transfers.grant(best.data_token, slots, until)
        except ValueError as e:  # slots our own worker would not grant: nothing was offered
            log.warning("p2p: a push's slots could not be granted: %s", e)
            self.results.append(PushDone(job_id, None, [], dict.fromkeys(keys, "rejected")))
            return
        self.push_grants[gid] = (job_id, best, keys, slots, until)
