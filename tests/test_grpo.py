"""GRPO maths pinned by hand-computed values, plus property tests and end-to-end runs."""

import dataclasses
import math

import pytest
import torch

import common
import grpo


# ------------------------------------------------------------------ advantage
def test_group_advantage_hand_values_and_all_equal_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    A = grpo.group_advantages(r, G=4)
    std = math.sqrt((4 * 0.25) / 3)  # Bessel: sum of squared deviations / (G - 1)
    expect = 0.5 / (std + 1e-4)
    assert torch.allclose(A[:4], torch.tensor([expect, -expect, -expect, expect]), atol=1e-6)
    assert torch.equal(A[4:], torch.zeros(8))  # all-1 and all-0 groups: exactly 0, no NaN
    assert not torch.isnan(A).any()


def test_group_advantage_rows_belong_to_prompt_b_div_G():
    r = torch.tensor([0.0, 0.0, 1.0, 3.0, 3.0, 3.0])
    A = grpo.group_advantages(r, G=3)
    assert A[2] > 0 and A[0] < 0 and torch.equal(A[3:], torch.zeros(3))


# ------------------------------------------------------------------ KL and clipped ratio
def test_k3_hand_value():
    q, p = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # d = log(0.5/0.25) = log 2: exp(d) - d - 1 = 2 - log 2 - 1
    assert torch.allclose(grpo.k3_kl(q, p), torch.tensor([1 - math.log(2)]), atol=1e-6)
    assert grpo.k3_kl(p, p).item() == 0.0
    assert (grpo.k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


@pytest.mark.parametrize(
    "ratio,A,expected",
    [
        (1.5, 1.0, -1.2),  # positive advantage: capped at 1 + eps
        (1.5, -1.0, 1.5),  # negative advantage: min picks the unclipped (more pessimistic) term
        (0.5, 1.0, -0.5),  # positive advantage, ratio below 1 - eps: unclipped
        (0.5, -1.0, 0.8),  # negative advantage: floored at 1 - eps
        (1.1, 2.0, -2.2),  # inside the clip range: ratio * A
    ],
)
def test_clipped_ratio_term_hand_values(ratio, A, expected):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio))
    loss = grpo.grpo_loss(logp, old, None, torch.tensor([A]), torch.ones(1, 1), kl_coef=0.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_clip_fraction_counts_only_active_clips():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.3]]))
    st = grpo.grpo_stats(logp, old, None, torch.tensor([1.0]), torch.ones(1, 4))
    assert st["clip_frac"] == pytest.approx(2 / 4)  # 1.5 and 1.3 are clipped for A > 0


# ------------------------------------------------------------------ aggregation
def test_seq_mean_token_mean_hand_value():
    l = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]]).float()
    # row means: (1 + 2) / 2 = 1.5 and 4 / 1 = 4; mean over rows 2.75
    assert grpo.seq_mean_token_mean(l, m, num_seqs=2).item() == pytest.approx(2.75)


def test_grpo_loss_with_kl_hand_value():
    logp = torch.log(torch.tensor([[0.25, 0.5]]))
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    loss = grpo.grpo_loss(
        logp, logp.clone(), ref, torch.tensor([2.0]), torch.tensor([[1.0, 1.0]]), kl_coef=0.1
    )
    st = grpo.grpo_stats(logp, logp.clone(), ref, torch.tensor([2.0]), torch.tensor([[1.0, 1.0]]))
    # ratio 1: pg = -2 per token; kl = [1 - log 2, 0]; mean over 2 tokens
    expected = (-2 + 0.1 * (1 - math.log(2)) + -2 + 0.0) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert st["kl"] == pytest.approx((1 - math.log(2)) / 2, abs=1e-6)


