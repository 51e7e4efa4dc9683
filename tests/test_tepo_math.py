"""TEPO maths (our reading, explained in docs/objectives.md) pinned by hand-computed values.

Sections 1-6 are pure tensor functions. Section 7 loads the bundled tiny model on the CPU (a few
seconds) to pin the chunked entropy-change term c and the recomputation noise that the observed
entropy test's tolerance has to stay above."""

import math
from types import SimpleNamespace

import pytest
import torch

import common
import dapo
import tepo

LN2, LN3 = math.log(2), math.log(3)


def _M(A, entropy, base_entropy, mask):
    """KL mask of the observed test with tolerance 0: entropy_falls = entropy < base_entropy."""
    return tepo.kl_mask(A, entropy < base_entropy, mask)


# the hand values below are worked for the sequence ratio at PPO's range, where ratios of e^0.1
# stay inside; the defaults (per-token ratios) and GSPO's range have their own test
SEQ_PPO = dict(ratio_level="sequence", clip_low=0.2, clip_high=0.28)


def _loss(logp, old, A, mask, M, ref_logp, N, **kw):
    # positional order of the API: logp, old_logp, ref_logp, advantages, mask, M, num_tokens
    return tepo.tepo_loss(logp, old, ref_logp, A, mask, M, **{**SEQ_PPO, **kw}, num_tokens=N)


def _stats(logp, old, A, mask, M, ref_logp, entropy, **kw):
    kw.pop("kl_coef", None)  # the loss's only argument that the statistics do not take
    return tepo.tepo_stats(logp, old, ref_logp, A, mask, M, entropy, **{**SEQ_PPO, **kw})


# ====================================================================== 1. carried ratio
def _seq_example():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    diff = torch.tensor([[0.1, 0.3, 5.0], [-0.2, 0.0, 0.5]])  # 5.0 sits on padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).float()
    return old, diff, mask


def test_carried_sequence_ratio_value_is_geometric_mean_on_every_valid_token():
    old, diff, mask = _seq_example()
    logp = (old + diff).requires_grad_()
    c = tepo.carried_log_ratio(logp, old, mask, "sequence")
    # row 0: (0.1 + 0.3) / 2 = 0.2 (the padded 5.0 is ignored); row 1: (-0.2 + 0.0 + 0.5) / 3 = 0.1
    assert torch.allclose(c[0, :2], torch.full((2,), 0.2), atol=1e-6)
    assert torch.allclose(c[1], torch.full((3,), 0.1), atol=1e-6)
    s = torch.exp(c)
    assert torch.allclose(s[0, :2], torch.full((2,), math.exp(0.2)), atol=1e-6)
    assert torch.allclose(s[1], torch.full((3,), math.exp(0.1)), atol=1e-6)


def test_carried_sequence_ratio_gradient_is_one_on_own_token_only():
    old, diff, mask = _seq_example()
    logp = (old + diff).requires_grad_()
    c = tepo.carried_log_ratio(logp, old, mask, "sequence")
    W = torch.tensor([[0.3, -1.7, 0.0], [2.0, 0.5, -0.25]])
    c.backward(W)
    # d(sum W * c)/d logp_it = W_it: derivative 1 w.r.t. its own logp, nothing through the row mean
    assert torch.allclose(logp.grad * mask, W * mask, atol=1e-7)


def test_carried_token_ratio_is_plain_log_ratio():
    old, diff, mask = _seq_example()
    logp = (old + diff).requires_grad_()
    c = tepo.carried_log_ratio(logp, old, mask, "token")
    assert torch.allclose(c, diff, atol=1e-6)
    c.backward(torch.ones_like(c))
    assert torch.allclose(logp.grad, torch.ones(2, 3))


