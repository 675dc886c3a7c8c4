"""Object-store tier against real S3-compatible servers on loopback (moto; nanio with SigV4)."""

import itertools
import time
import urllib.request

import botocore.exceptions
import numpy as np
import pytest
from helpers import (
    HIT,
    MISS,
    PENDING,
    ROW,
    Rig,
    failed_chunks,
    keys_for,
    namespace,
    patience,
    payload,
    peak_rss_bytes,
    serve_prefix,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families
from s3 import FaultProxy, Nanio, Rule, client, new_bucket, obj_tier, start_moto

from kvoffload import metrics
from kvoffload.config import ConfigError
from kvoffload.workers import chunkfile as cf
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


@pytest.fixture
def bucket(moto):
    return new_bucket(moto)


def object_name(rig, key):
    return f"{rig.ns.id()}/{relative_name(key)}"


def test_round_trip_through_the_object_store_is_bit_exact(moto, bucket):
    with Rig([obj_tier(moto, bucket)], num_slots=8) as rig:
        keys = keys_for(8)
        rig.store(keys)
        rig.evict_all()
        assert rig.resolve(keys) == [HIT] * 8
        for k, row in zip(keys, rig.read(keys)):
            assert np.array_equal(row, payload(k))
        head = client(moto).head_object(Bucket=bucket, Key=object_name(rig, keys[0]))
        assert head["ContentLength"] == HEADER_BYTES + ROW
        body = client(moto).get_object(Bucket=bucket, Key=f"{rig.ns.id()}/config.json")["Body"]
        assert b'"kv_dtype"' in body.read()


def test_two_managers_share_chunks_through_one_bucket(moto, bucket):
    keys = keys_for(6)
    with Rig([obj_tier(moto, bucket)], num_slots=8) as a:
        a.store(keys)
    with Rig([obj_tier(moto, bucket)], num_slots=8) as b:
        assert b.resolve(keys) == [HIT] * 6
        for k, row in zip(keys, b.read(keys)):
            assert np.array_equal(row, payload(k))


def test_prefix_and_namespace_separate_deployments(moto, bucket):
    keys = keys_for(2)
    with Rig([obj_tier(moto, bucket, prefix="team-a")], num_slots=4) as a:
        a.store(keys)
    with Rig([obj_tier(moto, bucket, prefix="team-b")], num_slots=4) as b:
        assert b.resolve(keys) == [MISS, MISS]
    with Rig(
        [obj_tier(moto, bucket, prefix="team-a")], num_slots=4, ns=namespace(kv_dtype="float8_e4m3")
    ) as c:
        assert c.resolve(keys) == [MISS, MISS]


def test_corrupted_object_is_a_miss_and_is_deleted(moto, bucket):
    k = keys_for(1)[0]
    with Rig([obj_tier(moto, bucket)], num_slots=4) as rig:
        rig.store([k])
        rig.evict_all()
        s3 = client(moto)
        name = object_name(rig, k)
        data = bytearray(s3.get_object(Bucket=bucket, Key=name)["Body"].read())
        data[HEADER_BYTES + 100] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=name, Body=bytes(data))
        assert rig.resolve([k]) == [MISS]
        assert rig.fs.counters["checksum_failures"] == 1
        with pytest.raises(botocore.exceptions.ClientError):
            s3.head_object(Bucket=bucket, Key=name)
        assert rig.resolve([k]) == [MISS]


