"""Configuration: vLLM's ``kv_connector_extra_config`` dict parsed into typed msgspec structs.

Every struct forbids unknown fields. An unknown key, a wrong type or an impossible size raises
:class:`ConfigError` whose message names the full key path (``secondary_tiers[0].max_byte``), suggests
the closest valid key for a near miss and lists the allowed keys, before any process or segment is
created. Sizes are integers in bytes: ``"10GB"`` is rejected, not guessed (the message gives the
integer). Every error of a configuration is reported at once, not only the first: the top level and
each tier entry are checked independently, and within a struct a bad key is dropped and the rest
checked again (:func:`kvoffload.validation.convert_all`); ``ConfigError.errors`` lists them as
:class:`ConfigIssue` (key path, message), and the message starts with the first.

::

    kv_connector_extra_config (dict)
        │ parse_config() = parse_config_all() + raise ConfigError(every error)
        ├─ top-level keys ────▶ OffloadConfig, KVEventsConfig   (validation.convert_all: errors name the key)
        ├─ secondary_tiers[i] ─▶ tiers.registry.parse_tier_entry ─▶ TierSpec(name, type, config)
        │                          type ─▶ tier class ─▶ its config_class struct (+ validate(),
        │                          check_on_this_machine(): an fs root_dir is a writable directory)
        └─ settings that depend on each other (blocks_per_chunk / block_size, eviction policy,
           event topics, unique tier names)

Each tier entry is parsed once, here; the engine builds its tiers from the :class:`TierSpec` objects
in ``OffloadConfig.secondary_tiers``. ``kvoffload check`` (:mod:`kvoffload.tools.config_check`)
calls :func:`parse_config_all` and goes further (this machine, a model, endpoints); the engine's
start does only what is here.

Example::

    {"cpu_bytes_to_use": 8589934592, "eviction_policy": "arc",
     "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kv", "max_bytes": 500000000000}]}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from kvoffload.ipc.names import EVENTS_TOPIC, MOVEMENTS_TOPIC
from kvoffload.tiers.registry import (
    BUILTIN_TIERS,
    TierSpec,
    parse_tier_config,
    parse_tier_entry,
    tier_class,
)
from kvoffload.validation import (
    SECRET_KEY_RE,
    Bytes,
    BytesOrZero,
    ConfigError,
    ConfigIssue,
    NonNegative,
    Positive,
    PositiveFloat,
    apply_aliases,
    closest,
    convert,
    convert_all,
    import_user_module,
    tenant_quota_problems,
)

__all__ = [
    "BUILTIN_TIERS",
    "Bytes",
    "BytesOrZero",
    "CanaryConfig",
    "VLLM_ONLY_KEYS",
    "VLLM_ONLY_TIER_KEYS",
    "ConfigError",
    "ConfigIssue",
    "KVEventsConfig",
    "NonNegative",
    "OffloadConfig",
    "ParsedConfig",
    "Positive",
    "PositiveFloat",
    "TierSpec",
    "apply_aliases",
    "closest",
    "convert",
    "describe",
    "effective_config",
    "ineffective_vllm_keys",
    "parse_config",
    "parse_config_all",
    "parse_tier_config",
    "secret_env_names",
    "tier_class",
]


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV events on a ZMQ PUB socket (``kv_events`` in ``kv_connector_extra_config``).

    Attributes:
        endpoint: ZMQ endpoint the PUB socket binds (default ``tcp://127.0.0.1:5557``, loopback
            only: a ``BlockStored`` carries the token ids and block hashes of users' prompts; bind
            ``tcp://*:5557`` for routers on other hosts, behind a firewall; port 0 picks one).
        replay_endpoint: ROUTER endpoint serving recent batches to late subscribers (None: off;
            the same content as ``endpoint``).
        topic: topic of vLLM-format ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved``).
        movements_topic: topic of chunk-movement batches (key, source, destination, locality).
            Neither topic may be a prefix of the other (a ZMQ subscription matches by prefix).
        buffer_steps: batches kept per topic for replay.
        hwm: the PUB socket's send high-water mark (messages); beyond it ZMQ drops.
    """

    unset_means: ClassVar[dict[str, str]] = {"replay_endpoint": "off: no replay socket"}

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = EVENTS_TOPIC
    movements_topic: str = MOVEMENTS_TOPIC
    buffer_steps: Positive = 10_000
    hwm: Positive = 100_000


class CanaryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The online correctness canary (``canary`` in ``kv_connector_extra_config``; off without
    it). Every ``every_s`` seconds a thread of the scheduler's process sends one fixed prompt
    twice through the server's OpenAI API: once able to reuse offloaded KV, once with a fresh
    ``cache_salt`` (recomputed), and compares the greedy tokens (:mod:`kvoffload.canary`,
    DESIGN.md "Online canary").

    Attributes:
        url: the server's base URL as the scheduler's process reaches it
            (``http://127.0.0.1:8000``): ``http`` or ``https``, no path. Required: the engine
            process is not told where vLLM's HTTP front end listens.
        model: the served model name to ask for (None: the first of ``/v1/models``).
        every_s: seconds between checks (>= 1); the first check starts one interval after
            the engine's start.
        max_tokens: tokens generated per run (1-64): the cost of a check, with ``prompt_chunks``.
        prompt_chunks: full chunks in the fixed prompt (1-64): what a reuse run can load.
        timeout_s: the most one HTTP request of a check may take (seconds); a slower one is an
            ``error``, never a pass.
        salt: the ``cache_salt`` of the reuse run: the canary's chunks are kept apart from every
            user's (a user who sends this salt shares only the canary's own chunks).
        api_key_env: the environment variable holding the server's API key (vLLM's
            ``--api-key``), sent as ``Authorization: Bearer``; the key itself is never in the
            configuration or a log, and no child process of the engine gets the variable. None:
            no key sent.
        fail_closed: on a mismatch, stop loading from the tiers that served the reused chunks
            until the engine restarts (their lookups answer MISS, counted as recomputed with
            reason ``canary``). Default False: count and log only.
    """

    unset_means: ClassVar[dict[str, str]] = {
        "model": "auto: the first model of /v1/models",
        "api_key_env": "none: no API key sent",
    }

    url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s?#]+/?$")]
    model: str | None = None
    every_s: Annotated[float, msgspec.Meta(ge=1.0, le=7 * 86400.0)] = 300.0
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    prompt_chunks: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 60.0
    salt: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] = "kvoffload-canary"
    api_key_env: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")] | None = (
        None
    )
    fail_closed: bool = False


class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Top-level settings (``kv_connector_extra_config``).

    Attributes:
        cpu_bytes_to_use: host-tier (arena) size in bytes. Required.
        blocks_per_chunk: engine blocks per chunk (default 1). Read by vLLM too.
        block_size: tokens per chunk instead of ``blocks_per_chunk`` (a multiple of the engine
            block size). Read by vLLM too.
        eviction_policy: ``lru`` or ``arc``, or an out-of-tree policy class name.
        cache_policy_module_path: module of an out-of-tree eviction policy.
        secondary_tiers: ordered list of tiers, written as tier configs (``{"type": "fs", ...}``)
            and parsed into :class:`~kvoffload.tiers.registry.TierSpec` (name, type, the tier's
            typed config); lookups ask them in this order, stores go to all of them.
        arena_name: fixed /dev/shm name for the host arena (default: derived from the engine id).
        warm_restart_s: seconds the host arena outlives its engine for a successor with the same
            ``arena_name`` and namespace to adopt the chunks it holds (DESIGN.md "Warm restart";
            0, the default: off, the arena goes with its engine). Needs ``arena_name``.
        cache_salt: part of the namespace: instances with different salts never share chunks.
            (A request's own ``cache_salt`` makes its chunks its tenant's: DESIGN.md "Tenants".)
        tenant_key_env: name of an environment variable holding a secret (at least 16 bytes)
            that keys tenant ids (:func:`kvoffload.tenants.tenant_id`), so nobody without it can
            test a guessed salt against a tenant directory's name; every instance sharing tiers,
            and ``kvoffload purge``, needs the same. None: ids keyed by a constant.
        host_tenant_quota_bytes: the most bytes of host-tier slots one tenant (a request's
            ``cache_salt``, DESIGN.md "Tenants") may hold; a store past it evicts that tenant's
            own least-recently-used chunks first, and what they cannot make room for is refused
            (``kvoffload_refused_chunks{reason="tenant_quota"}``). Counted in whole slots (at
            least one). Unsalted requests are no tenant: no quota applies to them. None (the
            default): no per-tenant quota, nothing counted. Needs ``eviction_policy`` lru or arc.
        host_tenant_quotas: a tenant's own host-tier quota in bytes, by tenant id (32 hex
            digits: ``kvoffload tenant-id`` prints a salt's), in place of
            ``host_tenant_quota_bytes`` (set alone: only the tenants named are limited).
        tenant_metrics_top: how many tenants, the largest by bytes held, get their own series of
            ``kvoffload_tenant_bytes`` per tier with quotas beside those its quota overrides
            name (the rest are summed under ``tenant="other"``): at most this plus one series a
            tier and the named ones (0-1000, default 10). Under vLLM its ``/metrics`` has the
            named tenants' series only (its exporter never drops a label set).
        model_revision: model revision for the namespace when the engine does not report one.
        offload_prompt_only: offload prompt blocks only (vLLM's setting, default True).
        tier_pin_fraction: at most this fraction of the host slots may be pinned by one secondary
            tier's in-flight stores (write-through); beyond it, that tier's stores are dropped and
            counted (``kvoffload_dropped_stores``), so a slow tier cannot pin the whole host tier
            and starve new stores (CASES C37). Default 0.5, chosen by measurement (BENCHMARKS.md
            §7); 1.0 lets one slow tier pin every host slot.
        promotion_hold_steps: a chunk promoted from a secondary tier for a request is held for it
            (no promotion of a request that asked later, and no peer, evicts it; a store only
            when nothing else can make room) until that request has loaded it, finishes, or has
            not looked it up for this many scheduler steps. A request whose promotion finds the
            host tier full of chunks held for requests that asked before it is told RETRY (it
            waits for them to load) rather than MISS (recompute), for at most this many steps.
            Holds take at most the host slots ``tier_pin_fraction`` leaves to them. 0: no holds
            (every promoted chunk is evictable at once, a promotion with no room is a MISS), the
            behaviour before holds (docs/profiles/thrash.md, BENCHMARKS.md §6b).
        slower_than_recompute: what a lookup does with a chunk found in a secondary tier whose
            load is expected to be slower than recomputing it (issue 26, "never slower than
            recompute"; :mod:`kvoffload.costs`). ``recompute`` (default) answers MISS for a chunk
            of a tier that moves a chunk slower than the engine recomputes it, so the engine
            recomputes from there; gives way for a request whose chunks from a tier, behind what
            the tier has queued, are expected to load slower than their recompute when its
            promotion is submitted; and abandons a promotion that overran (in both, its lookups
            answer MISS; the load goes on and publishes the chunks when it lands). Nothing
            changes while an estimate is missing (a tier before its first finished job, an
            engine before its first prefill step) or while loads beat recompute, so a healthy
            tier serves what it always served: in three three-point ``bench scaling`` sweeps it
            sent nothing a healthy fs tier held to prefill and served as much as ``serve``
            (BENCHMARKS §6). A request kept at RETRY by a tier's lookup (a probe of a chunk
            this instance has no record of, queued behind the tier's loads) is not kept waiting
            by a tier slower than recompute, and gives way once the wait has overrun
            (``promotion_overrun_factor`` times the tier's expected lookup, its queue of loads
            included; at least one chunk's recompute, at most ``recompute_margin`` times that
            of the chunks it asks; and two steps).
            ``serve`` always waits for the tier. Not applied to the p2p tier. Counted:
            ``kvoffload_recomputed_tokens``.
        recompute_margin: how much slower than recomputing a load may be expected to be and
            still be served, as a ratio (>= 1; default 1.5). Above 1 leans to the tier: the
            estimates are noisy, and a load spares the engine's compute for other requests.
        promotion_overrun_factor: a promotion has overrun (its request recomputes) once it has
            been in flight this many times its expected load time (>= 1; default 3.0), or
            ``recompute_margin`` times the recompute of its chunks if that comes first, and at
            least two scheduler steps. Lower gives up on a stalled tier sooner (a stall costs a
            request about this many expected loads); higher tolerates more jitter in a healthy
            tier's loads. The same factor bounds a request's wait for a tier's lookup (a probe):
            this many times the tier's expected lookup (its usual round trip
            behind the loads it has outstanding).
        recompute_tokens_per_s: the engine's prefill throughput in tokens per second, instead of
            the live estimate taken from its own steps (tokens scheduled per step over the
            step's time; None, the default: live).
        canonical_layout: store rows in vLLM's canonical (parallelism-free) layout.
        self_describing_kv_events: vLLM's own KV events for offloaded chunks carry the request's
            parent hash and token ids (vLLM's tracker; default on here, off in vLLM's own spec).
        kv_events: publish KV events and chunk movements on a ZMQ PUB socket (see
            :class:`KVEventsConfig`; None: off). Independent of vLLM's own ``--kv-events-config``.
        canary: the online correctness canary (:class:`CanaryConfig`; None, the default: off,
            nothing runs and nothing is checked on the hot path).
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

    # What a field left None means once :func:`effective_config` has run: decided at run time, or
    # off (``kvoffload check`` prints these words instead of null).
    unset_means: ClassVar[dict[str, str]] = {
        "blocks_per_chunk": "auto: block_size / the engine's block size (tokens)",
        "block_size": "auto: blocks_per_chunk x the engine's block size (tokens), from the model",
        "cache_policy_module_path": "none: eviction_policy is built in",
        "arena_name": "auto: derived from the engine id at start",
        "model_revision": "auto: the revision vLLM reports for the model",
        "kv_events": "off",
        "canary": "off",
        "instance_id": "auto: process id and a counter",
        "recompute_tokens_per_s": "auto: measured from the engine's own steps",
        "tenant_key_env": "off: tenant ids are keyed by a constant (a salt anyone could guess "
        "can be tested against them)",
        "host_tenant_quota_bytes": "off: no per-tenant quota in the host tier (unless "
        "host_tenant_quotas names the tenant)",
        **dict.fromkeys(("lock", "config_info", "expedited"), "none (vLLM 0.33's key; unused)"),
        **dict.fromkeys(
            ("tier_poll_interval_s", "backpressure", "max_tracker_size"),
            "none (vLLM's key; no effect here)",
        ),
    }

    cpu_bytes_to_use: Bytes
    blocks_per_chunk: Positive | None = None
    block_size: Positive | None = None
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    secondary_tiers: list[TierSpec] = []
    arena_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] | None = None
    warm_restart_s: Annotated[float, msgspec.Meta(ge=0.0, le=7 * 86400.0)] = 0.0
    cache_salt: str = ""
    tenant_key_env: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    host_tenant_quota_bytes: Bytes | None = None
    host_tenant_quotas: dict[str, Bytes] = {}
    tenant_metrics_top: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 10
    model_revision: str | None = None
    offload_prompt_only: bool = True
    tier_pin_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    promotion_hold_steps: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 64
    slower_than_recompute: Literal["recompute", "serve"] = "recompute"
    recompute_margin: Annotated[float, msgspec.Meta(ge=1.0, le=1000.0)] = 1.5
    promotion_overrun_factor: Annotated[float, msgspec.Meta(ge=1.0, le=1000.0)] = 3.0
    recompute_tokens_per_s: Annotated[float, msgspec.Meta(gt=0.0, le=1e12)] | None = None
    canonical_layout: bool = False
    self_describing_kv_events: bool = True
    kv_events: KVEventsConfig | None = None
    canary: CanaryConfig | None = None
    instance_id: str | None = None
    spec_name: str = "KVOffloadSpec"
    spec_module_path: str = "kvoffload.vllm"
    lock: Any = None
    config_info: Any = None
    expedited: Any = None
    sync_load_budget_bytes: BytesOrZero = 0
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


def parse_config(extra_config: dict[str, Any]) -> OffloadConfig:
    """Parse and validate the whole configuration, secondary tiers included
    (:func:`parse_config_all`, raising every error it found).

    Raises:
        ConfigError: anything invalid: every error, each named by key path, the first one first.
    """
    parsed = parse_config_all(extra_config)
    if parsed.errors or parsed.config is None:
        raise ConfigError(parsed.errors)
    return parsed.config


class ParsedConfig(msgspec.Struct, kw_only=True):
    """What :func:`parse_config_all` made of a ``kv_connector_extra_config``.

    Attributes:
        config: the top-level settings with the valid tiers in ``secondary_tiers``; a key with an
            error holds its default (a missing ``cpu_bytes_to_use``: None); None when the
            configuration is not an object at all.
        tiers: one entry per ``secondary_tiers`` item as written (so index ``i`` is
            ``secondary_tiers[i]``): its spec, or None when no config could be built from it.
        errors: every error found, in document order (the top level, then each tier).
    """

    config: OffloadConfig | None
    tiers: list[TierSpec | None] = []
    errors: list[ConfigIssue] = []


def parse_config_all(extra_config: Any, *, this_machine: bool = True) -> ParsedConfig:
    """Parse and validate the whole configuration and report every error, not only the first.

    The top level and each ``secondary_tiers`` entry are checked independently, each reporting all
    of its errors (:func:`kvoffload.validation.convert_all`,
    :func:`kvoffload.tiers.registry.parse_tier_entry`), then the settings that depend on each other
    (one of ``blocks_per_chunk`` / ``block_size``, the eviction policy, the event topics, unique
    tier names).

    Args:
        extra_config: the ``kv_connector_extra_config`` dict.
        this_machine: also run each tier config's ``check_on_this_machine()`` (an fs
            ``root_dir``), as the engine does at start.
    """
    where = "kv_connector_extra_config"
    if not isinstance(extra_config, dict):
        got = type(extra_config).__name__
        return ParsedConfig(
            config=None, errors=[ConfigIssue(where, f"expected an object (dict), got {got}")]
        )
    top = dict(extra_config)
    written = top.pop("secondary_tiers", [])
    cfg, errors = convert_all(top, OffloadConfig, where)
    assert cfg is not None  # top is a dict
    reported = {i.path for i in errors}
    if cfg.blocks_per_chunk is not None and cfg.block_size is not None:
        errors.append(ConfigIssue(where, "set only one of 'blocks_per_chunk' and 'block_size'"))
    policy_at = f"{where}.cache_policy_module_path"
    if cfg.cache_policy_module_path is not None:
        from kvoffload.policies import make_policy

        try:
            import_user_module(cfg.cache_policy_module_path, policy_at)
            make_policy(cfg.eviction_policy, 1, cfg.cache_policy_module_path)
        except ConfigError as e:
            errors += e.errors
        except (ImportError, ValueError) as e:
            errors.append(ConfigIssue(policy_at, str(e)))
    elif f"{where}.eviction_policy" not in reported and policy_at not in reported:
        from kvoffload.policies import BUILTIN_POLICIES

        if cfg.eviction_policy not in BUILTIN_POLICIES:
            close = closest(cfg.eviction_policy, list(BUILTIN_POLICIES))
            hint = f" (did you mean {close!r}?)" if close else ""
            errors.append(
                ConfigIssue(
                    f"{where}.eviction_policy",
                    f"unknown policy {cfg.eviction_policy!r}{hint}; allowed: "
                    f"{', '.join(BUILTIN_POLICIES)}, or a class name together with "
                    "cache_policy_module_path",
                )
            )
    errors += [
        ConfigIssue(f"{where}.{p.split(':', 1)[0]}", p.split(": ", 1)[1])
        for p in tenant_quota_problems("host_tenant_quotas", cfg.host_tenant_quotas)
    ]
    if (
        cfg.host_tenant_quota_bytes is not None or cfg.host_tenant_quotas
    ) and cfg.cache_policy_module_path is not None:
        errors.append(
            ConfigIssue(
                f"{where}.host_tenant_quota_bytes",
                "per-tenant quotas need the lru or arc eviction_policy (an out-of-tree policy "
                "keeps no ranks to order a tenant's own chunks by): use lru or arc, or drop "
                "host_tenant_quota_bytes and host_tenant_quotas",
            )
        )
    ev = cfg.kv_events
    if (
        ev is not None and ev.replay_endpoint == ev.endpoint and not ev.endpoint.endswith(":0")
    ):  # port 0: each socket gets its own free port
        errors.append(
            ConfigIssue(
                f"{where}.kv_events.replay_endpoint",
                f"the same as endpoint ({ev.endpoint!r}); the replay socket needs its own address",
            )
        )
    if ev is not None:
        a, b = ev.topic, ev.movements_topic
        if a.startswith(b) or b.startswith(a):
            errors.append(
                ConfigIssue(
                    f"{where}.kv_events.movements_topic",
                    f"{b!r} and topic {a!r} overlap (a ZMQ subscription to one would also receive "
                    "the other); pick topics that are not prefixes of each other",
                )
            )
    tiers: list[TierSpec | None] = []
    if not isinstance(written, list):
        errors.append(
            ConfigIssue(
                f"{where}.secondary_tiers",
                f"expected an array (list) of tier objects, got {type(written).__name__}",
            )
        )
        written = []
    names: set[str] = set()
    for i, raw in enumerate(written):
        at = f"{where}.secondary_tiers[{i}]"
        spec, found = parse_tier_entry(raw, at, this_machine=this_machine)
        errors += found
        tiers.append(spec)
        if spec is None:
            continue
        if spec.name in names:
            errors.append(ConfigIssue(f"{at}.name", f"duplicate tier name {spec.name!r}"))
        names.add(spec.name)
        cfg.secondary_tiers.append(spec)
    return ParsedConfig(config=cfg, tiers=tiers, errors=errors)


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


def _mask(obj: Any) -> Any:
    """Copy of ``obj`` with secrets replaced (``***``) and access key ids shortened."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            # ``*_env`` keys name an environment variable (p2p's ``secret_env``), not a secret.
            if isinstance(v, str) and v and SECRET_KEY_RE.search(k) and not k.endswith("_env"):
                out[k] = "***"
            elif isinstance(v, str) and v and k in ("access_key_id", "access_key"):
                out[k] = v[:4] + "***"
            else:
                out[k] = _mask(v)
        return out
    if isinstance(obj, list):
        return [_mask(v) for v in obj]
    return obj


