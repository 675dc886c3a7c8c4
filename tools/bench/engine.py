"""``kvoffload bench engine``: what the scheduler's thread pays, per lookup and per chunk of whole
jobs, as the number of stored chunks grows.

::

    per N stored chunks (host tier holding N, full; fs tier's engine-side index holding N):
      lookup      wall µs per host-hit lookup (library, and vLLM's manager interface)
      all-in      engine-thread CPU µs per chunk of jobs of k chunks (k = 1, 2, 4, 64), through
                  vLLM's OffloadingManager calls as its scheduler makes them, one step at a time:
        store     on_new_request, prepare_store, (next step) complete_store (host publish and the
                  hand-off to the fs tier), on_request_finished, and every step's
                  on_schedule_end + get_stats until the tier's completion is applied
        fs load   on_new_request, lookups (fs hit: a promotion), on_schedule_end (its hand-off),
                  the steps until the promotion landed, lookups again (host hits), prepare_load,
                  get_load_source, (next step) complete_load, on_request_finished
        fs reload the fs load of chunks the fs tier holds but has no verdict on, as after a
                  restart (its present verdicts forgotten; a capped tier's ledger still counts
                  them): a lookup that asks the tier's storage first (a probe, RETRY) is asked
                  again the next step, as vLLM's scheduler does
        host load on_new_request, lookups (host hits), prepare_load, get_load_source, (next step)
                  complete_load, on_request_finished
      host only   the store and host-load flows with no secondary tier, kvoffload's manager and,
                  as the baseline in the same run, vLLM's own pure-Python CPUOffloadingManager
                  (LRU): the managers' bookkeeping alone, without a tier's hand-off

The fs tier's workers run in other processes and really move the chunks (4 KiB rows here, so the
disk is not what the run waits on; tasks are cut at 32 chunks, what the fs tier's default gives
for 256 KiB chunks). Between two steps the engine thread is busy (``--step-ms`` of pure-Python
work, as vLLM's engine thread is between its scheduler calls; a sleep instead leaves caches and
branch predictors cold and roughly doubles every figure on this machine). Engine-thread CPU is
``time.thread_time`` around the manager's calls, less the cost of reading the clock (a system
call); a step in which nothing of the measured jobs happened (no job call, no completion applied)
is an idle step, reported apart. ``--profile`` writes a cProfile of the all-in runs of the first
``--chunks`` value.
"""

from __future__ import annotations

import cProfile
import gc
import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import click

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.tiering import TieringManager
from kvoffload.tiers.process import ProcessTierManager
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import (
    NO_PLOT_HINT,
    arena_name,
    bench_namespace,
    busy_step,
    calibrate,
    make_workdir,
    plot_lines,
    plot_option,
    print_header,
)
from kvoffload.tools.extras import missing_modules, require

_ROW = 4096
_TASK_CHUNKS = 32  # chunks per task the fs tier's default gives for 256 KiB chunks (8 MiB)
_FILL_BATCH = 4096
_CALLS = (
    "lookup",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "requests",  # on_new_request, on_request_finished, get_load_source
    "step",  # on_schedule_end + get_stats in steps where the measured jobs did something
)


def _key(i: int, tag: int) -> bytes:
    """A vLLM-shaped chunk key: 32 bytes of block hash, 4 bytes of KV-group index."""
    return i.to_bytes(8, "little") + tag.to_bytes(4, "little") + os.urandom(20) + b"\0\0\0\0"


