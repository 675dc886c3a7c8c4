"""vLLM's side of the driver: vLLM 0.33's own p2p tier (``P2PSecondaryTierManager``) driven directly
in the ``pd`` flow (:class:`Side` per instance, :class:`Pair`: producer A spawned, consumer B here),
and through vLLM's own ``TieringOffloadingManager`` in the ``symmetric`` flow (:class:`SymPair`).
vLLM is imported by :func:`load_vllm_p2p` only, never at module import.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import types
from typing import Any

import numpy as np

from kvoffload.tools.bench.harness import Payloads, ends_process
from kvoffload.tools.bench.vllm_p2p.driver import (
    DONE_TIMEOUT_S,
    HOST,
    POLL_S,
    TOKENS,
    WAIT_S,
    LoadingPair,
    ProducerPair,
    answer,
    chunk_digest,
    on_free_port,
)
from kvoffload.tools.extras import MissingExtra
from kvoffload.workers import p2p_transport as pt


def load_vllm_p2p() -> dict[str, Any]:
    """vLLM's p2p tier and the types a driver needs, imported here (never at module import).

    Returns a dict of ``P2PSecondaryTierManager``, ``ReqContext``, ``TransferJob``,
    ``ScheduleEndContext``, ``LookupResult``, ``make_offload_key`` and ``version``.

    Raises:
        MissingExtra: vLLM cannot be imported, has no p2p tier (before 0.33), or NIXL is missing
            (vLLM's tier would start without a data plane and fail every transfer).
    """
    try:
        import vllm
    except ImportError as e:
        raise MissingExtra(
            f"vLLM's p2p tier needs vLLM 0.33 ({e}): pip install vllm==0.33.0 into a separate "
            "environment (tox -e vllm033 builds one) and run this module there"
        ) from e
    try:
        from vllm.v1.kv_offload.base import (
            LookupResult,
            ReqContext,
            ScheduleEndContext,
            make_offload_key,
        )
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager
    except ImportError as e:
        raise MissingExtra(
            f"vLLM {vllm.__version__} has no p2p tier ({e}): this driver targets vLLM 0.33's "
            "(pip install vllm==0.33.0 into a separate environment)"
        ) from e
    from vllm.distributed.nixl_utils import is_nixl_available
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    # As vLLM's engine core does at start (for its default algorithm): vLLM's p2p handshake
    # compares the seed of each side's hash chain, PYTHONHASHSEED where set, and a process that
    # never seeded its chain reports the default seed whatever PYTHONHASHSEED says.
    init_none_hash(sha256)
    if not is_nixl_available():
        raise MissingExtra(
            "vLLM's p2p tier moves bytes with NIXL, which cannot be imported here: "
            "pip install 'nixl>=1.5.1,<2' (kvoffload's p2p extra)"
        )
    return {
        "P2PSecondaryTierManager": P2PSecondaryTierManager,
        "ReqContext": ReqContext,
        "TransferJob": TransferJob,
        "ScheduleEndContext": ScheduleEndContext,
        "LookupResult": LookupResult,
        "make_offload_key": make_offload_key,
        "version": vllm.__version__,
    }


def offloading_spec(row_bytes: int) -> types.SimpleNamespace:
    """The attributes of vLLM's ``OffloadingSpec`` that its p2p tier reads (one KV group of 16-token
    blocks, one chunk per block, no parallelism, replica 0); both peers must build the same (its
    handshake compares a fingerprint of them)."""
    SN = types.SimpleNamespace
    return SN(
        config=SN(
            groups=[SN(tokens_per_block=TOKENS, layer_names=["bench"])],
            parallel=SN(
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                rank=0,
                is_parallelism_agnostic=True,
                data_parallel_index=0,
            ),
            canonical_layout=False,
            kv_cache_layout=None,
            replicated_layout=False,
            model=SN(name=f"bench-p2p-{row_bytes}", dtype="bfloat16"),
            cache=SN(tokens_per_hash=TOKENS),
        ),
        blocks_per_chunk=1,
    )


def chunk_key(v: dict[str, Any], row_bytes: int, i: int | str) -> bytes:
    """vLLM's offload key of chunk ``i`` (a sha256 block hash, KV group 0)."""
    return v["make_offload_key"](chunk_digest(row_bytes, i), 0)


