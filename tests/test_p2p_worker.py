"""The p2p peer worker (``kvoffload.workers.p2p_worker``) driven through its engine-side handle
(``kvoffload.tiers.p2p.worker_handle.PeerWorkerHandle``).

Each "instance" is an arena created in the test process (the test plays the engines) with a real
peer worker process attached to it. Every behaviour runs over TCP and over NIXL; NIXL is skipped,
with the reason, where it cannot be imported. Waiting is always on the handles' ``fileno()`` with a
generous upper bound: nothing here measures speed.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time

import msgspec
import numpy as np
import psutil
import pytest
import zmq

from kvoffload.ipc.arena import Arena, ArenaError, list_arenas
from kvoffload.tiers.p2p.worker_handle import WORKER_DIED, PeerWorkerHandle
from kvoffload.workers import p2p_transport as pt
from kvoffload.workers.p2p_transport import TransferState, TransportConfig, TransportError

SLOTS = 32
ROW = 8 * 1024
# Generous upper bound for anything to happen (seconds): never a measure of speed.
PATIENCE_S = 60.0
# The deadline of transfers meant to fail by it (a stopped peer cannot answer in any time).
DEADLINE_S = 1.0
DONE, FAILED = TransferState.DONE, TransferState.FAILED

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
# UCX over TCP needs the serving process to answer (shared memory would let a READ finish while the
# peer is stopped), so a stopped peer holds a NIXL transfer in flight.
STOPPABLE = {"UCX_TLS": "tcp"}


class Instance:
    """One arena (this process plays its engine) and its peer worker."""

    def __init__(self, tag: str, kind: str, seed: int, env: dict[str, str] | None = None):
        self.tag = tag
        name = f"kvoffload_p2pwtest_{os.getpid()}_{tag}_{secrets.token_hex(3)}"
        self.arena = Arena.create(name, SLOTS, ROW)
        rows = self.arena.rows
        rows[:] = np.random.default_rng(seed).integers(0, 256, size=rows.shape, dtype=np.uint8)
        self.handle = PeerWorkerHandle(
            self.arena.name, TransportConfig(kind=kind, deadline_s=PATIENCE_S), env=env
        )
        self.pids = [self.handle.pid]
        self.reported: dict[int, tuple[TransferState, str]] = {}
        self.report_pids: dict[int, bool] = {}  # tid -> the worker had exited when it was reported

    def rows(self) -> np.ndarray:
        return self.arena.rows.copy()

    def pump(self) -> None:
        exited = not self.handle.alive
        for tid, state, reason in self.handle.poll():
            assert tid not in self.reported, f"{self.tag}: transfer {tid} reported twice"
            self.reported[tid] = (state, reason)
            self.report_pids[tid] = exited

    def restart(self) -> list[str]:
        names = self.handle.restart()
        self.pids.append(self.handle.pid)
        return names


def wait_for(insts, cond, what: str, timeout_s: float = PATIENCE_S):
    """Pump ``insts`` until ``cond()`` is true, sleeping only in ``select`` on their handles'
    ``fileno()`` (so a handle whose fd never wakes its waiter fails here)."""
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()  # what the p2p tier's node thread waits with
    for i in insts:
        poller.register(i.handle.fileno(), zmq.POLLIN)
        i.pump()
    while not (value := cond()):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out after {timeout_s} s waiting for {what}"
        ready = poller.poll(left * 1000)
        assert ready or cond(), f"no handle became readable in {timeout_s} s waiting for {what}"
        for i in insts:
            i.pump()
    return value


def wait_ready(*insts: Instance) -> None:
    def ready():
        for i in insts:
            assert i.handle.start_error is None, i.handle.start_error
        return all(i.handle.descriptor is not None for i in insts)

    wait_for(insts, ready, "the workers' hello")


def result(inst: Instance, tid: int) -> tuple[TransferState, str]:
    return wait_for([inst], lambda: inst.reported.get(tid), f"transfer {tid} of {inst.tag}")


def pair_up(*insts: Instance) -> None:
    wait_ready(*insts)
    for i in insts:
        for j in insts:
            if i is not j:
                i.handle.add_peer(j.tag, j.handle.descriptor)
    wait_for(
        insts,
        lambda: all(i.handle.peer_state(j.tag) == "up" for i in insts for j in insts if i is not j),
        "the peers to be added",
    )


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def instances():
    made: list[Instance] = []

    def make(tag: str, kind: str, env: dict[str, str] | None = None) -> Instance:
        inst = Instance(tag, kind, seed=len(made) + 1, env=env)
        made.append(inst)
        return inst

    yield make
    for i in made:
        for pid in i.pids:
            if pid is not None and not pid_gone(pid):
                os.kill(pid, signal.SIGCONT)  # a stopped worker must be able to stop
        i.handle.close()
        i.arena.close()
    # Nothing left behind: every worker process gone, every arena unlinked.
    for i in made:
        for pid in i.pids:
            assert pid is None or pid_gone(pid), f"worker {pid} of {i.tag} still runs"
    names = {i.arena.name for i in made}
    assert not [a.name for a in list_arenas() if a.name in names]


@pytest.mark.parametrize("kind", KINDS)
def test_read_and_write_are_bit_exact_both_ways(instances, kind):
    a, b = instances("a", kind), instances("b", kind)
    pair_up(a, b)
    assert a.handle.kind == b.handle.kind == kind
    ra, rb = a.rows(), b.rows()

    # At once, both ways: A reads B's 0..11 into its 31..20; B reads A's 0..11 into its 20..31.
    read_ab = [(SLOTS - 1 - r, r) for r in range(12)]  # (local, remote)
    read_ba = [(20 + r, r) for r in range(12)]
    t1 = a.handle.read("b", read_ab)
    t2 = b.handle.read("a", read_ba)
    assert result(a, t1) == (DONE, "")
    assert result(b, t2) == (DONE, "")
    ra2, rb2 = a.rows(), b.rows()
    for lo, re_ in read_ab:
        assert np.array_equal(ra2[lo], rb[re_])
    for lo, re_ in read_ba:
        assert np.array_equal(rb2[lo], ra[re_])
    assert np.array_equal(ra2[:20], ra[:20]) and np.array_equal(rb2[:20], rb[:20])

    # Writes both ways: A's 0..5 into B's 12..17; B's 25..28 into A's 12..15.
    write_ab = [(i, 12 + i) for i in range(6)]
    write_ba = [(25 + i, 12 + i) for i in range(4)]
    t3 = a.handle.write("b", write_ab)
    t4 = b.handle.write("a", write_ba)
    assert result(a, t3) == (DONE, "")
    assert result(b, t4) == (DONE, "")
    ra3, rb3 = a.rows(), b.rows()
    for lo, re_ in write_ab:
        assert np.array_equal(rb3[re_], ra2[lo])
    for lo, re_ in write_ba:
        assert np.array_equal(ra3[re_], rb2[lo])
    assert np.array_equal(ra3[16:], ra2[16:]) and np.array_equal(ra3[:12], ra2[:12])
    assert np.array_equal(rb3[18:], rb2[18:]) and np.array_equal(rb3[:12], rb2[:12])


@pytest.mark.parametrize("kind", KINDS)
def test_transfer_to_a_killed_peer_fails_and_one_to_a_live_peer_beside_it_completes(
    instances, kind
):
    env = STOPPABLE if kind == "nixl" else None
    a, b, c = (instances(t, kind, env) for t in "abc")
    pair_up(a, b, c)
    rc = c.rows()
    os.kill(b.handle.pid, signal.SIGSTOP)
    # A deadline longer than the wait below: only the kill can end this transfer in time.
    dead = a.handle.read("b", [(i, i) for i in range(16)], deadline_s=4 * PATIENCE_S)
    live = a.handle.read("c", [(16 + i, i) for i in range(16)])
    assert result(a, live) == (DONE, "")
    assert dead not in a.reported  # B cannot have answered
    assert np.array_equal(a.rows()[16:], rc[:16])

    os.kill(b.handle.pid, signal.SIGKILL)
    state, reason = result(a, dead)
    assert state is FAILED and reason and "deadline" not in reason, reason
    # B's own handle sees its worker gone once it has exited.
    wait_for([b], lambda: not b.handle.alive and b.handle.returncode is not None, "B's exit")
    assert b.handle.descriptor is None and b.handle.returncode == -signal.SIGKILL

    # The live peer still works, both ways; the dead one refuses until re-added.
    t = a.handle.write("c", [(0, 31)])
    assert result(a, t) == (DONE, "")
    assert np.array_equal(c.rows()[31], a.rows()[0])
    t = a.handle.read("b", [(0, 0)])
    state, reason = result(a, t)
    assert state is FAILED and "PeerDownError" in reason, reason


@pytest.mark.parametrize("kind", KINDS)
def test_c22_a_transfer_past_its_deadline_is_reported_only_once_settled(instances, kind):
    env = STOPPABLE if kind == "nixl" else None
    a, b = instances("a", kind, env), instances("b", kind, env)
    pair_up(a, b)
    os.kill(b.handle.pid, signal.SIGSTOP)
    late = a.handle.read("b", [(i, i) for i in range(8)], deadline_s=DEADLINE_S)

    # Probe until the worker has marked B down (the late transfer's deadline passed): a transfer
    # submitted after that is refused at once. Between probes, wait on fileno() up to 0.2 s.
    probes: list[int] = []
    deadline = time.monotonic() + PATIENCE_S
    while not any("PeerDownError" in a.reported.get(t, (None, ""))[1] for t in probes):
        assert time.monotonic() < deadline, "B was never marked down"
        probes.append(a.handle.read("b", [(SLOTS - 1, 0)], deadline_s=4 * PATIENCE_S))
        select.select([a.handle.fileno()], [], [], 0.2)
        a.pump()
    if kind == "tcp":
        # A TCP transfer settles when it fails: its I/O thread has stopped. Its report may come in
        # a later batch than the refused probe's (B is marked down first; a CI run read the
        # results between the two).
        give_up = time.monotonic() + PATIENCE_S
        while late not in a.reported:
            assert time.monotonic() < give_up, "the late TCP transfer was never reported"
            select.select([a.handle.fileno()], [], [], 0.2)
            a.pump()
        assert a.reported[late][0] is FAILED and "deadline" in a.reported[late][1]
    else:
        # UCX still holds the READ (B may answer late and land bytes in A's slots): unsettled, so
        # not reported although it failed.
        assert late not in a.reported
    os.kill(b.handle.pid, signal.SIGKILL)
    for t in [late, *probes]:
        assert result(a, t)[0] is FAILED


@pytest.mark.parametrize("kind", KINDS)
def test_c17_own_worker_killed_mid_transfer_reports_worker_died_after_exit_and_restart_works(
    instances, kind
):
    env = STOPPABLE if kind == "nixl" else None
    a, b = instances("a", kind, env), instances("b", kind, env)
    pair_up(a, b)
    old = a.handle.descriptor
    os.kill(b.handle.pid, signal.SIGSTOP)  # holds A's transfer in flight
    tids = [
        a.handle.read("b", [(i, i) for i in range(8)], deadline_s=4 * PATIENCE_S),
        a.handle.write("b", [(8 + i, 8 + i) for i in range(8)], deadline_s=4 * PATIENCE_S),
    ]
    pid = a.handle.pid
    os.kill(pid, signal.SIGKILL)
    for t in tids:
        assert result(a, t) == (FAILED, WORKER_DIED)
        assert a.report_pids[t] or pid_gone(pid)  # reported once the process had exited
    assert pid_gone(pid) and not a.handle.alive
    assert a.handle.returncode == -signal.SIGKILL and a.handle.descriptor is None
    # With no worker, a transfer fails at once (reported by the next poll).
    t = a.handle.read("b", [(0, 0)])
    assert result(a, t) == (FAILED, WORKER_DIED)

    os.kill(b.handle.pid, signal.SIGCONT)
    assert a.restart() == ["b"]  # the peers the caller must add again
    assert a.handle.peers == []
    wait_ready(a)
    assert a.handle.descriptor not in (None, old)
    b.handle.remove_peer("a")
    b.handle.add_peer("a", a.handle.descriptor)
    a.handle.add_peer("b", b.handle.descriptor)
    wait_for(
        [a, b],
        lambda: a.handle.peer_state("b") == b.handle.peer_state("a") == "up",
        "the peers to be added again",
    )
    ra, rb = a.rows(), b.rows()
    t1 = a.handle.read("b", [(i, 16 + i) for i in range(4)])
    t2 = b.handle.write("a", [(0, 30), (1, 31)])
    assert result(a, t1) == (DONE, "")
    assert result(b, t2) == (DONE, "")
    assert np.array_equal(a.rows()[:4], rb[16:20])
    assert np.array_equal(a.rows()[30:], rb[:2])
    assert np.array_equal(a.rows()[4:30], ra[4:30])
    assert a.handle.take_peer_errors() == [] and b.handle.take_peer_errors() == []


@pytest.mark.parametrize("kind", KINDS)
def test_worker_imports_no_torch(instances, kind):
    a, b = instances("a", kind), instances("b", kind)
    pair_up(a, b)
    t = a.handle.read("b", [(0, 0)])
    assert result(a, t) == (DONE, "")
    with open(f"/proc/{a.handle.pid}/maps") as f:
        maps = f.read()
    # torch's libraries, not any path with "torch" in it: vLLM-CPU puts torch's libgomp in
    # LD_PRELOAD (vllm/platforms/cpu.py) once a config is built in the engine process, and every
    # child inherits that preload without importing torch (as tests/test_fs_tier.py checks)
    assert "libtorch" not in maps and "torch/_C" not in maps
    if kind == "nixl":
        assert "nixl" in maps  # NIXL really is loaded


def test_bad_requests_are_refused_and_nothing_moves(instances):
    a, b = instances("a", "tcp"), instances("b", "tcp")
    pair_up(a, b)
    ra, rb = a.rows(), b.rows()
    h = a.handle
    bad = [
        ("read", "nobody", [(0, 0)], None, "not added"),
        ("read", "b", [], None, "slot pairs"),
        ("read", "b", [(SLOTS, 0)], None, "local slot"),
        ("write", "b", [(0, SLOTS)], None, "outside its arena"),
        ("read", "b", [(3, 0), (3, 1)], None, "named twice"),
        ("write", "b", [(0, 3), (1, 3)], None, "named twice"),
        ("read", "b", [(0, 0)], 0.0, "deadline_s"),
    ]
    for op, peer, pairs, deadline, match in bad:
        with pytest.raises(ValueError, match=match):
            getattr(h, op)(peer, pairs, deadline)
    with pytest.raises(TransportError, match="malformed"):
        h.add_peer("x", b"\x93garbage")
    other_rows = msgspec.msgpack.encode(pt.TcpDescriptor("127.0.0.1", 1, b"t", 4, 2 * ROW))
    with pytest.raises(TransportError, match="-byte slots"):
        h.add_peer("x", other_rows)
    # What only the worker can judge (another transport kind) comes back as a peer error, and
    # transfers to that peer fail.
    other_kind = msgspec.msgpack.encode(pt.NixlDescriptor(b"md", 4096, SLOTS, ROW))
    h.add_peer("n", other_kind)
    errors = wait_for([a], h.take_peer_errors, "the worker's refusal")
    assert errors[0][0] == "n" and "nixl descriptor" in errors[0][1]
    t = h.read("n", [(0, 0)])
    state, reason = result(a, t)
    assert state is FAILED and "PeerDownError" in reason
    assert np.array_equal(a.rows(), ra) and np.array_equal(b.rows(), rb)
    with pytest.raises(ArenaError, match="no ready host arena"):
        PeerWorkerHandle(f"kvoffload_p2pwtest_{os.getpid()}_missing", TransportConfig(kind="tcp"))


def test_a_worker_that_cannot_start_says_why_and_exits(instances):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        arena = Arena.create(f"kvoffload_p2pwtest_{os.getpid()}_nostart", 4, ROW)
        try:
            h = PeerWorkerHandle(arena.name, TransportConfig(kind="tcp", port=port))
            try:
                pid = h.pid
                deadline = time.monotonic() + PATIENCE_S
                while h.returncode is None:  # set once poll() has seen the exit
                    assert time.monotonic() < deadline, "the worker did not exit"
                    select.select([h.fileno()], [], [], PATIENCE_S)
                    assert h.poll() == []
                assert h.returncode == 3 and not h.alive
                assert h.start_error and "transport" in h.start_error, h.start_error
                assert h.descriptor is None and pid_gone(pid)
            finally:
                h.close()
        finally:
            arena.close()


def test_close_leaves_no_process_and_no_descriptor(instances):
    fds_before = set(os.listdir("/proc/self/fd"))
    a = instances("a", "tcp")
    wait_ready(a)
    pid = a.handle.pid
    a.restart()
    wait_ready(a)
    a.handle.close()
    assert pid_gone(pid) and pid_gone(a.pids[-1])
    assert a.handle.returncode == 0  # a Stop, not a kill
    a.handle.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        a.handle.read("b", [(0, 0)])
    a.arena.close()
    assert set(os.listdir("/proc/self/fd")) <= fds_before


def test_worker_exits_when_its_engine_dies():
    # An "engine" process owning an arena and a handle, SIGKILLed: its peer worker must exit by itself.
    code = textwrap.dedent(
        f"""
        import os, select, sys
        from kvoffload.ipc.arena import Arena
        from kvoffload.tiers.p2p.worker_handle import PeerWorkerHandle
        from kvoffload.workers.p2p_transport import TransportConfig
        arena = Arena.create("kvoffload_p2pwtest_{os.getpid()}_orphan", 4, {ROW})
        h = PeerWorkerHandle(arena.name, TransportConfig(kind="tcp"))
        while h.descriptor is None:
            select.select([h.fileno()], [], [], 1.0)
            h.poll()
            assert h.alive, h.start_error
        print(h.pid, flush=True)
        sys.stdin.read()
        """
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout is not None
        ready, _, _ = select.select([engine.stdout], [], [], PATIENCE_S)
        assert ready, "the engine process did not start its worker"
        worker = int(engine.stdout.readline())
        assert not pid_gone(worker)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + PATIENCE_S
    while not pid_gone(worker):
        assert time.monotonic() < deadline, "the orphaned peer worker did not exit"
        time.sleep(0.05)


def test_c17_a_hung_peer_worker_is_killed_so_its_transfers_settle(instances):
    a, b = instances("a", "tcp"), instances("b", "tcp")
    a.handle.settle_timeout_s = DEADLINE_S
    pair_up(a, b)
    os.kill(b.handle.pid, signal.SIGSTOP)  # the transfer cannot finish...
    t = a.handle.read("b", [(0, 0)], deadline_s=DEADLINE_S)
    pid = a.handle.pid
    os.kill(pid, signal.SIGSTOP)  # ...and A's worker cannot report it: only a kill settles it
    # The node polls at least once a second (the settle timeout has no fd of its own).
    deadline = time.monotonic() + PATIENCE_S
    while t not in a.reported:
        assert time.monotonic() < deadline, "the hung worker was never killed"
        select.select([a.handle.fileno()], [], [], 1.0)
        a.pump()
    assert a.reported[t] == (FAILED, WORKER_DIED)
    assert pid_gone(pid) and a.handle.returncode == -signal.SIGKILL
