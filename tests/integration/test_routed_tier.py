"""Routed-tier hooks (:class:`~kvoffload.tiers.base.RoutedTier`): checked once when the manager is
built; only a tier with all of them is attached, told of requests and asked what to store."""

from __future__ import annotations

import pytest
from helpers import Rig, keys_for

ROW = 16384


def tier(kind: str) -> dict:
    return {"type": kind, "module_path": "custom_tier", "max_bytes": 64 * ROW}


def test_a_tier_with_some_routed_hooks_only_is_refused_naming_those_missing():
    with pytest.raises(TypeError) as e:
        Rig([tier("HalfRoutedTier")], num_slots=8)
    msg = str(e.value)
    assert "defines on_request, wants_store" in msg
    assert "but not attach, on_request_finished, origin" in msg


def test_a_routed_tier_is_attached_told_of_requests_and_stores_only_what_is_routed_to_it():
    with Rig([tier("RoutedMemoryTier"), tier("MemoryTier")], num_slots=8) as rig:
        routed, plain = rig.tm.tiers
        assert routed.attached is rig.tm
        params = {"to_tier": True}
        rig.tm.on_request("r1", params)
        rig.tm.on_request("r2", None)
        assert routed.told == [("r1", params), ("r2", None)]
        a, b = keys_for(2, seed=1), keys_for(2, seed=2)
        for req, keys in (("r1", a), ("r2", b)):
            plan = rig.tm.prepare_store(keys, req)
            assert plan is not None and plan.keys == keys
            rig.tm.complete_store(keys, True, req)
        assert rig.tm.wait_idle(30)
        assert [routed.known_present(k) for k in a + b] == [True, True, False, False]
        assert [plain.known_present(k) for k in a + b] == [True] * 4  # no hooks: stores all
        assert rig.tm.stats.cascaded == {routed.name: 2, plain.name: 4}
        rig.tm.on_request_finished("r1")
        assert routed.finished == ["r1"]
