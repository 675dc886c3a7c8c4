"""Back-pressure: a slow secondary tier never stops the host tier taking new chunks (CASES C37)."""

from helpers import HIT, MISS, Rig, fs_tier, keys_for, payload, wait_until


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
