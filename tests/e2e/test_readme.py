"""README.md's vLLM-CPU example, run as written: its server command and its requests, taken from
the README's text (the fenced blocks after a ``<!-- tests/e2e/test_readme.py: NAME -->`` marker), so
the README cannot drift from what works.

Only two things are substituted, each checked to be in the text: the port (``8000``: the test
takes a free one) and the fs tier's ``root_dir`` (``/tmp/kvoffload-fs``: a directory of the
test's, removed at the end). The directory is on /dev/shm, a tmpfs, so the fs tier's stores do not
depend on how full the machine's disk is (the README's config keeps the default free-space floor,
5 % of the filesystem). ``python`` in the blocks is this interpreter (its directory first on
``PATH``: the README assumes the environment kvoffload is installed in).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import vllm_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
vllm_or_skip()

from kvoffload.tools.vllm_server import ServerSpec, VLLMServer, vllm_shm_names  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
PORT = "8000"
FS_ROOT = "/tmp/kvoffload-fs"


def readme_block(name: str) -> str:
    """The fenced ``bash`` block that follows ``<!-- tests/e2e/test_readme.py: NAME -->`` in
    README.md, as the reader copies it."""
    text = README.read_text()
    found = re.findall(
        rf"<!-- tests/e2e/test_readme\.py: {re.escape(name)} -->\n```bash\n(.*?)\n```\n", text, re.S
    )
    assert len(found) == 1, f"README.md has {len(found)} blocks marked {name!r}"
    return found[0]


class ReadmeServer(VLLMServer):
    """README.md's server block run by bash in a process group of its own, with
    :class:`VLLMServer`'s wait for ``/health``, stop (the whole group) and clean-up of vLLM's
    shared memory; on this server's free port and the test's fs root."""

    def __init__(self, script: str, fs_root: str, log_path: str):
        bindir = os.path.dirname(sys.executable)
        super().__init__(
            ServerSpec(
                model="(README.md's)",
                kv_cache_tokens=0,
                log_path=log_path,
                env={"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"},
            )
        )
        self.script = script.replace(f"--port {PORT}", f"--port {self.port}").replace(
            FS_ROOT, fs_root
        )

    def command(self) -> list[str]:
        return ["bash", "-c", self.script]


def test_readme_vllm_cpu_example_serves_reloads_from_the_host_and_fs_tiers(tmp_path):
    server_block = readme_block("vllm-cpu server")
    requests_block = readme_block("vllm-cpu requests")
    # what is substituted is there, once in the server's command
    assert server_block.count(f"--port {PORT}") == 1 and server_block.count(FS_ROOT) == 1
    assert requests_block.count(f"http://127.0.0.1:{PORT}/") >= 3  # health, completions, metrics

    fs_root = tempfile.mkdtemp(prefix="readme-fs-", dir="/dev/shm")
    log_path = tmp_path / "server.log"
    srv = ReadmeServer(server_block, fs_root, str(log_path))
    group = None
    try:
        srv.start(timeout_s=900)
        group = srv.proc.pid
        proc = subprocess.run(
            [
                "bash",
                "-e",
                "-c",
                requests_block.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{srv.port}"),
            ],
            env={**os.environ, "PATH": srv.spec.env["PATH"]},
            capture_output=True,
            text=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, (proc.stdout, proc.stderr, srv.log_tail())
        tokens = {}
        for line in proc.stdout.splitlines():
            m = re.fullmatch(
                r'vllm:prompt_tokens_cached_by_source_total\{.*source="(\w+)".*\} (\S+)', line
            )
            assert m, f"the README's last command printed {line!r}"
            tokens[m[1]] = float(m[2])
        assert tokens.get("host", 0) > 0 and tokens.get("disk", 0) > 0, tokens
        log = log_path.read_text(errors="replace")
        assert "fewer than max_model_len" not in log  # the README's host tier holds a request
        arena = re.search(r"kvoffload: arena (\S+) \(", log)
        assert arena, "the server logged no arena"
    finally:
        srv.stop()
        shutil.rmtree(fs_root, ignore_errors=True)
    # nothing is left: no process of the server's group, none of vLLM's shared memory, and the
    # engine's arena (its janitor removes it once the engine is gone)
    assert group is not None
    left = []
    for p in psutil.process_iter():
        try:  # a zombie has ended: only its parent (init, when bash was stopped) can reap it
            if os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    assert not left, f"processes of the README's server left: {left}"
    assert not srv.held_shm & vllm_shm_names(), "the stopped server's shared memory is left"
    deadline = time.monotonic() + 120
    while os.path.exists(f"/dev/shm/{arena[1]}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/dev/shm/{arena[1]}"), f"the engine's arena {arena[1]} is left"
