"""The p2p bulk-transfer layer (``kvoffload.workers.p2p_transport``) between real peer processes.

Each peer is a standalone process (``tests/p2p_peer.py``) that owns its own arena and runs one
transport; the test drives them over pipes. Both implementations run every behaviour test; NIXL is
skipped, with the reason, where it cannot be imported. The serving side grants what is read (a
session's token, the slots, a lifetime) and the reader checks every row against the digests the
grant returned, as the p2p tier does. Hostile programs on the TCP data port speak the real wire
protocol from this test process.
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
import xxhash
from helpers import TESTS_DIR, patience, stop_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from p2p_data import DataClient, frame
from pipe_commands import PipeClient

from kvoffload.ipc.arena import Arena, list_arenas
from kvoffload.workers import p2p_transport as pt

PEER_SCRIPT = Path(TESTS_DIR) / "p2p_peer.py"
SLOTS = 48
ROW = 16 * 1024
# Generous upper bound for anything to happen (seconds): never a measure of speed.
PATIENCE_S = patience(60.0)
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

    def __init__(
        self,
        tag: str,
        kind: str,
        env: dict[str, str] | None = None,
        deadline_s: float = PATIENCE_S,  # tests about deadlines pass a short one per transfer
        **config,  # more TransportConfig fields (nixl_part_bytes)
    ):
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
            deadline_s=deadline_s,
            **config,
        )
        assert kind == "auto" or reply["kind"] == kind, reply
        self.kind: str = reply["kind"]
        self.choice: str = reply["choice"]
        self.descriptor: str = reply["descriptor"]
        self.gids = iter(range(1, 1 << 30))

    def rows(self) -> list[str]:
        return self.ok("digest")["rows"]

    def grant(self, token: str, slots: list[int], ttl_s: float = PATIENCE_S) -> tuple[int, str]:
        """Grant ``slots`` to ``token``'s session: (grant id, digests hex)."""
        gid = next(self.gids)
        return gid, self.ok("grant", gid=gid, token=token, slots=slots, ttl_s=ttl_s)["digests"]

    def refused(self) -> dict[str, int]:
        return self.ok("refused")["refused"]

    def stop(self) -> None:
        """Close cleanly if alive, else reap."""
        self.stop_process()


@pytest.fixture
def peers():
    made: list[PeerProc] = []

    def make(tag: str, kind: str, env: dict[str, str] | None = None, **kw) -> PeerProc:
        p = PeerProc(tag, kind, env, **kw)
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


class Session:
    """One session's data token shared by a reader and a server (what the control channel's
    Welcome hands both), with the server's grants read back as the reader needs them."""

    def __init__(self, reader: PeerProc, server: PeerProc, as_name: str):
        self.token = secrets.token_hex(pt.TOKEN_BYTES)
        self.reader, self.server, self.name = reader, server, as_name
        server.ok("add_session", token=self.token)
        reader.ok("add_peer", name=as_name, descriptor=server.descriptor, token=self.token)

    def read(self, pairs, deadline_s=None, ttl_s=PATIENCE_S, not_after_s=0.0) -> dict:
        """Grant the remote slots of ``pairs`` ((remote, local)) and start the reader's READ."""
        _, digests = self.server.grant(self.token, [r for r, _ in pairs], ttl_s)
        return self.reader.call(
            "read",
            peer=self.name,
            pairs=pairs,
            digests=digests,
            deadline_s=deadline_s,
            not_after_s=not_after_s,
        )

    def transfer(self, pairs, **kw) -> dict:
        """:meth:`read` and wait until it is final and settled."""
        h = self.read(pairs, **kw)["handle"]
        return self.reader.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)


