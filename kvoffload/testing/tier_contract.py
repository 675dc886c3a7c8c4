"""The secondary-tier contract suite: one test class every tier runs (memory, fs, obj, out-of-tree).

Modelled on zarr-python's ``StoreTests``: a tier author subclasses :class:`TierContract` in a test
module and provides one fixture, ``tier_under_test``, returning a :class:`TierUnderTest` (how to
configure the tier and what it promises); every test of the class then runs against that tier,
through a real :class:`~kvoffload.ipc.arena.Arena`, a real
:class:`~kvoffload.tiering.TieringManager` and, for tiers on kvoffload's worker pool, real worker
processes::

    from kvoffload.testing.tier_contract import TierContract, TierUnderTest

    class TestMyTier(TierContract):
        @pytest.fixture
        def tier_under_test(self, tmp_path):
            return TierUnderTest(
                config=lambda capacity_chunks=None: {"type": "MyTier", "module_path": "my_tier"},
                medium="STORAGE",
                locality="REMOTE",
            )

What it checks (DESIGN.md §4, "Secondary tiers"):

- round trips: chunks stored through the host arena load back bit-exact, served by the tier;
- missing keys: a key never stored is a MISS, and a load of it fails as ``missing`` while the
  other keys of the same job succeed (never wrong bytes);
- partial failure: a chunk lost from the tier's storage (``lose`` hook), a store or a load that
  fails for one key (fault injection): that key's verdict is a failure, the others succeed;
- worker death: a worker SIGKILLed mid-job: the job still ends with one result, the tier replaces
  the worker and serves again;
- deadlines: a hung worker task fails after the tier's ``job_timeout_s`` and the tier serves again;
- events: stores (and, for bounded tiers, evictions) publish ``BlockStored`` / ``BlockRemoved``
  with the tier's medium, locality and name, and movement events with its locality;
- metrics: the tier's transfers, failures and own counters reach kvoffload's ``/metrics``;
- tenants: requests with different ``cache_salt`` values (and none) store the same engine keys
  with different bytes; no lookup under one salt ever hits a chunk stored under another, each
  reads back its own bytes (from a fresh engine too, for a persistent tier).

Tests that need kvoffload's worker pool (worker death, deadlines, injected faults) are skipped for a
tier whose :attr:`TierUnderTest.runs_workers` is False (the memory tier); the removal-event test
needs :attr:`TierUnderTest.evicts`; the lost-chunk tests need :attr:`TierUnderTest.lose`. A tier
that takes stores only once it is connected (the p2p tier: a session with a peer) names that
moment in :attr:`TierUnderTest.ready`.

Needs pytest (the ``test`` extra). Nothing in :mod:`kvoffload` imports this module.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash
import zmq

from kvoffload import metrics
from kvoffload.config import parse_config
from kvoffload.events import END_SEQ
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import Namespace, chunk_keys
from kvoffload.tenants import tenant_key
from kvoffload.tiering import TieringManager
from kvoffload.tiers.base import JobMetadata, JobResult, LookupResult, SecondaryTierManager

HIT, MISS = LookupResult.HIT, LookupResult.MISS
_UNSETTLED = (LookupResult.RETRY, LookupResult.HIT_PENDING)
ROW_BYTES = 16384


def wait_cap_s() -> float:
    """The cap ``KVOFFLOAD_TEST_WAIT_S`` puts on every bounded wait of a test run (seconds; inf
    when unset): kvoffload's mutation proof sets 30 s, so a patch that makes the awaited thing
    never come fails its test in that time.

    Raises:
        ValueError: the variable is not a number of seconds above 0.
    """
    raw = os.environ.get("KVOFFLOAD_TEST_WAIT_S", "inf")
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not cap > 0:
        raise ValueError(f"KVOFFLOAD_TEST_WAIT_S={raw!r}: must be a number of seconds above 0")
    return cap


#: The most a check waits for what should come (seconds): a bound for a stuck run, never the thing
#: checked, capped by :func:`wait_cap_s`.
WAIT_S = min(120.0, wait_cap_s())
"""Upper bound (seconds) on any wait for a condition: generous for a stuck run, never what is
tested."""
_names = itertools.count()


@dataclass(frozen=True)
class TierUnderTest:
    """How to build the tier under test and what it promises.

    Attributes:
        config: ``config(capacity_chunks=None) -> dict``: a fresh ``secondary_tiers`` entry for
            the tier (its storage new and empty for every test). With ``capacity_chunks`` an int,
            the tier must hold at most that many chunks of ``row_bytes`` bytes and evict beyond
            (only asked when ``evicts`` is True).
        medium: the ``medium`` its KV events carry (``STORAGE``, ``CPU``, ``PEER``).
        locality: the ``locality`` its KV events carry (``LOCAL`` or ``REMOTE``).
        runs_workers: the tier runs kvoffload's worker pool (its config takes the
            :class:`~kvoffload.tiers.process.ProcessTierConfig` keys ``faults``,
            ``job_timeout_s``, ``chunks_per_task``; it has ``worker_pids()``). Enables the
            fault-injection, worker-death and deadline tests.
        evicts: ``config(capacity_chunks=n)`` bounds the tier (enables the removal-event test).
        lose: ``lose(tier, key)`` removes the stored chunk ``key`` from the tier's storage behind
            its back (deletes the file or object, drops the in-memory copy); None skips the
            lost-chunk tests.
        job_timeout_s: ``job_timeout_s`` the deadline test sets (seconds; workers only).
        row_bytes: bytes per chunk (one arena row, a page-size multiple).
        ready: ``ready(tier) -> bool``: the tier takes stores now (e.g. its sessions with its
            peers are up); each test waits for it after building its engine. None: at once.
        counts_events: the tier counts named events (:meth:`~SecondaryTierManager.count`) on a
            healthy run; False for one that counts only trouble (the p2p tier: peers down,
            refused messages), whose healthy-run counts are its own metrics.
        chunk_bytes: the bytes the tier moves to store or load one chunk, as its storage holds
            it (fs and obj: the chunk file's header page plus the row); None: ``row_bytes``.
            ``kvoffload_tier_transfer_bytes_total`` must count exactly that per chunk moved.
        persistent: a second engine built from ``config()`` (the same storage) finds what the
            first stored (fs, obj; p2p: the same peer): the tenant test then checks a fresh
            engine too, which knows nothing of the chunks and must ask the storage.
        in_live_engines: the tier's storage is other live engines' host tiers (p2p: its
            peers'), which ``kvoffload purge`` cannot reach; a persistent tier without it must
            be purged by its class's ``purge_storage``.
    """

    config: Callable[..., dict[str, Any]]
    medium: str
    locality: str
    runs_workers: bool = False
    evicts: bool = False
    lose: Callable[[SecondaryTierManager, bytes], None] | None = None
    job_timeout_s: float = 10.0
    row_bytes: int = ROW_BYTES
    ready: Callable[[SecondaryTierManager], bool] | None = None
    counts_events: bool = True
    chunk_bytes: int | None = None
    persistent: bool = False
    in_live_engines: bool = False


# -- the engine the suite drives -------------------------------------------------------------------


def wait_until(
    condition: Callable[[], Any],
    what: str,
    step: Callable[[], Any] | None = None,
    timeout_s: float = WAIT_S,
) -> Any:
    """Call ``step`` (if given) and ``condition`` until the latter returns a true value (returned).
    ``timeout_s`` bounds a stuck run only.

    Raises:
        AssertionError: the condition never came within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if step is not None:
            step()
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.005)


def payload(key: bytes, nbytes: int = ROW_BYTES) -> np.ndarray:
    """Deterministic pseudo-random bytes of a chunk, ``(nbytes,)`` uint8, derived from its key."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(key))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def keys_for(n: int, seed: int = 0, tokens_per_chunk: int = 16) -> list[bytes]:
    """``n`` chained chunk keys (``tokens_per_chunk`` tokens each) of a prompt chosen by ``seed``."""
    return chunk_keys(
        np.arange(seed * 1_000_000, seed * 1_000_000 + n * tokens_per_chunk), tokens_per_chunk
    )


class ContractEngine:
    """One engine with a single secondary tier: a real arena and tiering manager.

    Args:
        tier: the tier's ``secondary_tiers`` entry.
        num_slots: host-tier slots (arena rows).
        row_bytes: bytes per slot.
        extra: further ``kv_connector_extra_config`` keys (e.g. ``kv_events``).
    """

    def __init__(
        self,
        tier: dict[str, Any],
        *,
        num_slots: int = 8,
        row_bytes: int = ROW_BYTES,
        poll_interval_s: float = 0.0005,
        **extra,
    ):
        self.row_bytes = row_bytes
        config = parse_config(
            {"cpu_bytes_to_use": num_slots * row_bytes, "secondary_tiers": [tier], **extra}
        )
        self.arena = Arena.create(
            f"kvoffload_contract_{os.getpid()}_{next(_names)}", num_slots, row_bytes
        )
        ns = Namespace(
            model="kvoffload/tier-contract",
            kv_dtype="bfloat16",
            layout="raw-v1",
            tokens_per_chunk=16,
            row_bytes=row_bytes,
        )
        try:
            self.tm = TieringManager(self.arena, ns, config, poll_interval_s=poll_interval_s)
        except BaseException:
            self.arena.close()
            raise
        self.tier = self.tm.tiers[0]
        self.name = self.tier.name

    def __enter__(self) -> ContractEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.tm.shutdown()
        self.arena.close()

    def store(
        self,
        keys: Sequence[bytes],
        wait: bool = True,
        req_id: str = "",
        row: Callable[[bytes], np.ndarray] | None = None,
    ) -> None:
        """Accelerator → host store of ``keys`` (their :func:`payload`, or ``row(key)``) by
        ``req_id``, then write-through to the tier; with ``wait``, until the tier's store job
        has ended."""
        plan = self.tm.prepare_store(list(keys), req_id)
        assert plan is not None and list(plan.keys) == list(keys), "host tier refused the store"
        for k, s in zip(plan.keys, plan.slots):
            self.arena.rows[s] = payload(k, self.row_bytes) if row is None else row(k)
        self.tm.complete_store(plan.keys, True, req_id)
        if wait:
            assert self.tm.wait_idle(WAIT_S), "the tier's store job did not end"

    def drop_from_host(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` from the host tier, so only the secondary tier holds them."""
        assert self.tm.host.remove(keys) == list(keys), "keys still pinned in the host tier"

    def resolve(self, keys: Sequence[bytes], req_id: str = "req") -> list[LookupResult]:
        """Look ``keys`` up every engine step until none is RETRY or HIT_PENDING."""

        def settled():
            res = [self.tm.lookup(k, req_id) for k in keys]
            return None if any(r in _UNSETTLED for r in res) else res

        return wait_until(settled, f"lookups of {len(keys)} key(s) to settle", step=self.tm.step)

    def read(self, keys: Sequence[bytes], req_id: str = "req") -> list[np.ndarray]:
        """Copies of the host rows of HIT ``keys`` (pinned for the copy, then released)."""
        slots = self.tm.prepare_load(list(keys), req_id)
        out = [self.arena.rows[s].copy() for s in slots]
        self.tm.complete_load(keys, req_id)
        return out

    def assert_serves(self, keys: Sequence[bytes]) -> None:
        """``keys`` are served by the tier (not the host) with exactly their bytes."""
        self.drop_from_host([k for k in keys if self.tm.host.lookup(k) is HIT])
        assert self.resolve(keys) == [HIT] * len(keys)
        for k, row in zip(keys, self.read(keys)):
            assert np.array_equal(row, payload(k, self.row_bytes)), "wrong bytes served"
            assert self.tm.source_of(k, "req") == self.name

    def drop_tenant_from_host(self, keys: Sequence[bytes], req_id: str) -> None:
        """Remove ``req_id``'s chunks of ``keys`` (its tenant keys, :func:`~kvoffload.tenants
        .tenant_key`, when it has a ``cache_salt``) from the host tier."""
        tenant = self.tm.tenant_of_request(req_id)
        held = [tenant_key(k, tenant) if tenant else k for k in keys]
        self.drop_from_host([k for k in held if self.tm.host.lookup(k) is not MISS])

    def worker_pids(self, kind: str) -> list[int]:
        """PIDs of the tier's ``"loads"`` or ``"stores"`` worker processes."""
        return list(self.tier.worker_pids()[kind])  # type: ignore[attr-defined]


def replay(endpoint: str, topic: bytes) -> list[Any]:
    """The buffered batches of ``topic`` from a KV-event replay endpoint (vLLM's protocol),
    each decoded as plain msgpack."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big"), topic])
        out: list[Any] = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), f"no replay from {endpoint}"
            _, _, seq, body = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append(msgspec.msgpack.decode(body))
    finally:
        dealer.close()
        ctx.term()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(sample name, sorted labels) -> value`` of a Prometheus text endpoint."""
    return samples(urllib.request.urlopen(url, timeout=30).read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(sample name, sorted labels) -> value`` of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# -- the suite ----------------------------------------------------------------------------------


class _Tenants:
    """Tenants ``a`` and ``b`` (each a fresh ``cache_salt``) and ``""`` (unsalted requests), each
    storing the same engine keys with its own bytes (``row_bytes`` bytes a chunk)."""

    def __init__(self, row_bytes: int):
        self.salts = {
            "a": "tenant-a-" + os.urandom(8).hex(),
            "b": "tenant-b-" + os.urandom(8).hex(),
        }
        self.row_bytes = row_bytes
        self._turn = itertools.count()

    def request(self, e: ContractEngine, who: str) -> str:
        """A new request of ``who`` on engine ``e`` (its salt set); returns its id."""
        req = f"{who or 'unsalted'}-{next(self._turn)}"
        e.tm.set_cache_salt(req, self.salts.get(who))
        return req

    def row_of(self, who: str) -> Callable[[bytes], np.ndarray]:
        """``who``'s bytes of a chunk, by key: ``(row_bytes,)`` uint8."""
        return lambda k: payload(xxhash.xxh3_128_digest(k + who.encode()), self.row_bytes)


class TierContract:
    """The contract every secondary tier keeps. Subclass it as ``Test...`` and provide the
    fixture ``tier_under_test`` (a :class:`TierUnderTest`), e.g. parametrized over several
    tiers."""

    # helpers --------------------------------------------------------------------------------

    @staticmethod
    def needs_workers(tut: TierUnderTest) -> None:
        if not tut.runs_workers:
            pytest.skip("the tier runs no kvoffload worker processes")

    @staticmethod
    def engine(
        tut: TierUnderTest, config: dict[str, Any] | None = None, **extra: Any
    ) -> ContractEngine:
        """An engine over the tier (``config``, default ``tut.config()``), once it is ready
        (:attr:`TierUnderTest.ready`)."""
        e = ContractEngine(
            tut.config() if config is None else config, row_bytes=tut.row_bytes, **extra
        )
        if tut.ready is not None:
            ready = tut.ready
            try:
                wait_until(lambda: ready(e.tier), "the tier to be ready", step=e.tm.step)
            except BaseException:
                e.__exit__()
                raise
        return e

    @staticmethod
    def with_workers(tut: TierUnderTest, **keys: Any) -> dict[str, Any]:
        """The tier's config with worker-pool keys (``faults``, ``job_timeout_s``, ...) set."""
        cfg = dict(tut.config())
        cfg.update(keys)
        return cfg

    # round trips ------------------------------------------------------------------------------

    def test_round_trip_through_the_host_arena_is_bit_exact(self, tier_under_test):
        tut = tier_under_test
        with self.engine(tut) as e:
            keys = keys_for(6)
            e.store(keys[:3])
            e.store(keys[3:])
            assert e.tm.stats.cascaded[e.name] == 6
            assert e.tm.stats.cascade_failures[e.name] == 0
            assert e.tm.host.num_pinned == 0  # the store jobs released their host slots
            e.assert_serves(keys)
            assert e.tm.stats.promotions[e.name] == 6
            assert e.tm.stats.promotion_failures[e.name] == 0

    # tenants ----------------------------------------------------------------------------------

    def test_no_lookup_under_one_salt_hits_a_chunk_stored_under_another(self, tier_under_test):
        """Requests with ``cache_salt`` A, B and none store the same engine keys, each with
        its own bytes. Before the others store, B's and the unsalted lookups of A's keys miss
        (host tier, then the tier alone); afterwards each reads back exactly its own bytes,
        served by the tier, and so does a fresh engine over the same storage."""
        tut = tier_under_test
        keys = keys_for(2, seed=27)
        tenants = _Tenants(tut.row_bytes)
        salts, request, row_of = tenants.salts, tenants.request, tenants.row_of

        def reads_own(e: ContractEngine, who: str) -> None:
            req = request(e, who)
            assert e.resolve(keys, req) == [HIT] * len(keys), f"{who or 'unsalted'} lost its chunks"
            for k, row in zip(keys, e.read(keys, req)):
                assert np.array_equal(row, row_of(who)(k)), f"{who or 'unsalted'}: wrong bytes"
                assert e.tm.source_of(k, req) == e.name

        with self.engine(tut) as e:
            writer = request(e, "a")
            e.store(keys, req_id=writer, row=row_of("a"))
            for who in ("b", ""):  # A's chunks in the host tier and the tier
                assert e.resolve(keys, request(e, who)) == [MISS] * len(keys)
            e.drop_tenant_from_host(keys, writer)
            for who in ("b", ""):  # A's chunks in the tier alone
                assert e.resolve(keys, request(e, who)) == [MISS] * len(keys)
            assert e.tm.stats.promotions[e.name] == 0
            for who in ("b", ""):
                req = request(e, who)
                e.store(keys, req_id=req, row=row_of(who))
                e.drop_tenant_from_host(keys, req)
            for who in ("a", "b", ""):
                reads_own(e, who)
        if not tut.persistent:
            return
        salts["c"] = "tenant-c-" + os.urandom(8).hex()  # stored nothing
        with self.engine(tut) as fresh:  # nothing known: every verdict comes from the storage
            assert fresh.resolve(keys, request(fresh, "c")) == [MISS] * len(keys)
            for who in ("b", "a", ""):
                reads_own(fresh, who)

    def test_a_purge_leaves_nothing_of_the_tenant(self, tier_under_test):
        """``kvoffload purge --salt A`` (:func:`kvoffload.tools.purge.purge`) over a config
        holding the tier, while an engine uses it. A tier whose storage outlives its engines
        (its class's :meth:`~kvoffload.tiers.base.SecondaryTierManager.purge_storage` answers)
        removes A's chunks and nothing else: the running engine and a fresh one miss A's
        chunks, read B's and the unsalted ones with their own bytes, and the report counts
        A's chunks. For a tier that keeps nothing beyond its engine the command says there is
        nothing persistent to purge; then nothing of A's outlives the engine (a fresh engine finds none), unless the tier's
        storage is another live engine's (the p2p tier: its peers' host tiers, erased when
        those engines end)."""
        from kvoffload.tools.purge import PurgeError, purge

        tut = tier_under_test
        cfg = tut.config()
        keys = keys_for(2, seed=28)
        tenants = _Tenants(tut.row_bytes)
        salts, request, row_of = tenants.salts, tenants.request, tenants.row_of

        def after_purge(e: ContractEngine) -> None:
            assert e.resolve(keys, request(e, "a")) == [MISS] * len(keys), "A's chunks served"
            for who in ("b", ""):
                req = request(e, who)
                assert e.resolve(keys, req) == [HIT] * len(keys), f"{who or 'unsalted'} lost"
                for k, row in zip(keys, e.read(keys, req)):
                    assert np.array_equal(row, row_of(who)(k)), f"{who or 'unsalted'}: bytes"
                e.drop_tenant_from_host(keys, req)

        with self.engine(tut, cfg) as e:
            for who in ("a", "b", ""):
                req = request(e, who)
                e.store(keys, req_id=req, row=row_of(who))
                e.drop_tenant_from_host(keys, req)
            try:
                report = purge(
                    {"cpu_bytes_to_use": 8 * tut.row_bytes, "secondary_tiers": [cfg]},
                    salt=salts["a"],
                )
            except PurgeError as err:  # the tier keeps nothing beyond its engine: told so
                assert "no persistent tier" in str(err), err
                assert not tut.persistent or tut.in_live_engines, (
                    "the tier's storage outlives its engines, and kvoffload purge skips it: "
                    "define purge_storage on its class"
                )
                report = None
            if report is not None:
                (done,) = report.tiers
                assert done.errors == [] and done.chunks == len(keys), done
                after_purge(e)
        if report is not None:
            with self.engine(tut, cfg) as fresh:  # nothing known: the storage answers
                after_purge(fresh)
        elif not tut.persistent:
            with self.engine(tut, cfg) as fresh:
                assert fresh.resolve(keys, request(fresh, "a")) == [MISS] * len(keys)

    def test_a_tenant_past_its_quota_loses_only_its_own_oldest_chunks(self, tier_under_test):
        """A capped worker-backed tier (its capacity ledger counts each tenant's bytes) with
        ``tenant_quota_bytes`` of two chunks: tenant A stores four chunks one request at a time,
        B two; A's two oldest are evicted from the tier, its newest two and all of B's are
        served by it (DESIGN.md "Tenants", quotas)."""
        tut = tier_under_test
        if not (tut.evicts and tut.runs_workers):
            pytest.skip("per-tenant quotas need a worker-backed tier's capacity ledger")
        chunk = tut.chunk_bytes or tut.row_bytes
        cfg = {**tut.config(capacity_chunks=16), "tenant_quota_bytes": 2 * chunk}
        a_keys, b_keys = keys_for(4, seed=31), keys_for(2, seed=32)
        salts = {"a": "tenant-a-" + os.urandom(8).hex(), "b": "tenant-b-" + os.urandom(8).hex()}
        with self.engine(tut, cfg) as e:
            tm = e.tm
            tm.set_cache_salt("b", salts["b"])
            e.store(b_keys, req_id="b")
            tm.on_request_finished("b")
            for i, k in enumerate(a_keys):  # each its own request: the oldest ranks lowest
                tm.set_cache_salt(f"a{i}", salts["a"])
                e.store([k], req_id=f"a{i}")
                tm.on_request_finished(f"a{i}")
            assert e.tier.counters.get("tenant_quota_evictions") == 2
            for who, keys, want in (
                ("a", a_keys, [MISS, MISS, HIT, HIT]),
                ("b", b_keys, [HIT, HIT]),
            ):
                req = f"read-{who}"
                tm.set_cache_salt(req, salts[who])
                e.drop_tenant_from_host(keys, req)
                assert e.resolve(keys, req) == want, who

    # missing keys -----------------------------------------------------------------------------

    def test_a_key_never_stored_is_a_miss(self, tier_under_test):
        tut = tier_under_test
        with self.engine(tut) as e:
            stored, never = keys_for(1)[0], keys_for(1, seed=9)[0]
            e.store([stored])
            assert e.resolve([never]) == [MISS]
            assert e.tm.host.lookup(never) is MISS
            assert e.tm.stats.promotions[e.name] == 0

    def test_a_load_of_a_missing_key_fails_as_missing_and_the_rest_of_the_job_succeeds(
        self, tier_under_test
    ):
        """Driven on the tier itself: one load job of a stored key and a key never stored
        yields one result, the stored key loaded bit-exact, the other failed as ``missing``."""
        tut = tier_under_test
        with self.engine(tut) as e:
            stored, never = keys_for(1)[0], keys_for(1, seed=9)[0]
            e.store([stored])
            e.drop_from_host([stored])
            rows = e.arena.rows
            rows[0] = 0x5A
            rows[1] = 0x5A
            tier = e.tier
            job = JobMetadata(job_id=1 << 40, keys=[stored, never], slots=[0, 1], is_promotion=True)
            tier.submit_load(job)
            tier.flush()
            results: list[JobResult] = []

            def finished():
                results.extend(tier.get_finished_jobs())
                return results

            wait_until(finished, "the load job's result", step=lambda: tier.wait(0.01))
            assert [r.job_id for r in results] == [job.job_id]
            (res,) = results
            assert res.success is False
            assert res.successful_keys == [stored]
            assert res.failed == {never: "missing"}
            assert np.array_equal(rows[0], payload(stored, e.row_bytes))
            assert not tier.has_pending_work()

    # partial failure --------------------------------------------------------------------------

    def test_a_chunk_lost_from_storage_fails_only_its_own_load(self, tier_under_test):
        tut = tier_under_test
        if tut.lose is None:
            pytest.skip("no lose hook for this tier")
        # Lookups poll only at engine steps here (a lookup's poll submits no promotion, but it
        # may apply a finished one: the chunk must be lost before anything is loaded).
        with self.engine(tut, poll_interval_s=3600.0) as e:
            keys = keys_for(4)
            lost = keys[1]
            e.store(keys)
            e.drop_from_host(keys)
            # the tier answers from what it knows (the stores made the keys present): one
            # promotion job for all four is queued, then a chunk goes missing underneath
            first = [e.tm.lookup(k, "req") for k in keys]
            assert all(r in _UNSETTLED for r in first), first
            tut.lose(e.tier, lost)
            got = e.resolve(keys)
            assert got == [HIT, MISS, HIT, HIT], got
            ok = [k for k in keys if k != lost]
            for k, row in zip(ok, e.read(ok)):
                assert np.array_equal(row, payload(k, e.row_bytes))
            assert e.tm.stats.promotion_failures[e.name] == 1
            assert e.tm.stats.failed[(e.name, "load", "missing")] == 1
            assert e.resolve([lost]) == [MISS]  # and it stays a miss
            assert e.tm.host.num_pinned == 0 and e.tm.host.num_writing == 0

    @pytest.mark.parametrize("direction", ["store", "load"])
    def test_a_key_whose_io_fails_fails_alone_and_the_others_succeed(
        self, tier_under_test, direction
    ):
        """An injected EIO for one key of a four-key job (one chunk per task): that key fails
        with ``io_error``, the other three succeed; a failed store is never served."""
        tut = tier_under_test
        self.needs_workers(tut)
        keys = keys_for(4)
        bad = keys[2]
        fault = {"point": direction, "action": "raise", "arg": 5, "key_hex": bad.hex(), "count": 1}
        cfg = self.with_workers(tut, faults=[fault], chunks_per_task=1)
        with self.engine(tut, cfg) as e:
            stats = e.tm.stats
            e.store(keys)
            e.drop_from_host(keys)
            if direction == "store":
                assert (stats.cascaded[e.name], stats.cascade_failures[e.name]) == (3, 1)
            else:
                assert (stats.cascaded[e.name], stats.cascade_failures[e.name]) == (4, 0)
            assert e.resolve(keys) == [HIT, HIT, MISS, HIT]
            ok = [k for k in keys if k != bad]
            for k, row in zip(ok, e.read(ok)):
                assert np.array_equal(row, payload(k, e.row_bytes))
            assert dict(stats.failed) == {(e.name, direction, "io_error"): 1}
            if direction == "load":
                assert stats.promotion_failures[e.name] == 1
            assert e.tm.host.num_pinned == 0

    # worker death -----------------------------------------------------------------------------

    @pytest.mark.parametrize("direction", ["store", "load"])
    def test_a_worker_killed_mid_job_is_replaced_and_the_job_ends(
        self, tier_under_test, direction, tmp_path
    ):
        """A worker SIGKILLed while it holds a job: the job still ends with one result (its
        tasks re-run once on a replacement), every key is served bit-exact afterwards, and the
        tier takes and serves new chunks."""
        tut = tier_under_test
        self.needs_workers(tut)
        gate = tmp_path / "gate"
        fault = {"point": direction, "action": "wait_file", "arg": str(gate), "count": 1}
        kind = "stores" if direction == "store" else "loads"
        with self.engine(tut, self.with_workers(tut, faults=[fault])) as e:
            keys = keys_for(2)
            if direction == "store":
                e.store(keys, wait=False)
            else:
                e.store(keys)
                e.drop_from_host(keys)
                assert all(e.tm.lookup(k, "req") in _UNSETTLED for k in keys)
                e.tm.step()
            victim = _paused_pids(gate, e.tm.poll)[0]
            assert victim in e.worker_pids(kind)
            os.kill(victim, signal.SIGKILL)
            wait_until(
                lambda: victim not in e.worker_pids(kind), "the death noticed", step=e.tm.poll
            )
            gate.touch()  # the re-run (a fresh process: its fault fires again) goes through
            assert e.tm.wait_idle(WAIT_S), "the job of the killed worker never ended"
            stats = e.tm.stats
            assert stats.cascaded[e.name] == 2 and stats.cascade_failures[e.name] == 0
            assert e.tm.host.num_pinned == 0
            e.assert_serves(keys)
            assert stats.promotion_failures[e.name] == 0
            fresh = keys_for(2, seed=3)
            e.store(fresh)
            e.assert_serves(fresh)
            assert victim not in e.worker_pids("loads") + e.worker_pids("stores")

    # deadlines ---------------------------------------------------------------------------------

    def test_a_hung_task_fails_after_the_job_timeout_and_the_tier_serves_again(
        self, tier_under_test
    ):
        tut = tier_under_test
        self.needs_workers(tut)
        hung, other = keys_for(2)
        fault = {"point": "load", "action": "sleep", "arg": 3600, "key_hex": hung.hex()}
        cfg = self.with_workers(
            tut, faults=[fault], job_timeout_s=tut.job_timeout_s, chunks_per_task=1
        )
        with self.engine(tut, cfg) as e:
            e.store([hung, other])
            e.drop_from_host([hung, other])
            readers = set(e.worker_pids("loads"))
            t0 = time.monotonic()
            assert e.resolve([hung]) == [MISS]  # failed by the deadline, never answered
            assert time.monotonic() - t0 >= tut.job_timeout_s  # and not before it
            assert dict(e.tm.stats.failed) == {(e.name, "load", "timeout"): 1}
            assert e.tm.host.num_writing == 0  # the reserved slot was released
            wait_until(
                lambda: readers - set(e.worker_pids("loads")), "the hung reader killed", e.tm.poll
            )
            e.assert_serves([other])
            assert e.resolve([hung]) == [MISS]

    # events ---------------------------------------------------------------------------------

    def test_stores_publish_the_tiers_events_with_its_locality(self, tier_under_test):
        tut = tier_under_test
        keys = keys_for(3)
        with _event_endpoints() as kv_events:
            with self.engine(tut, kv_events=kv_events) as e:
                e.store(keys[:2])
                e.store(keys[2:])
                e.tm.step()
                cfg = e.tm.config.kv_events

                def stored():
                    events = _engine_events(cfg)
                    done = all(_tier_event(events, "BlockStored", k, e.name) for k in keys)
                    return events if done else None

                events = wait_until(stored, "BlockStored of every key", step=e.tm.step)
                for k in keys:
                    (ev,) = _tier_event(events, "BlockStored", k, e.name)
                    assert ev.get("medium") == tut.medium
                    assert ev.get("locality") == tut.locality

                def moved():
                    moves = _movements(cfg)
                    return moves if all(_moves(moves, k, "host", e.name) for k in keys) else None

                moves = wait_until(moved, "host -> tier movements", step=e.tm.step)
                for k in keys:
                    (mv,) = _moves(moves, k, "host", e.name)
                    assert mv["locality"] == tut.locality.lower()
                    assert mv["nbytes"] == e.row_bytes

    def test_evictions_publish_removals_with_the_tiers_locality(self, tier_under_test):
        tut = tier_under_test
        if not tut.evicts:
            pytest.skip("the tier has no capacity bound to evict by")
        keys = keys_for(4)
        with _event_endpoints() as kv_events:
            with self.engine(tut, tut.config(capacity_chunks=2), kv_events=kv_events) as e:
                for k in keys:  # one at a time: the oldest two are evicted from the tier
                    e.store([k])
                    e.tm.step()
                cfg = e.tm.config.kv_events

                def removed():
                    events = _engine_events(cfg)
                    done = all(_tier_event(events, "BlockRemoved", k, e.name) for k in keys[:2])
                    return events if done else None

                events = wait_until(removed, "BlockRemoved of the evicted keys", step=e.tm.step)
                for k in keys[:2]:
                    (ev,) = _tier_event(events, "BlockRemoved", k, e.name)
                    assert ev.get("medium") == tut.medium
                    assert ev.get("locality") == tut.locality
                for k in keys[2:]:
                    assert not _tier_event(events, "BlockRemoved", k, e.name)
                e.drop_from_host([k for k in keys if e.tm.host.lookup(k) is HIT])
                assert e.resolve(keys) == [MISS, MISS, HIT, HIT]

    # metrics ---------------------------------------------------------------------------------

    def test_the_tiers_counters_reach_the_metrics_endpoint(self, tier_under_test):
        tut = tier_under_test
        port = metrics.serve(0)
        # A tier that can be bounded runs bounded here, so that gauges it sets only with a cap
        # (used and capacity bytes) are checked too.
        config = tut.config(capacity_chunks=1024) if tut.evicts else tut.config()
        try:
            with self.engine(tut, config) as e:
                keys = keys_for(4)
                e.store(keys)
                if tut.lose is not None:
                    e.drop_from_host(keys)
                    assert all(e.tm.lookup(k, "req") in _UNSETTLED for k in keys)
                    tut.lose(e.tier, keys[3])
                    assert e.resolve(keys) == [HIT, HIT, HIT, MISS]
                    served = 3
                else:
                    e.assert_serves(keys)
                    served = 4
                assert e.tm.wait_idle(WAIT_S)
                got = scrape(f"http://127.0.0.1:{port}/metrics")
                counters = dict(e.tier.counters)  # as the scrape read them: nothing ran since
                inst, name = e.tm.instance, e.name

                def value(sample: str, **labels: str) -> float | None:
                    return got.get((sample, tuple(sorted({"instance": inst, **labels}.items()))))

                chunks = "kvoffload_tier_transfer_chunks_total"
                assert value(chunks, tier=name, direction="store") == 4
                assert value(chunks, tier=name, direction="load") == served
                # what the tier moved, as its storage holds a chunk (CASES C50)
                per_chunk = tut.chunk_bytes or e.row_bytes
                moved = "kvoffload_tier_transfer_bytes_total"
                assert value(moved, tier=name, direction="load") == served * per_chunk
                assert value(moved, tier=name, direction="store") == 4 * per_chunk
                assert (value("kvoffload_tier_hits_total", tier=name) or 0) >= served
                if tut.lose is not None:
                    failed = "kvoffload_tier_failed_chunks_total"
                    assert value(failed, tier=name, direction="load", reason="missing") == 1
                    assert (
                        value("kvoffload_tier_failed_jobs_total", tier=name, direction="load") == 1
                    )
                if tut.counts_events:
                    assert counters, "the tier counted nothing"
                for event, n in counters.items():
                    if "." in event:  # a labelled family (e.g. eviction_errors.EACCES)
                        continue
                    assert value("kvoffload_tier_events_total", tier=name, event=event) == n, event
                families = {s for s, _ in got}
                for d in type(e.tier).metric_definitions:
                    assert any(f.startswith(d.name) for f in families), d.name
        finally:
            metrics.stop_serving()


# -- event helpers -------------------------------------------------------------------------------


class _event_endpoints:
    """KV-event endpoints on fresh IPC paths (no port to pick), removed afterwards."""

    def __enter__(self) -> dict[str, str]:
        self.dir = tempfile.mkdtemp(prefix="kvo-ev-")
        return {"endpoint": f"ipc://{self.dir}/pub", "replay_endpoint": f"ipc://{self.dir}/replay"}

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _engine_events(cfg: Any) -> list[dict[str, Any]]:
    return [ev for batch in replay(cfg.replay_endpoint, cfg.topic.encode()) for ev in batch[1]]


def _movements(cfg: Any) -> list[dict[str, Any]]:
    batches = replay(cfg.replay_endpoint, cfg.movements_topic.encode())
    return [
        dict(zip(("key", "src", "dst", "locality", "nbytes"), mv) if isinstance(mv, list) else mv)
        for b in batches
        for mv in b["events"]
    ]


def _tier_event(events: list[dict], kind: str, key: bytes, tier: str) -> list[dict]:
    return [
        ev
        for ev in events
        if ev.get("type") == kind and ev.get("ownership") == tier and key in ev["block_hashes"]
    ]


def _moves(moves: list[dict], key: bytes, src: str, dst: str) -> list[dict]:
    return [mv for mv in moves if mv["key"] == key and mv["src"] == src and mv["dst"] == dst]


def _paused_pids(gate: Path, step: Callable[[], Any]) -> list[int]:
    """PIDs of the workers paused at a ``wait_file`` fault gated on ``gate``."""
    marker = Path(f"{gate}.reached")

    def paused():
        try:
            return [int(x) for x in marker.read_text().split()]
        except FileNotFoundError:
            return None

    return wait_until(paused, f"a worker paused at {gate}", step=step)
