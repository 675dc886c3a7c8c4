"""ZMQ channels between one tier's engine-side manager and its worker processes.

::

    engine (TierChannels)                                  worker (WorkerChannels)
      ROUTER  loads   ◀── bind ── connect ──▶ DEALER  (reader workers: tasks in, Hello out)
      ROUTER  stores  ◀── bind ── connect ──▶ DEALER  (writer workers: tasks in, Hello out)
      PULL    results ◀── bind ── connect ─── PUSH    (every worker: TaskResult out)

    p2p tier (PeerWorkerChannel)                           p2p peer worker
      PAIR            ◀── bind ── connect ──▶ PAIR    (transfers in, settled transfers out)

Per tier, one socket carries loads and one carries stores, so a reload never queues behind a burst of
stores. The jobs sockets are ROUTERs rather than plain PUSH sockets so the engine addresses each task to
one named worker: it always knows which worker holds which task, and when a worker dies it fails or
re-runs exactly that worker's tasks (a PUSH socket would hide where a task went). Endpoints are Linux
abstract-namespace IPC sockets (``ipc://@...``): nothing to clean up on disk, gone when the engine dies.

This module owns the sockets between an engine and its own worker processes, both ends: nothing
else talks to a tier worker or the peer worker. The project's other sockets each belong to the one
part that serves them: the KV-event publisher's PUB and replay ROUTER (:mod:`kvoffload.events`);
the p2p tier's control sockets (its ROUTER, a DEALER per peer, the ZAP handler's REP:
:mod:`kvoffload.tiers.p2p.node`; the SUB and replay DEALER sockets of
:mod:`kvoffload.tiers.p2p.locations`, made by the tier and handed to the node thread before it
starts); the TCP sockets between peer workers (:mod:`kvoffload.workers.p2p_transport`); the
standalone metrics endpoint's HTTP server (``prometheus_client``, :mod:`kvoffload.metrics`); and
the tools' own (``kvoffload top``'s subscriber, ``kvoffload check``'s reachability probes, the
benchmarks).
"""

from __future__ import annotations

import os
import secrets
import select

import zmq

LOADS = "loads"
STORES = "stores"
# Plain ints: an IntFlag operation per send or recv is a Python-level enum call.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


def _readable(sock: zmq.Socket) -> bool:
    """A message is waiting on ``sock`` (one getsockopt, no exception when there is none)."""
    events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]  # int for EVENTS
    return bool(events & zmq.POLLIN)


def _endpoint(tag: str) -> str:
    return f"ipc://@kvoffload-{os.getpid()}-{secrets.token_hex(6)}-{tag}"


