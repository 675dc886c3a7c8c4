"""kvoffload: hierarchical KV-cache offloading for LLM serving.

accelerator → host tier (shared-memory arena, LRU/ARC) → secondary tiers (fs, memory, out-of-tree),
with tier I/O in worker processes. See DESIGN.md for the architecture and README.md to start.
"""

__version__ = "0.1.0"
