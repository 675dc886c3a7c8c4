"""Configuration: vLLM's ``kv_connector_extra_config`` dict parsed into typed msgspec structs.

Every struct forbids unknown fields. An unknown key, a wrong type or an impossible size raises
:class:`ConfigError` whose message names the full key path (``secondary_tiers[0].max_byte``), suggests
the closest valid key for a near miss and lists the allowed keys, before any process or segment is
created. Sizes are integers in bytes: ``"10GB"`` is rejected, not guessed.

Example::

    {"cpu_bytes_to_use": 8589934592, "eviction_policy": "arc",
     "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kv", "max_bytes": 500000000000}]}
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Annotated, Any

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key path."""


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV events on a ZMQ PUB socket (``kv_events`` in ``kv_connector_extra_config``).

    Attributes:
        endpoint: ZMQ endpoint the PUB socket binds (``tcp://*:5557``; port 0 picks one).
        replay_endpoint: ROUTER endpoint serving recent batches to late subscribers (None: off).
        topic: topic of vLLM-format ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved``).
        movements_topic: topic of chunk-movement batches (key, source, destination, locality).
            Neither topic may be a prefix of the other (a ZMQ subscription matches by prefix).
        buffer_steps: batches kept per topic for replay.
        hwm: the PUB socket's send high-water mark (messages); beyond it ZMQ drops.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    movements_topic: str = "kvoffload-movements"
    buffer_steps: Positive = 10_000
    hwm: Positive = 100_000


