"""SAPO maths pinned by hand-computed values (Segment-Aligned Policy Optimization, arXiv
2605.01327: segments, segment rewards, segment GAE, segment ratio, value loss).

Pure functions only: no model is loaded and nothing is trained here."""

import doctest
import math

import pytest
import torch

import sapo

INF, NAN = float("inf"), float("nan")


def _ends(entropy, mask, frac=0.3):
    return sapo.segment_ends(torch.tensor(entropy), torch.tensor(mask), frac)


def _close(t, expected, atol=1e-6):
    want = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(t.double(), want, atol=atol, rtol=0)


def _positions(ends_row):
    return [t for t, e in enumerate(ends_row.tolist()) if e]


# ------------------------------------------------------------------ segment ends
def test_segment_ends_known_entropies():
    # row 0: n = 10, k = ceil(0.3 * 10) = 3 -> 4.0 @6, 3.0 @1, 2.0 @3; last @9 (lowest entropy)
    # row 1: n = 7,  k = ceil(2.1) = 3     -> 5 @2, 2 @4, 1 @0; last @6; padding holds 99
    entropy = [
        [0.5, 3.0, 0.1, 2.0, 0.2, 0.0, 4.0, 0.3, 0.4, 0.05],
        [1.0, 0.0, 5.0, 0.0, 2.0, 0.0, 0.5, 99.0, 99.0, 99.0],
    ]
    mask = [[1] * 10, [1] * 7 + [0] * 3]
    ends = _ends(entropy, mask)
    assert ends.dtype == torch.bool and ends.shape == (2, 10)
    assert _positions(ends[0]) == [1, 3, 6, 9]
    assert _positions(ends[1]) == [0, 2, 4, 6]


def test_segment_ends_count_is_ceil_not_round_and_immune_to_float_error():
    # n = 4: 0.3 * 4 = 1.2 -> ceil 2 (round would give 1): 3.0 @0, 2.0 @1, plus last @3
    assert _positions(_ends([[3.0, 2.0, 1.0, 0.0]], [[1, 1, 1, 1]])[0]) == [0, 1, 3]
    # n = 10: k = 3 exactly
    e = [[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]
    assert _positions(_ends(e, [[1] * 10])[0]) == [0, 1, 2, 9]
    # n = 100, frac = 0.07: 0.07 * 100 is 7.000000000000001 in floating point; k must be 7, not 8
    assert 0.07 * 100 > 7
    e = [[float(100 - t) for t in range(100)]]
    assert _positions(_ends(e, [[1] * 100], frac=0.07)[0]) == [0, 1, 2, 3, 4, 5, 6, 99]


def test_segment_ends_ties_go_to_the_earlier_position():
    # all equal, n = 5, k = ceil(1.5) = 2 -> positions 0 and 1, plus last @4
    assert _positions(_ends([[1.0] * 5], [[1] * 5])[0]) == [0, 1, 4]
    # n = 6, k = ceil(1.8) = 2; three-way tie at 2.0 on 1, 3, 4 -> 1 and 3; last @5
    assert _positions(_ends([[0.0, 2.0, 1.0, 2.0, 2.0, 0.0]], [[1] * 6])[0]) == [1, 3, 5]
    # n = 4, k = 2, padding's 9.0 ignored; tie at 7.0 on 1, 2, 3 -> 1 and 2; last @3
    assert _positions(_ends([[0.0, 7.0, 7.0, 7.0, 9.0]], [[1, 1, 1, 1, 0]])[0]) == [1, 2, 3]


def test_segment_ends_ties_on_long_rows_follow_position_order():
    # long rows with many ties (where an unstable sort does reorder equal keys)
    g = torch.Generator().manual_seed(1)
    entropy = torch.randint(0, 3, (4, 100), generator=g).float()
    lengths = [100, 90, 73, 64]
    mask = (torch.arange(100)[None, :] < torch.tensor(lengths)[:, None]).long()
    ends = sapo.segment_ends(entropy, mask)
    for b, n in enumerate(lengths):
        k = math.ceil(round(0.3 * n, 9))
        e = entropy[b].tolist()
        first_k = sorted(range(n), key=lambda t: (-e[t], t))[:k]  # highest, then earliest
        assert _positions(ends[b]) == sorted(set(first_k) | {n - 1})


def test_one_token_completion_has_one_segment():
    ends = _ends([[0.0, 5.0, 5.0], [0.3, 0.1, 0.2]], [[1, 0, 0], [1, 1, 1]])  # row 1: 2 segments
    assert ends[0].tolist() == [True, False, False]
    seg_id, seg_mask = sapo.segment_index(ends, torch.tensor([[1, 0, 0], [1, 1, 1]]))
    assert seg_mask[0].tolist() == [True, False]  # one segment for the 1-token row
    assert seg_id[0].tolist() == [0, -1, -1]


def test_padding_is_never_an_end_even_with_huge_or_non_finite_entropy():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 1e30, INF, NAN], [1.0, 2.0, INF, INF, NAN, 1e30]])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    ends = sapo.segment_ends(entropy, mask)
    assert not (ends & ~mask.bool()).any()
    # row 0: k = ceil(0.9) = 1 -> 0.3 @2, which is also the last; row 1: k = 1 -> 2.0 @1 = last
    assert _positions(ends[0]) == [2] and _positions(ends[1]) == [1]


