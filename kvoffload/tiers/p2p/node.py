"""The p2p tier's node thread: its sockets, its poll loop, and the wiring of its roles and worker.

::

    engine thread (P2PTier)
      │ submit(Command): deque + a byte on the wake-up pipe          ▲ results: deque (Result)
      ▼                                                              │
    PeerNode thread ── poll(router, peers' DEALERs, wake-up pipe, worker fd, event feeds, ZAP,
      │                     the router's monitor; 20 ms)
      │  commands ───────────────▶ PeerClient.commands ──┐
      │  a peer's DEALER frame ──▶ PeerClient.on_frame ──┼──▶ [Send | Open | Close | Trusted |
      │  every loop ─────────────▶ PeerClient.tick ──────┘     Restarted] applied here, in order
      │  ROUTER (identity, frame) ▶ PeerServer.handle ───────▶ replies sent on the ROUTER
      │  every loop ─────────────▶ PeerServer.tick ──────────▶ replies (timeouts)
      │  worker fd readable ─────▶ PeerWorkerHandle.poll ─────▶ settled reads: a load part's
      │                                                         (PeerClient.transfer_settled) or
      │                                                         an admitted offer's pull
      │                                                         (PeerServer.pull_settled)
      └─ PeerLocations.poll (peers' KV events; the client asks it where a key is)

**Sockets under CurveZMQ** (``auth: secret``). The ROUTER is a CURVE server and every DEALER a
CURVE client, all with the keypair derived from the shared secret
(:func:`~kvoffload.ipc.peer_messages.curve_keypair`); the node itself is the context's ZAP
handler (a REP socket at ``inproc://zeromq.zap.01``, bound before the ROUTER, answered in the
poll loop): it admits a client only when the long-term key it proved is that public key, and
counts every other (``wrong_key``). A peer that does not know the secret completes no ZMQ
handshake, so no frame of it ever reaches the roles, and everything on the control sockets is
encrypted and authenticated end to end (a relay forwards ciphertext it cannot read or alter).

**Before authentication** (C41). The ROUTER's handshake must finish within ``peer_timeout_s``
(``HANDSHAKE_IVL``) and no frame may exceed
:data:`~kvoffload.ipc.peer_messages.MAX_MESSAGE_BYTES` (``MAXMSGSIZE``, checked by ZMQ from a
frame's header, before its body is buffered). The router's monitor tells the node of each
connection accepted (its descriptor) and closed; a connection is *half-open* from its accept until
its first frame reaches the roles (a frame's ``SRCFD``). At most ``max_half_open_per_source``
half-open connections per source address (one beyond is shut down at once: ``shutdown(2)`` on a
duplicate of its descriptor, after checking that it still is that connection to our port; ZMQ then
closes it) and ``max_half_open`` in all (when full, the oldest of the source holding most is shut
down to make room, so a source with few, as an honest peer has, still gets in); a half-open
connection older than the handshake bound is shut down too; each counted by reason
(:attr:`PeerNode.refused_connections`).
ZMQ's own handshake failures (a client without CURVE, a bad CURVE handshake, a replay) are counted
from the monitor. No thread is spent per connection.

**Engine to node.** The engine thread appends a command (:mod:`.commands`) to a deque and writes a
byte to a pipe the poller watches, so the node wakes at once; it never blocks and never touches a
socket. The node hands every queued command to the client role in one call, so probes bound for
one peer share a Lookup.

**Client role** (:mod:`.client`, socket-free). Its outputs are applied here in order: ``Open``
closes the peer's old DEALER and opens a new one (routing id, ``MAXMSGSIZE``, ``LINGER`` 0),
``Send`` sends without blocking (a full queue drops the frame: the request's deadline handles it),
``Close`` closes it, ``Trusted`` and ``Restarted`` confirm or drop the peer in the KV-event
locations. An address ZMQ will not connect to goes back as :meth:`~.client.PeerClient.unreachable`.
Frames read from a DEALER go to the client role until it closes that socket.

**Serving role** (:mod:`.server`, socket-free). Frames from the ROUTER go to
:meth:`~.server.PeerServer.handle`; its replies and those of its ``tick`` go back on the ROUTER.
When it admits an offer it asks :meth:`PeerNode.pull` to READ the pusher's slots.

**Peer worker** (:mod:`.worker_handle`). Both roles use one worker through :class:`WorkerPort`,
which names each remote agent once per session token (counted: a session and pulls on it share
it). Settled transfers go to the role that started them, and so do answered grants and
revocations (the serving role's leases, the client role's pushes); a refused descriptor fails the
sessions using it; a dead worker is restarted (at most once a second), after which every session
and the serving role's sessions start again (our descriptor changed). The worker's data-plane
refusals are counted with the serving role's, as ``refused.data_<reason>``.

**Node to engine.** Results (:mod:`.commands`) go into a deque the engine drains on its next
lookup or step: verdicts, load and push results and peers down from the client role, fetched
leases from the serving role.

An error that escapes the loop ends the thread (logged, kept in :attr:`PeerNode.error`); its
sockets close with it, and :meth:`PeerNode.stop` still ends the rest.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq
from zmq.utils import z85

from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.p2p.client import (
    Close,
    Open,
    Out,
    PeerClient,
    Restarted,
    Send,
    Trusted,
    lease_margin_s,
)
from kvoffload.tiers.p2p.commands import Command, Result

log = logging.getLogger("kvoffload.p2p")

POLL_MS = 20
"""The poll loop's longest wait: timers (heartbeats, deadlines) are coarse, 20 ms is plenty."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where ZMQ asks a context's ZAP handler (RFC 27)."""
ZAP_DOMAIN = b"kvoffload-p2p"
REFUSED_CONNECTIONS = (
    "per_source",
    "total",
    "handshake_timeout",
    "wrong_key",
    "mechanism",
    "handshake_failed",
)
"""Why the node refused or closed a connection to its control port before authentication: more
half-open connections from its source than allowed, more half-open in all, half-open past the
handshake bound, a CURVE key that is not the shared secret's (ZAP), no CURVE (or another
mechanism), a failed ZMQ handshake (bad CURVE messages, a replay, a frame over the limit)."""
_MONITOR_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class SwitchInterval:
    """The interpreter's thread switch interval (:func:`sys.setswitchinterval`, seconds), lowered
    while at least one p2p tier of the process holds it, and given back when the last lets go.

    Why: the node thread needs the GIL for every hop of a load (the lease's reply, the READ handed
    to the worker, its settlement); while vLLM's scheduler thread runs pure-Python steps it gets
    the GIL only when the holder is made to drop it, after the switch interval (CPython's 5 ms
    by default), so each hop waited up to 5 ms and loads crawled while the scheduler was busy:
    at 256 KiB with 2 ms steps, 0.16-0.39 GB/s (every load submitted at once) and 0.19-0.25 (one
    a step), against 0.58-2.04 and 0.32-0.41 at 0.5 ms (BENCHMARKS §9b).
    A lower interval costs only when threads contend for the GIL (a thread that waits for it asks
    the holder to drop it sooner); an idle node thread waits in poll(2) without it.

    The lowest interval held wins, never above the one the process had (a host that lowered it
    keeps its own); one set by someone else while held is kept, and given back to at the end.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[int] = []  # the holders' intervals (µs)
        self._before = 0  # the process's interval when the first holder came, or set since (µs)
        self._seen = 0  # the interval as this object last left it (µs)

    def hold(self, seconds: float) -> None:
        """Lower the interval to at most ``seconds`` (> 0) until :meth:`release` (seconds)."""
        with self._lock:
            if not self._held:
                self._before = self._seen = _now_us()
            self._held.append(_us(seconds))
            self._apply()

    def release(self, seconds: float) -> None:
        """Let go of a :meth:`hold` of ``seconds``; the last one gives the interval back.

        Raises:
            ValueError: no hold of ``seconds`` is held.
        """
        with self._lock:
            self._held.remove(_us(seconds))
            self._apply()

    def _apply(self) -> None:
        now = _now_us()
        if now != self._seen:  # set by someone else meanwhile: theirs is the one to give back
            self._before = now
        target = min([self._before, *self._held])
        if target != now:
            # CPython truncates 1e6 x seconds to whole µs: half a µs more lands on target
            sys.setswitchinterval((target + 0.5) / 1e6)
        self._seen = _now_us()


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


