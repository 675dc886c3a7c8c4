"""``kvoffload bench integrity``: what an integrity key (``integrity_key_env``, CASES C43) costs
the fs tier: stores and loads of the same chunks through a real fs tier without and with a key,
repetitions interleaved in one run, and the MAC alone (HMAC-SHA256 against keyed BLAKE2b) on one
core. With ``--encryption``, the same against encryption at rest (``encryption_key_env``:
AES-256-GCM in the workers) instead of the key, and the cipher alone.

The tier runs with ``direct_io: none`` by default, on the directory given (``/dev/shm`` keeps the
disk out of it): the MAC is CPU work, one more pass over each chunk when it is stored and when it
is loaded, and a disk's noise would hide it. Stores are timed from the hand-off to the last chunk
written, loads from the first lookup to the last chunk readable in the host tier; every loaded
chunk is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import (
    Payloads,
    arena_name,
    bench_namespace,
    load_all,
    make_workdir,
    print_header,
)

KEY_ENV = "KVOFFLOAD_BENCH_INTEGRITY_KEY"
ENCRYPTION_ENV = "KVOFFLOAD_BENCH_ENCRYPTION_KEY"


def store_and_load(
    arena: Arena,
    payloads: Payloads,
    root: Path,
    keyed: bool,
    direct_io: str,
    encrypted: bool = False,
) -> tuple[float, float]:
    """Seconds to store every row of ``arena`` through a fresh fs tier at ``root`` and to load
    them all back (``keyed``: with ``integrity_key_env``; ``encrypted``: with
    ``encryption_key_env``)."""
    n, row_bytes = arena.num_slots, arena.row_bytes
    extra: dict[str, str] = {"integrity_key_env": KEY_ENV} if keyed else {}
    if encrypted:
        extra["encryption_key_env"] = ENCRYPTION_ENV
    cfg = parse_config(
        {
            "cpu_bytes_to_use": n * row_bytes,
            "secondary_tiers": [
                scratch_fs_tier(
                    str(root), direct_io=direct_io, max_pending_store_chunks=n + 1, **extra
                )
            ],
        }
    )
    keys = chunk_keys(np.arange(n * 16), 16)
    shutil.rmtree(root, ignore_errors=True)
    tm = TieringManager(arena, bench_namespace(row_bytes), cfg)
    try:
        assert tm.wait_workers_ready(600), "fs tier workers did not start"
        plan = tm.prepare_store(keys)
        assert plan is not None and len(plan.keys) == n
        payloads.fill(arena.rows, plan.slots)
        t0 = time.perf_counter()
        tm.complete_store(keys)
        assert tm.wait_idle(600)
        store_s = time.perf_counter() - t0
        assert tm.stats.cascaded["fs"] == n
        tm.host.remove(keys)
        arena.rows[:] = 0
        t0 = time.perf_counter()
        load_all(tm, keys)
        load_s = time.perf_counter() - t0
        assert tm.stats.promotion_failures["fs"] == 0
        slots = tm.prepare_load(keys, "bench")
        assert all(payloads.check(arena.rows[s], i) for i, s in enumerate(slots))
        tm.complete_load(keys, "bench")
    finally:
        tm.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return store_s, load_s


def mac_alone(nbytes: int, reps: int = 20) -> dict[str, float]:
    """Milliseconds (best of ``reps``) to MAC ``nbytes`` on one core: HMAC-SHA256 (what the tiers
    use) and keyed BLAKE2b (the alternative), with xxh3-64 (the unkeyed checksum) for scale."""
    import xxhash

    data = os.urandom(nbytes)
    key = os.urandom(32)
    fns = {
        "hmac_sha256": lambda: hmac.new(key, data, hashlib.sha256).digest(),
        "blake2b_keyed": lambda: hashlib.blake2b(data, key=key).digest(),
        "xxh3_64": lambda: xxhash.xxh3_64_intdigest(data),
    }
    return _best_ms(fns, reps)


def _best_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Milliseconds, best of ``reps`` after one warm-up call, of each of ``fns`` by name."""
    out = {}
    for name, fn in fns.items():
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = best * 1e3
    return out


