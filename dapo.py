"""DAPO, Decoupled Clip and Dynamic sAmpling Policy Optimization, in one file.

Paper: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, Sec. 3.1-3.4. Every script's objective, and every choice we had to make, is
explained in docs/objectives.md.

    python dapo.py                            # bundled tiny model + arithmetic, CPU, a few minutes
    python dapo.py --model Qwen2.5-Math-1.5B  # the real run: one CUDA GPU, MATH train split
    python dapo.py --resume runs/<run-name>   # continue a stopped run exactly where it stopped
    python eval.py --model runs/<run-name>/checkpoint-<step>

DAPO is GRPO (grpo.py) with four changes and without the KL term (no reference model):
1. Clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high > eps_low,
   so unlikely tokens with a positive advantage can still grow (keeps entropy up).
2. Dynamic sampling: groups whose completions are all right or all wrong have A = 0 and teach
   nothing; they are dropped and more prompts are sampled until P mixed groups are collected
   (or a round limit is reached).
3. Token-level loss: every token of the mini-batch weighs the same,
       loss = sum_it l_it m_it / sum_it m_it                  ("token-mean")
   instead of GRPO's mean over sequences of per-sequence means, which lets long wrong
   answers off lightly.
4. Overlong reward shaping: reward +1 right / -1 wrong, plus a penalty that grows linearly
   from 0 to -1 over the last L_cache tokens before the length cap L_max.

Per token:  ratio_it = exp(logp_it - old_logp_it),
            l_it = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i).
Below the banner "The skeleton" the file is grpo.py's, line for line; lines marked `# DAPO:`
differ from grpo.py.
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

ALGO = "dapo"


# =====================================================================================
# Arguments: DAPO's own flags (the run's, the same in every script, are common.RunArgs)
# =====================================================================================
@dataclass
class Args(common.RunArgs):
    clip_low: float = arg(0.2, "eps_low: the ratio is clipped below at 1 - eps_low")
    clip_high: float = arg(0.28, "eps_high: the ratio is clipped above at 1 + eps_high")
    overlong_cache: int = arg(
        8,
        "L_cache: the length penalty ramps over the last L_cache tokens before --max-new-tokens "
        "(the cpu preset's: 16, the gpu preset's: 600)",
    )
    max_gen_rounds: int = arg(4, "dynamic sampling: at most this many generation rounds a step")


# DAPO: L_cache by scale; the real run as the paper's, 16 prompts x 16, 20 warm-up steps
PRESETS = common.presets(
    cpu=dict(overlong_cache=16),
    gpu=dict(prompts_per_step=16, group_size=16, overlong_cache=600, warmup_steps=20),
)


def resolve_args(args: Args) -> Args:
    """The preset's value for every flag not passed, then every flag checked."""
    runner.resolve_run_args(args, ALGO, PRESETS)  # the run's flags, the batch's shape
    runner.check_args(
        args,
        {
            f"--clip-low must be in [0, 1), not {args.clip_low}": 0 <= args.clip_low < 1,
            f"--clip-high must be >= 0, not {args.clip_high}": args.clip_high >= 0,
            f"--overlong-cache {args.overlong_cache} must be at least 1 and below --max-new-tokens "
            f"{args.max_new_tokens} (else every completion is penalised)": 1
            <= args.overlong_cache
            < args.max_new_tokens,
            f"--max-gen-rounds must be at least 1, not {args.max_gen_rounds}": args.max_gen_rounds
            >= 1,
        },
    )
    return args


def needs_reference(args: Args) -> bool:
    """DAPO has no KL term: no reference model."""
    return False


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
    """DAPO's reward: +1 if the completion's final answer equals the reference answer, else -1,
    plus the overlong penalty on its length in tokens. The final answer is the content of the
    last \\boxed{} (--answer-extraction math_verify: math-verify finds it in free text instead);
    it is compared with math-verify, gold first, each parse and comparison time-bounded, and
    model text is never executed."""
    grades = [
        common.grade(t, a, args.grader_timeout, args.answer_extraction)
        for t, a in zip(texts, answers)
    ]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)  # [B]
    parsed = torch.tensor([g.parsed for g in grades], dtype=torch.float32)  # [B]
    penalty = overlong_penalty(lengths.cpu(), args.max_new_tokens, args.overlong_cache)  # [B]
    return 2 * correct - 1 + penalty, correct, parsed


