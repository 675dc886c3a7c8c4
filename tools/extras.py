"""Optional dependencies of the ``kvoffload`` commands, checked before a command starts.

The base install (``pip install kvoffload``) runs ``check``, ``sweep``, ``stress`` and ``top``. ``demo`` and
``bench`` need extras (``setup.cfg``'s ``[options.extras_require]``); when one is missing they exit with
status 2 and name the extra to install, instead of failing on an import deep inside.
"""

from __future__ import annotations

import importlib.util

import click

#: Top-level modules each extra brings, as checked here (a subset of what the extra installs).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "demo": ("vllm", "httpx", "transformers", "gguf", "accelerate"),
    "bench": ("matplotlib", "nanio"),
    "test": ("pytest", "moto", "hypothesis"),
}


class MissingExtra(click.ClickException):
    """A command needs modules that the base install does not bring. Exit status 2."""

    exit_code = 2


def missing_modules(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The names in ``modules`` (top-level module names) that cannot be imported here.

    Uses ``importlib.util.find_spec``, which imports nothing (a module blocked with
    ``sys.modules[name] = None`` counts as missing).
    """
    missing = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(m)
    return missing


def require(
    command: str, *extras: str, modules: tuple[str, ...] | None = None, hint: str = ""
) -> None:
    """Stop ``command`` with exit status 2 unless the modules of ``extras`` can be imported.

    ``modules`` overrides the modules checked (when a command needs only part of an extra);
    ``hint`` is added to the message (another way out, e.g. an option that needs no module).
    Raises :class:`MissingExtra` naming the missing modules and the ``pip install`` that brings them.
    """
    wanted = modules if modules is not None else tuple(m for e in extras for m in EXTRA_MODULES[e])
    missing = missing_modules(wanted)
    if missing:
        spec = ",".join(extras)
        raise MissingExtra(
            f"`kvoffload {command}` needs the extra [{spec}] (missing: {', '.join(missing)}): "
            f"from the kvoffload checkout, pip install -e '.[{spec}]'{hint}"
        )
