"""Metrics and KV events: scraped over HTTP, decoded with vLLM's own decoder and plain msgpack."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq
from helpers import HIT, MISS, PENDING, ROW, Rig, fs_tier, keys_for, patience, payload, replay
from prometheus_client.parser import text_string_to_metric_families
from s3 import free_port

from kvoffload import metrics
from kvoffload.metrics import CORE_METRICS
from kvoffload.workers.chunkfile import HEADER_BYTES


@pytest.fixture
def endpoint():
    port = metrics.serve(0)
    yield f"http://127.0.0.1:{port}/metrics"
    metrics.stop_serving()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    import urllib.request

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, instance, **labels) -> float:
    want = tuple(sorted({"instance": instance, **labels}.items()))
    return samples.get((name, want), 0.0)


def store(rig: Rig, keys: list[bytes]) -> None:
    plan = rig.tm.prepare_store(keys)
    assert plan is not None
    for k, slot in zip(plan.keys, plan.slots):
        rig.arena.rows[slot] = payload(k)
    rig.tm.complete_store(plan.keys, True)


def resolve(rig: Rig, key: bytes, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        r = rig.tm.lookup(key)
        if r in (HIT, MISS, PENDING) or time.monotonic() > deadline:
            return r
        rig.tm.step()
        time.sleep(0.002)


def test_c19_hit_rate_counts_every_lookup_not_only_hits(tmp_path, endpoint):
    """4 of 10 looked-up chunks present (in the fs tier, not the host): requested += 10, hits += 4,
    ratio 0.4; load counters rise by 4 chunks and 4*S bytes; counters never go down; two managers in
    one process are exported side by side."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=16) as rig, Rig(num_slots=4) as other:
        keys = keys_for(10)
        store(rig, keys[:4])
        assert rig.tm.wait_idle(120)
        rig.tm.host.remove(keys[:4])  # only the fs tier holds them now
        inst = rig.tm.instance
        before = scrape(endpoint)
        verdicts = [resolve(rig, k) for k in keys]
        assert verdicts[:4] == [PENDING] * 4 and verdicts[4:] == [MISS] * 6
        assert rig.tm.wait_idle(120)
        for k in keys[:4]:
            assert resolve(rig, k) == HIT
        slots = rig.tm.prepare_load(keys[:4])
        for k, slot in zip(keys[:4], slots):
            assert np.array_equal(rig.arena.rows[slot], payload(k))
        rig.tm.complete_load(keys[:4])
        after = scrape(endpoint)

        def delta(name, **labels):
            return value(after, name, inst, **labels) - value(before, name, inst, **labels)

        # the 4 re-lookups after the promotions are host hits: 14 verdicts, 8 hits
        assert delta("kvoffload_lookup_requested_chunks_total") == 14
        assert delta("kvoffload_lookup_hit_chunks_total") == 8
        assert delta("kvoffload_tier_queries_total", tier="fs") == 10
        assert delta("kvoffload_tier_hits_total", tier="fs") == 4
        assert delta("kvoffload_tier_hits_total", tier="fs") / delta(
            "kvoffload_tier_queries_total", tier="fs"
        ) == pytest.approx(0.4)
        assert delta("kvoffload_tier_transfer_chunks_total", tier="fs", direction="load") == 4
        # the chunk files' bytes read (header page and row each: CASES C50)
        assert delta("kvoffload_tier_transfer_bytes_total", tier="fs", direction="load") == 4 * (
            HEADER_BYTES + ROW
        )
        assert (
            delta("kvoffload_tier_transfer_latency_seconds_count", tier="fs", direction="load") >= 1
        )
        assert delta("kvoffload_lookup_latency_seconds_count", tier="fs") >= 1
        # monotonic across scrapes
        again = scrape(endpoint)
        for (name, labels), v in after.items():
            if name.endswith("_total") and dict(labels).get("instance") == inst:
                assert again[(name, labels)] >= v, name
        # the second manager is there too, under its own instance label
        assert value(after, "kvoffload_host_slots", other.tm.instance) == 4
        assert value(after, "kvoffload_host_slots", inst) == 16


