"""Peer worker process of the p2p tier: maps the host arena, owns one Transport, runs slot transfers.

::

    engine (PeerWorkerHandle, node thread)                peer worker (this module)
      PAIR ──AddPeer / RemovePeer / Transfer / Stop──▶ PAIR ─▶ Transport (p2p_transport.py)
           ◀──Ready / PeerAdded / Settled / StartFailed──        │ NIXL agent (whole arena
                                                                 │ registered) or TCP server thread:
                                  peers' one-sided READ/WRITE ◀──┘ serves peers for as long as it lives

Started by :class:`kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle` as
``python -m kvoffload.workers.p2p_worker`` (a fresh interpreter: spawn, never fork) with its
:class:`PeerWorkerSpec` as JSON in ``KVOFFLOAD_PEER_WORKER``
(:data:`~kvoffload.ipc.names.PEER_WORKER_SPEC_ENV`). It attaches the arena by name (checking its
nonce), creates one :class:`~kvoffload.workers.p2p_transport.Transport`, says :class:`Ready` with the
transport's descriptor, then serves commands until :class:`Stop`, its parent's death (polled every
``_IDLE_POLL_S``) or the socket's loss.

A :class:`Transfer` names its slot pairs as ``local`` and ``remote`` lists (``local[i]`` <->
``remote[i]``) for both directions; the transport's own pair order differs per direction and is
applied here. Each transfer is answered exactly once, in a :class:`Settled` batch, and only once
the transport says it has SETTLED (:attr:`TransferStatus.settled`): a failed NIXL transfer may still
write its local slots until then, so the engine keeps them reserved until it hears. A transfer the
transport refuses at once (a bad slot, an unknown or down peer) is answered at once, failed and
settled (nothing moved).

The messages are private to this process and its handle: msgpack of a tagged union of
``msgspec.Struct`` (``array_like``), one ZMQ frame each. The process imports no torch (NIXL is
imported through its back-end wheel's API, see ``p2p_transport.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Literal

import msgspec
import zmq

from kvoffload.ipc.arena import Arena, ArenaError
from kvoffload.ipc.channels import PeerWorkerChannel
from kvoffload.ipc.names import PEER_WORKER_SPEC_ENV
from kvoffload.workers.p2p_transport import (
    TransferState,
    Transport,
    TransportConfig,
    TransportError,
    exit_process,
    make_transport,
)

# How often an idle worker checks that its parent is alive (seconds).
_IDLE_POLL_S = 0.2
# While transfers are pending the worker polls the transport every _BUSY_POLL_MIN_S at first, backing
# off (doubling) to _BUSY_POLL_MAX_S while nothing changes (seconds).
_BUSY_POLL_MIN_S = 0.001
_BUSY_POLL_MAX_S = 0.008

#: Exit status when the arena cannot be attached or the transport cannot start.
EXIT_START_FAILED = 3
#: Exit status when no spec was given.
EXIT_NO_SPEC = 2


class PeerWorkerSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Everything a peer worker needs, passed at spawn (JSON in ``KVOFFLOAD_PEER_WORKER``).

    Attributes:
        arena_name: the host arena's /dev/shm name.
        arena_nonce: its header nonce (16 bytes): a recreated arena of that name is refused.
        endpoint: the engine's PAIR socket (``ipc://@...``).
        parent_pid: the engine process; the worker exits once it is no longer its parent.
        transport: which transport to run and how (:class:`TransportConfig`).
        nice: CPU niceness increment (0: none).
    """

    arena_name: str
    arena_nonce: bytes
    endpoint: str
    parent_pid: int
    transport: TransportConfig
    nice: int = 0


# -- engine -> worker -----------------------------------------------------------------------------


class AddPeer(msgspec.Struct, tag="add", array_like=True, forbid_unknown_fields=True):
    """Make peer ``name`` reachable with its transport ``descriptor``; a peer of that name that is
    still known is removed first. Answered by :class:`PeerAdded`."""

    name: str
    descriptor: bytes


class RemovePeer(msgspec.Struct, tag="remove", array_like=True, forbid_unknown_fields=True):
    """Forget peer ``name``; its pending transfers fail ("peer removed") and are answered once
    settled. Not answered itself."""

    name: str


