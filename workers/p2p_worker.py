"""Peer worker process of the p2p tier: maps the host arena, owns one Transport, runs slot READs and
keeps the grants of its arena's slots to peers' sessions.

::

    engine (PeerWorkerHandle, node thread)                          peer worker (this module)
    stream ──AddPeer / RemovePeer / Transfer ───────────────▶ stream ▶ Transport (p2p_transport.py)
           ──AddSession / DropSession / Grant / Revoke / Stop ─▶         │ NIXL agent (the arena's rows
           ◀──Ready / PeerAdded / Settled / Granted / Revoked ──         │ registered) or TCP data
           ◀──Refusals / StartFailed                                     │ server: serves peers' READs
                                         peers' one-sided READs ◀────────┘ of granted slots

Started by :class:`kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle` as
``python -m kvoffload.workers.p2p_worker`` (a fresh interpreter: spawn, never fork; its environment
is an allow-list, :mod:`kvoffload.ipc.childenv`, holding no secret) with its
:class:`PeerWorkerSpec` as JSON in ``KVOFFLOAD_PEER_WORKER``
(:data:`~kvoffload.ipc.names.PEER_WORKER_SPEC_ENV`). It attaches the arena by name (checking its
nonce), creates one :class:`~kvoffload.workers.p2p_transport.Transport`, says :class:`Ready` with the
transport's descriptor, then serves commands until :class:`Stop`, its parent's death (polled every
``_IDLE_POLL_S``) or the socket's loss.

A :class:`Transfer` is a READ: peer rows ``remote[i]`` into local rows ``local[i]``, each checked
against ``digests`` (those the serving side took when it granted them); nothing ever writes into
another instance's arena. Each transfer is answered exactly once, in a :class:`Settled` batch, and
only once the transport says it has SETTLED (:attr:`TransferStatus.settled`): a failed NIXL transfer
may still write its local slots until then, so the engine keeps them reserved until it hears. Its
:class:`Outcome` names the rows that failed their digest (``bad``); a transfer whose bytes were not
all in by ``not_after`` (the reader's end of its lease) fails as ``lease_expired``. A transfer the
transport refuses at once (a bad slot, an unknown or down peer) is answered at once, failed and
settled (nothing moved).

A :class:`Grant` lets one session (named by its data token, added by :class:`AddSession`) read
some slots until a time; it is answered by :class:`Granted` with the slots' digests, taken then.
A :class:`Revoke` is answered by :class:`Revoked` once no row of the grant will be sent any more
(at once, or when the row being sent ends): only then may the engine reuse the slots.

The messages are private to this process and its handle: msgpack of a tagged union of
``msgspec.Struct`` (``array_like``), one frame each (``ipc/channels.py``). The process imports no torch (NIXL is
imported through its back-end wheel's API, see ``p2p_transport.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Literal

import msgspec

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
# off (doubling) to _BUSY_POLL_MAX_S while nothing changes (seconds); it is woken at once when a
# transfer or revocation ends (Transport.fileno), so these bound only what the transport cannot
# signal: a NIXL READ's end in UCX, a deadline passing.
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
        channel_fd: this process's end of the stream to the engine (a descriptor it inherited).
        parent_pid: the engine process; the worker exits once it is no longer its parent.
        transport: which transport to run and how (:class:`TransportConfig`).
        nice: CPU niceness increment (0: none).
    """

    arena_name: str
    arena_nonce: bytes
    channel_fd: int
    parent_pid: int
    transport: TransportConfig
    nice: int = 0


# -- engine -> worker -----------------------------------------------------------------------------


class AddPeer(msgspec.Struct, tag="add", array_like=True, forbid_unknown_fields=True):
    """Make peer ``name`` reachable with its transport ``descriptor`` and the data ``token`` of the
    session its grants are made on; a peer of that name that is still known is removed first.
    Answered by :class:`PeerAdded`."""

    name: str
    descriptor: bytes
    token: bytes


class RemovePeer(msgspec.Struct, tag="remove", array_like=True, forbid_unknown_fields=True):
    """Forget peer ``name``; its pending transfers fail ("peer removed") and are answered once
    settled. Not answered itself."""

    name: str


class Transfer(msgspec.Struct, tag="xfer", array_like=True, forbid_unknown_fields=True):
    """READ peer rows ``remote[i]`` into local rows ``local[i]``, checking each against
    ``digests`` (16 bytes per row, in order). ``deadline_s``: seconds from receipt until it fails;
    ``not_after``: ``time.monotonic()`` by which every byte must be in (0: none). ``tid``: the
    engine's id, echoed in :class:`Settled`."""

    tid: int
    peer: str
    local: list[int]
    remote: list[int]
    deadline_s: float
    digests: bytes
    not_after: float = 0.0


class AddSession(msgspec.Struct, tag="session", array_like=True, forbid_unknown_fields=True):
    """Accept data connections proving ``token`` (a control session's data token)."""

    token: bytes


