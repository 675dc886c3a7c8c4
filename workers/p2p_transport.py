"""Bulk bytes between two instances' host arenas: one-sided READs of whole slots a peer granted.

::

    instance A (peer worker, reader)                               instance B (peer worker, server)
    ┌──────────── Transport ────────────┐   descriptor, session   ┌──────────── Transport ────────────┐
    │ add_peer("B", desc, token)        │ ◀─ token: the control ─▶│ add_session(token)                │
    │                                   │    channel (Welcome)    │ grant(gid, token, slots, until)   │
    │                                   │ ◀── digests, lifetime ──│   -> digests (xxh3-128 per slot)  │
    │ read("B", [(rb, la), ...],        │                         │                                   │
    │      digests, not_after) ─────────┼──── rows rb of B ──────▶│ (TCP: served only while a live    │
    │ poll(handle) -> TransferStatus    │    (checked per row)    │  grant of that session covers rb) │
    │   DONE (bad: mismatched rows) /   │                         │ revoke(gid): no row of it is sent │
    │   FAILED (lease_expired, ...)     │                         │  once acknowledged                │
    └───────────────────────────────────┘                         └───────────────────────────────────┘

A :class:`Transport` wraps the local arena of one peer worker process (the process that maps the host
arena, see ``ipc/arena.py`` and ``workers/main.py``). Nothing ever writes into another instance's
arena: a push is a pull the receiver performs, so the only operation between arenas is a READ.

**Grants** (the serving side). Each authenticated control session has a random data token (32 bytes,
:data:`TOKEN_BYTES`, sent inside the session's Welcome); :meth:`Transport.add_session` makes this
side's data server accept it. :meth:`Transport.grant` lets one session read some slots until a time
(``time.monotonic()`` of this host, which every process of the machine shares) and returns the
slots' digests, taken now (:func:`chunk_digest`: xxh3-128 seeded from the session's token). The
TCP data server serves a READ only of slots a live grant of the reading session covers, checks the
grant again before each row, and never takes a write. :meth:`Transport.revoke` ends a grant; it is
acknowledged (at once, or through :meth:`Transport.take_revoked` once the row being sent ends) only
when no row of it will be sent any more, so the caller may release the slots then.

**Reads** (the reading side). :meth:`Transport.add_peer` takes a peer's descriptor and the data
token of the session it was granted on; :meth:`Transport.read` copies peer rows into local rows and
verifies each row against the digest the serving side took at grant time. A row that does not match
is reported in ``TransferStatus.bad`` (the rest of the transfer is good); a transfer whose bytes
were not all in by ``not_after`` (the reader's conservative end of the lease) fails as
:data:`LEASE_EXPIRED`, since the serving side may have reused the slots meanwhile.

Its owner sleeps on :meth:`Transport.fileno` (an eventfd, :class:`Wakeup`), which a transport's
threads signal when a transfer's outcome is ready or a revocation is acknowledged: a finished
transfer is reported at once rather than at the owner's next timed poll.

Two implementations, chosen by :class:`TransportConfig` ``kind``:

- ``"nixl"`` (:class:`NixlTransport`): the arena's rows are registered once with a NIXL agent (UCX
  backend, ``DRAM`` memory); a transfer is prepared NIXL requests of at most 2 MiB each over
  per-slot descriptor lists, each checked as soon as it is done.
  UCX takes RDMA where the hardware has it, shared memory / CMA between processes of one host, TCP
  otherwise. One-sided operations of a registered region cannot be checked per grant: an
  authenticated NIXL peer can READ and WRITE every row of the arena while the agent lives (grants
  give it only the digests its reads are checked against). Use TCP with peers you do not trust
  with your arena.
- ``"tcp"`` (:class:`TcpTransport`): a server thread answers read requests by ``sendall`` straight
  from the arena rows (no staging copy); the reader ``recv_into``\\ s its own rows. Frames are a
  4-byte little-endian length and a msgpack struct, each length bounded before anything is
  allocated or read (:data:`MAX_AUTH_FRAME_BYTES`, :data:`MAX_REQUEST_BYTES`,
  :data:`MAX_REPLY_BYTES`). A connection authenticates with its session's token by
  challenge-response (HMAC-SHA256 over both sides' nonces, the server proving first; the token
  never crosses), within :data:`AUTH_TIMEOUT_S`. Unauthenticated connections are bounded per
  source address (:data:`MAX_PENDING_PER_SOURCE`) and in total (:data:`MAX_PENDING_TOTAL`: the
  oldest goes), authenticated ones per session (:data:`MAX_CONNS_PER_SESSION`: the session's
  newest wins) and in total (:data:`MAX_CONNS_TOTAL`), so a flood does not stop honest reads. Refusals are counted by reason (:attr:`Transport.refused`).
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

Exposure. The TCP server binds ``host`` (loopback by default); its rows travel in clear text (their
integrity is checked against the digests, which travel on the control channel). A NIXL agent's UCX
back-end listens on every network device of the machine (seen: loopback and the machine's address,
each on an ephemeral port) and serves anyone holding the agent's metadata; restrict it with
``UCX_NET_DEVICES`` where that matters. A NIXL descriptor must therefore travel only inside the
p2p tier's authenticated control channel.

Torch. ``import nixl`` (1.5.1) imports torch where torch has no CUDA (its back-end chooser falls back
to ``import torch`` to learn the CUDA version). Measured on the 2-vCPU CI machine (torch 2.13.0+cpu), a
process that creates an arena and a :class:`NixlTransport`: through ``import nixl`` 2.3-7.0 s and
248 MiB RSS; through this module's import 0.9-1.2 s and 61 MiB (an arena alone: 30 MiB). So this module
imports the back-end wheel's API (``nixl_cu13._api`` / ``nixl_cu12._api`` / ``nixl_rocm._api``)
directly, choosing the CUDA major version from torch's ``version.py`` read off disk, never importing
torch (``tests/integration/test_p2p_transport.py`` checks ``/proc/<pid>/maps`` and ``sys.modules`` of a peer process
after a NIXL transfer). When torch is already imported it uses the ``nixl`` package as is.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import enum
import hashlib
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

import msgspec
import psutil
import xxhash
from typing_extensions import override

from kvoffload.ipc.arena import Arena

#: Default per-transfer deadline (seconds): the issue's liveness bound for a silent peer.
DEFAULT_DEADLINE_S = 2.0
#: Largest descriptor :meth:`Transport.add_peer` accepts (bytes); NIXL agent metadata is a few KiB.
MAX_DESCRIPTOR_BYTES = 1 << 20
#: Most slots in one transfer (one control message's keys, ``peer_messages.MAX_KEYS``).
MAX_PAIRS = 4096
#: Largest frame a data connection may send before it is authenticated (bytes).
MAX_AUTH_FRAME_BYTES = 256
#: Largest request frame of an authenticated data connection (bytes): a read of :data:`MAX_PAIRS`
#: slots is at most ~20 KiB of msgpack.
MAX_REQUEST_BYTES = 64 << 10
#: Largest reply frame a reader accepts from a data server (bytes): an id and a short error.
MAX_REPLY_BYTES = 4096
#: Bytes of a session's data token (random, one per authenticated control session).
TOKEN_BYTES = 32
#: Bytes of a chunk digest (xxh3-128).
DIGEST_BYTES = 16
#: Seconds a new data connection has to authenticate (from its accept) before it is closed.
AUTH_TIMEOUT_S = 10.0
#: Unauthenticated data connections at once from one source address (more are refused).
MAX_PENDING_PER_SOURCE = 4
#: Unauthenticated data connections at once in all (a new one closes the oldest).
MAX_PENDING_TOTAL = 64
#: Authenticated data connections at once per session, and in all (more are refused).
MAX_CONNS_PER_SESSION = 4
MAX_CONNS_TOTAL = 256
#: ``TransferStatus.reason`` of a transfer whose bytes were not all in before the reader's end of
#: the lease it was granted on (the serving side may have reused the slots).
LEASE_EXPIRED = "lease_expired"
#: What a row failing its digest is called (the tier's failure reason).
DIGEST_MISMATCH = "digest_mismatch"
_LEN = struct.Struct("<I")
_SOCK_BUF_BYTES = 4 << 20
#: Most bytes of a row received before they are hashed: a piece this size is still in the CPU's
#: cache when it is hashed. Hashing whole 2 MiB rows after each arrived cost 15-25 % of a
#: loopback read's throughput here; pieces of 256 KiB, 8-10 % (64 KiB-512 KiB measured).
_PIECE_BYTES = 256 << 10
_MAX_ERROR_CHARS = 200
#: Default bytes of one NIXL request within a transfer (whole rows, at least one): each is checked
#: against its digests as soon as UCX reports it done, while the transfer's later requests move
#: (BENCHMARKS 10c).
NIXL_PART_BYTES = 2 << 20
#: How long the NIXL checking thread sleeps between looks at unfinished requests (seconds: from
#: the first, doubling to the second while none finished).
_NIXL_CHECK_MIN_S = 50e-6
_NIXL_CHECK_MAX_S = 1e-3
#: Nice value of the threads a NIXL agent starts (its UCX progress thread busy-polls).
_NIXL_THREAD_NICE = 19


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
    and poll again). PENDING is never settled. ``bad``: for DONE, the positions (in the transfer's
    pairs) of rows that did not match their digest: their local slots hold wrong bytes.
    """

    state: TransferState
    reason: str = ""
    settled: bool = True
    bad: tuple[int, ...] = ()


class TransportConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How a peer worker moves bulk bytes.

    Attributes:
        kind: ``"nixl"``, ``"tcp"`` or ``"auto"`` (NIXL when importable and its backend starts).
        host: TCP: the address the data server binds (loopback unless told otherwise).
        port: TCP: the data server's port; 0 picks a free one.
        advertise_host: TCP: the address put in the descriptor; defaults to ``host`` (or the host
            name when ``host`` is ``0.0.0.0``).
        deadline_s: default per-transfer deadline (seconds); also how long the TCP data server
            waits for one row or request to move before it closes the connection.
        nixl_backends: NIXL backends to instantiate (``["UCX"]``).
        nixl_part_bytes: NIXL: bytes of one request within a transfer (whole rows, at least one
            row); each is checked as soon as it is done (:class:`NixlTransport`).
    """

    kind: Literal["nixl", "tcp", "auto"] = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    deadline_s: float = DEFAULT_DEADLINE_S
    nixl_backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    nixl_part_bytes: int = NIXL_PART_BYTES

    def __post_init__(self) -> None:
        if self.nixl_part_bytes < 1:
            raise ValueError(f"transport nixl_part_bytes must be >= 1, got {self.nixl_part_bytes}")
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
    """Reaches a :class:`TcpTransport`: its data server's endpoint and the arena's shape. It grants
    nothing: a connection must prove a session's data token, and reads only what it was granted."""

    host: str
    port: int
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


# -- sessions, digests and grants -------------------------------------------------------------------


def session_id(token: bytes) -> bytes:
    """The public name of the session holding data ``token`` (16 bytes; what a data connection
    says it is before it proves the token)."""
    return hashlib.blake2b(token, digest_size=16, person=b"kvoffload-sid").digest()


def digest_seed(token: bytes) -> int:
    """The xxh3 seed of a session's chunk digests (64 bits drawn from its token), so that someone
    who sees a chunk's bytes on the data path cannot compute its digest."""
    return int.from_bytes(
        hashlib.blake2b(token, digest_size=8, person=b"kvoffload-dig").digest(), "little"
    )


def chunk_digest(row: Any, seed: int) -> bytes:
    """xxh3-128 of one arena row (:data:`DIGEST_BYTES` bytes) under ``seed`` (:func:`digest_seed`).
    A non-cryptographic hash (17 GB/s per core here, against 1.3 GB/s for SHA-256): it catches any
    accidental change of a chunk, and, seeded per session and carried on the control channel, is
    not computable by whoever sees only the data path."""
    return xxhash.xxh3_128_digest(row, seed=seed)


def rows_digests(arena: Arena, slots: Iterable[int], seed: int) -> bytes:
    """The concatenated :func:`chunk_digest` of ``slots``' rows."""
    rows = arena.rows
    return b"".join(xxhash.xxh3_128_digest(rows[s], seed=seed) for s in slots)


def data_mac(token: bytes, role: bytes, sid: bytes, cnonce: bytes, snonce: bytes) -> bytes:
    """A data connection's proof of ``token`` (role ``b"server"`` or ``b"client"``)."""
    h = hmac.new(token, b"kvoffload-p2p-data/" + role, hashlib.sha256)
    for part in (sid, cnonce, snonce):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


class Wakeup:
    """An eventfd that a transport's threads signal when a transfer or a revocation may have
    finished, so that its owner sleeps on it (:meth:`Transport.fileno`) instead of polling on a
    timer: a finished transfer is reported at once, not at the owner's next poll (1-8 ms later).
    Thread-safe; signals after :meth:`close` are dropped (the descriptor's number could be reused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        """The eventfd (readable from a :meth:`signal` until :meth:`clear`; -1 once closed)."""
        return self._fd

    def signal(self) -> None:
        """Make the descriptor readable (from any thread)."""
        with self._lock:
            if self._fd >= 0:
                os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        """Make the descriptor unreadable until the next :meth:`signal`."""
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._fd)

    def close(self) -> None:
        """Close the eventfd; later signals are dropped. Idempotent."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


@dataclass(slots=True)
class _Grant:
    sid: bytes
    slots: frozenset[int]
    until: float
    busy: int = 0  # requests sending its rows now
    revoked: bool = False