def test_a_requests_chunk_is_counted_once_however_often_it_is_looked_up(tmp_path):
    """vLLM looks a deferred request's chunks up again every step: a chunk promoted from the fs
    tier for a request is one fs hit, not an fs hit plus a host hit for each later step (a fresh
    user's dashboard showed 91 host hits for a 13-chunk reload from fs, where vLLM counted none).
    Another request's lookups count on their own; a finished request's are forgotten."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=16) as rig:
        keys = keys_for(4, seed=41)
        store(rig, keys)
        assert rig.tm.wait_idle(120)
        rig.tm.host.remove(keys)  # only the fs tier holds them now
        st = rig.tm.stats
        lookups = 0
        deadline = time.monotonic() + 120  # an upper bound for a stuck run, not a measure

        def all_hit(req: str) -> bool:
            nonlocal lookups
            lookups += len(keys)
            return all(rig.tm.lookup(k, req) is HIT for k in keys)

        while not all_hit("r"):
            assert time.monotonic() < deadline, "the promotions never landed"
            rig.tm.step()
            time.sleep(0.002)
        for _ in range(3):  # vLLM's later steps, and its own re-checks
            assert all_hit("r")
        assert lookups >= 5 * len(keys)
        assert (st.host_queries, st.host_hits, st.tier_hits["fs"]) == (4, 0, 4)
        assert st.tier_queries["fs"] == 4
        assert all_hit("q")  # another request: its own verdicts, host hits now
        assert (st.host_queries, st.host_hits, st.tier_hits["fs"]) == (8, 4, 4)
        rig.tm.on_request_finished("r")
        assert all_hit("r")  # a new request under the old id counts again
        assert (st.host_queries, st.host_hits) == (12, 8)


def test_every_metric_is_exported_with_plausible_values(tmp_path, endpoint):
    from kvoffload.tools.stress import Stress, Workload

    cfg = {
        "cpu_bytes_to_use": 24 * ROW,
        "secondary_tiers": [fs_tier(tmp_path / "fs", max_bytes=64 * (ROW + 4096))],
    }
    run = Stress(cfg, chunk_bytes=ROW)
    try:
        wl = Workload(
            "zipf",
            np.random.default_rng(1),
            conversations=4,
            turn_chunks=2,
            system_chunks=1,
            max_turns=4,
            documents=30,
            doc_chunks=6,
            zipf_a=1.0,
        )

        # until every metric below has something to show (when depends on the machine's speed:
        # a contended machine may take many more seconds than an idle one), not for a duration
        def enough() -> bool:
            st = run.tm.stats
            done = run.report.requests
            return done >= 20_000 or (
                done >= 100
                and st.tier_hits["fs"] > 0
                and (run.tm.host.evictions > 0 and run.tm.tiers[0].counters.get("evictions", 0) > 0)
            )

        rep = run.run(wl, 3600.0, 4, stop_requested=enough)
        assert rep.ok and rep.requests > 0
        got = scrape(endpoint)
        inst = run.tm.instance
    finally:
        run.close()
    names = {n for (n, labels) in got if dict(labels).get("instance") == inst}
    for d in CORE_METRICS:
        if d.name in (
            "kvoffload_kv_events_published",
            "kvoffload_warm_restart_chunks",
            "kvoffload_canary_checks",
            "kvoffload_canary_seconds",
            "kvoffload_tenant_bytes",
            "kvoffload_tenant_quota_evictions",
            "kvoffload_tenant_quota_refusals",
        ):
            # only with kv_events (the events tests), warm_restart_s (test_warm_restart), canary
            # (tests/e2e/test_vllm_canary.py), tenant quotas (test_tenant_quotas)
            continue
        exposed = {"counter": d.name + "_total", "gauge": d.name, "histogram": d.name + "_count"}
        if d.name in (
            "kvoffload_tier_failed_chunks",
            "kvoffload_tier_failed_jobs",
            "kvoffload_tier_eviction_errors",
        ):
            continue  # no failure in a clean run
        assert exposed[d.kind] in names, d.name
    v = lambda name, **kw: value(got, name, inst, **kw)  # noqa: E731
    assert v("kvoffload_lookup_hit_chunks_total") <= v("kvoffload_lookup_requested_chunks_total")
    assert v("kvoffload_lookup_hit_chunks_total") > 0
    for tier in ("host", "fs"):
        assert (
            0
            < v("kvoffload_tier_hits_total", tier=tier)
            <= v("kvoffload_tier_queries_total", tier=tier)
        )
    assert (
        v("kvoffload_tier_transfer_bytes_total", tier="fs", direction="store")
        == v("kvoffload_tier_transfer_chunks_total", tier="fs", direction="store")
        * (HEADER_BYTES + ROW)
        > 0
    )
    assert v("kvoffload_device_transfer_bytes_total", direction="load") == rep.chunks_loaded * ROW
    assert v("kvoffload_device_transfer_bytes_total", direction="store") == rep.chunks_stored * ROW
    assert v("kvoffload_tier_workers_alive", tier="fs") == 2
    assert v("kvoffload_host_evictions_total") > 0
    assert v("kvoffload_tier_evictions_total", tier="fs") > 0
    assert 0 < v("kvoffload_host_usage_ratio") <= 1
    assert v("kvoffload_tier_events_total", tier="fs", event="bytes_written") > 0


def test_out_of_tree_tier_metrics_are_exported_with_no_wiring(endpoint):
    tier = {"type": "CountingTier", "module_path": "custom_tier", "max_bytes": 64 * ROW}
    with Rig([tier], num_slots=8) as rig:
        store(rig, keys_for(5))
        rig.tm.step()
        got = scrape(endpoint)
        inst = rig.tm.instance
        assert value(got, "kvoffload_counting_stores_total", inst, tier="CountingTier") == 1
        assert value(got, "kvoffload_counting_chunks", inst, tier="CountingTier") == 5
        assert value(got, "kvoffload_counting_job_chunks_count", inst, tier="CountingTier") == 1
        assert (
            value(got, "kvoffload_counting_job_chunks_bucket", inst, tier="CountingTier", le="8.0")
            == 1
        )
        assert (
            value(
                got, "kvoffload_tier_events_total", inst, tier="CountingTier", event="custom_event"
            )
            == 1
        )
    from kvoffload.vllm import KVOffloadSpec

    defs = KVOffloadSpec.build_metric_definitions(
        {"cpu_bytes_to_use": 8 * ROW, "secondary_tiers": [tier]}
    )
    assert {
        "kvoffload_counting_stores",
        "kvoffload_counting_chunks",
        "kvoffload_counting_job_chunks",
        "kvoffload_tier_hits",
    } <= set(defs)


def test_counts_made_in_worker_processes_reach_the_endpoint(tmp_path, endpoint):
    import os

    root = tmp_path / "fs"
    with Rig([fs_tier(root)], num_slots=8) as rig, Rig([fs_tier(root)], num_slots=8) as peer:
        keys = keys_for(2)
        store(peer, keys)
        assert peer.tm.wait_idle(120)
        store(rig, keys)  # the other engine wrote them: rig's writers find the files present
        assert rig.tm.wait_idle(120)
        rig.tm.host.remove(keys)
        path = next(
            os.path.join(d, f)
            for d, _, fs in os.walk(tmp_path / "fs")
            for f in fs
            if f.endswith(".kv")
        )
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\xff")
        for k in keys:
            resolve(rig, k)
        assert rig.tm.wait_idle(120)
        got = scrape(endpoint)
        inst = rig.tm.instance
        ev = lambda e: value(got, "kvoffload_tier_events_total", inst, tier="fs", event=e)  # noqa: E731
        assert ev("store_already_present") == 2
        assert ev("corrupt_removed") == 1
        assert (
            value(got, "kvoffload_tier_failed_jobs_total", inst, tier="fs", direction="load") == 1
        )
        assert (
            value(
                got,
                "kvoffload_tier_failed_chunks_total",
                inst,
                tier="fs",
                direction="load",
                reason="corrupt",
            )
            == 1
        )


def test_the_vllm_stats_path_carries_increments_and_samples(tmp_path):
    """What ``get_stats`` hands vLLM: counter increments since the last call, gauges, histogram
    samples; vLLM's own ``OffloadingConnectorStats`` aggregates it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    with Rig([fs_tier(tmp_path / "fs")], num_slots=8) as rig:
        rig.tm.metrics.keep_samples = True
        for h in rig.tm.metrics.values["kvoffload_tier_transfer_latency_seconds"].values():
            h.samples = []
        store(rig, keys_for(3))
        assert rig.tm.wait_idle(120)
        first = OffloadingConnectorStats(data=rig.tm.take_metric_stats())
        data = first.data["data"]
        assert data["kvoffload_tier_transfer_chunks"][("fs", "store")] == 3
        assert len(data["kvoffload_tier_transfer_latency_seconds"][("fs", "store")]) == 1
        assert data["kvoffload_host_slots"][()] == 8
        store(rig, keys_for(2, seed=1))
        assert rig.tm.wait_idle(120)
        second = OffloadingConnectorStats(data=rig.tm.take_metric_stats())
        assert second.data["data"]["kvoffload_tier_transfer_chunks"][("fs", "store")] == 2
        assert "kvoffload_host_slots" not in second.data["data"]  # unchanged gauge: not resent
        first.aggregate(second)
        assert first.reduce()["kvoffload_tier_transfer_chunks:('fs', 'store')"] == 5


