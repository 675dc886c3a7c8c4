"""The tier registry: tier type names to classes, and one ``secondary_tiers`` entry to a :class:`TierSpec`.

::

    {"type": "fs", "name": "nvme", "root_dir": ...}
        │ type (+ module_path) ──▶ tier_class() ──▶ BUILTIN_TIERS[type] or <module_path>.<type>
        │ the other keys ─────────▶ cls.config_class (a msgspec struct, forbid_unknown_fields)
        ▼                              (vLLM's key names renamed first, then validate())
    TierSpec(name="nvme", type="fs", module_path=None, config=FsTierConfig(...))

Every entry is parsed once, by :func:`kvoffload.config.parse_config` (the engine builds tiers from
the :class:`TierSpec` objects, see :func:`kvoffload.tiers.create_tier`), so a bad entry is an error
naming its key before any process or segment exists. A new built-in tier is one entry in
:data:`BUILTIN_TIERS`; an out-of-tree tier needs none: ``{"type": "<ClassName>", "module_path":
"<module>"}`` names it.

Imports only :mod:`kvoffload.validation` and :mod:`kvoffload.tiers.base` at load time (tier modules
are imported when a type is resolved), so :mod:`kvoffload.config` imports this module, not the other
way round.
"""

from __future__ import annotations

import builtins
import importlib
import re
from typing import Any

import msgspec

from kvoffload.tiers.base import SecondaryTierManager
from kvoffload.validation import (
    ConfigError,
    closest,
    convert,
    import_user_module,
    name_given_keys,
)

BUILTIN_TIERS: dict[str, str] = {
    "fs": "kvoffload.tiers.fs:FsTier",
    "obj": "kvoffload.tiers.obj:ObjTier",
    "memory": "kvoffload.tiers.memory:MemoryTier",
    "p2p": "kvoffload.tiers.p2p:P2PTier",
}
"""Built-in tier types: ``type`` -> ``"<module>:<class>"`` (imported on first use)."""

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,40}")


class TierSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One parsed ``secondary_tiers`` entry.

    Attributes:
        name: the tier's name (``name``, default its ``type``): 1-40 characters of
            ``[A-Za-z0-9_.-]``, unique among the tiers; labels its metrics and events.
        type: the type as written (``fs``, or an out-of-tree class name).
        module_path: the module of an out-of-tree tier class; None for a built-in type.
        config: the tier's settings, an instance of the tier class's ``config_class``.
    """

    name: str
    type: str
    module_path: str | None = None
    config: msgspec.Struct

    @property
    def tier_class(self) -> builtins.type[SecondaryTierManager]:
        """The tier's class (resolved when parsed, so this never fails)."""
        return tier_class(self.type, self.module_path, "secondary_tiers[]")


def tier_class(type_name: str, module_path: str | None, where: str) -> type[SecondaryTierManager]:
    """Resolve a tier type: a built-in name, or a class named ``type_name`` in ``module_path``.

    Raises:
        ConfigError: unknown type, unimportable module, or not a ``SecondaryTierManager``.
    """
    if module_path is None:
        target = BUILTIN_TIERS.get(type_name)
        if target is None:
            close = closest(type_name, list(BUILTIN_TIERS))
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(
                f"{where}.type: unknown tier type {type_name!r}{hint}; built-in types: "
                f"{', '.join(BUILTIN_TIERS)}; an out-of-tree tier needs 'module_path'"
            )
        mod_name, cls_name = target.split(":")
    else:
        mod_name, cls_name = module_path, type_name
    if module_path is None:
        mod = importlib.import_module(mod_name)  # a built-in tier's own module
    else:
        mod = import_user_module(module_path, f"{where}.module_path")
    cls = getattr(mod, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTierManager)):
        raise ConfigError(
            f"{where}.type: {mod_name}.{cls_name} is not a SecondaryTierManager subclass"
        )
    return cls


def parse_tier_config(raw: dict[str, Any], where: str) -> TierSpec:
    """Validate one ``secondary_tiers`` entry.

    Args:
        raw: the entry as written (``{"type": ..., "name": ..., "module_path": ..., <settings>}``).
        where: its key path for error messages (``kv_connector_extra_config.secondary_tiers[0]``).

    Returns:
        The entry's :class:`TierSpec`.

    Raises:
        ConfigError: naming the key path (a vLLM key name as written).
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object with a 'type', got {type(raw).__name__}")
    body = dict(raw)
    type_name = body.pop("type", None)
    if not isinstance(type_name, str):
        raise ConfigError(f"{where}.type: required, a string such as 'fs'")
    module_path = body.pop("module_path", None)
    name = body.pop("name", type_name)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}.name: 1-40 characters of [A-Za-z0-9_.-], got {name!r}")
    cls = tier_class(type_name, module_path, where)
    config_class = cls.config_class
    renamed: dict[str, str] = {}
    from_vllm = getattr(config_class, "from_vllm_keys", None)
    if from_vllm is not None:
        body, renamed = from_vllm(body, where)
    try:
        config = convert(body, config_class, where)
    except ConfigError as e:
        raise ConfigError(name_given_keys(str(e), where, renamed)) from None
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            raise ConfigError(name_given_keys(f"{where}.{e}", where, renamed)) from None
    return TierSpec(name=name, type=type_name, module_path=module_path, config=config)
