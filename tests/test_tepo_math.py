"""TEPO maths pinned by hand-computed values (spec: ../shared/ALGORITHMS.md, TEPO, "our reading").

Pure functions only: no model is loaded and nothing is trained here."""

import math

import pytest
import torch

import dapo
import tepo

LN2, LN3 = math.log(2), math.log(3)


def _loss(logp, old, A, mask, ent, base, kl_logp, N, **kw):
    # positional order of the API: logp, old_logp, advantages, mask, entropy, base_entropy, kl_logp, num_tokens
    return tepo.tepo_loss(logp, old, A, mask, ent, base, kl_logp, N, **kw)


# ------------------------------------------------------------------ carried ratio
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
    expected = torch.tensor([[0.2, 0.2], [0.1, 0.1]])
    assert torch.allclose(c[0, :2], expected[0], atol=1e-6) and torch.allclose(c[1], torch.full((3,), 0.1), atol=1e-6)
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


# ------------------------------------------------------------------ KL mask
def test_kl_mask_selects_positive_advantage_decreasing_entropy_valid_tokens_for_both_baselines():
    A = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0])
    entropy = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5], [0.3, 0.3, 0.3], [0.1, 0.1, 0.1], [0.7, 0.7, 0.7]])
    old_entropy = torch.tensor([[1.5, 1.5, 1.5], [1.5, 1.5, 1.5], [0.2, 0.4, 0.4], [0.9, 0.9, 0.9], [0.7, 0.7, 0.7]])
    ref_entropy = torch.tensor([[0.5, 2.5, 0.4], [0.5, 2.5, 0.4], [0.5, 0.2, 0.5], [0.9, 0.9, 0.9], [0.7, 0.8, 0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]).float()
    F_, T_ = False, True
    # baseline = old_entropy (default): "entropy fell since the batch was sampled"
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
    m_old = tepo.kl_mask(A, entropy, old_entropy, mask)
    m_ref = tepo.kl_mask(A, entropy, ref_entropy, mask)
    assert m_old.dtype == torch.bool and m_ref.dtype == torch.bool
    assert m_old.tolist() == expected_old
    assert m_ref.tolist() == expected_ref
    assert tepo.kl_mask(A, entropy, old_entropy, mask.long()).tolist() == expected_old  # integer mask too


def test_kl_mask_is_empty_before_the_policy_moves():
    A = torch.tensor([1.0, 2.0])
    e = torch.rand(2, 4)
    assert not tepo.kl_mask(A, e, e.clone(), torch.ones(2, 4)).any()


# ------------------------------------------------------------------ token level, empty mask == DAPO
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
    kl_logp = logp0 + torch.randn(B, T)
    N = float(mask.sum())

    a = logp0.clone().requires_grad_()
    lt, st = _loss(a, old, A, mask, ent, base, kl_logp, N, ratio_level="token", kl_coef=0.04)
    lt.backward()
    b = logp0.clone().requires_grad_()
    ld, sd = dapo.dapo_loss(b, old, A, mask, N, clip_low=0.2, clip_high=0.28)
    ld.backward()
    assert lt.item() == pytest.approx(ld.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-7)
    assert float(st["clip_frac"]) == pytest.approx(float(sd["clip_frac"]))
    assert float(st["mask_frac"]) == 0.0 and float(st["masked_kl"]) == 0.0
    assert math.isfinite(float(st["masked_entropy"])) and math.isfinite(float(st["other_entropy"]))


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
    base, ent = torch.zeros(B, T), torch.ones(B, T)
    a = logp0.clone().requires_grad_()
    lt, _ = _loss(a, old, A, mask, ent, base, old, 9.0, ratio_level="sequence")
    lt.backward()
    b = logp0.clone().requires_grad_()
    ld, _ = dapo.dapo_loss(b, old, A, mask, 9.0)
    ld.backward()
    assert lt.item() == pytest.approx(ld.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


# ------------------------------------------------------------------ sequence-ratio gradient
def test_sequence_ratio_gradient_is_minus_s_A_over_N_where_unclipped():
    old, diff, mask = _seq_example()
    logp = (old + diff).requires_grad_()
    A = torch.tensor([1.0, -0.5])
    ent, base = torch.ones(2, 3), torch.zeros(2, 3)  # mask empty anyway
    loss, st = _loss(logp, old, A, mask, ent, base, old, 5.0, kl_coef=0.0)
    s0, s1 = math.exp(0.2), math.exp(0.1)  # both inside [0.8, 1.28]
    # value: sum over the 5 valid tokens of -s_i A_i, / 5 = (-2 s0 + 3 * 0.5 s1) / 5
    assert loss.item() == pytest.approx((-2 * s0 + 1.5 * s1) / 5, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[-s0 * 1.0 / 5, -s0 * 1.0 / 5, 0.0], [s1 * 0.5 / 5] * 3])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # token (0, 1) has its own ratio e^0.3 = 1.35 > 1.28: the token-level objective clips it, the
    # sequence-level one does not (its weight is the row's ratio)
    assert logp.grad[0, 1].item() != 0.0
    assert float(st["seq_ratio_min"]) == pytest.approx(s1, abs=1e-6)
    assert float(st["seq_ratio_max"]) == pytest.approx(s0, abs=1e-6)
    assert float(st["clip_frac"]) == 0.0


def test_clipped_sequences_get_no_policy_gradient():
    old = torch.zeros(4, 2)
    diff = torch.tensor([[0.2, 0.8], [-0.9, -0.1], [1.0, 0.0], [0.0, -1.0]])  # row means 0.5, -0.5, 0.5, -0.5
    logp = (old + diff).requires_grad_()
    A = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, 2)
    ent, base = torch.zeros(4, 2), torch.ones(4, 2)  # entropies fell: mask non-empty on rows 0 and 3, but kl_coef = 0
    loss, st = _loss(logp, old, A, mask, ent, base, old - 1.0, 8.0, kl_coef=0.0)
    e, ei = math.exp(0.5), math.exp(-0.5)  # 1.6487 and 0.6065
    # row 0: A > 0, s = e > 1.28  -> clipped, -1.28 per token, no gradient
    # row 1: A < 0, s = ei < 0.8  -> clipped, -min(-ei, -0.8) = 0.8 per token, no gradient
    # row 2: A < 0, s = e > 1.28  -> min picks s * A: e per token, gradient -s A / N = e / 8
    # row 3: A > 0, s = ei < 0.8  -> unclipped: -ei per token, gradient -ei / 8
    assert loss.item() == pytest.approx(2 * (-1.28 + 0.8 + e - ei) / 8, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0], [0.0, 0.0], [e / 8, e / 8], [-ei / 8, -ei / 8]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert float(st["clip_frac"]) == pytest.approx(4 / 8)
    assert float(st["seq_ratio_min"]) == pytest.approx(ei, abs=1e-6)
    assert float(st["seq_ratio_max"]) == pytest.approx(e, abs=1e-6)