class _Meter:
    """Engine-thread CPU seconds, in brackets of ``time.thread_time`` readings, each less the
    cost of one clock reading (a system call here, measured after the same busy work that comes
    before a step). By default one bracket per step (every manager call of the step); with
    ``by_call``, one per kind of call (``t = meter.lap(kind, t)``): a finer breakdown, with more
    clock readings, so noisier."""

    def __init__(self, by_call: bool, busy_iters: int) -> None:
        self.clock = clock = time.thread_time
        self.by_call = by_call
        self.busy_iters = busy_iters
        reads = []
        for _ in range(200):
            busy_step(busy_iters // 10)
            t0 = clock()
            reads.append(clock() - t0)
        self.overhead = statistics.median(reads)
        self.spent: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.idle_steps = 0
        #: Load flows: per job, the scheduler steps from its first lookup to its prepare_load.
        self.waits: list[int] = []

    def lap(self, kind: str, t0: float) -> float:
        if not self.by_call:
            return t0
        self.spent[kind] += self.clock() - t0 - self.overhead
        return self.clock()


class _Engine:
    """A :class:`TieringManager` behind vLLM's ``OffloadingManager`` (``KVOffloadManager``), built
    as ``KVOffloadSpec.get_manager`` builds it (metric samples kept for vLLM's stats, no KV
    events), with an fs tier; the host tier is filled (every slot) and the fs tier's index given
    ``n`` chunks (:meth:`ProcessTierManager.mark_present`), without writing them."""

    writes_through = True  # a store is done once the tier's completion is applied

    def __init__(self, arena: Arena, n: int, root: Path, fs: dict[str, Any] | None = None):
        self._vllm_contexts()
        entry = scratch_fs_tier(root, chunks_per_task=_TASK_CHUNKS, **(fs or {}))
        self._kvoffload_manager(arena, [entry])
        tier = self.tm.tiers[0]
        assert isinstance(tier, ProcessTierManager)
        self.tier = tier
        host = self.tm.host
        for i in range(0, arena.num_slots, _FILL_BATCH):
            keys = [_key(j, 1) for j in range(i, min(arena.num_slots, i + _FILL_BATCH))]
            plan = host.allocate(keys)
            assert plan is not None
            host.complete_write(plan.keys, True)
        tier.mark_present(_key(j, 2) for j in range(n))
        if not self.tm.wait_workers_ready(600):
            raise RuntimeError("fs tier workers did not start")
        self._tag = 10

    def _vllm_contexts(self) -> None:
        """vLLM's request context class and an empty end-of-step context."""
        from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

        self.ReqContext = ReqContext
        self.end_ctx = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def _kvoffload_manager(self, arena: Arena, tiers: list[dict]) -> None:
        """A :class:`TieringManager` over every slot of ``arena`` with ``tiers``, behind
        ``KVOffloadManager`` (metric samples kept for vLLM's stats, no KV events)."""
        from kvoffload.vllm import KVOffloadManager

        cfg = parse_config(
            {"cpu_bytes_to_use": arena.num_slots * arena.row_bytes, "secondary_tiers": tiers}
        )
        self.tm = TieringManager(
            arena, bench_namespace(arena.row_bytes), cfg, record_events=False,
            keep_metric_samples=True,
        )  # fmt: skip
        self.mgr = KVOffloadManager(self.tm)

    def new_keys(self, count: int) -> list[bytes]:
        self._tag += 1
        return [_key(j, self._tag) for j in range(count)]

    def probes(self) -> int:
        """Chunks whose existence the fs tier has asked its storage so far."""
        return int(self.tier.counters.get("probes", 0))

    def tier_done(self) -> int:
        st, name = self.tm.stats, self.tier.name
        return (
            st.cascaded[name]
            + st.cascade_failures[name]
            + st.promotions[name]
            + st.promotion_failures[name]
        )

    def check(self) -> None:
        st, name = self.tm.stats, self.tier.name
        bad = {
            "cascade_failures": st.cascade_failures[name],
            "promotion_failures": st.promotion_failures[name],
            "dropped_stores": st.dropped_stores[name],
            "promotion_alloc_failures": st.promotion_alloc_failures,
            "store_rejections": st.store_rejections,
        }
        if any(bad.values()):
            raise AssertionError(f"bench engine: jobs did not all succeed: {bad}")

    def end_step(self, meter: _Meter, t_step: float, active: bool) -> None:
        """vLLM's per-step calls (``on_schedule_end``, ``get_stats``); the step (from ``t_step``,
        or these calls alone with ``by_call``) counts to the jobs when they or the step did
        something for them, else as an idle step. Then the step's forward pass: the thread is
        busy (pure-Python work, not measured) as vLLM's engine thread is between two steps."""
        before = self.tier_done()
        clock = meter.clock
        t = clock() if meter.by_call else t_step
        self.mgr.on_schedule_end(self.end_ctx)
        self.mgr.get_stats()
        spent = clock() - t - meter.overhead
        meter.steps += 1
        if active or self.tier_done() != before:
            meter.spent["step" if meter.by_call else "all"] += spent
        else:
            meter.spent["idle"] += spent
            meter.idle_steps += 1
        busy_step(meter.busy_iters)

    def shutdown(self) -> None:
        self.tm.shutdown()


class _HostOnly(_Engine):
    """Host tier only, no secondary tier: kvoffload's manager (a :class:`TieringManager` built
    with no ``secondary_tiers``) or, as the baseline, vLLM's own pure-Python
    ``CPUOffloadingManager`` (vllm.v1.kv_offload.cpu.manager, LRU) behind the same calls; each
    filled to every slot (every store evicts). Its store is the host publish
    alone (nothing is handed to a tier), so the two managers' store and host-load flows do the
    same work: their ratio is the cost of kvoffload's bookkeeping over vLLM's own. Every slot
    of ``arena`` is filled (kvoffload's host tier uses its slots; vLLM's manager, as many)."""

    writes_through = False

    def __init__(self, arena: Arena, vllm_own: bool):
        self._vllm_contexts()
        self.tm = None  # type: ignore[assignment]
        if vllm_own:
            from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

            self.mgr = CPUOffloadingManager(num_chunks=arena.num_slots)
        else:
            self._kvoffload_manager(arena, [])
        ctx = self.ReqContext(req_id="fill")
        n = arena.num_slots
        for i in range(0, n, _FILL_BATCH):
            keys = [_key(j, 1) for j in range(i, min(n, i + _FILL_BATCH))]
            out = self.mgr.prepare_store(keys, ctx)
            assert out is not None and len(out.keys_to_store) == len(keys)
            self.mgr.complete_store(keys, ctx)
        self._tag = 10

    def tier_done(self) -> int:
        return 0

    def probes(self) -> int:
        return 0

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.tm is not None:
            self.tm.shutdown()
        else:
            self.mgr.shutdown()


def _store_flow(eng: _Engine, jobs: list[list[bytes]], per_step: int, m: _Meter) -> None:
    mgr, ctx_of = eng.mgr, eng.ReqContext
    # written through: until the tier's completions are applied (a host-only engine: none)
    target = eng.tier_done() + sum(map(len, jobs)) if eng.writes_through else 0
    copying: list[tuple[list[bytes], Any]] = []  # prepared this step, copied by the next
    i = 0
    while copying or i < len(jobs) or eng.tier_done() < target:
        active = bool(copying) or i < len(jobs)
        ctxs = [ctx_of(req_id=f"s{j}") for j in range(i, min(i + per_step, len(jobs)))]
        t = t_step = m.clock()
        for keys, ctx in copying:
            mgr.complete_store(keys, ctx)
        t = m.lap("complete_store", t)
        for _keys, ctx in copying:
            mgr.on_request_finished(ctx)
        t = m.lap("requests", t)
        copying = []
        for ctx in ctxs:
            mgr.on_new_request(ctx)
        t = m.lap("requests", t)
        for ctx in ctxs:
            keys = jobs[i]
            i += 1
            out = mgr.prepare_store(keys, ctx)
            copying.append((keys, ctx))
            if out is None or len(out.keys_to_store) != len(keys):
                raise AssertionError("bench engine: the host tier did not take a store")
        m.lap("prepare_store", t)
        eng.end_step(m, t_step, active)
    eng.check()


def _load_flow(
    eng: _Engine, jobs: list[list[bytes]], per_step: int, m: _Meter, from_fs: bool
) -> None:
    """Load ``jobs``: from the fs tier (``from_fs``: each job's keys are looked up, every step
    while one is RETRY, promoted, and looked up again once they landed) or from the host tier."""
    mgr, tm, ctx_of = eng.mgr, eng.tm, eng.ReqContext
    # a job's first answers: promotions started (or landed already), or a tier still asking
    want = {"HIT_PENDING", "HIT"} if from_fs else {"HIT"}
    index, state, ready = (tm.host.index, tm.host.state, 2) if from_fs else ({}, [], 2)
    asking: list[tuple[list[bytes], Any]] = []  # a tier answered RETRY: looked up again
    promoting: list[tuple[list[bytes], Any]] = []
    landed: list[tuple[list[bytes], Any]] = []
    copying: list[tuple[list[bytes], Any]] = []
    first_step: dict[int, int] = {}  # id(ctx) -> the step of the job's first lookup
    i = 0
    while i < len(jobs) or asking or promoting or landed or copying:
        active = bool(asking or landed or copying) or i < len(jobs)
        ctxs = [ctx_of(req_id=f"l{j}") for j in range(i, min(i + per_step, len(jobs)))]
        t = t_step = m.clock()
        for keys, ctx in copying:
            mgr.complete_load(keys, ctx)
        t = m.lap("complete_load", t)
        for _keys, ctx in copying:
            mgr.on_request_finished(ctx)
        for ctx in ctxs:
            mgr.on_new_request(ctx)
        t = m.lap("requests", t)
        copying = []
        starting = []
        asked, asking = asking, []
        for ctx in ctxs:
            asked.append((jobs[i], ctx))
            first_step[id(ctx)] = m.steps
            i += 1
        for keys, ctx in asked:
            answers = {mgr.lookup(k, ctx).name for k in keys}
            if from_fs and "RETRY" in answers:
                asking.append((keys, ctx))
            elif answers <= want:
                starting.append((keys, ctx))
            else:
                raise AssertionError(f"bench engine: lookups answered {answers}, not {want}")
        for keys, ctx in landed:
            for k in keys:
                if mgr.lookup(k, ctx).name != "HIT":
                    raise AssertionError("bench engine: a landed chunk is not a host hit")
        t = m.lap("lookup", t)
        loading = landed if from_fs else starting
        m.waits.extend(m.steps - first_step.pop(id(ctx)) for _, ctx in loading)
        for keys, ctx in loading:
            mgr.prepare_load(keys, ctx)
        t = m.lap("prepare_load", t)
        for keys, ctx in loading:
            for k in keys:
                mgr.get_load_source(k, ctx)
        m.lap("requests", t)
        copying, landed = loading, []
        if from_fs:
            promoting.extend(starting)
        eng.end_step(m, t_step, active)
        # which promotions landed (the scheduler learns it by looking up again; read here from
        # the slot table, outside the clock, so a request is looked up twice in all)
        still = []
        for keys, ctx in promoting:
            if all(state[index[k]] == ready for k in keys if k in index):
                landed.append((keys, ctx))
            else:
                still.append((keys, ctx))
        promoting = still
    eng.check()


def all_in(
    eng: _Engine,
    chunks_per_job: int,
    run_chunks: int,
    per_step: int,
    busy_iters: int,
    by_call: bool = False,
) -> dict[str, Any]:
    """Engine-thread µs per chunk of the store, fs-load and host-load flows of jobs of
    ``chunks_per_job`` chunks (``run_chunks`` chunks per flow, ``per_step`` jobs a step,
    ``busy_iters`` of :func:`busy_step` between steps)."""
    k = chunks_per_job
    n_jobs = max(1, run_chunks // k)
    keys = eng.new_keys(n_jobs * k)
    jobs = [keys[j * k : (j + 1) * k] for j in range(n_jobs)]
    out: dict[str, Any] = {"chunks_per_job": k, "jobs": n_jobs}
    flows = (
        ("store", lambda m: _store_flow(eng, jobs, per_step, m)),
        ("fs_load", lambda m: _load_flow(eng, jobs, per_step, m, True)),
        ("host_load", lambda m: _load_flow(eng, jobs, per_step, m, False)),
        ("fs_reload", lambda m: _load_flow(eng, jobs, per_step, m, True)),
    )
    for name, run in flows:
        if name.startswith("fs_") and not eng.writes_through:
            continue
        if name.startswith("fs_"):  # the stored chunks leave the host tier: they load from fs
            assert eng.tm.wait_idle(120)
            removed = eng.tm.host.remove(keys)
            assert len(removed) == len(keys), "stored chunks still pinned"
        if name == "fs_reload":  # ...and the tier has no verdict on them, as after a restart
            for key in keys:
                eng.tier.verdicts.forget(key)
        gc.collect()
        m = _Meter(by_call, busy_iters)
        probes = eng.probes()
        run(m)
        probes = eng.probes() - probes
        total = sum(v for c, v in m.spent.items() if c != "idle")
        out[name] = {
            "us_per_chunk": total / len(keys) * 1e6,
            "us_per_job": total / n_jobs * 1e6,
            "calls_us_per_chunk": {c: m.spent.get(c, 0.0) / len(keys) * 1e6 for c in _CALLS},
            "idle_step_us": m.spent["idle"] / max(1, m.idle_steps) * 1e6,
            "idle_steps": m.idle_steps,
            "steps": m.steps,
            "steps_to_load": statistics.median(m.waits) if m.waits else None,
            "probes_per_job": probes / n_jobs,
        }
    return out


def lookup_cost(n_chunks: int, arena: Arena) -> dict[str, float | None]:
    """Wall µs per host-hit lookup with ``n_chunks`` stored, through the library and through
    vLLM's manager interface (None without vLLM)."""
    out: dict[str, float | None] = {}
    cfg = parse_config({"cpu_bytes_to_use": arena.num_slots * arena.row_bytes})
    tm = TieringManager(arena, bench_namespace(arena.row_bytes), cfg, record_events=False)
    try:
        keys = [_key(i, 0) for i in range(n_chunks)]
        for i in range(0, n_chunks, _FILL_BATCH):
            plan = tm.prepare_store(keys[i : i + _FILL_BATCH])
            assert plan is not None
            tm.complete_store(plan.keys)
        sample = keys[:: max(1, n_chunks // 20000)]
        t0 = time.perf_counter()
        for k in sample:
            tm.lookup(k)
        out["lookup_us"] = (time.perf_counter() - t0) / len(sample) * 1e6
        out["vllm_lookup_us"] = None
        if not missing_modules(("vllm",)):
            from vllm.v1.kv_offload.base import ReqContext

            from kvoffload.vllm import KVOffloadManager

            mgr = KVOffloadManager(tm)
            ctx = ReqContext(req_id="bench")
            t0 = time.perf_counter()
            for k in sample:
                mgr.lookup(k, ctx)
            out["vllm_lookup_us"] = (time.perf_counter() - t0) / len(sample) * 1e6
    finally:
        tm.shutdown()
    return out


def engine_cost(
    n_chunks: int,
    job_sizes: tuple[int, ...],
    run_chunks: int,
    per_step: int,
    busy_iters: int,
    workdir: Path,
    by_call: bool = False,
    profile: str | None = None,
    fs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Lookup and all-in figures with ``n_chunks`` stored (see the module docstring); ``fs``:
    more settings of the fs tier."""
    out: dict[str, Any] = {"stored_chunks": n_chunks, "all_in": []}
    with Arena.create(arena_name("engine"), max(n_chunks, 4 * run_chunks), _ROW) as arena:
        out.update(lookup_cost(n_chunks, arena))
        gc.collect()
        if missing_modules(("vllm",)):
            return out
        root = workdir / "fs-engine"
        eng = _Engine(arena, n_chunks, root, fs)
        try:
            prof = cProfile.Profile() if profile else None
            for k in job_sizes:
                if prof is not None:
                    prof.enable()
                out["all_in"].append(all_in(eng, k, run_chunks, per_step, busy_iters, by_call))
                if prof is not None:
                    prof.disable()
            if prof is not None and profile:
                prof.dump_stats(profile)
        finally:
            eng.shutdown()
            shutil.rmtree(root, ignore_errors=True)
        out["host_only"] = host_only_cost(arena, job_sizes, run_chunks, per_step, busy_iters)
    return out


def host_only_cost(
    arena: Arena, job_sizes: tuple[int, ...], run_chunks: int, per_step: int, busy_iters: int
) -> list[dict[str, Any]]:
    """Store and host-load flows, host tier only, kvoffload's manager and vLLM's own
    ``CPUOffloadingManager`` (the baseline), run in turn per job size (:class:`_HostOnly`)."""
    out = []
    for k in job_sizes:
        row: dict[str, Any] = {"chunks_per_job": k}
        for who, vllm_own in (("ours", False), ("vllm", True)):
            eng = _HostOnly(arena, vllm_own)
            try:
                row[who] = all_in(eng, k, run_chunks, per_step, busy_iters)
            finally:
                eng.shutdown()
        out.append(row)
    return out


_FLOWS = (
    ("store", "store"),
    ("fs_load", "fs load"),
    ("host_load", "host load"),
    ("fs_reload", "fs reload"),
)


@click.command("engine")
@click.option(
    "--chunks",
    multiple=True,
    type=click.IntRange(min=1),
    default=(10_000, 100_000, 1_000_000),
    show_default=True,
    help="Stored chunks (host tier and fs tier index each).",
)
@click.option(
    "--job-chunks",
    multiple=True,
    type=click.IntRange(min=1),
    default=(1, 2, 4, 64),
    show_default=True,
    help="Chunks per job.",
)
@click.option(
    "--run-chunks",
    type=click.IntRange(min=64),
    default=1024,
    show_default=True,
    help="Chunks moved per flow and job size.",
)
@click.option(
    "--jobs-per-step",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Jobs started per scheduler step.",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="The forward pass between two scheduler steps (pure-Python work in the engine thread).",
)
@click.option(
    "--by-call",
    is_flag=True,
    help="Break each flow down by manager call (more clock readings: noisier).",
)
@click.option(
    "--fs-unbounded",
    is_flag=True,
    help='The fs tier with max_bytes "unbounded" (no ledger: after a restart, or with its verdicts '
    "forgotten, it has no record of its chunks).",
)
@click.option("--profile", "profile_path", default=None, help="cProfile output of the first N.")
@plot_option("docs/bench/engine.png")
def bench_engine(
    chunks,
    job_chunks,
    run_chunks,
    jobs_per_step,
    step_ms,
    by_call,
    fs_unbounded,
    profile_path,
    plot_path,
) -> None:
    """Engine-thread µs per host-hit lookup and per chunk of whole jobs (all-in: lookup,
    hand-off, completion, metrics, through vLLM's manager interface), as the number of stored
    chunks grows; and, as the baseline, the store and host-load flows with the host tier only,
    kvoffload's manager against vLLM's own CPUOffloadingManager. The host tier holds
    max(N, 4 x run chunks) slots, the fs tier's index N chunks."""
    require(
        "bench engine",
        "bench",
        modules=("matplotlib",) if plot_path else (),
        hint=NO_PLOT_HINT,
    )
    wd = make_workdir(None)
    print_header()
    if missing_modules(("vllm",)):
        click.echo("vLLM is not installed: the all-in table (vLLM's manager calls) is left out")
    busy_iters = calibrate(step_ms) if step_ms else 0
    small = [n for n in chunks if n < 4 * run_chunks]
    if small:
        click.echo(
            f"host tier: {4 * run_chunks:,} slots where stored chunks < 4 x run chunks "
            f"({', '.join(f'{n:,}' for n in small)}): the flows need room for their own chunks"
        )
    rows = []
    try:
        for i, n in enumerate(chunks):
            rows.append(
                engine_cost(
                    n,
                    tuple(job_chunks),
                    run_chunks,
                    jobs_per_step,
                    busy_iters,
                    wd,
                    by_call,
                    profile_path if i == 0 else None,
                    {"max_bytes": "unbounded"} if fs_unbounded else None,
                )
            )
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        "\n| stored chunks | lookup µs | lookup via vLLM manager µs | idle step µs |\n|---|---|---|---|"
    )
    for r in rows:
        vl = f"{r['vllm_lookup_us']:.2f}" if r["vllm_lookup_us"] is not None else "-"
        idle = [a[f]["idle_step_us"] for a in r["all_in"] for f, _ in _FLOWS if a[f]["idle_steps"]]
        idle_s = f"{statistics.median(idle):.1f}" if idle else "-"
        click.echo(f"| {r['stored_chunks']:,} | {r['lookup_us']:.2f} | {vl} | {idle_s} |")
    if not any(r["all_in"] for r in rows):
        return
    click.echo(
        f"\nAll-in engine-thread CPU, µs per chunk ({jobs_per_step} job(s) a step, "
        f"{step_ms:g} ms steps, {run_chunks} chunks per flow):\n"
        "\n| stored chunks | chunks/job | store | fs load | host load | fs reload | store µs/job | "
        "fs load µs/job | steps to load: fs load / fs reload | fs reload probes/job |"
        "\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        for a in r["all_in"]:
            click.echo(
                f"| {r['stored_chunks']:,} | {a['chunks_per_job']} | "
                + " | ".join(f"{a[f]['us_per_chunk']:.2f}" for f, _ in _FLOWS)
                + f" | {a['store']['us_per_job']:.1f} | {a['fs_load']['us_per_job']:.1f} | "
                f"{a['fs_load']['steps_to_load']:g} / {a['fs_reload']['steps_to_load']:g} | "
                f"{a['fs_reload']['probes_per_job']:g} |"
            )
    _host_only_table(rows, jobs_per_step, step_ms, run_chunks)
    if not by_call:
        _plot(plot_path, rows, job_chunks)
        return
    click.echo(
        "\nBy call, µs per chunk (flow: " + ", ".join(_CALLS) + "):\n"
        "\n| stored chunks | chunks/job | flow | "
        + " | ".join(_CALLS)
        + " |\n|---|---|---|"
        + "---|" * len(_CALLS)
    )
    for r in rows:
        for a in r["all_in"]:
            for f, label in _FLOWS:
                calls = a[f]["calls_us_per_chunk"]
                click.echo(
                    f"| {r['stored_chunks']:,} | {a['chunks_per_job']} | {label} | "
                    + " | ".join(f"{calls[c]:.2f}" for c in _CALLS)
                    + " |"
                )
    _plot(plot_path, rows, job_chunks)


def _host_only_table(rows: list[dict[str, Any]], per_step: int, step_ms: float, run: int) -> None:
    click.echo(
        "\nHost tier only (no secondary tier): kvoffload's manager against vLLM's own "
        f"CPUOffloadingManager (LRU), engine-thread CPU µs per chunk ({per_step} job(s) a step, "
        f"{step_ms:g} ms steps, {run} chunks per flow):\n"
        "\n| stored chunks | chunks/job | store ours | store vLLM | ours / vLLM | "
        "host load ours | host load vLLM | ours / vLLM |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        for h in r.get("host_only", ()):
            cells = []
            for f in ("store", "host_load"):
                ours, theirs = h["ours"][f]["us_per_chunk"], h["vllm"][f]["us_per_chunk"]
                cells.append(f"{ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x")
            click.echo(
                f"| {r['stored_chunks']:,} | {h['chunks_per_job']} | " + " | ".join(cells) + " |"
            )


def _plot(path: str, rows: list[dict[str, Any]], job_chunks: tuple[int, ...]) -> None:
    """All-in µs per chunk against stored chunks, a line per flow and job size ("": none)."""
    if not path:
        return
    series = {}
    for k in job_chunks:
        for f, label in _FLOWS:
            series[f"{label}, {k}-chunk jobs"] = [
                next(a[f]["us_per_chunk"] for a in r["all_in"] if a["chunks_per_job"] == k)
                for r in rows
            ]
    plot_lines(
        path,
        [r["stored_chunks"] for r in rows],
        series,
        "stored chunks",
        "engine-thread µs per chunk (all-in)",
        "engine-side cost per chunk",
        logx=True,
    )
    click.echo(f"\nplot: {path}")
