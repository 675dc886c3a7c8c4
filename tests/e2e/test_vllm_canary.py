"""The online canary (issue 27 item 3) on a real vLLM-CPU server with SmolLM2-135M and an fs tier:
a healthy server's checks match, through the host tier and through the fs tier; chunks of the fs
tier rewritten behind its back with valid headers (wrong KV its checksum cannot see) make a check
a mismatch whose log line names the fs tier, and with ``fail_closed`` the fs tier serves no more
loads (its chunks are recomputed, counted with reason ``canary``) while the host tier's checks
match again. One engine for every step (a start costs 30-40 s)."""

import os
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
from helpers import fs_server_spec, vllm_or_skip  # noqa: E402

vllm_or_skip()

from kvoffload.tools.vllm_server import (  # noqa: E402
    VLLMServer,
    counter_increase,
)
from kvoffload.workers import chunkfile as cf  # noqa: E402

BLOCK = 32
DEADLINE_S = 240.0  # a generous bound on checks every second: behaviour, not speed


def _checks(server: VLLMServer) -> dict[str, int]:
    return counter_increase({}, server.metrics(), "kvoffload_canary_checks_total", "outcome")


def _wait(server: VLLMServer, done, what: str) -> dict:
    """Scrape until ``done(samples)``; fails naming ``what`` (and the checks so far)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        samples = server.metrics()
        if done(samples):
            return samples
        time.sleep(0.5)
    raise AssertionError(f"{what}: not seen; checks {_checks(server)}\n{server.log_tail()}")


def _count(samples: dict, name: str, **labels) -> float:
    return sum(
        v
        for (n, pairs), v in samples.items()
        if n == name and labels.items() <= dict(pairs).items()
    )


def _outcome(samples: dict, outcome: str) -> float:
    return _count(samples, "kvoffload_canary_checks_total", outcome=outcome)


def _fs_loads(samples: dict) -> float:
    return _count(samples, "kvoffload_tier_transfer_chunks_total", tier="fs", direction="load")


def _rewrite_behind_the_tiers_back(root: Path) -> int:
    """Give every chunk file under ``root`` a payload of zeros (the bytes of a copy that never
    landed, the field's silent wrong KV) under a well-formed header with the checksum of that
    payload, published by rename as a writer would: nothing the tier checks can tell. Returns
    the files rewritten. (Another chunk's payload is not enough: SmolLM2 continued the canary's
    prompt identically from its chunks' KV permuted.)"""
    files = sorted(root.rglob("*.kv"))
    for path in files:
        # <root>/<namespace id>/[t-<tenant id>/]<hh>/<hh>/<key>.kv: the canary's runs are
        # salted, so its chunks sit in its tenant's directory
        ns_dir = path.parent.parent.parent
        if cf.is_tenant_id(ns_dir.name.removeprefix(cf.TENANT_DIR_PREFIX)):
            ns_dir = ns_dir.parent
        ns_id = bytes.fromhex(ns_dir.name)
        key = cf.key_from_name(path.name)
        assert key is not None
        body = bytes(path.stat().st_size - cf.HEADER_BYTES)
        tmp = path.with_name(f".forged-{path.name}")
        tmp.write_bytes(cf.build_header(ns_id, key, body) + body)
        os.replace(tmp, path)
    return len(files)


def test_the_canary_matches_then_names_a_tier_serving_wrong_kv_and_closes_it(tmp_path, model_dir):
    root = tmp_path / "fs"
    log = tmp_path / "server.log"
    server = VLLMServer(fs_server_spec(model_dir, root, str(log)))
    server.spec.offload["canary"] = {
        "url": server.url,
        "every_s": 1,
        "max_tokens": 8,
        "prompt_chunks": 4,
        "timeout_s": 120,
        "fail_closed": True,
    }
    with server:
        # healthy: checks through the host tier and through the fs tier (its loads) match
        healthy = _wait(
            server,
            lambda s: _outcome(s, "match") >= 2 and _fs_loads(s) >= 4,
            "two matching checks, one of them loading from the fs tier",
        )
        assert _outcome(healthy, "mismatch") == 0
        assert _outcome(healthy, "error") == 0
        assert _outcome(healthy, "unstable") == 0

        assert _rewrite_behind_the_tiers_back(root) >= 4
        wrong = _wait(server, lambda s: _outcome(s, "mismatch") >= 1, "a mismatch")
        text = log.read_text(errors="replace")
        line = next(x for x in text.splitlines() if "kvoffload canary: MISMATCH" in x)
        assert re.search(r"served by fs: \d+", line), line
        assert "fail_closed: loads from fs stopped until restart" in line, line
        assert "host" not in line.split("served by", 1)[1].split(" and generated")[0], line

        # closed: the fs tier's chunks are recomputed (counted), never loaded again, and the
        # host tier's checks match again once it holds recomputed chunks
        after = _wait(
            server,
            lambda s: (
                _outcome(s, "match") > _outcome(wrong, "match")
                and _count(s, "kvoffload_recomputed_tokens_total", tier="fs", reason="canary") > 0
            ),
            "a match through the host tier and the fs tier's chunks recomputed",
        )
        assert _fs_loads(after) == _fs_loads(wrong)
        assert _outcome(after, "mismatch") == 1
        assert _outcome(after, "error") == 0
