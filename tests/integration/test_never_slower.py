"""Never slower than recompute (issue 26 item 4, kvoffload.costs): a real tiering manager over a
real fs tier, its loads stalled by a ``wait_file`` fault (slower than any deadline: nothing loads
until the test opens the gate) or its throughput set to an estimate orders of magnitude below
the engine's prefill. The deadlines run on a clock the test holds (``tm.clock``), so nothing here
depends on how fast the machine is: a healthy tier's promotions are never past theirs, a stalled
one's are once the test moves the clock on."""

import types

import pytest
from helpers import (
    HIT,
    MISS,
    PENDING,
    RETRY,
    ROW,
    Rig,
    fs_tier,
    keys_for,
    vllm_installed,
    wait_until,
)

from kvoffload.costs import RateEstimate

TOKENS = 16  # tokens per chunk of the helpers' namespace
# a chunk recomputes in 16 s: any load beats it; the policy under test asked for (not the default)
SLOW_PREFILL = {"recompute_tokens_per_s": 1.0, "slower_than_recompute": "recompute"}


class Clock:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refs_of(tm) -> dict[int, int]:
    return {s: r for s, r in enumerate(tm.host.refs) if r}


def offloaded(rig: Rig, keys: list) -> None:
    """``keys`` stored through to the fs tier (its stores measured: the tier's first estimate),
    then pushed out of the host tier."""
    rig.store(keys)
    rig.evict_all()
    assert not any(rig.tm.host.is_present(k) for k in keys)
    assert rig.tm.load_costs[0].bytes_per_s is not None


def serve(tm, rid: str, keys: list) -> int:
    """Look ``keys`` up for ``rid`` as vLLM's scheduler does (every step, from the start, up to
    the first MISS) until no verdict waits; load what was found. Returns the chunks found."""

    def verdicts():
        out = []
        for k in keys:
            r = tm.lookup(k, rid)
            out.append(r)
            if r is MISS:
                break
        return None if PENDING in out or any(r.name == "RETRY" for r in out) else out

    found = wait_until(verdicts, what="verdicts on every chunk", step=tm.step)
    hits = [k for k, r in zip(keys, found) if r is HIT]
    if hits:
        tm.prepare_load(hits, rid)
        tm.complete_load(hits, rid)
    return len(hits)


@pytest.mark.parametrize("policy", ["recompute", "serve"])
def test_a_healthy_tier_serves_every_chunk_it_served_before(tmp_path, policy):
    keys = keys_for(6)
    with Rig(
        [fs_tier(tmp_path / "fs")],
        num_slots=16,
        **{**SLOW_PREFILL, "slower_than_recompute": policy},
    ) as rig:
        tm = rig.tm
        tm.clock = Clock()  # frozen: no promotion ever overruns
        offloaded(rig, keys)
        assert serve(tm, "a", keys) == 6  # on the stores' estimate
        tm.on_request_finished("a")
        assert tm.load_costs[0].loads.rate is not None  # now on the loads'
        rig.evict_all(seed=7)
        assert serve(tm, "b", keys) == 6
        tm.on_request_finished("b")
        st = tm.stats
        assert st.promotions["fs"] == 12 and st.tier_hits["fs"] == 12
        assert set(st.recomputed.values()) == {0}
        assert tm.load_costs[0].outstanding_bytes == 0


