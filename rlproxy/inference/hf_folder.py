"""Writing Hugging Face model folders that every loader reads alike: transformers v4 and v5, and so
every vLLM. Shared by the built-in models (`tiny.py`, the smollm2 conversion in `models.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a class name every
    transformers version (and so every vLLM) knows, not only v5's `TokenizersBackend`."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    edit_json(
        out_dir / "tokenizer_config.json",
        drop=("is_local", "local_files_only"),  # loader state, not tokenizer settings
        tokenizer_class="PreTrainedTokenizerFast",
    )


def edit_json(path: Path, drop: tuple[str, ...] = (), **set_: object) -> None:
    """Rewrite the JSON object in `path` without the keys `drop`, with the keys `set_`."""
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(set_)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
