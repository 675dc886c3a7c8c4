"""S3-compatible servers on loopback for the obj-tier tests, and a fault-injecting HTTP proxy.

- :func:`start_moto`: moto's threaded server (fast, in-process, no signature checks).
- :class:`Nanio`: the ``nanio`` server in a subprocess, with SigV4 credentials, on disk.
- :class:`FaultProxy`: forwards to an upstream endpoint and injects faults by rule: an HTTP error
  status with an S3 XML body, a hang, a dropped connection; it can be stopped (connection refused)
  and restarted on the same port.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from botocore.config import Config

from kvoffload.tools.s3_server import Nanio as _Nanio
from kvoffload.tools.s3_server import free_port, start_moto  # noqa: F401 - used by the tests

ACCESS = "kvoffload-test"
SECRET = "kvoffload-secret-key-0123456789"


def client(endpoint: str, access: str = ACCESS, secret: str = SECRET):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access,
                        aws_secret_access_key=secret, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"},
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def new_bucket(endpoint: str) -> str:
    name = f"kv-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def obj_tier(endpoint: str, bucket: str, **extra) -> dict:
    cfg = {"type": "obj", "bucket": bucket, "endpoint_override": endpoint, "region": "us-east-1",
           "access_key_id": ACCESS, "secret_access_key": SECRET, "addressing_style": "path",
           "io_workers": 1, "io_threads": 4, "job_timeout_s": 10.0}
    cfg.update(extra)
    return cfg


class Nanio(_Nanio):
    """nanio with the test credentials."""

    def __init__(self, data_dir: str):
        super().__init__(data_dir, ACCESS, SECRET)


class Rule:
    """``action``: ``("status", code, s3_error_code)``, ``("hang", seconds)`` or ``("drop",)``."""

    def __init__(self, method: str, path_contains: str, action: tuple, count: int = -1):
        self.method = method
        self.path_contains = path_contains
        self.action = action
        self.count = count
        self.hits = 0


class FaultProxy:
    def __init__(self, upstream: str):
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
                for rule in proxy.rules:
                    if (rule.method == self.command and rule.path_contains in self.path
                            and rule.count != 0):
                        rule.count -= 1 if rule.count > 0 else 0
                        rule.hits += 1
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
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{err}</Code>'
                           f"<Message>injected</Message></Error>").encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                elif action[0] == "hang":
                    time.sleep(action[1])
                    self.close_connection = True
                elif action[0] == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle

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
