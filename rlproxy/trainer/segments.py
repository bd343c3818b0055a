"""A run's calls merged token-exactly into segments, and each sampled token's loss weight.

An agent's episode is many calls; each call's stored prompt is, most of the time, the previous
call's prompt + its sampled tokens + the new turn, token for token. Training each call as its own
sample runs that shared history again once per call. Here a run's completions are walked in `seq`
order (every choice of a call in turn) and each one is placed by the first rule that applies:

    extend   its prompt starts with a segment's tokens (previous prompts + sampled ids): only the new
             suffix is appended, as context (trained 0), then its sampled ids (trained 1, each with its
             own call's stored logprob, temperature and policy_step). The longest such segment wins.
    retry    its prompt *equals* the prompt of one of a segment's calls: an SDK retry after a timeout
             (or an agent re-asking the same thing) whose first answer nobody used. That call and every
             later one of the segment are abandoned: cut off the segment (never trained, counted
             `merge/retries` and `merge/abandoned_tokens`) and the new call continues from that prompt.
             AReaL's rule (an orphaned completion, one no later call builds on, is dropped) at the point
             of the re-send; the same prompt is never trained twice. Only an identical prompt counts: a
             prompt that merely starts like an earlier one cannot be told, by its tokens, from a
             re-rendered history, so it is a break and both leaves train (as ART's prefix tree does).
    branch   choice j > 0 of an `n > 1` call: a new segment, its copied history all context (only its
             own sampled ids train), so no token is trained twice (ART's prefix tree trains each
             leaf once, the shared prefix as context).
    break    none of the above (a template that re-renders earlier turns, a truncated history, a
             rebuilt call): a new segment from the call's stored prompt, counted (`merge/breaks`) with
             its reason and the position of the first differing token (`runs.segment_breaks`).

A call is never retokenized here (the stored ids are the text the model saw); the fallback of an
upstream without token ids (batches.rebuild_with_template) still applies, counted, and such a call
rarely extends anything. A call past `max_policy_lag`, with broken stored logprobs, or left out by
`overlong_filter` stays in its segment as context (later calls were conditioned on it) but is not
trained. A merged row is never longer than the per-call sample of its last call, so `max_seq_len`
cuts exactly as before. Segments with nothing to train are not run.

Weights. Each trained token t gets a weight w_t so that the step's loss is sum_t w_t l_t over the
whole step (all micro-batches, all ranks); "sequence" means one run (GRPO's o_i is the trajectory, as
in TRL, verl, ART and Agent Lightning), or one call with `loss_weighting=per_call`, today's behaviour:

    grpo     1 / (N_seq |seq's trained tokens|)                mean over sequences of their token mean
    gspo     the same, with one ratio per *segment* (per call with per_call): GSPO's s_i is the
             geometric mean over the response y_i (Zheng et al. 2025, eq. 7); a segment is one row of
             one forward, and when a run merges fully (the usual case) it is the run itself
    dr_grpo  1 / (N_seq L), L = `completion_budget` (per_call: max_seq_len, as before): Dr. GRPO
             divides by the generation budget, a constant, not by each response's length
    dapo     1 / (trained tokens of the step)                  token-level, as before
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlproxy.storage.training import RunData
from rlproxy.trainer.batches import _finish_reason, read_choice, sampling_temperature, usable

log = logging.getLogger(__name__)

Weighting = Literal["run", "per_call"]


@dataclass
class Segment:
    """One row of the forward pass: a run's merged calls. Per-position lists are len(ids) long."""

    run_id: str
    advantage: float
    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)  # a sampled token the loss covers
    old_logprobs: list[float] = field(default_factory=list)  # NaN where unknown (ratio 1) or context
    temperature: list[float] = field(default_factory=list)
    policy_step: list[int] = field(default_factory=list)
    call: list[int] = field(default_factory=list)  # the step-wide id of the call that sampled it; -1 context
    weight: list[float] = field(default_factory=list)  # the loss weight (set by `assign_weights`)
    calls: list[tuple[int, int]] = field(default_factory=list)  # (prompt end, call id) per call, in order

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def positions(self) -> int:
        return len(self.ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)

    def append(
        self, ids: list[int], *, trained: bool, old: list[float], temp: float, step: int, call: int
    ) -> None:
        n = len(ids)
        self.ids += ids
        self.trained += [trained] * n
        self.old_logprobs += old
        self.temperature += [temp] * n
        self.policy_step += [step] * n
        self.call += [call] * n

    def cut(self, end: int) -> int:
        """Drop every position from `end` on (an abandoned tail); returns the trained tokens dropped."""
        dropped = sum(self.trained[end:])
        for name in ("ids", "trained", "old_logprobs", "temperature", "policy_step", "call"):
            del getattr(self, name)[end:]
        self.calls = [c for c in self.calls if c[0] < end]
        return dropped

    def as_context(self, end: int) -> Segment:
        """A copy of the first `end` positions with nothing trained (the history of a branch)."""
        return Segment(
            self.run_id,
            self.advantage,
            self.ids[:end],
            [False] * end,
            [math.nan] * end,
            self.temperature[:end],
            self.policy_step[:end],
            [-1] * end,
        )


