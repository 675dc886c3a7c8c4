"""A relay that knows no secret, for the p2p attack tests (CASES C38): it listens on a TCP port
and, for each connection it accepts, connects to a target and forwards the bytes both ways,
recording them, as a hostile program at an address a request named would.

Started as ``python tests/p2p_relay.py`` (also inside a network namespace); reads one JSON command
per line on stdin and answers one JSON line each (``tests/pipe_commands.py``). Commands:

- ``init(host, target)``: listen on ``host`` (any port) and relay to ``target`` (``host:port``);
  answers ``port``.
- ``stats()``: connections relayed, bytes each way, and what was recorded (hex, the first
  :data:`KEEP` bytes of each direction of each connection).
- ``replay(target, data)``: open a fresh connection to ``target`` and send ``data`` (hex: bytes
  recorded from a client), as a replay of a recorded handshake; answers whether the target
  closed the connection (within ``timeout_s``) and what it sent back (its length).
- ``close()``.
"""

from __future__ import annotations

import os
import socket
import threading

_reply_fd = os.dup(1)
os.dup2(2, 1)

from pipe_commands import serve  # noqa: E402

KEEP = 1 << 20
"""Bytes recorded per direction of each connection."""


class Relay:
    def __init__(self) -> None:
        self.listener: socket.socket | None = None
        self.lock = threading.Lock()
        self.conns: list[dict] = []
        self.socks: list[socket.socket] = []

    def init(self, host: str, target: str) -> dict:
        thost, _, tport = target.rpartition(":")
        self.target = (thost, int(tport))
        self.listener = socket.create_server((host, 0))
        threading.Thread(target=self._accept, daemon=True).start()
        return {"port": self.listener.getsockname()[1]}

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            rec = {"to_target": bytearray(), "to_client": bytearray(), "n": [0, 0]}
            with self.lock:
                self.conns.append(rec)
                self.socks += [client, upstream]
            for src, dst, key, i in (
                (client, upstream, "to_target", 0),
                (upstream, client, "to_client", 1),
            ):
                threading.Thread(
                    target=self._pump, args=(src, dst, rec, key, i), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rec: dict, key: str, i: int) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    rec["n"][i] += len(data)
                    room = KEEP - len(rec[key])
                    if room > 0:
                        rec[key] += data[:room]
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stats(self) -> dict:
        with self.lock:
            return {
                "connections": len(self.conns),
                "to_target": sum(c["n"][0] for c in self.conns),
                "to_client": sum(c["n"][1] for c in self.conns),
                "recorded": [
                    {"to_target": c["to_target"].hex(), "to_client": c["to_client"].hex()}
                    for c in self.conns
                ],
            }

    def replay(self, target: str, data: str, timeout_s: float = 60.0) -> dict:
        thost, _, tport = target.rpartition(":")
        got = b""
        closed = False
        with socket.create_connection((thost, int(tport))) as s:
            s.sendall(bytes.fromhex(data))
            s.settimeout(timeout_s)
            try:
                while chunk := s.recv(65536):
                    got += chunk
                closed = True
            except (TimeoutError, OSError):
                closed = False
        return {"closed": closed, "answered": len(got)}

    def close(self) -> dict:
        if self.listener is not None:
            self.listener.close()
        with self.lock:
            for s in self.socks:
                try:
                    s.close()
                except OSError:
                    pass
        return {}


def main() -> None:
    serve(Relay(), _reply_fd)


if __name__ == "__main__":
    main()
