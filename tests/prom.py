"""A real Prometheus server on loopback for the tests (Debian's ``prometheus`` package, 2.42).

::

    with start_prometheus(["127.0.0.1:8000"]) as prom:
        prom.wait_until_up()                       # every target scraped, health "up"
        prom.wait_for("kvoffload_host_slots", lambda r: r and float(r[0]["value"][1]) > 0)
        rows = prom.query('sum by (tier) (rate(kvoffload_tier_hits_total[10s]))')

- :func:`start_prometheus` writes a ``prometheus.yml`` (one job, ``kvoffload``, with static targets) into
  a temporary directory, which also holds the TSDB and the server's log, starts the server on a free
  loopback port (it binds nothing else) and returns once ``/-/ready`` answers.
  Ready is not scraped: Prometheus applies new targets ~5 s after it starts (its discovery manager
  applies updates on a 5 s tick, no flag for it in 2.42), so wait with :meth:`PromServer.wait_until_up`
  or :meth:`PromServer.wait_for` before expecting data.
- ``honor_labels`` is on by default: standalone, kvoffload exports an ``instance`` label per manager and
  it is kept (with it off, Prometheus renames it ``exported_instance`` and sets ``instance`` to the target
  address). Targets without their own ``instance`` label still get the target address.
- :meth:`PromServer.stop` (or leaving the ``with`` block) terminates the server, waits for it and
  removes the temporary directory. The server also gets SIGTERM if the test process dies.
- Without the binary, :func:`start_prometheus` skips the calling test, naming why (pytest's ``-ra``
  summary prints it): the README's ``tox -e py`` passes on a machine without Prometheus. With
  ``KVOFFLOAD_REQUIRE_PROMETHEUS=1`` a missing binary is an error instead (:class:`PrometheusNotFound`):
  ``.ci/run`` installs the server and sets it for its run of the ``prometheus``-marked tests.
- Every test that uses the server is marked ``prometheus`` (so ``pytest -m prometheus`` runs them all);
  an unmarked one is an error (``tests/conftest.py`` sets :data:`CURRENT_TEST_MARKED`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from kvoffload.tools.ports import free_port

INSTALL_HINT = (
    "install it with `apt-get install prometheus` (Debian/Ubuntu; the tests use only the "
    "prometheus and promtool binaries, the packaged service need not run), or point "
    "KVOFFLOAD_PROMETHEUS at a prometheus 2.x binary"
)


class PrometheusNotFound(RuntimeError):
    pass


#: Whether the test being set up is marked ``prometheus`` (set by ``tests/conftest.py`` before its
#: fixtures run; None outside pytest).
CURRENT_TEST_MARKED: bool | None = None


class PromQueryError(RuntimeError):
    def __init__(self, expr: str, error_type: str, error: str):
        super().__init__(f"{error_type}: {error} (query: {expr})")
        self.expr = expr
        self.error_type = error_type
        self.error = error


def prometheus_binary() -> str | None:
    """``$KVOFFLOAD_PROMETHEUS``, else ``prometheus`` on PATH, else ``/usr/bin/prometheus``."""
    env = os.environ.get("KVOFFLOAD_PROMETHEUS")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


def require_prometheus() -> str:
    """The binary's path; if there is none, an error under ``KVOFFLOAD_REQUIRE_PROMETHEUS=1``, else a
    skip of the calling test."""
    if CURRENT_TEST_MARKED is False:
        raise RuntimeError(
            "a test that uses a real Prometheus must be marked @pytest.mark.prometheus: .ci/run runs "
            "`-m prometheus` with the server installed, and the README's test command skips them "
            "without it"
        )
    binary = prometheus_binary()
    if binary:
        return binary
    msg = f"the prometheus server binary is not installed: {INSTALL_HINT}"
    if os.environ.get("KVOFFLOAD_REQUIRE_PROMETHEUS") == "1":
        raise PrometheusNotFound(msg + " (KVOFFLOAD_REQUIRE_PROMETHEUS=1 makes this an error)")
    import pytest

    pytest.skip(msg)
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _config(targets: list[str], scrape_interval_s: float, honor_labels: bool) -> str:
    interval = _duration(scrape_interval_s)
    # Written as JSON, which is YAML: no quoting questions for target strings.
    cfg = {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {
                "job_name": "kvoffload",
                "honor_labels": honor_labels,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }
    return json.dumps(cfg, indent=2) + "\n"


class PromServer:
    """A running Prometheus; see :func:`start_prometheus`."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: str, log_path: str):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.log_path = log_path

    # -- HTTP API ---------------------------------------------------------------------------------
    def _get(self, path: str, params: dict | None = None, timeout: float = 10.0) -> dict:
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 400/422/503 carry the API's JSON error body
            body = e.read()
            try:
                return json.loads(body)
            except ValueError:
                raise RuntimeError(f"GET {url}: HTTP {e.code}: {body[:500]!r}") from e

    def query_raw(self, expr: str, time_s: float | None = None) -> dict:
        """``/api/v1/query``'s ``data``: ``{"resultType": ..., "result": ...}``; raises
        :class:`PromQueryError` when the API answers ``status: error`` (e.g. a parse error)."""
        params = {"query": expr}
        if time_s is not None:
            params["time"] = repr(time_s)
        body = self._get("/api/v1/query", params)
        if body.get("status") != "success":
            raise PromQueryError(expr, body.get("errorType", "?"), body.get("error", repr(body)))
        return body["data"]

    def query(self, expr: str, time_s: float | None = None) -> list[dict]:
        """An instant query's result: for a vector, ``[{"metric": {labels}, "value": [ts, "1"]}, ...]``
        (values are strings, as the API gives them); a scalar or string comes back as one row with
        empty ``metric``."""
        data = self.query_raw(expr, time_s)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` as a float (None when the result is empty)."""
        rows = self.query(expr)
        if not rows:
            return None
        if len(rows) > 1:
            raise AssertionError(f"{expr!r} returned {len(rows)} series: {rows}")
        return float(rows[0]["value"][1])

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list[dict]], object] = bool,
        timeout_s: float = 30.0,
        interval_s: float = 0.2,
    ) -> list[dict]:
        """Polls ``query(expr)`` until ``predicate(result)`` is true; returns that result. The
        default predicate waits for a non-empty result. Raises TimeoutError with the last result."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            rows = self.query(expr)
            if predicate(rows):
                return rows
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{expr!r}: condition not met within {timeout_s}s; last result: {rows}"
                )
            time.sleep(interval_s)

    def targets(self) -> list[dict]:
        """``/api/v1/targets``' active targets: each has ``scrapeUrl``, ``health`` ("up", "down",
        "unknown" before the first scrape), ``lastError``, ``labels``, ``lastScrape``..."""
        body = self._get("/api/v1/targets", {"state": "active"})
        return body["data"]["activeTargets"]

    def wait_until_up(self, timeout_s: float = 30.0) -> list[dict]:
        """Waits until every target has been scraped successfully (health "up")."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            ts = self.targets()
            if ts and all(t["health"] == "up" for t in ts):
                return ts
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"targets not up within {timeout_s}s: "
                    f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in ts]}"
                )
            time.sleep(0.2)

    # -- lifecycle --------------------------------------------------------------------------------
    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"prometheus exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
            )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminates the server, waits for it (kills it after ``timeout_s``) and removes the temporary
        directory. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PromServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PromServer({self.url}, pid={self.proc.pid})"


def start_prometheus(
    targets: list[str],
    scrape_interval_s: float = 1.0,
    honor_labels: bool = True,
    ready_timeout_s: float = 30.0,
    extra_args: tuple[str, ...] = (),
) -> PromServer:
    """Starts Prometheus scraping ``targets`` (``"127.0.0.1:PORT"``; path ``/metrics``) every
    ``scrape_interval_s`` and returns once it is ready. Use it as a context manager or call ``stop()``.
    """
    binary = require_prometheus()
    workdir = tempfile.mkdtemp(prefix="kvoffload-prom-")
    proc = None
    try:
        cfg_path = os.path.join(workdir, "prometheus.yml")
        with open(cfg_path, "w") as f:
            f.write(_config(targets, scrape_interval_s, honor_labels))
        for attempt in range(5):  # the free port can be taken between probing and binding
            port = free_port()
            log_path = os.path.join(workdir, f"prometheus-{attempt}.log")
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={cfg_path}",
                        f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                        # the packaged defaults point at /etc/prometheus; nothing of it is needed
                        f"--web.console.templates={workdir}",
                        f"--web.console.libraries={workdir}",
                        *extra_args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=workdir,
                    preexec_fn=_die_with_parent,
                )
            server = PromServer(proc, port, workdir, log_path)
            deadline = time.monotonic() + ready_timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(server.url + "/-/ready", timeout=2) as resp:
                        if resp.status == 200:
                            return server
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.05)
            log_text = server.log()
            if proc.poll() is None:  # alive but never ready
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"prometheus not ready within {ready_timeout_s}s:\n{log_text[-4000:]}"
                )
            if "address already in use" not in log_text:
                raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log_text[-4000:]}")
        raise RuntimeError(f"prometheus could not bind a free loopback port:\n{log_text[-4000:]}")
    except BaseException:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
