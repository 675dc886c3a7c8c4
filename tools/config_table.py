"""``kvoffload check``: the resolved configuration as a table of key, value and where it came from.

Rows follow the typed structs of :mod:`kvoffload.config` (top-level settings, ``kv_events.*``,
then ``secondary_tiers[i].*`` with each tier's own config struct), so every setting the engine will
use is listed, defaults included. Values are the effective ones
(:func:`kvoffload.config.effective_config`, which the engine and each tier start with: e.g. an
fs tier's ``locality`` ``LOCAL``, ``read_io_threads`` = ``read_workers`` x ``io_threads``); a
value decided only at run time (from the model, the filesystem) or off is said in words, from the
struct's ``unset_means``, never as null. A value is ``set`` when the file names its key or it
differs from what the same struct with only its required keys would take (a key spelled with an
accepted alias, or a value derived from a set key, as ``read_workers`` from an obj tier's
``io_workers``), else ``default``. Secrets are masked as in the start-up log line.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvoffload.config import OffloadConfig, describe, effective_config


def _default_of(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


#: Shown for a None value whose struct does not say what it means (an out-of-tree tier's config
#: without ``unset_means``).
NOT_SET = "not set"


def _baseline(struct: msgspec.Struct) -> msgspec.Struct | None:
    """``struct``'s class built from its required fields only: every other field at its default
    (None where its own checks refuse that combination: then each field's default is compared)."""
    required = {
        f.name: getattr(struct, f.name)
        for f in msgspec.structs.fields(struct)
        if _default_of(f) is msgspec.NODEFAULT
    }
    try:
        return type(struct)(**required)
    except (ValueError, TypeError, msgspec.ValidationError):
        return None


def _struct_rows(
    struct: msgspec.Struct,
    baseline: msgspec.Struct | None,
    resolved: dict[str, Any],
    raw: dict[str, Any],
    prefix: str,
    rows: list[tuple[str, str, str]],
    skip: tuple[str, ...] = (),
) -> None:
    """Rows of ``struct``'s (effective) fields; values shown from ``resolved`` (its masked
    builtins form); ``baseline``: the effective struct of required fields only (None: every field
    of ``struct`` counts as set unless it equals its default)."""
    unset_means: dict[str, str] = getattr(type(struct), "unset_means", {})
    for field in msgspec.structs.fields(struct):
        name = field.name
        if name in skip:
            continue
        value = getattr(struct, name)
        sub: dict[str, Any] = raw[name] if isinstance(raw.get(name), dict) else {}
        if isinstance(value, msgspec.Struct):
            _struct_rows(value, _baseline(value), resolved[name], sub, f"{prefix}{name}.", rows)
            continue
        default = _default_of(field) if baseline is None else getattr(baseline, name)
        source = (
            "set" if name in raw or default is msgspec.NODEFAULT or value != default else "default"
        )
        shown = unset_means.get(name, NOT_SET) if value is None else _show(resolved[name])
        rows.append((f"{prefix}{name}", shown, source))


_VLLM_SPEC_DEFAULTS = {
    "spec_name": "not set: vLLM loads its own CPUOffloadingSpec, not kvoffload's",
    "spec_module_path": "not set: vLLM looks for spec_name among its own specs",
}
"""What an unset ``spec_name`` / ``spec_module_path`` means: vLLM's defaults, not the fields'."""


def config_rows(raw: dict[str, Any], cfg: OffloadConfig) -> list[tuple[str, str, str]]:
    """``(key path, value, "set" | "default")`` for every setting of a parsed configuration, with
    its effective value (:func:`~kvoffload.config.effective_config`) or, where that is decided at
    run time or off, words saying so.

    Args:
        raw: the ``kv_connector_extra_config`` dict as written.
        cfg: ``parse_config(raw)``.
    """
    resolved = json.loads(describe(cfg))  # effective values, secrets masked
    cfg = effective_config(cfg)
    rows: list[tuple[str, str, str]] = []
    top = effective_config(OffloadConfig(cpu_bytes_to_use=cfg.cpu_bytes_to_use))
    _struct_rows(cfg, top, resolved, raw, "", rows, skip=("secondary_tiers",))
    for i, (key, _, _) in enumerate(rows):  # which spec vLLM loads is vLLM's default, not ours
        if key in _VLLM_SPEC_DEFAULTS and key not in raw:
            rows[i] = (key, _VLLM_SPEC_DEFAULTS[key], "default")
    if not cfg.secondary_tiers:
        rows.append(("secondary_tiers", "[]", "set" if "secondary_tiers" in raw else "default"))
    written = raw.get("secondary_tiers") or []
    for i, (spec, shown) in enumerate(zip(cfg.secondary_tiers, resolved["secondary_tiers"])):
        where = f"secondary_tiers[{i}]"
        tier = written[i]
        rows.append((f"{where}.type", spec.type, "set"))
        rows.append((f"{where}.name", spec.name, "set" if "name" in tier else "default"))
        if spec.module_path is not None:
            rows.append((f"{where}.module_path", spec.module_path, "set"))
        baseline = _baseline(spec.config)
        if baseline is not None:
            baseline = spec.tier_class.effective_config(baseline)
        _struct_rows(spec.config, baseline, shown, tier, f"{where}.", rows)
    return rows


def render(raw: dict[str, Any], cfg: OffloadConfig, console, title: str) -> None:
    """Print :func:`config_rows` as a rich table titled ``title``."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("key", style="cyan", no_wrap=True)
    t.add_column("value", overflow="fold")
    t.add_column("source")
    for key, value, source in config_rows(raw, cfg):
        t.add_row(key, value, source if source == "default" else f"[bold]{source}[/bold]")
    console.print(t)