class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Top-level settings (``kv_connector_extra_config``).

    Attributes:
        cpu_bytes_to_use: host-tier (arena) size in bytes. Required.
        blocks_per_chunk: engine blocks per chunk (default 1). Read by vLLM too.
        block_size: tokens per chunk instead of ``blocks_per_chunk`` (a multiple of the engine
            block size). Read by vLLM too.
        eviction_policy: ``lru`` or ``arc``, or an out-of-tree policy class name.
        cache_policy_module_path: module of an out-of-tree eviction policy.
        secondary_tiers: ordered list of tier configs (``{"type": "fs", ...}``); lookups ask them
            in this order, stores go to all of them.
        arena_name: fixed /dev/shm name for the host arena (default: derived from the engine id).
        cache_salt: part of the namespace: instances with different salts never share chunks.
        model_revision: model revision for the namespace when the engine does not report one.
        offload_prompt_only: offload prompt blocks only (vLLM's setting, default True).
        tier_pin_fraction: at most this fraction of the host slots may be pinned by one secondary
            tier's in-flight stores (write-through); beyond it, that tier's stores are dropped and
            counted (``kvoffload_dropped_stores``), so a slow tier cannot pin the whole host tier
            and starve new stores (CASES C37). Default 0.5, chosen by measurement (BENCHMARKS.md
            §7); 1.0 lets one slow tier pin every host slot.
        canonical_layout: store rows in vLLM's canonical (parallelism-free) layout.
        self_describing_kv_events: vLLM's own KV events for offloaded chunks carry the request's
            parent hash and token ids (vLLM's tracker; default on here, off in vLLM's own spec).
        kv_events: publish KV events and chunk movements on a ZMQ PUB socket (see
            :class:`KVEventsConfig`; None: off). Independent of vLLM's own ``--kv-events-config``.
        instance_id: the ``instance`` label of standalone metrics and movement events (default:
            process id and a counter).
        spec_name, spec_module_path: how vLLM found this spec.
        lock, config_info, expedited: accepted for vLLM 0.33 compatibility; unused.
        sync_load_budget_bytes: read by vLLM's offloading scheduler (0.33), whatever the spec.
        tier_poll_interval_s, backpressure, store_threshold, max_tracker_size: settings of vLLM's
            own ``TieringOffloadingSpec`` / ``CPUOffloadingSpec``, accepted so that a config
            written for it works unchanged; they have no effect here (logged once at start, see
            :func:`ineffective_vllm_keys`). ``store_threshold`` above 1 is refused, as vLLM's
            tiering spec refuses it.
    """

    cpu_bytes_to_use: Positive
    blocks_per_chunk: Positive | None = None
    block_size: Positive | None = None
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    secondary_tiers: list[dict[str, Any]] = []
    arena_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] | None = None
    cache_salt: str = ""
    model_revision: str | None = None
    offload_prompt_only: bool = True
    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    canonical_layout: bool = False
    self_describing_kv_events: bool = True
    kv_events: KVEventsConfig | None = None
    instance_id: str | None = None
    spec_name: str = "KVOffloadSpec"
    spec_module_path: str = "kvoffload.vllm"
    lock: Any = None
    config_info: Any = None
    expedited: Any = None
    sync_load_budget_bytes: NonNegative = 0
    tier_poll_interval_s: float | None = None
    backpressure: dict[str, Any] | None = None
    store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    max_tracker_size: Positive | None = None


# Keys of vLLM's own tiering spec that kvoffload accepts (so a config written for it works after
# changing only spec_name / spec_module_path) but does not act on, with what does that job here.
VLLM_ONLY_KEYS = {
    "tier_poll_interval_s": "tier workers report over sockets drained at every scheduler step",
    "backpressure": "see tier_pin_fraction, and the tiers' max_pending_store_chunks and "
    "breaker_failures",
    "max_tracker_size": "kvoffload offloads every stored chunk (store_threshold 0)",
}
VLLM_ONLY_TIER_KEYS = {
    "backpressure": "see the tier's max_pending_store_chunks and breaker_failures, and "
    "tier_pin_fraction",
    "enable_kv_events": "kvoffload reports every tier in KV events whenever events are on",
}


_PATH_RE = re.compile(r"`\$(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `(?P<field>[^`]+)`")


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


def convert(data: Any, struct_type: type[msgspec.Struct], where: str) -> Any:
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
        owner = _struct_at(struct_type, sub) if sep else None
        if owner is not None and field in owner.__struct_fields__:
            sub, detail = f"{sub}.{field}", why
        allowed = _literal_values(struct_type, sub) if "Invalid enum value" in msg else None
        if allowed:
            detail += f"; allowed: {', '.join(map(str, allowed))}"
        raise ConfigError(f"{where}{sub}: {detail}") from None


def _literal_values(root: type[msgspec.Struct], path: str) -> list | None:
    """The values a ``Literal`` field at ``path`` (``.a[0].b``) allows, when it can be told."""
    parent, _, name = path.rpartition(".")
    owner = _struct_at(root, parent) if parent else root
    if owner is None:
        return None
    field = next((f for f in msgspec.inspect.type_info(owner).fields if f.name == name), None)
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


def parse_config(extra_config: dict[str, Any]) -> OffloadConfig:
    """Parse and validate the whole configuration, secondary tiers included.

    Raises:
        ConfigError: anything invalid, named by key path.
    """
    if not isinstance(extra_config, dict):
        raise ConfigError(
            f"kv_connector_extra_config: expected an object (dict), got "
            f"{type(extra_config).__name__}"
        )
    cfg = convert(dict(extra_config), OffloadConfig, "kv_connector_extra_config")
    if cfg.blocks_per_chunk is not None and cfg.block_size is not None:
        raise ConfigError(
            "kv_connector_extra_config: set only one of 'blocks_per_chunk' and 'block_size'"
        )
    if cfg.cache_policy_module_path is not None:
        from kvoffload.policies import make_policy

        try:
            make_policy(cfg.eviction_policy, 1, cfg.cache_policy_module_path)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config.cache_policy_module_path: {e}") from None
    else:
        from kvoffload.policies import BUILTIN_POLICIES

        if cfg.eviction_policy not in BUILTIN_POLICIES:
            close = closest(cfg.eviction_policy, list(BUILTIN_POLICIES))
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(
                f"kv_connector_extra_config.eviction_policy: unknown policy "
                f"{cfg.eviction_policy!r}{hint}; allowed: {', '.join(BUILTIN_POLICIES)}, or a class "
                f"name together with cache_policy_module_path"
            )
    ev = cfg.kv_events
    if (
        ev is not None and ev.replay_endpoint == ev.endpoint and not ev.endpoint.endswith(":0")
    ):  # port 0: each socket gets its own free port
        raise ConfigError(
            "kv_connector_extra_config.kv_events.replay_endpoint: the same as endpoint "
            f"({ev.endpoint!r}); the replay socket needs its own address"
        )
    if ev is not None:
        a, b = ev.topic, ev.movements_topic
        if a.startswith(b) or b.startswith(a):
            raise ConfigError(
                f"kv_connector_extra_config.kv_events.movements_topic: {b!r} and topic {a!r} overlap "
                f"(a ZMQ subscription to one would also receive the other); pick topics that are not "
                f"prefixes of each other"
            )
    names = set()
    for i, tier in enumerate(cfg.secondary_tiers):
        name, _, _ = parse_tier_config(tier, f"kv_connector_extra_config.secondary_tiers[{i}]")
        if name in names:
            raise ConfigError(
                f"kv_connector_extra_config.secondary_tiers[{i}].name: duplicate tier name {name!r}"
            )
        names.add(name)
    return cfg


BUILTIN_TIERS = {
    "fs": "kvoffload.tiers.fs:FsTier",
    "obj": "kvoffload.tiers.obj:ObjTier",
    "memory": "kvoffload.tiers.memory:MemoryTier",
}


def tier_class(type_name: str, module_path: str | None, where: str) -> type:
    """Resolve a tier type: a built-in name, or a class named ``type_name`` in ``module_path``.

    Raises:
        ConfigError: unknown type, unimportable module, or not a ``SecondaryTierManager``.
    """
    from kvoffload.tiers.base import SecondaryTierManager

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
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{where}.module_path: cannot import {mod_name!r}: {e}") from None
    cls = getattr(mod, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTierManager)):
        raise ConfigError(
            f"{where}.type: {mod_name}.{cls_name} is not a SecondaryTierManager subclass"
        )
    return cls


def parse_tier_config(raw: dict[str, Any], where: str) -> tuple[str, type, msgspec.Struct]:
    """Validate one ``secondary_tiers`` entry.

    Returns:
        ``(tier name, tier class, config struct)``.

    Raises:
        ConfigError: naming the key path.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object with a 'type', got {type(raw).__name__}")
    body = dict(raw)
    type_name = body.pop("type", None)
    if not isinstance(type_name, str):
        raise ConfigError(f"{where}.type: required, a string such as 'fs'")
    module_path = body.pop("module_path", None)
    name = body.pop("name", type_name)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", name):
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
        raise ConfigError(_name_given_keys(str(e), where, renamed)) from None
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            raise ConfigError(_name_given_keys(f"{where}.{e}", where, renamed)) from None
    return name, cls, config


def _name_given_keys(msg: str, where: str, renamed: dict[str, str]) -> str:
    """Rewrite an error about one of our keys to name the key the user wrote (a vLLM alias)."""
    for ours, given in renamed.items():
        if msg.startswith(f"{where}.{ours}:"):
            return f"{where}.{given}:" + msg[len(f"{where}.{ours}:") :]
    return msg


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


def ineffective_vllm_keys(extra_config: dict[str, Any]) -> list[str]:
    """Keys of vLLM's own tiering spec present in ``extra_config`` that kvoffload accepts but
    does not act on, each as ``"<key path>: <what does that job here>"``."""
    out = [f"{k}: {why}" for k, why in VLLM_ONLY_KEYS.items() if extra_config.get(k) is not None]
    tiers = extra_config.get("secondary_tiers") or []
    for i, tier in enumerate(tiers if isinstance(tiers, list) else []):
        if isinstance(tier, dict):
            out += [
                f"secondary_tiers[{i}].{k}: {why}"
                for k, why in VLLM_ONLY_TIER_KEYS.items()
                if k in tier
            ]
    return out


_SECRET_RE = re.compile(r"secret|token|password|credential", re.IGNORECASE)


def _mask(obj: Any) -> Any:
    """Copy of ``obj`` with secrets replaced (``***``) and access key ids shortened."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, str) and v and _SECRET_RE.search(k):
                out[k] = "***"
            elif isinstance(v, str) and v and k in ("access_key_id", "access_key"):
                out[k] = v[:4] + "***"
            else:
                out[k] = _mask(v)
        return out
    if isinstance(obj, list):
        return [_mask(v) for v in obj]
    return obj


def describe(cfg: OffloadConfig) -> str:
    """One-line JSON of the effective configuration, tier defaults included and secrets masked
    (logged once at start)."""
    resolved = msgspec.to_builtins(cfg)
    tiers = []
    for i, raw in enumerate(cfg.secondary_tiers):
        name, _, tier_cfg = parse_tier_config(raw, f"secondary_tiers[{i}]")
        extra = {k: raw[k] for k in ("type", "module_path") if k in raw}
        tiers.append({**extra, "name": name, **msgspec.to_builtins(tier_cfg)})
    resolved["secondary_tiers"] = tiers
    return msgspec.json.encode(_mask(resolved)).decode()
