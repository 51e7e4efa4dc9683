"""SAPO, Segment-Aligned Policy Optimization, in one file.

Paper: Gao et al., "Segment-Aligned Policy Optimization for Multi-Modal Reasoning",
arXiv 2605.01327, ICML 2026 (Sec. 4, Eqs. 5-13, Algorithm 1, Table 7), and the authors'
released verl-based code. Not Qwen's "Soft Adaptive Policy Optimization" (the same acronym).
Which piece comes from the paper, which from the code, and which is our reading:
docs/objectives.md, section 6.

    python sapo.py                            # bundled tiny model + arithmetic, CPU, a few minutes
    python sapo.py --model Qwen2.5-Math-1.5B  # the real run: one CUDA GPU, MATH train split
    python sapo.py --resume runs/<run-name>   # continue a stopped run exactly where it stopped
    python eval.py --model runs/<run-name>/checkpoint-<step>   # the policy; the critic: critic/

SAPO is PPO with a critic in which the unit of credit is a reasoning segment, not a token
(PPO) and not a whole response (GRPO). One completion is sampled per prompt (G = 1). Each
completion is cut into segments that end at its highest-entropy tokens; a critic values the
state before each segment; GAE runs over segments; every token of a segment gets the segment's
advantage and the segment's importance ratio (the geometric mean of its token ratios).
Segment m spans tokens b_m..e_m:

    ends      top ceil(30% of n) entropy positions of each completion, and its last token
    r_m       -kl_coef * sum_{t in m} (old_logp_t - ref_logp_t)  (+ outcome on the last m)
    delta_m   r_m + gamma V(s_{m+1}) - V(s_m),   V(s_{M+1}) = 0                     (Eq. 6)
    A_m       sum_l (gamma lam)^l delta_{m+l},   R_m = A_m + V(s_m)                 (Eq. 7)
    log s_m   mean_{t in m} (logp_t - old_logp_t)                                   (Eq. 8)
    l_t       -min(s_m A_m, clip(s_m, 1 - eps_low, 1 + eps_high) A_m),  m = m(t)    (Eq. 9)
    l_V       0.5 max((V - R)^2, (V_clip - R)^2) at segment states                  (Eq. 10)

The advantages are whitened over the rollout batch and clamped (official code). The segments
come first, then the losses over them, then the rewards, GAE and the critic that feed them.
Below the banner "The skeleton" the file is grpo.py's, line for line; `# SAPO:` marks the rest.
On the cpu preset (a real model, --device cpu) the outcome also charges the length cap
(--overlong-cache 16, DAPO's soft overlong punishment at half the right/wrong gap): reward
shaping of ours, not part of SAPO's objective, on because the study's rule adopted it
there: TEPO learned with it and not without (docs/study/README.md, the length term).
"""

from __future__ import annotations

import dataclasses
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
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
)

import common
import runner
from common import UserError, arg

ALGO = "sapo"


# =====================================================================================
# Arguments: SAPO's own flags (the run's, the same in every script, are common.RunArgs)
# =====================================================================================
@dataclass
class Args(common.RunArgs):
    prompts_per_step: int = arg(128, "P, prompts per rollout batch (SAPO: one completion each)")
    group_size: int = arg(
        1, "G, completions per prompt: 1, since a critic, not a group, is the baseline"
    )
    clip_low: float = arg(0.2, "eps_low: the segment ratio is clipped below at 1 - eps_low")
    clip_high: float = arg(
        0.28,
        "eps_high: the segment ratio is clipped above at 1 + eps_high "
        "(official code; the paper writes one eps)",
    )
    kl_coef: float = arg(
        0.001, "coefficient of the k1 KL penalty in the segment rewards; 0 loads no reference model"
    )
    segment_frac: float = arg(
        0.3, "k: this fraction of each completion's tokens, those of highest entropy, end segments"
    )
    gamma: float = arg(1.0, "GAE discount over segments")
    lam: float = arg(0.99, "GAE lambda over segments")
    adv_clip: float = arg(
        5.0, "whitened advantages are clamped to [-adv_clip, adv_clip] (official code)"
    )
    critic_model: str | None = arg(
        None, "model the critic starts from (default: --model); it must use the policy's tokenizer"
    )
    critic_lr: float = arg(4e-4, "critic AdamW learning rate (the paper: 2e-6 with --lr 1e-6)")
    value_at: str = arg(
        "start",
        "V(s_m) at the segment's first token (start: the paper's state "
        "before the segment) or at its last (end: the official code)",
        choices=["start", "end"],
    )
    value_clip: float = arg(0.5, "the value loss clips V - V_old to [-value_clip, value_clip]")
    overlong_cache: int = arg(
        0,
        "L_cache: reward shaping of ours, not part of the objective: the reward loses up to 0.5 "
        "over the last L_cache tokens before --max-new-tokens (DAPO's soft overlong punishment "
        "at DAPO's weight); 0: off; the cpu preset's is 16",
    )


# SAPO: one completion per prompt, so as many prompts as the others' completions (the paper's
# 512 ran on 8 GPUs); the critic's lr twice the policy's, as in the paper (Table 7)
PRESETS = common.presets(
    cpu=dict(prompts_per_step=32, critic_lr=6e-5),
    gpu=dict(prompts_per_step=256, critic_lr=2e-6),
)