class Side:
    """One instance: vLLM's p2p tier on its own primary arena (``rows`` x ``row_bytes`` uint8 over an
    anonymous mmap), a lock held by every call into the tier, and the tier-poll thread vLLM's
    ``TieringOffloadingManager`` runs for it (``poll_s`` between rounds; 0: none)."""

    def __init__(self, v: dict[str, Any], row_bytes: int, rows: int, poll_s: float = POLL_S):
        self.v, self.row_bytes, self.rows = v, row_bytes, rows
        self._mm = mmap.mmap(-1, rows * row_bytes)
        self.arena = np.frombuffer(self._mm, dtype=np.uint8).reshape(rows, row_bytes)
        self.view = self.arena.data  # (rows, row_bytes) memoryview
        self.lock = threading.Lock()
        self.tier: Any = None
        pt.note_nixl_agent()  # vLLM's p2p tier makes one in this process (see ends_process)
        try:
            self.tier, self.port = on_free_port(
                lambda port: v["P2PSecondaryTierManager"](
                    offloading_spec(row_bytes), self.view, "p2p", host=HOST, port=port
                )
            )
        except BaseException:
            self._release_arena()
            raise
        self._results: list = []  # JobResults the poll thread collected
        self._next_job = 0
        self._step_ctx = v["ScheduleEndContext"](new_req_ids=(), preempted_req_ids=())
        self._stop = threading.Event()
        self._thread = None
        if poll_s > 0:
            self._thread = threading.Thread(
                target=self._poll_loop, args=(poll_s,), name="vllm_offload_tier_poll", daemon=True
            )
            self._thread.start()

    def _poll_loop(self, poll_s: float) -> None:
        """vLLM's ``_tier_poll_loop``: a round under the lock, then a pause after releasing it."""
        while not self._stop.is_set():
            if not self.lock.acquire(timeout=1.0):
                continue
            try:
                self._results.extend(self.tier.get_finished_jobs())
            finally:
                self.lock.release()
            self._stop.wait(poll_s)

    def job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def step(self) -> list:
        """What a scheduler step does with this tier: its finished jobs (the poll thread's since the
        last step and this call's), then ``on_schedule_end``. Returns vLLM ``JobResult`` s."""
        with self.lock:
            out = self._results
            self._results = []
            out.extend(self.tier.get_finished_jobs())
            self.tier.on_schedule_end(self._step_ctx)
        return out

    def _release_arena(self) -> None:
        self.view.release()
        del self.arena
        try:
            self._mm.close()
        except BufferError:  # something still holds a view of it: unmapped when that is freed
            pass

    def close(self) -> None:
        """Stop the poll thread, shut the tier down (its NIXL agent deregisters the arena), free
        the arena."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.tier is not None:
            with self.lock:
                self.tier.shutdown()
            self.tier = None
            self._release_arena()


# -- the pd flow: producer A (spawned) and consumer B (this process) -------------------------------


@ends_process
def _producer(conn: Any, row_bytes: int, rows: int, poll_s: float) -> None:
    """Producer process: A's tier on an arena whose row ``i`` holds chunk ``i``'s payload. Parks
    stores on request, steps its tier between messages, reports its counts and CPU time."""
    v = load_vllm_p2p()
    side = Side(v, row_bytes, rows, poll_s)
    try:
        Payloads(rows, row_bytes).fill(side.arena, range(rows))
        keys = [chunk_key(v, row_bytes, i) for i in range(rows)]
        pending: dict[int, Any] = {}  # store job id -> its request
        done = {"ok": 0, "failed": 0}

        def finish_stores() -> None:
            for r in side.step():
                ctx = pending.pop(r.job_id)
                done["ok" if r.success else "failed"] += 1
                with side.lock:
                    side.tier.on_request_finished(ctx)

        def park(msg: tuple) -> tuple:
            # What vLLM does for a prefill whose decoder pulls: one store job per request,
            # with the request's remote_decoder kv_request_id (the tier parks it).
            for kv_id, first, count in msg[1]:
                ctx = v["ReqContext"](
                    req_id=f"a-{kv_id}",
                    kv_transfer_params={"remote_decoder": {"kv_request_id": kv_id}},
                )
                jid = side.job_id()
                with side.lock:
                    side.tier.on_new_request(ctx)
                    side.tier.submit_store(
                        v["TransferJob"](
                            jid,
                            keys[first : first + count],
                            np.arange(first, first + count),
                            False,
                            ctx,
                        )
                    )
                pending[jid] = ctx
            return ("parked", len(msg[1]))

        conn.send(("ready", side.port))
        answer(conn, {"park": park}, poll_s or POLL_S, between=finish_stores, counts=done.copy)
    finally:
        side.close()
        conn.send(("stopped", None))


class Pair(LoadingPair):
    """Producer A in a spawned process and consumer B in this one, each with vLLM's p2p tier on a
    ``rows`` x ``row_bytes`` arena; B's first load (one chunk) opens the session (ZMQ handshake
    and NIXL registration both ways) before anything is measured. Use as a context manager."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = POLL_S):
        self.v = load_vllm_p2p()
        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self.keys = [chunk_key(self.v, row_bytes, i) for i in range(rows)]
        super().__init__(_producer, row_bytes, rows, poll_s)
        self.b: Side | None = None
        try:
            self.a_port = self.ask(("hello",), expect="ready")
            self.b = Side(self.v, row_bytes, rows, poll_s)
            self.load([(self.kv_id("warm-up"), 0, 1)])
            # A reports its store job done on its own next step, maybe after B's load ended: a
            # count taken before that would see the warm-up's store land in what it measures
            self.wait_stores(0, 1)
        except BaseException:
            self.close()
            raise

    def step(self, inflight: dict) -> list:
        """One scheduler step of B's tier: vLLM ``JobResult`` s of finished load jobs."""
        assert self.b is not None
        return self.b.step()

    def submit(self, jobs: list[tuple[str, int, int]], out: dict) -> None:
        """B's side of a decode request per job, as vLLM's scheduler drives a tier: new request
        naming its prefiller, a lookup per chunk (HIT), one load job into rows ``first ..``; each
        job's (request, chunks, submit time) goes into ``out`` under its job id."""
        b = self.b
        assert b is not None
        hit = self.v["LookupResult"].HIT
        for kv_id, first, count in jobs:
            ctx = self.v["ReqContext"](
                req_id=f"b-{kv_id}",
                kv_transfer_params={
                    "remote_prefiller": {
                        "kv_request_id": kv_id,
                        "remote_host": HOST,
                        "remote_port": self.a_port,
                    }
                },
            )
            keys = self.keys[first : first + count]
            jid = b.job_id()
            with b.lock:
                b.tier.on_new_request(ctx)
                for k in keys:
                    if (r := b.tier.lookup(k, ctx)) is not hit:
                        raise AssertionError(f"vLLM p2p lookup of {kv_id} answered {r}")
                b.tier.submit_load(
                    self.v["TransferJob"](jid, keys, np.arange(first, first + count), True, ctx)
                )
            out[jid] = (ctx, count, time.perf_counter())

    def settle(self, results: list, inflight: dict, latencies: list | None = None) -> int:
        """Finish B's requests of ``results`` (vLLM ``JobResult`` s): chunks loaded.

        Raises:
            AssertionError: a load job failed.
        """
        now, n = time.perf_counter(), 0
        b = self.b
        assert b is not None
        for r in results:
            ctx, count, t0 = inflight.pop(r.job_id)
            with b.lock:
                b.tier.on_request_finished(ctx)
            if not r.success:
                raise AssertionError(f"vLLM p2p load job {r.job_id} ({ctx.req_id}) failed")
            if latencies is not None:
                latencies.append(now - t0)
            n += count
        return n

    def clear(self, first: int, count: int) -> None:
        assert self.b is not None
        self.b.arena[first : first + count] = 0

    def verify(self, first: int, count: int) -> None:
        """Every byte of B's rows ``first ..`` equals A's chunk in the same row.

        Raises:
            AssertionError: naming the first chunk whose bytes differ.
        """
        assert self.b is not None
        for i in range(first, first + count):
            if not self.payloads.check(self.b.arena[i], i):
                raise AssertionError(f"vLLM p2p: chunk {i} arrived with wrong bytes")

    def wait_stores(self, ok_before: int, jobs: int) -> dict:
        """A's stats once ``jobs`` more store jobs finished there (they finish when written).

        Raises:
            AssertionError: a store job failed on A.
        """
        deadline = time.monotonic() + DONE_TIMEOUT_S
        while True:
            st = self.a_stats()
            if st["failed"]:
                raise AssertionError(f"vLLM p2p: {st['failed']} store jobs failed on the producer")
            if st["ok"] >= ok_before + jobs:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError("producer store jobs did not finish")
            time.sleep(0.01)

    def close_consumer(self) -> None:
        if self.b is not None:
            self.b.close()
            self.b = None


