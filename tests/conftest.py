import os
import subprocess
import time

import pytest


def _our_segments() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("kvoffload"))


def _our_workers() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "kvoffload.workers"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


@pytest.fixture(autouse=True, scope="session")
def _leaves_nothing_behind():
    before = set(_our_segments())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (set(_our_segments()) - before or _our_workers()):
        time.sleep(0.1)
    leaked = set(_our_segments()) - before
    workers = _our_workers()
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"
    assert not workers, f"tier worker processes left running: {workers}"