def test_segment_ends_properties_on_random_batches():
    g = torch.Generator().manual_seed(0)
    B, T = 64, 37
    entropy = torch.rand(B, T, generator=g) * 3
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ends = sapo.segment_ends(entropy, mask, 0.3)
    for b in range(B):
        n = int(lengths[b])
        row = ends[b]
        assert not row[n:].any()
        if n == 0:
            assert not row.any()
            continue
        assert row[n - 1]  # the last valid token always ends a segment
        k = max(math.ceil(round(0.3 * n, 9)), 1)
        # continuous random entropies: no ties, so the top k are unambiguous
        expected = set(torch.topk(entropy[b, :n], k).indices.tolist()) | {n - 1}
        assert set(_positions(row)) == expected


def test_segment_ends_frac_one_makes_every_valid_token_an_end_and_bad_frac_raises():
    ends = _ends([[0.1, 0.2, 0.3, 0.4]], [[1, 1, 1, 0]], frac=1.0)
    assert ends[0].tolist() == [True, True, True, False]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            _ends([[0.1, 0.2]], [[1, 1]], frac=bad)


# ------------------------------------------------------------------ segment index, broadcast
def test_segment_index_hand_values():
    ends = torch.tensor([[0, 1, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    seg_id, seg_mask = sapo.segment_index(ends, mask)
    assert seg_id.tolist() == [[0, 0, 1, 1, 2, -1], [0, 0, 0, -1, -1, -1], [0, 1, 2, 3, 4, 5]]
    assert seg_mask.shape == (3, 6)
    assert seg_mask.sum(1).tolist() == [3, 1, 6]
    assert seg_mask[0].tolist() == [True, True, True, False, False, False]


def test_segment_index_ignores_ends_marked_on_padding():
    ends = torch.tensor([[0, 1, 0, 1, 1]]).bool()  # the end @3 and @4 sit on padding
    seg_id, seg_mask = sapo.segment_index(ends, torch.tensor([[1, 1, 0, 0, 0]]))
    assert seg_id.tolist() == [[0, 0, -1, -1, -1]] and seg_mask.tolist() == [[True]]


def test_to_tokens_gives_each_segment_value_to_exactly_its_tokens():
    seg_vals = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 0.0]])
    seg_id = torch.tensor([[0, 0, 1, 1, 2, -1], [0, 0, 0, 7, 7, 7]])  # padding: -1 or anything
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    out = sapo.to_tokens(seg_vals, seg_id, mask)
    assert out.tolist() == [[0.5, 0.5, -1.0, -1.0, 2.0, 0.0], [3.0, 3.0, 3.0, 0.0, 0.0, 0.0]]


