"""ERPO maths pinned by hand-computed values, plus property tests (the formulas are our reading
of the paper; see erpo.py's module docstring). Pure functions only: nothing is trained here."""

import doctest
import math

import pytest
import torch

import erpo
import grpo

NAN, INF = float("nan"), float("inf")


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------ (i) entropy gate
def _gate_example():
    # 2 prompts x G = 2. Prompt 0: valid entropies 0, 1, 3 (row 0) and 2 (row 1).
    H = torch.tensor(
        [[0.0, 1.0, 3.0, 7.0], [2.0, 5.0, 5.0, 5.0], [4.0, 4.0, 1.0, 0.0], [9.0, 8.0, 0.5, 0.0]]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return H, mask


def test_gate_hand_values_population_std_over_the_whole_group():
    H, mask = _gate_example()
    gamma = 5.0
    W = erpo.entropy_gate(H, mask, G=2, gamma=gamma)
    # prompt 0, valid tokens {0, 1, 3, 2}: mean 1.5, population variance
    # (2.25 + 0.25 + 2.25 + 0.25) / 4 = 1.25 (Bessel would give 5 / 3)
    mu, sd = 1.5, math.sqrt(1.25)
    expect = [
        [_sigmoid(gamma * (h - mu) / (sd + 1e-6)) for h in (0.0, 1.0, 3.0)],
        [_sigmoid(gamma * (2.0 - mu) / (sd + 1e-6))],
    ]
    assert torch.allclose(W[0, :3], torch.tensor(expect[0]), atol=1e-6)
    assert torch.allclose(W[1, :1], torch.tensor(expect[1]), atol=1e-6)
    # prompt 1, valid tokens {4, 4, 1, 0, 9, 8}: mean 26 / 6, population variance by hand
    vals = [4.0, 4.0, 1.0, 0.0, 9.0, 8.0]
    mu1 = 26 / 6
    sd1 = math.sqrt(sum((v - mu1) ** 2 for v in vals) / 6)
    expect1 = [_sigmoid(gamma * (v - mu1) / (sd1 + 1e-6)) for v in vals]
    assert torch.allclose(torch.cat([W[2], W[3, :2]]), torch.tensor(expect1), atol=1e-6)
    # padding gets 0
    assert W[0, 3] == 0 and torch.equal(W[1, 1:], torch.zeros(3))
    assert torch.equal(W[3, 2:], torch.zeros(2))


def test_gate_ignores_padding_and_other_prompts():
    H, mask = _gate_example()
    W = erpo.entropy_gate(H, mask, G=2)
    H2 = H.clone()
    H2[0, 3], H2[1, 1:] = INF, torch.tensor([NAN, -INF, 1e9])  # padding of prompt 0
    H2[2:] = torch.randn(2, 4) * 100  # the other prompt's entropies
    W2 = erpo.entropy_gate(H2, mask, G=2)
    assert torch.equal(W2[:2], W[:2])
    assert not torch.isnan(W2).any()
    # ... while a valid token of the same prompt, in the other completion, does move it
    H3 = H.clone()
    H3[1, 0] = 6.0
    assert not torch.allclose(erpo.entropy_gate(H3, mask, G=2)[0, :3], W[0, :3])


def test_gate_rejects_incomplete_groups():
    with pytest.raises(ValueError):
        erpo.entropy_gate(torch.zeros(3, 2), torch.ones(3, 2), G=2)


# ------------------------------------------------------------------ (ii) buckets
def test_bucket_index_by_relative_position_for_different_lengths():
    lengths = [10, 3, 7, 1, 0]
    T = 10
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    k = erpo.token_buckets(mask, num_buckets=10)
    # floor(t / n * 10), worked out by hand; -1 marks padding
    expected = [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # n = 10: one token per bucket
        [0, 3, 6] + [-1] * 7,  # n = 3: 0, 3.33, 6.67
        [0, 1, 2, 4, 5, 7, 8] + [-1] * 3,  # n = 7: 0, 1.43, 2.86, 4.29, 5.71, 7.14, 8.57
        [0] + [-1] * 9,
        [-1] * 10,  # an empty completion
    ]
    assert k.tolist() == expected
    # K = 4 on n = 10: 0, .4, .8, 1.2, 1.6, 2.0, 2.4, 2.8, 3.2, 3.6
    assert erpo.token_buckets(mask[:1], num_buckets=4).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3, 3]]
    # n = 3 with K = 3 puts exactly one token per bucket (t * 3 / 3 lands on integers)
    assert erpo.token_buckets(mask[1:2], num_buckets=3)[0, :3].tolist() == [0, 1, 2]


