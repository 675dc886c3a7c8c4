"""Tools built on the library (installed as ``kvoffload.tools``): the demo, stress and benchmarks."""

from __future__ import annotations

from typing import Any


def scratch_fs_tier(root_dir: str, **settings) -> dict:
    """The fs tier entry of a run that writes a bounded amount into a scratch directory (the demo,
    the stress tool, the benchmarks): ``{"type": "fs", "root_dir": root_dir, **settings}`` with no
    free-space floor (``min_free_fraction`` 0) unless ``settings`` sets one.

    The default floor (5 % of the filesystem's size) refuses every store on a disk that is already
    fuller than that, which would turn a run's fs figures into misses on a nearly full machine; a
    scratch run removes what it wrote, and a truly full disk still fails its stores (ENOSPC).
    """
    return {"type": "fs", "root_dir": str(root_dir), "min_free_fraction": 0.0, **settings}


def stdout_console(**settings: Any) -> Any:
    """A rich ``Console`` for a command's report on stdout: today's look on a terminal; on a pipe or
    a file no width to fit, so no line or table cell is folded and a path copied from the output
    stays whole (``kvoffload check``, ``inspect``, ``sweep``, ``stress``). With ``stderr=True``
    the same for a command's errors on stderr."""
    import sys

    from rich.console import Console

    stream = sys.stderr if settings.get("stderr") else sys.stdout
    if stream.isatty():
        return Console(**settings)
    return Console(width=100_000, **settings)
