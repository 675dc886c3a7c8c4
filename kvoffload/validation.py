"""Config dicts to typed msgspec structs, with errors that name the key.

The shared half of configuration parsing: :class:`ConfigError` (one or several
:class:`ConfigIssue`, each a key path and a message), the size types every config struct uses, and
:func:`convert_all`, which turns a raw dict into a struct and rewrites msgspec's errors to name the
full key path (``kv_connector_extra_config.secondary_tiers[0].max_byte``), the closest valid key for a
near miss and the allowed keys. Imported by :mod:`kvoffload.config` (the top level),
:mod:`kvoffload.tiers.registry` (one ``secondary_tiers`` entry) and the tiers' own config structs;
it imports nothing of the project, so none of them import each other to parse.

Every error of a dict is reported, not only the first: msgspec stops at the first bad key, so
:func:`convert_all` records it, drops that key (a bad list item: that item) and converts again, until
the rest converts. A missing required field is reported with every other missing one, then stood in
for by None so the other keys are still checked; a struct's own cross-field checks
(``__post_init__``, raising :class:`Problems` for several at once) are reported and then skipped, so
an instance still comes back for callers that check further (``kvoffload check``). A key reported once
is never reported again by a later check that saw only its stand-in.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import re
from types import ModuleType
from typing import Annotated, Any, TypeVar

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
"""An integer > 0 that fits in 63 bits (counts)."""
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Bytes = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1, extra={"unit": "bytes"})]
"""A size in bytes: an integer > 0 that fits in 63 bits. A string (``"8GB"``) is refused with a
message that says so and gives the integer (:func:`convert_all`)."""
BytesOrZero = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1, extra={"unit": "bytes"})]
"""A size in bytes that may be 0."""

S = TypeVar("S", bound=msgspec.Struct)


class ConfigIssue(msgspec.Struct, frozen=True):
    """One configuration error (or, in ``kvoffload check``, a warning).

    Attributes:
        path: the key path (``kv_connector_extra_config.secondary_tiers[0].max_bytes``); "" when
            the message is about no key.
        message: what is wrong and how to fix it.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    @classmethod
    def parse(cls, text: str) -> ConfigIssue:
        """``"<key path>: <message>"`` (as every ConfigError message is written) split in two."""
        path, sep, message = text.partition(": ")
        if sep and _KEY_PATH_RE.fullmatch(path):
            return cls(path, message)
        return cls("", text)


_KEY_PATH_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*(\[[^\]\s]*\][A-Za-z0-9_.\-]*)*")


class ConfigError(ValueError):
    """Invalid configuration: one or several :class:`ConfigIssue`, each naming its key path.

    ``ConfigError("<key path>: <why>")`` makes one issue; ``ConfigError([issue, ...])`` several.
    The message is the first issue's text, then (when there are more) one line per other issue,
    so a message that starts with the first error still does.

    Attributes:
        errors: the issues, in the order found (document order: top level, then each tier).
    """

    def __init__(self, errors: str | list[ConfigIssue] | tuple[ConfigIssue, ...]):
        issues = (ConfigIssue.parse(errors),) if isinstance(errors, str) else tuple(errors)
        if not issues:
            raise TypeError("ConfigError needs at least one issue")
        self.errors: tuple[ConfigIssue, ...] = issues
        text = str(issues[0])
        if len(issues) > 1:
            more = len(issues) - 1
            text += f"\nand {more} more error{'s' if more > 1 else ''}:" + "".join(
                f"\n  {i}" for i in issues[1:]
            )
        super().__init__(text)

    def __reduce__(self):  # pickled whole (worker processes, vLLM's engine core)
        return (type(self), (list(self.errors),))


