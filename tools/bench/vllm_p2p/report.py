"""The report of a run: markdown tables of :func:`~.measure.measure` / :func:`~.measure.sym_measure`
results, each system's rows and, where both systems ran at a chunk size, a row of ratios
kvoffload / vLLM."""

from __future__ import annotations

from collections.abc import Iterator

import click

NAMES = {"vllm": "vLLM 0.33", "kvoffload": "kvoffload"}


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _ratios(a: dict, b: dict, x: str, y: str) -> str:
    """``a[x] / b[x]`` and ``a[y] / b[y]``, as ``"1.02x / 0.97x"``."""
    return f"{_ratio(a[x], b[x])} / {_ratio(a[y], b[y])}"


def _both(by: dict) -> Iterator[tuple[int, dict, dict]]:
    """``(chunk bytes, kvoffload's result, vLLM's)`` per chunk size at which both systems ran
    the pd flow."""
    for chunk, got in by.items():
        k, vl = got.get(("kvoffload", "fetch")), got.get(("vllm", "pd"))
        if k is not None and vl is not None:
            yield chunk, k, vl


def report(results: list[dict], step_ms: float, iters: int, jitter_reps: int) -> None:
    """Print the markdown tables of ``results``: load figures, then scheduler-step figures where
    jitter was measured."""
    click.echo(
        "\n| system (flow) | chunk | load GB/s (median) | runs | request done after p50 / p99 ms "
        "(all submitted at once) | one-chunk load p50 / p99 µs | CPU s per GB: producer A / "
        "consumer B (with worker processes) | worker processes A / B |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    by: dict = {}
    for r in results:
        by.setdefault(r["chunk_bytes"], {})[(r["system"], r["flow"])] = r
        lat = f"{r['chunk_p50_us']:.0f} / {r['chunk_p99_us']:.0f}" if "chunk_p50_us" in r else "-"
        procs = f"{len(r.get('procs_a', []))} / {len(r.get('procs_b', []))}"
        if r.get("procs_a") or r.get("procs_b"):
            procs += f" ({', '.join(sorted(set(r.get('procs_a', []) + r.get('procs_b', []))))})"
        click.echo(
            f"| {NAMES[r['system']]} ({r['flow']}) | {r['chunk_bytes'] >> 10} KiB | "
            f"{r['gbps']:.2f} | {', '.join(f'{g:.2f}' for g in r['gbps_runs'])} | "
            f"{r['job_p50_ms']:.1f} / {r['job_p99_ms']:.1f} | {lat} | "
            f"{r['cpu_a_s_per_gb']:.2f} / {r['cpu_b_s_per_gb']:.2f} | {procs} |"
        )
    for chunk, k, vl in _both(by):
        lat = "-"
        if "chunk_p50_us" in k and "chunk_p50_us" in vl:
            lat = _ratios(k, vl, "chunk_p50_us", "chunk_p99_us")
        job = _ratios(k, vl, "job_p50_ms", "job_p99_ms")
        cpu = _ratios(k, vl, "cpu_a_s_per_gb", "cpu_b_s_per_gb")
        click.echo(
            f"| **kvoffload / vLLM** | {chunk >> 10} KiB | {_ratio(k['gbps'], vl['gbps'])} | | "
            f"{job} | {lat} | {cpu} | |"
        )
    for r in results:
        if r.get("reasked"):
            click.echo(
                f"\nkvoffload, {r['chunk_bytes'] >> 10} KiB: {r['reasked']} lookups of requested "
                "chunks answered MISS (the producer refused the lease: at most half its host tier "
                "is leased to peers at once) and were asked again the next step"
            )
    if not jitter_reps or not any("steps" in r for r in results):
        return
    click.echo(
        f"\nscheduler step on B: {step_ms:g} ms of pure-Python work ({iters} iterations), then "
        "the tier's calls (vLLM: the step's submit_load, get_finished_jobs + on_schedule_end; "
        "kvoffload: the step's on_request + lookups, TieringManager.step() + the waiting "
        "requests' lookups); no tier: the same steps before either instance starts; idle: both "
        "instances up (session open, worker / progress / poll threads running), nothing moving"
    )
    click.echo(
        "\n| system | chunk | while | steps | p50 ms | p99 ms | p99 / no tier | p99 / tier idle | "
        "tier calls p50 / p99 µs | GB/s during |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        for s in r.get("steps", ()):
            gbps = "-" if s["gbps"] is None else f"{s['gbps']:.2f}"
            click.echo(
                f"| {NAMES[r['system']]} | {r['chunk_bytes'] >> 10} KiB | {s['while']} | "
                f"{s['steps']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                f"{s['p99_vs_no_tier']:.2f}x | {s['p99_vs_idle']:.2f}x | "
                f"{s['call_p50_us']:.0f} / {s['call_p99_us']:.0f} | {gbps} |"
            )
    for chunk, k, vl in _both(by):
        if "steps" not in k or "steps" not in vl:
            continue
        vsteps = {s["while"]: s for s in vl["steps"]}
        for s in k["steps"]:
            o = vsteps.get(s["while"])
            if o is None or s["while"] == "no tier":
                continue
            calls = _ratios(s, o, "call_p50_us", "call_p99_us")
            click.echo(
                f"| **kvoffload / vLLM** | {chunk >> 10} KiB | {s['while']} | | "
                f"{_ratio(s['p50_ms'], o['p50_ms'])} | {_ratio(s['p99_ms'], o['p99_ms'])} | | | "
                f"{calls} | {_ratio(s['gbps'], o['gbps'])} |"
            )