# ------------------------------------------------------------------ value at segment states
def _three_segments():
    # row 0: segments [0, 1] [2, 3] [4]; row 1: [0] [1, 2, 3]; both padded to T = 6
    seg_id = torch.tensor([[0, 0, 1, 1, 2, -1], [0, 1, 1, 1, -1, -1]])
    seg_mask = torch.tensor([[True, True, True], [True, True, False]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    return seg_id, seg_mask, mask


def test_segment_state_values_start_and_end_hand_values_and_gradient_positions():
    seg_id, seg_mask, mask = _three_segments()
    v = torch.tensor(
        [[10.0, 11.0, 12.0, 13.0, 14.0, INF], [20.0, 21.0, 22.0, 23.0, NAN, INF]],
        requires_grad=True,
    )
    start = sapo.segment_state_values(v, seg_id, seg_mask, mask, "start")
    assert start.tolist() == [[10.0, 12.0, 14.0], [20.0, 21.0, 0.0]]  # V at b_m
    start.sum().backward()
    assert v.grad.tolist() == [[1, 0, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]]
    v.grad = None
    end = sapo.segment_state_values(v, seg_id, seg_mask, mask, "end")
    assert end.tolist() == [[11.0, 13.0, 14.0], [20.0, 23.0, 0.0]]  # V at e_m
    end.sum().backward()
    assert v.grad.tolist() == [[0, 1, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0]]
    with pytest.raises(ValueError):
        sapo.segment_state_values(v, seg_id, seg_mask, mask, "middle")


# ------------------------------------------------------------------ segment rewards
def test_segment_rewards_kl_part_and_outcome_on_last_segment_only():
    seg_id, seg_mask, mask = _three_segments()
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0, -0.2, 0.0], [-0.1, -0.3, -0.3, -0.3, 0.0, 0.0]])
    ref = torch.tensor([[-2.0, -2.5, -0.5, -4.0, -0.7, -INF], [-1.1, -0.3, -0.3, -1.3, INF, NAN]])
    # old - ref: row 0 = 1.0, 0.5 | 0.0, 3.0 | 0.5 ; row 1 = 1.0 | 0.0, 0.0, 1.0
    outcome = torch.tensor([1.0, 0.0])
    r = sapo.segment_rewards(old, ref, outcome, seg_id, seg_mask, mask, kl_coef=0.1)
    expected = [[-0.15, -0.3, 1.0 - 0.05], [-0.1, -0.1, 0.0]]
    assert torch.allclose(r, torch.tensor(expected), atol=1e-6)
    assert torch.isfinite(r).all()


def test_segment_rewards_without_kl_is_outcome_on_last_segment():
    seg_id, seg_mask, mask = _three_segments()
    old = torch.zeros(2, 6)
    r = sapo.segment_rewards(old, None, torch.tensor([1.0, 1.0]), seg_id, seg_mask, mask, kl_coef=0)
    assert r.tolist() == [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_segment_rewards_empty_completion_gets_nothing():
    seg_id = torch.tensor([[0, 0], [-1, -1]])
    seg_mask = torch.tensor([[True], [False]])
    mask = torch.tensor([[1, 1], [0, 0]])
    r = sapo.segment_rewards(
        torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([1.0, 1.0]), seg_id, seg_mask, mask
    )
    assert r.tolist() == [[1.0], [0.0]]


# ------------------------------------------------------------------ segment GAE
def test_segment_gae_three_segments_against_hand_recursion():
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[0.1, -0.2, 1.0]])
    V = torch.tensor([[0.5, 0.3, 0.7]])
    A, R = sapo.segment_gae(r, V, torch.ones(1, 3, dtype=torch.bool), gamma, lam)
    d3 = 1.0 + gamma * 0.0 - 0.7  # 0.3   (V(s_4) = 0)
    d2 = -0.2 + gamma * 0.7 - 0.3  # 0.13
    d1 = 0.1 + gamma * 0.3 - 0.5  # -0.13
    gl = gamma * lam  # 0.72
    A_hand = [d1 + gl * d2 + gl**2 * d3, d2 + gl * d3, d3]  # 0.11912, 0.346, 0.3
    assert A[0].tolist() == pytest.approx(A_hand, abs=1e-6)
    assert A[0].tolist() == pytest.approx([0.11912, 0.346, 0.3], abs=1e-6)
    assert R[0].tolist() == pytest.approx([0.11912 + 0.5, 0.346 + 0.3, 0.3 + 0.7], abs=1e-6)


def test_segment_gae_rows_with_different_segment_counts_are_independent():
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[0.1, -0.2, 1.0], [0.5, 100.0, 100.0], [0.0, 1.0, 100.0]])
    V = torch.tensor([[0.5, 0.3, 0.7], [0.2, 100.0, NAN], [0.4, 0.6, INF]])  # junk on padding
    seg_mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    A, R = sapo.segment_gae(r, V, seg_mask, gamma, lam)
    assert torch.isfinite(A).all() and torch.isfinite(R).all()
    # row 1: one segment: delta = 0.5 - 0.2 = 0.3 (nothing after it)
    assert A[1].tolist() == pytest.approx([0.3, 0.0, 0.0], abs=1e-6)
    assert R[1].tolist() == pytest.approx([0.5, 0.0, 0.0], abs=1e-6)
    # row 2: delta_2 = 1.0 - 0.6 = 0.4, delta_1 = 0 + 0.9 * 0.6 - 0.4 = 0.14;
    # A_1 = 0.14 + 0.72 * 0.4
    assert A[2].tolist() == pytest.approx([0.14 + 0.72 * 0.4, 0.4, 0.0], abs=1e-6)
    assert R[2].tolist() == pytest.approx([0.428 + 0.4, 1.0, 0.0], abs=1e-6)
    # the 3-segment row is unaffected by its neighbours
    assert A[0].tolist() == pytest.approx([0.11912, 0.346, 0.3], abs=1e-6)


