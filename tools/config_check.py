"""``kvoffload check``: everything about a configuration that can be known before an engine starts.

::

    FILE ──json (keys given twice)──▶ the whole --kv-transfer-config object? ── yes: its own keys ─┐
      │ no: the file is kv_connector_extra_config              its kv_connector_extra_config ◀─┘
      ▼
    kv_connector_extra_config
      │ spec_name / spec_module_path: will vLLM load kvoffload's spec?            ─────── syntax
      │ parse_config_all(this_machine=False): every error, by key path            ─────── syntax
      │ (a later check that needs a key with an error says it was not checked)
      │ KV-event sockets bound to loopback only (prompts' token ids travel there) ─────── syntax
      │ each p2p tier's exposure: its bind and advertise address, its secret in
      │ the file, allowed_peers wide open, auth none                              ─────── syntax
      ├─ /dev/shm against cpu_bytes_to_use, each p2p tier's secret in this
      │  environment, each fs root (relative, a directory, writable, free-space
      │  floor), one chunk of the namespaces already in an fs root                ─ this machine
      ├─ --model DIR: KV bytes per token from config.json: one chunk, one request ──────── model
      └─ --online: each obj bucket (one HeadBucket), each p2p peer (TCP connect)  ─────── online
    ──▶ Report: one Check per fact (what, key path, scope, result, detail)

Scopes say how far a fact was checked: ``syntax`` (the file alone: what the engine checks when it
parses the configuration), ``this machine`` (this machine's /dev/shm, filesystems and environment,
now: the server's may differ; skipped with ``--syntax-only``), ``model`` (the model directory
given), ``online`` (endpoints reached from here, now), ``not checked`` (with why). Errors are what
would stop the engine at start (or make vLLM never load kvoffload); warnings what would make it run
worse than meant, or may differ on the server. None of this runs at engine start: the engine parses
(:func:`kvoffload.config.parse_config`, with the fs ``root_dir`` checks it always made) and finds the
rest as it reaches it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import ipaddress
import json
import math
import os
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from kvoffload.config import (
    ConfigIssue,
    OffloadConfig,
    ParsedConfig,
    TierSpec,
    closest,
    parse_config_all,
)

EXTRA = "kv_connector_extra_config"
OUTER = "kv_transfer_config"
OFFLOADING_CONNECTOR = "OffloadingConnector"
SPEC_NAME, SPEC_MODULE = "KVOffloadSpec", "kvoffload.vllm"
#: Spec names vLLM resolves from its own registry, never reading ``spec_module_path``.
VLLM_SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
#: The keys of vLLM's ``KVTransferConfig`` (0.32 and 0.33, and older releases' ones). vLLM refuses
#: any other key; a release newer than kvoffload knows may add some, so an unknown one is a warning.
KV_TRANSFER_CONFIG_KEYS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_ENGINE_BLOCK_SIZE = 16
"""vLLM's default block size (tokens) on GPUs; vLLM-CPU's is 128 (``--block-size`` sets it)."""
ONLINE_TIMEOUT_S = 3.0
"""Connect and read timeout of each ``--online`` check (seconds); no retries."""
#: Bytes per KV element by ``--kv-cache-dtype`` (or ``--dtype``: ``half`` and ``float`` are vLLM's
#: aliases of float16 and float32).
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
#: vLLM's other names of a dtype (``--dtype half``, ``--kv-cache-dtype fp8``: e4m3 where not
#: said), by the name each resolves to.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp8": "fp8_e4m3"}

SYNTAX, MACHINE, MODEL, ONLINE, NOT_CHECKED = (
    "syntax",
    "this machine",
    "model",
    "online",
    "not checked",
)
OK, WARNING, ERROR, NONE = "ok", "warning", "error", "-"


class Check(msgspec.Struct, kw_only=True):
    """One fact ``kvoffload check`` looked at.

    Attributes:
        check: what was checked, in a few words.
        path: the key path it is about (``kv_connector_extra_config.secondary_tiers[0].root_dir``);
            ``kv_connector_extra_config`` for the configuration as a whole.
        scope: ``syntax``, ``this machine``, ``model``, ``online`` or ``not checked``.
        result: ``ok``, ``warning``, ``error``, or ``-`` (not checked).
        detail: what was found and, for a warning or error, what to change; why, when not checked.
    """

    check: str
    path: str
    scope: str
    result: str
    detail: str = ""


class Report(msgspec.Struct, kw_only=True):
    """Everything ``kvoffload check`` found (``--json`` prints its errors on an invalid config).

    Attributes:
        file: the file checked.
        form: ``kv_connector_extra_config`` (the file is that object) or ``kv_transfer_config``
            (the whole ``--kv-transfer-config`` object).
        checks: every check, in the order made.
    """

    file: str
    form: str = EXTRA
    checks: list[Check] = []

    @property
    def errors(self) -> list[Check]:
        """The checks that failed: the engine would not start (or never load kvoffload)."""
        return [c for c in self.checks if c.result == ERROR]

    @property
    def warnings(self) -> list[Check]:
        """The checks that warn: the engine starts, but maybe not as meant."""
        return [c for c in self.checks if c.result == WARNING]

    def add(self, check: str, path: str, scope: str, result: str, detail: str = "") -> None:
        """Record one check."""
        self.checks.append(Check(check=check, path=path, scope=scope, result=result, detail=detail))

    def issue(self, check: str, issue: ConfigIssue, scope: str, result: str = ERROR) -> None:
        """Record a :class:`ConfigIssue` (a key path and a message) as a check."""
        self.add(check, issue.path, scope, result, issue.message)

    def not_checked(self, check: str, path: str, why: str) -> None:
        """Record a check that was not made, and why."""
        self.add(check, path, NOT_CHECKED, NONE, why)


class Options(msgspec.Struct, kw_only=True):
    """How far ``kvoffload check`` goes.

    Attributes:
        syntax_only: only the file (a config meant for another machine): no check of this machine.
        online: reach each obj endpoint and p2p peer.
        model_dir: a local Hugging Face model directory (``config.json``): the chunk size.
        engine_block_size: the engine's block size (tokens); None: vLLM's GPU default.
        max_model_len: the longest request (tokens); None: the model's ``max_position_embeddings``.
        kv_cache_dtype: ``auto`` (the engine's ``dtype``) or a :data:`DTYPE_BYTES` name.
        dtype: the engine's ``--dtype``: ``auto`` (the model's, float32 run in 16 bits, as vLLM
            does) or a :data:`DTYPE_BYTES` name (``half``, ``float`` too, vLLM's aliases).
        shm_dir: where host arenas live (``/dev/shm``).
        timeout_s: connect and read timeout of each online check (seconds).
    """

    syntax_only: bool = False
    online: bool = False
    model_dir: str | None = None
    engine_block_size: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    shm_dir: str = "/dev/shm"
    timeout_s: float = ONLINE_TIMEOUT_S


class CheckInputError(ValueError):
    """A file or ``--model`` directory that cannot be read at all (a usage error, exit 2)."""


class Checked(msgspec.Struct, kw_only=True):
    """What :func:`check_text` returns.

    Attributes:
        report: the checks.
        extra_config: the ``kv_connector_extra_config`` dict as read (None when there is none).
        parsed: what :func:`~kvoffload.config.parse_config_all` made of it (None without one).
    """

    report: Report
    extra_config: Any = None
    parsed: ParsedConfig | None = None


def check_text(text: str, name: str, options: Options) -> Checked:
    """Check a configuration file's text.

    Args:
        text: the file's contents (JSON).
        name: the file name, for the report.
        options: how far to check.

    Raises:
        json.JSONDecodeError: not JSON.
        CheckInputError: ``--model`` names no readable model directory.
    """
    report = Report(file=name)
    raw = json.loads(text, object_pairs_hook=_Object.of_pairs)
    duplicates: list[ConfigIssue] = []
    whole = isinstance(raw, dict) and any(k in raw for k in ("kv_connector", "kv_role", EXTRA))
    if whole:
        report.form = OUTER
        raw = _plain(raw, OUTER, duplicates, {EXTRA: EXTRA})
    else:
        raw = _plain(raw, EXTRA, duplicates)
    for issue in duplicates:
        report.issue("key given once", issue, SYNTAX)
    if not duplicates:
        report.add("key given once", report.form, SYNTAX, OK, "no key is given twice")
    extra = _check_outer(raw, report) if whole else raw
    if extra is None:
        return Checked(report=report)
    if isinstance(extra, dict):
        _check_spec_name(extra, whole, report)
        if extra.get("spec_name") == "TieringOffloadingSpec":
            # vLLM's own spec, its own config format (kvoffload's tiers may be in it by module
            # path): kvoffload's parse would only add errors that are not this config's
            report.not_checked(
                "keys and values",
                EXTRA,
                "vLLM's TieringOffloadingSpec reads this config and validates it at start",
            )
            return Checked(report=report, extra_config=extra)
    parsed = parse_config_all(extra, this_machine=False)
    for issue in parsed.errors:
        report.issue("key and value", issue, SYNTAX)
    if not parsed.errors:
        report.add(
            "keys and values",
            EXTRA,
            SYNTAX,
            OK,
            "every key known, every value of its type and range",
        )
    if parsed.config is not None:
        _check_parsed(parsed, report, options)
    return Checked(report=report, extra_config=extra, parsed=parsed)


# -- reading the file ------------------------------------------------------------------------------


class _Object(dict):
    """A JSON object as read, with the keys it was given more than once (``json`` keeps the last
    value of a repeated key, silently; so does vLLM when it reads ``--kv-transfer-config``)."""

    duplicates: dict[str, int]

    @classmethod
    def of_pairs(cls, pairs: list[tuple[str, Any]]) -> _Object:
        obj = cls()
        obj.duplicates = {}
        for key, value in pairs:
            if key in obj:
                obj.duplicates[key] = obj.duplicates.get(key, 1) + 1
            obj[key] = value
        return obj


def _plain(
    value: Any, path: str, out: list[ConfigIssue], paths: dict[str, str] | None = None
) -> Any:
    """``value`` with plain dicts, each key given more than once reported in ``out`` by path;
    ``paths``: the paths of some of this object's keys (the inner object's own name)."""
    paths = paths or {}
    if isinstance(value, dict):
        for key, n in getattr(value, "duplicates", {}).items():
            out.append(
                ConfigIssue(
                    paths.get(key, f"{path}.{key}"),
                    f"given {n} times: only the last one counts, silently (here and when vLLM "
                    "reads it); keep one",
                )
            )
        return {k: _plain(v, paths.get(k, f"{path}.{k}"), out) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{path}[{i}]", out) for i, v in enumerate(value)]
    return value


def _check_outer(raw: dict[str, Any], report: Report) -> Any:
    """Check the whole ``--kv-transfer-config`` object as far as kvoffload knows it; its
    ``kv_connector_extra_config`` (None when it has none)."""
    for key in raw:
        if key not in KV_TRANSFER_CONFIG_KEYS:
            close = closest(key, list(KV_TRANSFER_CONFIG_KEYS))
            hint = f" (did you mean {close!r}?)" if close else ""
            # A near miss of a known key is a typo: vLLM refuses it at start. Any other key may
            # be one of a vLLM release newer than kvoffload's list: a warning.
            report.add(
                "vLLM key",
                f"{OUTER}.{key}",
                SYNTAX,
                ERROR if close else WARNING,
                f"not a key of vLLM's KVTransferConfig as kvoffload knows it{hint}; vLLM refuses "
                f"unknown keys at start (known: {', '.join(KV_TRANSFER_CONFIG_KEYS)})",
            )
    connector = raw.get("kv_connector")
    at = f"{OUTER}.kv_connector"
    if connector == OFFLOADING_CONNECTOR:
        report.add("connector", at, SYNTAX, OK, "vLLM's OffloadingConnector loads the spec")
    else:
        got = "not given" if connector is None else f"{connector!r}"
        report.add(
            "connector",
            at,
            SYNTAX,
            ERROR,
            f"{got}: kvoffload's spec is loaded only by vLLM's {OFFLOADING_CONNECTOR}, so "
            f'vLLM would never read kvoffload\'s keys; set "kv_connector": '
            f'"{OFFLOADING_CONNECTOR}" (inside a MultiConnector, check the object of its '
            f"{OFFLOADING_CONNECTOR} entry)",
        )
    role = raw.get("kv_role")
    at = f"{OUTER}.kv_role"
    if role in KV_ROLES:
        report.add("role", at, SYNTAX, OK, f"{role}")
    elif role is None and connector is None:
        pass  # the connector's error says it all
    else:
        got = "not given" if role is None else f"{role!r}"
        report.add(
            "role",
            at,
            SYNTAX,
            ERROR,
            f"{got}: vLLM needs one of {', '.join(KV_ROLES)} with a connector "
            '(kv_both for offloading: "kv_role": "kv_both")',
        )
    extra = raw.get(EXTRA)
    if not isinstance(extra, dict):
        got = "not given" if extra is None else f"expected an object, got {type(extra).__name__}"
        report.add(
            "kvoffload's settings",
            EXTRA,
            SYNTAX,
            ERROR,
            f"{got}: the object with kvoffload's settings (spec_name, cpu_bytes_to_use, "
            "secondary_tiers...) goes here",
        )
        return None
    return extra


def _check_spec_name(extra: dict[str, Any], whole: bool, report: Report) -> None:
    """How vLLM will find the spec: only ``spec_name`` and ``spec_module_path`` naming kvoffload's
    make vLLM load it (vLLM's default spec is its own ``CPUOffloadingSpec``)."""
    name, module = extra.get("spec_name"), extra.get("spec_module_path")
    at = f"{EXTRA}.spec_name"
    use = f'"spec_name": "{SPEC_NAME}", "spec_module_path": "{SPEC_MODULE}"'
    tiers = extra.get("secondary_tiers")
    ours_inside = name == "TieringOffloadingSpec" and any(
        isinstance(t, dict) and str(t.get("module_path", "")).startswith("kvoffload")
        for t in (tiers if isinstance(tiers, list) else [])
    )
    if ours_inside:  # vLLM's spec running kvoffload's tiers: README shows this use
        report.add(
            "spec loaded by vLLM",
            at,
            SYNTAX,
            WARNING,
            "vLLM's own TieringOffloadingSpec, with kvoffload's tiers by module_path: vLLM loads "
            "and validates this config, not kvoffload's spec (README 'kvoffload's tiers inside "
            f"vLLM's TieringOffloadingSpec'); for kvoffload's spec use {use}",
        )
    elif name in VLLM_SPEC_NAMES:
        report.add(
            "spec loaded by vLLM",
            at,
            SYNTAX,
            ERROR,
            f"{name!r} is vLLM's own spec: vLLM resolves it from its registry and never loads "
            f"kvoffload (spec_module_path is ignored). For kvoffload's spec use {use}"
            + (
                ". To use kvoffload's tiers under vLLM's TieringOffloadingSpec, see README "
                "'kvoffload's tiers inside vLLM's TieringOffloadingSpec' (vLLM validates that "
                "config)"
                if name == "TieringOffloadingSpec"
                else ""
            ),
        )
    elif name is None:
        report.add(
            "spec loaded by vLLM",
            at,
            SYNTAX,
            ERROR if whole else WARNING,
            f"not given: vLLM then loads its own CPUOffloadingSpec, which does not read "
            f"kvoffload's keys; add {use}",
        )
    elif module is None:
        report.add(
            "spec loaded by vLLM",
            f"{EXTRA}.spec_module_path",
            SYNTAX,
            ERROR,
            f"not given: vLLM cannot find spec_name {name!r} without it (it refuses to start: "
            f"'Unsupported spec type'); add {use}",
        )
    elif module == SPEC_MODULE and name != SPEC_NAME:
        report.add(
            "spec loaded by vLLM",
            at,
            SYNTAX,
            ERROR,
            f"{SPEC_MODULE} has no spec {name!r}: vLLM would fail to load it; use {use}",
        )
    elif module == SPEC_MODULE:
        report.add("spec loaded by vLLM", at, SYNTAX, OK, f"{SPEC_NAME} from {SPEC_MODULE}")
    else:
        report.add(
            "spec loaded by vLLM",
            at,
            SYNTAX,
            OK,
            f"{name} from {module} (not kvoffload's own module: its settings are checked here "
            "as kvoffload's)",
        )


# -- the parsed configuration ----------------------------------------------------------------------


def _check_parsed(parsed: ParsedConfig, report: Report, options: Options) -> None:
    cfg = parsed.config
    assert cfg is not None
    bad = {i.path for i in parsed.errors}
    cpu_at = f"{EXTRA}.cpu_bytes_to_use"
    cpu = cfg.cpu_bytes_to_use if cpu_at not in bad else None
    online: list[Callable[[], Check]] = []
    if cfg.kv_events is not None:
        _check_events_bind(cfg.kv_events, bad, report)
    if options.syntax_only:
        report.not_checked(
            "/dev/shm, fs roots, p2p secrets", EXTRA, "--syntax-only (a config for another machine)"
        )
    else:
        if cpu is None:
            report.not_checked("host tier fits /dev/shm", cpu_at, "cpu_bytes_to_use has an error")
        else:
            _check_shm(cpu, options.shm_dir, report)
    for i, spec in enumerate(parsed.tiers):
        at = f"{EXTRA}.secondary_tiers[{i}]"
        if spec is None:
            report.not_checked("tier", at, "the entry has errors that leave no tier to check")
            continue
        if not options.syntax_only:
            _check_tier_here(spec, at, bad, report)
        _check_p2p_exposure(spec, at, bad, report)
        online += _online_checks(spec, at, bad, report, options)
    if options.model_dir is not None:
        _check_model(cfg, cpu, cpu_at, bad, report, options)
    elif options.syntax_only:
        report.not_checked(
            "host tier holds one chunk", cpu_at, "the chunk size comes from the model: --model DIR"
        )
    elif cpu is not None:
        _check_chunk_from_roots(cfg, cpu, cpu_at, parsed.tiers, bad, report)
    if online:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(online))) as pool:
            report.checks += list(pool.map(lambda f: f(), online))