def _revoke(peer: PeerProc, gid: int) -> None:
    """Revoke grant ``gid`` and wait for its acknowledgement: a reader may have received a row's
    last byte before the server's thread is done sending it (the grant is then acknowledged
    through ``take_revoked``)."""
    if peer.ok("revoke", gid=gid)["done"]:
        return
    deadline = time.monotonic() + PATIENCE_S
    while gid not in peer.ok("revoked")["gids"]:
        assert time.monotonic() < deadline, f"grant {gid} was never acknowledged revoked"
        time.sleep(0.01)


def _pair_up(*ps: PeerProc) -> dict[tuple[int, int], Session]:
    """A session for each ordered pair (reader i, server j); readers know server j as "abc..."[j]."""
    names = "abcdefgh"
    return {
        (i, j): Session(p, q, names[j])
        for i, p in enumerate(ps)
        for j, q in enumerate(ps)
        if i != j
    }


@pytest.mark.parametrize("kind", KINDS)
def test_granted_reads_are_bit_exact_both_ways(peers, kind):
    a, b = peers("a", kind), peers("b", kind)
    a.ok("fill", seed=1)
    b.ok("fill", seed=2)
    s = _pair_up(a, b)
    ra, rb = a.rows(), b.rows()

    # At once (so the slots each side reads into are disjoint): A reads B's slots 0..23 into its
    # slots 47..24 (reversed); B reads A's 0..23 into its 24..47.
    read_ab = [(r, SLOTS - 1 - r) for r in range(24)]
    read_ba = [(i, 24 + i) for i in range(24)]
    h1 = s[0, 1].read(read_ab)["handle"]
    h2 = s[1, 0].read(read_ba)["handle"]
    assert a.ok("wait", handle=h1, timeout_s=PATIENCE_S)["state"] == "done"
    assert b.ok("wait", handle=h2, timeout_s=PATIENCE_S)["state"] == "done"
    ra2, rb2 = a.rows(), b.rows()
    assert [ra2[lo] for _, lo in read_ab] == [rb[r] for r, _ in read_ab]
    assert [rb2[lo] for _, lo in read_ba] == [ra[r] for r, _ in read_ba]
    assert ra2[:24] == ra[:24]  # untouched rows stay as they were
    assert rb2[:24] == rb[:24]


@pytest.mark.parametrize("kind", KINDS)
def test_a_finished_read_wakes_its_owner_without_a_timer(peers, kind):
    """The transport's descriptor turns readable when a read's outcome is ready (TCP: its last
    row checked; NIXL: its digest check over), so the peer worker reports it at once instead of
    at its next timed poll."""
    a, b = peers("a", kind), peers("b", kind)
    b.ok("fill", seed=3)
    s = _pair_up(a, b)
    for _ in range(3):
        h = s[0, 1].read([(r, r) for r in range(8)])["handle"]
        got = a.ok("wait_woken", handle=h, timeout_s=PATIENCE_S)
        assert got == {"state": "done", "timer": False}
    assert a.rows()[:8] == b.rows()[:8]


@pytest.mark.parametrize("kind", KINDS)
def test_three_peers_read_each_other_at_once(peers, kind):
    ps = [peers(t, kind) for t in "abc"]
    for i, p in enumerate(ps):
        p.ok("fill", seed=10 + i)
    s = _pair_up(*ps)
    before = [p.rows() for p in ps]
    a, b, c = ps
    # A reads 0..15 from B and 16..31 from C at once; C reads B's 0..15 into its 32..47.
    h_ab = s[0, 1].read([(i, i) for i in range(16)])["handle"]
    h_ac = s[0, 2].read([(i, i) for i in range(16, 32)])["handle"]
    h_cb = s[2, 1].read([(i, 32 + i) for i in range(16)])["handle"]
    for p, h in ((a, h_ab), (a, h_ac), (c, h_cb)):
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
    s = _pair_up(a, b)[0, 1]
    ra, rb = a.rows(), b.rows()
    one = "00" * pt.DIGEST_BYTES
    bad = [
        ([(0, SLOTS)], one),  # local slot out of range
        ([(SLOTS, 0)], one),  # remote slot out of range
        ([(0, -1)], one),
        ([(3, 0), (3, 0)], one * 2),  # one local destination twice
        ([], ""),
        ([(0, 0)], one * 2),  # digests of another length
    ]
    for pairs, digests in bad:
        reply = a.call("read", peer="b", pairs=pairs, digests=digests)
        assert reply.get("error") == "ValueError", (pairs, reply)
    zero = a.call("read", peer="b", pairs=[(0, 0)], digests=one, deadline_s=0)
    assert zero.get("error") == "ValueError"
    unknown = a.call("read", peer="nobody", pairs=[(0, 0)], digests=one)
    assert unknown.get("error") == "PeerDownError"
    assert a.rows() == ra and b.rows() == rb
    assert a.ok("peer_up", name="b")["up"]  # refusing a request does not mark the peer down
    assert s.transfer([(0, 0)])["state"] == "done"
    for slots in ([SLOTS], [], [-1]):
        assert (
            b.call("grant", gid=99, token=s.token, slots=slots, ttl_s=1.0)["error"] == "ValueError"
        )