# ====================================================================== 2. KL mask
def test_kl_mask_is_positive_advantage_and_entropy_falls_and_valid_token():
    A = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])
    T_, F_ = True, False
    falls = torch.tensor([[T_, F_, T_], [T_, T_, T_], [F_, T_, T_], [T_, T_, T_], [F_, F_, F_]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    #   row 0: A > 0: falls T F, third is padding -> T F F
    #   row 1: A < 0: nothing, whatever falls     -> F F F
    #   row 2: A > 0: F T, third is padding       -> F T F
    #   row 3: A == 0 is not > 0                  -> F F F
    #   row 4: A > 0 but nothing falls            -> F F F
    expected = [[T_, F_, F_], [F_, F_, F_], [F_, T_, F_], [F_, F_, F_], [F_, F_, F_]]
    for m in (mask, mask.float(), mask.bool()):  # long, float and bool masks alike
        M = tepo.kl_mask(A, falls, m)
        assert M.dtype == torch.bool and M.shape == (5, 3)
        assert M.tolist() == expected


def test_kl_mask_observed_test_for_both_baselines():
    """The observed test as the caller builds it (tolerance 0): entropy_falls = entropy now <
    baseline, with the baseline the sampling policy's entropy (default) or the reference's."""
    A = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])
    entropy = torch.tensor(
        [[1.0, 2.0, 0.5], [1.0, 2.0, 0.5], [0.3, 0.3, 0.3], [0.1, 0.1, 0.1], [0.7, 0.7, 0.7]]
    )
    old_entropy = torch.tensor(
        [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5], [0.2, 0.4, 0.4], [0.9, 0.9, 0.9], [0.7, 0.7, 0.7]]
    )
    ref_entropy = torch.tensor(
        [[0.5, 2.5, 0.4], [0.5, 2.5, 0.4], [0.5, 0.2, 0.5], [0.9, 0.9, 0.9], [0.7, 0.8, 0.6]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]).float()
    F_, T_ = False, True
    # baseline = old_entropy: "entropy fell since the batch was sampled"
    #   row 0: A > 0, 1 < 1.5 yes, 2 < 1.5 no, 0.5 < 1.5 yes but padding  -> T F F
    #   row 1: A < 0                                                        -> F F F
    #   row 2: A > 0, 0.3 < 0.2 no, 0.3 < 0.4 yes, third is padding         -> F T F
    #   row 3: A == 0 (not > 0)                                             -> F F F
    #   row 4: A > 0 but entropy unchanged (strict <)                       -> F F F
    expected_old = [[T_, F_, F_], [F_, F_, F_], [F_, T_, F_], [F_, F_, F_], [F_, F_, F_]]
    # baseline = ref_entropy (--entropy-baseline ref)
    #   row 0: 1 < 0.5 no, 2 < 2.5 yes, padding      -> F T F
    #   row 2: 0.3 < 0.5 yes, 0.3 < 0.2 no, padding  -> T F F
    #   row 4: 0.7 < 0.7 no, 0.7 < 0.8 yes, 0.7 < 0.6 no -> F T F
    expected_ref = [[F_, T_, F_], [F_, F_, F_], [T_, F_, F_], [F_, F_, F_], [F_, T_, F_]]
    assert _M(A, entropy, old_entropy, mask).tolist() == expected_old
    assert _M(A, entropy, ref_entropy, mask).tolist() == expected_ref
    assert _M(A, entropy, old_entropy, mask.long()).tolist() == expected_old  # integer mask too


def test_observed_mask_is_empty_before_the_policy_moves():
    A = torch.tensor([1.0, 2.0])
    e = torch.rand(2, 4)
    for tol in (0.0, 1e-3):
        assert not tepo.kl_mask(A, e < e.clone() - tol, torch.ones(2, 4)).any()


# ====================================================================== 3. the loss
@pytest.mark.parametrize("seed", [0, 1])
def test_token_level_with_empty_mask_equals_dapo_loss(seed):
    torch.manual_seed(seed)
    B, T = 6, 5
    logp0 = torch.randn(B, T)
    old = logp0 + 0.3 * torch.randn(B, T)
    A = torch.randn(B)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,))[:, None]).float()
    base = torch.rand(B, T)
    ent = base + 0.1 + torch.rand(B, T)  # every entropy increased: mask empty
    M = _M(A, ent, base, mask)
    assert not M.any()
    ref_logp = logp0 + torch.randn(B, T)
    N = float(mask.sum())

    a = logp0.clone().requires_grad_()
    lt = _loss(a, old, A, mask, M, ref_logp, N, ratio_level="token", kl_coef=0.04)
    lt.backward()
    st = _stats(a, old, A, mask, M, ref_logp, ent, ratio_level="token")
    b = logp0.clone().requires_grad_()
    ld = dapo.dapo_loss(b, old, A, mask, clip_low=0.2, clip_high=0.28, num_tokens=N)
    ld.backward()
    sd = dapo.dapo_stats(b, old, A, mask, clip_low=0.2, clip_high=0.28)
    assert lt.item() == pytest.approx(ld.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-7)
    assert st["clip_frac"] == pytest.approx(sd["clip_frac"])
    assert st["mask_frac"] == 0.0 and st["masked_kl"] == 0.0
    assert math.isfinite(st["masked_entropy"]) and math.isfinite(st["other_entropy"])


