"""The one supervisor of kvoffload's child processes (``kvoffload.supervisor.Supervisor``), with
real children: its exit noticed through the pidfd (or the sentinel pipe of a kernel without
pidfds), reaped before it is reported, killed when it says no hello in time, closed without
leaving a process or a descriptor behind, started with an allow-listed environment."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import psutil
import pytest
from helpers import no_child_or_descriptor_left, wait_until

from kvoffload.supervisor import Supervisor, pidfd_supported

PATIENCE_S = 120.0
SLEEPER = [sys.executable, "-c", "import time; time.sleep(1000)"]

WATCHES = [
    pytest.param(
        True,
        id="pidfd",
        marks=pytest.mark.skipif(not pidfd_supported(), reason="this kernel has no pidfd"),
    ),
    pytest.param(False, id="sentinel"),
]


def exit_fd_readable(sup: Supervisor, timeout_s: float = PATIENCE_S) -> bool:
    ready, _, _ = select.select([sup.fileno()], [], [], timeout_s)
    return bool(ready)


def zombie(pid: int) -> bool:
    """True while ``pid`` has exited and is not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def leaves_nothing():
    """Every child a test starts is reaped, and no pidfd or pipe of a supervisor stays open."""
    with no_child_or_descriptor_left("pidfd", "pipe:"):
        yield


@pytest.mark.parametrize("use_pidfd", WATCHES)
def test_a_child_killed_from_outside_is_reported_only_once_reaped(use_pidfd, leaves_nothing):
    sup = Supervisor(SLEEPER, name="test child", use_pidfd=use_pidfd)
    assert sup.pidfd is use_pidfd
    assert sup.poll() is None and sup.running
    assert not exit_fd_readable(sup, 0)
    os.kill(sup.pid, signal.SIGKILL)
    assert exit_fd_readable(sup), "the exit descriptor never became readable"
    # Exited, not yet reaped: the supervisor has reported nothing, and the process is a zombie.
    wait_until(lambda: zombie(sup.pid), PATIENCE_S, "the killed child to be a zombie")
    assert sup.returncode is None and not sup.running
    rc = wait_until(sup.poll, PATIENCE_S, "the death reported")
    assert rc == -signal.SIGKILL == sup.returncode
    assert not psutil.pid_exists(sup.pid), "reported before it was reaped"
    assert sup.poll() == rc  # reported again, the same
    assert sup.close() == rc and sup.fileno() == -1


@pytest.mark.parametrize("use_pidfd", WATCHES)
def test_a_child_that_says_no_hello_by_its_deadline_is_killed_and_reaped(
    use_pidfd, leaves_nothing, caplog
):
    sup = Supervisor(SLEEPER, name="test child", hello_timeout_s=0.5, use_pidfd=use_pidfd)
    rc = wait_until(sup.poll, PATIENCE_S, "the silent child killed", interval_s=0.05)
    assert rc == -signal.SIGKILL
    assert "hello" in sup.kill_reason
    assert not psutil.pid_exists(sup.pid)
    assert any("did not say hello" in r.getMessage() for r in caplog.records)
    sup.close()


def test_a_child_that_said_hello_outlives_the_hello_deadline(leaves_nothing):
    sup = Supervisor(SLEEPER, name="test child", hello_timeout_s=0.2)
    sup.hello()
    wait_until(lambda: time.monotonic() > sup.hello_by, PATIENCE_S, "the hello deadline to pass")
    assert sup.poll() is None and sup.running and not sup.kill_reason
    sup.kill("the test is done")
    assert wait_until(sup.poll, PATIENCE_S, "the kill reported") == -signal.SIGKILL
    assert sup.kill_reason == "the test is done"
    sup.close()


def test_close_kills_a_child_still_running_at_the_deadline_and_reaps_it(leaves_nothing):
    sup = Supervisor(SLEEPER, name="test child")
    pid = sup.pid
    assert sup.close(time.monotonic()) == -signal.SIGKILL
    assert not psutil.pid_exists(pid) and sup.fileno() == -1
    assert sup.close() == -signal.SIGKILL  # idempotent


def test_close_waits_for_a_child_that_exits_by_itself(leaves_nothing):
    sup = Supervisor([sys.executable, "-c", "import sys; sys.exit(7)"], name="test child")
    assert sup.close(time.monotonic() + PATIENCE_S) == 7
    assert not sup.kill_reason


def test_the_child_gets_the_allow_list_and_its_own_variables_only(monkeypatch, leaves_nothing):
    monkeypatch.setenv("KVOFFLOAD_P2P_SECRET", "not-for-children")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "only-where-allowed")
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("HF_TOKEN", "engine-only")
    code = (
        "import os, sys; e = os.environ; "
        "sys.exit(0 if e.get('OWN') == 'x' and e.get('UCX_TLS') == 'tcp' "
        "and 'HF_TOKEN' not in e and 'AWS_SECRET_ACCESS_KEY' not in e "
        "and 'KVOFFLOAD_P2P_SECRET' not in e and 'PATH' in e else 1)"
    )
    sup = Supervisor(
        [sys.executable, "-c", code],
        name="test child",
        env_allow=("UCX_*", "KVOFFLOAD_*"),
        env_set={"OWN": "x"},
    )
    assert sup.close(time.monotonic() + PATIENCE_S) == 0


def test_a_child_that_cannot_start_leaves_no_descriptor(leaves_nothing):
    for use_pidfd in (True, False):
        with pytest.raises(OSError):
            Supervisor(["/nonexistent/kvoffload-test"], name="test child", use_pidfd=use_pidfd)


def test_an_impossible_hello_deadline_is_refused(leaves_nothing):
    with pytest.raises(ValueError, match="hello_timeout_s"):
        Supervisor(SLEEPER, name="test child", hello_timeout_s=0)