def _reply_of(data: bytes) -> pt.TcpReply:
    (n,) = struct.unpack("<I", data[:4])
    return msgspec.msgpack.decode(data[4 : 4 + n], type=pt.TcpReply)


def test_c39_the_tcp_data_server_serves_only_reads_a_live_grant_of_the_session_covers(peers):
    """An authenticated session reads what it was granted while the grant lives, nothing else;
    another session cannot read it; nobody writes; each refusal is counted, the bytes unchanged."""
    a, b = peers("a", "tcp"), peers("b", "tcp")
    b.ok("fill", seed=5)
    rb = b.rows()
    desc = pt.decode_descriptor(bytes.fromhex(b.descriptor))
    assert isinstance(desc, pt.TcpDescriptor) and desc.host == "127.0.0.1"
    mine, other = secrets.token_bytes(32), secrets.token_bytes(32)
    for t in (mine, other):
        b.ok("add_session", token=t.hex())
    gid, _ = b.grant(mine.hex(), [0, 1, 2, 3])
    b.grant(other.hex(), [8, 9])

    # The session reads its granted slots, bit-exact, on its own connection...
    c = DataClient(desc)
    c.authenticate(mine)
    assert c.read([0, 3]).error == ""
    assert xxhash.xxh3_64_hexdigest(c.recv_exact(2 * ROW)[ROW:]) == rb[3]
    # ...and not a slot outside its grant, nor another session's (the connection is closed)
    for slots in ([0, 4], [8]):
        c = DataClient(desc)
        c.authenticate(mine)
        assert "not_granted" in c.read(slots).error
        assert c.closed_after() == b""
    # a write of any kind, by an authenticated session: refused before a byte lands
    for op in ("write", "WRITE", "put"):
        c = DataClient(desc)
        c.authenticate(mine)
        reply = _reply_of(c.closed_after(frame(pt.TcpRequest(op, 7, [0])) + b"\x00" * ROW))
        assert reply.xfer_id == 7 and "only reads" in reply.error
    c = DataClient(desc)
    c.authenticate(mine)
    assert b"malformed request" in c.closed_after(frame(["write", 8, [0], b"\x01" * 64]))
    # a connection that does not prove a session's token, or names none: closed, told nothing
    c = DataClient(desc)
    c.sock.sendall(frame(pt.DataHello(pt.session_id(secrets.token_bytes(32)), os.urandom(32))))
    assert c.closed_after() == b""
    c = DataClient(desc)
    c.sock.sendall(frame(pt.DataHello(pt.session_id(mine), os.urandom(32))))
    c.recv_frame()  # the server's proof
    assert (
        c.closed_after(frame(pt.DataAuth(b"\x00" * 32)) + frame(pt.TcpRequest("read", 1, [0])))
        == b""
    )
    assert DataClient(desc).closed_after(b"\x05\x00\x00\x00hello") == b""
    # a revoked grant serves nothing more, nor does the session once dropped
    _revoke(b, gid)
    c = DataClient(desc)
    c.authenticate(mine)
    assert "not_granted" in c.read([0]).error
    b.grant(mine.hex(), [5])
    b.ok("drop_session", token=mine.hex())
    c = DataClient(desc)
    c.sock.sendall(frame(pt.DataHello(pt.session_id(mine), os.urandom(32))))
    assert c.closed_after() == b""
    # an expired grant serves nothing
    b.grant(other.hex(), [6], ttl_s=-1.0)  # ended before it is read
    c = DataClient(desc)
    c.authenticate(other)
    assert "expired" in c.read([6]).error

    assert b.rows() == rb
    refused = b.refused()
    assert refused["not_granted"] == 3 and refused["write"] == 3 and refused["malformed"] >= 2
    assert refused["unauthenticated"] == 3 and refused["expired"] == 1, refused
    # and through the transport itself: a read beyond the grant fails, the granted one succeeds
    s = Session(a, b, "b")
    _, digests = b.grant(s.token, [10])
    h = a.ok("read", peer="b", pairs=[(11, 0)], digests=digests)["handle"]
    st = a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)
    assert st["state"] == "failed" and "not_granted" in st["reason"], st
    a.ok("remove_peer", name="b")
    s = Session(a, b, "b")
    assert s.transfer([(12, 0)])["state"] == "done"
    assert a.rows()[0] == rb[12]


