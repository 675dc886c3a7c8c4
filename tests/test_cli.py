"""The ``kvoffload`` command on installs without the optional extras.

Each test runs the command in a fresh interpreter where chosen third-party modules are blocked
(``sys.modules[name] = None`` makes their import fail as if they were not installed), so the check
holds in an environment that has every extra. ``.ci/check_install.sh plain`` checks the same on a real
base-only install.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TOOL_MODULES = ["kvoffload.tools.demo", "kvoffload.tools.bench", "kvoffload.tools.stress",
                "kvoffload.tools.top", "kvoffload.tools.vllm_server"]


def _kvoffload(args: list[str], blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``kvoffload ARGS`` in a new interpreter with ``blocked`` modules unimportable; the last line
    of stdout is a JSON list of the kvoffload.tools modules that were imported."""
    code = f"""
import json, sys
for name in {list(blocked)!r}:
    sys.modules[name] = None
from kvoffload.tools.cli import main
try:
    main({args!r}, prog_name="kvoffload")
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvoffload.tools."))))
sys.exit(code)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def _imported(proc: subprocess.CompletedProcess) -> list[str]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_lists_every_command_without_importing_any_tool():
    proc = _kvoffload(["--help"])
    assert proc.returncode == 0, proc.stderr
    for command in ("bench", "check", "demo", "inspect", "stress", "sweep", "top"):
        assert f"  {command} " in proc.stdout
    assert not set(_imported(proc)) & set(TOOL_MODULES)


@pytest.mark.parametrize("args", [["check", "--help"], ["sweep", "--list"], ["stress", "--help"],
                                  ["top", "--help"], ["bench", "--help"], ["inspect", "--help"]])
def test_base_commands_run_without_the_demo_and_bench_extras(args):
    proc = _kvoffload(args, blocked=("httpx", "vllm", "transformers", "matplotlib", "moto", "nanio"))
    assert proc.returncode == 0, proc.stderr
    assert "demo" not in " ".join(_imported(proc))


@pytest.mark.parametrize("args, extra", [
    (["demo"], "kvoffload[demo]"),
    (["demo", "--json", "--turns", "2"], "kvoffload[demo]"),
    (["bench", "tier"], "kvoffload[bench]"),
    (["bench", "ttft"], "kvoffload[demo]"),
    (["bench", "scaling"], "kvoffload[demo,bench]"),
    (["stress", "--obj", "--duration", "1"], "kvoffload[stress]"),
])
def test_a_command_whose_extra_is_missing_exits_2_and_names_it(args, extra):
    proc = _kvoffload(args, blocked=("httpx", "matplotlib", "moto", "nanio"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert extra in proc.stderr
    assert "Traceback" not in proc.stderr
