"""S3-compatible servers on loopback, for ``kvoffload demo`` (an obj tier), ``kvoffload stress --obj``
(moto) and ``kvoffload bench obj`` (nanio), and for the tests.

- :func:`start_moto`: moto's threaded server, in this process (fast to start, in memory, no
  signature checks; the ``stress`` and ``demo`` extras bring it).
- :class:`Nanio`: the ``nanio`` server in a subprocess (objects on disk, SigV4 credentials; the
  ``bench`` extra brings it).

Faults in front of either: :class:`kvoffload.tools.faultproxy.FaultProxy`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from kvoffload.tools.ports import free_port


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
