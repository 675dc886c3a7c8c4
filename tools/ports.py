"""Free TCP ports on 127.0.0.1 for the servers the tools start (a vLLM server, nanio, the S3 fault
proxy) and for the tests' endpoints."""

from __future__ import annotations

import contextlib
import random
import socket

_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ``bind(port 0)`` and outgoing connections (Linux default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(consecutive: int = 1) -> int:
    """A TCP port on 127.0.0.1 that is free now and that nothing else will be handed by the kernel.

    ``bind(port 0)`` answers with a port from the ephemeral range, which any other process (vLLM's
    engine picks its own internal ports that way) may be handed too between this call and the
    caller's bind, and an engine that loses its port fails to start. The port comes from below the
    ephemeral range instead, is checked by binding it, and is never handed out twice by this process.

    Args:
        consecutive: how many ports ``p .. p+consecutive-1`` must be free; returns ``p``.

    Raises:
        RuntimeError: no free run of ports found in 2,000 tries.
    """
    lo, hi = _ephemeral_range()
    # Below the ephemeral range where there is room (the usual case), above it otherwise.
    bottom, top = (10000, lo - consecutive) if lo > 11000 else (hi + 1, 65535 - consecutive)
    for _ in range(2000):
        base = random.randint(bottom, top)
        ports = range(base, base + consecutive)
        if any(p in _HANDED_OUT for p in ports):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for p in ports:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"no {consecutive} free consecutive port(s) on 127.0.0.1 in 2,000 tries")
