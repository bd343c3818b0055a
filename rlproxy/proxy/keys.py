"""Keys per app: which app a request is, what it may use, and at what rate (issue 55; docs/tenancy.md).

The operator creates a key per app (`rlproxy keys create`, storage/keys.py); the secret's sha256 is
in the `keys` table that every replica reads. `KeyRing` holds the valid keys of this process in
memory, read again every `TTL_S` (2 s): a key created or revoked on any replica takes effect on every
replica within that. A request's bearer is hashed once and looked up (`find`); the guard puts the
`AppKey` it finds into the ASGI scope (`SCOPE_KEY`), where the routes read it.

What belongs to a key is named in its own namespace, so no id of another app can reach it: a keyed
app's run id `r` is stored as `<key id>~r` (`scoped`), its groups likewise (X-Group-Id and the
default group), and `~` is not a character a client may send in an id (proxy/runkey.py). Another
key's run, reward, judge request, reply or group is then simply not found: 404, the same answer as
an id nobody used. The shared agents' key (`RLPROXY_API_KEY`) keeps the unprefixed namespace.

Limits (per key, per replica: each replica counts what it serves): requests per minute (`rpm`),
tokens per minute (`tpm`: the usage of the answers served, counted once each call has ended, so the
request after the one that went over is refused), streams in flight (`max_streams`). Over a limit is
a 429 with `Retry-After` in OpenAI's error shape. Per-key figures are on `/metrics` by key name
(keys are made by the operator, so the label set is bounded).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlproxy.errors import APIError
from rlproxy.proxy.runkey import invalid_id
from rlproxy.storage import keys as store

log = logging.getLogger(__name__)

TTL_S = 2.0  # the keys are read again this often: a revoke reaches every replica within it
TOUCH_S = 60.0  # last_used_at is written at most this often per replica
SEP = "~"  # between a key's id and an id of its app (never in a client's id: runkey.RUN_ID_PATTERN)
SCOPE_KEY = "rlproxy.key"  # where the guard leaves the request's AppKey in the ASGI scope
_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class AppKey:
    """One valid key, as the routes see it."""

    id: str
    name: str
    policies: frozenset[str] | None  # None: every policy
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    scorer_url: str | None = None
    secret_hash: bytes = b""

    def may_use(self, policy: str) -> bool:
        return self.policies is None or policy in self.policies


MAX_ID = 128  # runs.id, runs.group_id: VARCHAR(128)


def scoped(key: AppKey | None, ident: str, what: str = "run id") -> str:
    """The stored form of an app's id (run, group, reply run): prefixed with its key's id (so an
    app key's ids are at most 128 - len(key id) - 1 characters: 111; 400 past that)."""
    if key is None:
        return ident
    out = f"{key.id}{SEP}{ident}"
    if len(out) > MAX_ID:
        raise invalid_id(what, f": an app key's ids are at most {MAX_ID - len(key.id) - 1} characters")
    return out


def unscope_error(exc: Exception, key: AppKey | None) -> None:
    """Name the app's ids in `exc`'s message as the app wrote them (without its key's prefix)."""
    if key is not None and exc.args and isinstance(exc.args[0], str):
        exc.args = (exc.args[0].replace(key.id + SEP, ""), *exc.args[1:])
        if hasattr(exc, "message"):
            exc.message = exc.args[0]  # type: ignore[attr-defined]


def unscoped(key: AppKey | None, ident: str | None) -> str | None:
    """The id as the app named it (the inverse of `scoped`)."""
    if key is None or ident is None:
        return ident
    prefix = key.id + SEP
    return ident[len(prefix) :] if ident.startswith(prefix) else ident


def of(scope) -> AppKey | None:
    """The key of a request (None: the shared agents' key, the admin key or no key)."""
    return scope.get(SCOPE_KEY)


@dataclass
class _Use:
    """One key's traffic on this replica."""

    name: str
    requests: int = 0
    tokens: int = 0
    streams: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    recent: deque = field(default_factory=deque)  # monotonic times of the last minute's requests
    spent: deque = field(default_factory=deque)  # (monotonic time, tokens) of the last minute
    spent_sum: int = 0
    tpm: bool = False  # the key has a tpm limit (its usage is kept for the window)
    used: bool = False  # since the last touch


class KeyRing:
    """The valid keys of the store, in memory (see the module doc)."""

    def __init__(self, engine=None, ttl: float = TTL_S) -> None:
        self.engine = engine
        self.ttl = ttl
        self._by_hash: dict[bytes, AppKey] = {}
        self._use: dict[str, _Use] = {}
        self._touched = time.monotonic()

    @property
    def any(self) -> bool:
        """Whether any key is valid: then agent routes need a key even without RLPROXY_API_KEY."""
        return bool(self._by_hash)

    def set(self, rows: list[dict]) -> None:
        """Replace the known keys with `rows` (storage.keys.active's)."""
        found = {}
        for r in rows:
            digest = bytes.fromhex(r["secret_hash"])
            policies = r.get("policies")
            found[digest] = AppKey(
                r["id"],
                r["name"],
                frozenset(policies) if policies is not None else None,
                r.get("rpm"),
                r.get("tpm"),
                r.get("max_streams"),
                r.get("scorer_url"),
                digest,
            )
        self._by_hash = found

    def find(self, authorization: bytes) -> AppKey | None:
        """The key an `Authorization: Bearer <secret>` value names, or None."""
        if not self._by_hash or authorization[:7] != b"Bearer ":
            return None
        digest = hashlib.sha256(authorization[7:]).digest()
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(digest, key.secret_hash):
            return None
        return key

    async def refresh(self) -> None:
        """Read the valid keys again; write `last_used_at` of the keys used, once a minute."""
        self.set(await store.active(self.engine))
        if time.monotonic() - self._touched >= TOUCH_S:
            used = [k for k, u in self._use.items() if u.used]
            for k in used:
                self._use[k].used = False
            self._touched = time.monotonic()
            await store.touch(self.engine, used, datetime.now(UTC))

    async def poll(self) -> None:
        """Forever: `refresh` every `ttl` seconds (a store that cannot answer keeps the last keys)."""
        while True:
            await asyncio.sleep(self.ttl)
            try:
                await self.refresh()
            except Exception as exc:  # CancelledError is not an Exception: a cancel still stops it
                log.warning("keys: could not read the keys table (%s); keeping the last ones", exc)

    # ------------------------------------------------------------ limits and counters

    def _of(self, key: AppKey) -> _Use:
        use = self._use.get(key.id)
        if use is None:
            use = self._use[key.id] = _Use(key.name)
        return use

    def refuse(self, key: AppKey, reason: str) -> None:
        """Count a refusal of `key`'s request for `reason` (model, rpm, tpm, streams)."""
        use = self._of(key)
        use.refused[reason] = use.refused.get(reason, 0) + 1

    def enter(
        self, key: AppKey, policy: str, model: object, upstream_body: dict | None, stream: bool
    ) -> None:
        """A completion request of `key` for `policy` (its `model` as sent): 404 `model_not_found`
        for a policy the key may not use (the answer of a model that does not exist: no oracle of
        the others'); its prefix-cache salt set in `upstream_body` (None: a hosted upstream, sent as
        written), so no prompt of another key is a hit, in time or in `cached_tokens`; then `admit`."""
        if not key.may_use(policy):
            self.refuse(key, "model")
            raise APIError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        if upstream_body is not None:
            upstream_body["cache_salt"] = key.id  # vLLM's field (>= 0.9); the embedded engine's too
        self.admit(key, stream)

    def admit(self, key: AppKey, stream: bool) -> None:
        """Count one request of `key`; APIError 429 (with `retry_after`) when it is over a limit."""
        use = self._of(key)
        use.used = True
        use.tpm = key.tpm is not None
        if key.rpm is not None or key.tpm is not None:
            now = time.monotonic()
            cut = now - _WINDOW_S
            while use.recent and use.recent[0] <= cut:
                use.recent.popleft()
            while use.spent and use.spent[0][0] <= cut:
                use.spent_sum -= use.spent.popleft()[1]
            if key.rpm is not None and len(use.recent) >= key.rpm:
                self._over(key, "rpm", use.recent[0] + _WINDOW_S - now, f"{key.rpm} requests per minute")
            if key.tpm is not None and use.spent_sum >= key.tpm:
                self._over(key, "tpm", use.spent[0][0] + _WINDOW_S - now, f"{key.tpm} tokens per minute")
            use.recent.append(now)
        if stream and key.max_streams is not None and use.streams >= key.max_streams:
            self._over(key, "streams", 1.0, f"{key.max_streams} streams in flight")
        use.requests += 1
        if stream:
            use.streams += 1

    def _over(self, key: AppKey, reason: str, wait_s: float, limit: str) -> None:
        self.refuse(key, reason)
        exc = APIError(
            429,
            f"Rate limit reached for key {key.name!r}: {limit}. Retry after Retry-After seconds.",
            type="requests",
            code="rate_limit_exceeded",
        )
        exc.retry_after = max(1.0, math.ceil(wait_s))  # type: ignore[attr-defined]  # errors.render
        raise exc

    def stream_done(self, key: AppKey) -> None:
        self._of(key).streams -= 1

    def spent(self, key_id: str, tokens: int) -> None:
        """The usage of one ended call of key `key_id` (prompt + completion tokens)."""
        use = self._use.get(key_id)
        if use is None:
            return
        use.tokens += tokens
        if use.tpm and tokens:
            use.spent.append((time.monotonic(), tokens))
            use.spent_sum += tokens

    def usage(self, key_id: str) -> dict:
        """This replica's counts of key `key_id` (`GET /v1/admin/keys`)."""
        use = self._use.get(key_id) or _Use("")
        return {
            "requests": use.requests,
            "tokens": use.tokens,
            "streams": use.streams,
            "refused": use.refused,
        }

    def collect(self):
        """Prometheus: requests, tokens, streams in flight and refusals per key name."""
        requests = CounterMetricFamily("rlproxy_key_requests", "requests admitted per key", labels=["key"])
        tokens = CounterMetricFamily(
            "rlproxy_key_tokens", "prompt + completion tokens served per key", labels=["key"]
        )
        streams = GaugeMetricFamily("rlproxy_key_streams", "streams in flight per key", labels=["key"])
        refused = CounterMetricFamily(
            "rlproxy_key_refusals", "requests refused per key and reason", labels=["key", "reason"]
        )
        for use in self._use.values():
            requests.add_metric([use.name], use.requests)
            tokens.add_metric([use.name], use.tokens)
            streams.add_metric([use.name], use.streams)
            for reason, n in use.refused.items():
                refused.add_metric([use.name, reason], n)
        return [requests, tokens, streams, refused]