def test_c09_s3_errors_are_never_swallowed(moto, bucket):
    k1, k2 = keys_for(2)
    proxy = FaultProxy(moto)
    try:
        with Rig(
            [obj_tier(proxy.endpoint, bucket, max_attempts=3, breaker_failures=None)], num_slots=4
        ) as rig:
            rig.store([k2])  # pre-seed K2 through the tier
            rig.evict_all()
            put_k1 = proxy.add(Rule("PUT", k1.hex(), ("status", 500, "InternalError")))
            get_k2 = proxy.add(Rule("GET", k2.hex(), ("status", 503, "SlowDown")))
            results = []  # every job result the tier hands the manager, as it hands it
            drain = rig.fs.get_finished_jobs

            def recording():
                out = drain()
                results.extend(out)
                return out

            rig.fs.get_finished_jobs = recording
            rig.arena.rows[:] = 0xEE
            rig.store([k1])
            stats = rig.tm.stats
            assert stats.cascade_failures["obj"] == 1 and put_k1.hits == 3  # bounded retries
            (stored,) = results
            assert not stored.success and stored.failed == {k1: "io_error"}
            assert stored.status == {k1: 500}  # the HTTP status travels in the result...
            assert rig.fs.counters["failures_http_500"] == 1  # ...and in a labelled metric
            assert k1 not in rig.fs.verdicts.present
            rig.tm.host.remove([k1])  # only the host copy remains: drop it
            assert rig.resolve([k1]) == [MISS]  # a failed upload is never recorded as present
            assert rig.tm.lookup(k2, "r") is PENDING
            res = rig.resolve([k2])
            assert res == [MISS] and get_k2.hits == 3
            assert stats.promotion_failures["obj"] == 1
            loaded = results[-1]
            assert not loaded.success and loaded.failed == {k2: "io_error"}
            assert loaded.status == {k2: 503}
            assert rig.fs.counters["failures_http_503"] == 1
            scraped = rig.tm.refresh_metrics()
            assert scraped.get("kvoffload_tier_events", "obj", "failures_http_503") == 1
            assert scraped.get("kvoffload_tier_events", "obj", "failures_http_500") == 1
            assert rig.tm.host.lookup(k2) is MISS  # the 0xEE slot was never published
    finally:
        proxy.stop()


def test_throttling_is_retried_and_then_succeeds(moto, bucket):
    k = keys_for(1)[0]
    proxy = FaultProxy(moto)
    try:
        with Rig([obj_tier(proxy.endpoint, bucket, max_attempts=4)], num_slots=4) as rig:
            rule = proxy.add(Rule("PUT", k.hex(), ("status", 503, "SlowDown"), count=2))
            rig.store([k])
            assert rule.hits == 2 and rig.tm.stats.cascaded["obj"] == 1
            rig.evict_all()
            assert rig.resolve([k]) == [HIT]
    finally:
        proxy.stop()


def test_c06_hanging_endpoint_fails_jobs_within_the_deadline(moto, bucket):
    k = keys_for(1)[0]
    proxy = FaultProxy(moto)
    try:
        with Rig(
            [
                obj_tier(
                    proxy.endpoint, bucket, max_attempts=1, read_timeout_s=1.0, job_timeout_s=3.0
                )
            ],
            num_slots=4,
        ) as rig:
            rig.store([k])
            rig.evict_all()
            proxy.add(Rule("GET", k.hex(), ("hang", 600)))  # answers long after the bound below
            assert rig.tm.lookup(k, "r") is PENDING
            assert rig.resolve([k], timeout_s=120) == [MISS]  # failed by a deadline, not answered
    finally:
        proxy.stop()


def test_c09_dead_endpoint_opens_the_breaker_which_closes_when_it_answers_again(moto, bucket):
    proxy = FaultProxy(moto)
    try:
        # The cooldown outlasts the few checks made while the breaker is open, on any machine.
        cfg = obj_tier(
            proxy.endpoint,
            bucket,
            max_attempts=1,
            connect_timeout_s=0.5,
            breaker_failures=3,
            breaker_cooldown_s=3.0,
        )
        with Rig([cfg], num_slots=16) as rig:
            rig.store(keys_for(1))
            proxy.stop()  # the server is killed: connections are refused
            for i in range(3):
                rig.store(keys_for(1, seed=10 + i))
            tier = rig.fs
            assert tier.breaker_state == "open" and tier.counters["breaker_opens"] == 1
            assert rig.tm.stats.cascade_failures["obj"] == 3
            # While open: lookups miss at once, stores are dropped and counted.
            assert rig.tm.lookup(keys_for(1, seed=99)[0], "r") is MISS
            rig.store(keys_for(1, seed=20))
            assert rig.tm.stats.dropped_stores["obj"] == 1
            assert tier.counters["breaker_dropped_stores"] == 1
            proxy.start()  # the endpoint answers again
            wait_until(lambda: tier.breaker_state == "half_open", what="the cooldown to pass")
            rig.store(keys_for(1, seed=30))
            assert tier.breaker_state == "closed" and tier.counters["breaker_closes"] == 1
            rig.evict_all()
            assert rig.resolve(keys_for(1, seed=30)) == [HIT]
    finally:
        proxy.stop()