class Problems(ValueError):
    """Several independent problems found by one struct's own checks (``__post_init__`` or
    ``validate()``), each ``"<key>: <why>"``; raised together so none hides another.

    Attributes:
        problems: the messages, in the order found.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def raise_problems(problems: list[str]) -> None:
    """Raise :class:`Problems` when ``problems`` is not empty.

    Raises:
        Problems: naming each problem.
    """
    if problems:
        raise Problems(problems)


_TENANT_ID_RE = re.compile(r"[0-9a-f]{32}")  # fullmatch: no trailing newline


def tenant_quota_problems(overrides_key: str, overrides: dict[str, int]) -> list[str]:
    """Problems of a per-tenant quota overrides setting (``<overrides_key>``: tenant id -> its
    quota in bytes), each ``"<key>: <why and the fix>"``:
    an override keyed by something that is not a tenant id (the key is not echoed back: it may
    be a salt written where its id belongs)."""
    problems = []
    for i, tenant in enumerate(overrides):
        if not isinstance(tenant, str) or not _TENANT_ID_RE.fullmatch(tenant):
            problems.append(
                f"{overrides_key}: key #{i + 1} is not a tenant id (32 lowercase hex digits); "
                "write the id, never the salt: `kvoffload tenant-id` prints a salt's id (the "
                "salt read from stdin or KVOFFLOAD_TENANT_SALT)"
            )
    return problems


def problems_of(e: BaseException) -> list[str]:
    """The ``"<key>: <why>"`` messages a struct's check raised (one for a plain ValueError)."""
    return list(e.problems) if isinstance(e, Problems) else [str(e)]


_PATH_RE = re.compile(r"`\$(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]+)`")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")
_PART_RE = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[\.\.\.\]")


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
    """:func:`convert_all`, raising every error it found.

    Raises:
        ConfigError: each issue naming its key path (the closest valid key for an unknown key, the
            allowed keys, the allowed values).
    """
    value, issues = convert_all(data, struct_type, where)
    if issues or value is None:
        raise ConfigError(issues or [ConfigIssue(where, "cannot be read")])
    return value


_MAX_ROUNDS = 1000  # bad keys dropped per dict at most: a bound, far above any real config


def convert_all(data: Any, struct_type: type[S], where: str) -> tuple[S | None, list[ConfigIssue]]:
    """``msgspec.convert`` that reports every error of ``data``, each naming ``where`` + its key path.

    After an error the offending key (or list item) is dropped and the rest converted again; a
    missing required field is reported with every other missing one and stood in for by None; the
    struct's own checks (``__post_init__``; :class:`Problems` for several) are reported, then
    skipped (see the module docstring). ``data`` itself is never modified.

    Args:
        data: the raw dict.
        struct_type: the struct to build.
        where: prefix for key paths in messages (e.g. ``kv_connector_extra_config``).

    Returns:
        ``(value, issues)``: value is a ``struct_type`` (a subclass of it with None for missing
        required fields when some are missing) built from the keys that are valid, or None when
        ``data`` is not a dict; issues is empty exactly when ``data`` is valid as a whole.
    """
    if not isinstance(data, dict):
        return None, [ConfigIssue(where, f"expected an object (dict), got {type(data).__name__}")]
    issues: list[ConfigIssue] = []
    typ: type[Any] = struct_type
    optional_required = skip_checks = False
    work: Any = data
    removed: dict[tuple, list[int]] = {}  # list path (as now) -> original indices of dropped items
    for _ in range(_MAX_ROUNDS):
        try:
            return msgspec.convert(work, typ, strict=True), issues
        except msgspec.ValidationError as e:
            if work is data:
                work = copy.deepcopy(data)  # only a bad config pays for the copy
            msg = str(e)
            m = _PATH_RE.search(msg)
            parts = _parts(m.group("path")) if m else []
            shown = where + _format(_original(parts, removed))
            cause = e.__cause__
            if isinstance(cause, (ValueError, TypeError)):
                # The struct's own checks: every field of it converted.
                owner = _struct_at(struct_type, _format(parts))
                if not (optional_required and isinstance(cause, TypeError)):
                    for text in problems_of(cause):
                        _add_check_issue(issues, text, shown, owner)
                if not parts:
                    skip_checks = True
                    typ = _lenient(struct_type, optional_required, skip_checks)
                    continue
            elif unknown := _UNKNOWN_RE.search(msg):
                field = unknown.group("field")
                issues.append(ConfigIssue(shown, _unknown_key(struct_type, parts, field)))
                parts = [*parts, field]
            elif _MISSING_RE.search(msg):
                owner = _struct_at(struct_type, _format(parts)) or struct_type
                given = _walk(work, parts)
                reported = {i.path for i in issues}  # a key dropped for its value is not missing
                for f in msgspec.structs.fields(owner):
                    path = f"{shown}.{f.name}"
                    if f.required and path not in reported:
                        if not (isinstance(given, dict) and f.name in given):
                            issues.append(ConfigIssue(path, _missing(owner, f.name)))
                if not parts:
                    optional_required = True
                    typ = _lenient(struct_type, optional_required, skip_checks)
                    continue
            else:
                value = _walk(work, parts)
                issues.append(ConfigIssue(shown, _value_problem(struct_type, parts, msg, value)))
            if not _drop(work, parts, removed):
                return None, issues
    return None, issues


