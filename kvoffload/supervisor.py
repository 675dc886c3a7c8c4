"""One child process of the engine, supervised: spawned, told hello, watched, killed, reaped.

::

    owner (a tier's WorkerPool, the p2p tier's PeerWorkerHandle)       child process
      Supervisor(argv, env_allow, env_set) ── spawn: a fresh interpreter, ──▶ python -m ...
          │                                   allow-listed environment
          │ hello()  ◀─ the owner heard the child's hello on its own socket
          │ poll(now) ─▶ exit descriptor readable? ── yes ─▶ reap (waitpid) ─▶ returncode
          │                   │ no
          │                   └─▶ no hello by the hello deadline? ─▶ SIGKILL (reported once reaped)
          │ kill(why) ─▶ SIGKILL (a task or transfer past its deadline: the owner's accounting)
          │ close(deadline) ─▶ wait for the exit until ``deadline``, SIGKILL past it, reap
          └ fileno(): the exit descriptor, readable once the child has exited

Every child process that kvoffload runs and waits for (the tier workers of
:mod:`kvoffload.tiers.workerpool`, the p2p peer worker of
:mod:`kvoffload.tiers.p2p.worker_handle`) runs under one :class:`Supervisor`, so there is one way
to start a child and one way to notice its death. The owner keeps its own accounting (which tasks
or transfers the child holds) and asks :meth:`Supervisor.poll`; a death is reported only once the
process has exited *and been reaped* (``returncode`` set), since until then it might still write
into the arena slots of what it held. A kill, for whatever reason, is the same: SIGKILL now, the
death reported by a later :meth:`~Supervisor.poll` once the process is gone.

The exit is noticed through a descriptor that becomes readable when the child exits: a pidfd
(``os.pidfd_open``, Linux 5.3), or, where the kernel has none, a sentinel (as
``multiprocessing``'s): the write end of a pipe that only the child holds, so the read end reports
EOF once the child has exited. The descriptor is registered with a poller by owners that sleep
(:meth:`Supervisor.fileno`); the engine thread's owners ask :meth:`Supervisor.poll`, which costs
one ``poll(2)`` and reaps only an exited child.

The environment is :func:`kvoffload.ipc.childenv.child_environment`: the base allow-list, what the
child's kind needs (``env_allow``) and its own variables (``env_set``), never the engine's whole
environment. The child is a fresh interpreter (``subprocess``, spawn, never a fork of the engine:
it may hold CUDA state), with stdin from ``/dev/null`` and no descriptor of the engine's but those
named in ``pass_fds``.

Not thread-safe: one thread drives a supervisor (:attr:`Supervisor.running` may be read from
another, it changes nothing).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence

from kvoffload.ipc.childenv import child_environment

log = logging.getLogger("kvoffload.supervisor")


@functools.cache
def pidfd_supported() -> bool:
    """True when this kernel and Python give process descriptors (``os.pidfd_open``)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


