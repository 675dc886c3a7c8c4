"""Logging for the ``kvoffload`` logger tree: ``KVOFFLOAD_LOG_LEVEL`` (default INFO) to stderr.

Engines such as vLLM configure only their own loggers, so without this kvoffload's messages would
reach stderr only at WARNING and above.
"""

from __future__ import annotations

import logging
import os

_configured = False


def setup() -> None:
    """Attach one stderr handler to the ``kvoffload`` logger (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    level = os.environ.get("KVOFFLOAD_LOG_LEVEL", "INFO").upper()
    logger = logging.getLogger("kvoffload")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s kvoffload %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
