"""The ``kvoffload bench`` command group: one subcommand per measurement module of this package."""

from __future__ import annotations

import click

from kvoffload.tools.bench.canary import bench_canary
from kvoffload.tools.bench.engine import bench_engine
from kvoffload.tools.bench.integrity import bench_integrity
from kvoffload.tools.bench.memory import bench_memory
from kvoffload.tools.bench.obj import bench_obj
from kvoffload.tools.bench.p2p import main as bench_p2p
from kvoffload.tools.bench.scaling import bench_scaling
from kvoffload.tools.bench.thrash import bench_thrash
from kvoffload.tools.bench.tier import bench_tier
from kvoffload.tools.bench.ttft import bench_ttft
from kvoffload.tools.bench.vllm_fs import vllm_fs
from kvoffload.tools.bench.vllm_p2p import vllm_p2p
from kvoffload.tools.bench.warm import bench_warm
from kvoffload.tools.bench.window import bench_window


@click.group()
def bench() -> None:
    """Benchmarks for BENCHMARKS.md (each against a baseline from the same run)."""


for _command in (
    bench_tier,
    bench_obj,
    bench_engine,
    bench_memory,
    bench_ttft,
    vllm_fs,
    vllm_p2p,
    bench_p2p,
    bench_scaling,
    bench_thrash,
    bench_window,
    bench_integrity,
    bench_canary,
    bench_warm,
):
    bench.add_command(_command)
