"""What every ``kvoffload bench`` measurement shares: machine facts and the header of a report, a
host arena and namespace for a run, dropping the page cache, promoting chunks back into the host
tier, chunk payloads that can be checked byte for byte, an instance with a p2p tier on loopback, a
calibrated pure-Python "scheduler step", work directories and plots (matplotlib, from the
``bench`` extra, imported only to draw).

Imported by the measurement modules of this package; imports none of them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import numpy as np

from kvoffload.ipc.arena import Arena
from kvoffload.namespace import Namespace
from kvoffload.tiering import TieringManager
from kvoffload.tiers.base import LookupResult


def machine_facts() -> str:
    """One line: vCPUs and CPU model, RAM, kernel, Python."""
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{psutil.cpu_count()} vCPU ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def arena_name(tag: str) -> str:
    """A host arena name of this process for the run tagged ``tag``."""
    return f"kvoffload_bench_{tag}_{os.getpid()}"


def bench_namespace(row_bytes: int) -> Namespace:
    """The namespace of the benchmarks' chunks: ``row_bytes`` bytes each, 16 tokens."""
    return Namespace(
        model="bench",
        kv_dtype="bfloat16",
        layout="raw-v1",
        tokens_per_chunk=16,
        row_bytes=row_bytes,
    )


def drop_caches() -> bool:
    """Sync and drop the page cache; False when that is not allowed here (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def load_all(tm: TieringManager, keys: list[bytes]) -> None:
    """Look ``keys`` up every step until all are readable in the host tier (promoted from the
    manager's first tier)."""
    pending = list(keys)
    while pending:
        pending = [k for k in pending if tm.lookup(k) is not LookupResult.HIT]
        tm.step()
        if pending:
            tm.tiers[0].wait(0.002)


class Payloads:
    """Chunk ``i``: one random row with ``i`` stamped at its start, middle and end (8 bytes each)."""

    def __init__(self, n: int, row_bytes: int):
        self.n, self.row_bytes = n, row_bytes
        self.base = np.random.default_rng(row_bytes).integers(0, 256, row_bytes, dtype=np.uint8)
        self._at = (0, row_bytes // 2, row_bytes - 8)

    def stamp(self, row: np.ndarray, i: int) -> None:
        tag = np.frombuffer(int(i).to_bytes(8, "little"), dtype=np.uint8)
        for at in self._at:
            row[at : at + 8] = tag

    def fill(self, rows: np.ndarray, slots) -> None:
        """Write chunk ``i``'s payload into ``rows[slots[i]]``."""
        for i, s in enumerate(slots):
            rows[s] = self.base
            self.stamp(rows[s], i)

    def check(self, row: np.ndarray, i: int) -> bool:
        want = self.base.copy()
        self.stamp(want, i)
        return bool(np.array_equal(row, want))


def busy_step(iters: int) -> int:
    """Pure-Python stand-in for a scheduler step (dict and int work, holds the GIL)."""
    acc, table = 0, {}
    for i in range(iters):
        acc = (acc + i * 7) % 1000003
        table[i & 255] = acc
    return acc


def calibrate(step_ms: float) -> int:
    """Iterations of the synthetic scheduler step's busy loop that take ``step_ms`` milliseconds on
    this machine uncontended.
    """
    iters = 2000
    for _ in range(3):
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            busy_step(iters)
            ts.append(time.perf_counter() - t0)
        iters = max(100, int(iters * step_ms / 1e3 / min(ts)))  # min: the uncontended cost
    return iters


def make_workdir(path: str | None) -> Path:
    """``path`` (created), or a new ``kvoffload-bench-*`` directory under the current one."""
    p = Path(path) if path else Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir="."))
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def server_workdir() -> Iterator[Path]:
    """A new ``kvoffload-bench-*`` directory under the current one (absolute), for a bench that
    starts vLLM servers: removed when the bench ends; when it fails or is interrupted, everything
    but the servers' logs (``*.log``) is removed and where they are is printed on stderr, so the
    path a server's failure names still leads to its log."""
    wd = make_workdir(None).resolve()
    try:
        yield wd
    except BaseException:
        from kvoffload.tools.vllm_server import keep_only_logs

        if keep_only_logs(wd):
            click.echo(f"(server logs kept in {wd})", err=True)
        else:
            shutil.rmtree(wd, ignore_errors=True)
        raise
    shutil.rmtree(wd, ignore_errors=True)


