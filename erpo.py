"""ERPO, Entropy-Regulated Policy Optimization, in one file.

Paper: "Entropy-Regulated Policy Optimization", arXiv 2603.28204. Only its abstract could be
read, and it gives no formula: all that it does not state is reconstructed, "(our reading)".
The abstract, the secondary accounts we drew on and each choice: docs/objectives.md.

    python erpo.py                            # bundled tiny model + arithmetic, CPU, a few minutes
    python erpo.py --model Qwen2.5-Math-1.5B  # the real run: one CUDA GPU, MATH train split
    python erpo.py --resume runs/<run-name>   # continue a stopped run exactly where it stopped
    python eval.py --model runs/<run-name>/checkpoint-<step>

The abstract: GRPO gives every token of a completion the same advantage, though a reasoning
chain is uneven; ERPO moves the advantage to tokens with (i) entropy-aware gating at Critical
Decision Pivots (short-lived high-entropy states), (ii) bucket-based implicit normalisation of
token progress windows, (iii) result-anchored advantage synthesis. Everything else is GRPO's
(grpo.py). Over the G completions of one prompt, valid tokens only (all OUR READING):
  (i)   W_it = sigmoid(gamma (H_it - mu_g) / (sd_g + 1e-6)), H the sampling policy's entropy,
        mu_g, sd_g over the group's tokens, gamma = --gate-gamma 5
  (ii)  s_it = old_logp_it - ref_logp_it, how far the policy has moved the token from the
        reference; s~_it its z-score among the group's tokens in the same relative-position
        bucket k = min(floor(K t / |o_i|), K - 1), K = --num-buckets 10
  (iii) Psi_it = W_it sgn(A_i) s~_it; --synthesis gated: A_it = A_i (1 + W_it) + eta Psi_it,
        additive: A_it = A_i + eta Psi_it, eta = --eta 0.2
An all-equal group (A_i = 0) gives A_it = 0 on every token. A_it is computed once per rollout
batch, on whole groups, before the shuffle into mini-batches; s needs the reference model, which
is loaded even with --kl-coef 0. ERPO's loss is GRPO's with A_it for A_i, so it comes before
the advantage that is new. Below the banner "The skeleton" the file is grpo.py's, line for line;
lines marked `# ERPO:` differ from grpo.py.
On the cpu preset (a real model, --device cpu) the reward also charges the length cap
(--overlong-cache 16, DAPO's soft overlong punishment at half the right/wrong gap): reward
shaping of ours, not part of ERPO's objective, on because the study's rule adopted it
there: TEPO learned with it and not without (docs/study/README.md, the length term).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# Before torch loads OpenMP: its idle threads then sleep instead of spinning, so a run keeps its
# pace beside another job (tools/bench.py, docs/speed.md). An OMP_WAIT_POLICY already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import common
import runner
from common import UserError, arg

ALGO = "erpo"


# =====================================================================================
# Arguments: ERPO's own flags (the run's, the same in every script, are common.RunArgs)
# =====================================================================================
@dataclass
class Args(common.RunArgs):
    clip_low: float = arg(0.2, "eps: the ratio is clipped below at 1 - eps")
    clip_high: float = arg(0.2, "the ratio is clipped above at 1 + this (as GRPO: the same eps)")
    kl_coef: float = arg(
        0.04,
        "beta, the coefficient of the KL term; 0 drops it (the reference "
        "model is still loaded: the progress signal needs it)",
    )
    gate_gamma: float = arg(
        5.0,
        "gamma, sharpness of the entropy gate sigmoid(gamma * "
        "group-normalised entropy) (our reading)",
    )
    num_buckets: int = arg(
        10, "K, relative-position buckets in which the progress signal is normalised (our reading)"
    )
    synthesis: str = arg(
        "gated",
        "token advantage (our reading): gated A_i (1 + W) + eta Psi, or additive A_i + eta Psi",
        choices=["gated", "additive"],
    )
    eta: float = arg(0.2, "weight of the progress term Psi in the token advantage (our reading)")
    overlong_cache: int = arg(
        0,
        "L_cache: reward shaping of ours, not part of the objective: the reward loses up to 0.5 "
        "over the last L_cache tokens before --max-new-tokens (DAPO's soft overlong punishment "
        "at DAPO's weight); 0: off; the cpu preset's is 16",
    )


PRESETS = common.presets()  # tiny, cpu, gpu: GRPO's


def resolve_args(args: Args) -> Args:
    """The preset's value for every flag not passed, then every flag checked."""
    runner.resolve_run_args(args, ALGO, PRESETS)  # the run's flags, the batch's shape
    runner.check_args(
        args,
        {
            f"--clip-low must be in [0, 1), not {args.clip_low}": 0 <= args.clip_low < 1,
            f"--clip-high must be >= 0, not {args.clip_high}": args.clip_high >= 0,
            f"--kl-coef must be >= 0, not {args.kl_coef}": args.kl_coef >= 0,
            f"--gate-gamma must be >= 0, not {args.gate_gamma}": args.gate_gamma >= 0,
            f"--num-buckets must be at least 1, not {args.num_buckets}": args.num_buckets >= 1,
            f"--eta must be >= 0, not {args.eta}": args.eta >= 0,
            f"--overlong-cache must be 0 (off) or in [1, --max-new-tokens {args.max_new_tokens}), "
            f"not {args.overlong_cache}": 0 <= args.overlong_cache < args.max_new_tokens,
        },
    )
    return args


def needs_reference(args: Args) -> bool:
    """ERPO: the progress signal s = old_logp - ref_logp needs pi_ref even at --kl-coef 0."""
    return True


