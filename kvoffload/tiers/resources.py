"""What a worker-backed tier holds outside the engine's memory: its sockets
(:class:`~kvoffload.ipc.channels.TierChannels`), its worker processes
(:class:`~kvoffload.tiers.workerpool.WorkerPool`, one per direction) and helper threads, in one
object that closes them all.

::

    ProcessTierManager ──owns──▶ TierResources ──▶ TierChannels (a listening socket per kind)
           │                          ├──▶ WorkerPool loads  ─▶ reader processes
           │ weakref.finalize         ├──▶ WorkerPool stores ─▶ writer processes
           └──────────────────────────┴──▶ closers (the fs tier's free-space sampler thread)

:meth:`TierResources.close` runs once: from the tier's ``shutdown()`` (which fails the tasks it
returns with ``CANCELLED``), or from the ``weakref.finalize`` the tier registers, when the tier is
dropped without a shutdown or at interpreter exit, so a forgotten tier leaks no process or socket.
Nothing here refers back to the tier (a reference would keep it alive for the finalizer): the
pools' callbacks reach it through :func:`weak_callback`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from kvoffload.ipc.channels import TierChannels
from kvoffload.tiers.workerpool import PoolTask, WorkerPool

log = logging.getLogger("kvoffload.tiers")


def weak_callback(method: Callable[..., Any]) -> Callable[..., None]:
    """A callable that calls the bound ``method`` while its object lives, and does nothing after
    (it holds no strong reference to the object)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class TierResources:
    """Sockets, worker processes and helper threads of one tier.

    Args:
        tier_name: names the sockets' endpoints.

    Attributes:
        channels: its engine-side sockets.
        pools: its worker pools, as added (:meth:`add_pool`).
        closed: True once :meth:`close` ran.

    Raises:
        OSError: a socket could not be made or bound.
    """

    def __init__(self, tier_name: str):
        self.channels = TierChannels(tier_name)
        self.pools: tuple[WorkerPool, ...] = ()
        self._closers: list[Callable[[], None]] = []
        self.closed = False

    def add_pool(self, pool: WorkerPool) -> WorkerPool:
        """Own ``pool`` (closed with the rest); returns it."""
        self.pools = (*self.pools, pool)
        return pool

    def on_close(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` (no arguments) at :meth:`close`, before the sockets close."""
        self._closers.append(closer)

    def close(self, timeout_s: float = 5.0) -> list[PoolTask]:
        """Stop every worker (each finishes its task within ``timeout_s`` seconds or is killed), run
        the closers, close the sockets and terminate the context. Idempotent.

        Returns:
            The tasks no worker answered (empty after the first call), for the tier to fail.
        """
        if self.closed:
            return []
        self.closed = True
        leftover: list[PoolTask] = []
        try:
            for pool in self.pools:
                try:
                    leftover.extend(pool.shutdown(timeout_s))
                except Exception:
                    log.exception("kvoffload: stopping %s workers failed", pool.kind)
            for closer in reversed(self._closers):
                try:
                    closer()
                except Exception:
                    log.exception("kvoffload: closing a tier helper failed")
        finally:
            self.channels.close()
        return leftover
