"""The measurements, the same for both sides (a :class:`~.driver.LoadingPair`): load throughput,
per-chunk latency and scheduler-step jitter in the ``pd`` flow (:func:`measure`), throughput and
latency in the ``symmetric`` flow (:func:`sym_measure`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvoffload.tools.bench.harness import busy_step
from kvoffload.tools.bench.vllm_p2p.driver import DONE_TIMEOUT_S, POLL_S, ProducerPair
from kvoffload.tools.bench.vllm_p2p.kvoffload_side import KvPair
from kvoffload.tools.bench.vllm_p2p.vllm_side import Pair, SymPair


def _jobs(pair: ProducerPair, tag: str, n: int, per_job: int) -> list[tuple[str, int, int]]:
    return [(pair.kv_id(tag), i, min(per_job, n - i)) for i in range(0, n, per_job)]


def throughput(pair: Any, n: int, per_job: int) -> dict:
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


def chunk_latency(pair: Any, m: int) -> list[float]:
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


def step_jitter(pair: Any, n: int, per_job: int, iters: int, mode: str) -> dict:
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
        if time.perf_counter() - w0 > DONE_TIMEOUT_S:
            raise TimeoutError(f"vLLM p2p: {mode} loads did not finish")
    gbps = n * pair.row_bytes / (time.perf_counter() - w0) / 1e9
    pair.verify(0, n)
    return {"steps": steps, "calls": calls, "gbps": gbps}


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _summary(out: dict, runs: list[dict], latencies: list[float] | None) -> None:
    """Into ``out``: the medians over ``runs`` (each with ``gbps``, ``cpu_a_s_per_gb``,
    ``cpu_b_s_per_gb`` and ``job_s``), every run's GB/s, request p50 / p99 and, with
    ``latencies``, one-chunk load p50 / p99."""
    out["gbps"] = statistics.median(r["gbps"] for r in runs)
    out["gbps_runs"] = [r["gbps"] for r in runs]
    out["cpu_a_s_per_gb"] = statistics.median(r["cpu_a_s_per_gb"] for r in runs)
    out["cpu_b_s_per_gb"] = statistics.median(r["cpu_b_s_per_gb"] for r in runs)
    jobs_s = [x for r in runs for x in r["job_s"]]
    out["job_p50_ms"], out["job_p99_ms"] = _pct(jobs_s, 50) * 1e3, _pct(jobs_s, 99) * 1e3
    if latencies is not None:
        out["chunk_p50_us"] = _pct(latencies, 50) * 1e6
        out["chunk_p99_us"] = _pct(latencies, 99) * 1e6


def measure(
    chunk_bytes: int,
    total_bytes: int,
    job_bytes: int,
    reps: int,
    latency_n: int,
    jitter_reps: int,
    iters: int,
    modes: tuple[str, ...] = ("paced", "burst"),
    poll_s: float = POLL_S,
    system: str = "vllm",
) -> dict:
    """Every measurement at one chunk size on one pair of instances (see the package docstring):
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
        _summary(out, runs, chunk_latency(pair, latency_n) if latency_n else None)
        out["procs_a"], out["procs_b"] = runs[-1]["procs_a"], runs[-1]["procs_b"]
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


def sym_measure(
    chunk_bytes: int,
    total_bytes: int,
    job_bytes: int,
    reps: int,
    latency_n: int,
    poll_s: float = POLL_S,
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
            runs.append(
                {
                    "gbps": gb / dt,
                    "cpu_a_s_per_gb": (a1 - a0) / gb,
                    "cpu_b_s_per_gb": (b1 - b0) / gb,
                    "job_s": lat,
                }
            )
        latencies = None
        if latency_n:
            keys = pair.store("lat", min(n, latency_n))
            latencies = [pair.load_requests([k], 1, first_index=i) for i, k in enumerate(keys)]
        _summary(out, runs, latencies)
    return out
