"""DAPO maths pinned by hand-computed values (DAPO, arXiv 2503.14476, Sec. 3.1-3.4).

Pure functions only: no model is loaded and nothing is trained here."""

import math

import pytest
import torch

import dapo
import grpo


# ------------------------------------------------------------------ overlong reward shaping
def test_overlong_penalty_three_regimes_and_both_boundaries():
    # L_max = 10, L_cache = 4: no penalty up to 10 - 4 = 6, linear ramp on (6, 10], -1 beyond.
    lengths = torch.tensor([1, 3, 6, 7, 8, 9, 10, 11, 40])
    pen = dapo.overlong_penalty(lengths, 10, 4)
    # (6 - 7) / 4 = -0.25, (6 - 8) / 4 = -0.5, (6 - 9) / 4 = -0.75, (6 - 10) / 4 = -1
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert pen.dtype.is_floating_point and pen.shape == (9,)
    assert pen.tolist() == expected  # quarters are exact in binary floating point
    assert pen[2].item() == 0.0  # len == L_max - L_cache: still no penalty
    assert pen[6].item() == -1.0  # len == L_max: the ramp reaches exactly -1
    assert pen[7].item() == -1.0  # len > L_max: flat -1, not (6 - 11) / 4 = -1.25


def test_overlong_penalty_non_dyadic_cache():
    # L_max = 7, L_cache = 3: threshold 4; 5 -> -1/3, 6 -> -2/3, 7 -> -1, 8 -> -1
    pen = dapo.overlong_penalty(torch.tensor([4, 5, 6, 7, 8]), 7, 3)
    assert pen.tolist() == pytest.approx([0.0, -1 / 3, -2 / 3, -1.0, -1.0], abs=1e-6)


def test_reward_fn_combines_correctness_and_overlong_penalty():
    texts = [
        "so \\boxed{4}",
        "\\boxed{5}",
        "no box here",
        "so \\boxed{4}",
        "\\boxed{4}",
        "\\boxed{3}",
        "\\boxed{4}",
    ]
    answers = ["4"] * 7
    lengths = torch.tensor([3, 3, 3, 8, 10, 12, 6])
    args = dapo.Args(max_new_tokens=10, overlong_cache=4, grader_timeout=5)  # ramp on (6, 10]
    r, c, p = dapo.reward_fn(texts, answers, lengths, args)
    # correct:  1,  0,  0,  1,    1,  0,  1
    # base:    +1, -1, -1, +1,   +1, -1, +1   (wrong, including unparsable, is -1, not 0)
    # penalty:  0,  0,  0, -0.5, -1, -1,  0
    assert c.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert p.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert r.tolist() == pytest.approx([1.0, -1.0, -1.0, 0.5, 0.0, -2.0, 1.0], abs=1e-6)
    assert r.dtype.is_floating_point and c.dtype.is_floating_point and p.dtype.is_floating_point


# ------------------------------------------------------------------ advantage
def test_group_advantages_same_as_grpo_and_hand_value_for_pm1_rewards():
    torch.manual_seed(0)
    r = torch.randn(12)
    assert torch.allclose(dapo.group_advantages(r, 4), grpo.group_advantages(r, 4))
    # rewards +-1: deviations +-1, Bessel std = sqrt(4 / 3)
    A = dapo.group_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0]), 4)
    a = 1 / (math.sqrt(4 / 3) + 1e-4)
    assert A.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], abs=1e-6)


# ------------------------------------------------------------------ dynamic sampling: group filter
def test_mixed_groups_all_zero_all_one_and_mixed():
    correct = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    m = dapo.mixed_groups(correct, 3)
    # groups (0,0,0) all wrong, (1,1,1) all right, (0,1,0) and (1,1,0) mixed
    assert m.dtype == torch.bool and m.tolist() == [False, False, True, True]


def test_mixed_groups_rows_belong_to_prompt_b_div_G():
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # G = 4: rows 0-3 are one group (mixed), rows 4-7 another (all 0)
    assert dapo.mixed_groups(correct, 4).tolist() == [True, False]
    # G = 2: (1, 0) mixed, then three all-0 groups
    assert dapo.mixed_groups(correct, 2).tolist() == [True, False, False, False]


# ------------------------------------------------------------------ dynamic sampling: the loop
ROW_TENSORS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "mask",
    "truncated",
    "correct",
    "rewards",
)


