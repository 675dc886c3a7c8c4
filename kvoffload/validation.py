"""Config dicts to typed msgspec structs, with errors that name the key.

The shared half of configuration parsing: :class:`ConfigError`, the size types every config struct
uses, and :func:`convert`, which turns a raw dict into a struct and rewrites msgspec's errors to name
the full key path (``kv_connector_extra_config.secondary_tiers[0].max_byte``), the closest valid key
for a near miss and the allowed keys. Imported by :mod:`kvoffload.config` (the top level),
:mod:`kvoffload.tiers.registry` (one ``secondary_tiers`` entry) and the tiers' own config structs;
it imports nothing of the project, so none of them import each other to parse.
"""

from __future__ import annotations

import difflib
import importlib
import re
from types import ModuleType
from typing import Annotated, Any, TypeVar

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
"""An integer > 0 that fits in 63 bits (sizes in bytes, counts)."""
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key path."""


_PATH_RE = re.compile(r"`\$(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]+)`")


def import_user_module(module_path: object, where: str) -> ModuleType:
    """Import the out-of-tree module a config names (a tier's ``module_path``, a policy's
    ``cache_policy_module_path``).

    Raises:
        ConfigError: ``where`` and why: not a non-empty absolute module name, or its import failed
            for any reason (missing, a syntax error, an exception raised at import), with the error.
    """
    if not isinstance(module_path, str) or not module_path or module_path.startswith("."):
        raise ConfigError(
            f"{where}: expected an absolute module name such as 'my_pkg.tiers', got {module_path!r}"
        )
    try:
        return importlib.import_module(module_path)
    except Exception as e:  # an out-of-tree module's import may raise anything
        raise ConfigError(
            f"{where}: cannot import {module_path!r}: {type(e).__name__}: {e}"
        ) from None


def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate a misspelled or truncated ``word`` most likely meant, or None."""
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if close:
        return close[0]
    if len(word) >= 4:
        prefixed = [c for c in candidates if c.startswith(word) or word.startswith(c)]
        if len(prefixed) == 1:
            return prefixed[0]
    return None


def _fields_of(struct_type: type[msgspec.Struct]) -> list[str]:
    return list(struct_type.__struct_fields__)


def _struct_at(root: type[msgspec.Struct], path: str) -> type[msgspec.Struct] | None:
    """The struct type found by following ``path`` (``.a[0].b``) from ``root``, when it can be told."""
    typ: Any = root
    for part in re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[\d+\]", path):
        if not part:
            continue
        if not (isinstance(typ, type) and issubclass(typ, msgspec.Struct)):
            return None
        info = msgspec.inspect.type_info(typ)
        assert isinstance(info, msgspec.inspect.StructType)
        field = next((f for f in info.fields if f.name == part), None)
        if field is None:
            return None
        t = field.type
        while isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.UnionType)):
            if isinstance(t, msgspec.inspect.ListType):
                t = t.item_type
            else:
                structs = [x for x in t.types if isinstance(x, msgspec.inspect.StructType)]
                t = structs[0] if structs else t.types[0]
                break
        typ = t.cls if isinstance(t, msgspec.inspect.StructType) else None
    return typ if isinstance(typ, type) else None


def convert(data: Any, struct_type: type[S], where: str) -> S:
    """``msgspec.convert`` with errors rewritten to name ``where`` + the key path.

    Args:
        data: the raw dict.
        struct_type: the struct to build.
        where: prefix for key paths in messages (e.g. ``kv_connector_extra_config``).

    Raises:
        ConfigError: naming the key path, the closest valid key for unknown keys, and the allowed
            keys.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object (dict), got {type(data).__name__}")
    try:
        return msgspec.convert(data, struct_type, strict=True)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH_RE.search(msg)
        sub = m.group("path") if m else ""
        unknown = _UNKNOWN_RE.search(msg)
        if unknown:
            field = unknown.group("field")
            owner = _struct_at(struct_type, sub) or struct_type
            allowed = _fields_of(owner) + list(getattr(owner, "vllm_aliases", {}))
            close = closest(field, allowed)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(
                f"{where}{sub}: unknown key {field!r}{hint}; allowed keys: {', '.join(allowed)}"
            ) from None
        detail = _PATH_RE.sub("", msg).replace(" - at ", "").strip(" -")
        # A struct's own check (__post_init__) names its field first: "arg: why".
        field, sep, why = detail.partition(": ")
        checked = _struct_at(struct_type, sub) if sep else None
        if checked is not None and field in checked.__struct_fields__:
            sub, detail = f"{sub}.{field}", why
        values = _literal_values(struct_type, sub) if "Invalid enum value" in msg else None
        if values:
            detail += f"; allowed: {', '.join(map(str, values))}"
        raise ConfigError(f"{where}{sub}: {detail}") from None


def _literal_values(root: type[msgspec.Struct], path: str) -> list | None:
    """The values a ``Literal`` field at ``path`` (``.a[0].b``) allows, when it can be told."""
    parent, _, name = path.rpartition(".")
    owner = _struct_at(root, parent) if parent else root
    if owner is None:
        return None
    info = msgspec.inspect.type_info(owner)
    assert isinstance(info, msgspec.inspect.StructType)
    field = next((f for f in info.fields if f.name == name), None)
    if field is None:
        return None
    types = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
    values = next(
        (list(t.values) for t in types if isinstance(t, msgspec.inspect.LiteralType)), None
    )
    if values is None:
        return None
    # the union's other forms, so a wrong string does not read as if only the words were allowed
    others = {
        msgspec.inspect.IntType: "an integer",
        msgspec.inspect.FloatType: "a number",
        msgspec.inspect.NoneType: "null",
    }
    return values + [others[type(t)] for t in types if type(t) in others]


def apply_aliases(
    body: dict[str, Any],
    aliases: dict[str, str],
    where: str,
    renamed: dict[str, str],
    origin: str = "",
) -> None:
    """Rename vLLM's key names in ``body`` to ours, in place.

    Args:
        body: a tier's config dict (already a copy).
        aliases: vLLM's name -> our name.
        where: key path for error messages.
        renamed: filled with our name -> the name as written (for error messages).
        origin: prefix of the written name (``"store_config."`` for nested keys).

    Raises:
        ConfigError: both a vLLM name and our name (or two names for one setting) are given.
    """
    for alias, ours in aliases.items():
        if alias not in body:
            continue
        if ours in body:
            first = renamed.get(ours, ours)
            what = f" ({ours!r})" if first != ours else ""
            raise ConfigError(
                f"{where}: {origin + alias!r} (vLLM's name) and {first!r} set the same "
                f"thing{what}; keep one"
            )
        body[ours] = body.pop(alias)
        renamed[ours] = origin + alias


def name_given_keys(msg: str, where: str, renamed: dict[str, str]) -> str:
    """Rewrite an error about one of our keys to name the key the user wrote (a vLLM alias)."""
    for ours, given in renamed.items():
        if msg.startswith(f"{where}.{ours}:"):
            return f"{where}.{given}:" + msg[len(f"{where}.{ours}:") :]
    return msg
