"""The chunked LM head's autograd Function (model._HeadLogprobs) against plain autograd of log_softmax."""

from __future__ import annotations

import torch

from rlproxy.trainer.model import _chunk_stats, _HeadLogprobs


def reference(head: torch.nn.Linear, h: torch.Tensor, y: torch.Tensor, inv: torch.Tensor | None):
    z = head(h).float()
    zt = z if inv is None else z * inv[:, None]
    logp_all = torch.log_softmax(zt, -1)
    p = logp_all.exp()
    entropy = -torch.where(p > 0, p * logp_all, 0.0).sum(-1)
    raw = torch.log_softmax(z, -1).gather(-1, y[:, None])[:, 0]
    return logp_all.gather(-1, y[:, None])[:, 0], raw.detach(), entropy.detach(), z.argmax(-1) == y


def test_values_and_gradients_equal_plain_autograd_at_mixed_temperatures() -> None:
    torch.manual_seed(0)
    n, H, V = 12, 16, 50
    head = torch.nn.Linear(H, V)  # trainable weights too (a head in modules_to_save): they get gradients
    with torch.no_grad():
        head.bias[7] = -torch.inf  # a banned token: probability 0, entropy still finite
    y = torch.randint(0, V, (n,))
    y[y == 7] = 8
    g = torch.randn(n)
    for inv in (None, 1 / torch.tensor([0.7, 1.0, 1.3] * 4)):
        results = []
        for fused in (True, False):
            head.zero_grad()
            h = torch.randn(n, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
            logp, raw, entropy, top = (
                _HeadLogprobs.apply(h, y, inv, head) if fused else reference(head, h, y, inv)
            )
            (logp * g).sum().backward()
            results.append((logp.detach(), raw, entropy, top, h.grad, head.weight.grad.clone()))
        (got, want) = results
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            if a.dtype == torch.bool:
                assert torch.equal(a, b)
            else:
                assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_stats_without_gradient_are_the_same_numbers() -> None:
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 30, bias=False)
    h, y, inv = torch.randn(5, 8), torch.randint(0, 30, (5,)), 1 / torch.full((5,), 0.6)
    with torch.no_grad():
        got = _chunk_stats(head(h).float(), y, inv)[:4]
    want = reference(head, h, y, inv)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b.detach(), atol=1e-6)


def test_a_frozen_head_keeps_its_probabilities_and_runs_once() -> None:
    """keep: backward turns the saved probabilities into dz (no second head matmul); same numbers."""
    torch.manual_seed(3)
    n, H, V = 12, 16, 50
    head = torch.nn.Linear(H, V).requires_grad_(False)  # the trainer's head: frozen
    with torch.no_grad():
        head.bias[7] = -torch.inf
    y = torch.randint(0, V, (n,))
    y[y == 7] = 8
    g = torch.randn(n)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    for inv in (None, 1 / torch.tensor([0.7, 1.0, 1.3] * 4)):
        results = {}
        for keep in (True, False, None):  # None: plain autograd, the oracle
            calls.clear()
            h = torch.randn(n, H, generator=torch.Generator().manual_seed(4)).requires_grad_()
            out = reference(head, h, y, inv) if keep is None else _HeadLogprobs.apply(h, y, inv, head, keep)
            (out[0] * g).sum().backward()
            assert len(calls) == (2 if keep is False else 1)  # kept: the logits are made once
            results[keep] = (out[0].detach(), out[1].detach(), out[2].detach(), out[3], h.grad)
        for keep in (True, False):
            for a, b in zip(results[keep], results[None], strict=True):
                if a.dtype == torch.bool:
                    assert torch.equal(a, b)
                else:
                    assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
