"""A standalone peer process for the p2p transport tests: owns an arena, runs one Transport.

Started as ``python tests/p2p_peer.py``; reads one JSON command per line on stdin and answers one JSON
line each on the stdout it was started with (the process's fd 1 is pointed at stderr first, because
NIXL logs to stdout). Commands (``op`` plus arguments): ``init``, ``fill``, ``scribble``, ``digest``,
``add_peer``, ``remove_peer``, ``peer_up``, ``add_session``, ``drop_session``, ``grant``,
``revoke``, ``revoked``, ``refused``, ``read``, ``poll``, ``wait``, ``wait_woken``, ``maps``,
``close``.
Bytes (descriptors, tokens, digests) travel as hex. Errors are answered as
``{"error": "<exception type>", "message": ...}``; the process goes on.
"""

from __future__ import annotations

import os
import select
import sys
import time

_reply_fd = os.dup(1)
os.dup2(2, 1)

import numpy as np  # noqa: E402
import xxhash  # noqa: E402
from pipe_commands import serve  # noqa: E402

from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.workers import p2p_transport as pt  # noqa: E402


class Peer:
    def __init__(self) -> None:
        self.arena: Arena | None = None
        self.transport: pt.Transport | None = None

    def init(
        self,
        name: str,
        num_slots: int,
        row_bytes: int,
        kind: str,
        deadline_s: float,
        host: str = "127.0.0.1",
        nixl_part_bytes: int = pt.NIXL_PART_BYTES,
    ) -> dict:
        self.arena = Arena.create(name, num_slots, row_bytes)
        config = pt.TransportConfig(
            kind=kind,  # type: ignore[arg-type]
            deadline_s=deadline_s,
            host=host,
            nixl_part_bytes=nixl_part_bytes,
        )
        self.transport = pt.make_transport(self.arena, config)
        return {
            "descriptor": self.transport.descriptor().hex(),
            "kind": self.transport.kind,
            "choice": self.transport.choice,
        }

    def fill(self, seed: int) -> dict:
        assert self.arena is not None
        rows = self.arena.rows
        rows[:] = np.random.default_rng(seed).integers(0, 256, size=rows.shape, dtype=np.uint8)
        return {}

    def scribble(self, slots: list[int], value: int) -> dict:
        """Overwrite ``slots``' rows with ``value`` (a slot reused for other bytes)."""
        assert self.arena is not None
        for s in slots:
            self.arena.rows[s] = value
        return {}

    def digest(self) -> dict:
        assert self.arena is not None
        return {"rows": [xxhash.xxh3_64_hexdigest(r) for r in self.arena.rows]}

    def add_peer(self, name: str, descriptor: str, token: str) -> dict:
        assert self.transport is not None
        self.transport.add_peer(name, bytes.fromhex(descriptor), bytes.fromhex(token))
        return {}

    def remove_peer(self, name: str) -> dict:
        assert self.transport is not None
        self.transport.remove_peer(name)
        return {}

    def peer_up(self, name: str) -> dict:
        assert self.transport is not None
        return {"up": self.transport.peer_up(name)}

    def add_session(self, token: str) -> dict:
        assert self.transport is not None
        self.transport.add_session(bytes.fromhex(token))
        return {}

    def drop_session(self, token: str) -> dict:
        assert self.transport is not None
        self.transport.drop_session(bytes.fromhex(token))
        return {}

    def grant(self, gid: int, token: str, slots: list[int], ttl_s: float) -> dict:
        """Grant ``slots`` to ``token``'s session for ``ttl_s`` seconds from now."""
        assert self.transport is not None
        until = time.monotonic() + ttl_s
        return {"digests": self.transport.grant(gid, bytes.fromhex(token), slots, until).hex()}

    def revoke(self, gid: int) -> dict:
        assert self.transport is not None
        return {"done": self.transport.revoke(gid)}

    def revoked(self) -> dict:
        assert self.transport is not None
        return {"gids": self.transport.take_revoked()}

    def refused(self) -> dict:
        assert self.transport is not None
        return {"refused": self.transport.refused}

    def read(
        self,
        peer: str,
        pairs: list,
        digests: str,
        deadline_s: float | None = None,
        not_after_s: float = 0.0,
    ) -> dict:
        """A READ checked against ``digests``; ``not_after_s``: seconds from now (0: none)."""
        assert self.transport is not None
        not_after = time.monotonic() + not_after_s if not_after_s else 0.0
        handle = self.transport.read(
            peer,
            [tuple(p) for p in pairs],
            deadline_s,
            digests=bytes.fromhex(digests),
            not_after=not_after,
        )
        return {"handle": handle}

    def poll(self, handle: int) -> dict:
        assert self.transport is not None
        st = self.transport.poll(handle)
        return {
            "state": st.state.value,
            "reason": st.reason,
            "settled": st.settled,
            "bad": list(st.bad),
        }

    def wait(self, handle: int, timeout_s: float, settled: bool = False) -> dict:
        """Poll until the transfer is final (and settled, if asked) or ``timeout_s`` passes."""
        assert self.transport is not None
        t0 = time.monotonic()
        while True:
            st = self.transport.poll(handle)
            final = st.state is not pt.TransferState.PENDING
            if (final and (st.settled or not settled)) or time.monotonic() - t0 > timeout_s:
                return {
                    "state": st.state.value,
                    "reason": st.reason,
                    "settled": st.settled,
                    "bad": list(st.bad),
                    "waited_s": time.monotonic() - t0,
                }
            time.sleep(0.001)

    def wait_woken(self, handle: int, timeout_s: float) -> dict:
        """Like :meth:`wait`, but sleeping on the transport's wake-up descriptor between polls
        (up to ``timeout_s`` in all); ``timer``: whether the poll that saw the transfer final
        followed a timeout rather than a wake-up (False too when the first poll saw it final)."""
        assert self.transport is not None
        t0 = time.monotonic()
        timer = False
        while True:
            self.transport.clear_wakeup()
            st = self.transport.poll(handle)
            if st.state is not pt.TransferState.PENDING or time.monotonic() - t0 > timeout_s:
                return {"state": st.state.value, "timer": timer}
            left = max(0.0, timeout_s - (time.monotonic() - t0))
            timer = not select.select([self.transport.fileno()], [], [], left)[0]

    def maps(self) -> dict:
        with open(f"/proc/{os.getpid()}/maps") as f:
            maps = f.read()
        return {
            "torch_mapped": "torch" in maps,
            "torch_imported": "torch" in sys.modules,
            "nixl_mapped": "nixl" in maps,
        }

    def close(self) -> dict:
        if self.transport is not None:
            self.transport.close()
        if self.arena is not None:
            self.arena.close()
        return {}


def main() -> None:
    serve(Peer(), _reply_fd)


if __name__ == "__main__":
    main()
    pt.exit_process(0)
