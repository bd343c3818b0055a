"""Request bodies of the embedded engine's OpenAI routes, validated the way vLLM validates them.

Unknown fields are accepted and ignored (OpenAI clients send many), impossible values are a 400
`BadRequestError` (vLLM answers validation errors with 400, not FastAPI's 422).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlproxy.inference.sampling import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    priority: int = 0  # vLLM's field: lower is admitted first (siblings send 10, app requests 0)
    # vLLM's prefix-cache isolation (>= 0.9): prompts under different salts never share cached KV;
    # the proxy sends an app key's id here (proxy/keys.py), so no app's prompts are hits for another
    cache_salt: str | None = Field(None, max_length=256)

    def sampling(
        self, max_tokens: int | None, logprobs: bool, top_logprobs: int, defaults: dict[str, float]
    ) -> SamplingParams:
        """The engine-side parameters of this body; unset temperature/top_p come from `defaults`."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        """`stream_options.include_usage`: a last chunk with `usage` and no choices."""
        return bool((self.stream_options or {}).get("include_usage"))


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        for m in self.messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("every message needs a `role`")
        return self

    def params(self, defaults: dict[str, float]) -> SamplingParams:
        limit = self.max_completion_tokens or self.max_tokens
        return self.sampling(limit, self.logprobs, self.top_logprobs or 0, defaults)

    @property
    def parse_tools(self) -> bool:
        """Whether the output is scanned for hermes `<tool_call>` blocks."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionBody:
        if self.echo:
            raise ValueError("`echo` is not supported by the embedded engine")
        if self.suffix:
            raise ValueError("`suffix` is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        return self

    def params(self, defaults: dict[str, float]) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs is not None, self.logprobs or 0, defaults)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class LoadLoRABody(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRABody(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None
