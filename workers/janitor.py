"""Arena janitor: removes an engine's host arena from /dev/shm once the engine is gone.

::

    engine process ──spawn──▶ janitor ──fork──▶ janitor' (detached: own session, parent exits)
                                                   │ every 0.5 s: is the engine process alive?
                                                   ▼ engine gone
                                   wait until no process owns the arena, then unlink it; exit

Engines such as vLLM kill their whole process tree with SIGKILL on shutdown (tier workers included)
and the arena's owner may be another engine process (vLLM's model runner), so nothing inside the
engine's tree is sure to outlive it. The janitor detaches (double fork, new session) to escape both
process-tree and process-group kills. It exits on its own when the arena is closed normally (the name
is gone or belongs to a newer arena). Imports nothing but :mod:`kvoffload.ipc`.

Usage: ``python -m kvoffload.workers.janitor <arena name> <nonce hex> <engine pid> <engine start time>``
"""

from __future__ import annotations

import os
import sys
import time

import psutil

from kvoffload.ipc.arena import unlink_if_orphaned

_POLL_S = 0.5
_OWNER_WAIT_S = 60.0


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _arena_present(name: str, nonce: bytes) -> bool:
    from kvoffload.ipc.arena import list_arenas

    return any(a.name == name and a.nonce == nonce for a in list_arenas(name))


def main(argv: list[str]) -> int:
    name, nonce_hex, pid, create_time = argv[0], argv[1], int(argv[2]), float(argv[3])
    nonce = bytes.fromhex(nonce_hex)
    if os.fork() > 0:
        os._exit(0)  # the spawner reaps this parent; the child is re-parented away from the engine
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    try:
        os.nice(19)
    except OSError:
        pass
    while _alive(pid, create_time):
        time.sleep(_POLL_S)
        if not _arena_present(name, nonce):
            return 0
    unlink_if_orphaned(name, nonce, wait_s=_OWNER_WAIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
