"""End-to-end tests: real vLLM engines and servers."""
