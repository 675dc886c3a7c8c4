"""Bulk bytes between two instances' host arenas: one-sided READ and WRITE of whole slots.

::

    instance A (peer worker)                                       instance B (peer worker)
    ┌──────────── Transport ────────────┐   descriptor() bytes   ┌──────────── Transport ────────────┐
    │ arena A (registered/served once)  │ ◀── control channel ──▶│ arena B (registered/served once)  │
    │ read("B", [(rb, la), ...])  ──────┼──── rows rb of B ─────▶│ (NIXL: no CPU of B involved where │
    │ write("B", [(la, rb), ...]) ──────┼──── rows la of A ─────▶│  the fabric allows; TCP: B's      │
    │ poll(handle) -> TransferStatus    │                        │  server thread sends/receives)    │
    └───────────────────────────────────┘                        └───────────────────────────────────┘

A :class:`Transport` wraps the local arena of one peer worker process (the process that maps the host
arena, see ``ipc/arena.py`` and ``workers/main.py``). :meth:`Transport.descriptor` is what another
instance needs to reach this one; the p2p tier hands it over its control channel *after* the peers
authenticated each other (it carries a NIXL agent's metadata or a TCP endpoint plus a random access
token, either of which grants access to the whole arena). :meth:`Transport.add_peer` takes a peer's
descriptor; :meth:`Transport.read` copies peer rows into local rows and :meth:`Transport.write` local
rows into peer rows the peer reserved. Both return at once with a handle; :meth:`Transport.poll` says
pending / done / failed. Which slots a peer may touch is decided by the control channel (leases, write
admission): the transport checks only that every slot exists on both sides.

Two implementations, chosen by :class:`TransportConfig` ``kind``:

- ``"nixl"`` (:class:`NixlTransport`): the arena is registered once with a NIXL agent (UCX backend,
  ``DRAM`` memory); a transfer is one prepared NIXL request over per-slot descriptor lists. UCX takes
  RDMA where the hardware has it, shared memory / CMA between processes of one host, TCP otherwise.
- ``"tcp"`` (:class:`TcpTransport`): a server thread answers read requests by ``sendall`` straight from
  the arena rows and receives writes with ``recv_into`` straight into them (no staging copy). Frames are
  a 4-byte little-endian length and a msgpack header (:class:`TcpRequest` / :class:`TcpReply`), each
  size- and schema-checked before anything is sent or written. A connection starts with the access
  token from the server's descriptor; a wrong token closes it.
- ``"auto"``: NIXL when it can be imported and its UCX backend starts, else TCP.

Liveness. Every transfer has a deadline (``deadline_s``, default 2 s). A transfer that fails — deadline
passed, connection lost, peer process gone — marks its peer *down*: every other pending transfer to that
peer fails with it, and new transfers to it raise :class:`PeerDownError` until the peer is removed and
added again with a fresh descriptor (a restarted peer has a new one anyway). Transfers to other peers
run on their own connections (TCP: one thread per peer) or their own UCX endpoints and are not delayed.

Settling. A failed transfer may still touch its *local* slots afterwards when the peer is slow rather
than dead: a UCX READ over TCP whose handle was released (NIXL's cancel) at its deadline was seen to land
its bytes once the stopped peer resumed, and so did one whose remote agent was removed (NIXL then even
reports the request as an error). :class:`TransferStatus` therefore carries ``settled``: True once the
transport will never again touch the transfer's local slots. The p2p tier must keep local slots
reserved until ``settled``. TCP transfers are settled when they fail (their I/O thread has stopped);
NIXL transfers settle when UCX itself finishes or errors the request (the peer answers late, or its
process is gone), so :class:`NixlTransport` neither releases their handles nor unloads their peer's
agent before that. A handle is forgotten after :meth:`Transport.poll` returned a settled final status.

Exposure. The TCP server binds ``host`` (loopback by default) and serves only connections that present
the token from its descriptor (compared in constant time; refusals are counted in ``refused``); the
token travels in clear text, as do the rows. A NIXL agent's UCX back-end listens on every network device
of the machine (seen: loopback and the machine's address, each on an ephemeral port) and serves anyone
holding the agent's metadata; restrict it with ``UCX_NET_DEVICES`` where that matters. Either descriptor
must therefore travel only over the p2p tier's authenticated control channel.

Torch. ``import nixl`` (1.5.1) imports torch where torch has no CUDA (its back-end chooser falls back
to ``import torch`` to learn the CUDA version). Measured on the 2-vCPU CI machine (torch 2.13.0+cpu), a
process that creates an arena and a :class:`NixlTransport`: through ``import nixl`` 2.3-7.0 s and
248 MiB RSS; through this module's import 0.9-1.2 s and 61 MiB (an arena alone: 30 MiB). So this module
imports the back-end wheel's API (``nixl_cu13._api`` / ``nixl_cu12._api`` / ``nixl_rocm._api``)
directly, choosing the CUDA major version from torch's ``version.py`` read off disk, never importing
torch (``tests/test_p2p_transport.py`` checks ``/proc/<pid>/maps`` and ``sys.modules`` of a peer process
after a NIXL transfer). When torch is already imported it uses the ``nixl`` package as is.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import hmac
import importlib
import importlib.util
import itertools
import os
import queue
import re
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import msgspec
from typing_extensions import override

from kvoffload.ipc.arena import Arena

#: Default per-transfer deadline (seconds): the issue's liveness bound for a silent peer.
DEFAULT_DEADLINE_S = 2.0
#: Largest descriptor :meth:`Transport.add_peer` accepts (bytes); NIXL agent metadata is a few KiB.
MAX_DESCRIPTOR_BYTES = 1 << 20
#: Largest TCP header frame (bytes): a request of 65,536 slots is ~200 KiB of msgpack.
MAX_HEADER_BYTES = 1 << 20
#: Most slots in one transfer.
MAX_PAIRS = 65536
_LEN = struct.Struct("<I")
_TOKEN_BYTES = 32
_SOCK_BUF_BYTES = 4 << 20


class TransportError(RuntimeError):
    """A transport could not be created, or a peer descriptor is unusable."""


class PeerDownError(TransportError):
    """The named peer is unknown or marked down (a transfer to it failed); re-add it to retry."""


class TransferState(enum.Enum):
    """Where a transfer is: still moving, all bytes in place, or given up."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """What :meth:`Transport.poll` reports for one transfer.

    ``reason`` says why a transfer failed (empty otherwise). ``settled`` is True once the transport will
    never touch the transfer's local slots again: always for DONE and for every TCP failure; a NIXL
    failure may be unsettled until UCX finishes or errors the request (keep its local slots reserved
    and poll again). PENDING is never settled.
    """

    state: TransferState
    reason: str = ""
    settled: bool = True


class TransportConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How a peer worker moves bulk bytes.

    Attributes:
        kind: ``"nixl"``, ``"tcp"`` or ``"auto"`` (NIXL when importable and its backend starts).
        host: TCP: the address the data server binds (loopback unless told otherwise).
        port: TCP: the data server's port; 0 picks a free one.
        advertise_host: TCP: the address put in the descriptor; defaults to ``host`` (or the host
            name when ``host`` is ``0.0.0.0``).
        deadline_s: default per-transfer deadline (seconds).
        nixl_backends: NIXL backends to instantiate (``["UCX"]``).
    """

    kind: Literal["nixl", "tcp", "auto"] = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    deadline_s: float = DEFAULT_DEADLINE_S
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"transport deadline_s must be > 0 seconds, got {self.deadline_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transport port must be 0-65535, got {self.port}")