@pytest.mark.parametrize("kind", KINDS)
def test_c40_a_row_that_changed_after_its_grant_fails_its_digest_and_the_others_are_good(
    peers, kind
):
    a, b = peers("a", kind), peers("b", kind)
    b.ok("fill", seed=6)
    s = _pair_up(a, b)[0, 1]
    rb = b.rows()
    _, digests = b.grant(s.token, [0, 1, 2, 3])
    b.ok("scribble", slots=[2], value=7)  # the serving slot is reused for other bytes
    h = a.ok("read", peer="b", pairs=[(i, i) for i in range(4)], digests=digests)["handle"]
    st = a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)
    assert st["state"] == "done" and st["bad"] == [2], st
    ra = a.rows()
    assert [ra[i] for i in (0, 1, 3)] == [rb[i] for i in (0, 1, 3)]
    # digests of another session's seed do not match the same bytes either
    t = secrets.token_hex(pt.TOKEN_BYTES)
    b.ok("add_session", token=t)
    _, foreign = b.grant(t, [0])
    _, own = b.grant(s.token, [0])
    assert foreign != own
    h = a.ok("read", peer="b", pairs=[(0, 5)], digests=foreign)["handle"]
    assert a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)["bad"] == [0]


@pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL cannot be imported: {NIXL_MISSING}")
def test_c40_a_nixl_read_in_parts_is_checked_part_by_part(peers):
    """A NIXL READ is posted in parts (here 3 rows each) and each part is checked as it ends:
    rows that changed after the grant in the first, a middle and the last part are the ones
    reported, by their position in the transfer, and every row holds the serving side's bytes."""
    a, b = peers("a", "nixl", nixl_part_bytes=3 * ROW), peers("b", "nixl")
    b.ok("fill", seed=8)
    s = _pair_up(a, b)[0, 1]
    _, digests = b.grant(s.token, list(range(SLOTS)))
    b.ok("scribble", slots=[0, 7, SLOTS - 1], value=9)
    pairs = [(r, SLOTS - 1 - r) for r in range(SLOTS)]
    h = a.ok("read", peer="b", pairs=pairs, digests=digests)["handle"]
    st = a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)
    assert st["state"] == "done" and st["bad"] == [0, 7, SLOTS - 1], st
    ra, rb = a.rows(), b.rows()
    assert [ra[lo] for _, lo in pairs] == [rb[r] for r, _ in pairs]