def bind_reach(endpoint: str) -> str | None:
    """Who can reach a ZMQ ``endpoint`` this host binds: None for this host only (a loopback
    address or interface, ``ipc://``, ``inproc://``), else in words (``all interfaces``, ``the
    address 10.0.0.5``)."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return None
    if transport != "tcp":
        return f"the {transport} transport"
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return "all interfaces"
    if host in ("localhost", "lo"):
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
        return f"the address {host}"
    except ValueError:
        return f"the interface or host {host!r}"


MIN_SECRET_CHARS = 32
"""A p2p secret shorter than this is reported: one handshake recorded by whoever a client dials
lets them test guesses of the secret offline (its CurveZMQ keys derive from it)."""


def _check_p2p_exposure(spec: TierSpec, at: str, bad: set[str], report: Report) -> None:
    """What a p2p tier exposes, from its settings alone (README, "Security model"): the control
    port's reach, an advertise address that names a loopback while the port binds beyond it
    (peers dial their own loopback, and every instance so configured claims one identity: CASES
    C42), a secret written in the file, allowed_peers wide open, auth none."""
    from kvoffload.tiers.p2p import P2PTierConfig
    from kvoffload.tiers.p2p.config import is_loopback, parse_allowed

    c = spec.config
    if not isinstance(c, P2PTierConfig):
        return
    if f"{at}.host" not in bad:
        reach = bind_reach(f"tcp://{c.host}:{c.port}")
        host_at = f"{at}.host"
        if reach is None:
            report.add("p2p control port reach", host_at, SYNTAX, OK, f"{c.host}: this host only")
        elif reach == "all interfaces":
            report.add(
                "p2p control port reach",
                host_at,
                SYNTAX,
                WARNING,
                f"{c.host} binds all interfaces: every network this host is on reaches the "
                "control port (CurveZMQ admits only peers that know the secret, but anyone can "
                "make it spend a handshake); bind the address peers use",
            )
        else:
            report.add(
                "p2p control port reach",
                host_at,
                SYNTAX,
                OK,
                f"binds {reach}; only peers that know the secret complete a handshake",
            )
        adv_at = f"{at}.advertise_host"
        if (
            c.advertise_host is not None
            and adv_at not in bad
            and is_loopback(c.advertise_host)
            and reach is not None
        ):
            report.add(
                "p2p advertise address",
                adv_at,
                SYNTAX,
                WARNING,
                f"{c.advertise_host!r} is a loopback address while host {c.host!r} binds "
                f"{reach}: peers on other hosts dialing it reach their own loopback, and every "
                "instance configured so claims the same identity (a second one is refused as "
                "an identity collision); set advertise_host to the address peers reach this "
                "instance at",
            )
    if c.secret is not None and f"{at}.secret" not in bad:
        report.add(
            "p2p secret kept out of the file",
            f"{at}.secret",
            SYNTAX,
            WARNING,
            "the secret is written in the configuration: vLLM logs its engine arguments (this "
            "kv-transfer-config with them) at start, and every local user can read a command "
            f"line; give it in the environment variable secret_env names ({c.secret_env})",
        )
        if len(c.secret) < MIN_SECRET_CHARS:
            report.add(
                "p2p secret length",
                f"{at}.secret",
                SYNTAX,
                WARNING,
                _short_secret(len(c.secret)),
            )
    if f"{at}.allowed_peers" not in bad:
        for i, entry in enumerate(c.allowed_peers):
            try:
                net = parse_allowed(entry, "").network
            except ValueError:
                continue
            if net is not None and net.prefixlen < (8 if net.version == 4 else 32):
                report.add(
                    "p2p allowed_peers narrow",
                    f"{at}.allowed_peers[{i}]",
                    SYNTAX,
                    WARNING,
                    f"{entry!r} lets any API request make this instance dial any of "
                    f"{net.num_addresses:,} addresses; name the peers' hosts or their subnet",
                )
    if c.auth == "none" and f"{at}.auth" not in bad:
        report.add(
            "p2p auth",
            f"{at}.auth",
            SYNTAX,
            WARNING,
            "auth none: no secret and no encryption; any local user of this machine can connect "
            "to the loopback port and read (and push) the KV of every user of this engine "
            "(trust_local_users says that is meant)",
        )


def _short_secret(n: int) -> str:
    return (
        f"the secret is {n} characters long: whoever a client dials can test guesses of it "
        "offline from one recorded handshake; use at least "
        f"{MIN_SECRET_CHARS} random characters (python -c 'import secrets; "
        "print(secrets.token_hex(32))')"
    )


def _check_events_bind(ev: Any, bad: set[str], report: Report) -> None:
    """Whether the KV-event sockets are reachable from other hosts: every ``BlockStored`` carries
    the token ids and block hashes of users' prompts, and neither socket authenticates or
    encrypts (a warning: routers on other hosts need it, behind a firewall)."""
    what = {
        "endpoint": "every subscriber that reaches it receives each BlockStored event",
        "replay_endpoint": "any client that reaches it is sent the recent batches",
    }
    for key, gets in what.items():
        at = f"{EXTRA}.kv_events.{key}"
        endpoint = getattr(ev, key)
        if endpoint is None or at in bad:
            continue
        reach = bind_reach(endpoint)
        if reach is None:
            report.add("KV events on loopback", at, SYNTAX, OK, f"{endpoint}: this host only")
            continue
        report.add(
            "KV events on loopback",
            at,
            SYNTAX,
            WARNING,
            f"{endpoint} binds {reach}: {gets}, with the token ids and block hashes of users' "
            "prompts, without authentication or encryption. Bind 127.0.0.1 (as the default "
            "endpoint, tcp://127.0.0.1:5557, does) unless routers on other hosts subscribe, and "
            "then let only them reach the port (a firewall rule)",
        )


def _check_shm(cpu: int, shm_dir: str, report: Report) -> None:
    """The host arena (``cpu_bytes_to_use`` plus its header, reserved at start) against
    ``shm_dir``'s size (error) and free space now (warning)."""
    from kvoffload.ipc.arena import HEADER_BYTES
    from kvoffload.tools.tier_inspect import format_bytes

    at = f"{EXTRA}.cpu_bytes_to_use"
    need = cpu + HEADER_BYTES
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        report.add(
            "host tier fits /dev/shm", at, MACHINE, WARNING, f"cannot look at {shm_dir}: {e}"
        )
        return
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if need > size:
        report.add(
            "host tier fits /dev/shm",
            at,
            MACHINE,
            ERROR,
            f"the host arena needs {format_bytes(need)} in {shm_dir}, more than its whole size "
            f"here ({format_bytes(size)}): the engine would fail at start; lower cpu_bytes_to_use "
            f"or enlarge {shm_dir} (in a container: --shm-size, or --ipc=host)",
        )
    elif need > free:
        report.add(
            "host tier fits /dev/shm",
            at,
            MACHINE,
            WARNING,
            f"the host arena needs {format_bytes(need)} in {shm_dir}, which has "
            f"{format_bytes(free)} free now (of {format_bytes(size)}): an engine started now "
            "would fail; free it (`kvoffload sweep` removes arenas of dead engines) or lower "
            "cpu_bytes_to_use",
        )
    else:
        report.add(
            "host tier fits /dev/shm",
            at,
            MACHINE,
            OK,
            f"needs {format_bytes(need)}; {shm_dir} has {format_bytes(free)} free of "
            f"{format_bytes(size)} (here, now; each data-parallel engine reserves its own)",
        )


