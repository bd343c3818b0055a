"""Asking the engine for more answers to a stored prompt: the exact prompt ids, a policy step, `n`.

Siblings (`siblings.py`) and the shadow check (`shadow.py`) sample through this one call. It posts
`/v1/completions` with the prompt as token ids, so the answers continue exactly the ids the app's
call was given (no chat template is rendered again), with `n` rows sharing one prefill (the embedded
engine prefills identical prompts once; vLLM's prefix cache does the same). It asks for what capture
asks for (`return_token_ids`, the sampled token's logprob) and a low `priority`, which the embedded
engine admits after every app request waiting (vLLM honours it only under `--scheduling-policy
priority`, so it is sent there only when asked).

    sample(client, url, model="policy@3", prompt_ids=[...], n=3, temperature=1.0, ...) -> [Sampled]

Each answer's logprobs are those of the temperature it was sampled at, as the trainer's ratios need.

A text-only call (an imported trace's: no prompt ids stored) gets its prompt ids from the engine
itself, `POST /tokenize` with its messages and tools (vLLM's route, and the embedded engine's with
the same body and answer): the serving model's chat template renders them exactly as it renders a
chat call's, and the proxy stays torch-free.

    chat_prompt_ids(client, url, model="policy@3", request={"messages": [...], "tools": [...]}) -> [ids]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from rlproxy.errors import RLProxyError
from rlproxy.inference.tools import parse_tool_calls

SIBLING_PRIORITY = 10  # the embedded engine admits lower values first; app requests carry 0


class ResampleError(RLProxyError):
    """The engine did not answer a resample request with n usable choices (status, body or shape)."""


@dataclass
class Sampled:
    """One answer the engine sampled for a stored prompt."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


async def sample(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    prompt_ids: list[int],
    n: int,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    api_key: str | None = None,
    priority: int | None = SIBLING_PRIORITY,
    timeout: float = 300.0,
) -> list[Sampled]:
    """`n` answers of `model` (an adapter name `policy@step`, or the served base) to `prompt_ids`."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": 0,  # the sampled token's logprob only
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = stop
    if priority is not None:
        body["priority"] = priority
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.post(
            f"{base_url.rstrip('/')}/v1/completions", json=body, headers=headers, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise ResampleError(f"the engine did not answer: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise ResampleError(f"the engine answered {r.status_code}: {r.text[:300]}")
    try:
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        out = [
            Sampled(
                token_ids=[int(t) for t in c["token_ids"]],
                logprobs=[float(x) for x in c["logprobs"]["token_logprobs"]],
                text=c.get("text") or "",
                finish_reason=c.get("finish_reason"),
            )
            for c in choices
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ResampleError(f"the engine's answer has no token ids or logprobs: {exc!r}") from exc
    if len(out) != n or any(len(s.token_ids) != len(s.logprobs) for s in out):
        raise ResampleError(f"the engine answered {len(out)} choices for n={n}, or ids and logprobs differ")
    return out


async def chat_prompt_ids(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    request: dict[str, Any],
    api_key: str | None = None,
    timeout: float = 60.0,
) -> list[int]:
    """The prompt ids `model` would be given for a chat `request` (its messages and tools, the
    generation prompt added), as the engine's `/tokenize` renders them."""
    body: dict[str, Any] = {"model": model, "messages": request.get("messages")}
    body["add_generation_prompt"] = True
    if request.get("tools"):
        body["tools"] = request["tools"]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.post(f"{base_url.rstrip('/')}/tokenize", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ResampleError(f"the engine did not answer /tokenize: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise ResampleError(f"the engine's /tokenize answered {r.status_code}: {r.text[:300]}")
    try:
        ids = [int(t) for t in r.json()["tokens"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ResampleError(f"the engine's /tokenize answer has no tokens: {exc!r}") from exc
    if not ids:
        raise ResampleError("the engine's /tokenize rendered an empty prompt")
    return ids


def as_message(text: str, finish_reason: str | None) -> dict[str, Any]:
    """The chat message an answer's text stands for (hermes `<tool_call>` blocks as `tool_calls`)."""
    content, calls = parse_tool_calls(text)
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": calls or None,
        "finish_reason": finish_reason,
    }