@pytest.mark.parametrize("kind", KINDS)
def test_c40_a_read_not_over_by_the_end_of_its_lease_fails_lease_expired(peers, kind):
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    a, b = peers("a", kind, env), peers("b", kind, env)
    b.ok("fill", seed=7)
    s = _pair_up(a, b)[0, 1]
    pairs = [(i, i) for i in range(SLOTS)]
    _, digests = b.grant(s.token, list(range(SLOTS)))
    stop_process(b.proc.pid)  # B cannot serve: the read outlives its lease
    h = a.ok(
        "read",
        peer="b",
        pairs=pairs,
        digests=digests,
        deadline_s=PATIENCE_S,
        not_after_s=DEADLINE_S,
    )
    st = a.ok("wait", handle=h["handle"], timeout_s=PATIENCE_S)
    assert st["state"] == "failed" and st["reason"] == pt.LEASE_EXPIRED, st
    os.kill(b.proc.pid, signal.SIGCONT)
    if not st["settled"]:  # NIXL: the request completes (or errors) once B answers
        st = a.ok("wait", handle=h["handle"], timeout_s=PATIENCE_S, settled=True)
        assert st["state"] == "failed" and st["settled"], st


def test_c41_a_flood_of_unauthenticated_data_connections_does_not_stop_honest_reads(peers):
    a, b = peers("a", "tcp"), peers("b", "tcp", deadline_s=1.0)
    b.ok("fill", seed=9)
    rb = b.rows()
    s = _pair_up(a, b)[0, 1]
    desc = pt.decode_descriptor(bytes.fromhex(b.descriptor))
    flood = []
    try:
        # one source opens many connections and says nothing; many sources one each
        for _ in range(3 * pt.MAX_PENDING_PER_SOURCE):
            flood.append(DataClient(desc, "127.0.0.2"))
        for i in range(pt.MAX_PENDING_TOTAL + 8):
            flood.append(DataClient(desc, f"127.0.1.{i + 1}"))
        st = s.transfer([(i, i) for i in range(8)])
        assert st["state"] == "done" and st["bad"] == [], st
        assert a.rows()[:8] == rb[:8]
        refused = b.refused()
        assert refused["flood"] >= 2 * pt.MAX_PENDING_PER_SOURCE + 8, refused
        # a silent connection is closed once the first bytes' deadline passes
        quiet = DataClient(desc, "127.0.0.3")
        assert quiet.closed_after() == b""
    finally:
        for c in flood:
            c.sock.close()


@pytest.mark.parametrize("kind", KINDS)
def test_peer_killed_mid_transfer_fails_within_deadline_without_delaying_others(peers, kind):
    # UCX over TCP needs the serving process to answer a READ (shared memory would let the READ
    # finish while the peer is stopped), so a stopped peer holds the transfer in flight.
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    a, b, c = (peers(t, kind, env) for t in "abc")
    for i, p in enumerate((a, b, c)):
        p.ok("fill", seed=20 + i)
    s = _pair_up(a, b, c)
    rc = c.rows()
    pairs = [(i, i) for i in range(SLOTS)]
    _, dead_digests = b.grant(s[0, 1].token, list(range(SLOTS)))

    stop_process(b.proc.pid)
    # A long deadline, so only the kill can end this transfer early.
    h_dead = a.ok("read", peer="b", pairs=pairs, digests=dead_digests, deadline_s=PATIENCE_S)[
        "handle"
    ]
    assert a.ok("poll", handle=h_dead)["state"] == "pending"
    # A transfer to a live peer while B hangs completes, and B's is still in flight: it did not wait.
    h_live = s[0, 2].read([(i, i) for i in range(SLOTS)])["handle"]
    assert a.ok("wait", handle=h_live, timeout_s=PATIENCE_S)["state"] == "done"
    assert a.ok("poll", handle=h_dead)["state"] == "pending"

    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(timeout=PATIENCE_S)
    dead = a.ok("wait", handle=h_dead, timeout_s=PATIENCE_S, settled=True)
    assert dead["state"] == "failed" and dead["reason"], dead
    assert "deadline" not in dead["reason"], dead  # the death was noticed, not waited out
    assert dead["settled"], dead
    assert not a.ok("peer_up", name="b")["up"]
    one = "00" * pt.DIGEST_BYTES
    assert a.call("read", peer="b", pairs=[(0, 0)], digests=one).get("error") == "PeerDownError"

    # The live peer still works after the death, both ways.
    assert s[0, 2].transfer([(i, i) for i in range(8)])["state"] == "done"
    ra = a.rows()
    assert ra[:8] == rc[:8]
    assert s[2, 0].transfer([(SLOTS - 1, 40)])["state"] == "done"
    assert c.rows()[40] == ra[SLOTS - 1]
    a.ok("remove_peer", name="b")