def test_first_update_gradient_is_policy_gradient():
    """ratio == 1: the loss value is 0 for zero-mean advantages, the gradient -A m / (|o_i| B)."""
    B, T = 4, 5
    logp = torch.randn(B, T, requires_grad=True)
    A = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    ).float()
    loss = grpo.grpo_loss(logp, logp.detach(), None, A, mask, kl_coef=0.0)
    loss.backward()
    expected = -A[:, None] * mask / mask.sum(1, keepdim=True) / B
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_micro_batch_invariance_of_loss_and_gradients():
    torch.manual_seed(0)
    B, T = 8, 7
    logp0 = torch.randn(B, T)
    old, ref = logp0 + 0.3 * torch.randn(B, T), logp0 + 0.3 * torch.randn(B, T)
    A = torch.randn(B)
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None] < lengths[:, None]).float()

    full = logp0.clone().requires_grad_()
    loss_full = grpo.grpo_loss(full, old, ref, A, mask, kl_coef=0.04)
    loss_full.backward()
    for k in (2, 3, 8):
        split = logp0.clone().requires_grad_()
        total = 0.0
        for idx in torch.arange(B).tensor_split(k):
            l = grpo.grpo_loss(
                split[idx], old[idx], ref[idx], A[idx], mask[idx], kl_coef=0.04, num_seqs=B
            )
            l.backward()
            total += l.item()
        assert total == pytest.approx(loss_full.item(), abs=1e-6)
        assert torch.allclose(split.grad, full.grad, atol=1e-7)


