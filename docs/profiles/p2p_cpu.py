"""Where the whole p2p tier's CPU goes (BENCHMARKS.md §10e, issue 26 item 1).

Two instances on loopback as ``kvoffload bench p2p``'s tier row builds them (a serving process
whose host tier holds every chunk, a reader whose tiering manager fetches them through its p2p
tier), then CPU seconds per GB moved of each process over the timed passes (psutil, user +
system): the reader's engine process (and its busiest threads), its peer worker, the serving
engine process and its peer worker.

    python docs/profiles/p2p_cpu.py --kind nixl --chunk-kib 256 --chunks 512 --passes 8
    python docs/profiles/p2p_cpu.py ... --step-s 0.001   # the reader's loop sleeps between steps

``--step-s 0`` (the default) is the bench's loop: it asks again without pause, as vLLM's engine core
steps while a request waits for KV.
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil

from kvoffload.tiers.base import LookupResult
from kvoffload.tools.bench import p2p


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _threads(p: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in p.threads()}


def run(kind: str, chunk_bytes: int, num_slots: int, passes: int, step_s: float) -> None:
    """Fetch ``num_slots`` chunks of ``chunk_bytes`` bytes through the ``kind`` (``nixl`` or
    ``tcp``) p2p tier ``passes`` times, the reader's loop sleeping ``step_s`` seconds per step;
    print GB/s and each process's CPU seconds per GB moved."""
    with p2p.tier_pair(kind, chunk_bytes, num_slots) as (tm, keys, server_pid):

        def fetch() -> None:
            pending = list(keys)
            while pending:
                res = [tm.lookup(k, "bench") for k in pending]
                tm.step()
                pending = [k for k, r in zip(pending, res) if r is not LookupResult.HIT]
                time.sleep(step_s)
            tm.host.remove(keys)

        fetch()  # learns where every key is
        me, srv = psutil.Process(), psutil.Process(server_pid)
        procs = {
            "reader engine process": me,
            "reader peer worker": psutil.Process(tm.tiers[0].worker_pid),
            "serving engine process": srv,
        }
        for c in srv.children(recursive=True):
            if "p2p_worker" in " ".join(c.cmdline()):
                procs["serving peer worker"] = c
        c0, th0 = {k: _cpu(p) for k, p in procs.items()}, _threads(me)
        t0 = time.perf_counter()
        for _ in range(passes):
            fetch()
        wall = time.perf_counter() - t0
        c1, th1 = {k: _cpu(p) for k, p in procs.items()}, _threads(me)
    gb = passes * num_slots * chunk_bytes / 1e9
    print(f"{kind}, {chunk_bytes >> 10} KiB chunks, step {step_s} s: {gb / wall:.2f} GB/s")
    total = 0.0
    for k in procs:
        d = (c1[k] - c0[k]) / gb
        total += d
        print(f"  {k:24s} {d:.3f} CPU s/GB")
    print(f"  {'total':24s} {total:.3f} CPU s/GB ({total * gb / wall:.2f} cores busy)")
    main = threading.main_thread().native_id
    for tid, v in sorted(th1.items(), key=lambda kv: kv[1] - th0.get(kv[0], 0.0), reverse=True):
        d = (v - th0.get(tid, 0.0)) / gb
        if d >= 0.01:
            print(f"    reader thread {tid}{' (main)' if tid == main else ''}: {d:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.0)
    a = ap.parse_args()
    run(a.kind, a.chunk_kib * 1024, a.chunks, a.passes, a.step_s)