@dataclass
class MergeCounts:
    """What building the segments did; reported under batch/ (per call, as before) and merge/."""

    samples: int = 0  # trained calls (choices)
    rebuilt: int = 0
    truncated: int = 0
    dropped: int = 0
    missing_logprobs: int = 0
    invalid_logprobs: int = 0  # calls kept as context only: a stored logprob null, non-finite or a stand-in
    stale: int = 0  # calls kept as context only: drawn more than max_policy_lag adapter steps ago
    overlong: int = 0  # calls kept as context only (overlong_filter)
    sampled_tokens: int = 0  # trained tokens
    segments: int = 0  # rows that train something
    breaks: int = 0
    retries: int = 0  # calls abandoned by a later call re-asking from their prompt
    abandoned_tokens: int = 0
    branches: int = 0
    positions_merged: int = 0  # positions of the rows run
    positions_unmerged: int = 0  # what one sample per trained call would have run (prompt + completion)
    policy_steps: list[int] = field(default_factory=list)  # of each trained call
    breaks_by_run: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    segments_by_run: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        batch = ("samples", "rebuilt", "truncated", "dropped", "missing_logprobs", "invalid_logprobs")
        batch += ("stale", "overlong", "sampled_tokens")
        merge = ("segments", "breaks", "retries", "abandoned_tokens", "branches")
        merge += ("positions_merged", "positions_unmerged")
        out = {f"batch/{k}": float(getattr(self, k)) for k in batch}
        out.update({f"merge/{k}": float(getattr(self, k)) for k in merge})
        out["merge/saved_frac"] = 1.0 - self.positions_merged / max(self.positions_unmerged, 1)
        return out

    def run_breaks(self) -> dict[str, tuple[int, str | None]]:
        """Per run: (segments, JSON list of its breaks or None): the `runs` columns of migration 0010."""
        return {
            rid: (n, json.dumps(self.breaks_by_run[rid]) if self.breaks_by_run.get(rid) else None)
            for rid, n in self.segments_by_run.items()
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def build_segments(
    runs: list[RunData],
    advantages: dict[str, float],
    tokenizer: Any,
    max_seq_len: int,
    *,
    current_step: int = 0,
    max_policy_lag: int | None = None,
    overlong_filter: bool = False,
    default_temperature: float = 1.0,
    merge: bool = True,
) -> tuple[list[Segment], MergeCounts]:
    """The trainable segments of `runs` (see the module docstring); `merge=False`: one per call."""
    counts = MergeCounts()
    out: list[Segment] = []
    call_id = 0
    for run in runs:
        open_: list[Segment] = []
        breaks: list[dict[str, Any]] = []
        for comp in run.completions:
            if not usable(comp):
                continue
            n_choices = max(len(comp.token_ids or []), len((comp.response or {}).get("choices") or []), 1)
            stale = max_policy_lag is not None and current_step - (comp.policy_step or 0) > max_policy_lag
            base: tuple[Segment, int] | None = None  # where choice 0 went: (segment, prompt end)
            for choice in range(n_choices):
                c = read_choice(tokenizer, comp, choice)
                prompt, completion, old, rebuilt = c.prompt, c.completion, c.old, c.rebuilt
                if not completion:
                    continue
                if len(prompt) >= max_seq_len:
                    counts.dropped += 1
                    log.warning(
                        "run %s: a prompt of %d tokens fills max_seq_len; call dropped",
                        run.run_id,
                        len(prompt),
                    )
                    continue
                trained = True
                if stale:
                    counts.stale += 1
                    trained = False
                elif c.broken_logprobs:
                    counts.invalid_logprobs += 1
                    log.warning(
                        "run %s: a sampled token has no valid logprob; call kept as context only", run.run_id
                    )
                    trained = False
                truncated = len(prompt) + len(completion) > max_seq_len
                if trained and overlong_filter and (truncated or _finish_reason(comp, choice) == "length"):
                    counts.overlong += 1
                    trained = False
                if old is None:
                    if trained:
                        counts.missing_logprobs += 1
                    old = [math.nan] * len(completion)
                if truncated:
                    keep = max_seq_len - len(prompt)
                    completion, old = completion[:keep], old[:keep]
                if not trained:
                    old = [math.nan] * len(completion)
                # place the call: extend, retry, branch or break (module docstring)
                seg: Segment | None = None
                if merge and choice > 0 and base is not None:
                    same = prompt[: base[1]] == base[0].ids[: base[1]]
                    seg = base[0].as_context(base[1]) if same else Segment(run.run_id, advantages[run.run_id])
                    counts.branches += 1
                    open_.append(seg)
                elif merge:
                    seg = _extend(open_, prompt)
                    if seg is None:
                        seg = _retry(open_, prompt, counts)
                if seg is None:
                    seg = Segment(run.run_id, advantages[run.run_id])
                    if open_:
                        breaks.append(_why(open_, prompt, comp.seq, rebuilt))
                        counts.breaks += 1
                    open_.append(seg)
                base = (seg, len(prompt)) if choice == 0 else base
                seg.append(
                    prompt[len(seg) :],
                    trained=False,
                    old=[math.nan] * (len(prompt) - len(seg)),
                    temp=1.0,
                    step=0,
                    call=-1,
                )
                temp = sampling_temperature(comp.request, default_temperature)
                seg.calls.append((len(prompt), call_id))
                seg.append(
                    completion,
                    trained=trained,
                    old=old,
                    temp=temp,
                    step=comp.policy_step or 0,
                    call=call_id if trained else -1,
                )
                call_id += 1
                if trained:
                    counts.samples += 1
                    counts.rebuilt += rebuilt
                    counts.truncated += truncated
                    counts.sampled_tokens += len(completion)
                    counts.positions_unmerged += len(prompt) + len(completion)
                    counts.policy_steps.append(comp.policy_step or 0)
        kept = [s for s in open_ if s.num_trained]
        out += kept
        counts.segments += len(kept)
        counts.positions_merged += sum(len(s) for s in kept)
        counts.segments_by_run[run.run_id] = len(kept)
        if breaks:
            counts.breaks_by_run[run.run_id] = breaks
    counts.sampled_tokens = sum(s.num_trained for s in out)  # after retries cut some
    return out, counts


def _extend(open_: list[Segment], prompt: list[int]) -> Segment | None:
    """The longest open segment whose tokens the prompt starts with."""
    best = None
    for seg in open_:
        if (
            len(prompt) >= len(seg)
            and (best is None or len(seg) > len(best))
            and prompt[: len(seg)] == seg.ids
        ):
            best = seg
    return best


def _retry(open_: list[Segment], prompt: list[int], counts: MergeCounts) -> Segment | None:
    """A segment one of whose calls had exactly this prompt: cut there (that call on is abandoned)."""
    best: tuple[Segment, int] | None = None
    for seg in open_:
        for end, _ in seg.calls:
            if len(prompt) == end and (best is None or end > best[1]) and prompt == seg.ids[:end]:
                best = (seg, end)
    if best is None:
        return None
    seg, end = best
    abandoned = sum(1 for e, _ in seg.calls if e >= end)
    counts.retries += abandoned
    counts.abandoned_tokens += seg.cut(end)
    return seg


def _why(open_: list[Segment], prompt: list[int], seq: int, rebuilt: bool) -> dict[str, Any]:
    """A break's record: the call, why, and where it left the closest segment."""
    seg = max(open_, key=lambda s: _common_prefix(s.ids, prompt))
    at = _common_prefix(seg.ids, prompt)
    if rebuilt:
        reason = "rebuilt"  # no stored token ids: retokenized text
    elif at == len(prompt):
        reason = "shorter"  # the prompt is a strict prefix of what came before (history truncated)
    else:
        reason = "prefix_mismatch"
    return {"seq": seq, "reason": reason, "at": at, "of": len(seg)}


def assign_weights(
    segments: list[Segment],
    kind: str,
    weighting: Weighting,
    *,
    max_seq_len: int,
    completion_budget: int | None = None,
) -> None:
    """Set every segment's per-token `weight` (module docstring); 0 on context."""
    unit_of = (lambda s, t: s.call[t]) if weighting == "per_call" else (lambda s, t: s.run_id)  # noqa: E731
    tokens: dict[Any, int] = {}
    seg_tokens: list[int] = []
    segs_of_run: dict[str, int] = {}
    for s in segments:
        seg_tokens.append(s.num_trained)
        segs_of_run[s.run_id] = segs_of_run.get(s.run_id, 0) + (1 if s.num_trained else 0)
        for t, on in enumerate(s.trained):
            if on:
                u = unit_of(s, t)
                tokens[u] = tokens.get(u, 0) + 1
    n_units, total = max(len(tokens), 1), max(sum(tokens.values()), 1)
    budget = max_seq_len if weighting == "per_call" else (completion_budget or max_seq_len)
    for s, n_seg in zip(segments, seg_tokens, strict=True):
        w = []
        for t, on in enumerate(s.trained):
            if not on:
                w.append(0.0)
            elif kind == "dapo":
                w.append(1.0 / total)
            elif kind == "dr_grpo":
                w.append(1.0 / (n_units * budget))
            elif kind == "gspo" and weighting == "run":
                w.append(1.0 / (n_units * segs_of_run[s.run_id] * n_seg))
            else:  # grpo; gspo per call
                w.append(1.0 / (n_units * tokens[unit_of(s, t)]))
        s.weight = w


def default_budget(runs: list[RunData]) -> int | None:
    """dr_grpo's L when `completion_budget` is not set: the largest sum of a run's requested max_tokens
    (a call that set none counts what it sampled), over the step's runs; None when no run has calls."""
    best = 0
    for run in runs:
        total = 0
        for c in run.completions:
            req = c.request or {}
            limit = req.get("max_completion_tokens") or req.get("max_tokens")
            sampled = max((len(t or []) for t in (c.token_ids or [])), default=0)
            total += int(limit) if isinstance(limit, int) and limit > 0 else sampled
        best = max(best, total)
    return best or None