def _check_tier_here(spec: TierSpec, at: str, bad: set[str], report: Report) -> None:
    """This machine's view of one tier: its config's ``check_on_this_machine()`` (the checks the
    engine makes at start), and per type what the engine would only find later."""
    from kvoffload.tiers.fs import FsTierConfig
    from kvoffload.tiers.obj import ObjTierConfig
    from kvoffload.tiers.p2p import P2PTierConfig

    c = spec.config
    stood_in = any(p.startswith(f"{at}.") for p in bad)
    machine = getattr(c, "check_on_this_machine", None)
    if isinstance(c, FsTierConfig):
        _check_fs_root(c, at, bad, report)
    elif machine is not None:
        if stood_in:
            report.not_checked("usable here", at, "the tier's config has errors")
        else:
            problems = machine()
            for text in problems:
                report.issue("usable here", ConfigIssue.parse(f"{at}.{text}"), MACHINE)
            if not problems:
                report.add("usable here", at, MACHINE, OK, f"{spec.type} tier")
    if isinstance(c, P2PTierConfig):
        _check_p2p_secret(c, at, bad, report)
    if getattr(c, "integrity_key_env", None) is not None:
        _check_integrity_key(c.integrity_key_env, at, bad, report)
    if isinstance(c, ObjTierConfig) and c.ca_bundle is not None and f"{at}.ca_bundle" not in bad:
        if os.path.isfile(c.ca_bundle):
            report.add("CA bundle readable", f"{at}.ca_bundle", MACHINE, OK, c.ca_bundle)
        else:
            report.add(
                "CA bundle readable",
                f"{at}.ca_bundle",
                MACHINE,
                ERROR,
                f"{c.ca_bundle!r} is not a file here: the tier's first request would fail "
                "(the engine stops at start); give the path of a PEM file on the server",
            )


