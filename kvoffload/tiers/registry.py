"""The tier registry: tier type names to classes, and one ``secondary_tiers`` entry to a :class:`TierSpec`.

::

    {"type": "fs", "name": "nvme", "root_dir": ...}
        │ type (+ module_path) ──▶ tier_class() ──▶ BUILTIN_TIERS[type] or <module_path>.<type>
        │ the other keys ─────────▶ cls.config_class (a msgspec struct, forbid_unknown_fields)
        ▼                              (vLLM's key names renamed first, then validate(), then
        │                               check_on_this_machine())
    TierSpec(name="nvme", type="fs", module_path=None, config=FsTierConfig(...))

Every entry is parsed once, by :func:`kvoffload.config.parse_config` (the engine builds tiers from
the :class:`TierSpec` objects, see :func:`kvoffload.tiers.create_tier`), so a bad entry is an error
naming its key before any process or segment exists; every error of an entry is reported, not only
the first (:func:`parse_tier_entry`). A new built-in tier is one entry in
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
    ConfigIssue,
    RenamedWithErrors,
    check_issues,
    closest,
    convert_all,
    import_user_module,
    name_given_key,
    problems_of,
)

BUILTIN_TIERS: dict[str, str] = {
    "fs": "kvoffload.tiers.fs:FsTier",
    "obj": "kvoffload.tiers.obj:ObjTier",
    "memory": "kvoffload.tiers.memory:MemoryTier",
    "p2p": "kvoffload.tiers.p2p.tier:P2PTier",
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
    """Validate one ``secondary_tiers`` entry (:func:`parse_tier_entry`, raising its errors).

    Raises:
        ConfigError: every error found, each naming its key path (a vLLM key name as written).
    """
    spec, issues = parse_tier_entry(raw, where)
    if issues or spec is None:
        raise ConfigError(issues or [ConfigIssue(where, "cannot be read")])
    return spec


def parse_tier_entry(
    raw: Any, where: str, *, this_machine: bool = True
) -> tuple[TierSpec | None, list[ConfigIssue]]:
    """Validate one ``secondary_tiers`` entry and report every error of it.

    Steps: ``type`` (+ ``module_path``) resolves the tier class; its config struct's
    ``from_vllm_keys`` hook (optional) renames vLLM's key names; :func:`convert_all` checks the keys;
    the struct's ``validate()`` (optional; :class:`~kvoffload.validation.Problems` for several)
    checks settings that depend on each other; with ``this_machine``, its
    ``check_on_this_machine()`` (optional, a list of ``"<key>: <why>"``) checks them against this
    machine (an fs ``root_dir``: a directory, writable), as the engine does at start.

    Args:
        raw: the entry as written (``{"type": ..., "name": ..., "module_path": ..., <settings>}``).
        where: its key path for error messages (``kv_connector_extra_config.secondary_tiers[0]``).
        this_machine: run ``check_on_this_machine()`` (``kvoffload check --syntax-only`` does not,
            and runs it itself to report it as a check of this machine).

    Returns:
        ``(spec, issues)``: spec is None when no config could be built (no type, an unknown one);
        otherwise its config holds the valid keys (see :func:`convert_all`). Issues name the keys
        as written (a vLLM alias as such).
    """
    if not isinstance(raw, dict):
        return None, [
            ConfigIssue(where, f"expected an object with a 'type', got {type(raw).__name__}")
        ]
    body = dict(raw)
    type_name = body.pop("type", None)
    if not isinstance(type_name, str):
        return None, [
            ConfigIssue(
                f"{where}.type",
                "required, a string such as 'fs' (the entry's other keys are checked once it "
                "names its type)",
            )
        ]
    issues: list[ConfigIssue] = []
    module_path = body.pop("module_path", None)
    name = body.pop("name", type_name)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        issues.append(
            ConfigIssue(f"{where}.name", f"1-40 characters of [A-Za-z0-9_.-], got {name!r}")
        )
        name = type_name
    try:
        cls = tier_class(type_name, module_path, where)
    except ConfigError as e:
        return None, [*issues, *e.errors]
    config_class = cls.config_class
    renamed: dict[str, str] = {}
    from_vllm = getattr(config_class, "from_vllm_keys", None)
    if from_vllm is not None:
        try:
            body, renamed = from_vllm(body, where)
        except RenamedWithErrors as e:
            issues += e.errors
            body, renamed = e.body, e.renamed
        except ConfigError as e:
            return None, [*issues, *e.errors]
    config, own = convert_all(body, config_class, where)
    if config is None:
        return None, [*issues, *(name_given_key(i, where, renamed) for i in own)]
    problems: list[str] = []
    stood_in = type(config) is not config_class  # required keys missing: None stands in
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            problems += problems_of(e)
        except (TypeError, AttributeError):
            if not stood_in:  # else a check tripped over a stand-in of a key already reported
                raise
    machine = getattr(config, "check_on_this_machine", None) if this_machine else None
    if machine is not None and not stood_in:
        problems += machine()
    check_issues(own, problems, where, config_class)
    issues += [name_given_key(i, where, renamed) for i in own]
    return TierSpec(name=name, type=type_name, module_path=module_path, config=config), issues