def mixed_groups(correct: torch.Tensor, G: int) -> torch.Tensor:
    """[B] -> [P] bool: True for groups whose completions are neither all right nor all wrong."""
    c = correct.view(-1, G)
    return c.min(1).values != c.max(1).values


def _pad_cat(tensors: list[torch.Tensor], value: int, left: bool) -> torch.Tensor:
    T = max(t.shape[1] for t in tensors)
    pads = [(T - t.shape[1], 0) if left else (0, T - t.shape[1]) for t in tensors]
    return torch.cat([F.pad(t, pad, value=value) for t, pad in zip(tensors, pads)])


def dynamic_sampling(sample_round, P: int, G: int, max_rounds: int):
    """Call sample_round() (one generation round: G completions for each of some prompts,
    scored) until P groups with mixed outcomes are kept or max_rounds rounds are spent. Returns
    the kept rows as one batch (exactly P groups, or fewer at the round limit) and counts."""
    kept, n_kept, n_dropped, rounds = [], 0, 0, 0
    while n_kept < P and rounds < max_rounds:
        b = sample_round()
        rounds += 1
        keep_groups = mixed_groups(b["correct"], G)
        n_kept += int(keep_groups.sum())
        n_dropped += int((~keep_groups).sum())
        rows = keep_groups.repeat_interleave(G).nonzero().squeeze(1)
        idx = rows.tolist()
        kept.append(
            {
                k: [v[i] for i in idx] if isinstance(v, list) else v[rows.to(v.device)]
                for k, v in b.items()
            }
        )
    if n_kept < P:
        tqdm.write(
            f"dynamic sampling: stopped at the round limit ({max_rounds}) with {n_kept} "
            f"of {P} mixed groups"
        )
    batch = {}
    for k, v in kept[0].items():
        parts = [b[k] for b in kept]
        if isinstance(v, list):
            batch[k] = sum(parts, [])[: P * G]
        elif v.dim() == 2:  # prompts left-padded, completions right-padded; padding is masked out
            batch[k] = _pad_cat(parts, 0, left=k.startswith("prompt"))[: P * G]
        else:
            batch[k] = torch.cat(parts)[: P * G]
    info = {
        "rounds": rounds,
        "kept_groups": min(n_kept, P),
        "dropped_groups": n_dropped,
        "hit_round_limit": n_kept < P,
    }
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
    the micro-batch loop, so the sum over micro-batches equals the unsplit token-mean. Padding
    is selected away (torch.where), never multiplied by 0, so an inf there cannot become NaN."""
    return torch.where(mask.bool(), l, 0.0).sum() / num_tokens


def dapo_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28, num_tokens=None):
    """DAPO policy loss (Sec. 3.1 clip-higher, Sec. 3.3 token-level loss; no KL term), aggregated
    token-mean. Copy it with token_mean; it needs nothing but torch.

    logp       [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp   [B, T]  the same under the policy that sampled the batch (no grad)
    advantages [B]     one advantage per completion, broadcast to its tokens
    mask       [B, T]  1 on completion tokens through the first EOS
    num_tokens         valid tokens in the whole mini-batch (default: this mask's)

    >>> logp = torch.log(torch.tensor([[0.5, 0.7, 0.5], [0.5, 0.5, 0.5]]))  # o_1: 3 tokens, o_2: 1
    >>> old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))  # o_1, token 2: 1.4
    >>> A, m = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> round(dapo_loss(logp, old, A, m).item(), 4)  # (-1 - 1.28 - 1 + 1) / 4
    -0.57
    """
    A = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A)  # clip-higher
    return token_mean(pg, mask, mask.sum() if num_tokens is None else num_tokens)


@torch.no_grad()
def dapo_stats(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28) -> dict:
    """What to watch: the share of tokens whose (asymmetric) clip is active."""
    A, m = advantages[:, None], mask.bool()
    ratio = torch.exp(logp - old_logp)
    clipped = ((ratio > 1 + clip_high) & (A > 0)) | ((ratio < 1 - clip_low) & (A < 0))
    return {"clip_frac": ((clipped & m).sum() / m.sum().clamp(min=1)).item()}


# =====================================================================================
# Training loop
# =====================================================================================
def train(args: Args) -> dict:
    run = runner.Run(args, ALGO, resolve_args, needs_reference)  # folder, --resume, GPU cost
    args, device = run.args, run.device
    tokenizer, ctx = load_tokenizer(args.model, args.trust_remote_code)
    train_rows, eval_rows = load_data(args, tokenizer, ctx)  # a bad dataset fails before a model
    policy = load_model(run.weights(), device, args, trainable=True)  # pi_theta
    eos_ids = eos_token_ids(policy, tokenizer)  # DAPO: no reference model
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args)
    sampler = common.PromptSampler(train_rows, args.seed, args.dataset)
    state = dict(optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    start = run.attach({"": policy}, tokenizer, state)  # what a checkpoint holds
    if eval_rows and run.eval_due(start):  # step 0, or a step whose evaluation a stop cut short
        run.log(start, evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))

    P, G = args.prompts_per_step, args.group_size
    for step in run.steps(start):
        # 1. DAPO: dynamic sampling. Rounds of P prompts x G completions, each scored (with the
        #    overlong penalty); groups with mixed outcomes are kept until there are P of them
        sampled = []

        def sample_round():
            rows = [train_rows[i] for i in sampler.take(P)]
            prompts = [r["prompt"] for r in rows]
            b = generate_rollouts(policy, tokenizer, prompts, G, args, eos_ids, device)
            answers = [r["answer"] for r in rows for _ in range(G)]
            lengths = b["mask"].sum(1)
            b["rewards"], b["correct"], b["parsed"] = reward_fn(b["texts"], answers, lengths, args)
            sampled.append(b)
            return b

        batch, ds_info = dynamic_sampling(sample_round, P, G, args.max_gen_rounds)

        # 2. The group-relative advantage A_i on the kept groups (one value per completion)
        advantages = group_advantages(batch["rewards"], G).to(device)  # [B]

        # 3. Log-probs under the sampling policy (fixed for this batch); DAPO: no reference model
        old_logp, old_entropy = batch_logps(policy, batch, args)  # [B, T] each

        # 4. Updates: the batch is shuffled into num_mini_batches mini-batches, one optimizer step
        #    each; a mini-batch's gradient is accumulated over micro-batches
        run.updating()  # a stop signal from here waits for the update to end
        policy.train()
        stats = []
        for _ in range(args.ppo_epochs if len(advantages) else 0):  # DAPO: none kept, no update
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                num_tokens = batch["mask"][mini].sum().item()  # DAPO: the mini-batch's tokens
                for mb in micro_batches(batch, mini, args.micro_batch_size):
                    logp = token_logps(policy, batch, mb, args).logp  # [b, T]
                    terms = dict(
                        logp=logp,
                        old_logp=old_logp[mb],
                        advantages=advantages[mb],
                        mask=batch["mask"][mb],
                        clip_low=args.clip_low,
                        clip_high=args.clip_high,
                    )
                    loss = dapo_loss(**terms, num_tokens=num_tokens)
                    loss.backward()  # gradients add up over micro-batches to the mini-batch's
                    loss_sum += loss.item()
                    stats.append(dapo_stats(**terms))
                step_stats = common.optimizer_step(
                    optimizer, scheduler, params, args.max_grad_norm, loss_sum
                )
                stats.append({"loss": loss_sum, **step_stats})

        # 5. Metrics (DAPO: reward and accuracy over every sampled completion, kept or not),
        #    samples, held-out evaluation, checkpoint
        rewards, correct, parsed = (
            torch.cat([b[k] for b in sampled]) for k in ("rewards", "correct", "parsed")
        )
        metrics = {
            **rollout_metrics(batch, rewards, correct, parsed, old_entropy, G),
            **common.reduce_stats(stats),
            "kept_groups": ds_info["kept_groups"],
            "dropped_groups": ds_info["dropped_groups"],
            "gen_rounds": ds_info["rounds"],
            "lr": scheduler.get_last_lr()[0],
        }
        run.updated(metrics)  # the update is done: a stop from here saves this step at once
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch, batch["rewards"])
            run.write_samples(
                step, tokenizer, batch, batch["rewards"], advantages, {"entropy": old_entropy}
            )
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
