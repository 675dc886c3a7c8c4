"""The ``kvoffload`` command.

::

    kvoffload demo     serve a real model with tiered offloading and show that it helps
    kvoffload bench    measurements for BENCHMARKS.md
    kvoffload sweep    remove host arenas of dead engines from /dev/shm (``--list`` to show them)
    kvoffload check    validate a kv_connector_extra_config JSON file and print the resolved config
    kvoffload stress   the tiering manager under generated load and injected faults, loads verified
    kvoffload top      live monitor of a running engine or stress run
"""

from __future__ import annotations

import json
import sys

import click

from kvoffload import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvoffload")
def main() -> None:
    """kvoffload: hierarchical KV-cache offloading for LLM serving (vLLM plug-in and tools)."""


@main.command()
@click.option("--list", "list_only", is_flag=True, help="Show the arenas instead of removing any.")
def sweep(list_only: bool) -> None:
    """Remove host arenas (/dev/shm/kvoffload*) whose owning engine is dead.

    A live engine's arena is never touched: liveness is the owner's lock on the segment, which the
    kernel drops when the owner dies, SIGKILL included.
    """
    from kvoffload.ipc.arena import list_arenas
    from kvoffload.ipc.arena import sweep as do_sweep

    if list_only:
        arenas = list_arenas()
        if not arenas:
            click.echo("no kvoffload arenas in /dev/shm")
        for a in arenas:
            state = "live" if a.owner_alive else "owner dead (sweep removes it)"
            click.echo(f"{a.name}  owner pid {a.owner_pid} ({state})  engine {a.engine_id or '-'}  "
                       f"{a.num_slots} x {a.row_bytes} B  {a.size_bytes / 2**20:.1f} MiB"
                       f"{'' if a.ready else '  (not initialized)'}")
        return
    removed = do_sweep()
    for name in removed:
        click.echo(f"removed {name}")
    click.echo(f"{len(removed)} arena(s) removed")


@main.command()
@click.argument("config_file", type=click.File("r"))
def check(config_file) -> None:
    """Validate CONFIG_FILE (the JSON of kv_connector_extra_config) and print it with defaults."""
    from kvoffload.config import ConfigError, describe, parse_config

    try:
        raw = json.load(config_file)
        cfg = parse_config(raw)
        click.echo(describe(cfg))
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{config_file.name}: not JSON: {e}") from None
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


def _register_tools() -> None:
    from kvoffload.tools.bench import bench
    from kvoffload.tools.demo import demo
    from kvoffload.tools.stress import stress
    from kvoffload.tools.top import top

    for command in (demo, bench, stress, top):
        main.add_command(command)


_register_tools()

if __name__ == "__main__":
    sys.exit(main())
