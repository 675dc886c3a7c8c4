"""``kvoffload stress``: the tiering manager under generated load, every load verified bit-exact.

No vLLM, no accelerator: this process plays the engine. Requests are sequences of chunk keys
(prefix-chained like vLLM's block hashes); for each one it looks the keys up in order, waits for
promotions, "copies to the device" the chunks found (checking every byte against the payload derived
from the key), and "computes" the rest, storing them (writing the payload into host slots, as the
accelerator worker would). Tier I/O runs in the real worker processes of the configured tiers.

Workloads:
    multiturn: conversations whose turns re-send the growing history after a shared system prompt.
    zipf: documents of fixed length, chosen with Zipf-distributed popularity.
    random: documents chosen uniformly.

A payload is a function of its key and of each 8-byte word's position, so a chunk served for the
wrong key, a shifted or torn copy, or stale bytes all fail verification (``corrupt_loads``). A
request that waits longer than ``--hang-after`` seconds, or a job still unfinished at the end,
counts as hung. Exit status 1 when any load was corrupt or anything hung.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import click
import numpy as np
import xxhash

from kvoffload.config import ConfigError, parse_config
from kvoffload.host import READY
from kvoffload.ipc import names
from kvoffload.ipc.arena import Arena, ArenaError, round_up_to_page, sweep
from kvoffload.namespace import Namespace
from kvoffload.tiering import HOST, TieringManager
from kvoffload.tiers.base import LookupResult
from kvoffload.tools import scratch_fs_tier, stdout_console
from kvoffload.tools.extras import require

_HIT, _MISS, _PENDING, _RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
_K1 = np.uint64(0x9E3779B97F4A7C15)


def default_config(root_dir: str) -> dict[str, Any]:
    """The embedded default: a 64 MiB host tier and an fs tier under ``root_dir`` capped at 2 GiB."""
    return {
        "cpu_bytes_to_use": 64 << 20,
        "eviction_policy": "lru",
        "secondary_tiers": [scratch_fs_tier(root_dir, max_bytes=2 << 30)],
    }


def payload(key: bytes, row_bytes: int) -> np.ndarray:
    """The chunk's bytes: ``(row_bytes,)`` uint8, word ``i`` = ``(i * K1) ^ xxh3_64(key)``."""
    seed = np.uint64(xxhash.xxh3_64_intdigest(key))
    words = np.arange(row_bytes // 8, dtype=np.uint64)
    words *= _K1
    words ^= seed
    return words.view(np.uint8)


def chain_keys(parent: bytes, n: int, salt: bytes) -> list[bytes]:
    """``n`` chunk keys continuing the prefix chain after ``parent`` (16 bytes each)."""
    keys = []
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + salt + i.to_bytes(4, "little"))
        keys.append(parent)
    return keys


class Workload:
    """Request generator: :meth:`next_request` returns the chunk keys of one request."""

    def __init__(
        self,
        kind: str,
        rng: np.random.Generator,
        *,
        conversations: int,
        turn_chunks: int,
        system_chunks: int,
        max_turns: int,
        documents: int,
        doc_chunks: int,
        zipf_a: float,
    ):
        self.kind = kind
        self.rng = rng
        self.turn_chunks = turn_chunks
        self.max_turns = max_turns
        self.system = chain_keys(b"system", system_chunks, b"s")
        self.doc_chunks = doc_chunks
        self.documents = documents
        self.zipf_a = zipf_a
        self._convs: list[list[bytes]] = [list(self.system) for _ in range(conversations)]
        self._conv_ids = [0] * conversations
        self._next_conv = conversations
        if kind == "zipf":
            ranks = np.arange(1, documents + 1, dtype=np.float64)
            w = ranks**-zipf_a
            self._doc_p = w / w.sum()

    def next_request(self) -> list[bytes]:
        if self.kind == "multiturn":
            i = int(self.rng.integers(len(self._convs)))
            history = self._convs[i]
            if (len(history) - len(self.system)) // self.turn_chunks >= self.max_turns:
                history = self._convs[i] = list(self.system)  # a new conversation takes its place
                self._conv_ids[i] = self._next_conv
                self._next_conv += 1
            salt = self._conv_ids[i].to_bytes(8, "little")
            history.extend(chain_keys(history[-1] if history else b"", self.turn_chunks, salt))
            return list(history)
        if self.kind == "zipf":
            doc = int(self.rng.choice(self.documents, p=self._doc_p))
        elif self.kind == "random":
            doc = int(self.rng.integers(self.documents))
        else:
            raise ValueError(f"unknown workload {self.kind!r}")
        return chain_keys(doc.to_bytes(8, "little"), self.doc_chunks, b"d")


