"""The policy being trained: the base model plus one LoRA adapter, and its log-probabilities.

Plain transformers + peft on every device (an untested fast path is worse than none: `make gpu-check`
runs a step on CUDA). Training mode without dropout, so the trainer's log-probabilities are the
ones the server sampled from; on CUDA the weights are bf16 and the LM head fp32 (a bf16 head rounds
log-probabilities by ~1e-2, the noise floor of every importance ratio). The reference model of the
KL term is the same weights with the adapter switched off, so it costs no memory, only a forward.

train_step runs `row_logprobs`: the decoder body on merged rows, then the LM head only at the
positions that predict trained tokens, in chunks whose probabilities backward reuses within a byte
budget (no (B, T, V) logits); SFT (sft.py) runs `row_logprobs` too. (Over 400 lines: loading the
policy and its one forward, with the step's shared prefixes and the chunked head's own backward.)
"""

from __future__ import annotations

import collections
import inspect
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from rlproxy.errors import ModelError
from rlproxy.inference.lora_fused import fuse_lora
from rlproxy.trainer.config import TrainerConfig
from rlproxy.trainer.rows import Rows

log = logging.getLogger(__name__)


def pick_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train_dtype(device: torch.device) -> torch.dtype:
    """The trainer's weights: bf16 on CUDA, fp32 on CPU (where body_autocast may run the matmuls in bf16)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated, slow."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, private: may go away
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def body_autocast(device: torch.device, setting: str) -> torch.dtype | None:
    """The dtype of the decoder body's matmuls under autocast (setting `train_autocast`); None: as loaded.

    CPU only: there the weights stay fp32 and bf16 autocast rounds each matmul's inputs (its outputs
    add into the fp32 residual stream): the directory step 1.3-1.5x faster on Zen 4 (bench/trainer.py
    --shape directory), its gradient at cosine 0.9985 to fp32's, kl/lag0 3.6e-4 against the fp32
    engine; inside `serve` only ~10% per step, so it is off by default (docs/training.md). CUDA loads
    bf16 weights instead.
    """
    if device.type != "cpu" or setting == "off":
        return None
    return torch.bfloat16 if setting == "bf16" or native_bf16() else None


def _body_precision(model: Any) -> Any:
    dtype = getattr(model, "rlproxy_autocast", None)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()


def load_policy(
    model_path: str, config: TrainerConfig, adapter_dir: str | None = None, base: Any = None
) -> tuple[Any, Any]:
    """(peft model, tokenizer) for `model_path` with a fresh LoRA adapter, or the one saved in `adapter_dir`.

    The model is in train mode with only the LoRA weights trainable and the base model's dropout off.
    `base`: the base model already in memory (the embedded engine's weights, `inference/shared_base.py`),
    used instead of loading it again; it must be on the trainer's device and dtype.
    """
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = pick_device()
    dtype = train_dtype(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if base is None:
            base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the base model from {model_path}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    base.config.use_cache = False  # training never decodes; the KV cache only costs memory
    disable_dropout(base)
    if dtype != torch.float32:
        fp32_lm_head(base)
    if config.gradient_checkpointing:
        # non-reentrant: gradients reach the LoRA weights without inputs that require grad
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(config.seed)  # LoRA's A matrices are random: same seed, same start
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    else:
        model = get_peft_model(base, _lora_config(base, config))
    fuse_lora(model)  # the LoRA product accumulates into the base layer's output (lora_fused.py)
    # read by row_hidden_states and StepPrefix
    model.rlproxy_autocast = body_autocast(device, config.train_autocast)
    if model.rlproxy_autocast is not None:
        log.info("trainer: decoder body under %s autocast (setting train_autocast)", model.rlproxy_autocast)
    model.train()
    return model, tokenizer


def _lora_config(model: Any, config: TrainerConfig) -> Any:
    from peft import LoraConfig

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in config.lora_target_modules if t in present]
    if not targets:
        raise ModelError(f"none of lora_target_modules {config.lora_target_modules} exist in the model")
    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout of `model` (modules, and attention dropout kept as a float attribute).

    The server samples without dropout; a training forward with it would see another policy, and
    every importance ratio would carry that noise (TRL's `disable_dropout`).
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def fp32_lm_head(model: Any) -> None:
    """Compute the logits in fp32: a frozen fp32 copy of the LM head, fed fp32 hidden states.

    A copy, so tied input embeddings stay in the model's dtype; the head is frozen (LoRA never
    targets it), so the copy never drifts from the original.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        log.warning("LM head is %s, not a Linear: kept in %s", type(head).__name__, head.weight.dtype)
        return
    fp32 = torch.nn.Linear(
        head.in_features, head.out_features, bias=head.bias is not None, device=head.weight.device
    )
    with torch.no_grad():
        fp32.weight.copy_(head.weight)
        if head.bias is not None:
            fp32.bias.copy_(head.bias)
    fp32.requires_grad_(False)
    fp32.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:]))
    model.config.tie_word_embeddings = False  # a later tie_weights() must not put the bf16 one back
    model.set_output_embeddings(fp32)


