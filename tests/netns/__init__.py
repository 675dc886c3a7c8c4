"""Tests that run processes in network namespaces of their own (root and iproute2)."""
