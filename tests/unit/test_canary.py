"""The online canary's pieces without a server (kvoffload.canary): its verdict, the board that
tells the engine which requests are its runs, its fixed prompt and its configuration."""

import pytest

from kvoffload.canary import MARKER, OUTCOMES, CanaryBoard, prompt_text, verdict
from kvoffload.config import ConfigError, parse_config


def test_a_check_passes_only_when_chunks_were_loaded_and_the_tokens_agree():
    assert verdict([1, 2, 3], [1, 2, 3], loaded=4) == "match"
    assert verdict([1, 2, 3], [1, 2, 3], loaded=0) == "not_exercised"


def test_differing_tokens_are_a_mismatch_only_when_a_second_recompute_agrees_with_the_first():
    assert verdict([1, 2, 9], [1, 2, 3], loaded=4, recompute_again=[1, 2, 3]) == "mismatch"
    assert verdict([1, 2, 9], [1, 2, 3], loaded=4, recompute_again=[1, 2, 4]) == "unstable"
    assert verdict([1, 2, 9], [1, 2, 3], loaded=4) == "error"  # unconfirmed: never a claim
    assert verdict([1, 2], [1, 2, 3], loaded=1, recompute_again=[1, 2, 3]) == "mismatch"


def test_two_computations_that_differ_without_a_load_are_unstable_not_a_pass():
    assert verdict([1, 2, 9], [1, 2, 3], loaded=0) == "unstable"


def test_outcomes_are_the_metric_labels():
    assert OUTCOMES == ("match", "mismatch", "not_exercised", "unstable", "error")


def test_only_a_request_carrying_the_token_of_an_expected_run_is_a_canary_run():
    board = CanaryBoard()
    token, run = board.expect("reuse", "fs")
    assert board.claim("r0", {MARKER: "0" * 32}) is None  # guessed: no run
    assert board.claim("r0", {MARKER: 7}) is None
    assert board.claim("r0", ["not", "a", "dict"]) is None
    assert board.claim("r1", {MARKER: token}) is run
    assert board.running == {"r1": run}
    assert board.claim("r2", {MARKER: token}) is None  # a token serves one request
    assert not run.done.is_set()
    board.finished("r1")
    assert run.done.is_set() and board.running == {}
    board.finished("r1")  # again, or for any other request: nothing


def test_a_withdrawn_run_is_never_claimed():
    board = CanaryBoard()
    token, _ = board.expect("recompute")
    board.withdraw(token)
    assert board.claim("r1", {MARKER: token}) is None


def test_the_prompt_is_one_fixed_list_of_words_written_three_times():
    assert prompt_text(20) == prompt_text(20)
    lines = prompt_text(20).splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1
    assert len(lines[0].split()) == 20
    assert len(set(lines[0].split())) > 5  # words to copy, not one repeated


def test_the_canary_is_off_by_default_and_its_settings_are_checked():
    assert parse_config({"cpu_bytes_to_use": 1 << 20}).canary is None
    cfg = parse_config({"cpu_bytes_to_use": 1 << 20, "canary": {"url": "http://127.0.0.1:8000"}})
    assert cfg.canary is not None
    assert (cfg.canary.every_s, cfg.canary.max_tokens, cfg.canary.fail_closed) == (300.0, 8, False)
    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "cpu_bytes_to_use": 1 << 20,
                "canary": {"url": "http://h:1/v1", "every_s": 0.1, "max_tokens": 1000},
            }
        )
    keys = {i.path for i in e.value.errors}
    assert {"canary.url", "canary.every_s", "canary.max_tokens"} <= {
        k.removeprefix("kv_connector_extra_config.") for k in keys
    }
    with pytest.raises(ConfigError, match="canary.url"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "canary": {}})


def test_the_api_key_is_named_by_a_variable_that_no_child_process_gets():
    from kvoffload.config import secret_env_names

    cfg = parse_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "canary": {"url": "http://127.0.0.1:8000", "api_key_env": "VLLM_API_KEY"},
        }
    )
    assert "VLLM_API_KEY" in secret_env_names(cfg)
    with pytest.raises(ConfigError, match="api_key_env") as e:
        parse_config(  # a key put where its variable's name goes is refused, never repeated
            {
                "cpu_bytes_to_use": 1 << 20,
                "canary": {"url": "http://127.0.0.1:8000", "api_key_env": "sk-live 1234"},
            }
        )
    assert "sk-live" not in str(e.value)
