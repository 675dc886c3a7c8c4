"""The command loop of the tests' standalone processes (``p2p_peer.py``, ``p2p_instance.py``): one
JSON command per line on stdin (``{"op": name, **arguments}``), one JSON answer per line on the reply
fd; an exception is answered as ``{"error": "<type>", "message": ...}`` and the loop goes on; ``close``
is answered, then the loop ends. :class:`PipeClient` is the tests' side of it."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from typing import Any

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


class PipeClient:
    """The test side of :func:`serve`: a process started with ``stdin`` and ``stdout`` pipes,
    driven one command at a time. Subclasses set ``proc``, ``name`` and ``patience_s`` (the upper
    bound for an answer, in seconds: never a measure of speed)."""

    proc: subprocess.Popen
    name: str
    patience_s: float = 60.0

    def call(self, op: str, **args: Any) -> dict:
        """Send one command; its answer (``{"error": ...}`` when it raised)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(msgspec.json.encode({"op": op, **args}) + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.patience_s)
        assert ready, f"{self.name} did not answer {op} within {self.patience_s} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.name} exited (rc {self.proc.poll()}) while answering {op}"
        return msgspec.json.decode(line)

    def ok(self, op: str, **args: Any) -> dict:
        """:meth:`call`, asserting that the command did not raise."""
        reply = self.call(op, **args)
        assert "error" not in reply, reply
        return reply

    def stop_process(self) -> None:
        """Ask a live process to ``close`` (continuing it first if it was stopped), wait for it
        to exit, kill it if it does not, and close the pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.call("close")
            try:
                self.proc.wait(timeout=self.patience_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
