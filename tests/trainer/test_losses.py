"""The GRPO math on examples small enough to compute by hand; expected numbers are written out.

The policy-loss example: train_step's loss, `token_policy_loss`, on 2 sequences flattened into N=5
trained tokens (the first sequence has 3, the second 2), weighted as segments.assign_weights weighs them:

    logp      [-1.0, -2.0, -0.5 | -1.5, -0.2]
    old_logp  [-1.2, -1.0, -0.5 | -1.0, -0.5]          adv [1, 1, 1 | -2, -2]
    log-ratio [0.2, -1.0, 0.0 | -0.5, 0.3]
    ratio     [1.2214028, 0.3678794, 1 | 0.6065307, 1.3498588]

    eps = 0.2: seq 0 (A=+1) min(rA, clip(r)A) = [1.2, 0.3678794, 1]  -> loss tokens [-1.2, -0.3678794, -1]
               seq 1 (A=-2) min = [min(-1.2130613, -1.6), min(-2.6997176, -2.4)]
                                                               -> loss tokens [1.6, 2.6997176]
    grpo    w = 1/(2 x 3), 1/(2 x 2): mean(-2.5678794 / 3, 4.2997176 / 2) = (-0.8559598 + 2.1498588) / 2
                                                                        = 0.6469495
    dapo    w = 1/5:                   (-2.5678794 + 4.2997176) / 5       = 0.3463676
    dr_grpo w = 1/(2 sequences x L 4): 1.7318382 / 8                      = 0.2164798
    gspo    w as grpo, one ratio per sequence: log-ratios -0.2666667, -0.1 -> ratios 0.7659283, 0.9048374
              seq 0: min(0.7659283, clip 0.8) = 0.7659283 -> -0.7659283 ; seq 1: -2 * 0.9048374 -> 1.8096748
              loss = (-0.7659283 + 1.8096748) / 2 = 0.5218732
"""

from __future__ import annotations

import math

import pytest
import torch

from rlproxy.trainer.losses import (
    advantages,
    approx_kl,
    behavior_logprobs,
    clip_range,
    k3_kl,
    sampled_logprobs,
    token_policy_loss,
)

LOGP = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.2])
OLD = torch.tensor([-1.2, -1.0, -0.5, -1.0, -0.5])
ADV = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])  # each token's run's advantage
SEQ = torch.tensor([0, 0, 0, 1, 1])  # each token's sequence (gspo's ratio group)
REF = torch.full((5,), -1.0)
PER_SEQ = torch.tensor([1 / 6] * 3 + [1 / 4] * 2)  # 1 / (sequences x the sequence's tokens)
WEIGHT = {
    "grpo": PER_SEQ,
    "gspo": PER_SEQ,
    "dapo": torch.full((5,), 1 / 5),
    "dr_grpo": torch.full((5,), 1 / 8),
}


def policy_loss(kind: str, logp=LOGP, ref=None, n: int = 5, **kw) -> tuple[torch.Tensor, dict[str, float]]:
    """token_policy_loss on the first `n` tokens of the example, weighted for `kind`."""
    w = kw.pop("weight", WEIGHT[kind][:n])
    return token_policy_loss(logp[:n], OLD[:n], ref, ADV[:n], w, kind=kind, ratio_group=SEQ[:n], **kw)


def approx(x: float) -> object:
    return pytest.approx(x, abs=2e-6)


def test_advantages_group_normalized() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    adv, m = advantages(rewards, groups, "group")
    # group 0: mean 0.5, unbiased std sqrt(0.5 / 3) = 0.4082483; group 1: mean 3, std sqrt(2) = 1.4142136
    s0, s1 = math.sqrt(0.5 / 3) + 1e-4, math.sqrt(2.0) + 1e-4
    expected = [0.5 / s0, -0.5 / s0, 0.0, 0.0, -1 / s1, 1 / s1, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[0].item() == approx(1.2244450)  # 0.5 / 0.4083483
    assert adv[5].item() == approx(0.7070568)  # 1 / 1.4143136
    assert m["reward/frac_zero_std"] == approx(1 / 3)  # group 2 has equal rewards
    assert m["reward/mean"] == approx(10 / 8)


def test_advantages_unscaled() -> None:
    adv, _ = advantages(
        torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0]), torch.tensor([0, 0, 0, 0, 1, 1]), "none"
    )
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, -1.0, 1.0])


