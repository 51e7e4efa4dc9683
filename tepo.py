"""TEPO, Token-level Policy Optimization, in one file.

Paper: "Token-Level Policy Optimization: Linking Group-Level Rewards to Token-Level
Aggregation via Sequence-Level Likelihood", arXiv 2510.09369 (v1) / 2604.12736 (v2), ACL 2026.
Spec followed here: ../shared/ALGORITHMS.md (TEPO).

    python tepo.py                                # bundled tiny model + arithmetic task, CPU, ~4 min
    python tepo.py --model Qwen2.5-Math-1.5B      # the real run: one CUDA GPU, MATH train split
    python tepo.py --resume runs/<run-name>       # continue a stopped run exactly where it stopped
    python eval.py --model runs/<run-name>/checkpoint-<step>

Only the paper's abstract was available to us. What it states, TEPO changes GRPO (grpo.py) in
two ways: (1) it uses the sequence-level likelihood (the product of token probabilities) to
link the group-level reward to individual tokens through token-level aggregation; (2) it adds
a token-level KL-divergence mask that constrains only tokens with a positive advantage and
decreasing entropy, against abrupt policy updates and entropy collapse. A published summary
of the full text calls (1) credit assignment through a geometric-mean importance ratio.

How this script turns that into formulas is OUR READING, not the paper's text:
- Sequence ratio, the geometric mean of the token ratios of completion i (our reading):
      log s_i = sum_t (logp_it - old_logp_it) m_it / sum_t m_it
  carried to every token without changing its value, so each token's gradient is weighted by
  the sequence ratio rather than its own:  log s_it = sg(log s_i) + logp_it - sg(logp_it).
- Policy term, aggregated token-mean over the whole mini-batch (the "token-level aggregation"):
      l_pg = -min(s_it * A_i, clip(s_it, 1 - eps_low, 1 + eps_high) * A_i),
  clip 0.2 / 0.28 as DAPO (our reading).
- KL mask (our reading of "decreasing entropy": lower than when the batch was sampled):
      M_it = [A_i > 0] * [entropy_it < old_entropy_it] * m_it
- KL term: kl_coef * M_it * k3(ref_logp_it, logp_it), token-mean over the same denominator,
  kl_coef = 0.04 as GRPO's beta (our reading).
- Flags for the uncertain parts, and only those: --ratio-level {sequence,token},
  --entropy-baseline {old,ref}, --kl-target {ref,old}, --kl-coef.
The mask can only select tokens once the policy has moved since sampling, so the default
takes several optimizer steps per rollout batch (mini-batches); mask_frac is logged each step.
The pipeline below runs in that order: arguments, model, rollouts, reward, advantage, loss,
training loop.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser

import common
from common import UserError

ALGO = "tepo"


# =====================================================================================
# Arguments
# =====================================================================================
@dataclass
class Args:
    # --- model and data ---
    model: str = field(default="tiny", metadata={"help": "'tiny' (bundled), a hub id such as Qwen/Qwen2.5-Math-1.5B, a short Qwen name, or a local folder"})
    dataset: str | None = field(default=None, metadata={"help": "'tiny', 'math' (DigitalLearningGmbH/MATH-lighteval), 'dapo-math' (open-r1/DAPO-Math-17k-Processed), another hub id, or a local .jsonl/.json/.parquet; default: tiny for the tiny model, math otherwise"})
    problem_column: str | None = field(default=None, metadata={"help": "column holding the problem text (default: the dataset's known column, else 'problem')"})
    answer_column: str | None = field(default=None, metadata={"help": "column holding the answer (default: the dataset's known column, else 'answer')"})
    template: str | None = field(default=None, metadata={"help": "prompt template: qwen_math, tiny or plain; default: tiny for the tiny model, qwen_math otherwise"})
    eval_dataset: str | None = field(default=None, metadata={"help": "held-out set for periodic evaluation ('none' to disable); default: the test split of tiny or math"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow custom model code from the hub (off unless you pass this)"})
    # --- rollouts ---
    prompts_per_step: int | None = field(default=None, metadata={"help": "P, prompts per rollout batch (tiny 16, real 32)"})
    group_size: int = field(default=8, metadata={"help": "G, completions sampled per prompt"})
    max_new_tokens: int | None = field(default=None, metadata={"help": "completion length cap (tiny 40, real 3000)"})
    max_prompt_tokens: int | None = field(default=None, metadata={"help": "longer prompts are dropped from the data; default: context length - max_new_tokens"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; log-probs use the same one"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling; keep 1.0 so log-probs are those of the sampling distribution"})
    gen_batch_size: int | None = field(default=None, metadata={"help": "completions per generate() call (tiny: the whole rollout batch, real 64)"})
    # --- objective ---
    clip_low: float = field(default=0.2, metadata={"help": "eps_low: the ratio is clipped below at 1 - eps_low (our reading)"})
    clip_high: float = field(default=0.28, metadata={"help": "eps_high: the ratio is clipped above at 1 + eps_high (our reading)"})
    ratio_level: str = field(default="sequence", metadata={"help": "sequence: the geometric-mean sequence ratio carried to every token (our reading of TEPO); token: per-token ratios", "choices": ["sequence", "token"]})
    entropy_baseline: str = field(default="old", metadata={"help": "the KL mask keeps tokens whose entropy fell below this: old (the sampling policy) or ref (the reference model)", "choices": ["old", "ref"]})
    kl_target: str = field(default="ref", metadata={"help": "the masked KL pulls towards: ref (the frozen starting model) or old (the sampling policy)", "choices": ["ref", "old"]})
    kl_coef: float = field(default=0.04, metadata={"help": "coefficient of the masked KL term (our reading: GRPO's beta)"})
    # --- optimisation ---
    steps: int | None = field(default=None, metadata={"help": "rollout batches to train on (tiny 160, real 500)"})
    lr: float | None = field(default=None, metadata={"help": "AdamW learning rate (tiny 2e-4, real 1e-6)"})
    warmup_steps: int | None = field(default=None, metadata={"help": "linear lr warm-up, in optimizer steps, then constant (tiny 4, real 10)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient-norm clipping"})
    num_mini_batches: int | None = field(default=None, metadata={"help": "optimizer steps per rollout batch: the batch is shuffled and split into this many mini-batches (tiny 2, real 4)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over the rollout batch"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "completions per forward/backward; gradients accumulate over micro-batches (tiny 64, real 4)"})
    optim: str = field(default="adamw", metadata={"help": "adamw (fp32 states) or adamw8bit (bitsandbytes, saves ~9 GB on a 1.5B model)"})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "recompute activations in the training pass (default: on for CUDA)"})
    # --- run ---
    seed: int = field(default=1, metadata={"help": "seed for data order, sampling and init"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    output_dir: str = field(default="runs", metadata={"help": "runs are written to <output_dir>/<run_name>/"})
    run_name: str | None = field(default=None, metadata={"help": "default: <algo>-<model>-s<seed>-<date>"})
    eval_every: int | None = field(default=None, metadata={"help": "held-out evaluation every N steps, and at the first and last (tiny 40, real 50)"})
    eval_n: int | None = field(default=None, metadata={"help": "held-out problems per evaluation (tiny 256, real 500)"})
    save_every: int | None = field(default=None, metadata={"help": "checkpoint every N steps, and at the end (tiny 80, real 50)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "most recent checkpoints kept"})
    sample_every: int = field(default=20, metadata={"help": "print a few completions with their rewards every N steps"})
    grader_timeout: int = field(default=5, metadata={"help": "seconds allowed per answer parse / comparison"})
    tensorboard: bool = field(default=True, metadata={"help": "also log to TensorBoard when it is installed"})
    resume: str | None = field(default=None, metadata={"help": "a run folder or checkpoint to continue from; its saved arguments are used (only --steps, --device may change)"})


# The two presets: `python grpo.py` (bundled tiny model, CPU) and any real model (one GPU).
TINY_DEFAULTS = dict(dataset="tiny", template="tiny", eval_dataset="tiny", prompts_per_step=16,
                     max_new_tokens=40, steps=160, lr=2e-4, warmup_steps=4, num_mini_batches=2,
                     micro_batch_size=64, gradient_checkpointing=False, eval_every=40, eval_n=256,
                     save_every=80)
REAL_DEFAULTS = dict(dataset="math", template="qwen_math", eval_dataset="math", prompts_per_step=32,
                     max_new_tokens=3000, steps=500, lr=1e-6, warmup_steps=10, num_mini_batches=4,
                     micro_batch_size=4, gen_batch_size=64, gradient_checkpointing=None, eval_every=50, eval_n=500,
                     save_every=50)
RESUME_OVERRIDABLE = ("steps", "device", "resume")


def resolve_args(args: Args) -> Args:
    """Fill every field left at None from the preset that fits the model."""
    preset = TINY_DEFAULTS if common.is_tiny(args.model) else REAL_DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eval_dataset == "math" and args.dataset != "math":
        args.eval_dataset = "none"  # only MATH and tiny come with a held-out split here
    if args.run_name is None:
        args.run_name = f"{ALGO}-{Path(args.model).name}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    B = args.prompts_per_step * args.group_size
    if B % args.num_mini_batches:
        raise UserError(f"P*G = {B} completions do not split into {args.num_mini_batches} equal mini-batches")
    return args


# =====================================================================================
# Model
# =====================================================================================
def load_model(name: str, device: torch.device, trust_remote_code: bool, trainable: bool):
    """The policy keeps fp32 weights (bf16 weights would round away lr=1e-6 updates) and
    computes in bf16 under autocast on CUDA; the frozen reference is stored in bf16 there."""
    path = common.resolve_model_name(name)
    dtype = torch.float32 if trainable or device.type == "cpu" else torch.bfloat16
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load model {name!r} ({path}): {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends on the right
    for m in model.modules():  # no dropout: the ratio must be exactly 1 before the first update
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.to(device)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model, tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS, the generation config's (Qwen
    lists <|endoftext|> and <|im_end|>), and <|im_end|> whenever the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def context_length(model, tokenizer) -> int:
    n = getattr(model.config, "max_position_embeddings", None)
    return n or min(tokenizer.model_max_length, 1 << 20)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


# =====================================================================================
# Data
# =====================================================================================
def load_prompts(dataset, split, tokenizer, args, max_prompt_tokens, limit=None):
    """Problems with their prompt text; prompts over max_prompt_tokens are dropped."""
    rows = common.load_problems(dataset, split, args.problem_column, args.answer_column,
                                limit=limit, seed=args.seed)
    for r in rows:
        r["prompt"] = common.build_prompt(tokenizer, r["problem"], args.template)
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]]
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise UserError(f"every prompt of {dataset!r} is longer than {max_prompt_tokens} tokens "
                        f"(context - max_new_tokens); lower --max-new-tokens")
    if len(kept) < len(rows):
        print(f"dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than {max_prompt_tokens} tokens")
    return kept


# =====================================================================================
# Rollouts
# =====================================================================================
def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long: 1 up to and including the first EOS, 0 after. Built by position,
    never by `token != pad`: Qwen base models pad with their EOS, and the EOS must be trained."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    T = completion_ids.shape[1]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], T, dtype=torch.long))
    return (torch.arange(T, device=completion_ids.device)[None, :] <= first_eos[:, None]).long()


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Text of each completion up to its first EOS; whatever generate() padded after it is dropped."""
    return [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())]


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: list[str], G: int, args, eos_ids, device) -> dict:
    """Sample G completions per prompt with HF generate (KV cache on); row b belongs to
    prompt b // G. Returns token tensors with the prompt left-padded and the completion masks."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(G, 0).to(device)
    prompt_mask = enc["attention_mask"].repeat_interleave(G, 0).to(device)
    gen_cfg = GenerationConfig(  # written out in full: a model's own defaults (top_k=50, ...) would bias sampling
        do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens,
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    model.eval()
    chunks, n = [], args.gen_batch_size or len(prompt_ids)
    for i in range(0, len(prompt_ids), n):
        with autocast(device):
            out = model.generate(input_ids=prompt_ids[i:i + n], attention_mask=prompt_mask[i:i + n], generation_config=gen_cfg)
        chunks.append(out[:, prompt_ids.shape[1]:])
    T = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([F.pad(c, (0, T - c.shape[1]), value=tokenizer.pad_token_id) for c in chunks])
    mask = completion_mask(completion_ids, eos_ids)
    truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)
    texts = decode_completions(tokenizer, completion_ids, mask)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                mask=mask, truncated=truncated, texts=texts, prompts=[p for p in prompts for _ in range(G)])


def token_logps_and_entropy(model, prompt_ids, prompt_mask, completion_ids, mask, temperature):
    """Log-prob of each completion token and the entropy of the full next-token distribution,
    both from logits / temperature (the distribution that was sampled). [B, T] each; the
    entropy carries no gradient. Position ids follow the left padding, as in generate."""
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    T = completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, logits_to_keep=T + 1).logits[:, :-1, :]  # position t predicts token t+1
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (F.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


@torch.no_grad()
def batch_logps(model, batch: dict, args, device, rows=None):
    """No-grad log-probs and entropies over a batch, micro-batch by micro-batch."""
    model.eval()
    rows = torch.arange(len(batch["mask"]), device=device) if rows is None else rows
    if len(rows) == 0:
        return (batch["mask"].new_zeros(0, batch["mask"].shape[1], dtype=torch.float32),) * 2
    logps, ents = [], []
    for mb in rows.split(args.micro_batch_size):
        with autocast(device):
            lp, ent = token_logps_and_entropy(model, batch["prompt_ids"][mb], batch["prompt_mask"][mb],
                                              batch["completion_ids"][mb], batch["mask"][mb], args.temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


# =====================================================================================
# Reward
# =====================================================================================
def reward_fn(texts: list[str], answers: list[str], timeout_s: int):
    """GRPO's outcome reward: 1 if the last \\boxed{} matches the answer (math-verify), else 0."""
    grades = [common.grade(t, a, timeout_s) for t, a in zip(texts, answers)]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)
    parsed = torch.tensor([g.parsed for g in grades], dtype=torch.float32)
    return correct.clone(), correct, parsed