def effective_config(cfg: OffloadConfig) -> OffloadConfig:
    """``cfg`` with every default that the configuration alone decides filled in, as the engine
    will run with it: ``blocks_per_chunk`` 1 when neither it nor ``block_size`` is set (vLLM's
    rule: vLLM reads both keys and hands the spec its ``blocks_per_chunk``), and each tier's config
    through its class's :meth:`~kvoffload.tiers.base.SecondaryTierManager.effective_config` (the
    one the tier starts with). What stays None is decided at run time or off: the struct's
    ``unset_means`` says which."""
    blocks_per_chunk = cfg.blocks_per_chunk
    if blocks_per_chunk is None and cfg.block_size is None:
        blocks_per_chunk = 1
    tiers = [
        msgspec.structs.replace(spec, config=spec.tier_class.effective_config(spec.config))
        for spec in cfg.secondary_tiers
    ]
    return msgspec.structs.replace(cfg, blocks_per_chunk=blocks_per_chunk, secondary_tiers=tiers)


def secret_env_names(cfg: OffloadConfig) -> list[str]:
    """The environment variables the configuration names with its tiers' ``*_env`` keys (the p2p
    tier's ``secret_env``), ``tenant_key_env`` and the canary's ``api_key_env``: they hold
    secrets, so no child process of the engine gets them (:func:`kvoffload.ipc.childenv.withhold`)."""
    out: list[str] = [cfg.tenant_key_env] if cfg.tenant_key_env else []
    for spec in cfg.secondary_tiers:
        for f in msgspec.structs.fields(spec.config):
            value = getattr(spec.config, f.name)
            if f.name.endswith("_env") and isinstance(value, str) and value:
                out.append(value)
    if cfg.canary is not None and cfg.canary.api_key_env:
        out.append(cfg.canary.api_key_env)
    return out


def describe(cfg: OffloadConfig) -> str:
    """One-line JSON of the effective configuration (:func:`effective_config`: null where a
    value is decided at run time or off), tier defaults included and secrets masked (logged once
    at start)."""
    cfg = effective_config(cfg)
    resolved = msgspec.to_builtins(cfg)
    tiers = []
    for spec in cfg.secondary_tiers:
        named = {"type": spec.type}
        if spec.module_path is not None:
            named["module_path"] = spec.module_path
        tiers.append({**named, "name": spec.name, **msgspec.to_builtins(spec.config)})
    resolved["secondary_tiers"] = tiers
    return msgspec.json.encode(_mask(resolved)).decode()
