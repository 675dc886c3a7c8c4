"""``kvoffload bench scaling``: multi-turn conversations on vLLM-CPU as concurrency grows past the
device KV cache, then past the host tier: recompute only, host tier, host tier + fs tier.

One vLLM server per configuration (SmolLM2-135M, float32); at each concurrency point ``c``, ``c``
fresh conversations (the same documents for every configuration) run ``turns`` turns concurrently,
each turn re-sending the growing history. Per point: prompt tokens per second (all prompt tokens
served, computed or reloaded, over the wall time), mean and p90 time to first token of the turns
after the first (the ones that can reuse a history), and where their cached tokens came from.

With ``--ceiling-tokens N`` a fourth configuration, ``ceiling``, recomputes with a device KV cache of
``N`` tokens, large enough that nothing is evicted: every history is a device-cache hit, the
throughput no tier can beat on this machine (what is left is decode, scheduling and HTTP).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import NO_PLOT_HINT, plot_option, print_header, server_workdir
from kvoffload.tools.extras import EXTRA_MODULES, require

CONFIGS = ("recompute", "host", "host+fs")
CEILING = "ceiling"
# host + fs with ``slower_than_recompute: recompute`` (kvoffload/costs.py): a load expected to take
# longer than recomputing its tokens is not served, an overrun promotion is given up (issue 26, 4);
# host and host+fs always wait for the tier (``serve``, said whatever the default), its baseline
JUDGED = "host+fs-judged"
KNOWN = CONFIGS + (JUDGED,)
MAX_MODEL_LEN = 4096  # SmolLM2's max_position_embeddings is 8192; a conversation is ~1.5k tokens


def _point(url: str, tokenizer, c: int, doc_tokens: int, turns: int, max_tokens: int) -> dict:
    from kvoffload.tools.workload import maintenance_log, run_workload

    docs = [maintenance_log(tokenizer, 10_000 + 100 * c + i, doc_tokens) for i in range(c)]
    t0 = time.perf_counter()
    result = run_workload(url, docs, turns, max_tokens, c, None)
    wall = time.perf_counter() - t0
    later = [t for t in result if t.turn > 0]
    ttft = np.array([t.ttft_s for t in later]) if later else np.array([0.0])
    prompt = sum(t.prompt_tokens for t in result)
    return {
        "concurrency": c,
        "turns": len(result),
        "wall_s": wall,
        "prompt_tokens": prompt,
        "prompt_tok_per_s": prompt / wall,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p90_s": float(np.quantile(ttft, 0.9)),
        "cached_share": sum(t.cached_tokens for t in later)
        / max(1, sum(t.prompt_tokens for t in later)),
    }


def run_sweep(
    model: str,
    points: list[int],
    doc_tokens: int,
    turns: int,
    max_tokens: int,
    device_tokens: int,
    host_tokens: int,
    workdir: Path,
    echo,
    ceiling_tokens: int = 0,
    configs: tuple[str, ...] = CONFIGS,
) -> dict[str, list[dict]]:
    """For each configuration of ``configs`` (of recompute, host, host+fs, host+fs-judged; with
    ``ceiling_tokens``, also ``ceiling``: recompute with that device KV cache) start one vLLM-CPU
    server and run ``points``
    conversations at once (``doc_tokens`` each, ``turns`` turns); returns per configuration one
    row per point: throughput, TTFT and where prompt tokens came from.
    """
    from transformers import AutoTokenizer

    from kvoffload.tools.vllm_server import (
        BLOCK_BYTES_PER_TOKEN_F32,
        ServerSpec,
        VLLMServer,
        cached_by_source,
        recomputed_by_reason,
    )

    tokenizer = AutoTokenizer.from_pretrained(model)
    out: dict[str, list[dict]] = {}
    for name in configs + ((CEILING,) if ceiling_tokens else ()):
        device = ceiling_tokens if name == CEILING else device_tokens
        offload = None
        if name not in ("recompute", CEILING):
            with_fs = name.startswith("host+fs")
            # a fresh root per configuration: the judged run must not reload the plain run's files
            tiers = [scratch_fs_tier(workdir / f"fs-{name}")] if with_fs else []
            offload = {
                "spec_name": "KVOffloadSpec",
                "spec_module_path": "kvoffload.vllm",
                "cpu_bytes_to_use": host_tokens * BLOCK_BYTES_PER_TOKEN_F32,
                "secondary_tiers": tiers,
            }
            offload["slower_than_recompute"] = "recompute" if name == JUDGED else "serve"
        spec = ServerSpec(
            model=model,
            kv_cache_tokens=device,
            block_size=32,
            max_model_len=min(device, MAX_MODEL_LEN) - 32,
            offload=offload,
            log_path=str(workdir / f"server-{name.replace('+', '_')}.log"),
        )
        echo(f"[{name}] starting vLLM (device KV {device} tokens)...")
        rows = []
        with VLLMServer(spec) as server:
            for c in points:
                before = server.metrics()
                row = _point(server.url, tokenizer, c, doc_tokens, turns, max_tokens)
                time.sleep(0.5)
                after = server.metrics()
                src = cached_by_source(before, after)
                if name == JUDGED:  # what the judge sent back to prefill, and why
                    row["recomputed"] = recomputed_by_reason(before, after)
                row["tokens_from"] = {
                    "device": src.get("device", 0),
                    "host": src.get("host", 0),
                    "fs": src.get("disk", 0),
                }
                echo(
                    f"[{name}] c={c}: {row['prompt_tok_per_s']:.0f} prompt tok/s, TTFT mean "
                    f"{row['ttft_mean_s']:.2f} s, tokens from {row['tokens_from']}"
                    + (f", recomputed {row['recomputed']}" if "recomputed" in row else "")
                )
                rows.append(row)
        out[name] = rows
    return out


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    """Write the sweep's throughput and cached share per configuration to ``path`` (PNG, matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        cs = [r["concurrency"] for r in rows]
        a.plot(cs, [r["prompt_tok_per_s"] for r in rows], marker="o", label=name)
        b.plot(cs, [r["ttft_mean_s"] for r in rows], marker="o", label=name)
    a.set(
        xlabel="concurrent conversations",
        ylabel="prompt tokens / s",
        xscale="log",
        title="throughput",
    )
    b.set(
        xlabel="concurrent conversations",
        ylabel="mean TTFT, turns 2+ (s)",
        xscale="log",
        yscale="log",
        title="time to first token",
    )
    for ax in (a, b):
        ax.set_xticks([r["concurrency"] for r in next(iter(results.values()))])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())  # 2x10^1 over 16
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _points(ctx, param, value: str) -> list[int]:
    try:
        pts = [int(p) for p in value.split(",")]
    except ValueError:
        pts = []
    if not pts or min(pts) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive integers")
    return pts