# =====================================================================================
# Advantage
# =====================================================================================
def group_advantages(rewards: torch.Tensor, G: int, eps: float = 1e-4) -> torch.Tensor:
    """[B] -> [B]: A_i = (r_i - mean_g r) / (std_g r + eps), std with Bessel's correction over
    the G completions of one prompt. An all-equal group gives exactly 0 (its numerator is 0)."""
    r = rewards.view(-1, G)
    if r.shape[0] == 0:  # an empty batch: nothing to normalise
        return rewards.clone()
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=True) + eps)
    return A.view(-1)


# =====================================================================================
# Loss
# =====================================================================================
def k3_kl(q_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || q) per token: exp(d) - d - 1, d = q_logp - logp (>= 0)."""
    d = q_logp - logp
    return torch.exp(d) - d - 1


def token_mean(l: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """sum_it l_it m_it / num_tokens, with num_tokens counted over the whole mini-batch before
    the micro-batch loop, so the sum over micro-batches equals the unsplit token-mean."""
    return (l * mask).sum() / num_tokens


def carried_log_ratio(logp, old_logp, mask, ratio_level: str) -> torch.Tensor:
    """[B, T] log-ratio used on each token. 'token': logp - old_logp. 'sequence' (our reading):
    log s_i = mean over valid tokens of (logp - old_logp), carried as sg(log s_i) + logp - sg(logp),
    so its value is log s_i on every token and d/d logp_it is 1 (each token keeps its own gradient)."""
    log_ratio = logp - old_logp
    if ratio_level == "token":
        return log_ratio
    if ratio_level != "sequence":
        raise ValueError(f"ratio_level must be 'sequence' or 'token', not {ratio_level!r}")
    mask = mask.to(logp.dtype)
    log_s = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return log_s.detach() + logp - logp.detach()


def kl_mask(advantages, entropy, base_entropy, mask) -> torch.Tensor:
    """[B, T] bool, TEPO's KL mask (our reading): A_i > 0, entropy below its baseline (the
    sampling policy's entropy, or the reference model's), and a valid completion token.
    Strictly below: before the first update the two entropies are equal and nothing is masked
    (in bf16 on a GPU, rounding between two forward passes can still tip a few tokens)."""
    return (advantages[:, None] > 0) & (entropy < base_entropy) & (mask > 0)


def tepo_loss(logp, old_logp, advantages, mask, entropy, base_entropy, kl_logp, num_tokens,
              clip_low=0.2, clip_high=0.28, kl_coef=0.04, ratio_level="sequence"):
    """TEPO loss as read in ../shared/ALGORITHMS.md, aggregated token-mean. A pure function of
    tensors: copy it into another trainer unchanged, together with the four small helpers above
    it (k3_kl, token_mean, carried_log_ratio, kl_mask); it needs nothing but torch.

    logp         [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp     [B, T]  the same under the policy that sampled the batch (no grad)
    advantages   [B]     one group-relative advantage per completion
    mask         [B, T]  1 on completion tokens through the first EOS
    entropy      [B, T]  entropy of the current policy at each position (no grad)
    base_entropy [B, T]  the entropy it is compared with (old policy's, or reference model's)
    kl_logp      [B, T]  log-probs under the KL target (reference or old policy); unused if kl_coef == 0
    num_tokens           valid tokens in the whole mini-batch (sum of its mask)
    Returns (loss, stats).

    Worked example, one completion of two tokens, A = 1, no KL: logp - old_logp = (0.2, 0.0)
    gives log s = 0.1, s = 1.105 on both tokens (inside [0.8, 1.28]); loss = -(1.105 + 1.105) / 2
    = -1.105, and d loss / d logp_t = -s * A / N = -0.553 for each token.
    """
    mask_f = mask.to(logp.dtype)
    A = advantages[:, None]
    s = torch.exp(carried_log_ratio(logp, old_logp, mask_f, ratio_level))
    pg = -torch.min(s * A, torch.clamp(s, 1 - clip_low, 1 + clip_high) * A)
    M = kl_mask(advantages, entropy, base_entropy, mask)
    kl = k3_kl(kl_logp, logp) if kl_coef > 0 else torch.zeros_like(logp)
    loss = token_mean(pg + kl_coef * M * kl, mask_f, num_tokens)
    with torch.no_grad():
        valid, Mf = mask_f.sum().clamp(min=1), M.to(logp.dtype)
        n_masked, other = Mf.sum(), mask_f * (1 - Mf)
        rows = mask_f.sum(1) > 0
        seq_ratio = torch.exp(((logp - old_logp) * mask_f).sum(1)[rows] / mask_f.sum(1)[rows])
        clipped = ((s > 1 + clip_high) & (A > 0)) | ((s < 1 - clip_low) & (A < 0))
        stats = {
            "mask_frac": n_masked / valid,
            "masked_entropy": (entropy * Mf).sum() / n_masked.clamp(min=1),
            "other_entropy": (entropy * other).sum() / other.sum().clamp(min=1),
            "seq_ratio_min": seq_ratio.min() if rows.any() else torch.ones(()),
            "seq_ratio_max": seq_ratio.max() if rows.any() else torch.ones(()),
            "clip_frac": (clipped * mask_f).sum() / valid,
            "masked_kl": (kl * Mf).sum() / n_masked.clamp(min=1),
            "kl": (kl * mask_f).sum() / valid,
        }
    return loss, stats


# =====================================================================================
# Evaluation, samples, checkpoints
# =====================================================================================
@torch.no_grad()
def evaluate(model, tokenizer, problems, args, eos_ids, device) -> dict:
    """Held-out accuracy, greedy and sampled at the training temperature."""
    out = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        cfg = GenerationConfig(do_sample=sample, temperature=args.temperature if sample else None, top_p=args.top_p if sample else None,
                               top_k=0 if sample else None, max_new_tokens=args.max_new_tokens, eos_token_id=eos_ids,
                               pad_token_id=tokenizer.pad_token_id, use_cache=True)
        correct, n = 0, args.gen_batch_size or 128
        model.eval()
        for i in tqdm(range(0, len(problems), n), desc=f"eval ({name})", leave=False, dynamic_ncols=True):
            chunk = problems[i:i + n]
            enc = tokenizer([p["prompt"] for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with autocast(device):
                ids = model.generate(**enc, generation_config=cfg)[:, enc["input_ids"].shape[1]:]
            texts = decode_completions(tokenizer, ids, completion_mask(ids, eos_ids))
            correct += sum(common.grade(t, p["answer"], args.grader_timeout).correct for t, p in zip(texts, chunk))
        out[f"eval/{name}_acc"] = correct / len(problems)
    return out


def show_samples(step, prompts, texts, rewards, k=2):
    tqdm.write(f"--- samples at step {step} ---")
    for p, t, r in list(zip(prompts, texts, rewards.tolist()))[:k]:
        tqdm.write(f"[reward {r:+.2f}] {p[-80:]!r} -> {t[:300]!r}")


BAR_FIGURES = {"reward": "reward", "accuracy": "acc", "kl": "kl", "entropy": "ent", "completion_len": "len", "tokens_per_s": "tok/s"}


class GracefulInterrupt:
    """First Ctrl-C: finish the current step, save, exit. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGINT, self._handler)

    def close(self):
        signal.signal(signal.SIGINT, self.previous)

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)")