def test_segment_gae_gamma_lambda_one_gives_reward_to_go_minus_value():
    r = torch.tensor([[0.0, -0.1, 1.0]])
    V = torch.tensor([[0.3, 0.6, 0.8]])
    A, R = sapo.segment_gae(r, V, torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    assert R[0].tolist() == pytest.approx([0.9, 0.9, 1.0], abs=1e-6)  # Monte Carlo returns
    assert A[0].tolist() == pytest.approx([0.6, 0.3, 0.2], abs=1e-6)


def test_advantage_broadcast_reaches_exactly_the_tokens_of_each_segment():
    seg_id, _, mask = _three_segments()
    A_seg = torch.tensor([[0.11912, 0.346, 0.3], [0.428, 0.4, 0.0]])
    A_tok = sapo.to_tokens(A_seg, seg_id, mask)
    assert torch.allclose(
        A_tok,
        torch.tensor(
            [[0.11912, 0.11912, 0.346, 0.346, 0.3, 0.0], [0.428, 0.4, 0.4, 0.4, 0.0, 0.0]]
        ),
    )


# ------------------------------------------------------------------ whiten and clamp
def test_whiten_hand_values_over_all_valid_tokens_of_the_batch():
    a = torch.tensor([[1.0, 1.0, 4.0, INF], [2.0, NAN, -INF, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = sapo.whiten_and_clamp(a, mask)
    # valid: 1, 1, 4, 2 -> mean 2, var (1 + 1 + 4 + 0) / 3 = 2 (Bessel), std sqrt(2)
    s = math.sqrt(2.0)
    assert _close(out, [[-1 / s, -1 / s, 2 / s, 0.0], [0.0, 0.0, 0.0, 0.0]], 1e-6)


def test_whiten_clamps_to_five():
    a = torch.zeros(1, 31)
    a[0, 30] = 100.0
    out = sapo.whiten_and_clamp(a, torch.ones(1, 31))
    mean = 100 / 31
    std = math.sqrt((30 * mean**2 + (100 - mean) ** 2) / 30)  # ~17.96: outlier ~5.39 std out
    assert out[0, 30].item() == 5.0
    assert out[0, 0].item() == pytest.approx(-mean / std, abs=1e-6)  # ~ -0.18, unclamped
    assert sapo.whiten_and_clamp(a, torch.ones(1, 31), clip=10.0)[0, 30].item() == pytest.approx(
        (100 - mean) / std, abs=1e-5
    )


def test_whiten_single_token_and_constant_batches_give_zero():
    one = sapo.whiten_and_clamp(torch.tensor([[3.0, 9.0]]), torch.tensor([[1, 0]]))
    assert one.tolist() == [[0.0, 0.0]]
    const = sapo.whiten_and_clamp(torch.full((2, 3), 0.5), torch.ones(2, 3))
    assert const.tolist() == [[0.0] * 3] * 2  # zero variance: no division by zero


# ------------------------------------------------------------------ segment ratio
def _ratio_example():
    # row 0: segments [0, 1, 2] [3]; row 1: [0, 1] [2] [3] padded; padding holds inf / nan
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0, 0.0], [-0.3, -1.2, -2.2, -0.1, 0.0]])
    diff = torch.tensor([[0.2, 0.0, -0.5, 0.3, 0.0], [-0.2, 0.4, 0.05, -0.3, 0.0]])
    seg_id = torch.tensor([[0, 0, 0, 1, -1], [0, 0, 1, 2, -1]])
    seg_mask = torch.tensor([[True, True, False], [True, True, True]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    return old, diff, seg_id, seg_mask, mask


def test_segment_ratio_value_is_the_geometric_mean_on_every_token():
    old, diff, seg_id, seg_mask, mask = _ratio_example()
    logp = old + diff
    logp[:, 4], old[:, 4] = INF, NAN
    x = sapo.segment_log_ratio(logp, old, seg_id, seg_mask, mask)
    s = torch.exp(x)
    g0 = (math.exp(0.2) * math.exp(0.0) * math.exp(-0.5)) ** (1 / 3)  # e^-0.1
    g1 = (math.exp(-0.2) * math.exp(0.4)) ** (1 / 2)  # e^0.1
    expected = [[g0, g0, g0, math.exp(0.3), 1.0], [g1, g1, math.exp(0.05), math.exp(-0.3), 1.0]]
    assert _close(s, expected, 1e-6)
    assert x[0, 4].item() == 0.0 and x[1, 4].item() == 0.0


def test_segment_ratio_gradient_is_one_on_own_token_only():
    old, diff, seg_id, seg_mask, mask = _ratio_example()
    logp = (old + diff).requires_grad_()
    x = sapo.segment_log_ratio(logp, old, seg_id, seg_mask, mask)
    W = torch.tensor([[0.3, -1.7, 2.0, 0.5, 9.0], [2.0, 0.5, -0.25, 1.0, 9.0]])
    x.backward(W)
    # d(sum W x)/d logp_t = W_t on valid tokens: nothing flows through the segment mean
    assert _close(logp.grad, (W * mask).tolist(), 1e-7)


def _literal_eq9_loss(logp, old, A_seg, segments, N, lo=0.2, hi=0.28):
    """Independent literal form: s_m = exp(mean over the segment of logp - old) WITH gradient
    through the mean (Eq. 8), Eq. 9 on each token, token-mean with denominator N."""
    total = 0.0
    for (b, ts), A in zip(segments, A_seg):
        s = torch.exp(torch.stack([logp[b, t] - old[b, t] for t in ts]).mean())
        term = -torch.min(s * A, torch.clamp(s, 1 - lo, 1 + hi) * A)
        total = total + term * len(ts)
    return total / N


def test_policy_loss_gradient_hand_value_and_equals_literal_eq8():
    old, diff, seg_id, seg_mask, mask = _ratio_example()
    A_seg = [2.0, -1.0, 0.5, 1.5, -2.0]  # row 0: seg 0, 1; row 1: seg 0, 1, 2
    A = torch.tensor([[2.0, 2.0, 2.0, -1.0, 0.0], [0.5, 0.5, 1.5, -2.0, 0.0]])
    N = 8
    logp = (old + diff).requires_grad_()
    loss = sapo.sapo_policy_loss(logp, old, A, seg_id, seg_mask, mask, num_tokens=N, dual_clip=None)
    loss.backward()
    # unclipped segments: d loss / d logp_t = -s_m A_m / N, the same on every token of m
    s00 = math.exp(-0.1)
    assert logp.grad[0, :3].tolist() == pytest.approx([-s00 * 2.0 / 8] * 3, abs=1e-6)  # -0.2262
    # row 0 seg 1: s = e^0.3 = 1.35, A < 0: -min(-1.35, -1.28) = 1.35, unclipped side -> grad s/N
    assert logp.grad[0, 3].item() == pytest.approx(math.exp(0.3) * 1.0 / 8, abs=1e-6)
    # row 1 seg 2: s = e^-0.3 = 0.741 < 0.8 with A < 0: clipped, no gradient
    assert logp.grad[1, 3].item() == 0.0
    # the same gradient as the literal geometric mean with gradient through the mean (Eq. 13)
    lit = logp.detach().clone().requires_grad_()
    segments = [(0, [0, 1, 2]), (0, [3]), (1, [0, 1]), (1, [2]), (1, [3])]
    lit_loss = _literal_eq9_loss(lit, old, A_seg, segments, N)
    lit_loss.backward()
    assert loss.item() == pytest.approx(lit_loss.item(), abs=1e-6)
    assert torch.allclose(logp.grad, lit.grad, atol=1e-6)


def test_clipping_is_per_segment_not_per_token():
    # one segment of two tokens, A = 1: token ratios e^0.6 (outside 1.28) and e^-0.4,
    # segment ratio e^0.1 = 1.105 (inside): no token is clipped, both get -s / N
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.6, -0.4]], requires_grad=True)
    seg_id, seg_mask, mask = torch.tensor([[0, 0]]), torch.tensor([[True]]), torch.ones(1, 2)
    loss = sapo.sapo_policy_loss(logp, old, torch.ones(1, 2), seg_id, seg_mask, mask, num_tokens=2)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert _close(logp.grad, [[-math.exp(0.1) / 2] * 2])
    # shift the segment to e^0.3 = 1.35 > 1.28: the whole segment is clipped at 1.28, zero grad
    logp2 = torch.tensor([[0.8, -0.2]], requires_grad=True)
    loss2 = sapo.sapo_policy_loss(
        logp2, old, torch.ones(1, 2), seg_id, seg_mask, mask, num_tokens=2
    )
    loss2.backward()
    assert loss2.item() == pytest.approx(-1.28, abs=1e-6)
    assert logp2.grad.tolist() == [[0.0, 0.0]]
    st = sapo.sapo_stats(logp2, old, torch.ones(1, 2), seg_id, seg_mask, mask)
    assert st["clip_frac"] == 1.0
    assert st["seg_ratio_max"] == pytest.approx(math.exp(0.3), abs=1e-6)


