"""The command loop of the tests' standalone processes (``p2p_peer.py``, ``p2p_instance.py``): one
JSON command per line on stdin (``{"op": name, **arguments}``), one JSON answer per line on the reply
fd; an exception is answered as ``{"error": "<type>", "message": ...}`` and the loop goes on; ``close``
is answered, then the loop ends."""

from __future__ import annotations

import os
import sys

import msgspec


def serve(target: object, reply_fd: int) -> None:
    """Run ``target``'s methods as commands until ``close`` or the end of stdin."""
    out = os.fdopen(reply_fd, "wb", buffering=0)
    for line in sys.stdin.buffer:
        cmd = msgspec.json.decode(line)
        op = cmd.pop("op")
        try:
            reply = getattr(target, op)(**cmd)
        except Exception as e:
            reply = {"error": type(e).__name__, "message": str(e)}
        out.write(msgspec.json.encode(reply) + b"\n")
        if op == "close":
            return