@dataclass
class _Request:
    keys: list[bytes]
    t0: float
    rid: str
    pos: int = 0  # next key to look up
    hits: int = 0  # keys [0, hits) found
    stalled_since: float = 0.0


@dataclass
class Report:
    """What a run did. ``latency_*`` are request latencies (submit to prefix loaded and rest stored),
    seconds; ``*_gbps`` are payload GB/s (1e9 bytes) between "device" and host."""

    duration_s: float = 0.0
    requests: int = 0
    lookups: int = 0
    chunks_loaded: int = 0
    chunks_stored: int = 0
    load_gbps: float = 0.0
    store_gbps: float = 0.0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    latency_p99_s: float = 0.0
    hit_rate: float = 0.0
    tier_hit_rate: dict[str, float] = field(default_factory=dict)
    tokens_from: dict[str, int] = field(default_factory=dict)
    tier_gbps: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # "tier.direction.reason" -> chunks
    refused: dict[str, int] = field(default_factory=dict)  # the same, chunks a tier refused
    dropped_stores: dict[str, int] = field(default_factory=dict)
    worker_restarts: dict[str, int] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)
    unexercised: list[str] = field(default_factory=list)  # faults injected without visible effect
    # fault flag -> the /metrics series that show it (FaultInjector.metric_evidence)
    fault_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    unmetered: list[str] = field(default_factory=list)  # faults that took effect, no metric shows
    corrupt_loads: int = 0
    hung_requests: int = 0
    hung_jobs: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.corrupt_loads == 0 and self.hung_requests == 0 and self.hung_jobs == 0