def _now_us() -> int:
    return _us(sys.getswitchinterval())


SWITCH_INTERVAL = SwitchInterval()
"""The process's one :class:`SwitchInterval` (every p2p tier's ``engine_switch_interval_s``)."""


def open_dealer(
    ctx: zmq.Context,
    out: Open,
    curve: tuple[bytes, bytes] | None,
    before_connect: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """The client role's DEALER for an :class:`~.client.Open`, connected to the peer: its
    routing id, ``MAXMSGSIZE``, ``LINGER`` 0 and, with ``curve`` (the shared secret's
    ``(public, secret)`` keypair, :func:`~kvoffload.ipc.peer_messages.curve_keypair`), a CURVE
    client expecting that server key. ``kvoffload doctor`` opens its probes with it too, with
    ``before_connect`` attaching a monitor to the socket before it connects (ZMQ's I/O thread
    may finish the handshake before a monitor attached later exists, and a failed one is not
    tried again: its event would be lost).

    Raises:
        zmq.ZMQError: an address ZMQ refuses to connect to (``*``); the socket is closed.
    """
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, out.routing_id)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, pm.MAX_MESSAGE_BYTES + pm.CURVE_OVERHEAD_BYTES)
    s.setsockopt(zmq.SNDHWM, 10_000)
    # ZMQ's own reconnects stay slow: the link's handshake deadline and backoff decide when to
    # try again (a peer that is not there costs few connects)
    s.setsockopt(zmq.RECONNECT_IVL, 500)
    s.setsockopt(zmq.RECONNECT_IVL_MAX, 10_000)
    if curve is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, curve[0])
        s.setsockopt(zmq.CURVE_PUBLICKEY, curve[0])
        s.setsockopt(zmq.CURVE_SECRETKEY, curve[1])
    try:
        if before_connect is not None:
            before_connect(s)
        s.connect(f"tcp://{out.host}:{out.port}")
    except BaseException:
        s.close(linger=0)
        raise
    return s


