"""An out-of-tree worker-side I/O module for tests (CASES C25): the fs tier's I/O, except that the
keys named in its config's ``poison`` (key hex -> what to do) misbehave the way a buggy module would:
raise an exception that is not an I/O error (``ValueError``, ``MemoryError``, ``struct.error``), or
answer the old tuple instead of an :class:`~kvoffload.workers.chunkio.IOOutcome` (``tuple``).

Imported by name inside the tier's worker processes (``PoisonTier.io_module``), so it imports only
worker-side modules.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from kvoffload.workers.fs_io import FsIO, FsIOConfig

if TYPE_CHECKING:
    from kvoffload.workers.chunkio import IOOutcome
    from kvoffload.workers.faults import Faults


class PoisonIOConfig(FsIOConfig, kw_only=True, tag="poison"):
    """The fs tier's I/O config plus ``poison`` (chunk key hex -> what to do)."""

    poison: dict[str, str] = {}


IO_CONFIG = PoisonIOConfig

_RAISES = {"ValueError": ValueError, "MemoryError": MemoryError, "struct.error": struct.error}


class PoisonIO:
    """A :class:`~kvoffload.workers.chunkio.ChunkIO` that wraps :class:`FsIO`."""

    def __init__(self, inner: FsIO, poison: dict[str, str]):
        self.inner = inner
        self.poison = poison

    def _misbehave(self, key: bytes, op: str):
        what = self.poison.get(key.hex())
        if what is None:
            return None
        if what == "tuple":
            return (0, 0, "")
        raise _RAISES[what](f"poisoned {op} of {key.hex()[:16]}")

    def store(self, key: bytes, src: memoryview) -> IOOutcome:
        return self._misbehave(key, "store") or self.inner.store(key, src)

    def load(self, key: bytes, dst: memoryview) -> IOOutcome:
        return self._misbehave(key, "load") or self.inner.load(key, dst)

    def probe(self, key: bytes) -> IOOutcome:
        return self.inner.probe(key)

    def delete(self, key: bytes) -> IOOutcome:
        return self.inner.delete(key)

    def scan(self) -> list[tuple[bytes, int, float]]:
        return self.inner.scan()


def make_io(config: PoisonIOConfig, faults: Faults) -> PoisonIO:
    return PoisonIO(FsIO(config, faults), config.poison)
