"""Segments -> right-padded rows in micro-batches bounded by a token budget.

A micro-batch holds at most `micro_batch_size` rows and, when `micro_batch_tokens` is set, at most
that many padded positions (rows x longest row): activation memory follows the budget, not the
episode length or the number of calls. A row longer than the budget runs alone (its length is
bounded by max_seq_len). Rows are right-padded and run without an attention mask: causal attention
never lets a real position see the padding after it, and padding predicts nothing trained.

Rows usually begin with the same tokens: a group's runs start from the same task prompt, often
sample the same first tool call, and a run's segment after a break starts with the history its
previous segment holds. Those prefixes form a tree, and each of its nodes runs once per step
(model.StepPrefix): the micro-batches are planned on it, rows under the same node packed together,
and each micro-batch carries the chain of nodes it runs on (`prefix`). Within a micro-batch the rows'
longest common prefix past that (`shared`) also runs once. Only the N trained tokens are gathered:
`row`, `col` say where each sits, and the hidden state at col - 1 predicts it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlproxy.trainer.segments import Segment

MIN_SHARED = 16  # a shorter common prefix is not worth a second forward call
# padding a row may add to a micro-batch: about what a forward + backward call of its own costs, since
# a call streams every weight twice whatever its length (SmolLM2-135M, 2 cores: 116 ms at 1 position,
# 4.4 ms per position at 128-512)
PAD_LIMIT = 32


@dataclass
class Rows:
    """B right-padded rows of T positions and the N trained tokens in them."""

    input_ids: Tensor  # (B, T)
    shared: int  # the rows' longest common prefix, run once (0: every row runs whole)
    row: Tensor  # (N,) row of each trained token
    col: Tensor  # (N,) its position in the row (>= 1)
    targets: Tensor  # (N,) the sampled token ids
    old_logp: Tensor  # (N,) stored sampling logprobs, NaN where unknown
    temperature: Tensor | None  # (N,) sampling temperature of each token's call; None when all are 1
    advantages: Tensor  # (N,) the run's advantage
    weight: Tensor  # (N,) the loss weight
    policy_step: Tensor  # (N,) the adapter step that sampled each token
    ratio_group: Tensor  # (N,) gspo's ratio unit: 0..G-1, one per segment (or per call)
    segments: list[Segment] = field(default_factory=list)
    # the step's prefixes it runs on, root first: (node id, length), each node a prefix of the next,
    # each run once for every micro-batch under it (model.StepPrefix); () = none
    prefix: tuple[tuple[int, int], ...] = ()

    @property
    def prefix_len(self) -> int:
        """The positions its prefixes cover (the deepest node's length)."""
        return self.prefix[-1][1] if self.prefix else 0

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def positions(self) -> int:
        return int(self.input_ids.numel())

    def positions_run(self, prefixed: bool) -> int:
        """The positions its forward runs: each shared prefix once; `prefixed`: without the step's
        prefix (`prefix_len`, run once for its cluster)."""
        B, T = self.input_ids.shape
        P = self.prefix_len if prefixed else 0
        L = max(self.shared, P) if B > 1 else P
        return (L - P) + B * (T - L)


def collate_rows(segments: list[Segment], pad_id: int, ratio_by: str = "segment") -> Rows:
    """Pad segments into one Rows; `ratio_by` segment or call numbers gspo's ratio groups."""
    B, T = len(segments), max(len(s) for s in segments)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    row, col, old, temp, adv, weight, step, group = [], [], [], [], [], [], [], []
    groups: dict[tuple[int, int], int] = {}
    for i, s in enumerate(segments):
        input_ids[i, : len(s)] = torch.tensor(s.ids, dtype=torch.long)
        for t, on in enumerate(s.trained):
            if not on or t == 0:
                continue
            key = (i, s.call[t] if ratio_by == "call" else -1)
            row.append(i)
            col.append(t)
            old.append(s.old_logprobs[t])
            temp.append(s.temperature[t])
            adv.append(s.advantage)
            weight.append(s.weight[t] if s.weight else 0.0)
            step.append(s.policy_step[t])
            group.append(groups.setdefault(key, len(groups)))
    row_t, col_t = torch.tensor(row, dtype=torch.long), torch.tensor(col, dtype=torch.long)
    temperature = torch.tensor(temp, dtype=torch.float32)
    return Rows(
        input_ids=input_ids,
        shared=_shared_prefix(input_ids, [len(s) for s in segments]),
        row=row_t,
        col=col_t,
        targets=input_ids[row_t, col_t],
        old_logp=torch.tensor(old, dtype=torch.float32),
        temperature=temperature if bool((temperature != 1.0).any()) else None,
        advantages=torch.tensor(adv, dtype=torch.float32),
        weight=torch.tensor(weight, dtype=torch.float64),
        policy_step=torch.tensor(step, dtype=torch.long),
        ratio_group=torch.tensor(group, dtype=torch.long),
        segments=segments,
    )


def _shared_prefix(ids: Tensor, lengths: list[int]) -> int:
    """The rows' longest common prefix, at most the shortest row minus one (so every row runs on)."""
    if ids.shape[0] < 2:
        return 0
    same = (ids == ids[:1]).all(dim=0)  # (T,)
    differs = (~same).nonzero()
    n = int(differs[0]) if differs.numel() else ids.shape[1]
    n = min(n, min(lengths) - 1)
    return n if n >= MIN_SHARED else 0


def micro_batches_by_tokens(
    segments: list[Segment], pad_id: int, *, max_rows: int, max_tokens: int | None, ratio_by: str = "segment"
) -> list[Rows]:
    """Segments cut into micro-batches of <= max_rows rows and <= max_tokens padded positions (None:
    rows only), planned on the tree of their shared prefixes (`_plan`), depth first; a segment alone
    over the budget gets a micro-batch of its own."""
    out: list[Rows] = []
    _plan(segments, (), out, itertools.count(), pad_id, max_rows, max_tokens, ratio_by)
    return out


def _plan(
    part: list[Segment],
    chain: tuple[tuple[int, int], ...],
    out: list[Rows],
    ids: Iterator[int],
    pad_id: int,
    max_rows: int,
    max_tokens: int | None,
    ratio_by: str,
) -> None:
    """Micro-batches of `part`, segments that all begin with the positions `chain` covers, into `out`.

    Past its longest common prefix n, the part splits into clusters by their next MIN_SHARED tokens:
    a cluster of one is a row of this level (packed longest first), a larger one shares more and is
    planned the same way below. The prefix [chain's end, n) becomes a node of the tree when at least
    two things run on it (micro-batches or clusters below) and it is MIN_SHARED long; with one, that
    one runs it itself (a micro-batch's `shared`, or the longer node below)."""
    start = chain[-1][1] if chain else 0
    n = _common_prefix([s.ids for s in part]) if len(part) > 1 else 0
    clusters: dict[tuple[int, ...], list[Segment]] = {}
    for s in part:
        clusters.setdefault(tuple(s.ids[n : n + MIN_SHARED]), []).append(s)
    below = [c for c in clusters.values() if 1 < len(c) < len(part)]
    level = [s for c in clusters.values() if not 1 < len(c) < len(part) for s in c]
    packed = _pack(sorted(level, key=len, reverse=True), max_rows, max_tokens)
    if n - start >= MIN_SHARED and len(packed) + len(below) > 1:
        chain = (*chain, (next(ids), n))
    for p in packed:
        rows = collate_rows(p, pad_id, ratio_by)
        rows.prefix = chain
        out.append(rows)
    for c in below:
        _plan(c, chain, out, ids, pad_id, max_rows, max_tokens, ratio_by)


def _common_prefix(rows: list[list[int]]) -> int:
    """The rows' longest common prefix, at most the shortest row minus one (so every row runs on)."""
    first, n = rows[0], min(len(r) for r in rows) - 1
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return n


def _pack(ordered: list[Segment], max_rows: int, max_tokens: int | None) -> list[list[Segment]]:
    """Rows longest first into micro-batches of <= max_rows rows and <= max_tokens padded positions;
    a row joins only when the padding it adds costs less than a forward call of its own (PAD_LIMIT)."""
    out: list[list[Segment]] = []
    for s in ordered:
        cur = out[-1] if out else None
        # longest first: the micro-batch's first row is its longest, so its padded size is rows x that
        fits = cur is not None and len(cur) < max_rows and len(cur[0]) - len(s) <= PAD_LIMIT
        if fits and max_tokens is not None:
            fits = (len(cur) + 1) * len(cur[0]) <= max_tokens
        if fits:
            cur.append(s)  # type: ignore[union-attr]
        else:
            out.append([s])
    return out
