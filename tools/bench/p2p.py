"""p2p bulk transfers on loopback: READ throughput and per-chunk latency of the kvoffload transports
(``kvoffload.workers.p2p_transport``, NIXL and TCP) against a raw NIXL transfer and a plain TCP copy of
the same bytes, in the same run.

::

    this process (reader)                               serving process (spawned)
    token ─────────────── the session's data token ───▶ add_session, grant(every slot) -> digests
    arena R  ◀── Transport.read(pairs, digests) ─────── arena S + Transport (nixl | tcp)
    arena R  ◀── raw NIXL make_prepped_xfer READ ────── the same agent's registration of S
    arena R  ◀── socket recv_into (one stream) ──────── sendall(arena S rows)
    TieringManager + p2p tier  ◀── Lookup, Lease, READ, Release ── TieringManager + p2p tier
                                   (a second pair of processes: the whole tier, same chunks)

Throughput: transfers of ``batch`` chunks each until ``total_mib`` moved, repeated ``reps`` times
(median GB/s, 1 GB = 1e9 bytes). Latency: ``latency_n`` one-chunk transfers, one at a time, from the
call to the poll that sees it done (p50 / p99, microseconds). The tier row fetches the same number
of chunks through the whole p2p tier (:func:`tier_fetch`): from the reader's lookups to the last
chunk READY in its host tier, with the serving instance's locations already known.

What verification costs: every row a transport reads is checked against the digest its grant
returned (xxh3-128, ``p2p_transport.chunk_digest``). The "digests unchecked" row runs the same reads
in the same passes, alternating with the checked ones, with the reader's digest computation
replaced by a constant (:func:`_digests_unchecked`, this benchmark only): the pair's ratio is the
reader's cost of checking. The serving side's cost (one digest per chunk when it grants it, off the
transfer's path) is the "xxh3-128 digest" row: one core hashing the arena's rows. Run:
``python -m kvoffload.tools.bench.p2p [--chunk-kib 256 --chunk-kib 2048] [--ucx-tls tcp]``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import secrets
import select
import socket
import statistics
import struct
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import click
import numpy as np

from kvoffload.ipc.arena import Arena
from kvoffload.tiers.base import LookupResult
from kvoffload.tools.bench.harness import ends_process, p2p_tier_instance
from kvoffload.workers import p2p_transport as pt

_REQ = struct.Struct("<QQ")  # first slot, number of slots
_NO_DIGEST = bytes(pt.DIGEST_BYTES)


class _Unhashed:
    """Stands in for ``xxhash.xxh3_128`` in :func:`_digests_unchecked`."""

    def __init__(self, seed: int = 0):
        pass

    def update(self, data: Any) -> None:
        pass

    def digest(self) -> bytes:
        return _NO_DIGEST


@contextlib.contextmanager
def _digests_unchecked() -> Iterator[None]:
    """Within: this process's transports compute no digest of a row they read (every row "has"
    the zero digest, so reads pass zero digests). The benchmark's baseline for what checking costs;
    nothing else ever does this."""
    real = pt.xxhash
    pt.xxhash = types.SimpleNamespace(  # type: ignore[assignment]
        xxh3_128_digest=lambda row, seed=0: _NO_DIGEST, xxh3_128=_Unhashed
    )
    try:
        yield
    finally:
        pt.xxhash = real


def _raw_tcp_server(arena: Arena, sock: socket.socket) -> None:
    """Plain TCP copy baseline: per request, sendall the requested contiguous rows."""
    conn, _ = sock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = arena.memoryview().cast("B")
    row = arena.row_bytes
    with conn:
        while True:
            head = conn.recv(_REQ.size, socket.MSG_WAITALL)
            if len(head) < _REQ.size:
                return
            first, n = _REQ.unpack(head)
            conn.sendall(mv[first * row : (first + n) * row])


@ends_process
def _serve(kind: str, num_slots: int, row_bytes: int, conn: Any) -> None:
    """Serving process: owns arena S, runs a transport of ``kind`` (every slot granted to the
    reader's session for an hour) and the raw TCP server."""
    arena = Arena.create(f"kvoffload_benchp2p_s_{secrets.token_hex(4)}", num_slots, row_bytes)
    arena.rows[:] = np.random.default_rng(7).integers(0, 256, arena.rows.shape, dtype=np.uint8)
    transport = pt.make_transport(arena, pt.TransportConfig(kind=kind, deadline_s=60.0))
    token = conn.recv()
    transport.add_session(token)
    until = time.monotonic() + 3600
    digests = b"".join(
        transport.grant(gid, token, list(range(first, min(first + pt.MAX_PAIRS, num_slots))), until)
        for gid, first in enumerate(range(0, num_slots, pt.MAX_PAIRS), 1)
    )
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_tcp_server, args=(arena, raw), daemon=True).start()
    conn.send((transport.descriptor(), raw.getsockname()[1], digests))
    conn.recv()  # until the reader is done
    transport.close()
    raw.close()
    arena.close()