# =====================================================================================
# Reward
# =====================================================================================
def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """[B] -> [B], DAPO Sec. 3.4 (soft overlong punishment): 0 up to L_max - L_cache tokens,
    then ((L_max - L_cache) - len) / L_cache, falling linearly to -1 at L_max, and -1 beyond."""
    lengths = lengths.float()
    soft = max_len - cache
    ramp = (soft - lengths) / cache
    return torch.where(lengths <= soft, 0.0, torch.where(lengths <= max_len, ramp, -1.0))


def reward_fn(texts: list[str], answers: list[str], lengths: torch.Tensor, args):
    """GRPO's outcome reward: r_i = 1 if the completion's final answer equals the reference
    answer, else 0. The final answer is the content of the last \\boxed{} (--answer-extraction
    math_verify: math-verify finds it in free text instead); it is compared with math-verify,
    gold first, each parse and comparison time-bounded, and model text is never executed.
    --overlong-cache L adds a length term, reward shaping that is no part of the objective:
    r_i = correct_i + 0.5 * overlong_penalty(len_i), DAPO's penalty at DAPO's weight (there -1
    against a right/wrong gap of 2), so a completion cut off at --max-new-tokens loses 0.5."""
    grades = [
        common.grade(t, a, args.grader_timeout, args.answer_extraction)
        for t, a in zip(texts, answers)
    ]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)  # [B]
    parsed = torch.tensor([g.parsed for g in grades], dtype=torch.float32)  # [B]
    if not args.overlong_cache:  # off: the outcome alone
        return correct.clone(), correct, parsed
    penalty = overlong_penalty(lengths.cpu(), args.max_new_tokens, args.overlong_cache)  # [B]
    return correct + 0.5 * penalty, correct, parsed


# =====================================================================================
# Loss: GRPO's, with one advantage per token
# =====================================================================================
def k3_kl(q_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || q) per token: exp(d) - d - 1 >= 0, with
    d = q_logp - logp."""
    d = q_logp - logp
    return torch.exp(d) - d - 1


def seq_mean_token_mean(l: torch.Tensor, mask: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """sum_i ( sum_t l_it m_it / sum_t m_it ) / num_seqs. num_seqs is the size of the whole
    mini-batch, so summing this over its micro-batches gives the unsplit value. Padding is
    selected away (torch.where), never multiplied by 0, so an inf there cannot become NaN."""
    m = mask.bool()
    per_seq = torch.where(m, l, 0.0).sum(1) / m.sum(1).clamp(min=1)
    return per_seq.sum() / num_seqs


def erpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    kl_coef=0.04,
    num_seqs=None,
):
    """ERPO loss: GRPO's (DeepSeekMath Eq. 3, KL as a loss term) with one advantage per token,
    aggregated seq-mean-token-mean. Copy it with k3_kl and seq_mean_token_mean; it needs
    nothing but torch.

    logp       [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp   [B, T]  the same under the policy that sampled the batch (no grad)
    ref_logp   [B, T]  the same under the frozen reference model, or None when kl_coef == 0
    advantages [B, T]  one advantage per token, A_it from token_advantages
    mask       [B, T]  1 on completion tokens through the first EOS
    num_seqs           completions in the whole mini-batch (default B), for micro-batching
    On the first update of a batch old_logp == logp: the ratio is 1 and the loss *value* is
    minus the mean A_it, yet its gradient is -A_it * grad logp, the token-level policy gradient.

    Ratios 1.5 and 0.5, A_it = (1, -2): -min(1.5, 1.2) * 1 = -1.2 and -min(-1.0, -1.6) = 1.6.

    >>> old = torch.log(torch.tensor([[0.2, 0.4]]))
    >>> logp = old + torch.log(torch.tensor([[1.5, 0.5]]))
    >>> A_it, m = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    >>> round(erpo_loss(logp, old, None, A_it, m, kl_coef=0.0).item(), 4)
    0.2
    """
    A = torch.where(mask.bool(), advantages, 0.0)  # [B, T]: a NaN on padding would reach grads
    ratio = torch.exp(logp - old_logp)  # [B, T]
    pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A)
    kl = k3_kl(ref_logp, logp) if kl_coef > 0 else torch.zeros_like(logp)
    return seq_mean_token_mean(pg + kl_coef * kl, mask, num_seqs or logp.shape[0])


@torch.no_grad()
def erpo_stats(logp, old_logp, ref_logp, advantages, mask, clip_low=0.2, clip_high=0.2) -> dict:
    """What to watch: mean KL to the reference, and the share of tokens whose clip is active,
    judged by each token's own advantage A_it [B, T]. Python floats, as grpo_stats."""
    A, m = advantages, mask.bool()  # ERPO: A_it [B, T]
    ratio = torch.exp(logp - old_logp)
    clipped = ((ratio > 1 + clip_high) & (A > 0)) | ((ratio < 1 - clip_low) & (A < 0))
    n = m.sum().clamp(min=1)
    stats = {"clip_frac": (clipped & m).sum() / n}
    if ref_logp is not None:
        stats["kl"] = torch.where(m, k3_kl(ref_logp, logp), 0.0).sum() / n
    return {k: v.item() for k, v in stats.items()}


# =====================================================================================
# Advantage: GRPO's A_i, then ERPO's per-token A_it
# =====================================================================================
def group_advantages(rewards: torch.Tensor, G: int, eps: float = 1e-4) -> torch.Tensor:
    """[B] -> [B]: A_i = (r_i - mean_g r) / (std_g r + eps), std with Bessel's correction over
    the G completions of one prompt. An all-equal group gives exactly 0 (its numerator is 0)."""
    r = rewards.view(-1, G)
    if r.shape[0] == 0:  # an empty batch: nothing to normalise
        return rewards.clone()
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=True) + eps)
    return A.view(-1)


