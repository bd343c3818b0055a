"""The embedded engine: one worker thread that owns the model and decodes every request in one batch.

Why a single thread: torch code is synchronous and the model (plus its peft wrapper) must not be
mutated while a forward pass runs. The async HTTP layer puts `GenRequest`s into a queue and gets
`RowDelta`s back through a thread-safe callback; nothing here touches the event loop.

Continuous batching: between two decode steps the worker admits waiting requests (prefills them
together, left-padded, then splices their KV cache into the running batch) and drops rows that
finished, so a request never waits for a whole wave to end. Each row carries its own position ids,
sampling parameters, `torch.Generator` and LoRA slot, so its tokens do not depend on its neighbours.

Prefill does as little as it can (issue 21): identical prompts of one admission (`n` > 1, a group's
first calls) are prefilled once and their KV copied to each row; a prompt that starts with tokens
already seen under the same adapter reuses their KV from the prefix cache (`prefix_cache.py`) and
prefills only the rest; only the last position's logits are computed (`logits_to_keep=1`).

Priority (issue 54): waiting requests are admitted lowest `priority` first, FIFO within a priority,
so an app request (0) waiting for a free row goes before the proxy's own sibling requests (10).

Cancellation (issue 22): `cancel` goes through the inbox behind the request it names, so it can
never be lost; the worker drops the rows between two decode steps and frees their slots at once.

    submit(req) ──queue──> worker: admit → prefill → [decode step → sample → emit]* → release

(Over 400 lines: the worker loop and the batch state it alone owns read best in one place; the
tensor surgery on the batch's KV is in `kvbatch.py`, the prefix cache in `prefix_cache.py`.)
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from rlproxy.errors import AdapterError, ModelError
from rlproxy.inference import kvbatch
from rlproxy.inference.adapters import BASE_SLOT, AdapterSlots
from rlproxy.inference.prefix_cache import PrefixCache
from rlproxy.inference.sampling import SamplingParams, TokenLogprob, make_generator, sample, token_logprob
from rlproxy.inference.shared_base import twin_model
from rlproxy.inference.skinny import SplitLinears
from rlproxy.inference.textstream import TextStream
from rlproxy.omp import release_workers

log = logging.getLogger(__name__)


@dataclass
class RowDelta:
    """What one choice produced in one step: new tokens, the text they completed, maybe the end."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class GenRequest:
    """One completion request: `n` rows sharing a prompt. `sink` is called from the worker thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[RowDelta], None]
    n: int = 1
    adapter: str | None = None  # adapter name, None = base model
    priority: int = 0  # admitted lowest first, FIFO within a priority (app 0, siblings 10)
    salt: str | None = None  # `cache_salt`: prefix-cache entries are shared only under the same salt


@dataclass
class _Row:
    req: GenRequest
    index: int
    generator: torch.Generator
    slot: str
    text: TextStream
    max_tokens: int
    out_ids: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Position id of the last sampled token, the one the next step feeds."""
        return len(self.req.prompt_ids) + len(self.out_ids) - 1