def _bench_keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") + b"kvoffload-bench-p2p-key!" for i in range(n)]


@ends_process
def _serve_tier(
    kind: str,
    num_slots: int,
    row_bytes: int,
    secret: str,
    conn: Any,
    worker_nice: int | None = None,
) -> None:
    """Serving instance: an arena whose every slot holds a chunk, served by its p2p tier."""
    arena, tm = p2p_tier_instance(kind, num_slots, row_bytes, [], secret, worker_nice)
    keys = _bench_keys(num_slots)
    plan = tm.prepare_store(keys)
    assert plan is not None and len(plan.keys) == num_slots
    arena.rows[:] = np.random.default_rng(8).integers(0, 256, arena.rows.shape, dtype=np.uint8)
    tm.complete_store(plan.keys, True)
    conn.send(tm.tiers[0].advertise)
    conn.recv()  # until the reader is done
    tm.shutdown()
    arena.close()


@contextlib.contextmanager
def tier_pair(
    kind: str, chunk_bytes: int, num_slots: int, worker_nice: int | None = None
) -> Iterator[tuple[Any, list[bytes], int]]:
    """Two instances on loopback, their p2p tiers' session up: a serving one (spawned) whose
    host tier holds ``num_slots`` chunks of ``chunk_bytes``, and a reader here whose p2p tier
    names it; both peer workers at ``worker_nice`` (None: the tier's default). Yields the
    reader's TieringManager, the chunks' keys and the serving process's pid; both end after.

    Raises:
        RuntimeError: the session did not come up within 120 s.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    secret = secrets.token_hex(32)
    server = ctx.Process(
        target=_serve_tier, args=(kind, num_slots, chunk_bytes, secret, child, worker_nice)
    )
    server.start()
    arena = tm = None
    try:
        addr = parent.recv()
        arena, tm = p2p_tier_instance(kind, num_slots, chunk_bytes, [addr], secret, worker_nice)
        tier = tm.tiers[0]
        deadline = time.monotonic() + 120
        while not tier.peers_up():  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise RuntimeError("the reader's session with the serving instance never came up")
            time.sleep(0.01)
        yield tm, _bench_keys(num_slots), server.pid
    finally:
        if tm is not None:
            tm.shutdown()
        if arena is not None:
            arena.close()
        parent.send("done")
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
            server.join()


def tier_fetch(
    kind: str,
    chunk_bytes: int,
    num_slots: int,
    reps: int,
    latency_n: int,
    worker_nice: int | None = None,
) -> dict:
    """The whole p2p tier on loopback: chunks fetched through two instances' tiering managers
    (lookup at the peer, lease, the peer worker's READ into reserved host slots, release), timed
    from the lookups to the last chunk READY in the reader's host tier; both peer workers at
    ``worker_nice`` (None: the tier's default)."""
    with tier_pair(kind, chunk_bytes, num_slots, worker_nice) as (tm, keys, _pid):
        host = tm.host

        def fetch(ks: list[bytes]) -> None:
            pending = list(ks)
            while pending:
                res = [tm.lookup(k, "bench") for k in pending]
                tm.step()
                pending = [k for k, r in zip(pending, res) if r is not LookupResult.HIT]
                if any(r is LookupResult.MISS for r in res):
                    raise RuntimeError("a chunk the serving instance holds was not found")
                time.sleep(0)
            host.remove(ks)  # the next pass fetches them again

        fetch(keys)  # learns where every key is (one Lookup round trip), moves them once
        gbps = _measure(lambda: fetch(keys), num_slots * chunk_bytes, reps)
        p50, p99 = _latency(lambda: fetch(keys[:1]), latency_n)
        return _row(f"kvoffload p2p tier ({kind})", chunk_bytes, gbps, p50, p99)


def _wait(transport: pt.Transport, handle: int) -> None:
    """Until transfer ``handle`` is over, as a peer worker waits: asleep on the transport's
    wake-up (signalled when a transfer's outcome is ready), looking at least every millisecond."""
    while (st := transport.poll(handle)).state is pt.TransferState.PENDING or not st.settled:
        select.select([transport.fileno()], [], [], 0.001)
        transport.clear_wakeup()
    if st.state is not pt.TransferState.DONE:
        raise RuntimeError(f"transfer failed: {st.reason}")


def _measure(fn, nbytes: int, reps: int) -> float:
    """Median GB/s of ``reps`` calls of ``fn`` that each move ``nbytes``."""
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _measure_pair(fn_a, fn_b, nbytes: int, reps: int) -> tuple[float, float]:
    """Median GB/s of ``fn_a`` and of ``fn_b`` (each moving ``nbytes``), run in turn ``reps``
    times each, so that both see the same machine, after one untimed call of each (the first
    touches the destination's pages)."""
    fn_a()
    fn_b()
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        a.append(_measure(fn_a, nbytes, 1))
        b.append(_measure(fn_b, nbytes, 1))
    return statistics.median(a), statistics.median(b)


def digest_row(chunk_bytes: int, num_slots: int, reps: int) -> dict:
    """One core computing :func:`~kvoffload.workers.p2p_transport.chunk_digest` of ``num_slots``
    rows of ``chunk_bytes``: what the serving side spends per chunk it grants."""
    arena = Arena.create(f"kvoffload_benchp2p_d_{secrets.token_hex(4)}", num_slots, chunk_bytes)
    try:
        arena.rows[:] = np.random.default_rng(9).integers(0, 256, arena.rows.shape, dtype=np.uint8)
        slots = range(num_slots)
        gbps = _measure(lambda: pt.rows_digests(arena, slots, 1), num_slots * chunk_bytes, reps)
        per_chunk_us = chunk_bytes / (gbps * 1e9) * 1e6
        return _row("xxh3-128 digest (1 core)", chunk_bytes, gbps, per_chunk_us, per_chunk_us)
    finally:
        arena.close()


def _latency(fn, n: int) -> tuple[float, float]:
    """p50 and p99 in microseconds of ``n`` calls of ``fn`` (one chunk each)."""
    fn()  # connection set-up is not a chunk's latency
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def run_one(kind: str, chunk_bytes: int, total_mib: int, batch: int, reps: int, latency_n: int):
    """Measure one transport kind at one chunk size; returns rows for the report table."""
    num_slots = max(batch, (total_mib << 20) // chunk_bytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(kind, num_slots, chunk_bytes, child))
    server.start()
    rows: list[dict] = []
    local = Arena.create(f"kvoffload_benchp2p_r_{secrets.token_hex(4)}", num_slots, chunk_bytes)
    try:
        token = secrets.token_bytes(pt.TOKEN_BYTES)
        parent.send(token)
        desc, raw_port, digests = parent.recv()
        transport = pt.make_transport(local, pt.TransportConfig(kind=kind, deadline_s=60.0))
        transport.add_peer("s", desc, token)
        nbytes = num_slots * chunk_bytes
        batches = [list(range(i, min(i + batch, num_slots))) for i in range(0, num_slots, batch)]
        D = pt.DIGEST_BYTES

        def kv_read_all() -> None:
            handles = [
                transport.read(
                    "s",
                    [(s, s) for s in b],
                    digests=digests[b[0] * D : (b[-1] + 1) * D],
                )
                for b in batches
            ]
            for h in handles:
                _wait(transport, h)

        def kv_read_all_unchecked() -> None:
            with _digests_unchecked():
                handles = [
                    transport.read("s", [(s, s) for s in b], digests=_NO_DIGEST * len(b))
                    for b in batches
                ]
                for h in handles:
                    _wait(transport, h)

        def kv_read_one() -> None:
            _wait(transport, transport.read("s", [(0, 1)], digests=digests[:D]))

        gbps, unchecked = _measure_pair(kv_read_all, kv_read_all_unchecked, nbytes, reps)
        p50, p99 = _latency(kv_read_one, latency_n)
        row = _row(f"kvoffload {kind}", chunk_bytes, gbps, p50, p99)
        row["verify_cost_pct"] = round(100 * (1 - gbps / unchecked), 1)
        rows.append(row)
        rows.append(_row(f"kvoffload {kind}, digests unchecked", chunk_bytes, unchecked))

        if kind == "nixl":
            assert isinstance(transport, pt.NixlTransport)
            agent = transport.agent
            peer = transport._peers["s"]
            local_side, remote_side = transport._local_side, peer.remote_side

            def raw_nixl(indices: list[list[int]]) -> None:
                hs = [
                    agent.make_prepped_xfer("READ", local_side, b, remote_side, b) for b in indices
                ]
                for h in hs:
                    agent.transfer(h)
                for h in hs:
                    while (state := agent.check_xfer_state(h)) == "PROC":
                        pass
                    if state != "DONE":
                        raise RuntimeError("raw NIXL transfer failed")
                    agent.release_xfer_handle(h)

            gbps = _measure(lambda: raw_nixl(batches), nbytes, reps)
            p50, p99 = _latency(lambda: raw_nixl([[0]]), latency_n)
            rows.append(_row("raw NIXL", chunk_bytes, gbps, p50, p99))
        else:
            sock = socket.create_connection(("127.0.0.1", raw_port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mv = local.memoryview().cast("B")

            def raw_tcp(first: int, n: int) -> None:
                sock.sendall(_REQ.pack(first, n))
                view = mv[first * chunk_bytes : (first + n) * chunk_bytes]
                got = 0
                while got < len(view):
                    got += sock.recv_into(view[got:])

            def raw_tcp_all() -> None:
                for b in batches:
                    raw_tcp(b[0], len(b))

            gbps = _measure(raw_tcp_all, nbytes, reps)
            p50, p99 = _latency(lambda: raw_tcp(0, 1), latency_n)
            rows.append(_row("plain TCP copy", chunk_bytes, gbps, p50, p99))
            sock.close()
        transport.close()
    finally:
        parent.send("done")
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
            server.join()
        local.close()
    return rows


def _row(
    what: str, chunk_bytes: int, gbps: float, p50: float | None = None, p99: float | None = None
) -> dict:
    """A report row; a path whose latency was not measured has None there."""
    return {
        "path": what,
        "chunk_kib": chunk_bytes // 1024,
        "read_gbps": round(gbps, 3),
        "chunk_p50_us": None if p50 is None else round(p50, 1),
        "chunk_p99_us": None if p99 is None else round(p99, 1),
    }


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def run(
    chunk_kib: tuple[int, ...] = (256, 2048),
    kinds: tuple[str, ...] = ("nixl", "tcp"),
    total_mib: int = 256,
    batch_mib: int = 16,
    reps: int = 5,
    latency_n: int = 200,
    worker_nice: int | None = None,
) -> list[dict]:
    """Every (kind, chunk size) measurement; NIXL is left out, with a note, when it cannot import.
    The whole tier's peer workers run at ``worker_nice`` (None: the tier's default)."""
    out: list[dict] = []
    for kib in chunk_kib:
        for kind in kinds:
            if kind == "nixl" and (why := pt.nixl_available()):
                out.append({"path": "kvoffload nixl", "chunk_kib": kib, "skipped": why})
                continue
            batch = max(1, (batch_mib << 10) // kib)
            out.extend(run_one(kind, kib * 1024, total_mib, batch, reps, latency_n))
            num_slots = max(batch, (total_mib << 10) // kib)
            out.append(tier_fetch(kind, kib * 1024, num_slots, reps, latency_n, worker_nice))
        out.append(digest_row(kib * 1024, max(1, (total_mib << 10) // kib), reps))
    return out


@click.command("p2p")
@click.option("--chunk-kib", multiple=True, type=int, default=(256, 2048), show_default=True)
@click.option("--kind", "kinds", multiple=True, default=("nixl", "tcp"), show_default=True)
@click.option("--total-mib", default=256, show_default=True, help="bytes per throughput pass")
@click.option("--batch-mib", default=16, show_default=True, help="bytes per transfer")
@click.option("--reps", default=5, show_default=True)
@click.option("--latency-n", default=200, show_default=True, help="one-chunk transfers timed")
@click.option("--ucx-tls", default="", help="UCX_TLS for both processes (e.g. tcp); default UCX's")
@click.option(
    "--worker-nice",
    type=click.IntRange(0, 19),
    default=None,
    help="the whole tier's peer workers' niceness (default: the tier's, 10)",
)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@ends_process
def main(
    chunk_kib, kinds, total_mib, batch_mib, reps, latency_n, ucx_tls, worker_nice, json_out
) -> None:
    """p2p READ throughput and per-chunk latency on loopback, with raw baselines."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls  # read by UCX when each process creates its agent
    rows = run(tuple(chunk_kib), tuple(kinds), total_mib, batch_mib, reps, latency_n, worker_nice)
    click.echo(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    click.echo(
        f"{'path':<36} {'chunk':>7} {'GB/s':>7} {'p50 us':>9} {'p99 us':>9} {'verify cost':>12}"
    )
    for r in rows:
        if "skipped" in r:
            click.echo(f"{r['path']:<36} {r['chunk_kib']:>5}Ki  skipped: {r['skipped']}")
            continue
        cost = f"{r['verify_cost_pct']:>11.1f}%" if "verify_cost_pct" in r else ""
        click.echo(
            f"{r['path']:<36} {r['chunk_kib']:>5}Ki {r['read_gbps']:>7.3f} "
            f"{_us(r['chunk_p50_us']):>9} {_us(r['chunk_p99_us']):>9} {cost:>12}"
        )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(
                {"ucx_tls": ucx_tls or "default", "load_average": os.getloadavg(), "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