def test_dual_clip_caps_negative_advantage_loss_at_c():
    old = torch.zeros(1, 2)
    seg_id, seg_mask, mask = torch.tensor([[0, 1]]), torch.tensor([[True, True]]), torch.ones(1, 2)
    A = torch.tensor([[-2.0, -2.0]])
    # seg 0: s = e^1.5 = 4.48 > 3 -> loss 2 * 3 = 6 and no gradient; seg 1: s = 2 < 3 -> 2 * 2 = 4
    logp = torch.tensor([[1.5, math.log(2.0)]], requires_grad=True)
    loss = sapo.sapo_policy_loss(logp, old, A, seg_id, seg_mask, mask, num_tokens=2, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((6.0 + 4.0) / 2, abs=1e-5)
    assert _close(logp.grad, [[0.0, 2.0 * 2.0 / 2]], 1e-5)
    st = sapo.sapo_stats(logp, old, A, seg_id, seg_mask, mask, dual_clip=3.0)
    assert st["dual_clip_frac"] == 0.5
    # without the dual clip: 2 * e^1.5 on seg 0, with gradient 2 * e^1.5 / 2
    logp.grad = None
    loss = sapo.sapo_policy_loss(logp, old, A, seg_id, seg_mask, mask, num_tokens=2, dual_clip=None)
    loss.backward()
    assert loss.item() == pytest.approx((2 * math.exp(1.5) + 4.0) / 2, abs=1e-5)
    assert logp.grad[0, 0].item() == pytest.approx(math.exp(1.5), abs=1e-5)
    with pytest.raises(ValueError):
        sapo.sapo_policy_loss(logp, old, A, seg_id, seg_mask, mask, num_tokens=2, dual_clip=1.0)


def test_log_ratio_clamp_at_twenty():
    old = torch.zeros(1, 2)
    seg_id, seg_mask, mask = torch.tensor([[0, 0]]), torch.tensor([[True]]), torch.ones(1, 2)
    logp = torch.tensor([[30.0, 0.0]], requires_grad=True)
    x = sapo.segment_log_ratio(logp, old, seg_id, seg_mask, mask)  # (20 + 0) / 2
    assert _close(x, [[10.0, 10.0]])
    x.sum().backward()
    assert logp.grad.tolist() == [[0.0, 1.0]]  # the clamped token passes no gradient
    x2 = sapo.segment_log_ratio(logp.detach(), old, seg_id, seg_mask, mask, clamp=None)
    assert _close(x2, [[15.0, 15.0]])


def test_policy_loss_hand_value_on_first_update_is_minus_mean_advantage():
    old, _, seg_id, seg_mask, mask = _ratio_example()
    A = torch.tensor([[2.0, 2.0, 2.0, -1.0, 0.0], [0.5, 0.5, 1.5, -2.0, 0.0]])
    loss = sapo.sapo_policy_loss(old.clone(), old, A, seg_id, seg_mask, mask, num_tokens=8)
    assert loss.item() == pytest.approx(-(6.0 - 1.0 + 1.0 + 1.5 - 2.0) / 8, abs=1e-6)


def test_policy_loss_micro_batch_invariance_of_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    B, T = 6, 9
    entropy = torch.rand(B, T, generator=g)
    lengths = torch.tensor([9, 4, 1, 7, 9, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    seg_id, seg_mask = sapo.segment_index(sapo.segment_ends(entropy, mask), mask)
    old = -torch.rand(B, T, generator=g) * 3
    base = old + 0.4 * torch.randn(B, T, generator=g)
    A = sapo.to_tokens(torch.randn(B, seg_mask.shape[1], generator=g), seg_id, mask)
    N = mask.sum()

    whole = base.clone().requires_grad_()
    loss = sapo.sapo_policy_loss(whole, old, A, seg_id, seg_mask, mask, num_tokens=N)
    loss.backward()
    split = base.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part = sapo.sapo_policy_loss(
            split[rows], old[rows], A[rows], seg_id[rows], seg_mask[rows], mask[rows], num_tokens=N
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-7)
    assert whole.grad.abs().sum() > 0


# ------------------------------------------------------------------ value loss
def test_value_loss_clipped_form_hand_values_and_gradient():
    v = torch.tensor([[1.0, 0.2, -1.0, 5.0]], requires_grad=True)
    v_old = torch.zeros(1, 4)
    R = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    seg_mask = torch.tensor([[True, True, True, False]])
    loss = sapo.sapo_value_loss(v, v_old, R, seg_mask, num_segments=3, clip=0.5)
    # seg 0: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped wins); seg 1: 0.64; seg 2: max(1, 0.25) = 1
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.64 + 1.0) / 3, abs=1e-6)
    loss.backward()
    # seg 0: clipped branch, constant in V -> 0; seg 1: (0.2 - 1) / 3; seg 2: (-1 - 0) / 3; padded 0
    assert _close(v.grad, [[0.0, -0.8 / 3, -1.0 / 3, 0.0]], 1e-6)
    unclipped = sapo.sapo_value_loss(v.detach(), v_old, R, seg_mask, 3, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.64 + 1.0) / 3, abs=1e-6)
    st = sapo.value_stats(v.detach(), v_old, R, seg_mask)
    assert st["value_clip_frac"] == pytest.approx(1 / 3)


