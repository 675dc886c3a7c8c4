"""A process that plays an engine for the warm-restart tests: it creates a host arena with a slot
table and a keeper (``warm_restart_s``), stores chunks through a tiering manager, starts one more
store that never completes (its bytes half written), prints ``stored`` and waits to be killed.

Usage: ``python tests/warm_owner.py NAME SLOTS KEEP_S N_STORED N_TORN [CACHE_SALT [REQUEST_SALT]]``
(``REQUEST_SALT``: the stored chunks are a request's with that ``cache_salt``: its tenant's.)
"""

import sys
import time

from helpers import Rig, keys_for, namespace, payload


def main(argv: list[str]) -> None:
    name, slots, keep_s, stored, torn = (
        argv[0],
        int(argv[1]),
        float(argv[2]),
        int(argv[3]),
        int(argv[4]),
    )
    salt = argv[5] if len(argv) > 5 else ""
    rig = Rig(name=name, num_slots=slots, warm_restart_s=keep_s, ns=namespace(cache_salt=salt))
    request_salt = argv[6] if len(argv) > 6 else ""
    req = "tenant" if request_salt else ""
    if request_salt:
        rig.tm.set_cache_salt(req, request_salt)
    keys = keys_for(stored + torn, seed=5)
    for k in keys[:stored]:  # one batch each: least recent first
        rig.store([k], request=req)
    plan = rig.tm.prepare_store(keys[stored:])  # never completed: the process dies writing it
    assert plan is not None
    for k, s in zip(plan.keys, plan.slots):
        rig.arena.rows[s][: rig.row_bytes // 2] = payload(k, rig.row_bytes)[: rig.row_bytes // 2]
    deadline = time.monotonic() + 60
    while not rig.arena.keeper_pid():  # its keeper is up (a crash before that keeps nothing)
        assert time.monotonic() < deadline, "the arena's keeper did not start"
        time.sleep(0.01)
    print("stored", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