def test_grpo_per_sequence_mean() -> None:
    loss, m = policy_loss("grpo", epsilon=0.2)
    assert loss.item() == approx(0.6469495)
    assert m["clip/low_frac"] == approx(0.2)  # row 1 token 0: ratio 0.61 < 0.8 with A < 0
    assert m["clip/high_frac"] == approx(0.2)  # row 0 token 0: ratio 1.22 > 1.2 with A > 0
    assert m["clip/frac"] == approx(0.4)
    # approx KL = mean over the 5 tokens of (r - 1) - log r
    ks = [(math.exp(x) - 1) - x for x in (0.2, -1.0, 0.0, -0.5, 0.3)]
    assert m["kl/approx"] == approx(sum(ks) / 5)
    assert "kl/ref" not in m


def test_dapo_token_mean_and_clip_higher() -> None:
    loss, _ = policy_loss("dapo", epsilon=0.2)
    assert loss.item() == approx(0.3463676)
    # clip-higher 0.3: row 0 token 0 (1.2214 < 1.3) is no longer clipped -> -1.2214028 instead of -1.2
    loss, m = policy_loss("dapo", epsilon=0.2, epsilon_high=0.3)
    assert loss.item() == approx((-1.2214028 - 0.3678794 - 1 + 1.6 + 2.6997176) / 5)
    assert loss.item() == approx(0.3420871)
    assert m["clip/high_frac"] == 0.0


def test_dr_grpo_constant_normalizer() -> None:
    loss, _ = policy_loss("dr_grpo", epsilon=0.2)
    assert loss.item() == approx(0.2164798)


def test_gspo_sequence_ratio() -> None:
    loss, m = policy_loss("gspo", epsilon=0.2)
    assert loss.item() == approx(0.5218732)
    assert m["clip/frac"] == 0.0  # 0.766 < 0.8 but A > 0: the unclipped term is the minimum


def test_k3_kl_and_beta() -> None:
    kl = k3_kl(LOGP, REF)
    # d = ref - logp = [0, 1, -0.5 | 0.5, -0.8]; k3 = e^d - d - 1
    assert kl[:3].tolist() == pytest.approx([0.0, math.e - 2, math.exp(-0.5) - 0.5], abs=1e-6)
    assert kl[3:].tolist() == pytest.approx([math.exp(0.5) - 1.5, math.exp(-0.8) - 0.2], abs=1e-6)
    loss, m = policy_loss("grpo", ref=REF, epsilon=0.2, beta=0.1)
    # row 0: (-2.5678794 + 0.1 * 0.8248125) / 3 ; row 1: (4.2997176 + 0.1 * 0.3980502) / 2
    assert loss.item() == approx(0.6706476)
    assert m["kl/ref"] == approx((0.8248125 + 0.3980502) / 5)
    # beta is ignored without reference log-probs (beta 0 never computes them)
    loss0, _ = policy_loss("grpo", epsilon=0.2, beta=0.1)
    assert loss0.item() == approx(0.6469495)


def test_on_policy_gradient_is_advantage_weighted() -> None:
    # at ratio 1 the gradient of the grpo loss w.r.t. logp_t is -A w_t = -A / (tokens in the sequence) / B
    logp = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss("grpo", logp=logp)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 6] * 3 + [0.5, 0.5])


def test_clip_range_defaults_per_loss() -> None:
    """Issue 16 risk 7: GSPO's sequence ratio needs 3e-4/4e-4 (0.2 is never reached), DAPO clips higher."""
    assert clip_range("grpo", None, None) == (0.2, 0.2)
    assert clip_range("dr_grpo", None, None) == (0.2, 0.2)
    assert clip_range("dapo", None, None) == (0.2, 0.28)
    assert clip_range("gspo", None, None) == (3e-4, 4e-4)
    assert clip_range("dapo", 0.1, None) == (0.1, 0.1)  # an explicit epsilon is symmetric ...
    assert clip_range("gspo", 1e-3, 2e-3) == (1e-3, 2e-3)  # ... unless epsilon_high says otherwise
    assert clip_range("dapo", None, 0.3) == (0.2, 0.3)


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    """Issue 16 risk 6: with A < 0 the surrogate grows without bound in the ratio; dual clip caps it at C|A|.

    Row 1 (A = -2), token 1 has ratio 1.3498588: its loss 2 x 1.3498588 = 2.6997176 > C|A| = 2.4 at C = 1.2
    -> grpo = mean(-2.5678794 / 3, (1.6 + 2.4) / 2) = (-0.8559598 + 2.0) / 2 = 0.5720201.
    """
    loss, m = policy_loss("grpo", epsilon=0.2, ratio_cap=1.2)
    assert loss.item() == approx(0.5720201)
    assert m["clip/dual_frac"] == approx(0.2)
    assert m["clip/ratio_max"] == approx(1.3498588)
    loss, m = policy_loss("grpo", epsilon=0.2, ratio_cap=3.0)
    assert loss.item() == approx(0.6469495) and m["clip/dual_frac"] == 0.0  # no ratio above 3: unchanged
    # A > 0 is never capped: the clip already bounds it (row 0, ratio 1.22 > C = 1.1)
    loss, _ = policy_loss("grpo", n=3, weight=torch.full((3,), 1 / 3), epsilon=0.2, ratio_cap=1.1)
    assert loss.item() == approx(-2.5678794 / 3)