class Engine:
    """A causal LM served from one worker thread with continuous batching and per-row LoRA."""

    def __init__(
        self,
        model_path: str,
        *,
        served_name: str | None = None,
        threads: int | None = None,
        max_batch: int = 16,
        prefix_cache_bytes: int = 0,
        default_max_tokens: int | None = None,
    ) -> None:
        self.model_path = model_path
        self.served_name = served_name or model_path
        self.threads = threads
        self.max_batch = max_batch  # rows decoded together; more requests wait in the queue
        self.default_max_tokens = default_max_tokens  # cap of a request without max_tokens (None: context)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model from {model_path}: {exc}") from exc
        model.eval()
        self._split = SplitLinears(model)  # decode steps read the weights on every thread (skinny.py)
        self.adapters = AdapterSlots(model, self.served_name)
        cfg = model.config
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        self.eos_ids = _eos_ids(model, self.tokenizer)
        # like vLLM's `--generation-config auto`: the model's own sampling defaults, if it has any
        gc = getattr(model, "generation_config", None)
        self.sampling_defaults = {
            k: float(v) for k in ("temperature", "top_p") if (v := getattr(gc, k, None)) is not None
        }
        # transformers renamed `past_key_values` to `cache` (the old name warns until 5.40)
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._cancelled: set[str] = set()  # worker thread only (cancels arrive through the inbox)
        self._thread: threading.Thread | None = None
        self._stopping = False
        # batch state, worker thread only
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (B, T) 1 = real token, 0 = left padding
        self.stats = {
            "steps": 0,
            "max_rows": 0,
            "requests": 0,
            "tokens": 0,  # tokens sampled (decoded), all rows
            "prefill_tokens": 0,  # prompt positions run through the model
            "prompt_tokens": 0,  # prompt positions of admitted rows (what a naive prefill runs)
            "cancelled": 0,  # rows dropped by cancel()
            "prefill_seconds": 0.0,  # worker time in prefill forwards (and their first sample)
            "decode_seconds": 0.0,  # worker time in decode steps (forward, sample, emit)
            "decode_steps": 0,
            "decode_rows": 0,  # rows summed over decode steps: / decode_steps = the mean batch
        }

    # ---- public, any thread ---------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlproxy-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Abort what is running and stop the worker."""
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, req: GenRequest) -> None:
        """Queue a request; its deltas arrive through `req.sink` from the worker thread."""
        self._inbox.put(req)

    def cancel(self, request_id: str) -> None:
        """Stop decoding a request (client went away); its rows end with finish_reason "abort" and their
        slots are free before the next decode step."""
        self._inbox.put(("cancel", request_id))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread between two decode steps (adapter loads, inspection)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def shared_base(self) -> concurrent.futures.Future:
        """A twin of the base model made of the engine's own weight tensors (`shared_base.py`), for a
        trainer in this process to put its own LoRA on; built on the worker thread."""
        return self.call(lambda: twin_model(self.adapters.base))

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> concurrent.futures.Future:
        """Load a LoRA adapter on the worker thread; the future raises AdapterError(status=...).
        A reload in place drops the prefix-cache entries of the weights it replaces."""

        def load() -> None:
            try:
                self.adapters.load(name, path, load_inplace)
            finally:
                self.prefix_cache.retain(self.adapters.live_slots())

        return self.call(load)

    def unload_adapter(self, name: str) -> concurrent.futures.Future:
        """Unload a LoRA adapter on the worker thread; the future raises AdapterError(404) if unknown."""

        def unload() -> None:
            try:
                self.adapters.unload(name)
            finally:
                self.prefix_cache.retain(self.adapters.live_slots())

        return self.call(unload)

    # ---- worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP settings are per thread: this one does the work
        waiting: list[GenRequest] = []
        while not self._stopping:
            block = not self._rows and not waiting
            if block:  # idle until the next request: its OpenMP workers would slow a trainer's
                release_workers()
            try:
                self._drain(waiting, block)
                self._drop_cancelled(waiting)
                self._admit(waiting)
                if self._rows:
                    self._step()
            except Exception:  # a bug must not kill the engine: fail the rows, keep serving
                log.exception("engine step failed; aborting %d rows", len(self._rows))
                self._fail_all("error")
        self._fail_all("abort")
        for req in waiting:
            for i in range(req.n):
                req.sink(RowDelta(i, [], "", [], "abort"))

    def _drain(self, waiting: list[GenRequest], block: bool) -> None:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is None:
                self._stopping = True
            elif isinstance(item, GenRequest):
                waiting.append(item)
            elif item[0] == "cancel":
                self._cancelled.add(item[1])
            elif item[0] == "call":
                _, fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # delivered to the caller, never raised here
                    fut.set_exception(exc)
        waiting.sort(key=_priority)  # lowest priority first; the sort is stable: FIFO within one

    def _drop_cancelled(self, waiting: list[GenRequest]) -> None:
        if not self._cancelled:
            return
        for req in [r for r in waiting if r.request_id in self._cancelled]:
            waiting.remove(req)
            for i in range(req.n):
                req.sink(RowDelta(i, [], "", [], "abort"))
        keep = []
        for b, row in enumerate(self._rows):
            if row.req.request_id in self._cancelled:
                self._remember(b, row)  # an SDK's retry sends the same prompt again
                row.req.sink(RowDelta(row.index, [], "", [], "abort"))
                self.adapters.release(row.slot)
                self.stats["cancelled"] += 1
            else:
                keep.append(b)
        if len(keep) != len(self._rows):
            self._select(keep)
        active = {r.req.request_id for r in self._rows} | {r.request_id for r in waiting}
        self._cancelled &= active

    @torch.inference_mode()
    def _admit(self, waiting: list[GenRequest]) -> None:
        """Prefill waiting requests that fit and splice them into the running batch."""
        new_rows: list[_Row] = []
        while waiting and (
            not self._rows
            and not new_rows
            or len(self._rows) + len(new_rows) + waiting[0].n <= self.max_batch
        ):
            req = waiting.pop(0)
            try:
                slot = self.adapters.acquire(req.adapter)
            except AdapterError:  # unloaded between validation and admission
                for i in range(req.n):
                    req.sink(RowDelta(i, [], "", [], "abort", "adapter unloaded"))
                continue
            self.stats["requests"] += 1
            budget = self.max_model_len - len(req.prompt_ids)
            max_tokens = min(req.params.max_tokens or self.default_max_tokens or budget, budget)
            for i in range(req.n):
                if i > 0 and slot != BASE_SLOT:
                    self.adapters.acquire(req.adapter)
                stream = TextStream(self.tokenizer, req.params.stop)
                new_rows.append(_Row(req, i, make_generator(req.params.seed, i), slot, stream, max_tokens))
        if not new_rows:
            return
        # identical (adapter, prompt) pairs are prefilled once: `unique[u]` feeds rows `source == u`
        unique: dict[tuple[str, str | None, tuple[int, ...]], int] = {}
        source = [
            unique.setdefault((r.slot, r.req.salt, tuple(r.req.prompt_ids)), len(unique)) for r in new_rows
        ]
        firsts = [new_rows[source.index(u)] for u in range(len(unique))]
        t0 = time.perf_counter()
        try:
            cache, mask, logits = self._prefill(firsts)  # (U, ...), logits (U, V)
        except Exception:  # only these rows fail; the running batch goes on
            log.exception("prefill of %d rows failed", len(new_rows))
            for row in new_rows:
                row.req.sink(RowDelta(row.index, [], "", [], "error"))
                self.adapters.release(row.slot)
            return
        self.stats["prompt_tokens"] += sum(len(r.req.prompt_ids) for r in new_rows)
        if self.prefix_cache.enabled:
            for u, row in enumerate(firsts):
                kv = kvbatch.row_kv(cache, mask, u)
                self.prefix_cache.put(row.slot, row.req.prompt_ids, *kv, salt=row.req.salt)
        if len(firsts) != len(new_rows):
            index = torch.tensor(source)
            cache, mask = kvbatch.expand(cache, mask, index)
            logits = logits.index_select(0, index)
        self._splice(new_rows, cache, mask)
        self._emit(new_rows, logits)
        self.stats["prefill_seconds"] += time.perf_counter() - t0

    def _prefill(self, rows: list[_Row]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Run `rows`' prompts through the model after their cached prefixes: (cache, mask, logits)."""
        found = [self.prefix_cache.lookup(r.slot, r.req.prompt_ids, r.req.salt) for r in rows]
        cache, past_mask = kvbatch.past_cache(found)  # (U, H, K, D), (U, K)
        suffixes = [r.req.prompt_ids[c:] for r, (_, c) in zip(rows, found, strict=True)]
        length = max(len(s) for s in suffixes)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (length - len(s)) + s for s in suffixes])  # (U, M)
        new_mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in suffixes])
        mask = torch.cat([past_mask, new_mask], dim=1)  # (U, K + M)
        # per-row positions counted over real tokens only, whatever padding sits where
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_mask.shape[1] :]  # (U, M)
        self.stats["prefill_tokens"] += sum(len(s) for s in suffixes)
        logits = self._forward(ids, mask, positions, cache, [r.slot for r in rows])  # (U, V)
        return cache, mask, logits

    @torch.inference_mode()
    def _step(self) -> None:
        """One decode step for every running row."""
        assert self._mask is not None
        t0 = time.perf_counter()
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(self._rows)
        ids = torch.tensor([[r.out_ids[-1]] for r in self._rows])  # (B, 1)
        self._mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=self._mask.dtype)], dim=1)
        positions = torch.tensor([[r.position] for r in self._rows])  # (B, 1)
        self._split.parts = torch.get_num_threads()
        try:
            logits = self._forward(ids, self._mask, positions, self._cache, [r.slot for r in self._rows])
        finally:
            self._split.parts = 0
        self._emit(self._rows, logits)
        self.stats["decode_seconds"] += time.perf_counter() - t0

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        slots: list[str],
    ) -> torch.Tensor:
        # each row through its own LoRA: peft's plain path when the rows share one, else its mixed batch
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, **self.adapters.forward_kwargs(slots)}
        out = self.adapters.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,  # the LM head on the last position only: never (B, T, V) at prefill
            **kwargs,
        )
        self.stats["steps"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], ids.shape[0])
        return out.logits[:, -1, :].float()  # (B, V)

    def _emit(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample one token per row, send its delta, then drop the rows that finished."""
        logprobs = torch.log_softmax(logits, dim=-1)  # (B, V) raw distribution, before temperature
        keep: list[int] = []
        all_rows = self._rows
        offset = 0 if rows is all_rows else len(self._rows) - len(rows)  # new rows sit at the end
        for b, row in enumerate(rows):
            p = row.req.params
            tok = sample(logits[b], p, row.generator)
            row.out_ids.append(tok)
            self.stats["tokens"] += 1
            lps = [token_logprob(logprobs[b], tok, p.top_logprobs)] if p.logprobs else []
            finish, stop_reason = None, None
            is_eos = tok in self.eos_ids and not p.ignore_eos
            if is_eos or tok in p.stop_token_ids:
                finish, stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
            text, hit = row.text.push(tok, final=finish is not None)
            if hit is not None:
                finish, stop_reason = "stop", hit
            elif finish is None and len(row.out_ids) >= row.max_tokens:
                finish = "length"
                text += row.text.flush()
            row.req.sink(RowDelta(row.index, [tok], text, lps, finish, stop_reason))
            if finish is None:
                keep.append(b)
            else:
                self._remember(offset + b, row)
                self.adapters.release(row.slot)
        if len(keep) != len(rows):
            self._select(list(range(offset)) + [offset + k for k in keep])

    def _remember(self, b: int, row: _Row) -> None:
        """Keep a finishing row's KV (prompt + sampled ids but the last, never fed) for its next call."""
        if not self.prefix_cache.enabled or self._cache is None or self._mask is None:
            return
        if row.slot not in self.adapters.live_slots():  # its adapter was reloaded meanwhile
            return
        tokens = row.req.prompt_ids + row.out_ids[:-1]
        keys, values = kvbatch.row_kv(self._cache, self._mask, b)
        if keys and keys[0].shape[1] == len(tokens):
            self.prefix_cache.put(row.slot, tokens, keys, values, salt=row.req.salt)

    def _splice(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled rows to the running batch, left-padding whichever side is shorter."""
        if not self._rows or self._cache is None or self._mask is None:
            self._rows, self._cache, self._mask = list(rows), cache, mask
            return
        self._mask = kvbatch.splice(self._cache, self._mask, cache, mask)
        self._rows.extend(rows)

    def _select(self, keep: list[int]) -> None:
        """Keep only rows `keep` and trim padding columns no remaining row needs."""
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        assert self._cache is not None and self._mask is not None
        self._mask = kvbatch.select(self._cache, self._mask, keep)
        self._rows = [self._rows[k] for k in keep]

    def _fail_all(self, reason: str) -> None:
        for row in self._rows:
            try:
                row.req.sink(RowDelta(row.index, [], "", [], reason))
                self.adapters.release(row.slot)
            except Exception:
                log.exception("could not fail a row")
        self._rows, self._cache, self._mask = [], None, None


def _priority(req: GenRequest) -> int:
    return req.priority


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
