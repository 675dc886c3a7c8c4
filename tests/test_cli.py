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

TOOL_MODULES = [
    "kvoffload.tools.demo",
    "kvoffload.tools.bench",
    "kvoffload.tools.stress",
    "kvoffload.tools.top",
    "kvoffload.tools.vllm_server",
]


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


@pytest.mark.parametrize(
    "args",
    [
        ["check", "--help"],
        ["sweep", "--list"],
        ["stress", "--help"],
        ["top", "--help"],
        ["bench", "--help"],
        ["inspect", "--help"],
    ],
)
def test_base_commands_run_without_the_demo_and_bench_extras(args):
    proc = _kvoffload(
        args, blocked=("httpx", "vllm", "transformers", "matplotlib", "moto", "nanio")
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo" not in " ".join(_imported(proc))


@pytest.mark.parametrize(
    "args, extra",
    [
        (["demo"], "extra [demo]"),
        (["demo", "--json", "--turns", "2"], "extra [demo]"),
        (["bench", "tier"], "extra [bench]"),
        (["bench", "ttft"], "extra [demo]"),
        (["bench", "scaling"], "extra [demo,bench]"),
        (["stress", "--obj", "--duration", "1"], "extra [stress]"),
    ],
)
def test_a_command_whose_extra_is_missing_exits_2_and_names_it(args, extra):
    proc = _kvoffload(args, blocked=("httpx", "matplotlib", "moto", "nanio"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert extra in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, rc, message",
    [
        (["stress", "--chunk-kib", "0"], 2, "--chunk-kib"),
        (["stress", "--duration", "0"], 2, "--duration"),
        (["stress", "--conversations", "0"], 2, "--conversations"),
        (["stress", "--config", "{binary}"], 2, "not UTF-8"),
        (["check", "{binary}"], 1, "not UTF-8"),
        (["check", "{vllm_spec}"], 1, "vLLM's own spec"),
        (
            ["inspect", "s3://bucket/prefix", "--endpoint-url", "notaurl"],
            2,
            "--endpoint-url notaurl",
        ),
        (["sweep", "--fs-root", "{missing}", "--list"], 2, "no such directory"),
        (["demo", "--p2p", "--turns", "1"], 2, "--turns"),
    ],
)
def test_bad_input_is_named_without_a_traceback(tmp_path, args, rc, message):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    vllm_spec = tmp_path / "vllm-spec.json"
    vllm_spec.write_text(
        '{"spec_name": "CPUOffloadingSpec", "spec_module_path": "kvoffload.vllm",'
        ' "cpu_bytes_to_use": 1048576}'
    )
    args = [
        a.format(binary=binary, vllm_spec=vllm_spec, missing=tmp_path / "missing") for a in args
    ]
    proc = _kvoffload(args)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if args[0] == "sweep":
        assert "arenas" not in proc.stdout  # refused before any arena was listed or swept


_KILLED_COMMAND = r"""
import subprocess, sys
import click
from kvoffload.tools.cli import main

@main.command("hold-child")
def hold_child():
    # As the demo and the benchmarks hold a vLLM server: a child in a process group of its own,
    # stopped in a finally block.
    child = subprocess.Popen(
        ["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        print(child.pid, flush=True)
        sys.stdin.read()
    finally:
        child.kill()
        child.wait()
        print("stopped", flush=True)

main(["hold-child"])
"""


def test_sigterm_ends_a_command_through_its_cleanup():
    """SIGTERM to a kvoffload command runs its cleanup (the servers it started are stopped):
    killed by the default action, ``bench scaling`` left its vLLM server running."""
    import os
    import signal

    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_COMMAND],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "stopped" in out
        assert not psutil.pid_exists(child)
    finally:
        proc.kill()
        proc.wait()
        if child is not None and psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)
