"""The embedded engine's own promises: real batching, batch invariance, per-row LoRA, stops, cancel."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest


@pytest.fixture
def client(embedded_backend: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{embedded_backend.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def _ids(
    client: openai.OpenAI, model: str, content: str, seed: int, max_tokens: int = 24, **kw: Any
) -> list[int]:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        seed=seed,
        temperature=kw.pop("temperature", 1.0),
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **kw,
    )
    return r.model_dump()["choices"][0]["token_ids"]


def _load(backend: Any, name: str, path: Path, inplace: bool = False) -> None:
    r = httpx.post(
        f"{backend.base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _unload(backend: Any, name: str) -> None:
    httpx.post(f"{backend.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def _engine_call(backend: Any, fn: Any) -> Any:
    return backend.engine.call(fn).result(timeout=30)


def test_concurrent_requests_are_batched_and_batch_invariant(
    client: openai.OpenAI, embedded_backend: Any
) -> None:
    model = embedded_backend.served_model
    jobs = [(f"question number {k} " * (1 + k % 3), 100 + k, 16 + 4 * k) for k in range(8)]
    solo = [_ids(client, model, c, s, m) for c, s, m in jobs]
    engine = embedded_backend.engine
    _engine_call(embedded_backend, lambda: engine.stats.update(max_rows=0))
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda j: _ids(client, model, *j), jobs))
    assert together == solo
    assert engine.stats["max_rows"] >= 4  # rows really shared decode steps


def test_mixed_adapter_batch_gives_each_row_its_own_adapter(
    client: openai.OpenAI, embedded_backend: Any, lora_dirs: dict[str, Path]
) -> None:
    _load(embedded_backend, "mix-a", lora_dirs["a"])
    _load(embedded_backend, "mix-b", lora_dirs["b"])
    try:
        base = embedded_backend.served_model
        jobs = [
            (base, "hello there", 1),
            ("mix-a", "hello there", 1),
            ("mix-b", "hello there", 1),
            ("mix-a", "a longer prompt about the capital", 5),
            (base, "x", 9),
            ("mix-b", "y y y", 4),
        ]
        solo = [_ids(client, m, c, s) for m, c, s in jobs]
        assert solo[0] != solo[1] and solo[1] != solo[2]  # the adapters matter
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda j: _ids(client, *j), jobs))
        assert together == solo
    finally:
        _unload(embedded_backend, "mix-a")
        _unload(embedded_backend, "mix-b")


def test_inplace_reload_lets_inflight_requests_finish_on_old_weights(
    client: openai.OpenAI, embedded_backend: Any, lora_dirs: dict[str, Path]
) -> None:
    _load(embedded_backend, "old-a", lora_dirs["a"])
    _load(embedded_backend, "new-b", lora_dirs["b"])
    _load(embedded_backend, "live", lora_dirs["a"])
    try:
        want_old = _ids(client, "old-a", "reload me", 11, max_tokens=300, temperature=0.0)
        want_new = _ids(client, "new-b", "reload me", 11, max_tokens=300, temperature=0.0)
        assert want_old != want_new
        started, result = threading.Event(), {}

        def stream() -> None:
            chunks = client.chat.completions.create(
                model="live",
                messages=[{"role": "user", "content": "reload me"}],
                max_tokens=300,
                seed=11,
                temperature=0.0,
                stream=True,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            ids = []
            for ch in chunks:
                started.set()
                for c in ch.model_dump()["choices"]:
                    ids += c.get("token_ids") or []
            result["ids"], result["end"] = ids, time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        _load(embedded_backend, "live", lora_dirs["b"], inplace=True)
        reloaded = time.monotonic()
        t.join(120)
        assert result["end"] > reloaded, "the stream ended before the reload; make it longer"
        assert result["ids"] == want_old
        assert _ids(client, "live", "reload me", 11, max_tokens=300, temperature=0.0) == want_new
    finally:
        for name in ("old-a", "new-b", "live"):
            _unload(embedded_backend, name)


def test_stop_string_truncates_and_reports_it(client: openai.OpenAI, embedded_backend: Any) -> None:
    args = {
        "model": embedded_backend.served_model,
        "prompt": "The capital of France is",
        "max_tokens": 40,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    text = client.completions.create(**args).choices[0].text
    clean = [
        i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip()
    ]
    if not clean:
        pytest.skip("the random model wrote no plain text to cut on")
    stop = text[clean[0] : clean[0] + 3]
    r = client.completions.create(stop=[stop], **args).choices[0]
    assert r.text == text[: text.find(stop)]
    assert r.finish_reason == "stop" and r.model_dump()["stop_reason"] == stop
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(stop=[stop], stream=True, **args) if ch.choices
    )
    assert streamed == r.text


def test_client_disconnect_cancels_the_rows(client: openai.OpenAI, embedded_backend: Any) -> None:
    engine = embedded_backend.engine
    with httpx.stream(
        "POST",
        f"{embedded_backend.base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": embedded_backend.served_model,
            "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 10
    while _engine_call(embedded_backend, lambda: len(engine._rows)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _engine_call(embedded_backend, lambda: len(engine._rows)) == 0
    assert _ids(client, embedded_backend.served_model, "still alive?", 1, max_tokens=4)


def test_backend_load_adapter_replaces_and_unload_raises_404(
    embedded_backend: Any, loop_thread: Any, lora_dirs: dict[str, Path]
) -> None:
    from rlproxy.errors import AdapterError

    loop_thread.run(embedded_backend.load_adapter("direct", str(lora_dirs["a"])))
    loop_thread.run(embedded_backend.load_adapter("direct", str(lora_dirs["b"])))  # replaces, no 400
    assert "direct" in embedded_backend.engine.adapters.listing()
    loop_thread.run(embedded_backend.unload_adapter("direct"))
    with pytest.raises(AdapterError) as err:
        loop_thread.run(embedded_backend.unload_adapter("direct"))
    assert err.value.status == 404
    with pytest.raises(AdapterError) as err:
        loop_thread.run(embedded_backend.load_adapter("x", str(lora_dirs["other"])))
    assert err.value.status == 400