def test_sequence_level_equals_dapo_when_token_ratios_are_equal_within_rows():
    # equal log-ratios inside a row: geometric mean == each token's ratio, and d s / d logp_it = s
    # in both cases, so values and gradients coincide
    torch.manual_seed(2)
    B, T = 4, 3
    old = torch.randn(B, T)
    per_row = torch.tensor([0.1, -0.4, 0.35, 0.0])
    logp0 = old + per_row[:, None]
    A = torch.tensor([1.0, -1.0, 1.0, -0.5])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]).float()
    M = torch.zeros(B, T, dtype=torch.bool)
    a = logp0.clone().requires_grad_()
    lt = _loss(a, old, A, mask, M, old, 9.0, ratio_level="sequence")
    lt.backward()
    b = logp0.clone().requires_grad_()
    ld = dapo.dapo_loss(b, old, A, mask, num_tokens=9.0)
    ld.backward()
    assert lt.item() == pytest.approx(ld.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_sequence_ratio_gradient_is_minus_s_A_over_N_where_unclipped():
    old, diff, mask = _seq_example()
    logp = (old + diff).requires_grad_()
    A = torch.tensor([1.0, -0.5])
    M = torch.zeros(2, 3, dtype=torch.bool)
    loss = _loss(logp, old, A, mask, M, old, 5.0, kl_coef=0.0)
    st = _stats(logp, old, A, mask, M, old, torch.ones(2, 3))
    s0, s1 = math.exp(0.2), math.exp(0.1)  # both inside [0.8, 1.28]
    # value: sum over the 5 valid tokens of -s_i A_i, / 5 = (-2 s0 + 3 * 0.5 s1) / 5
    assert loss.item() == pytest.approx((-2 * s0 + 1.5 * s1) / 5, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[-s0 * 1.0 / 5, -s0 * 1.0 / 5, 0.0], [s1 * 0.5 / 5] * 3])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # token (0, 1) has its own ratio e^0.3 = 1.35 > 1.28: the token-level objective clips it, the
    # sequence-level one does not (its weight is the row's ratio)
    assert logp.grad[0, 1].item() != 0.0
    assert st["seq_ratio_min"] == pytest.approx(s1, abs=1e-6)
    assert st["seq_ratio_max"] == pytest.approx(s0, abs=1e-6)
    assert st["clip_frac"] == 0.0
    st_tok = _stats(logp, old, A, mask, M, old, torch.ones(2, 3), ratio_level="token")
    assert st_tok["clip_frac"] == pytest.approx(1 / 5)  # ... and is counted as clipped there


def test_clipped_sequences_get_no_policy_gradient():
    old = torch.zeros(4, 2)
    # row means 0.5, -0.5, 0.5, -0.5
    diff = torch.tensor([[0.2, 0.8], [-0.9, -0.1], [1.0, 0.0], [0.0, -1.0]])
    logp = (old + diff).requires_grad_()
    A = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, 2)
    # entropies fell: the mask is non-empty on rows 0 and 3, but kl_coef = 0
    M = _M(A, torch.zeros(4, 2), torch.ones(4, 2), mask)
    assert M.sum() == 4
    loss = _loss(logp, old, A, mask, M, old - 1.0, 8.0, kl_coef=0.0)
    st = _stats(logp, old, A, mask, M, old - 1.0, torch.zeros(4, 2))
    e, ei = math.exp(0.5), math.exp(-0.5)  # 1.6487 and 0.6065
    # row 0: A > 0, s = e > 1.28  -> clipped, -1.28 per token, no gradient
    # row 1: A < 0, s = ei < 0.8  -> clipped, -min(-ei, -0.8) = 0.8 per token, no gradient
    # row 2: A < 0, s = e > 1.28  -> min picks s * A: e per token, gradient -s A / N = e / 8
    # row 3: A > 0, s = ei < 0.8  -> unclipped: -ei per token, gradient -ei / 8
    assert loss.item() == pytest.approx(2 * (-1.28 + 0.8 + e - ei) / 8, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0], [0.0, 0.0], [e / 8, e / 8], [-ei / 8, -ei / 8]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert st["clip_frac"] == pytest.approx(4 / 8)
    assert st["seq_ratio_min"] == pytest.approx(ei, abs=1e-6)
    assert st["seq_ratio_max"] == pytest.approx(e, abs=1e-6)


def test_kl_gradient_only_on_masked_tokens():
    torch.manual_seed(3)
    B, T = 3, 4
    old = torch.randn(B, T)
    logp0 = old + 0.05 * torch.randn(B, T)
    A = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]).float()
    ent = torch.tensor([[0.5, 1.5, 0.5, 1.5], [0.5, 0.5, 0.5, 0.5], [0.5, 1.5, 0.5, 0.5]])
    base = torch.ones(B, T)
    # M: row 0 (A > 0): cols 0, 2; row 1: A < 0, none; row 2 (A > 0): col 0 (col 2 is padding)
    M = _M(A, ent, base, mask)
    assert M.float().tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    ref = logp0 + torch.randn(B, T)  # kl target, != logp everywhere
    N = float(mask.sum())

    grads = {}
    for coef in (0.04, 0.0):
        x = logp0.clone().requires_grad_()
        _loss(x, old, A, mask, M, ref, N, kl_coef=coef).backward()
        grads[coef] = x.grad
    st = _stats(logp0, old, A, mask, M, ref, ent)
    diff = grads[0.04] - grads[0.0]
    # d/dp of 0.04 * k3(q, p) / N = 0.04 * (1 - exp(q - p)) / N, only where M = 1
    expected = 0.04 * M.float() * (1 - torch.exp(ref - logp0)) / N
    assert torch.allclose(diff, expected, atol=1e-7)
    assert (diff[M] != 0).all() and (diff[~M] == 0).all()
    k3 = torch.exp(ref - logp0) - (ref - logp0) - 1
    assert st["mask_frac"] == pytest.approx(3 / N)
    assert st["masked_kl"] == pytest.approx(k3[M].mean().item(), abs=1e-6)
    assert st["kl"] == pytest.approx(k3[mask.bool()].mean().item(), abs=1e-6)