def test_value_loss_only_at_segment_states():
    seg_id, seg_mask, mask = _three_segments()
    tok_v = torch.tensor(
        [[0.1, 0.9, 0.2, 0.8, 0.3, 0.0], [0.4, 0.5, 0.7, 0.6, 0.0, 0.0]], requires_grad=True
    )
    R = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    for value_at, picked in (("start", [[0, 2, 4], [0, 1]]), ("end", [[1, 3, 4], [0, 3]])):
        tok_v.grad = None
        V = sapo.segment_state_values(tok_v, seg_id, seg_mask, mask, value_at)
        loss = sapo.sapo_value_loss(V, V.detach(), R, seg_mask, num_segments=5, clip=None)
        loss.backward()
        grad_at = [[t for t in range(6) if tok_v.grad[b, t] != 0] for b in range(2)]
        assert grad_at == picked
        # d/dV 0.5 (V - R)^2 / 5 = (V - R) / 5 at the picked token
        b, t = 1, picked[1][1]
        assert tok_v.grad[b, t].item() == pytest.approx((tok_v[b, t].item() - 1.0) / 5, abs=1e-6)


def test_value_loss_micro_batch_invariance():
    v = torch.tensor([[1.0, 0.2, 0.0], [0.3, -0.4, 0.9]])
    v_old = torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0]])
    R = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.5, 1.0]])
    seg_mask = torch.tensor([[True, True, False], [True, True, True]])
    whole = sapo.sapo_value_loss(v, v_old, R, seg_mask, 5)
    parts = sum(
        sapo.sapo_value_loss(v[i : i + 1], v_old[i : i + 1], R[i : i + 1], seg_mask[i : i + 1], 5)
        for i in range(2)
    )
    assert parts.item() == pytest.approx(whole.item(), abs=1e-7)