def binned_zscore(x: torch.Tensor, bins: torch.Tensor, mask: torch.Tensor, num_bins: int):
    """[B, T] -> ([B, T], [B, T]): z_it = (x_it - mu_k) / (sd_k + 1e-6) and n_k, where k =
    bins[b, t] and mu_k, sd_k, n_k are the mean, population std and count of x over the valid
    tokens of bin k. 0 on padding, whose values (even inf / NaN) never enter a statistic.

    Population std (divide by n, our reading): the bins hold hundreds of tokens, where n and
    n - 1 agree, and it stays defined for a bin of one token. Statistics in float64: a bin of
    equal values must give z = 0, not float32 rounding in the mean divided by 1e-6.
    """
    valid = mask > 0
    xv = torch.where(valid, x, 0.0).double().flatten()
    idx = torch.where(valid, bins, 0).flatten()
    w = valid.double().flatten()
    zeros = torch.zeros(num_bins, dtype=torch.float64, device=x.device)
    n = zeros.scatter_add(0, idx, w)
    mu = zeros.scatter_add(0, idx, xv) / n.clamp(min=1)
    dev = (xv - mu[idx]) * w  # w is 0/1 and xv finite here, so this product is safe
    sd = (zeros.scatter_add(0, idx, dev**2) / n.clamp(min=1)).sqrt()
    z = dev / (sd[idx] + 1e-6)
    return z.view_as(x).to(x.dtype), n[idx].view_as(x)


def _group_ids(B: int, G: int, device) -> torch.Tensor:
    if B % G:
        raise ValueError(f"{B} rows are not whole groups of G = {G}")
    return torch.arange(B, device=device) // G  # row b belongs to prompt b // G