def _round(tag: str, groups: list[list[int]], Tp: int, Tc: int) -> dict:
    """A fake rollout round: one entry of `groups` per prompt (its G correctness bits).
    Every row gets its own recognisable tokens, a left-padded prompt of a row-dependent
    length and a right-padded completion of a row-dependent length, so that a padding bug
    shows up as changed tokens or misaligned masks."""
    G = len(groups[0])
    B = len(groups) * G
    base = 1000 * (1 + ord(tag[-1]) % 50)
    prompt_ids = torch.zeros(B, Tp, dtype=torch.long)
    prompt_mask = torch.zeros(B, Tp, dtype=torch.long)
    completion_ids = torch.zeros(B, Tc, dtype=torch.long)
    mask = torch.zeros(B, Tc, dtype=torch.long)
    for b in range(B):
        lp = 1 + b % Tp  # real prompt tokens: right-aligned (left padding)
        prompt_ids[b, Tp - lp :] = base + 10 * b + torch.arange(lp) + 1
        prompt_mask[b, Tp - lp :] = 1
        lc = 1 + (b * 2) % Tc  # real completion tokens: left-aligned (right padding)
        completion_ids[b, :lc] = base + 500 + 10 * b + torch.arange(lc) + 1
        mask[b, :lc] = 1
    correct = torch.tensor([float(x) for g in groups for x in g])
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        mask=mask,
        truncated=torch.tensor([b % 3 == 0 for b in range(B)]),
        texts=[f"{tag}-p{b // G}-row{b}" for b in range(B)],
        answers=[f"ans-{tag}-p{b // G}" for b in range(B)],
        correct=correct,
        rewards=2 * correct - 1 + 0.01 * torch.arange(B),  # recognisable per row
    )


class FakeSampler:
    def __init__(self, rounds):
        self.rounds, self.calls = rounds, 0

    def __call__(self):
        out = self.rounds[self.calls % len(self.rounds)]
        self.calls += 1
        return out


def _source_rows(rounds):
    """text -> (round dict, row index) for every row ever produced."""
    return {t: (rd, i) for rd in rounds for i, t in enumerate(rd["texts"])}


def _assert_rows_preserved(batch, rounds):
    """Every kept row carries its own real tokens and correctly aligned masks."""
    src = _source_rows(rounds)
    Tp, Tc = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    for j, text in enumerate(batch["texts"]):
        rd, i = src[text]
        # per-row scalars and lists move together with the row
        assert batch["answers"][j] == rd["answers"][i]
        assert batch["correct"][j].item() == rd["correct"][i].item()
        assert batch["rewards"][j].item() == pytest.approx(rd["rewards"][i].item())
        assert bool(batch["truncated"][j]) == bool(rd["truncated"][i])
        # prompt: same real tokens, mask of the form 0..0 1..1 (left padding, right-aligned)
        pm, opm = batch["prompt_mask"][j].bool(), rd["prompt_mask"][i].bool()
        n = int(opm.sum())
        assert pm.tolist() == [False] * (Tp - n) + [True] * n
        assert batch["prompt_ids"][j][pm].tolist() == rd["prompt_ids"][i][opm].tolist()
        # completion: same real tokens, mask of the form 1..1 0..0 (right padding)
        cm, ocm = batch["mask"][j].bool(), rd["mask"][i].bool()
        n = int(ocm.sum())
        assert cm.tolist() == [True] * n + [False] * (Tc - n)
        assert batch["completion_ids"][j][cm].tolist() == rd["completion_ids"][i][ocm].tolist()


def _rows(batch):
    return batch["completion_ids"].shape[0]