def test_c09_a_burst_of_failures_opens_the_breaker_once_for_its_base_cooldown(moto, bucket):
    """Tasks already in flight when the breaker opens fail after it: they must not reopen it and
    double its cooldown again and again (one outage kept it open for minutes)."""
    proxy = FaultProxy(moto)
    try:
        cfg = obj_tier(
            proxy.endpoint,
            bucket,
            max_attempts=1,
            connect_timeout_s=0.5,
            breaker_failures=3,
            breaker_cooldown_s=1.0,
            chunks_per_task=1,
        )
        with Rig([cfg], num_slots=32) as rig:
            proxy.stop()
            rig.store(keys_for(12))  # 12 tasks in flight at once, all failing
            tier = rig.fs
            assert tier.counters["breaker_opens"] == 1
            assert tier.breaker.open_count == 1  # opened once: the next cooldown is not doubled yet
            assert tier.breaker.reopens_at - time.monotonic() <= 1.0  # for the base cooldown
            proxy.start()
            wait_until(lambda: tier.breaker_state == "half_open", what="the cooldown to pass")
            rig.store(keys_for(1, seed=40))
            assert tier.breaker_state == "closed"
    finally:
        proxy.stop()


def breaker_gauge(url: str, instance: str, tier: str) -> str:
    """The state whose ``kvoffload_tier_breaker_state`` gauge is 1 on the real ``/metrics`` (the
    other two must be 0)."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    values = {
        s.labels["state"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvoffload_tier_breaker_state"
        and s.labels.get("instance") == instance
        and s.labels.get("tier") == tier
    }
    on = [state for state, v in values.items() if v == 1]
    assert len(values) == 3 and len(on) == 1 and sum(values.values()) == 1, values
    return on[0]


def test_c51_after_an_outage_the_breaker_closes_within_its_max_cooldown_of_recovery(moto, bucket):
    """An obj tier behind the fault proxy; its endpoint dies (every connection refused) under
    steady traffic (a store each step) until the breaker has opened four times, each failed trial
    doubling the cooldown from 0.5 s but never past ``breaker_max_cooldown_s`` (1.2 s; uncapped,
    the fourth cooldown would be 4 s). Then the endpoint comes back: the breaker turns half-open
    within 1.2 s of that (its own schedule, no timing of this machine in it), the next store is
    its trial and closes it, and that store's object is in the bucket, within the documented
    bound (the max cooldown plus one trial's round trip, at most ``job_timeout_s``). Whenever
    the real ``/metrics`` is read, its state gauge shows the state the breaker is in: open
    during the outage, half_open once the cooldown after recovery has passed (it stays so until
    a request comes), closed after the trial."""
    first, cap = 0.5, 1.2
    proxy = FaultProxy(moto)
    url = f"http://127.0.0.1:{metrics.serve(0)}/metrics"
    try:
        cfg = obj_tier(
            proxy.endpoint,
            bucket,
            max_attempts=1,
            connect_timeout_s=0.5,
            breaker_failures=2,
            breaker_cooldown_s=first,
            breaker_max_cooldown_s=cap,
            breaker_trial_requests=1,
            chunks_per_task=1,
        )
        with Rig([cfg], num_slots=16) as rig:
            tm, tier = rig.tm, rig.fs
            br = tier.breaker
            rig.wait_workers_ready()
            fresh = (keys_for(1, seed=5100 + i)[0] for i in itertools.count())
            seen: list[str] = []  # the gauge's states, each once per run of it
            cooldowns: list[float] = []  # each opening's cooldown left just after it

            def observe() -> str:
                while True:  # again if it turned half-open while scraped (the clock's one move)
                    before = tier.breaker_state
                    shown = breaker_gauge(url, tm.instance, "obj")
                    if tier.breaker_state == before:
                        break
                assert shown == before
                if not seen or seen[-1] != shown:
                    seen.append(shown)
                return shown

            def store_one() -> bytes:
                observe()
                opens = br.opens
                key = next(fresh)
                rig.store([key])
                if br.opens > opens:
                    cooldowns.append(br.reopens_at - time.monotonic())
                return key

            store_one()
            assert tm.stats.cascaded["obj"] == 1 and seen == ["closed"]
            proxy.stop()  # the endpoint is dead: every connection is refused
            wait_until(lambda: br.opens >= 4, what="four openings", step=store_one)
            assert max(cooldowns) <= cap  # however long the outage
            assert tier.counters["breaker_dropped_stores"] > 0
            assert tm.stats.cascaded["obj"] == 1 and "open" in seen
            assert br.trials_in_flight == 0  # the last trial failed: nothing of the outage is out
            proxy.start()  # the endpoint answers again
            recovered_at = time.monotonic()
            assert br.reopens_at - recovered_at <= cap  # half-open within the cap of recovery
            wait_until(lambda: observe() == "half_open", what="the gauge to show half_open")
            served = store_one()  # the trial
            served_in = time.monotonic() - recovered_at
            assert tm.stats.cascaded["obj"] == 2 and observe() == "closed"
            assert br.opens == 4 and br.closes == 1
            assert served_in <= cap + cfg["job_timeout_s"], served_in
            client(moto).head_object(Bucket=bucket, Key=object_name(rig, served))
            assert seen[0] == "closed" and seen[-2:] == ["half_open", "closed"], seen
    finally:
        metrics.stop_serving()
        proxy.stop()


def test_missing_bucket_and_unreachable_endpoint_fail_at_start(moto):
    with pytest.raises(ConfigError, match="bucket: 'no-such-bucket' does not exist"):
        Rig([obj_tier(moto, "no-such-bucket")])
    with pytest.raises(ConfigError, match="endpoint_override: cannot use"):
        Rig([obj_tier("http://127.0.0.1:9", "kvcache")])


@pytest.mark.slow
def test_sigv4_server_round_trip_and_refused_credentials(tmp_path):
    server = Nanio(str(tmp_path / "nanio-data"))
    try:
        bucket = new_bucket(server.endpoint)
        keys = keys_for(4)
        with Rig([obj_tier(server.endpoint, bucket)], num_slots=8) as rig:
            rig.store(keys)
            rig.evict_all()
            assert rig.resolve(keys) == [HIT] * 4
            for k, row in zip(keys, rig.read(keys)):
                assert np.array_equal(row, payload(k))
        with pytest.raises(ConfigError, match="credentials were refused") as e:
            Rig([obj_tier(server.endpoint, bucket, secret_access_key="wrong-secret")])
        assert "wrong-secret" not in str(e.value)
    finally:
        server.stop()


def test_c17_obj_worker_killed_mid_upload_is_replaced_and_its_job_rerun(moto, bucket):
    import os
    import signal

    k = keys_for(1)[0]
    proxy = FaultProxy(moto)
    try:
        with Rig([obj_tier(proxy.endpoint, bucket, job_timeout_s=20.0)], num_slots=4) as rig:
            rig.wait_workers_ready()
            rule = proxy.add(Rule("PUT", k.hex(), ("hang", 5), count=1))  # the upload stalls
            rig.store([k], wait=False)
            wait_until(
                lambda: rule.hits > 0, what="the upload to reach the server", step=rig.tm.poll
            )
            writer = rig.fs.worker_pids()["stores"][0]
            os.kill(writer, signal.SIGKILL)  # dies holding the job
            assert rig.tm.wait_idle(60)
            # re-run on the replacement as soon as the death is seen, not after the job timeout
            assert rig.fs.counters.get("job_timeouts", 0) == 0
            assert rig.tm.stats.cascaded["obj"] == 1 and rig.tm.host.num_pinned == 0
            assert writer not in rig.fs.worker_pids()["stores"]
            assert rig.fs.counters["worker_restarts"] == 1
            rig.evict_all()
            assert rig.resolve([k]) == [HIT]
    finally:
        proxy.stop()


def test_server_killed_mid_job_fails_the_job_within_its_deadline(moto, bucket):
    keys = keys_for(4)
    proxy = FaultProxy(moto)
    try:
        cfg = obj_tier(
            proxy.endpoint,
            bucket,
            max_attempts=2,
            connect_timeout_s=0.5,
            job_timeout_s=60.0,
            breaker_failures=None,
        )
        with Rig([cfg], num_slots=8) as rig:
            rig.wait_workers_ready()
            rule = proxy.add(Rule("PUT", "/", ("hang", 600)))  # uploads stall...
            rig.store(keys, wait=False)
            wait_until(
                lambda: rule.hits > 0, what="an upload to reach the server", step=rig.tm.poll
            )
            proxy.stop()  # ...and the server dies with them in flight
            assert rig.tm.wait_idle(90)
            # failed by the broken connections, not left hanging until the job deadline
            assert rig.fs.counters.get("job_timeouts", 0) == 0
            stats = rig.tm.stats
            assert stats.cascade_failures["obj"] == 4 and stats.cascaded["obj"] == 0
            assert rig.tm.host.num_pinned == 0
            assert not any(k in rig.fs.verdicts.present for k in keys)  # nothing recorded as stored
    finally:
        proxy.stop()


def stored_objects(endpoint: str, bucket: str, rig) -> dict[str, int]:
    """Chunk objects of the rig's namespace in the bucket -> their sizes (config.json left out)."""
    pages = (
        client(endpoint)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=f"{rig.ns.id()}/")
    )
    return {
        o["Key"]: o["Size"]
        for page in pages
        for o in page.get("Contents", [])
        if not o["Key"].endswith("config.json")
    }


