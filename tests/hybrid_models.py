"""Tiny random-weight hybrid models for the end-to-end tests: built by
:mod:`kvoffload.tools.hybrid_models` (``kvoffload bench window`` uses them too)."""

from kvoffload.tools.hybrid_models import (  # noqa: F401
    DEEPSEEK_V2,
    GEMMA3,
    GEMMA3_FULL,
    GRANITE4,
    KINDS,
    SEED,
    hybrid_model_dir,
    prepare_hybrid_model,
)
