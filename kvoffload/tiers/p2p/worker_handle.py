"""Engine-side handle of the p2p tier's peer worker process (``kvoffload.workers.p2p_worker``).

::

    node thread ── add_peer / remove_peer / read ─────────────▶ PeerWorkerHandle ─stream─▶ peer worker
                ── add_session / drop_session / grant / revoke ▶
                ◀── poll(): [Result(tid, DONE | FAILED, reason, bad)] ┘  fileno(): one fd that is
                ◀── take_granted(): [(gid, digests | None)]              readable when poll() has
                ◀── take_revoked(): [gid]                                something to do

One handle runs one worker process (under a :class:`~kvoffload.supervisor.Supervisor`: a fresh
interpreter, never a fork of the engine, with an allow-listed environment, no secret of the
engine's; its exit watched through a pidfd) that maps the host arena and owns the instance's one
Transport (NIXL or TCP). Every call returns at once: commands are queued on the socket (and held
here until the worker has connected), results come back through :meth:`PeerWorkerHandle.poll` and
the ``take_*`` methods.

Settling. A transfer is reported exactly once, and only once it has SETTLED: nothing will write its
local slots any more, so the caller may free or publish them (less the rows its ``bad`` names,
which failed their digest). The worker reports a transfer when its transport says so; the
transfers of a worker that died are reported failed with reason :data:`WORKER_DIED` only after the
process has *exited* (reaped), since until then it could still write into their slots. A worker
that leaves a transfer unsettled, or a revocation unanswered, for ``settle_timeout_s`` seconds past
its deadline (a hung worker, or a NIXL request a stopped peer holds in flight) is SIGKILLed so that
they settle; the caller then restarts it.

Grants. :meth:`PeerWorkerHandle.grant` is answered once, by :meth:`take_granted` (the digests, or
None when the worker refused it or died first); :meth:`revoke` once, by :meth:`take_revoked`, when
no row of the grant will be sent any more (a dead worker sends none: its grants are revoked once it
has exited). Only then may the caller release the slots.

Threads. A handle is used by ONE thread, the p2p tier's node thread (it owns the socket to the
worker, and its buffers): create it there, or hand it over before its first use. Another thread
must not call any method; to wait, the node registers :meth:`PeerWorkerHandle.fileno` with its
``zmq.Poller`` (``POLLIN``) and calls :meth:`PeerWorkerHandle.poll` when it is readable, and at least
once a second (for the settle timeout).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import msgspec

from kvoffload.ipc.arena import ArenaError, list_arenas
from kvoffload.ipc.channels import PeerWorkerChannel
from kvoffload.ipc.names import PEER_WORKER_SPEC_ENV
from kvoffload.supervisor import Supervisor
from kvoffload.workers import p2p_worker as pw
from kvoffload.workers.p2p_transport import (
    DIGEST_BYTES,
    MAX_PAIRS,
    TOKEN_BYTES,
    Descriptor,
    TransferState,
    TransportConfig,
    TransportError,
    decode_descriptor,
)

log = logging.getLogger("kvoffload.p2p")

#: Reason of every transfer failed because its worker process exited (or was not running).
WORKER_DIED = "worker_died"
#: Default grace (seconds) after a transfer's deadline before an unsettled one gets its worker killed.
DEFAULT_SETTLE_TIMEOUT_S = 60.0
#: Default time (seconds) a new worker has to say hello before it is killed (NIXL's first import can
#: take seconds on a loaded machine).
DEFAULT_START_TIMEOUT_S = 120.0
_SETTLE_CHECK_S = 0.1

#: What the worker's environment may take from the engine's beyond the base allow-list: UCX's and
#: NIXL's settings (``UCX_TLS``, ``UCX_NET_DEVICES``...).
WORKER_ENV = ("UCX_*", "NIXL_*")


class Result(NamedTuple):
    """A settled transfer: its id, DONE or FAILED, why it failed, and for DONE the positions of
    rows that failed their digest (their bytes are wrong: never serve them)."""

    tid: int
    state: TransferState
    reason: str = ""
    bad: tuple[int, ...] = ()


PeerState = Literal["adding", "up", "refused"]


@dataclass(slots=True)
class _Pending:
    deadline_s: float
    settle_by: float | None = None  # monotonic; set when the command has left for the worker


class PeerWorkerHandle:
    """Runs and talks to one peer worker process. Non-blocking; one thread only (see the module).

    Args:
        arena_name: the host arena (it must exist: its nonce and shape are read from its header).
        transport_config: the worker's transport (kind ``nixl`` / ``tcp`` / ``auto``, TCP bind
            address, default deadline).
        nice: CPU niceness increment of the worker (like the tier workers', so transfers do not
            steal the scheduler's core).
        env: environment variables set for the worker (e.g. ``UCX_TLS``, ``UCX_NET_DEVICES``);
            beside them it gets only the base allow-list and the engine's ``UCX_*`` and ``NIXL_*``
            (:data:`WORKER_ENV`).
        settle_timeout_s: seconds after a transfer's deadline before an unsettled transfer (or a
            revocation unanswered that long) gets the worker killed (None: never).
        start_timeout_s: seconds a new worker has to say hello before it is killed (None: never).

    Raises:
        ArenaError: no arena named ``arena_name``.
    """

    def __init__(
        self,
        arena_name: str,
        transport_config: TransportConfig | None = None,
        *,
        nice: int = 10,
        env: Mapping[str, str] | None = None,
        settle_timeout_s: float | None = DEFAULT_SETTLE_TIMEOUT_S,
        start_timeout_s: float | None = DEFAULT_START_TIMEOUT_S,
    ):
        info = next((a for a in list_arenas(arena_name) if a.name == arena_name), None)
        if info is None or not info.ready:
            raise ArenaError(f"no ready host arena named {arena_name!r} in /dev/shm")
        for what, value in (("settle", settle_timeout_s), ("start", start_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{what}_timeout_s must be > 0 seconds or None, got {value}")
        self.arena_name = arena_name
        self.arena_nonce = info.nonce
        self.num_slots = info.num_slots
        self.row_bytes = info.row_bytes
        self.config = transport_config or TransportConfig()
        self.nice = nice
        self.env = dict(env or {})
        self.settle_timeout_s = settle_timeout_s
        self.start_timeout_s = start_timeout_s
        self._ep = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ep.register(self._wake, select.EPOLLIN)
        self._tids = itertools.count(1)
        self._peers: dict[str, Descriptor] = {}
        self._adding: dict[str, int] = {}  # name -> AddPeer commands not yet answered
        self._peer_state: dict[str, PeerState] = {}
        self._pending: dict[int, _Pending] = {}
        self._outbox: deque[tuple[bytes, int]] = deque()  # (frame, tid or 0)
        self._results: list[Result] = []
        self._gids = itertools.count(1)
        self._granting: set[int] = set()  # grants the current worker has not answered
        self._granted_gids: set[int] = set()  # grants the current worker holds (not revoked)
        self._revoking: dict[int, float] = {}  # gid -> kill the worker if unanswered by then
        self._granted: list[tuple[int, bytes | None]] = []
        self._revoked: list[int] = []
        #: The worker's data server refusals by reason (as it last reported them).
        self.refused: dict[str, int] = {}
        self._peer_errors: list[tuple[str, str]] = []
        self._next_settle_check = 0.0
        self._closed = False
        self._sup: Supervisor | None = None
        self._chan: PeerWorkerChannel | None = None
        self._descriptor: bytes | None = None
        self.kind: str | None = None
        self.start_error: str | None = None
        self.returncode: int | None = None
        try:
            self._spawn()
        except BaseException:
            self._ep.close()
            os.close(self._wake)
            raise

    # -- lifecycle --------------------------------------------------------------------------------

    def _spawn(self) -> None:
        chan, theirs = PeerWorkerChannel.pair()
        spec = pw.PeerWorkerSpec(
            arena_name=self.arena_name,
            arena_nonce=self.arena_nonce,
            channel_fd=theirs,
            parent_pid=os.getpid(),
            transport=self.config,
            nice=self.nice,
        )
        try:
            sup = Supervisor(
                [sys.executable, "-m", "kvoffload.workers.p2p_worker"],
                name="kvoffload p2p: peer worker",
                env_allow=WORKER_ENV,
                env_set={**self.env, PEER_WORKER_SPEC_ENV: msgspec.json.encode(spec).decode()},
                hello_timeout_s=self.start_timeout_s,
                pass_fds=(theirs,),
            )
        except BaseException:
            chan.close()
            raise
        finally:
            os.close(theirs)  # the worker's end is the worker's
        self._chan, self._sup = chan, sup
        self._descriptor, self.kind, self.start_error, self.returncode = None, None, None, None
        self._ep.register(chan.fd, select.EPOLLIN)
        self._watching_out = False
        self._ep.register(sup.fileno(), select.EPOLLIN)  # readable once the worker has exited

    @property
    def pid(self) -> int | None:
        """The worker's process id (None after close)."""
        return None if self._sup is None else self._sup.pid

    @property
    def alive(self) -> bool:
        """True while the worker process runs (it may not have said hello yet)."""
        return self._chan is not None and self._sup is not None and self._sup.running

    @property
    def descriptor(self) -> bytes | None:
        """This instance's transport descriptor (msgpack, grants access to the whole arena: send it
        only over the authenticated control channel) once the worker said hello; None before, and
        once it has exited. Changes with every restart."""
        return self._descriptor

    @property
    def peers(self) -> list[str]:
        """Names of the peers added and not removed (since the last restart)."""
        return list(self._peers)

    def restart(self) -> list[str]:
        """Replace the worker with a fresh one (SIGKILL and reap the old one first if it still
        runs; blocks only for that). Its unsettled transfers are reported failed
        (:data:`WORKER_DIED`) by the next :meth:`poll`. The new worker has a new :attr:`descriptor`
        (None until it said hello) and knows no peers.

        Returns:
            The names of the peers the old worker had: add them again (the control plane must also
            send peers this instance's new descriptor).
        """
        self._check_open()
        names = list(self._peers)
        self._peers.clear()
        self._adding.clear()
        self._peer_state.clear()
        if self._sup is not None and self._chan is not None:
            self._sup.kill()
            self._sup.wait()
            self._on_exit()
        self._spawn()
        self._signal()
        return names

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (a Stop command, SIGKILL after ``timeout_s`` seconds) and wait until it
        has exited; close the socket and every descriptor. Unreported transfers are dropped (their
        slots are safe: the process is gone). Idempotent."""
        if self._closed:
            return
        self._closed = True
        sup, chan = self._sup, self._chan
        deadline = None
        if sup is not None and chan is not None and sup.running:
            sent = self.descriptor is not None and chan.send(pw.encode(pw.Stop()))
            if not sent:
                sup.kill()
            deadline = time.monotonic() + timeout_s  # then SIGKILL
        self._release_process(deadline)  # reaped before the socket closes
        if sup is not None:
            self.returncode = sup.returncode
        self._pending.clear()
        self._outbox.clear()
        self._results.clear()
        self._granting.clear()
        self._granted_gids.clear()
        self._revoking.clear()
        self._granted.clear()
        self._revoked.clear()
        self._sup = None
        self._ep.close()
        os.close(self._wake)

    def __enter__(self) -> PeerWorkerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the peer worker handle is closed")

    def _release_process(self, deadline: float | None = None) -> None:
        """Stop watching the worker and reap it (waiting until ``deadline``, SIGKILL past it; a
        worker that exited is only reaped), then close its socket."""
        sup = self._sup
        if sup is not None and sup.fileno() >= 0:
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(sup.fileno())
            sup.close(deadline)
        if self._chan is not None:
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(self._chan.fd)
            self._chan.close()
            self._chan = None
        self._descriptor = None

    def _on_exit(self) -> None:
        """The worker has exited (reaped): take its last reports, then fail what it still held."""
        assert self._sup is not None
        self._receive()
        self.returncode = self._sup.returncode
        if self.start_error is None and self._pending and not self._closed:
            log.warning(
                "kvoffload p2p: peer worker (pid %d) exited with code %s; failing %d transfers",
                self._sup.pid,
                self.returncode,
                len(self._pending),
            )
        for tid in self._pending:
            self._results.append(Result(tid, TransferState.FAILED, WORKER_DIED))
        self._pending.clear()
        # nothing serves the dead worker's grants any more
        self._granted.extend((gid, None) for gid in sorted(self._granting))
        self._revoked.extend(self._revoking)
        self._granting.clear()
        self._granted_gids.clear()
        self._revoking.clear()
        self._outbox.clear()
        self._adding.clear()
        self._release_process()

    # -- peers ------------------------------------------------------------------------------------

    def add_peer(self, name: str, descriptor: bytes, token: bytes) -> None:
        """Make peer ``name`` reachable through its transport ``descriptor``, authenticating with
        ``token``, the data token of the session its grants are made on (replacing an earlier
        one of that name). Checked here for shape; a refusal by the worker (e.g. a NIXL peer that
        still has unsettled transfers) comes back from :meth:`take_peer_errors`, and transfers to
        the peer then fail.

        Raises:
            TransportError: a malformed descriptor, or another slot size than this arena's.
            ValueError: an empty name, a token of another length than ``TOKEN_BYTES``.
        """
        self._check_open()
        if not name:
            raise ValueError("peer name is empty")
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a session token is {TOKEN_BYTES} bytes, not {len(token)}")
        desc = decode_descriptor(descriptor)
        if desc.row_bytes != self.row_bytes:
            raise TransportError(
                f"peer {name!r} has {desc.row_bytes}-byte slots, this arena {self.row_bytes}-byte"
            )
        self._peers[name] = desc
        self._peer_state[name] = "adding"
        if self._chan is not None:
            self._adding[name] = self._adding.get(name, 0) + 1
        self._send(pw.encode(pw.AddPeer(name, descriptor, bytes(token))))

    def remove_peer(self, name: str) -> None:
        """Forget peer ``name``: its transfers fail ("peer removed") and are reported once settled.
        Unknown names are ignored."""
        self._check_open()
        self._peer_state.pop(name, None)
        if self._peers.pop(name, None) is not None:
            self._send(pw.encode(pw.RemovePeer(name)))

    def peer_state(self, name: str) -> PeerState | None:
        """Where peer ``name`` is: "adding" (the worker has not answered the last
        :meth:`add_peer` yet), "up" (it took the descriptor), "refused" (see
        :meth:`take_peer_errors`), or None (not added, removed, or lost in a restart). Transfers
        may be submitted in any state; the worker runs commands in order."""
        return self._peer_state.get(name)

    def take_peer_errors(self) -> list[tuple[str, str]]:
        """``(name, reason)`` for each :meth:`add_peer` the worker refused since the last call."""
        out, self._peer_errors = self._peer_errors, []
        return out

    # -- grants (the serving side) ----------------------------------------------------------------

    def add_session(self, token: bytes) -> None:
        """Let the worker's data server accept connections proving ``token`` (a control session's
        data token, ``TOKEN_BYTES`` bytes).

        Raises:
            ValueError: a token of another length.
        """
        self._check_open()
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a session token is {TOKEN_BYTES} bytes, not {len(token)}")
        self._send(pw.encode(pw.AddSession(bytes(token))))

    def drop_session(self, token: bytes) -> None:
        """End ``token``'s session on the data plane: its connections close and its grants are no
        longer served (each still needs its :meth:`revoke`)."""
        self._check_open()
        self._send(pw.encode(pw.DropSession(bytes(token))))

    def grant(self, token: bytes, slots: Sequence[int], until: float) -> int:
        """Let ``token``'s session read ``slots`` until ``until`` (``time.monotonic()``); returns
        the grant's id. Answered once by :meth:`take_granted`: the slots' digests (taken when the
        worker granted them), or None (refused, or no worker). Until then no peer can have been
        told the slots, so no read races the grant.

        Raises:
            ValueError: no slots or more than ``MAX_PAIRS``, a slot outside the arena.
        """
        self._check_open()
        if not 0 < len(slots) <= MAX_PAIRS:
            raise ValueError(f"a grant names 1..{MAX_PAIRS} slots, got {len(slots)}")
        bad = next((s for s in slots if not 0 <= s < self.num_slots), None)
        if bad is not None:
            raise ValueError(f"slot {bad} is outside the arena (0..{self.num_slots - 1})")
        gid = next(self._gids)
        if self._chan is None:
            self._granted.append((gid, None))
            self._signal()
            return gid
        self._granting.add(gid)
        self._send(pw.encode(pw.Grant(gid, bytes(token), [int(s) for s in slots], float(until))))
        return gid

    def revoke(self, gid: int) -> None:
        """End grant ``gid``. Answered once by :meth:`take_revoked`, when no row of it will be
        sent any more: then its slots may be reused. A grant the worker does not hold (refused, or
        of a worker since gone) is answered at once."""
        self._check_open()
        if gid in self._revoking:
            return
        if self._chan is None or (gid not in self._granting and gid not in self._granted_gids):
            self._revoked.append(gid)
            self._signal()
            return
        self._granted_gids.discard(gid)
        late = self.settle_timeout_s
        self._revoking[gid] = time.monotonic() + (late if late is not None else float("inf"))
        self._send(pw.encode(pw.Revoke(gid)))

    def take_granted(self) -> list[tuple[int, bytes | None]]:
        """``(gid, digests or None)`` for each grant answered since the last call."""
        out, self._granted = self._granted, []
        return out

    def take_revoked(self) -> list[int]:
        """Grants revoked since the last call: none of their rows will be sent any more."""
        out, self._revoked = self._revoked, []
        return out

    # -- transfers --------------------------------------------------------------------------------

    def read(
        self,
        peer: str,
        pairs: Sequence[tuple[int, int]],
        deadline_s: float | None = None,
        *,
        digests: bytes,
        not_after: float = 0.0,
    ) -> int:
        """Copy peer rows into local rows: ``pairs`` = ``[(local_slot, remote_slot), ...]``, each
        row checked against ``digests`` (``DIGEST_BYTES`` per pair, as the peer's grant gave them).

        ``deadline_s``: seconds the worker gives the transfer (default: the transport config's).
        ``not_after``: ``time.monotonic()`` by which every byte must be in (the end of the lease it
        reads, less a margin; 0: none), else it fails ``lease_expired``. Returns the transfer id
        :meth:`poll` reports. With no worker running the transfer is reported failed
        (:data:`WORKER_DIED`) by the next poll.

        Raises:
            ValueError: unknown peer, no pairs or more than ``MAX_PAIRS``, a slot outside either
                arena, a local slot named twice, digests of another length, ``deadline_s`` <= 0.
                Nothing is sent.
        """
        self._check_open()
        desc = self._peers.get(peer)
        if desc is None:
            raise ValueError(f"peer {peer!r} was not added (or was removed)")
        if deadline_s is None:
            deadline_s = self.config.deadline_s
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s}")
        n = len(pairs)
        if not 0 < n <= MAX_PAIRS:
            raise ValueError(f"a transfer needs 1..{MAX_PAIRS} slot pairs, got {n}")
        if len(digests) != DIGEST_BYTES * n:
            raise ValueError(f"{len(digests)} bytes of digests for {n} slots")
        local: list[int] = []
        remote: list[int] = []
        for pair in pairs:
            if len(pair) != 2:
                raise ValueError(f"slot pair {pair!r} is not (local slot, remote slot)")
            lo, re_ = int(pair[0]), int(pair[1])
            if not 0 <= lo < self.num_slots:
                raise ValueError(f"local slot {lo} is outside the arena (0..{self.num_slots - 1})")
            if not 0 <= re_ < desc.num_slots:
                raise ValueError(
                    f"peer {peer!r} slot {re_} is outside its arena (0..{desc.num_slots - 1})"
                )
            local.append(lo)
            remote.append(re_)
        if len(set(local)) != n:
            raise ValueError("a local destination slot is named twice in one transfer")
        tid = next(self._tids)
        if self._chan is None:
            self._results.append(Result(tid, TransferState.FAILED, WORKER_DIED))
            self._signal()
            return tid
        self._pending[tid] = _Pending(float(deadline_s))
        frame = pw.encode(
            pw.Transfer(
                tid, peer, local, remote, float(deadline_s), bytes(digests), float(not_after)
            )
        )
        self._send(frame, tid)
        return tid

    def _send(self, frame: bytes, tid: int = 0) -> None:
        chan = self._chan
        if chan is None:
            return  # no worker: peers are re-added after a restart
        if not self._outbox and chan.send(frame):
            self._sent(tid)
        else:
            self._outbox.append((frame, tid))
        self._watch_out(chan)

    def _sent(self, tid: int) -> None:
        p = self._pending.get(tid) if tid else None
        if p is not None and self.settle_timeout_s is not None:
            p.settle_by = time.monotonic() + p.deadline_s + self.settle_timeout_s

    def _flush(self) -> None:
        chan = self._chan
        if chan is None:
            return
        chan.flush()
        while self._outbox:
            frame, tid = self._outbox[0]
            if not chan.send(frame):
                break
            self._outbox.popleft()
            self._sent(tid)
        self._watch_out(chan)

    def _watch_out(self, chan: PeerWorkerChannel) -> None:
        """Watch the socket for room to write while bytes wait for the kernel (so that
        :meth:`fileno` wakes the caller to send them), and only then."""
        want = chan.pending_out
        if want != self._watching_out:
            self._watching_out = want
            self._ep.modify(chan.fd, select.EPOLLIN | (select.EPOLLOUT if want else 0))

    # -- results ----------------------------------------------------------------------------------

    def fileno(self) -> int:
        """A file descriptor that is readable when :meth:`poll` has something to do (a report
        arrived, the worker exited, a result is queued). Stable for the handle's life, restarts
        included; register it with a ``zmq.Poller`` / ``select`` for ``POLLIN``."""
        return self._ep.fileno()

    def poll(self) -> list[Result]:
        """Take what happened: ``(tid, DONE | FAILED, reason)`` for each transfer that has settled
        since the last call, each reported once. Never blocks. Also sends what waited for the
        worker to connect, notices the worker's exit and enforces ``settle_timeout_s``."""
        self._check_open()
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        if self._chan is not None:
            self._flush()
            self._receive()
            assert self._sup is not None
            # reaped, or None (a worker silent past start_timeout_s is killed, reported later)
            if self._sup.poll() is not None:
                self._on_exit()
            else:
                self._check_timeouts()
        out, self._results = self._results, []
        self._ep.poll(0)  # refreshes the epoll set's readiness (fileno) after the drain
        self._signal_if_readable()
        return out

    def _receive(self) -> None:
        chan = self._chan
        if chan is None:
            return
        for frame in chan.recv_ready():
            try:
                rep = pw.decode_report(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("kvoffload p2p: malformed report from the peer worker dropped: %s", e)
                continue
            if isinstance(rep, pw.Settled):
                for o in rep.outcomes:
                    if self._pending.pop(o.tid, None) is not None:
                        state = TransferState.DONE if o.state == "done" else TransferState.FAILED
                        self._results.append(Result(o.tid, state, o.reason, tuple(o.bad)))
            elif isinstance(rep, pw.Granted):
                if rep.gid in self._granting:
                    self._granting.discard(rep.gid)
                    ok = not rep.error and len(rep.digests) % DIGEST_BYTES == 0
                    if ok and rep.gid not in self._revoking:
                        self._granted_gids.add(rep.gid)
                    self._granted.append((rep.gid, rep.digests if ok else None))
            elif isinstance(rep, pw.Revoked):
                for gid in rep.gids:
                    if self._revoking.pop(gid, None) is not None:
                        self._revoked.append(gid)
            elif isinstance(rep, pw.Refusals):
                self.refused = dict(rep.counts)
            elif isinstance(rep, pw.PeerAdded):
                if rep.error:
                    self._peer_errors.append((rep.name, rep.error))
                left = self._adding.get(rep.name, 0) - 1
                if left > 0:
                    self._adding[rep.name] = left
                else:
                    self._adding.pop(rep.name, None)
                    if rep.name in self._peer_state:  # not removed meanwhile
                        self._peer_state[rep.name] = "refused" if rep.error else "up"
            elif isinstance(rep, pw.Ready):
                if (rep.num_slots, rep.row_bytes) != (self.num_slots, self.row_bytes):
                    log.error("kvoffload p2p: the peer worker mapped another arena shape")
                self._descriptor, self.kind = rep.descriptor, rep.kind
                if self._sup is not None:
                    self._sup.hello()
                log.info(
                    "kvoffload p2p: peer worker ready, transport %s (%s)", rep.kind, rep.choice
                )
            elif isinstance(rep, pw.StartFailed):
                self.start_error = rep.reason
                if self._sup is not None:
                    self._sup.hello()  # an answer: it exits by itself
                log.error("kvoffload p2p: the peer worker could not start: %s", rep.reason)

    def _check_timeouts(self) -> None:
        """SIGKILL a worker that holds a transfer unsettled ``settle_timeout_s`` past its deadline,
        or a revocation unanswered that long (its Supervisor kills one that has not said hello
        within ``start_timeout_s``); :meth:`poll` reports the exit once it is reaped."""
        now = time.monotonic()
        if now < self._next_settle_check or self._sup is None:
            return
        self._next_settle_check = now + _SETTLE_CHECK_S
        why = ""
        if self.settle_timeout_s is not None:
            late = sum(
                1 for p in self._pending.values() if p.settle_by is not None and now > p.settle_by
            )
            if late:
                why = (
                    f"{late} transfers are unsettled {self.settle_timeout_s:.0f} s past their "
                    "deadline"
                )
            elif any(now > t for t in self._revoking.values()):
                why = f"a revocation is unanswered after {self.settle_timeout_s:.0f} s"
        if why:
            self._sup.kill(why)

    def _signal(self) -> None:
        os.eventfd_write(self._wake, 1)

    def _signal_if_readable(self) -> None:
        # results taken from the socket but not yet given out: make fileno() readable (the socket's
        # own readiness is level-triggered in the epoll set)
        if self._results or self._granted or self._revoked:
            self._signal()