def test_dynamic_sampling_concatenates_rounds_of_different_widths():
    G, P = 2, 3
    rounds = [
        _round("a", [[1, 1], [0, 1], [0, 0]], Tp=3, Tc=4),  # 1 mixed group (prompt 1), 2 dropped
        _round("b", [[1, 0], [1, 1]], Tp=5, Tc=2),  # 1 mixed (prompt 0), 1 dropped
        _round("c", [[0, 0], [0, 1]], Tp=2, Tc=6),  # 1 mixed, 1 dropped -> 3 kept, stop
    ]
    sampler = FakeSampler(rounds)
    batch, info = dapo.dynamic_sampling(sampler, P, G, 10)
    assert sampler.calls == 3  # stops as soon as P mixed groups are in hand
    assert info["rounds"] == 3 and info["kept_groups"] == 3 and info["dropped_groups"] == 4
    assert not info["hit_round_limit"]
    assert batch["texts"] == [
        "a-p1-row2",
        "a-p1-row3",
        "b-p0-row0",
        "b-p0-row1",
        "c-p1-row2",
        "c-p1-row3",
    ]
    for k in ROW_TENSORS:
        assert batch[k].shape[0] == P * G, k
    assert len(batch["answers"]) == P * G
    # the longest kept rows have 3 real prompt tokens (round a, row 2) and 5 real completion
    # tokens (round c, row 2)
    assert batch["prompt_ids"].shape[1] >= 3 and batch["completion_ids"].shape[1] >= 5
    assert batch["prompt_mask"].shape == batch["prompt_ids"].shape
    assert batch["mask"].shape == batch["completion_ids"].shape
    _assert_rows_preserved(batch, rounds)
    # every kept group is mixed, and rows stay grouped G at a time
    assert dapo.mixed_groups(batch["correct"], G).all()
    # hand check of one row: round b (Tp = 5, Tc = 2), row 1: lp = 1 + 1 % 5 = 2 prompt tokens,
    # lc = 1 + 2 % 2 = 1 completion token
    j = batch["texts"].index("b-p0-row1")
    b = rounds[1]
    assert batch["prompt_ids"][j][batch["prompt_mask"][j].bool()].tolist() == [
        b["prompt_ids"][1, -2].item(),
        b["prompt_ids"][1, -1].item(),
    ]
    assert batch["completion_ids"][j][batch["mask"][j].bool()].tolist() == [
        b["completion_ids"][1, 0].item()
    ]


def test_dynamic_sampling_trims_to_exactly_P_groups():
    G, P = 3, 2
    rounds = [_round("a", [[0, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 1]], Tp=4, Tc=5)]  # 3 mixed
    sampler = FakeSampler(rounds)
    batch, info = dapo.dynamic_sampling(sampler, P, G, 5)
    assert sampler.calls == 1 and info["rounds"] == 1
    assert info["kept_groups"] == P and not info["hit_round_limit"]
    assert _rows(batch) == P * G and len(batch["texts"]) == P * G and len(batch["answers"]) == P * G
    assert batch["correct"].shape == (P * G,) and batch["rewards"].shape == (P * G,)
    # whole groups are kept (never a partial one), each of them mixed
    prompts = [t.split("-row")[0] for t in batch["texts"]]
    assert prompts[0:3] == [prompts[0]] * 3 and prompts[3:6] == [prompts[3]] * 3
    assert prompts[0] != prompts[3]
    assert set(prompts) <= {"a-p0", "a-p2", "a-p3"}
    assert dapo.mixed_groups(batch["correct"], G).all()
    _assert_rows_preserved(batch, rounds)


def test_dynamic_sampling_stops_at_round_limit_and_says_so(capsys):
    G, P = 2, 4
    rounds = [
        _round("a", [[1, 0], [1, 1], [0, 0]], Tp=2, Tc=3),  # 1 mixed, 2 dropped per round
        _round("b", [[0, 0], [0, 1], [1, 1]], Tp=4, Tc=2),
    ]
    sampler = FakeSampler(rounds)
    batch, info = dapo.dynamic_sampling(sampler, P, G, 2)
    assert sampler.calls == 2  # never more than max_rounds generation calls
    assert info["rounds"] == 2 and info["kept_groups"] == 2 and info["dropped_groups"] == 4
    assert info["hit_round_limit"]
    assert "round limit" in "".join(capsys.readouterr())
    assert _rows(batch) == 2 * G  # trains on what it has: fewer than P groups
    assert batch["texts"] == ["a-p0-row0", "a-p0-row1", "b-p1-row2", "b-p1-row3"]
    _assert_rows_preserved(batch, rounds)