# =====================================================================================
# Training loop
# =====================================================================================
def train(args: Args) -> dict:
    state = None
    if args.resume:  # continue with the run's own arguments (only a few may change)
        ckpt = common.find_checkpoint(args.resume)
        state = common.load_trainer_state(ckpt)
        cli = args
        try:
            args = Args(**state["args"])
        except TypeError:
            raise UserError(f"checkpoint {str(ckpt)!r} was not written by {ALGO}.py (its arguments differ)") from None
        for k in RESUME_OVERRIDABLE:
            if getattr(cli, k) is not None:
                setattr(args, k, getattr(cli, k))
    args = resolve_args(args)
    device = common.resolve_device(args.device)
    common.seed_everything(args.seed)
    run_dir = Path(args.output_dir) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))

    # --- models: the policy pi_theta, and the frozen reference pi_ref (when the KL or the mask uses it) ---
    policy, tokenizer = load_model(str(ckpt) if state else args.model, device, args.trust_remote_code, trainable=True)
    need_ref = (args.kl_coef > 0 and args.kl_target == "ref") or args.entropy_baseline == "ref"
    ref = load_model(args.model, device, args.trust_remote_code, trainable=False)[0] if need_ref else None
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = device.type == "cuda"
    if args.gradient_checkpointing:  # only active in train mode, so generate() is not slowed
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eos_ids = eos_token_ids(policy, tokenizer)
    ctx = context_length(policy, tokenizer)
    if args.max_new_tokens >= ctx:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                        f"this model's {ctx}-token context")
    max_prompt = args.max_prompt_tokens or ctx - args.max_new_tokens
    if max_prompt + args.max_new_tokens > ctx:
        raise UserError(f"--max-prompt-tokens {max_prompt} + --max-new-tokens {args.max_new_tokens} "
                        f"exceed this model's {ctx}-token context")

    # --- data ---
    train_rows = load_prompts(args.dataset, "train", tokenizer, args, max_prompt)
    eval_rows = [] if args.eval_dataset == "none" else load_prompts(args.eval_dataset, "test", tokenizer, args, max_prompt, limit=args.eval_n)
    sampler = common.PromptSampler(len(train_rows), args.seed)

    # --- optimiser: AdamW, linear warm-up then constant lr ---
    params = [p for p in policy.parameters() if p.requires_grad]
    if args.optim == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError("--optim adamw8bit needs bitsandbytes: pip install bitsandbytes") from None
        optimizer = bnb.optim.AdamW8bit(params, lr=args.lr, weight_decay=args.weight_decay)
    elif args.optim == "adamw":
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    else:
        raise UserError(f"unknown --optim {args.optim!r}; use adamw or adamw8bit")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))

    start = 0
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        common.set_rng_state(state["rng"])
        start = state["step"]
        print(f"resumed {run_dir} from {ckpt.name} at step {start}")

    logger = common.RunLogger(run_dir, args.tensorboard)
    interrupt = GracefulInterrupt()
    P, G = args.prompts_per_step, args.group_size
    first_eval = last_metrics = None

    def save(step):
        trainer_state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                         "sampler": sampler.state_dict(), "rng": common.rng_state(), "args": dataclasses.asdict(args)}
        return common.save_checkpoint(run_dir, step, policy, tokenizer, trainer_state, args.keep_checkpoints)

    if start == 0 and eval_rows:
        first_eval = evaluate(policy, tokenizer, eval_rows, args, eos_ids, device)
        logger.log(0, first_eval)
        tqdm.write(f"step 0: held-out greedy acc {first_eval['eval/greedy_acc']:.3f}, sampled acc {first_eval['eval/sampled_acc']:.3f}")

    bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps, desc=ALGO, dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # 1. sample P prompts, G completions each
        rows = [train_rows[i] for i in sampler.take(P)]
        batch = generate_rollouts(policy, tokenizer, [r["prompt"] for r in rows], G, args, eos_ids, device)
        t_gen = time.time() - t0

        # 2. reward, then group-relative advantage (one value per completion)
        answers = [r["answer"] for r in rows for _ in range(G)]
        rewards, correct, parsed = reward_fn(batch["texts"], answers, args.grader_timeout)
        advantages = group_advantages(rewards, G).to(device)

        # 3. old_logp and old_entropy (the sampling policy, fixed for this batch), ref_logp and ref_entropy
        old_logp, old_entropy = batch_logps(policy, batch, args, device)
        ref_logp, ref_entropy = batch_logps(ref, batch, args, device) if ref is not None else (None, None)
        base_entropy = old_entropy if args.entropy_baseline == "old" else ref_entropy  # the mask's "entropy fell"
        kl_logp = ref_logp if args.kl_target == "ref" else old_logp

        # 4. several optimizer steps per rollout batch, over shuffled mini-batches
        policy.train()
        stats = []
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens = batch["mask"][mini].sum().item()  # token-mean denominator, counted once per mini-batch
                mini_loss = 0.0
                for micro in mini.split(args.micro_batch_size):
                    with autocast(device):
                        logp, entropy = token_logps_and_entropy(policy, batch["prompt_ids"][micro], batch["prompt_mask"][micro],
                                                          batch["completion_ids"][micro], batch["mask"][micro], args.temperature)
                    loss, st = tepo_loss(logp, old_logp[micro], advantages[micro], batch["mask"][micro], entropy,
                                         base_entropy[micro], kl_logp[micro] if kl_logp is not None else None, num_tokens,
                                         args.clip_low, args.clip_high, args.kl_coef, args.ratio_level)
                    loss.backward()  # gradients add up over micro-batches to those of the mini-batch
                    mini_loss += loss.item()
                    stats.append({k: v.item() for k, v in st.items()})
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                stats.append({"loss": mini_loss, "grad_norm": grad_norm.item()})
        t_train = time.time() - t0 - t_gen

        # 5. metrics, samples, evaluation, checkpoint
        mask = batch["mask"].float()
        n_tokens = max(mask.sum().item(), 1)
        zero_std = (rewards.view(-1, G).std(1) == 0).float().mean().item()
        metrics = {
            "reward": rewards.mean().item(), "accuracy": correct.mean().item(), "unparsable_frac": 1 - parsed.mean().item(),
            "zero_std_frac": zero_std, "entropy": ((old_entropy * mask).sum() / n_tokens).item(),
            "completion_len": mask.sum(1).mean().item(), "truncated_frac": batch["truncated"].float().mean().item(),
            **common.reduce_stats(stats), "lr": scheduler.get_last_lr()[0],
            "time/generate": t_gen, "time/train": t_train, "tokens_per_s": n_tokens / (time.time() - t0),
        }
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch["prompts"], batch["texts"], rewards)
        if eval_rows and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))
            tqdm.write(f"step {step}: held-out greedy acc {metrics['eval/greedy_acc']:.3f}, sampled acc {metrics['eval/sampled_acc']:.3f}")
        logger.log(step, metrics)
        last_metrics = metrics
        bar.set_postfix({short: f"{metrics[k]:.3g}" if abs(metrics[k]) < 1000 else f"{metrics[k]:.0f}"
                         for k, short in BAR_FIGURES.items() if k in metrics})
        if step % args.save_every == 0 or step == args.steps or interrupt.requested:
            path = save(step)
            if interrupt.requested:
                tqdm.write(f"interrupted: saved {path}; continue with: python {ALGO}.py --resume {run_dir}")
                logger.close()
                interrupt.close()
                raise SystemExit(130)
    bar.close()
    logger.close()
    interrupt.close()

    # --- summary ---
    summary = {"run_dir": str(run_dir), "steps": args.steps}
    history = common.read_metrics(run_dir)
    evals = [m for m in history if "eval/sampled_acc" in m]
    if evals:
        summary.update({"first_eval": {k: v for k, v in evals[0].items() if k.startswith("eval/")},
                        "last_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval/")}})
    if last_metrics:
        summary["last_step"] = {k: round(v, 4) for k, v in last_metrics.items() if isinstance(v, float)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\ndone: {args.steps} steps, run folder {run_dir}")
    if evals:
        f, l = evals[0], evals[-1]
        print(f"held-out accuracy  greedy {f['eval/greedy_acc']:.3f} -> {l['eval/greedy_acc']:.3f}   "
              f"sampled {f['eval/sampled_acc']:.3f} -> {l['eval/sampled_acc']:.3f}")
    return summary


def main(argv=None):
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)
    try:
        return train(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