def _parts(path: str) -> list[str | int | None]:
    """msgspec's ``.a[0].b`` as ``["a", 0, "b"]``; None for a dict key it does not name (``[...]``)."""
    out: list[str | int | None] = []
    for m in _PART_RE.finditer(path):
        name, index = m.group(1), m.group(2)
        out.append(name if name is not None else int(index) if index is not None else None)
    return out


def _format(parts: list[str | int | None]) -> str:
    return "".join(
        f".{p}" if isinstance(p, str) else f"[{p}]" if isinstance(p, int) else "[...]"
        for p in parts
    )


def _original(parts: list[str | int | None], removed: dict[tuple, list[int]]) -> list:
    """``parts`` with each list index turned back into its index as written (items dropped
    earlier shifted the ones after them)."""
    out: list[str | int | None] = []
    for i, p in enumerate(parts):
        if isinstance(p, int):
            for gone in sorted(removed.get(tuple(parts[:i]), ())):
                if gone <= p:
                    p += 1
        out.append(p)
    return out


def _walk(data: Any, parts: list[str | int | None]) -> Any:
    """The value at ``parts`` in ``data``, or None when it cannot be followed."""
    for p in parts:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _drop(work: Any, parts: list[str | int | None], removed: dict[tuple, list[int]]) -> bool:
    """Remove the key (or list item) at ``parts`` from ``work``; False when there is none."""
    if None in parts:  # a dict key msgspec does not name: drop the whole dict
        parts = parts[: parts.index(None)]
    if not parts:
        return False
    container, last = _walk(work, parts[:-1]), parts[-1]
    if isinstance(last, int) and isinstance(container, list) and last < len(container):
        removed.setdefault(tuple(parts[:-1]), []).append(_original(parts, removed)[-1])
        del container[last]
        return True
    if isinstance(last, str) and isinstance(container, dict) and last in container:
        del container[last]
        return True
    return False


@functools.cache
def _lenient(struct_type: type[Any], optional_required: bool, skip_checks: bool) -> type[Any]:
    """``struct_type`` with its required fields optional (None) and/or its ``__post_init__``
    skipped, so the other keys of a config that lacks one can still be checked."""
    fields = [
        (f.name, f.type | None, None)
        for f in msgspec.structs.fields(struct_type)
        if optional_required and f.required
    ]
    namespace: dict[str, Any] = {"__post_init__": lambda self: None} if skip_checks else {}
    return msgspec.defstruct(
        struct_type.__name__,
        fields,
        bases=(struct_type,),
        namespace=namespace,
        kw_only=True,
        forbid_unknown_fields=True,
        module=struct_type.__module__,
    )


def _add_check_issue(
    issues: list[ConfigIssue], text: str, where: str, owner: type[msgspec.Struct] | None
) -> None:
    """Add the problem ``"<field>: <why>"`` a struct's own check found, named by its field's path
    when it names a field; not when that key was already reported (it was stood in for)."""
    field, sep, why = text.partition(": ")
    first = text.split(" ", 1)[0]  # "heartbeat_s (5.0) must be below ...": about heartbeat_s
    fields = owner.__struct_fields__ if owner is not None else ()
    if sep and field in fields:
        issue = ConfigIssue(f"{where}.{field}", why)
    elif first in fields:
        issue = ConfigIssue(f"{where}.{first}", text)
    else:
        issue = ConfigIssue.parse(f"{where}.{text}") if sep else ConfigIssue(where, text)
    if issue.path != where and any(i.path == issue.path for i in issues):
        return  # that key was reported already: this check saw its stand-in
    issues.append(issue)


def check_issues(
    issues: list[ConfigIssue], problems: list[str], where: str, owner: type[msgspec.Struct]
) -> None:
    """Add the ``"<field>: <why>"`` problems a struct's ``validate()`` found to ``issues``, named
    by key path, leaving out those about a key already reported."""
    for text in problems:
        _add_check_issue(issues, text, where, owner)