def cipher_alone(nbytes: int, reps: int = 20) -> dict[str, float]:
    """Milliseconds (best of ``reps``) to encrypt and to decrypt ``nbytes`` on one core as the
    workers do (AES-256-GCM into a buffer under a key derived for the chunk,
    :class:`~kvoffload.workers.chunkseal.Sealer`), and to derive a chunk's key and cipher alone
    (``derive``: what a chunk pays besides the cipher's pass over its bytes)."""
    import mmap

    from kvoffload.workers.chunkseal import SALT_BYTES, TAG_BYTES, Sealer

    sealer = Sealer(os.urandom(32), "0" * 32)
    src = memoryview(bytearray(os.urandom(nbytes)))
    sealed = memoryview(mmap.mmap(-1, nbytes + TAG_BYTES))
    dst = memoryview(bytearray(nbytes))
    record = b""

    def enc() -> None:
        nonlocal record
        record = sealer.seal(b"k" * 20, src, sealed)

    def dec() -> None:
        assert sealer.open(b"k" * 20, record, sealed, dst)

    def derive() -> None:
        sealer._aead(os.urandom(SALT_BYTES))

    return _best_ms({"encrypt": enc, "decrypt": dec, "derive": derive}, reps)


@click.command("integrity")
@click.option(
    "--chunk-kib", "chunk_kib", multiple=True, type=int, default=(256, 2048), show_default=True
)
@click.option("--total-mib", default=256, show_default=True, help="Bytes moved per measurement.")
@click.option("--reps", default=5, show_default=True, help="Interleaved repetitions (medians).")
@click.option(
    "--direct-io",
    default="none",
    show_default=True,
    type=click.Choice(["none", "writes", "reads", "both"]),
)
@click.option(
    "--dir",
    "workdir",
    default=None,
    help="Directory for the tier's root (default: a new directory under the current one; "
    "/dev/shm keeps the disk out of the figures).",
)
@click.option(
    "--encryption",
    is_flag=True,
    help="Measure encryption at rest (encryption_key_env) against none instead of the key.",
)
def bench_integrity(chunk_kib, total_mib, reps, direct_io, workdir, encryption) -> None:
    """fs tier store/load GB/s with an integrity key (or, --encryption, encryption at rest)
    against without, and the MAC (or the cipher) alone."""
    os.environ[KEY_ENV] = secrets.token_hex(32)  # the workers inherit them; never printed
    os.environ[ENCRYPTION_ENV] = secrets.token_hex(32)
    wd = make_workdir(workdir)
    print_header()
    load1, _, _ = os.getloadavg()
    click.echo(f"load average at start: {load1:.2f}")
    on, off = ("encrypted", "plain") if encryption else ("key", "no key")
    click.echo(
        f"\n| chunk | store GB/s, {off} | store GB/s, {on} | {on} / {off} | load GB/s, {off} | "
        f"load GB/s, {on} | {on} / {off} |\n|---|---|---|---|---|---|---|"
    )
    try:
        for kib in chunk_kib:
            row_bytes = kib << 10
            n = max(1, (total_mib << 20) // row_bytes)
            payloads = Payloads(n, row_bytes)
            runs: dict[tuple[bool, str], list[float]] = {}
            with Arena.create(arena_name("integrity"), n, row_bytes) as arena:
                for _ in range(reps):
                    for keyed in (False, True):
                        store_s, load_s = store_and_load(
                            arena,
                            payloads,
                            wd / "fs",
                            keyed and not encryption,
                            direct_io,
                            encrypted=keyed and encryption,
                        )
                        runs.setdefault((keyed, "store"), []).append(n * row_bytes / store_s / 1e9)
                        runs.setdefault((keyed, "load"), []).append(n * row_bytes / load_s / 1e9)
            med = {k: statistics.median(v) for k, v in runs.items()}
            click.echo(
                f"| {kib} KiB | {med[False, 'store']:.2f} | {med[True, 'store']:.2f} | "
                f"{med[True, 'store'] / med[False, 'store']:.2f}x | {med[False, 'load']:.2f} | "
                f"{med[True, 'load']:.2f} | {med[True, 'load'] / med[False, 'load']:.2f}x |"
            )
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    load1, _, _ = os.getloadavg()
    click.echo(f"load average at the end: {load1:.2f}")
    if encryption:
        click.echo(
            "\nThe cipher alone, one core (ms, best of 20; encrypt and decrypt include the "
            "chunk's key derivation):\n\n| chunk | AES-256-GCM encrypt | AES-256-GCM decrypt | "
            "key derivation |\n|---|---|---|---|"
        )
        for kib in chunk_kib:
            c = cipher_alone(kib << 10)
            click.echo(
                f"| {kib} KiB | {c['encrypt']:.3f} | {c['decrypt']:.3f} | {c['derive']:.4f} |"
            )
        return
    click.echo(
        "\nThe MAC alone, one core (ms, best of 20):\n\n| chunk | HMAC-SHA256 | keyed BLAKE2b | "
        "xxh3-64 |\n|---|---|---|---|"
    )
    for kib in chunk_kib:
        t = mac_alone(kib << 10)
        click.echo(
            f"| {kib} KiB | {t['hmac_sha256']:.3f} | {t['blake2b_keyed']:.3f} | "
            f"{t['xxh3_64']:.3f} |"
        )