class GrantTable:
    """Which session may read which slots of this arena until when: the serving side's leases as its
    peer worker knows them. Thread-safe (the TCP server's threads read it).

    A grant is looked up per request (:meth:`acquire`: every slot must be covered by a live grant of
    the session) and held while its rows are sent (:meth:`release` after); :meth:`revoke` is
    acknowledged at once when no row of it is being sent, else when the last such request ends
    (:meth:`take_acks`; ``on_ack``, when given, is called after such an acknowledgement is queued).
    """

    def __init__(self, on_ack: Callable[[], None] | None = None) -> None:
        self._on_ack = on_ack
        self._lock = threading.Lock()
        self._tokens: dict[bytes, bytes] = {}  # session id -> token
        self._grants: dict[int, _Grant] = {}
        self._by_sid: dict[bytes, dict[int, set[int]]] = {}  # session id -> slot -> grant ids
        self._draining: dict[int, _Grant] = {}  # revoked, rows still being sent
        self._acks: list[int] = []

    def add_session(self, token: bytes) -> bytes:
        """Accept data connections proving ``token``; returns the session id."""
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a session token is {TOKEN_BYTES} bytes, not {len(token)}")
        sid = session_id(token)
        with self._lock:
            self._tokens[sid] = token
        return sid

    def drop_session(self, token: bytes) -> bytes:
        """No new data connection of ``token``'s session; its grants are no longer served (each
        still awaits its :meth:`revoke`). Returns the session id."""
        sid = session_id(token)
        with self._lock:
            self._tokens.pop(sid, None)
            for gids in self._by_sid.get(sid, {}).values():
                for gid in gids:
                    self._grants[gid].revoked = True
        return sid

    def token_of(self, sid: bytes) -> bytes | None:
        """The token of session ``sid``, None when no such session is open."""
        with self._lock:
            return self._tokens.get(sid)

    def grant(self, gid: int, token: bytes, slots: Sequence[int], until: float) -> None:
        """Session ``token`` may read ``slots`` until ``until`` (``time.monotonic()``)."""
        sid = session_id(token)
        g = _Grant(sid, frozenset(slots), until)
        with self._lock:
            if gid in self._grants or gid in self._draining:
                raise ValueError(f"grant {gid} exists")
            self._grants[gid] = g
            index = self._by_sid.setdefault(sid, {})
            for s in g.slots:
                index.setdefault(s, set()).add(gid)

    def revoke(self, gid: int) -> bool:
        """End grant ``gid``: True when no row of it is being sent (done now); else it is
        acknowledged by :meth:`take_acks` once the last request sending its rows ends. An unknown
        grant is done."""
        with self._lock:
            g = self._grants.pop(gid, None)
            if g is None:
                return gid not in self._draining
            g.revoked = True
            index = self._by_sid.get(g.sid, {})
            for s in g.slots:
                gids = index.get(s)
                if gids is not None:
                    gids.discard(gid)
                    if not gids:
                        del index[s]
            if not index:
                self._by_sid.pop(g.sid, None)
            if g.busy:
                self._draining[gid] = g
                return False
            return True

    def acquire(self, sid: bytes, slots: Sequence[int], now: float) -> list[_Grant] | str:
        """The live grants of session ``sid`` covering every one of ``slots`` (held: pass them to
        :meth:`release`), or the reason to refuse: ``not_granted``, ``expired``."""
        with self._lock:
            index = self._by_sid.get(sid)
            if index is None:
                return "not_granted"
            held: dict[int, _Grant] = {}
            expired = False
            for s in slots:
                chosen = None
                for gid in index.get(s, ()):
                    g = self._grants[gid]
                    if g.revoked:
                        continue
                    if g.until <= now:
                        expired = True
                        continue
                    chosen = gid
                    break
                if chosen is None:
                    return "expired" if expired else "not_granted"
                held[chosen] = self._grants[chosen]
            for g in held.values():
                g.busy += 1
            return list(held.values())

    def release(self, grants: Iterable[_Grant]) -> None:
        """A request that :meth:`acquire` held ``grants`` for has ended."""
        acked = False
        with self._lock:
            for g in grants:
                g.busy -= 1
            for gid, g in list(self._draining.items()):
                if not g.busy:
                    del self._draining[gid]
                    self._acks.append(gid)
                    acked = True
        if acked and self._on_ack is not None:
            self._on_ack()

    def take_acks(self) -> list[int]:
        """Revoked grants whose last request has ended since the last call."""
        with self._lock:
            out, self._acks = self._acks, []
            return out

    def draining(self) -> bool:
        """True while a revoked grant still has rows being sent."""
        with self._lock:
            return bool(self._draining)


# -- the interface ----------------------------------------------------------------------------------


Pairs = Sequence[tuple[int, int]]
_D = TypeVar("_D", NixlDescriptor, TcpDescriptor)