def _unknown_key(root: type[msgspec.Struct], parts: list, field: str) -> str:
    owner = _struct_at(root, _format(parts)) or root
    allowed = _fields_of(owner) + list(getattr(owner, "vllm_aliases", {}))
    close = closest(field, allowed)
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"unknown key {field!r}{hint}; allowed keys: {', '.join(allowed)}"


def _missing(owner: type[msgspec.Struct], name: str) -> str:
    field = _field_info(owner, name)
    what = " (a size in bytes, as an integer)" if field and _is_bytes(field.type) else ""
    return f"required, and missing{what}"


def _value_problem(root: type[msgspec.Struct], parts: list, msg: str, value: Any) -> str:
    """What is wrong with ``value`` at ``parts``, from msgspec's message ``msg``."""
    detail = _PATH_RE.sub("", msg).replace(" - at ", "").strip(" -")
    sub = _format(parts)
    parent, _, name = sub.rpartition(".")
    owner = _struct_at(root, parent) if parent else root
    field = _field_info(owner, name)
    if owner is not None and field is not None and isinstance(value, str) and _is_bytes(field.type):
        return _bytes_problem(value, owner, field)
    values = _literal_values(root, sub) if "Invalid enum value" in msg else None
    if values:
        detail += f"; allowed: {', '.join(map(str, values))}"
    elif not NOT_REPEATED_RE.search(str(name)) and not (parts and parts[-1] is None):
        # msgspec's message names the type, not the value (a dict entry's value, ``[...]``, is
        # not known here: said as "one of its entries" instead of a wrong "given: null")
        detail += f" (given: {_given(value)})"
    elif parts and parts[-1] is None:
        detail += " (in one of its entries)"
    allowed = _allowed_numbers(field.type) if field is not None else None
    # msgspec names the type, or the one bound the value broke: say the whole range where that
    # is more (a wrong type; a range with two ends)
    if allowed and ("got `" in msg or " from " in allowed or " and " in allowed):
        detail += f"; allowed: {allowed}"
    return detail


_NO_BOUND = 2**63 - 1  # an integer setting's upper "bound" that only says it fits in 64 bits


def _allowed_numbers(t: Any) -> str | None:
    """A bounded number field's allowed values, e.g. ``a number from 0.0001 to 0.1, or null``
    (None for a field that is not a number with a bound, or that takes other forms too)."""
    nullable = False
    said = None
    for x in _types(t):
        if isinstance(x, msgspec.inspect.Metadata):
            x = x.type
        if isinstance(x, msgspec.inspect.NoneType):
            nullable = True
        elif not isinstance(x, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
            return None  # a string, a literal, a list...: the number's range is not all it takes
        elif said is None:
            kind = "an integer" if isinstance(x, msgspec.inspect.IntType) else "a number"
            le = None if x.le == _NO_BOUND else x.le
            if x.ge is not None and le is not None:
                said = f"{kind} from {x.ge} to {le}"
                continue
            bounds = [
                f"{op} {v}"
                for op, v in ((">=", x.ge), (">", x.gt), ("<=", le), ("<", x.lt))
                if v is not None
            ]
            if bounds:
                said = f"{kind} {' and '.join(bounds)}"
    if said is None:
        return None
    return f"{said}, or null" if nullable else said


SECRET_KEY_RE = re.compile(r"secret|token|password|credential|api_key", re.IGNORECASE)
"""Setting names that hold a secret: their values are masked in the effective config
(``kvoffload.config.describe``) and never repeated in an error."""
NOT_REPEATED_RE = re.compile(SECRET_KEY_RE.pattern + r"|salt|key", re.IGNORECASE)
"""Setting names whose wrongly typed values an error never repeats: the secrets, a
``cache_salt`` (a tenant's isolation: guessable from its words), anything named a key."""


def _given(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, shortened to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_info(owner: type[msgspec.Struct] | None, name: str) -> msgspec.inspect.Field | None:
    if owner is None:
        return None
    info = msgspec.inspect.type_info(owner)
    assert isinstance(info, msgspec.inspect.StructType)
    return next((f for f in info.fields if f.name == name), None)


def _types(t: Any) -> tuple[Any, ...]:
    return t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)


def _is_bytes(t: Any) -> bool:
    """Whether a field's type (or one form of its union) is :data:`Bytes` / :data:`BytesOrZero`."""
    return any(
        isinstance(x, msgspec.inspect.Metadata) and (x.extra or {}).get("unit") == "bytes"
        for x in _types(t)
    )


_SIZE_RE = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[kKmMgGtTpP])?(?P<i>i)?[bB]?")