def _check_fs_root(c: Any, at: str, bad: set[str], report: Report) -> None:
    from kvoffload.tools.tier_inspect import format_bytes

    root_at = f"{at}.root_dir"
    if root_at in bad or c.root_dir is None:
        report.not_checked("root_dir usable", root_at, "root_dir has an error")
        return
    full = os.path.abspath(c.root_dir)
    if not os.path.isabs(c.root_dir):
        report.add(
            "root_dir absolute",
            root_at,
            MACHINE,
            WARNING,
            f"{c.root_dir!r} is relative: the engine resolves it against the server's working "
            f"directory (from here: {full}); give an absolute path",
        )
    problems = c.check_on_this_machine()
    for text in problems:
        report.issue("root_dir usable", ConfigIssue.parse(f"{at}.{text}"), MACHINE)
    if problems:
        return
    where = full if os.path.isdir(full) else f"{full} (created at start)"
    report.add("root_dir usable", root_at, MACHINE, OK, f"a writable directory: {where}")
    floor_at = f"{at}.min_free_fraction"
    space = c.free_space_now()
    if floor_at in bad:
        report.not_checked("free space above the floor", floor_at, "min_free_fraction has an error")
    elif space is None:
        report.not_checked("free space above the floor", root_at, f"cannot look at {full}")
    elif space[0] < space[1]:
        report.add(
            "free space above the floor",
            root_at,
            MACHINE,
            WARNING,
            f"{c.root_dir} has {space[0]} bytes free now, below its free-space floor of "
            f"{space[1]} bytes (min_free_fraction {c.min_free_fraction:g}): it would store "
            "nothing until space is freed there (or lower min_free_fraction)",
        )
    else:
        report.add(
            "free space above the floor",
            root_at,
            MACHINE,
            OK,
            f"{format_bytes(space[0])} free, floor {format_bytes(space[1])} "
            f"(min_free_fraction {c.min_free_fraction:g})",
        )