class Supervisor:
    """One supervised child process (see the module docstring).

    Args:
        argv: the command (``[sys.executable, "-m", "kvoffload.workers.main"]``).
        name: what log lines call the child (``"kvoffload tier fs: stores worker 3"``).
        env_allow: variables (names or ``fnmatch`` patterns) the child gets from this process's
            environment beyond :data:`kvoffload.ipc.childenv.BASE_ENV`.
        env_set: variables set for the child (its spec), whatever the allow-list says.
        pass_fds: descriptors the child inherits (beyond stdin, stdout and stderr).
        hello_timeout_s: seconds the child has to say hello (:meth:`hello`) before :meth:`poll`
            kills it; None: no deadline.
        use_pidfd: watch the exit through a pidfd where the kernel has them (default); False: the
            sentinel pipe (what runs on a kernel without pidfds; tests choose it).

    Raises:
        OSError: the child could not be started (nothing is left open).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env_allow: Iterable[str] = (),
        env_set: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
        hello_timeout_s: float | None = None,
        use_pidfd: bool = True,
    ):
        if hello_timeout_s is not None and not hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be > 0 seconds or None, got {hello_timeout_s}")
        self.name = name
        self.hello_timeout_s = hello_timeout_s
        env = child_environment(env_allow, env_set)
        sentinel_w = -1
        self._fd = -1
        if not (use_pidfd and pidfd_supported()):
            self._fd, sentinel_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(*pass_fds, *((sentinel_w,) if sentinel_w >= 0 else ())),
            )
        except BaseException:
            if sentinel_w >= 0:
                os.close(self._fd)
                os.close(sentinel_w)
            raise
        if sentinel_w >= 0:
            os.close(sentinel_w)  # the child holds the only write end: EOF once it has exited
        else:
            self._fd = os.pidfd_open(self.proc.pid)
        #: True when the exit is watched through a pidfd (False: the sentinel pipe).
        self.pidfd = sentinel_w < 0
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        #: When the child was started (``time.monotonic()``).
        self.started = time.monotonic()
        self.hello_by = self.started + (
            hello_timeout_s if hello_timeout_s is not None else math.inf
        )
        #: True once the owner heard the child's hello.
        self.said_hello = False
        #: Why the child was killed ("" when it was not).
        self.kill_reason = ""
        #: The exit status once reaped (negative: the signal that ended it), else None.
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    @property
    def running(self) -> bool:
        """True until the child has exited (whether or not it has been reaped). Reads only: safe
        from another thread (a metrics scrape)."""
        fd = self._fd
        if self.returncode is not None or fd < 0:
            return False
        # A poll object of its own: the owner's may be in use on its thread (and select() cannot
        # take a descriptor past 1023). A descriptor closed meanwhile answers POLLNVAL: not running.
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def fileno(self) -> int:
        """A descriptor that is readable once the child has exited (for a poller; -1 once
        :meth:`close` ran: unregister it from the poller before)."""
        return self._fd

    def hello(self) -> None:
        """The child said hello: its hello deadline no longer applies."""
        self.said_hello = True

    def poll(self, now: float | None = None) -> int | None:
        """The child's exit status once it has exited and been reaped, else None. Never blocks
        (it reaps only a child whose exit descriptor is readable). Kills a child that has not
        said hello by its hello deadline (its death is then reported by a later call).

        Args:
            now: ``time.monotonic()`` (taken when None).
        """
        if self.returncode is not None:
            return self.returncode
        if self._fd >= 0 and self._poller.poll(0):
            # Exited. With the sentinel the pipe can report EOF a moment before the process is a
            # zombie: then it is reaped at the next call.
            rc = self.proc.poll()
            if rc is not None:
                self._reaped(rc)
                return rc
            return None
        if not self.said_hello and (time.monotonic() if now is None else now) > self.hello_by:
            self.kill(f"it did not say hello within {self.hello_timeout_s:.0f} s")
        return None

    def kill(self, why: str = "") -> None:
        """SIGKILL the child (nothing when it has exited). ``why``, when given, is logged and
        kept in :attr:`kill_reason`. The death is reported by :meth:`poll` once reaped."""
        if self.returncode is not None or self.kill_reason:
            return
        if why:
            self.kill_reason = why
            log.warning("%s (pid %d): killing it: %s", self.name, self.proc.pid, why)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Block up to ``timeout_s`` seconds (None: without end) for the child to exit; reap it.
        Returns the exit status, or None when it still runs."""
        if self.returncode is None:
            try:
                self._reaped(self.proc.wait(timeout_s))
            except subprocess.TimeoutExpired:
                return None
        return self.returncode

    def close(self, deadline: float | None = None) -> int:
        """Wait for the child to exit until ``deadline`` (``time.monotonic()``; None: now),
        SIGKILL it past that, reap it and close the exit descriptor. Returns the exit status.
        Idempotent."""
        timeout = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
        rc = self.wait(timeout)
        if rc is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            rc = self.proc.wait()
            self._reaped(rc)
        self._close_fd()
        return rc

    def _reaped(self, rc: int) -> None:
        self.returncode = rc

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(self._fd)
            os.close(self._fd)
            self._fd = -1
