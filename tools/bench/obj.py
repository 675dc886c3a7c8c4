"""``kvoffload bench obj``: obj-tier store/load throughput against plain boto3 put/get of objects of
the same size with the same concurrency, against a nanio server on loopback or a given endpoint.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tools.bench.harness import (
    arena_name,
    bench_namespace,
    load_all,
    make_workdir,
    print_header,
)
from kvoffload.tools.extras import require


def obj_throughput(
    chunk_bytes: int,
    total_bytes: int,
    endpoint: str,
    bucket: str,
    creds: dict,
    reps: int,
    io_workers: int,
    io_threads: int,
) -> dict:
    """obj-tier store/load GB/s against plain boto3 put_object/get_object of objects of the same
    size with the same concurrency (``io_workers * io_threads`` threads), interleaved."""
    from concurrent.futures import ThreadPoolExecutor

    from kvoffload.workers.chunkfile import HEADER_BYTES
    from kvoffload.workers.obj_io import ObjIOConfig, make_client

    n = total_bytes // chunk_bytes
    tier = {
        "type": "obj",
        "bucket": bucket,
        "endpoint_override": endpoint,
        "addressing_style": "path",
        "io_workers": io_workers,
        "io_threads": io_threads,
        "max_pending_store_chunks": n + 1,
        **creds,
    }
    arena = Arena.create(arena_name("obj"), n, chunk_bytes)
    rng = np.random.default_rng(0)
    arena.rows[:] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    for i in range(n):
        arena.rows[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    body = bytes(HEADER_BYTES) + arena.rows[0].tobytes()
    s3 = make_client(
        ObjIOConfig(
            bucket=bucket,
            namespace_id="00",
            row_bytes=chunk_bytes,
            endpoint_url=endpoint,
            addressing_style="path",
            max_connections=io_workers * io_threads + 2,
            **{k: v for k, v in creds.items()},
        )
    )
    threads = io_workers * io_threads
    res = {"boto3_put": [], "store": [], "boto3_get": [], "load": []}
    try:
        for rep in range(reps):
            names = [f"bench-boto3/{rep}/{i}" for i in range(n)]
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=body), names))
                res["boto3_put"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                list(pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), names))
                res["boto3_get"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
            cfg = parse_config(
                {
                    "cpu_bytes_to_use": n * chunk_bytes,
                    "secondary_tiers": [{**tier, "prefix": f"bench-tier/{rep}"}],
                }
            )
            tm = TieringManager(arena, bench_namespace(chunk_bytes), cfg)
            try:
                assert tm.wait_workers_ready(600), "obj tier workers did not start"
                keys = chunk_keys(np.arange(n * 16) + rep * 10**7, 16)
                plan = tm.prepare_store(keys)
                assert plan is not None and len(plan.keys) == n
                t0 = time.perf_counter()
                tm.complete_store(keys)
                assert tm.wait_idle(600)
                res["store"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.cascaded["obj"] == n, tm.stats.cascaded
                tm.host.remove(keys)
                t0 = time.perf_counter()
                load_all(tm, keys)
                res["load"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
                assert tm.stats.promotion_failures["obj"] == 0
                tm.host.remove(keys)
            finally:
                tm.shutdown()
    finally:
        arena.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "chunk_bytes": chunk_bytes,
        **med,
        "store_ratio": med["store"] / med["boto3_put"],
        "load_ratio": med["load"] / med["boto3_get"],
        "runs": res,
    }


@click.command("obj")
@click.option(
    "--endpoint",
    default=None,
    help="S3-compatible endpoint (credentials from the boto3 "
    "chain); default: a nanio server on loopback with its data on this disk.",
)
@click.option("--bucket", default="kvoffload-bench", show_default=True)
@click.option(
    "--chunk-kib", "chunk_kib", multiple=True, type=int, default=(256, 2048), show_default=True
)
@click.option("--total-mib", default=256, show_default=True)
@click.option("--reps", default=3, show_default=True)
@click.option("--io-workers", default=2, show_default=True)
@click.option("--io-threads", default=8, show_default=True)
def bench_obj(endpoint, bucket, chunk_kib, total_mib, reps, io_workers, io_threads) -> None:
    """obj-tier store/load GB/s against plain boto3 put/get of the same objects."""
    if endpoint is None:
        require("bench obj", "bench", modules=("nanio",))
    from kvoffload.tools.s3_server import Nanio

    wd = make_workdir(None)
    server = None
    creds: dict = {}
    if endpoint is None:
        creds = {
            "access_key_id": "bench",
            "secret_access_key": "bench-secret-0123456789",
            "region": "us-east-1",
        }
        server = Nanio(str(wd / "nanio"), creds["access_key_id"], creds["secret_access_key"])
        endpoint = server.endpoint
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=creds["access_key_id"],
            aws_secret_access_key=creds["secret_access_key"],
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
    print_header()
    click.echo(f"endpoint: {'nanio on loopback (data on this disk)' if server else endpoint}")
    click.echo(
        "\n| object | boto3 put GB/s | store GB/s | store / boto3 | boto3 get GB/s | load GB/s | "
        "load / boto3 |\n|---|---|---|---|---|---|---|"
    )
    try:
        for kib in chunk_kib:
            r = obj_throughput(
                kib << 10, total_mib << 20, endpoint, bucket, creds, reps, io_workers, io_threads
            )
            click.echo(
                f"| {kib} KiB | {r['boto3_put']:.2f} | {r['store']:.2f} | "
                f"{r['store_ratio']:.2f}x | {r['boto3_get']:.2f} | {r['load']:.2f} | "
                f"{r['load_ratio']:.2f}x |"
            )
            click.echo(f"<!-- runs {json.dumps(r['runs'])} -->", err=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(wd, ignore_errors=True)