def test_max_bytes_deletes_the_least_recently_used_objects(moto, bucket):
    ob = HEADER_BYTES + ROW  # bytes of one chunk object
    k0, k1, k2, k3, k4 = keys_for(5)
    with Rig([obj_tier(moto, bucket, max_bytes=3 * ob)], num_slots=8) as rig:
        for k in (k0, k1, k2):
            rig.store([k])
        assert rig.fs.capacity.used_bytes == 3 * ob and rig.fs.counters.get("evictions", 0) == 0
        rig.tm.host.remove([k0])
        assert rig.resolve([k0]) == [HIT]  # loaded back from the tier: its most recently used
        rig.store([k3])  # one object too many: k1, the least recently used, is deleted
        assert rig.fs.counters["evictions"] == 1
        names = {object_name(rig, k) for k in (k0, k2, k3)}
        wait_until(
            lambda: set(stored_objects(moto, bucket, rig)) == names,
            what="the evicted object deleted",
            step=rig.tm.poll,
        )
        assert (
            sum(stored_objects(moto, bucket, rig).values()) == rig.fs.capacity.used_bytes == 3 * ob
        )
        scraped = rig.tm.refresh_metrics()
        assert scraped.get("kvoffload_tier_used_bytes", "obj") == 3 * ob
        assert scraped.get("kvoffload_tier_capacity_bytes", "obj") == 3 * ob
        rig.tm.host.remove([k1])
        assert rig.resolve([k1]) == [MISS]  # evicted from the tier: a clean miss
    # A later instance counts what the bucket holds and keeps the cap with it.
    with Rig([obj_tier(moto, bucket, max_bytes=3 * ob)], num_slots=8) as again:
        wait_until(
            lambda: again.fs.capacity.used_bytes == 3 * ob,
            what="the objects of the earlier run adopted",
            step=again.tm.poll,
        )
        assert again.fs.counters["adopted_chunks"] == 3
        again.store([k4])
        assert again.fs.counters["evictions"] == 1 and again.fs.capacity.used_bytes == 3 * ob
        wait_until(
            lambda: len(stored_objects(moto, bucket, again)) == 3,
            what="an adopted object deleted",
            step=again.tm.poll,
        )
        assert object_name(again, k4) in stored_objects(moto, bucket, again)