class Transfer(msgspec.Struct, tag="xfer", array_like=True, forbid_unknown_fields=True):
    """Move whole slots: ``op`` "read" copies peer rows ``remote[i]`` into local rows ``local[i]``,
    "write" local rows ``local[i]`` into peer rows ``remote[i]``. ``deadline_s``: seconds from
    receipt until it fails. ``tid``: the engine's id, echoed in :class:`Settled`."""

    tid: int
    op: Literal["read", "write"]
    peer: str
    local: list[int]
    remote: list[int]
    deadline_s: float


class Stop(msgspec.Struct, tag="stop", array_like=True, forbid_unknown_fields=True):
    """Close the transport and exit (pending transfers are not answered)."""


Command = AddPeer | RemovePeer | Transfer | Stop


# -- worker -> engine -----------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True, forbid_unknown_fields=True):
    """The worker is serving: its pid, transport kind ("nixl"/"tcp"), the descriptor peers need to
    reach it, the arena's shape (slots, bytes per slot), and why that transport runs
    (``Transport.choice``: ``configured``, or for ``auto`` why NIXL was or was not taken)."""

    pid: int
    kind: str
    descriptor: bytes
    num_slots: int
    row_bytes: int
    choice: str = ""


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True, forbid_unknown_fields=True):
    """The worker could not attach the arena or start its transport (``reason``); it exits."""

    reason: str


class PeerAdded(msgspec.Struct, tag="added", array_like=True, forbid_unknown_fields=True):
    """Answer to :class:`AddPeer`: ``error`` empty when the peer is reachable now, else why not
    (transfers to it then fail at once)."""

    name: str
    error: str = ""


