"""vLLM's KV-cache groups as :class:`kvoffload.hybrid.GroupLayout` s.

vLLM hands an offloading spec an ``OffloadingConfig`` whose groups carry only their id, tokens per
block and layer names (0.33 adds a sliding window in chunks); the layer kind, page size and shapes
are in the engine's ``KVCacheConfig`` (``kv_cache_groups[group_id].kv_cache_spec``), which the
``OffloadingConnector`` holds while it creates the spec (:func:`kvoffload.vllm.compat.calling_kv_cache_config`).
With it each group gets its kind, window and shape; without it (a spec made outside a connector)
each group is ``unknown``, sized by the whole worker block, and needs the whole prefix (or, 0.33,
the window the config names).

A group's window is the one vLLM's offloading scheduler uses to compute a hit: from 0.33 on the
scheduler (and vLLM's own CPU spec) reads the group config's ``sliding_window_size_in_chunks``
(None: the whole prefix), so that field is taken as it is; 0.32's scheduler computes the window
from the group's ``KVCacheSpec`` with ``get_sliding_window_size_in_chunks``, and so does this
module for 0.32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvoffload.hybrid import UNKNOWN, GroupLayout
from kvoffload.vllm.compat import (
    AttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    iter_layer_specs,
    sliding_window_size_in_chunks,
)

# vLLM 0.33's ``OffloadingGroupConfig`` field: a group's window in chunks, which its scheduler reads
CONFIG_WINDOW = "sliding_window_size_in_chunks"


def config_names_window(group_config: Any) -> bool:
    """Whether vLLM's ``OffloadingGroupConfig`` carries the group's window (0.33+), so that its
    scheduler takes a hit's window from there rather than from the group's ``KVCacheSpec``."""
    return dataclasses.is_dataclass(group_config) and any(
        f.name == CONFIG_WINDOW for f in dataclasses.fields(group_config)
    )


def _spec_shape(spec: Any) -> str:
    """``name=value;...`` of the fields of one layer's ``KVCacheSpec`` that decide its bytes."""
    parts: list[tuple[str, Any]] = [("type", type(spec).__name__)]
    if isinstance(spec, AttentionSpec):
        parts += [
            ("kv_heads", spec.num_kv_heads),
            ("head", spec.head_size),
            ("head_v", spec.head_size_v),
            ("dtype", str(spec.dtype).removeprefix("torch.")),
            ("quant", getattr(spec.kv_quant_mode, "name", spec.kv_quant_mode)),
            ("tokens_per_state", spec.tokens_per_state),
        ]
        for name in ("sliding_window", "attention_chunk_size", "extra_retained_tokens"):
            value = getattr(spec, name, None)
            if value:
                parts.append((name, value))
    elif isinstance(spec, MambaSpec):
        parts += [
            ("shapes", "x".join(",".join(map(str, s)) for s in spec.shapes)),
            ("dtypes", ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)),
            ("mamba_type", getattr(spec.mamba_type, "name", spec.mamba_type)),
            ("cache_mode", spec.mamba_cache_mode),
        ]
    parts.append(("page", spec.page_size_bytes))
    return ";".join(f"{k}={v}" for k, v in parts)


def _reach_tokens(spec: Any) -> int | None:
    """Tokens before a hit's end a sliding-window layer's load must hold: ``sliding_window - 1 +
    extra_retained_tokens`` (vLLM's ``load_window_size_in_chunks``, 0.32 and 0.33); None for any
    other kind (a chunked-local window is whole chunks)."""
    if not isinstance(spec, SlidingWindowSpec):
        return None
    return spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)


def _window_chunks(spec: Any, tokens_per_chunk: int) -> int | None:
    """vLLM 0.32's count of chunks a load of this group needs (its offloading scheduler's
    ``get_sliding_window_size_in_chunks``, which 0.33 moved to its offloading config), so the two
    never disagree."""
    try:
        return sliding_window_size_in_chunks(spec, tokens_per_chunk)
    except AssertionError:  # a kind vLLM's scheduler treats as needing the whole prefix
        return None


def group_layouts(
    cfg: Any, kv_cache_config: Any | None, blocks_per_chunk: int
) -> tuple[GroupLayout, ...]:
    """The offloaded groups of an engine.

    Args:
        cfg: vLLM's ``OffloadingConfig`` (its ``groups`` are the offloaded ones).
        kv_cache_config: vLLM's ``KVCacheConfig`` the config was built from, or None.
        blocks_per_chunk: engine blocks per chunk.

    Raises:
        ValueError: ``kv_cache_config`` has no group of an offloaded group's id.
    """
    if kv_cache_config is None:
        return tuple(
            GroupLayout(
                group_id=g.group_id,
                kind=UNKNOWN,
                tokens_per_chunk=g.tokens_per_block * blocks_per_chunk,
                num_layers=len(g.layer_names),
                block_bytes=cfg.worker_kv_bytes_per_block,
                window_chunks=getattr(g, CONFIG_WINDOW, None),
            )
            for g in cfg.groups
        )
    out = []
    for g in cfg.groups:
        if not 0 <= g.group_id < len(kv_cache_config.kv_cache_groups):
            raise ValueError(
                f"KV group {g.group_id} of the offloading config is not in the engine's "
                f"KV-cache config ({len(kv_cache_config.kv_cache_groups)} groups)"
            )
        group = kv_cache_config.kv_cache_groups[g.group_id]
        spec = group.kv_cache_spec
        layer_specs = list(iter_layer_specs(spec))
        if len(layer_specs) == 1 and len(group.layer_names) > 1:  # one spec for every layer
            block_bytes = spec.page_size_bytes * len(group.layer_names)
        else:  # vLLM's UniformTypeKVCacheSpecs: its page is the sum of its layers'
            block_bytes = spec.page_size_bytes
        shapes = sorted({_spec_shape(s) for s in layer_specs})
        tokens_per_chunk = g.tokens_per_block * blocks_per_chunk
        window = (
            getattr(g, CONFIG_WINDOW)
            if config_names_window(g)
            else _window_chunks(layer_specs[0], tokens_per_chunk)
        )
        out.append(
            GroupLayout(
                group_id=g.group_id,
                kind=str(get_kv_cache_spec_kind(spec).value),
                tokens_per_chunk=tokens_per_chunk,
                num_layers=len(group.layer_names),
                block_bytes=block_bytes,
                window_chunks=window,
                reach_tokens=_reach_tokens(layer_specs[0]) if window is not None else None,
                replicated=all(
                    isinstance(s, MLAAttentionSpec)
                    or (isinstance(s, MambaSpec) and s.tp_replicated)
                    for s in layer_specs
                ),
                shape="|".join(shapes),
            )
        )
    return tuple(out)