class WorkerPort:
    """The peer worker as the roles use it (the client role's
    :class:`~kvoffload.tiers.p2p.client.Transfers`, through :meth:`role`): one worker name per
    remote agent and session token, counted per user, added on first use and removed by the last;
    grants remembered per role, so that their answers go back to the role that asked. Node thread
    only."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.agents: dict[str, int] = {}  # worker peer name -> links and pulls using it
        self.owners: dict[int, str] = {}  # grant id -> "client" | "server"

    @property
    def descriptor(self) -> bytes | None:
        """The worker's transport descriptor (None while it starts)."""
        return self.worker.descriptor

    @property
    def row_bytes(self) -> int:
        """Bytes per arena row."""
        return self.worker.row_bytes

    def acquire_peer(self, descriptor: bytes, token: bytes) -> str:
        """The worker's name for the instance behind ``descriptor`` reached with session data
        ``token``, added on first use.

        Raises:
            TransportError, ValueError: a descriptor or token the worker cannot use.
        """
        h = hashlib.blake2b(descriptor, digest_size=8, key=token[:64])
        name = "peer#" + h.hexdigest()
        n = self.agents.get(name, 0)
        if n == 0:
            self.worker.add_peer(name, descriptor, token)
        self.agents[name] = n + 1
        return name

    def release_peer(self, name: str) -> None:
        """One user of ``name`` is done; the last removes it from the worker (its transfers
        settle failed)."""
        n = self.agents.get(name, 0)
        if n <= 1:
            if self.agents.pop(name, None) is not None:
                self.worker.remove_peer(name)
        else:
            self.agents[name] = n - 1

    def read(
        self,
        name: str,
        pairs: list[tuple[int, int]],
        deadline_s: float,
        digests: bytes,
        not_after: float,
    ) -> int:
        """:meth:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle.read`."""
        return self.worker.read(name, pairs, deadline_s, digests=digests, not_after=not_after)

    def add_session(self, token: bytes) -> None:
        """:meth:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle.add_session`."""
        self.worker.add_session(token)

    def drop_session(self, token: bytes) -> None:
        """:meth:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle.drop_session`."""
        self.worker.drop_session(token)

    def grant(self, token: bytes, slots: list[int], until: float, owner: str = "client") -> int:
        """:meth:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle.grant`, for ``owner``."""
        gid = self.worker.grant(token, slots, until)
        self.owners[gid] = owner
        return gid

    def revoke(self, gid: int) -> None:
        """:meth:`~kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle.revoke`."""
        self.worker.revoke(gid)

    def role(self, owner: str) -> _RolePort:
        """This port as the ``owner`` role's grants (``"client"`` or ``"server"``)."""
        return _RolePort(self, owner)