# -- descriptors (exchanged over the authenticated control channel) -------------------------------


class NixlDescriptor(msgspec.Struct, tag="nixl", forbid_unknown_fields=True, frozen=True):
    """Reaches a :class:`NixlTransport`: its agent's metadata and the arena's shape and address."""

    agent_metadata: bytes
    base_address: int
    num_slots: int
    row_bytes: int


class TcpDescriptor(msgspec.Struct, tag="tcp", forbid_unknown_fields=True, frozen=True):
    """Reaches a :class:`TcpTransport`: its data server's endpoint and access token."""

    host: str
    port: int
    token: bytes
    num_slots: int
    row_bytes: int


Descriptor = NixlDescriptor | TcpDescriptor
_descriptor_decoder = msgspec.msgpack.Decoder(Descriptor)
_encoder = msgspec.msgpack.Encoder()


def decode_descriptor(raw: bytes) -> Descriptor:
    """Parse a peer descriptor (msgpack of :class:`NixlDescriptor` or :class:`TcpDescriptor`).

    Raises:
        TransportError: too large, malformed, or an impossible shape.
    """
    if len(raw) > MAX_DESCRIPTOR_BYTES:
        raise TransportError(f"peer descriptor is {len(raw)} bytes, over {MAX_DESCRIPTOR_BYTES}")
    try:
        desc = _descriptor_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise TransportError(f"malformed peer descriptor: {e}") from None
    if desc.num_slots <= 0 or desc.row_bytes <= 0:
        raise TransportError(
            f"peer descriptor has an impossible arena shape ({desc.num_slots}, {desc.row_bytes})"
        )
    return desc


