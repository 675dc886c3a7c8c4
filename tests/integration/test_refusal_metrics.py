"""Nothing silent: every refusal, dropped store and failed eviction is a labelled metric, a log line
and a row of ``kvoffload top``; the circuit breaker's three states are a gauge, and half-open lets a
bounded number of trial requests through.

Here with a real :class:`~kvoffload.tiering.TieringManager`, real fs tier worker processes and the
real ``/metrics`` endpoint; the breaker's state machine alone, with a fake clock (no processes, no
sleeps), is tests/unit/test_refusal_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.request

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
    payload,
    wait_paused,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families
from textual.widgets import DataTable

from kvoffload import metrics
from kvoffload.tools.top.app import TopApp
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name

# -- a real manager, real workers, the real endpoint -----------------------------------------------


@pytest.fixture
def endpoint():
    port = metrics.serve(0)
    yield f"http://127.0.0.1:{port}/metrics"
    metrics.stop_serving()


def scrape(url: str, instance: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels without instance) -> value`` of one manager."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if labels.pop("instance", None) == instance:
                out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def sample(got, name, **labels) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def refused(got, tier, direction, reason) -> float | None:
    return sample(
        got, "kvoffload_refused_chunks_total", tier=tier, direction=direction, reason=reason
    )


def offer(rig: Rig, keys: list[bytes]):
    """One accelerator → host store, completed at once (the engine's two calls); the plan."""
    plan = rig.tm.prepare_store(keys)
    if plan is not None:
        for k, slot in zip(plan.keys, plan.slots):
            rig.arena.rows[slot] = payload(k)
        rig.tm.complete_store(plan.keys, True)
    return plan


def settle(rig: Rig, key: bytes):
    return wait_until(
        lambda: (lambda r: r if r is not RETRY else None)(rig.tm.lookup(key, "r")),
        what="a lookup verdict",
        step=rig.tm.step,
    )


def test_host_refusals_truncations_and_promotion_failures_are_labelled_metrics(
    tmp_path, endpoint, caplog
):
    """Host tier of 4 slots: 2 pinned by a load, then a store of 6 new chunks takes 2 (4 refused,
    batch_truncated), a store of 3 more takes none (no_evictable_slot), and a chunk found in the fs
    tier cannot be promoted (host load no_evictable_slot); each reason is logged once."""
    with (
        Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig,
        caplog.at_level(logging.INFO, logger="kvoffload"),
    ):
        tm = rig.tm
        inst = tm.instance
        got = scrape(endpoint, inst)
        for tier, direction, reason in (
            ("host", "store", "no_evictable_slot"),
            ("host", "store", "batch_truncated"),
            ("host", "load", "no_evictable_slot"),
            ("fs", "store", "pin_limit"),
            ("fs", "store", "queue_full"),
            ("fs", "store", "breaker_open"),
        ):
            assert refused(got, tier, direction, reason) == 0, (tier, direction, reason)

        in_fs = keys_for(2, seed=1)
        rig.store(in_fs)
        tm.host.remove(in_fs)  # only the fs tier holds them now
        loaded = keys_for(2, seed=2)
        rig.store(loaded)
        tm.prepare_load(loaded, "r")  # pinned while "the accelerator copies them"

        plan = tm.prepare_store(keys_for(6, seed=3))
        assert plan is not None and len(plan.slots) == 2  # the 2 free slots; the other 4 refused
        assert tm.prepare_store(keys_for(3, seed=4)) is None  # every slot pinned or being written
        assert tm.prepare_store(keys_for(5, seed=5)) is None
        assert settle(rig, in_fs[0]) is MISS  # found in fs; no host slot to promote it into

        got = scrape(endpoint, inst)
        assert refused(got, "host", "store", "batch_truncated") == 4
        assert refused(got, "host", "store", "no_evictable_slot") == 3 + 5
        assert refused(got, "host", "load", "no_evictable_slot") == 1
        assert refused(got, "fs", "store", "pin_limit") == 0
        st = tm.stats
        assert (st.store_truncations, st.store_rejections, st.promotion_alloc_failures) == (1, 2, 1)

        lines = [r.getMessage() for r in caplog.records if r.name == "kvoffload"]
        rejections = [x for x in lines if "refused a store" in x]
        # the symptom, and the fix: a host tier with room for what was in flight and this store
        assert rejections == [
            "kvoffload: host tier refused a store of 3 chunk(s): no evictable "
            "slot (of 4 slots, 2 pinned by transfers in flight and 2 being "
            "written); raise cpu_bytes_to_use (now 65536 bytes, 4 chunks) to at least 114688 "
            "bytes: 7 chunks of 16384 bytes, room for the 4 in flight and 3 more"
        ]  # once a minute: the second refusal is not logged
        assert [
            x
            for x in lines
            if "took 2 of 6 new chunk(s)" in x and "to at least 131072 bytes: 8 chunks" in x
        ]
        assert [
            x
            for x in lines
            if "is not promoted" in x and "tier fs" in x and "to at least 81920 bytes" in x
        ]

        tm.complete_store(plan.keys, True)
        tm.complete_load(loaded, "r")
        assert tm.wait_idle(120)


def test_a_host_tier_smaller_than_one_request_names_the_size_that_holds_one(caplog):
    """The field's case (README "Using it with vLLM"): one request stores more chunks than the
    host tier has slots, so its next batch finds every slot being written by its own first one.
    When the manager knows how many chunks one request of the engine's longest length takes (the
    vLLM spec passes ``max_model_len``'s), the refusal names the ``cpu_bytes_to_use`` that holds
    one, not just the slots that were busy."""
    with (
        Rig(num_slots=4, request_chunks=10) as rig,
        caplog.at_level(logging.WARNING, logger="kvoffload"),
    ):
        tm = rig.tm
        first = tm.prepare_store(keys_for(4, seed=1), "req")  # its first batch fills the tier
        assert first is not None and len(first.slots) == 4
        assert tm.prepare_store(keys_for(3, seed=2), "req") is None  # its next: no room
        lines = [r.getMessage() for r in caplog.records if "refused a store" in r.getMessage()]
        assert lines == [
            "kvoffload: host tier refused a store of 3 chunk(s): no evictable slot (of 4 slots, "
            "0 pinned by transfers in flight and 4 being written); raise cpu_bytes_to_use (now "
            "65536 bytes, 4 chunks) to at least 163840 bytes: 10 chunks of 16384 bytes, one "
            "request of the engine's longest length"
        ]
        tm.complete_store(first.keys, True, "req")


def test_dropped_stores_carry_their_reason_pin_limit_and_queue_full(tmp_path, endpoint, caplog):
    """Two fs tiers whose writers are paused: tier ``q`` takes 2 chunks in flight
    (max_pending_store_chunks), tier ``p`` is stopped by the pin limit (4 of 16 host slots)."""
    gate = tmp_path / "gate"
    pause = [{"point": "store", "action": "wait_file", "arg": str(gate), "count": -1}]
    tiers = [
        fs_tier(tmp_path / "q", name="q", max_pending_store_chunks=2, faults=pause),
        fs_tier(tmp_path / "p", name="p", faults=pause),
    ]
    with (
        Rig(tiers, num_slots=16, tier_pin_fraction=0.25) as rig,
        caplog.at_level(logging.INFO, logger="kvoffload"),
    ):
        tm = rig.tm
        batches = [keys_for(2, seed=s) for s in (1, 2, 3)]
        for keys in batches:
            assert offer(rig, keys) is not None
        wait_paused(gate, count=2, step=tm.step)  # one writer of each tier holds its first store
        got = scrape(endpoint, tm.instance)
        # q: batch 1 in flight; batches 2 and 3 find its 2 chunks queued. p: batches 1 and 2
        # pin 4 slots, the limit; batch 3 would pin more.
        assert refused(got, "q", "store", "queue_full") == 4
        assert refused(got, "q", "store", "pin_limit") == 0
        assert refused(got, "p", "store", "pin_limit") == 2
        assert refused(got, "p", "store", "queue_full") == 0
        assert sample(got, "kvoffload_dropped_stores_total", tier="q") == 4
        assert sample(got, "kvoffload_dropped_stores_total", tier="p") == 2
        lines = [r.getMessage() for r in caplog.records if r.name == "kvoffload"]
        assert [x for x in lines if "not written to tier q: too many of its stores in flight" in x]
        assert [
            x
            for x in lines
            if "not written to tier p: its stores in flight already pin 4 "
            "host slots (tier_pin_fraction allows 4)" in x
        ]
        gate.touch()
        assert tm.wait_idle(120)


def breaker_states(got, tier):
    return {
        s: sample(got, "kvoffload_tier_breaker_state", tier=tier, state=s)
        for s in ("closed", "open", "half_open")
    }


def test_breaker_state_gauge_and_half_open_trials_with_real_workers(tmp_path, endpoint):
    """fs tier whose store of one chunk fails (an injected EIO): the breaker opens (stores dropped
    as breaker_open), turns half-open after its cooldown, lets one trial lookup through while the
    others miss at once, and closes when the trial's probe answers; the gauge follows. The trial
    probes the tier even for a chunk it is known to hold."""
    held, failing = keys_for(1, seed=6)[0], keys_for(1, seed=1)[0]
    fault = [
        {
            "point": "before_read_slot",
            "action": "raise",
            "arg": 5,
            "count": 1,
            "key_hex": failing.hex(),
        }
    ]
    cfg = fs_tier(
        tmp_path / "fs",
        breaker_failures=1,
        breaker_cooldown_s=3.0,
        breaker_trial_requests=1,
        faults=fault,
    )
    with Rig([cfg], num_slots=16) as rig:
        tm, tier = rig.tm, rig.fs
        got = scrape(endpoint, tm.instance)
        assert breaker_states(got, "fs") == {"closed": 1, "open": 0, "half_open": 0}
        rig.store([held])
        tm.host.remove([held])  # only the fs tier holds it

        rig.store([failing])  # fails: the breaker opens
        # The cooldown (3 s) outlasts these few checks on any machine.
        got = scrape(endpoint, tm.instance)
        assert breaker_states(got, "fs") == {"closed": 0, "open": 1, "half_open": 0}
        assert sample(got, "kvoffload_tier_breaker_open", tier="fs") == 1
        dropped = keys_for(3, seed=2)
        assert offer(rig, dropped) is not None
        got = scrape(endpoint, tm.instance)
        assert refused(got, "fs", "store", "breaker_open") == 3

        wait_until(lambda: tier.breaker_state == "half_open", what="the cooldown to pass")
        got = scrape(endpoint, tm.instance)
        assert breaker_states(got, "fs") == {"closed": 0, "open": 0, "half_open": 1}
        assert sample(got, "kvoffload_tier_breaker_open", tier="fs") == 0

        unknown = keys_for(3, seed=3)  # in no tier
        verdicts = [tm.lookup(k, "r") for k in [held, *unknown]]
        assert verdicts == [RETRY, MISS, MISS, MISS]  # one trial, not the whole queue
        assert offer(rig, keys_for(2, seed=4)) is not None  # the trial place is taken: dropped
        got = scrape(endpoint, tm.instance)
        assert refused(got, "fs", "store", "breaker_open") == 3 + 2

        assert settle(rig, held) is PENDING  # the trial probe found it: promoted
        assert tier.breaker_state == "closed"
        assert settle(rig, unknown[0]) is MISS
        got = scrape(endpoint, tm.instance)
        assert breaker_states(got, "fs") == {"closed": 1, "open": 0, "half_open": 0}
        assert sample(got, "kvoffload_tier_events_total", tier="fs", event="breaker_opens") == 1
        assert sample(got, "kvoffload_tier_events_total", tier="fs", event="breaker_closes") == 1

        stored = keys_for(2, seed=5)
        rig.store(stored)
        tm.host.remove(stored)
        assert [settle(rig, k) for k in stored] == [PENDING, PENDING]  # promoted from fs
        assert tm.wait_idle(120)
        assert [settle(rig, k) for k in stored] == [HIT, HIT]


def test_eviction_errors_are_counted_by_errno(tmp_path, endpoint):
    """A capped fs tier must evict a chunk whose path cannot be unlinked (a directory took its
    place: EISDIR): the failed eviction is ``kvoffload_tier_eviction_errors_total{errno="EISDIR"}``,
    not a tier event."""
    cap = 2 * (HEADER_BYTES + ROW)
    with Rig([fs_tier(tmp_path / "fs", max_bytes=cap)], num_slots=16) as rig:
        tm, tier = rig.tm, rig.fs
        first, second = keys_for(2, seed=1)
        rig.store([first])
        rig.store([second])
        path = os.path.join(tier.ns_dir, relative_name(first))
        os.unlink(path)
        os.mkdir(path)
        rig.store(keys_for(1, seed=2))  # over the cap: the least recently used (first) goes

        def counted():
            tm.step()
            return tm.refresh_metrics().get("kvoffload_tier_eviction_errors", "fs", "EISDIR")

        wait_until(counted, what="the failed eviction to be counted")
        got = scrape(endpoint, tm.instance)
        assert sample(got, "kvoffload_tier_eviction_errors_total", tier="fs", errno="EISDIR") == 1
        assert not [
            k
            for k in got
            if k[0] == "kvoffload_tier_events_total"
            and "eviction_errors" in dict(k[1]).get("event", "")
        ]
        assert sample(got, "kvoffload_tier_evictions_total", tier="fs") >= 1


# -- kvoffload top --------------------------------------------------------------------------------


def test_top_shows_refusals_and_the_open_breaker_of_a_real_manager(tmp_path, endpoint):
    """Host tier of 4 slots and an fs tier whose breaker opens (for ten minutes): ``kvoffload top``
    on the manager's endpoint shows the breaker OPEN and every refusal with its reason."""
    fault = [{"point": "before_read_slot", "action": "raise", "arg": 5, "count": 1}]
    cfg = fs_tier(tmp_path / "fs", breaker_failures=1, breaker_cooldown_s=600.0, faults=fault)
    with Rig([cfg], num_slots=4) as rig:
        tm = rig.tm
        rig.store(keys_for(1, seed=1))  # its fs store fails: the breaker opens
        held = keys_for(2, seed=2)
        assert offer(rig, held) is not None  # host READY; its fs store dropped: breaker_open
        tm.prepare_load(held, "r")  # 2 slots pinned
        writing = tm.prepare_store(keys_for(3, seed=3))  # 2 slots (1 free, 1 evicted): 1 cut off
        assert writing is not None and len(writing.slots) == 2
        assert tm.prepare_store(keys_for(2, seed=4)) is None  # nothing evictable: 2 refused

        def rows(app, table_id):
            table = app.query_one(f"#{table_id}-table", DataTable)
            return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]

        async def drive() -> TopApp:
            app = TopApp(endpoint, interval=0.2)
            async with app.run_test(size=(140, 60)) as pilot:
                for _ in range(2400):  # a generous bound: 120 s
                    if app.stats is not None and app.stats.refusals:
                        break
                    await pilot.pause(0.05)
                assert app.stats is not None, "no scrape reached the monitor"
                health = {r[0]: r for r in rows(app, "health")}
                assert health["fs"][3] == "OPEN"
                shown = {tuple(r[:3]): r[3] for r in rows(app, "refusals")}
                assert shown == {
                    ("host", "store", "batch_truncated"): "1",
                    ("host", "store", "no_evictable_slot"): "2",
                    ("fs", "store", "breaker_open"): "2",
                }
                await pilot.press("q")
            return app

        assert asyncio.run(drive()).return_code == 0
        tm.complete_store(writing.keys, False)
        tm.complete_load(held, "r")
