"""``kvoffload bench thrash``: requests whose chunks do not all fit the host tier at once, reloaded
from the fs tier through the vLLM plug-in's manager the way vLLM's scheduler drives it.

::

    step:  worker results of the last step ─▶ complete_load / complete_store
           running requests compute; a finished one stores its new chunks, ends, may come back
           waiting requests, in order: lookup of each chunk ──┬─ any RETRY / HIT_PENDING: skipped
                                                              ├─ device full: stop this step
                                                              └─ prepare_load(the HIT prefix)
           on_schedule_end (the tiering manager's step: promotions go out, results come in)

The scheduler is a model of vLLM's (``vllm/v1/core/sched/scheduler.py`` and the offloading
connector's ``scheduler.py``, vLLM 0.32): a waiting request is looked up chunk by chunk until the
first MISS (a RETRY or HIT_PENDING makes it wait for the next step, the lookups past it still
run, as vLLM's ``_maximal_prefix_lookup`` does); a request with an answer gets its device blocks
(all its chunks) or, when they are not free, stops the step's admissions; its HIT prefix is
loaded with one ``prepare_load`` and the worker's copy (every row checked against the chunk's
payload) ends at the next step with ``complete_load``. The rest of the prompt is computed, its
chunks stored (``prepare_store`` / ``complete_store``, written through to the fs tier), and the
request finishes; with ``--rounds`` it comes back (the next turn of the same conversation: the
same chunks plus ``--grow`` new ones, computed and stored) and is looked up again. ``--preempt-every`` preempts the newest running request every
so many steps: it loses its device blocks and is looked up again.

The manager is the real one (:class:`kvoffload.vllm.KVOffloadManager` over a
:class:`~kvoffload.tiering.TieringManager` with an fs tier and its worker processes). Reported:
fs loads (chunks promoted from the fs tier) per chunk served to the device, host evictions,
promotions, chunks recomputed, steps and wall time; each admission policy in the same run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections import deque
from pathlib import Path

import click

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.tiering import TieringManager
from kvoffload.tools import scratch_fs_tier
from kvoffload.tools.bench.harness import (
    Payloads,
    arena_name,
    bench_namespace,
    make_workdir,
    print_header,
)
from kvoffload.tools.extras import require
from kvoffload.workers.chunkfile import HEADER_BYTES

_ROW = 64 << 10


class _Req:
    __slots__ = (
        "rid",
        "first",
        "n",
        "ctx",
        "rounds_left",
        "state",
        "hits",
        "compute_left",
        "loading",
        "storing",
        "turn",
    )

    def __init__(self, rid: str, first: int, n: int, rounds: int):
        self.rid = rid
        self.first = first  # index of its first chunk in the run's chunk list
        self.n = n  # chunks of its prompt this round
        self.ctx = None
        self.rounds_left = rounds
        self.state = "waiting"
        self.hits = 0
        self.compute_left = 0
        self.loading: list[bytes] = []
        self.storing: list[bytes] = []
        self.turn = 0


class SchedulerModel:
    """vLLM's scheduler and offloading connector (scheduler side), reduced to what decides which
    chunks are looked up, loaded and stored each step (see the module docstring).

    Args:
        manager: a :class:`kvoffload.vllm.KVOffloadManager`.
        arena: its host arena (the worker's copies read and write its rows).
        keys: every chunk key of the run; request ``r`` owns ``span`` of them from ``r * span``,
            ``span = chunks + (rounds - 1) * grow``.
        payloads: the chunks' payloads (:class:`~kvoffload.tools.bench.harness.Payloads`), to check
            every row loaded (a wrong row is counted) and fill every row stored.
        requests, chunks: how many requests, chunks of each one's first round.
        device_chunks: device KV cache (chunks); a request needs all its chunks there to run.
        compute_chunks_per_step: chunks of prefill computed per step.
        rounds: how many times each request runs; round ``k`` has ``chunks + k * grow`` chunks.
        preempt_every: preempt the newest running request every this many steps (0: never).
    """

    def __init__(
        self,
        manager,
        arena: Arena,
        keys: list[bytes],
        payloads: Payloads,
        requests: int,
        chunks: int,
        device_chunks: int,
        compute_chunks_per_step: int,
        rounds: int,
        grow: int = 0,
        preempt_every: int = 0,
    ):
        from kvoffload.vllm.compat import LookupResult, ReqContext

        self._ctx_cls = ReqContext
        self._lr = LookupResult
        self.mgr = manager
        self.arena = arena
        self.keys = keys
        self.payloads = payloads
        self.grow = grow
        self.device_free = device_chunks
        self.compute = compute_chunks_per_step
        self.preempt_every = preempt_every
        span = chunks + (rounds - 1) * grow
        self.reqs = [_Req(f"req-{r}", r * span, chunks, rounds) for r in range(requests)]
        self.waiting: deque[_Req] = deque(self.reqs)
        for r in self.reqs:
            self._new_context(r)
        self.running: list[_Req] = []
        self.steps = 0
        self.served = 0
        self.prompt_chunks = 0
        self.recomputed = 0
        self.wrong_rows = 0
        self.preemptions = 0
        self.runs_done = 0

    def req_keys(self, r: _Req) -> list[bytes]:
        return self.keys[r.first : r.first + r.n]

    def _new_context(self, r: _Req) -> None:
        r.turn += 1
        r.ctx = self._ctx_cls(req_id=f"{r.rid}-{r.turn}")
        self.mgr.on_new_request(r.ctx)

    @property
    def done(self) -> bool:
        return all(r.state == "done" for r in self.reqs)

    def step(self) -> None:
        """One scheduler step: last step's transfers end, requests compute, waiting requests are
        looked up and admitted, the step's stores are prepared, then the manager's step."""
        self.steps += 1
        mgr, rows = self.mgr, self.arena.rows
        # update_connector_output: the workers' copies of the last step are done
        for r in self.reqs:
            if r.loading:
                mgr.complete_load(r.loading, r.ctx)
                r.loading = []
                r.state = "running"
                self.running.append(r)
            if r.storing:
                mgr.complete_store(r.storing, r.ctx)
                r.storing = []
                if r.state == "finishing":
                    self._finish(r)
        # running requests compute; those done store their chunks after the admissions
        computed = []
        for r in list(self.running):
            r.compute_left -= self.compute
            if r.compute_left <= 0:
                self.running.remove(r)
                computed.append(r)
        if self.preempt_every and self.steps % self.preempt_every == 0 and self.running:
            victim = self.running.pop()  # vLLM preempts the newest running request
            self.preemptions += 1
            self.device_free += victim.n
            victim.state = "waiting"
            self.waiting.appendleft(victim)
        # waiting requests, in order: skipped ones keep their place
        skipped: list[_Req] = []
        while self.waiting:
            r = self.waiting[0]
            hits = self._lookup(r)
            if hits is None:
                skipped.append(self.waiting.popleft())
                continue
            if self.device_free < r.n:
                break
            self.waiting.popleft()
            self.device_free -= r.n
            r.hits = hits
            r.compute_left = r.n - hits
            self.prompt_chunks += r.n
            self.recomputed += r.n - hits
            if hits:
                keys = self.req_keys(r)[:hits]
                spec = mgr.prepare_load(keys, r.ctx)
                for j, slot in enumerate(spec.block_ids):  # the worker's copy
                    if not self.payloads.check(rows[slot], r.first + j):
                        self.wrong_rows += 1
                self.served += hits
                r.loading = keys
                r.state = "loading"
            else:
                r.state = "running"
                self.running.append(r)
        self.waiting.extendleft(reversed(skipped))
        for r in computed:  # build_connector_meta: the step's stores, after its loads
            self._store_and_finish(r)
        mgr.on_schedule_end(None)

    def _lookup(self, r: _Req) -> int | None:
        """vLLM's ``_maximal_prefix_lookup``: chunks counted until the first MISS; None when any
        answer was RETRY or HIT_PENDING (the request waits for the next step)."""
        lr = self._lr
        hit, defer = 0, False
        for k in self.req_keys(r):
            res = self.mgr.lookup(k, r.ctx)
            if res == lr.HIT:
                hit += 1
            elif res == lr.HIT_PENDING:
                hit += 1
                defer = True
            elif res == lr.RETRY:
                defer = True
            else:
                break
        return None if defer else hit

    def _store_and_finish(self, r: _Req) -> None:
        keys = self.req_keys(r)[r.hits :]
        out = self.mgr.prepare_store(keys, r.ctx) if keys else None
        if out is not None and out.keys_to_store:
            rows = self.arena.rows
            where = {k: r.first + j for j, k in enumerate(self.req_keys(r))}
            for k, slot in zip(out.keys_to_store, out.store_spec.block_ids):
                rows[slot] = self.payloads.base
                self.payloads.stamp(rows[slot], where[k])
            r.storing = list(out.keys_to_store)
            r.state = "finishing"
        else:
            self._finish(r)

    def _finish(self, r: _Req) -> None:
        self.device_free += r.n
        self.mgr.on_request_finished(r.ctx)
        self.runs_done += 1
        r.rounds_left -= 1
        if r.rounds_left > 0:
            r.n += self.grow
            self._new_context(r)
            r.state = "waiting"
            self.waiting.append(r)
        else:
            r.state = "done"


def run_case(
    workdir: Path,
    *,
    host_slots: int,
    requests: int,
    chunks: int,
    device_chunks: int,
    compute_chunks_per_step: int = 4,
    rounds: int = 3,
    grow: int = 0,
    preempt_every: int = 0,
    step_s: float = 0.002,
    max_seconds: float = 60.0,
    policy: str = "lru",
    hold_steps: int = 64,
    settle: bool = False,
    fs_chunks: int = 0,
) -> dict:
    """One run: an fs tier holding the first round's chunks of every request (capped at
    ``fs_chunks`` chunk files with ``max_bytes``; 0: uncapped), an empty host tier
    of ``host_slots`` (64 KiB rows), then :class:`SchedulerModel` steps (each followed by a
    ``step_s`` sleep, the step's compute) until every request has run ``rounds`` times or
    ``max_seconds`` pass. ``hold_steps``: the tiering manager's ``promotion_hold_steps`` (0: no
    holds). With ``settle``, each step also waits until the tier jobs it started have ended, so
    a run's counts do not depend on the machine's speed (tests). Returns the run's counts (see
    the module docstring).

    Raises:
        RuntimeError: the fs tier's workers did not start or its stores did not finish.
    """
    from kvoffload.vllm import KVOffloadManager

    root = workdir / "fs"
    shutil.rmtree(root, ignore_errors=True)
    span = chunks + (rounds - 1) * grow
    n_keys = requests * span
    keys = [i.to_bytes(8, "big") * 4 + bytes(4) for i in range(1, n_keys + 1)]
    payloads = Payloads(n_keys, _ROW)
    cfg = parse_config(
        {
            "cpu_bytes_to_use": host_slots * _ROW,
            "eviction_policy": policy,
            "promotion_hold_steps": hold_steps,
            "secondary_tiers": [
                scratch_fs_tier(
                    root,
                    max_pending_store_chunks=n_keys + 1,
                    **({"max_bytes": fs_chunks * (HEADER_BYTES + _ROW)} if fs_chunks else {}),
                )
            ],
        }
    )
    with Arena.create(arena_name("thrash"), host_slots, _ROW) as arena:
        tm = TieringManager(arena, bench_namespace(_ROW), cfg, record_events=False)
        try:
            if not tm.wait_workers_ready(120):
                raise RuntimeError("the fs tier's workers did not start")
            first = [i for r in range(requests) for i in range(r * span, r * span + chunks)]
            for i in range(0, len(first), host_slots):  # through the host tier into the fs tier
                batch = first[i : i + host_slots]
                plan = tm.prepare_store([keys[j] for j in batch])
                if plan is None:
                    raise RuntimeError("the empty host tier refused a store")
                for j, slot in zip(batch, plan.slots):
                    arena.rows[slot] = payloads.base
                    payloads.stamp(arena.rows[slot], j)
                tm.complete_store(plan.keys)
                if not tm.wait_idle(120):
                    raise RuntimeError("the fs tier's stores did not finish")
            tm.reset_cache()  # the host tier forgets them: the fs tier holds them only
            before = tm.stats.snapshot()
            evictions0 = tm.host.evictions
            model = SchedulerModel(
                KVOffloadManager(tm),
                arena,
                keys,
                payloads,
                requests,
                chunks,
                device_chunks,
                compute_chunks_per_step,
                rounds,
                grow,
                preempt_every,
            )
            t0 = time.perf_counter()
            deadline = t0 + max_seconds
            while not model.done and time.perf_counter() < deadline:
                model.step()
                if settle and not tm.wait_idle(120):
                    raise RuntimeError("the fs tier's jobs did not finish")
                time.sleep(step_s)
            wall = time.perf_counter() - t0
            after = tm.stats.snapshot()

            def delta(name: str) -> int:
                a, b = after[name], before[name]
                return sum(a.values()) - sum(b.values()) if isinstance(a, dict) else a - b

            fs_loads = delta("promotions") + delta("promotion_failures")
            return {
                "hold_steps": hold_steps,
                "finished": model.done,
                "runs_done": model.runs_done,
                "steps": model.steps,
                "wall_s": wall,
                "prompt_chunks": model.prompt_chunks,
                "served_chunks": model.served,
                "recomputed_chunks": model.recomputed,
                "cached_share": model.served / max(1, model.prompt_chunks),
                "fs_loads": fs_loads,
                "fs_loads_per_served": fs_loads / max(1, model.served),
                "host_evictions": tm.host.evictions - evictions0,
                "promotion_waits": delta("promotion_waits"),
                "evicted_holds": delta("evicted_holds"),
                "expired_holds": delta("expired_holds"),
                "promotion_alloc_failures": delta("promotion_alloc_failures"),
                "wrong_rows": model.wrong_rows,
                "preemptions": model.preemptions,
            }
        finally:
            tm.shutdown()


#: The cases of ``kvoffload bench thrash`` (name -> :func:`run_case` arguments): the three
#: requests of 18 chunks through a 10-slot host tier (device room for all three, then
#: for one at a time), and multi-turn conversations whose prompts each fit the host tier but not
#: all together (with and without preemption; and with an fs tier capped below their 160 chunks,
#: which then evicts too: what it keeps of each prefix is served only from its head).
CASES: dict[str, dict] = {
    "3x18 chunks, host 10, device 54": dict(host_slots=10, requests=3, chunks=18, device_chunks=54),
    "3x18 chunks, host 10, device 18": dict(host_slots=10, requests=3, chunks=18, device_chunks=18),
    "16x(6+2/turn) chunks, host 24, device 24": dict(
        host_slots=24, requests=16, chunks=6, grow=2, device_chunks=24
    ),
    "8x(8+2/turn), host 24, device 30, preempt/9 steps": dict(
        host_slots=24, requests=8, chunks=8, grow=2, device_chunks=30, preempt_every=9
    ),
    "16x(6+2/turn) chunks, host 24, fs 112, device 24": dict(
        host_slots=24, requests=16, chunks=6, grow=2, device_chunks=24, fs_chunks=112
    ),
}
_COLUMNS = (
    "finished",
    "steps",
    "wall_s",
    "prompt_chunks",
    "served_chunks",
    "recomputed_chunks",
    "cached_share",
    "fs_loads",
    "fs_loads_per_served",
    "host_evictions",
    "promotion_waits",
    "evicted_holds",
    "wrong_rows",
)


def _median_row(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k in _COLUMNS:
        if k == "finished":
            out[k] = all(r[k] for r in runs)
        elif k == "wrong_rows":
            out[k] = sum(r[k] for r in runs)
        else:
            out[k] = statistics.median(r[k] for r in runs)
    return out


@click.command("thrash")
@click.option("--reps", default=3, show_default=True, help="Runs per case and policy (median).")
@click.option(
    "--hold-steps",
    default=64,
    show_default=True,
    help="promotion_hold_steps of the measured configuration (the baseline runs with 0).",
)
@click.option("--rounds", default=3, show_default=True, help="Turns of each request.")
@click.option("--step-ms", default=2.0, show_default=True, help="Compute time of a step.")
@click.option("--max-seconds", default=60.0, show_default=True, help="Per run.")
@click.option("--case", "cases", multiple=True, help="Only these cases (by name; repeatable).")
@click.option("--workdir", default=None, help="Where the fs tier lives (default: a new dir here).")
@click.option("--json", "json_path", default=None, help="Also write every run to this file.")
def bench_thrash(reps, hold_steps, rounds, step_ms, max_seconds, cases, workdir, json_path):
    """Requests whose chunks exceed the host tier, reloaded from the fs tier through the vLLM
    plug-in's manager as vLLM's scheduler drives it: without promotion holds, then with."""
    require("bench thrash", "demo", modules=("vllm",))
    print_header()
    names = list(cases) or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise click.BadParameter(
            f"unknown case(s) {unknown}; known: {list(CASES)}", param_hint="--case"
        )
    wd = make_workdir(workdir)
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        for rep in range(reps):  # interleaved: baseline and holds one after the other
            for name in names:
                for hold in (0, hold_steps):
                    r = run_case(
                        wd,
                        rounds=rounds,
                        step_s=step_ms / 1e3,
                        max_seconds=max_seconds,
                        hold_steps=hold,
                        **CASES[name],
                    )
                    click.echo(
                        f"[{rep + 1}/{reps}] {name}, holds {hold}: "
                        f"{r['fs_loads']} fs loads / {r['served_chunks']} served, "
                        f"{r['recomputed_chunks']} recomputed, {r['wall_s']:.2f} s",
                        err=True,
                    )
                    runs.setdefault((name, hold), []).append(r)
    finally:
        shutil.rmtree(wd / "fs", ignore_errors=True)
        if not workdir:
            shutil.rmtree(wd, ignore_errors=True)
    click.echo(
        f"\n{rounds} turns per request, a {step_ms:g} ms step, 64 KiB chunks; median of {reps} "
        f"runs (holds 0 = before promotion holds)\n"
    )
    click.echo(
        "| case | holds | finished | steps | wall s | prompt chunks | served | recomputed | "
        "cached share | fs loads | fs loads / served | host evictions | waits | evicted holds | "
        "wrong rows |"
    )
    click.echo("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for hold in (0, hold_steps):
            m = _median_row(runs[(name, hold)])
            click.echo(
                f"| {name} | {hold} | {'yes' if m['finished'] else 'no'} | {m['steps']:.0f} | "
                f"{m['wall_s']:.2f} | {m['prompt_chunks']:.0f} | {m['served_chunks']:.0f} | "
                f"{m['recomputed_chunks']:.0f} | {m['cached_share']:.2f} | {m['fs_loads']:.0f} | "
                f"**{m['fs_loads_per_served']:.2f}** | {m['host_evictions']:.0f} | "
                f"{m['promotion_waits']:.0f} | {m['evicted_holds']:.0f} | {m['wrong_rows']} |"
            )
    if json_path:
        Path(json_path).write_text(
            json.dumps([{"case": n, **r} for (n, _h), rs in runs.items() for r in rs], indent=2)
        )
