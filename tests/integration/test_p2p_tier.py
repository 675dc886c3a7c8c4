"""The p2p tier end to end between standalone instances on loopback (issue 12).

Serving instances are their own processes (``tests/p2p_instance.py``: arena, tiering manager, peer
worker, node thread), as other vLLM servers would be; the instance under test is built in this
process (``helpers.Rig``) so its host tier can be inspected. Both transports run every behaviour
test; NIXL is skipped, with the reason, where it cannot be imported.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq
from helpers import TESTS_DIR, Rig, arena_name, namespace, patience, stop_process, wait_until
from p2p_raw import RawClient as _RawClient
from pipe_commands import PipeClient

from kvoffload.ipc import peer_messages as pm
from kvoffload.ipc.arena import list_arenas
from kvoffload.testing.tier_contract import keys_for, payload
from kvoffload.tiers.base import LookupResult, TierEvent
from kvoffload.tools.ports import free_port
from kvoffload.workers import p2p_transport as pt

HIT, MISS = LookupResult.HIT, LookupResult.MISS
INSTANCE_SCRIPT = Path(TESTS_DIR) / "p2p_instance.py"
ROW = 64 * 1024
SLOTS = 32
SECRET = "p2p-test-secret-" + secrets.token_hex(8)
PATIENCE_S = patience(120.0)  # upper bound for anything to happen: never a measure of speed

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


def p2p(kind: str, port: int, peers: list[str] = (), **extra) -> dict:
    """A p2p tier entry on loopback with the tests' secret."""
    return {
        "type": "p2p",
        "host": "127.0.0.1",
        "port": port,
        "peers": list(peers),
        "transport": kind,
        "secret": SECRET,
        **extra,
    }