def test_dynamic_sampling_zero_kept_groups(capsys):
    G, P = 2, 2
    rounds = [_round("a", [[1, 1], [0, 0]], Tp=3, Tc=3)]  # never a mixed group
    sampler = FakeSampler(rounds)
    batch, info = dapo.dynamic_sampling(sampler, P, G, 3)
    assert sampler.calls == 3
    assert info["rounds"] == 3 and info["kept_groups"] == 0 and info["dropped_groups"] == 6
    assert info["hit_round_limit"]
    assert "round limit" in "".join(capsys.readouterr())
    for k in ROW_TENSORS:
        assert isinstance(batch[k], torch.Tensor) and batch[k].shape[0] == 0, k
    assert batch["texts"] == [] and batch["answers"] == []


def test_dynamic_sampling_does_not_report_limit_when_it_fills_in_time(capsys):
    G, P = 2, 1
    rounds = [_round("a", [[1, 0]], Tp=2, Tc=2)]
    batch, info = dapo.dynamic_sampling(FakeSampler(rounds), P, G, 4)
    assert info["rounds"] == 1 and info["kept_groups"] == 1 and info["dropped_groups"] == 0
    assert not info["hit_round_limit"]
    assert "round limit" not in "".join(capsys.readouterr())


# ------------------------------------------------------------------ aggregation
def test_token_mean_vs_seq_mean_token_mean_unequal_lengths():
    l = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 99.0, 99.0, 99.0]])  # 99s are masked out
    m = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]).float()
    # token-mean: (1 + 2 + 3 + 4 + 10) / 5 = 4
    assert dapo.token_mean(l, m, 5.0).item() == pytest.approx(4.0)
    # seq-mean-token-mean: ((1 + 2 + 3 + 4) / 4 + 10 / 1) / 2 = (2.5 + 10) / 2 = 6.25
    assert grpo.seq_mean_token_mean(l, m, num_seqs=2).item() == pytest.approx(6.25)
    # a micro-batch slice divides by the whole mini-batch's token count: 10 / 5 = 2 and 10 / 5 = 2
    assert dapo.token_mean(l[1:], m[1:], 5.0).item() == pytest.approx(2.0)
    assert dapo.token_mean(l[:1], m[:1], 5.0).item() == pytest.approx(2.0)


# ------------------------------------------------------------------ loss: clip-higher
def _one_token_loss(ratio, A, **kw):
    """(loss, stats) of a single token with the given ratio and advantage."""
    logp, old = torch.full((1, 1), math.log(ratio)), torch.zeros(1, 1)
    A, mask = torch.tensor([A]), torch.ones(1, 1)
    loss = dapo.dapo_loss(logp, old, A, mask, **kw, num_tokens=1.0)
    return loss, dapo.dapo_stats(logp, old, A, mask, **kw)


@pytest.mark.parametrize(
    "ratio,A,clip_high,expected,clipped",
    [
        (1.25, 1.0, 0.28, -1.25, 0.0),  # A > 0, 1.25 < 1.28: NOT clipped under clip-higher ...
        (1.25, 1.0, 0.20, -1.20, 1.0),  # ... but would be under the symmetric 0.2
        (1.30, 1.0, 0.28, -1.28, 1.0),  # capped at 1 + 0.28
        (1.30, 2.0, 0.28, -2.56, 1.0),  # 1.28 * 2
        (1.25, -1.0, 0.28, 1.25, 0.0),  # A < 0: the upper clip never binds (min takes ratio * A)
        (0.75, -1.0, 0.28, 0.80, 1.0),  # A < 0, ratio < 1 - 0.2: floored at 0.8
        (0.85, -1.0, 0.28, 0.85, 0.0),  # inside [0.8, 1.28]
        (0.50, 1.0, 0.28, -0.50, 0.0),  # A > 0 below the range: unclipped
    ],
)
def test_clip_higher_asymmetry_by_hand(ratio, A, clip_high, expected, clipped):
    loss, st = _one_token_loss(ratio, A, clip_low=0.2, clip_high=clip_high)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert float(st["clip_frac"]) == pytest.approx(clipped)


def test_default_clip_range_is_0_2_and_0_28():
    assert _one_token_loss(1.25, 1.0)[0].item() == pytest.approx(-1.25, abs=1e-6)
    assert _one_token_loss(1.30, 1.0)[0].item() == pytest.approx(-1.28, abs=1e-6)
    assert _one_token_loss(0.70, -1.0)[0].item() == pytest.approx(0.80, abs=1e-6)


