"""The p2p bulk-transfer layer (``kvoffload.workers.p2p_transport``) between real peer processes.

Each peer is a standalone process (``tests/p2p_peer.py``) that owns its own arena and runs one
transport; the test drives them over pipes. Both implementations run every behaviour test; NIXL is
skipped, with the reason, where it cannot be imported.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from pipe_commands import PipeClient

from kvoffload.ipc.arena import Arena, list_arenas
from kvoffload.workers import p2p_transport as pt

PEER_SCRIPT = Path(__file__).with_name("p2p_peer.py")
SLOTS = 48
ROW = 16 * 1024
# Generous upper bound for anything to happen (seconds): never a measure of speed.
PATIENCE_S = 60.0
# The deadline of transfers that are meant to fail by it (a stopped peer cannot answer in any time).
DEADLINE_S = 1.0

NIXL_MISSING = pt.nixl_available()
KINDS = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            bool(NIXL_MISSING), reason=f"NIXL cannot be imported: {NIXL_MISSING}"
        ),
    ),
]


class PeerProc(PipeClient):
    """One peer process and its command pipe."""

    patience_s = PATIENCE_S

    def __init__(self, tag: str, kind: str, env: dict[str, str] | None = None):
        self.name = f"kvoffload_p2ptest_{os.getpid()}_{tag}_{secrets.token_hex(3)}"
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        reply = self.call(
            "init",
            name=self.name,
            num_slots=SLOTS,
            row_bytes=ROW,
            kind=kind,
            deadline_s=PATIENCE_S,  # tests about deadlines pass a short one per transfer
        )
        assert kind == "auto" or reply["kind"] == kind, reply
        self.kind: str = reply["kind"]
        self.choice: str = reply["choice"]
        self.descriptor: str = reply["descriptor"]

    def rows(self) -> list[str]:
        return self.ok("digest")["rows"]

    def connect(self, other: PeerProc, as_name: str) -> None:
        self.ok("add_peer", name=as_name, descriptor=other.descriptor)

    def stop(self) -> None:
        """Close cleanly if alive, else reap."""
        self.stop_process()


@pytest.fixture
def peers():
    made: list[PeerProc] = []

    def make(tag: str, kind: str, env: dict[str, str] | None = None) -> PeerProc:
        p = PeerProc(tag, kind, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()
    # Nothing left behind: every peer process reaped, every arena gone (a killed peer's janitor
    # removes its segment shortly after the kill).
    assert all(p.proc.returncode is not None for p in made)
    names = {p.name for p in made}
    deadline = time.monotonic() + PATIENCE_S
    while (left := [a.name for a in list_arenas() if a.name in names]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not left, f"arenas left behind: {left}"


def _pair_up(*ps: PeerProc) -> None:
    names = "abcdefgh"
    for i, p in enumerate(ps):
        for j, q in enumerate(ps):
            if i != j:
                p.connect(q, names[j])


@pytest.mark.parametrize("kind", KINDS)
def test_read_and_write_are_bit_exact_both_ways(peers, kind):
    a, b = peers("a", kind), peers("b", kind)
    a.ok("fill", seed=1)
    b.ok("fill", seed=2)
    _pair_up(a, b)
    ra, rb = a.rows(), b.rows()

    # At once (so the slots each side reads and writes are disjoint): A reads B's slots 0..23 into
    # its slots 47..24 (reversed); B reads A's 0..23 into its 24..47.
    read_ab = [(r, SLOTS - 1 - r) for r in range(24)]
    read_ba = [(i, 24 + i) for i in range(24)]
    h1 = a.ok("read", peer="b", pairs=read_ab)["handle"]
    h2 = b.ok("read", peer="a", pairs=read_ba)["handle"]
    assert a.ok("wait", handle=h1, timeout_s=PATIENCE_S)["state"] == "done"
    assert b.ok("wait", handle=h2, timeout_s=PATIENCE_S)["state"] == "done"
    ra2, rb2 = a.rows(), b.rows()
    assert [ra2[lo] for _, lo in read_ab] == [rb[r] for r, _ in read_ab]
    assert [rb2[lo] for _, lo in read_ba] == [ra[r] for r, _ in read_ba]
    assert ra2[:24] == ra[:24]  # untouched rows stay as they were
    assert rb2[:24] == rb[:24]

    # Writes: A pushes its slots 0..9 into B's 30..39; B pushes its 40..47 into A's 10..17.
    write_ab = [(i, 30 + i) for i in range(10)]
    write_ba = [(40 + i, 10 + i) for i in range(8)]
    h3 = a.ok("write", peer="b", pairs=write_ab)["handle"]
    h4 = b.ok("write", peer="a", pairs=write_ba)["handle"]
    assert a.ok("wait", handle=h3, timeout_s=PATIENCE_S)["state"] == "done"
    assert b.ok("wait", handle=h4, timeout_s=PATIENCE_S)["state"] == "done"
    ra3, rb3 = a.rows(), b.rows()
    assert [rb3[r] for _, r in write_ab] == [ra2[lo] for lo, _ in write_ab]
    assert [ra3[r] for _, r in write_ba] == [rb2[lo] for lo, _ in write_ba]
    assert ra3[18:] == ra2[18:] and ra3[:10] == ra2[:10]


@pytest.mark.parametrize("kind", KINDS)
def test_three_peers_read_and_write_each_other_at_once(peers, kind):
    ps = [peers(t, kind) for t in "abc"]
    for i, p in enumerate(ps):
        p.ok("fill", seed=10 + i)
    _pair_up(*ps)
    before = [p.rows() for p in ps]
    a, b, c = ps
    # A reads 0..15 from B and 16..31 from C at once; B writes 0..15 into C's 32..47.
    h_ab = a.ok("read", peer="b", pairs=[(i, i) for i in range(16)])["handle"]
    h_ac = a.ok("read", peer="c", pairs=[(i, i) for i in range(16, 32)])["handle"]
    h_bc = b.ok("write", peer="c", pairs=[(i, 32 + i) for i in range(16)])["handle"]
    for p, h in ((a, h_ab), (a, h_ac), (b, h_bc)):
        assert p.ok("wait", handle=h, timeout_s=PATIENCE_S)["state"] == "done"
    ra, rc = a.rows(), c.rows()
    assert ra[:16] == before[1][:16]
    assert ra[16:32] == before[2][16:32]
    assert ra[32:] == before[0][32:]
    assert rc[32:] == before[1][:16]
    assert rc[:32] == before[2][:32]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_slot_pairs_are_refused_and_nothing_moves(peers, kind):
    a, b = peers("a", kind), peers("b", kind)
    a.ok("fill", seed=3)
    b.ok("fill", seed=4)
    _pair_up(a, b)
    ra, rb = a.rows(), b.rows()
    bad = [
        ("read", [(0, SLOTS)]),  # local slot out of range
        ("read", [(SLOTS, 0)]),  # remote slot out of range
        ("read", [(0, -1)]),
        ("write", [(SLOTS + 5, 0)]),
        ("write", [(0, SLOTS)]),
        ("read", [(0, 3), (1, 3)]),  # one local destination twice
        ("write", [(0, 3), (1, 3)]),  # one remote destination twice
        ("read", []),
    ]
    for op, pairs in bad:
        reply = a.call(op, peer="b", pairs=pairs)
        assert reply.get("error") == "ValueError", (op, pairs, reply)
    assert a.call("read", peer="b", pairs=[(0, 0)], deadline_s=0).get("error") == "ValueError"
    unknown = a.call("read", peer="nobody", pairs=[(0, 0)])
    assert unknown.get("error") == "PeerDownError"
    assert a.rows() == ra and b.rows() == rb
    assert a.ok("peer_up", name="b")["up"]  # refusing a request does not mark the peer down


def test_tcp_server_checks_token_and_every_request(peers):
    b = peers("b", "tcp")
    b.ok("fill", seed=5)
    rb = b.rows()
    desc = pt.decode_descriptor(bytes.fromhex(b.descriptor))
    assert isinstance(desc, pt.TcpDescriptor)
    assert desc.host == "127.0.0.1"  # loopback unless told otherwise

    def frame(obj) -> bytes:
        body = msgspec.msgpack.encode(obj)
        return struct.pack("<I", len(body)) + body

    def closed_after(payload: bytes) -> bytes:
        with socket.create_connection((desc.host, desc.port), timeout=PATIENCE_S) as s:
            s.sendall(payload)
            data = b""
            with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
                while chunk := s.recv(65536):
                    data += chunk
            return data

    # A wrong token, a garbage hello and an oversized header frame: closed, nothing answered.
    assert closed_after(frame(pt.TcpHello(b"x" * 32)) + frame(pt.TcpRequest("read", 1, [0]))) == b""
    assert closed_after(b"\x05\x00\x00\x00hello") == b""
    hello = frame(pt.TcpHello(desc.token))
    assert closed_after(hello + struct.pack("<I", pt.MAX_HEADER_BYTES + 1)) == b""
    # A write to a slot outside the arena: refused before a byte lands, connection closed.
    reply = closed_after(hello + frame(pt.TcpRequest("write", 7, [SLOTS])))
    (n,) = struct.unpack("<I", reply[:4])
    answer = msgspec.msgpack.decode(reply[4 : 4 + n], type=pt.TcpReply)
    assert answer.xfer_id == 7 and "outside the arena" in answer.error
    # A request of the wrong shape (unknown op): refused.
    reply = closed_after(hello + frame(["erase", 8, [0]]))
    assert b"malformed request" in reply
    assert b.rows() == rb


@pytest.mark.parametrize("kind", KINDS)
def test_peer_killed_mid_transfer_fails_within_deadline_without_delaying_others(peers, kind):
    # UCX over TCP needs the serving process to answer a READ (shared memory would let the READ
    # finish while the peer is stopped), so a stopped peer holds the transfer in flight.
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    a, b, c = (peers(t, kind, env) for t in "abc")
    for i, p in enumerate((a, b, c)):
        p.ok("fill", seed=20 + i)
    _pair_up(a, b, c)
    rc = c.rows()

    os.kill(b.proc.pid, signal.SIGSTOP)
    # A long deadline, so only the kill can end this transfer early.
    pairs = [(i, i) for i in range(SLOTS)]
    h_dead = a.ok("read", peer="b", pairs=pairs, deadline_s=PATIENCE_S)["handle"]
    assert a.ok("poll", handle=h_dead)["state"] == "pending"
    # A transfer to a live peer while B hangs completes, and B's is still in flight: it did not wait.
    h_live = a.ok("read", peer="c", pairs=[(i, i) for i in range(SLOTS)])["handle"]
    assert a.ok("wait", handle=h_live, timeout_s=PATIENCE_S)["state"] == "done"
    assert a.ok("poll", handle=h_dead)["state"] == "pending"

    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(timeout=PATIENCE_S)
    dead = a.ok("wait", handle=h_dead, timeout_s=PATIENCE_S, settled=True)
    assert dead["state"] == "failed" and dead["reason"], dead
    assert "deadline" not in dead["reason"], dead  # the death was noticed, not waited out
    assert dead["settled"], dead
    assert not a.ok("peer_up", name="b")["up"]
    assert a.call("read", peer="b", pairs=[(0, 0)]).get("error") == "PeerDownError"

    # The live peer still works after the death, both ways.
    h = a.ok("read", peer="c", pairs=[(i, i) for i in range(8)])["handle"]
    assert a.ok("wait", handle=h, timeout_s=PATIENCE_S)["state"] == "done"
    ra = a.rows()
    assert ra[:8] == rc[:8]
    h = a.ok("write", peer="c", pairs=[(SLOTS - 1, 40)])["handle"]
    assert a.ok("wait", handle=h, timeout_s=PATIENCE_S)["state"] == "done"
    assert c.rows()[40] == ra[SLOTS - 1]
    a.ok("remove_peer", name="b")


@pytest.mark.parametrize("kind", KINDS)
def test_silent_peer_fails_at_its_deadline_and_the_transport_recovers_on_re_add(peers, kind):
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    a, b = peers("a", kind, env), peers("b", kind, env)
    b.ok("fill", seed=30)
    _pair_up(a, b)
    rb = b.rows()
    os.kill(b.proc.pid, signal.SIGSTOP)
    h = a.ok("read", peer="b", pairs=[(i, i) for i in range(SLOTS)], deadline_s=DEADLINE_S)[
        "handle"
    ]
    t0 = time.monotonic()
    st = a.ok("wait", handle=h, timeout_s=PATIENCE_S)
    assert st["state"] == "failed" and "deadline" in st["reason"], st
    assert st["waited_s"] >= DEADLINE_S * 0.5  # not failed before the peer had its chance
    assert time.monotonic() - t0 < PATIENCE_S
    assert not a.ok("peer_up", name="b")["up"]
    # Removing the peer does not settle what UCX may still complete into A's slots.
    a.ok("remove_peer", name="b")
    if not st["settled"]:
        assert not a.ok("poll", handle=h)["settled"]
        refused = a.call("add_peer", name="b", descriptor=b.descriptor)
        assert refused.get("error") == "TransportError" and "unsettled" in refused["message"]
    os.kill(b.proc.pid, signal.SIGCONT)
    if not st["settled"]:  # NIXL: the request completes (or errors) once B answers
        st = a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)
        assert st["state"] == "failed" and st["settled"], st
    # Re-adding the peer (what the tier does after a heartbeat) makes it usable again.
    a.ok("add_peer", name="b", descriptor=b.descriptor)
    h = a.ok("read", peer="b", pairs=[(i, i) for i in range(SLOTS)])["handle"]
    assert a.ok("wait", handle=h, timeout_s=PATIENCE_S)["state"] == "done"
    assert a.rows() == rb


@pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL cannot be imported: {NIXL_MISSING}")
def test_nixl_peer_process_stays_torch_free(peers):
    a, b = peers("a", "nixl"), peers("b", "nixl")
    _pair_up(a, b)
    h = a.ok("read", peer="b", pairs=[(0, 0)])["handle"]
    assert a.ok("wait", handle=h, timeout_s=PATIENCE_S)["state"] == "done"
    maps = a.ok("maps")
    assert maps["nixl_mapped"], maps  # NIXL really is loaded
    assert not maps["torch_mapped"] and not maps["torch_imported"], maps


def test_descriptors_are_checked():
    with pytest.raises(pt.TransportError, match="malformed"):
        pt.decode_descriptor(b"\x93garbage")
    with pytest.raises(pt.TransportError, match="over"):
        pt.decode_descriptor(b"\x00" * (pt.MAX_DESCRIPTOR_BYTES + 1))
    raw = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, b"t", 0, 4096))
    with pytest.raises(pt.TransportError, match="impossible arena shape"):
        pt.decode_descriptor(raw)
    with pytest.raises(ValueError, match="deadline_s"):
        pt.TransportConfig(deadline_s=0)


def test_auto_chooses_nixl_when_it_imports_else_tcp_and_peers_must_match(peers):
    # in a peer process: a process that made a NIXL agent dies at exit (pt.exit_process)
    auto = peers("auto", "auto")
    assert auto.kind == ("tcp" if NIXL_MISSING else "nixl")
    # why it runs, as the peer worker logs it and `kvoffload demo --p2p` prints it
    # (the reason's words may differ between processes: which NIXL module failed first)
    if NIXL_MISSING:
        assert auto.choice.startswith("auto: NIXL cannot run here (") and len(auto.choice) > 30
    else:
        assert auto.choice == "auto: NIXL imports and its UCX back end started"
    arena = Arena.create(f"kvoffload_p2ptest_{os.getpid()}_auto", 4, 4096)
    try:
        if NIXL_MISSING:
            with pytest.raises(pt.TransportError, match="'nixl' cannot start"):
                pt.make_transport(arena, pt.TransportConfig(kind="nixl"))
        tcp = pt.make_transport(arena, pt.TransportConfig(kind="tcp"))
        try:
            assert tcp.choice == "configured"
            other_kind = msgspec.msgpack.encode(pt.NixlDescriptor(b"md", 4096, 4, 4096))
            with pytest.raises(pt.TransportError, match="offers a nixl descriptor"):
                tcp.add_peer("x", other_kind)
            other_rows = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, b"t", 4, 8192))
            with pytest.raises(pt.TransportError, match="8192-byte slots"):
                tcp.add_peer("x", other_rows)
            assert not tcp.peer_up("x")
        finally:
            tcp.close()
    finally:
        arena.close()
