"""``kvoffload bench tier``: host ↔ fs store and load throughput against raw sequential disk I/O
(fio, O_DIRECT, libaio, iodepth 4, block size = chunk size), repetitions interleaved; and the host
arena copy (torch ``copy_`` of KV rows into shared-memory slots) against memcpy between private
buffers.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import (
    NO_PLOT_HINT,
    arena_name,
    bench_namespace,
    drop_caches,
    load_all,
    make_workdir,
    plot_bars,
    plot_option,
    print_header,
)
from kvoffload.tools.extras import require


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
    """Host -> fs stores and fs -> host loads of ``total_bytes`` in ``chunk_bytes`` chunks through
    a real fs tier, against fio's sequential writes and reads of the same bytes (GB/s, best of
    ``reps``), with and without O_DIRECT (``direct_io``).
    """
    n = total_bytes // chunk_bytes
    root = workdir / "fs"
    cfg = parse_config(
        {
            "cpu_bytes_to_use": n * chunk_bytes,
            "secondary_tiers": [
                scratch_fs_tier(
                    root,
                    read_workers=readers,
                    write_workers=writers,
                    max_pending_store_chunks=n + 1,
                    direct_io=direct_io,
                    io_threads=io_threads,
                )
            ],
        }
    )
    arena = Arena.create(arena_name("tier"), n, chunk_bytes)
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
            tm = TieringManager(arena, bench_namespace(chunk_bytes), cfg)
            try:
                tm.wait_idle(10)
                # workers up before the clock starts
                assert tm.wait_workers_ready(600), "fs tier workers did not start"
                plan = tm.prepare_store(keys)
                assert plan is not None and len(plan.keys) == n
                # The rows already hold the payloads (the accelerator copy is not measured).
                drop_caches()
                t0 = time.perf_counter()
                tm.complete_store(keys)
                assert tm.wait_idle(600)
                os.sync()
                res["store"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.cascaded["fs"] == n
                res["raw_read"].append(_fio(fio_file, "read", chunk_bytes, total_bytes))
                tm.host.remove(keys)
                drop_caches()
                t0 = time.perf_counter()
                load_all(tm, keys)
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


def arena_copy(chunk_bytes: int, total_bytes: int, reps: int) -> dict:
    """GB/s copying KV-shaped rows into host-arena slots (shared memory, torch ``copy_``, as the
    accelerator worker does on CPU) against the same copies between two private buffers (memcpy)."""
    import torch

    n = max(1, total_bytes // chunk_bytes)
    src = torch.randint(0, 127, (n, chunk_bytes), dtype=torch.int8)
    private = torch.empty_like(src)
    res = {"memcpy": [], "arena": []}
    with Arena.create(arena_name("copy"), n, chunk_bytes) as arena:
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


@click.command("tier")
@click.option(
    "--chunk-kib",
    "chunk_kib",
    multiple=True,
    type=int,
    default=(256, 2048, 8192),
    show_default=True,
)
@click.option("--total-mib", default=1024, show_default=True, help="Bytes moved per measurement.")
@plot_option("docs/bench/tier.png")
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
    require(
        "bench tier",
        "bench",
        modules=("matplotlib",) if plot_path else (),
        hint=NO_PLOT_HINT,
    )
    if shutil.which("fio") is None:
        raise click.ClickException("fio is not installed (apt-get install fio)")
    wd = make_workdir(workdir)
    print_header()
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
    if not plot_path:
        return
    groups = [f"{kib} KiB" for kib in chunk_kib]
    plot_bars(
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
