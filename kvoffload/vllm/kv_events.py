"""The KV-event translator under its former name: it lives in :mod:`kvoffload.kv_events` (the core
imports nothing of the vLLM plug-in), and imports no vLLM."""

from kvoffload.kv_events import KVEventTranslator

__all__ = ["KVEventTranslator"]
