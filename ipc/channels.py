"""The channels between one tier's engine-side manager and its worker processes.

::

    engine (TierChannels)                                   worker (WorkerChannels)
      listening socket  loads   ◀── connect ── one stream per reader worker: Hello, results out;
      listening socket  stores  ◀── connect ── one stream per writer worker   tasks in

    p2p tier (PeerWorkerChannel)                            p2p peer worker
      PAIR            ◀── bind ── connect ──▶ PAIR    (transfers in, settled transfers out)

A tier worker talks to its engine over one Unix stream socket of its own, in Linux's abstract
namespace (``@kvoffload-<pid>-<random>-<tier>-<kind>``: nothing to clean up on disk, gone when the
engine dies): the engine listens on one socket per kind (loads, stores), so a reload never queues
behind a burst of stores, and each worker connects to its kind's. Messages are frames: a 4-byte
little-endian length, then the body; a worker's first frame is its Hello (its identity, then the
encoded ``Hello``), every later one a ``TaskResult``; the engine's frames are tasks. Each
connection belongs to one worker (its identity, chosen by the pool), so the engine always knows
which worker holds which task, and when a worker dies it fails or re-runs exactly that worker's
tasks.

**Why not ZMQ here** (it was, until issue 26): a ZMQ socket hands every message to its context's
I/O thread, which then writes it to the kernel, so each task sent after an idle moment woke a
thread of the engine process before the worker, and each result took the same detour back. On
the 2-vCPU VM of BENCHMARKS.md a task's send cost the engine thread 18 µs of CPU and a result's
pick-up 34 µs (a ROUTER send and a PULL drain, 2 ms apart); a send on the socket itself costs
12 µs and a ``poll`` + ``recv`` 13 µs (``docs/profiles/engine.md``, section 7).

**Who may connect.** Abstract sockets have no file permissions: any local user can connect to
one. A connection whose peer (``SO_PEERCRED``) runs as another user than the engine is closed at
once, counted (``refused``) and logged once per user, so another local user can neither take a
worker's place (and be sent its tasks) nor answer tasks with forged results (a load reported done
whose slot holds nothing: wrong KV served). Processes of the engine's own user are trusted (the
README's security model).

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

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
from collections.abc import Callable

log = logging.getLogger("kvoffload.ipc")

LOADS = "loads"
STORES = "stores"

_LEN = struct.Struct("<I")
_IDENT = struct.Struct("<H")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: Largest frame either end accepts (bytes): a scan of a very large tier's listing fits; a length
#: beyond it is a peer that is not one of ours, and its connection is closed.
MAX_FRAME_BYTES = 1 << 30
#: Bytes asked of one ``recv``: results are small; a long scan listing takes several.
_RECV_BYTES = 1 << 18
_IN = select.POLLIN | select.POLLPRI
_ACCEPTS_PER_PUMP = 16
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def _address(endpoint: str) -> str:
    """The abstract-namespace address of ``endpoint`` (``@name``)."""
    if not endpoint.startswith("@") or len(endpoint) < 2:
        raise ValueError(f"not an abstract socket endpoint (@name): {endpoint!r}")
    return "\0" + endpoint[1:]


def frame(body: bytes) -> bytes:
    """``body`` as one frame (its length first)."""
    return _LEN.pack(len(body)) + body


def hello_frame(identity: bytes, hello: bytes) -> bytes:
    """A worker's first frame: its ``identity`` and its encoded ``Hello``."""
    return frame(_IDENT.pack(len(identity)) + identity + hello)


class FrameError(ValueError):
    """Bytes that are no frame of ours (a length past :data:`MAX_FRAME_BYTES`)."""