def entropy_gate(entropy: torch.Tensor, mask: torch.Tensor, G: int, gamma: float = 5.0):
    """[B, T] -> [B, T]: ERPO's entropy-aware gate (i), W_it = sigmoid(gamma * (H_it - mu_g) /
    (sd_g + 1e-6)), with mu_g, sd_g the mean and population std of H over ALL valid tokens of
    the G completions of prompt b // G (our reading), never padding or another prompt's
    tokens. W > 0.5 where a token is more uncertain than its group's typical token. 0 on
    padding. Pass the sampling policy's entropy (old_entropy, no grad; our reading).

    Group {1, 3, 2}: mu = 2, sd = sqrt(2/3) = 0.8165, z = -1.2247, 1.2247, 0 (gamma = 1):

    >>> H = torch.tensor([[1.0, 3.0], [2.0, float("nan")]])
    >>> entropy_gate(H, torch.tensor([[1, 1], [1, 0]]), G=2, gamma=1.0)
    tensor([[0.2271, 0.7729],
            [0.5000, 0.0000]])
    """
    B, T = entropy.shape
    group = _group_ids(B, G, entropy.device)[:, None].expand(B, T)
    z, _ = binned_zscore(entropy, group, mask, B // G)
    return torch.where(mask > 0, torch.sigmoid(gamma * z), 0.0)


def progress_signal(old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor):
    """[B, T] -> [B, T]: ERPO's implicit progress signal s_it = old_logp_it - ref_logp_it (our
    reading): how much the sampling policy has already raised (> 0) or lowered (< 0) this
    token's log-probability relative to the reference. No grad; 0 on padding.

    >>> s = progress_signal(torch.tensor([[-0.5, -1.0]]), torch.tensor([[-1.5, -0.25]]),
    ...                     torch.tensor([[1, 1]]))
    >>> s
    tensor([[ 1.0000, -0.7500]])
    """
    return torch.where(mask > 0, old_logp - ref_logp, 0.0).detach()


def token_buckets(mask: torch.Tensor, num_buckets: int = 10) -> torch.Tensor:
    """[B, T] -> [B, T] long: bucket k = min(floor(tau * K), K - 1) of each valid token, with
    tau = t / |o_i| its relative position (t the 0-based index of the valid token, |o_i| the
    completion's valid length); -1 on padding. Integer arithmetic, so no rounding at the edges.

    Lengths 5 and 2, K = 3: t * 3 // 5 = 0 0 1 1 2 and t * 3 // 2 = 0 1.

    >>> token_buckets(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), num_buckets=3)
    tensor([[ 0,  0,  1,  1,  2],
            [ 0,  1, -1, -1, -1]])
    """
    valid = mask > 0
    t = valid.long().cumsum(1) - 1  # 0-based index of each valid token
    n = valid.long().sum(1, keepdim=True).clamp(min=1)
    k = torch.clamp(t * num_buckets // n, max=num_buckets - 1)  # floor(t / n * K)
    return torch.where(valid, k, -1)


def bucket_normalize(s: torch.Tensor, mask: torch.Tensor, G: int, num_buckets: int = 10):
    """[B, T] -> [B, T]: ERPO's bucket-based normalisation (ii) (our reading): s~_it =
    (s_it - mu_gk) / (sd_gk + 1e-6), mean and population std over the valid tokens of the G
    completions of prompt g = b // G that fall in the same relative-position bucket k (see
    token_buckets). 0 where the bucket holds a single token, and 0 on padding.

    Lengths 3 and 1, K = 2: bucket 0 holds s = 1, 2 (row 0) and 3 (row 1): mu = 2, sd =
    sqrt(2/3), s~ = -1.2247, 0, 1.2247; row 0's last token is alone in bucket 1: 0.

    >>> s = torch.tensor([[1.0, 2.0, 5.0], [3.0, float("inf"), 0.0]])
    >>> bucket_normalize(s, torch.tensor([[1, 1, 1], [1, 0, 0]]), G=2, num_buckets=2)
    tensor([[-1.2247,  0.0000,  0.0000],
            [ 1.2247,  0.0000,  0.0000]])
    """
    B, K = s.shape[0], num_buckets
    group = _group_ids(B, G, s.device)[:, None]
    bins = group * K + token_buckets(mask, K).clamp(min=0)  # one bin per (group, bucket)
    z, n = binned_zscore(s, bins, mask, (B // G) * K)
    return torch.where((mask > 0) & (n > 1), z, 0.0)


def token_advantages(advantages, gate, s_tilde, mask, eta=0.2, synthesis="gated"):
    """ERPO's result-anchored advantage synthesis (iii). Returns (A_it [B, T], Psi [B, T]).

    advantages [B]     group-relative advantage A_i of each completion (as GRPO's)
    gate       [B, T]  W from entropy_gate
    s_tilde    [B, T]  s~ from bucket_normalize
    mask       [B, T]  1 on completion tokens through the first EOS
    Psi_it = W_it * sgn(A_i) * s~_it, then (our reading)
      synthesis="gated":    A_it = A_i * (1 + W_it) + eta * Psi_it
      synthesis="additive": A_it = A_i + eta * Psi_it
    Both 0 on padding. A_i = 0 (an all-equal group) gives exactly 0 everywhere: sgn(0) = 0.

    A = (1, -1): Psi = (0.5 * 2, 0.9 * -1 | -1 * 0.2 * 0.5) = (1, -0.9 | -0.1);
    gated: 1 * 1.5 + 0.2 * 1 = 1.7, 1 * 1.9 - 0.18 = 1.72 | -1 * 1.2 - 0.02 = -1.22.

    >>> A_it, psi = token_advantages(torch.tensor([1.0, -1.0]),
    ...     torch.tensor([[0.5, 0.9], [0.2, 0.0]]), torch.tensor([[2.0, -1.0], [0.5, 0.0]]),
    ...     torch.tensor([[1, 1], [1, 0]]))
    >>> psi
    tensor([[ 1.0000, -0.9000],
            [-0.1000,  0.0000]])
    >>> A_it
    tensor([[ 1.7000,  1.7200],
            [-1.2200,  0.0000]])
    """
    valid = mask > 0
    A = advantages[:, None]
    psi = torch.where(valid, gate * torch.sign(A) * s_tilde, 0.0)
    if synthesis == "gated":
        A_it = A * (1 + gate) + eta * psi
    elif synthesis == "additive":
        A_it = A + eta * psi
    else:
        raise ValueError(f"synthesis must be 'gated' or 'additive', not {synthesis!r}")
    return torch.where(valid, A_it, 0.0), psi


@torch.no_grad()
def token_advantage_stats(advantages_it, advantages, gate, psi, mask) -> dict:
    """What ERPO's token advantage does, over the valid tokens of a whole rollout batch (the
    shares below would be skewed by averaging over micro-batches); dict of Python floats.

    gate_mean       mean W
    gate_high_frac  share of tokens with W > 0.9 (the gate near its 2x ceiling)
    psi_abs_mean    mean |Psi|
    sign_flip_frac  share of tokens whose A_it sign differs from A_i's, among tokens of
                    completions with A_i != 0
    adv_token_std   mean over completions (with a valid token) of the population std of
                    A_it within the completion: 0 for GRPO's constant advantage

    >>> st = token_advantage_stats(torch.tensor([[1.7, 1.72], [-1.22, 0.0]]),
    ...     torch.tensor([1.0, -1.0]), torch.tensor([[0.5, 0.95], [0.2, 0.0]]),
    ...     torch.tensor([[1.0, -0.9], [-0.1, 0.0]]), torch.tensor([[1, 1], [1, 0]]))
    >>> for k, v in st.items():
    ...     print(f"{k} {v:.4f}")
    gate_mean 0.5500
    gate_high_frac 0.3333
    psi_abs_mean 0.6667
    sign_flip_frac 0.0000
    adv_token_std 0.0050
    """
    valid = mask > 0
    n = valid.sum().clamp(min=1)
    A_it = torch.where(valid, advantages_it, 0.0)
    A = advantages[:, None].expand_as(A_it)
    signed = valid & (A != 0)
    flipped = signed & (torch.sign(A_it) != torch.sign(A))
    len_i = valid.sum(1)
    mean_i = A_it.sum(1) / len_i.clamp(min=1)
    var_i = (torch.where(valid, A_it - mean_i[:, None], 0.0) ** 2).sum(1) / len_i.clamp(min=1)
    rows = len_i > 0
    stats = {
        "gate_mean": torch.where(valid, gate, 0.0).sum() / n,
        "gate_high_frac": (valid & (gate > 0.9)).sum() / n,
        "psi_abs_mean": torch.where(valid, psi.abs(), 0.0).sum() / n,
        "sign_flip_frac": flipped.sum() / signed.sum().clamp(min=1),
        "adv_token_std": var_i.sqrt()[rows].sum() / rows.sum().clamp(min=1),
    }
    return {k: v.item() for k, v in stats.items()}


# =====================================================================================
# Training loop
# =====================================================================================
def train(args: Args) -> dict:
    run = runner.Run(args, ALGO, resolve_args, needs_reference)  # folder, --resume, GPU cost
    args, device = run.args, run.device
    tokenizer, ctx = load_tokenizer(args.model, args.trust_remote_code)
    train_rows, eval_rows = load_data(args, tokenizer, ctx)  # a bad dataset fails before a model
    policy = load_model(run.weights(), device, args, trainable=True)  # pi_theta
    ref = load_reference(device, args) if needs_reference(args) else None  # ERPO: always
    eos_ids = eos_token_ids(policy, tokenizer)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args)
    sampler = common.PromptSampler(train_rows, args.seed, args.dataset)
    state = dict(optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    start = run.attach({"": policy}, tokenizer, state)  # what a checkpoint holds
    if eval_rows and run.eval_due(start):  # step 0, or a step whose evaluation a stop cut short
        run.log(start, evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))

    P, G = args.prompts_per_step, args.group_size
    for step in run.steps(start):
        # 1. Rollouts: P prompts, G completions each; row b belongs to prompt b // G
        rows = [train_rows[i] for i in sampler.take(P)]
        prompts = [r["prompt"] for r in rows]
        batch = generate_rollouts(policy, tokenizer, prompts, G, args, eos_ids, device)

        # 2. Reward r_i, then the group-relative advantage A_i (one value per completion)
        answers = [r["answer"] for r in rows for _ in range(G)]
        lengths = batch["mask"].sum(1)  # [B] completion lengths in tokens
        rewards, correct, parsed = reward_fn(batch["texts"], answers, lengths, args)  # [B] each
        advantages = group_advantages(rewards, G).to(device)  # [B]

        # 3. Log-probs under the sampling policy (fixed for this batch) and the reference; no grad
        old_logp, old_entropy = batch_logps(policy, batch, args)  # [B, T] each
        ref_logp = reference_logps(policy, ref, batch, args).logp if needs_reference(args) else None
        # ERPO: the per-token advantage, once per rollout batch on whole groups, before shuffling
        m = batch["mask"]  # [B, T]
        W = entropy_gate(old_entropy, m, G, args.gate_gamma)  # ERPO: (i) the entropy gate [B, T]
        s = progress_signal(old_logp, ref_logp, m)  # ERPO: (ii) the progress signal [B, T]
        s_tilde = bucket_normalize(s, m, G, args.num_buckets)  # ERPO: (ii) within buckets
        A_it, psi = token_advantages(advantages, W, s_tilde, m, args.eta, args.synthesis)  # (iii)

        # 4. Updates: the batch is shuffled into num_mini_batches mini-batches, one optimizer step
        #    each; a mini-batch's gradient is accumulated over micro-batches
        run.updating()  # a stop signal from here waits for the update to end
        policy.train()
        stats = [token_advantage_stats(A_it, advantages, W, psi, m)]  # ERPO: per rollout batch
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for mb in micro_batches(batch, mini, args.micro_batch_size):
                    logp = token_logps(policy, batch, mb, args).logp  # [b, T]
                    terms = dict(
                        logp=logp,
                        old_logp=old_logp[mb],
                        ref_logp=ref_logp[mb] if ref_logp is not None else None,
                        advantages=A_it[mb],  # ERPO: A_it [b, T]
                        mask=batch["mask"][mb],
                        clip_low=args.clip_low,
                        clip_high=args.clip_high,
                    )
                    loss = erpo_loss(**terms, kl_coef=args.kl_coef, num_seqs=len(mini))
                    loss.backward()  # gradients add up over micro-batches to the mini-batch's
                    loss_sum += loss.item()
                    stats.append(erpo_stats(**terms))
                step_stats = common.optimizer_step(
                    optimizer, scheduler, params, args.max_grad_norm, loss_sum
                )
                stats.append({"loss": loss_sum, **step_stats})

        # 5. Metrics, samples, held-out evaluation, checkpoint
        metrics = {
            **rollout_metrics(batch, rewards, correct, parsed, old_entropy, G),
            **common.reduce_stats(stats),
            "lr": scheduler.get_last_lr()[0],
        }
        run.updated(metrics)  # the update is done: a stop from here saves this step at once
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch, rewards)
            shown = {"entropy": old_entropy, "gate": W, "A_it": A_it, "psi": psi}  # ERPO
            run.write_samples(step, tokenizer, batch, rewards, advantages, shown)
        if eval_rows and run.eval_due(step):  # every --eval-every steps, and after the last
            metrics.update(evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))
        run.end_step(step, metrics)  # log, progress bar, checkpoint when due or when stopped
    return run.finish()


# =====================================================================================
# The skeleton: below this line, every script is the same, line for line
# =====================================================================================
# ----- Model: the tokenizer, the policy (LoRA optional) and the frozen reference -------------
def load_tokenizer(name: str, trust_remote_code: bool):
    """The tokenizer (left padding: generation appends on the right) and the context length."""
    path = runner.resolve_model_name(name)
    runner.check_model_folder(path)  # a config and tokenizer files, or one line on what is missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # hub errors, missing files: one line, not a deep traceback
        raise UserError(f"cannot load model {name!r} ({path}): {common.first_line(e)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    ctx = getattr(config, "max_position_embeddings", None)
    ctx = ctx or min(tokenizer.model_max_length, 1 << 20)
    return tokenizer, ctx


def load_model(name: str, device: torch.device, args, trainable: bool):
    """fp32 weights for the policy and the reference alike (bf16 weights would round away lr=1e-6
    updates, and would make the reference disagree with the policy at step 0), computed in bf16
    under autocast when --bf16. With --lora-rank the trainable policy is the frozen base plus
    fp32 adapters (add_lora), and the base, never updated, is held in bf16 on CUDA; `name` may
    then be a LoRA checkpoint (adapter_config.json), whose base is --model. Sampling follows this
    script's settings only: the model's own generation_config.json (temperature 0.6, top_k 20,
    ...) is replaced by a neutral one."""
    path = runner.resolve_model_name(name)
    adapter = path if (Path(path) / "adapter_config.json").is_file() else None  # a LoRA checkpoint
    base = runner.resolve_model_name(args.model) if adapter else path
    bf16_base = args.lora_rank and args.bf16 and device.type == "cuda"
    dtype = torch.bfloat16 if bf16_base else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, trust_remote_code=args.trust_remote_code
        )
    except Exception as e:  # a truncated safetensors file, a missing folder, a hub error
        raise UserError(f"cannot load model {name!r} ({base}): {common.first_line(e)}") from None
    # the log-prob pass reads logits as lm_head(last hidden state): a model that rescales or
    # soft-caps them after that (Gemma 2, Cohere) must say so
    with torch.no_grad():
        x = torch.arange(3)[None]
        direct = model.get_output_embeddings()(model.get_decoder()(input_ids=x).last_hidden_state)
        if not torch.allclose(model(input_ids=x).logits, direct, rtol=1e-4, atol=1e-4):
            raise UserError(
                f"model {name!r} transforms its logits after the output layer (e.g. "
                "soft-capping or a logit scale), which this script's chunked log-prob "
                "pass does not reproduce"
            )
    own = model.generation_config
    model.generation_config = GenerationConfig(
        eos_token_id=own.eos_token_id, pad_token_id=own.pad_token_id, bos_token_id=own.bos_token_id
    )
    for m in model.modules():  # no dropout: the ratio must be exactly 1 before the first update
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if trainable and args.gradient_checkpointing:  # only in train mode: generate() is not slowed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(trainable)
    if trainable and args.lora_rank:  # LoRA: the base stays frozen, only the adapters learn
        model = add_lora(model, base, args, adapter)
    model.to(device)
    model.train(trainable)
    return model


def add_lora(model, base: str, args, adapter: str | None = None):
    """The model as PEFT's LoRA model: every module in --lora-target-modules gets adapters A
    (r x in) and B (out x r), B = 0 so that the output is exactly the base's before the first
    update, fp32 whatever the base's dtype, no adapter dropout (it would make the ratio differ
    from 1 before the first update). `adapter`: a checkpoint's adapters to continue from."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("--lora-rank needs peft: pip install peft") from None
    targets = args.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    try:
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        else:
            config = LoraConfig(
                r=args.lora_rank,
                lora_alpha=args.lora_alpha,
                lora_dropout=0.0,
                target_modules=targets,
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # nothing matched, or PEFT failed
        raise UserError(
            f"cannot add LoRA adapters to {args.model!r} (--lora-target-modules "
            f"{args.lora_target_modules}): {common.first_line(e)}"
        ) from None
    if Path(base).is_dir():  # the checkpoint names its base by full path: eval.py finds it anywhere
        model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def load_reference(device: torch.device, args):
    """pi_ref, the frozen starting model: a second copy loaded from --model; under --lora-rank
    none, since the policy with its adapters switched off is pi_ref (reference_logps)."""
    return None if args.lora_rank else load_model(args.model, device, args, trainable=False)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS, the model's (Qwen lists
    <|endoftext|> and <|im_end|>), and <|im_end|> whenever the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def autocast(args):
    device_type = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bool(args.bf16))


# ----- Data ----------------------------------------------------------------------------------
def load_prompts(dataset, split, tokenizer, args, max_prompt_tokens, limit=None):
    """Problems with their prompt text; prompts over max_prompt_tokens are dropped and counted.
    --problem-column / --answer-column apply to the training set only."""
    cols = (args.problem_column, args.answer_column) if dataset == args.dataset else (None, None)
    rows = common.load_problems(dataset, split, *cols, limit=limit)  # the same for every seed
    for r in rows:
        r["prompt"] = common.build_prompt(tokenizer, r["problem"], args.template)
    ids = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    lengths = [len(x) for x in ids]
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise UserError(
            f"every prompt of {dataset!r} is longer than {max_prompt_tokens} tokens "
            f"(context - max_new_tokens); lower --max-new-tokens"
        )
    if len(kept) < len(rows):
        print(
            f"dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than "
            f"{max_prompt_tokens} tokens"
        )
    return kept


def load_data(args, tokenizer, ctx: int):
    """Training and held-out prompts, checked before any model loads (file, columns, non-empty,
    prompt + completion within the model's context)."""
    if args.max_new_tokens >= ctx:
        raise UserError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
            f"this model's {ctx}-token context"
        )
    max_prompt = args.max_prompt_tokens or ctx - args.max_new_tokens
    if max_prompt + args.max_new_tokens > ctx:
        raise UserError(
            f"--max-prompt-tokens {max_prompt} + --max-new-tokens "
            f"{args.max_new_tokens} "
            f"exceed this model's {ctx}-token context"
        )
    train_rows = load_prompts(args.dataset, "train", tokenizer, args, max_prompt)
    if args.eval_dataset == "none":
        print("no held-out evaluation (--eval-dataset none)")
        return train_rows, []
    eval_rows = load_prompts(args.eval_dataset, "test", tokenizer, args, max_prompt, args.eval_n)
    return train_rows, eval_rows


# ----- Rollouts ------------------------------------------------------------------------------
def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long: 1 up to and including the first EOS, 0 after. Built by position,
    never by `token != pad`: Qwen base models pad with their EOS, and the EOS must be trained."""
    eos = torch.tensor(eos_ids, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)  # [B, T]
    T = completion_ids.shape[1]
    no_eos = torch.full_like(is_eos[:, 0], T, dtype=torch.long)  # no EOS: valid to its end
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)  # [B]: the first 1
    positions = torch.arange(T, device=completion_ids.device)[None, :]  # [1, T]
    return (positions <= first_eos[:, None]).long()


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Text of each completion up to its first EOS; what generate() padded after it is dropped."""
    return [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())
    ]


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: list[str], G: int, args, eos_ids, device) -> dict:
    """Sample G completions per prompt with HF generate (KV cache on); row b belongs to
    prompt b // G. Returns token tensors with the prompt left-padded and the completion masks."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(G, 0).to(device)  # [B, Tp]
    prompt_mask = enc["attention_mask"].repeat_interleave(G, 0).to(device)  # [B, Tp]
    gen_cfg = GenerationConfig(  # every sampling setting written out: nothing else shapes it
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    model.eval()
    chunks, n = [], args.gen_batch_size or len(prompt_ids)
    for i in range(0, len(prompt_ids), n):
        with autocast(args):
            out = model.generate(
                input_ids=prompt_ids[i : i + n],
                attention_mask=prompt_mask[i : i + n],
                generation_config=gen_cfg,
            )
        chunks.append(out[:, prompt_ids.shape[1] :])
    T = max(c.shape[1] for c in chunks)
    padded = [F.pad(c, (0, T - c.shape[1]), value=tokenizer.pad_token_id) for c in chunks]
    completion_ids = torch.cat(padded)  # [B, T]
    mask = completion_mask(completion_ids, eos_ids)  # [B, T]
    truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)
    texts = decode_completions(tokenizer, completion_ids, mask)
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        mask=mask,
        truncated=truncated,
        texts=texts,
        prompts=[p for p in prompts for _ in range(G)],
    )


def model_inputs(batch, rows):
    """Prompt + completion tokens of `rows` for one forward pass, trimmed to the columns these rows
    use (prompts are left-padded, completions right-padded), so a micro-batch of short completions
    is not padded to the batch's longest. Position ids follow the left padding, as in generate.
    Returns input_ids, attention_mask, position_ids [b, Tp' + T'] and T', the completion width."""
    prompt_mask, mask = batch["prompt_mask"][rows], batch["mask"][rows]
    start = prompt_mask.shape[1] - int(prompt_mask.sum(1).max())  # first prompt column any row uses
    T = int(mask.sum(1).max())  # the mask is 1 up to each row's EOS, then 0
    input_ids = torch.cat([batch["prompt_ids"][rows, start:], batch["completion_ids"][rows, :T]], 1)
    attention_mask = torch.cat([prompt_mask[:, start:], mask[:, :T]], 1)
    return input_ids, attention_mask, (attention_mask.cumsum(1) - 1).clamp(min=0), T


