"""The p2p tier's node thread: every ZMQ socket of the tier, both roles, one thread.

::

    engine thread (P2PTier) ──commands (deque + wake-up fd)──▶ PeerNode thread ──results (deque)──▶ engine
                                                                │
        serving role: ROUTER on host:port ──▶ PeerServer.handle (host tier under TieringManager.lock)
        client role:  one DEALER per peer (PeerLink: handshake, heartbeats, lookups, leases, offers)
        bytes:        PeerWorkerHandle (the peer worker process: reads of leased slots, pulls of offers)

The engine thread never touches a socket; the node never touches engine-thread state. What crosses is
plain tuples in two :class:`collections.deque` (appends and pops are atomic), so the engine's calls
stay microseconds-cheap whatever the peers do.

Liveness: a link heartbeats every ``heartbeat_s``; a peer that has not been heard from for
``peer_timeout_s`` (or whose handshake does not finish within it) is down at once: its outstanding
lookups answer "not there", its loads fail, its transfers are cancelled in the worker, the engine
is told (locations and verdicts naming it are dropped), and the link reconnects with backoff (0.5 s
doubling up to 10 s). A peer that comes back with a new incarnation is a new peer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

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

    def __init__(self, job_id: int, parts: int):
        self.job_id = job_id
        self.remaining = parts
        self.ok: list[bytes] = []
        self.failed: dict[bytes, str] = {}
        self.nbytes = 0
        self.t0 = time.monotonic()


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
        self, group: _LoadGroup, keys: list[bytes], slots: list[int], kvr: str, link: PeerLink
    ):
        self.group = group
        self.keys = keys
        self.slots = slots
        self.kv_request_id = kvr
        self.lease = -1
        self.tid = -1
        self.ok: list[bytes] = []
        self.refused: dict[bytes, str] = {}  # keys the peer would not lease, and why
        self.t0 = time.monotonic()
        self.link = link
        self.sent = False


class PeerLink:
    """The client role towards one peer (``host:port``): one DEALER socket, its handshake state,
    its outstanding requests. Used only by the node thread."""

    def __init__(self, node: PeerNode, addr: str):
        self.node = node
        self.addr = addr
        self.host, self.port = parse_peer(addr, "peer")
        self.sock: zmq.Socket | None = None
        self.state = "down"  # down -> hello -> auth -> up
        self.retry_at = 0.0
        self.backoff = 0.0
        self.nonce = b""
        self.peer_incarnation = b""
        self.worker_name = ""  # the peer's name in our worker's transport (per incarnation)
        self.last_heard = 0.0
        self.next_heartbeat = 0.0
        self.since = 0.0  # when the current handshake started
        self.free_quota = 0
        self.pending: dict[int, _Pending] = {}
        self.queued: list[pm.PeerMessage] = []  # sent once up
        self.inflight_chunks = 0  # chunks of load parts sent and not yet done
        self.waiting_loads: deque[_Load] = deque()  # parts held back by MAX_INFLIGHT_CHUNKS
        self.connects = 0

    @property
    def up(self) -> bool:
        """True once authenticated, and until the peer is noticed down."""
        return self.state == "up"

    def connect(self, now: float) -> None:
        """Open a fresh socket and say Hello (the previous socket, if any, is closed)."""
        node = self.node
        if node.worker.descriptor is None:
            self.retry_at = now + 0.05  # our worker has not said hello yet: nothing to offer
            return
        self.close_socket()
        s = node.ctx.socket(zmq.DEALER)
        self.connects += 1
        s.setsockopt(zmq.ROUTING_ID, node.incarnation + self.connects.to_bytes(4, "little"))
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, pm.MAX_MESSAGE_BYTES)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.connect(f"tcp://{self.host}:{self.port}")
        self.sock = s
        node.poller.register(s, zmq.POLLIN)
        node.sock_links[s] = self
        self.nonce = os.urandom(pm.NONCE_BYTES)
        self.state = "hello"
        self.since = now
        self.last_heard = now
        self._send_now(
            pm.Hello(
                version=pm.PROTOCOL_VERSION,
                incarnation=node.incarnation,
                advertise=node.advertise,
                namespace_id=node.namespace_id,
                nonce=self.nonce,
            )
        )

    def close_socket(self) -> None:
        """Close this link's socket (unsent messages are dropped: LINGER 0)."""
        s = self.sock
        if s is not None:
            self.node.poller.unregister(s)
            self.node.sock_links.pop(s, None)
            s.close(linger=0)
            self.sock = None

    def _send_now(self, msg: pm.PeerMessage) -> None:
        s = self.sock
        if s is None:
            return
        try:
            s.send(pm.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the send queue is full: the request's deadline handles it

    def send(self, msg: pm.PeerMessage) -> None:
        """Send now when up, else once the handshake ends (or never, when it fails)."""
        if self.state == "up":
            self._send_now(msg)
        else:
            self.queued.append(msg)

    def request(self, msg: Any, kind: str, ctx: Any, now: float) -> None:
        """Send a request with a ``req`` field and remember what its answer is for."""
        node = self.node
        node.next_req += 1
        msg.req = node.next_req
        self.pending[msg.req] = _Pending(kind, ctx, now + node.peer_timeout_s)
        self.send(msg)

    def on_frame(self, frame: bytes, now: float) -> None:
        """One message from the peer."""
        node = self.node
        try:
            msg = pm.decode(frame)
        except pm.BadMessage as e:
            node.count("malformed_replies")
            log.warning("p2p: malformed message from peer %s: %s", self.addr, e)
            return
        self.last_heard = now
        if self.state == "hello":
            if not isinstance(msg, pm.Challenge):
                self.fail(now, f"answered Hello with {type(msg).__name__}")
                return
            expect = pm.mac(node.secret, "server", *self._mac_parts(msg.incarnation, msg.nonce))
            if node.secret and not pm.mac_ok(expect, msg.mac):
                node.count("refused_bad_mac")
                self.fail(now, "its Challenge does not prove the shared secret")
                return
            if self.peer_incarnation and self.peer_incarnation != msg.incarnation:
                node.peer_restarted(self)  # a new instance at that address: forget the old one
            self.peer_incarnation = msg.incarnation
            mine = pm.mac(node.secret, "client", *self._mac_parts(msg.incarnation, msg.nonce))
            self.state = "auth"
            desc = node.worker.descriptor
            self._send_now(pm.Auth(mac=mine, descriptor=desc or b""))
            return
        if self.state == "auth":
            if isinstance(msg, pm.Welcome):
                try:
                    self.worker_name = node.acquire_peer(msg.descriptor)
                except Exception as e:  # a descriptor our transport cannot use
                    self.fail(now, f"its transport descriptor is unusable: {e}")
                    return
                self.state = "up"
                self.backoff = 0.0
                if node.locations is not None:  # it serves our namespace: trust its events
                    node.locations.confirm_peer(self.addr)
                self.free_quota = msg.quota_chunks
                self.next_heartbeat = now + node.heartbeat_s
                log.info("p2p: peer %s is up", self.addr)
                queued, self.queued = self.queued, []
                for q in queued:
                    self._send_now(q)
                return
            reason = msg.reason if isinstance(msg, pm.Refused) else type(msg).__name__
            if reason == "not_ready":  # its peer worker is still starting: try again soon
                self.fail(now, "its peer worker is starting", retry_s=BACKOFF_NOT_READY_S)
            else:
                self.fail(now, f"refused the session: {reason}")
            return
        # up
        if isinstance(msg, pm.HeartbeatAck):
            self.free_quota = msg.free_quota
            return
        if isinstance(msg, pm.Heartbeat):
            self.free_quota = msg.free_quota
            self._send_now(pm.HeartbeatAck(seq=msg.seq, free_quota=node.server_free_quota()))
            return
        if isinstance(msg, pm.Pulled):
            node.on_pulled(self, msg, now)
            return
        if isinstance(msg, pm.Refused):
            node.count("refused_by_peer")
            log.warning("p2p: peer %s refused a message: %s", self.addr, msg.reason)
            self.fail(now, f"refused: {msg.reason}")
            return
        req = getattr(msg, "req", None)
        p = self.pending.pop(req, None) if req is not None else None
        if p is None:
            node.count("unknown_replies")
            return
        node.on_reply(self, p, msg, now)

    def _mac_parts(self, server_incarnation: bytes, server_nonce: bytes) -> tuple[bytes, ...]:
        node = self.node
        return (
            self.nonce,
            server_nonce,
            node.incarnation,
            server_incarnation,
            node.namespace_id.encode(),
        )

    def tick(self, now: float) -> None:
        """Timers: reconnect, handshake deadline, heartbeats, silence, request deadlines."""
        node = self.node
        if self.state == "down":
            if now >= self.retry_at:
                self.connect(now)
            return
        if self.state != "up":
            if now - self.since > node.peer_timeout_s:
                self.fail(now, "the handshake did not finish in time")
            return
        if now - self.last_heard > node.peer_timeout_s:
            self.fail(now, f"silent for {now - self.last_heard:.1f} s")
            return
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + node.heartbeat_s
            node.heartbeat_seq += 1
            self._send_now(
                pm.Heartbeat(seq=node.heartbeat_seq, free_quota=node.server_free_quota())
            )
        expired = [r for r, p in self.pending.items() if p.deadline <= now]
        for r in expired:
            node.on_unanswered(self, self.pending.pop(r), now)

    def fail(self, now: float, why: str, retry_s: float | None = None) -> None:
        """The peer is down: fail everything outstanding, tell the engine, reconnect later
        (after ``retry_s``, or with the link's backoff)."""
        node = self.node
        if retry_s is None:
            log.warning("p2p: peer %s is down: %s", self.addr, why)
            self.backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self.backoff * 2))
            retry_s = self.backoff
        else:
            log.info("p2p: peer %s: %s", self.addr, why)
        node.count("peer_down")
        self.state = "down"
        self.close_socket()
        self.retry_at = now + retry_s
        pending, self.pending = self.pending, {}
        for p in pending.values():
            node.on_unanswered(self, p, now)
        waiting, self.waiting_loads = self.waiting_loads, deque()
        for part in waiting:
            node._load_done(part, [], "peer_down")
        self.queued = []
        node.link_down(self, now)