def _check_p2p_secret(c: Any, at: str, bad: set[str], report: Report) -> None:
    keys = ("secret", "secret_env", "auth")
    if any(f"{at}.{k}" in bad for k in keys):
        report.not_checked("p2p secret", f"{at}.secret", "secret, secret_env or auth has an error")
        return
    if c.auth == "none":
        report.add("p2p secret", f"{at}.auth", MACHINE, OK, "auth none (loopback): no secret")
    elif c.secret is not None:
        report.add("p2p secret", f"{at}.secret", MACHINE, OK, "given in the config")
    elif os.environ.get(c.secret_env):
        report.add(
            "p2p secret",
            f"{at}.secret_env",
            MACHINE,
            OK,
            f"{c.secret_env} is set in this environment (the server's may differ)",
        )
        n = len(os.environ[c.secret_env])
        if n < MIN_SECRET_CHARS:
            report.add("p2p secret length", f"{at}.secret_env", MACHINE, WARNING, _short_secret(n))
    else:
        report.add(
            "p2p secret",
            f"{at}.secret_env",
            MACHINE,
            WARNING,
            f"{c.secret_env} is not set in this environment and secret is not given: an "
            "engine started with this environment stops at start ('secret: the p2p tier needs a "
            f"shared secret'). Set {c.secret_env} to the same value on every instance (the "
            "server's environment may differ from this one)",
        )