@pytest.mark.parametrize("kind", KINDS)
def test_silent_peer_fails_at_its_deadline_and_the_transport_recovers_on_re_add(peers, kind):
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    a, b = peers("a", kind, env), peers("b", kind, env)
    b.ok("fill", seed=30)
    sess = _pair_up(a, b)[0, 1]
    rb = b.rows()
    _, digests = b.grant(sess.token, list(range(SLOTS)))
    stop_process(b.proc.pid)
    pairs = [(i, i) for i in range(SLOTS)]
    h = a.ok("read", peer="b", pairs=pairs, digests=digests, deadline_s=DEADLINE_S)["handle"]
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
        refused = a.call("add_peer", name="b", descriptor=b.descriptor, token=sess.token)
        assert refused.get("error") == "TransportError" and "unsettled" in refused["message"]
    os.kill(b.proc.pid, signal.SIGCONT)
    if not st["settled"]:  # NIXL: the request completes (or errors) once B answers
        st = a.ok("wait", handle=h, timeout_s=PATIENCE_S, settled=True)
        assert st["state"] == "failed" and st["settled"], st
    # Re-adding the peer (what the tier does after a heartbeat) makes it usable again.
    a.ok("add_peer", name="b", descriptor=b.descriptor, token=sess.token)
    assert sess.transfer(pairs)["state"] == "done"
    assert a.rows() == rb


@pytest.mark.skipif(bool(NIXL_MISSING), reason=f"NIXL cannot be imported: {NIXL_MISSING}")
def test_nixl_peer_process_stays_torch_free(peers):
    a, b = peers("a", "nixl"), peers("b", "nixl")
    assert _pair_up(a, b)[0, 1].transfer([(0, 0)])["state"] == "done"
    maps = a.ok("maps")
    assert maps["nixl_mapped"], maps  # NIXL really is loaded
    assert not maps["torch_mapped"] and not maps["torch_imported"], maps


def test_descriptors_are_checked():
    with pytest.raises(pt.TransportError, match="malformed"):
        pt.decode_descriptor(b"\x93garbage")
    with pytest.raises(pt.TransportError, match="over"):
        pt.decode_descriptor(b"\x00" * (pt.MAX_DESCRIPTOR_BYTES + 1))
    raw = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, 0, 4096))
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
            token = secrets.token_bytes(pt.TOKEN_BYTES)
            with pytest.raises(pt.TransportError, match="offers a nixl descriptor"):
                tcp.add_peer("x", other_kind, token)
            other_rows = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, 4, 8192))
            with pytest.raises(pt.TransportError, match="8192-byte slots"):
                tcp.add_peer("x", other_rows, token)
            same = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, 4, 4096))
            with pytest.raises(pt.TransportError, match="token"):
                tcp.add_peer("x", same, b"short")
            assert not tcp.peer_up("x")
        finally:
            tcp.close()
    finally:
        arena.close()


# -- fuzz of the TCP data port ----------------------------------------------------------------------

