"""The guard of tests/unit (tests/unit/conftest.py): in a unit test, starting a process, opening a
socket or creating an arena raises, naming what was tried and that the test belongs in
tests/integration/; an attempt the code under test caught still fails the test at its end.

Each attempt here is harmless should the guard let it through (a ``true`` process, a socket that is
closed, an arena that is closed at once), and each is taken back from the guard once seen."""

import os
import socket
import subprocess

import pytest
import zmq
from helpers import arena_name

from kvoffload.ipc.arena import Arena

MOVE_IT = r": move it to tests/integration/$"


def test_starting_a_process_raises_and_names_where_the_test_belongs(unit_guard):
    with pytest.raises(RuntimeError, match=r"^a unit test may not start a process \(subprocess"):
        subprocess.run(["true"], check=True)
    with pytest.raises(RuntimeError, match=r"start a process \(os\.posix_spawn\)" + MOVE_IT):
        os.waitpid(os.posix_spawn("/bin/true", ["true"], os.environ), 0)
    with pytest.raises(RuntimeError, match=r"start a process \(os\.system\)" + MOVE_IT):
        os.system("true")
    assert unit_guard.take() == [
        "start a process (subprocess.Popen)",
        "start a process (os.posix_spawn)",
        "start a process (os.system)",
    ]


def test_opening_a_socket_raises(unit_guard):
    with pytest.raises(RuntimeError, match=r"open a socket \(socket\.socket\)" + MOVE_IT):
        socket.socket().close()
    ctx = zmq.Context()
    try:
        with pytest.raises(RuntimeError, match=r"open a socket \(zmq\.Context\.socket\)" + MOVE_IT):
            ctx.socket(zmq.PUB).close()
    finally:
        ctx.term()
    assert unit_guard.take() == [
        "open a socket (socket.socket)",
        "open a socket (zmq.Context.socket)",
    ]


def test_creating_an_arena_raises(unit_guard):
    with pytest.raises(RuntimeError, match=r"create an arena \(Arena\.create, .*" + MOVE_IT):
        Arena.create(arena_name(), 1, 4096).close()
    assert unit_guard.take() == ["create an arena (Arena.create, which starts its janitor process)"]


def test_an_attempt_the_code_caught_still_fails_the_test(unit_guard):
    try:
        subprocess.run(["true"])
    except Exception:  # what code under test might do with any error
        pass
    with pytest.raises(AssertionError, match=r"tried to start a process .*error was caught"):
        unit_guard.check()  # what the guard does when the test ends
    assert unit_guard.take() == []  # check() forgot it: this test passes