def _check_integrity_key(env_name: str, at: str, bad: set[str], report: Report) -> None:
    """A tier's integrity key in this environment, checked as the tier checks it at start (set,
    long enough); its value is never shown."""
    from kvoffload.workers.chunkfile import IntegrityKeyError, secret_from_env

    key_at = f"{at}.integrity_key_env"
    if key_at in bad:
        report.not_checked("integrity key", key_at, "integrity_key_env has an error")
        return
    try:
        secret_from_env(env_name)
    except IntegrityKeyError as e:
        why = str(e).removeprefix("integrity_key_env: ")
        report.add(
            "integrity key",
            key_at,
            MACHINE,
            WARNING,
            f"{why}: an engine started with this environment stops at start (the server's "
            "environment may differ from this one)",
        )
    else:
        report.add(
            "integrity key",
            key_at,
            MACHINE,
            OK,
            f"{env_name} is set in this environment (the server's may differ)",
        )


# -- the chunk size --------------------------------------------------------------------------------


class ModelKV(msgspec.Struct, kw_only=True):
    """What a model's ``config.json`` tells of its KV cache.

    Attributes:
        bytes_per_token: KV bytes per token, all layers and heads (2 x layers x KV heads x head
            dim x dtype bytes); None when it cannot be told (``how`` says why).
        how: how it was computed, or why it cannot be.
        max_len: ``max_position_embeddings`` (tokens), None when not given.
    """

    bytes_per_token: int | None
    how: str
    max_len: int | None = None


def model_kv(model_dir: str, kv_cache_dtype: str = "auto", dtype: str = "auto") -> ModelKV:
    """KV bytes per token of a local Hugging Face model directory, for plain attention models
    (every layer full or sliding-window attention, K and V per KV head). The KV cache's dtype is
    ``kv_cache_dtype``, else the engine's ``dtype`` (vLLM's ``--dtype``), else the model's
    (vLLM's ``--dtype auto``: a float32 model runs in 16 bits); ``how`` names which.

    Raises:
        CheckInputError: no readable ``config.json`` in ``model_dir``.
    """
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            top = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckInputError(
            f"--model {model_dir}: cannot read {path} ({e}); give a local Hugging Face model "
            "directory"
        ) from None
    if not isinstance(top, dict):
        raise CheckInputError(f"--model {model_dir}: {path} is not a JSON object")
    text = {**top, **top["text_config"]} if isinstance(top.get("text_config"), dict) else top
    max_len = text.get("max_position_embeddings")
    max_len = max_len if isinstance(max_len, int) and max_len > 0 else None

    def unknown(why: str) -> ModelKV:
        return ModelKV(bytes_per_token=None, how=why, max_len=max_len)

    if "kv_lora_rank" in text:
        return unknown("an MLA model (kv_lora_rank): its KV is a compressed latent per token")
    kinds = set(text.get("layer_types") or [])
    if len(kinds) > 1 or kinds - {"full_attention", "sliding_attention"}:
        return unknown(
            f"a hybrid model (layer_types: {', '.join(sorted(map(str, kinds)))}): its KV-cache "
            "groups differ in shape"
        )
    if any("mamba" in str(k) or "ssm" in str(k) for k in text) or "mamba" in str(
        text.get("model_type", "")
    ):
        return unknown("a model with state-space (Mamba) layers")
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim")
    if head_dim is None and isinstance(heads, int) and heads > 0:
        hidden = text.get("hidden_size")
        head_dim = hidden // heads if isinstance(hidden, int) else None
    shape = {"num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    missing = [k for k, v in shape.items() if not (isinstance(v, int) and v > 0)]
    if missing:
        return unknown(f"config.json does not give {', '.join(missing)}")
    if kv_cache_dtype != "auto":
        nbytes, named = DTYPE_BYTES[kv_cache_dtype], f"--kv-cache-dtype {kv_cache_dtype}"
    elif dtype != "auto":
        nbytes, named = DTYPE_BYTES[dtype], f"--dtype {dtype}"
    else:
        model_dtype = text.get("dtype") or text.get("torch_dtype")
        if model_dtype not in ("float32", "float16", "bfloat16"):
            return unknown(f"config.json names no dtype ({model_dtype!r}): give --dtype")
        # vLLM's --dtype auto runs float32 models in 16 bits
        nbytes = 2
        named = f"the model's {model_dtype}" + (
            ", run in 16 bits by vLLM's --dtype auto; give --dtype float32 for a server run with it"
            if model_dtype == "float32"
            else ""
        )
    assert isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)
    return ModelKV(
        bytes_per_token=2 * layers * kv_heads * head_dim * nbytes,
        how=f"2 (K, V) x {layers} layers x {kv_heads} KV heads x {head_dim} head dim x "
        f"{nbytes} bytes ({named})",
        max_len=max_len,
    )


