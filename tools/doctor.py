"""``kvoffload doctor``: why instances share nothing, or would fail at start, in one command.

::

    CONFIG [OTHER ...]  (the forms `kvoffload check` reads, or a vLLM serve configuration YAML
      │ whose kv-transfer-config is one; the first is this machine's instance)
      │ config_check.check_text: each file's own checks (keys, /dev/shm, fs roots writable,
      │ secrets in this environment...): its errors and warnings, per instance       ── config
      ├─ the fields of the namespace the files decide, side by side (NAMESPACE_ROWS: one row
      │  per Namespace field a file decides; model, revision, KV dtype, engine block size from a
      │  serve configuration; integrity key per storage place) with the hash seed and algorithm
      │  (--hash-seed / --hash-algo): each field that differs                          ── namespace
      ├─ the fs roots and obj buckets each instance uses: which instances share one, a root on
      │  tmpfs, max_bytes against the disk, the namespaces a root already holds and the fields
      │  that tell them apart (their config.json)                                    ── storage
      ├─ the p2p tiers' auth, and whether each names the others' advertise addresses     ── mesh
      ├─ each p2p tier's peers: TCP connect, then the p2p client's own handshake
      │  (PeerClient over the node's DEALER: CurveZMQ, Hello/Challenge/Auth/Welcome)   ── peers
      ├─ KV-event endpoints: something listens, the replay answers on the expected topic, a
      │  subscriber sees that topic                                                  ── events
      └─ --metrics URL: the endpoint answers with kvoffload's metrics; its Date header and
         the events' timestamps give each peer's clock against ours                   ── clock
    ──▶ Report: one Finding per fact (check, subject, ok / warn / fail, what was found, the fix)

Read-only: nothing here writes a tier, an arena or a file (the fs root checks are
``os.access`` and ``statvfs``); the p2p probe opens a session with no data plane, which reads and
leases nothing, and drops it (the peer ends it after its ``peer_timeout_s``). The p2p protocol
carries no clock: skew is measured only where a peer reports its time (a metrics endpoint's HTTP
``Date``, an event batch's ``ts``).

The first file is this machine's instance; the others are other machines' (``--same-host``: this
one's too): their files are checked as files only, their loopback addresses not reached, a root
path they share with this one not called shared. What crosses in is bounded: configuration files
(regular, :data:`MAX_CONFIG_BYTES`, no YAML aliases), event messages (:data:`MAX_EVENT_MESSAGE_BYTES`,
:data:`REPLAY_BATCHES`), metrics bodies (:data:`MAX_METRICS_BYTES`), each reach within
``--timeout``. No secret is printed: a ``cache_salt`` shows as ``set`` or ``empty``, an integrity
key as its key id (:func:`kvoffload.workers.chunkfile.key_id`).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import stat
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any

import msgspec

from kvoffload.config import OffloadConfig, TierSpec
from kvoffload.tools import config_check

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_TIMEOUT_S = 3.0
"""How long each reach of a peer, an events endpoint or a metrics endpoint may take (seconds)."""
MAX_WAIT_S = 600.0
"""The longest ``--timeout`` or ``--events-wait`` (seconds)."""
EVENTS_WAIT_S = 2.0
"""How long a subscriber waits for a batch on a KV-events PUB socket (seconds): an idle engine
publishes nothing, so silence is a warning, not a failure."""
CLOCK_SKEW_WARN_S = 5.0
"""A peer's clock this far from ours (seconds, beyond the measure's own uncertainty) is reported:
event timestamps compared across instances (routers ageing entries) and file ages on a shared fs
root (``kvoffload sweep``'s orphan age) mislead by that much."""
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``--prefix-caching-hash-algo`` values; the ``xxhash`` ones seed per process without
``PYTHONHASHSEED``."""
UNSET = "unset"
HEADROOM_CHECKS = ("host tier fits /dev/shm", "free space above the floor")
"""``kvoffload check`` rows shown even when ok: the headroom of /dev/shm and of each fs root."""
NOT_KNOWN = "not known"


class Finding(msgspec.Struct, kw_only=True):
    """One fact ``kvoffload doctor`` looked at.

    Attributes:
        check: what was checked (``namespace: cache_salt``, ``p2p peer``...).
        subject: what it is about: an instance (its file name), a pair, a root, an address.
        status: ``ok``, ``warn`` or ``fail``.
        found: what was found (for a mismatch, each side's value).
        fix: what to change; empty when ok.
    """

    check: str
    subject: str
    status: str
    found: str
    fix: str = ""


class Report(msgspec.Struct, kw_only=True):
    """Everything ``kvoffload doctor`` found (``--json`` prints it).

    Attributes:
        instances: the configuration files, in the order given (the first is this machine's).
        findings: every finding, in the order made.
    """

    instances: list[str]
    findings: list[Finding] = []

    @property
    def failed(self) -> bool:
        """At least one finding failed (exit status 1)."""
        return any(f.status == FAIL for f in self.findings)

    def add(self, check: str, subject: str, status: str, found: str, fix: str = "") -> None:
        """Record one finding."""
        self.findings.append(
            Finding(check=check, subject=subject, status=status, found=found, fix=fix)
        )


class Options(msgspec.Struct, kw_only=True):
    """What ``kvoffload doctor`` is told besides the configuration files.

    Attributes:
        hash_seeds: each instance's ``PYTHONHASHSEED`` in the order of the files (``unset``: the
            server runs without it); fewer than files: the rest are not known.
        hash_algos: each instance's vLLM ``--prefix-caching-hash-algo`` likewise (where not
            given: a serve configuration's, else ``sha256``, vLLM's default).
        engine_block_size: the engines' ``--block-size`` (tokens) where a serve configuration
            does not give it: compares a ``block_size`` with a ``blocks_per_chunk``; None: such a
            pair is not compared.
        namespace_id: the namespace id the engines log at start (``namespace <32 hex>``): the
            p2p probe names it in its Hello, as the engine's tier does; None: a placeholder, and
            a peer's refusal of it says only that the secret is right.
        metrics: metrics endpoints (``host:port`` or URLs) of running instances.
        events: KV-event endpoints (``tcp://host:port``) to subscribe to, besides those the
            configurations bind to a concrete address.
        timeout_s: each reach's limit (seconds).
        events_wait_s: how long a subscriber waits for a batch (seconds).
        shm_dir: where host arenas live.
        same_host: every file is an instance of this machine: their host arenas together
            against ``shm_dir``.
    """

    hash_seeds: list[str] = []
    hash_algos: list[str] = []
    engine_block_size: int | None = None
    namespace_id: str | None = None
    metrics: list[str] = []
    events: list[str] = []
    timeout_s: float = DEFAULT_TIMEOUT_S
    events_wait_s: float = EVENTS_WAIT_S
    shm_dir: str = "/dev/shm"
    same_host: bool = False


class DoctorInputError(ValueError):
    """A file that cannot be read at all, or options that do not fit the files (exit 2)."""


class EngineSettings(msgspec.Struct, kw_only=True):
    """What a vLLM serve configuration file (``vllm serve --config FILE.yaml``: its keys are
    ``vllm serve``'s options) says of an engine's namespace, besides its ``kv-transfer-config``.

    Attributes:
        model: ``model`` (a Hugging Face id or a path); None when not given.
        revision: ``revision``.
        dtype: ``dtype`` (``auto``: the model's).
        kv_cache_dtype: ``kv-cache-dtype`` (``auto``: ``dtype``).
        block_size: ``block-size`` (tokens); None: vLLM's default for the device.
        hash_algo: ``prefix-caching-hash-algo``; None: vLLM's default, sha256.
        tp_size, pp_size, pcp_size, dcp_size: ``tensor-parallel-size``,
            ``pipeline-parallel-size``, ``prefill-context-parallel-size``,
            ``decode-context-parallel-size`` (default 1).
    """

    model: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    hash_algo: str | None = None
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1


#: Keys of a vLLM serve configuration file the doctor reads, by field of :class:`EngineSettings`
#: (vLLM accepts each option name with dashes or underscores).
ENGINE_KEYS = {
    "model": "model",
    "revision": "revision",
    "dtype": "dtype",
    "kv_cache_dtype": "kv-cache-dtype",
    "block_size": "block-size",
    "hash_algo": "prefix-caching-hash-algo",
    "tp_size": "tensor-parallel-size",
    "pp_size": "pipeline-parallel-size",
    "pcp_size": "prefill-context-parallel-size",
    "dcp_size": "decode-context-parallel-size",
}
_INT_FIELDS = ("block_size", "tp_size", "pp_size", "pcp_size", "dcp_size")


def _no_alias_loader() -> Any:
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """PyYAML's safe loader refusing aliases (``*name``): a serve configuration needs none,
        and nested aliases expand to billions of nodes (a "billion laughs" file)."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, "an alias (*name): not accepted here, write the value out", mark
                )
            return super().compose_node(parent, index)

    return NoAliasLoader


def read_serve_config(path: str, text: str) -> tuple[str, EngineSettings]:
    """A vLLM serve configuration file (YAML): the JSON text of its ``kv-transfer-config`` (the
    whole object, a form ``kvoffload check`` reads) and the engine's settings.

    Raises:
        DoctorInputError: PyYAML missing (vLLM brings it), not YAML (or an alias in it), not a
            mapping, no ``kv-transfer-config``, a ``block-size`` that is not a positive integer.
    """
    try:
        import yaml
    except ImportError:
        raise DoctorInputError(
            f"{path}: a vLLM serve configuration (YAML) needs PyYAML, which vLLM installs: "
            "pip install pyyaml"
        ) from None
    try:
        doc = yaml.load(text, Loader=_no_alias_loader())  # a SafeLoader
    except yaml.YAMLError as e:
        # the problem and where, never the source line (it may hold a secret)
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise DoctorInputError(f"{path}: not YAML: {problem}{where}") from None
    if not isinstance(doc, dict):
        raise DoctorInputError(f"{path}: expected a mapping of vllm serve options")
    doc = {str(k).replace("_", "-"): v for k, v in doc.items()}
    transfer = doc.get("kv-transfer-config")
    if transfer is None:
        raise DoctorInputError(
            f"{path}: no kv-transfer-config: a vLLM serve configuration names kvoffload there"
        )
    if isinstance(transfer, str):
        text = transfer
    else:
        text = json.dumps(transfer)
    fields: dict[str, Any] = {}
    for field, key in ENGINE_KEYS.items():
        value = doc.get(key)
        if value is None:
            continue
        if field in _INT_FIELDS and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise DoctorInputError(f"{path}: {key} {value!r}: expected a positive integer")
        fields[field] = value if field in _INT_FIELDS else str(value)
    return text, EngineSettings(**fields)


class Instance(msgspec.Struct, kw_only=True):
    """One configuration as the doctor reads it.

    Attributes:
        label: its file name as given.
        checked: what ``kvoffload check`` made of it.
        config: the parsed configuration; None when it has errors that leave none.
        hash_seed: its ``PYTHONHASHSEED`` (``unset``), or None when not known.
        hash_algo: its prefix-caching hash algorithm.
        engine: the engine's settings, from a vLLM serve configuration file; None from a
            kvoffload configuration alone.
        here: an instance of this machine (the first file, or every one with ``--same-host``):
            this machine's /dev/shm, fs roots, environment and loopback addresses are its own.
    """

    label: str
    checked: config_check.Checked
    config: OffloadConfig | None
    hash_seed: str | None
    hash_algo: str
    engine: EngineSettings | None = None
    here: bool = True


def diagnose(paths: list[str], options: Options) -> Report:
    """Run every check on the configuration files ``paths`` (the first is this machine's).

    Raises:
        DoctorInputError: a file cannot be read or is not JSON; more ``--hash-seed`` or
            ``--hash-algo`` values than files, or an unknown algorithm; a timeout that is not
            a finite number of seconds up to :data:`MAX_WAIT_S`; an ``--events`` endpoint or a
            ``--metrics`` URL that cannot be reached as such.
    """
    for name, values in (("--hash-seed", options.hash_seeds), ("--hash-algo", options.hash_algos)):
        if len(values) > len(paths):
            raise DoctorInputError(
                f"{name} given {len(values)} times for {len(paths)} configuration file(s): give "
                "it once per file, in the files' order"
            )
    for name, value in (("--timeout", options.timeout_s), ("--events-wait", options.events_wait_s)):
        if not (math.isfinite(value) and 0 < value <= MAX_WAIT_S):
            raise DoctorInputError(
                f"{name} {value!r}: give seconds above 0, at most {MAX_WAIT_S:g}"
            )
    for problem in [events_endpoint_problem(e) for e in options.events] + [
        metrics_url_problem(u) for u in options.metrics
    ]:
        if problem is not None:
            raise DoctorInputError(problem)
    for algo in options.hash_algos:
        if algo not in HASH_ALGOS:
            raise DoctorInputError(
                f"--hash-algo {algo!r}: not one of vLLM's ({', '.join(HASH_ALGOS)})"
            )
    report = Report(instances=list(paths))
    instances = [
        _load(path, i, options) for i, path in enumerate(paths)
    ]  # every file read before anything is reached
    for inst in instances:
        _config_findings(inst, report)
    if options.same_host:
        _same_host_findings(instances, report, options)
    _namespace_findings(instances, report, options)
    _storage_findings(instances, report)
    _p2p_mesh_findings(instances, report)
    for inst in instances:
        if inst.config is not None:
            _peer_findings(inst, report, options)
    _events_findings(instances, report, options)
    for url in options.metrics:
        _metrics_finding(url, report, options)
    note = p2p_clock_note(instances)
    if note is not None and not any(f.check == "clock skew" for f in report.findings):
        report.add(
            "clock skew",
            "p2p peers",
            WARN,
            f"not compared: {note}",
            "give --metrics of each instance to compare their clocks",
        )
    return report


# -- reading ---------------------------------------------------------------------------------------


MAX_CONFIG_BYTES = 1 << 20
"""The largest configuration file read (bytes): a real one is a few KiB."""


def read_config_file(path: str) -> str:
    """The text of a configuration file: a regular file (not a FIFO, a device, a directory) of at
    most :data:`MAX_CONFIG_BYTES`, in UTF-8.

    Raises:
        DoctorInputError: it cannot be opened, is no regular file, is larger, or not UTF-8.
    """
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; a regular file ignores it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DoctorInputError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DoctorInputError(f"{path}: not a regular file: give a configuration file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise DoctorInputError(f"{path}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise DoctorInputError(
            f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a configuration file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DoctorInputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _load(path: str, i: int, options: Options) -> Instance:
    text = read_config_file(path)
    engine = None
    if path.lower().endswith((".yaml", ".yml")):
        text, engine = read_serve_config(path, text)
    # another machine's instance: only what its file says (this machine's /dev/shm, roots and
    # environment say nothing of it), unless --same-host
    here = i == 0 or options.same_host
    check_options = config_check.Options(
        shm_dir=options.shm_dir, timeout_s=options.timeout_s, syntax_only=not here
    )
    try:
        checked = config_check.check_text(text, path, check_options)
    except json.JSONDecodeError as e:
        raise DoctorInputError(f"{path}: not JSON: {e}") from None
    parsed = checked.parsed
    config = parsed.config if parsed is not None else None
    seed = options.hash_seeds[i] if i < len(options.hash_seeds) else None
    if i < len(options.hash_algos):
        algo = options.hash_algos[i]
    else:
        algo = (engine.hash_algo if engine is not None else None) or "sha256"
    if algo not in HASH_ALGOS:
        raise DoctorInputError(f"{path}: prefix-caching-hash-algo {algo!r}: not one of vLLM's")
    return Instance(
        label=path,
        checked=checked,
        config=config,
        hash_seed=seed,
        hash_algo=algo,
        engine=engine,
        here=here,
    )


def _config_findings(inst: Instance, report: Report) -> None:
    """The file's own errors and warnings as ``kvoffload check`` finds them."""
    checks = inst.checked.report
    for c in checks.checks:
        if c.result == config_check.OK and c.check in HEADROOM_CHECKS:
            status, fix = OK, ""
        elif c.result in (config_check.ERROR, config_check.WARNING):
            status = FAIL if c.result == config_check.ERROR else WARN
            fix = f"see `kvoffload check {inst.label}`"
        else:
            continue
        report.add(
            f"config: {c.check}",
            f"{inst.label}: {config_check.short_path(c.path)}",
            status,
            c.detail,
            fix,
        )
    if inst.config is None and not checks.errors:
        extra = inst.checked.extra_config
        spec = extra.get("spec_name") if isinstance(extra, dict) else None
        if spec == "TieringOffloadingSpec":  # vLLM's own spec: not kvoffload's to compare
            report.add("config", inst.label, WARN, f"spec_name {spec!r}: not compared here")
            return
        holds = "null" if extra is None else type(extra).__name__
        report.add(
            "config",
            inst.label,
            FAIL,
            f"no kvoffload configuration in it (it holds {holds})",
            "give the kv_connector_extra_config object, or the whole --kv-transfer-config one",
        )
        return
    if not checks.errors and not checks.warnings:
        passed = sum(c.result == config_check.OK for c in checks.checks)
        where = (
            ""
            if inst.here
            else "; this machine's checks (/dev/shm, fs roots, secrets) not made: another "
            "machine's instance (give --same-host if it runs here)"
        )
        report.add("config", inst.label, OK, f"valid; {passed} check(s) passed{where}")


def _same_host_findings(instances: list[Instance], report: Report, options: Options) -> None:
    """Every instance's host arena on this machine's /dev/shm at once."""
    from kvoffload.ipc.arena import HEADER_BYTES
    from kvoffload.tools.tier_inspect import format_bytes

    sized = [(i.label, i.config) for i in instances if i.config is not None]
    need = sum(c.cpu_bytes_to_use + HEADER_BYTES for _, c in sized)
    subject = f"{', '.join(label for label, _ in sized)} on {options.shm_dir}"
    try:
        st = os.statvfs(options.shm_dir)
    except OSError as e:
        report.add("host arenas together", subject, WARN, f"cannot look at it: {e}")
        return
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    what = f"{len(sized)} host arenas need {format_bytes(need)} together"
    fix = "lower cpu_bytes_to_use, or enlarge /dev/shm (in a container: --shm-size, --ipc=host)"
    if need > size:
        report.add(
            "host arenas together",
            subject,
            FAIL,
            f"{what}, more than its size {format_bytes(size)}",
            fix,
        )
    elif need > free:
        report.add(
            "host arenas together",
            subject,
            WARN,
            f"{what}, more than its {format_bytes(free)} free now (of {format_bytes(size)})",
            "free it (`kvoffload sweep` removes arenas of dead engines), or " + fix,
        )
    else:
        report.add(
            "host arenas together",
            subject,
            OK,
            f"{what}; {format_bytes(free)} free of {format_bytes(size)}",
        )


# -- the namespace ---------------------------------------------------------------------------------


def _tier_label(spec: TierSpec) -> str:
    return f"{spec.type} tier {spec.name!r}"


#: Each field of :class:`kvoffload.namespace.KeyedNamespace` (a :class:`~kvoffload.namespace.
#: Namespace` and its integrity key's id) and the row that compares it, or None where only the
#: running engine knows it (the row bytes, the groups' shapes: :func:`_root_namespaces` compares
#: them where a shared root holds namespaces). ``groups`` is compared through its blocks' size in
#: tokens (``engine block size``), ``integrity_key_id`` per storage place (:func:`_integrity_findings`).
NAMESPACE_ROWS: dict[str, str | None] = {
    "model": "model",
    "revision": "revision",
    "model_path": None,
    "model_fingerprint": None,
    "kv_dtype": "kv dtype",
    "layout": "layout",
    "tokens_per_chunk": "chunk size",
    "row_bytes": None,
    "groups": "engine block size",
    "tp_size": "parallel geometry",
    "pp_size": "parallel geometry",
    "pcp_size": "parallel geometry",
    "dcp_size": "parallel geometry",
    "tp_rank": None,
    "format_version": None,
    "cache_salt": "cache_salt",
    "integrity_key_id": "integrity key",
}


def namespace_rows() -> list[str]:
    """The namespace rows, in :class:`~kvoffload.namespace.KeyedNamespace`'s field order.

    Raises:
        KeyError: a namespace field :data:`NAMESPACE_ROWS` does not place (a field added to the
            namespace must be compared, or said to be the engine's).
    """
    from kvoffload.namespace import KeyedNamespace

    rows = [NAMESPACE_ROWS[f.name] for f in msgspec.structs.fields(KeyedNamespace)]
    return [r for r in dict.fromkeys(rows) if r is not None and r != "integrity key"]


def kv_dtype_name(name: str) -> str:
    """A dtype as vLLM resolves it (``half`` is ``float16``, ``fp8`` is ``fp8_e4m3``)."""
    return config_check.DTYPE_ALIASES.get(name, name)


def namespace_fields(inst: Instance, options: Options) -> dict[str, str]:
    """The fields of an instance's namespace that its files (and the options) decide, as words,
    by row (:func:`namespace_rows`; from a vLLM serve configuration ``model``, ``kv dtype``,
    ``engine block size`` and, direct layout, ``parallel geometry``) and ``hash seed`` (no
    namespace field: it changes the chunk keys). ``cache_salt`` says only ``set`` or ``empty``:
    :func:`_namespace_findings` compares the values themselves and never prints them."""
    from kvoffload.config import effective_config

    cfg = inst.config
    assert cfg is not None
    engine = inst.engine
    engine_block = engine.block_size if engine is not None else None
    engine_block = engine_block or options.engine_block_size
    revision = (engine.revision if engine is not None else None) or cfg.model_revision
    words: dict[str, str] = {}
    if engine is not None:
        words["model"] = engine.model or f"{NOT_KNOWN} (no model in the file)"
        kv_dtype = engine.kv_cache_dtype if engine.kv_cache_dtype != "auto" else engine.dtype
        words["kv dtype"] = "auto (the model's)" if kv_dtype == "auto" else kv_dtype_name(kv_dtype)
    words["revision"] = revision or "none"
    words["layout"] = "canonical" if cfg.canonical_layout else "direct"
    if cfg.block_size is not None:
        words["chunk size"] = f"{cfg.block_size} tokens (block_size)"
    else:
        per = effective_config(cfg).blocks_per_chunk or 1  # set where block_size is not
        if engine_block is not None:
            words["chunk size"] = f"{per * engine_block} tokens (blocks_per_chunk {per})"
        else:
            words["chunk size"] = f"blocks_per_chunk {per}"
    if engine_block is not None:
        words["engine block size"] = f"{engine_block} tokens"
    elif engine is not None:
        words["engine block size"] = f"{NOT_KNOWN} (vLLM's default for the device; give block-size)"
    if engine is not None and not cfg.canonical_layout:
        # rows hold one geometry's pages (a canonical layout's may be the same under any)
        words["parallel geometry"] = (
            f"TP {engine.tp_size} x PP {engine.pp_size} x PCP {engine.pcp_size} x "
            f"DCP {engine.dcp_size}"
        )
    words["cache_salt"] = "set" if cfg.cache_salt else "empty"
    words["hash seed"] = _hash_seed(inst)
    return {row: words[row] for row in [*namespace_rows(), "hash seed"] if row in words}


def _random_seed(inst: Instance) -> bool:
    """vLLM seeds this instance's block hashes at random per process (an xxhash algorithm
    without ``PYTHONHASHSEED``)."""
    return inst.hash_seed == UNSET and inst.hash_algo.startswith("xxhash")


def _hash_seed(inst: Instance) -> str:
    """vLLM's seed of the block-hash chain (``resolve_none_hash_seed``): ``PYTHONHASHSEED``
    where set; unset, the fixed default for sha256 and a random one per process for xxhash."""
    algo = inst.hash_algo
    if inst.hash_seed is None:
        return f"{NOT_KNOWN} ({algo}; give --hash-seed)"
    if inst.hash_seed != UNSET:
        return f"PYTHONHASHSEED={inst.hash_seed} ({algo})"
    if algo.startswith("xxhash"):
        return f"random per process ({algo} without PYTHONHASHSEED)"
    return f"vLLM's default ({algo} without PYTHONHASHSEED)"


_FIXES = {
    "model": "serve the same model on every instance meant to share",
    "revision": "serve the same model revision (vllm serve --revision, or model_revision) on "
    "every instance meant to share",
    "kv dtype": "run every instance with the same dtype and kv-cache-dtype",
    "cache_salt": "set the same cache_salt on every instance meant to share chunks (a salt is "
    "for instances that must not)",
    "chunk size": "set the same block_size (tokens) or blocks_per_chunk on every instance",
    "engine block size": "run every engine with the same --block-size (the namespace holds it)",
    "layout": "set the same canonical_layout on every instance",
    "parallel geometry": "run the same tensor-, pipeline- and context-parallel sizes, or set "
    "canonical_layout on every instance (rows then hold every rank's pages)",
    "hash seed": "start every vLLM server with the same PYTHONHASHSEED (or unset everywhere "
    "with sha256) and the same --prefix-caching-hash-algo",
}
#: Rows whose value a file may leave to the engine: where not known, or differing from an
#: unknown, they are said, not judged.
_MAYBE_UNKNOWN = ("model", "kv dtype", "engine block size")


def _namespace_findings(instances: list[Instance], report: Report, options: Options) -> None:
    usable = [i for i in instances if i.config is not None]
    for inst in usable:
        assert inst.config is not None
        if _random_seed(inst) and inst.config.secondary_tiers:
            report.add(
                "namespace: hash seed",
                inst.label,
                FAIL,
                f"{inst.hash_algo} without PYTHONHASHSEED: vLLM seeds its block hashes at "
                "random per process, so kvoffload refuses to start with secondary tiers "
                "(they would never hit)",
                "set PYTHONHASHSEED to the same value on every instance, or use sha256",
            )
    if len(usable) < 2:
        if len(instances) > 1:
            report.add(
                "namespace",
                ", ".join(i.label for i in instances),
                WARN,
                "fewer than two configurations without errors: nothing to compare",
                "fix the errors above",
            )
        return
    fields = [namespace_fields(i, options) for i in usable]
    names = list(dict.fromkeys(k for f in fields for k in f))
    for name in names:
        # (label, value) of each instance that has the field
        sides = [(i.label, f[name]) for i, f in zip(usable, fields) if name in f]
        if len(sides) < 2:
            continue
        if name == "hash seed" and any(_random_seed(i) for i in usable):
            continue  # never the same: said above, per instance
        values = [v for _, v in sides]
        subject = " vs ".join(label for label, _ in sides)
        both = "; ".join(f"{label}: {v}" for label, v in sides)
        if name == "chunk size" and len({v.split(" ")[0].isdigit() for v in values}) > 1:
            report.add(
                f"namespace: {name}",
                subject,
                WARN,
                both,
                "give --block-size (the engines' block size) to compare block_size with "
                "blocks_per_chunk",
            )
            continue
        unknown = any(v.startswith(NOT_KNOWN) for v in values)
        if name in _MAYBE_UNKNOWN and (unknown or "auto (the model's)" in values):
            if len(set(values)) > 1:  # cannot be told from the files: said, not judged
                report.add(
                    f"namespace: {name}",
                    subject,
                    WARN,
                    f"not comparable from the files: {both}",
                    "name the model, dtype (or kv-cache-dtype) and block-size in every vLLM "
                    "serve configuration",
                )
                continue
        if name == "hash seed" and unknown:
            report.add(
                f"namespace: {name}",
                subject,
                WARN,
                f"not known: {both}",
                "give --hash-seed once per file (unset for none)",
            )
            continue
        if name == "cache_salt":
            # compared by value, shown as set or empty only: a salt is guessable from its words
            salts = [i.config.cache_salt for i in usable if i.config is not None]
            compared = set(salts)
            if len(compared) > 1 and all(salts):
                both = "all set, to different values"
        else:
            # a chunk size is compared in tokens whichever key gave it
            compared = {v.split(" (")[0] if name == "chunk size" else v for v in values}
        if len(compared) == 1:
            shown = values[0] if len(set(values)) == 1 else both
            report.add(f"namespace: {name}", subject, OK, f"the same: {shown}")
            continue
        # the hash seed is no namespace field: it changes every chunk's key instead
        what = "chunk keys" if name == "hash seed" else "namespaces"
        report.add(
            f"namespace: {name}",
            subject,
            FAIL,
            f"differs, so the {what} differ and nothing is shared: " + both,
            _FIXES[name],
        )
    _integrity_findings(usable, report)


def _storage_place(spec: TierSpec) -> str | None:
    """Where a shared tier stores its chunks, as the instances name it: an fs root (its real
    path here) or an obj ``endpoint s3://bucket/prefix``; None for another tier."""
    from kvoffload.tiers.fs import FsTierConfig
    from kvoffload.tiers.obj import ObjTierConfig

    c = spec.config
    if isinstance(c, FsTierConfig) and c.root_dir:
        return os.path.realpath(c.root_dir)
    if isinstance(c, ObjTierConfig):
        return f"{c.endpoint_override or 'AWS S3'} s3://{c.bucket}/{c.prefix}"
    return None


def _integrity_key_id(env: str) -> str | None:
    """The integrity key id (:func:`kvoffload.namespace.for_integrity_key`, safe to print) of the
    key in ``env`` in this environment; None where it is not set here (or not a usable key)."""
    from kvoffload.namespace import KeyedNamespace, Namespace, for_integrity_key

    probe = Namespace(model="", kv_dtype="", layout="", tokens_per_chunk=1, row_bytes=1)
    try:
        keyed = for_integrity_key(probe, env)
    except ValueError:
        return None
    return keyed.integrity_key_id if isinstance(keyed, KeyedNamespace) else None


def _integrity_findings(usable: list[Instance], report: Report) -> None:
    """The integrity key of each place two instances store in (paired by place, not by tier
    name): keyed and unkeyed, or two keys, are different namespaces (CASES C43). A key is
    compared by its id where this environment holds it; elsewhere it cannot be told from here."""
    places: dict[str, list[tuple[str, str | None]]] = {}  # place -> [(label, env or None)]
    for inst in usable:
        assert inst.config is not None
        for spec in inst.config.secondary_tiers:
            place = _storage_place(spec)
            if place is not None:
                env = getattr(spec.config, "integrity_key_env", None)
                places.setdefault(place, []).append((inst.label, env))
    for place, users in places.items():
        if len({label for label, _ in users}) < 2:
            continue
        subject = f"{place}: " + " vs ".join(label for label, _ in users)
        ids = [(label, env, _integrity_key_id(env) if env else None) for label, env in users]
        words = "; ".join(
            f"{label}: "
            + (
                "none"
                if env is None
                else f"${env}, key id {kid}"
                if kid
                else f"${env} (not set here)"
            )
            for label, env, kid in ids
        )
        keyed = {env is not None for _, env, _ in ids}
        if len(keyed) > 1:
            status, found = FAIL, "keyed and unkeyed: different namespaces, nothing shared"
        elif keyed == {False}:
            status, found = OK, "the same: no key"
        elif any(kid is None for _, _, kid in ids):
            status, found = WARN, "cannot be compared from here (a key is not in this environment)"
        elif len({kid for _, _, kid in ids}) > 1:
            status, found = FAIL, "different keys: different namespaces, nothing shared"
        else:
            status, found = OK, "the same key"
        fix = {
            OK: "",
            WARN: "run the doctor with the keys' variables set as on the servers",
            FAIL: "give the tier the same integrity key on every instance (integrity_key_env "
            "naming a variable that holds it), or none on all",
        }[status]
        report.add("namespace: integrity key", subject, status, f"{found} ({words})", fix)


# -- shared storage --------------------------------------------------------------------------------


def _storage_findings(instances: list[Instance], report: Report) -> None:
    from kvoffload.tiers.fs import FsTierConfig

    # kind -> place -> the instances storing there; kind -> every instance with such a tier
    places: dict[str, dict[str, list[Instance]]] = {"fs root": {}, "obj bucket": {}}
    users: dict[str, list[str]] = {"fs root": [], "obj bucket": []}
    for inst in instances:
        if inst.config is None:
            continue
        for spec in inst.config.secondary_tiers:
            place = _storage_place(spec)
            if place is None:
                continue
            kind = "fs root" if isinstance(spec.config, FsTierConfig) else "obj bucket"
            places[kind].setdefault(place, []).append(inst)
            users[kind].append(inst.label)
            if kind == "fs root" and inst.here:  # another machine's disk is not this one's
                _fs_root_findings(inst.label, spec, spec.config, place, report)
    for kind in places:
        if len(set(users[kind])) < 2:
            continue
        for place, insts in places[kind].items():
            labels = sorted({i.label for i in insts})
            others = sorted(set(users[kind]) - set(labels))
            if len(labels) > 1 and kind == "fs root" and not all(i.here for i in insts):
                report.add(
                    f"shared {kind}",
                    place,
                    WARN,
                    f"named by {', '.join(labels)}: one root only if it is the same "
                    "filesystem on each host (a network filesystem mounted there); a local "
                    "disk's path on two hosts is two roots that share nothing",
                    "mount the same shared filesystem at this path on every host (or give "
                    "--same-host if the instances run on this machine)",
                )
            elif len(labels) > 1:
                report.add(
                    f"shared {kind}",
                    place,
                    OK,
                    f"used by {', '.join(labels)}: they share its chunks when their "
                    "namespaces match (see namespace rows)",
                )
            if others:
                report.add(
                    f"shared {kind}",
                    place,
                    WARN,
                    f"used by {', '.join(labels)} only, not by {', '.join(others)}: "
                    "they share nothing through it (unless it is the same storage under "
                    "another name)",
                    f"point every instance meant to share at the same {kind}",
                )
    for root, insts in places["fs root"].items():
        if any(i.here for i in insts):
            _root_namespaces(root, report)


def _fs_root_findings(label: str, spec: TierSpec, c: Any, root: str, report: Report) -> None:
    """A root on tmpfs or ramfs, and ``max_bytes`` against the disk's size and free space."""
    import psutil

    from kvoffload.tools.tier_inspect import format_bytes

    subject = f"{label}: {_tier_label(spec)} {c.root_dir}"
    probe = root
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    mounts = [p for p in psutil.disk_partitions(all=True) if _under(probe, p.mountpoint)]
    if mounts:
        mount = max(mounts, key=lambda p: len(p.mountpoint))
        if mount.fstype in ("tmpfs", "ramfs"):
            report.add(
                "fs root storage",
                subject,
                WARN,
                f"on {mount.fstype} ({mount.mountpoint}): the chunks live in memory (competing "
                "with the host arenas in /dev/shm) and are gone at reboot",
                "put root_dir on a disk (NVMe) or a shared filesystem",
            )
    if isinstance(c.max_bytes, int):
        try:
            st = os.statvfs(probe)
        except OSError:
            return
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        floor = int(c.min_free_fraction * size)
        room = max(0, free - floor)
        if c.max_bytes > room:
            report.add(
                "fs root headroom",
                subject,
                WARN,
                f"max_bytes {format_bytes(c.max_bytes)} but {format_bytes(free)} free now "
                f"({format_bytes(room)} above the free-space floor): the tier stops at the "
                "floor before its cap",
                "free space there, or lower max_bytes",
            )
        else:
            report.add(
                "fs root headroom",
                subject,
                OK,
                f"max_bytes {format_bytes(c.max_bytes)} fits {format_bytes(room)} free above "
                "the floor",
            )


def _under(path: str, mountpoint: str) -> bool:
    return path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")


def _root_namespaces(root: str, report: Report) -> None:
    """The namespaces an fs root holds (their ``config.json``), side by side: ids and the fields
    that tell them apart."""
    from kvoffload.tools.tier_inspect import InspectError, namespace_identities

    try:
        found = namespace_identities(root)
    except InspectError:
        return  # missing, or no namespace yet
    known = [ns for ns in found if ns.identity]
    if len(known) < 2:
        if known:
            report.add(
                "namespaces in root", root, OK, f"one: {known[0].id} ({_ns_words(known[0])})"
            )
        return
    keys = list(dict.fromkeys(k for ns in known for k in ns.identity or {}))
    differ = [k for k in keys if len({json.dumps((ns.identity or {}).get(k)) for ns in known}) > 1]
    sides = "; ".join(
        f"{ns.id}: " + ", ".join(f"{k}={_ns_value(ns, k)}" for k in differ) for ns in known
    )
    report.add(
        "namespaces in root",
        root,
        WARN,
        f"{len(known)} namespaces, which share no chunk; they differ in {', '.join(differ)} "
        f"({sides})",
        "instances meant to share must agree on those fields (an old namespace from an earlier "
        "model or setting is harmless: `kvoffload inspect` shows its age)",
    )


def _ns_value(ns: Any, key: str) -> str:
    """A field of a namespace's ``config.json`` as the table shows it: a salt only as ``set``
    or ``empty`` (it is a secret of the instances that chose it)."""
    value = (ns.identity or {}).get(key)
    if key == "cache_salt":
        return "set" if value else "empty"
    return json.dumps(value)


def _ns_words(ns: Any) -> str:
    ident = ns.identity or {}
    return (
        f"model {ident.get('model')}, {ident.get('kv_dtype')}, {ident.get('layout')}, "
        f"{ident.get('tokens_per_chunk')} tokens per chunk, {ident.get('row_bytes')} bytes per "
        f"row, cache_salt {_ns_value(ns, 'cache_salt')}"
    )


# -- peers -----------------------------------------------------------------------------------------


class _NoDataPlane:
    """The doctor's side of a p2p session: no transport, no slots (a probe moves no bytes).
    Implements :class:`kvoffload.tiers.p2p.client.Transfers`; a Welcome's descriptor is taken
    and never used."""

    descriptor = b""
    row_bytes = 0

    def acquire_peer(self, descriptor: bytes, token: bytes) -> str:
        return "doctor"

    def release_peer(self, name: str) -> None:
        pass

    def read(self, *args: Any, **kwargs: Any) -> int:
        raise ValueError("kvoffload doctor reads no chunk")

    def add_session(self, token: bytes) -> None:
        pass

    def drop_session(self, token: bytes) -> None:
        pass

    def grant(self, *args: Any, **kwargs: Any) -> int:
        raise ValueError("kvoffload doctor grants no slot")

    def revoke(self, gid: int) -> None:
        pass


PLACEHOLDER_NAMESPACE = "kvoffload-doctor-probe"
ZMTP_GREETING_BYTES = 64
"""A ZMTP 3 greeting: signature (10), version (2), mechanism (20, NUL-padded), as-server (1),
filler (31) (ZMQ RFC 23)."""


class PeerProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`probe_peer` found.

    Attributes:
        outcome: ``up`` (authenticated), ``refused_<reason>`` (the peer answered, so CurveZMQ
            passed, and refused: ``refused_namespace``...), ``bad_mac`` (its MACs do not prove
            our secret), ``curve_failed`` (the CurveZMQ handshake failed: another secret),
            ``not_curve`` (the peer speaks ZMQ without CurveZMQ: ``auth: none``, or a ZMQ socket
            that is no p2p port), ``not_zmtp`` (it breaks ZMQ's protocol: no ZMQ socket),
            ``auth_refused`` (a ZAP handler refused us), ``no_answer``, ``unreachable`` (no TCP
            connection), ``bad_address`` (ZMQ cannot dial it: ``*``), or another
            :data:`~kvoffload.tiers.p2p.client.HANDSHAKE_FAILURES` reason.
        detail: what was seen, in words.
    """

    outcome: str
    detail: str


def probe_peer(addr: str, secret: bytes, namespace_id: str | None, timeout_s: float) -> PeerProbe:
    """Open a p2p session with the peer at ``addr`` as the tier's client does
    (:class:`~kvoffload.tiers.p2p.client.PeerClient` over :func:`~kvoffload.tiers.p2p.node.open_dealer`),
    then drop it (the peer holds it until its ``peer_timeout_s``: the protocol has no Close).

    Args:
        addr: ``host:port``.
        secret: the shared secret (bytes; empty: ``auth: none``, no CurveZMQ).
        namespace_id: the namespace the Hello names; None: a placeholder the peer refuses.
        timeout_s: the limit of the TCP connect and of the handshake, each (seconds).
    """
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from kvoffload.ipc import peer_messages as pm
    from kvoffload.tiers.p2p.client import Close, Open, PeerClient, Send
    from kvoffload.tiers.p2p.commands import Connect
    from kvoffload.tiers.p2p.config import parse_peer
    from kvoffload.tiers.p2p.node import open_dealer

    host, port = parse_peer(addr, "peer")
    why = config_check.tcp_unreachable(host, port, timeout_s)
    if why is not None:
        return PeerProbe(outcome="unreachable", detail=f"no TCP connection ({why})")
    client = PeerClient(
        transfers=_NoDataPlane(),
        incarnation=os.urandom(pm.INCARNATION_BYTES),
        namespace_id=namespace_id or PLACEHOLDER_NAMESPACE,
        secret=secret,
        heartbeat_s=timeout_s / 2,
        peer_timeout_s=timeout_s,
        transfer_deadline_s=timeout_s,
        lease_ttl_s=timeout_s,
        advertise=f"kvoffload-doctor-{os.urandom(4).hex()}:0",
        static_peers=[addr],
    )
    curve = pm.curve_keypair(secret) if secret else None
    # the client role logs each session's fate for an engine's log; the doctor's table says it
    p2p_log = logging.getLogger("kvoffload.p2p")
    level = p2p_log.level
    p2p_log.setLevel(logging.CRITICAL)
    ctx = zmq.Context()
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    shook_hands = False  # the monitor saw the ZMQ handshake succeed
    try:
        pending = client.commands([Connect(addr)], time.monotonic())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for out in pending:
                if isinstance(out, Open) and sock is None:

                    def watch(s: zmq.Socket) -> None:
                        # before the connect: ZMQ does not try a failed handshake again, so a
                        # monitor attached after it would never hear of it
                        nonlocal monitor
                        monitor = s.get_monitor_socket(
                            zmq.EVENT_HANDSHAKE_SUCCEEDED
                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                        )

                    try:
                        sock = open_dealer(ctx, out, curve, before_connect=watch)
                    except zmq.ZMQError as e:
                        return PeerProbe(
                            outcome="bad_address",
                            detail=f"not an address ZMQ can dial (tcp://{out.host}:{out.port}: "
                            f"{e.strerror})",
                        )
                elif isinstance(out, Send) and sock is not None:
                    try:
                        sock.send(out.frame, zmq.NOBLOCK)
                    except zmq.Again:
                        # no connection to queue it on (the peer dropped ours): as the node
                        # does, the frame is dropped; the events or the greeting say why
                        pass
                elif isinstance(out, Close):
                    failed = {k: v for k, v in client.handshake_failures.items() if v}
                    reason = next(iter(failed), "closed")
                    return PeerProbe(outcome=reason, detail=reason)
            if client.peers_up():
                return PeerProbe(outcome="up", detail="authenticated")
            pending = []
            if sock is None:
                break
            while monitor is not None and monitor.poll(0):
                failed_how = _handshake_failure(recv_monitor_message(monitor))
                if failed_how is None:
                    shook_hands = True
                    continue
                if curve is None and failed_how.outcome in ("not_curve", "curve_failed"):
                    # the probe speaks NULL (auth: none): a mismatch is the peer's mechanism
                    return _dropped_handshake(host, port, timeout_s, curve=False)
                if failed_how.outcome != "curve_failed":
                    return failed_how
                # a connection dropped in the handshake: a server of another key drops it, and
                # so may a peer without CurveZMQ before its greeting was read: its greeting says
                return _dropped_handshake(host, port, timeout_s)
            if sock.poll(20):
                pending = client.on_frame(addr, sock.recv(), time.monotonic())
            else:
                pending = client.tick(time.monotonic())
        if sock is not None and not shook_hands:
            # no monitor event (libzmq reports none for bytes that are not ZMTP, nor for a
            # handshake failed before a monitor existed): the peer's greeting says which it is,
            # not a peer too busy to answer. Without CurveZMQ (auth: none) the probe speaks NULL
            # itself: a NULL peer that does not answer is busy
            mechanism = zmtp_mechanism(host, port, timeout_s)
            if mechanism == NOT_ZMTP:
                return _no_greeting(mechanism)
            if curve is None and mechanism not in (None, "NULL"):
                return _mechanism_of_null_peer(mechanism)
            if curve is not None and mechanism not in (None, "CURVE"):
                return _not_curve(mechanism)
        return PeerProbe(outcome="no_answer", detail=f"no answer to Hello within {timeout_s:g} s")
    finally:
        if sock is not None and monitor is not None:
            sock.disable_monitor()
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        p2p_log.setLevel(level)


NOT_ZMTP = ""
"""What :func:`zmtp_mechanism` answers for a peer that sent bytes which are no ZMTP 3 greeting."""


def zmtp_mechanism(host: str, port: int, timeout_s: float) -> str | None:
    """The security mechanism a ZMQ peer's greeting names (``CURVE``, ``NULL``, ``PLAIN``), read
    over a plain TCP connection that sends only the start of a greeting (signature and major
    version: the peer answers with its whole greeting and waits for the rest, so it has judged
    nothing yet); :data:`NOT_ZMTP` when it sent bytes that are no ZMTP 3 greeting; None when it
    sent nothing within ``timeout_s`` seconds (or the connection failed)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03")
            got = b""
            deadline = time.monotonic() + timeout_s
            while len(got) < ZMTP_GREETING_BYTES and time.monotonic() < deadline:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = s.recv(ZMTP_GREETING_BYTES - len(got))
                if not chunk:
                    break
                got += chunk
                if got[0] != 0xFF or (len(got) > 9 and got[9] != 0x7F):
                    break  # no ZMTP signature: nothing more to wait for
    except OSError:
        pass
    if not got:
        return None
    if len(got) < ZMTP_GREETING_BYTES or got[0] != 0xFF or got[9] != 0x7F or got[10] < 3:
        return NOT_ZMTP
    return got[12:32].rstrip(b"\0").decode("ascii", "replace")


def _dropped_handshake(host: str, port: int, timeout_s: float, curve: bool = True) -> PeerProbe:
    """Why a peer dropped the probe's handshake (a CurveZMQ one unless ``curve`` is False: the
    probe of an ``auth: none`` tier speaks NULL), from the mechanism its greeting names."""
    mechanism = zmtp_mechanism(host, port, timeout_s)
    if mechanism is None or mechanism == NOT_ZMTP:
        return _no_greeting(mechanism)
    if not curve:
        return _mechanism_of_null_peer(mechanism)
    if mechanism == "CURVE":
        return PeerProbe(
            outcome="curve_failed", detail="the CurveZMQ handshake failed (the peer dropped it)"
        )
    return _not_curve(mechanism)


def _no_greeting(mechanism: str | None) -> PeerProbe:
    """A peer whose answer is no ZMTP greeting (``NOT_ZMTP``) or nothing (None)."""
    if mechanism == NOT_ZMTP:
        return PeerProbe(
            outcome="not_zmtp", detail="it answers with bytes that are no ZMQ greeting"
        )
    return PeerProbe(outcome="not_zmtp", detail="it sends no ZMQ greeting")


def _mechanism_of_null_peer(mechanism: str) -> PeerProbe:
    """What a peer greeting with ``mechanism`` is to a probe without CurveZMQ (``auth: none``)."""
    if mechanism == "CURVE":
        return PeerProbe(
            outcome="needs_curve",
            detail="it requires CurveZMQ (a peer with auth: secret) and this instance has "
            "auth: none",
        )
    if mechanism == "NULL":
        return PeerProbe(outcome="no_answer", detail="no answer to Hello")
    return PeerProbe(
        outcome="not_zmtp",
        detail=f"it speaks ZMQ with mechanism {mechanism}: not a kvoffload p2p port",
    )


def _not_curve(mechanism: str) -> PeerProbe:
    """A peer whose ZMTP greeting names ``mechanism``, not ``CURVE``."""
    return PeerProbe(
        outcome="not_curve",
        detail=f"it speaks ZMQ without CurveZMQ (mechanism {mechanism}: a peer with auth none, "
        "or a ZMQ socket that is not a p2p port)",
    )


def _handshake_failure(event: Any) -> PeerProbe | None:
    """What a ZMQ monitor event of the probe's DEALER says of the peer; None for a success.

    ZMQ reports another CurveZMQ secret as ``HANDSHAKE_FAILED_NO_DETAIL`` (the server drops a
    HELLO it cannot open), a peer without CurveZMQ (``auth: none``, or a plain ZMQ socket) as
    ``HANDSHAKE_FAILED_PROTOCOL`` with ``ZMTP_MECHANISM_MISMATCH``, bytes that are not ZMTP as
    another protocol error, a ZAP refusal as ``HANDSHAKE_FAILED_AUTH``."""
    import zmq

    kind, value = event["event"], event.get("value")
    if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # a CurveZMQ server drops a HELLO of another key without a word (so does a peer too
        # busy to finish the handshake)
        return PeerProbe(outcome="curve_failed", detail="the CurveZMQ handshake failed")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return PeerProbe(
            outcome="auth_refused", detail=f"its authentication refused us (ZAP status {value})"
        )
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return PeerProbe(
            outcome="not_curve",
            detail="it speaks ZMQ without CurveZMQ (a peer with auth none, or a ZMQ socket "
            "that is not a p2p port)",
        )
    return PeerProbe(
        outcome="not_zmtp", detail=f"it breaks ZMQ's protocol (protocol error {int(value or 0):#x})"
    )


def _p2p_mesh_findings(instances: list[Instance], report: Report) -> None:
    """Between the instances' p2p tiers: each names the others' advertise addresses among its
    ``peers`` (or ``peer_events``), and all use the same ``auth``."""
    from kvoffload.tiers.p2p import P2PTierConfig

    tiers = []  # (label, config, advertise address or None)
    for inst in instances:
        for spec in inst.config.secondary_tiers if inst.config is not None else ():
            c = spec.config
            if isinstance(c, P2PTierConfig):
                host = c.advertise_host or c.host
                addr = f"{host}:{c.port}" if c.port and host not in ("0.0.0.0", "::") else None
                tiers.append((inst.label, c, addr))
    if len(tiers) < 2:
        return
    auths = {c.auth for _, c, _ in tiers}
    if len(auths) > 1:
        report.add(
            "p2p auth",
            " vs ".join(label for label, _, _ in tiers),
            FAIL,
            "differs: "
            + "; ".join(f"{label}: {c.auth}" for label, c, _ in tiers)
            + " (a CurveZMQ client and a plain server never complete a handshake)",
            "use the same auth (secret) on every instance",
        )
    _p2p_secret_findings([(label, c) for label, c, _ in tiers if c.auth == "secret"], report)
    for label, c, _ in tiers:
        named = set(c.peers) | set(c.peer_events)
        for other, _, addr in tiers:
            if other == label or addr is None:
                continue
            if addr in named:
                report.add("p2p peers named", f"{label} -> {other}", OK, f"names {addr}")
            else:
                report.add(
                    "p2p peers named",
                    f"{label} -> {other}",
                    WARN,
                    f"{other} advertises {addr}, which {label}'s p2p tier does not name in peers "
                    "or peer_events: it asks that instance only when a request names it",
                    f"add {addr!r} to peers",
                )


def _p2p_secret_findings(tiers: list[tuple[str, Any]], report: Report) -> None:
    """The p2p secrets the files write (``secret``), compared by the CurveZMQ public key each
    derives (:func:`kvoffload.ipc.peer_messages.curve_keypair`: public, and the secret cannot be
    told from it); a tier reading ``secret_env`` holds its server's environment's, not known
    here."""
    from kvoffload.ipc import peer_messages as pm

    given = [(label, c) for label, c in tiers if c.secret]
    if len(given) < 2:
        return
    keys = [(label, pm.curve_keypair(c.secret.encode())[0].decode()) for label, c in given]
    subject = " vs ".join(label for label, _ in keys)
    words = "; ".join(f"{label}: public key {key[:8]}..." for label, key in keys)
    if len({key for _, key in keys}) == 1:
        report.add("p2p secret", subject, OK, f"the same secret in the files ({words})")
    else:
        report.add(
            "p2p secret",
            subject,
            FAIL,
            f"the files give different secrets ({words}): no handshake between them completes",
            "give every instance the same secret (better: in KVOFFLOAD_P2P_SECRET, not the file)",
        )


def _peer_findings(inst: Instance, report: Report, options: Options) -> None:
    from kvoffload.tiers.p2p import P2PTierConfig

    assert inst.config is not None
    for spec in inst.config.secondary_tiers:
        c = spec.config
        if not isinstance(c, P2PTierConfig) or not c.peers:
            continue
        shared = c.shared_secret()
        secret = shared.encode() if shared is not None else None
        for peer in c.peers:
            subject = f"{inst.label}: {_tier_label(spec)} -> {peer}"
            host = peer.rpartition(":")[0]
            if not inst.here and config_check.bind_reach(f"tcp://{host}:1") is None:
                # that file's loopback is its own machine's, not this one's
                report.add(
                    "p2p peer",
                    subject,
                    OK,
                    "not probed: a loopback address of another machine (give --same-host if "
                    "the instance runs here)",
                )
                continue
            if secret is None:
                report.add(
                    "p2p peer",
                    subject,
                    WARN,
                    f"not probed: no secret here ({c.secret_env} is unset and the config "
                    "gives none)",
                    f"run the doctor with {c.secret_env} set as on the server",
                )
                continue
            got = probe_peer(peer, secret, options.namespace_id, options.timeout_s)
            _peer_finding(got, subject, c, options, report)


#: The fix for each way a probe's handshake fails besides a wrong secret, an unreachable or a
#: silent peer (the peer's refusals are :data:`kvoffload.tiers.p2p.server.REFUSALS`).
_HANDSHAKE_FIXES = {
    "refused_version": "run the same kvoffload release on both",
    "version": "run the same kvoffload release on both",
    "refused_misrouted": "dial the address the peer advertises (its advertise_host:port)",
    "refused_identity_collision": "give each instance its own advertise address",
    "refused_reflection": "the address is this instance itself: name the other instances",
    "reflection": "the address is this instance itself: name the other instances",
    "refused_handshake_busy": "the peer is taking many handshakes at once (max_handshakes, "
    "max_handshakes_per_source): run again",
    "refused_busy": "the peer holds as many sessions as it takes (64): run again after its "
    "peer_timeout_s",
    "refused_not_ready": "the peer is starting: run again when it serves",
    "auth_refused": "add this host to the peer's allowed_peers",
    "needs_curve": "give every instance the same auth setting (auth: secret with the same "
    "secret, or auth: none on all)",
    "bad_address": "give the peer's concrete host:port (not *), as it advertises it",
}


def _peer_finding(got: PeerProbe, subject: str, c: Any, options: Options, report: Report) -> None:
    outcome = got.outcome
    same_secret = (
        f"give every instance the same secret ({c.secret_env}, or secret), "
        "and the same auth setting"
    )
    if outcome == "up":
        report.add(
            "p2p peer",
            subject,
            OK,
            "reachable; authenticated (CurveZMQ and the handshake's MACs prove the same secret); "
            f"it serves namespace {options.namespace_id}",
        )
    elif outcome == "refused_namespace" and options.namespace_id is None:
        report.add(
            "p2p peer",
            subject,
            OK,
            "reachable; the secret is the same (CurveZMQ passed, the peer answered); its "
            "namespace not compared",
            "give --namespace-id (the engine logs it at start) to check that it serves yours",
        )
    elif outcome == "refused_namespace":
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"reachable and the secret is the same, but it serves another namespace than "
            f"{options.namespace_id}: the two share nothing",
            "see the namespace rows: model, dtype, chunk size, layout, cache_salt and hash "
            "seed must match (compare its start log's namespace line)",
        )
    elif outcome in ("curve_failed", "bad_mac"):
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"auth failure: reachable, but {got.detail}: the peer's shared secret is not "
            "this instance's",
            same_secret,
        )
    elif outcome == "not_curve":
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"reachable, but {got.detail}",
            "check that the address is the peer's p2p port; if it is, " + same_secret,
        )
    elif outcome == "bad_address":
        report.add("p2p peer", subject, FAIL, got.detail, _HANDSHAKE_FIXES[outcome])
    elif outcome == "unreachable":
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"unreachable: {got.detail}",
            "start the peer, or fix the address (its host:port, advertise_host), or the network "
            "between them",
        )
    elif outcome in ("no_answer", "not_zmtp"):
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"a TCP connection, then {got.detail}: not a kvoffload p2p port, or it is overloaded",
            "check that the address is the peer's p2p port (host, port)",
        )
    else:
        report.add(
            "p2p peer",
            subject,
            FAIL,
            f"the handshake failed: {got.detail}",
            _HANDSHAKE_FIXES.get(
                outcome,
                "compare the peer's log (it names each refusal) and run the same kvoffload "
                "release on both",
            ),
        )


# -- events ----------------------------------------------------------------------------------------


MAX_EVENT_MESSAGE_BYTES = 16 << 20
"""The largest KV-events message the doctor's sockets take (bytes; ZMQ drops the connection on a
larger one): a step's batch is KiBs, and a publisher flooding huge messages costs no more."""
REPLAY_BATCHES = 256
"""The most replayed batches read from a replay socket (each names a topic)."""


def events_endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a KV-events endpoint to subscribe to (``--events``): None for
    ``tcp://HOST:PORT`` (a concrete host, a port 1-65535) or ``ipc://PATH``."""
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        return f"{endpoint!r}: not tcp://HOST:PORT or ipc://PATH (the transport is missing)"
    if transport == "ipc":
        return None if rest else f"{endpoint!r}: ipc:// needs the socket's path"
    if transport != "tcp":
        return f"{endpoint!r}: the {transport} transport: give tcp://HOST:PORT or ipc://PATH"
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{endpoint!r}: not tcp://HOST:PORT (port 1-65535)"
    if config_check.bind_reach(endpoint) == "all interfaces":
        return f"{endpoint!r}: {host} binds all interfaces; a subscriber needs the host's address"
    return None


def _events_target(endpoint: str, here: bool) -> tuple[str | None, str]:
    """Where a subscriber reaches a bound ZMQ ``endpoint`` of an instance (``here``: of this
    machine), or None and why not."""
    transport, _, rest = endpoint.partition("://")
    if transport == "inproc":
        return None, "inproc:// is inside the engine's process: no other process subscribes"
    if transport == "ipc" and not here:
        return None, "an ipc:// socket of another machine"
    if transport == "ipc":
        return (endpoint, "") if os.path.exists(rest) else (None, f"no socket file at {rest}")
    port = rest.rpartition(":")[2]
    reach = config_check.bind_reach(endpoint)
    if transport != "tcp":
        return None, f"the {transport} transport: not reached"
    if reach == "all interfaces" or port == "0":
        return None, "bound to all interfaces or port 0 (picked at start); give --events " + (
            "tcp://HOST:PORT"
        )
    if reach is None and not here:
        return None, "a loopback address of another machine (give --same-host if it runs here)"
    return endpoint, ""


def _events_findings(instances: list[Instance], report: Report, options: Options) -> None:
    from kvoffload.config import KVEventsConfig

    # (subject, endpoint, replay endpoint, the instance's events settings: its topics)
    targets: list[tuple[str, str, str | None, KVEventsConfig]] = []
    for inst in instances:
        ev = inst.config.kv_events if inst.config is not None else None
        if ev is None:
            continue
        where, why = _events_target(ev.endpoint, inst.here)
        if where is None:
            report.add(
                "KV events",
                f"{inst.label}: {ev.endpoint}",
                WARN,
                f"not reached: {why}",
                "give --events with an address a subscriber reaches, to check it",
            )
            continue
        replay = _events_target(ev.replay_endpoint, inst.here)[0] if ev.replay_endpoint else None
        targets.append((inst.label, where, replay, ev))
    first = instances[0].config if instances and instances[0].config is not None else None
    expected = first.kv_events if first is not None and first.kv_events else KVEventsConfig()
    for endpoint in options.events:
        targets.append(("--events", endpoint, None, expected))
    for label, endpoint, replay, ev in targets:
        _events_finding(f"{label}: {endpoint}", endpoint, replay, ev, report, options)


def _listens(endpoint: str, timeout_s: float) -> str | None:
    """Why nothing listens at an endpoint; None when something does (a ``tcp://`` one takes a
    TCP connection, an ``ipc://`` one is a socket file)."""
    transport, _, rest = endpoint.partition("://")
    if transport == "ipc":
        return None if os.path.exists(rest) else f"no socket file at {rest}"
    host, _, port = rest.rpartition(":")
    return config_check.tcp_unreachable(host.strip("[]"), int(port), timeout_s)


def _event_socket(ctx: Any, kind: int) -> Any:
    import zmq

    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_MESSAGE_BYTES)
    s.setsockopt(zmq.RCVHWM, 64)
    return s


