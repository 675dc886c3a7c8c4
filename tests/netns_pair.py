"""Two network namespaces joined by a veth pair, for tests that must not ride on loopback.

::

    root namespace (the test)                 nothing of ours here: the veth ends are created inside
      │ ip netns exec NS_A python ...           the namespaces, never in the root namespace
      ▼                                        ▼
    ┌──────── NS_A ────────┐               ┌──────── NS_B ────────┐
    │ lo 127.0.0.1 (own)   │               │ lo 127.0.0.1 (own)   │
    │ kvoveth-a addr_a/30 ─┼─── veth pair ─┼─ kvoveth-b addr_b/30 │
    └──────────────────────┘               └──────────────────────┘

:class:`NetnsPair` creates both namespaces (``ip netns add``), the veth pair with one end in each
(``ip link add ... netns A type veth peer ... netns B``), gives the ends two addresses of a /30 taken
from the benchmark range 198.18.0.0/15 (RFC 2544) that overlaps no route or address of the root
namespace, and brings ``lo`` and both ends up. Each namespace has its own loopback: ``127.0.0.1`` in
A is not ``127.0.0.1`` in B, so two processes on opposite sides can reach each other only over the
veth addresses. :meth:`NetnsPair.spawn` / :meth:`NetnsPair.python` start a process inside one side
(``ip netns exec NS ...``, which execs the command, so the handle's ``pid`` is the process's own)
and return a :class:`subprocess.Popen`; :meth:`NetnsPair.close` kills every process left in either
namespace (those spawned and anything they started), deletes both namespaces (which destroys the
veth pair) and checks that none of it survives.

Names: namespaces are ``kvoffload-test-<pid>-<n>-a`` / ``-b`` (``<pid>``: the creating process), so
the session-end check (``tests/conftest.py``) finds any of this session's that survive, and
:func:`sweep_stale` removes those of a test process that died without cleaning up (SIGKILL).

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ``ip``; :func:`netns_unavailable` says
why not, and the ``netns_pair`` fixture (``tests/conftest.py``) skips with that reason, or fails when
``KVOFFLOAD_REQUIRE_NETNS=1`` (so a CI run that should have them cannot pass by skipping).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import psutil
import pytest

PREFIX = "kvoffload-test-"
#: Devices (veth ends) inside the namespaces; the names exist only there.
DEV_A, DEV_B = "kvoveth-a", "kvoveth-b"
#: Where addresses of the veth pair come from: the benchmark range, never routed on the internet.
ADDRESS_POOL = ipaddress.ip_network("198.18.0.0/15")
#: Upper bound for ``ip`` and for processes to exit (seconds); never a measure of speed.
PATIENCE_S = 30.0
#: How long processes get to exit on their own at :meth:`NetnsPair.close` before SIGKILL (seconds).
GRACE_S = 10.0
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+-[ab]|probe)$")
_serial = itertools.count()

Side = Literal["a", "b"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip")
    if ip is None:
        raise RuntimeError("iproute2's `ip` is not on PATH")
    done = subprocess.run(
        [ip, *args], capture_output=True, text=True, timeout=PATIENCE_S, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done


def list_namespaces() -> list[str]:
    """Names of every named network namespace on the machine (``ip netns list``)."""
    if shutil.which("ip") is None:
        return []
    # One line per namespace: "NAME" or "NAME (id: N)".
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()]


def creator_pid(name: str) -> int:
    """The pid of the test process that created namespace ``name`` (one of :func:`our_namespaces`)."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a namespace of tests/netns_pair.py")
    return int(m.group(1))


def our_namespaces(pid: int | None = None) -> list[str]:
    """This helper's namespaces; with ``pid``, only those created by that process."""
    out = []
    for name in list_namespaces():
        if _NAME.match(name) and (pid is None or creator_pid(name) == pid):
            out.append(name)
    return out


