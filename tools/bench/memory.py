"""``kvoffload bench memory``: engine-side bytes per stored chunk (tracemalloc), per eviction
policy, and the memory of a tier worker process (USS, RSS; whether torch is loaded in it).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tracemalloc
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import arena_name, bench_namespace, make_workdir, print_header


def memory_per_chunk(n_chunks: int, workdir: Path) -> dict:
    """Engine-side memory per stored chunk (bytes, tracemalloc) for each eviction policy with
    ``n_chunks`` chunks indexed, and the resident size of a small running manager (psutil).
    """
    import psutil

    row = 4096
    out: dict = {"chunks": n_chunks}
    cfg = parse_config({"cpu_bytes_to_use": n_chunks * row})
    with Arena.create(arena_name("mem"), n_chunks, row) as arena:
        for policy in ("lru", "arc"):
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            tm = TieringManager(
                arena,
                bench_namespace(row),
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
            "secondary_tiers": [scratch_fs_tier(workdir / "fs-mem")],
        }
    )
    with Arena.create(arena_name("memw"), 64, row) as arena:
        tm = TieringManager(arena, bench_namespace(row), cfg)
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


@click.command("memory")
@click.option("--chunks", type=click.IntRange(min=1), default=200_000, show_default=True)
def bench_memory(chunks) -> None:
    """Engine-side bytes per stored chunk and tier worker process memory."""
    wd = make_workdir(None)
    print_header()
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
