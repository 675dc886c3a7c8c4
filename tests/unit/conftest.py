"""tests/unit holds tests that start no process, open no socket and create no arena (tests/README.md).

While a unit test runs (its fixtures included, whatever their scope), each of these raises
:class:`NotAUnitTest`, naming what was tried and where the test belongs:

- a process: ``subprocess.Popen`` (so ``subprocess.run`` and the rest), ``os.fork``,
  ``os.forkpty``, ``os.posix_spawn``, ``os.posix_spawnp``, ``os.system``, the interpreter's
  ``_posixsubprocess.fork_exec`` (which ``multiprocessing``'s spawn and forkserver use) and
  ``multiprocessing``'s ``Process.start``;
- a socket: ``socket.socket`` (so ``socket.socketpair``, ``socket.create_connection`` and an
  asyncio event loop's self-pipe too) and ``zmq.Context.socket``;
- an arena: ``Arena.create`` (it starts the janitor process; ``helpers.Rig`` makes one).

An attempt that the code under test caught and carried on from still fails the test when it ends.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import socket
import subprocess

import pytest
import zmq

from kvoffload.ipc.arena import Arena


class NotAUnitTest(RuntimeError):
    """What a unit test tried that only a test in tests/integration/ may do."""


class UnitGuard:
    """The attempts refused during the current unit test."""

    def __init__(self) -> None:
        self.test = "(no test)"
        self.attempts: list[str] = []

    def refuse(self, what: str) -> None:
        self.attempts.append(what)
        raise NotAUnitTest(f"a unit test may not {what}: move it to tests/integration/")

    def take(self) -> list[str]:
        """The attempts so far, forgotten (for a test that makes one on purpose)."""
        taken, self.attempts = self.attempts, []
        return taken

    def check(self) -> None:
        """Fails when an attempt was made: also one the code under test caught."""
        attempts, self.attempts = self.attempts, []
        assert not attempts, (
            f"{self.test} tried to {'; '.join(attempts)} (refused, and the error was caught on the "
            "way): a unit test may not start a process, open a socket or create an arena: move it "
            "to tests/integration/"
        )


_GUARD = UnitGuard()


def _refusing(what: str):
    def refuse(*args, **kwargs):
        _GUARD.refuse(what)

    return refuse


# (owner, attribute, what a call of it is)
_REFUSED = [
    (subprocess.Popen, "__init__", "start a process (subprocess.Popen)"),
    (os, "fork", "start a process (os.fork)"),
    (os, "forkpty", "start a process (os.forkpty)"),
    (os, "posix_spawn", "start a process (os.posix_spawn)"),
    (os, "posix_spawnp", "start a process (os.posix_spawnp)"),
    (os, "system", "start a process (os.system)"),
    (_posixsubprocess, "fork_exec", "start a process (_posixsubprocess.fork_exec)"),
    (multiprocessing.process.BaseProcess, "start", "start a process (multiprocessing)"),
    (socket.socket, "__init__", "open a socket (socket.socket)"),
    (zmq.Context, "socket", "open a socket (zmq.Context.socket)"),
]


@pytest.fixture(scope="package", autouse=True)
def _no_process_socket_or_arena():
    """Package-scoped, so that the fixtures of every scope a unit test uses are guarded too; the
    patches go when the last test of tests/unit has run (pytest tears a package's fixtures down
    when the next test is outside it)."""
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, what in _REFUSED:
            if hasattr(owner, name):
                mp.setattr(owner, name, _refusing(what))
        mp.setattr(
            Arena,
            "create",
            classmethod(
                _refusing("create an arena (Arena.create, which starts its janitor process)")
            ),
        )
        yield


_REFUSAL_RAISED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Notes a test that already failed with the guard's error (its end need not say it again)."""
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(NotAUnitTest):
        item.stash[_REFUSAL_RAISED] = True
    return report


@pytest.fixture(autouse=True)
def unit_guard(request, _no_process_socket_or_arena) -> UnitGuard:
    """The guard of the current unit test; an attempt it refused that did not fail the test (the
    code under test caught the error) fails it at its end."""
    _GUARD.test = request.node.nodeid  # what a fixture of a wider scope tried counts here too
    yield _GUARD
    if request.node.stash.get(_REFUSAL_RAISED, False):
        _GUARD.take()  # the test failed with the refusal itself
    _GUARD.check()
