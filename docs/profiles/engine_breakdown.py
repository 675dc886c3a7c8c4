"""Engine-thread CPU per job of ``kvoffload bench engine``'s flows, by function (inclusive).

Wraps the engine-side functions a job goes through (tiering manager, fs tier manager, host
tier, channels, ``zmq.Socket.send``) with ``time.thread_time`` brackets and runs the bench's
own flows (``tools/bench/engine.py``: fs tier with real worker processes, host tier full,
1 ms of pure-Python work between steps). Each bracket costs two clock readings (a system call
here, ~0.3-1 µs), so the figures are inflated by about 1 µs per call listed and a function's
figure includes its callees' brackets: read them as where the time goes, not as the bench's
totals. Used for docs/profiles/engine.md, section 6::

    PYTHONPATH=. python docs/profiles/engine_breakdown.py --job-chunks 1
    PYTHONPATH=. python docs/profiles/engine_breakdown.py --job-chunks 64
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import zmq

from kvoffload import host as H
from kvoffload import tiering as T
from kvoffload.ipc import channels as C
from kvoffload.ipc.arena import Arena
from kvoffload.tiers import process as P
from kvoffload.tools.bench import engine as E
from kvoffload.tools.bench.harness import calibrate

_clock = time.thread_time
_spent: dict[tuple[str, str], float] = defaultdict(float)
_calls: dict[tuple[str, str], int] = defaultdict(int)
_flow = ["-"]

_WRAPPED = (
    (
        T.TieringManager,
        "TieringManager",
        ("poll", "step", "lookup", "prepare_store", "complete_store", "write_through",
         "submit_promotions", "_start_promotion", "prepare_load", "complete_load"),
    ),
    (
        P.ProcessTierManager,
        "ProcessTierManager",
        ("get_finished_jobs", "submit_store", "submit_load", "_send", "flush", "_on_result",
         "_apply", "_finish"),
    ),
    (H.HostTier, "HostTier", ("allocate", "complete_write", "unpin_slots")),
    (C.TierChannels, "TierChannels", ("send_task", "recv_results")),
    (zmq.Socket, "zmq.Socket", ("send",)),
)  # fmt: skip


def _wrap(owner: type, label: str) -> None:
    f = getattr(owner, label.rsplit(".", 1)[1])

    @functools.wraps(f)
    def timed(*a, **k):
        t = _clock()
        try:
            return f(*a, **k)
        finally:
            key = (_flow[0], label)
            _spent[key] += _clock() - t
            _calls[key] += 1

    setattr(owner, label.rsplit(".", 1)[1], timed)


def _install() -> None:
    for owner, prefix, names in _WRAPPED:
        for name in names:
            _wrap(owner, f"{prefix}.{name}")
    store_flow, load_flow = E._store_flow, E._load_flow

    def store(*a, **k):
        _flow[0] = "store"
        return store_flow(*a, **k)

    def load(eng, jobs, per_step, m, from_fs):
        _flow[0] = "fs load" if from_fs else "host load"
        return load_flow(eng, jobs, per_step, m, from_fs)

    E._store_flow, E._load_flow = store, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job-chunks", type=int, default=1)
    ap.add_argument("--run-chunks", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=10_000, help="stored chunks")
    ap.add_argument("--step-ms", type=float, default=1.0)
    args = ap.parse_args()
    _install()
    busy = calibrate(args.step_ms)
    with tempfile.TemporaryDirectory() as d:
        # sized as the bench sizes it: room for the flows' own chunks beside the stored ones
        slots = max(args.chunks, 4 * args.run_chunks)
        with Arena.create(E.arena_name("engine"), slots, E._ROW) as arena:
            eng = E._Engine(arena, args.chunks, Path(d) / "fs")
            try:
                E.all_in(eng, args.job_chunks, min(256, args.run_chunks), 1, busy)  # warm-up
                _spent.clear()
                _calls.clear()
                out = E.all_in(eng, args.job_chunks, args.run_chunks, 1, busy)
            finally:
                eng.shutdown()
    jobs = out["jobs"]
    print(
        f"{args.job_chunks}-chunk jobs, {jobs} per flow; bench totals (µs per job, unwrapped "
        "clock brackets): "
        + ", ".join(f"{f} {out[f]['us_per_job']:.1f}" for f in ("store", "fs_load", "host_load"))
    )
    print("\n| flow | function (inclusive) | µs per job | calls per job |\n|---|---|---|---|")
    for key in sorted(_spent, key=lambda k: (k[0], -_spent[k])):
        print(
            f"| {key[0]} | {key[1]} | {_spent[key] / jobs * 1e6:.1f} | {_calls[key] / jobs:.2f} |"
        )


if __name__ == "__main__":
    main()