def _configs(ctx, param, value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in KNOWN]
    if unknown or "recompute" not in names:
        raise click.BadParameter(
            f"{value!r}: give a comma-separated list of {', '.join(KNOWN)} that includes "
            "recompute (every ratio is against it)"
        )
    return tuple(n for n in KNOWN if n in names)  # recompute first: the baseline


@click.command("scaling")
@click.option(
    "--points",
    default="1,2,4,8",
    show_default=True,
    callback=_points,
    help="Concurrency points: conversations run at once, comma-separated.",
)
@click.option(
    "--doc-tokens", default=1000, show_default=True, help="Tokens of each conversation's document."
)
@click.option("--turns", default=3, show_default=True, help="Turns per conversation.")
@click.option("--max-tokens", default=8, show_default=True, help="Tokens per reply.")
@click.option("--device-tokens", default=4096, show_default=True, help="Device KV cache (tokens).")
@click.option("--host-tokens", default=8192, show_default=True, help="Host tier (tokens).")
@click.option(
    "--ceiling-tokens",
    default=0,
    show_default=True,
    help="Also recompute with a device KV cache this large (tokens; 0: not run): the ceiling.",
)
@click.option(
    "--configs",
    default=",".join(CONFIGS),
    show_default=True,
    callback=_configs,
    help=f"Configurations to run, of {', '.join(KNOWN)} (must include recompute); "
    f"{JUDGED} is host+fs with slower_than_recompute: recompute; host and host+fs always serve "
    "from their tiers (slower_than_recompute: serve).",
)
@click.option("--model-dir", default=None, help="Prepared model directory (default: the cache).")
@plot_option("docs/bench/scaling.png")
@click.option("--json", "json_path", default=None, help="Also write the results to this file.")
def bench_scaling(
    points,
    doc_tokens,
    turns,
    max_tokens,
    device_tokens,
    host_tokens,
    ceiling_tokens,
    configs,
    model_dir,
    plot_path,
    json_path,
) -> None:
    """Concurrency sweep on vLLM-CPU: recompute only vs host tier vs host + fs (plotted)."""
    from kvoffload.tools.model import prepare_model

    plotting = ("matplotlib",) if plot_path else ()
    require(
        "bench scaling",
        "demo",
        "bench",
        modules=EXTRA_MODULES["demo"] + plotting,
        hint=NO_PLOT_HINT,
    )
    print_header()
    model = str(prepare_model(model_dir))
    pts = points
    with server_workdir() as wd:
        results = run_sweep(
            model,
            pts,
            doc_tokens,
            turns,
            max_tokens,
            device_tokens,
            host_tokens,
            wd,
            lambda s: click.echo(s, err=True),
            ceiling_tokens,
            configs,
        )
    base = {r["concurrency"]: r for r in results["recompute"]}
    click.echo(
        f"\ndevice KV {device_tokens} tokens, host tier {host_tokens} tokens, conversations of "
        f"~{doc_tokens} tokens + {turns} turns"
        + (
            f"; ceiling: recompute with a device KV cache of {ceiling_tokens} tokens"
            if ceiling_tokens
            else ""
        )
        + "\n"
    )
    click.echo(
        "| config | concurrency | prompt tok/s | vs recompute | TTFT mean s | vs recompute | "
        "TTFT p90 s | cached share | tokens from device / host / fs |"
    )
    click.echo("|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for r in rows:
            b = base[r["concurrency"]]
            tf = r["tokens_from"]
            click.echo(
                f"| {name} | {r['concurrency']} | {r['prompt_tok_per_s']:.0f} | "
                f"{r['prompt_tok_per_s'] / b['prompt_tok_per_s']:.2f}x | "
                f"{r['ttft_mean_s']:.2f} | {r['ttft_mean_s'] / b['ttft_mean_s']:.2f}x | "
                f"{r['ttft_p90_s']:.2f} | {r['cached_share']:.2f} | "
                f"{tf['device']} / {tf['host']} / {tf['fs']} |"
            )
    for r in results.get(JUDGED, ()):
        click.echo(
            f"{JUDGED} c={r['concurrency']}: tokens the fs tier held, recomputed instead: "
            + (", ".join(f"{k} {v}" for k, v in sorted(r["recomputed"].items())) or "none")
        )
    if ceiling_tokens and "host+fs" in results:
        click.echo(
            "\nagainst the ceiling (prompt tok/s): what a tier could add at most is "
            "ceiling / recompute; host+fs reached host+fs / ceiling of it"
        )
        for r, top in zip(results["host+fs"], results[CEILING]):
            c, b = r["concurrency"], base[r["concurrency"]]
            click.echo(
                f"  c={c}: ceiling / recompute {top['prompt_tok_per_s'] / b['prompt_tok_per_s']:.2f}x, "
                f"host+fs / ceiling {r['prompt_tok_per_s'] / top['prompt_tok_per_s']:.2f}x"
            )
    if plot_path:
        plot(
            results,
            Path(plot_path),
            f"SmolLM2-135M on vLLM-CPU, device KV {device_tokens} tok, host tier {host_tokens} tok",
        )
        click.echo(f"\nplot: {plot_path}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
