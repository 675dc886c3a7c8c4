"""A second local user, the co-tenant of the shared-host cases (CASES C44), and steps run as it.

::

    test process (root) ──fork──▶ child: setgroups([]), setgid, setuid(kvoffload-cotenant)
          ▲                             │ runs fn(*args) (or fn(conn, *args) for a held process)
          └──── result / exception ─────┘ over a multiprocessing pipe; the child then exits

The user ``kvoffload-cotenant`` is created once (``useradd --system``, no home, no login shell)
and never deleted: other test runs on this machine may create or use the same name at the same
time, so creation is idempotent and a creator that lost the race just looks the user up.

The child is forked, not exec'd: the co-tenant cannot read the test virtualenv (it may live
under a directory private to root), so it runs the code this process has already imported.
Everything the steps need is imported before the fork. Needs root: :func:`cotenant` skips
without it, and fails with ``KVOFFLOAD_REQUIRE_NETNS=1`` (set by CI, which runs as root).
"""

from __future__ import annotations

import multiprocessing
import os
import pwd
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

COTENANT = "kvoffload-cotenant"
_FORK = multiprocessing.get_context("fork")
PATIENCE_S = 120.0


def cotenant() -> pwd.struct_passwd:
    """The co-tenant user, created if missing. Skips the calling test without root (fails with
    ``KVOFFLOAD_REQUIRE_NETNS=1``)."""
    if os.geteuid() != 0:
        why = f"needs root: creates the local user {COTENANT} and runs steps as it"
        if os.environ.get("KVOFFLOAD_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVOFFLOAD_REQUIRE_NETNS=1 but the test {why}")
        pytest.skip(why)
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            return pwd.getpwnam(COTENANT)
        except KeyError:
            pass
        res = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent"]
            + ["--shell", "/usr/sbin/nologin", COTENANT],
            capture_output=True,
            text=True,
        )
        # 0 created; 9 already there (a concurrent creator won); 10 /etc/passwd locked by one
        if res.returncode not in (0, 9, 10) or time.monotonic() > deadline:
            pytest.fail(f"useradd {COTENANT} failed ({res.returncode}): {res.stderr.strip()}")
        if res.returncode == 10:
            time.sleep(0.1)


def _become(user: pwd.struct_passwd) -> None:
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)


def _one_shot(conn, user: pwd.struct_passwd, fn: Callable[..., Any], args: tuple) -> None:
    try:
        _become(user)
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # handed to the test, which re-raises it
        conn.send(("raised", e))
    conn.close()


def as_cotenant(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as the co-tenant in a forked child; its return value, or the exception
    it raised, re-raised here (both must pickle)."""
    user = cotenant()
    here, there = _FORK.Pipe()
    proc = _FORK.Process(target=_one_shot, args=(there, user, fn, args))
    proc.start()
    there.close()
    try:
        assert here.poll(PATIENCE_S), f"{fn.__name__} did not answer as {COTENANT}"
        how, value = here.recv()
    finally:
        proc.join(PATIENCE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        here.close()
    if how == "raised":
        raise value
    return value


def _held(conn, user: pwd.struct_passwd, fn: Callable[..., Any], args: tuple) -> None:
    try:
        _become(user)
        fn(conn, *args)
    except BaseException as e:
        conn.send(("raised", e))
    conn.close()


class CotenantProcess:
    """A process of the co-tenant that lives until the test is done with it: runs
    ``fn(conn, *args)`` in a forked child; the test and ``fn`` talk over ``conn`` (a
    multiprocessing connection). Use as a context manager: leaving it waits for the child to
    end (``fn`` must return once the test sends what it waits for), killing it after
    ``PATIENCE_S`` at most."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        user = cotenant()
        self.conn, there = _FORK.Pipe()
        self.proc = _FORK.Process(target=_held, args=(there, user, fn, args))
        self.proc.start()
        there.close()

    def recv(self) -> Any:
        """The next thing the child sent; an exception it raised is re-raised here."""
        assert self.conn.poll(PATIENCE_S), f"the {COTENANT} process did not answer"
        msg = self.conn.recv()
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "raised":
            raise msg[1]
        return msg

    def send(self, value: Any) -> None:
        self.conn.send(value)

    def __enter__(self) -> CotenantProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.join(PATIENCE_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
