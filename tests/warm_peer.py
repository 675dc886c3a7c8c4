"""Another process of an engine, for the warm-restart tests: it maps the engine's host arena and
holds it until killed.

- ``claim``: claims a kept segment as vLLM's model runner does (``Arena.create`` with a slot
  table and a keep time, the same call ``Arena.open_or_create`` makes first) and prints
  ``claimed <adopted>``; it builds no tiering manager (under vLLM the scheduler does).
- ``attach``: maps a live engine's arena as a tier worker or another rank does
  (``Arena.attach``) and prints ``attached``.
- ``race``: a successor racing others for one kept segment: prints ``ready``, claims as ``claim``
  does once a line arrives on its stdin, and prints ``claimed <adopted>`` or ``refused <error
  class>``.
- ``claim-then-die``: a claimant that dies between the keeper's hand-over and taking the lock:
  writes its claim in the header as ``Arena.create`` does, waits until the keeper has let go
  (its process exited), prints ``handed over`` and waits to be killed.

It unmaps (and, owning it, removes) the arena and exits when its stdin closes.

Usage: ``python tests/warm_peer.py claim|race NAME SLOTS KEEP_S``, ``python tests/warm_peer.py
attach NAME`` or ``python tests/warm_peer.py claim-then-die NAME``
"""

import os
import sys
import time

import psutil
from helpers import ROW

from kvoffload.ipc import arena as arena_mod
from kvoffload.ipc.arena import Arena, ArenaError


def gone(p: psutil.Process) -> bool:
    """``p`` exited (a zombie too: where its reaper is slow, or is a PID namespace's init that
    reaps nothing)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def claim_then_die(name: str) -> None:
    fd = arena_mod._open_segment(name)
    pid = arena_mod._WARM.unpack(os.pread(fd, arena_mod._WARM.size, arena_mod._WARM_OFFSET))[1]
    keeper = psutil.Process(pid)  # before the claim: it may exit at once after it
    me = psutil.Process()
    os.pwrite(fd, arena_mod._CLAIM.pack(me.pid, me.create_time()), arena_mod._CLAIM_OFFSET)
    deadline = time.monotonic() + 600
    while gone(keeper) is False:  # it lets go of a live claimant of its user: it exits
        assert time.monotonic() < deadline, "the keeper did not let go"
        time.sleep(0.01)
    print("handed over", flush=True)
    sys.stdin.read()


def main(argv: list[str]) -> None:
    if argv[0] == "claim-then-die":
        claim_then_die(argv[1])
        return
    if argv[0] in ("claim", "race"):
        name, slots, keep_s = argv[1], int(argv[2]), float(argv[3])
        if argv[0] == "race":
            print("ready", flush=True)
            sys.stdin.readline()
        try:
            arena = Arena.create(name, slots, ROW, table=True, keep_s=keep_s)
        except ArenaError as e:
            print("refused", type(e).__name__, flush=True)
            sys.stdin.read()
            return
        print("claimed", int(arena.adopted), flush=True)
    else:
        arena = Arena.attach(argv[1])
        print("attached", flush=True)
    sys.stdin.read()  # until the test closes the pipe (or kills this process)
    arena.close(keep=False)


if __name__ == "__main__":
    main(sys.argv[1:])
