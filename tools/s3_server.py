"""S3-compatible servers on loopback for the demo, the benchmarks and the tests.

- :func:`start_moto`: moto's threaded server, in this process (fast to start, in memory, no
  signature checks).
- :class:`Nanio`: the ``nanio`` server in a subprocess (objects on disk, SigV4 credentials).
- :class:`FaultProxy`: an HTTP proxy in front of any of them that injects S3 faults (error statuses,
  hangs, delays, dropped connections, a dead endpoint); the tests and ``kvoffload stress --flaky-s3``.
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ``bind(port 0)`` and outgoing connections (Linux default 32768-60999)."""
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(consecutive: int = 1) -> int:
    """A TCP port on 127.0.0.1 that is free now and that nothing else will be handed by the kernel.

    ``bind(port 0)`` answers with a port from the ephemeral range, which any other process (vLLM's
    engine picks its own internal ports that way) may be handed too between this call and the
    caller's bind: a CI run lost its engine to exactly that. The port comes from below the
    ephemeral range instead, is checked by binding it, and is never handed out twice by this process.

    Args:
        consecutive: how many ports ``p .. p+consecutive-1`` must be free; returns ``p``.

    Raises:
        RuntimeError: no free run of ports found in 2,000 tries.
    """
    import contextlib
    import random

    lo, hi = _ephemeral_range()
    # Below the ephemeral range where there is room (the usual case), above it otherwise.
    bottom, top = (10000, lo - consecutive) if lo > 11000 else (hi + 1, 65535 - consecutive)
    for _ in range(2000):
        base = random.randint(bottom, top)
        ports = range(base, base + consecutive)
        if any(p in _HANDED_OUT for p in ports):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for p in ports:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"no {consecutive} free consecutive port(s) on 127.0.0.1 in 2,000 tries")


def start_moto():
    """Start moto's threaded S3 server on 127.0.0.1; returns ``(server, endpoint URL)``."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class Nanio:
    """``nanio serve`` on 127.0.0.1 with one SigV4 user (``access_key`` / ``secret_key``).

    Raises:
        RuntimeError: the server did not start within 30 s.
    """

    def __init__(self, data_dir: str, access_key: str, secret_key: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, NANIO_ACCESS_KEY=access_key, NANIO_SECRET_KEY=secret_key)
        exe = os.path.join(os.path.dirname(sys.executable), "nanio")
        self.proc = subprocess.Popen(
            [
                exe,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--data-dir",
                data_dir,
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("nanio did not start (pip install nanio)")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Rule:
    """A fault for requests whose method is ``method`` (``"*"``: any) and whose path contains
    ``path_contains``.

    ``action``: ``("status", code, s3_error_code)`` (an S3 XML error), ``("hang", seconds)`` (no
    answer, then the connection closes), ``("delay", seconds)`` (answer normally, late) or
    ``("drop",)`` (connection reset). ``count`` faults at most (-1: unlimited); ``probability`` of
    applying to each matching request.
    """

    def __init__(
        self,
        method: str,
        path_contains: str,
        action: tuple,
        count: int = -1,
        probability: float = 1.0,
    ):
        self.method = method
        self.path_contains = path_contains
        self.action = action
        self.count = count
        self.probability = probability
        self.hits = 0


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3-compatible ``upstream`` that injects faults by
    :class:`Rule`; :meth:`stop` makes it refuse connections like a dead server, :meth:`start`
    brings it back on the same port."""

    def __init__(self, upstream: str, seed: int | None = None):
        self._rng = random.Random(seed)
        self.upstream = upstream.removeprefix("http://")
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.conns: set[socket.socket] = set()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                proxy.conns.add(self.connection)

            def finish(self):
                proxy.conns.discard(self.connection)
                super().finish()

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.requests.append((self.command, self.path))
                for rule in list(proxy.rules):
                    if (
                        rule.method in (self.command, "*")
                        and rule.path_contains in self.path
                        and rule.count != 0
                        and (rule.probability >= 1.0 or proxy._rng.random() < rule.probability)
                    ):
                        rule.count -= 1 if rule.count > 0 else 0
                        rule.hits += 1
                        if rule.action[0] == "delay":
                            time.sleep(rule.action[1])
                            break
                        return self._fault(rule.action)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _fault(self, action):
                if action[0] == "status":
                    code, err = action[1], action[2]
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{err}</Code>'
                        f"<Message>injected</Message></Error>"
                    ).encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header(
                        "Content-Length", str(len(xml) if self.command != "HEAD" else 0)
                    )
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                elif action[0] == "hang":
                    time.sleep(action[1])
                    self.close_connection = True
                elif action[0] == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _handle_quietly(self):
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                    self.close_connection = True  # the client gave up (or the fault dropped it)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle_quietly

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Die like a killed server: close open connections, refuse new ones."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for conn in list(self.conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def count(self, method: str, path_contains: str) -> int:
        return sum(1 for m, p in self.requests if m == method and path_contains in p)
