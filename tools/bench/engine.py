"""``kvoffload bench engine``: engine-thread cost per host-hit lookup, per job and chunk handed to
the fs tier and completed, per completion poll, as the number of stored chunks grows.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tiers.process import ProcessTierManager
from kvoffload.tools.bench.harness import (
    arena_name,
    bench_namespace,
    make_workdir,
    plot_lines,
    print_header,
)
from kvoffload.tools.extras import require

_STEP_S = 0.005  # a scheduler step of vLLM-CPU with a batch in flight is several ms here


def engine_cost(n_chunks: int, batch: int, workdir: Path) -> dict:
    """µs per host-hit lookup with ``n_chunks`` stored (wall time), and engine-thread CPU µs per
    256 KiB chunk handed to / completed by the fs tier (the workers run in other processes)."""
    out: dict = {"stored_chunks": n_chunks}
    row = 4096
    cfg = parse_config({"cpu_bytes_to_use": n_chunks * row})
    with Arena.create(arena_name("cost"), n_chunks, row) as arena:
        tm = TieringManager(arena, bench_namespace(row), cfg, record_events=False)
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
            # every job is handed over before any completes: no store may be dropped for the pin budget
            "tier_pin_fraction": 1.0,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(workdir / "fs-cost"),
                    "max_pending_store_chunks": n + 1,
                }
            ],
        }
    )
    with Arena.create(arena_name("handoff"), n, row) as arena:
        tm = TieringManager(arena, bench_namespace(row), cfg, record_events=False)
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


@click.command("engine")
@click.option(
    "--chunks",
    multiple=True,
    type=click.IntRange(min=1),
    default=(10_000, 100_000, 1_000_000),
    show_default=True,
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Chunks per store job.",
)
@click.option("--plot", "plot_path", default="docs/bench/engine.png", show_default=True)
def bench_engine(chunks, batch, plot_path) -> None:
    """Engine-thread µs per host-hit lookup, per job and chunk handed to the fs tier, per completion
    poll, as the number of stored chunks grows."""
    require("bench engine", "bench", modules=("matplotlib",))
    wd = make_workdir(None)
    print_header()
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
    plot_lines(
        plot_path,
        [r["stored_chunks"] for r in rows],
        {label: [r[k] for r in rows] for label, k in lines.items()},
        "stored chunks",
        "engine-thread µs",
        f"engine-side cost ({batch}-chunk jobs)",
        logx=True,
    )
    click.echo(f"\nplot: {plot_path}")