def _events_finding(
    subject: str, endpoint: str, replay: str | None, ev: Any, report: Report, options: Options
) -> None:
    import zmq

    topic = ev.topic
    why = _listens(endpoint, options.timeout_s)
    if why is not None:
        report.add(
            "KV events",
            subject,
            FAIL,
            f"nothing listens there ({why})",
            "start the instance with kv_events, or subscribe where it binds",
        )
        return
    ctx = zmq.Context()
    frames = None
    try:
        if replay is not None:
            _replay_finding(ctx, subject, replay, topic, report, options)
        sub = _event_socket(ctx, zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            got = sub.poll(int(options.events_wait_s * 1000))
            frames = sub.recv_multipart() if got else None
            now = time.time()
        except zmq.ZMQError as e:
            report.add(
                "KV events",
                subject,
                FAIL,
                f"cannot subscribe: {e.strerror}",
                "give an endpoint ZMQ can connect to (tcp://HOST:PORT, ipc://PATH)",
            )
            return
        finally:
            sub.close(linger=0)
    finally:
        ctx.term()
    if frames is None:
        if replay is None:
            report.add(
                "KV events",
                subject,
                WARN,
                f"subscribed; no batch within {options.events_wait_s:g} s (an idle engine "
                "publishes nothing), so the topic is not confirmed",
                "send a request and run again, or give the instance a replay_endpoint",
            )
        else:
            report.add(
                "KV events",
                subject,
                WARN,
                f"subscribed; no batch within {options.events_wait_s:g} s (an idle engine "
                "publishes nothing): the replay row says which topic it publishes",
                "send a request and run again to see a subscriber receive it",
            )
        return
    seen = frames[0].decode(errors="replace")
    is_batch, ts = _batch_ts(frames)
    if not is_batch:
        report.add(
            "KV events",
            subject,
            FAIL,
            f"a message that is no KV event batch ({len(frames)} frame(s), topic {seen!r})",
            "check that the endpoint is the instance's kv_events endpoint",
        )
        return
    if seen in (topic, ev.movements_topic):
        report.add("KV events", subject, OK, f"a subscriber receives batches (topic {seen!r})")
    else:
        report.add(
            "KV events",
            subject,
            FAIL,
            f"it publishes topic {seen!r}, a subscriber expects {topic!r} (or the movements "
            f"topic {ev.movements_topic!r})",
            "give subscribers the publisher's topic (kv_events.topic)",
        )
    if ts is None:
        report.add(
            "clock skew",
            subject + " (an event batch's ts)",
            WARN,
            "its ts is no believable time (not finite, or outside 2001-2286)",
            "check the publisher's clock",
        )
    else:
        _skew_finding(subject + " (an event batch's ts)", ts - now, 0.0, report)


def _replay_finding(
    ctx: Any, subject: str, replay: str, topic: str, report: Report, options: Options
) -> None:
    """Ask the replay socket for the expected topic's batches, and for the engine topic's (whose
    frames name the topic the publisher actually uses); each ask within one ``timeout_s``."""
    import zmq

    from kvoffload.events import END_SEQ

    def ask(*request: bytes, until: bytes | None = None) -> list[bytes] | None:
        """The topics of the batches answered (up to the first of ``until``, at most
        :data:`REPLAY_BATCHES`); None: no answer, or not the replay protocol."""
        d = _event_socket(ctx, zmq.DEALER)
        try:
            d.connect(replay)
            d.send_multipart((b"", *request))
            topics: list[bytes] = []
            deadline = time.monotonic() + options.timeout_s
            while len(topics) < REPLAY_BATCHES:
                left = deadline - time.monotonic()
                if left <= 0 or not d.poll(max(1, int(left * 1000))):
                    return topics or None
                frames = d.recv_multipart()
                if len(frames) != 4:
                    return None
                if frames[2] == END_SEQ:
                    return topics
                topics.append(frames[1])
                if frames[1] == until:
                    break
            return topics
        except zmq.ZMQError:
            return None
        finally:
            d.close(linger=0)

    zero = (0).to_bytes(8, "big")
    mine = ask(zero, topic.encode(), until=topic.encode())
    if mine is None:
        report.add(
            "KV events replay",
            f"{subject} (replay {replay})",
            FAIL,
            f"no answer of the replay protocol within {options.timeout_s:g} s",
            "check replay_endpoint",
        )
        return
    if topic.encode() in mine:
        report.add(
            "KV events replay",
            f"{subject} (replay {replay})",
            OK,
            f"answers batches of topic {topic!r}",
        )
        return
    theirs = ask(zero) or []
    named = sorted({t.decode(errors="replace") for t in theirs})
    report.add(
        "KV events replay",
        f"{subject} (replay {replay})",
        FAIL,
        f"no batch of topic {topic!r}"
        + (f"; the publisher's topic is {', '.join(named)}" if named else ""),
        "give subscribers the publisher's topic (kv_events.topic)",
    )


SANE_TS = (1e9, 1e10)
"""The span of a believable event timestamp (seconds since the epoch: 2001 to 2286)."""


def _batch_ts(frames: list[bytes]) -> tuple[bool, float | None]:
    """Whether a KV-events message ``(topic, seq, payload)`` carries an event batch
    (:class:`kvoffload.events.KVEventBatch` or :class:`~kvoffload.events.MovementBatch`), and
    its ``ts`` where that is a believable time (:data:`SANE_TS`; None: not, or no batch)."""
    from kvoffload.events import KVEventBatch, MovementBatch

    if len(frames) != 3 or len(frames[1]) != 8:
        return False, None
    kinds: tuple[type[KVEventBatch] | type[MovementBatch], ...] = (KVEventBatch, MovementBatch)
    for kind in kinds:
        try:
            ts = msgspec.msgpack.decode(frames[2], type=kind).ts
        except msgspec.DecodeError:
            continue
        return True, (ts if math.isfinite(ts) and SANE_TS[0] < ts < SANE_TS[1] else None)
    return False, None


# -- metrics and clocks ----------------------------------------------------------------------------


MAX_METRICS_BYTES = 16 << 20
"""The most of a metrics body read (bytes): kvoffload's metrics appear in its first KiBs."""


def metrics_url_problem(url: str) -> str | None:
    """What is wrong with a ``--metrics`` endpoint (``HOST:PORT``, an http or https URL)."""
    from kvoffload.tools.top.feed import normalize_metrics_url

    scheme = normalize_metrics_url(url).partition("://")[0].lower()
    if scheme not in ("http", "https"):
        return f"{url!r}: the {scheme} scheme: give HOST:PORT or an http(s):// URL"
    return None


def _read_metrics(resp: Any, deadline: float) -> bytes:
    """The start of a metrics body: up to the first ``kvoffload_`` sample name, the end, the
    deadline (``time.monotonic()``) or :data:`MAX_METRICS_BYTES`, whichever comes first (each
    read waits at most the connection's timeout)."""
    body = b""
    while len(body) < MAX_METRICS_BYTES and time.monotonic() < deadline:
        chunk = resp.read1(65536)
        if not chunk:
            break
        body += chunk
        if b"kvoffload_" in body:
            break
    return body


def _metrics_finding(url: str, report: Report, options: Options) -> None:
    from kvoffload.tools.top.feed import normalize_metrics_url

    full = normalize_metrics_url(url)
    sent = time.time()
    try:
        with urllib.request.urlopen(full, timeout=options.timeout_s) as resp:
            date = resp.headers.get("Date")
            back = time.time()
            body = _read_metrics(resp, time.monotonic() + options.timeout_s)
    except urllib.error.HTTPError as e:
        report.add(
            "metrics",
            full,
            FAIL,
            f"answers HTTP {e.code} {e.reason}",
            "check the path (vLLM serves /metrics on its API port)",
        )
        return
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        report.add(
            "metrics",
            full,
            FAIL,
            f"no answer: {getattr(e, 'reason', None) or e}",
            "check the address (vLLM serves /metrics on its API port)",
        )
        return
    if b"kvoffload_" in body:
        report.add("metrics", full, OK, "answers with kvoffload's metrics")
    else:
        report.add(
            "metrics",
            full,
            WARN,
            "answers, without kvoffload's metrics",
            "check that the server runs kvoffload's spec (spec_name KVOffloadSpec)",
        )
    theirs = None
    if date:
        try:
            theirs = parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, OverflowError):
            theirs = None
    if theirs is None:
        report.add(
            "clock skew",
            f"{full} (HTTP Date)",
            WARN,
            f"not measured: the Date header is {'missing' if not date else 'no date'}",
            "compare the host's clock another way (chronyc tracking)",
        )
        return
    # the Date header is whole seconds, taken between our send and the headers' receipt
    _skew_finding(
        f"{full} (HTTP Date)", theirs + 0.5 - (sent + back) / 2, 0.5 + (back - sent) / 2, report
    )