def test_a_promotion_past_its_deadline_gives_way_to_recompute_and_still_lands(tmp_path):
    gate = tmp_path / "loads-may-run"
    stalled = fs_tier(
        tmp_path / "fs",
        job_timeout_s=600.0,
        faults=[{"point": "load", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    keys = keys_for(4)
    with Rig([stalled], num_slots=16, **SLOW_PREFILL) as rig:
        tm = rig.tm
        clock = tm.clock = Clock()
        offloaded(rig, keys)
        try:
            # promoted and submitted: HIT_PENDING while within its deadline, however many steps
            assert [tm.lookup(k, "r") for k in keys] == [PENDING] * 4
            for _ in range(5):
                tm.step()
                assert [tm.lookup(k, "r") for k in keys] == [PENDING] * 4
            ((_name, _direction, job),) = tm.jobs_in_flight()
            assert job.keys == keys
            # past 3 x its expected load (the stores' estimate: well under a second) or, at the
            # latest, 1.5 x the recompute of its 4 chunks at 1 token/s (96 s), it has overrun
            clock.now += 1.5 * 4 * TOKENS + 1
            assert tm.lookup(keys[0], "r") is MISS  # vLLM recomputes from the first chunk
            assert [tm.lookup(k, "r") for k in keys] == [MISS] * 4  # and never HIT after it
            st = tm.stats
            assert st.recomputed[("fs", "promotion_overran")] == 4 * TOKENS
            assert st.recomputed[("fs", "slower_than_recompute")] == 0
            m = tm.refresh_metrics()
            assert m.get("kvoffload_recomputed_tokens", "fs", "promotion_overran") == 4 * TOKENS
            # the request gave up what it held on them: no hold, no load source, no pin
            assert tm.promotion_holds == 0
            assert all(tm.source_of(k, "r") == "host" for k in keys)
            assert tm.pins_held() == refs_of(tm) == {}
            # another request finds the same overran promotion: it recomputes too (counted once)
            assert tm.lookup(keys[0], "s") is MISS
            assert st.recomputed[("fs", "promotion_overran")] == 5 * TOKENS
        finally:
            gate.touch()
        # the load went on: its chunks land in the host tier, for later requests
        wait_until(
            lambda: all(tm.host.lookup(k) is HIT for k in keys),
            step=tm.step,
            what="the stalled promotion to land",
        )
        assert tm.stats.promotions["fs"] == 4
        assert tm.load_costs[0].outstanding_bytes == 0 and not tm._promoting
        assert tm.lookup(keys[0], "r") is MISS  # still recomputed by the request that gave way
        assert serve(tm, "t", keys) == 4  # a later request is served
        for rid in ("r", "s", "t"):
            tm.on_request_finished(rid)
        assert not tm._recompute
        assert tm.pins_held() == refs_of(tm) == {}


def test_a_tier_expected_slower_than_recompute_is_not_waited_for_and_is_probed_now_and_then(
    tmp_path,
):
    keys = keys_for(3)
    with Rig([fs_tier(tmp_path / "fs")], num_slots=16, **SLOW_PREFILL) as rig:
        tm = rig.tm
        clock = tm.clock = Clock()
        offloaded(rig, keys)
        # the tier's estimate: one chunk in a million seconds (a configured estimate, not a
        # measured one); a chunk recomputes in 16 s
        tm.load_costs[0].loads = RateEstimate(fixed=ROW / 1e6)
        queries = tm.stats.tier_queries["fs"]
        assert tm.lookup(keys[0], "r") is MISS  # at once: the request waits for nothing
        st = tm.stats
        assert st.recomputed[("fs", "slower_than_recompute")] == TOKENS
        assert st.tier_queries["fs"] == queries + 1 and st.tier_hits["fs"] == 0
        # the tier is probed all the same, for no request: one load, which lands for later ones
        # (in flight after the step, or landed within its poll already on a quick machine)
        promoted = st.promotions["fs"]
        tm.step()
        in_flight = [(d, j.keys, j.request) for _n, d, j in tm.jobs_in_flight()]
        assert in_flight in ([("load", [keys[0]], "")], []), in_flight
        wait_until(lambda: tm.host.lookup(keys[0]) is HIT, step=tm.step, what="the probe")
        assert st.promotions["fs"] == promoted + 1
        assert tm.source_of(keys[0], "r") == "host" and tm.promotion_holds == 0
        assert tm.lookup(keys[0], "r") is MISS  # still recomputed by the request told MISS
        # within the probe interval, no other probe: nothing is loaded
        promoted = st.promotions["fs"]
        assert tm.lookup(keys[1], "s") is MISS
        tm.step()
        assert tm.jobs_in_flight() == [] and st.promotions["fs"] == promoted
        clock.now += 60
        assert tm.lookup(keys[1], "t") is MISS
        tm.step()
        assert [j.keys for _n, _d, j in tm.jobs_in_flight()] in ([[keys[1]]], [])
        assert tm.wait_idle(120)
        assert st.recomputed[("fs", "slower_than_recompute")] == 3 * TOKENS
        for rid in ("r", "s", "t"):
            tm.on_request_finished(rid)
        # the tier is fast again: served as before
        tm.load_costs[0].loads = RateEstimate(fixed=ROW * 1e9)
        assert serve(tm, "u", keys) == 3
        tm.on_request_finished("u")
        assert st.recomputed[("fs", "slower_than_recompute")] == 3 * TOKENS
        assert tm.pins_held() == refs_of(tm) == {}


def _stalled_probe_rig(tmp_path, keys: list[bytes], stalled_key: bytes, **tier) -> Rig:
    """An instance with an unbounded fs tier on a root where another stored ``keys`` (it has no
    record of them: each is probed), whose probes of ``stalled_key`` wait for the file
    ``tmp_path / "probe-may-run"`` (two readers: the other probes go to the one it leaves)."""
    root = tmp_path / "fs"
    with Rig([fs_tier(root, max_bytes="unbounded")], num_slots=16) as other:
        other.store(keys)
    gate = tmp_path / "probe-may-run"
    fault = {
        "point": "probe",
        "action": "wait_file",
        "arg": str(gate),
        "key_hex": stalled_key.hex(),
    }
    cfg = {"read_workers": 2, "job_timeout_s": 600.0, "faults": [fault], **tier}
    return Rig([fs_tier(root, max_bytes="unbounded", **cfg)], num_slots=16, **SLOW_PREFILL)


def test_a_request_kept_waiting_by_a_probe_past_its_deadline_gives_way(tmp_path):
    """A fresh request's chunk the tier knows nothing of is probed; its probe is stalled (as one
    queued behind another request's abandoned loads: BENCHMARKS.md §6). The request waits at
    RETRY while an estimate is missing (no evidence, no change), at least two steps, and until
    its deadline (3 x the tier's expected lookup, its queue of loads included, at least one
    chunk's recompute, at most 1.5 x the recompute of the chunks it asks); then MISS
    (``lookup_overran``) and it never waits for that chunk again. The wait is the request's,
    whichever chunks it asks each step (as vLLM 0.32 asks: all of them); only the chunk waited
    for is judged; the deadline is never lowered as the tier's queue drains; a wait whose
    chunk is no longer asked ends. A tier slower than recompute is not waited for at all. The
    probe's answer serves later requests."""
    keys = keys_for(4)
    stored, absent = keys[:3], keys[3]
    chunk_s = TOKENS / 1.0  # a chunk's recompute at SLOW_PREFILL's 1 token/s
    gate = tmp_path / "probe-may-run"
    with _stalled_probe_rig(tmp_path, stored, stored[0]) as rig:
        tm = rig.tm
        clock = tm.clock = Clock()
        tier, cost, st = tm.tiers[0], tm.load_costs[0], tm.stats
        wait_until(tier.workers_ready, step=tm.step, what="both readers")

        def ask(rid: str) -> list:  # as vLLM 0.32's scheduler: every chunk, every step
            return [tm.lookup(k, rid) for k in stored]

        try:
            # a probe sent to idle readers and answered: the tier's usual lookup, measured
            assert tier.lookup_seconds is None
            assert tm.lookup(absent, "m") is RETRY
            wait_until(lambda: tm.lookup(absent, "m") is MISS, step=tm.step, what="a probe")
            assert tier.lookup_seconds is not None
            # before it, a chunk's load at the tier's throughput stands in (none known here)
            assert cost.bytes_per_s is None
            assert tm._expected_lookup_s(0) == tier.lookup_seconds
            # no prefill estimate: no deadline, however long the wait
            tm.prefill = RateEstimate()
            assert tm.lookup(stored[0], "q") is RETRY  # its probe goes out at the step's end
            for _ in range(3):
                tm.step()
                clock.now += 1000.0
                assert tm.lookup(stored[0], "q") is RETRY
            tm.prefill = RateEstimate(fixed=1.0)
            assert tm.lookup(stored[0], "q") is MISS  # q has waited past any deadline
            assert st.recomputed[("fs", "lookup_overran")] == TOKENS

            # r: three chunks asked each step; its deadline is one chunk's recompute (its
            # expected lookup is milliseconds), and two steps at least
            assert ask("r") == [RETRY] * 3
            began = clock.now
            clock.now += 1000.0
            assert ask("r") == [RETRY] * 3  # within two steps, however late the clock
            tm.step()
            assert ask("r") == [RETRY] * 3
            tm.step()
            clock.now = began + chunk_s - 0.001
            assert ask("r") == [RETRY] * 3
            clock.now = began + chunk_s + 0.001
            assert tm.lookup(stored[1], "r") is RETRY  # not the chunk it waits for
            assert tm.lookup(stored[0], "r") is MISS  # vLLM's prefix ends at its first chunk
            assert tm.lookup(stored[0], "r") is MISS  # and it never waits for it again
            assert st.recomputed[("fs", "lookup_overran")] == 2 * TOKENS

            # w: waits behind 40 s of the tier's loads (3 x = 120 s; 1.5 x the recompute of
            # its 3 chunks, 72 s, is the most); the loads drain: its deadline stays
            cost.loads = RateEstimate(fixed=ROW * 1e3)  # a chunk in 1 ms
            cost.outstanding_bytes += ROW * 4e4
            try:
                assert ask("w") == [RETRY] * 3
                began = clock.now
                tm.step()
                tm.step()
                assert ask("w") == [RETRY] * 3
            finally:
                cost.outstanding_bytes -= ROW * 4e4
            clock.now = began + 1.5 * 3 * chunk_s - 0.001
            assert ask("w") == [RETRY] * 3  # drained: 3 x its expected lookup is long past
            clock.now = began + 1.5 * 3 * chunk_s + 0.001
            assert tm.lookup(stored[0], "w") is MISS

            # x: a wait whose chunk is no longer asked is over; the next RETRY begins anew
            assert tm.lookup(stored[0], "x") is RETRY
            for _ in range(3):
                tm.step()
            clock.now += 1000.0
            assert tm.lookup(stored[1], "x") is RETRY
            assert tm._waiting["x"].key == stored[1]

            # a tier slower than recompute is not waited for: its HIT would be a MISS
            cost.loads = RateEstimate(fixed=ROW / 1e6)  # a chunk in 11.6 days
            assert tm.lookup(stored[0], "v") is MISS
            assert st.recomputed[("fs", "slower_than_recompute")] == TOKENS
            cost.loads = RateEstimate()
            assert st.recomputed[("fs", "lookup_overran")] == 3 * TOKENS
            m = tm.refresh_metrics()
            assert m.get("kvoffload_recomputed_tokens", "fs", "lookup_overran") == 3 * TOKENS
            assert tm.promotion_holds == 0 and tm.pins_held() == refs_of(tm) == {}
        finally:
            gate.touch()
        # the probe is answered: a later request is served every chunk (the others unasked)
        assert serve(tm, "t", stored) == 3
        assert tm.lookup(stored[0], "r") is MISS  # still recomputed by the request that gave way
        for rid in ("m", "q", "r", "t", "v", "w", "x"):
            tm.on_request_finished(rid)
        assert not tm._waiting and not tm._recompute
        assert tm.pins_held() == refs_of(tm) == {}


def test_a_probe_that_timed_out_is_no_sample_of_the_tiers_lookups(tmp_path):
    """Only probes answered (present or absent) with nothing queued ahead of them teach the tier
    what a lookup costs: one that timed out says how long it waited, not what a lookup costs
    (taken as a sample, a stalled tier would lengthen its own deadlines)."""
    keys = keys_for(2)
    with _stalled_probe_rig(tmp_path, keys, keys[0], job_timeout_s=0.5) as rig:
        tm = rig.tm
        tier = tm.tiers[0]
        try:
            assert tm.lookup(keys[0], "r") is RETRY
            wait_until(lambda: tm.lookup(keys[0], "r") is not RETRY, step=tm.step, what="timeout")
            assert tier.lookup_seconds is None
        finally:
            (tmp_path / "probe-may-run").touch()
        assert tm.lookup(keys[1], "s") is RETRY
        wait_until(lambda: tm.lookup(keys[1], "s") is not RETRY, step=tm.step, what="a probe")
        assert tier.lookup_seconds is not None
        for rid in ("r", "s"):
            tm.on_request_finished(rid)


def test_the_serve_policy_waits_for_the_slowest_tier(tmp_path):
    gate = tmp_path / "loads-may-run"
    stalled = fs_tier(
        tmp_path / "fs",
        job_timeout_s=600.0,
        faults=[{"point": "load", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    keys = keys_for(2)
    with Rig(
        [stalled], num_slots=16, slower_than_recompute="serve", recompute_tokens_per_s=1e6
    ) as rig:
        tm = rig.tm
        clock = tm.clock = Clock()
        offloaded(rig, keys)
        tm.load_costs[0].loads = RateEstimate(fixed=ROW / 1000.0)  # slower than recompute
        try:
            assert [tm.lookup(k, "r") for k in keys] == [PENDING] * 2
            for _ in range(3):
                tm.step()
            clock.now += 1e9
            assert [tm.lookup(k, "r") for k in keys] == [PENDING] * 2
        finally:
            gate.touch()
        assert serve(tm, "r", keys) == 2
        tm.on_request_finished("r")
        assert set(tm.stats.recomputed.values()) == {0}


class _Tiering:
    """What KVOffloadManager reads of a tiering manager to take prefill samples."""

    def __init__(self):
        self.tiers = []
        self.publishes_events = False
        self.namespace = types.SimpleNamespace(tokens_per_chunk=16)
        self.config = types.SimpleNamespace(canary=None)  # no online canary
        self.prefill = RateEstimate()
        self.samples = []

    def observe_prefill(self, tokens, seconds):
        self.samples.append((tokens, seconds))
        self.prefill.observe(tokens, seconds)


needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")


@needs_vllm
def test_the_vllm_manager_samples_prefill_from_steps_of_at_least_a_chunk():
    from kvoffload.vllm.manager import KVOffloadManager

    tm = _Tiering()
    m = KVOffloadManager(tm)
    m._observe_step(64, now=10.0)  # the first step: nothing before it to time
    m._observe_step(3, now=10.5)  # 64 tokens took 0.5 s
    m._observe_step(None, now=10.6)  # 3 tokens: a decode step, not a prefill sample
    m._observe_step(32, now=11.0)  # the step before scheduled nothing known
    m._observe_step(0, now=11.25)  # 32 tokens in 0.25 s
    assert tm.samples == [(64, 0.5), (32, 0.25)]
    assert tm.prefill.rate == pytest.approx(128.0)


@needs_vllm
def test_the_vllm_manager_takes_an_idle_gap_for_no_prefill_sample():
    from kvoffload.vllm.manager import KVOffloadManager

    tm = _Tiering()
    m = KVOffloadManager(tm)
    m._observe_step(100, now=0.0)
    m._observe_step(100, now=1.0)  # 100 tokens/s
    m._observe_step(10, now=1000.0)  # the engine went idle after the step: 0.1 tokens/s
    assert tm.samples == [(100, 1.0)]


def test_the_load_estimate_counts_what_the_tier_has_outstanding(tmp_path):
    gate = tmp_path / "loads-may-run"
    stalled = fs_tier(
        tmp_path / "fs",
        job_timeout_s=600.0,
        faults=[{"point": "load", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    keys = keys_for(3)
    # a chunk loads in 1 s and recomputes in 1 s: served alone (1 s <= 2.5 x 1 s) or behind one
    # more (2 s), not behind two (3 s). Lookups judge the tier's speed alone (1 s: served); the
    # queue is weighed when the step submits the requests' promotions, in order
    prefill = {
        "recompute_tokens_per_s": float(TOKENS),
        "recompute_margin": 2.5,
        "slower_than_recompute": "recompute",
    }
    with Rig([stalled], num_slots=16, **prefill) as rig:
        tm = rig.tm
        tm.clock = Clock()
        offloaded(rig, keys)
        tm.load_costs[0].loads = RateEstimate(fixed=float(ROW))
        try:
            assert [tm.lookup(k, r) for k, r in zip(keys, "abc")] == [PENDING] * 3
            tm.step()
            assert tm.load_costs[0].outstanding_bytes == 3 * ROW  # c's load goes on
            assert tm.lookup(keys[0], "a") is PENDING
            assert tm.lookup(keys[1], "b") is PENDING  # behind a's chunk: 2 s, served
            assert tm.lookup(keys[2], "c") is MISS  # behind both: 3 s, recomputed
            assert tm.stats.recomputed[("fs", "slower_than_recompute")] == TOKENS
        finally:
            gate.touch()
        assert tm.wait_idle(120)
        assert tm.load_costs[0].outstanding_bytes == 0
        assert tm.host.lookup(keys[2]) is HIT  # c's chunk landed for later requests
        for rid in "abc":
            tm.on_request_finished(rid)


def test_a_requests_found_prefix_is_judged_whole_when_its_promotion_is_submitted(tmp_path):
    """A tier whose every job costs 30 s (its fixed cost; its bytes are fast) against 16 s of
    recompute a chunk (24 s with the margin): a request that found three chunks there waits for
    them (30 s against 72 s), one that found a single chunk recomputes it (30 s against 24 s).
    Judged at its first chunk, the three-chunk prefix would have lost too; judged with the rest
    of its prompt, the one-chunk request would have waited for a prompt the tier does not hold."""
    keys = keys_for(4)
    with Rig([fs_tier(tmp_path / "fs")], num_slots=16, **SLOW_PREFILL) as rig:
        tm = rig.tm
        tm.clock = Clock()
        offloaded(rig, keys)
        cost = tm.load_costs[0]
        cost.loads = RateEstimate(fixed=ROW * 1e6)
        cost.job_seconds = 30.0
        assert [tm.lookup(k, "r") for k in keys[:3]] == [PENDING] * 3  # the tier is fast
        assert tm.lookup(keys[3], "s") is PENDING
        tm.step()
        assert [tm.lookup(k, "r") for k in keys[:3]] != [MISS] * 3
        assert tm.lookup(keys[3], "s") is MISS
        st = tm.stats
        assert st.recomputed[("fs", "slower_than_recompute")] == TOKENS
        assert tm.wait_idle(120)
        assert serve(tm, "r", keys[:3]) == 3
        assert tm.host.lookup(keys[3]) is HIT  # s's load went on and landed
        for rid in "rs":
            tm.on_request_finished(rid)
        assert tm.pins_held() == refs_of(tm) == {}


def test_a_load_that_timed_out_is_a_sample_of_a_slow_tier(tmp_path):
    gate = tmp_path / "never"
    stalled = fs_tier(
        tmp_path / "fs",
        job_timeout_s=1.0,
        faults=[{"point": "load", "action": "wait_file", "arg": str(gate), "count": 1}],
    )
    keys = keys_for(1)
    with Rig([stalled], num_slots=16) as rig:
        tm = rig.tm
        offloaded(rig, keys)
        assert tm.load_costs[0].loads.rate is None
        assert tm.lookup(keys[0], "r") is PENDING
        try:
            wait_until(
                lambda: tm.lookup(keys[0], "r") is not PENDING,
                step=tm.step,
                what="the stalled load to time out",
            )
        finally:
            gate.touch()
        assert tm.stats.failed[("fs", "load", "timeout")] == 1
        loads = tm.load_costs[0].loads
        assert loads.samples == 1 and loads.rate <= ROW / 1.0  # one chunk in at least 1 s
        tm.on_request_finished("r")