def test_no_reference_needed_when_kl_coef_is_zero():
    # kl_coef = 0: the script loads no reference model and passes None
    old, diff, mask = _seq_example()
    A, M = torch.tensor([1.0, -0.5]), torch.ones(2, 3, dtype=torch.bool)
    with_none = _loss(old + diff, old, A, mask, M, None, 5.0, kl_coef=0.0)
    with_target = _loss(old + diff, old, A, mask, M, old - 3.0, 5.0, kl_coef=0.0)
    assert with_none.item() == pytest.approx(with_target.item(), abs=0)
    st = _stats(old + diff, old, A, mask, M, None, torch.ones(2, 3))
    assert st["kl"] == 0.0 and st["masked_kl"] == 0.0


# ====================================================================== 4. full hand value
def _hand_2x3():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    diff = torch.tensor([[0.0, 0.1, 0.2], [0.4, 0.2, 3.0]])  # 3.0 is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    A = torch.tensor([2.0, 1.0])
    ent = torch.tensor([[1.0, 2.0, 0.5], [0.2, 0.9, 0.1]])
    base = torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 0.5]])
    d = torch.tensor([[LN2, 1.0, -LN2], [LN3, 1.0, 1.0]])  # ref_logp - logp
    return old, diff, mask, A, ent, base, d


def test_full_tepo_loss_hand_value_2x3():
    old, diff, mask, A, ent, base, d = _hand_2x3()
    logp = (old + diff).requires_grad_()
    M = _M(A, ent, base, mask)
    # M = [[1, 0, 1], [1, 0, 0]]  (A > 0 on both rows; (1, 2) fell but is padding)
    assert M.float().tolist() == [[1, 0, 1], [1, 0, 0]]
    ref_logp = (old + diff) + d
    loss = _loss(logp, old, A, mask, M, ref_logp, 5.0, kl_coef=0.1)
    st = _stats(logp, old, A, mask, M, ref_logp, ent)
    # row 0: log s = (0 + 0.1 + 0.2) / 3 = 0.1, s = e^0.1 in range: -2 e^0.1 on each of 3 tokens
    # row 1: log s = (0.4 + 0.2) / 2 = 0.3, s = e^0.3 = 1.35 > 1.28, A > 0: -1.28 on each of 2
    # k3 on M: d = ln 2 -> 2 - ln 2 - 1 = 1 - ln 2; d = -ln 2 -> 1/2 + ln 2 - 1 = ln 2 - 1/2;
    #          d = ln 3 -> 3 - ln 3 - 1 = 2 - ln 3; sum = 5/2 - ln 3
    expected = (-6 * math.exp(0.1) - 2.56 + 0.1 * (2.5 - LN3)) / 5  # = -1.8101773...
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(-1.8101773, abs=1e-6)
    assert st["mask_frac"] == pytest.approx(3 / 5)
    assert st["masked_kl"] == pytest.approx((2.5 - LN3) / 3, abs=1e-6)
    # k3 over all 5 valid tokens: the 3 above plus two with d = 1 (e - 2 each); the padded
    # (1, 2) is left out: (5/2 - ln 3 + 2 (e - 2)) / 5
    assert st["kl"] == pytest.approx((2.5 - LN3 + 2 * (math.e - 2)) / 5, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(2 / 5)
    assert st["seq_ratio_min"] == pytest.approx(math.exp(0.1), abs=1e-6)
    assert st["seq_ratio_max"] == pytest.approx(math.exp(0.3), abs=1e-6)
    assert st["masked_entropy"] == pytest.approx((1.0 + 0.5 + 0.2) / 3, abs=1e-6)
    assert st["other_entropy"] == pytest.approx((2.0 + 0.9) / 2, abs=1e-6)
    assert all(isinstance(v, float) for v in st.values())
    loss.backward()
    # policy: -s0 A0 / 5 = -2 e^0.1 / 5 on row 0, 0 on the clipped row 1
    # KL: 0.1 (1 - e^d) / 5 on M:
    #     (0,0) 0.1 (1 - 2) / 5, (0,2) 0.1 (1 - 1/2) / 5, (1,0) 0.1 (1 - 3) / 5
    g = -2 * math.exp(0.1) / 5
    expected_grad = torch.tensor([[g - 0.02, g, g + 0.01], [-0.04, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_defaults_are_token_level_clip_0_2_0_28_and_kl_0_04():
    # the hand example above, called with defaults (docs/study/PLAN-clip-real.md's pick): per-token
    # ratios; row 0's e^0, e^0.1, e^0.2 lie inside [0.8, 1.28]; row 1's e^0.4 = 1.49 > 1.28 with
    # A > 0 is clipped, its e^0.2 is not (its third token is padding)
    old, diff, mask, A, ent, base, d = _hand_2x3()
    M = _M(A, ent, base, mask)
    loss = tepo.tepo_loss(old + diff, old, old + diff + d, A, mask, M, num_tokens=5.0)
    e1, e2 = math.exp(0.1), math.exp(0.2)
    expected = (-2 * (1 + e1 + e2) - 1.28 - e2 + 0.04 * (2.5 - LN3)) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    st = tepo.tepo_stats(old + diff, old, old + diff + d, A, mask, M, ent)
    assert st["clip_frac"] == pytest.approx(1 / 5)
    args = tepo.resolve_args(tepo.Args())
    assert (args.clip_low, args.clip_high, args.ratio_level, args.kl_coef) == (
        0.2,
        0.28,
        "token",
        0.04,
    )


def test_the_sequence_ratio_at_gspos_range_by_hand():
    # --ratio-level sequence --clip-low 3e-4 --clip-high 4e-4 (the tiny task's pick, the default
    # until the real model's study): both rows' sequence ratios (e^0.1, e^0.3) are above 1 + 4e-4
    # with A > 0, so every token is clipped
    old, diff, mask, A, ent, base, d = _hand_2x3()
    M = _M(A, ent, base, mask)
    gspo = dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4)
    loss = tepo.tepo_loss(old + diff, old, old + diff + d, A, mask, M, **gspo, num_tokens=5.0)
    expected = (-3 * 2 * 1.0004 - 2 * 1 * 1.0004 + 0.04 * (2.5 - LN3)) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    st = tepo.tepo_stats(old + diff, old, old + diff + d, A, mask, M, ent, **gspo)
    assert st["clip_frac"] == pytest.approx(1.0)
    # a ratio inside [1 - 3e-4, 1 + 4e-4] is not clipped: log s = 3e-4 on both rows
    near = torch.full_like(old, 3e-4)
    assert (
        tepo.tepo_stats(old + near, old, old + diff + d, A, mask, M, ent, **gspo)["clip_frac"] == 0
    )


def test_where_the_kl_sits_by_hand():
    from tools import diagnostics  # the studies' diagnostics, wrapped around the loss from outside

    # k3(ref, logp) with logp = 0 and ref = d: e^d - d - 1 per token; the padded one holds a huge d
    d = torch.tensor([[1.0, LN2, -LN2, LN3], [2.0, -1.0, 9.0, 9.0]])
    k = torch.exp(d) - d - 1  # [[e - 2, 1 - ln 2, 1/2 + ln 2 - 1, 2 - ln 3], [e^2 - 3, 1/e, ., .]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).float()
    A = torch.tensor([1.0, -1.0])
    M = torch.tensor([[True, False, True, False], [False, False, False, False]])
    run = SimpleNamespace(algo="tepo", args=tepo.resolve_args(tepo.Args()))
    batch = {"mask": mask, "truncated": torch.tensor([False, False])}
    st = diagnostics.update_figures(
        run,
        {"batch": batch, "advantages": A},
        torch.arange(2),
        torch.zeros(2, 4),
        torch.zeros(2, 4),
        d,  # the reference's log-probs
        M,
    )
    # row 0 is A > 0 (4 tokens), row 1 A < 0 (2 tokens); off the mask: (0,1), (0,3), (1,0), (1,1)
    assert st["kl_pos_adv"] == pytest.approx(k[0].mean().item(), abs=1e-6)
    assert st["kl_neg_adv"] == pytest.approx((k[1, 0] + k[1, 1]).item() / 2, abs=1e-6)
    assert st["kl_off_mask"] == pytest.approx(
        (k[0, 1] + k[0, 3] + k[1, 0] + k[1, 1]).item() / 4, abs=1e-6
    )
    # positions: row 0 at 1/4, 2/4, 3/4, 1; row 1 at 1/2, 1: first quarter (0,0); last (0,3), (1,1)
    assert st["kl_first_quarter"] == pytest.approx(math.e - 2, abs=1e-6)
    assert st["kl_last_quarter"] == pytest.approx((2 - LN3 + math.exp(-1)) / 2, abs=1e-6)
    # not the padding's e^9 - 10
    assert st["kl_token_max"] == pytest.approx(math.exp(2) - 3, abs=1e-5)


def _random_batch(seed=0, B=8, T=7):
    torch.manual_seed(seed)
    logp0 = torch.randn(B, T)
    old = logp0 + 0.3 * torch.randn(B, T)
    A = torch.randn(B)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,))[:, None]).float()
    M = _M(A, torch.rand(B, T), torch.rand(B, T), mask)
    return logp0, old, A, mask, M, logp0 + 0.5 * torch.randn(B, T)