def p2p_tier_instance(
    kind: str,
    num_slots: int,
    row_bytes: int,
    peers: list[str],
    secret: str,
    worker_nice: int | None = None,
) -> tuple:
    """An arena of ``num_slots`` rows of ``row_bytes`` and a TieringManager with one p2p tier on
    loopback (transport ``kind``: ``nixl`` or ``tcp``) naming ``peers``, authenticated with
    ``secret`` (CurveZMQ on its control sockets, as deployed), its peer worker ready (at the
    tier's ``worker_nice``: its default, or ``worker_nice``).

    Raises:
        RuntimeError: the peer worker did not start within 120 s.
    """
    from kvoffload.config import parse_config

    arena = Arena.create(f"kvoffload_benchp2p_t_{secrets.token_hex(4)}", num_slots, row_bytes)
    tier = {
        "type": "p2p",
        "host": "127.0.0.1",
        "port": 0,
        "peers": peers,
        "transport": kind,
        "secret": secret,
        "transfer_deadline_s": 60.0,
        "lease_ttl_s": 600.0,
    }
    if worker_nice is not None:
        tier["worker_nice"] = worker_nice
    config = parse_config({"cpu_bytes_to_use": num_slots * row_bytes, "secondary_tiers": [tier]})
    ns = Namespace(
        model="kvoffload/bench-p2p",
        kv_dtype="bfloat16",
        layout="raw-v1",
        tokens_per_chunk=16,
        row_bytes=row_bytes,
    )
    tm = TieringManager(arena, ns, config, record_events=False)
    if not tm.wait_workers_ready(120):
        raise RuntimeError("the p2p tier's peer worker did not start")
    return arena, tm


NO_PLOT_HINT = " (or --plot '' to draw no plot)"
"""What a bench's missing-matplotlib error adds (:func:`kvoffload.tools.extras.require`)."""


def plot_option(default: str):
    """The benches' ``--plot PATH`` option (``plot_path``; "" draws none, needing no matplotlib)."""
    return click.option(
        "--plot",
        "plot_path",
        default=default,
        show_default=True,
        help='Where to draw the plot (needs matplotlib, the bench extra); "" draws none.',
    )


def print_header() -> None:
    """The first lines of every report: the command as typed and the machine."""
    click.echo(f"command: kvoffload bench {shlex.join(sys.argv[2:])}")  # pastes back as typed
    click.echo(f"machine: {machine_facts()}")


def plot_lines(
    path: str,
    xs: list,
    series: dict[str, list],
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> None:
    """One PNG with a line per series (matplotlib, from the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(
    path: str, groups: list[str], series: dict[str, list], ylabel: str, title: str
) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], ys, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ends_process(fn: Callable[..., object]) -> Callable[..., None]:
    """Decorator for a bench command, or the target of a spawned process, whose process may make a
    NIXL agent (kvoffload's transport or vLLM's p2p tier): once ``fn`` returns or raises, the
    process ends through :func:`kvoffload.workers.p2p_transport.exit_process` when an agent was
    made, so NIXL 1.5.1's SIGSEGV at interpreter exit never replaces its exit status. Status: 0
    when ``fn`` returns; a ``SystemExit``'s code; a click exception shown with its exit code; 130
    on Ctrl-C; otherwise the traceback is printed and the status is 1. Without an agent, ``fn``
    returns and raises as usual."""
    import functools

    from kvoffload.workers import p2p_transport as pt

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as e:
            if not pt.nixl_agent_made():
                raise
            pt.exit_process(_status_of(e))
        if pt.nixl_agent_made():
            pt.exit_process(0)

    return run


def _status_of(e: BaseException) -> int:
    """The exit status a process ending on ``e`` has (printing what click or Python would)."""
    import traceback

    if isinstance(e, SystemExit):
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    if isinstance(e, click.exceptions.Exit):
        return e.exit_code
    if isinstance(e, click.ClickException):
        e.show()
        return e.exit_code
    if isinstance(e, (KeyboardInterrupt, click.Abort)):
        print("Aborted!", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    traceback.print_exception(e)
    return 1
