"""vLLM plug-in: ``spec_name: "KVOffloadSpec"``, ``spec_module_path: "kvoffload.vllm"``.

::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 4294967296,
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kvcache"}]}}'

vLLM's ``OffloadingConnector`` creates one :class:`KVOffloadSpec` in the scheduler process
(``get_manager``: the tiering manager, the host tier's slot table and the tier worker processes) and
one per model-runner rank (``get_worker``: KV copies between the accelerator and arena rows). Both
open the engine's arena by a name derived from vLLM's engine id; whichever comes first creates it.

The spec's name differs from vLLM's registered ``CPUOffloadingSpec`` / ``TieringOffloadingSpec``:
vLLM resolves those from its own registry and never reads ``spec_module_path`` for them.

Modules:

- :mod:`~kvoffload.vllm.spec`: :class:`KVOffloadSpec`, the chunk namespace of an engine
  (:func:`engine_namespace`, :func:`canonical_copies`);
- :mod:`~kvoffload.vllm.manager`: :class:`KVOffloadManager`, vLLM's ``OffloadingManager`` over a
  :class:`~kvoffload.tiering.TieringManager`;
- :mod:`~kvoffload.vllm.worker`: :class:`KVOffloadWorker`, the accelerator ↔ arena copies;
- :mod:`~kvoffload.vllm.compat`: the one place that knows which vLLM release runs;
- :mod:`~kvoffload.vllm.tiers`: kvoffload's fs and obj tiers as vLLM's own out-of-tree secondary
  tiers (under vLLM's ``TieringOffloadingSpec``);
- :mod:`~kvoffload.vllm.kv_events`: the former name of :mod:`kvoffload.kv_events` (host and tier
  events as vLLM's KV-event types, for kvoffload's own publisher; part of the core, no vLLM).

Every vLLM import of kvoffload is in :mod:`~kvoffload.vllm.compat`. The names above are loaded
when first used (``from kvoffload.vllm import KVOffloadSpec``, or vLLM's ``getattr`` on this
package), so ``kvoffload.vllm.kv_events`` and ``import kvoffload`` work without vLLM installed; the
others raise ``ImportError`` naming vLLM (or torch) when it is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.vllm.manager import KVOffloadManager
    from kvoffload.vllm.spec import KVOffloadSpec, canonical_copies, engine_namespace
    from kvoffload.vllm.worker import KVOffloadWorker

__all__ = [
    "KVOffloadManager",
    "KVOffloadSpec",
    "KVOffloadWorker",
    "canonical_copies",
    "engine_namespace",
]

_WHERE = {
    "KVOffloadSpec": "spec",
    "engine_namespace": "spec",
    "canonical_copies": "spec",
    "KVOffloadManager": "manager",
    "KVOffloadWorker": "worker",
}


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not exported here.
        ImportError: vLLM or torch is not installed.
    """
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