class _Frames:
    """Frames cut from a byte stream as it arrives."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        """Append ``data``; return every frame body now complete, in order.

        Raises:
            FrameError: a frame claims more than :data:`MAX_FRAME_BYTES`.
        """
        buf = self.buf
        buf += data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        unpack = _LEN.unpack_from
        while end - pos >= 4:
            (n,) = unpack(buf, pos)
            if n > MAX_FRAME_BYTES:
                raise FrameError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
            if end - pos - 4 < n:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if pos:
            del buf[:pos]
        return out


def _recv_frames(
    sock: socket.socket, frames: _Frames, buf: bytearray, to_end: bool = False
) -> tuple[list[bytes], str | None]:
    """Read what waits on ``sock`` now (never waiting), cut into ``frames``. Returns the bodies
    complete now and why the stream ended: ``"closed"`` (the other end is gone, all it sent read),
    a :class:`FrameError`'s message (bytes no frame of ours has), or None while it is open. One
    ``recv`` unless it filled ``buf``, or with ``to_end`` (the other end is known gone: read to its
    end)."""
    out: list[bytes] = []
    while True:
        try:
            n = sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return out, None
        except OSError:
            n = 0
        if n == 0:
            return out, "closed"
        try:
            out += frames.feed(memoryview(buf)[:n])
        except FrameError as e:
            return out, str(e)
        if n < len(buf) and not to_end:
            return out, None


class _Conn:
    """One worker's connection, engine side."""

    __slots__ = ("sock", "fd", "kind", "identity", "frames", "out")

    def __init__(self, sock: socket.socket, kind: str):
        self.sock = sock
        self.fd = sock.fileno()
        self.kind = kind
        self.identity: bytes | None = None  # known once its Hello came
        self.frames = _Frames()
        self.out = bytearray()  # bytes the kernel would not take yet


