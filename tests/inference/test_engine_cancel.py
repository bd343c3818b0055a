"""Issue 22 item 9: the embedded engine stops decoding for a client that left, and caps completions.

Every case here failed before the fix: a non-streaming request whose client gave up was decoded to
its end (~1,900 tokens after a 1 s timeout), an SDK that timed out and retried left the first
generation running, and a chat request without max_tokens could take the whole context.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

BIN = Path(sys.executable).parent
MAX_AFTER = 16  # tokens a row may still decode between the disconnect and its cancel


def _rows(backend: Any) -> int:
    engine = backend.engine
    return backend.engine.call(lambda: len(engine._rows)).result(timeout=30)


def _wait_rows(backend: Any, want: int, timeout: float) -> float:
    """Seconds until the engine holds `want` rows (fails after `timeout`)."""
    start = time.monotonic()
    while _rows(backend) != want:
        assert time.monotonic() - start < timeout, f"engine still holds rows after {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


def _long_chat(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_client_that_leaves_after_1s_stops_the_engine_within_1s(embedded_backend: Any, stream: bool) -> None:
    """A raw client sends a long generation, waits 1 s, hangs up: the rows go within 1 s."""
    engine = embedded_backend.engine
    body = json.dumps(_long_chat(embedded_backend.served_model, stream)).encode()
    host, port = embedded_backend.host, embedded_backend.port
    sock = socket.create_connection((host, port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    _wait_rows(embedded_backend, 1, 30)
    time.sleep(1.0)
    decoded = engine.stats["tokens"]
    cancelled = engine.stats["cancelled"]
    sock.close()
    took = _wait_rows(embedded_backend, 0, 5)
    after = engine.stats["tokens"] - decoded
    assert took < 1.0, f"the engine kept the row {took:.2f} s after the disconnect"
    assert after <= MAX_AFTER, f"{after} tokens decoded after the disconnect"
    assert engine.stats["cancelled"] == cancelled + 1


def test_sdk_timeout_and_retries_leave_no_generation_running(embedded_backend: Any) -> None:
    engine = embedded_backend.engine
    client = openai.OpenAI(
        base_url=f"{embedded_backend.base_url}/v1", api_key="unused", max_retries=2, timeout=1.0
    )
    before = engine.stats["cancelled"]
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model=embedded_backend.served_model,
            messages=[{"role": "user", "content": "long"}],
            max_tokens=1900,
            extra_body={"ignore_eos": True},
        )
    assert _wait_rows(embedded_backend, 0, 5) < 1.0
    assert engine.stats["cancelled"] == before + 3  # the first call and both retries


def test_chat_without_max_tokens_is_capped(tiny_model_dir: Path, loop_thread: Any) -> None:
    from rlproxy.inference.embedded import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_model_dir), threads=1, default_max_tokens=7)
    loop_thread.run(backend.start())
    try:
        client = openai.OpenAI(base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model=backend.served_model,
            messages=[{"role": "user", "content": "go"}],
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
        r = client.chat.completions.create(
            model=backend.served_model,
            messages=[{"role": "user", "content": "go"}],
            max_tokens=9,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 9  # an explicit max_tokens is the request's own
    finally:
        loop_thread.run(backend.stop())


def test_default_cap_of_the_settings() -> None:
    from rlproxy.compose import make_backend
    from rlproxy.settings import Settings

    embedded = make_backend(Settings(backend="embedded", model="tiny"))
    assert embedded.default_max_tokens == 1024
    launched = make_backend(Settings(backend="vllm", model="tiny"))
    assert "--override-generation-config" not in launched.command("/m", 1)  # vLLM unchanged unset
    assert "--enable-prefix-caching" in launched.command("/m", 1)
    capped = make_backend(Settings(backend="vllm", model="tiny", engine_default_max_tokens=300))
    cmd = capped.command("/m", 1)
    assert json.loads(cmd[cmd.index("--override-generation-config") + 1]) == {"max_new_tokens": 300}


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on /metrics")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_disconnect_through_serve_stops_the_engine_and_stores_cancelled(
    tiny_model_dir: Path, tmp_path: Path, stream: bool
) -> None:
    """Through a real `rlproxy serve`: the client leaves after 1 s, the engine's token counter (on
    the proxy's /metrics) stops within 1 s, and the completion is stored `cancelled`."""
    env = {
        **os.environ,
        "RLPROXY_ENGINE_THREADS": "1",
        "RLPROXY_CACHE_DIR": str(tiny_model_dir.parents[1]),
    }
    db = tmp_path / "serve.db"
    cmd = [str(BIN / "rlproxy"), "serve", "--model", str(tiny_model_dir), "--no-train", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--db", str(db), "--no-access-log"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        base = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and base is None:
            line = proc.stdout.readline()
            if not line:
                break
            if "OPENAI_BASE_URL=" in line:
                base = line.split("OPENAI_BASE_URL=", 1)[1].strip().removesuffix("/v1")
        assert base, "serve did not print the OPENAI_BASE_URL line"
        args = {"json": _long_chat("tiny", stream), "headers": {"X-Run-Id": "gone-1"}}
        if stream:  # read chunks for 1 s, then hang up
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, **args) as r:
                start = time.monotonic()
                for _ in r.iter_lines():
                    if time.monotonic() - start > 1.0:
                        break
                else:
                    pytest.fail("the stream ended within 1 s; make it longer")
        else:  # an SDK-style client that gives up after 1 s
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{base}/v1/chat/completions", timeout=1.0, **args)
        left = time.monotonic()
        first = _metric(base, "rlproxy_engine_tokens")
        while _metric(base, "rlproxy_engine_rows") != 0:
            assert time.monotonic() - left < 5, "the engine went on decoding after the client left"
            time.sleep(0.02)
        took = time.monotonic() - left
        assert took < 1.0, f"the engine kept the row {took:.2f} s after the client left"
        assert _metric(base, "rlproxy_engine_tokens") - first <= MAX_AFTER
        assert _metric(base, "rlproxy_engine_cancelled") == 1
        # the prefix cache is on by default and reports on the proxy's /metrics: the cancelled
        # row's KV was kept, so the same conversation again (an SDK's retry) reuses it
        assert _metric(base, "rlproxy_engine_prefix_cache_bytes") > 0
        hits = _metric(base, "rlproxy_engine_prefix_cache_hits")
        again = {**args["json"], "max_tokens": 2, "stream": False}
        assert httpx.post(f"{base}/v1/chat/completions", json=again, timeout=60).status_code == 200
        assert _metric(base, "rlproxy_engine_prefix_cache_hits") == hits + 1
        # where the worker's time went: prefill and decode seconds, decode steps and their rows
        steps = _metric(base, "rlproxy_engine_decode_steps")
        assert steps >= 1 and _metric(base, "rlproxy_engine_decode_rows") >= steps
        assert _metric(base, "rlproxy_engine_decode_seconds") > 0
        assert _metric(base, "rlproxy_engine_prefill_seconds") > 0
        status = None
        for _ in range(100):
            out = subprocess.run(
                ["sqlite3", str(db), "SELECT status FROM completions WHERE run_id = 'gone-1'"],
                capture_output=True,
                text=True,
            )
            status = out.stdout.strip()
            if status:
                break
            time.sleep(0.1)
        assert status == "cancelled"
    finally:
        proc.terminate()
        proc.wait(30)
