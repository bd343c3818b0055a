"""Siblings: the proxy samples more answers to stored prompts, scores them, and stores them as groups.

    poll ──> calls to branch (storage/siblings.py: new since a cursor, alone, plateau, imported), by mode,
             share (a hash of the completion id) and never a hosted policy ──> bounded queue (drops counted)
    sampler (Budget: slots, pacing, app first) ──> resample.sample: n answers, one prefill, priority 10
             ──> create_group: K members, one transaction, status scoring
    scorer loop ──> ScoreRequest (the app's stored request, K candidates) ──> build_scorer's scorer
             ──> store_scores (ready for the trainer at once) | fail_scoring (back off, then failed)

Which model samples: the call's own adapter (`completions.adapter`, `policy@step` or the base) when
the engine still serves it (`GET /v1/models`): then the app's answer is a member and K - 1 siblings
are sampled (`with_original`). When that step is gone (pruned, or replaced since), the policy's
serving adapter answers K fresh times and the app's answer is left out: an answer of another step
would share no baseline with them. `policy_step` of the group says which step sampled.

Imported calls (mode `imported`: `rlproxy import --policy NAME`'s text-only calls, traces/imports.py)
are prompts without ids and without an answer of this engine: the policy's serving adapter answers
K fresh times, on the prompt ids the engine's `/tokenize` renders from the stored messages and tools
with its chat template (resample.chat_prompt_ids), exactly as it renders a chat call. They are read
from the oldest on (history is the point) with a cursor of their own, a page no larger than the
queue's free room: a backlog waits in the store, never dropped; each is branched once (the group's
unique completion id, so a restart, which reads from the start again, finds them branched).

Sampling parameters are the call's own (its stored request's temperature, top_p, stop and
max_tokens / max_completion_tokens; without a limit: its own length when it was cut there, else
`DEFAULT_MAX_TOKENS` at least twice its length; an imported call's: `DEFAULT_MAX_TOKENS`), or
`siblings_temperature` when set. Each answer's request is stored with it, so the trainer reads its
temperature like any call's. The seed is a hash of the completion id: reproducible, and never the
app's own.

Only asyncio and httpx: the service waits on the store, the engine and the scorer, never on torch.

(Over 400 lines: choosing, sampling and scoring share the queue, the budget and the counters that
/metrics reads; the budget itself is `sibling_budget.py`, the queries `storage/siblings.py`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from rlproxy.errors import ConfigError
from rlproxy.settings import Settings
from rlproxy.storage import siblings as store
from rlproxy.storage.db import create_engine
from rlproxy.trainer import resample
from rlproxy.trainer.scorers import ScoreRequest, ScorerError, build_scorer
from rlproxy.trainer.sibling_budget import Budget

log = logging.getLogger(__name__)

MODES = ("new", "alone", "plateau", "imported")
LOOKBACK = timedelta(hours=1)  # alone/plateau read runs rewarded at most this long before the start
DEFAULT_MAX_TOKENS = 256  # a call whose request named no limit (module doc)
MAX_BACKOFF = 60.0  # seconds between two scorer attempts of a group, at most
MODELS_TTL = 5.0  # seconds a read of the engine's /v1/models is trusted
NEW_PAGES = 10  # pages of new (or imported) calls read in one poll, at most
SEEN_MAX = 100_000  # alone/plateau calls remembered as already offered


def parse_modes(spec: str) -> dict[str, frozenset[str]]:
    """`siblings` -> {policy or "*": modes}. `off`; `new,plateau` (every policy);
    `agent=new+plateau,*=off` (per policy, modes joined by `+`). ValueError on anything else."""
    out: dict[str, set[str]] = {}
    for item in (spec or "off").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, modes = item.rpartition("=") if "=" in item else ("*", "=", item)
        name = name.strip()
        wanted = {m.strip() for m in modes.split("+") if m.strip()}
        if not name or not wanted or not wanted <= {*MODES, "off"} or ("off" in wanted and len(wanted) > 1):
            raise ValueError(
                f"siblings entry {item!r}: want off, new, alone, plateau, imported or policy=new+alone"
            )
        out.setdefault(name, set()).update(wanted - {"off"})
    return {k: frozenset(v) for k, v in out.items()}


def modes_of(modes: dict[str, frozenset[str]], policy: str) -> frozenset[str]:
    """The sibling modes of `policy`: its own entry, else `*`, else none."""
    return modes.get(policy, modes.get("*", frozenset()))


def share_hit(completion_id: int, share: float) -> bool:
    """Whether a call is in the sampled share: a hash of its id, the same answer every time."""
    if share >= 1.0:
        return True
    h = int.from_bytes(hashlib.sha256(f"siblings:{completion_id}".encode()).digest()[:8], "big")
    return h / 2**64 < share


def seed_of(completion_id: int) -> int:
    """The seed of a call's siblings (module doc)."""
    return int.from_bytes(hashlib.sha256(f"siblings-seed:{completion_id}".encode()).digest()[:4], "big") >> 1


