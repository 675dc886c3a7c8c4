"""An fs reload in one round trip (issue 26 item 2; kvoffload/tiers/speculation.py): a request's
chunks after one its probe found are loaded without a probe, its other unknown chunks wait for
that one probe, and a capped tier answers from its ledger for the chunks it counts. Real worker
processes and files.

Round trips are counted, never timed: :func:`reload` looks a prefix up as vLLM's scheduler does
(in order, stopping at the first MISS), ends the step, then waits until the tier has answered
everything sent in it. So one pass is one scheduler step and one engine-worker round trip,
whatever the machine's speed; a reload of N chunks from a root the tier knew nothing of took
three passes and N probes before this change (a probe per chunk, then the load, then the hits).
"""

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import HIT, MISS, PENDING, RETRY, ROW, Rig, fs_tier, keys_for, payload, wait_until

from kvoffload.tiers.base import SPECULATIVE_MISS
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name

N = 8
FILE_BYTES = HEADER_BYTES + ROW


def reload(rig: Rig, keys: list[bytes], req: str = "req") -> tuple[int, list]:
    """Passes of ``req``'s prefix lookup of ``keys`` until none is RETRY or HIT_PENDING, and the
    last pass's answers (up to its first MISS)."""
    tm = rig.tm
    passes = 0
    while True:
        passes += 1
        answers = []
        for k in keys:
            answers.append(tm.lookup(k, req))
            if answers[-1] is MISS:
                break
        if not any(r in (RETRY, PENDING) for r in answers):
            return passes, answers
        assert passes < 20, f"no verdict after {passes} passes: {answers}"
        tm.step()
        assert tm.wait_idle(120), "the tier did not answer"


def stored_root(root, keys: list[bytes], **tier) -> None:
    """``keys`` stored in an fs tier on ``root`` by an instance that then stops."""
    with Rig([fs_tier(root, **tier)], num_slots=16) as rig:
        rig.store(keys)


@contextlib.contextmanager
def restarted(root, keys: list[bytes], **tier) -> Iterator[Rig]:
    """An instance with an unbounded fs tier (``tier``: its other keys) on ``root``, started
    after another stored ``keys`` there: it has no record of them."""
    stored_root(root, keys, max_bytes="unbounded")
    with Rig([fs_tier(root, max_bytes="unbounded", **tier)], num_slots=16) as rig:
        yield rig


def counter(rig: Rig, name: str) -> int:
    return int(rig.fs.counters.get(name, 0))


def chunk_file(rig: Rig, root, key: bytes) -> str:
    return os.path.join(str(root), rig.ns.id(), relative_name(key))


def assert_bytes(rig: Rig, keys: list[bytes], req: str = "req") -> None:
    slots = rig.tm.prepare_load(list(keys), req)
    for k, s in zip(keys, slots):
        assert np.array_equal(rig.arena.rows[s], payload(k)), "wrong bytes served"
    rig.tm.complete_load(keys, req)


def test_a_reload_unknown_to_the_tier_costs_one_probe_not_one_per_chunk(tmp_path):
    """After a restart of an unbounded tier (no ledger, no verdict) the first chunk is probed;
    the others wait for that probe and are then loaded, unasked, in the same job."""
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N
        assert passes == 3  # probe, load, hits: as before, with one probe instead of N
        assert counter(rig, "probes") == 1
        assert counter(rig, "speculative_loads") == N - 1
        assert rig.tm.stats.promotions["fs"] == N and not rig.tm.stats.failed
        assert_bytes(rig, keys)


def test_a_chunk_asked_after_the_first_probe_found_its_chunk_is_loaded_unasked(tmp_path):
    """The first probe's answer may land in the middle of a request's lookups (a lookup polls):
    the request's next unknown chunk is then expected, though the request has not asked the
    first chunk again."""
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        assert rig.tm.lookup(keys[0], "req") is RETRY
        rig.tm.step()
        assert rig.tm.wait_idle(120)  # the probe answered and was applied
        assert rig.tm.lookup(keys[1], "req") is PENDING
        assert counter(rig, "probes") == 1
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N and counter(rig, "probes") == 1
        assert_bytes(rig, keys)


