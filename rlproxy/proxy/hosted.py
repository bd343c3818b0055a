"""Hosted upstreams: policies served by a provider that returns no token ids (text only).

Most agents today call a hosted model (OpenAI, Anthropic's OpenAI-compatible endpoint, Together,
Fireworks, a LiteLLM gateway, Ollama). Such a provider rejects vLLM's capture fields (OpenAI answers
400 to an unknown parameter) and returns text, not tokens. A deployment names the policies it
serves (`hosted_upstreams = "teacher=https://api.openai.com/v1"`); for those:

- the request goes as the client wrote it: only `model` is mapped (`hosted_models`, else the
  client's name as written), no `return_token_ids`/`logprobs` are added, nothing is stripped;
- the provider's key goes with it (`hosted_api_keys` names an environment variable per policy, else
  `upstream_api_key`); of the client's headers only `PASSED` do (what describes the request body
  and its retry: content type, accepted types and encoding, user agent, `Idempotency-Key`,
  `OpenAI-Beta`), never its `Authorization`/`x-api-key`, cookies, `OpenAI-Organization` or
  `OpenAI-Project` (they pick whom the operator's key bills), `X-Forwarded-For`/`Forwarded` (the
  app's addresses), rlproxy's run headers, the SDKs' `X-Stainless-*` telemetry (the client's OS and
  runtime) or Anthropic's headers (the provider is asked in chat-completions form);
- streams are relayed byte for byte as they arrive (nothing to rewrite: `capture.Injected()` is empty);
- the row keeps messages, tool calls and usage with `prompt_token_ids`, `token_ids`, `logprobs` NULL
  and `completions.source = 'hosted'` (migration 0012): never a GRPO sample (the trainer skips such
  runs, status_reason `hosted`, and counts them), always SFT/distillation data
  (`rlproxy sft --from-policy teacher`);
- every answer of the provider reaches the client as the provider gave it: 400, 401, 429 with its
  `Retry-After` (and `x-ratelimit-*`), 5xx (its body to the log: `errors.upstream_failure`); it is
  stored as an error row. A stream the provider cuts is stored as cut (status error) and the
  client's stream is cut too. A 401/403 is also logged once
  for the operator: it means rlproxy's key for the provider is wrong, not the client's.

Other policies (the trainable `student`) stay on the backend (embedded engine or vLLM), so an app
moves from teacher to student by one setting on the proxy: `RLPROXY_MODEL_MAP=gpt-4o-mini=student`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from rlproxy.errors import ConfigError
from rlproxy.proxy import http11
from rlproxy.proxy.forward import Upstream
from rlproxy.proxy.policies import pairs
from rlproxy.settings import Settings
from rlproxy.storage.records import CompletionRecord

logger = logging.getLogger(__name__)

HOSTED = "hosted"  # completions.source of a row a text-only upstream answered
# The client headers a provider is sent (module doc): an allowlist, so a header nobody thought of
# (a cookie, a billing selector, a forwarded address) stays here under the operator's key
PASSED = frozenset(
    {b"content-type", b"accept", b"accept-encoding", b"user-agent", b"idempotency-key", b"openai-beta"}
)


@dataclass(frozen=True)
class HostedSpec:
    """One policy's text-only upstream, as the settings declare it."""

    policy: str
    url: str  # the provider's base URL as users write it (`https://api.openai.com/v1`)
    model: str | None  # the model name the provider is asked for; None: the client's as written
    api_key: str | None

    @property
    def root(self) -> str:
        """The URL without its trailing `/v1` (the proxy asks for `/v1/chat/completions` on it)."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_hosted(
    upstreams: str, models: str = "", api_keys: str = "", default_key: str | None = None
) -> dict[str, HostedSpec]:
    """The hosted policies the settings declare (`hosted_upstreams`, `hosted_models`,
    `hosted_api_keys`), by policy; ConfigError on a malformed entry or a key variable that is unset."""
    urls = pairs(upstreams, "hosted_upstreams")
    names = pairs(models, "hosted_models")
    keys = pairs(api_keys, "hosted_api_keys")
    for policy in (names.keys() | keys.keys()) - urls.keys():
        raise ConfigError(f"hosted_models/hosted_api_keys name {policy!r}, which hosted_upstreams does not")
    out = {}
    for policy, url in urls.items():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"hosted_upstreams: {policy}={url!r} is not an http(s) URL")
        key = default_key
        if policy in keys:
            key = os.environ.get(keys[policy])
            if not key:
                raise ConfigError(
                    f"hosted_api_keys: {policy}={keys[policy]} but the environment variable "
                    f"{keys[policy]} is not set"
                )
        out[policy] = HostedSpec(policy, url, names.get(policy), key)
    return out


def provider_models(specs: dict[str, HostedSpec]) -> dict[str, str | None]:
    """policy -> the model name its provider is asked for (None: the client's): what Policies needs."""
    return {p: s.model for p, s in specs.items()}


class HostedUpstream:
    """One provider: `forward.Upstream`'s `post` with the client's `PASSED` headers only, plus an
    operator warning when the provider refuses rlproxy's key."""

    def __init__(self, spec: HostedSpec, upstream: Upstream) -> None:
        self.spec = spec
        self.upstream = upstream
        self.base_url = upstream.base_url
        self._warned_auth = False

    async def post(
        self, path: bytes, headers: list, body: bytes, query: bytes, stream: bool, run_id: str | None = None
    ) -> http11.Response:
        resp = await self.upstream.post(
            path, [(k, v) for k, v in headers if k in PASSED], body, query, stream, run_id
        )
        if resp.status_code in (401, 403) and not self._warned_auth:
            self._warned_auth = True
            logger.warning(
                "hosted upstream %s (policy %s) answered %d: its key is rlproxy's to send "
                "(RLPROXY_UPSTREAM_API_KEY or RLPROXY_HOSTED_API_KEYS), relayed to the client as is",
                self.spec.url,
                self.spec.policy,
                resp.status_code,
            )
        return resp

    async def aclose(self) -> None:
        await self.upstream.aclose()


class HostedUpstreams:
    """The text-only upstreams by policy; created and closed in the lifespan."""

    def __init__(self, by_policy: dict[str, HostedUpstream]) -> None:
        self.by_policy = by_policy

    def get(self, policy: str) -> HostedUpstream | None:
        return self.by_policy.get(policy)

    def __bool__(self) -> bool:
        return bool(self.by_policy)

    async def aclose(self) -> None:
        for up in self.by_policy.values():
            await up.aclose()


def open_hosted(specs: dict[str, HostedSpec], settings: Settings) -> HostedUpstreams:
    """One pooled client per provider (call inside the running loop: the lifespan)."""
    made = {}
    for policy, spec in specs.items():
        made[policy] = HostedUpstream(spec, Upstream.of(spec.root, settings, spec.api_key))
        logger.info("policy %s: hosted upstream %s (text only, no token ids)", policy, spec.url)
    return HostedUpstreams(made)


def text_only(rec: CompletionRecord) -> None:
    """A hosted row as stored: no token ids or logprobs (the provider sent none; a stream assembled
    without them would say [] and count 0 tokens), usage only when the provider reported it."""
    rec.source = HOSTED
    rec.prompt_token_ids = rec.token_ids = rec.logprobs = None
    response = rec.response if isinstance(rec.response, dict) else {}
    if not isinstance(response.get("usage"), dict):
        rec.prompt_tokens = rec.completion_tokens = None
    for choice in response.get("choices") or ():
        if isinstance(choice, dict) and not choice.get("token_ids"):
            choice.pop("token_ids", None)