class _RolePort:
    """A :class:`WorkerPort` whose grants are remembered as one role's."""

    def __init__(self, port: WorkerPort, owner: str):
        self.port = port
        self.owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.port, name)

    def grant(self, token: bytes, slots: list[int], until: float) -> int:
        return self.port.grant(token, slots, until, self.owner)


class PeerNode(threading.Thread):
    """The node thread of one p2p tier (see the module docstring).

    Args:
        ctx: the tier's ZMQ context.
        server: the serving role (:class:`kvoffload.tiers.p2p.server.PeerServer`), or None.
        worker: the :class:`kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle`.
        bind: ``tcp://host:port`` of the serving ROUTER.
        advertise: ``host:port`` peers reach this instance at (settable until :meth:`start`).
        incarnation: 16 random bytes, this start's identity.
        namespace_id: hex id of the namespace the sessions read.
        secret: the shared secret (bytes; empty with ``auth: none``: no CurveZMQ).
        heartbeat_s, peer_timeout_s, transfer_deadline_s, lease_ttl_s: seconds.
        static_peers: the configured peers (see :class:`~kvoffload.tiers.p2p.client.PeerClient`).
        request_peer_idle_s, max_request_peers: links requests named (the client role's).
        max_half_open, max_half_open_per_source: connections not yet authenticated, in all and
            per source address (see the module docstring).
        count: ``count(counter, n=1)`` of the tier (thread-safe for distinct names: dict updates).
        server_free_quota: chunks the serving role would admit now.
        locations: the :class:`~kvoffload.tiers.p2p.locations.PeerLocations`, or None; this
            thread owns it once started.
        port: the :class:`WorkerPort` over ``worker`` the serving role was given (default: a
            new one).

    Raises:
        zmq.ZMQError: ``bind`` cannot be bound (nothing is left open).
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
        static_peers: Iterable[str] = (),
        request_peer_idle_s: float = 60.0,
        max_request_peers: int = 16,
        max_half_open: int = 64,
        max_half_open_per_source: int = 8,
        port: WorkerPort | None = None,
    ):
        super().__init__(name="kvoffload-p2p-node", daemon=True)
        self.ctx = ctx
        self.server = server
        self.worker = worker
        self.port = port if port is not None else WorkerPort(worker)
        self.count = count
        self.commands: deque[Command] = deque()
        self.results: deque[Result] = deque()
        self.locations = locations  # PeerLocations, owned by this thread once it starts
        self.client = PeerClient(
            transfers=self.port.role("client"),
            incarnation=incarnation,
            namespace_id=namespace_id,
            secret=secret,
            heartbeat_s=heartbeat_s,
            peer_timeout_s=peer_timeout_s,
            transfer_deadline_s=transfer_deadline_s,
            lease_ttl_s=lease_ttl_s,
            advertise=advertise,
            results=self.results,
            count=count,
            server_free_quota=server_free_quota,
            where=locations.where if locations is not None else None,
            static_peers=static_peers,
            request_peer_idle_s=request_peer_idle_s,
            max_request_peers=max_request_peers,
        )
        self.transfer_deadline_s = transfer_deadline_s
        self.socks: dict[str, zmq.Socket] = {}  # peer -> its DEALER (the client role's session)
        self.sock_peers: dict[zmq.Socket, str] = {}
        # transfer id -> (client identity, lease, pairs, worker peer name): pulls of admitted offers
        self.pulls: dict[int, tuple[bytes, int, int, str]] = {}
        self.server_counters: dict[str, int] = {}  # the server's counters, as of the last tick
        self._counters_at = 0.0
        self._stopping = False
        self.handshake_ivl_s = peer_timeout_s
        self.max_half_open = max(1, max_half_open)
        self.max_half_open_per_source = max(1, max_half_open_per_source)
        #: Connections refused or closed before authentication, by reason
        #: (:data:`REFUSED_CONNECTIONS`); read by scrapes.
        self.refused_connections: dict[str, int] = dict.fromkeys(REFUSED_CONNECTIONS, 0)
        #: The advertise addresses of the peers authenticated to our server now (a snapshot the
        #: engine thread reads: the tier's routing allows them).
        self.authenticated_peers: frozenset[str] = frozenset()
        self._session_changes = -1
        # half-open connections: descriptor -> (peer (ip, port), accepted at)
        self._half_open: dict[int, tuple[tuple[str, int], float]] = {}
        self._active: set[int] = set()  # descriptors whose frames reached us, until closed
        self._half_open_per_source: Counter[str] = Counter()
        self._half_open_check_at = 0.0
        self._curve: tuple[bytes, bytes] | None = None  # (public, secret), Z85
        self._curve_public_raw = b""
        self._zap: zmq.Socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, pm.MAX_MESSAGE_BYTES + pm.CURVE_OVERHEAD_BYTES)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(peer_timeout_s * 1000)))
        # a send to an identity whose connection is gone raises: reachable() asks that way
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._monitor: zmq.Socket | None = None
        try:
            if secret:
                self._curve = pm.curve_keypair(secret)
                self._curve_public_raw = z85.decode(self._curve[0])
                # the ZAP handler must be bound before the first CURVE handshake: without one,
                # ZMQ would admit any client key
                self._zap = ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
                self.router.setsockopt(zmq.CURVE_SERVER, 1)
                self.router.setsockopt(zmq.CURVE_SECRETKEY, self._curve[1])
                self.router.setsockopt(zmq.CURVE_PUBLICKEY, self._curve[0])
                self.router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
                self.router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            self._monitor = self.router.get_monitor_socket(_MONITOR_EVENTS)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self.router.bind(bind)
        except zmq.ZMQError:
            self._close_server_sockets()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self.bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._port = int(self.bound.rsplit(":", 1)[1])
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self._monitor, zmq.POLLIN)
        if self._zap is not None:
            self.poller.register(self._zap, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        if locations is not None:
            locations.register(self.poller)
        self._worker_fd: int | None = None
        self._restart_at = 0.0
        self.error: BaseException | None = None

    @property
    def advertise(self) -> str:
        """``host:port`` peers reach this instance at (sent in every Hello)."""
        return self.client.advertise

    @advertise.setter
    def advertise(self, value: str) -> None:
        self.client.advertise = value

    # -- engine thread side ------------------------------------------------------------------------

    def submit(self, cmd: Command) -> None:
        """Queue a command for the node thread (engine thread; never blocks)."""
        self.commands.append(cmd)
        self._wake()

    def _wake(self) -> None:
        fd = self._wake_w
        if fd < 0:
            return  # stopped: nobody to wake (a command submitted after stop() is dropped)
        try:
            os.write(fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread and close its sockets (engine thread). The wake-up pipe is closed
        here, once the thread has ended (not by the thread: a write to a descriptor it closed
        could land in whatever file took that number); a thread that does not end keeps it."""
        self._stopping = True
        if self.is_alive():
            self._wake()
            self.join(timeout_s)
        if not self.is_alive() and self._wake_w >= 0:
            r, w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1  # marked closed before the numbers can be reused
            os.close(r)
            os.close(w)

    # -- the thread --------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`."""
        try:
            self._loop()
        except BaseException as e:  # the tier reports it; peers see us go silent
            self.error = e
            log.exception("p2p: the node thread stopped on an error")
        finally:
            for s in list(self.socks.values()):
                s.close(linger=0)
            self.socks.clear()
            self.sock_peers.clear()
            if self.locations is not None:
                self.locations.close()
            self._close_server_sockets()

    def _close_server_sockets(self) -> None:
        if self._monitor is not None:
            try:
                self.router.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        self.router.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)
            self._zap = None

    def _loop(self) -> None:
        poller = self.poller
        client = self.client
        while not self._stopping:
            fd = self._worker_fileno()
            if fd != self._worker_fd:
                if self._worker_fd is not None:
                    poller.unregister(self._worker_fd)
                if fd is not None:
                    poller.register(fd, zmq.POLLIN)
                self._worker_fd = fd
            events = dict(poller.poll(POLL_MS))
            now = time.monotonic()
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self.locations is not None:
                self.locations.poll()
            if self._zap is not None and self._zap in events:
                self._answer_zap()
            if self._monitor is not None and self._monitor in events:
                self._watch_connections(now)
            if self.commands:
                self._apply(client.commands(self._take_commands(), now), now)
            if self.router in events:
                self._serve(now)
            for s, peer in list(self.sock_peers.items()):
                if s in events:
                    self._drain_peer(s, peer, now)
            self._worker_events(now)
            self._tick(now)

    def _take_commands(self) -> list[Command]:
        cmds = self.commands
        out = []
        while cmds:
            out.append(cmds.popleft())
        return out

    def _worker_fileno(self) -> int | None:
        try:
            return self.worker.fileno()
        except Exception:
            return None

    # -- client role: sockets -------------------------------------------------------------------

    def _apply(self, outs: list[Out], now: float) -> None:
        """Do what the client role asked, in order."""
        for out in outs:
            match out:
                case Send():
                    s = self.socks.get(out.peer)
                    if s is not None:
                        try:
                            s.send(out.frame, zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # the send queue is full: the request's deadline handles it
                case Open():
                    self._close(out.peer)
                    try:
                        s = open_dealer(self.ctx, out, self._curve)
                    except zmq.ZMQError as e:  # an address ZMQ refuses ("*", a request's)
                        self._apply(self.client.unreachable(out.peer, str(e), now), now)
                        continue
                    self.socks[out.peer] = s
                    self.sock_peers[s] = out.peer
                    self.poller.register(s, zmq.POLLIN)
                case Close():
                    self._close(out.peer)
                case Trusted():
                    if self.locations is not None:  # it serves our namespace: trust its events
                        self.locations.confirm_peer(out.peer)
                case Restarted():
                    if self.locations is not None:
                        self.locations.drop_peer(out.peer)

    def _close(self, peer: str) -> None:
        s = self.socks.pop(peer, None)
        if s is not None:
            self.poller.unregister(s)
            self.sock_peers.pop(s, None)
            s.close(linger=0)

    def _drain_peer(self, s: zmq.Socket, peer: str, now: float) -> None:
        for _ in range(1000):
            try:
                frame = s.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(self.client.on_frame(peer, frame, now), now)
            if self.socks.get(peer) is not s:  # the session went down and closed this socket
                return

    # -- serving role ---------------------------------------------------------------------------

    def _serve(self, now: float) -> None:
        router = self.router
        server = self.server
        for _ in range(1000):
            try:
                parts = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._authenticated(parts[-1])
            if len(parts) != 2:
                self.count("refused_malformed")
                continue
            if server is None:
                continue
            ident, frame = parts
            source = frame.get("Peer-Address") or ""
            for to, out in server.handle(ident.bytes, frame.buffer, now, source):
                self._route(to, out)
        if server is not None and server.session_changes != self._session_changes:
            self._session_changes = server.session_changes
            self.authenticated_peers = server.authenticated_peers()

    def reachable(self, identity: bytes) -> bool:
        """Whether the connection of ``identity`` is still open (the serving role asks before it
        takes a new incarnation at a peer's address for a restart): a Heartbeat is sent to it,
        which a live client answers and ZMQ refuses for an identity it no longer routes."""
        hb = pm.encode(pm.Heartbeat(seq=0, free_quota=0))
        try:
            self.router.send_multipart([identity, hb], zmq.NOBLOCK)
        except zmq.Again:
            return True  # routed, its queue is full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: no connection with that identity
        return True

    # -- before authentication ------------------------------------------------------------------

    def _answer_zap(self) -> None:
        """Answer ZMQ's authentication requests (RFC 27): a CURVE client is admitted only when
        the long-term key it proved is the shared secret's."""
        zap = self._zap
        assert zap is not None
        for _ in range(1000):
            try:
                req = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(req) < 6:  # not a ZAP request: REP must still answer it
                zap.send_multipart([b"1.0", b"", b"500", b"malformed", b"", b""])
                continue
            version, request_id, domain, address, _identity, mechanism = req[:6]
            creds = req[6:]
            ok = (
                domain == ZAP_DOMAIN
                and mechanism == b"CURVE"
                and len(creds) == 1
                and hmac.compare_digest(creds[0], self._curve_public_raw)
            )
            if not ok:
                self.refused_connections["wrong_key"] += 1
                log.warning(
                    "p2p: refused a connection from %s: its CurveZMQ key is not the shared "
                    "secret's (another secret, or no secret)",
                    address.decode(errors="replace"),
                )
            code, text = (b"200", b"OK") if ok else (b"400", b"not the shared secret")
            zap.send_multipart([version, request_id, code, text, b"", b""])

    def _watch_connections(self, now: float) -> None:
        """The ROUTER's monitor: track half-open connections, refuse those over the bounds,
        count ZMQ's handshake failures."""
        mon = self._monitor
        assert mon is not None
        for _ in range(10_000):
            try:
                head, _endpoint = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:
                continue  # not an event of this ZMQ version's shape
            event, value = struct.unpack("=HI", head[:6])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(value, now)
            elif event == zmq.EVENT_DISCONNECTED:
                self._active.discard(value)
                self._gone(value)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                mismatch = value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                self.refused_connections["mechanism" if mismatch else "handshake_failed"] += 1
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.refused_connections["handshake_failed"] += 1
            # EVENT_HANDSHAKE_FAILED_AUTH: the ZAP handler counted it (wrong_key)
        if self._half_open and now >= self._half_open_check_at:
            self._half_open_check_at = now + 0.25
            self._expire_half_open(now)

    def _peer_of(self, fd: int) -> tuple[str, int] | None:
        """The remote ``(ip, port)`` of ``fd`` if it is a connection to our control port now,
        else None (the descriptor may already be closed, or reused for something else)."""
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                return None
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6):
                    return None
                if s.getsockname()[1] != self._port:
                    return None
                peer = s.getpeername()
                return str(peer[0]), int(peer[1])
        except OSError:
            return None

    def _shut(self, fd: int, peer: tuple[str, int]) -> bool:
        """Shut the connection on ``fd`` down if it still is the one from ``peer`` (ZMQ then
        closes it); True if it was."""
        if self._peer_of(fd) != peer:
            return False
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True

    def _accepted(self, fd: int, now: float) -> None:
        if fd in self._active:
            return  # its first frame was read before this event: authenticated already
        peer = self._peer_of(fd)
        if peer is None:
            return
        self._gone(fd)  # a descriptor number reused: what it was is over
        source = peer[0]
        per_source = self._half_open_per_source
        if per_source[source] >= self.max_half_open_per_source:
            self.refused_connections["per_source"] += 1
            self._shut(fd, peer)
            return
        if len(self._half_open) >= self.max_half_open:
            # full: the oldest connection of the source holding most goes, unless that is the
            # newcomer's own source; so a source with few half-open (an honest peer) gets in
            worst = max(per_source, key=per_source.__getitem__)
            self.refused_connections["total"] += 1
            if per_source[worst] <= per_source[source]:
                self._shut(fd, peer)
                return
            old_fd, (old_peer, _) = min(
                ((f, e) for f, e in self._half_open.items() if e[0][0] == worst),
                key=lambda item: item[1][1],
            )
            self._gone(old_fd)
            self._shut(old_fd, old_peer)
        self._half_open[fd] = (peer, now)
        per_source[source] += 1

    def _gone(self, fd: int) -> None:
        """``fd`` is no longer half-open (closed, or its first frame arrived)."""
        entry = self._half_open.pop(fd, None)
        if entry is not None:
            source = entry[0][0]
            left = self._half_open_per_source[source] - 1
            if left > 0:
                self._half_open_per_source[source] = left
            else:
                del self._half_open_per_source[source]

    def _authenticated(self, frame: Any) -> None:
        """A frame reached us: its connection finished ZMQ's handshake (and CURVE's)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        if fd not in self._active:
            self._active.add(fd)
            self._gone(fd)

    def _expire_half_open(self, now: float) -> None:
        limit = now - self.handshake_ivl_s - 1.0  # ZMQ's own handshake bound goes first
        for fd, (peer, since) in list(self._half_open.items()):
            if since <= limit:
                self._gone(fd)
                if self._shut(fd, peer):
                    self.refused_connections["handshake_timeout"] += 1

    def _route(self, ident: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.count("unsent_replies")

    def pull(
        self,
        ident: bytes,
        descriptor: bytes,
        token: bytes,
        lease: int,
        pairs: list[tuple[int, int]],
        digests: bytes,
        ttl_s: float,
    ) -> None:
        """The serving role admitted an offer: read the pusher's granted slots into ours, each
        checked against ``digests``, over before the pusher's grant of ``ttl_s`` may end."""
        now = time.monotonic()
        not_after = now + ttl_s - lease_margin_s(ttl_s)
        deadline_s = min(self.transfer_deadline_s, not_after - now)
        if deadline_s <= 0:
            raise ValueError(f"the offer's grant ({ttl_s:.3f} s) ends before a pull could")
        try:
            name = self.port.acquire_peer(descriptor, token)
        except Exception as e:
            log.warning("p2p: cannot pull an offer from a peer: %s", e)
            raise  # the server frees the admitted slots and answers the offer as not accepted
        try:
            tid = self.worker.read(name, pairs, deadline_s, digests=digests, not_after=not_after)
        except Exception:
            self.port.release_peer(name)
            raise
        self.pulls[tid] = (ident, lease, len(pairs), name)

    # -- worker -------------------------------------------------------------------------------

    def _worker_events(self, now: float) -> None:
        worker = self.worker
        results = worker.poll()
        for name, err in worker.take_peer_errors():
            self._apply(self.client.transport_refused(name, err, now), now)
        if not worker.alive and now >= self._restart_at:
            # Our worker died (its transfers were reported failed above, after it exited): start
            # a new one; its descriptor is new, so every session starts again (peers learn it).
            self.count("worker_restarts")
            log.warning("p2p: the peer worker died; restarting it")
            self._restart_at = now + 1.0
            worker.restart()
            self.port.agents.clear()  # the new worker knows no peer
            self._apply(self.client.worker_restarted(now), now)
            if self.server is not None:
                self.server.close()  # peers hold our old descriptor: their sessions start again
        for tid, state, reason, bad in results:
            done = state.name == "DONE"
            pull = self.pulls.pop(tid, None)
            if pull is None:
                self._apply(self.client.transfer_settled(tid, done, reason, now, bad), now)
            elif self.server is not None:
                ident, lease, n, name = pull
                self.port.release_peer(name)
                ok = [done and i not in bad for i in range(n)]
                for to, out in self.server.pull_settled(ident, lease, ok, len(bad) if done else 0):
                    self._route(to, out)
        owners = self.port.owners
        for gid, digests in worker.take_granted():
            if owners.get(gid) == "server" and self.server is not None:
                for to, out in self.server.granted(gid, digests, now):
                    self._route(to, out)
            else:
                self._apply(self.client.granted(gid, digests, now), now)
        for gid in worker.take_revoked():
            if owners.pop(gid, None) == "server" and self.server is not None:
                for to, out in self.server.revoked(gid, now):
                    self._route(to, out)
            else:
                self._apply(self.client.revoked(gid, now), now)

    # -- timers -------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self._apply(self.client.tick(now), now)
        if self._half_open and now >= self._half_open_check_at:
            self._half_open_check_at = now + 0.25
            self._expire_half_open(now)
        if self.server is not None:
            for to, out in self.server.tick(now):
                self._route(to, out)
            if self.server.session_changes != self._session_changes:
                self._session_changes = self.server.session_changes
                self.authenticated_peers = self.server.authenticated_peers()
            if now >= self._counters_at:
                self._counters_at = now + 0.25
                counters = self.server.counters
                for reason, n in self.worker.refused.items():
                    counters[f"refused.data_{reason}"] = n
                self.server_counters = counters