def resolve_args(args: Args) -> Args:
    """The preset's value for every flag not passed, then every flag checked."""
    runner.resolve_run_args(args, ALGO, PRESETS, min_group=1)  # SAPO: a critic, no group
    runner.check_args(
        args,
        {
            f"--clip-low must be in [0, 1), not {args.clip_low}": 0 <= args.clip_low < 1,
            f"--clip-high must be >= 0, not {args.clip_high}": args.clip_high >= 0,
            f"--kl-coef must be >= 0, not {args.kl_coef}": args.kl_coef >= 0,
            f"--segment-frac must be in (0, 1], not {args.segment_frac}": 0
            < args.segment_frac
            <= 1,
            f"--gamma must be in [0, 1], not {args.gamma}": 0 <= args.gamma <= 1,
            f"--lam must be in [0, 1], not {args.lam}": 0 <= args.lam <= 1,
            f"--adv-clip must be > 0, not {args.adv_clip}": args.adv_clip > 0,
            f"--critic-lr must be > 0, not {args.critic_lr}": args.critic_lr > 0,
            f"--value-at must be start or end, not {args.value_at!r}": args.value_at
            in ("start", "end"),
            f"--value-clip must be > 0, not {args.value_clip}": args.value_clip > 0,
            f"--overlong-cache must be 0 (off) or in [1, --max-new-tokens {args.max_new_tokens}), "
            f"not {args.overlong_cache}": 0 <= args.overlong_cache < args.max_new_tokens,
        },
    )
    return args


def needs_reference(args: Args) -> bool:
    """pi_ref for the KL penalty in the segment rewards; --kl-coef 0 does without it."""
    return args.kl_coef > 0


# =====================================================================================
# Segments: cut at the highest-entropy tokens
# =====================================================================================
def _seg_sum(x: torch.Tensor, seg_id: torch.Tensor, mask: torch.Tensor, S: int) -> torch.Tensor:
    """[B, T] -> [B, S]: sum of x over the valid tokens of each segment (padding adds nothing)."""
    valid = mask.bool()
    out = x.new_zeros(x.shape[0], S)
    if S == 0:
        return out
    return out.scatter_add(1, torch.where(valid, seg_id, 0), torch.where(valid, x, 0.0))


def _seg_mean(x: torch.Tensor, seg_id: torch.Tensor, mask: torch.Tensor, S: int) -> torch.Tensor:
    """[B, T] -> [B, S]: mean of x over the valid tokens of each segment (0 for padded ones)."""
    count = _seg_sum(mask.bool().to(x.dtype), seg_id, mask, S)
    return _seg_sum(x, seg_id, mask, S) / count.clamp(min=1)


def segment_ends(entropy: torch.Tensor, mask: torch.Tensor, frac: float = 0.3) -> torch.Tensor:
    """[B, T] entropies of the sampling policy, [B, T] mask -> [B, T] bool, True where a
    segment ends (inclusive).

    Per completion with n valid tokens, the k = ceil(frac * n) highest-entropy valid
    positions are ends (ceil as the official code: every non-empty completion gets at least
    one; our 1e-9 tolerance keeps 0.07 * 100 = 7.000000000000001 from giving 8), and the
    last valid token always is, so a completion has k or k + 1 segments. Ties go to the
    earlier position (our reading). Padding is never an end, whatever its entropy.

    >>> entropy = torch.tensor([[0.1, 2.0, 0.3, 1.5, 0.2, 9.0]])  # 9.0 sits on padding
    >>> mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    >>> segment_ends(entropy, mask).long().tolist()  # k = ceil(1.5) = 2: positions 1, 3; last 4
    [[0, 1, 0, 1, 1, 0]]
    """
    if not 0 < frac <= 1:
        raise ValueError(f"frac must be in (0, 1], not {frac}")
    valid = mask.bool()
    B, T = valid.shape
    n = valid.sum(1)
    k = torch.ceil(n.double() * frac - 1e-9).long().clamp(min=1)
    score = torch.where(valid, entropy, float("-inf"))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices  # stable: earlier first
    positions = torch.arange(T, device=valid.device).expand(B, T)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    top = rank < k[:, None]
    last = valid.long().flip(1).cumsum(1).flip(1) == 1  # no valid token after this one
    return valid & (top | last)


def segment_index(ends: torch.Tensor, mask: torch.Tensor):
    """[B, T] ends (from segment_ends: the last valid token must be one), [B, T] mask ->
    (seg_id [B, T] long, seg_mask [B, S] bool). seg_id is the 0-based segment of each valid
    token and -1 on padding; S is the largest number of segments in the batch and seg_mask
    marks the segments that exist. Segment m spans b_m..e_m, e_m being its end.

    >>> ends = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]]).bool()
    >>> mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    >>> seg_id, seg_mask = segment_index(ends, mask)
    >>> seg_id.tolist()
    [[0, 0, 1, 1, 2, -1], [0, -1, -1, -1, -1, -1]]
    >>> seg_mask.tolist()
    [[True, True, True], [True, False, False]]
    """
    valid = mask.bool()
    e = (ends.bool() & valid).long()
    seg_id = torch.where(valid, e.cumsum(1) - e, -1)  # ends strictly before t
    n_seg = e.sum(1)
    S = int(n_seg.max()) if n_seg.numel() else 0
    seg_mask = torch.arange(S, device=valid.device)[None, :] < n_seg[:, None]
    return seg_id, seg_mask