def test_dapo_loss_hand_value_token_mean_and_clip_frac():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).float()
    ratio = torch.tensor([[1.25, 1.3, 9.0], [0.5, 9.0, 9.0]])  # the 9s sit on padding
    logp = torch.log(ratio).requires_grad_()
    A = torch.tensor([1.0, -1.0])
    loss = dapo.dapo_loss(logp, torch.zeros(2, 3), A, mask, num_tokens=3.0)
    st = dapo.dapo_stats(logp, torch.zeros(2, 3), A, mask)
    # row 0 (A = 1): -1.25 (unclipped), -1.28 (clipped);
    # row 1 (A = -1): -min(-0.5, -0.8) = 0.8 (clipped)
    # token-mean over 3 tokens: (-1.25 - 1.28 + 0.8) / 3
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3, abs=1e-6)
    assert float(st["clip_frac"]) == pytest.approx(2 / 3)
    loss.backward()
    # d/dlogp of -ratio * A / N = -ratio * A / N where unclipped; 0 where clipped or padded
    expected = torch.tensor([[-1.25 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_dapo_stats_clip_frac_counts_active_clips_on_valid_tokens_only():
    # one token per case; columns: ratio, A
    #   1.30, +1  above 1 + 0.28 with A > 0            -> clipped
    #   1.25, +1  inside [0.8, 1.28]                   -> not
    #   0.70, -1  below 1 - 0.2 with A < 0             -> clipped
    #   0.70, +1  below the range but A > 0 (min = ratio * A) -> not
    #   1.50, -1  above the range but A < 0            -> not
    #   1.50,  0  A == 0                               -> not
    #   0.10, -1  would be clipped, but sits on padding -> not counted at all
    ratio = torch.tensor([[1.30, 1.25, 0.70, 0.70, 1.50, 1.50, 0.10]]).T  # [7, 1]
    A = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, 0.0, -1.0])
    mask = torch.tensor([[1], [1], [1], [1], [1], [1], [0]])
    st = dapo.dapo_stats(torch.log(ratio), torch.zeros(7, 1), A, mask)
    assert set(st) == {"clip_frac"} and isinstance(st["clip_frac"], float)
    assert st["clip_frac"] == pytest.approx(2 / 6)
    # the symmetric clip 0.2 / 0.2 also clips 1.25 with A > 0
    st = dapo.dapo_stats(torch.log(ratio), torch.zeros(7, 1), A, mask, clip_low=0.2, clip_high=0.2)
    assert st["clip_frac"] == pytest.approx(3 / 6)
    # no valid token at all: 0, not NaN
    assert dapo.dapo_stats(torch.log(ratio), torch.zeros(7, 1), A, 0 * mask)["clip_frac"] == 0.0


def test_first_update_gradient_is_token_mean_policy_gradient():
    """ratio == 1 on the first update: gradient -A_i m_it / N_tokens (every token weighs the same,
    unlike GRPO's -A_i m_it / (|o_i| B))."""
    B, T = 4, 5
    logp = torch.randn(B, T, requires_grad=True)
    A = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    ).float()
    loss = dapo.dapo_loss(logp, logp.detach(), A, mask, num_tokens=float(mask.sum()))  # N = 11
    loss.backward()
    assert torch.allclose(logp.grad, -A[:, None] * mask / 11, atol=1e-7)


def test_dapo_loss_micro_batch_invariance_of_value_and_gradients():
    torch.manual_seed(0)
    B, T = 8, 7
    logp0 = torch.randn(B, T)
    old = logp0 + 0.3 * torch.randn(B, T)  # ratios spread across both clip edges
    A = torch.randn(B)
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    N = float(mask.sum())  # counted once, before the micro-batch loop

    full = logp0.clone().requires_grad_()
    loss_full = dapo.dapo_loss(full, old, A, mask, num_tokens=N)
    st = dapo.dapo_stats(full, old, A, mask)
    loss_full.backward()
    assert 0 < float(st["clip_frac"]) < 1  # both clipped and unclipped tokens are exercised
    for k in (2, 3, B):
        split = logp0.clone().requires_grad_()
        total = 0.0
        for idx in torch.arange(B).tensor_split(k):
            l = dapo.dapo_loss(split[idx], old[idx], A[idx], mask[idx], num_tokens=N)
            l.backward()
            total += l.item()
        assert total == pytest.approx(loss_full.item(), abs=1e-6)
        assert torch.allclose(split.grad, full.grad, atol=1e-7)