# -- the symmetric flow: vLLM's own TieringOffloadingManager on both sides --------------------------


def tiering_manager(row_bytes: int, rows: int, port: int, poll_s: float) -> Any:
    """vLLM's own ``TieringOffloadingManager`` (``TieringOffloadingSpec.get_manager()``: CPU primary
    tier of ``rows`` chunks in a shared-memory region, the p2p tier as its one secondary tier on
    ``HOST:port``, its tier-poll thread every ``poll_s``), built from an ``OffloadingConfig`` as the
    connector builds it: one KV group of 16-token blocks, ``row_bytes`` per block, one block per
    chunk. Its ``lock`` must be held around calls, as vLLM's scheduler holds it for a step."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": rows * row_bytes,
        "tier_poll_interval_s": poll_s,
        "secondary_tiers": [{"type": "p2p", "host": HOST, "port": port}],
    }
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=("bench",), group_id=0),
        ),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvoffload-bench-p2p-{os.getpid()}-{port}",
        model=OffloadingModelConfig(name=f"bench-p2p-{row_bytes}", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=0,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="NHD",
    )
    return TieringOffloadingSpec(config).get_manager()


def _manager_with_port(row_bytes: int, rows: int, poll_s: float) -> tuple[Any, int]:
    pt.note_nixl_agent()  # vLLM's p2p tier makes one in this process (see ends_process)
    return on_free_port(lambda port: tiering_manager(row_bytes, rows, port, poll_s))


def primary_rows(mgr: Any, row_bytes: int) -> np.ndarray:
    """The manager's CPU primary tier as ``(chunks, row_bytes)`` uint8 rows."""
    mv = mgr.primary_tier.get_kv_memoryview()
    return np.asarray(mv).view(np.uint8).reshape(-1, row_bytes)