_FUZZ_GRANTED = [0, 1, 2, 3]
_slot_any = st.integers(-3, SLOTS + 3) | st.integers(-(1 << 63), (1 << 64) - 1)
_request = st.builds(
    pt.TcpRequest,
    st.sampled_from(["read", "write", "READ", "put", ""]) | st.text(max_size=6),
    st.integers(0, 1 << 62),
    st.lists(st.sampled_from(_FUZZ_GRANTED) | _slot_any, max_size=6),
)
_hello = st.builds(
    pt.DataHello, st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32)
)
_anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack can carry
    | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)
_read = st.builds(  # well-formed, so it reaches the grant check, of slots in the arena
    pt.TcpRequest,
    st.just("read"),
    st.integers(0, 9),
    st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=6),
)
_data_frame = st.one_of(
    st.builds(frame, _read),
    st.builds(frame, _read),
    st.builds(frame, _request),
    st.builds(frame, _hello),
    st.builds(frame, st.builds(pt.DataAuth, st.binary(min_size=32, max_size=32))),
    st.builds(frame, _anything),
    # a length that lies: bigger (up to 4 GiB) or smaller than what follows
    st.builds(
        lambda n, body: struct.pack("<I", n) + body,
        st.integers(0, (1 << 32) - 1),
        st.binary(max_size=64),
    ),
    st.binary(max_size=300),
)


class _FuzzTarget:
    """One TCP peer process whose slots 0-3 are granted to one session for the whole fuzz, and
    every row's bytes as an oracle session read them."""

    def __init__(self, peer: PeerProc):
        self.peer = peer
        peer.ok("fill", seed=31)
        self.digests = peer.rows()
        self.desc = pt.decode_descriptor(bytes.fromhex(peer.descriptor))
        self.token = secrets.token_bytes(pt.TOKEN_BYTES)
        oracle = secrets.token_bytes(pt.TOKEN_BYTES)
        for t in (self.token, oracle):
            peer.ok("add_session", token=t.hex())
        peer.grant(self.token.hex(), _FUZZ_GRANTED)
        gid, _ = peer.grant(oracle.hex(), list(range(SLOTS)))
        c = DataClient(self.desc)
        c.authenticate(oracle)
        assert c.read(list(range(SLOTS))).error == ""
        data = c.recv_exact(SLOTS * ROW)
        c.sock.close()
        _revoke(peer, gid)
        self.rows = [data[i * ROW : (i + 1) * ROW] for i in range(SLOTS)]


@pytest.fixture(scope="module")
def fuzz_target():
    p = PeerProc("fuzz", "tcp", deadline_s=2.0)
    try:
        yield _FuzzTarget(p)
    finally:
        p.stop()
        assert p.proc.returncode is not None
        assert p.name not in {a.name for a in list_arenas()}


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(authenticated=st.booleans(), frames=st.lists(_data_frame, min_size=1, max_size=5))
def test_fuzzed_frames_on_the_data_port_read_nothing_ungranted_and_break_nothing(
    fuzz_target, authenticated, frames
):
    """Whatever an authenticated session (or a connection that proves none) sends on the data
    port: no byte of a row outside its grant comes back, the arena is unchanged, and an honest
    read on a fresh connection still gets its rows."""
    t = fuzz_target
    c = DataClient(t.desc, "127.0.0.4")
    if authenticated:
        c.authenticate(t.token)
    with contextlib.suppress(OSError):
        c.sock.sendall(b"".join(frames))
        c.sock.shutdown(socket.SHUT_WR)
    back = c.closed_after()
    for s in range(len(_FUZZ_GRANTED), SLOTS):
        assert t.rows[s][:64] not in back, f"row {s} was sent without a grant"
    if not authenticated:
        assert all(r[:64] not in back for r in t.rows)
    honest = DataClient(t.desc)
    honest.authenticate(t.token)
    assert honest.read([3, 0]).error == ""
    assert honest.recv_exact(2 * ROW) == t.rows[3] + t.rows[0]
    honest.sock.close()
    assert t.peer.rows() == t.digests