def test_the_same_reload_without_speculation_probes_every_chunk(tmp_path):
    """``max_speculative_chunks: 0`` is the behaviour before: a probe per chunk."""
    keys = keys_for(N)
    with restarted(tmp_path, keys, max_speculative_chunks=0) as rig:
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N and passes == 3
        assert counter(rig, "probes") == N and counter(rig, "speculative_loads") == 0


def test_a_capped_tier_reloads_what_its_start_scan_found_in_one_round_trip(tmp_path):
    """A capped tier (the default) counts the chunks it finds at start: their lookups load at
    once, no probe: two passes (the load, the hits) where there were three."""
    keys = keys_for(N)
    cap = {"max_bytes": 64 * FILE_BYTES}
    stored_root(tmp_path, keys, **cap)
    with Rig([fs_tier(tmp_path, **cap)], num_slots=16) as rig:
        wait_until(lambda: counter(rig, "adopted_chunks") == N, what="the scan", step=rig.tm.poll)
        assert all(rig.fs.known_present(k) for k in keys)  # the ledger's word, no verdict
        assert not any(rig.fs.verdicts.is_present(k) for k in keys)
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N and passes == 2
        assert counter(rig, "probes") == 0 and counter(rig, "speculative_loads") == 0
        assert_bytes(rig, keys)


def test_chunks_another_instance_added_to_a_known_prefix_cost_one_probe(tmp_path):
    """On a shared root: this instance stored the head of a prefix, another the rest. The head
    answers from what this tier stored; the first chunk it never saw is probed, the rest wait
    for it and are loaded unasked."""
    keys = keys_for(N)
    with Rig([fs_tier(tmp_path, max_bytes="unbounded")], num_slots=16) as rig:
        rig.store(keys[:3])
        stored_root(tmp_path, keys, max_bytes="unbounded")  # the other instance, same root
        rig.evict_all()
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N and passes == 3
        assert counter(rig, "probes") == 1
        assert counter(rig, "speculative_loads") == N - 4
        assert_bytes(rig, keys)


def test_a_new_prompt_costs_one_probe_and_loads_nothing(tmp_path):
    """Nothing stored: the first chunk's probe finds nothing, the request's prefix ends there;
    the other chunks were never probed, nothing was loaded."""
    with Rig([fs_tier(tmp_path)], num_slots=16) as rig:
        rig.store(keys_for(2, seed=3))  # the tier holds something, not this prompt
        passes, answers = reload(rig, keys_for(N))
        assert answers == [MISS] and passes == 2
        assert counter(rig, "probes") == 1 and counter(rig, "speculative_loads") == 0
        assert rig.tm.stats.promotions["fs"] == 0


def test_a_new_turn_after_a_known_prefix_probes_its_first_new_chunk_and_loads_no_guess(
    tmp_path,
):
    """The chunks this instance stored are reloaded; the new turn's chunks after them were
    stored nowhere: the first is probed, none is loaded on expectation (a chunk found from the
    tier's own records says nothing of the unknown ones after it)."""
    keys = keys_for(N)
    with Rig([fs_tier(tmp_path)], num_slots=16) as rig:
        rig.store(keys[:5])
        rig.evict_all()
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * 5 + [MISS] and passes == 2
        assert counter(rig, "probes") == 1 and counter(rig, "speculative_loads") == 0
        assert not rig.tm.stats.failed


def test_a_chunk_asked_after_its_requests_first_probe_found_nothing_is_not_probed(tmp_path):
    """The request's first probe (its scout) answers absent in the middle of its lookups (a
    lookup polls results; on a loaded machine the answer can land between two of them): the
    chunks after it are MISS without a probe each, since the prefix ends at the scout (the
    previous test probed twice once in a while under load)."""
    keys = keys_for(N)
    with Rig([fs_tier(tmp_path)], num_slots=16) as rig:
        tm = rig.tm
        rig.store(keys[:5])
        rig.evict_all()
        assert [tm.lookup(k, "req") for k in keys[:6]] == [PENDING] * 5 + [RETRY]
        tm.step()
        assert tm.wait_idle(120)  # the probe of keys[5] answered (absent) and applied
        assert tm.lookup(keys[6], "req") is MISS  # asked before keys[5] again: no probe
        assert tm.lookup(keys[7], "req") is MISS
        assert counter(rig, "probes") == 1
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * 5 + [MISS] and counter(rig, "probes") == 1
        assert_bytes(rig, keys[:5])