class Stress:
    """One stress run over a fresh arena and tiering manager (built from ``config``).

    Args:
        config: ``kv_connector_extra_config`` dict (validated here).
        chunk_bytes: bytes per chunk (rounded up to a page); the arena holds
            ``cpu_bytes_to_use // chunk_bytes`` chunks.
        tokens_per_chunk: tokens a chunk stands for (reports ``tokens_from``).

    Raises:
        ConfigError: an invalid config (names the key), or a host tier of fewer than 4 chunks.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        chunk_bytes: int = 256 << 10,
        tokens_per_chunk: int = 16,
        hang_after_s: float = 30.0,
    ):
        self.settings = parse_config(config)
        self.row_bytes = round_up_to_page(chunk_bytes)
        num_slots = self.settings.cpu_bytes_to_use // self.row_bytes
        if num_slots < 4:
            raise ConfigError(
                f"kv_connector_extra_config.cpu_bytes_to_use: "
                f"{self.settings.cpu_bytes_to_use} bytes hold {num_slots} chunks of "
                f"{self.row_bytes} bytes; at least 4 are needed"
            )
        self.tokens_per_chunk = tokens_per_chunk
        self.hang_after_s = hang_after_s
        self.ns = Namespace(
            model="kvoffload-stress",
            kv_dtype="uint8",
            layout="stress-v1",
            tokens_per_chunk=tokens_per_chunk,
            row_bytes=self.row_bytes,
        )
        sweep()
        name = self.settings.arena_name or f"kvoffload_stress_{os.getpid()}"
        self.arena = Arena.create(name, num_slots, self.row_bytes, engine_id="stress")
        try:
            self.tm = TieringManager(self.arena, self.ns, self.settings)
        except BaseException:
            self.arena.close()
            raise
        self.rows = self.arena.rows
        self._dev = self.arena.device_stats[0]
        self.report = Report(config=config)
        self._latencies: list[float] = []
        self._corrupt_keys: set[bytes] = set()

    # -- the engine's side of one request --------------------------------------------------------

    def _advance(self, req: _Request, now: float) -> bool:
        """Move ``req`` on; True when it finished."""
        tm = self.tm
        keys = req.keys
        while req.pos < len(keys):
            r = tm.lookup(keys[req.pos], req.rid)
            if r is _RETRY:
                return False
            self.report.lookups += 1
            if r is _MISS:
                break
            req.pos += 1
        # keys [0, pos) are HIT or HIT_PENDING: wait until every one is readable
        state, index = tm.host.state, tm.host.index
        for k in keys[: req.pos]:
            slot = index.get(k)
            if slot is None:  # a promotion failed (or the chunk was evicted): look up again
                req.pos = keys.index(k)
                return False
            if state[slot] != READY:
                return False
        hits = keys[: req.pos]
        if hits:
            t0 = time.perf_counter()
            slots = tm.prepare_load(hits, req.rid)
            for k, slot in zip(hits, slots):
                if not np.array_equal(self.rows[slot], payload(k, self.row_bytes)):
                    self.report.corrupt_loads += 1
                    self._corrupt_keys.add(k)
            tm.complete_load(hits, req.rid)
            self._dev[0] += len(hits) * self.row_bytes
            self._dev[1] += time.perf_counter() - t0
            self.report.chunks_loaded += len(hits)
        rest = keys[req.pos :]
        if rest:
            plan = tm.prepare_store(rest, req.rid)
            if plan is not None and plan.keys:
                t0 = time.perf_counter()
                for k, slot in zip(plan.keys, plan.slots):
                    self.rows[slot] = payload(k, self.row_bytes)
                tm.complete_store(plan.keys, True, req.rid)
                self._dev[2] += len(plan.keys) * self.row_bytes
                self._dev[3] += time.perf_counter() - t0
                self.report.chunks_stored += len(plan.keys)
        tm.on_request_finished(req.rid)
        self._latencies.append(time.monotonic() - req.t0)
        return True

    # -- the loop --------------------------------------------------------------------------------

    def run(
        self,
        workload: Workload,
        duration_s: float,
        concurrency: int,
        progress=None,
        stop_requested=lambda: False,
        injector=None,
    ) -> Report:
        tm = self.tm
        active: deque[_Request] = deque()
        n = 0
        t_start = time.monotonic()
        t_end = t_start + duration_s
        last_progress = 0.0
        rep = self.report
        while True:
            now = time.monotonic()
            stopping = now >= t_end or stop_requested()
            while not stopping and len(active) < concurrency:
                n += 1
                active.append(_Request(workload.next_request(), now, f"req-{n}"))
            if not active:
                break
            progressed = False
            for _ in range(len(active)):
                req = active.popleft()
                if self._advance(req, now):
                    rep.requests += 1
                    progressed = True
                    continue
                if now - req.t0 > self.hang_after_s:
                    rep.hung_requests += 1
                    tm.on_request_finished(req.rid)
                    continue
                active.append(req)
            tm.step()
            if injector is not None and not stopping:
                injector.tick(now)
            if not progressed and active:
                for tier in tm.tiers:
                    if tier.has_pending_work():
                        tier.wait(0.002)
                        break
            if progress is not None and now - last_progress >= 0.5:
                last_progress = now
                progress(self._snapshot(now - t_start, injector))
            if stopping and now > t_end + self.hang_after_s:
                rep.hung_requests += len(active)
                break
        rep.duration_s = time.monotonic() - t_start
        if not tm.wait_idle(self.hang_after_s):
            rep.hung_jobs = len(tm.jobs_in_flight())
        self._summarize()
        return rep

    def _snapshot(self, elapsed: float, injector=None) -> dict[str, Any]:
        st = self.tm.stats
        found = st.host_hits + sum(st.tier_hits.values())
        return {
            "elapsed_s": elapsed,
            "requests": self.report.requests,
            "hit_rate": found / st.host_queries if st.host_queries else 0.0,
            "tier_hits": dict(st.tier_hits),
            "loaded": self.report.chunks_loaded,
            "stored": self.report.chunks_stored,
            "corrupt": self.report.corrupt_loads,
            "failed": sum(st.failed.values()),
            "injected": dict(injector.injected) if injector is not None else {},
        }

    def _summarize(self) -> None:
        rep, tm, st = self.report, self.tm, self.tm.stats
        secs = max(rep.duration_s, 1e-9)
        rep.load_gbps = rep.chunks_loaded * self.row_bytes / secs / 1e9
        rep.store_gbps = rep.chunks_stored * self.row_bytes / secs / 1e9
        if self._latencies:
            q = np.quantile(np.array(self._latencies), [0.5, 0.9, 0.99])
            rep.latency_p50_s, rep.latency_p90_s, rep.latency_p99_s = (float(x) for x in q)
        found = st.host_hits + sum(st.tier_hits.values())
        rep.hit_rate = found / st.host_queries if st.host_queries else 0.0
        rep.tier_hit_rate = {HOST: st.host_hits / st.host_queries if st.host_queries else 0.0}
        for name in tm.tier_names:
            q = st.tier_queries[name]
            rep.tier_hit_rate[name] = st.tier_hits[name] / q if q else 0.0
        rep.tokens_from = {k: v * self.tokens_per_chunk for k, v in st.loads_from.items()}
        for tier in tm.tiers:
            c = tier.counters
            rep.tier_gbps[tier.name] = {
                "load": c.get("bytes_read", 0) / secs / 1e9,
                "store": c.get("bytes_written", 0) / secs / 1e9,
            }
            rep.worker_restarts[tier.name] = int(c.get(names.WORKER_RESTARTS, 0))
        failures: Counter[str] = Counter()
        for (tname, direction, reason), v in st.failed.items():
            failures[f"{tname}.{direction}.{reason}"] += v
        rep.failures = dict(failures)
        rep.refused = {f"{t}.{d}.{r}": v for (t, d, r), v in st.refused.items() if v}
        rep.dropped_stores = dict(st.dropped_stores)

    def close(self) -> None:
        self.tm.shutdown()
        self.arena.close()


def _print_summary(rep: Report, console) -> None:
    from rich.table import Table

    t = Table(title="kvoffload stress", show_header=True)
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [
        ("duration", f"{rep.duration_s:.1f} s"),
        ("requests", f"{rep.requests}"),
        ("chunk lookups", f"{rep.lookups}"),
        ("chunks loaded / stored", f"{rep.chunks_loaded} / {rep.chunks_stored}"),
        ("device<-host / device->host", f"{rep.load_gbps:.3f} / {rep.store_gbps:.3f} GB/s"),
        (
            "request latency p50/p90/p99",
            f"{rep.latency_p50_s * 1e3:.2f} / {rep.latency_p90_s * 1e3:.2f} / "
            f"{rep.latency_p99_s * 1e3:.2f} ms",
        ),
        ("hit rate", f"{rep.hit_rate:.3f}"),
    ]
    for name, r in rep.tier_hit_rate.items():
        rows.append((f"  {name} hit rate (of lookups reaching it)", f"{r:.3f}"))
    for name, g in rep.tier_gbps.items():
        rows.append((f"  {name} load / store", f"{g['load']:.3f} / {g['store']:.3f} GB/s"))
    rows.append(("tokens from", ", ".join(f"{k} {v}" for k, v in rep.tokens_from.items())))
    for k, v in sorted(rep.failures.items()):
        rows.append((f"failed chunks {k}", str(v)))
    for k, v in sorted(rep.refused.items()):
        rows.append((f"refused chunks {k}", str(v)))
    for k, v in rep.dropped_stores.items():
        if v:
            rows.append((f"dropped stores {k}", str(v)))
    for k, v in rep.worker_restarts.items():
        if v:
            rows.append((f"worker restarts {k}", str(v)))
    for k, v in sorted(rep.injected.items()):
        rows.append((f"injected {k}", str(v)))
    if rep.unexercised:
        rows.append(("injected, no effect seen", ", ".join(rep.unexercised)))
    for flag, series in rep.fault_metrics.items():
        rows.append((f"--{flag} on /metrics", "" if series else "[red]no metric shows it"))
        rows.extend((f"  {k}", f"{v:g}") for k, v in series.items())
    rows.append(
        ("corrupt loads", f"[{'red' if rep.corrupt_loads else 'green'}]{rep.corrupt_loads}")
    )
    rows.append(
        (
            "hung requests / jobs",
            f"[{'red' if rep.hung_requests or rep.hung_jobs else 'green'}]"
            f"{rep.hung_requests} / {rep.hung_jobs}",
        )
    )
    for r in rows:
        t.add_row(*r)
    console.print(t)
    for line in reason_notes(rep):
        console.print(line, highlight=False, soft_wrap=True)


def reason_notes(rep: Report) -> list[str]:
    """One line per failure or refusal reason the run counted: what it means and whether to act
    (:mod:`kvoffload.reasons`, the same words as docs/observability.md)."""
    from kvoffload.reasons import explain

    lines = []
    for refused, counted in ((False, rep.failures), (True, rep.refused)):
        what = "refused" if refused else "failed"
        for reason in sorted({k.rsplit(".", 1)[-1] for k in counted}):
            entry = explain(reason, refused)
            if entry is None:
                lines.append(f"{what} '{reason}': not in the catalogue (docs/observability.md)")
            else:
                lines.append(f"{what} '{reason}': {entry.meaning}. Action: {entry.action}.")
    return lines


def _bad_input(message: str):
    """Exit with status 2 (bad input), as click does for bad options."""
    e = click.ClickException(message)
    e.exit_code = 2
    raise e


def _live_view(s: dict[str, Any]):
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_row(
        f"[bold]{s['elapsed_s']:6.1f} s",
        f"requests {s['requests']}",
        f"hit rate {s['hit_rate']:.3f}",
        f"loaded {s['loaded']}",
        f"stored {s['stored']}",
        f"failed chunks {s['failed']}",
        f"corrupt loads [{'red' if s['corrupt'] else 'green'}]{s['corrupt']}",
    )
    if s["injected"]:
        t.add_row("injected", *[f"{k} {v}" for k, v in sorted(s["injected"].items())])
    return t


_AT_LEAST_ONE = click.IntRange(min=1)


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.File("r"),
    help="JSON file with the same content as vLLM's kv_connector_extra_config "
    "(default: 64 MiB host tier + fs tier of at most 2 GiB in a temporary directory).",
)
@click.option(
    "--duration",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds of load.",
)
@click.option(
    "--workload",
    type=click.Choice(["multiturn", "zipf", "random"]),
    default="multiturn",
    show_default=True,
)
@click.option(
    "--concurrency", default=8, show_default=True, type=_AT_LEAST_ONE, help="Requests in flight."
)
@click.option(
    "--chunk-kib", default=256, show_default=True, type=_AT_LEAST_ONE, help="KiB per chunk."
)
@click.option(
    "--turn-chunks",
    default=4,
    show_default=True,
    type=_AT_LEAST_ONE,
    help="multiturn: chunks added per turn.",
)
@click.option(
    "--conversations",
    default=32,
    show_default=True,
    type=_AT_LEAST_ONE,
    help="multiturn: live conversations.",
)
@click.option(
    "--documents",
    default=200,
    show_default=True,
    type=_AT_LEAST_ONE,
    help="zipf/random: distinct documents.",
)
@click.option(
    "--doc-chunks",
    default=16,
    show_default=True,
    type=_AT_LEAST_ONE,
    help="zipf/random: chunks per document.",
)
@click.option("--zipf-a", default=1.1, show_default=True, help="zipf: exponent.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--obj",
    "add_obj",
    is_flag=True,
    help="Add an obj tier on an S3-compatible server started in this process (moto).",
)
@click.option("--kill-workers", is_flag=True, help="SIGKILL a random tier worker every ~2 s.")
@click.option(
    "--corrupt",
    is_flag=True,
    help="Corrupt, truncate or delete a random stored chunk (file or object) every ~0.5 s.",
)
@click.option(
    "--fill-disk",
    is_flag=True,
    help="Run the fs tiers in a small tmpfs (root only) that a ballast file fills every ~6 s "
    "for 2 s, and until a store has met the full disk (at most 30 s).",
)
@click.option("--fill-disk-mib", default=128, show_default=True, help="--fill-disk: tmpfs size.")
@click.option(
    "--flaky-s3",
    is_flag=True,
    help="Obj tiers talk through a proxy injecting 503/500, delays, dropped connections and "
    "an outage every ~15 s: 3 s, and until the breaker has dropped a store (at most 30 s).",
)
@click.option(
    "--until-exercised",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="After --duration, go on until every injected fault has been seen to take effect "
    "(a worker replaced, a damaged chunk refused on load, a store meeting the full "
    "disk, S3 errors answered and the breaker dropping stores), for at most this many "
    "more seconds. What never took effect is listed as 'unexercised'.",
)
@click.option(
    "--hang-after",
    default=30.0,
    show_default=True,
    help="Seconds after which a waiting request or an unfinished job counts as hung.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port, printed).",
)
@click.option("--metrics-addr", default="127.0.0.1", show_default=True)
@click.option(
    "--events-endpoint",
    default=None,
    help="Publish KV events on this ZMQ endpoint (e.g. tcp://127.0.0.1:5557); overrides "
    "the config's kv_events.endpoint.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def stress(
    config_file,
    duration,
    workload,
    concurrency,
    chunk_kib,
    turn_chunks,
    conversations,
    documents,
    doc_chunks,
    zipf_a,
    seed,
    add_obj,
    kill_workers,
    corrupt,
    fill_disk,
    fill_disk_mib,
    flaky_s3,
    until_exercised,
    hang_after,
    metrics_port,
    metrics_addr,
    events_endpoint,
    as_json,
) -> None:
    """Run the tiering manager under generated load, verifying every load bit-exact.

    Exit status: 0 clean; 1 when a load was corrupt or a request or job hung; 2 on bad input (config,
    options, a port in use) or a fault that cannot be set up here.
    """
    import contextlib

    from rich.live import Live

    from kvoffload import logs, metrics
    from kvoffload.tools import stress_faults as sf

    os.environ.setdefault("KVOFFLOAD_LOG_LEVEL", "WARNING")  # injected faults would flood INFO
    logs.setup()
    err = stdout_console(stderr=True)  # a path in an error stays whole on a pipe
    stack = contextlib.ExitStack()
    run = injector = None
    evidence: dict[str, dict[str, float]] = {}
    proxies: dict[str, Any] = {}
    try:
        if config_file is not None:
            try:
                config = json.load(config_file)
            except json.JSONDecodeError as e:
                _bad_input(f"{config_file.name}: not JSON: {e}")
            except UnicodeDecodeError as e:
                _bad_input(f"{config_file.name}: not UTF-8 text (JSON): {e}")
            if not isinstance(config, dict):
                _bad_input(f"{config_file.name}: expected a JSON object")
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-stress-"))
            config = default_config(os.path.join(tmp, "fs"))
        config = json.loads(json.dumps(config))  # a private copy to adjust
        tiers = config.setdefault("secondary_tiers", [])
        if not isinstance(tiers, list):
            _bad_input("secondary_tiers: expected a list")
        if add_obj:
            require("stress --obj", "stress", modules=("moto",))
            from kvoffload.tools.s3_server import start_moto

            server, endpoint = start_moto()
            stack.callback(server.stop)
            import boto3

            boto3.client(
                "s3",
                endpoint_url=endpoint,
                aws_access_key_id="stress",
                aws_secret_access_key="stress-secret",
                region_name="us-east-1",
            ).create_bucket(Bucket="kvoffload-stress")
            tiers.append(
                {
                    "type": "obj",
                    "bucket": "kvoffload-stress",
                    "endpoint_override": endpoint,
                    "region": "us-east-1",
                    "access_key_id": "stress",
                    "secret_access_key": "stress-secret",
                }
            )
        if events_endpoint:
            config["kv_events"] = {**(config.get("kv_events") or {}), "endpoint": events_endpoint}
        fill_dir = None
        if fill_disk:
            fs_tiers = [t for t in tiers if isinstance(t, dict) and t.get("type") == "fs"]
            if not fs_tiers:
                _bad_input("--fill-disk needs an fs tier")
            try:
                fill_dir = stack.enter_context(sf.small_tmpfs(fill_disk_mib << 20))
            except sf.FaultError as e:
                _bad_input(str(e))
            for i, t in enumerate(
                fs_tiers
            ):  # the fs tiers move into the tmpfs, capped at half of it
                t["root_dir"] = os.path.join(fill_dir, f"tier{i}")
                given = t.get("max_bytes")
                t["max_bytes"] = min(
                    1 << 62 if given in (None, "unbounded") else int(given),
                    (fill_disk_mib << 20) // (2 * len(fs_tiers)),
                )
        upstreams: dict[str, str] = {}
        if flaky_s3:
            from kvoffload.tools.faultproxy import FaultProxy

            obj_tiers = [t for t in tiers if isinstance(t, dict) and t.get("type") == "obj"]
            if not obj_tiers:
                _bad_input("--flaky-s3 needs an obj tier (add --obj)")
            for t in obj_tiers:
                if not t.get("endpoint_override"):
                    _bad_input(
                        "--flaky-s3: an obj tier without endpoint_override (AWS S3) cannot be "
                        "put behind the fault proxy"
                    )
                proxy = FaultProxy(t["endpoint_override"], seed=seed)
                stack.callback(proxy.stop)
                name = t.get("name", "obj")
                proxies[name] = proxy
                upstreams[name] = t["endpoint_override"]
                t["endpoint_override"] = proxy.endpoint
        try:
            run = Stress(config, chunk_bytes=chunk_kib << 10, hang_after_s=hang_after)
        except (ConfigError, ArenaError) as e:  # a bad config, or a host tier /dev/shm cannot hold
            err.print(f"[red]kvoffload stress: {e}", highlight=False)
            sys.exit(2)
        for proxy in proxies.values():  # after the tier's start-up check of the bucket
            proxy.rules.extend(sf.flaky_rules())
        injector = sf.FaultInjector(
            run.tm,
            kill_workers=kill_workers,
            corrupt=corrupt,
            fill_disk_dir=fill_dir,
            proxies=proxies,
            upstreams=upstreams,
            seed=seed,
        )
        if metrics_port is not None:
            try:
                port = metrics.serve(metrics_port, metrics_addr)
            except OSError as e:
                _bad_input(
                    f"--metrics-port {metrics_port}: cannot serve on {metrics_addr}: "
                    f"{e.strerror or e}"
                )
            err.print(f"metrics on http://{metrics_addr}:{port}/metrics", highlight=False)
        if run.tm.publisher is not None:
            err.print(f"KV events on {run.tm.publisher.endpoint}", highlight=False)
        rng = np.random.default_rng(seed)
        wl = Workload(
            workload,
            rng,
            conversations=conversations,
            turn_chunks=turn_chunks,
            system_chunks=2,
            max_turns=max(1, math.ceil(64 / turn_chunks)),
            documents=documents,
            doc_chunks=doc_chunks,
            zipf_a=zipf_a,
        )
        stop = {"now": False}
        old = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(now=True))
        stack.callback(signal.signal, signal.SIGTERM, old)
        live = None
        if not as_json and err.is_terminal:
            live = stack.enter_context(Live(console=err, refresh_per_second=4, transient=True))
        progress = (lambda snap: live.update(_live_view(snap))) if live is not None else None
        t_begin = time.monotonic()

        def stop_requested() -> bool:
            if stop["now"]:
                return True
            return (
                until_exercised > 0
                and time.monotonic() - t_begin >= duration
                and not injector.unexercised()
            )

        try:
            rep = run.run(
                wl, duration + until_exercised, concurrency, progress, stop_requested, injector
            )
        except KeyboardInterrupt:
            rep = run.report
    finally:
        if injector is not None:
            unexercised = injector.unexercised()  # before close() folds the proxies' rules away
            if run is not None:
                evidence = injector.metric_evidence()  # before the manager leaves the registry
            injector.close()
        if run is not None:
            run.close()
        metrics.stop_serving()
        stack.close()
    rep.injected = dict(injector.injected)
    rep.unexercised = unexercised
    rep.fault_metrics = evidence
    # A fault that took effect (not in unexercised) must show on /metrics; one that never did (a
    # damaged chunk nobody loaded again) has nothing to show yet.
    rep.unmetered = [n for n, series in evidence.items() if not series and n not in unexercised]
    if as_json:
        out = {k: v for k, v in vars(rep).items()}
        out["ok"] = rep.ok
        click.echo(json.dumps(out, indent=2))
    else:
        _print_summary(rep, stdout_console())
    sys.exit(0 if rep.ok else 1)


main = stress

if __name__ == "__main__":
    stress()
