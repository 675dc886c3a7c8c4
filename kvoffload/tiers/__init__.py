"""Secondary tiers: the contract (:mod:`.base`), the registry (:mod:`.registry`), built-in tiers
(``fs``, ``obj``, ``memory``) and the factory.

Out-of-tree tiers are named ``{"type": "<ClassName>", "module_path": "<module>", ...}``; the class
subclasses :class:`~kvoffload.tiers.base.SecondaryTierManager`, declares ``config_class`` (a msgspec
struct with ``forbid_unknown_fields=True`` for its own keys) and accepts the keyword arguments
``name``, ``arena_view``, ``namespace``, ``config`` and ``arena``.
"""

from __future__ import annotations

from typing import Any

from kvoffload.tiers.base import (
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    TierEvent,
)
from kvoffload.tiers.registry import TierSpec
from kvoffload.validation import ConfigError


def create_tier(spec: TierSpec, arena: Any, namespace: Any, where: str) -> SecondaryTierManager:
    """Build the tier of one parsed ``secondary_tiers`` entry.

    Args:
        spec: the entry, parsed by :func:`kvoffload.config.parse_config`.
        arena: the host :class:`~kvoffload.ipc.arena.Arena`.
        namespace: the chunks' :class:`~kvoffload.namespace.Namespace`.
        where: key path for error messages.

    Raises:
        ConfigError: a tier that cannot start (its constructor's ``ValueError``), naming the
            key path.
    """
    cls: Any = spec.tier_class  # tier classes also take ``arena`` (the base class does not)
    try:
        return cls(
            name=spec.name,
            arena_view=arena.memoryview(),
            namespace=namespace,
            config=spec.config,
            arena=arena,
        )
    except ValueError as e:
        raise ConfigError(f"{where}.{e}") from None


__all__ = [
    "JobMetadata",
    "JobResult",
    "LookupResult",
    "SecondaryTierManager",
    "TierEvent",
    "TierSpec",
    "create_tier",
]
