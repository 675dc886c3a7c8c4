"""The p2p tier's node thread: its sockets, its poll loop, and the wiring of its roles and worker.

::

    engine thread (P2PTier)
      │ submit(Command): deque + a byte on the wake-up pipe          ▲ results: deque (Result)
      ▼                                                              │
    PeerNode thread ── poll(router, peers' DEALERs, wake-up pipe, worker fd, event feeds; 20 ms)
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
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

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
        secret: the shared secret (bytes; empty with ``auth: none``).
        heartbeat_s, peer_timeout_s, transfer_deadline_s, lease_ttl_s: seconds.
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
        )
        self.transfer_deadline_s = transfer_deadline_s
        self.socks: dict[str, zmq.Socket] = {}  # peer -> its DEALER (the client role's session)
        self.sock_peers: dict[zmq.Socket, str] = {}
        # transfer id -> (client identity, lease, pairs, worker peer name): pulls of admitted offers
        self.pulls: dict[int, tuple[bytes, int, int, str]] = {}
        self.server_counters: dict[str, int] = {}  # the server's counters, as of the last tick
        self._counters_at = 0.0
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
        try:
            os.write(self._wake_w, b"\0")
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
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

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
            self.router.close(linger=0)

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
                    s = self.ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.ROUTING_ID, out.routing_id)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.MAXMSGSIZE, pm.MAX_MESSAGE_BYTES)
                    s.setsockopt(zmq.SNDHWM, 10_000)
                    try:
                        s.connect(f"tcp://{out.host}:{out.port}")
                    except zmq.ZMQError as e:  # an address ZMQ refuses ("*", a request's)
                        s.close(linger=0)
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
        if self.server is not None:
            for to, out in self.server.tick(now):
                self._route(to, out)
            if now >= self._counters_at:
                self._counters_at = now + 0.25
                counters = self.server.counters
                for reason, n in self.worker.refused.items():
                    counters[f"refused.data_{reason}"] = n
                self.server_counters = counters