def _check_model(
    cfg: OffloadConfig,
    cpu: int | None,
    cpu_at: str,
    bad: set[str],
    report: Report,
    options: Options,
) -> None:
    """``cpu_bytes_to_use`` against one chunk of the model, and against its longest request."""
    from kvoffload.ipc.arena import round_up_to_page

    assert options.model_dir is not None
    kv = model_kv(options.model_dir, options.kv_cache_dtype, options.dtype)
    one = "host tier holds one chunk"
    if cpu is None:
        report.not_checked(one, cpu_at, "cpu_bytes_to_use has an error")
        return
    if kv.bytes_per_token is None:
        report.not_checked(one, cpu_at, f"the KV size cannot be told from --model: {kv.how}")
        return
    if any(f"{EXTRA}.{k}" in bad for k in ("block_size", "blocks_per_chunk")):
        report.not_checked(one, cpu_at, "blocks_per_chunk or block_size has an error")
        return
    engine_block = options.engine_block_size or DEFAULT_ENGINE_BLOCK_SIZE
    if cfg.block_size is not None:
        tokens, tokens_how = cfg.block_size, "block_size"
    else:
        per = cfg.blocks_per_chunk or 1
        given = "" if options.engine_block_size else ", vLLM's default on GPUs (--block-size)"
        tokens = per * engine_block
        tokens_how = f"blocks_per_chunk {per} x engine block size {engine_block}{given}"
    row = round_up_to_page(tokens * kv.bytes_per_token)
    chunk = f"one chunk of {row} bytes ({tokens} tokens: {tokens_how}; x {kv.how})"
    if cpu < row:
        levers = ["raise cpu_bytes_to_use to at least " + str(row)]
        if cfg.block_size is not None:
            levers.append("lower block_size")
        elif (cfg.blocks_per_chunk or 1) > 1:
            levers.append("lower blocks_per_chunk")
        report.add(
            one,
            cpu_at,
            MODEL,
            ERROR,
            f"{cpu} bytes cannot hold {chunk}: the engine would refuse to start; "
            + ", or ".join(levers),
        )
        return
    slots = cpu // row
    report.add(one, cpu_at, MODEL, OK, f"{slots} chunks of {row} bytes ({tokens} tokens each)")
    longest = options.max_model_len or kv.max_len
    request = "host tier holds the longest request"
    if longest is None:
        report.not_checked(
            request, cpu_at, "config.json gives no max_position_embeddings: --max-model-len"
        )
        return
    held = slots * tokens
    source = "--max-model-len" if options.max_model_len else "the model's max_position_embeddings"
    if held < longest:
        need = math.ceil(longest / tokens) * row
        report.add(
            request,
            cpu_at,
            MODEL,
            WARNING,
            f"the host tier holds {held} tokens, fewer than {longest} ({source}): a longer "
            f"request is offloaded only up to what fits; cpu_bytes_to_use {need} holds one "
            "request of that length",
        )
    else:
        report.add(request, cpu_at, MODEL, OK, f"{held} tokens, at least {longest} ({source})")


def _check_chunk_from_roots(
    cfg: OffloadConfig,
    cpu: int,
    cpu_at: str,
    tiers: list[TierSpec | None],
    bad: set[str],
    report: Report,
) -> None:
    """Without ``--model``: the chunk size of the namespaces already in the fs roots (their
    ``config.json``: row bytes, tokens per chunk), which an engine serving that model again
    would use."""
    from kvoffload.tiers.fs import FsTierConfig
    from kvoffload.tools.tier_inspect import InspectError, namespace_identities

    check = "host tier holds one chunk"
    found = False
    for i, spec in enumerate(tiers):
        at = f"{EXTRA}.secondary_tiers[{i}]"
        if spec is None or not isinstance(spec.config, FsTierConfig):
            continue
        if f"{at}.root_dir" in bad or not os.path.isdir(spec.config.root_dir):
            continue
        try:
            namespaces = namespace_identities(spec.config.root_dir)
        except InspectError:
            continue  # no namespace there yet
        for ns in namespaces:
            row = (ns.identity or {}).get("row_bytes")
            if not isinstance(row, int) or row <= 0:
                continue
            found = True
            model = (ns.identity or {}).get("model", "?")
            tokens = (ns.identity or {}).get("tokens_per_chunk", "?")
            what = (
                f"namespace {ns.id} in {spec.config.root_dir} (model {model}): chunks of {row} "
                f"bytes ({tokens} tokens)"
            )
            if cpu < row:
                report.add(
                    check,
                    cpu_at,
                    MACHINE,
                    WARNING,
                    f"{cpu} bytes cannot hold one chunk of {what}: an engine serving that "
                    f"model again would refuse to start; raise cpu_bytes_to_use to at least {row}",
                )
            else:
                report.add(check, cpu_at, MACHINE, OK, f"{cpu // row} chunks of {what}")
    if not found:
        report.not_checked(
            check,
            cpu_at,
            "the chunk size comes from the model: give --model DIR (a local Hugging Face model "
            "directory); no fs root holds a namespace yet",
        )


# -- online ----------------------------------------------------------------------------------------