@pytest.mark.parametrize("ratio_level", ["sequence", "token"])
def test_the_loss_is_the_token_mean_of_pg_and_masked_kl_bit_for_bit(ratio_level):
    # the loss written out inline: token_mean(pg + kl_coef * M k3), the mini-batch's token count
    # given or (by default) this mask's; token-mean is TEPO's only aggregation (--loss-agg, a
    # study's rejected arm, was removed with --kl-target: issue 51)
    logp, old, A, mask, M, ref_logp = _random_batch(1)
    N = float(mask.sum())
    s = torch.exp(tepo.carried_log_ratio(logp, old, mask, ratio_level))
    a = A[:, None]
    pg = -torch.min(s * a, torch.clamp(s, 1 - 0.2, 1 + 0.28) * a)
    before = tepo.token_mean(pg + 0.04 * torch.where(M, tepo.k3_kl(ref_logp, logp), 0.0), mask, N)
    for n in (N, None):
        now = tepo.tepo_loss(logp, old, ref_logp, A, mask, M, ratio_level=ratio_level, num_tokens=n)
        assert torch.equal(now, before)
    args = tepo.resolve_args(tepo.Args())
    assert not hasattr(args, "loss_agg") and not hasattr(args, "kl_target")
    assert not hasattr(tepo, "seq_mean_token_mean")