def test_bucket_normalize_hand_values_within_group_and_bucket():
    # G = 2, K = 2. Row 0 has 4 valid tokens (buckets 0 0 1 1), row 1 has 2 (buckets 0 1).
    # Rows 2-3 are another prompt whose values must not leak in.
    s = torch.tensor(
        [
            [1.0, 2.0, 10.0, 20.0, INF],
            [6.0, 30.0, NAN, 0.0, 0.0],
            [100.0, -50.0, 3.0, 0.0, 0.0],
            [7.0, 7.0, 7.0, 7.0, 7.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    st = erpo.bucket_normalize(s, mask, G=2, num_buckets=2)
    # prompt 0, bucket 0: {1, 2, 6}: mean 3, population variance (4 + 1 + 9) / 3 = 14 / 3
    sd0 = math.sqrt(14 / 3)
    # prompt 0, bucket 1: {10, 20, 30}: mean 20, population variance 200 / 3
    sd1 = math.sqrt(200 / 3)
    exp0 = [(1 - 3) / (sd0 + 1e-6), (2 - 3) / (sd0 + 1e-6), (10 - 20) / (sd1 + 1e-6), 0.0, 0.0]
    exp1 = [(6 - 3) / (sd0 + 1e-6), (30 - 20) / (sd1 + 1e-6), 0.0, 0.0, 0.0]
    assert torch.allclose(st[0], torch.tensor(exp0), atol=1e-6)
    assert torch.allclose(st[1], torch.tensor(exp1), atol=1e-6)
    # prompt 1: row 2 has 3 tokens (t * 2 // 3 = 0 0 1), row 3 has 5 (t * 2 // 5 = 0 0 0 1 1).
    # bucket 0: {100, -50, 7, 7, 7}: mean 71 / 5; bucket 1: {3, 7, 7}: mean 17 / 3
    b0, b1 = [100.0, -50.0, 7.0, 7.0, 7.0], [3.0, 7.0, 7.0]
    m0, m1 = 71 / 5, 17 / 3
    sdb0 = math.sqrt(sum((v - m0) ** 2 for v in b0) / 5)
    sdb1 = math.sqrt(sum((v - m1) ** 2 for v in b1) / 3)
    exp2 = [(100 - m0) / (sdb0 + 1e-6), (-50 - m0) / (sdb0 + 1e-6), (3 - m1) / (sdb1 + 1e-6), 0, 0]
    exp3 = [(7 - m0) / (sdb0 + 1e-6)] * 3 + [(7 - m1) / (sdb1 + 1e-6)] * 2
    assert torch.allclose(st[2], torch.tensor(exp2), atol=1e-6)
    assert torch.allclose(st[3], torch.tensor(exp3), atol=1e-6)


def test_bucket_normalize_lone_token_gives_zero_and_other_prompts_do_not_leak():
    # G = 2, K = 10: row 0 has 10 tokens (one per bucket), row 1 has 1 token (bucket 0), so
    # bucket 0 holds two tokens and buckets 1..9 one each.
    s = torch.tensor([[3.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], [5.0] + [0.0] * 9])
    mask = torch.tensor([[1] * 10, [1] + [0] * 9])
    st = erpo.bucket_normalize(s, mask, G=2, num_buckets=10)
    z = 1 / (1 + 1e-6)  # {3, 5}: mean 4, population std 1
    assert torch.allclose(st[:, 0], torch.tensor([-z, z]), atol=1e-6)
    assert torch.equal(st[0, 1:], torch.zeros(9))  # lone tokens
    assert torch.equal(st[1, 1:], torch.zeros(9))  # padding
    # the same prompt next to another one whose tokens share the bucket numbers
    s2 = torch.cat([s, torch.randn(2, 10) * 50])
    st2 = erpo.bucket_normalize(s2, torch.cat([mask, torch.ones(2, 10, dtype=torch.long)]), G=2)
    assert torch.equal(st2[:2], st)


def test_bucket_normalize_equal_values_give_exactly_zero():
    # a bucket of equal values: float32 rounding of the mean must not be blown up by 1 / 1e-6
    s = torch.full((4, 30), 0.1234567) * torch.tensor([1.0, 1.0, 3.0, 3.0])[:, None]
    st = erpo.bucket_normalize(s, torch.ones(4, 30), G=2, num_buckets=3)
    assert st.abs().max() < 1e-6


# ------------------------------------------------------------------ (iii) synthesis
def _synth_example():
    A = torch.tensor([1.0, -1.0])
    W = torch.tensor([[0.5, 0.9, 0.3], [0.2, 0.0, 0.7]])
    st = torch.tensor([[2.0, -1.0, 4.0], [0.5, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    return A, W, st, mask


def test_synthesis_both_modes_hand_values():
    A, W, st, mask = _synth_example()
    # Psi = W sgn(A) s~: row 0: 0.5 * 2 = 1, 0.9 * -1 = -0.9; row 1: -(0.2 * 0.5) = -0.1, 0
    psi_exp = torch.tensor([[1.0, -0.9, 0.0], [-0.1, 0.0, 0.0]])
    A_it, psi = erpo.token_advantages(A, W, st, mask, eta=0.2, synthesis="gated")
    assert torch.allclose(psi, psi_exp, atol=1e-6)
    # gated: A (1 + W) + 0.2 Psi
    gated = torch.tensor([[1.5 + 0.2, 1.9 - 0.18, 0.0], [-1.2 - 0.02, -1.0, 0.0]])
    assert torch.allclose(A_it, gated, atol=1e-6)
    A_it, psi = erpo.token_advantages(A, W, st, mask, eta=0.2, synthesis="additive")
    additive = torch.tensor([[1 + 0.2, 1 - 0.18, 0.0], [-1 - 0.02, -1.0, 0.0]])
    assert torch.allclose(A_it, additive, atol=1e-6) and torch.allclose(psi, psi_exp, atol=1e-6)
    with pytest.raises(ValueError):
        erpo.token_advantages(A, W, st, mask, synthesis="mean")


def test_all_equal_group_gives_exactly_zero_through_the_whole_pipeline():
    torch.manual_seed(0)
    G, T = 4, 6
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # prompt 1: all correct
    A = grpo.group_advantages(rewards, G)
    mask = (torch.arange(T)[None, :] < torch.tensor([6, 4, 5, 2, 3, 6, 1, 4])[:, None]).long()
    W = erpo.entropy_gate(torch.rand(8, T) * 3, mask, G)
    old, ref = -torch.rand(8, T) * 2, -torch.rand(8, T) * 2
    st = erpo.bucket_normalize(erpo.progress_signal(old, ref, mask), mask, G)
    assert st[G:].abs().sum() > 0  # the zero below comes from A = 0, not from an empty s~
    for mode in ("gated", "additive"):
        A_it, psi = erpo.token_advantages(A, W, st, mask, synthesis=mode)
        assert torch.equal(A_it[G:], torch.zeros(G, T)) and torch.equal(psi[G:], torch.zeros(G, T))
        assert (A_it[:G][mask[:G] > 0] != 0).all()


def test_flipping_the_outcome_flips_psi_and_the_advantage():
    torch.manual_seed(1)
    A = torch.tensor([0.8, -1.3, 0.4])
    W, st = torch.rand(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    for mode in ("gated", "additive"):
        A_it, psi = erpo.token_advantages(A, W, st, mask, synthesis=mode)
        A_neg, psi_neg = erpo.token_advantages(-A, W, st, mask, synthesis=mode)
        assert torch.allclose(psi_neg, -psi) and torch.allclose(A_neg, -A_it)
    # Psi's sign follows the outcome, not its size
    _, psi_big = erpo.token_advantages(A * 7, W, st, mask)
    assert torch.allclose(psi_big, psi)


def test_progress_signal_is_old_minus_ref_without_grad_and_zero_on_padding():
    old = torch.tensor([[-0.5, -2.0, NAN]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, -INF]])
    s = erpo.progress_signal(old, ref, torch.tensor([[1, 1, 0]]))
    assert torch.allclose(s, torch.tensor([[1.0, -1.5, 0.0]])) and not s.requires_grad


# ------------------------------------------------------------------ loss
def test_loss_hand_value_uses_each_tokens_own_advantage():
    # one completion, ratios 1.5, 0.5, 0.9 and A_it = (1, -2, -2), beta = 0:
    #   -min(1.5 * 1, 1.2 * 1) = -1.2        (clipped above)
    #   -min(0.5 * -2, 0.8 * -2) = 1.6       (clipped below)
    #   -min(0.9 * -2, 0.9 * -2) = 1.8       (inside the clip range)
    # token mean (-1.2 + 1.6 + 1.8) / 3
    old = torch.log(torch.tensor([[0.3, 0.6, 0.2, 0.1]]))
    logp = (old + torch.log(torch.tensor([[1.5, 0.5, 0.9, 9.0]]))).requires_grad_()
    A = torch.tensor([[1.0, -2.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = erpo.erpo_loss(logp, old, None, A, mask, kl_coef=0.0)
    assert abs(loss.item() - 2.2 / 3) < 1e-6
    loss.backward()
    # clipped tokens get no gradient; d/dlogp of -(ratio * -2) / 3 = 2 * 0.9 / 3 = 0.6
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.6, 0.0]]), atol=1e-6)
    # with KL: + beta * mean(k3), k3 = exp(d) - d - 1 with d = ref - logp = ln 2, 0, 0
    ref = logp.detach() + torch.tensor([[math.log(2), 0.0, 0.0, 0.0]])
    loss_kl = erpo.erpo_loss(logp, old, ref, A, mask, kl_coef=0.1)
    assert abs(loss_kl.item() - (2.2 / 3 + 0.1 * (1 - math.log(2)) / 3)) < 1e-6


def _loss_batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    A_it = torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, ref, A_it, mask


def test_loss_micro_batch_split_gives_same_value_and_gradient():
    logp, old, ref, A_it, mask = _loss_batch()
    full = erpo.erpo_loss(logp, old, ref, A_it, mask, kl_coef=0.04)
    (g_full,) = torch.autograd.grad(full, logp)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part = erpo.erpo_loss(
            logp[rows], old[rows], ref[rows], A_it[rows], mask[rows], kl_coef=0.04, num_seqs=6
        )
        part.backward()
        total = total + part.detach()
    assert torch.allclose(total, full.detach(), atol=1e-6)
    assert torch.allclose(logp.grad, g_full, atol=1e-6)
    assert g_full.abs().sum() > 0


def test_constant_gate_without_psi_is_grpo_with_scaled_advantage():
    logp, old, ref, _, mask = _loss_batch(seed=3)
    A = torch.tensor([1.2, -0.4, 0.0, 2.0, -1.1, 0.3])
    c = 0.6
    W = torch.full(mask.shape, c)
    A_it, _ = erpo.token_advantages(A, W, torch.randn(mask.shape), mask, eta=0.0)
    ours = erpo.erpo_loss(logp, old, ref, A_it, mask, kl_coef=0.04)
    ref_loss = grpo.grpo_loss(logp, old, ref, A * (1 + c), mask, 0.2, 0.2, 0.04, None)
    assert torch.allclose(ours, ref_loss, atol=1e-6)
    g_ours = torch.autograd.grad(ours, logp)[0]
    g_grpo = torch.autograd.grad(ref_loss, logp)[0]
    assert torch.allclose(g_ours, g_grpo, atol=1e-6)
    # and the gated advantage really differs from plain GRPO's (the test can tell them apart)
    plain = grpo.grpo_loss(logp, old, ref, A, mask, 0.2, 0.2, 0.04, None)
    assert not torch.allclose(ours, plain, atol=1e-4)


def test_nan_and_inf_on_padding_do_not_reach_advantages_loss_or_gradient():
    torch.manual_seed(2)
    logp, old, ref, _, mask = _loss_batch(seed=5)
    pad = mask == 0
    A = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 3)
    H = torch.rand(mask.shape) * 2

    def pipeline(H, old_in, ref_in):
        # junk on padding in the inputs of ERPO's own statistics (entropies, log-probs) ...
        W = erpo.entropy_gate(H, mask, G=3)
        st = erpo.bucket_normalize(erpo.progress_signal(old_in, ref_in, mask), mask, G=3)
        A_it, psi = erpo.token_advantages(A, W, st, mask)
        # ... while the loss gets log-probs as batch_logps returns them (0 on padding)
        loss = erpo.erpo_loss(logp, old, ref, A_it, mask, kl_coef=0.04)
        return A_it, psi, loss, torch.autograd.grad(loss, logp)[0]

    clean = pipeline(H, old, ref)

    def poison(x, value):
        return torch.where(pad, torch.full_like(x, value), x)

    for bad in (NAN, INF, -INF):
        dirty = pipeline(poison(H, bad), poison(old, bad), poison(ref, -bad))
        for c, d in zip(clean, dirty):
            assert torch.isfinite(d).all()
            assert torch.allclose(c, d, atol=1e-6)
    # per-token advantages with junk on padding, given straight to the loss: the per-token
    # advantage is ERPO's new input, so the loss itself must keep it off the gradient
    A_junk = torch.where(pad, torch.full(mask.shape, NAN), torch.randn(mask.shape))
    loss = erpo.erpo_loss(logp, old, ref, A_junk, mask)
    grad = torch.autograd.grad(loss, logp)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[pad], torch.zeros(int(pad.sum())))


# ------------------------------------------------------------------ statistics
def test_token_advantage_stats_hand_values():
    # row 3 has no valid token: it enters no statistic
    A = torch.tensor([1.0, -1.0, 0.0, 0.5])
    A_it = torch.tensor([[1.5, -0.1, 2.5], [-1.0, 0.4, 9.0], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.0]])
    W = torch.tensor([[0.95, 0.2, 0.99], [0.5, 0.91, 0.1], [0.3, 0.1, 0.1], [0.99, 0.99, 0.99]])
    psi = torch.tensor([[0.5, -2.0, 7.0], [-1.0, 0.5, 7.0], [0.0, 0.0, 7.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    st = erpo.token_advantage_stats(A_it, A, W, psi, mask)
    assert all(type(v) is float for v in st.values())
    # 5 valid tokens; W = 0.95, 0.2, 0.5, 0.91, 0.3
    assert abs(st["gate_mean"] - (0.95 + 0.2 + 0.5 + 0.91 + 0.3) / 5) < 1e-6
    assert abs(st["gate_high_frac"] - 2 / 5) < 1e-6
    assert abs(st["psi_abs_mean"] - (0.5 + 2.0 + 1.0 + 0.5 + 0.0) / 5) < 1e-6
    # among the 4 valid tokens with A_i != 0, -0.1 (A = 1) and 0.4 (A = -1) flipped
    assert abs(st["sign_flip_frac"] - 2 / 4) < 1e-6
    # population std within completions: row 0 {1.5, -0.1}: 0.8; row 1 {-1, 0.4}: 0.7; row 2: 0
    assert abs(st["adv_token_std"] - (0.8 + 0.7 + 0.0) / 3) < 1e-6
    # an empty batch gives zeros, not NaN
    empty = erpo.token_advantage_stats(A_it, A, W, psi, torch.zeros_like(mask))
    assert all(v == 0 for v in empty.values())


def test_erpo_stats_clip_and_kl_use_each_tokens_own_advantage():
    # ratios 1.5, 1.5, 0.5 | 0.5, then padding; A_it = -1, 1, -1 | 1.
    # clip active: (1.5, A < 0) no; (1.5, A > 0) yes; (0.5, A < 0) yes | (0.5, A > 0) no -> 2 / 4
    old = torch.log(torch.tensor([[0.2, 0.2, 0.4], [0.4, 0.1, 0.1]]))
    logp = old + torch.log(torch.tensor([[1.5, 1.5, 0.5], [0.5, 2.0, 2.0]]))
    A_it = torch.tensor([[-1.0, 1.0, -1.0], [1.0, 1.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    st = erpo.erpo_stats(logp, old, None, A_it, mask, 0.2, 0.2)
    assert set(st) == {"clip_frac"} and type(st["clip_frac"]) is float
    assert abs(st["clip_frac"] - 2 / 4) < 1e-6
    # one advantage per completion (A_i = 1, -1 broadcast) counts a different set: 1.5, 1.5 (row 0,
    # A > 0) and 0.5 (row 1, A < 0) -> 3 / 4
    row_A = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    assert abs(erpo.erpo_stats(logp, old, None, row_A, mask)["clip_frac"] - 3 / 4) < 1e-6
    # kl: k3 = exp(d) - d - 1 with d = ref - logp = ln 2 on token (0, 0), 0 elsewhere, over 4 tokens
    ref = logp + torch.tensor([[math.log(2), 0.0, 0.0], [0.0, 5.0, 5.0]])
    st = erpo.erpo_stats(logp, old, ref, A_it, mask)
    assert abs(st["kl"] - (1 - math.log(2)) / 4) < 1e-6


# ------------------------------------------------------------------ docstring examples
def test_doctests_of_erpo_pass():
    result = doctest.testmod(erpo)
    assert result.failed == 0 and result.attempted >= 5
