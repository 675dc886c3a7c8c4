"""Pinning the host arena: registering its rows with the accelerator driver for DMA.

::

    arena rows (POSIX shm mapping, num_slots * row_bytes bytes)
        │ split into pieces that end on row boundaries, each <= MAX_REGISTER_BYTES
        ▼
    cudaHostRegister(piece) per piece ──any piece fails──▶ unregister the pieces done; stay pageable
        │ all done
        ▼
    pinned: torch views of the rows report is_pinned(); copies use the copy engines directly
        │ release()  (before the arena is unmapped)
        ▼
    cudaHostUnregister(piece) per piece

The arena is a shared-memory mapping made before any accelerator exists in the process, so it
cannot come from the driver's pinned allocator; it is registered after the fact, as vLLM does for its
own shared offload region (``vllm.v1.kv_offload.cpu.gpu_worker.pin_mmap_region``, whose 64 GiB
piece bound against driver limits on large registrations we keep). Pieces end on row boundaries, so
no chunk's transfer straddles two registrations. Pinning only buys bandwidth: when it fails, copies
still work from pageable memory, so failure is logged and reported, never raised.

Backends: ``vllm`` calls vLLM's ``host_register``/``host_unregister`` (CUDA, ROCm, XPU; clears the
driver's last-error state after a failure); ``torch`` calls ``torch.cuda.cudart()`` (CUDA only), for
processes without vLLM. ``auto`` picks ``vllm`` when it is importable.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

log = logging.getLogger("kvoffload.pinning")

MAX_REGISTER_BYTES = 64 * 2**30
"""Largest single registration (bytes), vLLM's bound for its own offload region."""

BACKENDS = ("auto", "vllm", "torch")


def register_pieces(
    base: int, nbytes: int, row_bytes: int, max_bytes: int = MAX_REGISTER_BYTES
) -> list[tuple[int, int]]:
    """``[(address, nbytes), ...]`` covering ``[base, base + nbytes)``; every piece but the last is
    a whole number of rows of at most ``max_bytes`` (at least one row).

    Raises:
        ValueError: ``nbytes`` is not a positive multiple of ``row_bytes``.
    """
    if row_bytes <= 0 or nbytes <= 0 or nbytes % row_bytes:
        raise ValueError(
            f"cannot register {nbytes} bytes in rows of {row_bytes} bytes: "
            f"the size must be a positive multiple of the row size"
        )
    step = max(max_bytes // row_bytes, 1) * row_bytes
    return [(base + off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def _vllm_backend() -> tuple[Callable[[int, int], bool], Callable[[int], None]]:
    # through the plug-in's compat, the one module that imports vLLM; loaded only when vLLM's
    # registration is asked for, so the core imports nothing of the plug-in otherwise
    from kvoffload.vllm.compat import host_register_functions

    return host_register_functions()


def _torch_backend() -> tuple[Callable[[int, int], bool], Callable[[int], None]]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the 'torch' pinning backend needs a CUDA device and a CUDA build of "
            "torch; torch.cuda.is_available() is False"
        )
    cudart = torch.cuda.cudart()

    def register(ptr: int, size: int) -> bool:
        code = int(cudart.cudaHostRegister(ptr, size, 0))  # cudaHostRegisterDefault, as vLLM
        if code:
            _clear_cuda_error()
            log.warning("cudaHostRegister failed (code %d); the range stays pageable", code)
        return code == 0

    def unregister(ptr: int) -> None:
        code = int(cudart.cudaHostUnregister(ptr))
        if code:
            _clear_cuda_error()
            log.warning("cudaHostUnregister failed (code %d)", code)

    return register, unregister


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call, so the next kernel launch check in
    this thread does not report it. torch's ``cudart()`` module has no ``cudaGetLastError``; the
    runtime library torch loaded does."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def _backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown pinning backend {name!r}; one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
    return name, (_vllm_backend() if name == "vllm" else _torch_backend())


class HostRegistration:
    """Driver registration of one host range (the arena's rows), piece by piece.

    Args:
        base: address of the range in this process (``Arena.base_address()``).
        nbytes: bytes of the range (``num_slots * row_bytes``).
        row_bytes: bytes per arena row; pieces end on row boundaries.
        backend: ``auto``, ``vllm`` or ``torch`` (see the module docstring).
        max_piece_bytes: bound on one registration, bytes.

    Attributes:
        pinned: True when every piece registered; False leaves the range pageable (nothing held).
        pieces: the registered ``(address, nbytes)`` pieces, empty once released.
        backend: the backend used (``vllm`` or ``torch``).

    Raises:
        ValueError: bad sizes or an unknown backend.
        RuntimeError: the ``torch`` backend without a CUDA device.
    """

    def __init__(
        self,
        base: int,
        nbytes: int,
        row_bytes: int,
        backend: str = "auto",
        max_piece_bytes: int = MAX_REGISTER_BYTES,
    ):
        pieces = register_pieces(base, nbytes, row_bytes, max_piece_bytes)
        self.backend, (register, self._unregister) = _backend(backend)
        self.pieces: list[tuple[int, int]] = []
        for addr, size in pieces:
            if register(addr, size):
                self.pieces.append((addr, size))
                continue
            log.warning(
                "pinning %d bytes at offset %d of %d failed; the arena stays pageable",
                size,
                addr - base,
                nbytes,
            )
            self.release()
            break
        self.pinned = bool(self.pieces)

    def release(self) -> None:
        """Unregister every piece (idempotent). Call before the range is unmapped."""
        while self.pieces:
            addr, _ = self.pieces.pop()
            self._unregister(addr)
        self.pinned = False

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def pin_arena(
    arena, backend: str = "auto", max_piece_bytes: int = MAX_REGISTER_BYTES
) -> HostRegistration:
    """Register ``arena``'s rows (``num_slots * row_bytes`` bytes from ``base_address()``) with the
    accelerator driver. Release the result before closing the arena."""
    return HostRegistration(
        arena.base_address(),
        arena.num_slots * arena.row_bytes,
        arena.row_bytes,
        backend,
        max_piece_bytes,
    )