def test_token_ratios_and_a_full_mask_are_grpo_on_equal_lengths():
    # per-token ratios, GRPO's symmetric clip and a KL mask over every valid token: where every
    # completion has as many tokens, token-mean is GRPO's seq-mean-token-mean, so the TEPO loss is
    # grpo_loss on the same inputs, value and gradient
    import grpo

    logp0, old, A, _, _, ref = _random_batch(2)
    mask = torch.ones_like(logp0)
    a, b = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
    t = tepo.tepo_loss(
        a,
        old,
        ref,
        A,
        mask,
        mask.bool(),
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.04,
        ratio_level="token",
        num_tokens=float(mask.sum()),
    )
    g = grpo.grpo_loss(b, old, ref, A, mask, 0.2, 0.2, 0.04)
    t.backward()
    g.backward()
    assert t.item() == pytest.approx(g.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-8)


# ====================================================================== 5. micro-batch invariance
@pytest.mark.parametrize("ratio_level", ["sequence", "token"])
def test_micro_batch_invariance_of_value_and_gradients(ratio_level):
    torch.manual_seed(0)
    B, T = 8, 7
    logp0 = torch.randn(B, T)
    old = logp0 + 0.3 * torch.randn(B, T)
    A = torch.randn(B)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,))[:, None]).float()
    ent, base = torch.rand(B, T), torch.rand(B, T)  # about half the tokens of A > 0 rows masked
    M = _M(A, ent, base, mask)
    ref_logp = logp0 + 0.5 * torch.randn(B, T)
    N = float(mask.sum())  # counted once for the whole mini-batch

    full = logp0.clone().requires_grad_()
    loss_full = _loss(full, old, A, mask, M, ref_logp, N, ratio_level=ratio_level)
    loss_full.backward()
    assert M.any()  # the KL term is exercised
    for k in (2, 3, B):
        split = logp0.clone().requires_grad_()
        total = 0.0
        for idx in torch.arange(B).tensor_split(k):
            l = _loss(
                split[idx],
                old[idx],
                A[idx],
                mask[idx],
                M[idx],
                ref_logp[idx],
                N,
                ratio_level=ratio_level,
            )
            l.backward()
            total += l.item()
        assert total == pytest.approx(loss_full.item(), abs=1e-6)
        assert torch.allclose(split.grad, full.grad, atol=1e-7)


# ====================================================================== 6. predicted change c
def _c_by_hand(p: list[float], k: int) -> float:
    """c = p_k (log p_k + H) - sum_j p_j^2 (log p_j + H), H = -sum_j p_j log p_j, in math.log."""
    H = -sum(q * math.log(q) for q in p)
    return p[k] * (math.log(p[k]) + H) - sum(q * q * (math.log(q) + H) for q in p)


def test_entropy_change_c_hand_values():
    p = [0.7, 0.2, 0.1]
    logits = torch.log(torch.tensor([p, p, p]))
    c = tepo.entropy_change_c(logits, torch.tensor([0, 1, 2]))
    assert c.shape == (3,) and c.dtype == torch.float32
    expected = [_c_by_hand(p, k) for k in range(3)]
    assert c.tolist() == pytest.approx(expected, abs=1e-6)
    # H = 0.80182, sum_j p_j^2 (log p_j + H) = 0.17082; c_0 = 0.7 (ln 0.7 + H) - 0.17082 > 0:
    # raising the likely token lowers the entropy; raising token 1 or 2 raises it (c < 0)
    assert expected == pytest.approx([0.14079, -0.33233, -0.32088], abs=1e-5)
    # a second distribution, rows of different vocabularies are independent
    q = [0.05, 0.15, 0.3, 0.5]
    c = tepo.entropy_change_c(torch.log(torch.tensor([q, q])), torch.tensor([3, 0]))
    assert c.tolist() == pytest.approx([_c_by_hand(q, 3), _c_by_hand(q, 0)], abs=1e-6)


@pytest.mark.parametrize("q", [0.9, 0.6, 0.5, 0.3, 0.01])
def test_entropy_change_c_two_tokens_closed_form(q):
    # V = 2, p = (q, 1 - q), L = ln(q / (1 - q)): log p_0 + H = (1 - q) L, log p_1 + H = -q L, so
    # c_0 = q (1 - q) L - [q^2 (1 - q) L - (1 - q)^2 q L] = 2 q (1 - q)^2 L,
    # c_1 = -q L (1 - q) - [q^2 (1 - q) L - (1 - q)^2 q L] = -2 q^2 (1 - q) L
    L = math.log(q / (1 - q))
    logits = torch.log(torch.tensor([[q, 1 - q], [q, 1 - q]]))
    c = tepo.entropy_change_c(logits, torch.tensor([0, 1]))
    expected = [2 * q * (1 - q) ** 2 * L, -2 * q * q * (1 - q) * L]
    assert c.tolist() == pytest.approx(expected, abs=1e-6)


