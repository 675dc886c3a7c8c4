"""What every ``kvoffload bench`` measurement shares: machine facts and the header of a report, a
host arena and namespace for a run, dropping the page cache, promoting chunks back into the host
tier, work directories and plots (matplotlib, from the ``bench`` extra, imported only to draw).

Imported by the measurement modules of this package; imports none of them.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

import click

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


def make_workdir(path: str | None) -> Path:
    """``path`` (created), or a new ``kvoffload-bench-*`` directory under the current one."""
    p = Path(path) if path else Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir="."))
    p.mkdir(parents=True, exist_ok=True)
    return p


def print_header() -> None:
    """The first lines of every report: the command as typed and the machine."""
    click.echo(f"command: kvoffload bench {' '.join(sys.argv[2:])}")
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
