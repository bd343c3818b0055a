"""Acceptance (issue 25): a text-only upstream nobody here wrote, LiteLLM's proxy, in front of the
embedded engine, as the hosted `teacher`: the openai SDK, streaming and not, tools and not, through
the proxy -> every turn stored (messages; token ids NULL; source `hosted`), zero 400s.

Needs `make litellm` (.venv-litellm); skipped without it. The strict provider stand-in
(test_hosted.py) covers the 400-on-unknown-fields, 429/Retry-After, 401, 5xx and cut-stream cases.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not a package of ours: import it from the checkout

from bench.litellm import LITELLM_BIN, MASTER_KEY, LiteLLM  # noqa: E402
from rlproxy.demo.directory import TOOLS  # noqa: E402

pytestmark = pytest.mark.skipif(not LITELLM_BIN.exists(), reason="LiteLLM is not installed: make litellm")

QUESTION = [{"role": "user", "content": "What are the phone extensions of Alice and Frank?"}]


@pytest.mark.timeout(600)
def test_litellm_as_the_hosted_teacher(make_proxy: Any, stub: Any, engine_backend: Any) -> None:
    served = engine_backend.served_model
    lite = LiteLLM(engine_backend.base_url, model=served).start(timeout=300)
    try:
        proxy = make_proxy(
            stub.url,
            hosted_upstreams=f"teacher={lite.url}/v1",
            hosted_models=f"teacher={served}",
            upstream_api_key=MASTER_KEY,
            model_map="gpt-4o-mini=teacher",
        )
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
        headers = {"X-Run-Id": "lite-1"}
        for tools in (None, TOOLS):
            extra = {"tools": tools} if tools else {}
            done = client.chat.completions.create(
                model="gpt-4o-mini", messages=QUESTION, max_tokens=8, extra_headers=headers, **extra
            )
            assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
            chunks = list(
                client.chat.completions.create(
                    model="gpt-4o-mini",
                    messages=QUESTION,
                    max_tokens=8,
                    stream=True,
                    extra_headers=headers,
                    **extra,
                )
            )
            assert chunks and any(c.choices and c.choices[0].finish_reason for c in chunks)
        rows = proxy.query(
            "SELECT source, status, status_code, token_ids, prompt_token_ids, logprobs, stream, request "
            "FROM completions WHERE run_id = 'lite-1' ORDER BY seq"
        )
        assert len(rows) == 4
        assert all(r[:6] == ("hosted", "ok", 200, None, None, None) for r in rows), rows  # zero 400s
        assert [r[6] for r in rows] == [0, 1, 0, 1]
        messages = proxy.query("SELECT count(*) FROM messages WHERE run_id = 'lite-1' AND role = 'assistant'")
        assert messages == [(4,)]
    finally:
        lite.stop()