def test_explained_variance_hand_values():
    seg_mask = torch.tensor([[True, True, True, False]])
    R = torch.tensor([[0.0, 2.0, 4.0, 99.0]])
    V = torch.tensor([[0.0, 1.0, 4.0, -99.0]])
    # R - V = (0, 1, 0): Var 2/9; Var(R) = 8/3 -> 1 - (2/9) / (8/3) = 1 - 1/12
    assert sapo.explained_variance(V, R, seg_mask).item() == pytest.approx(11 / 12, abs=1e-6)
    assert sapo.explained_variance(R, R, seg_mask).item() == pytest.approx(1.0)
    mean_critic = torch.full((1, 4), 2.0)  # predicts mean(R) everywhere
    assert sapo.explained_variance(mean_critic, R, seg_mask).item() == pytest.approx(0.0)
    assert math.isnan(sapo.explained_variance(V, torch.ones(1, 4), seg_mask).item())


# ------------------------------------------------------------------ statistics
def test_rollout_stats_hand_values():
    _, seg_mask, mask = _three_segments()
    adv = torch.tensor([[1.0, 1.0, 2.0, 2.0, 3.0, INF], [0.0, 1.0, 1.0, 1.0, NAN, 0.0]])
    # 5 segment states; padded segment [1, 2] holds junk that must not count
    V = torch.tensor([[0.0, 1.0, 1.0], [2.0, 1.0, NAN]])
    R = torch.tensor([[0.0, 2.0, 1.0], [2.0, 0.0, INF]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0, NAN], [-2.0, -2.0, -2.0, -2.0, INF, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, -1.0, -1.0, 0.0], [-1.0, -2.0, -2.0, -2.0, -INF, 0.0]])
    st = sapo.rollout_stats(adv, V, R, seg_mask, mask, old, ref)
    assert all(isinstance(v, float) for v in st.values())
    assert st["segments_per_completion"] == 2.5  # (3 + 2) / 2
    assert st["segment_len"] == pytest.approx(9 / 5)
    # 9 tokens: 1, 1, 2, 2, 3, 0, 1, 1, 1 -> mean 12/9; sum of squares 22 -> var (22 - 9 m^2) / 8
    m = 12 / 9
    assert st["adv_mean"] == pytest.approx(m, abs=1e-6)
    assert st["adv_std"] == pytest.approx(math.sqrt((22 - 9 * m * m) / 8), abs=1e-6)
    # R = (0, 2, 1, 2, 0): mean 1, Var 0.8; R - V = (0, 1, 0, 0, -1): Var 0.4 -> 1 - 0.4 / 0.8
    assert st["explained_var"] == pytest.approx(0.5, abs=1e-6)
    assert st["value_mean"] == pytest.approx(5 / 5) and st["return_mean"] == pytest.approx(5 / 5)
    # k1 = old - ref over the 9 valid tokens: 0.5 on token [0, 0], -1 on token [1, 0]
    assert st["kl"] == pytest.approx(-0.5 / 9, abs=1e-6)
    assert "kl" not in sapo.rollout_stats(adv, V, R, seg_mask, mask)