# ------------------------------------------------------------------ KL term only on masked tokens
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
    M = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).float()
    assert tepo.kl_mask(A, ent, base, mask).float().tolist() == M.tolist()
    ref = logp0 + torch.randn(B, T)  # kl target, != logp everywhere
    N = float(mask.sum())

    grads, stats = {}, {}
    for coef in (0.04, 0.0):
        x = logp0.clone().requires_grad_()
        loss, stats[coef] = _loss(x, old, A, mask, ent, base, ref, N, kl_coef=coef)
        loss.backward()
        grads[coef] = x.grad
    st = stats[0.04]
    diff = grads[0.04] - grads[0.0]
    # d/dp of 0.04 * k3(q, p) / N = 0.04 * (1 - exp(q - p)) / N, only where M = 1
    expected = 0.04 * M * (1 - torch.exp(ref - logp0)) / N
    assert torch.allclose(diff, expected, atol=1e-7)
    assert (diff[M.bool()] != 0).all() and (diff[~M.bool()] == 0).all()
    k3 = torch.exp(ref - logp0) - (ref - logp0) - 1
    assert float(st["mask_frac"]) == pytest.approx(3 / N)
    assert float(st["masked_kl"]) == pytest.approx(k3[M.bool()].mean().item(), abs=1e-6)


