"""What the online canary asks of the tiering manager (kvoffload.canary), with a real fs tier and
its worker processes: a canary run restricted to one tier (or none), the canary's chunks removed
from the host tier, and a tier's loads closed by a mismatch (``fail_closed``)."""

import time

import pytest
from helpers import Rig, fs_tier, keys_for, patience

from kvoffload.tiers.base import LookupResult

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)


def _resolve(rig: Rig, keys, req: str) -> list[LookupResult]:
    deadline = time.monotonic() + patience(60)
    while True:
        res = [rig.tm.lookup(k, req) for k in keys]
        if not any(r in (RETRY, PENDING) for r in res) or time.monotonic() > deadline:
            return res
        rig.tm.step()
        time.sleep(0.002)


@pytest.fixture
def rig(tmp_path):
    with Rig([fs_tier(str(tmp_path / "fs"))]) as r:
        r.wait_workers_ready()
        yield r


def test_a_run_restricted_to_no_tier_misses_what_only_a_tier_holds_and_one_to_fs_loads_it(rig):
    keys = keys_for(3, seed=5)
    rig.store(keys)
    assert rig.tm.remove_host_copies(keys) == keys
    assert rig.tm.remove_host_copies(keys) == []  # gone already
    rig.tm.restrict_loads("recompute-run", None)
    assert _resolve(rig, keys, "recompute-run") == [MISS] * 3
    rig.tm.restrict_loads("reuse-run", "fs")
    assert _resolve(rig, keys, "reuse-run") == [HIT] * 3
    assert {rig.tm.source_of(k, "reuse-run") for k in keys} == {"fs"}
    rig.tm.on_request_finished("recompute-run")
    rig.tm.on_request_finished("reuse-run")
    assert rig.tm._only == {}  # forgotten with their requests
    with pytest.raises(ValueError):
        rig.tm.restrict_loads("r", "nosuch")


def test_a_closed_tier_serves_nothing_and_its_chunks_are_counted_as_recomputed(rig):
    keys = keys_for(2, seed=6)
    rig.store(keys)
    rig.tm.remove_host_copies(keys)
    assert rig.tm.close_loads(["fs"]) == ["fs"]
    assert rig.tm.close_loads(["fs"]) == []  # closed already
    assert rig.tm.closed_loads == ["fs"]
    loads_before = rig.tm.stats.promotions["fs"]
    assert _resolve(rig, keys, "after") == [MISS, MISS]
    assert rig.tm.stats.promotions["fs"] == loads_before
    tpc = rig.ns.tokens_per_chunk
    assert _resolve(rig, keys, "after") == [MISS, MISS]  # asked again: counted once per chunk
    assert rig.tm.stats.recomputed[("fs", "canary")] == 2 * tpc
    assert rig.tm.refresh_metrics().get("kvoffload_recomputed_tokens", "fs", "canary") == 2 * tpc


def test_a_closed_host_tier_makes_every_lookup_a_miss(rig):
    keys = keys_for(2, seed=7)
    rig.store(keys)
    assert _resolve(rig, keys, "before") == [HIT, HIT]
    assert rig.tm.close_loads(["host"]) == ["host"]
    assert rig.tm.closed_loads == ["host"]
    assert [rig.tm.lookup(k, "after") for k in keys] == [MISS, MISS]
    assert [rig.tm.lookup(k, "after") for k in keys] == [MISS, MISS]  # counted once
    assert rig.tm.stats.recomputed[("host", "canary")] == 2 * rig.ns.tokens_per_chunk
    with pytest.raises(ValueError, match="nosuch"):
        rig.tm.close_loads(["nosuch"])