def sampling_params(call: store.BranchCall, temperature: float | None) -> dict[str, Any]:
    """temperature, top_p, max_tokens and stop of a call's siblings (module doc)."""
    req = call.request or {}
    limit = req.get("max_completion_tokens") or req.get("max_tokens") or req.get("max_output_tokens")
    if not isinstance(limit, int) or limit < 1:
        n = len(call.token_ids)
        limit = n if n and call.finish_reason == "length" else max(DEFAULT_MAX_TOKENS, 2 * n)
    stop = req.get("stop")
    stop = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    t = temperature if temperature is not None else req.get("temperature")
    top_p = req.get("top_p")
    return {
        "temperature": float(t) if isinstance(t, int | float) else 1.0,
        "top_p": float(top_p) if isinstance(top_p, int | float) and 0 < top_p <= 1 else 1.0,
        "max_tokens": int(limit),
        "stop": stop or None,
    }


def candidate(member: store.ScoringMember) -> dict[str, Any]:
    """A member as the scorer sees it: an assistant message with its finish_reason."""
    choice = ((member.response or {}).get("choices") or [{}])[0] or {}
    msg = choice.get("message")
    if isinstance(msg, dict):
        return {
            "role": "assistant",
            "content": msg.get("content"),
            "tool_calls": msg.get("tool_calls") or None,
            "finish_reason": choice.get("finish_reason"),
        }
    return resample.as_message(choice.get("text") or "", choice.get("finish_reason"))