def test_c47_an_obj_tier_with_max_bytes_evicts_a_prefix_tail_first(moto, bucket):
    """CASES C47 in the obj tier: a host tier of 8 chunks, a bucket capped at 12 objects, two
    conversations of 8-chunk prefixes in turn: each prefix the bucket holds is usable from its
    head, in the bucket as in the tier's ledger, and a conversation that comes back finds 4."""
    ob = HEADER_BYTES + ROW
    with Rig([obj_tier(moto, bucket, max_bytes=12 * ob)], num_slots=8) as rig:
        prefixes = [keys_for(8, seed=475 + i) for i in range(2)]
        found = []
        for turn in range(2):
            for i, keys in enumerate(prefixes):
                found.append(serve_prefix(rig, f"t{turn}-c{i}", keys, 3))
                stored = stored_objects(moto, bucket, rig)
                for p in prefixes:
                    in_bucket = "".join("x" if object_name(rig, k) in stored else "-" for k in p)
                    counted = "".join("x" if k in rig.fs.capacity.index else "-" for k in p)
                    assert in_bucket == counted, (in_bucket, counted)
                    assert "-x" not in in_bucket, f"turn {turn}, conversation {i}: {in_bucket}"
        assert found == [0, 0, 4, 4], found


def test_without_max_bytes_the_obj_tier_deletes_nothing(moto, bucket):
    keys = keys_for(12)
    with Rig([obj_tier(moto, bucket)], num_slots=4) as rig:
        for i in range(0, 12, 4):
            rig.store(keys[i : i + 4])
        assert rig.fs.capacity.capacity_bytes is None and rig.fs.capacity.used_bytes == 0
        assert (
            rig.fs.counters.get("evictions", 0) == 0
            and len(stored_objects(moto, bucket, rig)) == 12
        )