def test_a_missing_middle_file_serves_the_chunks_before_it_and_nothing_after(tmp_path):
    """Chunks loaded on expectation where one file is gone: the prefix ends at it (a MISS,
    counted as speculative_miss), the chunks before it are served with their bytes, it and
    those after it are not (the engine recomputes them)."""
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        os.unlink(chunk_file(rig, tmp_path, keys[5]))
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * 5 + [MISS] and passes == 3
        assert rig.tm.stats.failed == {("fs", "load", SPECULATIVE_MISS): 1}
        assert rig.tm.stats.promotion_failures["fs"] == 1
        assert_bytes(rig, keys[:5])
        assert rig.tm.host.lookup(keys[5]) is MISS
        assert reload(rig, keys)[1] == [HIT] * 5 + [MISS]  # and it stays so
        assert counter(rig, "probes") == 1 and counter(rig, "load_failures") == 1
        assert rig.tm.host.num_pinned == 0 and rig.tm.host.num_writing == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_file_loaded_on_expectation_is_a_corrupt_miss_and_removed(tmp_path, damage):
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        path = chunk_file(rig, tmp_path, keys[3])
        if damage == "flip":
            with open(path, "r+b") as f:
                f.seek(HEADER_BYTES + ROW // 2)
                b = f.read(1)
                f.seek(HEADER_BYTES + ROW // 2)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.truncate(path, HEADER_BYTES + ROW // 2)
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * 3 + [MISS]
        assert rig.tm.stats.failed == {("fs", "load", "corrupt"): 1}
        assert counter(rig, "checksum_failures") == 1
        assert not os.path.exists(path)
        assert_bytes(rig, keys[:3])


def test_expectations_stop_at_max_speculative_chunks(tmp_path):
    """Past the cap a request's unknown chunks are probed again (one probe each), then loaded."""
    keys = keys_for(N)
    with restarted(tmp_path, keys, max_speculative_chunks=2) as rig:
        passes, answers = reload(rig, keys)
        assert answers == [HIT] * N and passes == 4
        assert counter(rig, "speculative_loads") == 2
        assert counter(rig, "probes") == 1 + (N - 3)
        assert_bytes(rig, keys)


def test_a_window_scans_lookup_is_never_answered_on_expectation(tmp_path):
    """A lookup that promotes nothing (a sliding-window scan, which must tell present chunks
    from absent ones) gets the tier's verdict: its unknown chunk is probed, even for a request
    whose chunks are expected."""
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        reload(rig, keys[:2])  # the first found by its probe, the second loaded unasked
        assert counter(rig, "speculative_loads") == 1
        probes = counter(rig, "probes")
        assert rig.tm.lookup(keys[2], "req", promote=False) is RETRY
        rig.tm.step()
        assert rig.tm.wait_idle(120)
        assert counter(rig, "probes") == probes + 1
        assert counter(rig, "speculative_loads") == 1


def test_a_finished_request_expects_nothing_more(tmp_path):
    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        reload(rig, keys[:2])
        rig.tm.on_request_finished("req")
        assert len(rig.fs.speculation) == 0
        reload(rig, keys[:4])  # the same id again: a new request, its first unknown chunk probed
        assert counter(rig, "probes") == 2 and counter(rig, "speculative_loads") == 2


def test_bench_ttfts_probe_column_counts_the_tiers_probe_round_trips(tmp_path):
    """`kvoffload bench ttft --restart` reports probes from the metrics endpoint's
    ``kvoffload_lookup_latency_seconds`` count (`fs_probes`): what the tier itself counted, one
    for a reload unknown to an unbounded tier, none once its chunks are known."""
    from prometheus_client import generate_latest

    from kvoffload import metrics
    from kvoffload.testing.tier_contract import samples
    from kvoffload.tools.bench.ttft import fs_probes

    def scrape() -> dict:
        return samples(generate_latest(metrics.registry()).decode())

    keys = keys_for(N)
    with restarted(tmp_path, keys) as rig:
        before = scrape()
        assert reload(rig, keys)[1] == [HIT] * N
        after = scrape()
        assert fs_probes(before, after) == counter(rig, "probes") == 1
        assert reload(rig, keys, "again")[1] == [HIT] * N
        assert fs_probes(after, scrape()) == 0