# ------------------------------------------------------------------ NaN safety
def test_non_finite_values_on_padding_do_not_leak_into_losses_or_gradients():
    old, diff, seg_id, seg_mask, mask = _ratio_example()
    A = torch.tensor([[2.0, 2.0, 2.0, -1.0, 0.0], [0.5, 0.5, 1.5, -2.0, 0.0]])
    clean = (old + diff).requires_grad_()
    ref_loss = sapo.sapo_policy_loss(clean, old, A, seg_id, seg_mask, mask, num_tokens=8)
    ref_loss.backward()

    dirty_old, dirty_A = old.clone(), A.clone()
    dirty_old[:, 4], dirty_A[:, 4] = -INF, NAN
    base = old + diff
    base[:, 4] = INF
    dirty = base.requires_grad_()
    loss = sapo.sapo_policy_loss(dirty, dirty_old, dirty_A, seg_id, seg_mask, mask, num_tokens=8)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref_loss.item(), abs=1e-7)
    assert torch.isfinite(dirty.grad).all() and torch.allclose(dirty.grad, clean.grad)
    st = sapo.sapo_stats(dirty.detach(), dirty_old, dirty_A, seg_id, seg_mask, mask)
    assert all(math.isfinite(v) for v in st.values())

    # value side: inf on a padded segment state
    v = torch.tensor([[1.0, 0.2, INF]], requires_grad=True)
    v_old = torch.tensor([[0.0, 0.0, -INF]])
    R = torch.tensor([[2.0, 1.0, NAN]])
    vm = torch.tensor([[True, True, False]])
    vl = sapo.sapo_value_loss(v, v_old, R, vm, 2)
    vl.backward()
    assert torch.isfinite(vl) and torch.isfinite(v.grad).all() and v.grad[0, 2].item() == 0.0
    assert all(math.isfinite(x) for x in sapo.value_stats(v.detach(), v_old, R, vm).values())
    assert torch.isfinite(sapo.explained_variance(v.detach(), R, vm))


def test_full_pipeline_on_a_small_batch_is_finite_and_consistent():
    g = torch.Generator().manual_seed(5)
    B, T = 4, 12
    lengths = torch.tensor([12, 5, 1, 8])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    entropy = torch.where(mask.bool(), torch.rand(B, T, generator=g), INF)
    old = torch.where(mask.bool(), -torch.rand(B, T, generator=g), NAN)
    ref = torch.where(mask.bool(), -torch.rand(B, T, generator=g), -INF)
    seg_id, seg_mask = sapo.segment_index(sapo.segment_ends(entropy, mask), mask)
    r = sapo.segment_rewards(old, ref, torch.tensor([1.0, 0.0, 1.0, 0.0]), seg_id, seg_mask, mask)
    tok_v = torch.where(mask.bool(), torch.rand(B, T, generator=g), INF)
    V = sapo.segment_state_values(tok_v, seg_id, seg_mask, mask)
    A, R = sapo.segment_gae(r, V, seg_mask)
    A_tok = sapo.whiten_and_clamp(sapo.to_tokens(A, seg_id, mask), mask)
    assert torch.isfinite(A_tok).all()
    assert torch.where(mask.bool(), A_tok, 0.0).sum().abs().item() < 1e-4  # whitened: zero mean
    # the 1-token completion has a single segment whose reward is its outcome minus its KL
    assert seg_mask[2].sum().item() == 1
    assert r[2, 0].item() == pytest.approx(1.0 - 0.001 * (old[2, 0] - ref[2, 0]).item(), abs=1e-7)
    assert torch.allclose(R, torch.where(seg_mask, A + V, 0.0))


# ------------------------------------------------------------------ docstring examples
def test_docstring_examples_pass():
    res = doctest.testmod(sapo, verbose=False)
    assert res.failed == 0
    assert res.attempted > 0
