"""Arena janitor: removes a host arena from /dev/shm once the process that created it is gone.

::

    arena owner ──spawn──▶ janitor ──fork──▶ janitor' (detached: own session, parent exits)
                                                │ every 0.5 s: is the owner alive? is the arena still there?
                                                ▼ owner gone
                                 unlink the arena once no process holds its owner lock; exit

Engines such as vLLM kill their whole process tree with SIGKILL on shutdown (tier workers and the
model runner that owns the arena included), so nothing inside the engine's tree is sure to outlive
it. The janitor detaches (double fork, new session) to escape both process-tree and process-group
kills. It exits on its own when the arena is closed normally (the name is gone or belongs to a newer
arena). Imports nothing but :mod:`kvoffload.ipc`.

Usage: ``python -m kvoffload.ipc.janitor <arena name> <nonce hex> <owner pid> <owner start time>``
"""

from __future__ import annotations

import os
import sys
import time

_POLL_S = 0.5
_OWNER_WAIT_S = 60.0


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _arena_present(name: str, nonce: bytes) -> bool:
    from kvoffload.ipc.arena import list_arenas

    return any(a.name == name and a.nonce == nonce for a in list_arenas(name))


def watch(name: str, nonce: bytes, pid: int, create_time: float) -> int:
    """Wait (polling every ``_POLL_S`` seconds) until the arena's owner process ``pid`` (started at
    ``create_time``, psutil seconds since the epoch, so a reused pid is not mistaken for it) is
    gone, then unlink segment ``name`` if it is still the one with ``nonce`` and nobody took it
    over. Returns the exit status (0)."""
    from kvoffload.ipc.arena import unlink_if_orphaned

    while _alive(pid, create_time):
        time.sleep(_POLL_S)
        if not _arena_present(name, nonce):
            return 0
    unlink_if_orphaned(name, nonce, wait_s=_OWNER_WAIT_S)
    return 0


def main(argv: list[str]) -> int:
    """``python -m kvoffload.ipc.janitor NAME NONCE_HEX PID CREATE_TIME``: fork once (so the
    spawner returns at once), then :func:`watch`. Returns the exit status."""
    name, nonce_hex, pid, create_time = argv[0], argv[1], int(argv[2]), float(argv[3])
    # Detach before any heavy import, so the spawner returns at once.
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
    return watch(name, bytes.fromhex(nonce_hex), pid, create_time)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