def _bytes_problem(value: str, owner: type[msgspec.Struct], field: msgspec.inspect.Field) -> str:
    """A size written as a string: say it is bytes as an integer, what the string would be, and
    the field's other allowed forms."""
    m = _SIZE_RE.fullmatch(value.strip())
    if m and not m.group("unit"):
        text = f"a size in bytes, as an integer: write {value.strip()} without quotes"
    elif m:
        n, unit = float(m.group("n")), m.group("unit").upper()
        power = "KMGTP".index(unit) + 1
        binary = f"{m.group('n')} {unit}iB is {int(n * 1024**power)}"
        decimal = f"{m.group('n')} {unit}B is {int(n * 1000**power)}"
        both = binary if m.group("i") else f"{binary}, {decimal}"
        text = f"a size in bytes, as an integer, not the string {value!r} ({both})"
    else:
        text = (
            f"a size in bytes, as an integer (e.g. 1073741824 for 1 GiB), not the string {value!r}"
        )
    others = []
    for t in _types(field.type):
        if isinstance(t, msgspec.inspect.LiteralType):
            others += [f'"{v}"' for v in t.values]
        elif isinstance(t, msgspec.inspect.NoneType):
            means = getattr(owner, "unset_means", {}).get(field.name)
            others.append(f"null ({means})" if means else "null")
    return text + (f"; also allowed: {', '.join(others)}" if others else "")


def _literal_values(root: type[msgspec.Struct], path: str) -> list | None:
    """The values a ``Literal`` field at ``path`` (``.a[0].b``) allows, when it can be told."""
    parent, _, name = path.rpartition(".")
    field = _field_info(_struct_at(root, parent) if parent else root, name)
    if field is None:
        return None
    types = _types(field.type)
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
    forms = [t.type if isinstance(t, msgspec.inspect.Metadata) else t for t in types]
    return values + [others[type(t)] for t in forms if type(t) in others]


def apply_aliases(
    body: dict[str, Any],
    aliases: dict[str, str],
    where: str,
    renamed: dict[str, str],
    origin: str = "",
    issues: list[ConfigIssue] | None = None,
) -> None:
    """Rename vLLM's key names in ``body`` to ours, in place.

    Args:
        body: a tier's config dict (already a copy).
        aliases: vLLM's name -> our name.
        where: key path for error messages.
        renamed: filled with our name -> the name as written (for error messages).
        origin: prefix of the written name (``"store_config."`` for nested keys).
        issues: when given, a conflict is added here (the vLLM name left out, ours kept) instead
            of raised, so the other keys are still checked.

    Raises:
        ConfigError: both a vLLM name and our name (or two names for one setting) are given, and
            ``issues`` is None.
    """
    for alias, ours in aliases.items():
        if alias not in body:
            continue
        if ours in body:
            first = renamed.get(ours, ours)
            what = f" ({ours!r})" if first != ours else ""
            issue = ConfigIssue(
                where,
                f"{origin + alias!r} (vLLM's name) and {first!r} set the same thing{what}; keep one",
            )
            if issues is None:
                raise ConfigError([issue])
            issues.append(issue)
            del body[alias]
            continue
        body[ours] = body.pop(alias)
        renamed[ours] = origin + alias


class RenamedWithErrors(ConfigError):
    """Raised by a config struct's ``from_vllm_keys`` hook that found errors but renamed the
    other keys: the parser reports the errors and still checks ``body``.

    Attributes:
        body: the tier's keys with our names, the offending ones left out.
        renamed: our name -> the name as written.
    """

    def __init__(self, errors: list[ConfigIssue], body: dict[str, Any], renamed: dict[str, str]):
        super().__init__(errors)
        self.body = body
        self.renamed = renamed

    def __reduce__(self):
        return (ConfigError, (list(self.errors),))


def name_given_key(issue: ConfigIssue, where: str, renamed: dict[str, str]) -> ConfigIssue:
    """``issue`` naming the key the user wrote (a vLLM alias) rather than ours."""
    for ours, given in renamed.items():
        if issue.path == f"{where}.{ours}":
            return ConfigIssue(f"{where}.{given}", issue.message)
    return issue