@functools.cache
def netns_unavailable() -> str:
    """Empty when network namespaces can be made here; else why not (for skip messages)."""
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        veth = _ip(
            "link", "add", "kvoprobe-a", "netns", probe, "type", "veth",
            "peer", "name", "kvoprobe-b", "netns", probe, check=False,
        )  # fmt: skip
        if veth.returncode != 0:
            return f"a veth pair cannot be made here: {veth.stderr.strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return ""


def _pids_in(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all_in(ns: str) -> None:
    """SIGKILL every process in ``ns`` and wait until none is left in it."""
    deadline = time.monotonic() + PATIENCE_S
    while pids := _pids_in(ns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def sweep_stale() -> list[str]:
    """Delete this helper's namespaces whose creating process is gone (a test run killed before its
    teardown), killing what still runs in them. Returns the names removed."""
    removed = []
    for name in our_namespaces():
        if psutil.pid_exists(creator_pid(name)):
            continue
        _kill_all_in(name)
        if _ip("netns", "delete", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the root namespace routes or owns (all tables, all addresses)."""
    nets = []
    for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = r.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.ip_network(dst, strict=False))
    for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def pick_subnet(taken: Sequence[ipaddress.IPv4Network] = ()) -> ipaddress.IPv4Network:
    """A /30 of :data:`ADDRESS_POOL` overlapping none of the root namespace's routes or addresses
    (nor ``taken``); its choice starts at an offset from this process's pid, so concurrent test runs
    on one machine use different ones (they could share one: each pair is isolated)."""
    avoid = [*_host_networks(), *taken]
    subnets = list(ADDRESS_POOL.subnets(new_prefix=30))
    start = os.getpid() % len(subnets)
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(n) for n in avoid):
            return net
    raise RuntimeError(f"every /30 of {ADDRESS_POOL} overlaps a route of this machine")


class NetnsPair:
    """Two fresh network namespaces joined by a veth pair with a /30 of their own.

    Attributes:
        ns_a, ns_b: namespace names (``ip netns``).
        dev_a, dev_b: the veth end inside each (for ``UCX_NET_DEVICES`` and link counters).
        addr_a, addr_b: the ends' IPv4 addresses (dotted quads); the only way between the sides.
        subnet: the /30 they come from.
        grace_s: how long :meth:`close` lets processes exit on their own before SIGKILL (seconds).

    A context manager: leaving the ``with`` block calls :meth:`close`. Other mounts (``/dev/shm``
    included, so host arenas) and the PID space are the machine's: only the network is separate.
    """

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        sweep_stale()
        n = next(_serial)
        self.ns_a = f"{PREFIX}{os.getpid()}-{n}-a"
        self.ns_b = f"{PREFIX}{os.getpid()}-{n}-b"
        self.dev_a, self.dev_b = DEV_A, DEV_B
        self.subnet = pick_subnet()
        host_a, host_b = list(self.subnet.hosts())
        self.addr_a, self.addr_b = str(host_a), str(host_b)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip(
                "link", "add", self.dev_a, "netns", self.ns_a, "type", "veth",
                "peer", "name", self.dev_b, "netns", self.ns_b,
            )  # fmt: skip
            plen = str(self.subnet.prefixlen)
            for ns, dev, addr in ((self.ns_a, DEV_A, self.addr_a), (self.ns_b, DEV_B, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/{plen}", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetnsPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ns(self, side: Side) -> str:
        """The namespace name of ``side``."""
        return {"a": self.ns_a, "b": self.ns_b}[side]

    def addr(self, side: Side) -> str:
        """The veth address of ``side``."""
        return {"a": self.addr_a, "b": self.addr_b}[side]

    def dev(self, side: Side) -> str:
        """The veth device of ``side`` (its name inside that namespace)."""
        return {"a": self.dev_a, "b": self.dev_b}[side]

    def spawn(
        self,
        side: Side,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``side``'s namespace; ``close`` stops it if it still runs.

        ``env`` is added to this process's environment (so the test env's ``PYTHONPATH`` and the like
        carry over). ``popen_kwargs`` go to :class:`subprocess.Popen` (``stdin``, ``stdout``, ...).
        The handle's ``pid`` is the command's own (``ip netns exec`` execs it).
        """
        if self._closed:
            raise RuntimeError("this NetnsPair is closed")
        ip = shutil.which("ip")
        assert ip is not None
        proc = subprocess.Popen(  # type: ignore[call-overload]
            [ip, "netns", "exec", self.ns(side), *argv],
            env={**os.environ, **(env or {})},
            **popen_kwargs,
        )
        self._procs.append(proc)
        return proc

    def python(
        self,
        side: Side,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """:meth:`spawn` this test env's Python (``sys.executable``) with ``args``: a script path,
        ``["-c", code, ...]`` or ``["-m", module, ...]``."""
        return self.spawn(side, [sys.executable, *args], env, **popen_kwargs)

    def run(self, side: Side, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to completion inside ``side`` (output captured as text, not checked)."""
        return subprocess.run(
            [shutil.which("ip") or "ip", "netns", "exec", self.ns(side), *argv],
            capture_output=True,
            text=True,
            timeout=PATIENCE_S,
            check=False,
        )

    def link_bytes(self, side: Side) -> tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` the veth end of ``side`` has carried so far."""
        out = _ip("-n", self.ns(side), "-s", "-j", "link", "show", "dev", self.dev(side)).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def ucx_tcp_env(self, side: Side) -> dict[str, str]:
        """Environment that keeps a NIXL/UCX process of ``side`` on the veth: ``UCX_TLS=tcp`` (the
        namespaces share /dev/shm and the PID space, so UCX would otherwise move bytes by shared
        memory or cross-memory attach and never touch the network) and ``UCX_NET_DEVICES`` = the
        veth end (UCX refuses the other side's ``lo`` anyway: it compares network namespaces)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev(side)}

    def pids(self, side: Side) -> list[int]:
        """Every process now in ``side``'s namespace."""
        return _pids_in(self.ns(side))

    def close(self) -> None:
        """Stop every process in either namespace and delete both; check none survives. Idempotent.

        The spawned processes get SIGTERM; then what they started gets ``grace_s`` to exit on
        its own (an arena's janitor unlinks the segment of an owner that died, see
        ``kvoffload.ipc.janitor``); anything still there is SIGKILLed, and, as that may have been a
        janitor, arena segments whose owner is dead are swept (``kvoffload.ipc.arena.sweep``).
        Deleting the namespaces, empty by then, destroys the veth pair.

        Raises:
            RuntimeError: a process survived SIGKILL or a namespace could not be deleted.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        sides = [ns for ns in (self.ns_a, self.ns_b) if ns in list_namespaces()]
        deadline = time.monotonic() + self.grace_s
        while any(_pids_in(ns) for ns in sides) and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = []
        killed = False
        for ns in sides:
            killed |= bool(_pids_in(ns))
            try:
                _kill_all_in(ns)
            except RuntimeError as e:
                errors.append(str(e))
            done = _ip("netns", "delete", ns, check=False)
            if done.returncode != 0:
                errors.append(f"`ip netns delete {ns}`: {done.stderr.strip()}")
        for p in self._procs:
            p.wait(timeout=PATIENCE_S)  # reaped: SIGKILLed above if it was still in a namespace
        if killed:
            from kvoffload.ipc.arena import sweep

            sweep()
        left = [ns for ns in (self.ns_a, self.ns_b) if ns in list_namespaces()]
        if left:
            errors.append(f"namespaces left: {left}")
        if errors:
            raise RuntimeError("; ".join(errors))


def require_netns() -> None:
    """Skip the calling test when network namespaces cannot be made here (fail instead with
    ``KVOFFLOAD_REQUIRE_NETNS=1``)."""
    why = netns_unavailable()
    if why:
        if os.environ.get("KVOFFLOAD_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVOFFLOAD_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