class Transport(abc.ABC):
    """READs of whole slots from peers' arenas into the local arena, and grants of the local arena's
    slots to peers' sessions."""

    kind: str
    arena: Arena
    #: Why this transport runs (set by :func:`make_transport`): ``configured``, or for ``auto``
    #: the reason NIXL was or was not taken.
    choice: str = "configured"
    grants: GrantTable
    _wakeup: Wakeup

    def fileno(self) -> int:
        """A file descriptor that is readable once a transfer or a revocation may have finished
        since :meth:`clear_wakeup` (register it with ``select`` / ``zmq.Poller``, ``POLLIN``). A
        NIXL transfer's READ is not signalled (UCX is polled), its digest check's end is."""
        return self._wakeup.fileno()

    def clear_wakeup(self) -> None:
        """Make :meth:`fileno` unreadable; call it before polling the transfers it signalled."""
        self._wakeup.clear()

    @abc.abstractmethod
    def descriptor(self) -> bytes:
        """What a peer passes to :meth:`add_peer` to reach this side (msgpack bytes, < 1 MiB).
        For NIXL it grants access to the whole arena: send it only over an authenticated channel."""

    @abc.abstractmethod
    def add_peer(self, name: str, descriptor: bytes, token: bytes) -> None:
        """Make peer ``name`` reachable (replaces a down peer of that name); ``token`` is the data
        token of the session its grants are made on.

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

    def read(
        self,
        peer: str,
        pairs: Pairs,
        deadline_s: float | None = None,
        *,
        digests: bytes,
        not_after: float = 0.0,
    ) -> int:
        """Copy the peer's rows into local rows: ``pairs`` = ``[(remote_slot, local_slot), ...]``,
        each row checked against ``digests`` (:data:`DIGEST_BYTES` per pair, in order, as the
        peer's grant returned them).

        ``deadline_s``: seconds until the transfer fails if not done (default: the config's).
        ``not_after``: ``time.monotonic()`` by which every byte must be in (the reader's end of the
        lease; 0: none): later, the transfer fails as :data:`LEASE_EXPIRED`. Returns a handle for
        :meth:`poll`. Raises ``ValueError`` (nothing moved) for an empty or too long list, a slot
        outside either arena, a local slot named twice, digests of another length or a deadline
        <= 0; :class:`PeerDownError` for an unknown or down peer.
        """
        if len(digests) != DIGEST_BYTES * len(pairs):
            raise ValueError(
                f"{len(digests)} bytes of digests for {len(pairs)} slots "
                f"({DIGEST_BYTES} bytes each expected)"
            )
        return self._submit(peer, pairs, deadline_s, bytes(digests), float(not_after))

    @abc.abstractmethod
    def _submit(
        self, peer: str, pairs: Pairs, deadline_s: float | None, digests: bytes, not_after: float
    ) -> int:
        """Start a READ (see :meth:`read`); returns its handle."""

    @abc.abstractmethod
    def poll(self, handle: int) -> TransferStatus:
        """State of a transfer; never blocks. After a settled DONE/FAILED the handle is forgotten
        and polling it again raises ``KeyError``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail every pending transfer, stop threads, release registrations. Idempotent."""

    # -- grants (the serving side) ----------------------------------------------------------------

    def add_session(self, token: bytes) -> None:
        """Accept data connections of the session holding ``token`` (:data:`TOKEN_BYTES` bytes).

        Raises:
            ValueError: a token of another length.
        """
        self.grants.add_session(token)

    def drop_session(self, token: bytes) -> None:
        """End ``token``'s session on the data plane: no new connection, no row of its grants
        served (each grant still awaits its :meth:`revoke`)."""
        self.grants.drop_session(token)

    def grant(self, gid: int, token: bytes, slots: Sequence[int], until: float) -> bytes:
        """Let ``token``'s session read ``slots`` until ``until`` (``time.monotonic()``); returns
        their digests (:func:`rows_digests`), taken now.

        Raises:
            ValueError: a slot outside the arena, an empty list, or ``gid`` in use.
        """
        n = self.arena.num_slots
        if not slots or len(slots) > MAX_PAIRS:
            raise ValueError(f"a grant names 1..{MAX_PAIRS} slots, not {len(slots)}")
        bad = next((s for s in slots if not 0 <= s < n), None)
        if bad is not None:
            raise ValueError(f"slot {bad} is outside the arena (0..{n - 1})")
        self.grants.grant(gid, token, slots, until)
        return rows_digests(self.arena, slots, digest_seed(token))

    def revoke(self, gid: int) -> bool:
        """End grant ``gid``: True once no row of it will be sent any more; False when a row is
        being sent now (it is then reported by :meth:`take_revoked` when that ends)."""
        return self.grants.revoke(gid)

    def take_revoked(self) -> list[int]:
        """Grants :meth:`revoke` answered False for, whose last row has been sent since."""
        return self.grants.take_acks()

    @property
    def refused(self) -> dict[str, int]:
        """Data connections and requests this side's server refused, by reason (empty for NIXL,
        whose one-sided operations this side never sees)."""
        return {}

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

    def _checked(self, peer: str, pairs: Pairs) -> tuple[Any, list[int], list[int]]:
        """Caller holds the lock: the live peer ``peer`` and ``pairs`` split into (local slots,
        remote slots), validated (see :meth:`read`)."""
        if self._closed:
            raise TransportError("transport is closed")
        p = self._peers.get(peer)
        if p is None or p.down:
            raise PeerDownError(f"peer {peer!r} is {'down' if p else 'unknown'}")
        local, remote = _check_pairs(pairs, self.arena.num_slots, p.desc.num_slots, peer)
        return p, local, remote


def _deadline(deadline_s: float | None, default_s: float) -> float:
    """Monotonic time at which a transfer started now fails (``deadline_s`` seconds, or the default)."""
    if deadline_s is None:
        deadline_s = default_s
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s}")
    return time.monotonic() + deadline_s


def _check_pairs(
    pairs: Pairs, local_slots: int, remote_slots: int, peer: str
) -> tuple[list[int], list[int]]:
    """Split READ ``pairs`` (remote, local) into (local slots, remote slots), validated."""
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
        re_, lo = int(pair[0]), int(pair[1])
        if not 0 <= lo < local_slots:
            raise ValueError(f"local slot {lo} is outside the arena (0..{local_slots - 1})")
        if not 0 <= re_ < remote_slots:
            raise ValueError(
                f"peer {peer!r} slot {re_} is outside its arena (0..{remote_slots - 1})"
            )
        local.append(lo)
        remote.append(re_)
    if len(set(local)) != n:
        raise ValueError("a local destination slot is named twice in one transfer")
    return local, remote


def _mismatched(arena: Arena, local: Sequence[int], digests: bytes, seed: int) -> tuple[int, ...]:
    """Positions of ``local`` rows whose digest is not the one given for them."""
    rows = arena.rows
    bad = []
    for i, s in enumerate(local):
        want = digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]
        if xxhash.xxh3_128_digest(rows[s], seed=seed) != want:
            bad.append(i)
    return tuple(bad)


# -- plain TCP --------------------------------------------------------------------------------------

_Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Sid = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
_Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class DataHello(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """First frame of a data connection: the session it speaks for and the client's nonce."""

    sid: _Sid
    nonce: _Nonce


class DataChallenge(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The server's nonce and its proof of the session's token (:func:`data_mac`, role server)."""

    nonce: _Nonce
    mac: _Mac


class DataAuth(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The client's proof of the session's token (:func:`data_mac`, role client)."""

    mac: _Mac


class DataReady(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The server took the client's proof: requests may follow."""


class TcpRequest(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One transfer on an authenticated data connection: after an OK :class:`TcpReply` the server
    sends ``slots`` rows in order. ``op`` is always ``"read"``: anything else is refused."""

    op: str
    xfer_id: int
    slots: list[int]


class TcpReply(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """The server's answer to a :class:`TcpRequest` (``error`` empty when OK); an error closes the
    connection."""

    xfer_id: int
    error: str = ""


_hello_decoder = msgspec.msgpack.Decoder(DataHello)
_challenge_decoder = msgspec.msgpack.Decoder(DataChallenge)
_auth_decoder = msgspec.msgpack.Decoder(DataAuth)
_ready_decoder = msgspec.msgpack.Decoder(DataReady)
_request_decoder = msgspec.msgpack.Decoder(TcpRequest)
_reply_decoder = msgspec.msgpack.Decoder(TcpReply)


class _Refused(Exception):
    """The data server refuses a connection or request (``reason``, counted)."""

    def __init__(self, reason: str, detail: str = "", counted: bool = False):
        super().__init__(detail or reason)
        self.reason = reason
        self.counted = counted  # counted already (before the client was answered)


def _recv_exact_into(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None,
    seen: Callable[[memoryview], object] | None = None,
) -> None:
    """Fill ``view`` from ``sock`` by ``deadline``. With ``seen``, received in pieces of at most
    :data:`_PIECE_BYTES`, each passed to ``seen`` as it arrives, while it is in the CPU's cache."""
    got, n = 0, len(view)
    most = _PIECE_BYTES if seen is not None else n
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, most))
        if k == 0:
            raise ConnectionError("connection closed by the other side")
        if seen is not None:
            seen(view[got : got + k])
        got += k


def _send_frame(sock: socket.socket, obj: msgspec.Struct, deadline: float) -> None:
    body = _encoder.encode(obj)
    _sendall_deadline(sock, memoryview(_LEN.pack(len(body)) + body), deadline)


def _recv_frame(sock: socket.socket, deadline: float | None, limit: int) -> bytes:
    """One frame of at most ``limit`` bytes; its length is checked before its body is read or a
    buffer for it allocated (``ValueError`` when over)."""
    head = bytearray(_LEN.size)
    _recv_exact_into(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"frame of {n} bytes, over {limit}")
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


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    source: str
    since: float
    sid: bytes = b""  # set once authenticated


class _TcpServer:
    """Serves reads of granted slots of the local arena: one thread accepts, one thread per
    connection (bounded, see the module docstring) authenticates it and answers its requests.

    Counts refusals by reason in ``refused``: ``flood`` (too many unauthenticated connections from
    a source, or the oldest closed for a new one), ``unauthenticated`` (an unknown session, a wrong
    proof, no proof in time), ``too_many_connections`` (all in use; or a session's oldest closed
    for its newest), ``malformed``, ``too_large``, ``write``
    (any request but a read), ``not_granted``, ``expired`` (its grant lapsed before the request),
    ``revoked`` (its grant ended or lapsed while its rows were sent: the rest is not sent). A
    connection that stalls in the middle of a frame or row for ``stall_s`` seconds is closed.
    """

    def __init__(self, arena: Arena, host: str, port: int, grants: GrantTable, stall_s: float):
        self.arena = arena
        self.grants = grants
        self.stall_s = stall_s
        self.auth_timeout_s = min(AUTH_TIMEOUT_S, max(stall_s, 1.0))
        self.refused: dict[str, int] = collections.Counter()
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, _Conn] = {}  # unauthenticated, oldest first
        self._per_source: collections.Counter[str] = collections.Counter()
        self._authed: dict[socket.socket, _Conn] = {}
        self._per_sid: collections.Counter[bytes] = collections.Counter()
        self._stopping = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept_loop, name="p2p-tcp-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return  # closed
            source = str(addr[0])
            evicted = None
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                if self._per_source[source] >= MAX_PENDING_PER_SOURCE:
                    self.refused["flood"] += 1
                    conn.close()
                    continue
                if len(self._pending) >= MAX_PENDING_TOTAL:
                    old_sock = next(iter(self._pending))
                    evicted = self._forget_pending(old_sock)
                    self.refused["flood"] += 1
                c = _Conn(conn, source, time.monotonic())
                self._pending[conn] = c
                self._per_source[source] += 1
            if evicted is not None:
                with contextlib.suppress(OSError):
                    evicted.sock.shutdown(socket.SHUT_RDWR)
            threading.Thread(
                target=self._serve, args=(c,), name="p2p-tcp-serve", daemon=True
            ).start()

    def _forget_pending(self, sock: socket.socket) -> _Conn | None:
        """Caller holds the lock."""
        c = self._pending.pop(sock, None)
        if c is not None:
            self._per_source[c.source] -= 1
            if not self._per_source[c.source]:
                del self._per_source[c.source]
        return c

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def _serve(self, c: _Conn) -> None:
        conn = c.sock
        try:
            _tune(conn)
            try:
                self._authenticate(c)
                self._requests(c)
            except _Refused as r:
                if not r.counted:
                    self._refuse(r.reason)
            except (OSError, ValueError, msgspec.DecodeError):
                return  # a connection lost, stalled or cut off mid-frame: nothing to answer
        finally:
            with self._lock:
                self._forget_pending(conn)
                if self._authed.pop(conn, None) is not None:
                    self._per_sid[c.sid] -= 1
                    if not self._per_sid[c.sid]:
                        del self._per_sid[c.sid]
            conn.close()

    def _authenticate(self, c: _Conn) -> None:
        """Challenge-response with the session's token, within ``auth_timeout_s`` of the accept;
        then the connection counts as its session's (bounded)."""
        conn = c.sock
        deadline = c.since + self.auth_timeout_s
        try:
            hello = _hello_decoder.decode(_recv_frame(conn, deadline, MAX_AUTH_FRAME_BYTES))
        except TimeoutError:
            raise _Refused("unauthenticated", "no hello in time") from None
        except ValueError as e:  # a frame over the bound, or not a hello
            raise _Refused("malformed", str(e)) from None
        token = self.grants.token_of(hello.sid)
        if token is None:
            raise _Refused("unauthenticated", "unknown session")
        snonce = secrets.token_bytes(32)
        proof = data_mac(token, b"server", hello.sid, hello.nonce, snonce)
        _send_frame(conn, DataChallenge(snonce, proof), deadline)
        try:
            auth = _auth_decoder.decode(_recv_frame(conn, deadline, MAX_AUTH_FRAME_BYTES))
        except TimeoutError:
            raise _Refused("unauthenticated", "no proof in time") from None
        except ValueError as e:
            raise _Refused("malformed", str(e)) from None
        want = data_mac(token, b"client", hello.sid, hello.nonce, snonce)
        if not hmac.compare_digest(auth.mac, want):
            raise _Refused("unauthenticated", "wrong proof")
        oldest = None
        with self._lock:
            if self._forget_pending(conn) is None:  # closed for a newer one meanwhile
                raise _Refused("flood")
            if self._per_sid[hello.sid] >= MAX_CONNS_PER_SESSION:
                # the session's newest connection wins (a reader reconnecting after a failure
                # must not wait for its old one to be noticed closed); its oldest goes
                oldest = next(x for x in self._authed.values() if x.sid == hello.sid)
                del self._authed[oldest.sock]
                self._per_sid[hello.sid] -= 1
                self.refused["too_many_connections"] += 1
            elif len(self._authed) >= MAX_CONNS_TOTAL:
                raise _Refused("too_many_connections")
            c.sid = hello.sid
            self._authed[conn] = c
            self._per_sid[hello.sid] += 1
        if oldest is not None:
            with contextlib.suppress(OSError):
                oldest.sock.shutdown(socket.SHUT_RDWR)
        _send_frame(conn, DataReady(), deadline)

    def _answer(self, conn: socket.socket, xfer_id: int, error: str) -> None:
        with contextlib.suppress(OSError):
            reply = TcpReply(xfer_id, error[:_MAX_ERROR_CHARS])
            _send_frame(conn, reply, time.monotonic() + self.stall_s)

    def _deny(self, conn: socket.socket, xfer_id: int, message: str, reason: str) -> NoReturn:
        """Refuse a request: counted first (whoever reads the answer sees the count), answered
        with ``message``, then the connection ends."""
        self._refuse(reason)
        self._answer(conn, xfer_id, message)
        raise _Refused(reason, counted=True)

    def _requests(self, c: _Conn) -> None:
        conn = c.sock
        rows = self.arena.rows
        n_slots = self.arena.num_slots
        while True:
            conn.settimeout(None)  # idle between requests is fine
            head = bytearray(_LEN.size)
            k = conn.recv_into(head, _LEN.size, socket.MSG_WAITALL)
            if k < _LEN.size:
                return  # closed by the client
            (n,) = _LEN.unpack(head)
            if n > MAX_REQUEST_BYTES:
                raise _Refused("too_large", f"request frame of {n} bytes")
            body = bytearray(n)
            _recv_exact_into(conn, memoryview(body), time.monotonic() + self.stall_s)
            try:
                req = _request_decoder.decode(body)
            except msgspec.DecodeError as e:
                self._deny(conn, 0, f"malformed request: {e}", "malformed")
            if req.op != "read":
                self._deny(conn, req.xfer_id, "only reads are served", "write")
            slots = req.slots
            if not slots or len(slots) > MAX_PAIRS:
                self._deny(conn, req.xfer_id, f"a request names 1..{MAX_PAIRS} slots", "malformed")
            bad = next((s for s in slots if not 0 <= s < n_slots), None)
            if bad is not None:
                self._deny(conn, req.xfer_id, f"slot {bad} is outside the arena", "malformed")
            held = self.grants.acquire(c.sid, slots, time.monotonic())
            if isinstance(held, str):
                self._deny(conn, req.xfer_id, f"{held}: no live grant of this session", held)
            try:
                until = min((g.until for g in held), default=float("inf"))
                _send_frame(conn, TcpReply(req.xfer_id), time.monotonic() + self.stall_s)
                for s in slots:
                    # checked before every row: a revoked grant's slots may be reused once its
                    # revocation is acknowledged, which waits for this request to end
                    if time.monotonic() >= until or any(g.revoked for g in held):
                        raise _Refused("revoked")
                    # the deadline is per row: a slow but moving client is not cut off
                    _sendall_deadline(conn, memoryview(rows[s]), time.monotonic() + self.stall_s)
            finally:
                self.grants.release(held)

    def drop_session(self, sid: bytes) -> None:
        """Close every connection of session ``sid``."""
        with self._lock:
            socks = [s for s, c in self._authed.items() if c.sid == sid]
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._pending) + list(self._authed)
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
    local: list[int]
    remote: list[int]
    deadline: float
    digests: bytes
    not_after: float
    status: TransferStatus = TransferStatus(TransferState.PENDING, settled=False)
    started: bool = False
    bad: list[int] = field(default_factory=list)