def test_entropy_change_c_is_zero_on_uniform_and_near_deterministic_distributions():
    for V in (2, 5, 259):
        c = tepo.entropy_change_c(torch.zeros(V, V), torch.arange(V))  # uniform: log p_j + H = 0
        assert c.abs().max().item() < 1e-6
    peaked = torch.tensor([[60.0, 0.0, 0.0], [60.0, 0.0, 0.0]])  # p_0 = 1 to float precision
    c = tepo.entropy_change_c(peaked, torch.tensor([0, 1]))
    assert torch.isfinite(c).all() and c.abs().max().item() < 1e-6


def test_entropy_change_c_ignores_logit_shift_and_averages_to_zero_under_p():
    torch.manual_seed(0)
    V = 11
    z = 2 * torch.randn(4, V)
    ids = torch.arange(V).repeat(4)  # every token of every row
    rows = z.repeat_interleave(V, 0)  # [4 V, V]
    c = tepo.entropy_change_c(rows, ids)
    assert torch.allclose(c, tepo.entropy_change_c(rows + 7.5, ids), atol=1e-6)  # softmax shift
    assert torch.allclose(c, tepo.entropy_change_c(torch.log_softmax(rows, -1), ids), atol=1e-6)
    # E_{k ~ p}[c_k] = sum_k p_k c_k = 0: the expected step E[onehot_k - p] is 0, so in
    # expectation over the sampled token a constant advantage leaves the entropy unchanged
    p = torch.softmax(z.double(), -1)
    assert (p * c.view(4, V).double()).sum(-1).abs().max().item() < 1e-6
    assert (c > 0).any() and (c < 0).any()


@pytest.mark.parametrize("V", [2, 3, 10, 259])
def test_entropy_change_c_matches_autograd_derivative_of_the_entropy(V):
    """Lemma 3.2 as read here: the policy-gradient step on A log p_k moves the logits by
    dz = d(A log p_k)/dz = A (onehot_k - p), and the entropy changes to first order by
    grad_z H . dz, which must equal -A c (sign and magnitude), for A of both signs."""
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        N = 32
        scale = torch.rand(N, 1, generator=g, dtype=torch.float64) * 6  # flat to very peaked
        z = (scale * torch.randn(N, V, generator=g, dtype=torch.float64)).requires_grad_()
        k = torch.randint(0, V, (N,), generator=g)
        A = torch.randn(N, generator=g, dtype=torch.float64) * 2
        A[:2] = torch.tensor([1.0, -1.0], dtype=torch.float64)  # both signs always present
        logp_all = torch.log_softmax(z, -1)
        H = -(logp_all.exp() * logp_all).sum(-1)
        (grad_H,) = torch.autograd.grad(H.sum(), z, retain_graph=True)  # rows are independent
        (dz,) = torch.autograd.grad((A * logp_all.gather(-1, k[:, None]).squeeze(-1)).sum(), z)
        p = logp_all.detach().exp()
        assert torch.allclose(dz, A[:, None] * (torch.nn.functional.one_hot(k, V) - p), atol=1e-12)
        dH = (grad_H * dz).sum(-1)  # [N] first-order entropy change along the step

        c = tepo.entropy_change_c(z.detach(), k).double()  # computed in float32
        assert torch.allclose(dH, -A * c, rtol=1e-4, atol=1e-5), (seed, (dH + A * c).abs().max())
        clear = c.abs() > 1e-5  # away from 0, float32 decides the sign for sure
        assert clear.sum() > N // 2
        assert torch.equal(torch.sign(dH[clear]), torch.sign(-A[clear] * c[clear]))

        # and real small steps move the entropy that way (central difference, O(eta^2) error)
        def entropy(x):
            lx = torch.log_softmax(x, -1)
            return -(lx.exp() * lx).sum(-1)

        eta = 1e-5
        slope = (entropy(z.detach() + eta * dz) - entropy(z.detach() - eta * dz)) / (2 * eta)
        assert torch.allclose(slope, dH, rtol=1e-5, atol=1e-8)


