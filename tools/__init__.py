"""Tools built on the library (installed as ``kvoffload.tools``): the demo, stress and benchmarks."""


def scratch_fs_tier(root_dir: str, **settings) -> dict:
    """The fs tier entry of a run that writes a bounded amount into a scratch directory (the demo,
    the stress tool, the benchmarks): ``{"type": "fs", "root_dir": root_dir, **settings}`` with no
    free-space floor (``min_free_fraction`` 0) unless ``settings`` sets one.

    The default floor (5 % of the filesystem's size) refuses every store on a disk that is already
    fuller than that, which would turn a run's fs figures into misses on a nearly full machine; a
    scratch run removes what it wrote, and a truly full disk still fails its stores (ENOSPC).
    """
    return {"type": "fs", "root_dir": str(root_dir), "min_free_fraction": 0.0, **settings}
