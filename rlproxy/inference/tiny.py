"""The `tiny` model: a random Qwen2 (~0.5M parameters) with a byte-level BPE tokenizer trained here
and Qwen2.5's chat template (hermes-style tools), for fast tests; made in about a second, identical
for a given seed. `rlproxy.inference.models` resolves the name `tiny` to a cached copy of it.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from rlproxy.inference.hf_folder import save_tokenizer

# Qwen2.5's chat template (hermes-style tools), made tolerant of `arguments` given as a JSON string
# (the OpenAI wire format) as well as a dict, and of `content: null` on assistant tool-call turns.
CHAT_TEMPLATE = """\
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


def make_tiny(out_dir: Path, seed: int = 0) -> Path:
    """Write the `tiny` model (random Qwen2 + locally trained BPE tokenizer) into `out_dir`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = _build_tokenizer(out_dir, seed)
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
    return out_dir


def _corpus(rng: random.Random, sentences: int = 4000) -> list[str]:
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
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
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
    fast.chat_template = CHAT_TEMPLATE
    save_tokenizer(fast, out_dir)
    return len(fast)