class Instance(PipeClient):
    """A serving instance in its own process, driven over a pipe."""

    patience_s = PATIENCE_S

    def __init__(
        self,
        tier: dict,
        env: dict[str, str] | None = None,
        num_slots: int = SLOTS,
        extra: dict | None = None,
    ):
        self.name = arena_name() + "_" + secrets.token_hex(3)
        self.proc = subprocess.Popen(
            [sys.executable, str(INSTANCE_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        reply = self.ok(
            "init", tiers=[tier], num_slots=num_slots, row_bytes=ROW, name=self.name, extra=extra
        )
        self.addr: str = reply["advertise"]
        self.worker_pid: int = reply["worker_pid"]

    def store(self, keys: list[bytes], salt: str | None = None) -> None:
        self.ok("store", keys=[k.hex() for k in keys], salt=salt)

    def stop(self) -> None:
        self.stop_process()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker_pid, signal.SIGKILL)


@pytest.fixture
def world():
    """Makes serving instances (processes) and rigs (in this process); cleans up and checks that
    nothing is left: no process, no arena."""
    made: list[Instance] = []
    rigs: list[Rig] = []

    class World:
        def instance(self, tier: dict, **kw) -> Instance:
            inst = Instance(tier, **kw)
            made.append(inst)
            return inst

        def rig(self, tier: dict, num_slots: int = SLOTS) -> Rig:
            r = Rig([tier], num_slots=num_slots, row_bytes=ROW)
            rigs.append(r)
            wait_until(lambda: r.tm.tiers[0].workers_ready(), PATIENCE_S, "the peer worker")
            return r

    yield World()
    for r in rigs:
        r.close()
    for inst in made:
        inst.stop()
    names = {i.name for i in made} | {r.arena.name for r in rigs}
    wait_until(
        lambda: not [a for a in list_arenas() if a.name in names],
        PATIENCE_S,
        "every arena of the test removed",
    )
    for pid in [i.worker_pid for i in made]:
        # a killed worker is an orphan until PID 1 reaps it: a zombie is gone
        wait_until(lambda pid=pid: not alive(pid) or None, PATIENCE_S, f"peer worker {pid} to exit")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tier(rig: Rig):
    return rig.tm.tiers[0]


def wait_found(b: Rig, keys: list[bytes]) -> None:
    """Step ``b``'s engine until its p2p tier answers HIT for every key (it learnt where they are)."""
    wait_until(
        lambda: all(tier(b).lookup(k, "r") is HIT for k in keys) or None,
        PATIENCE_S,
        "B to find A's keys",
        step=b.tm.step,
    )


def assert_serves(rig: Rig, keys: list[bytes], req_id: str = "req", params=None) -> None:
    """``keys`` resolve to HIT through the p2p tier and their bytes are exact."""
    if params is not None:
        rig.tm.on_request(req_id, params)
    res = settle(rig, keys, req_id)
    assert res == [HIT] * len(keys), res
    slots = rig.tm.prepare_load(keys, req_id)
    for k, s in zip(keys, slots):
        assert np.array_equal(rig.arena.rows[s], payload(k, ROW)), "wrong bytes served"
        assert rig.tm.source_of(k, req_id) == tier(rig).name
    rig.tm.complete_load(keys, req_id)


def settle(rig: Rig, keys: list[bytes], req_id: str = "req") -> list[LookupResult]:
    """Look ``keys`` up every engine step until none is RETRY or HIT_PENDING; a key that has
    settled keeps its verdict and is not asked again (as a request's scheduler keeps a MISS: with
    ``negative_ttl_s=0`` a MISS is given once, so asking it again would probe it anew and, when
    the verdicts of several keys arrive in different steps, never settle them all at once)."""
    unsettled = (LookupResult.RETRY, LookupResult.HIT_PENDING)
    verdicts: dict[bytes, LookupResult] = {}

    def settled():
        for k in keys:
            if k not in verdicts:
                r = rig.tm.lookup(k, req_id)
                if r not in unsettled:
                    verdicts[k] = r
        return [verdicts[k] for k in keys] if len(verdicts) == len(set(keys)) else None

    return wait_until(settled, PATIENCE_S, f"{len(keys)} lookup(s) to settle", step=rig.tm.step)


def pins_consistent(rig: Rig) -> bool:
    host = rig.tm.host
    # the node thread's serving role pins and unpins under the manager's lock (a peer's lease,
    # its release acknowledged): both sides are read under it, or an unpin between them tears
    with rig.tm.lock:
        refs = {s: int(r) for s, r in enumerate(host.refs) if r}
        return rig.tm.pins_held() == refs


@pytest.mark.parametrize("kind", KINDS)
def test_two_instances_serve_each_other_bit_exact(world, kind):
    pa, pb = free_port(), free_port()
    a = world.instance(p2p(kind, pa, [f"127.0.0.1:{pb}"]))
    b = world.rig(p2p(kind, pb, [a.addr]))
    wait_until(lambda: a.ok("state")["peers_up"] or None, PATIENCE_S, "A's link to B up")
    wait_until(lambda: tier(b).peers_up() or None, PATIENCE_S, "B's link to A up")
    ka, kb = keys_for(6, seed=1), keys_for(5, seed=2)
    a.store(ka)
    b.store(kb)
    assert_serves(b, ka)  # B reads A's chunks
    assert wait_until(lambda: b.tm.wait_idle(1) or None, PATIENCE_S, "B idle")
    reply = a.ok("resolve", keys=[k.hex() for k in kb])  # A reads B's
    assert reply["results"] == ["HIT"] * len(kb), reply
    want = [xxh(payload(k, ROW)) for k in kb]
    assert a.ok("digest", keys=[k.hex() for k in kb])["digests"] == want
    assert pins_consistent(b)
    st = a.ok("state")
    assert st["pins_match"], st
    # leases released on both sides once the loads settled
    wait_until(lambda: a.ok("state")["pinned"] == 0 or None, PATIENCE_S, "A's leases released")


def test_the_peer_worker_runs_at_the_configured_niceness(world):
    """The peer worker's transfers are loads requests wait for while vLLM's engine loop spins: at
    the engine's priority by default (a niced worker was starved by that loop, BENCHMARKS 10e),
    at ``worker_nice`` when the operator asks."""
    me = psutil.Process().nice()
    if me > 12:
        pytest.skip(f"the tests run at nice {me}: a worker 7 nicer cannot be told apart")
    plain = world.rig(p2p("tcp", free_port()))
    niced = world.rig(p2p("tcp", free_port(), worker_nice=7))
    assert psutil.Process(tier(plain).worker_pid).nice() == me
    assert psutil.Process(tier(niced).worker_pid).nice() == min(19, me + 7)


def test_the_engine_process_switch_interval_is_lowered_while_a_tier_runs_and_given_back(world):
    """The node thread needs the GIL for each hop of a load; while vLLM's scheduler thread ran
    pure-Python steps it got it only after CPython's 5 ms switch interval, so loads crawled
    while the scheduler was busy (BENCHMARKS 9b). A running tier lowers it to
    ``engine_switch_interval_s`` (0.5 ms by default; null leaves it) and its shutdown gives it
    back."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        untouched = world.rig(p2p("tcp", free_port(), engine_switch_interval_s=None))
        assert sys.getswitchinterval() == pytest.approx(0.005)
        plain = world.rig(p2p("tcp", free_port()))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        lower = world.rig(p2p("tcp", free_port(), engine_switch_interval_s=0.0002))
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        tier(lower).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        tier(plain).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        tier(untouched).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


def xxh(row) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(row)


@pytest.mark.parametrize("kind", KINDS)
def test_three_instances_peers_are_asked_in_order_and_a_key_nowhere_misses(world, kind):
    a = world.instance(p2p(kind, free_port()))
    b = world.instance(p2p(kind, free_port()))
    c = world.rig(p2p(kind, free_port(), [a.addr, b.addr], negative_ttl_s=0))
    on_a, on_b, nowhere = keys_for(3, seed=3), keys_for(3, seed=4), keys_for(2, seed=5)
    a.store(on_a)
    b.store(on_b)
    # (a peer whose session is not up yet is skipped: a lookup then would miss)
    wait_until(lambda: len(tier(c).peers_up()) == 2 or None, PATIENCE_S, "C's sessions up")
    assert_serves(c, on_a + on_b)
    res = settle(c, nowhere, "r2")
    assert res == [MISS, MISS]
    assert sorted(tier(c).peers_up()) == sorted([a.addr, b.addr])


def test_a_peer_with_another_secret_gets_nothing(world):
    a = world.instance(p2p("tcp", free_port()))
    a.store(keys_for(2, seed=6))
    bad = dict(p2p("tcp", free_port(), [a.addr]), secret="not-the-secret")
    c = world.rig(bad)
    res = settle(c, keys_for(2, seed=6), "r")
    assert res == [MISS, MISS]
    assert tier(c).peers_up() == []


def test_a_client_without_the_secrets_curve_keys_gets_no_answer_and_is_counted(world):
    """A client speaking plain ZMQ (no CurveZMQ) to an instance with a secret: ZMQ refuses its
    handshake, counted ``mechanism`` (or ``handshake_failed`` when the client reads the server's
    greeting first and hangs up: ZMQ then reports a broken pipe, naming no mechanism); no frame
    of it reaches the protocol (nothing answered, nothing refused by the serving role, nothing
    pinned)."""
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(2, seed=7)
    a.store(keys)
    c = _RawClient(a.addr, namespace(row_bytes=ROW).id(), secret=None)
    try:
        for msg in (
            c.hello(),
            pm.Lookup(req=1, keys=keys),
            pm.Lease(req=2, keys=keys, ttl_s=10),
            pm.Auth(mac=b"\0" * 32, descriptor=b""),
        ):
            c.send(msg)

        def refused():
            counted = a.ok("counters")["refused_connections"]
            return counted["mechanism"] + counted["handshake_failed"] or None

        wait_until(refused, PATIENCE_S, "the instance to refuse the plain client's handshake")
        with pytest.raises(zmq.Again):
            c.sock.recv(zmq.NOBLOCK)
    finally:
        c.close()
    counters = a.ok("counters")
    assert not any(counters["refused_messages"].values()), counters  # nothing reached the role
    assert counters["authenticated"] == []
    assert a.ok("state")["pinned"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_sigkilled_mid_transfer_fails_the_job_no_hang_no_leak(world, kind):
    # A long transfer deadline, so only noticing the death can end the load early; UCX over TCP so
    # a stopped peer worker really holds the transfer in flight.
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    slow = {"transfer_deadline_s": 600.0, "lease_ttl_s": 3600.0, "peer_timeout_s": 2.0}
    a = world.instance(p2p(kind, free_port(), **slow), env=env)
    keys = keys_for(8, seed=8)
    a.store(keys)
    old = os.environ.get("UCX_TLS")
    if env:
        os.environ["UCX_TLS"] = "tcp"
    try:
        b = world.rig(p2p(kind, free_port(), [a.addr], **slow))
    finally:
        if env:
            if old is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old
    # B learns where the keys are, then A's data plane stops: the load's transfer hangs.
    wait_found(b, keys)
    stop_process(a.worker_pid)
    res = [b.tm.lookup(k, "r") for k in keys]
    assert all(r is LookupResult.HIT_PENDING for r in res), res
    b.tm.step()
    wait_until(lambda: b.tm.jobs_in_flight() or None, PATIENCE_S, "the load job in flight")
    t_kill = time.monotonic()
    os.kill(a.proc.pid, signal.SIGKILL)
    os.kill(a.worker_pid, signal.SIGKILL)
    a.proc.wait(PATIENCE_S)
    assert b.tm.wait_idle(PATIENCE_S), "the load never ended"
    took = time.monotonic() - t_kill
    assert took < 600.0, "the load ended only at its transfer deadline"
    # failed, nothing published, no slot leaked, lookups now miss
    st = b.tm.stats
    assert st.promotion_failures[tier(b).name] == len(keys)
    assert all(b.tm.host.index.get(k) is None for k in keys)
    assert pins_consistent(b) and not b.tm.busy_slots()
    assert b.tm.host.num_used == 0
    # the failed transfer (or the silent session, whichever is noticed first) marks A down
    wait_until(lambda: tier(b).peers_up() == [] or None, PATIENCE_S, "A marked down")


def test_what_a_peer_held_is_forgotten_when_it_goes_down(world):
    """B learnt that A holds some keys (its lookups HIT); A dies: once B marks it down, none of
    those keys is a HIT any more and none names A as its origin."""
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(6, seed=12)
    a.store(keys)
    b = world.rig(p2p("tcp", free_port(), [a.addr]))
    wait_found(b, keys)
    assert {tier(b).origin(k) for k in keys} == {a.addr}
    os.kill(a.proc.pid, signal.SIGKILL)
    os.kill(a.worker_pid, signal.SIGKILL)
    a.proc.wait(PATIENCE_S)
    wait_until(
        lambda: tier(b).peers_up() == [] or None, PATIENCE_S, "A marked down", step=b.tm.step
    )
    # the node thread tells the engine side right after it marks the link down
    wait_until(
        lambda: not [k for k in keys if tier(b).lookup(k, "r2") is HIT] or None,
        PATIENCE_S,
        "A's keys to be forgotten",
        step=b.tm.step,
    )
    assert {tier(b).origin(k) for k in keys} == {""}


def test_lease_holds_for_a_remote_decoder_until_fetched_then_ends(world):
    pa, pb = free_port(), free_port()
    a = world.rig(p2p("tcp", pa, hold_s=3600.0))
    b = world.rig(p2p("tcp", pb, allowed_peers=[f"127.0.0.1:{pa}"]))  # the prefiller routes name
    keys = keys_for(4, seed=9)
    a.tm.on_request("prefill-1", {"remote_decoder": {"kv_request_id": "kvr-1"}})
    plan = a.tm.prepare_store(keys, "prefill-1")
    for k, s in zip(plan.keys, plan.slots):
        a.arena.rows[s] = payload(k, ROW)
    a.tm.complete_store(plan.keys, True, "prefill-1")
    # the store job to the p2p tier is held: the slots stay pinned for the decoder
    a.tm.step()
    assert [j for j in a.tm.jobs_in_flight() if j[0] == tier(a).name]
    params = {
        "remote_prefiller": {
            "kv_request_id": "kvr-1",
            "remote_host": "127.0.0.1",
            "remote_port": int(tier(a).advertise.rsplit(":", 1)[1]),
        }
    }
    # the decoder reads them in two leases (two steps' lookups): the hold ends only after both
    assert_serves(b, keys[:2], "decode-1", params)
    wait_until(lambda: b.tm.wait_idle(1) or None, PATIENCE_S, "B's first load done")
    a.tm.step()
    assert [j for j in a.tm.jobs_in_flight() if j[0] == tier(a).name], "ended before all were read"
    assert_serves(b, keys[2:], "decode-1", params)
    # the decoder released its leases naming kvr-1: the prefiller's hold ends
    wait_until(
        lambda: not a.tm.jobs_in_flight() or None, PATIENCE_S, "the hold ended", step=a.tm.step
    )
    assert a.tm.stats.cascaded[tier(a).name] == len(keys)
    # the leases' pins go once their grants' revocation is acknowledged, which may come a
    # step after the decoder's release ended the hold
    wait_until(
        lambda: a.tm.host.num_pinned == 0 or None,
        PATIENCE_S,
        "A's lease pins released",
        step=a.tm.step,
    )
    assert pins_consistent(a)


def test_c49_a_repeat_prefill_holds_the_chunks_it_found_for_its_own_decoder(world):
    """CASES C49: two prefill requests with the same prefix, each naming its decoder. The first
    stores the chunks (held for decoder 1); the second finds them stored and loads them (held for
    decoder 2 too). Decoder 1 reads, the prefiller's host tier is refilled, and decoder 2 still
    reads every chunk (it got MISS x4: nothing was held for it)."""
    pa = free_port()
    a = world.rig(p2p("tcp", pa, hold_s=3600.0), num_slots=16)
    b = world.rig(p2p("tcp", free_port(), allowed_peers=[f"127.0.0.1:{pa}"]))
    keys = keys_for(4, seed=49)
    a.tm.on_request("prefill-1", {"remote_decoder": {"kv_request_id": "kvr-1"}})
    a.store(keys, wait=False, request="prefill-1")
    a.tm.on_request_finished("prefill-1")
    a.tm.on_request("prefill-2", {"remote_decoder": {"kv_request_id": "kvr-2"}})
    assert [a.tm.lookup(k, "prefill-2") for k in keys] == [HIT] * 4
    a.tm.prepare_load(keys, "prefill-2")
    a.tm.complete_load(keys, "prefill-2")
    a.tm.on_request_finished("prefill-2")
    port = int(tier(a).advertise.rsplit(":", 1)[1])

    def decoder(kvr: str) -> dict:
        return {
            "remote_prefiller": {
                "kv_request_id": kvr,
                "remote_host": "127.0.0.1",
                "remote_port": port,
            }
        }

    assert_serves(b, keys, "decode-1", decoder("kvr-1"))
    b.tm.on_request_finished("decode-1")
    wait_until(lambda: b.tm.wait_idle(1) or None, PATIENCE_S, "B's load done")
    b.tm.host.remove(keys)  # decoder 2 has none of them
    wait_until(  # decoder 1's hold ends; decoder 2's stays
        lambda: len(a.tm.jobs_in_flight()) == 1 or None, PATIENCE_S, "hold 1 ended", step=a.tm.step
    )
    a.store(keys_for(12, seed=490), wait=False)  # the prefiller's host tier refilled (16 slots)
    assert all(a.tm.host.lookup(k) is HIT for k in keys), "a held chunk was evicted"
    assert_serves(b, keys, "decode-2", decoder("kvr-2"))
    wait_until(
        lambda: not a.tm.jobs_in_flight() or None, PATIENCE_S, "hold 2 ended", step=a.tm.step
    )
    assert a.tm.stats.cascaded[tier(a).name] == 8  # each decoder read the 4 chunks held for it
    wait_until(
        lambda: a.tm.host.num_pinned == 0 or None, PATIENCE_S, "A's pins released", step=a.tm.step
    )
    assert pins_consistent(a)


def test_c49_a_hold_of_chunks_a_prefill_found_stored_stays_within_the_pin_budget(world):
    """A prefill that computes nothing (every chunk found stored) holds what it loads for its
    decoder only within the tier's pin budget (half the host tier's 8 slots), even with nothing
    else in flight: a request naming a decoder cannot pin the host tier by loading (review of
    C49)."""
    a = world.rig(p2p("tcp", free_port(), hold_s=3600.0), num_slots=8)
    keys = keys_for(6, seed=491)
    a.store(keys)  # no request: nothing held
    a.tm.on_request("prefill-3", {"remote_decoder": {"kv_request_id": "kvr-3"}})
    a.tm.prepare_load(keys, "prefill-3")
    a.tm.complete_load(keys, "prefill-3")
    a.tm.step()
    held = [j for j in a.tm.jobs_in_flight() if j[0] == tier(a).name]
    assert len(held) == 1 and len(held[0][2].keys) == 4, held
    assert a.tm.stats.refused[(tier(a).name, "store", "pin_limit")] == 2
    assert a.tm.host.num_pinned == 4
    a.tm.on_request_finished("prefill-3")


def _prefiller_port(rig: Rig) -> int:
    return int(tier(rig).advertise.rsplit(":", 1)[1])


def _decoder_params(port: int, kvr: str) -> dict:
    """A decoder request's routing: pull ``kvr``'s chunks from the prefiller at ``port``."""
    return {
        "remote_prefiller": {"kv_request_id": kvr, "remote_host": "127.0.0.1", "remote_port": port}
    }


def _hold_for(rig: Rig, req: str, kvr: str, keys: list[bytes]) -> None:
    """A prefill request naming the remote decoder ``kvr`` stores ``keys`` (held for it)."""
    rig.tm.on_request(req, {"remote_decoder": {"kv_request_id": kvr}})
    rig.store(keys, wait=False, request=req)


def test_requests_naming_decoders_that_never_come_keep_no_honest_hold_out(world):
    """``remote_decoder`` comes from whoever sends the API request. Requests naming made-up
    decoders fill the p2p tier's pin budget (half of 16 host slots) with holds for an hour; the
    next honest prefill's chunks are still held for its decoder, which reads every one: the
    oldest unread holds give their pins up (``hold_displaced``). Before, the honest store was
    cut to nothing (``pin_limit``) and its decoder found no chunk for ``hold_s``."""
    pa = free_port()
    a = world.rig(p2p("tcp", pa, hold_s=3600.0), num_slots=16)
    b = world.rig(p2p("tcp", free_port(), allowed_peers=[f"127.0.0.1:{pa}"]))
    name = tier(a).name
    for i in range(4):  # 4 x 2 chunks: the budget of 8 pins is full
        _hold_for(a, f"flood-{i}", f"made-up-{i}", keys_for(2, seed=700 + i))
    assert a.tm.host.num_pinned == 8
    honest = keys_for(4, seed=710)
    _hold_for(a, "prefill-h", "kvr-h", honest)
    assert a.tm.stats.refused.get((name, "store", "pin_limit"), 0) == 0
    assert a.tm.stats.failed[(name, "store", "hold_displaced")] == 4  # the two oldest floods
    held = sorted(len(j[2].keys) for j in a.tm.jobs_in_flight() if j[0] == name)
    assert held == [2, 2, 4], held
    assert a.tm.host.num_pinned == 8 and pins_consistent(a)
    assert_serves(b, honest, "decode-h", _decoder_params(_prefiller_port(a), "kvr-h"))
    wait_until(  # the honest hold ends as read; the floods' stay until hold_s
        lambda: len(a.tm.jobs_in_flight()) == 2 or None,
        PATIENCE_S,
        "the honest hold ended",
        step=a.tm.step,
    )
    assert a.tm.stats.cascaded[name] == len(honest)


def test_a_hold_its_decoder_has_begun_to_read_is_never_displaced(world):
    """A hold whose decoder has read part of it keeps its pins while newer holds, for decoders
    that never come, take each other's places: its decoder then reads the rest."""
    pa = free_port()
    a = world.rig(p2p("tcp", pa, hold_s=3600.0), num_slots=16)
    b = world.rig(p2p("tcp", free_port(), allowed_peers=[f"127.0.0.1:{pa}"]))
    name = tier(a).name
    honest = keys_for(4, seed=720)
    _hold_for(a, "prefill-h", "kvr-h", honest)
    params = _decoder_params(_prefiller_port(a), "kvr-h")
    assert_serves(b, honest[:2], "decode-h", params)
    wait_until(  # the decoder released its lease: A knows the first two were read
        lambda: b.tm.wait_idle(1) or None, PATIENCE_S, "the decoder's first load done"
    )
    wait_until(
        lambda: next(iter(tier(a)._holds.values())).fetched or None,
        PATIENCE_S,
        "the prefiller to learn of the read",
        step=a.tm.step,
    )
    for i in range(3):  # 3 x 4 chunks for made-up decoders: each displaces the one before
        _hold_for(a, f"flood-{i}", f"made-up-{i}", keys_for(4, seed=730 + i))
    assert a.tm.stats.failed[(name, "store", "hold_displaced")] == 8
    assert a.tm.stats.refused.get((name, "store", "pin_limit"), 0) == 0
    assert_serves(b, honest[2:], "decode-h", params)
    wait_until(
        lambda: len(a.tm.jobs_in_flight()) == 1 or None,
        PATIENCE_S,
        "the honest hold ended",
        step=a.tm.step,
    )
    assert a.tm.stats.cascaded[name] == len(honest)
    assert pins_consistent(a)


def test_a_request_that_computes_nothing_displaces_no_honest_hold(world):
    """A prompt already stored, sent again naming a made-up decoder, computes nothing: its hold
    of the chunks it found (C49) takes only the room the budget has left and displaces no
    honest hold (review: one such request displaced every unread one)."""
    a = world.rig(p2p("tcp", free_port(), hold_s=3600.0), num_slots=16)
    name = tier(a).name
    bait = keys_for(8, seed=900)
    a.store(bait)  # computed once, naming no decoder: nothing held
    honest = keys_for(4, seed=901)
    _hold_for(a, "prefill-h", "kvr-h", honest)
    a.tm.on_request("again", {"remote_decoder": {"kv_request_id": "made-up"}})
    assert [a.tm.lookup(k, "again") for k in bait] == [HIT] * 8
    a.tm.prepare_load(bait, "again")
    a.tm.complete_load(bait, "again")
    a.tm.on_request_finished("again")
    assert a.tm.stats.failed.get((name, "store", "hold_displaced"), 0) == 0
    held = {j[2].req_id: len(j[2].keys) for j in a.tm.jobs_in_flight() if j[0] == name}
    assert held == {"prefill-h": 4, "again": 4}, held  # the budget's other half
    assert pins_consistent(a)


def test_a_hold_nobody_fetches_expires_and_releases_its_slots(world):
    a = world.rig(p2p("tcp", free_port(), hold_s=0.5))
    keys = keys_for(3, seed=10)
    a.tm.on_request("prefill-2", {"remote_decoder": {"kv_request_id": "kvr-2"}})
    plan = a.tm.prepare_store(keys, "prefill-2")
    for k, s in zip(plan.keys, plan.slots):
        a.arena.rows[s] = payload(k, ROW)
    a.tm.complete_store(plan.keys, True, "prefill-2")
    assert a.tm.wait_idle(PATIENCE_S)
    assert a.tm.stats.cascade_failures[tier(a).name] == len(keys)
    assert a.tm.host.num_pinned == 0 and pins_consistent(a)
    # the chunks stay in A's host tier
    assert all(a.tm.host.lookup(k) is HIT for k in keys)


@pytest.mark.parametrize("kind", KINDS)
def test_push_is_admitted_within_the_quota_and_read_back_later(world, kind):
    pa, pb = free_port(), free_port()
    b = world.instance(p2p(kind, pb, quota_chunks=4), num_slots=SLOTS)
    a = world.rig(p2p(kind, pa, [b.addr], push="always"))
    wait_until(lambda: tier(a).peers_up() or None, PATIENCE_S, "A's link to B", step=a.tm.step)
    first, second = keys_for(4, seed=11), keys_for(4, seed=12)
    a.store(first)
    assert a.tm.stats.cascaded[tier(a).name] == len(first)
    # B now holds them in its host tier, read from A (B pulled them)
    want = [xxh(payload(k, ROW)) for k in first]
    assert b.ok("digest", keys=[k.hex() for k in first])["digests"] == want
    # B's quota is used up: A offers no more (a peer with no free quota takes no push), and
    # nothing stays pinned
    a.store(second)
    assert a.tm.stats.cascaded[tier(a).name] == len(first)
    assert b.ok("digest", keys=[k.hex() for k in second])["digests"] == [None] * len(second)
    assert pins_consistent(a) and a.tm.host.num_pinned == 0
    # A forgets them; they come back from B
    a.tm.host.remove(first)
    assert_serves(a, first, "again")


def test_chunks_a_peer_pulled_from_our_push_are_stored_events_of_the_p2p_tier(world):
    """KV events name a medium per tier (DESIGN §4, Observability; a peer's is PEER, REMOTE): a
    chunk a peer took from our push is now held by the p2p tier, and its stored event is
    published like any tier's (peers' locations ignore medium PEER). A chunk the peer refused,
    or a store held for a remote decoder, is not."""
    b = world.instance(p2p("tcp", free_port(), quota_chunks=2))
    a = world.rig(p2p("tcp", free_port(), [b.addr], push="always", hold_s=0.5))
    wait_until(lambda: tier(a).peers_up() or None, PATIENCE_S, "A's link to B", step=a.tm.step)
    name = tier(a).name
    a.tm.take_events()
    keys = keys_for(3, seed=42)
    a.store(keys)  # B admits two (its quota), refuses the third
    assert a.tm.stats.cascaded[name] == 2
    assert [e for t, e in a.tm.take_events() if t == name] == [TierEvent(keys[:2], False)]
    a.tm.on_request("prefill", {"remote_decoder": {"kv_request_id": "kvr-42"}})
    plan = a.tm.prepare_store(keys_for(2, seed=43), "prefill")
    a.tm.complete_store(plan.keys, True, "prefill")
    assert a.tm.wait_idle(PATIENCE_S)  # the hold expires: nothing was stored at a peer
    assert [e for t, e in a.tm.take_events() if t == name] == []


def test_each_per_peer_counter_of_a_known_peer_is_exported_from_zero(world):
    """A peer's counters exist once the tier knows it, at 0 until counted: a counter that appears
    at its first increment loses that increase to rate(), and every metric a tier declares must
    reach the scrape (the tier contract suite checks it; its p2p run asks no Lookup)."""
    b = world.instance(p2p("tcp", free_port()))
    a = world.rig(p2p("tcp", free_port(), [b.addr]))
    wait_until(lambda: tier(a).peers_up() or None, PATIENCE_S, "A's link to B", step=a.tm.step)
    values = a.tm.refresh_metrics().values
    name = tier(a).name
    for _stat, metric, labels in type(tier(a))._STATS:
        assert values[metric][(name, b.addr, *labels)] == 0, (metric, labels)


class RawClient(_RawClient):
    """A hand-driven control session with a serving instance (the protocol, no tier), knowing
    the tests' secret by default."""

    def __init__(self, addr: str, namespace_id: str, secret: str = SECRET, **kw):
        super().__init__(addr, namespace_id, secret.encode(), **kw)

    def handshake(self, descriptor: bytes = b"") -> pm.Welcome:
        welcome = super().handshake(descriptor)
        assert isinstance(welcome, pm.Welcome), welcome
        return welcome


def test_a_lease_expires_and_its_pins_are_released(world):
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(4, seed=13)
    a.store(keys)
    ns_id = namespace(row_bytes=ROW).id()
    c = RawClient(a.addr, ns_id)
    try:
        c.handshake()
        reply = c.ask(pm.Lease(req=1, keys=keys, ttl_s=1.0))
        assert isinstance(reply, pm.LeaseReply) and all(s >= 0 for s in reply.slots), reply
        assert a.ok("state")["pinned"] == len(keys)
        # the session stays alive (heartbeats) while the lease runs out
        seq = 0

        def expired():
            nonlocal seq
            seq += 1
            assert isinstance(c.ask(pm.Heartbeat(seq, 0)), pm.HeartbeatAck)
            return a.ok("state")["pinned"] == 0 or None

        wait_until(expired, PATIENCE_S, "the lease to expire", interval_s=0.1)
        st = a.ok("state")
        assert st["pins_match"], st
        # a Release of the expired lease changes nothing; a new lease works, and its Release frees it
        c.sock.send(pm.encode(pm.Release(reply.lease)))
        again = c.ask(pm.Lease(req=2, keys=keys[:2], ttl_s=600.0))
        assert isinstance(again, pm.LeaseReply) and all(s >= 0 for s in again.slots)
        assert a.ok("state")["pinned"] == 2
        c.sock.send(pm.encode(pm.Release(again.lease)))
        wait_until(lambda: a.ok("state")["pinned"] == 0 or None, PATIENCE_S, "the release")
    finally:
        c.close()


def test_fuzzed_control_messages_never_crash_a_serving_instance(world):
    """Random frames, multipart junk, valid messages out of order and hostile values, before and
    after authenticating: the instance answers (or drops) each, keeps no pin, and still serves."""
    import random

    rng = random.Random(1234)
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(3, seed=14)
    a.store(keys)
    ns_id = namespace(row_bytes=ROW).id()
    hostile = [
        pm.Lookup(req=1, keys=[b""] * 5),
        pm.Lease(req=2, keys=keys, ttl_s=86400.0),
        pm.Release(lease=(1 << 63) - 1),
        pm.Offer(req=3, keys=keys, lease=7, slots=[10**9] * 3, ttl_s=9.0, digests=b"d" * 48),
        pm.Offer(req=4, keys=keys, lease=8, slots=[1], ttl_s=1.0, digests=b""),
        pm.Pulled(lease=1, ok=b"\1" * 9),
        pm.Welcome(b"x" * 100, 0.1, 5, b"t" * 32, os.urandom(32)),
        pm.Challenge(pm.PROTOCOL_VERSION, os.urandom(16), "127.0.0.1:1", os.urandom(32), b"m" * 32),
        pm.Hello(1, os.urandom(16), "127.0.0.1:1", "10.9.9.9:1", ns_id, os.urandom(32)),
        pm.LookupReply(req=1, states=b"\1\2"),
    ]
    for authenticated in (False, True):
        c = RawClient(a.addr, ns_id)
        try:
            if authenticated:
                c.handshake()
            for i in range(300):
                pick = rng.random()
                if pick < 0.4:
                    frames = [rng.randbytes(rng.randrange(0, 300))]
                elif pick < 0.5:
                    frames = [rng.randbytes(8) for _ in range(rng.randrange(2, 5))]
                elif pick < 0.6:
                    good = pm.encode(rng.choice(hostile))
                    cut = rng.randrange(len(good))
                    frames = [good[:cut] + rng.randbytes(3) + good[cut + 3 :]]
                else:
                    frames = [pm.encode(rng.choice(hostile))]
                c.sock.send_multipart(frames)
                if i % 50 == 0:
                    c.sock.send(pm.encode(pm.Heartbeat(i, 0)))
            # drain whatever came back
            while c.sock.poll(200):
                c.sock.recv()
        finally:
            c.close()
    # still alive, nothing pinned for long, and a real client is served
    st = a.ok("state")
    assert st["pins_match"], st
    c = RawClient(a.addr, ns_id)
    try:
        c.handshake()
        reply = c.ask(pm.Lookup(req=9, keys=keys))
        assert isinstance(reply, pm.LookupReply) and reply.states == bytes([pm.READY] * 3)
    finally:
        c.close()
    wait_until(lambda: a.ok("state")["pinned"] == 0 or None, PATIENCE_S, "hostile leases gone")


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_sigkilled_mid_transfer_leaks_no_slot_on_the_serving_side(world, kind):
    env = {"UCX_TLS": "tcp"} if kind == "nixl" else None
    slow = {"transfer_deadline_s": 600.0, "lease_ttl_s": 3600.0, "peer_timeout_s": 2.0}
    if env:
        os.environ["UCX_TLS"] = "tcp"
    try:
        a = world.rig(p2p(kind, free_port(), **slow))
    finally:
        if env:
            os.environ.pop("UCX_TLS", None)
    keys = keys_for(6, seed=15)
    a.store(keys)
    b = world.instance(p2p(kind, free_port(), [tier(a).advertise], **slow), env=env)
    wait_until(lambda: b.ok("state")["peers_up"] or None, PATIENCE_S, "B's session with A")
    stop_process(b.worker_pid)  # B's reads will hang, holding A's lease
    hexkeys = [k.hex() for k in keys]
    wait_until(
        lambda: (b.ok("lookup_once", keys=hexkeys), a.tm.host.num_pinned == len(keys))[1] or None,
        PATIENCE_S,
        "A to lease its slots to B",
    )
    os.kill(b.proc.pid, signal.SIGKILL)
    os.kill(b.worker_pid, signal.SIGKILL)
    b.proc.wait(PATIENCE_S)
    # A notices the silent session and releases its leases: nothing stays pinned
    wait_until(lambda: a.tm.host.num_pinned == 0 or None, PATIENCE_S, "A's leases released")
    assert pins_consistent(a)
    assert all(a.tm.host.lookup(k) is HIT for k in keys)  # A still holds and serves them


def test_an_instance_over_its_host_capacity_pushes_to_an_underused_peer_and_reads_back(world):
    """Load balancing: with ``push: when_full``, chunks stored while A's host tier is full are
    offered to B (within B's quota); the chunks A then evicts come back from B."""
    b = world.instance(p2p("tcp", free_port(), quota_chunks=64), num_slots=64)
    a = world.rig(p2p("tcp", free_port(), [b.addr], push="when_full"), num_slots=8)
    wait_until(lambda: tier(a).peers_up() or None, PATIENCE_S, "A's link to B", step=a.tm.step)
    keys = keys_for(24, seed=16)
    for i in range(0, len(keys), 4):
        a.store(keys[i : i + 4])
    pushed = a.tm.stats.cascaded[tier(a).name]
    assert pushed > 0, "nothing was pushed while the host tier was full"
    assert a.tm.stats.cascade_failures[tier(a).name] == 0
    held = b.ok("digest", keys=[k.hex() for k in keys])["digests"]
    assert sum(d is not None for d in held) == pushed
    # the chunks A evicted and B holds are served back from B, bit-exact
    back = [k for k, d in zip(keys, held) if d is not None and a.tm.host.lookup(k) is not HIT][:4]
    assert back, "no pushed chunk was evicted from A"
    assert_serves(a, back, "reread")


def located_world(world) -> tuple[Instance, Instance, Rig]:
    """A and B, each publishing its KV events, and C (a rig), whose p2p tier has both as peers
    (A first) and follows both's events; every session up."""
    ev = {}
    inst = {}
    for name in "ab":
        port, replay = free_port(), free_port()
        ev[name] = {
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        inst[name] = world.instance(
            p2p("tcp", free_port()),
            extra={
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                }
            },
        )
    a, b = inst["a"], inst["b"]
    c = world.rig(
        p2p(
            "tcp",
            free_port(),
            [a.addr, b.addr],
            peer_events={a.addr: ev["a"], b.addr: ev["b"]},
            negative_ttl_s=0,
        )
    )
    wait_until(
        lambda: len(tier(c).peers_up()) == 2 or None, PATIENCE_S, "C's sessions", step=c.tm.step
    )
    return a, b, c


def test_a_lookup_asks_the_peer_whose_kv_events_show_the_chunk_first(world):
    """C subscribes to A's and B's KV events: a chunk only B holds is asked of B alone, though A
    comes first in C's peer list; a chunk no event names is asked of the peers in order."""
    a, b, c = located_world(world)
    only_b = keys_for(3, seed=17)
    b.store(only_b)
    node = tier(c)._node
    # wait until C's locations show B holding them (events arrive asynchronously)
    wait_until(
        lambda: all(node.locations.where(k) == [b.addr] for k in only_b) or None,
        PATIENCE_S,
        "C to learn B's chunks from its events",
    )
    assert_serves(c, only_b)
    asked = dict(node.client.peer_stats)
    assert asked.get((a.addr, "lookup_chunks"), 0) == 0, asked
    assert asked[(b.addr, "lookup_chunks")] >= len(only_b)
    # a chunk no event shows is asked of the configured peers in order (A, then B)
    nowhere = keys_for(2, seed=19)
    assert settle(c, nowhere, "r3") == [MISS, MISS]
    asked = dict(node.client.peer_stats)
    assert asked.get((a.addr, "lookup_chunks"), 0) == len(nowhere)


def test_c18_a_salted_lookup_asks_the_peer_whose_kv_events_show_the_chunk_first(world):
    """The salted variant (review of issue 27): B holds a tenant's chunks under their tenant
    keys, and its KV events name their engine keys (as vLLM's do). C's salted request looks them
    up by tenant key; before, the locations were asked with the tenant key, matched nothing,
    and A (first in C's list) was asked first. Now they are asked with the engine key: B alone
    is asked, for the tenant key, and serves the tenant's bytes. An unsalted lookup of the same
    engine keys (B first: its events name them) misses: B holds no unsalted chunk of them."""
    a, b, c = located_world(world)
    salt = "tenant-" + secrets.token_hex(8)
    only_b = keys_for(3, seed=23)
    b.store(only_b, salt=salt)
    node = tier(c)._node
    wait_until(
        lambda: all(node.locations.where(k) == [b.addr] for k in only_b) or None,
        PATIENCE_S,
        "C to learn B's chunks (by engine key) from its events",
    )
    c.tm.set_cache_salt("salted", salt)
    assert_serves(c, only_b, "salted")
    asked = dict(node.client.peer_stats)
    assert asked.get((a.addr, "lookup_chunks"), 0) == 0, asked
    assert asked[(b.addr, "lookup_chunks")] >= len(only_b)
    # the same engine keys without the salt: B's hint is tried first, but B holds no unsalted
    # chunk of them: a miss everywhere, never the tenant's bytes
    assert settle(c, only_b, "unsalted") == [MISS] * len(only_b)


def test_a_request_naming_a_peer_no_socket_can_reach_leaves_the_tier_serving(world):
    """A request's kv_transfer_params name its peers: one whose address ZMQ refuses to connect to
    ("*") is no allowed peer, refused and counted before any socket (were it allowed, the node
    would take it as a peer down: tests/integration/test_p2p_client.py), and the configured peer still
    serves. Before, the error ended the node thread, and every later lookup and job of the tier
    waited forever."""
    a = world.instance(p2p("tcp", free_port()))
    keys = keys_for(3, seed=40)
    a.store(keys)
    b = world.rig(p2p("tcp", free_port(), [a.addr]))
    wait_until(lambda: tier(b).peers_up() or None, PATIENCE_S, "B's session with A")
    route = {"remote_host": "*", "remote_port": 5710, "kv_request_id": "kvr-40"}
    assert_serves(b, keys, "r40", {"remote_kv_source": route})
    node = tier(b)._node
    assert node.is_alive() and node.error is None
    assert "*:5710" not in node.client.links
    assert tier(b).refused_routes["not_allowed"] == 1


def test_a_tier_whose_node_thread_ended_still_shuts_down_and_leaves_no_process(world):
    """Whatever ends the node thread (a bug), the tier still shuts down and its peer worker
    exits. Before, the ended thread had closed its wake-up pipe and stop() wrote to it: the
    EBADF (or a byte into whatever file had taken that descriptor number) made shutdown fail
    before it stopped the peer worker."""
    r = world.rig(p2p("tcp", free_port()))
    t = tier(r)
    node = t._node

    def a_bug(now):
        raise RuntimeError("a bug in the node thread")

    node.client.tick = a_bug
    wait_until(lambda: not node.is_alive() or None, PATIENCE_S, "the node thread to end")
    assert isinstance(node.error, RuntimeError)
    pid = t.worker_pid
    t.shutdown()
    wait_until(lambda: not alive(pid) or None, PATIENCE_S, "the peer worker to exit")
    # a command submitted after the stop (a request finishing during teardown) writes nothing:
    # not into the closed pipe (EBADF), nor into a file that took its descriptor number since
    r_fd, w_fd = os.pipe()
    try:
        node.submit(node.commands[0] if node.commands else object())
        node.stop()  # again: nothing left to close
        os.set_blocking(r_fd, False)
        with pytest.raises(BlockingIOError):
            os.read(r_fd, 1)  # nothing was written into a reused descriptor
    finally:
        os.close(r_fd)
        os.close(w_fd)


def test_a_taken_port_is_a_config_error_and_leaves_nothing(world):
    import socket

    from kvoffload.config import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(ConfigError, match=r"port: cannot bind tcp://127\.0\.0\.1:\d+"):
            Rig([p2p("tcp", port)], num_slots=SLOTS, row_bytes=ROW)
    wait_until(
        lambda: (
            not [
                p
                for p in psutil.Process().children(recursive=True)
                if p.pid not in before and alive(p.pid)
            ]
            or None
        ),
        PATIENCE_S,
        "the peer worker of the failed instance to exit",
    )


def test_the_demo_pairs_p2p_tiers_take_the_liveness_limits_they_are_given(tmp_path):
    """``pair_specs`` (the p2p demo's and the vLLM p2p end-to-end test's two servers) hands its
    ``p2p_settings`` to both servers' p2p tiers, as each server's config parser reads them: the
    end-to-end test sets upper bounds there instead of the 2 s defaults, which a busy machine's
    stalls exceed (its prefiller route then got 0 or 32 of ~1,200 tokens from P). Without
    settings the tiers keep the defaults (the demo's)."""
    from kvoffload.config import parse_config
    from kvoffload.tiers.p2p import P2PTierConfig
    from kvoffload.tools.demo_p2p import pair_specs

    args = {"device_tokens": 2048, "block_size": 32, "max_model_len": 2016, "host_tokens": 4096}
    limits = {"peer_timeout_s": 30.0, "transfer_deadline_s": 30.0, "lease_ttl_s": 150.0}
    for settings, want in (
        (limits, limits),
        (None, {k: getattr(P2PTierConfig(), k) for k in limits}),
    ):
        p, d, p_port = pair_specs("model", args, "prefiller", "auto", tmp_path, "s", settings)
        tiers = [parse_config(s.offload).secondary_tiers[0].config for s in (p, d)]
        assert tiers[0].port == p_port
        assert tiers[0].peers == [f"127.0.0.1:{tiers[1].port}"] and tiers[1].peers == []
        # D's requests name P (remote_prefiller): P is an allowed peer of D's
        assert tiers[1].allowed_peers == [f"127.0.0.1:{tiers[0].port}"]
        for t in tiers:
            assert {k: getattr(t, k) for k in want} == want


# -- the engine thread's verdicts and peers going down (no instance, no socket) -------------------


def engine_side_tier(max_down_log: int | None = None):
    """A p2p tier as its engine thread sees it, never attached: its node is a results deque the
    test fills as the node thread would (``tier._node.results``)."""
    from collections import deque
    from types import SimpleNamespace

    from kvoffload.tiers.p2p.config import P2PTierConfig
    from kvoffload.tiers.p2p.tier import P2PTier, _DownLog

    t = P2PTier(
        name="p2p",
        arena_view=memoryview(bytearray(ROW)),
        namespace=namespace(),
        config=P2PTierConfig(secret=SECRET),
        arena=object(),
    )
    if max_down_log is not None:
        t._downs = _DownLog(max_down_log)
    t._node = SimpleNamespace(results=deque())
    return t


def test_many_distinct_peers_going_down_leave_the_tiers_memory_bounded():
    """Requests may name many peers: 3x MAX_DOWN_LOG distinct peers each told HIT for a key and
    then going down leave at most MAX_DOWN_LOG remembered, at most MAX_PEER_LABELS metric labels,
    and no verdict of any of them standing."""
    from kvoffload.tiers.p2p.client import MAX_PEER_LABELS, PeerClient
    from kvoffload.tiers.p2p.commands import PeerDown, Verdict
    from kvoffload.tiers.p2p.tier import MAX_DOWN_LOG

    t = engine_side_tier()
    n = 3 * MAX_DOWN_LOG
    peers = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:5710" for i in range(n)]
    keys = [i.to_bytes(32, "little") for i in range(n)]
    for key, peer in zip(keys, peers):
        t._node.results.extend((Verdict(key, peer), PeerDown(peer)))
    assert t.lookup(keys[0]) == MISS  # drains them all
    assert len(t._downs) <= MAX_DOWN_LOG
    assert [k for k in keys if t.lookup(k) == HIT] == []

    client = PeerClient.__new__(PeerClient)  # its labels alone
    client._labels = {}
    labels = {client.label(p) for p in peers}
    assert len(client._labels) == MAX_PEER_LABELS
    assert labels == {*peers[:MAX_PEER_LABELS], "other"}
    assert client.label(peers[0]) == peers[0]  # a labelled peer keeps its label


def test_forgetting_a_peer_can_only_void_verdicts_never_revive_one():
    """Verdicts and peers going down in random order against a down log of 8 peers, compared
    with unbounded memory: a verdict learnt before its peer went down is never HIT again, even
    once that peer is forgotten; a verdict learnt after the last peer went down stands."""
    import random

    from kvoffload.tiers.p2p.commands import PeerDown, Verdict

    rng = random.Random(23)
    t = engine_side_tier(max_down_log=8)
    peers = [f"peer-{i}:5710" for i in range(40)]
    learnt: dict[bytes, tuple[str, int]] = {}  # key -> (peer, downs of all peers so far)
    downs: dict[str, int] = {}  # peer -> how many went down before its last going down
    total = 0
    voided = 0
    for step in range(5000):
        peer = rng.choice(peers)
        if rng.random() < 0.4:
            total += 1
            downs[peer] = total
            t._node.results.append(PeerDown(peer))
        else:
            key = rng.randrange(200).to_bytes(32, "little")
            learnt[key] = (peer, total)
            t._node.results.append(Verdict(key, peer))
        key = rng.choice(list(learnt)) if learnt else b"\0" * 32
        got = t.lookup(key)
        holder, at = learnt.get(key, ("", 0))
        void = holder == "" or downs.get(holder, 0) > at
        if void:
            assert got == MISS, f"step {step}: a void verdict of {holder} revived"
        elif got == MISS:
            voided += 1  # forgetting voided a verdict still good: allowed, never the reverse
            learnt.pop(key)
    assert len(t._downs) <= 8
    assert voided > 0  # the log did forget peers whose verdicts it then voided
    key = b"fresh".ljust(32, b"\0")
    t._node.results.append(Verdict(key, peers[0]))
    assert t.lookup(key) == HIT  # learnt after every going down so far: it stands


def data_of(welcome: pm.Welcome) -> tuple[pt.TcpDescriptor, bytes]:
    """The data port and session token a Welcome gives, once the serving instance's worker
    accepts the token (it learns it just after the Welcome went: a connection before is
    refused; an honest reader connects only after a LeaseReply, which waits for its worker)."""
    from p2p_data import DataClient

    desc = pt.decode_descriptor(welcome.descriptor)
    assert isinstance(desc, pt.TcpDescriptor)

    def accepted():
        c = DataClient(desc)
        try:
            c.authenticate(welcome.data_token)
            return True
        except AssertionError:  # closed: not yet
            return None
        finally:
            c.sock.close()

    wait_until(accepted, PATIENCE_S, "the worker to accept the session", interval_s=0.01)
    return desc, welcome.data_token


def leased(node) -> set[bytes]:
    """The keys of the reading instance's loads whose lease was granted and whose READ went to
    its worker (read from the test's thread while the node thread runs: a torn read is empty).
    The lookups of a test may become several load jobs, each its own Lease: a test that stalls
    the serving side once the leases are granted waits for all of them."""
    try:
        return {k for part in list(node.client.loads.values()) for k in part.keys}
    except RuntimeError:  # the dict changed size during the copy
        return set()


def wait_counters(inst: Instance, want: dict[str, int]) -> None:
    """Wait until the serving instance's counters (as its node publishes them, a few times a
    second) are ``want``."""

    def seen():
        c = inst.ok("state")["counters"]
        return {n: c.get(n, 0) for n in want} == want or None

    wait_until(seen, PATIENCE_S, f"counters {want}", interval_s=0.05)


def test_c39_an_authenticated_peer_reads_only_what_it_leased_while_the_lease_lives_and_writes_nothing(
    world,
):
    """Instance A holds the chunks of two requests (different salts: different keys). B knows the
    secret and authenticates, then tries A's data plane: without a lease it reads no slot and
    writes none; with a lease of the first request's chunks it reads those (matching the
    LeaseReply's digests), nothing of the second, and nothing once it released them."""
    from p2p_data import DataClient, frame

    a = world.instance(p2p("tcp", free_port()))
    first, second = keys_for(4, seed=50), keys_for(4, seed=51)
    a.store(first + second)
    hexkeys = [k.hex() for k in first + second]
    before = a.ok("digest", keys=hexkeys)["digests"]
    b = RawClient(a.addr, namespace(row_bytes=ROW).id())
    try:
        desc, token = data_of(b.handshake())
        for slot in range(SLOTS):  # no lease: every slot of A refused
            c = DataClient(desc)
            c.authenticate(token)
            assert "not_granted" in c.read([slot]).error
            c.sock.close()
        for op in ("write", "put"):  # and a write of any slot, whatever the op is called
            c = DataClient(desc)
            c.authenticate(token)
            c.closed_after(frame(pt.TcpRequest(op, 1, list(range(SLOTS)))) + b"\0" * ROW * 4)
        lr = b.ask(pm.Lease(req=1, keys=first, ttl_s=60.0))
        assert isinstance(lr, pm.LeaseReply) and all(s >= 0 for s in lr.slots), lr
        c = DataClient(desc)
        c.authenticate(token)
        assert c.read(lr.slots).error == ""
        seed = pt.digest_seed(token)
        for i, k in enumerate(first):
            row = c.recv_exact(ROW)
            assert row == payload(k, ROW).tobytes()
            d = lr.digests[i * pt.DIGEST_BYTES : (i + 1) * pt.DIGEST_BYTES]
            assert pt.chunk_digest(row, seed) == d
        other = [s for s in range(SLOTS) if s not in lr.slots]
        assert "not_granted" in c.read(other[:1]).error
        c.sock.close()
        b.sock.send(pm.encode(pm.Release(lr.lease)))
        wait_until(lambda: a.ok("state")["pinned"] == 0 or None, PATIENCE_S, "the release")
        c = DataClient(desc)
        c.authenticate(token)
        assert "not_granted" in c.read(lr.slots[:1]).error
        c.sock.close()
    finally:
        b.close()
    assert a.ok("digest", keys=hexkeys)["digests"] == before  # nothing written
    wait_counters(a, {"refused.data_not_granted": SLOTS + 2, "refused.data_write": 2})


@pytest.mark.parametrize("kind", KINDS)
def test_c40_a_serving_slot_refilled_while_the_read_is_in_flight_is_a_miss_never_its_bytes(
    world, kind
):
    """The serving instance's slot gets other bytes after the lease granted it (evicted and
    refilled: a bug, or a writer of its arena) while the reader's READ waits to run: the
    reader's worker finds the digest wrong, the chunk fails ``digest_mismatch``, the others
    are served bit-exact."""
    a = world.instance(p2p(kind, free_port(), lease_ttl_s=50.0, transfer_deadline_s=10.0))
    keys = keys_for(4, seed=52)
    a.store(keys)
    b = world.rig(p2p(kind, free_port(), [a.addr], lease_ttl_s=50.0, transfer_deadline_s=10.0))
    wait_found(b, keys)
    node = tier(b)._node
    stop_process(tier(b).worker_pid)  # B's READ waits, its lease granted
    try:
        assert all(r is LookupResult.HIT_PENDING for r in [b.tm.lookup(k, "r") for k in keys])
        b.tm.step()
        wait_until(lambda: leased(node) >= set(keys) or None, PATIENCE_S, "every key leased")
        a.ok("scribble", keys=[keys[1].hex()], value=9)
    finally:
        os.kill(tier(b).worker_pid, signal.SIGCONT)
    assert b.tm.wait_idle(PATIENCE_S)
    name = tier(b).name
    assert b.tm.stats.failed.get((name, "load", "digest_mismatch")) == 1
    assert b.tm.host.index.get(keys[1]) is None  # never a HIT with those bytes
    for k in (keys[0], keys[2], keys[3]):
        row = b.arena.rows[b.tm.host.index[k]]
        assert np.array_equal(row, payload(k, ROW))
    assert pins_consistent(b)


def test_c40_a_lease_that_lapses_while_the_server_is_stalled_is_never_served(world):
    """CASES C40: server deadline 1 s / lease 5 s, reader deadline 10 s / lease 50 s, each valid
    on its own. The serving instance's worker stalls past the lease and its slots get other
    bytes: the reader, bound by the lease it was granted (5 s, not its own 50 s or its 10 s
    deadline), fails the load ``lease_expired`` and serves no HIT."""
    a = world.instance(p2p("tcp", free_port(), transfer_deadline_s=1.0, lease_ttl_s=5.0))
    keys = keys_for(4, seed=53)
    a.store(keys)
    b = world.rig(p2p("tcp", free_port(), [a.addr], transfer_deadline_s=10.0, lease_ttl_s=50.0))
    wait_found(b, keys)
    node = tier(b)._node
    own = tier(b).worker_pid
    stop_process(own)  # B's READ waits until A's worker stalls
    stalled = False
    try:
        assert all(r is LookupResult.HIT_PENDING for r in [b.tm.lookup(k, "r") for k in keys])
        b.tm.step()
        wait_until(lambda: leased(node) >= set(keys) or None, PATIENCE_S, "every key leased")
        stop_process(a.worker_pid)
        stalled = True
        os.kill(own, signal.SIGCONT)
        assert b.tm.wait_idle(PATIENCE_S), "the load never ended"
        a.ok("scribble", keys=[k.hex() for k in keys], value=5)  # its slots are reused
    finally:
        os.kill(own, signal.SIGCONT)
        if stalled:
            os.kill(a.worker_pid, signal.SIGCONT)
    name = tier(b).name
    assert b.tm.stats.failed.get((name, "load", "lease_expired")) == len(keys)
    assert all(b.tm.host.index.get(k) is None for k in keys)
    assert pins_consistent(b) and not b.tm.busy_slots()
    # A acknowledges the revocation once it runs again: its pins go
    wait_until(lambda: a.ok("state")["pinned"] == 0 or None, PATIENCE_S, "A's lease released")


def test_c46_a_peer_that_leases_all_it_can_and_never_reads_does_not_starve_another(world):
    """A greedy peer (it knows the secret) leases A's whole lease cap with a huge lifetime and
    never reads or releases. The lifetime A grants is its own (30 s); once another peer
    connects the greedy one is over its share, and its leases, unreleased past A's transfer
    deadline, are taken back for the other peer, which is served bit-exact."""
    a = world.instance(
        p2p("tcp", free_port(), transfer_deadline_s=1.0, lease_ttl_s=30.0, peer_timeout_s=60.0)
    )
    keys = keys_for(SLOTS, seed=54)
    a.store(keys)
    greedy = RawClient(a.addr, namespace(row_bytes=ROW).id())
    try:
        greedy.handshake()
        lr = greedy.ask(pm.Lease(req=1, keys=keys, ttl_s=86400.0))
        assert isinstance(lr, pm.LeaseReply) and lr.ttl_s <= 30.0, lr
        leased = sum(s >= 0 for s in lr.slots)
        assert leased == SLOTS // 2 and pm.LEASE_BUSY in lr.slots  # the cap: half the host tier
        since = time.monotonic()
        # held without reading past A's transfer deadline (1 s)
        wait_until(lambda: time.monotonic() > since + 1.0 or None, PATIENCE_S, "1 s to pass")
        b = world.rig(p2p("tcp", free_port(), [a.addr]))
        wait_until(lambda: tier(b).peers_up() or None, PATIENCE_S, "B's session with A")
        assert_serves(b, keys[:4])
        wait_counters(a, {"leases_reclaimed": 1})
    finally:
        greedy.close()