def gradient_checkpointing(model: Any) -> bool:
    """True when the model recomputes activations in backward (then no KV cache survives a forward)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the new name, then the old
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _cache_kwarg(model: Any) -> str:
    # transformers renamed `past_key_values` to `cache` (the old name warns until 5.40)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The LoRA weights (what the optimizer updates)."""
    return [p for p in model.parameters() if p.requires_grad]


def default_temperature(model: Any) -> float:
    """The temperature the server samples at when a request sets none: the model's generation config's
    (the embedded engine, and vLLM's `--generation-config auto`), else 1."""
    t = getattr(getattr(model, "generation_config", None), "temperature", None)
    return float(t) if t is not None else 1.0


# --- merged segments: the decoder body once, the LM head only where a sampled token is predicted ---

HEAD_CHUNK = 256  # positions per LM-head chunk: (256, V) fp32 is 50 MB at V = 49k, 150 MB at 150k


def _body_and_head(model: Any) -> tuple[Any, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


class StepPrefix:
    """A prefix that several micro-batches of a step share (a group's task prompt), run once.

    Its keys/values and hidden states are handed to each micro-batch as leaf tensors; each
    micro-batch's backward adds its gradient into them, and `backward()`, after the last of them,
    runs the prefix's own backward once with the sums. Values and gradients are those of running
    the prefix in every micro-batch (tests/trainer/test_merged_step.py), for (M - 1) x L fewer
    positions. Its activations are kept until then: one row of L positions beyond the budget.
    With a `parent` (a shorter prefix of the same rows) only the tokens past it run, on its cache;
    the leaves then cover the whole prefix, and the backward sends the parent its share.
    """

    def __init__(self, model: Any, ids: Tensor, parent: StepPrefix | None = None) -> None:
        decoder, _ = _body_and_head(model)
        device = next(model.parameters()).device
        start = parent.length if parent is not None else 0
        L = start + ids.shape[-1]
        kw = _cache_kwarg(model)
        on = {kw: parent.cache(1)} if parent is not None else {}
        with _body_precision(model):
            out = decoder(
                input_ids=ids[None].to(device),
                position_ids=torch.arange(start, L, device=device)[None],
                use_cache=True,
                **on,
            )
        cache = getattr(out, kw)  # the parent's keys/values and these, concatenated
        hidden = out.last_hidden_state
        if parent is not None:
            hidden = torch.cat([parent.hidden(1), hidden], dim=1)
        self.length = L
        self._outputs = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        self._outputs.append(hidden)
        self._leaves = [t.detach().requires_grad_(t.requires_grad) for t in self._outputs]

    def cache(self, batch: int) -> Any:
        """A cache (DynamicCache) of the prefix for `batch` rows (views: gradients add up in the leaves)."""
        from transformers import DynamicCache

        kv = self._leaves[:-1]
        return DynamicCache(
            [
                (kv[i].expand(batch, -1, -1, -1), kv[i + 1].expand(batch, -1, -1, -1))
                for i in range(0, len(kv), 2)
            ]
        )

    def hidden(self, batch: int) -> Tensor:
        return self._leaves[-1].expand(batch, -1, -1)

    def backward(self) -> None:
        """The prefix's backward, once, with what every micro-batch's backward added up."""
        pairs = [
            (o, leaf.grad)
            for o, leaf in zip(self._outputs, self._leaves, strict=True)
            if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._outputs, self._leaves = [], []


class StepPrefixes:
    """The step's tree of prefixes (planned by rows.micro_batches_by_tokens) as the step runs it.

    A node runs once, when the first micro-batch under it comes (after its parent); its backward
    runs once everything on it (micro-batches, longer nodes) has had its own, then it is its parent's
    turn. The micro-batches come depth first, so only the nodes on the current path are alive.
    """

    def __init__(self, model: Any, batches: list[Rows]) -> None:
        self._model = model
        self._nodes: dict[int, StepPrefix] = {}
        self._parent: dict[int, int] = {}
        self._left: collections.Counter[int] = collections.Counter()  # what still runs on each node
        for b in batches:
            if b.num_tokens and b.prefix:
                self._left[b.prefix[-1][0]] += 1
                self._parent.update({c: p for (p, _), (c, _) in zip(b.prefix, b.prefix[1:], strict=False)})
        for p in self._parent.values():
            self._left[p] += 1
        self.positions = 0  # the positions the nodes ran

    def enter(self, rows: Rows) -> StepPrefix | None:
        """The deepest node `rows` runs on, its missing ancestors and itself run first; None: none."""
        node = None
        for nid, length in rows.prefix:
            if nid not in self._nodes:
                start = node.length if node is not None else 0
                self._nodes[nid] = StepPrefix(self._model, rows.input_ids[0, start:length], node)
                self.positions += length - start
            node = self._nodes[nid]
        return node

    def leave(self, rows: Rows) -> None:
        """After the backward of `rows`: the backward of each node nothing else runs on any more."""
        nid: int | None = rows.prefix[-1][0] if rows.prefix else None
        while nid is not None:
            self._left[nid] -= 1
            if self._left[nid]:
                return
            self._nodes.pop(nid).backward()
            nid = self._parent.get(nid)


def row_hidden_states(model: Any, rows: Rows, prefix: StepPrefix | None = None) -> Tensor:
    """The decoder's last hidden states (B, T, H) of the rows (no LM head, no logits), under the
    policy's autocast (body_autocast): still fp32 then, as the residual stream and its final norm are.

    With a shared prefix of L tokens it runs once (1, L) and its keys/values are fanned out to the B
    rows, whose remaining T - L positions then run on top; the gradient flows back through the
    fan-out, so values and gradients are those of running every row whole (tests/trainer/test_segments.py).
    `prefix`: the first `prefix.length` of those tokens, already run for the step (StepPrefix).
    Gradient checkpointing keeps no KV cache: then every row runs whole.
    """
    with _body_precision(model):
        return _row_hidden_states(model, rows, prefix)


def _row_hidden_states(model: Any, rows: Rows, prefix: StepPrefix | None) -> Tensor:
    decoder, _ = _body_and_head(model)
    device = next(model.parameters()).device
    ids = rows.input_ids.to(device)
    B, T = ids.shape
    L = rows.shared
    kw = _cache_kwarg(model)
    if prefix is not None:
        P = prefix.length
        parts = [prefix.hidden(B)]
        if L > P and B > 1:  # these rows share more: that part once, on top of the step's prefix
            mid = decoder(
                input_ids=ids[:1, P:L],
                position_ids=torch.arange(P, L, device=device)[None],
                **{kw: prefix.cache(1)},
                use_cache=True,
            )
            cache = getattr(mid, kw)
            cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))
            parts.append(mid.last_hidden_state.expand(B, -1, -1))
        else:
            L, cache = P, prefix.cache(B)
        rest = decoder(
            input_ids=ids[:, L:],
            position_ids=torch.arange(L, T, device=device)[None].expand(B, -1),
            **{kw: cache},
            use_cache=True,
        )
        return torch.cat([*parts, rest.last_hidden_state], dim=1)
    if L and B > 1 and not gradient_checkpointing(model):
        first = decoder(
            input_ids=ids[:1, :L], position_ids=torch.arange(L, device=device)[None], use_cache=True
        )
        cache = getattr(first, kw)
        cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))  # (1, ...) -> (B, ...)
        rest = decoder(
            input_ids=ids[:, L:],
            position_ids=torch.arange(L, T, device=device)[None].expand(B, -1),
            **{kw: cache},
            use_cache=True,
        )
        return torch.cat([first.last_hidden_state.expand(B, -1, -1), rest.last_hidden_state], dim=1)
    position_ids = torch.arange(T, device=device)[None].expand(B, -1)
    return decoder(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state


def _chunk_stats(
    z: Tensor, targets: Tensor, inv_temp: Tensor | None, probs: bool = False
) -> tuple[Tensor, ...]:
    """(logp at T, raw logp at T = 1, entropy at T, target is argmax, logsumexp at T), each (n,), of
    n positions' fp32 logits z (n, V). z is overwritten: it ends as the tempered log-probabilities,
    or with `probs` as the tempered probabilities (what the head's backward needs).

    A few rows at a time (_row_blocks), so that the half-dozen passes over each row run in cache
    rather than each pass over the whole (n, V) chunk in DRAM."""
    parts = []
    for rows in _row_blocks(z.shape[0], z.shape[-1]):
        zb, yb = z[rows], targets[rows].unsqueeze(-1)
        lse = torch.logsumexp(zb, dim=-1)  # at T = 1
        raw = zb.gather(-1, yb).squeeze(-1) - lse
        top = zb.argmax(-1) == yb.squeeze(-1)  # SFT's token accuracy
        if inv_temp is not None:  # tempered: a second logsumexp; at T = 1 the first is the one
            lse = torch.logsumexp(zb.mul_(inv_temp[rows].unsqueeze(-1)), dim=-1)
        logp = zb.sub_(lse.unsqueeze(-1)).gather(-1, yb).squeeze(-1)
        p = zb.exp()
        entropy = -p.mul(zb).nansum(-1)  # p log p; at a -inf logit 0 x -inf is NaN, which nansum drops
        if probs:
            zb.copy_(p)
        parts.append((logp, raw, entropy, top, lse))
    logp, raw, entropy, top, lse = (torch.cat(x) for x in zip(*parts, strict=True))
    return logp, raw, entropy, top, lse


BLOCK_BYTES = 2 * 2**20  # rows of (n, V) fp32 per in-cache pass of _chunk_stats: ~10 rows at V = 49k


def _row_blocks(n: int, vocab: int) -> list[slice]:
    step = max(1, BLOCK_BYTES // (4 * vocab))
    return [slice(r, r + step) for r in range(0, n, step)]


HEAD_KEEP_BYTES = 256 * 2**20  # per row_logprobs call: the tempered probabilities kept for backward


def _frozen_linear(head: Any) -> bool:
    """True for a plain frozen linear head: its backward into h is dz @ weight, nothing to recompute."""
    weight = getattr(head, "weight", None)
    return (
        isinstance(head, torch.nn.Linear)
        and isinstance(weight, Tensor)
        and not any(p.requires_grad for p in head.parameters())
    )


class _HeadLogprobs(torch.autograd.Function):
    """The LM head and the log-softmax of n positions (n, H) -> (logp, raw, entropy, top), each (n,).

    Only logp has a gradient, d logp / d z = (onehot(y) - p) / T, sent through the head once. The (n, V)
    logits are never kept as an autograd graph. With `keep` (a frozen linear head, within
    HEAD_KEEP_BYTES) forward keeps the tempered probabilities p and backward turns them into dz in
    place and multiplies by the weight: the head's matmul runs twice per step, not three times. Else
    (a trained head, or past the budget) forward keeps only h and the logsumexp (n,) and backward
    recomputes the logits and rebuilds p from them (activation checkpointing of the head by hand).
    """

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, targets: Tensor, inv_temp: Tensor | None, head: Any, keep: bool = False
    ) -> tuple[Tensor, ...]:
        with torch.no_grad():
            z = head(h).float()
            logp, raw, entropy, top, lse = _chunk_stats(z, targets, inv_temp, probs=keep)
        ctx.head, ctx.keep, ctx.h_dtype = head, keep, h.dtype
        ctx.save_for_backward(z if keep else h, targets, inv_temp, lse)
        ctx.mark_non_differentiable(raw, entropy, top)
        return logp, raw, entropy, top

    @staticmethod
    def backward(ctx: Any, g: Tensor, *_: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        saved, targets, inv_temp, lse = ctx.saved_tensors
        scale = g if inv_temp is None else g * inv_temp  # (n,): d logp / d z = scale x (onehot - p)
        if ctx.keep:  # saved: p itself, (n, V) fp32
            with torch.no_grad():
                dz = _softmax_grad_(saved, targets, scale)
                weight = ctx.head.weight
                return (dz.to(weight.dtype) @ weight).to(ctx.h_dtype), None, None, None, None
        with torch.enable_grad():
            leaf = saved.detach().requires_grad_(saved.requires_grad)
            z = ctx.head(leaf)
        with torch.no_grad():
            dz = z.detach().float()  # in place on the logits: the head's own backward never reads them
            for rows in _row_blocks(dz.shape[0], dz.shape[-1]):  # p from the logits, block by block
                zb = dz[rows]
                if inv_temp is not None:
                    zb.mul_(inv_temp[rows].unsqueeze(-1))
                zb.sub_(lse[rows].unsqueeze(-1)).exp_()
            dz = _softmax_grad_(dz, targets, scale)
        torch.autograd.backward(z, dz.to(z.dtype))  # the head's backward: into h, and its weights if trained
        return leaf.grad, None, None, None, None


def _softmax_grad_(p: Tensor, targets: Tensor, scale: Tensor) -> Tensor:
    """d loss / d z = scale x (onehot(y) - p), written over p (n, V) block by block."""
    for rows in _row_blocks(p.shape[0], p.shape[-1]):
        s = scale[rows].unsqueeze(-1)
        p[rows].mul_(-s).scatter_add_(-1, targets[rows].unsqueeze(-1), s)
    return p


def row_logprobs(
    model: Any, rows: Rows, chunk: int = HEAD_CHUNK, prefix: StepPrefix | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, raw, entropy, top), each (N,), of the rows' trained tokens; never a (B, T, V) tensor.

    logp is log_softmax(z / T)[y] with gradient, T its call's temperature; raw the same at T = 1,
    entropy the tempered distribution's and top whether y is the argmax (all three without gradient).
    The hidden states that predict trained tokens are gathered (N, H) and the LM head + log-softmax
    run `chunk` positions at a time (_HeadLogprobs): a frozen head's chunks keep their probabilities
    for backward, up to HEAD_KEEP_BYTES per call (N x V fp32: 100 MB at N = 512, V = 49k); past that,
    or with a trained head, backward recomputes a chunk's logits instead. `prefix`: see
    row_hidden_states.
    """
    _, head = _body_and_head(model)
    h = row_hidden_states(model, rows, prefix)  # (B, T, H)
    device = h.device
    picked = h[rows.row.to(device), rows.col.to(device) - 1]  # (N, H): position t - 1 predicts token t
    del h
    targets = rows.targets.to(device)
    temp = rows.temperature
    inv = None if temp is None else 1.0 / temp.to(device)
    parts = []
    frozen, kept = _frozen_linear(head), 0
    for c0 in range(0, len(targets), chunk):
        h, y = picked[c0 : c0 + chunk], targets[c0 : c0 + chunk]
        t = None if inv is None else inv[c0 : c0 + chunk]
        if torch.is_grad_enabled() and picked.requires_grad:
            size = 4 * len(y) * head.weight.shape[0]  # its probabilities, (n, V) fp32
            keep = frozen and kept + size <= HEAD_KEEP_BYTES
            kept += size if keep else 0
            parts.append(_HeadLogprobs.apply(h, y, t, head, keep))
        else:
            with torch.no_grad():
                parts.append(_chunk_stats(head(h).float(), y, t)[:4])
    if not parts:
        empty = torch.zeros(0, device=device)
        return empty, empty, empty, empty.bool()
    logp, raw, entropy, top = (torch.cat(x) for x in zip(*parts, strict=True))
    return logp, raw, entropy, top


@torch.no_grad()
def reference_row_logprobs(model: Any, rows: Rows) -> Tensor:
    """The base model's log-probabilities (adapter disabled) of the rows' trained tokens (N,)."""
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()
    with ctx:
        return row_logprobs(model, rows)[0]