class PeerNode(threading.Thread):
    """The node thread of one p2p tier (see the module docstring).

    Args:
        ctx: the tier's ZMQ context.
        server: the serving role (:class:`kvoffload.tiers.p2p.server.PeerServer`), or None.
        worker: the :class:`kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle`.
        bind: ``tcp://host:port`` of the serving ROUTER.
        advertise: ``host:port`` peers reach this instance at.
        incarnation: 16 random bytes, this start's identity.
        namespace_id: hex id of the namespace the sessions read.
        secret: the shared secret (bytes; empty with ``auth: none``).
        heartbeat_s, peer_timeout_s, transfer_deadline_s, lease_ttl_s: seconds.
        count: ``count(counter, n=1)`` of the tier (thread-safe for distinct names: dict updates).
    """

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        server: Any,
        worker: Any,
        bind: str,
        advertise: str,
        incarnation: bytes,
        namespace_id: str,
        secret: bytes,
        heartbeat_s: float,
        peer_timeout_s: float,
        transfer_deadline_s: float,
        lease_ttl_s: float,
        count: Callable[..., None],
        server_free_quota: Callable[[], int],
        locations: Any = None,
    ):
        super().__init__(name="kvoffload-p2p-node", daemon=True)
        self.ctx = ctx
        self.server = server
        self.worker = worker
        self.advertise = advertise
        self.incarnation = incarnation
        self.namespace_id = namespace_id
        self.secret = secret
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.transfer_deadline_s = transfer_deadline_s
        self.lease_ttl_s = lease_ttl_s
        self.count = count
        self.server_free_quota = server_free_quota
        self.commands: deque[Command] = deque()
        self.results: deque[Result] = deque()
        self.links: dict[str, PeerLink] = {}
        self.sock_links: dict[zmq.Socket, PeerLink] = {}
        self.next_req = 0
        self.heartbeat_seq = 0
        self.loads: dict[int, _Load] = {}  # transfer id -> load part
        # transfer id -> (client identity, lease, pairs, worker peer name): pulls of admitted offers
        self.pulls: dict[int, tuple[bytes, int, int, str]] = {}
        self._agents: dict[str, int] = {}  # worker peer name -> links and pulls using it
        self.server_counters: dict[str, int] = {}  # the server's counters, as of the last tick
        self._counters_at = 0.0
        self.pushes: dict[int, tuple[PeerLink, list[bytes], float]] = {}  # job id -> offer
        self.later: list[tuple[float, _Probe]] = []  # probes to send again at a time
        # Per-peer statistics, written by this thread only, read by scrapes (P2PTier.report_metrics):
        # (peer label, statistic) -> total; load latencies (peer label, seconds) until taken.
        self.peer_stats: dict[tuple[str, str], float] = {}
        self.latencies: deque[tuple[str, float]] = deque(maxlen=65536)
        self._labels: dict[str, str] = {}
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, pm.MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self.router.bind(bind)
        except zmq.ZMQError:
            self.router.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self.bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.locations = locations  # PeerLocations, owned by this thread once it starts
        if locations is not None:
            locations.register(self.poller)
        self._worker_fd: int | None = None
        self._restart_at = 0.0
        self.error: BaseException | None = None

    def label(self, peer: str) -> str:
        """The ``peer`` label value of ``peer`` in metrics."""
        label = self._labels.get(peer)
        if label is None:
            # bounded cardinality: the first MAX_PEER_LABELS peers by name, the rest as "other"
            label = peer if len(self._labels) < MAX_PEER_LABELS else "other"
            self._labels[peer] = label
        return label

    def stat(self, peer: str, what: str, n: float = 1) -> None:
        """Add ``n`` to a per-peer statistic (node thread)."""
        k = (self.label(peer), what)
        self.peer_stats[k] = self.peer_stats.get(k, 0) + n

    # -- engine thread side ------------------------------------------------------------------------

    def submit(self, cmd: Command) -> None:
        """Queue a command for the node thread (engine thread; never blocks)."""
        self.commands.append(cmd)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and close its sockets (engine thread)."""
        self._stopping = True
        self._wake()
        if self.is_alive():
            self.join(timeout_s)

    # -- the thread --------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`."""
        try:
            self._loop()
        except BaseException as e:  # the tier reports it; peers see us go silent
            self.error = e
            log.exception("p2p: the node thread stopped on an error")
        finally:
            for link in list(self.links.values()):
                link.close_socket()
            if self.locations is not None:
                self.locations.close()
            self.router.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _loop(self) -> None:
        poller = self.poller
        while not self._stopping:
            fd = self._worker_fileno()
            if fd != self._worker_fd:
                if self._worker_fd is not None:
                    poller.unregister(self._worker_fd)
                if fd is not None:
                    poller.register(fd, zmq.POLLIN)
                self._worker_fd = fd
            events = dict(poller.poll(self._timeout_ms()))
            now = time.monotonic()
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self.locations is not None:
                self.locations.poll()
            self._commands(now)
            if self.router in events:
                self._serve(now)
            for s, link in list(self.sock_links.items()):
                if s in events:
                    self._drain_link(s, link, now)
            self._worker_events(now)
            self._tick(now)

    def _drain_link(self, s: zmq.Socket, link: PeerLink, now: float) -> None:
        for _ in range(1000):
            try:
                frame = s.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            link.on_frame(frame, now)
            if link.sock is not s:  # the link failed and closed this socket
                return

    def _worker_fileno(self) -> int | None:
        try:
            return self.worker.fileno()
        except Exception:
            return None

    def _timeout_ms(self) -> int:
        # timers are coarse (heartbeats, deadlines): 20 ms granularity is plenty
        return 20

    def _commands(self, now: float) -> None:
        cmds = self.commands
        batches: dict[str, list[_Probe]] = {}
        while cmds:
            cmd = cmds.popleft()
            match cmd:
                case Probe():
                    peers = cmd.head
                    if cmd.tail is not None:
                        where = self.locations.where if self.locations is not None else None
                        located = where(cmd.key) if where is not None else ()
                        peers = tuple(dict.fromkeys((*cmd.head, *located, *cmd.tail)))
                    self._probe_next(_Probe(cmd.key, peers, now), batches, now)
                case Load():
                    self._start_load(
                        cmd.job_id, cmd.peer, cmd.keys, cmd.slots, cmd.kv_request_id, now
                    )
                case Push():
                    self._start_push(cmd.job_id, cmd.keys, cmd.slots, now)
                case Connect():
                    self.link(cmd.peer, now)
        self._send_probes(batches, now)

    def _send_probes(self, batches: dict[str, list[_Probe]], now: float) -> None:
        for addr, probes in batches.items():
            link = self.links[addr]
            for i in range(0, len(probes), pm.MAX_KEYS):
                batch = probes[i : i + pm.MAX_KEYS]
                keys = [p.key for p in batch]
                link.request(pm.Lookup(req=0, keys=keys), "lookup", batch, now)

    def link(self, addr: str, now: float) -> PeerLink:
        """The link to ``addr``, opened on first use."""
        link = self.links.get(addr)
        if link is None:
            link = self.links[addr] = PeerLink(self, addr)
            link.connect(now)
        return link

    def _probe_next(self, probe: _Probe, batches: dict[str, list[_Probe]], now: float) -> None:
        """Ask the probe's next peer that is not down; none left: the key is nowhere."""
        peers = probe.peers
        while probe.idx < len(peers):
            addr = peers[probe.idx]
            probe.idx += 1
            link = self.link(addr, now)
            if link.state == "down":
                continue
            probe.since = now
            batches.setdefault(addr, []).append(probe)
            return
        self.results.append(Verdict(probe.key, None))

    # -- serving role ---------------------------------------------------------------------------

    def _serve(self, now: float) -> None:
        router = self.router
        server = self.server
        for _ in range(1000):
            try:
                parts = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(parts) != 2:
                self.count("refused_malformed")
                continue
            ident, frame = parts
            if server is None:
                continue
            for to, out in server.handle(ident, frame, now):
                self._route(to, out)

    def _route(self, ident: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.count("unsent_replies")

    def pull(self, ident: bytes, descriptor: bytes, lease: int, pairs: list[tuple[int, int]]):
        """The serving role admitted an offer: read the pusher's leased slots into ours."""
        try:
            name = self.acquire_peer(descriptor)
        except Exception as e:
            log.warning("p2p: cannot pull an offer from a peer: %s", e)
            raise  # the server frees the admitted slots and answers the offer as not accepted
        tid = self.worker.read(name, pairs, self.transfer_deadline_s)
        self.pulls[tid] = (ident, lease, len(pairs), name)

    def acquire_peer(self, descriptor: bytes) -> str:
        """The worker's name for the instance behind ``descriptor``, added on first use. One name
        per remote agent, counted: a link and pulls from the same instance share it.

        Raises:
            TransportError, ValueError: a descriptor the worker cannot use.
        """
        name = "peer#" + hashlib.blake2b(descriptor, digest_size=8).hexdigest()
        n = self._agents.get(name, 0)
        if n == 0:
            self.worker.add_peer(name, descriptor)
        self._agents[name] = n + 1
        return name

    def release_peer(self, name: str) -> None:
        """One user of ``name`` is done; the last removes it from the worker (its transfers
        settle failed)."""
        n = self._agents.get(name, 0)
        if n <= 1:
            if self._agents.pop(name, None) is not None:
                self.worker.remove_peer(name)
        else:
            self._agents[name] = n - 1

    # -- client role: replies -------------------------------------------------------------------

    def on_reply(self, link: PeerLink, p: _Pending, msg: Any, now: float) -> None:
        """A reply to one of ``link``'s requests."""
        if p.kind == "lookup" and isinstance(msg, pm.LookupReply):
            probes: list[_Probe] = p.ctx
            if len(msg.states) != len(probes):
                self.count("malformed_replies")
                self.on_unanswered(link, p, now)
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
            if len(msg.slots) != len(part.keys):
                self.count("malformed_replies")
                self._load_done(part, [], "bad_reply")
                return
            part.lease = msg.lease
            pairs = []
            keys = []
            refused: dict[bytes, str] = {}
            for key, local, remote in zip(part.keys, part.slots, msg.slots):
                if 0 <= remote:
                    pairs.append((local, remote))
                    keys.append(key)
                else:  # -2: the peer's lease cap is reached now (not a verdict on the key)
                    refused[key] = "busy" if remote == pm.LEASE_BUSY else "missing"
            part.refused = refused
            if not pairs:
                self._release(part)
                self._load_done(part, [], refused)
                return
            part.ok = keys
            part.tid = self.worker.read(link.worker_name, pairs, self.transfer_deadline_s)
            self.loads[part.tid] = part
            return
        if p.kind == "offer" and isinstance(msg, pm.OfferReply):
            job_id, keys, slots = p.ctx
            if len(msg.accepted) != len(keys) or not any(msg.accepted):
                reason = "bad_reply" if len(msg.accepted) != len(keys) else "refused"
                self.pushes.pop(job_id, None)
                self.results.append(PushDone(job_id, None, [], dict.fromkeys(keys, reason)))
                return
            # wait for Pulled (the receiver reads our slots); the job keeps them pinned meanwhile
            self.pushes[job_id] = (link, keys, now + self.lease_ttl_s)
            return
        self.count("malformed_replies")
        self.on_unanswered(link, p, now)

    def on_unanswered(self, link: PeerLink, p: _Pending, now: float) -> None:
        """A request of ``link`` got no (usable) answer: its peer is down or too slow."""
        if p.kind == "lookup":
            batches: dict[str, list[_Probe]] = {}
            for probe in p.ctx:
                self._probe_next(probe, batches, now)
            self._send_probes(batches, now)
        elif p.kind == "lease":
            self._load_done(p.ctx, [], "peer_down" if link.state == "down" else "timeout")
        elif p.kind == "offer":
            job_id, keys, _slots = p.ctx
            self.results.append(PushDone(job_id, None, [], dict.fromkeys(keys, "timeout")))

    def on_pulled(self, link: PeerLink, msg: pm.Pulled, now: float) -> None:
        """The receiver of our offer has read it: the push job ends."""
        push = self.pushes.pop(msg.lease, None)
        if push is None or push[0] is not link:
            self.count("unknown_replies")
            return
        _, keys, _ = push
        if len(msg.ok) != len(keys):
            self.count("malformed_replies")
            self.results.append(PushDone(msg.lease, None, [], dict.fromkeys(keys, "bad_reply")))
            return
        ok = [k for k, b in zip(keys, msg.ok) if b]
        failed = {k: "refused" for k, b in zip(keys, msg.ok) if not b}
        self.stat(link.addr, "push_chunks", len(ok))
        self.stat(link.addr, "push_bytes", len(ok) * self.worker.row_bytes)
        self.results.append(PushDone(msg.lease, link.addr, ok, failed))

    # -- client role: jobs ----------------------------------------------------------------------

    def _start_load(
        self, job_id: int, addr: str, keys: list[bytes], slots: list[int], kvr: str, now: float
    ) -> None:
        link = self.link(addr, now)
        n = LEASE_CHUNKS
        group = _LoadGroup(job_id, (len(keys) + n - 1) // n)
        for i in range(0, len(keys), n):
            part = _Load(group, keys[i : i + n], slots[i : i + n], kvr, link)
            if link.state == "down":
                self._load_done(part, [], "peer_down")
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
        part.link.request(
            pm.Lease(
                req=0, keys=part.keys, ttl_s=self.lease_ttl_s, kv_request_id=part.kv_request_id
            ),
            "lease",
            part,
            now,
        )

    def _release(self, part: _Load) -> None:
        if part.lease >= 0 and part.link.state == "up":
            part.link.send(pm.Release(lease=part.lease))
        part.lease = -1

    def _load_done(self, part: _Load, ok: list[bytes], failed: str | dict[bytes, str]) -> None:
        """A part ended: ``ok`` its keys now in host slots; every other key failed, with the
        reason ``failed`` names for it (one reason for all, or per key)."""
        ok_set = set(ok)
        if isinstance(failed, str):
            why = {k: failed for k in part.keys if k not in ok_set}
        else:
            why = {k: failed.get(k, "transfer_failed") for k in part.keys if k not in ok_set}
        link = part.link
        nbytes = len(ok) * self.worker.row_bytes
        peer = link.addr
        self.stat(peer, "load_bytes", nbytes)
        self.stat(peer, "load_chunks", len(ok))
        if why:
            self.stat(peer, "load_failed_chunks", len(why))
        now = time.monotonic()
        if ok:
            self.latencies.append((self.label(peer), now - part.t0))
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
        best.request(
            pm.Offer(req=0, keys=keys, lease=job_id, slots=slots),
            "offer",
            (job_id, keys, slots),
            now,
        )

    # -- worker -------------------------------------------------------------------------------

    def _worker_events(self, now: float) -> None:
        worker = self.worker
        results = worker.poll()
        for name, err in worker.take_peer_errors():
            for link in list(self.links.values()):
                if link.worker_name == name and link.state != "down":
                    link.fail(now, f"the peer worker refused its descriptor: {err}")
        if not worker.alive and now >= self._restart_at:
            # Our worker died (its transfers were reported failed above, after it exited): start
            # a new one; its descriptor is new, so every session starts again (peers learn it).
            self.count("worker_restarts")
            log.warning("p2p: the peer worker died; restarting it")
            self._restart_at = now + 1.0
            worker.restart()
            self._agents.clear()  # the new worker knows no peer
            for link in list(self.links.values()):
                if link.state != "down":
                    link.fail(now, "our peer worker restarted")
                link.retry_at = now
            if self.server is not None:
                self.server.close()  # peers hold our old descriptor: their sessions start again
        self._settled(results, now)

    def _settled(self, results: list, now: float) -> None:
        for tid, state, reason in results:
            done = state.name == "DONE"
            part = self.loads.pop(tid, None)
            if part is not None:
                self._release(part)
                if done:
                    self._load_done(part, part.ok, part.refused)
                else:
                    self.count("transfer_failures")
                    self._load_done(part, [], reason or "transfer_failed")
                    # The transport marks a peer down on any failed transfer (its connection
                    # state is unknown): the session goes down with it and starts again.
                    if part.link.up and reason != "worker_died":
                        part.link.fail(now, f"a transfer failed: {reason}")
                continue
            pull = self.pulls.pop(tid, None)
            if pull is not None and self.server is not None:
                ident, lease, n, name = pull
                self.release_peer(name)
                for to, out in self.server.pull_settled(ident, lease, [done] * n):
                    self._route(to, out)

    # -- timers -------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.later:
            due = [p for t, p in self.later if t <= now]
            if due:
                self.later = [(t, p) for t, p in self.later if t > now]
                batches: dict[str, list[_Probe]] = {}
                for probe in due:
                    self._probe_next(probe, batches, now)
                self._send_probes(batches, now)
        for link in list(self.links.values()):
            link.tick(now)
        for job_id, (_link, keys, deadline) in list(self.pushes.items()):
            if deadline <= now:
                # The receiver never said it pulled: its reads (deadline far shorter than this)
                # are over, so the slots can go back.
                del self.pushes[job_id]
                self.results.append(PushDone(job_id, None, [], dict.fromkeys(keys, "timeout")))
        if self.server is not None:
            for to, out in self.server.tick(now):
                self._route(to, out)
            if now >= self._counters_at:
                self._counters_at = now + 0.25
                self.server_counters = self.server.counters

    # -- liveness -----------------------------------------------------------------------------

    def link_down(self, link: PeerLink, now: float) -> None:
        """``link``'s peer is down: cancel its transfers, fail its pushes, tell the engine."""
        if link.worker_name:
            name, link.worker_name = link.worker_name, ""
            try:
                self.release_peer(name)  # its transfers settle failed
            except Exception:
                log.exception("p2p: removing peer %s from the worker failed", link.addr)
        # Pushes to it keep their pins until their deadline: the receiver's reads may still run.
        self.results.append(PeerDown(link.addr))

    def peer_restarted(self, link: PeerLink) -> None:
        """``link``'s address answers with a new incarnation: drop what we knew of the old one."""
        self.count("peer_restarts")
        if self.locations is not None:
            self.locations.drop_peer(link.addr)
        self.results.append(PeerDown(link.addr))