class TierChannels:
    """Engine-side sockets of one tier (see the module docstring). Not thread-safe: use from the
    engine thread only.

    Args:
        tier_name: names the endpoints (for people reading ``/proc/net/unix``).
        on_refused: called with the reason of each connection refused (``other_user``, ``bad_frame``,
            ``duplicate``) so the tier can count it.

    Raises:
        OSError: a socket could not be made or bound.
    """

    def __init__(self, tier_name: str, on_refused: Callable[[str], None] | None = None):
        self.endpoints: dict[str, str] = {}
        self.on_refused = on_refused
        self.refused: dict[str, int] = {}
        self._uid = os.geteuid()
        self._warned_uids: set[int] = set()
        self._poller = select.poll()
        self._listeners: dict[int, tuple[socket.socket, str]] = {}
        self._conns: dict[int, _Conn] = {}
        self._by_identity: dict[tuple[str, bytes], _Conn] = {}
        self._hellos: dict[str, list[tuple[bytes, bytes]]] = {LOADS: [], STORES: []}
        self._results: list[bytes] = []
        self._buf = bytearray(_RECV_BYTES)
        try:
            for kind in (LOADS, STORES):
                name = f"kvoffload-{os.getpid()}-{secrets.token_hex(6)}-{tier_name}-{kind}"
                sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
                )
                self._listeners[sock.fileno()] = (sock, kind)
                sock.bind("\0" + name)
                sock.listen(128)
                self._poller.register(sock.fileno(), _IN)
                self.endpoints[kind] = "@" + name
        except BaseException:
            self.close()
            raise

    # -- the engine's calls -----------------------------------------------------------------------

    def send_task(self, kind: str, worker_identity: bytes, payload: bytes) -> bool:
        """Send one encoded task to a worker (queued here if the kernel will not take it all now).
        False when that worker is not connected (not yet, or gone)."""
        conn = self._by_identity.get((kind, worker_identity))
        if conn is None:
            return False
        data = _LEN.pack(len(payload)) + payload
        if conn.out:
            conn.out += data
            return self._flush(conn)
        try:
            n = conn.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self._read_then_drop(conn)
            return False
        if n < len(data):
            conn.out += data[n:]
            self._poller.modify(conn.fd, _IN | select.POLLOUT)
        return True

    def recv_hellos(self, kind: str) -> list[tuple[bytes, bytes]]:
        """``(identity, payload)`` of each worker of ``kind`` that said hello since the last call
        (``payload``: its encoded ``Hello``). Never blocks."""
        self._pump(0)
        out = self._hellos[kind]
        if out:
            self._hellos[kind] = []
        return out

    def results_pending(self) -> bool:
        """True when a result may be waiting (one ``poll(2)``; :meth:`recv_results` tells for
        sure)."""
        return bool(self._results) or bool(self._poller.poll(0))

    def recv_results(self, limit: int = 100_000) -> list[bytes]:
        """Waiting results (encoded ``TaskResult``, at most ``limit``; the rest stay for the next
        call). Never blocks."""
        self._pump(0)
        out = self._results
        if len(out) <= limit:
            self._results = []
            return out
        self._results = out[limit:]
        return out[:limit]

    def wait_results(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for a result (standalone callers only, never the
        scheduler step)."""
        if not self._results:
            self._pump(max(0, int(timeout_s * 1000)))
        return bool(self._results)

    def sockets(self) -> list[socket.socket]:
        """The sockets open now: the listening ones and one per connected worker."""
        return [s for s, _ in self._listeners.values()] + [c.sock for c in self._conns.values()]

    def close(self) -> None:
        """Close every socket at once (nothing unsent is waited for)."""
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        self._by_identity.clear()
        for sock, _ in self._listeners.values():
            sock.close()
        self._listeners.clear()

    # -- inside -----------------------------------------------------------------------------------

    def _pump(self, timeout_ms: int) -> None:
        """Accept new workers, read what they sent, send what waited (one ``poll(2)``)."""
        for fd, ev in self._poller.poll(timeout_ms):
            lst = self._listeners.get(fd)
            if lst is not None:
                self._accept(*lst)
                continue
            conn = self._conns.get(fd)
            if conn is None:
                continue
            if ev & select.POLLOUT and conn.out and not self._flush(conn):
                continue
            if ev & (_IN | _GONE):
                self._read(conn)

    def _accept(self, listener: socket.socket, kind: str) -> None:
        # At most _ACCEPTS_PER_PUMP a call: a flood of connections from another user costs the
        # engine thread a bounded time per step (the rest wait in the backlog).
        for _ in range(_ACCEPTS_PER_PUMP):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE: try again at the next pump
                log.warning("kvoffload: accepting a worker connection failed: %s", e)
                return
            pid, uid, _gid = _CRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
            if uid != self._uid:
                sock.close()
                self._refuse("other_user")
                if uid not in self._warned_uids:
                    self._warned_uids.add(uid)
                    log.warning(
                        "kvoffload: refused a connection to the tier's worker socket from pid %d "
                        "of uid %d (the engine runs as uid %d): only the engine's own workers may "
                        "connect; further ones from that user are counted only",
                        pid,
                        uid,
                        self._uid,
                    )
                continue
            sock.setblocking(False)
            conn = _Conn(sock, kind)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, _IN)

    def _read(self, conn: _Conn) -> None:
        bodies, ended = _recv_frames(conn.sock, conn.frames, self._buf)
        for body in bodies:
            if conn.identity is None:
                self._on_hello(conn, body)
                if conn.fd not in self._conns:
                    return
            else:
                self._results.append(body)
        if ended is None:
            return
        if ended != "closed":
            log.warning("kvoffload: a worker connection sent %s; closed", ended)
            self._refuse("bad_frame")
        self._drop(conn)  # (a worker's death is the pool's to handle)

    def _on_hello(self, conn: _Conn, body: bytes) -> None:
        if len(body) < _IDENT.size:
            self._refuse("bad_frame")
            self._drop(conn)
            return
        (n,) = _IDENT.unpack_from(body)
        identity = body[_IDENT.size : _IDENT.size + n]
        key = (conn.kind, identity)
        old = self._by_identity.get(key)
        if old is not None and old.fd in self._conns:
            # One connection per worker: a second one naming a live worker's identity is not it.
            self._refuse("duplicate")
            self._drop(conn)
            return
        conn.identity = identity
        self._by_identity[key] = conn
        self._hellos[conn.kind].append((identity, body[_IDENT.size + n :]))

    def _flush(self, conn: _Conn) -> bool:
        """Send what waited for ``conn``. False when the connection is gone."""
        try:
            n = conn.sock.send(conn.out)
        except BlockingIOError:
            return True
        except OSError:
            self._read_then_drop(conn)
            return False
        del conn.out[:n]
        if not conn.out:
            self._poller.modify(conn.fd, _IN)
        return True

    def _read_then_drop(self, conn: _Conn) -> None:
        """A send to ``conn`` failed (its worker is gone): take the results it sent before it went
        (its last answers, still in the socket), then forget it."""
        if conn.fd in self._conns:
            self._read(conn)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._poller.unregister(conn.fd)
        if conn.identity is not None and self._by_identity.get((conn.kind, conn.identity)) is conn:
            del self._by_identity[(conn.kind, conn.identity)]
        conn.sock.close()

    def _refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1
        if self.on_refused is not None:
            self.on_refused(why)


class WorkerChannels:
    """Worker side: one stream socket to the engine's listening socket of its kind (tasks in, Hello
    and results out). Results are sent by one thread at a time (the worker's loop).

    Args:
        jobs_endpoint: the engine's endpoint for this worker's kind (``@name``).
        identity: this worker's identity (the pool's name for it).

    Raises:
        OSError: the engine's socket cannot be reached.
    """

    def __init__(self, jobs_endpoint: str, identity: bytes):
        self.identity = identity
        self.jobs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.jobs.connect(_address(jobs_endpoint))
        self._frames = _Frames()
        self._tasks: list[bytes] = []
        self._buf = bytearray(_RECV_BYTES)
        self._fd = self.jobs.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, _IN)
        self.engine_gone = False

    def say_hello(self, payload: bytes) -> None:
        """Tell the engine this worker is ready (``payload``: an encoded ``Hello``)."""
        self._send(hello_frame(self.identity, payload))

    def next_task(self, timeout_s: float) -> bytes | None:
        """The next task's bytes, or None after ``timeout_s`` seconds without one."""
        if not self._tasks and self.jobs in self.wait(timeout_s):
            self._fill()
        return self._tasks.pop(0) if self._tasks else None

    def watch(self, fd: int) -> None:
        """Also wake :meth:`wait` when the file descriptor ``fd`` is readable (a wake-up pipe)."""
        self._poller.register(fd, _IN)

    def wait(self, timeout_s: float, tasks: bool = True) -> dict:
        """Wait up to ``timeout_s`` seconds for a task (unless ``tasks`` is False) or a watched
        descriptor; returns what is ready (``self.jobs`` and/or the descriptors, as keys)."""
        if tasks and self._tasks:
            return {self.jobs: select.POLLIN}
        pause = not tasks and not self.engine_gone
        if pause:
            self._poller.modify(self._fd, 0)  # (a hang-up is still reported)
        try:
            ready = self._poller.poll(int(timeout_s * 1000))
        finally:
            if pause and not self.engine_gone:
                self._poller.modify(self._fd, _IN)
        return {self.jobs if fd == self._fd else fd: ev for fd, ev in ready}

    def try_task(self) -> bytes | None:
        """The next task's bytes if one is there now, else None."""
        if not self._tasks:
            self._fill()
        return self._tasks.pop(0) if self._tasks else None

    def send_result(self, payload: bytes) -> None:
        """Send one encoded ``TaskResult`` to the engine (blocks while the engine's side of the
        socket is full; dropped once the engine is gone)."""
        self._send(frame(payload))

    def close(self) -> None:
        """Close the socket at once."""
        self.jobs.close()

    def _send(self, data: bytes) -> None:
        if self.engine_gone:
            return
        try:
            self.jobs.sendall(data)
        except OSError:
            self._gone()

    def _fill(self) -> None:
        """Read what the engine sent, without waiting."""
        if self.engine_gone:
            return
        bodies, ended = _recv_frames(self.jobs, self._frames, self._buf)
        self._tasks.extend(bodies)
        if ended is not None:
            self._gone()

    def _gone(self) -> None:
        """The engine closed its end: no more tasks; :meth:`wait` stops watching the socket (its
        caller notices the engine's death through its own checks)."""
        if not self.engine_gone:
            self.engine_gone = True
            self._poller.unregister(self._fd)