class SiblingService:
    """Chooses calls, samples their siblings under the budget, and scores the groups (module doc)."""

    def __init__(
        self,
        settings: Settings,
        db_url: str,
        backend: Any,
        *,
        serving: Callable[[str], tuple[str, int]],
        app_busy: Callable[[], bool] | None = None,
        hosted: frozenset[str] = frozenset(),
        priority: int | None = resample.SIBLING_PRIORITY,
        poll_interval: float = 1.0,
        metrics: Any = None,
        judge: Any = None,
    ) -> None:
        try:
            self.modes = parse_modes(settings.siblings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.settings = settings
        self.db_url = db_url
        self.backend = backend
        self.serving = serving  # policy -> (model the engine serves it as, its step)
        self.hosted = hosted
        self.priority = priority
        self.poll_interval = poll_interval
        self._judge = judge  # compose's judge for scorer=judge (its endpoint defaults to the upstream)
        self.budget = Budget(settings.siblings_max_inflight, settings.siblings_max_share, app_busy)
        self.queue: list[store.BranchCall] = []
        self.counts = {"sampled": 0, "tokens": 0, "scored": 0, "failed": 0, "dropped": 0}
        self._wake = asyncio.Event()
        self._seen: dict[int, None] = {}
        self._next_try: dict[str, float] = {}
        self._models: tuple[float, frozenset[str]] = (-math.inf, frozenset())
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._engine: Any = None
        self._client: httpx.AsyncClient | None = None
        self.cursor = 0
        self.imported_cursor = 0  # imported calls are read from the oldest (module doc)
        if metrics is not None:
            metrics.attach_siblings(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start from the newest stored call (history is not branched), then poll, sample and score."""
        self._engine = create_engine(self.db_url)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.settings.scorer_timeout))
        self.scorer = build_scorer(self.settings, self._client, judge=self._judge)
        self.cursor = await store.last_completion_id(self._engine)
        self.since = datetime.now(UTC) - LOOKBACK
        for name, loop in (
            ("poll", self._poll_loop),
            ("sample", self._sample_loop),
            ("score", self._score_loop),
        ):
            self._tasks.append(asyncio.create_task(loop(), name=f"rlproxy-siblings-{name}"))
        log.info(
            "siblings: %s, K=%d, scorer %s",
            self.settings.siblings,
            self.settings.siblings_k,
            self.scorer.name,
        )

    async def stop(self) -> None:
        for t in [*self._tasks, *self._inflight]:
            t.cancel()
        for t in [*self._tasks, *self._inflight]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
        if self._engine is not None:
            await self._engine.dispose()

    async def _forever(self, what: str, once: Callable[[], Any]) -> None:
        while True:
            try:
                await once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("siblings: %s failed; trying again", what)
                await asyncio.sleep(self.poll_interval)

    # ------------------------------------------------------------------ choosing calls

    async def _poll_loop(self) -> None:
        async def once() -> None:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval)

        await self._forever("poll", once)

    async def poll_once(self) -> int:
        """Queue the calls to branch that were stored or became eligible since the last poll."""
        wanted = {m for modes in self.modes.values() for m in modes}
        calls: list[store.BranchCall] = []
        if "new" in wanted:  # a burst of calls is read in pages (up to NEW_PAGES a poll)
            for _ in range(NEW_PAGES):
                before = self.cursor
                got, self.cursor = await store.new_calls(self._engine, after=self.cursor)
                calls += got
                if self.cursor == before:
                    break
        per_run = self.settings.siblings_calls_per_run
        if "alone" in wanted:
            calls += await store.alone_calls(self._engine, since=self.since, calls_per_run=per_run)
        if "plateau" in wanted:
            calls += await store.plateau_calls(self._engine, since=self.since, calls_per_run=per_run)
        queued = 0
        for c in calls:
            if c.reason != "new":
                if c.completion_id in self._seen:
                    continue
                self._seen[c.completion_id] = None
                if len(self._seen) > SEEN_MAX:
                    self._seen.pop(next(iter(self._seen)))
            if not self.eligible(c):
                continue
            if len(self.queue) >= self.settings.siblings_queue:
                self.counts["dropped"] += 1
                continue
            self.queue.append(c)
            queued += 1
        if "imported" in wanted:
            queued += await self._poll_imported()
        if queued:
            self._wake.set()
        return queued

    async def _poll_imported(self) -> int:
        """Queue imported calls, a page no larger than the queue's free room (never dropped: the
        cursor stays at the last call read, and the rest wait in the store)."""
        queued = 0
        for _ in range(NEW_PAGES):
            room = self.settings.siblings_queue - len(self.queue)
            before = self.imported_cursor
            if room <= 0:
                break
            got, self.imported_cursor = await store.imported_calls(
                self._engine, after=before, limit=min(room, 200)
            )
            for c in got:
                if self.eligible(c):
                    self.queue.append(c)
                    queued += 1
            if self.imported_cursor == before:
                break
        return queued

    def eligible(self, c: store.BranchCall) -> bool:
        """The policy's modes name the call's reason, the share takes it, and the local engine serves it."""
        return (
            c.reason in modes_of(self.modes, c.policy)
            and c.policy not in self.hosted
            and share_hit(c.completion_id, self.settings.siblings_share)
        )

    # ------------------------------------------------------------------ sampling

    async def _sample_loop(self) -> None:
        async def once() -> None:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            await self.budget.acquire()
            task = asyncio.create_task(self._branch_logged(self.queue.pop(0)))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        await self._forever("sampler", once)

    async def _served(self) -> frozenset[str]:
        """The model names the engine serves now (its /v1/models, read at most every MODELS_TTL s)."""
        at, names = self._models
        if time.monotonic() - at < MODELS_TTL:
            return names
        assert self._client is not None
        key = self.backend.api_key
        r = await self._client.get(
            f"{self.backend.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}
        )
        r.raise_for_status()
        names = frozenset(m["id"] for m in r.json().get("data", []))
        self._models = (time.monotonic(), names)
        return names

    async def _branch_logged(self, call: store.BranchCall) -> None:
        try:
            await self._branch(call)
        except asyncio.CancelledError:
            raise
        except Exception:  # the store failed: the call is not branched (nothing half-written)
            log.exception("siblings of completion %d not stored", call.completion_id)

    async def _branch(self, call: store.BranchCall) -> None:
        """Sample one call's siblings (holding a budget slot) and store its group."""
        k = self.settings.siblings_k
        started = time.perf_counter()
        elapsed = 0.0
        gid = f"sib-{call.completion_id}"
        assert self._client is not None
        try:
            if call.reason == "imported":  # text only: K fresh answers to its rendered prompt (module doc)
                (model, step), with_original = self.serving(call.policy), False
                ids = await resample.chat_prompt_ids(
                    self._client,
                    self.backend.base_url,
                    model=model,
                    request=call.request,
                    api_key=self.backend.api_key,
                )
                call = dataclasses.replace(call, prompt_ids=ids)
            elif call.adapter and call.adapter in await self._served():
                model, step, with_original = call.adapter, call.policy_step, True
            else:
                (model, step), with_original = self.serving(call.policy), False
            n = k - 1 if with_original else k
            params = sampling_params(call, self.settings.siblings_temperature)
            seed = seed_of(call.completion_id)
            sampled = await resample.sample(
                self._client,
                self.backend.base_url,
                model=model,
                prompt_ids=call.prompt_ids,
                n=n,
                seed=seed,
                api_key=self.backend.api_key,
                priority=self.priority,
                **params,
            )
            elapsed = time.perf_counter() - started
        except (resample.ResampleError, httpx.HTTPError) as exc:
            elapsed = time.perf_counter() - started
            log.warning("siblings of completion %d not sampled: %s", call.completion_id, exc)
            self.counts["failed"] += await store.fail_sampling(
                self._engine, group_id=gid, call=call, k=k, error=str(exc)
            )
            return
        finally:
            self.budget.release(elapsed or time.perf_counter() - started)
        request = store.sampled_request(model, call.prompt_ids, **params)
        request["seed"] = seed
        created = await store.create_group(
            self._engine,
            group_id=gid,
            call=call,
            model=model,
            policy_step=step,
            members=[store.Member(s.token_ids, s.logprobs, s.text, s.finish_reason) for s in sampled],
            request=request,
            with_original=with_original,
            temperature=params["temperature"],
            sampled_tokens=sum(len(s.token_ids) for s in sampled),
            sample_ms=elapsed * 1000.0,
        )
        if created:
            self.counts["sampled"] += len(sampled)
            self.counts["tokens"] += sum(len(s.token_ids) for s in sampled)
            self._wake_scorer()

    # ------------------------------------------------------------------ scoring

    def _wake_scorer(self) -> None:
        ev = getattr(self, "_score_wake", None)
        if ev is not None:
            ev.set()

    async def _score_loop(self) -> None:
        self._score_wake = asyncio.Event()

        async def once() -> None:
            await self.score_once()
            self._score_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._score_wake.wait(), self.poll_interval)

        await self._forever("scorer", once)

    async def score_once(self) -> int:
        """Score every group waiting whose back-off has passed; returns the groups scored."""
        done = 0
        now = time.monotonic()
        for g in await store.scoring_groups(self._engine, limit=64):
            if self._next_try.get(g.group_id, 0.0) > now:
                continue
            req = ScoreRequest(
                group_id=g.group_id,
                policy=g.policy,
                endpoint=g.endpoint,
                request=g.request,
                candidates=[candidate(m) for m in g.members],
                scorer_url=g.scorer_url,  # a key's own scorer sees only its own app's calls
            )
            try:
                scores = await self.scorer.score(req)
                if len(scores) != len(g.members) or not all(math.isfinite(float(s)) for s in scores):
                    raise ScorerError(f"{len(scores)} scores for {len(g.members)} candidates, or not finite")
            except Exception as exc:  # a ScorerError, or a scorer's bug: never trained on a guess
                why = str(exc) if isinstance(exc, ScorerError) else f"{type(exc).__name__}: {exc}"
                failed = await store.fail_scoring(
                    self._engine, g.group_id, why, max_attempts=self.settings.scorer_max_attempts
                )
                self._next_try[g.group_id] = now + min(MAX_BACKOFF, 2.0 ** (g.attempts + 1) * 0.25)
                log.warning(
                    "sibling group %s: scorer failed (%s)%s", g.group_id, why, "; failed" if failed else ""
                )
                if failed:
                    self.counts["failed"] += 1
                    self._next_try.pop(g.group_id, None)
                continue
            scored = {m.run_id: float(s) for m, s in zip(g.members, scores, strict=True)}
            await store.store_scores(self._engine, g.group_id, scored, self.scorer.name)
            self._next_try.pop(g.group_id, None)
            self.counts["scored"] += 1
            done += 1
        return done

    def stats(self) -> dict[str, float]:
        """What /metrics shows (proxy/metrics.py reads it at scrape time)."""
        return {
            **{k: float(v) for k, v in self.counts.items()},
            "engine_seconds": self.budget.engine_seconds,
            "queue": float(len(self.queue)),
            "in_flight": float(self.budget.in_flight),
            "share": self.budget.share(),
        }