def _online_checks(
    spec: TierSpec, at: str, bad: set[str], report: Report, options: Options
) -> list[Callable[[], Check]]:
    """The online checks of one tier, to run (each returns its :class:`Check`); without
    ``--online`` a not-checked row instead."""
    from kvoffload.tiers.obj import ObjTierConfig
    from kvoffload.tiers.p2p import P2PTierConfig

    c = spec.config
    out: list[Callable[[], Check]] = []
    if isinstance(c, ObjTierConfig):
        where = c.endpoint_override or "AWS S3"
        check = "bucket answers"
        keys = ("bucket", "endpoint_override", "access_key_id", "secret_access_key", "region")
        if not options.online:
            report.not_checked(check, f"{at}.bucket", f"--online reaches {where} from here")
        elif c.bucket is None or any(f"{at}.{k}" in bad for k in keys):
            report.not_checked(check, f"{at}.bucket", "a key it needs has an error")
        else:
            out.append(functools.partial(_head_bucket, c, at, options.timeout_s))
    if isinstance(c, P2PTierConfig) and c.peers:
        check = "peer answers"
        if not options.online:
            report.not_checked(
                check, f"{at}.peers", "--online tries a TCP connect to each peer from here"
            )
        else:
            for i, peer in enumerate(c.peers):
                if f"{at}.peers[{i}]" in bad:
                    continue
                out.append(functools.partial(_connect_peer, peer, f"{at}.peers[{i}]", options))
    return out


def _head_bucket(c: Any, at: str, timeout_s: float) -> Check:
    from kvoffload.tiers.obj import bucket_problem, io_config_of
    from kvoffload.workers.obj_io import make_client

    where = c.endpoint_override or "AWS S3"
    try:
        client = make_client(
            io_config_of(
                c,
                namespace_id="",
                row_bytes=0,
                max_attempts=1,
                connect_timeout_s=timeout_s,
                read_timeout_s=timeout_s,
                max_connections=1,
            )
        )
        problem = bucket_problem(client, c)
    except Exception as e:  # botocore refuses the endpoint URL, the region...
        problem = f"endpoint_override: cannot use {where}: {type(e).__name__}: {e}"
    if problem is None:
        return Check(
            check="bucket answers",
            path=f"{at}.bucket",
            scope=ONLINE,
            result=OK,
            detail=f"{c.bucket!r} exists at {where} and the credentials are accepted (HeadBucket)",
        )
    issue = ConfigIssue.parse(f"{at}.{problem}")
    return Check(
        check="bucket answers",
        path=issue.path,
        scope=ONLINE,
        result=ERROR,
        detail=f"{issue.message} (from here, now): the engine would stop at start",
    )


def tcp_unreachable(host: str, port: int, timeout_s: float) -> str | None:
    """Why no TCP connection to ``host:port`` opens within ``timeout_s`` seconds (``no
    answer``, ``Connection refused``, a name that does not resolve...); None when one does (it is
    closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return "no answer" if isinstance(e, socket.timeout) else e.strerror or str(e)
    except (ValueError, UnicodeError) as e:  # a host name the resolver refuses
        return str(e)


def _connect_peer(peer: str, at: str, options: Options) -> Check:
    from kvoffload.tiers.p2p import parse_peer

    host, port = parse_peer(peer, at)
    only = "only reachability is checked, not the shared secret"
    why = tcp_unreachable(host, port, options.timeout_s)
    if why is not None:
        return Check(
            check="peer answers",
            path=at,
            scope=ONLINE,
            result=WARNING,
            detail=f"{peer} does not answer from here ({why}): the tier keeps asking it again "
            f"with backoff and skips it meanwhile; {only}",
        )
    return Check(
        check="peer answers",
        path=at,
        scope=ONLINE,
        result=OK,
        detail=f"{peer} accepts a TCP connection; {only}",
    )


# -- output ----------------------------------------------------------------------------------------


def short_path(path: str) -> str:
    """A key path as the settings table names it (without ``kv_connector_extra_config.``)."""
    prefix = f"{EXTRA}."
    return path[len(prefix) :] if path.startswith(prefix) else path


def render(report: Report, console: Any) -> None:
    """Print the checks as a rich table: key, what was checked, scope, result."""
    from rich.markup import escape
    from rich.table import Table

    # On a terminal the result (the longest cell) gets most of the width; elsewhere the console
    # is unbounded (see kvoffload.tools.cli) and every cell stays on one line.
    wide = console.is_terminal
    t = Table(title="checks", title_justify="left", expand=wide)
    t.add_column("key", style="cyan", no_wrap=True)
    t.add_column("check", ratio=1 if wide else None)
    t.add_column("scope", no_wrap=True)
    t.add_column("result", overflow="fold", ratio=3 if wide else None)
    style = {OK: "green", WARNING: "yellow", ERROR: "red"}
    for c in report.checks:
        if c.scope == NOT_CHECKED:
            scope, result = c.scope, escape(c.detail)  # why
        else:
            scope = c.scope
            word = f"[{style[c.result]}]{c.result}[/{style[c.result]}]"
            result = f"{word}: {escape(c.detail)}" if c.detail else word
        t.add_row(escape(short_path(c.path)), c.check, scope, result)
    console.print(t)


def to_json(report: Report) -> str:
    """``kvoffload check --json`` on an invalid configuration: ``{"file", "form", "valid":
    false, "errors", "warnings", "checks"}``; each error and warning ``{"path", "message",
    "scope"}``, each check as :class:`Check`."""

    def item(c: Check) -> dict[str, str]:
        return {"path": c.path, "message": c.detail, "scope": c.scope}

    doc = {
        "file": report.file,
        "form": report.form,
        "valid": not report.errors,
        "errors": [item(c) for c in report.errors],
        "warnings": [item(c) for c in report.warnings],
        "checks": msgspec.to_builtins(report.checks),
    }
    return json.dumps(doc)