def micro_batches(batch, rows, size: int):
    """`rows` split into micro-batches of at most `size` completions of similar length, so each
    is padded only to its own longest. The loss of a mini-batch is a sum over its micro-batches,
    so how they are grouped does not change the gradient."""
    return rows[batch["mask"][rows].sum(1).argsort(stable=True)].split(size)


# ----- Log-probs -----------------------------------------------------------------------------
class LogProbs(NamedTuple):
    logp: torch.Tensor  # [b, T] log-prob of each sampled token, from logits / temperature
    entropy: torch.Tensor | None  # [b, T] entropy of each next-token distribution (no grad)


def logp_and_entropy(logits, ids, with_entropy: bool = True) -> LogProbs:
    """[N, V] logits / temperature (the distribution that was sampled), [N] sampled ids -> the
    log-prob of each id [N] and the entropy of each distribution [N] (no grad; when asked)."""
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, ids[:, None]).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else None
    return LogProbs(logp, entropy)


def hidden_states(model, batch, rows, args):
    """The last hidden state at each position that predicts a completion token of `rows` [N, H],
    that token's id [N], and where it sits in the batch's [B, T]: (row, column) index tensors.
    Position ids follow the left padding, as in generate."""
    input_ids, attention_mask, position_ids, T = model_inputs(batch, rows)
    valid = batch["mask"][rows, :T].bool()  # [b, T']
    with autocast(args):
        hidden = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
    r, c = valid.nonzero(as_tuple=True)
    h = hidden[:, -T - 1 : -1][valid]  # position t predicts completion token t + 1
    return h, batch["completion_ids"][rows, :T][valid], (rows[r], c)


