"""Unit tests: in-process only, no process, socket or arena (tests/unit/conftest.py enforces it)."""