def test_obj_max_bytes_below_one_object_is_refused_naming_the_key(moto, bucket):
    with pytest.raises(ConfigError, match=r"\.max_bytes: 100 is smaller than one chunk \("):
        Rig([obj_tier(moto, bucket, max_bytes=100)])


# -- CASES C43: keyed integrity on a shared bucket ------------------------------------------------

INTEGRITY_ENV = "KVOFFLOAD_TEST_INTEGRITY_KEY"


def test_c43_with_an_integrity_key_an_object_written_without_it_is_a_forged_miss_and_deleted(
    moto, bucket, monkeypatch
):
    monkeypatch.setenv(INTEGRITY_ENV, "a key the other credential does not have, 0123")
    keys = keys_for(3)
    evil = np.full(ROW, 0x66, dtype=np.uint8)
    with Rig([obj_tier(moto, bucket, integrity_key_env=INTEGRITY_ENV)], num_slots=4) as rig:
        ns_id = rig.fs.ns_id
        assert ns_id != rig.ns.id()  # the key's id is part of the namespace
        rig.store(keys)
        rig.evict_all()
        s3 = client(moto)
        names = [f"{ns_id}/{relative_name(k)}" for k in keys]
        ns_bytes = bytes.fromhex(ns_id)
        forged = cf.build_header(ns_bytes, keys[0], evil) + evil.tobytes()  # unkeyed, valid
        other = cf.build_header(ns_bytes, keys[1], evil, cf.mac_key(b"another key, long enough"))
        s3.put_object(Bucket=bucket, Key=names[0], Body=forged)
        s3.put_object(Bucket=bucket, Key=names[1], Body=other + evil.tobytes())
        assert rig.resolve(keys) == [MISS, MISS, HIT]
        assert failed_chunks(rig, "load") == {"forged": 2}
        assert rig.fs.counters["forged_removed"] == 2
        for name in names[:2]:
            with pytest.raises(botocore.exceptions.ClientError):
                s3.head_object(Bucket=bucket, Key=name)
        (row,) = rig.read([keys[2]])
        assert np.array_equal(row, payload(keys[2]))
    with Rig([obj_tier(moto, bucket)], num_slots=4) as plain:  # no key: another namespace
        assert plain.resolve([keys[2]]) == [MISS]


# -- CASES C45: sizes from the endpoint are untrusted --------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [("oversized", 256 << 20), ("lying_length", 1 << 40), ("endless",)],
    ids=["oversized", "lying_length", "endless"],
)
def test_c45_a_hostile_body_is_a_corrupt_miss_and_the_readers_memory_stays_flat(
    moto, bucket, fault
):
    """A body of 256 MiB for a 20 KiB chunk (its true Content-Length), a Content-Length of 1
    TiB over the real body, an endless chunked body: each load is a miss counted as corrupt,
    the reader reads no more than one object (its peak RSS stays within a few MiB) and goes on
    serving loads, with no deadline passed."""
    keys = keys_for(3)
    proxy = FaultProxy(moto)
    try:
        cfg = obj_tier(proxy.endpoint, bucket, job_timeout_s=patience(60.0), breaker_failures=None)
        with Rig([cfg], num_slots=8) as rig:
            rig.store(keys)
            rig.evict_all()
            assert rig.resolve([keys[0]]) == [HIT]  # the reader has served a load already
            (reader,) = rig.fs.worker_pids()["loads"]
            before = peak_rss_bytes(reader)
            rule = proxy.add(Rule("GET", keys[1].hex(), fault))
            assert rig.resolve([keys[1]]) == [MISS]
            assert rule.hits >= 1
            assert failed_chunks(rig, "load") == {"corrupt": 1}
            assert rig.fs.worker_pids()["loads"] == [reader]
            assert rig.fs.counters.get("job_timeouts", 0) == 0
            assert peak_rss_bytes(reader) - before < 8 << 20
            assert rig.resolve([keys[2]]) == [HIT]
            (row,) = rig.read([keys[2]])
            assert np.array_equal(row, payload(keys[2]))
    finally:
        proxy.stop()
