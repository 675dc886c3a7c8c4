"""Tier worker processes (installed as ``kvoffload.workers``): entry point, fault hooks, and the
tier I/O modules they run. Imports only :mod:`kvoffload.ipc` and the I/O code, never torch."""