def to_tokens(seg_values: torch.Tensor, seg_id: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S] per-segment values -> [B, T]: each valid token gets its segment's value, padding 0.

    >>> seg_id = torch.tensor([[0, 0, 1, 1, 2, -1]])
    >>> to_tokens(torch.tensor([[0.5, -1.0, 2.0]]), seg_id, seg_id >= 0).tolist()
    [[0.5, 0.5, -1.0, -1.0, 2.0, 0.0]]
    """
    valid = mask.bool()
    if seg_values.shape[1] == 0:
        return seg_values.new_zeros(valid.shape)
    return torch.where(valid, seg_values.gather(1, torch.where(valid, seg_id, 0)), 0.0)


def segment_state_values(token_values, seg_id, seg_mask, mask, value_at: str = "start"):
    """[B, T] value-head outputs -> [B, S] V(s_m), with gradient (for the critic's loss).

    Alignment: token_values[:, t] is the value head applied to the hidden state of the input
    position just before completion token t (the last prompt token for t = 0), the position
    whose logits give logp[:, t]. It is V(x, y_<t): the state in which token t is chosen.
    - "start" (default, the paper's s_m = (x, y_<=e_{m-1}), Sec. 4.1): token_values[:, b_m],
      the state before the segment's first token.
    - "end" (the official code): token_values[:, e_m], the prefix before the segment's last
      token. The two agree on one-token segments.
    Padded segments get 0.

    >>> v = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 9.9]])
    >>> seg_id = torch.tensor([[0, 0, 1, 1, 2, -1]])
    >>> seg_mask = torch.tensor([[True, True, True]])
    >>> start = segment_state_values(v, seg_id, seg_mask, seg_id >= 0)  # V at b_m = 0, 2, 4
    >>> end = segment_state_values(v, seg_id, seg_mask, seg_id >= 0, "end")  # at e_m = 1, 3, 4
    >>> [round(x, 4) for x in start[0].tolist()], [round(x, 4) for x in end[0].tolist()]
    ([0.1, 0.3, 0.5], [0.2, 0.4, 0.5])
    """
    valid = mask.bool()
    no = torch.zeros_like(valid[:, :1])
    if value_at == "start":  # first token of its segment: previous token invalid or elsewhere
        prev_valid = torch.cat([no, valid[:, :-1]], 1)
        prev_id = torch.cat([seg_id[:, :1], seg_id[:, :-1]], 1)
        pick = valid & (~prev_valid | (prev_id != seg_id))
    elif value_at == "end":  # last token of its segment
        next_valid = torch.cat([valid[:, 1:], no], 1)
        next_id = torch.cat([seg_id[:, 1:], seg_id[:, -1:]], 1)
        pick = valid & (~next_valid | (next_id != seg_id))
    else:
        raise ValueError(f"value_at must be 'start' or 'end', not {value_at!r}")
    out = _seg_sum(torch.where(pick, token_values, 0.0), seg_id, mask, seg_mask.shape[1])
    return torch.where(seg_mask, out, 0.0)


# =====================================================================================
# Loss: the clipped surrogate with segment ratios, and the critic's value loss
# =====================================================================================
def segment_log_ratio(logp, old_logp, seg_id, seg_mask, mask, clamp: float | None = 20.0):
    """[B, T] log of the segment ratio s_m (Eq. 8) on every token of segment m, 0 on padding.

    With x_t = clamp(logp_t - old_logp_t, -clamp, clamp) (the clamp is the official code's;
    None disables it), log s_m = mean of x_t over the segment, carried to each token as
    sg(log s_m) + x_t - sg(x_t): its value is log s_m, and d/d logp_t is 1 (0 where the
    clamp is active) with nothing through the other tokens. Since every token of a segment
    shares s_m and A_m, a token-mean of any f(s_m, A_m) then has, for each logp_t, the
    gradient f'(s_m) s_m / N: exactly that of the literal mean of Eq. 8 (Eq. 13).

    >>> old = torch.tensor([[-1.0, -1.0, -2.0, 0.0]])
    >>> logp = torch.tensor([[-0.8, -1.0, -2.3, 0.0]])  # logp - old = 0.2, 0.0 | -0.3
    >>> seg_id = torch.tensor([[0, 0, 1, -1]])
    >>> x = segment_log_ratio(logp, old, seg_id, torch.tensor([[True, True]]), seg_id >= 0)
    >>> [round(v, 4) for v in x[0].tolist()]
    [0.1, 0.1, -0.3, 0.0]
    """
    valid = mask.bool()
    x = torch.where(valid, logp - old_logp, 0.0)
    if clamp is not None:
        x = x.clamp(-clamp, clamp)
    log_s = _seg_mean(x.detach(), seg_id, mask, seg_mask.shape[1])
    return torch.where(valid, to_tokens(log_s, seg_id, mask) + x - x.detach(), 0.0)


def sapo_policy_loss(
    logp,
    old_logp,
    advantages,
    seg_id,
    seg_mask,
    mask,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    log_ratio_clamp=20.0,
    num_tokens=None,
):
    """SAPO's clipped surrogate (Eq. 9) with the segment ratio, token-mean.

    logp        [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp    [B, T]  the same under the policy that sampled the batch (no grad)
    advantages  [B, T]  A_m(t) on each token (to_tokens of the whitened segment advantages)
    seg_id, seg_mask, mask   from segment_index
    num_tokens          valid tokens in the whole mini-batch (default: this mask's), counted
                        before the micro-batch loop, so micro-batch losses sum to the unsplit
    dual_clip           official code: for A < 0 the loss is capped at -A * dual_clip (> 1),
                        so a segment whose ratio has run far up stops being pushed; None = off
    log_ratio_clamp     official code: token log-ratios clamped to +-20; None = off
    Returns the scalar loss. On the first update of a batch old_logp == logp, every s_m is 1
    and the loss value is -mean(A) (~0 after whitening), yet its gradient is the policy
    gradient -A_m(t) * grad logp_t / num_tokens.

    >>> old = torch.tensor([[-1.0, -1.0, -2.0]])
    >>> logp = torch.tensor([[-0.8, -1.0, -2.3]], requires_grad=True)  # s = e^0.1 | e^-0.3
    >>> seg_id = torch.tensor([[0, 0, 1]])
    >>> A = torch.tensor([[1.0, 1.0, -1.0]])
    >>> loss = sapo_policy_loss(logp, old, A, seg_id, torch.tensor([[True, True]]),
    ...                         seg_id >= 0, num_tokens=3)
    >>> round(loss.item(), 4)  # (-e^0.1 - e^0.1 + max(e^-0.3, 0.8)) / 3: segment 2 clipped
    -0.4701
    """
    valid = mask.bool()
    s = torch.exp(segment_log_ratio(logp, old_logp, seg_id, seg_mask, mask, log_ratio_clamp))
    A = torch.where(valid, advantages, 0.0)
    pg = torch.max(-A * s, -A * torch.clamp(s, 1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, not {dual_clip}")
        pg = torch.where(A < 0, torch.min(pg, -A * dual_clip), pg)
    return torch.where(valid, pg, 0.0).sum() / (valid.sum() if num_tokens is None else num_tokens)


def sapo_value_loss(values, old_values, returns, seg_mask, num_segments, clip=0.5):
    """Critic loss at segment states only (Eq. 10, in the official code's clipped form):
    0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -clip, clip),
    summed over valid segments / num_segments (segments in the whole mini-batch, so
    micro-batches sum to the unsplit value). clip=None gives 0.5 * (V - R)^2.

    values      [B, S]  V(s_m) from the critic being trained (segment_state_values, grad)
    old_values  [B, S]  the same when the batch was sampled (no grad)
    returns     [B, S]  R_m from segment_gae

    >>> v, v_old = torch.tensor([[1.0, 0.2]]), torch.tensor([[0.0, 0.0]])
    >>> R = torch.tensor([[2.0, 1.0]])
    >>> loss = sapo_value_loss(v, v_old, R, torch.tensor([[True, True]]), num_segments=2)
    >>> round(loss.item(), 4)  # (0.5 * max(1, 2.25) + 0.5 * max(0.64, 0.64)) / 2
    0.7225
    """
    ok = seg_mask.bool()
    v, v_old, R = (torch.where(ok, x, 0.0) for x in (values, old_values, returns))
    l_v = (v - R) ** 2
    if clip is not None:
        v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
        l_v = torch.max(l_v, (v_clip - R) ** 2)
    return torch.where(ok, 0.5 * l_v, 0.0).sum() / num_segments


@torch.no_grad()
def explained_variance(values, returns, seg_mask) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the valid segments ([B, S] each): 1 for a perfect
    critic, 0 for one that predicts the mean, negative for worse; NaN if Var(R) == 0.

    >>> ev = explained_variance(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([[0.0, 1.0, 2.0]]),
    ...                         torch.tensor([[True, True, True]]))
    >>> round(ev.item(), 4)  # R - V = (0, 0, 1): Var 2/9; Var(R) = 2/3
    0.6667
    """
    ok = seg_mask.bool()
    v, R = values[ok].double(), returns[ok].double()
    var_r = R.var(unbiased=False) if R.numel() else R.new_tensor(0.0)
    if var_r <= 0:
        return torch.tensor(float("nan"))
    return (1 - (R - v).var(unbiased=False) / var_r).float()


# =====================================================================================
# Reward: the outcome on the last segment, a KL penalty on every one
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


def segment_rewards(old_logp, ref_logp, outcome, seg_id, seg_mask, mask, kl_coef=0.001):
    """[B, S] segment rewards r_m = -kl_coef * sum_{t in m} (old_logp_t - ref_logp_t), plus
    outcome[b] (1 correct / 0 wrong) on the completion's last segment. The KL part is the k1
    estimator in the reward, as the paper's Table 7; ref_logp may be None when kl_coef == 0.

    old_logp, ref_logp [B, T]   log-probs of the sampled tokens (sampling policy, reference)
    outcome            [B]      outcome reward per completion
    seg_id, seg_mask, mask      from segment_index

    >>> old = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    >>> ref = torch.tensor([[-2.0, -2.5, -0.5, -4.0]])  # old - ref = 1.0, 0.5 | 0.0, 3.0
    >>> seg_id = torch.tensor([[0, 0, 1, 1]])
    >>> r = segment_rewards(old, ref, torch.tensor([1.0]), seg_id, torch.tensor([[True, True]]),
    ...                     seg_id >= 0, kl_coef=0.1)
    >>> [round(x, 4) for x in r[0].tolist()]  # -0.1 * 1.5 | 1 - 0.1 * 3
    [-0.15, 0.7]
    """
    S = seg_mask.shape[1]
    outcome = outcome.to(old_logp.dtype)
    r = outcome.new_zeros(seg_mask.shape)
    if kl_coef:
        kl = torch.where(mask.bool(), old_logp - ref_logp, 0.0)
        r = r - kl_coef * _seg_sum(kl, seg_id, mask, S)
    if S:
        last = (seg_mask.sum(1) - 1).clamp(min=0)
        bonus = torch.where(seg_mask.any(1), outcome, 0.0)  # no segment, no reward
        r = r.scatter_add(1, last[:, None], bonus[:, None])
    return torch.where(seg_mask, r, 0.0)


# =====================================================================================
# Advantage: GAE over segments, whitened and clamped
# =====================================================================================
@torch.no_grad()
def segment_gae(rewards, values, seg_mask, gamma: float = 1.0, lam: float = 0.99):
    """[B, S] rewards r_m and state values V(s_m) -> (advantages [B, S], returns [B, S]).

    delta_m = r_m + gamma V(s_{m+1}) - V(s_m) with V(s_{M+1}) = 0 (Eq. 6);
    A_m = sum_l (gamma lam)^l delta_{m+l}, R_m = A_m + V(s_m) (Eq. 7). Each row stops at its
    own last segment; padded segments get 0.

    >>> r = torch.tensor([[0.0, 1.0]])
    >>> v = torch.tensor([[0.5, 0.8]])
    >>> A, R = segment_gae(r, v, torch.tensor([[True, True]]), gamma=1.0, lam=0.5)
    >>> [round(x, 4) for x in A[0].tolist()]  # delta = (0.3, 0.2); A_1 = 0.3 + 0.5 * 0.2
    [0.4, 0.2]
    >>> [round(x, 4) for x in R[0].tolist()]
    [0.9, 1.0]
    """
    B, S = rewards.shape
    adv = torch.zeros_like(rewards)
    last_adv, next_v = rewards.new_zeros(B), rewards.new_zeros(B)
    for m in reversed(range(S)):
        ok = seg_mask[:, m]
        delta = rewards[:, m] + gamma * next_v - values[:, m]
        last_adv = torch.where(ok, delta + gamma * lam * last_adv, 0.0)
        adv[:, m] = last_adv
        next_v = torch.where(ok, values[:, m], 0.0)  # 0 past a row's last segment
    return adv, torch.where(seg_mask, adv + values, 0.0)


@torch.no_grad()
def whiten_and_clamp(adv_tokens, mask, clip: float = 5.0, eps: float = 1e-8):
    """[B, T] -> [B, T]: (A - mean) / sqrt(var + eps) over all valid tokens of the rollout
    batch (var with Bessel's correction), clamped to [-clip, clip], 0 on padding (official
    code). Call it once on the whole rollout batch, before splitting it into mini-batches.

    >>> a = torch.tensor([[1.0, 1.0, 4.0, 0.0]])
    >>> [round(x, 4) for x in whiten_and_clamp(a, torch.tensor([[1, 1, 1, 0]]))[0].tolist()]
    [-0.5774, -0.5774, 1.1547, 0.0]
    """
    valid = mask.bool()
    n = valid.sum()
    x = torch.where(valid, adv_tokens, 0.0)
    mean = x.sum() / n.clamp(min=1)
    var = torch.where(valid, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    out = ((x - mean) * torch.rsqrt(var + eps)).clamp(-clip, clip)
    return torch.where(valid, out, 0.0)


# =====================================================================================
# The critic: V at every position, read at segment states
# =====================================================================================
def load_critic(name: str, device: torch.device, args, tokenizer):
    """SAPO's critic V: the model `name` with a scalar value head on every position
    (AutoModelForTokenClassification, num_labels=1, as verl builds critics), fp32 weights
    computed under the same autocast as the policy, and no dropout (V_old must equal V before
    the first update; the head would add a dropout of 0.1). A head the folder does not hold
    (the first load, from a language model) starts at zero weight and bias (our reading;
    transformers would draw it at random): V = 0 at every state on step 1, so the first
    advantages are the whitened returns rather than the noise of a random head."""
    path = runner.resolve_model_name(name)
    try:
        critic, info = AutoModelForTokenClassification.from_pretrained(
            path,
            num_labels=1,
            dtype=torch.float32,
            trust_remote_code=args.trust_remote_code,
            output_loading_info=True,
        )
    except Exception as e:  # a truncated safetensors file, a missing folder, a hub error
        raise UserError(
            f"cannot load the critic from {name!r} ({path}): {common.first_line(e)}"
        ) from None
    n_vocab = critic.get_input_embeddings().num_embeddings
    if n_vocab < len(tokenizer):
        raise UserError(
            f"the critic model {name!r} has {n_vocab} token embeddings, fewer than "
            f"the {len(tokenizer)} tokens of the policy's tokenizer: --critic-model "
            f"must use that tokenizer"
        )
    with torch.no_grad():
        for key in info["missing_keys"]:
            if not key.startswith(critic.base_model_prefix + "."):  # the new head, not the base
                critic.get_parameter(key).zero_()
    for m in critic.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if args.gradient_checkpointing:  # only active in train mode
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return critic.to(device)


def critic_optimizer_for(critic, args):
    """The critic's own AdamW and schedule, as the policy's but at --critic-lr:
    (its trainable parameters, optimizer, scheduler)."""
    params = [p for p in critic.parameters() if p.requires_grad]
    critic_args = dataclasses.replace(args, lr=args.critic_lr)
    optimizer, scheduler = common.make_optimizer(params, critic_args)
    return params, optimizer, scheduler


def token_values(critic, batch, rows, args):
    """The critic's value V(x, y_<t) of each completion token t, [b, T], 0 on padding: the value
    head at the input position just before token t (the last prompt token for t = 0), the
    position whose logits give logp[:, t], so it values the state in which token t is chosen.
    Input, position ids and autocast as in hidden_states; with grad when enabled."""
    input_ids, attention_mask, position_ids, T = model_inputs(batch, rows)
    valid = batch["mask"][rows].bool()  # [b, T]
    with autocast(args):
        v = critic(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).logits[..., 0]  # [b, Tp' + T']
    v = F.pad(v[:, -T - 1 : -1].float(), (0, valid.shape[1] - T))  # position t - 1 values token t
    return torch.where(valid, v, 0.0)


@torch.no_grad()
def batch_values(critic, batch: dict, args) -> torch.Tensor:
    """No-grad token values [B, T] over the whole batch, micro-batch by micro-batch."""
    critic.eval()
    rows = torch.arange(len(batch["mask"]), device=batch["mask"].device)
    mbs = micro_batches(batch, rows, args.micro_batch_size)
    values = torch.cat([token_values(critic, batch, mb, args) for mb in mbs])
    return values[torch.cat(mbs).argsort()]  # back to the batch's row order


@torch.no_grad()
def segment_batch(critic, batch, old_logp, old_entropy, ref_logp, outcome, args) -> dict:
    """Everything SAPO fixes once per rollout batch, before any update (no grad):

    ends [B, T] bool, seg_id [B, T], seg_mask [B, S]   segments from the sampling policy's
                                                       entropies (Eq. 11, --segment-frac)
    token_values [B, T], old_values [B, S]             the critic's V(x, y_<t), and V(s_m)
                                                       read per --value-at
    returns [B, S]                                     R_m, the critic's targets (Eq. 7)
    raw_advantages, advantages [B, T]                  A_m on the tokens of segment m, before
                                                       and after whitening over the whole
                                                       rollout batch and clamping
    outcome [B] is the reward per completion; ref_logp is None when --kl-coef is 0."""
    mask = batch["mask"]
    ends = segment_ends(old_entropy, mask, args.segment_frac)
    seg_id, seg_mask = segment_index(ends, mask)
    tok_values = batch_values(critic, batch, args)
    old_values = segment_state_values(tok_values, seg_id, seg_mask, mask, args.value_at)
    rewards = segment_rewards(old_logp, ref_logp, outcome, seg_id, seg_mask, mask, args.kl_coef)
    adv, returns = segment_gae(rewards, old_values, seg_mask, args.gamma, args.lam)  # Eqs. 6-7
    raw = to_tokens(adv, seg_id, mask)
    return dict(
        ends=ends,
        seg_id=seg_id,
        seg_mask=seg_mask,
        token_values=tok_values,
        old_values=old_values,
        returns=returns,
        raw_advantages=raw,
        advantages=whiten_and_clamp(raw, mask, args.adv_clip),
    )


def value_backward(critic, batch, rows, seg, num_segments, args):
    """The critic's update on micro-batch `rows`: V(s_m) with grad, the clipped value loss
    (Eq. 10) over the mini-batch's num_segments segments, backpropagated (gradients add up over
    micro-batches); returns the loss's value and value_stats."""
    mask, seg_id, seg_mask = batch["mask"][rows], seg["seg_id"][rows], seg["seg_mask"][rows]
    old_values, returns = seg["old_values"][rows], seg["returns"][rows]  # [b, S] each
    v_tokens = token_values(critic, batch, rows, args)  # [b, T], with grad
    values = segment_state_values(v_tokens, seg_id, seg_mask, mask, args.value_at)  # [b, S]
    value_loss = sapo_value_loss(
        values, old_values, returns, seg_mask, num_segments, args.value_clip
    )
    value_loss.backward()
    return value_loss.item(), value_stats(values, old_values, returns, seg_mask, args.value_clip)


# =====================================================================================
# Statistics
# =====================================================================================
def critic_step(optimizer, scheduler, params, args, value_loss_sum: float) -> dict:
    """common.optimizer_step for the critic, with its statistics named for it: value_loss,
    value_grad_norm, and skipped_updates (reduce_stats sums it with the policy's, so it counts
    the skipped steps of both optimizers)."""
    c = common.optimizer_step(optimizer, scheduler, params, args.max_grad_norm, value_loss_sum)
    return {
        "value_loss": value_loss_sum,
        "value_grad_norm": c["grad_norm"],
        "skipped_updates": c["skipped_updates"],
    }


def sapo_metrics(batch, rewards, correct, parsed, old_entropy, seg, old_logp, ref_logp) -> dict:
    """rollout_metrics with the whole batch as one group (G = 1, so zero_std_frac is 1 when every
    completion got the same reward: nothing to learn), plus SAPO's rollout_stats."""
    return {
        **rollout_metrics(batch, rewards, correct, parsed, old_entropy, len(rewards)),
        **rollout_stats(
            seg["raw_advantages"],
            seg["old_values"],
            seg["returns"],
            seg["seg_mask"],
            batch["mask"],
            old_logp,
            ref_logp,
        ),
    }


@torch.no_grad()
def rollout_stats(
    raw_adv_tokens, old_values, returns, seg_mask, mask, old_logp=None, ref_logp=None
) -> dict:
    """SAPO, per rollout batch: segments per completion, mean segment length (tokens), the token
    advantages' mean and std (Bessel) before whitening, the critic's explained variance of the
    returns by the values it gave this batch before training on it (out of sample), the mean
    old value and return per segment, and kl, the mean k1 term old_logp - ref_logp of the
    reward per token (when there is a reference).

    >>> st = rollout_stats(torch.tensor([[1.0, 1.0, 4.0, 0.0]]), torch.tensor([[0.0, 1.0]]),
    ...                    torch.tensor([[0.0, 2.0]]), torch.tensor([[True, True]]),
    ...                    torch.tensor([[1, 1, 1, 0]]))
    >>> for k, v in st.items():
    ...     print(k, round(v, 4))
    segments_per_completion 2.0
    segment_len 1.5
    adv_mean 2.0
    adv_std 1.7321
    explained_var 0.75
    value_mean 0.5
    return_mean 1.0
    """
    valid, ok = mask.bool(), seg_mask.bool()
    n_tok, n_seg = valid.sum(), ok.sum()
    x = torch.where(valid, raw_adv_tokens, 0.0)
    mean = x.sum() / n_tok.clamp(min=1)
    var = torch.where(valid, (x - mean) ** 2, 0.0).sum() / (n_tok - 1).clamp(min=1)
    stats = {
        "segments_per_completion": n_seg / max(valid.shape[0], 1),
        "segment_len": n_tok / n_seg.clamp(min=1),
        "adv_mean": mean,
        "adv_std": var.sqrt(),
        "explained_var": explained_variance(old_values, returns, seg_mask),
        "value_mean": torch.where(ok, old_values, 0.0).sum() / n_seg.clamp(min=1),
        "return_mean": torch.where(ok, returns, 0.0).sum() / n_seg.clamp(min=1),
    }
    if ref_logp is not None:
        stats["kl"] = torch.where(valid, old_logp - ref_logp, 0.0).sum() / n_tok.clamp(min=1)
    return {k: float(v) for k, v in stats.items()}


@torch.no_grad()
def sapo_stats(
    logp,
    old_logp,
    advantages,
    seg_id,
    seg_mask,
    mask,
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    log_ratio_clamp=20.0,
) -> dict:
    """Per micro-batch, token-weighted over valid tokens: clip_frac (the clipped branch of
    Eq. 9 is active), dual_clip_frac (A < 0 and s > dual_clip), approx_kl (k1 estimate of
    KL(old || new), mean of old_logp - logp), and the min / max segment ratio.

    >>> old = torch.tensor([[-1.0, -1.0, -2.0]])
    >>> logp = torch.tensor([[-0.8, -1.0, -2.3]])
    >>> seg_id = torch.tensor([[0, 0, 1]])
    >>> st = sapo_stats(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), seg_id,
    ...                 torch.tensor([[True, True]]), seg_id >= 0)
    >>> for k, v in st.items():
    ...     print(k, round(v, 4))
    clip_frac 0.3333
    dual_clip_frac 0.0
    approx_kl 0.0333
    seg_ratio_min 0.7408
    seg_ratio_max 1.1052
    """
    valid = mask.bool()
    n = valid.sum().clamp(min=1)
    log_s = segment_log_ratio(logp, old_logp, seg_id, seg_mask, mask, log_ratio_clamp)
    s, A = torch.exp(log_s), torch.where(valid, advantages, 0.0)
    clipped = ((s > 1 + clip_high) & (A > 0)) | ((s < 1 - clip_low) & (A < 0))
    dual = (A < 0) & (s > dual_clip) if dual_clip is not None else torch.zeros_like(valid)
    seg_s = torch.exp(_seg_mean(log_s, seg_id, mask, seg_mask.shape[1])[seg_mask.bool()])
    one = s.new_ones(())
    stats = {
        "clip_frac": (clipped & valid).sum() / n,
        "dual_clip_frac": (dual & valid).sum() / n,
        "approx_kl": torch.where(valid, old_logp - logp, 0.0).sum() / n,
        "seg_ratio_min": seg_s.min() if seg_s.numel() else one,
        "seg_ratio_max": seg_s.max() if seg_s.numel() else one,
    }
    return {k: float(v) for k, v in stats.items()}


@torch.no_grad()
def value_stats(values, old_values, returns, seg_mask, clip=0.5) -> dict:
    """Per micro-batch, over valid segments: value_clip_frac, the share of segments whose
    clipped term is the larger one in the value loss (the critic wanted to move further).

    >>> value_stats(torch.tensor([[1.0, 0.2]]), torch.tensor([[0.0, 0.0]]),
    ...             torch.tensor([[2.0, 1.0]]), torch.tensor([[True, True]]))
    {'value_clip_frac': 0.5}
    """
    ok = seg_mask.bool()
    v, v_old, R = (torch.where(ok, x, 0.0) for x in (values, old_values, returns))
    if clip is not None:
        clipped = (v_old + torch.clamp(v - v_old, -clip, clip) - R) ** 2 > (v - R) ** 2
    else:
        clipped = torch.zeros_like(ok)
    return {"value_clip_frac": float((clipped & ok).sum() / ok.sum().clamp(min=1))}


# =====================================================================================
# Training loop
# =====================================================================================
def train(args: Args) -> dict:
    run = runner.Run(args, ALGO, resolve_args, needs_reference)  # folder, --resume, GPU cost
    args, device = run.args, run.device
    tokenizer, ctx = load_tokenizer(args.model, args.trust_remote_code)
    train_rows, eval_rows = load_data(args, tokenizer, ctx)  # a bad dataset fails before a model
    policy = load_model(run.weights(), device, args, trainable=True)  # pi_theta
    ref = load_reference(device, args) if needs_reference(args) else None  # SAPO: for r_m
    critic = load_critic(run.weights("critic", args.critic_model), device, args, tokenizer)  # SAPO
    eos_ids = eos_token_ids(policy, tokenizer)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args)
    critic_params, critic_optimizer, critic_scheduler = critic_optimizer_for(critic, args)  # SAPO
    sampler = common.PromptSampler(train_rows, args.seed, args.dataset)
    state = dict(
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        critic_optimizer=critic_optimizer,
        critic_scheduler=critic_scheduler,
    )  # SAPO
    start = run.attach({"": policy, "critic": critic}, tokenizer, state)  # what a checkpoint holds
    if eval_rows and run.eval_due(start):  # step 0, or a step whose evaluation a stop cut short
        run.log(start, evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))

    P, G = args.prompts_per_step, args.group_size
    for step in run.steps(start):
        # 1. Rollouts: P prompts, G completions each (SAPO: G = 1); row b belongs to prompt b // G
        rows = [train_rows[i] for i in sampler.take(P)]
        prompts = [r["prompt"] for r in rows]
        batch = generate_rollouts(policy, tokenizer, prompts, G, args, eos_ids, device)

        # 2. Reward r_i (SAPO: the outcome, given to the completion's last segment in step 4)
        answers = [r["answer"] for r in rows for _ in range(G)]
        lengths = batch["mask"].sum(1)  # [B] completion lengths in tokens
        rewards, correct, parsed = reward_fn(batch["texts"], answers, lengths, args)  # [B] each

        # 3. Log-probs under the sampling policy (fixed for this batch) and the reference; no grad
        old_logp, old_entropy = batch_logps(policy, batch, args)  # [B, T] each
        ref_logp = reference_logps(policy, ref, batch, args).logp if needs_reference(args) else None

        # 4. SAPO: segments, old values V(s_m), segment rewards, GAE over segments -> A_m, R_m,
        #    A_m on every token of segment m, whitened over the rollout batch and clamped
        outcome = rewards.to(device)
        seg = segment_batch(critic, batch, old_logp, old_entropy, ref_logp, outcome, args)
        seg_id, seg_mask, advantages = seg["seg_id"], seg["seg_mask"], seg["advantages"]

        # 5. Updates: the batch is shuffled into num_mini_batches mini-batches, one optimizer step
        #    each for the policy and (SAPO) the critic; gradients accumulate over micro-batches
        run.updating()  # a stop signal from here waits for the update to end
        policy.train()
        critic.train()  # SAPO
        stats = []
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(rewards), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)  # SAPO
                num_tokens = batch["mask"][mini].sum().item()  # SAPO: the mini-batch's tokens
                num_segments = seg_mask[mini].sum().item()  # SAPO: and segments (value loss)
                loss_sum, value_loss_sum = 0.0, 0.0
                for mb in micro_batches(batch, mini, args.micro_batch_size):
                    logp = token_logps(policy, batch, mb, args).logp  # [b, T]
                    terms = dict(
                        logp=logp,
                        old_logp=old_logp[mb],
                        advantages=advantages[mb],  # SAPO: A_m(t) [b, T]
                        seg_id=seg_id[mb],  # SAPO
                        seg_mask=seg_mask[mb],  # SAPO
                        mask=batch["mask"][mb],
                        clip_low=args.clip_low,
                        clip_high=args.clip_high,
                    )
                    loss = sapo_policy_loss(**terms, num_tokens=num_tokens)  # SAPO: Eq. 9
                    loss.backward()  # gradients add up over micro-batches to the mini-batch's
                    value_loss, v_stats = value_backward(critic, batch, mb, seg, num_segments, args)
                    loss_sum += loss.item()
                    value_loss_sum += value_loss  # SAPO: Eq. 10's, backpropagated just above
                    stats.append({**sapo_stats(**terms), **v_stats})
                step_stats = common.optimizer_step(
                    optimizer, scheduler, params, args.max_grad_norm, loss_sum
                )
                stats.append({"loss": loss_sum, **step_stats})
                stats.append(
                    critic_step(
                        critic_optimizer, critic_scheduler, critic_params, args, value_loss_sum
                    )
                )  # SAPO

        # 6. Metrics, samples, held-out evaluation, checkpoint
        metrics = {
            **sapo_metrics(
                batch, rewards, correct, parsed, old_entropy, seg, old_logp, ref_logp
            ),  # SAPO
            **common.reduce_stats(stats),
            "lr": scheduler.get_last_lr()[0],
            "critic_lr": critic_scheduler.get_last_lr()[0],  # SAPO
        }
        run.updated(metrics)  # the update is done: a stop from here saves this step at once
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch, rewards)
            shown = {
                "entropy": old_entropy,
                "segment_end": seg["ends"].float(),  # SAPO: segments,
                "advantage": advantages,
                "value": seg["token_values"],
            }  # advantages, values
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