def test_dual_clip_gradient_of_a_stale_token() -> None:
    """A token with A = -1 and ratio 50: 50x the gradient uncapped, none with C = 3 (the default)."""
    old = torch.tensor([-3.0])
    for cap, loss_value, grad in ((None, 50.0, 50.0), (3.0, 3.0, 0.0)):
        logp = (old + math.log(50.0)).requires_grad_(True)
        loss, _ = token_policy_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1), ratio_cap=cap)
        loss.backward()
        assert loss.item() == pytest.approx(loss_value, rel=1e-6)
        assert logp.grad.item() == pytest.approx(grad, abs=1e-5)


def test_sampled_logprobs_at_the_request_temperature() -> None:
    """Issue 16 risk 5: the policy trained is softmax(logits / T), T the request's temperature (TRL, verl).

    logits [1, 2, 0], target 1.  T = 1: 2 - log(e + e^2 + 1) = 2 - log 11.1073379 = -0.4076059
                                  T = 2: 1 - log(e^0.5 + e + 1) = 1 - log 5.3670031 = -0.6802696
    """
    logits = torch.tensor([[[1.0, 2.0, 0.0]], [[1.0, 2.0, 0.0]]])  # (B=2, C=1, V=3)
    targets = torch.tensor([[1], [1]])
    raw = sampled_logprobs(logits, targets)
    assert raw.flatten().tolist() == pytest.approx([-0.4076059] * 2, abs=1e-6)
    tempered = sampled_logprobs(logits, targets, torch.tensor([2.0, 1.0]))
    assert tempered.flatten().tolist() == pytest.approx([-0.6802696, -0.4076059], abs=1e-6)


def test_behavior_logprobs_by_logprob_mode() -> None:
    """The ratio's value: tempered against processed logprobs, raw against raw ones; its gradient: pi_T's.

    logp_T = -0.6802696 (T = 2), raw = -0.4076059, stored = -0.5.
    processed: old = -0.5                  -> log-ratio -0.1802696
    raw:       old = logp_T - (raw - stored) = -0.7726637 -> log-ratio 0.0923941 = raw - stored
    """
    logits = torch.tensor([[[1.0, 2.0, 0.0]]], requires_grad=True)
    targets = torch.tensor([[1]])
    logp = sampled_logprobs(logits, targets, torch.tensor([2.0]))
    raw = sampled_logprobs(logits, targets)
    stored = torch.tensor([[-0.5]])
    assert behavior_logprobs(logp, raw, stored, "processed").item() == approx(-0.5)
    old = behavior_logprobs(logp, raw, stored, "raw")
    assert old.item() == approx(-0.7726637)
    assert (logp - old).item() == approx(0.0923941)
    # the gradient is the tempered policy's score times the ratio: d/dlogits of exp(logp_T - old)
    torch.exp(logp - old).sum().backward()
    p_t = torch.softmax(torch.tensor([0.5, 1.0, 0.0]), -1)
    expected = math.exp(0.0923941) * (torch.tensor([0.0, 1.0, 0.0]) - p_t) / 2.0
    assert logits.grad.flatten().tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # unknown stored logprobs (NaN): ratio 1
    unknown = behavior_logprobs(logp, raw, torch.tensor([[math.nan]]), "raw")
    assert unknown.item() == approx(logp.item())


def test_approx_kl() -> None:
    lr = torch.tensor([[0.2, -1.0], [0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    expected = sum((math.exp(x) - 1) - x for x in (0.2, -1.0, 0.5)) / 3
    assert approx_kl(lr, mask).item() == approx(expected)