# -- the interface ----------------------------------------------------------------------------------


Pairs = Sequence[tuple[int, int]]
Op = Literal["read", "write"]
_D = TypeVar("_D", NixlDescriptor, TcpDescriptor)


class Transport(abc.ABC):
    """Bulk transfers between the local arena and peers' arenas (whole slots)."""

    kind: str
    arena: Arena
    #: Why this transport runs (set by :func:`make_transport`): ``configured``, or for ``auto``
    #: the reason NIXL was or was not taken.
    choice: str = "configured"

    @abc.abstractmethod
    def descriptor(self) -> bytes:
        """What a peer passes to :meth:`add_peer` to reach this side (msgpack bytes, < 1 MiB).
        Grants access to the whole arena: send it only over an authenticated channel."""

    @abc.abstractmethod
    def add_peer(self, name: str, descriptor: bytes) -> None:
        """Make peer ``name`` reachable (replaces a down peer of that name).

        Raises:
            TransportError: malformed descriptor, another transport kind, a different row size, or
                ``name`` is already up.
        """

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget peer ``name``; its pending transfers fail (``reason`` "peer removed"). Their local
        slots are free once :meth:`poll` reports them settled (NIXL may need the peer to answer)."""

    def peer_up(self, name: str) -> bool:
        """True when ``name`` was added and no transfer to it has failed since."""
        with self._lock:
            peer = self._peers.get(name)
        return peer is not None and not peer.down

    def read(self, peer: str, pairs: Pairs, deadline_s: float | None = None) -> int:
        """Copy the peer's rows into local rows: ``pairs`` = ``[(remote_slot, local_slot), ...]``.

        ``deadline_s``: seconds until the transfer fails if not done (default: the config's).
        Returns a handle for :meth:`poll`. Raises ``ValueError`` (nothing moved) for an empty or too
        long list, a slot outside either arena, a local slot named twice or a deadline <= 0;
        :class:`PeerDownError` for an unknown or down peer.
        """
        return self._submit(peer, "read", pairs, deadline_s)

    def write(self, peer: str, pairs: Pairs, deadline_s: float | None = None) -> int:
        """Copy local rows into the peer's rows: ``pairs`` = ``[(local_slot, remote_slot), ...]``.

        Same checks as :meth:`read` (a remote slot named twice is refused)."""
        return self._submit(peer, "write", pairs, deadline_s)

    @abc.abstractmethod
    def _submit(self, peer: str, op: Op, pairs: Pairs, deadline_s: float | None) -> int:
        """Start a transfer of ``op`` (see :meth:`read`, :meth:`write`); returns its handle."""

    @abc.abstractmethod
    def poll(self, handle: int) -> TransferStatus:
        """State of a transfer; never blocks. After a settled DONE/FAILED the handle is forgotten
        and polling it again raises ``KeyError``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail every pending transfer, stop threads, release registrations. Idempotent."""

    # What both transports keep: ``_lock`` guards ``_peers`` (name -> peer with ``down`` and
    # ``desc``) and ``_closed``.
    _lock: threading.Lock
    _peers: dict[str, Any]
    _closed: bool

    def _peer_descriptor(self, name: str, descriptor: bytes, kind: type[_D]) -> _D:
        """Peer ``name``'s descriptor, decoded and checked: this transport's kind and this arena's
        row size (TransportError otherwise)."""
        desc = decode_descriptor(descriptor)
        if not isinstance(desc, kind):
            raise TransportError(
                f"peer {name!r} offers a {type(desc).__name__.removesuffix('Descriptor').lower()} "
                f"descriptor; this side runs {self.kind}"
            )
        if desc.row_bytes != self.arena.row_bytes:
            raise TransportError(
                f"peer {name!r} has {desc.row_bytes}-byte slots, this arena "
                f"{self.arena.row_bytes}-byte slots"
            )
        return desc

    def _replaced_peer(self, name: str) -> Any:
        """Caller holds the lock: the down peer that a new ``name`` replaces, or None.

        Raises:
            TransportError: ``name`` is up.
        """
        old = self._peers.get(name)
        if old is not None and not old.down:
            raise TransportError(f"peer {name!r} is already up; remove it first")
        return old

    def _checked(self, peer: str, op: Op, pairs: Pairs) -> tuple[Any, list[int], list[int]]:
        """Caller holds the lock: the live peer ``peer`` and ``pairs`` split into (local slots,
        remote slots), validated (see :meth:`read`)."""
        if self._closed:
            raise TransportError("transport is closed")
        p = self._peers.get(peer)
        if p is None or p.down:
            raise PeerDownError(f"peer {peer!r} is {'down' if p else 'unknown'}")
        local, remote = _check_pairs(
            pairs, self.arena.num_slots, p.desc.num_slots, 1 if op == "read" else 0, peer
        )
        return p, local, remote


def _deadline(deadline_s: float | None, default_s: float) -> float:
    """Monotonic time at which a transfer started now fails (``deadline_s`` seconds, or the default)."""
    if deadline_s is None:
        deadline_s = default_s
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s}")
    return time.monotonic() + deadline_s


def _check_pairs(
    pairs: Pairs, local_slots: int, remote_slots: int, local_pos: int, peer: str
) -> tuple[list[int], list[int]]:
    """Split ``pairs`` into (local slots, remote slots), validated. ``local_pos`` is 0 or 1."""
    n = len(pairs)
    if n == 0:
        raise ValueError("transfer has no slot pairs")
    if n > MAX_PAIRS:
        raise ValueError(f"transfer has {n} slot pairs, over {MAX_PAIRS}")
    local: list[int] = []
    remote: list[int] = []
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"slot pair {pair!r} is not (slot, slot)")
        lo, re_ = int(pair[local_pos]), int(pair[1 - local_pos])
        if not 0 <= lo < local_slots:
            raise ValueError(f"local slot {lo} is outside the arena (0..{local_slots - 1})")
        if not 0 <= re_ < remote_slots:
            raise ValueError(
                f"peer {peer!r} slot {re_} is outside its arena (0..{remote_slots - 1})"
            )
        local.append(lo)
        remote.append(re_)
    dest = local if local_pos == 1 else remote
    if len(set(dest)) != n:
        side = "local" if local_pos == 1 else f"peer {peer!r}"
        raise ValueError(f"a {side} destination slot is named twice in one transfer")
    return local, remote


# -- plain TCP --------------------------------------------------------------------------------------


class TcpHello(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """First frame of a data connection: the token from the server's :class:`TcpDescriptor`."""

    token: bytes


class TcpRequest(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One transfer on a data connection. ``op`` "read": the server sends ``slots`` rows in order
    after an OK reply; "write": the client sends ``slots`` rows right after this frame."""

    op: Op
    xfer_id: int
    slots: list[int]


class TcpReply(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The server's answer to a :class:`TcpRequest` (``error`` empty when OK). A write is answered
    after its rows are in the arena; an error closes the connection."""

    xfer_id: int
    error: str = ""


_hello_decoder = msgspec.msgpack.Decoder(TcpHello)
_request_decoder = msgspec.msgpack.Decoder(TcpRequest)
_reply_decoder = msgspec.msgpack.Decoder(TcpReply)


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the other side")
        got += k


def _send_frame(sock: socket.socket, obj: msgspec.Struct, deadline: float) -> None:
    body = _encoder.encode(obj)
    _sendall_deadline(sock, memoryview(_LEN.pack(len(body)) + body), deadline)


def _recv_frame(sock: socket.socket, deadline: float | None) -> bytes:
    head = bytearray(_LEN.size)
    _recv_exact_into(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"header frame of {n} bytes, over {MAX_HEADER_BYTES}")
    body = bytearray(n)
    _recv_exact_into(sock, memoryview(body), deadline)
    return bytes(body)


def _sendall_deadline(sock: socket.socket, view: memoryview, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    sock.sendall(view)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF_BYTES)


class _TcpServer:
    """Serves the local arena: one thread accepts, one thread per connection answers requests.

    Counts refused connections (bad token or malformed frames) in ``refused``. A connection that
    stalls in the middle of a frame for ``stall_s`` seconds is closed.
    """

    def __init__(self, arena: Arena, host: str, port: int, token: bytes, stall_s: float):
        self.arena = arena
        self.token = token
        self.stall_s = stall_s
        self.refused = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopping = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept_loop, name="p2p-tcp-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
            _tune(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="p2p-tcp-serve", daemon=True
            ).start()

    def _refuse(self) -> None:
        with self._lock:
            self.refused += 1

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                hello = _hello_decoder.decode(_recv_frame(conn, time.monotonic() + self.stall_s))
            except (ValueError, msgspec.DecodeError, OSError):
                self._refuse()
                return
            if not hmac.compare_digest(hello.token, self.token):
                self._refuse()
                return
            rows = self.arena.rows
            while True:
                conn.settimeout(None)  # idle between requests is fine
                head = bytearray(_LEN.size)
                try:
                    k = conn.recv_into(head, _LEN.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if k < _LEN.size:
                    return  # closed by the client
                (n,) = _LEN.unpack(head)
                deadline = time.monotonic() + self.stall_s
                if n > MAX_HEADER_BYTES:
                    self._refuse()
                    return
                body = bytearray(n)
                _recv_exact_into(conn, memoryview(body), deadline)
                try:
                    req = _request_decoder.decode(body)
                except msgspec.DecodeError as e:
                    self._refuse()
                    with contextlib.suppress(OSError):
                        _send_frame(conn, TcpReply(0, f"malformed request: {e}"), deadline)
                    return
                error = self._check(req)
                if error:
                    self._refuse()
                    with contextlib.suppress(OSError):
                        _send_frame(conn, TcpReply(req.xfer_id, error), deadline)
                    return
                if req.op == "read":
                    _send_frame(conn, TcpReply(req.xfer_id), deadline)
                    for s in req.slots:
                        # the deadline is per row: a slow but moving client is not cut off
                        _sendall_deadline(
                            conn, memoryview(rows[s]), time.monotonic() + self.stall_s
                        )
                else:
                    for s in req.slots:
                        _recv_exact_into(conn, memoryview(rows[s]), time.monotonic() + self.stall_s)
                    _send_frame(conn, TcpReply(req.xfer_id), time.monotonic() + self.stall_s)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check(self, req: TcpRequest) -> str:
        n = self.arena.num_slots
        if not req.slots or len(req.slots) > MAX_PAIRS:
            return f"request names {len(req.slots)} slots (1..{MAX_PAIRS} allowed)"
        bad = next((s for s in req.slots if not 0 <= s < n), None)
        if bad is not None:
            return f"slot {bad} is outside the arena (0..{n - 1})"
        if req.op == "write" and len(set(req.slots)) != len(req.slots):
            return "a write names a slot twice"
        return ""

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


@dataclass(slots=True)
class _Xfer:
    xid: int
    peer: str
    op: Op
    local: list[int]
    remote: list[int]
    deadline: float
    status: TransferStatus = TransferStatus(TransferState.PENDING, settled=False)
    started: bool = False


class _TcpPeer:
    """One peer's connection and the thread that runs its transfers in order."""

    def __init__(self, owner: TcpTransport, name: str, desc: TcpDescriptor):
        self.owner = owner
        self.name = name
        self.desc = desc
        self.queue: queue.SimpleQueue[_Xfer | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.down = False
        self.thread = threading.Thread(target=self._run, name=f"p2p-tcp-{name}", daemon=True)
        self.thread.start()

    def _connect(self, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed before connecting")
        sock = socket.create_connection((self.desc.host, self.desc.port), timeout=left)
        _tune(sock)
        _send_frame(sock, TcpHello(self.desc.token), deadline)
        return sock

    def _run(self) -> None:
        while True:
            x = self.queue.get()
            if x is None:
                break
            if not self.owner._start(x):
                continue  # failed while queued (deadline, peer removed)
            if self.down:
                self.owner._finish(x, TransferState.FAILED, "peer is down")
                continue
            try:
                self._transfer(x)
                self.owner._finish(x, TransferState.DONE)
            except (OSError, ValueError, msgspec.DecodeError) as e:
                why = (
                    "deadline passed" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                )
                self._mark_down()
                self.owner._finish(x, TransferState.FAILED, why)
            except Exception as e:  # a bug must fail the transfer, not leave it pending forever
                self._mark_down()
                self.owner._finish(x, TransferState.FAILED, f"unexpected {type(e).__name__}: {e}")
        if self.sock is not None:
            self.sock.close()

    def _mark_down(self) -> None:
        self.down = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _transfer(self, x: _Xfer) -> None:
        if self.sock is None:
            self.sock = self._connect(x.deadline)
        sock = self.sock
        rows = self.owner.arena.rows
        _send_frame(sock, TcpRequest(x.op, x.xid, x.remote), x.deadline)
        if x.op == "write":
            for s in x.local:
                _sendall_deadline(sock, memoryview(rows[s]), x.deadline)
        reply = _reply_decoder.decode(_recv_frame(sock, x.deadline))
        if reply.error or reply.xfer_id != x.xid:
            raise ValueError(f"peer refused the transfer: {reply.error or 'wrong transfer id'}")
        if x.op == "read":
            for s in x.local:
                _recv_exact_into(sock, memoryview(rows[s]), x.deadline)

    def kill(self) -> None:
        """Unblock the thread (shut the socket down) and stop it after the current transfer."""
        self.down = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.queue.put(None)


class TcpTransport(Transport):
    """:class:`Transport` over plain TCP sockets (see the module docstring for the wire format)."""

    kind = "tcp"

    def __init__(self, arena: Arena, config: TransportConfig | None = None):
        self.config = config or TransportConfig(kind="tcp")
        self.arena = arena
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        self.server = _TcpServer(
            arena, self.config.host, self.config.port, self._token, self.config.deadline_s
        )
        host = self.config.advertise_host or self.config.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        self._advertise = host
        self._lock = threading.Lock()
        self._peers: dict[str, _TcpPeer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def refused(self) -> int:
        """Data connections or requests refused by this side's server (bad token, bad frame)."""
        return self.server.refused

    @override
    def descriptor(self) -> bytes:
        return _encoder.encode(
            TcpDescriptor(
                self._advertise,
                self.server.port,
                self._token,
                self.arena.num_slots,
                self.arena.row_bytes,
            )
        )

    @override
    def add_peer(self, name: str, descriptor: bytes) -> None:
        desc = self._peer_descriptor(name, descriptor, TcpDescriptor)
        with self._lock:
            old = self._replaced_peer(name)
            self._peers[name] = _TcpPeer(self, name, desc)
        if old is not None:
            old.kill()

    @override
    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            doomed = [x for x in self._xfers.values() if x.peer == name]
        if peer is None:
            return
        peer.kill()
        peer.thread.join()
        for x in doomed:  # the thread is gone: nothing touches their slots any more
            self._finish(x, TransferState.FAILED, "peer removed")

    @override
    def _submit(self, peer: str, op: Op, pairs: Pairs, deadline_s: float | None) -> int:
        with self._lock:
            p, local, remote = self._checked(peer, op, pairs)
            x = _Xfer(
                next(self._ids),
                peer,
                op,
                local,
                remote,
                _deadline(deadline_s, self.config.deadline_s),
            )
            self._xfers[x.xid] = x
        p.queue.put(x)
        return x.xid

    def _start(self, x: _Xfer) -> bool:
        with self._lock:
            if x.status.state is not TransferState.PENDING:
                return False
            x.started = True
            return True

    def _finish(self, x: _Xfer, state: TransferState, reason: str = "") -> None:
        with self._lock:
            if x.status.state is TransferState.PENDING:
                x.status = TransferStatus(state, reason)

    @override
    def poll(self, handle: int) -> TransferStatus:
        with self._lock:
            x = self._xfers[handle]
            if (
                x.status.state is TransferState.PENDING
                and not x.started
                and time.monotonic() > x.deadline
            ):
                # Still queued behind another transfer to the same peer: its thread never touched
                # this one's slots and will skip it.
                x.status = TransferStatus(TransferState.FAILED, "deadline passed while queued")
            st = x.status
            if st.state is not TransferState.PENDING:
                del self._xfers[handle]
            return st

    @override
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.kill()
        for p in peers:
            p.thread.join()
        with self._lock:
            for x in self._xfers.values():
                if x.status.state is TransferState.PENDING:
                    x.status = TransferStatus(TransferState.FAILED, "transport closed")
        self.server.close()


# -- NIXL -------------------------------------------------------------------------------------------


def _torch_cuda_major_on_disk() -> int | None:
    """CUDA major version of the installed torch, read from ``torch/version.py`` without importing
    torch; None for a CPU build or no torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "version.py"
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)\.", text, re.M)
        return int(m.group(1)) if m else None
    return None


def import_nixl_api() -> Any:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``), imported torch-free.

    Raises:
        ImportError: no NIXL back-end wheel can be imported.
    """
    if "torch" in sys.modules or "nixl._api" in sys.modules:
        import nixl  # torch is paid for already: the package's own chooser is free

        return nixl._api
    major = _torch_cuda_major_on_disk()
    names = [f"nixl_cu{major}"] if major else ["nixl_cu13", "nixl_cu12", "nixl_rocm"]
    errors = []
    for name in names:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as e:  # missing wheel, or its native libraries cannot load
            errors.append(f"{name}: {e}")
    raise ImportError("no NIXL back-end importable (" + "; ".join(errors) + ")")


def nixl_available() -> str:
    """Empty when NIXL imports torch-free; else why not (for skip messages and ``auto``)."""
    try:
        import_nixl_api()
    except ImportError as e:
        return str(e)
    return ""


@dataclass(slots=True)
class _NixlPeer:
    name: str
    agent_name: str
    desc: NixlDescriptor
    remote_side: Any
    down: bool = False
    removed: bool = False  # removed while it had unsettled transfers: its agent stays loaded


@dataclass(slots=True)
class _NixlXfer:
    peer: _NixlPeer
    handle: Any
    deadline: float
    failed: str = ""


_nixl_agents_made = False
"""True once this process made a NIXL agent (see :func:`exit_process`)."""


def note_nixl_agent() -> None:
    """Record that this process made a NIXL agent through another library (vLLM's p2p tier, say),
    so that :func:`exit_process` skips the interpreter's finalization here too."""
    global _nixl_agents_made
    _nixl_agents_made = True


def nixl_agent_made() -> bool:
    """Whether this process made a NIXL agent (ours, or one noted by :func:`note_nixl_agent`)."""
    return _nixl_agents_made


def exit_process(status: int) -> NoReturn:
    """End this process with exit ``status``.

    Where a NIXL agent was made, the interpreter's finalization is skipped (stdio and logging are
    flushed, then ``os._exit``): with NIXL 1.5.1 a process that made a UCX agent dies of SIGSEGV
    at exit, whether or not the agent was released first, which would turn every clean exit into
    a crash (exit status -11 / 139).
    """
    if _nixl_agents_made:
        import logging

        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        logging.shutdown()
        os._exit(status)
    sys.exit(status)


class NixlTransport(Transport):
    """:class:`Transport` over a NIXL agent (UCX backend) with the arena registered once as DRAM.

    Registration: one region ``(base, num_slots * row_bytes, 0, "")``; transfer descriptor lists of one
    ``(address, row_bytes, 0)`` entry per slot are prepared once per side (local, and per peer), so a
    transfer is ``make_prepped_xfer`` with slot numbers as indices. The agent runs NIXL's progress
    thread, so this side serves peers' one-sided operations without calls from its owner.
    """

    kind = "nixl"

    def __init__(self, arena: Arena, config: TransportConfig | None = None):
        self.config = config or TransportConfig(kind="nixl")
        self.arena = arena
        api = import_nixl_api()
        self._name = f"kvoffload-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        global _nixl_agents_made
        _nixl_agents_made = True  # set before: a failed start may have made one too
        try:
            self.agent = api.nixl_agent(
                self._name, api.nixl_agent_config(backends=list(self.config.nixl_backends))
            )
        except Exception as e:  # NIXL raises its own exception types
            raise TransportError(f"NIXL agent could not start: {e}") from e
        missing = [b for b in self.config.nixl_backends if b not in self.agent.backends]
        if missing:
            raise TransportError(f"NIXL backends {missing} are not available on this machine")
        rows = arena.rows
        self._base = rows.ctypes.data
        nbytes = arena.num_slots * arena.row_bytes
        self._reg = self.agent.register_memory([(self._base, nbytes, 0, "")], mem_type="DRAM")
        self._local_side = self.agent.prep_xfer_dlist("", self._slot_descs(self._base), "DRAM")
        self._lock = threading.Lock()
        self._peers: dict[str, _NixlPeer] = {}
        self._retired: list[_NixlPeer] = []  # removed, some transfers unsettled
        self._xfers: dict[int, _NixlXfer] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def _slot_descs(self, base: int, num_slots: int | None = None) -> Any:
        import numpy as np

        n = self.arena.num_slots if num_slots is None else num_slots
        row = self.arena.row_bytes
        descs = np.zeros((n, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(row)
        descs[:, 1] = row
        return descs

    @override
    def descriptor(self) -> bytes:
        return _encoder.encode(
            NixlDescriptor(
                self.agent.get_agent_metadata(),
                self._base,
                self.arena.num_slots,
                self.arena.row_bytes,
            )
        )

    @override
    def add_peer(self, name: str, descriptor: bytes) -> None:
        desc = self._peer_descriptor(name, descriptor, NixlDescriptor)
        with self._lock:
            old = self._replaced_peer(name)
        if old is not None:
            self.remove_peer(name)
        with self._lock:
            if any(p.desc.agent_metadata == desc.agent_metadata for p in self._retired):
                # The same incarnation with requests UCX still runs: NIXL would refuse or replace
                # the agent under them.
                raise TransportError(
                    f"peer {name!r} still has unsettled transfers; poll them until settled first"
                )
        try:
            agent_name = self.agent.add_remote_agent(desc.agent_metadata)
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            remote_side = self.agent.prep_xfer_dlist(
                agent_name, self._slot_descs(desc.base_address, desc.num_slots), "DRAM"
            )
        except Exception as e:
            raise TransportError(f"peer {name!r}: NIXL refused its metadata: {e}") from e
        with self._lock:
            self._peers[name] = _NixlPeer(name, agent_name, desc, remote_side)

    @override
    def remove_peer(self, name: str) -> None:
        """Forget peer ``name``. Its transfers fail at once; while any is unsettled the peer's NIXL
        agent stays loaded (removing it makes NIXL report those requests as errors although UCX may
        still complete them into local slots), and is dropped when the last one settles."""
        with self._lock:
            peer = self._peers.pop(name, None)
            if peer is None:
                return
            peer.down = True
            mine = [x for x in self._xfers.values() if x.peer is peer]
            for x in mine:
                x.failed = x.failed or "peer removed"
            if mine:
                peer.removed = True
                self._retired.append(peer)
                return
        self._drop(peer)

    def _drop(self, peer: _NixlPeer) -> None:
        with contextlib.suppress(Exception):
            peer.remote_side.release()
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(peer.agent_name)

    @override
    def _submit(self, peer: str, op: Op, pairs: Pairs, deadline_s: float | None) -> int:
        with self._lock:
            p, local, remote = self._checked(peer, op, pairs)
            xid = next(self._ids)
            deadline = _deadline(deadline_s, self.config.deadline_s)
            try:
                handle = self.agent.make_prepped_xfer(
                    op.upper(), self._local_side, local, p.remote_side, remote
                )
            except Exception as e:
                self._mark_down(p, f"NIXL refused the transfer: {e}")
                raise PeerDownError(f"peer {peer!r}: NIXL refused the transfer: {e}") from e
            x = _NixlXfer(p, handle, deadline)
            self._xfers[xid] = x
            try:
                state = self.agent.transfer(handle)
            except Exception as e:  # e.g. nixlRemoteDisconnectError
                state, why = "ERR", f"{type(e).__name__}: {e}"
            else:
                why = "NIXL reported an error posting the transfer"
            if state == "ERR":
                x.failed = why
                self._mark_down(p, why)
        return xid

    def _mark_down(self, peer: _NixlPeer, why: str) -> None:
        """Caller holds the lock. Fails every pending transfer to ``peer``."""
        peer.down = True
        for x in self._xfers.values():
            if x.peer is peer and not x.failed:
                x.failed = f"peer is down ({why})"

    @override
    def poll(self, handle: int) -> TransferStatus:
        with self._lock:
            x = self._xfers[handle]
            try:
                state = self.agent.check_xfer_state(x.handle)
            except Exception as e:  # nixlRemoteDisconnectError and kin
                state = "ERR"
                if not x.failed:
                    x.failed = f"{type(e).__name__}: {e}"
            if state == "PROC" and not x.failed and time.monotonic() > x.deadline:
                x.failed = "deadline passed"
            if state == "ERR" and not x.failed:
                x.failed = "NIXL reported a transfer error"
            if x.failed and state != "DONE":
                self._mark_down(x.peer, x.failed)
            if state == "PROC":
                if x.failed:
                    return TransferStatus(TransferState.FAILED, x.failed, settled=False)
                return TransferStatus(TransferState.PENDING, settled=False)
            # DONE or ERR: UCX is finished with the request, its local slots are settled
            with contextlib.suppress(Exception):
                x.handle.release()
            del self._xfers[handle]
            last = x.peer.removed and not any(y.peer is x.peer for y in self._xfers.values())
            if last:
                self._retired.remove(x.peer)
        if last:
            self._drop(x.peer)
        if state == "DONE" and not x.failed:
            return TransferStatus(TransferState.DONE)
        return TransferStatus(TransferState.FAILED, x.failed)

    @override
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            xfers = list(self._xfers.values())
            self._xfers.clear()
            peers = list(self._peers.values()) + self._retired
            self._peers.clear()
            self._retired = []
        for x in xfers:  # asks UCX to cancel; an unsettled request may still land (see above)
            with contextlib.suppress(Exception):
                x.handle.release()
        for p in peers:
            self._drop(p)
        with contextlib.suppress(Exception):
            self._local_side.release()
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


# -- choice ------------------------------------------------------------------------------------------


def make_transport(arena: Arena, config: TransportConfig | None = None) -> Transport:
    """The transport ``config.kind`` names over ``arena`` (``auto``: NIXL when it imports and its
    backend starts, else TCP).

    Raises:
        TransportError: ``kind`` "nixl" and NIXL cannot start (the reason is in the message).
    """
    config = config or TransportConfig()
    if config.kind == "tcp":
        return TcpTransport(arena, config)
    why = nixl_available()
    if not why:
        try:
            nixl = NixlTransport(arena, config)
        except TransportError as e:
            why = str(e)
        else:
            if config.kind == "auto":
                nixl.choice = "auto: NIXL imports and its UCX back end started"
            return nixl
    if config.kind == "nixl":
        raise TransportError(f"transport 'nixl' cannot start: {why}")
    tcp = TcpTransport(arena, config)
    tcp.choice = f"auto: NIXL cannot run here ({why})"
    return tcp