@ends_process
def _sym_producer(conn: Any, row_bytes: int, rows: int, poll_s: float) -> None:
    """Producer process of the symmetric mode: vLLM's manager stores chunks ``(tag, i)`` with chunk
    ``i``'s payload on request (prepare_store, rows written, complete_store); peers are served by
    the manager's tier-poll thread (its p2p tier's ``serve_external_requests``)."""
    v = load_vllm_p2p()
    mgr, port = _manager_with_port(row_bytes, rows, poll_s)
    step = v["ScheduleEndContext"](new_req_ids=(), preempted_req_ids=())
    payloads = Payloads(rows, row_bytes)

    def store(msg: tuple) -> tuple:
        tag, n = msg[1], msg[2]
        keys = [chunk_key(v, row_bytes, f"{tag}/{i}") for i in range(n)]
        index = {k: i for i, k in enumerate(keys)}
        ctx = v["ReqContext"](req_id=f"a-store-{tag}")
        with mgr.lock:
            mgr.on_new_request(ctx)
            out = mgr.prepare_store(keys, ctx)
            if out is None or len(out.keys_to_store) != n:
                raise RuntimeError(f"producer's primary tier took only part of {tag}")
            prim = primary_rows(mgr, row_bytes)
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                prim[cid] = payloads.base
                payloads.stamp(prim[cid], index[k])
            mgr.complete_store(out.keys_to_store, ctx)
            mgr.on_request_finished(ctx)
            mgr.on_schedule_end(step)
        return ("stored", n)

    try:
        conn.send(("ready", port))
        answer(conn, {"store": store})
    finally:
        mgr.shutdown()
        conn.send(("stopped", None))


