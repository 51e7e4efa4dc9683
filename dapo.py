"""DAPO, Decoupled Clip and Dynamic sAmpling Policy Optimization, in one file.

Paper: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, Sec. 3.1-3.4. Spec followed here: ../shared/ALGORITHMS.md (DAPO).

    python dapo.py                                # bundled tiny model + arithmetic task, CPU, ~4 min
    python dapo.py --model Qwen2.5-Math-1.5B      # the real run: one CUDA GPU, MATH train split
    python dapo.py --resume runs/<run-name>       # continue a stopped run exactly where it stopped
    python eval.py --model runs/<run-name>/checkpoint-<step>

DAPO is GRPO (grpo.py) with four changes and without the KL term (no reference model):
1. Clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high > eps_low,
   so unlikely tokens with a positive advantage can still grow (keeps entropy up).
2. Dynamic sampling: groups whose completions are all right or all wrong have A = 0 and teach
   nothing; they are dropped and more prompts are sampled until P mixed groups are collected
   (or a round limit is reached).
3. Token-level loss: every token of the rollout batch weighs the same,
       loss = sum_it l_it m_it / sum_it m_it                  ("token-mean")
   instead of GRPO's mean over sequences of per-sequence means, which lets long wrong
   answers off lightly.
4. Overlong reward shaping: reward +1 right / -1 wrong, plus a penalty that grows linearly
   from 0 to -1 over the last L_cache tokens before the length cap L_max.

Per token:  ratio_it = exp(logp_it - old_logp_it),
            l_it = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i).
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

ALGO = "dapo"


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
    group_size: int | None = field(default=None, metadata={"help": "G, completions sampled per prompt (tiny 8, real 16)"})
    max_new_tokens: int | None = field(default=None, metadata={"help": "completion length cap (tiny 40, real 3000)"})
    max_prompt_tokens: int | None = field(default=None, metadata={"help": "longer prompts are dropped from the data; default: context length - max_new_tokens"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature; log-probs use the same one"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling; keep 1.0 so log-probs are those of the sampling distribution"})
    gen_batch_size: int | None = field(default=None, metadata={"help": "completions per generate() call (tiny: the whole rollout batch, real 64)"})
    # --- objective ---
    clip_low: float = field(default=0.2, metadata={"help": "eps_low: the ratio is clipped below at 1 - eps_low"})
    clip_high: float = field(default=0.28, metadata={"help": "eps_high: the ratio is clipped above at 1 + eps_high (clip-higher)"})
    overlong_cache: int | None = field(default=None, metadata={"help": "L_cache: the length penalty ramps over the last L_cache tokens before --max-new-tokens (tiny 8, real 600)"})
    max_gen_rounds: int = field(default=4, metadata={"help": "dynamic sampling: at most this many generation rounds per step, then train on what was kept"})
    # --- optimisation ---
    steps: int | None = field(default=None, metadata={"help": "rollout batches to train on (tiny 160, real 500)"})
    lr: float | None = field(default=None, metadata={"help": "AdamW learning rate (tiny 2e-4, real 1e-6)"})
    warmup_steps: int | None = field(default=None, metadata={"help": "linear lr warm-up, in optimizer steps, then constant (tiny 4, real 20)"})
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
TINY_DEFAULTS = dict(dataset="tiny", template="tiny", eval_dataset="tiny", prompts_per_step=16, group_size=8, overlong_cache=8,
                     max_new_tokens=40, steps=160, lr=2e-4, warmup_steps=4, num_mini_batches=2,
                     micro_batch_size=64, gradient_checkpointing=False, eval_every=40, eval_n=256,
                     save_every=80)
REAL_DEFAULTS = dict(dataset="math", template="qwen_math", eval_dataset="math", prompts_per_step=16, group_size=16,
                     overlong_cache=600, max_new_tokens=3000, steps=500, lr=1e-6, warmup_steps=20, num_mini_batches=4,
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
def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """[B] -> [B], DAPO Sec. 3.4 (soft overlong punishment): 0 up to L_max - L_cache tokens, then ((L_max - L_cache) - len) / L_cache
    falling linearly to -1 at L_max, and -1 beyond."""
    lengths = lengths.float()
    soft = max_len - cache
    ramp = (soft - lengths) / cache
    return torch.where(lengths <= soft, torch.zeros_like(lengths), torch.where(lengths <= max_len, ramp, -torch.ones_like(lengths)))


def reward_fn(texts: list[str], answers: list[str], lengths: torch.Tensor, max_new_tokens: int, overlong_cache: int, timeout_s: int):
    """DAPO's reward: +1 if the last \\boxed{} matches the answer (math-verify), else -1, plus
    the overlong penalty on the completion length in tokens."""
    grades = [common.grade(t, a, timeout_s) for t, a in zip(texts, answers)]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)
    parsed = torch.tensor([g.parsed for g in grades], dtype=torch.float32)
    rewards = 2 * correct - 1 + overlong_penalty(lengths.cpu(), max_new_tokens, overlong_cache)
    return rewards, correct, parsed


def mixed_groups(correct: torch.Tensor, G: int) -> torch.Tensor:
    """[B] -> [P] bool: True for groups whose completions are neither all right nor all wrong."""
    c = correct.view(-1, G)
    return (c.min(1).values != c.max(1).values)


def _pad_cat(tensors: list[torch.Tensor], value: int, left: bool) -> torch.Tensor:
    T = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (T - t.shape[1], 0) if left else (0, T - t.shape[1]), value=value) for t in tensors])


def dynamic_sampling(sample_round, P: int, G: int, max_rounds: int):
    """Call sample_round() (one generation round: G completions for each of some prompts, scored)
    until P groups with mixed outcomes are kept or max_rounds rounds are spent. Returns the kept
    rows as one batch (exactly P groups, or fewer at the round limit) and counts for the log."""
    kept, n_kept, n_dropped, rounds = [], 0, 0, 0
    while n_kept < P and rounds < max_rounds:
        b = sample_round()
        rounds += 1
        keep_groups = mixed_groups(b["correct"], G)
        n_kept += int(keep_groups.sum())
        n_dropped += int((~keep_groups).sum())
        rows = keep_groups.repeat_interleave(G).nonzero().squeeze(1)
        kept.append({k: [v[i] for i in rows.tolist()] if isinstance(v, list) else v[rows.to(v.device)] for k, v in b.items()})
    if n_kept < P:
        tqdm.write(f"dynamic sampling: stopped at the round limit ({max_rounds}) with {n_kept} of {P} mixed groups")
    batch = {}
    for k, v in kept[0].items():
        parts = [b[k] for b in kept]
        if isinstance(v, list):
            batch[k] = sum(parts, [])[:P * G]
        elif v.dim() == 2:  # prompts are left-padded, completions right-padded; padded ids are masked out
            batch[k] = _pad_cat(parts, 0, left=k.startswith("prompt"))[:P * G]
        else:
            batch[k] = torch.cat(parts)[:P * G]
    info = {"rounds": rounds, "kept_groups": min(n_kept, P), "dropped_groups": n_dropped, "hit_round_limit": n_kept < P}
    return batch, info


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
def token_mean(l: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """sum_it l_it m_it / num_tokens, with num_tokens counted over the whole mini-batch before
    the micro-batch loop, so the sum over micro-batches equals the unsplit token-mean."""
    return (l * mask).sum() / num_tokens


def dapo_loss(logp, old_logp, advantages, mask, num_tokens, clip_low=0.2, clip_high=0.28):
    """DAPO policy loss (Sec. 3.1 clip-higher, Sec. 3.3 token-level loss; no KL term), aggregated token-mean.

    logp      [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp  [B, T]  the same under the policy that sampled the batch (no grad)
    advantages [B]    one advantage per completion, broadcast to its tokens
    mask      [B, T]  1 on completion tokens through the first EOS
    num_tokens        valid tokens in the whole mini-batch (sum of its mask)
    Returns (loss, stats).
    """
    mask = mask.to(logp.dtype)
    A = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss = token_mean(pg, mask, num_tokens)
    with torch.no_grad():
        clipped = ((ratio > 1 + clip_high) & (A > 0)) | ((ratio < 1 - clip_low) & (A < 0))
        n = mask.sum().clamp(min=1)
        stats = {"clip_frac": (clipped * mask).sum() / n}
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

    # --- models: the policy pi_theta only (DAPO has no KL term, so no reference model) ---
    policy, tokenizer = load_model(str(ckpt) if state else args.model, device, args.trust_remote_code, trainable=True)
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
        # 1. dynamic sampling: P prompts a round, G completions each, scored (reward with the
        #    overlong penalty); groups with mixed outcomes are kept until there are P of them
        sampled = []

        def sample_round():
            rows = [train_rows[i] for i in sampler.take(P)]
            b = generate_rollouts(policy, tokenizer, [r["prompt"] for r in rows], G, args, eos_ids, device)
            b["answers"] = [r["answer"] for r in rows for _ in range(G)]
            b["rewards"], b["correct"], b["parsed"] = reward_fn(b["texts"], b["answers"], b["mask"].sum(1), args.max_new_tokens,
                                                                args.overlong_cache, args.grader_timeout)
            sampled.append(b)
            return b

        batch, ds_info = dynamic_sampling(sample_round, P, G, args.max_gen_rounds)
        t_gen = time.time() - t0

        # 2. group-relative advantage (one value per completion) on the kept groups
        advantages = group_advantages(batch["rewards"], G).to(device)

        # 3. old_logp: the sampling policy, fixed for this batch
        old_logp, old_entropy = batch_logps(policy, batch, args, device)

        # 4. several optimizer steps per rollout batch, over shuffled mini-batches
        policy.train()
        stats = []
        for _ in range(args.ppo_epochs if len(advantages) else 0):  # no kept group: no update
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens = batch["mask"][mini].sum().item()  # token-mean denominator, counted once per mini-batch
                mini_loss = 0.0
                for micro in mini.split(args.micro_batch_size):
                    with autocast(device):
                        logp, _ = token_logps_and_entropy(policy, batch["prompt_ids"][micro], batch["prompt_mask"][micro],
                                                          batch["completion_ids"][micro], batch["mask"][micro], args.temperature)
                    loss, st = dapo_loss(logp, old_logp[micro], advantages[micro], batch["mask"][micro], num_tokens,
                                         args.clip_low, args.clip_high)
                    loss.backward()  # gradients add up over micro-batches to those of the mini-batch
                    mini_loss += loss.item()
                    stats.append({k: v.item() for k, v in st.items()})
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                stats.append({"loss": mini_loss, "grad_norm": grad_norm.item()})
        t_train = time.time() - t0 - t_gen

        # 5. metrics (reward and accuracy over every sampled completion, kept or not), samples, evaluation, checkpoint
        rewards, correct, parsed = (torch.cat([b[k] for b in sampled]) for k in ("rewards", "correct", "parsed"))
        mask = batch["mask"].float()
        n_tokens = max(mask.sum().item(), 1)
        zero_std = (rewards.view(-1, G).std(1) == 0).float().mean().item()
        metrics = {
            "reward": rewards.mean().item(), "accuracy": correct.mean().item(), "unparsable_frac": 1 - parsed.mean().item(),
            "zero_std_frac": zero_std, "entropy": ((old_entropy * mask).sum() / n_tokens).item(),
            "completion_len": mask.sum(1).mean().item(), "truncated_frac": batch["truncated"].float().mean().item(),
            **common.reduce_stats(stats), "lr": scheduler.get_last_lr()[0],
            "kept_groups": ds_info["kept_groups"], "dropped_groups": ds_info["dropped_groups"], "gen_rounds": ds_info["rounds"],
            "time/generate": t_gen, "time/train": t_train, "tokens_per_s": n_tokens / (time.time() - t0),
        }
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch["prompts"], batch["texts"], batch["rewards"])
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