def _skew_finding(subject: str, skew_s: float, uncertainty_s: float, report: Report) -> None:
    if abs(skew_s) - uncertainty_s > CLOCK_SKEW_WARN_S:
        report.add(
            "clock skew",
            subject,
            WARN,
            f"its clock is {skew_s:+.1f} s from ours (± {uncertainty_s:.1f} s)",
            "run NTP (chrony) on every host",
        )
    else:
        report.add(
            "clock skew", subject, OK, f"{skew_s:+.1f} s from ours (± {uncertainty_s:.1f} s)"
        )


def p2p_clock_note(instances: list[Instance]) -> str | None:
    """Why p2p peers' clocks are not compared (None without a p2p tier)."""
    from kvoffload.tiers.p2p import P2PTierConfig

    for inst in instances:
        for spec in inst.config.secondary_tiers if inst.config is not None else ():
            if isinstance(spec.config, P2PTierConfig):
                return (
                    "the p2p protocol carries no time (lease lifetimes are relative, so the "
                    "tier needs no common clock); a peer's clock is compared only through "
                    "--metrics or its KV events"
                )
    return None


# -- output ----------------------------------------------------------------------------------------


def render(report: Report, console: Any) -> None:
    """Print the findings as a rich table: check, subject, status, what was found, the fix."""
    from rich.markup import escape
    from rich.table import Table

    wide = console.is_terminal
    t = Table(title="kvoffload doctor", title_justify="left", expand=wide)
    t.add_column("check", no_wrap=True)
    t.add_column("subject", style="cyan", overflow="fold", ratio=1 if wide else None)
    t.add_column("status", no_wrap=True)
    t.add_column("found", overflow="fold", ratio=3 if wide else None)
    t.add_column("fix", overflow="fold", ratio=2 if wide else None)
    style = {OK: "green", WARN: "yellow", FAIL: "red"}
    for f in report.findings:
        word = f"[{style[f.status]}]{f.status}[/{style[f.status]}]"
        t.add_row(escape(f.check), escape(f.subject), word, escape(f.found), escape(f.fix))
    console.print(t)
    fails = sum(f.status == FAIL for f in report.findings)
    warns = sum(f.status == WARN for f in report.findings)
    console.print(
        f"{len(report.findings)} check(s): {fails} failed, {warns} warning(s)", highlight=False
    )


def to_json(report: Report) -> str:
    """``{"instances", "ok", "findings": [{check, subject, status, found, fix}]}``."""
    doc = {
        "instances": report.instances,
        "ok": not report.failed,
        "findings": msgspec.to_builtins(report.findings),
    }
    return json.dumps(doc)