class DropSession(msgspec.Struct, tag="drop", array_like=True, forbid_unknown_fields=True):
    """End ``token``'s session on the data plane: its connections close, its grants are no longer
    served (each still awaits its :class:`Revoke`)."""

    token: bytes


class Grant(msgspec.Struct, tag="grant", array_like=True, forbid_unknown_fields=True):
    """Session ``token`` may read ``slots`` until ``until`` (``time.monotonic()``). Answered by
    :class:`Granted`."""

    gid: int
    token: bytes
    slots: list[int]
    until: float


class Revoke(msgspec.Struct, tag="revoke", array_like=True, forbid_unknown_fields=True):
    """End grant ``gid``; answered by :class:`Revoked` once none of its rows will be sent."""

    gid: int


class Stop(msgspec.Struct, tag="stop", array_like=True, forbid_unknown_fields=True):
    """Close the transport and exit (pending transfers are not answered)."""


Command = AddPeer | RemovePeer | Transfer | AddSession | DropSession | Grant | Revoke | Stop


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
    """One settled transfer: ``state`` "done" or "failed", ``reason`` why it failed; for "done",
    ``bad`` the positions of rows that failed their digest (their keys are not to be served)."""

    tid: int
    state: Literal["done", "failed"]
    reason: str = ""
    bad: list[int] = []


class Settled(msgspec.Struct, tag="settled", array_like=True, forbid_unknown_fields=True):
    """Transfers that have settled since the last report: the transport will never touch their
    local slots again."""

    outcomes: list[Outcome]


class Granted(msgspec.Struct, tag="granted", array_like=True, forbid_unknown_fields=True):
    """Answer to :class:`Grant`: the slots' digests (16 bytes each, in order), or ``error`` (empty
    digests: nothing was granted)."""

    gid: int
    digests: bytes
    error: str = ""


class Revoked(msgspec.Struct, tag="revoked", array_like=True, forbid_unknown_fields=True):
    """Grants none of whose rows will be sent any more."""

    gids: list[int]


class Refusals(msgspec.Struct, tag="refusals", array_like=True, forbid_unknown_fields=True):
    """The data server's refusals so far, by reason (sent when they change)."""

    counts: dict[str, int]


Report = Ready | StartFailed | PeerAdded | Settled | Granted | Revoked | Refusals

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode(msg: Command | Report) -> bytes:
    """msgpack bytes of one message (one frame)."""
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
        self.revoked: list[int] = []
        self.refusals: dict[str, int] = {}

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
            busy = self.pending or t.grants.draining()
            # woken by a command, or by the transport the moment a transfer or revocation ends
            frames = self.chan.recv_all(busy_wait if busy else _IDLE_POLL_S, t.fileno())
            t.clear_wakeup()
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
            self.revoked.extend(t.take_revoked())
            if self.revoked:
                self.chan.send(encode(Revoked(self.revoked)))
                self.revoked = []
            refused = t.refused
            if refused != self.refusals:
                self.refusals = refused
                self.chan.send(encode(Refusals(refused)))
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
                t.add_peer(cmd.name, cmd.descriptor, cmd.token)
            except (TransportError, ValueError) as e:
                error = str(e)
            self.chan.send(encode(PeerAdded(cmd.name, error)))
        elif isinstance(cmd, RemovePeer):
            t.remove_peer(cmd.name)
        elif isinstance(cmd, Transfer):
            self.start(cmd)
        elif isinstance(cmd, Grant):
            try:
                digests = t.grant(cmd.gid, cmd.token, cmd.slots, cmd.until)
            except ValueError as e:
                self.chan.send(encode(Granted(cmd.gid, b"", str(e) or "refused")))
            else:
                self.chan.send(encode(Granted(cmd.gid, digests)))
        elif isinstance(cmd, Revoke):
            if t.revoke(cmd.gid):
                self.revoked.append(cmd.gid)
        elif isinstance(cmd, AddSession):
            try:
                t.add_session(cmd.token)
            except ValueError as e:
                print(f"kvoffload peer worker: session refused: {e}", file=sys.stderr)
        elif isinstance(cmd, DropSession):
            t.drop_session(cmd.token)

    def start(self, x: Transfer) -> None:
        """Hand ``x`` to the transport; a refusal is answered at once (failed, nothing moved)."""
        if x.tid in self.pending:
            self.outcomes.append(Outcome(x.tid, "failed", f"transfer id {x.tid} is in use"))
            return
        try:
            if len(x.local) != len(x.remote):
                raise ValueError(f"{len(x.local)} local slots but {len(x.remote)} remote slots")
            h = self.transport.read(
                x.peer,
                list(zip(x.remote, x.local)),
                x.deadline_s,
                digests=x.digests,
                not_after=x.not_after,
            )
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
                self.outcomes.append(Outcome(tid, "done", bad=list(st.bad)))
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
    chan = PeerWorkerChannel.from_fd(spec.channel_fd)
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


if __name__ == "__main__":
    exit_process(main())
