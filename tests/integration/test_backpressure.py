"""Back-pressure: a slow secondary tier never stops the host tier taking new chunks (CASES C37),
and what it drops never leaves a hole in a prefix (C48)."""

import os

from helpers import HIT, MISS, Rig, fs_tier, keys_for, payload, wait_until

from kvoffload.workers.chunkfile import relative_name


def test_c37_a_slow_tier_does_not_stop_the_host_tier_taking_new_chunks(tmp_path):
    # The secondary tier's every store blocks until the gate file exists (the slow tier, slower than
    # any delay: nothing it is given finishes while the chunks are offered). Offers go by steps, two
    # new chunks a step, 80 in all, as an engine offers them between scheduler steps.
    gate = tmp_path / "stores-may-run"
    slow = fs_tier(
        tmp_path / "fs",
        faults=[{"point": "store", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    with Rig([slow], num_slots=16) as rig:  # the default configuration otherwise
        tm = rig.tm
        keys = keys_for(80)
        accepted: list[bytes] = []
        for i in range(0, 80, 2):
            offered = keys[i : i + 2]
            plan = tm.prepare_store(offered)
            assert plan is not None, f"the host tier refused chunks {i}, {i + 1}"
            for k, s in zip(plan.keys, plan.slots):
                rig.arena.rows[s] = payload(k, rig.row_bytes)
            tm.complete_store(plan.keys, True)
            accepted.extend(plan.keys)
            tm.step()
        assert accepted == keys  # every chunk taken, none cut from its batch
        assert tm.stats.store_rejections == 0 and tm.stats.store_truncations == 0
        assert tm.stats.cascaded["fs"] == 0  # nothing waited for the slow tier
        pinned = tm.host.num_pinned
        assert pinned < 16  # the slow tier holds part of the host tier, never all of it
        dropped = tm.stats.dropped_stores["fs"]
        assert dropped == 80 - pinned > 0  # the excess is dropped, and counted
        m = tm.refresh_metrics()
        assert m.get("kvoffload_dropped_stores", "fs") == dropped
        # The host tier holds the newest chunks, readable with their own bytes.
        for k in keys[-(16 - pinned) :]:
            slot = tm.host.index[k]
            assert (rig.arena.rows[slot] == payload(k, rig.row_bytes)).all()
        gate.touch()
        assert tm.wait_idle(120)
        wait_until(
            lambda: tm.host.num_pinned == 0, what="the slow tier's pins to drop", step=tm.step
        )
        assert tm.stats.cascaded["fs"] == pinned and tm.stats.cascade_failures["fs"] == 0
        assert tm.stats.cascaded["fs"] + tm.stats.dropped_stores["fs"] == 80


def test_a_batch_over_a_tiers_pin_budget_gives_that_tier_its_longest_fitting_prefix(tmp_path):
    gate = tmp_path / "stores-may-run"
    slow = fs_tier(
        tmp_path / "fs",
        faults=[{"point": "store", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    with Rig([slow], num_slots=8) as rig:  # default budget: half the host tier, 4 slots
        first, second = keys_for(3, seed=1), keys_for(3, seed=2)
        rig.store(first, wait=False)  # nothing in flight: the whole batch goes
        rig.store(second, wait=False)  # one slot of budget left: the head of the batch goes
        assert rig.tm.host.num_pinned == 4
        assert rig.tm.stats.dropped_stores["fs"] == 2
        gate.touch()
        assert rig.tm.wait_idle(120)
        assert rig.tm.stats.cascaded["fs"] == 4
        rig.tm.host.remove(first + second)
        assert rig.resolve(first + second[:1]) == [HIT] * 4
        rig.tm.host.remove(first + second[:1])
        assert rig.resolve(second[1:]) == [MISS] * 2


def test_c48_a_request_whose_chunk_was_dropped_or_failed_writes_nothing_past_it(tmp_path):
    """CASES C48: a slow fs tier (its stores wait on a gate) and a request offering its 24-chunk
    prefix 4 chunks a step. The first 8 are written (the tier's pin budget, half the host tier's
    16 slots), the next 4 dropped (``pin_limit``); the gate opens and the tier catches up, and the
    rest of the request's chunks are dropped too (``prefix_hole``): the tier holds the prefix's
    head, never a chunk past the hole (it held ``xxxxxxxx----xxxxxxxxxxxx``). Another request's
    chunks are written as before. A chunk that failed in the tier (EIO) stops its request's later
    chunks the same way."""
    gate = tmp_path / "stores-may-run"
    root = tmp_path / "fs"
    r1, r2, r3 = keys_for(24, seed=481), keys_for(8, seed=482), keys_for(8, seed=483)
    slow = fs_tier(
        root,
        faults=[
            {"point": "store", "action": "wait_file", "arg": str(gate), "count": -1},
            {"point": "before_publish", "action": "raise", "arg": 5, "key_hex": r3[3].hex()},
        ],
    )
    with Rig([slow], num_slots=16) as rig:
        tm = rig.tm

        def on_disk(keys: list) -> str:
            names = (os.path.join(root, rig.ns.id(), relative_name(k)) for k in keys)
            return "".join("x" if os.path.exists(p) else "-" for p in names)

        for i in range(0, 24, 4):
            if i == 12:  # the tier catches up: its pins drop, its budget is free again
                gate.touch()
                assert tm.wait_idle(120)
            rig.store(r1[i : i + 4], wait=False, request="r1")
            tm.step()
        tm.on_request_finished("r1")
        assert tm.wait_idle(120)
        assert on_disk(r1) == "x" * 8 + "-" * 16
        refused = tm.stats.refused
        assert refused[("fs", "store", "pin_limit")] == 4
        assert refused[("fs", "store", "prefix_hole")] == 12
        scraped = tm.refresh_metrics()
        assert scraped.get("kvoffload_refused_chunks", "fs", "store", "prefix_hole") == 12
        assert tm.stats.dropped_stores["fs"] == 16
        for i in range(0, 8, 4):  # another request: its own prefix, whole
            rig.store(r2[i : i + 4], request="r2")
        tm.on_request_finished("r2")
        assert on_disk(r2) == "x" * 8
        for i in range(0, 8, 2):  # r3's chunk 3 fails (EIO) in its second job
            rig.store(r3[i : i + 2], request="r3")
        tm.on_request_finished("r3")
        assert on_disk(r3) == "xxx-----"
        assert tm.stats.cascade_failures["fs"] == 1
        assert refused[("fs", "store", "prefix_hole")] == 12 + 4
        assert not tm._holes  # nothing kept once the requests finished
        tm._hole("r3", 0)  # a store of r3 failing now (it ended after r3 finished) keeps none
        assert not tm._holes
