"""The two-network-namespace test helper (``tests/netns_pair.py``) itself: what it builds, that the
namespaces are joined only by their veth pair, and that it leaves nothing behind.

Needs root and iproute2 (skipped with the reason otherwise; ``KVOFFLOAD_REQUIRE_NETNS=1`` makes that
a failure), except the address-choice test.
"""

from __future__ import annotations

import ipaddress
import select
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from netns_pair import (
    ADDRESS_POOL,
    PREFIX,
    NetnsPair,
    Side,
    _host_networks,
    _pids_in,
    list_namespaces,
    pick_subnet,
    require_netns,
    sweep_stale,
)

pytestmark = pytest.mark.netns

# Generous upper bound for anything to happen (seconds): never a measure of speed.
PATIENCE_S = 60.0


_PROBE = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()
        print("connected")
    except OSError as e:
        print(type(e).__name__)
    """
)

_LISTEN = textwrap.dedent(
    """
    import socket, sys
    socks = []
    for host in sys.argv[1:]:
        s = socket.socket()
        s.bind((host, 0))
        s.listen()
        socks.append(s)
    print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    """
)


def _probe(pair: NetnsPair, side: Side, host: str, port: int) -> str:
    """Connect from ``side`` to ``host:port``: "connected" or the error's type name."""
    done = pair.run(side, [sys.executable, "-c", _PROBE, host, str(port)])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _gone(pid: int) -> bool:
    """The process is gone (or a zombie nobody reaped yet: it runs nothing and holds no namespace)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_subnet_is_a_slash_30_of_the_pool_clear_of_the_hosts_routes():
    host = _host_networks()
    assert any(n.prefixlen < 32 for n in host)  # it sees the machine's routes at all
    net = pick_subnet()
    assert net.prefixlen == 30 and net.subnet_of(ADDRESS_POOL)
    assert not any(net.overlaps(n) for n in host)
    # Everything else taken: the one free /30 is chosen; nothing free: a clear error.
    rest = [n for n in ADDRESS_POOL.subnets(new_prefix=30) if n != net]
    assert pick_subnet(taken=rest) == net
    with pytest.raises(RuntimeError, match="overlaps a route"):
        pick_subnet(taken=[ADDRESS_POOL])


def test_namespaces_are_joined_only_by_the_veth_pair(netns_pair):
    pair = netns_pair
    assert {pair.ns_a, pair.ns_b} <= set(list_namespaces())
    assert ipaddress.ip_address(pair.addr_a) in pair.subnet
    assert ipaddress.ip_address(pair.addr_b) in pair.subnet
    assert pair.addr_a != pair.addr_b
    # The veth ends exist only inside the namespaces, each namespace sees just lo and its end.
    for side in ("a", "b"):
        links = pair.run(side, ["ip", "-o", "link", "show"]).stdout
        names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
        assert names == sorted(["lo", pair.dev(side)]), links
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert pair.dev_a not in root_links and pair.dev_b not in root_links
    # B listens on its loopback and on its veth address; A reaches only the veth one. A's own
    # 127.0.0.1 is another loopback: the same port there is closed.
    listener = pair.python(
        "b",
        ["-c", _LISTEN, "127.0.0.1", pair.addr_b],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert listener.stdout is not None and listener.stdin is not None
    ready, _, _ = select.select([listener.stdout], [], [], PATIENCE_S)
    assert ready, "the listener in B did not start"
    lo_port, veth_port = (int(p) for p in listener.stdout.readline().split())
    assert listener.pid in pair.pids("b")  # the handle is the process itself, inside B
    assert listener.pid not in pair.pids("a")
    assert _probe(pair, "b", "127.0.0.1", lo_port) == "connected"
    assert _probe(pair, "a", "127.0.0.1", lo_port) == "ConnectionRefusedError"
    assert _probe(pair, "a", pair.addr_b, veth_port) == "connected"
    assert _probe(pair, "a", pair.addr_b, lo_port) == "ConnectionRefusedError"
    rx_b, _ = pair.link_bytes("b")
    assert rx_b > 0  # A's connections arrived over the veth
    listener.stdin.close()
    assert listener.wait(timeout=PATIENCE_S) == 0


_STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                             start_new_session=True)
    print(os.getpid(), child.pid, flush=True)
    time.sleep(3600)
    """
)


def test_close_leaves_nothing_even_when_processes_ignore_sigterm_or_detach(netns_pair):
    pair = netns_pair
    pair.grace_s = 0.5  # they will not exit: do not wait long before SIGKILL
    stubborn = pair.python("a", ["-c", _STUBBORN], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None
    ready, _, _ = select.select([stubborn.stdout], [], [], PATIENCE_S)
    assert ready, "the process in A did not start"
    pid, detached = (int(p) for p in stubborn.stdout.readline().split())
    assert pid == stubborn.pid and detached in pair.pids("a")
    sleeper = pair.spawn("b", ["sleep", "3600"])
    pair.close()
    assert stubborn.returncode is not None and sleeper.returncode is not None
    assert _gone(detached), psutil.Process(detached).status()
    assert pair.ns_a not in list_namespaces() and pair.ns_b not in list_namespaces()
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert pair.dev_a not in root_links and pair.dev_b not in root_links
    pair.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pair.spawn("a", ["true"])


def test_sweep_removes_the_namespaces_of_a_test_process_that_died():
    require_netns()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a dead creator (reused pids are not this fast to come back)
    stale = f"{PREFIX}{gone.pid}-0-a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=PATIENCE_S)
    orphan = None
    try:
        orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "3600"])
        deadline = time.monotonic() + PATIENCE_S
        while orphan.pid not in _pids_in(stale):  # until `ip netns exec` has entered it
            assert time.monotonic() < deadline, "the process never entered the namespace"
            time.sleep(0.02)
        assert stale in sweep_stale()
        assert stale not in list_namespaces()
        assert orphan.wait(timeout=PATIENCE_S) == -9  # what ran in it was killed
    finally:
        if orphan is not None and orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        if stale in list_namespaces():
            subprocess.run(["ip", "netns", "delete", stale], check=False, timeout=PATIENCE_S)


def test_a_pair_made_in_a_with_block_is_gone_after_it():
    require_netns()
    with NetnsPair() as pair:
        proc = pair.python("b", ["-c", "import time; time.sleep(3600)"])
        names = [pair.ns_a, pair.ns_b]
        assert set(names) <= set(list_namespaces())
    assert proc.returncode is not None
    assert not set(names) & set(list_namespaces())
