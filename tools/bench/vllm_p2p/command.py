"""The ``kvoffload bench vllm-p2p`` command (``python -m kvoffload.tools.bench.vllm_p2p``)."""

from __future__ import annotations

import json
import os
import sys

import click

from kvoffload.tools.bench.harness import calibrate, ends_process, machine_facts
from kvoffload.tools.bench.vllm_p2p.measure import measure, sym_measure
from kvoffload.tools.bench.vllm_p2p.report import report
from kvoffload.tools.bench.vllm_p2p.vllm_side import load_vllm_p2p
from kvoffload.tools.extras import MissingExtra


@click.command("vllm-p2p")
@click.option("--chunk-kib", multiple=True, type=int, default=(256, 2048), show_default=True)
@click.option("--total-mib", default=256, show_default=True, help="Bytes per load run.")
@click.option(
    "--job-mib", default=1, show_default=True, help="Bytes per request (one load job each)."
)
@click.option("--reps", default=3, show_default=True, help="Throughput runs per chunk size.")
@click.option("--latency-n", default=200, show_default=True, help="One-chunk loads timed.")
@click.option("--jitter-reps", default=2, show_default=True, help="Step-time runs per mode.")
@click.option("--step-ms", default=2.0, show_default=True, help="Pure-Python work per step.")
@click.option(
    "--jitter-mode",
    "modes",
    multiple=True,
    type=click.Choice(["paced", "burst"]),
    default=("paced", "burst"),
    show_default=True,
)
@click.option(
    "--poll-ms",
    default=1.0,
    show_default=True,
    help="vLLM's tier_poll_interval_s, in ms, on both sides (0: steps only).",
)
@click.option(
    "--flow",
    "flows",
    multiple=True,
    type=click.Choice(["pd", "symmetric"]),
    default=("pd", "symmetric"),
    show_default=True,
    help="pd: the tier driven directly with remote_decoder / remote_prefiller requests; symmetric: "
    "vLLM's TieringOffloadingManager on both sides, remote_kv_source requests (no jitter runs).",
)
@click.option(
    "--system",
    "systems",
    multiple=True,
    type=click.Choice(["vllm", "kvoffload"]),
    default=("vllm", "kvoffload"),
    show_default=True,
    help="Whose p2p tier runs the pd-flow measurements: vLLM 0.33's, kvoffload's, or both (then "
    "one table with the ratios kvoffload / vLLM).",
)
@click.option("--ucx-tls", default="", help="UCX_TLS for both processes (e.g. tcp); default UCX's")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@ends_process
def vllm_p2p(
    chunk_kib,
    total_mib,
    job_mib,
    reps,
    latency_n,
    jitter_reps,
    step_ms,
    modes,
    poll_ms,
    flows,
    systems,
    ucx_tls,
    json_out,
) -> None:
    """vLLM 0.33's own p2p tier and kvoffload's, two instances each on loopback, side by side:
    load GB/s, per-chunk latency, CPU s per GB and scheduler-step jitter (needs vLLM 0.33 and
    NIXL)."""
    for name, val in (("--chunk-kib", min(chunk_kib)), ("--total-mib", total_mib)):
        if val < 1:
            raise click.BadParameter(f"must be at least 1, got {val}", param_hint=name)
    if job_mib < 1 or reps < 1:
        raise click.BadParameter("--job-mib and --reps must be at least 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read by vLLM when first imported
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # read by UCX when each process creates its agent
    v = load_vllm_p2p()
    from kvoffload.workers.p2p_transport import nixl_available

    if "kvoffload" in systems and (why := nixl_available()):
        raise MissingExtra(f"kvoffload's p2p tier runs here with NIXL, which is missing: {why}")
    iters = calibrate(step_ms) if jitter_reps else 0
    ctx = click.get_current_context()
    args = sys.argv[1:] if ctx.parent is None else sys.argv[len(ctx.command_path.split()) :]
    click.echo(f"command: {ctx.command_path} {' '.join(args)}")
    click.echo(f"machine: {machine_facts()}")
    click.echo(
        f"vLLM {v['version']} P2PSecondaryTierManager (UCX, num_threads 4), tier-poll thread "
        f"every {poll_ms:g} ms on both sides; kvoffload p2p tier (NIXL transport in its peer "
        f"worker process); UCX_TLS {ucx_tls or 'UCX default'}; "
        f"{total_mib} MiB per run in {job_mib} MiB requests"
    )
    results = []
    for kib in chunk_kib if "pd" in flows else ():
        for system in systems:
            r = measure(
                kib << 10,
                total_mib << 20,
                job_mib << 20,
                reps,
                latency_n,
                jitter_reps,
                iters,
                tuple(modes),
                poll_ms / 1e3,
                system,
            )
            results.append(r | {"flow": "pd" if system == "vllm" else "fetch", "system": system})
    for kib in chunk_kib if "symmetric" in flows else ():
        r = sym_measure(kib << 10, total_mib << 20, job_mib << 20, reps, latency_n, poll_ms / 1e3)
        results.append(r | {"flow": "symmetric", "system": "vllm"})
    report(results, step_ms, iters, jitter_reps)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"vllm": v["version"], "ucx_tls": ucx_tls or "default", "runs": results}, f)