class Outcome(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One settled transfer: ``state`` "done" or "failed", ``reason`` why it failed."""

    tid: int
    state: Literal["done", "failed"]
    reason: str = ""


class Settled(msgspec.Struct, tag="settled", array_like=True, forbid_unknown_fields=True):
    """Transfers that have settled since the last report: the transport will never touch their
    local slots again."""

    outcomes: list[Outcome]


Report = Ready | StartFailed | PeerAdded | Settled

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode(msg: Command | Report) -> bytes:
    """msgpack bytes of one message (one ZMQ frame)."""
    return _encoder.encode(msg)


def decode_command(data: bytes) -> Command:
    """Parse an engine -> worker frame. Raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _command_decoder.decode(data)


def decode_report(data: bytes) -> Report:
    """Parse a worker -> engine frame. Raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _report_decoder.decode(data)


class PeerWorker:
    """The worker loop around one transport. Use :meth:`run`; :meth:`close` releases everything."""

    def __init__(self, spec: PeerWorkerSpec, chan: PeerWorkerChannel, arena: Arena):
        self.spec = spec
        self.chan = chan
        self.arena = arena
        self.transport: Transport = make_transport(arena, spec.transport)
        # tid -> transport handle of transfers not yet settled
        self.pending: dict[int, int] = {}
        self.outcomes: list[Outcome] = []

    def parent_alive(self) -> bool:
        """True while the engine process that spawned this worker is its parent."""
        return os.getppid() == self.spec.parent_pid

    def run(self) -> None:
        """Say :class:`Ready`, then serve commands until :class:`Stop` or the engine's death."""
        t = self.transport
        self.chan.send(
            encode(
                Ready(
                    os.getpid(),
                    t.kind,
                    t.descriptor(),
                    self.arena.num_slots,
                    self.arena.row_bytes,
                    t.choice,
                )
            )
        )
        busy_wait = _BUSY_POLL_MIN_S
        while True:
            wait_s = busy_wait if self.pending else _IDLE_POLL_S
            frames = self.chan.recv_all(wait_s)
            if not self.parent_alive():
                return  # the engine is gone; its janitor removes the arena
            for data in frames:
                try:
                    cmd = decode_command(data)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    print(f"kvoffload peer worker: malformed command dropped: {e}", file=sys.stderr)
                    continue
                if isinstance(cmd, Stop):
                    return
                self.handle(cmd)
            progressed = self.settle()
            if self.outcomes:
                self.chan.send(encode(Settled(self.outcomes)))
                self.outcomes = []
            busy_wait = (
                _BUSY_POLL_MIN_S if frames or progressed else min(busy_wait * 2, _BUSY_POLL_MAX_S)
            )

    def handle(self, cmd: Command) -> None:
        """Carry out one command (never raises for what a command names)."""
        t = self.transport
        if isinstance(cmd, AddPeer):
            error = ""
            try:
                t.remove_peer(cmd.name)
                t.add_peer(cmd.name, cmd.descriptor)
            except (TransportError, ValueError) as e:
                error = str(e)
            self.chan.send(encode(PeerAdded(cmd.name, error)))
        elif isinstance(cmd, RemovePeer):
            t.remove_peer(cmd.name)
        elif isinstance(cmd, Transfer):
            self.start(cmd)

    def start(self, x: Transfer) -> None:
        """Hand ``x`` to the transport; a refusal is answered at once (failed, nothing moved)."""
        if x.tid in self.pending:
            self.outcomes.append(Outcome(x.tid, "failed", f"transfer id {x.tid} is in use"))
            return
        try:
            if len(x.local) != len(x.remote):
                raise ValueError(f"{len(x.local)} local slots but {len(x.remote)} remote slots")
            if x.op == "read":
                h = self.transport.read(x.peer, list(zip(x.remote, x.local)), x.deadline_s)
            else:
                h = self.transport.write(x.peer, list(zip(x.local, x.remote)), x.deadline_s)
        except (TransportError, ValueError) as e:
            self.outcomes.append(Outcome(x.tid, "failed", f"{type(e).__name__}: {e}"))
            return
        self.pending[x.tid] = h

    def settle(self) -> bool:
        """Poll every pending transfer; queue an :class:`Outcome` for each that has settled.
        Returns True when one did."""
        progressed = False
        for tid, h in list(self.pending.items()):
            st = self.transport.poll(h)
            if st.state is TransferState.PENDING or not st.settled:
                continue
            del self.pending[tid]
            progressed = True
            if st.state is TransferState.DONE:
                self.outcomes.append(Outcome(tid, "done"))
            else:
                self.outcomes.append(Outcome(tid, "failed", st.reason or "failed"))
        return progressed

    def close(self) -> None:
        """Close the transport (its server stops serving peers) and unmap the arena."""
        self.transport.close()
        self.arena.close()


def _lower_priority(nice: int) -> None:
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:
            pass


def main() -> int:
    """Entry point (``python -m kvoffload.workers.p2p_worker``): reads its :class:`PeerWorkerSpec`
    from the environment and serves until told to stop or its parent is gone. Returns the exit
    status (0; :data:`EXIT_NO_SPEC`; :data:`EXIT_START_FAILED`, after a :class:`StartFailed`)."""
    raw = os.environ.get(PEER_WORKER_SPEC_ENV)
    if not raw:
        print(
            f"kvoffload peer worker: {PEER_WORKER_SPEC_ENV} is not set; peer workers are started "
            "by the engine's p2p tier",
            file=sys.stderr,
        )
        return EXIT_NO_SPEC
    spec = msgspec.json.decode(raw, type=PeerWorkerSpec)
    _lower_priority(spec.nice)
    ctx = zmq.Context(1)
    chan = PeerWorkerChannel.connect(ctx, spec.endpoint)
    try:
        try:
            arena = Arena.attach(spec.arena_name, nonce=spec.arena_nonce)
        except ArenaError as e:
            chan.send(encode(StartFailed(f"arena: {e}")))
            return EXIT_START_FAILED
        try:
            worker = PeerWorker(spec, chan, arena)
        except (TransportError, OSError) as e:  # OSError: e.g. the TCP port is taken
            arena.close()
            chan.send(encode(StartFailed(f"transport: {e}")))
            return EXIT_START_FAILED
        try:
            worker.run()
        except KeyboardInterrupt:
            pass
        finally:
            worker.close()
        return 0
    finally:
        chan.close()
        ctx.term()


if __name__ == "__main__":
    exit_process(main())