def test_all_equal_group_gives_finite_loss_and_gradients():
    A = grpo.group_advantages(torch.ones(4), G=4)
    logp = torch.randn(4, 3, requires_grad=True)
    loss = grpo.grpo_loss(
        logp, logp.detach() - 0.1, logp.detach(), A, torch.ones(4, 3), kl_coef=0.04
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# ------------------------------------------------------------------ masks and log-probs
def test_position_mask_when_pad_equals_eos():
    eos, im_end = 0, 2  # pad == eos == 0, as in Qwen base models
    ids = torch.tensor(
        [
            [5, 6, 0, 0, 0],  # ends with EOS at 2, then padding that is also EOS
            [0, 0, 0, 0, 0],  # EOS first: only that token counts
            [5, 6, 7, 8, 9],  # truncated: every token counts
            [5, 2, 0, 0, 0],  # ends on the second EOS id
        ]
    )
    m = grpo.completion_mask(ids, [eos, im_end])
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert (ids != eos).long().tolist() != m.tolist()  # the pad-based mask would be wrong


def _tiny_policy(tiny_dir, bf16=False):
    args = grpo.Args(bf16=bf16, gradient_checkpointing=False, device="cpu", micro_batch_size=64)
    tok, _ = grpo.load_tokenizer(str(tiny_dir), False)
    return grpo.load_model(str(tiny_dir), torch.device("cpu"), args, trainable=False), tok


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logps_use_temperature_and_match_generate(tiny_dir, temperature):
    """Log-probs with left padding equal log_softmax(logits / T) of the very distribution
    generate() sampled from (its raw logits, one sequence at a time, unpadded)."""
    model, tok = _tiny_policy(tiny_dir)
    prompts = [common.build_prompt(tok, p, "tiny") for p in ("1+2-3", "45+67-89")]
    torch.manual_seed(0)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any()  # left padding is exercised
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        max_new_tokens=8,
        eos_token_id=[-1],
        pad_token_id=tok.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    comp = out.sequences[:, enc["input_ids"].shape[1] :]
    mask = torch.ones_like(comp)
    batch = dict(
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        completion_ids=comp,
        mask=mask,
    )
    args = grpo.Args(temperature=temperature, bf16=False, device="cpu")
    with torch.no_grad():
        logp, ent = grpo.token_logps(model, batch, torch.arange(2), args, with_entropy=True)
    raw = torch.stack(out.logits, 1).float()  # [B, T, V] before any processing
    expected = torch.log_softmax(raw / temperature, -1).gather(-1, comp[..., None]).squeeze(-1)
    assert torch.allclose(logp, expected, atol=1e-4)
    expected_ent = torch.distributions.Categorical(logits=raw / temperature).entropy()
    assert torch.allclose(ent, expected_ent, atol=1e-4)
    if temperature != 1.0:  # and the temperature really matters
        untempered = torch.log_softmax(raw, -1).gather(-1, comp[..., None]).squeeze(-1)
        assert not torch.allclose(logp, untempered, atol=1e-3)


def _rollout_batch(tiny_dir, n_prompts=3, G=4):
    model, tok = _tiny_policy(tiny_dir)
    args = grpo.resolve_args(grpo.Args(run_name="x", max_new_tokens=24))
    prompts = [
        common.build_prompt(tok, p, "tiny")
        for p in ("1+2-3", "45+67-89", "9-9+9", "123-4")[:n_prompts]
    ]
    torch.manual_seed(0)
    batch = grpo.generate_rollouts(
        model, tok, prompts, G, args, grpo.eos_token_ids(model, tok), torch.device("cpu")
    )
    return model, batch, args


def _pad_batch(batch, left: int, right: int, pad_id: int) -> dict:
    """The same rows with `left` more padding columns before the prompts, `right` after the
    completions."""
    return dict(
        batch,
        prompt_ids=torch.nn.functional.pad(batch["prompt_ids"], (left, 0), value=pad_id),
        prompt_mask=torch.nn.functional.pad(batch["prompt_mask"], (left, 0)),
        completion_ids=torch.nn.functional.pad(batch["completion_ids"], (0, right), value=pad_id),
        mask=torch.nn.functional.pad(batch["mask"], (0, right)),
    )


def test_micro_batches_cover_rows_once_in_length_order(tiny_dir):
    _, batch, _ = _rollout_batch(tiny_dir)
    lens = batch["mask"].sum(1)
    assert len(set(lens.tolist())) > 1  # completions of different lengths are exercised
    rows = torch.randperm(len(lens))[:9]
    mbs = grpo.micro_batches(batch, rows, 4)
    assert [len(m) for m in mbs] == [4, 4, 1]
    assert sorted(torch.cat(mbs).tolist()) == sorted(rows.tolist())
    assert torch.all(lens[torch.cat(mbs)].diff() >= 0)


def test_model_inputs_trim_padding_without_changing_logps(tiny_dir):
    """A micro-batch runs over the columns its own rows use: extra padding on either side, or a
    different grouping into micro-batches, leaves every log-prob and entropy as it was."""
    model, batch, args = _rollout_batch(tiny_dir)
    padded = _pad_batch(batch, 3, 5, pad_id=0)
    ids, attn, pos, T = grpo.model_inputs(padded, torch.arange(len(batch["mask"])))
    assert T == int(batch["mask"].sum(1).max()) and ids.shape[1] == T + int(
        batch["prompt_mask"].sum(1).max()
    )
    short = batch["mask"].sum(1).argsort()[:2]
    assert grpo.model_inputs(batch, short)[3] == int(batch["mask"][short].sum(1).max()) < T
    rows = torch.arange(len(batch["mask"]))
    with torch.no_grad():
        ref = grpo.token_logps(model, batch, rows, args, with_entropy=True)
        pad = grpo.token_logps(model, padded, rows, args, with_entropy=True)
        for k in range(2):
            assert torch.allclose(pad[k][:, : batch["mask"].shape[1]], ref[k], atol=1e-5)
            assert torch.all(pad[k][:, batch["mask"].shape[1] :] == 0)
        for size in (1, 5):  # batch_logps regroups rows by length and must give them back in order
            got = grpo.batch_logps(model, batch, dataclasses.replace(args, micro_batch_size=size))
            assert torch.allclose(got.logp, ref.logp, atol=1e-5)
            assert torch.allclose(got.entropy, ref.entropy, atol=1e-5)
    assert torch.all(ref.logp[batch["mask"] == 0] == 0)


def test_sampled_logits_cover_every_completion_token_once(tiny_dir):
    """The no-grad pass yields each completion token once, at most `chunk` at a time, with its
    place in the batch, the logits / temperature it was sampled from, and its id."""
    model, batch, args = _rollout_batch(tiny_dir)
    args = dataclasses.replace(args, micro_batch_size=5, temperature=0.7)
    seen = torch.zeros_like(batch["mask"])
    with torch.no_grad():
        ref = grpo.token_logps(model, batch, torch.arange(len(seen)), args, with_entropy=True)
    for (r, c), logits, ids in grpo.sampled_logits(model, batch, args, chunk=7):
        assert 1 <= len(r) <= 7 and logits.shape == (len(r), model.config.vocab_size)
        assert not logits.requires_grad and torch.equal(ids, batch["completion_ids"][r, c])
        seen[r, c] += 1
        logp, entropy = grpo.logp_and_entropy(logits, ids)
        assert torch.allclose(logp, ref.logp[r, c], atol=1e-5)
        assert torch.allclose(entropy, ref.entropy[r, c], atol=1e-5)
        expected = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
        assert torch.allclose(logp, expected, atol=1e-5)
        assert grpo.logp_and_entropy(logits, ids, with_entropy=False).entropy is None
    assert torch.equal(seen, batch["mask"])  # every valid position once, no padding


def test_eos_ids_include_both_qwen_ends(tiny_dir):
    model, tok = _tiny_policy(tiny_dir)
    ids = grpo.eos_token_ids(model, tok)
    assert (
        tok.convert_tokens_to_ids("<|im_end|>") in ids
        and tok.convert_tokens_to_ids("<|endoftext|>") in ids
    )


def test_rollouts_shapes_and_grouping(tiny_dir):
    model, tok = _tiny_policy(tiny_dir)
    args = grpo.resolve_args(grpo.Args(run_name="x"))
    prompts = [common.build_prompt(tok, p, "tiny") for p in ("1+2-3", "45+67-89", "9-9+9")]
    torch.manual_seed(0)
    b = grpo.generate_rollouts(
        model, tok, prompts, 4, args, grpo.eos_token_ids(model, tok), torch.device("cpu")
    )
    assert b["completion_ids"].shape[0] == 12 and len(b["texts"]) == 12
    assert torch.equal(b["prompt_ids"][4], b["prompt_ids"][7])
    assert not torch.equal(b["prompt_ids"][3], b["prompt_ids"][4])
    assert torch.equal(
        b["mask"], grpo.completion_mask(b["completion_ids"], grpo.eos_token_ids(model, tok))
    )
    assert b["truncated"].dtype == torch.bool


# ------------------------------------------------------------------ reward
def test_reward_counts_unparsable():
    r, c, p = grpo.reward_fn(
        ["x \\boxed{4}", "\\boxed{5}", "no box here"],
        ["4", "4", "4"],
        torch.tensor([5, 3, 4]),
        grpo.Args(),
    )
    assert (
        r.tolist() == [1.0, 0.0, 0.0]
        and c.tolist() == [1.0, 0.0, 0.0]
        and p.tolist() == [1.0, 1.0, 0.0]
    )


def test_decoded_text_stops_at_the_first_eos(tiny_dir):
    """Anything generate() leaves after the first EOS (pad ids, which in Qwen's vocabulary can be
    ordinary characters) must not reach the grader."""
    _, tok = _tiny_policy(tiny_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    seven = tok.convert_tokens_to_ids("7")
    body = tok("\\boxed{4}", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([body + [eos, seven, seven], body + [seven, seven, seven]])
    mask = grpo.completion_mask(ids, [eos])
    assert grpo.decode_completions(tok, ids, mask) == ["\\boxed{4}", "\\boxed{4}777"]