def _chunk_logps(h, lm_head, ids, temperature: float, with_entropy: bool):
    return logp_and_entropy(lm_head(h).float() / temperature, ids, with_entropy)


def token_logps(model, batch, rows, args, with_entropy=False, chunk=1024) -> LogProbs:
    """Log-probs [b, T] (and entropies) of the completion tokens of `rows`, in their order, with
    grad. The [b, T, V] logits are never built whole: the output layer runs over `chunk` valid
    positions at a time and is recomputed in the backward pass, so memory holds one chunk of
    logits (a 3000-token completion over a 152k vocabulary would be ~2 GB a copy). Padded
    positions are 0."""
    h, ids, _ = hidden_states(model, batch, rows, args)
    lm_head, parts = model.get_output_embeddings(), []
    for i in range(0, len(h), chunk):
        inputs = (h[i : i + chunk], lm_head, ids[i : i + chunk], args.temperature, with_entropy)
        with autocast(args):
            if torch.is_grad_enabled():  # recomputed in the backward pass: one chunk in memory
                parts.append(checkpoint(_chunk_logps, *inputs, use_reentrant=False))
            else:
                parts.append(_chunk_logps(*inputs))
    full = batch["mask"][rows].bool()  # [b, T]: the trimmed columns are all padding

    def scatter(values):  # [N] values at the valid positions -> [b, T], 0 at padding
        zeros = torch.zeros(full.shape, dtype=torch.float32, device=full.device)
        return zeros.masked_scatter(full, torch.cat(values)) if values else zeros

    entropy = scatter([p.entropy for p in parts]) if with_entropy else None
    return LogProbs(scatter([p.logp for p in parts]), entropy)