# ------------------------------------------------------------------ hand-computed full value
def test_full_tepo_loss_hand_value_2x3():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    diff = torch.tensor([[0.0, 0.1, 0.2], [0.4, 0.2, 3.0]])  # 3.0 is padding
    logp = (old + diff).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    A = torch.tensor([2.0, 1.0])
    ent = torch.tensor([[1.0, 2.0, 0.5], [0.2, 0.9, 0.1]])
    base = torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 0.5]])
    # M = [[1, 0, 1], [1, 0, 0]]  (A > 0 on both rows; (1, 2) fell but is padding)
    d = torch.tensor([[LN2, 1.0, -LN2], [LN3, 1.0, 1.0]])  # kl_logp - logp
    kl_logp = (old + diff) + d
    loss, st = _loss(logp, old, A, mask, ent, base, kl_logp, 5.0, kl_coef=0.1)
    # row 0: log s = (0 + 0.1 + 0.2) / 3 = 0.1, s = e^0.1 in range: -2 e^0.1 on each of 3 tokens
    # row 1: log s = (0.4 + 0.2) / 2 = 0.3, s = e^0.3 = 1.35 > 1.28, A > 0: -1.28 on each of 2 tokens
    # k3 on M: d = ln 2 -> 2 - ln 2 - 1 = 1 - ln 2; d = -ln 2 -> 1/2 + ln 2 - 1 = ln 2 - 1/2;
    #          d = ln 3 -> 3 - ln 3 - 1 = 2 - ln 3; sum = 5/2 - ln 3
    expected = (-6 * math.exp(0.1) - 2.56 + 0.1 * (2.5 - LN3)) / 5  # = -1.8101773...
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(-1.8101773, abs=1e-6)
    assert float(st["mask_frac"]) == pytest.approx(3 / 5)
    assert float(st["masked_kl"]) == pytest.approx((2.5 - LN3) / 3, abs=1e-6)
    assert float(st["clip_frac"]) == pytest.approx(2 / 5)
    assert float(st["seq_ratio_min"]) == pytest.approx(math.exp(0.1), abs=1e-6)
    assert float(st["seq_ratio_max"]) == pytest.approx(math.exp(0.3), abs=1e-6)
    assert float(st["masked_entropy"]) == pytest.approx((1.0 + 0.5 + 0.2) / 3, abs=1e-6)
    assert float(st["other_entropy"]) == pytest.approx((2.0 + 0.9) / 2, abs=1e-6)
    loss.backward()
    # policy: -s0 A0 / 5 = -2 e^0.1 / 5 on row 0, 0 on the clipped row 1
    # KL: 0.1 (1 - e^d) / 5 on M: (0,0) 0.1 (1 - 2) / 5, (0,2) 0.1 (1 - 1/2) / 5, (1,0) 0.1 (1 - 3) / 5
    g = -2 * math.exp(0.1) / 5
    expected_grad = torch.tensor([[g - 0.02, g, g + 0.01], [-0.04, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_defaults_are_sequence_level_clip_0_2_0_28_and_kl_0_04():
    # the hand example above, called with defaults: only the KL term changes (0.04 instead of 0.1)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    diff = torch.tensor([[0.0, 0.1, 0.2], [0.4, 0.2, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    ent = torch.tensor([[1.0, 2.0, 0.5], [0.2, 0.9, 0.1]])
    base = torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 0.5]])
    d = torch.tensor([[LN2, 1.0, -LN2], [LN3, 1.0, 1.0]])
    loss, _ = _loss(old + diff, old, torch.tensor([2.0, 1.0]), mask, ent, base, old + diff + d, 5.0)
    assert loss.item() == pytest.approx((-6 * math.exp(0.1) - 2.56 + 0.04 * (2.5 - LN3)) / 5, abs=1e-6)


# ------------------------------------------------------------------ micro-batch invariance
@pytest.mark.parametrize("ratio_level", ["sequence", "token"])
def test_micro_batch_invariance_of_value_and_gradients(ratio_level):
    torch.manual_seed(0)
    B, T = 8, 7
    logp0 = torch.randn(B, T)
    old = logp0 + 0.3 * torch.randn(B, T)
    A = torch.randn(B)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,))[:, None]).float()
    ent, base = torch.rand(B, T), torch.rand(B, T)  # about half the tokens of A > 0 rows are masked
    kl_logp = logp0 + 0.5 * torch.randn(B, T)
    N = float(mask.sum())  # counted once for the whole mini-batch

    full = logp0.clone().requires_grad_()
    loss_full, st = _loss(full, old, A, mask, ent, base, kl_logp, N, ratio_level=ratio_level)
    loss_full.backward()
    assert float(st["mask_frac"]) > 0  # the KL term is exercised
    for k in (2, 3, B):
        split = logp0.clone().requires_grad_()
        total = 0.0
        for idx in torch.arange(B).tensor_split(k):
            l, _ = _loss(split[idx], old[idx], A[idx], mask[idx], ent[idx], base[idx], kl_logp[idx], N,
                         ratio_level=ratio_level)
            l.backward()
            total += l.item()
        assert total == pytest.approx(loss_full.item(), abs=1e-6)
        assert torch.allclose(split.grad, full.grad, atol=1e-7)