class SymPair(ProducerPair):
    """Symmetric p2p (``remote_kv_source``) through vLLM's own ``TieringOffloadingManager`` on both
    sides: A stores chunks in its CPU primary tier; B's scheduler-side cycle per request is
    lookup every step (RETRY while the probe is out, HIT_PENDING while the promotion loads, HIT),
    then ``prepare_load`` / ``complete_load``; B's loaded rows are checked byte for byte."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = POLL_S):
        self.v = load_vllm_p2p()
        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self._step = self.v["ScheduleEndContext"](new_req_ids=(), preempted_req_ids=())
        super().__init__(_sym_producer, row_bytes, rows, poll_s)
        self.mgr: Any = None
        try:
            self.a_port = self.ask(("hello",), expect="ready")
            self.mgr, _ = _manager_with_port(row_bytes, rows, poll_s)
            self.load_requests(self.store("warm-up", 1), 1)
        except BaseException:
            self.close()
            raise

    def store(self, tag: str, n: int) -> list[bytes]:
        """A stores chunks ``0 .. n-1`` under keys of ``tag``; returns the keys."""
        self.ask(("store", tag, n), expect="stored")
        return [chunk_key(self.v, self.row_bytes, f"{tag}/{i}") for i in range(n)]

    def load_requests(
        self, keys: list[bytes], per_job: int, latencies: list | None = None, first_index: int = 0
    ) -> float:
        """All requests (``per_job`` keys each, every one naming A as its ``remote_kv_source``)
        started at once, then scheduler steps until every request has its chunks in B's primary
        tier and has loaded them (``prepare_load``, rows checked, ``complete_load``). Returns the
        seconds from the first lookup to the last request done. ``keys[i]`` holds chunk
        ``first_index + i``'s payload.

        Raises:
            AssertionError: a lookup answered MISS, or a chunk arrived with wrong bytes.
        """
        mgr, hit = self.mgr, self.v["LookupResult"]
        reqs = []
        t0 = time.perf_counter()
        with mgr.lock:
            for j in range(0, len(keys), per_job):
                kv_id = self.kv_id("sym")
                ctx = self.v["ReqContext"](
                    req_id=f"b-{kv_id}",
                    kv_transfer_params={
                        "remote_kv_source": {
                            "kv_request_id": kv_id,
                            "remote_host": HOST,
                            "remote_port": self.a_port,
                        }
                    },
                )
                mgr.on_new_request(ctx)
                reqs.append((ctx, first_index + j, keys[j : j + per_job]))
        deadline = time.monotonic() + DONE_TIMEOUT_S
        while reqs:
            with mgr.lock:
                left = []
                for ctx, first, ks in reqs:
                    res = [mgr.lookup(k, ctx) for k in ks]
                    if hit.MISS in res:
                        raise AssertionError(f"vLLM p2p: {ctx.req_id} looked up a MISS")
                    if any(r is not hit.HIT for r in res):
                        left.append((ctx, first, ks))
                        continue
                    spec = mgr.prepare_load(ks, ctx)
                    prim = primary_rows(mgr, self.row_bytes)
                    for i, cid in enumerate(spec.chunk_ids):
                        if not self.payloads.check(prim[cid], first + i):
                            raise AssertionError(
                                f"vLLM p2p: chunk {first + i} arrived with wrong bytes"
                            )
                    mgr.complete_load(ks, ctx)
                    mgr.on_request_finished(ctx)
                    if latencies is not None:
                        latencies.append(time.perf_counter() - t0)
                mgr.on_schedule_end(self._step)
            reqs = left
            if reqs:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(reqs)} symmetric p2p requests did not finish")
                time.sleep(WAIT_S)
        return time.perf_counter() - t0

    def close_consumer(self) -> None:
        if self.mgr is not None:
            self.mgr.shutdown()
            self.mgr = None
