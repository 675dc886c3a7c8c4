"""``kvoffload check``: the resolved configuration as a table of key, value and where it came from.

Rows follow the typed structs of :mod:`kvoffload.config` (top-level settings, ``kv_events.*``,
then ``secondary_tiers[i].*`` with each tier's own config struct), so every setting the engine will
use is listed, defaults included. A value is ``set`` when the file names its key or it differs from
the field's default (a key spelled with an accepted alias), else ``default``. Secrets are masked as
in the start-up log line.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvoffload.config import OffloadConfig, describe


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


def _struct_rows(
    struct: msgspec.Struct,
    resolved: dict[str, Any],
    raw: dict[str, Any],
    prefix: str,
    rows: list[tuple[str, str, str]],
    skip: tuple[str, ...] = (),
) -> None:
    """Rows of ``struct``'s fields; values shown from ``resolved`` (its masked builtins form)."""
    for field in msgspec.structs.fields(struct):
        name = field.name
        if name in skip:
            continue
        value = getattr(struct, name)
        if isinstance(value, msgspec.Struct):
            sub = raw.get(name) if isinstance(raw.get(name), dict) else {}
            _struct_rows(value, resolved[name], sub, f"{prefix}{name}.", rows)
            continue
        default = _default_of(field)
        source = (
            "set" if name in raw or default is msgspec.NODEFAULT or value != default else "default"
        )
        rows.append((f"{prefix}{name}", _show(resolved[name]), source))


def config_rows(raw: dict[str, Any], cfg: OffloadConfig) -> list[tuple[str, str, str]]:
    """``(key path, value, "set" | "default")`` for every setting of a parsed configuration.

    Args:
        raw: the ``kv_connector_extra_config`` dict as written.
        cfg: ``parse_config(raw)``.
    """
    resolved = json.loads(describe(cfg))  # tier defaults filled in, secrets masked
    rows: list[tuple[str, str, str]] = []
    _struct_rows(cfg, resolved, raw, "", rows, skip=("secondary_tiers",))
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
        _struct_rows(spec.config, shown, tier, f"{where}.", rows)
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