# ====================================================================== 7. tiny model (CPU)
PROBLEMS = ("1+2-3", "45+67-89", "9-9+9", "7", "12+3-4+5-6", "8-1+2")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The bundled model and a real rollout batch sampled from it: 6 prompts of different
    lengths (left padding) x 4 completions, some ending before the cap (right padding)."""
    args = tepo.resolve_args(tepo.Args(run_name="x", device="cpu", max_new_tokens=24))
    tok, _ = tepo.load_tokenizer(str(tiny_dir), False)
    model = tepo.load_model(str(tiny_dir), torch.device("cpu"), args, trainable=True)
    prompts = [common.build_prompt(tok, p, "tiny") for p in PROBLEMS]
    torch.manual_seed(0)
    batch = tepo.generate_rollouts(
        model, tok, prompts, 4, args, tepo.eos_token_ids(model, tok), torch.device("cpu")
    )
    assert (batch["prompt_mask"] == 0).any() and (batch["mask"] == 0).any()
    return model, batch, {}  # the dict caches _c_direct by temperature


def _args(**kw):
    return tepo.resolve_args(tepo.Args(run_name="x", device="cpu", **kw))


def _c_direct(tiny, temperature):
    """c of every valid completion token from the full logits of each row alone, unpadded:
    model(prompt + completion).logits / temperature, position t predicting token t + 1."""
    model, batch, cache = tiny
    if temperature in cache:
        return cache[temperature]
    out = cache[temperature] = torch.zeros(batch["mask"].shape)
    for b in range(len(out)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        n = int(batch["mask"][b].sum())
        comp = batch["completion_ids"][b, :n]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, comp])[None]).logits[0].float()
        logits = logits[len(prompt) - 1 : len(prompt) - 1 + n] / temperature  # [n, V]
        out[b, :n] = tepo.entropy_change_c(logits, comp)
    return out


def _sampling_pass(model, batch, args, chunk=1024):
    """train()'s step 3, as it is written there: old log-probs, entropies and c of every token,
    from the sampling policy's logits, a chunk of valid positions at a time."""
    old_logp, old_entropy, c = (torch.zeros(batch["mask"].shape) for _ in range(3))
    for where, logits, ids in tepo.sampled_logits(model, batch, args, chunk=chunk):
        old_logp[where], old_entropy[where] = tepo.logp_and_entropy(logits, ids)
        c[where] = tepo.entropy_change_c(logits, ids)
    return old_logp, old_entropy, c


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_c_equals_c_from_full_logits(tiny, temperature):
    model, batch, _ = tiny
    m = batch["mask"].bool()
    expected = _c_direct(tiny, temperature)
    args = _args(temperature=temperature, bf16=False)
    # the micro-batch split (all at once, or 5 + 5 + 5 + 5 + 4) and the output layer's chunk of
    # valid positions (train(): 1024)
    for mbs, chunk in ((64, 1024), (5, 1024), (64, 1), (5, 7)):
        args.micro_batch_size = mbs
        old_logp, old_entropy, c = _sampling_pass(model, batch, args, chunk)
        assert c.shape == m.shape
        err = (c - expected)[m].abs().max()
        assert torch.allclose(c[m], expected[m], atol=1e-5), (mbs, chunk, err)
        assert (c[~m] == 0).all()  # padding is 0, not garbage
        # the same pass gives batch_logps' log-probs and entropies (bit for bit at its chunk)
        logp, entropy = tepo.batch_logps(model, batch, args)
        same = torch.equal if chunk == 1024 else lambda a, b: torch.allclose(a, b, atol=1e-5)
        assert same(old_logp, logp) and same(old_entropy, entropy), (mbs, chunk)
    assert (expected[m] > 0).any() and (expected[m] < 0).any()
    if temperature != 1.0:  # the temperature really reaches c
        assert not torch.allclose(expected[m], _c_direct(tiny, 1.0)[m], atol=1e-3)


def _recompute_like_training(model, batch, args, seed=1):
    """Entropies and log-probs as train() recomputes them in its update: train mode, grad on,
    the batch shuffled into mini-batches, micro-batches of 5 (not the old pass's split)."""
    model.train()
    ent, logp = torch.zeros(batch["mask"].shape), torch.zeros(batch["mask"].shape)
    g = torch.Generator().manual_seed(seed)
    for mini in torch.randperm(len(ent), generator=g).chunk(2):
        for mb in mini.split(5):
            lp, e = tepo.token_logps(model, batch, mb, args, with_entropy=True)
            ent[mb], logp[mb] = e.detach(), lp.detach()
    model.eval()
    return ent, logp


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_observed_mask_is_empty_without_an_update(tiny, bf16):
    """No update, only a different micro-batch split: the observed test, at the script's default
    tolerance for this precision, must mask nothing, even with A > 0 on every row."""
    model, batch, _ = tiny
    m = batch["mask"].bool()
    args = _args(bf16=bf16)
    assert args.micro_batch_size >= len(m)  # the old pass takes the batch in one micro-batch
    old_logp, old_ent, _ = _sampling_pass(model, batch, args)
    ent, logp = _recompute_like_training(model, batch, args)
    A = torch.ones(len(m))  # the worst case: every row may be masked
    tol = args.entropy_tol
    M = tepo.kl_mask(A, ent < old_ent - tol, batch["mask"])  # train()'s observed test
    ent_noise = (ent - old_ent)[m].abs().max().item()
    logp_noise = (logp - old_logp)[m].abs().max().item()
    print(
        f"[{'bf16' if bf16 else 'fp32'} on CPU] recomputation noise over {int(m.sum())} tokens: "
        f"max|d entropy| = {ent_noise:.3g}, max|d logp| = {logp_noise:.3g}, tol = {tol}"
    )  # -rP
    assert not M.any(), f"{int(M.sum())} tokens masked by noise alone (max |d entropy| {ent_noise})"
    assert ent_noise <= tol
    if not bf16:
        assert logp_noise <= 1e-5  # the ratio is 1 before the first update
    # tolerance 0: the same comparison shows whether the tolerance is what keeps the mask empty
    M0 = tepo.kl_mask(A, ent < old_ent, batch["mask"])
    if ((ent - old_ent)[m] < 0).any():
        assert M0.any()  # the noise is real here: without the tolerance it would mask tokens
    else:
        assert not M0.any()  # bit-exact recomputation (so far, CPU): nothing even at tolerance 0