@torch.no_grad()
def sampled_logits(model, batch: dict, args, chunk=1024):
    """The whole batch, micro-batch by micro-batch, no grad: yields (where, logits, ids) for at
    most `chunk` completion tokens at a time: where they sit in the batch's [B, T] ((row, column)
    index tensors), logits / temperature [N, V] of the distribution each was sampled from, and
    their ids [N]. The [B, T, V] logits are never built whole."""
    model.eval()
    rows = torch.arange(len(batch["mask"]), device=batch["mask"].device)
    for mb in micro_batches(batch, rows, args.micro_batch_size) if len(rows) else ():  # DAPO: 0
        h, ids, (r, c) = hidden_states(model, batch, mb, args)
        for i in range(0, len(h), chunk):
            with autocast(args):
                logits = model.get_output_embeddings()(h[i : i + chunk]).float()
            yield (
                (r[i : i + chunk], c[i : i + chunk]),
                logits / args.temperature,
                ids[i : i + chunk],
            )


def batch_logps(model, batch: dict, args) -> LogProbs:
    """No grad: log-probs and entropies [B, T] of every completion token of the batch."""
    logp = torch.zeros(batch["mask"].shape, device=batch["mask"].device)
    entropy = torch.zeros_like(logp)
    for where, logits, ids in sampled_logits(model, batch, args):
        logp[where], entropy[where] = logp_and_entropy(logits, ids)
    return LogProbs(logp, entropy)