class TierChannels:
    """Engine-side sockets of one tier. Not thread-safe: use from the engine thread only."""

    def __init__(self, ctx: zmq.Context, tier_name: str):
        self.endpoints: dict[str, str] = {}
        self.jobs: dict[str, zmq.Socket] = {}
        for kind in (LOADS, STORES):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            ep = _endpoint(f"{tier_name}-{kind}")
            sock.bind(ep)
            self.jobs[kind] = sock
            self.endpoints[kind] = ep
        self.results = ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.setsockopt(zmq.RCVHWM, 0)
        ep = _endpoint(f"{tier_name}-results")
        self.results.bind(ep)
        self.endpoints["results"] = ep
        # The results socket's ZMQ_FD is readable when commands wait for the socket, which is
        # how a message that arrives after the socket was found empty makes itself known
        # (libzmq's own zmq_poll works this way). One poll(2) on it costs a system call; asking
        # the socket (ZMQ_EVENTS, or a recv that finds nothing) costs three here (libzmq checks
        # getpid() for forks, then polls its mailbox) and a Python exception for the recv.
        self._results_fd = select.poll()
        self._results_fd.register(self.results.getsockopt(zmq.FD), select.POLLIN)
        # False only while the socket is known drained (its last recv found nothing) and
        # nothing else has touched it since: then an unreadable FD means no new result.
        self._results_unsure = True

    def send_task(self, kind: str, worker_identity: bytes, payload: bytes) -> bool:
        """Send one encoded task to a worker. False when the worker is not connected."""
        try:
            # Tasks are small: copying is cheaper than zero-copy frame bookkeeping. Two sends
            # are what send_multipart does, without its Python loop.
            sock = self.jobs[kind]
            sock.send(worker_identity, _MORE_NOBLOCK)
            sock.send(payload, _NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def recv_hellos(self, kind: str) -> list[tuple[bytes, bytes]]:
        """Drain ``(identity, payload)`` messages workers sent on a jobs socket. Never blocks."""
        out: list[tuple[bytes, bytes]] = []
        sock = self.jobs[kind]
        while _readable(sock):
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            if len(frames) == 2:
                out.append((frames[0], frames[1]))
        return out

    def results_pending(self) -> bool:
        """True when a result may be waiting (one poll(2) of the socket's ZMQ_FD once the socket
        was found drained; :meth:`recv_results` tells for sure)."""
        return self._results_unsure or bool(self._results_fd.poll(0))

    def recv_results(self, limit: int = 100_000) -> list[bytes]:
        """Drain waiting result messages (at most ``limit``). Never blocks.

        Reads until the socket has nothing more (one ``zmq.Again``), which leaves it drained, so
        that :meth:`results_pending` can trust the ZMQ_FD afterwards; when ``limit`` stops it
        first, the next call reads again whatever the FD says."""
        if not self.results_pending():
            return []
        out: list[bytes] = []
        recv = self.results.recv
        try:
            while len(out) < limit:
                out.append(recv(_NOBLOCK))
            self._results_unsure = True  # stopped by the limit: more may be waiting
        except zmq.Again:
            self._results_unsure = False
        return out

    def wait_results(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for a result (standalone callers only, never the
        scheduler step)."""
        # zmq_poll handles the socket's commands itself: the FD may then stay quiet while a
        # result waits, so the next recv_results asks the socket
        self._results_unsure = True
        return bool(self.results.poll(int(timeout_s * 1000)))

    def close(self) -> None:
        """Close the sockets at once (nothing unsent is waited for)."""
        for sock in (*self.jobs.values(), self.results):
            sock.close(linger=0)


class WorkerChannels:
    """Worker-side sockets: a DEALER on the tier's jobs socket for one kind, a PUSH for results."""

    def __init__(
        self, ctx: zmq.Context, jobs_endpoint: str, results_endpoint: str, identity: bytes
    ):
        self.jobs = ctx.socket(zmq.DEALER)
        self.jobs.setsockopt(zmq.LINGER, 0)
        self.jobs.setsockopt(zmq.ROUTING_ID, identity)
        self.jobs.setsockopt(zmq.RCVHWM, 0)
        self.jobs.connect(jobs_endpoint)
        self.results = ctx.socket(zmq.PUSH)
        self.results.setsockopt(zmq.LINGER, 2000)
        self.results.setsockopt(zmq.SNDHWM, 0)
        self.results.connect(results_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.jobs, zmq.POLLIN)

    def say_hello(self, payload: bytes) -> None:
        """Tell the engine this worker is ready (``payload``: an encoded ``Hello``)."""
        self.jobs.send(payload)

    def next_task(self, timeout_s: float) -> bytes | None:
        """The next task's bytes, or None after ``timeout_s`` seconds without one."""
        if self.poller.poll(int(timeout_s * 1000)):
            return self.jobs.recv()
        return None

    def watch(self, fd: int) -> None:
        """Also wake :meth:`wait` when the file descriptor ``fd`` is readable (a wake-up pipe)."""
        self.poller.register(fd, zmq.POLLIN)

    def wait(self, timeout_s: float, tasks: bool = True) -> dict:
        """Wait up to ``timeout_s`` seconds for a task (unless ``tasks`` is False) or a watched
        descriptor; returns what is ready (``self.jobs`` and/or the descriptors, as keys)."""
        if not tasks:
            self.poller.modify(self.jobs, 0)
        try:
            return dict(self.poller.poll(int(timeout_s * 1000)))
        finally:
            if not tasks:
                self.poller.modify(self.jobs, zmq.POLLIN)

    def try_task(self) -> bytes | None:
        """The next task's bytes if one is there now, else None."""
        try:
            return self.jobs.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def send_result(self, payload: bytes) -> None:
        """Send one encoded ``TaskResult`` to the engine (never blocks for long: a PUSH socket)."""
        self.results.send(payload)

    def close(self) -> None:
        """Close the sockets at once (nothing unsent is waited for)."""
        self.jobs.close(linger=0)
        self.results.close()


class PeerWorkerChannel:
    """The socket pair between the p2p tier's engine side and its peer worker process: one ZMQ PAIR
    socket each end over an abstract-namespace IPC endpoint, bound by the engine (:meth:`bind`),
    connected by the worker (:meth:`connect`). One frame per message, unlimited queues (the engine
    bounds what it sends). Not thread-safe: each end is used by one thread.
    """

    def __init__(self, sock: zmq.Socket, endpoint: str):
        self.sock = sock
        self.endpoint = endpoint

    @classmethod
    def bind(cls, ctx: zmq.Context, tag: str = "p2p-worker") -> PeerWorkerChannel:
        """The engine's end, bound to a fresh endpoint (a restarted worker gets a new one)."""
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        ep = _endpoint(tag)
        sock.bind(ep)
        return cls(sock, ep)

    @classmethod
    def connect(cls, ctx: zmq.Context, endpoint: str) -> PeerWorkerChannel:
        """The worker's end. Messages sent before the connection completes are queued; on close,
        unsent ones get up to 2 s to leave (a worker's last report)."""
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return cls(sock, endpoint)

    @property
    def fd(self) -> int:
        """The socket's ZMQ_FD: readable when its events *may* have changed (edge-like: check
        :meth:`readable` after it fires, and after every send)."""
        fd: int = self.sock.getsockopt(zmq.FD)  # type: ignore[assignment]  # int for FD
        return fd

    def readable(self) -> bool:
        """A message is waiting (one getsockopt, no exception when there is none)."""
        return _readable(self.sock)

    def send(self, payload: bytes) -> bool:
        """Send one frame without blocking. False when it cannot be queued (the engine's end: no
        worker connected yet)."""
        try:
            self.sock.send(payload, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv_ready(self) -> list[bytes]:
        """Drain the frames waiting now. Never blocks."""
        out: list[bytes] = []
        sock = self.sock
        while _readable(sock):
            out.append(sock.recv(flags=zmq.NOBLOCK))
        return out

    def recv_all(self, timeout_s: float, wake_fd: int | None = None) -> list[bytes]:
        """Wait up to ``timeout_s`` seconds for a frame, or with ``wake_fd`` until that file
        descriptor is readable (the worker's transport finished something), then drain every
        waiting frame (none when woken by ``wake_fd`` alone)."""
        if not self.readable():
            ms = max(1, round(timeout_s * 1000))
            if wake_fd is None:
                self.sock.poll(ms)
            else:
                zmq.zmq_poll([(self.sock, zmq.POLLIN), (wake_fd, zmq.POLLIN)], ms)
        return self.recv_ready()

    def close(self) -> None:
        """Close the socket (the worker's end lingers as :meth:`connect` says)."""
        self.sock.close()
