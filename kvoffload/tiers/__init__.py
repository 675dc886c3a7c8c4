"""Secondary tiers: the contract (:mod:`.base`), built-in tiers (``fs``, ``memory``) and the factory.

Out-of-tree tiers are named ``{"type": "<ClassName>", "module_path": "<module>", ...}``; the class
subclasses :class:`~kvoffload.tiers.base.SecondaryTierManager`, declares ``config_class`` (a msgspec
struct with ``forbid_unknown_fields=True`` for its own keys) and accepts the keyword arguments
``name``, ``arena_view``, ``namespace``, ``config`` and ``arena``.
"""

from __future__ import annotations

from typing import Any

from kvoffload.config import ConfigError, parse_tier_config
from kvoffload.tiers.base import (
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    TierEvent,
)


def create_tier(
    raw: dict[str, Any], arena: Any, namespace: Any, where: str
) -> SecondaryTierManager:
    """Validate one ``secondary_tiers`` entry and build the tier.

    Args:
        raw: the tier's config dict.
        arena: the host :class:`~kvoffload.ipc.arena.Arena`.
        namespace: the chunks' :class:`~kvoffload.namespace.Namespace`.
        where: key path for error messages.

    Raises:
        ConfigError: invalid config or a tier that cannot start, naming the key path.
    """
    name, cls, cfg = parse_tier_config(raw, where)
    try:
        return cls(
            name=name, arena_view=arena.memoryview(), namespace=namespace, config=cfg, arena=arena
        )
    except ValueError as e:
        raise ConfigError(f"{where}.{e}") from None


__all__ = [
    "JobMetadata",
    "JobResult",
    "LookupResult",
    "SecondaryTierManager",
    "TierEvent",
    "create_tier",
]