@torch.no_grad()
def reference_logps(policy, ref, batch: dict, args) -> LogProbs:
    """batch_logps under pi_ref: the frozen copy `ref`, or under --lora-rank the policy itself
    with its adapters switched off (PEFT's disable_adapter), so no second model is in memory."""
    if ref is not None:
        return batch_logps(ref, batch, args)
    with policy.disable_adapter():
        return batch_logps(policy, batch, args)


# ----- Evaluation, samples, metrics ----------------------------------------------------------
@torch.no_grad()
def evaluate(model, tokenizer, problems, args, eos_ids, device) -> dict:
    """Held-out accuracy, greedy and sampled at the training temperature, and the share cut off."""
    out = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        cfg = GenerationConfig(
            do_sample=sample,
            temperature=args.temperature if sample else None,
            top_p=args.top_p if sample else None,
            top_k=0 if sample else None,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
        )
        correct, cut, n = 0, 0, args.gen_batch_size or 128
        model.eval()
        chunks = range(0, len(problems), n)
        for i in tqdm(chunks, desc=f"eval ({name})", leave=False, dynamic_ncols=True):
            chunk = problems[i : i + n]
            enc = tokenizer(
                [p["prompt"] for p in chunk],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            with autocast(args):
                ids = model.generate(**enc, generation_config=cfg)[:, enc["input_ids"].shape[1] :]
            texts = decode_completions(tokenizer, ids, completion_mask(ids, eos_ids))
            grades = [
                common.grade(t, p["answer"], args.grader_timeout, args.answer_extraction)
                for t, p in zip(texts, chunk)
            ]
            correct += sum(g.correct for g in grades)
            cut += (~torch.isin(ids, torch.tensor(eos_ids, device=ids.device)).any(1)).sum().item()
        out[f"eval/{name}_acc"] = correct / len(problems)
        out[f"eval/{name}_truncated_frac"] = cut / len(problems)  # cut off at --max-new-tokens
    out["eval/grader_timeouts"] = common.take_timeouts()  # greedy and sampled, counted wrong
    return out


def show_samples(step, batch, rewards, k=2):
    tqdm.write(f"--- samples at step {step} ---")
    for p, t, r in list(zip(batch["prompts"], batch["texts"], rewards.tolist()))[:k]:
        tqdm.write(f"[reward {r:+.2f}] {p[-80:]!r} -> {t[:300]!r}")


def rollout_metrics(batch, rewards, correct, parsed, entropy, G) -> dict:
    m = batch["mask"].bool()
    zero_std = rewards.view(-1, G).std(1) == 0  # [P]: groups that teach nothing
    return {
        "reward": rewards.mean().item(),
        "accuracy": correct.mean().item(),
        "unparsable_frac": 1 - parsed.mean().item(),
        "zero_std_frac": zero_std.float().mean().item() if len(rewards) else 1.0,
        "entropy": (torch.where(m, entropy, 0.0).sum() / m.sum().clamp(min=1)).item(),
        "completions": len(m),
        "tokens": m.sum().item(),
        "completion_len": m.sum(1).float().mean().item(),
        "completion_len_max": m.sum(1).max().item() if len(m) else 0,
        "truncated_frac": batch["truncated"].float().mean().item(),
        "grader_timeouts": common.take_timeouts(),  # grades cut off by --grader-timeout: wrong
    }


def main(argv=None):
    args = runner.parse_args(Args, argv, __doc__, PRESETS)
    with runner.user_errors():
        return train(args)


if __name__ == "__main__":
    main()