# -- KV events ------------------------------------------------------------------------------------


def _sub(ctx, endpoint: str, topic: bytes):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def _wait_subscribed(pub, sub, topic: bytes) -> None:
    """Until ``sub``'s subscription to ``topic`` has reached the publisher (ZMQ drops what a PUB
    sends before it knows of a subscriber). ``sub`` also subscribes to the movements topic, after
    ``topic``: a probe movement arriving proves both subscriptions arrived, in order. Probes are
    movement batches, so the engine topic's sequence numbers still follow the run's opening
    clear without a gap."""
    from kvoffload.events import Movement

    moves = pub.config.movements_topic.encode()
    sub.setsockopt(zmq.SUBSCRIBE, moves)
    deadline = time.monotonic() + 30
    while True:
        pub.publish(
            [], [Movement(key=b"probe", src="none", dst="none", locality="local", nbytes=0)]
        )
        if sub.poll(50):
            frames = sub.recv_multipart()
            assert frames[0] == moves
            break
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
    pub.flush()
    while sub.poll(0):  # the probes still queued
        assert sub.recv_multipart()[0] == moves
    sub.setsockopt(zmq.UNSUBSCRIBE, moves)


def _events_cfg():
    return {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}


def test_c20_offloaded_copies_emit_kv_events(tmp_path):
    """BlockStored(K1, CPU), BlockStored(K1, STORAGE), BlockRemoved(K1, CPU), BlockRemoved(K1,
    STORAGE), in that order, gap-free, every one with a medium, none for a failed store; decoded by
    vLLM's own decoder and by plain msgpack."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    k1, *others = keys_for(9)
    bad = others[1]  # its host copy succeeds, its fs store fails: no STORAGE event for it
    fs = fs_tier(
        tmp_path / "fs",
        max_bytes=6 * (ROW + 4096),  # K1 + 5 later chunks
        faults=[{"point": "before_publish", "action": "raise", "arg": 5, "key_hex": bad.hex()}],
    )
    with Rig([fs], num_slots=4, kv_events=_events_cfg()) as rig:
        pub = rig.tm.publisher
        ctx = zmq.Context()
        sub = _sub(ctx, pub.endpoint, b"kv-events")
        try:
            _wait_subscribed(pub, sub, b"kv-events")
            store(rig, [k1])
            assert rig.tm.wait_idle(120)
            rig.tm.step()
            plan = rig.tm.prepare_store([others[0]])  # a failed accelerator copy: no event
            rig.tm.complete_store(plan.keys, False)
            rig.tm.step()
            # fill the host tier: K1 is evicted from it (the first batch's fs job half fails)
            for batch in ([bad, others[2]], [others[3]], [others[4]]):
                store(rig, batch)
                assert rig.tm.wait_idle(120)
                rig.tm.step()
            assert rig.tm.stats.cascade_failures["fs"] == 1
            for k in others[5:]:  # and the fs tier's byte cap evicts it there too
                store(rig, [k])
                assert rig.tm.wait_idle(120)
                rig.tm.step()
            pub.flush()  # everything published so far has been sent
            # every batch sent comes, however slowly: a quiet spell on a loaded machine is no
            # proof that none is still on its way
            # the run's opening AllBlocksCleared went out before the subscription (C54)
            sent = pub.published["engine"] - 1
            batches = []
            while len(batches) < sent:
                assert sub.poll(patience(120.0) * 1000), (
                    f"{len(batches)} of the {sent} batches sent came"
                )
                frames = sub.recv_multipart()
                if frames[0] == b"kv-events":  # (a probe sent just before the unsubscribe)
                    batches.append(frames)
            replayed = replay(pub.replay_endpoint)
        finally:
            sub.close()
            ctx.term()
    first = pub.first_seq  # the opening clear's number: the batches follow it, gap-free
    assert [int.from_bytes(s, "big") for _, s, _ in batches] == [
        first + 1 + i for i in range(len(batches))
    ]
    assert [s for s, _ in replayed] == [first + i for i in range(len(batches) + 1)]
    assert [p for _, p in replayed[1:]] == [p for _, _, p in batches]
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    seen = []
    seen_bad = []
    for topic, _, body in batches:
        assert topic == b"kv-events"
        plain = msgspec.msgpack.decode(body)
        assert isinstance(plain[0], float) and all(e["medium"] for e in plain[1])
        for ev in dec.decode(body).events:
            assert ev.medium in ("CPU", "STORAGE")
            if k1 in ev.block_hashes:
                seen.append((type(ev), ev.medium, ev.ownership))
            if bad in ev.block_hashes:
                seen_bad.append((type(ev), ev.medium))
            assert others[0] not in ev.block_hashes or isinstance(ev, BlockStored) is False
    assert seen == [
        (BlockStored, "CPU", None),
        (BlockStored, "STORAGE", "fs"),
        (BlockRemoved, "CPU", None),
        (BlockRemoved, "STORAGE", "fs"),
    ]
    # the chunk whose fs store failed: stored in (and evicted from) the host tier, never the fs tier
    assert seen_bad == [(BlockStored, "CPU"), (BlockRemoved, "CPU")]


def test_movement_events_match_the_movements_the_manager_made(tmp_path):
    from kvoffload.tools.stress import Stress, Workload

    # A fixed number of requests (not a duration): the same work on any machine, and far fewer
    # event batches than the replay buffer keeps, so a replay from 0 returns every one.
    requests = 2000
    cfg = {
        "cpu_bytes_to_use": 16 * ROW,
        "kv_events": {**_events_cfg(), "buffer_steps": 1_000_000},
        "secondary_tiers": [fs_tier(tmp_path / "fs")],
    }
    run = Stress(cfg, chunk_bytes=ROW)
    try:
        wl = Workload(
            "multiturn",
            np.random.default_rng(2),
            conversations=6,
            turn_chunks=2,
            system_chunks=1,
            max_turns=5,
            documents=1,
            doc_chunks=1,
            zipf_a=1.0,
        )

        def enough() -> bool:  # the movements to compare happened (when depends on the machine)
            done = run.report.requests
            return done >= 20 * requests or (
                done >= requests and run.tm.host.evictions > 0 and run.tm.stats.promotions["fs"] > 0
            )

        rep = run.run(wl, 3600.0, 3, stop_requested=enough)
        tm = run.tm
        tm.step()
        assert rep.ok and rep.requests >= requests
        stats = tm.stats.snapshot()
        evictions = tm.host.evictions
        publisher = tm.publisher
        publisher.flush()  # the publisher thread has sent (and buffered) all that was queued
        assert publisher.published["movements"] < publisher.config.buffer_steps
        batches = replay(publisher.replay_endpoint, 0, b"kvoffload-movements")
        first = publisher.first_seq
    finally:
        run.close()
    assert [s for s, _ in batches] == [first + i for i in range(len(batches))]
    moves: dict[tuple[str, str], int] = {}
    for _, body in batches:
        batch = msgspec.msgpack.decode(body)
        assert batch["instance"] == run.tm.instance
        for m in batch["events"]:
            assert len(m["key"]) == 16 and m["locality"] == "local" and m["nbytes"] == ROW
            moves[(m["src"], m["dst"])] = moves.get((m["src"], m["dst"]), 0) + 1
    assert moves.get(("device", "host"), 0) == rep.chunks_stored
    assert moves.get(("host", "device"), 0) == rep.chunks_loaded
    assert moves.get(("host", "fs"), 0) == stats["cascaded"]["fs"]
    assert moves.get(("fs", "host"), 0) == stats["promotions"]["fs"] > 0
    assert moves.get(("host", "none"), 0) == evictions > 0


def test_overlapping_topics_are_refused():
    from kvoffload.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="kv_events.movements_topic"):
        parse_config(
            {
                "cpu_bytes_to_use": 1 << 20,
                "kv_events": {"topic": "kv", "movements_topic": "kv-moves"},
            }
        )


@pytest.mark.prometheus
def test_a_real_prometheus_scrapes_a_stress_run(tmp_path):
    """``kvoffload stress --metrics-port`` in its own process, scraped by Debian's Prometheus."""
    import subprocess
    import sys
    import urllib.request

    from prom import require_prometheus, start_prometheus

    require_prometheus()  # skips (or fails, in CI's run) before a stress run is started for nothing
    port = free_port()
    # Runs until this test stops it (SIGTERM ends a stress run cleanly, exit 0).
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvoffload.tools.cli",
            "stress",
            "--duration",
            "600",
            "--workload",
            "zipf",
            "--chunk-kib",
            "64",
            "--metrics-port",
            str(port),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.2)
        with start_prometheus([f"127.0.0.1:{port}"], scrape_interval_s=1.0) as prom:
            prom.wait_until_up()
            prom.wait_for(
                'kvoffload_tier_hits_total{tier="fs"}',
                lambda r: r and float(r[0]["value"][1]) > 0,
                timeout_s=120,
            )
            first = prom.value('sum(kvoffload_tier_transfer_bytes_total{direction="load"})')
            prom.wait_for(
                'sum(kvoffload_tier_transfer_bytes_total{direction="load"})',
                lambda r: r and float(r[0]["value"][1]) > first,
                timeout_s=60,
            )
            hits = prom.value("sum(kvoffload_lookup_hit_chunks_total)")
            queries = prom.value("sum(kvoffload_lookup_requested_chunks_total)")
            assert 0 < hits <= queries
            for tier in ("host", "fs"):
                h = prom.value(f'sum(kvoffload_tier_hits_total{{tier="{tier}"}})')
                q = prom.value(f'sum(kvoffload_tier_queries_total{{tier="{tier}"}})')
                assert 0 < h <= q, tier
            assert prom.value("sum(kvoffload_tier_workers_alive)") == 4  # 2 readers, 2 writers
            assert 0 < prom.value("max(kvoffload_host_usage_ratio)") <= 1
            assert (
                prom.value(
                    "histogram_quantile(0.5, sum by (le) "
                    '(kvoffload_tier_transfer_latency_seconds_bucket{tier="fs"}))'
                )
                > 0
            )
            series = prom.query('{__name__=~"kvoffload_.+"}')
            names = {r["metric"]["__name__"] for r in series}
            for d in CORE_METRICS:
                if d.name in (
                    "kvoffload_kv_events_published",
                    "kvoffload_warm_restart_chunks",
                    "kvoffload_canary_checks",
                    "kvoffload_canary_seconds",
                    "kvoffload_tenant_bytes",
                    "kvoffload_tenant_quota_evictions",
                    "kvoffload_tenant_quota_refusals",
                    "kvoffload_tier_failed_chunks",
                    "kvoffload_tier_failed_jobs",
                    "kvoffload_tier_eviction_errors",
                ):
                    # no KV events, warm restart, canary or tenant quotas configured, no failure
                    # in a clean run
                    continue
                want = {
                    "counter": d.name + "_total",
                    "gauge": d.name,
                    "histogram": d.name + "_bucket",
                }[d.kind]
                assert want in names, d.name
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()[-2000:]


def test_a_replay_endpoint_equal_to_the_endpoint_is_refused():
    from kvoffload.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="kv_events.replay_endpoint"):
        parse_config(
            {
                "cpu_bytes_to_use": 1 << 20,
                "kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"},
            }
        )