class _TcpPeer:
    """One peer's connection and the thread that runs its transfers in order."""

    def __init__(self, owner: TcpTransport, name: str, desc: TcpDescriptor, token: bytes):
        self.owner = owner
        self.name = name
        self.desc = desc
        self.token = token
        self.sid = session_id(token)
        self.seed = digest_seed(token)
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
        try:
            _tune(sock)
            cnonce = secrets.token_bytes(32)
            _send_frame(sock, DataHello(self.sid, cnonce), deadline)
            ch = _challenge_decoder.decode(_recv_frame(sock, deadline, MAX_AUTH_FRAME_BYTES))
            want = data_mac(self.token, b"server", self.sid, cnonce, ch.nonce)
            if not hmac.compare_digest(ch.mac, want):
                raise ValueError("the data server did not prove the session's token")
            proof = data_mac(self.token, b"client", self.sid, cnonce, ch.nonce)
            _send_frame(sock, DataAuth(proof), deadline)
            _ready_decoder.decode(_recv_frame(sock, deadline, MAX_AUTH_FRAME_BYTES))
        except BaseException:
            sock.close()
            raise
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
                if isinstance(e, TimeoutError):
                    lease_bound = x.not_after and x.not_after <= x.deadline
                    why = LEASE_EXPIRED if lease_bound else "deadline passed"
                else:
                    why = f"{type(e).__name__}: {e}"
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
        # every byte must be in by the lease's end as well as by the transfer's deadline
        deadline = min(x.deadline, x.not_after) if x.not_after else x.deadline
        if self.sock is None:
            self.sock = self._connect(deadline)
        sock = self.sock
        rows = self.owner.arena.rows
        _send_frame(sock, TcpRequest("read", x.xid, x.remote), deadline)
        reply = _reply_decoder.decode(_recv_frame(sock, deadline, MAX_REPLY_BYTES))
        if reply.error or reply.xfer_id != x.xid:
            raise ValueError(f"peer refused the transfer: {reply.error or 'wrong transfer id'}")
        seed, digests = self.seed, x.digests
        for i, s in enumerate(x.local):
            # hashed piece by piece as it arrives, while each piece is in the CPU's cache (a
            # second pass over a 2 MiB row would read it back from memory); nothing else writes a
            # slot being read into
            h = xxhash.xxh3_128(seed=seed)
            _recv_exact_into(sock, memoryview(rows[s]), deadline, h.update)
            if h.digest() != digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]:
                x.bad.append(i)
        if x.not_after and time.monotonic() > x.not_after:
            raise TimeoutError("the lease ended before the last row was in")

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
        self._wakeup = Wakeup()
        self.grants = GrantTable(self._wakeup.signal)
        self.server = _TcpServer(
            arena, self.config.host, self.config.port, self.grants, self.config.deadline_s
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
    @override
    def refused(self) -> dict[str, int]:
        with self.server._lock:
            return dict(self.server.refused)

    @override
    def descriptor(self) -> bytes:
        return _encoder.encode(
            TcpDescriptor(
                self._advertise,
                self.server.port,
                self.arena.num_slots,
                self.arena.row_bytes,
            )
        )

    @override
    def add_peer(self, name: str, descriptor: bytes, token: bytes) -> None:
        desc = self._peer_descriptor(name, descriptor, TcpDescriptor)
        if len(token) != TOKEN_BYTES:
            raise TransportError(f"peer {name!r}: a session token is {TOKEN_BYTES} bytes")
        with self._lock:
            old = self._replaced_peer(name)
            self._peers[name] = _TcpPeer(self, name, desc, token)
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
    def drop_session(self, token: bytes) -> None:
        self.server.drop_session(self.grants.drop_session(token))

    @override
    def _submit(
        self, peer: str, pairs: Pairs, deadline_s: float | None, digests: bytes, not_after: float
    ) -> int:
        with self._lock:
            p, local, remote = self._checked(peer, pairs)
            x = _Xfer(
                next(self._ids),
                peer,
                local,
                remote,
                _deadline(deadline_s, self.config.deadline_s),
                digests,
                not_after,
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
                bad = tuple(x.bad) if state is TransferState.DONE else ()
                x.status = TransferStatus(state, reason, bad=bad)
        self._wakeup.signal()

    @override
    def poll(self, handle: int) -> TransferStatus:
        with self._lock:
            x = self._xfers[handle]
            if x.status.state is TransferState.PENDING and not x.started:
                now = time.monotonic()
                # Still queued behind another transfer to the same peer: its thread never touched
                # this one's slots and will skip it.
                # the lease first, as the transfer thread does (its deadline is the lease's when
                # the lease ends first): a read of slots the server may reuse now is said so
                if x.not_after and now > x.not_after:
                    x.status = TransferStatus(TransferState.FAILED, LEASE_EXPIRED)
                elif now > x.deadline:
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
        self._wakeup.close()


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
    seed: int  # the digest seed of the session its grants are made on
    down: bool = False
    removed: bool = False  # removed while it had unsettled transfers: its agent stays loaded


@dataclass(slots=True)
class _NixlPart:
    """One NIXL request of a transfer: consecutive pairs of it, checked as soon as UCX is done."""

    handle: Any
    first: int  # position of its first pair in the transfer
    local: list[int]
    posted: bool = False  # transfer() returned: UCX may be asked about it
    settled: bool = False  # UCX reported DONE or ERR; the handle is released


@dataclass(slots=True)
class _NixlXfer:
    peer: _NixlPeer
    deadline: float
    digests: bytes
    not_after: float
    parts: list[_NixlPart]
    bad: list[int]  # positions whose row failed its digest
    unsettled: int  # parts UCX has not finished (or that are being checked)
    failed: str = ""


def _threads() -> set[int]:
    """Ids of this process's threads (empty where psutil cannot tell)."""
    try:
        return {t.id for t in psutil.Process().threads()}
    except psutil.Error:
        return set()


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

    Registration: one region, the arena's rows ``(base, num_slots * row_bytes, 0, "")`` (not its
    header); transfer descriptor lists of one ``(address, row_bytes, 0)`` entry per slot are
    prepared once per side (local, and per peer), so a transfer is ``make_prepped_xfer`` with slot
    numbers as indices. The agent runs NIXL's progress thread (at nice :data:`_NIXL_THREAD_NICE`:
    it busy-polls), so this side serves peers' one-sided operations without calls from its owner,
    and without seeing them: grants are kept only for the digests they return (:meth:`revoke` is
    done at once), and every authenticated peer holding the agent's metadata can READ and WRITE any
    row while the agent lives.

    Checking. A READ is posted in parts of at most :attr:`TransportConfig.nixl_part_bytes` (whole rows), each
    outside the lock (the agent is made thread-safe on its data path, ``NIXL_THREAD_SYNC_RW``).
    Over shared memory UCX copies a part's bytes inside ``transfer()``; elsewhere it finishes it
    later. One checking thread hashes each finished part against its digests while the caller's
    thread copies the next one, and asks UCX about unfinished parts every
    :data:`_NIXL_CHECK_MIN_S` to :data:`_NIXL_CHECK_MAX_S` (failing a transfer past its deadline or
    its lease's end). :meth:`poll` reports a transfer PENDING until its last part is checked; the
    checking thread then signals :meth:`fileno`.
    """

    kind = "nixl"

    def __init__(self, arena: Arena, config: TransportConfig | None = None):
        self.config = config or TransportConfig(kind="nixl")
        self.arena = arena
        api = import_nixl_api()
        self._name = f"kvoffload-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        global _nixl_agents_made
        _nixl_agents_made = True  # set before: a failed start may have made one too
        sync = getattr(api, "nixl_thread_sync_t", None)
        if sync is None:
            raise TransportError(
                "this NIXL has no thread-safe agent mode (nixl_thread_sync_t); install NIXL 1.x"
            )
        before = _threads()
        try:
            self.agent = api.nixl_agent(
                self._name,
                api.nixl_agent_config(
                    backends=list(self.config.nixl_backends),
                    sync_mode=sync.NIXL_THREAD_SYNC_RW,
                ),
            )
        except Exception as e:  # NIXL raises its own exception types
            raise TransportError(f"NIXL agent could not start: {e}") from e
        # NIXL's progress thread polls UCX without pause (a whole core while idle): at the
        # lowest priority it takes only what nothing else wants
        for tid in _threads() - before:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, _NIXL_THREAD_NICE)
        missing = [b for b in self.config.nixl_backends if b not in self.agent.backends]
        if missing:
            raise TransportError(f"NIXL backends {missing} are not available on this machine")
        rows = arena.rows
        self._base = rows.ctypes.data
        nbytes = arena.num_slots * arena.row_bytes
        self._reg = self.agent.register_memory([(self._base, nbytes, 0, "")], mem_type="DRAM")
        self._local_side = self.agent.prep_xfer_dlist("", self._slot_descs(self._base), "DRAM")
        self._wakeup = Wakeup()
        self.grants = GrantTable(self._wakeup.signal)
        self._lock = threading.Lock()
        self._peers: dict[str, _NixlPeer] = {}
        self._retired: list[_NixlPeer] = []  # removed, some transfers unsettled
        self._xfers: dict[int, _NixlXfer] = {}
        self._ids = itertools.count(1)
        self._closed = False
        # the checking thread: looks at UCX's unfinished requests and checks each finished one
        self._work = threading.Condition(self._lock)
        self._ready: list[tuple[_NixlXfer, _NixlPart]] = []  # finished when posted, to check
        self._checker = threading.Thread(
            target=self._check_loop, name="p2p-nixl-check", daemon=True
        )
        self._checker.start()

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
    def add_peer(self, name: str, descriptor: bytes, token: bytes) -> None:
        desc = self._peer_descriptor(name, descriptor, NixlDescriptor)
        if len(token) != TOKEN_BYTES:
            raise TransportError(f"peer {name!r}: a session token is {TOKEN_BYTES} bytes")
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
            self._peers[name] = _NixlPeer(name, agent_name, desc, remote_side, digest_seed(token))

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
    def _submit(
        self, peer: str, pairs: Pairs, deadline_s: float | None, digests: bytes, not_after: float
    ) -> int:
        with self._lock:
            p, local, remote = self._checked(peer, pairs)
            deadline = _deadline(deadline_s, self.config.deadline_s)
            # unsettled counts the posting itself until every part is posted: never seen settled
            # before then
            x = _NixlXfer(p, deadline, digests, not_after, parts=[], bad=[], unsettled=1)
            xid = next(self._ids)
            self._xfers[xid] = x
        # Each part is posted outside the lock (the agent is thread-safe on its data path, sync
        # mode RW): over shared memory UCX copies a READ's bytes inside transfer(), and the
        # checking thread checks the parts copied before meanwhile, on another core.
        per = max(1, self.config.nixl_part_bytes // self.arena.row_bytes)
        try:
            for first in range(0, len(local), per):
                part = self._prepare(
                    x, first, local[first : first + per], remote[first : first + per]
                )
                if part is None:
                    break
                try:
                    state = self.agent.transfer(part.handle)
                    why = "NIXL reported an error posting the transfer"
                except Exception as e:  # e.g. nixlRemoteDisconnectError
                    state, why = "ERR", f"{type(e).__name__}: {e}"
                with self._lock:
                    part.posted = True
                    if state == "ERR":
                        x.failed = x.failed or why
                        self._mark_down(x.peer, why)
                    elif state == "DONE":
                        done, _ = self._settle(x, part, state, time.monotonic())
                        if done is not None:
                            self._ready.append((x, done))
                    self._work.notify()
        finally:
            with self._lock:
                x.unsettled -= 1
                nothing = not x.parts
                if nothing and x.failed:
                    self._xfers.pop(xid, None)
            if not x.unsettled:
                self._wakeup.signal()
        if nothing and x.failed:
            raise PeerDownError(f"peer {peer!r}: {x.failed}")
        return xid

    def _prepare(
        self, x: _NixlXfer, first: int, local: list[int], remote: list[int]
    ) -> _NixlPart | None:
        """One part of ``x`` (its pairs from position ``first``), prepared and counted unsettled
        but not posted; None when ``x`` failed, the transport closed, or NIXL refused the request
        (``x`` then fails and its peer is down)."""
        with self._lock:
            if x.failed or self._closed:
                return None
            try:
                handle = self.agent.make_prepped_xfer(
                    "READ", self._local_side, local, x.peer.remote_side, remote
                )
            except Exception as e:
                x.failed = x.failed or f"NIXL refused the transfer: {e}"
                self._mark_down(x.peer, x.failed)
                return None
            part = _NixlPart(handle, first, local)
            x.parts.append(part)
            x.unsettled += 1
            return part

    def _mark_down(self, peer: _NixlPeer, why: str) -> None:
        """Caller holds the lock. Fails every pending transfer to ``peer``."""
        peer.down = True
        for x in self._xfers.values():
            if x.peer is peer and not x.failed:
                x.failed = f"peer is down ({why})"

    def _check_loop(self) -> None:
        """The checking thread: while transfers are unfinished, looks at their requests every
        :data:`_NIXL_CHECK_MIN_S` to :data:`_NIXL_CHECK_MAX_S` and checks the rows of each one UCX
        finished against their digests (outside the lock: :func:`_mismatched` releases the GIL
        while it hashes); signals the owner's :class:`Wakeup` when a transfer has settled."""
        wait = _NIXL_CHECK_MIN_S
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    if self._ready:  # finished when posted
                        finished, settled = self._ready, False
                        self._ready = []
                        break
                    if not any(x.unsettled for x in self._xfers.values()):
                        self._work.wait()  # until a transfer is posted
                        wait = _NIXL_CHECK_MIN_S
                        continue
                    finished, settled = self._look(time.monotonic())
                    if finished or settled:
                        break
                    self._work.wait(wait)  # or until the next part is posted
                    wait = min(wait * 2, _NIXL_CHECK_MAX_S)
            wait = _NIXL_CHECK_MIN_S
            for x, part in finished:
                self._check(x, part)
            if settled:
                self._wakeup.signal()

    def _check(self, x: _NixlXfer, part: _NixlPart) -> None:
        """Checks the rows of ``part``, which UCX finished, against their digests (outside the
        lock: :func:`_mismatched` releases the GIL while it hashes); signals the owner's
        :class:`Wakeup` when that settles ``x``."""
        end = part.first + len(part.local)
        bad = _mismatched(
            self.arena,
            part.local,
            x.digests[part.first * DIGEST_BYTES : end * DIGEST_BYTES],
            x.peer.seed,
        )
        with self._lock:
            x.bad.extend(part.first + i for i in bad)
            x.unsettled -= 1
            settled = not x.unsettled
        if settled:
            self._wakeup.signal()

    def _look(self, now: float) -> tuple[list[tuple[_NixlXfer, _NixlPart]], bool]:
        """Caller holds the lock: asks UCX about every unfinished request; returns the ones it
        finished whose rows are to be checked (their transfer not failed), and whether a transfer
        settled meanwhile (the others' ends settle it).
        A transfer still moving past its deadline or its lease's end fails (its peer is then
        down); one seen finished only after the lease's end fails too: it may have read slots the
        serving side reused."""
        finished: list[tuple[_NixlXfer, _NixlPart]] = []
        settled = False
        for x in self._xfers.values():
            if not x.unsettled:
                continue
            for part in x.parts:
                if part.settled or not part.posted:
                    continue
                try:
                    state = self.agent.check_xfer_state(part.handle)
                except Exception as e:  # nixlRemoteDisconnectError and kin
                    state = "ERR"
                    x.failed = x.failed or f"{type(e).__name__}: {e}"
                # the time UCX answered, not the pass's start: a thread starved between the two
                # (seen on one busy core) would otherwise take a READ finished after the lease's
                # end for one finished before it
                done, ended = self._settle(x, part, state, max(now, time.monotonic()))
                if done is not None:
                    finished.append((x, done))
                settled = settled or ended
        return finished, settled

    def _settle(
        self, x: _NixlXfer, part: _NixlPart, state: str, now: float
    ) -> tuple[_NixlPart | None, bool]:
        """Caller holds the lock: what UCX's ``state`` of ``part`` (of ``x``) means at ``now``.
        Still moving past ``x``'s deadline or its lease's end: ``x`` fails and its peer is down.
        Finished (DONE or ERR): the request is released; seen finished only after the lease's
        end, ``x`` fails (the serving side may have reused the slots). Returns the part when its
        rows are to be checked (DONE, ``x`` not failed), and whether ``x`` settled."""
        if state == "PROC" and not x.failed:
            if x.not_after and now > x.not_after:
                x.failed = LEASE_EXPIRED
            elif now > x.deadline:
                x.failed = "deadline passed"
        if state == "DONE" and not x.failed and x.not_after and now > x.not_after:
            x.failed = LEASE_EXPIRED
        if state == "ERR" and not x.failed:
            x.failed = "NIXL reported a transfer error"
        if x.failed and state != "DONE":
            self._mark_down(x.peer, x.failed)
        if state == "PROC":
            return None, False
        # DONE or ERR: UCX is finished with the request, its local slots are settled
        part.settled = True
        with contextlib.suppress(Exception):
            part.handle.release()
        if state == "DONE" and not x.failed:
            return part, False
        x.unsettled -= 1
        return None, not x.unsettled

    @override
    def poll(self, handle: int) -> TransferStatus:
        with self._lock:
            x = self._xfers[handle]
            if x.unsettled:
                if x.failed:
                    return TransferStatus(TransferState.FAILED, x.failed, settled=False)
                return TransferStatus(TransferState.PENDING, settled=False)
            del self._xfers[handle]
            last = x.peer.removed and not any(y.peer is x.peer for y in self._xfers.values())
            if last:
                self._retired.remove(x.peer)
        if last:
            self._drop(x.peer)
        if x.failed:
            return TransferStatus(TransferState.FAILED, x.failed)
        return TransferStatus(TransferState.DONE, bad=tuple(sorted(x.bad)))

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
            self._work.notify_all()
        # a check reads local rows: over before the caller may unmap the arena
        self._checker.join()
        for x in xfers:  # asks UCX to cancel; an unsettled request may still land (see above)
            for part in x.parts:
                if not part.settled:
                    with contextlib.suppress(Exception):
                        part.handle.release()
        for p in peers:
            self._drop(p)
        with contextlib.suppress(Exception):
            self._local_side.release()
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)
        self._wakeup.close()


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