class PeerWorkerChannel:
    """The stream between the p2p tier's engine side and its peer worker process: one end of a
    ``socketpair`` each (:meth:`pair`), the worker's inherited as a file descriptor
    (:meth:`from_fd`). Frames as :class:`TierChannels`'s. The engine's end never blocks (what the
    kernel will not take yet waits here, :attr:`pending_out`, sent by later calls); the worker's
    sends block. Not thread-safe: each end is used by one thread.

    It was a ZMQ PAIR socket until issue 26: each message then woke the sending process's ZMQ I/O
    thread before the receiver (section 7 of docs/profiles/engine.md), on each of the hand-offs a
    p2p fetch makes between the node thread and the worker.
    """

    def __init__(self, sock: socket.socket, blocking: bool):
        self.sock = sock
        sock.setblocking(blocking)
        self._frames = _Frames()
        self._buf = bytearray(_RECV_BYTES)
        self._out = bytearray()
        self._poller: select.poll | None = None  # recv_all's
        self._polled_wake: int | None = None
        #: The other end is gone and everything it sent has been read (the end of the stream).
        self.closed_by_peer = False
        #: A send failed (the other end is gone); what it sent before is still read.
        self.send_failed = False

    @classmethod
    def pair(cls) -> tuple[PeerWorkerChannel, int]:
        """The engine's end, and the worker's end as a file descriptor to pass to the worker
        process (inheritable; close it in the engine once the worker has started)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = theirs.detach()
        os.set_inheritable(fd, True)
        return cls(ours, blocking=False), fd

    @classmethod
    def from_fd(cls, fd: int) -> PeerWorkerChannel:
        """The worker's end, from the descriptor the engine passed."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd)
        os.set_inheritable(fd, False)
        return cls(sock, blocking=True)

    @property
    def fd(self) -> int:
        """The socket's descriptor: readable when a frame (or part of one) waits."""
        return self.sock.fileno()

    @property
    def pending_out(self) -> bool:
        """Bytes wait here for the kernel to take them (watch :attr:`fd` for writing)."""
        return bool(self._out)

    def send(self, payload: bytes) -> bool:
        """Send one frame. False when the other end is gone. The engine's end queues what the
        kernel will not take now and sends it with the next call (or :meth:`flush`)."""
        data = _LEN.pack(len(payload)) + payload
        sock = self.sock
        try:
            if sock.getblocking():
                sock.sendall(data)
                return True
            if self._out:
                self._out += data
                return self.flush()
            n = sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.send_failed = True
            return False
        if n < len(data):
            self._out += data[n:]
        return True

    def flush(self) -> bool:
        """Send what waited (the engine's end). False when the other end is gone."""
        if not self._out:
            return True
        try:
            n = self.sock.send(self._out)
        except BlockingIOError:
            return True
        except OSError:
            self.send_failed = True
            return False
        del self._out[:n]
        return True

    def recv_ready(self) -> list[bytes]:
        """The frames complete now, in order, those the other end sent before it went away
        included. Never blocks."""
        if self._out and not self.send_failed:
            self.flush()
        if self.closed_by_peer:
            return []
        bodies, ended = _recv_frames(self.sock, self._frames, self._buf, self.send_failed)
        if ended is not None:
            if ended != "closed":
                log.error("kvoffload p2p: the peer worker channel carried %s; closed", ended)
            self._hung_up()
        return bodies

    def recv_all(self, timeout_s: float, wake_fd: int | None = None) -> list[bytes]:
        """Wait up to ``timeout_s`` seconds for a frame, or with ``wake_fd`` until that file
        descriptor is readable (the worker's transport finished something), then take every
        complete frame (none when woken by ``wake_fd`` alone)."""
        if self._poller is None or self._polled_wake != wake_fd:
            self._poller = select.poll()
            self._polled_wake = wake_fd
            if not self.closed_by_peer:
                self._poller.register(self.fd, _IN)
            if wake_fd is not None:
                self._poller.register(wake_fd, _IN)
        self._poller.poll(max(1, round(timeout_s * 1000)))
        return self.recv_ready()

    def _hung_up(self) -> None:
        """The other end is gone: :meth:`recv_all` stops watching the socket (a hang-up would
        wake it at once, every time)."""
        self.closed_by_peer = True
        if self._poller is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(self.fd)

    def close(self) -> None:
        """Close this end (the other sees the end of the stream after what was sent)."""
        self.sock.close()
