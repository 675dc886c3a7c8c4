"""Integration tests: real worker processes, arenas, files, sockets and servers; no vLLM engine."""
