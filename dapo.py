"""DAPO, Decoupled Clip and Dynamic sAmpling Policy Optimization, in one file.

Paper: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, Sec. 3.1-3.4. The objectives of every script in this project, and every
choice we had to make, are explained in docs/objectives.md.

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
3. Token-level loss: every token of the mini-batch weighs the same,
       loss = sum_it l_it m_it / sum_it m_it                  ("token-mean")
   instead of GRPO's mean over sequences of per-sequence means, which lets long wrong
   answers off lightly.
4. Overlong reward shaping: reward +1 right / -1 wrong, plus a penalty that grows linearly
   from 0 to -1 over the last L_cache tokens before the length cap L_max.

Per token:  ratio_it = exp(logp_it - old_logp_it),
            l_it = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i).
The file runs in pipeline order: arguments, model, data,
rollouts, reward, advantage, loss, training loop. Lines marked with an algorithm's name in the
other scripts (e.g. `# TEPO:`) are where they differ from this one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import common
import harness
import tasks
from common import UserError, arg

ALGO = "dapo"


# =====================================================================================
# Arguments
# =====================================================================================
@dataclass
class Args:
    # --- model and data ---
    model: str = arg("tiny", "'tiny' (bundled), a hub id, a short Qwen name, or a local folder")
    dataset: str | None = arg(None, "tiny, words, math, dapo-math, a hub id, or a .jsonl/.json/.parquet file")
    problem_column: str | None = arg(None, "column holding the problem (default: known, else 'problem')")
    answer_column: str | None = arg(None, "column holding the answer (default: known, else 'answer')")
    template: str | None = arg(None, "prompt template: qwen_math, tiny, plain or chat")
    eval_dataset: str | None = arg(None, "held-out set for periodic evaluation, or 'none'")
    answer_extraction: str | None = arg(None, "final answer: the last \\boxed{}, or math-verify's own "
                                        "extraction from free text", choices=list(common.ANSWER_EXTRACTIONS))
    trust_remote_code: bool = arg(False, "allow custom model code from the hub (off unless passed)")
    preset: str = arg("auto", "where unset flags take their values: tiny (the bundled model), cpu (a real model "
                      "on a CPU), gpu (the real run on one GPU); auto picks by --model and --device",
                      choices=["auto", *common.PRESETS])
    # --- rollouts ---
    prompts_per_step: int | None = arg(None, "P, prompts per rollout batch")
    group_size: int | None = arg(None, "G, completions sampled per prompt (at least 2)")
    max_new_tokens: int | None = arg(None, "completion length cap")
    max_prompt_tokens: int | None = arg(None, "longer prompts are dropped (default: context - max_new_tokens)")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    top_p: float = arg(1.0, "nucleus sampling; keep 1.0 so log-probs describe the sampling distribution")
    gen_batch_size: int | None = arg(None, "completions per generate() call (default: all at once)")
    # --- objective ---
    clip_low: float = arg(0.2, "eps_low: the ratio is clipped below at 1 - eps_low")  # DAPO
    clip_high: float = arg(0.28, "eps_high: the ratio is clipped above at 1 + eps_high")  # DAPO
    overlong_cache: int | None = arg(None, "L_cache: the length penalty ramps over the last L_cache "
                                     "tokens before --max-new-tokens")  # DAPO
    max_gen_rounds: int = arg(4, "dynamic sampling: at most this many generation rounds per step")  # DAPO
    # --- optimisation ---
    steps: int | None = arg(None, "rollout batches to train on")
    lr: float | None = arg(None, "AdamW learning rate")
    warmup_steps: int | None = arg(None, "linear lr warm-up in optimizer steps, then constant")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping")
    num_mini_batches: int | None = arg(None, "optimizer steps per rollout batch (shuffled mini-batches)")
    ppo_epochs: int = arg(1, "passes over the rollout batch")
    micro_batch_size: int | None = arg(None, "completions per forward/backward (gradients accumulate)")
    optim: str = arg("adamw", "adamw, or adamw8bit (bitsandbytes)", choices=["adamw", "adamw8bit"])
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the update (default: on CUDA)")
    bf16: bool | None = arg(None, "compute in bf16 autocast over fp32 weights (default: on CUDA)")
    # --- LoRA (PEFT) ---
    lora_rank: int | None = arg(None, "LoRA rank r: train low-rank adapters on a frozen base; 0 = full "
                                "fine-tuning (the tiny and gpu presets' default; the cpu preset's is 16)")
    lora_alpha: float = arg(32.0, "LoRA alpha: the adapters' update is scaled by alpha / r")
    lora_target_modules: str = arg("all-linear", "modules that get an adapter: all-linear (every linear layer "
                                   "of the transformer blocks, MLPs included) or a comma list, e.g. q_proj,v_proj")
    # --- run ---
    seed: int = arg(1, "seed for data order, sampling and init")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    output_dir: str = arg("runs", "runs are written to <output_dir>/<run_name>/")
    run_name: str | None = arg(None, "default: <algo>-<model>-s<seed>-<date>")
    eval_every: int | None = arg(None, "held-out evaluation every N steps, and at the first and last")
    eval_n: int | None = arg(None, "held-out problems per evaluation (the same ones whatever --seed)")
    save_every: int | None = arg(None, "checkpoint every N steps, and at the end")
    keep_checkpoints: int = arg(2, "most recent checkpoints kept (only the newest keeps the optimizer)")
    sample_every: int = arg(20, "print completions and write samples/step-N.html every N steps")
    grader_timeout: int = arg(5, "seconds allowed per answer parse / comparison")
    tensorboard: bool = arg(True, "also log to TensorBoard when it is installed")
    resume: str | None = arg(None, "a run folder or checkpoint to continue from, in place, with its saved "
                             "arguments (only --steps, --device, --save-every, --keep-checkpoints, "
                             "--sample-every and --tensorboard may change)")


# The three presets, picked by --preset or by model and device (common.apply_preset): tiny, the
# bundled model; cpu, a real model on a CPU; gpu, the real run on one CUDA GPU.
# lora_lr replaces lr under --lora-rank: about 10x full fine-tuning's for real models (LoRA Without
# Regret, Thinking Machines 2025); 5x for the tiny model (measured: 1e-3 learns, 2e-3 and 5e-3 degrade).
TINY_DEFAULTS = dict(dataset="tiny", template="tiny", eval_dataset="tiny", answer_extraction="boxed",
                     prompts_per_step=16, group_size=8, overlong_cache=8, max_new_tokens=40, steps=160, lr=2e-4,
                     lora_lr=1e-3, warmup_steps=4, num_mini_batches=2, micro_batch_size=64, eval_every=40, eval_n=256,
                     save_every=80)
# cpu, each value's reason (SmolLM2-135M-Instruct on 2 cores; docs/real-models.md): word problems
# through the chat template, read by math-verify (a task a 135M chat model can start on, offline);
# 64 new tokens (a right answer takes 15-30; at 96 the model rambled to the cap, 82% cut off); 4
# prompts x 8 (32 completions keep a step near 50 s; 8 give a group a chance of one right answer at
# a 6% start); LoRA rank 16 at 3e-4 (10x full's 3e-5; the reference is the adapters switched off, no
# second model); 60 steps, 128 held-out problems every 15 (an hour on 2 cores, ~2 min an evaluation).
CPU_DEFAULTS = dict(dataset="words", template="chat", eval_dataset="words", answer_extraction="math_verify",
                    lora_rank=16, prompts_per_step=4, group_size=8, overlong_cache=16, max_new_tokens=64, steps=60,
                    lr=3e-5, lora_lr=3e-4, warmup_steps=2, num_mini_batches=2, micro_batch_size=16, gen_batch_size=64,
                    eval_every=15, eval_n=128, save_every=15)
REAL_DEFAULTS = dict(dataset="math", template="qwen_math", eval_dataset="math", answer_extraction="boxed",
                     prompts_per_step=16, group_size=16, overlong_cache=600, max_new_tokens=3000, steps=500, lr=1e-6,
                     lora_lr=1e-5, warmup_steps=20, num_mini_batches=4, micro_batch_size=4, gen_batch_size=64,
                     eval_every=50, eval_n=500, save_every=50)


def resolve_args(args: Args) -> Args:
    """Fill every field left at None from the preset that fits the model, then check them all."""
    cache_given = args.overlong_cache is not None  # DAPO
    cuda = common.resolve_device(args.device).type == "cuda"
    common.apply_preset(args, {"tiny": TINY_DEFAULTS, "cpu": CPU_DEFAULTS, "gpu": REAL_DEFAULTS}, cuda)
    args.bf16 = cuda if args.bf16 is None else args.bf16
    args.gradient_checkpointing = cuda if args.gradient_checkpointing is None else args.gradient_checkpointing
    if args.run_name is None:
        args.run_name = f"{ALGO}-{Path(args.model).name}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not cache_given and args.overlong_cache >= args.max_new_tokens:  # DAPO: the preset's L_cache is too long
        args.overlong_cache = max(1, args.max_new_tokens // 5)
        print(f"--overlong-cache set to {args.overlong_cache}: the preset's exceeds --max-new-tokens")
    B = args.prompts_per_step * args.group_size
    common.check_args(args, {
        f"--group-size must be at least 2 (a group advantage needs 2 completions), not {args.group_size}":
            args.group_size >= 2,
        f"P*G = {B} completions do not split into {args.num_mini_batches} equal mini-batches":
            args.num_mini_batches >= 1 and B % args.num_mini_batches == 0,
        f"--clip-low must be in [0, 1), not {args.clip_low}": 0 <= args.clip_low < 1,
        f"--clip-high must be >= 0, not {args.clip_high}": args.clip_high >= 0,
        f"--overlong-cache {args.overlong_cache} must be at least 1 and below --max-new-tokens "
        f"{args.max_new_tokens} (else every completion is penalised)": 1 <= args.overlong_cache < args.max_new_tokens,
        f"--max-gen-rounds must be at least 1, not {args.max_gen_rounds}": args.max_gen_rounds >= 1,
    })
    return args


# =====================================================================================
# Model
# =====================================================================================
def load_tokenizer(name: str, trust_remote_code: bool):
    """The tokenizer (left padding: generation appends on the right) and the context length."""
    path = common.resolve_model_name(name)
    common.check_model_folder(path)  # a config and tokenizer files, or one line saying what is missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # hub errors, missing files: one line, not a deep traceback
        raise UserError(f"cannot load model {name!r} ({path}): {common.first_line(e)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    ctx = getattr(config, "max_position_embeddings", None) or min(tokenizer.model_max_length, 1 << 20)
    return tokenizer, ctx


def load_model(name: str, device: torch.device, args, trainable: bool):
    """fp32 weights for the policy and the reference alike (bf16 weights would round away lr=1e-6
    updates, and would make the reference disagree with the policy at step 0), computed in bf16
    under autocast when --bf16. With --lora-rank the trainable policy is the frozen base plus
    fp32 adapters (add_lora), and the base, never updated, is held in bf16 on CUDA; `name` may
    then be a LoRA checkpoint (adapter_config.json), whose base is --model. Sampling follows this
    script's settings only: the model's own generation_config.json (temperature 0.6, top_k 20,
    ...) is replaced by a neutral one."""
    path = common.resolve_model_name(name)
    adapter = path if (Path(path) / "adapter_config.json").is_file() else None  # a LoRA checkpoint
    base = common.resolve_model_name(args.model) if adapter else path
    dtype = torch.bfloat16 if args.lora_rank and args.bf16 and device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # a truncated safetensors file, a missing folder, a hub error
        raise UserError(f"cannot load model {name!r} ({base}): {common.first_line(e)}") from None
    with torch.no_grad():  # the log-prob pass reads logits as lm_head(last hidden state): a model that
        x = torch.arange(3)[None]  # rescales or soft-caps them after that (Gemma 2, Cohere) must say so
        direct = model.get_output_embeddings()(model.get_decoder()(input_ids=x).last_hidden_state)
        if not torch.allclose(model(input_ids=x).logits, direct, rtol=1e-4, atol=1e-4):
            raise UserError(f"model {name!r} transforms its logits after the output layer (e.g. soft-capping "
                            "or a logit scale), which this script's chunked log-prob pass does not reproduce")
    own = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=own.eos_token_id, pad_token_id=own.pad_token_id,
                                               bos_token_id=own.bos_token_id)
    for m in model.modules():  # no dropout: the ratio must be exactly 1 before the first update
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if trainable and args.gradient_checkpointing:  # only active in train mode, so generate() is not slowed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(trainable)
    if trainable and args.lora_rank:  # LoRA: the base stays frozen, only the adapters learn
        model = add_lora(model, base, args, adapter)
    model.to(device)
    model.train(trainable)
    return model


def add_lora(model, base: str, args, adapter: str | None = None):
    """The model as PEFT's LoRA model: every module in --lora-target-modules gets adapters A (r x in)
    and B (out x r), B = 0 so that the output is exactly the base's before the first update, fp32
    whatever the base's dtype, no adapter dropout (it would make the ratio differ from 1 before
    the first update). `adapter`: a checkpoint's adapters to continue from."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("--lora-rank needs peft: pip install peft") from None
    targets = args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    try:
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        else:
            config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                target_modules=targets, task_type="CAUSAL_LM")
            model = get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # nothing matched, a layer PEFT cannot wrap
        raise UserError(f"cannot add LoRA adapters to {args.model!r} (--lora-target-modules "
                        f"{args.lora_target_modules}): {common.first_line(e)}") from None
    if Path(base).is_dir():  # the checkpoint names its base by full path, so eval.py finds it from anywhere
        model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


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


# =====================================================================================
# Data
# =====================================================================================
def load_prompts(dataset, split, tokenizer, args, max_prompt_tokens, limit=None):
    """Problems with their prompt text; prompts over max_prompt_tokens are dropped and counted.
    --problem-column / --answer-column apply to the training set only."""
    cols = (args.problem_column, args.answer_column) if dataset == args.dataset else (None, None)
    rows = tasks.load_problems(dataset, split, *cols, limit=limit, seed=0)  # seed 0: same subset always
    for r in rows:
        r["prompt"] = tasks.build_prompt(tokenizer, r["problem"], args.template)
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]]
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise UserError(f"every prompt of {dataset!r} is longer than {max_prompt_tokens} tokens "
                        f"(context - max_new_tokens); lower --max-new-tokens")
    if len(kept) < len(rows):
        print(f"dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than {max_prompt_tokens} tokens")
    return kept


def load_data(args, tokenizer, ctx: int):
    """Training and held-out prompts, checked before any model loads (file, columns, non-empty,
    prompt + completion within the model's context)."""
    if args.max_new_tokens >= ctx:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                        f"this model's {ctx}-token context")
    max_prompt = args.max_prompt_tokens or ctx - args.max_new_tokens
    if max_prompt + args.max_new_tokens > ctx:
        raise UserError(f"--max-prompt-tokens {max_prompt} + --max-new-tokens {args.max_new_tokens} "
                        f"exceed this model's {ctx}-token context")
    train_rows = load_prompts(args.dataset, "train", tokenizer, args, max_prompt)
    if args.eval_dataset == "none":
        print("no held-out evaluation (--eval-dataset none)")
        return train_rows, []
    return train_rows, load_prompts(args.eval_dataset, "test", tokenizer, args, max_prompt, limit=args.eval_n)


# =====================================================================================
# Rollouts
# =====================================================================================
def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long: 1 up to and including the first EOS, 0 after. Built by position,
    never by `token != pad`: Qwen base models pad with their EOS, and the EOS must be trained."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # [B, T]
    T = completion_ids.shape[1]
    no_eos = torch.full_like(is_eos[:, 0], T, dtype=torch.long)  # a row without EOS is valid to its end
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)  # [B]: argmax finds the first 1
    positions = torch.arange(T, device=completion_ids.device)[None, :]  # [1, T]
    return (positions <= first_eos[:, None]).long()


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Text of each completion up to its first EOS; whatever generate() padded after it is dropped."""
    return [tokenizer.decode(ids[:n], skip_special_tokens=True)
            for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())]


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: list[str], G: int, args, eos_ids, device) -> dict:
    """Sample G completions per prompt with HF generate (KV cache on); row b belongs to
    prompt b // G. Returns token tensors with the prompt left-padded and the completion masks."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(G, 0).to(device)  # [B, Tp]
    prompt_mask = enc["attention_mask"].repeat_interleave(G, 0).to(device)  # [B, Tp]
    gen_cfg = GenerationConfig(  # every sampling setting written out: nothing may reshape the distribution
        do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens,
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    model.eval()
    chunks, n = [], args.gen_batch_size or len(prompt_ids)
    for i in range(0, len(prompt_ids), n):
        with autocast(args):
            out = model.generate(input_ids=prompt_ids[i:i + n], attention_mask=prompt_mask[i:i + n],
                                 generation_config=gen_cfg)
        chunks.append(out[:, prompt_ids.shape[1]:])
    T = max(c.shape[1] for c in chunks)
    completion_ids = torch.cat([F.pad(c, (0, T - c.shape[1]), value=tokenizer.pad_token_id) for c in chunks])  # [B, T]
    mask = completion_mask(completion_ids, eos_ids)  # [B, T]
    truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)
    texts = decode_completions(tokenizer, completion_ids, mask)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                mask=mask, truncated=truncated, texts=texts, prompts=[p for p in prompts for _ in range(G)])


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


def _logp_entropy_chunk(h, lm_head, ids, temperature, with_entropy, extra):
    """[N, H] hidden states of N positions -> log-prob of each sampled id [N], entropy [N] and
    extra(logits, ids) [N] (both no grad), from logits / temperature."""
    logits = lm_head(h).float() / temperature  # [N, V]
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, ids[:, None]).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else None
        extra_value = extra(logits, ids) if extra is not None else None
    return logp, entropy, extra_value


def token_logps_and_entropy(model, batch, rows, args, with_entropy=True, extra=None, chunk=1024):
    """Log-prob of each completion token [b, T] and the entropy of the full next-token
    distribution [b, T] (no grad; only when asked), both from logits / temperature, the
    distribution that was sampled. Position ids follow the left padding, as in generate.
    The [b, T, V] logits are never built whole: the output layer runs over `chunk` valid
    positions at a time and is recomputed in the backward pass, so memory holds one chunk
    of logits (a 3000-token completion over a 152k vocabulary would be ~2 GB per copy).
    Padded positions are 0 in every output."""
    input_ids, attention_mask, position_ids, T = model_inputs(batch, rows)
    ids, valid = batch["completion_ids"][rows, :T], batch["mask"][rows, :T].bool()  # [b, T']
    with autocast(args):
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids, use_cache=False).last_hidden_state
    h = hidden[:, -T - 1:-1][valid]  # [N, H]: position t predicts completion token t + 1
    lm_head, outs = model.get_output_embeddings(), []
    for i in range(0, len(h), chunk):
        args_i = (h[i:i + chunk], lm_head, ids[valid][i:i + chunk], args.temperature, with_entropy, extra)
        with autocast(args):
            outs.append(checkpoint(_logp_entropy_chunk, *args_i, use_reentrant=False)
                        if torch.is_grad_enabled() else _logp_entropy_chunk(*args_i))

    def scatter(k):  # [N] values at the valid positions -> [b, T], 0 at padding
        if outs and outs[0][k] is None:
            return None
        flat = torch.cat([o[k] for o in outs]) if outs else h.new_zeros(0, dtype=torch.float32)
        full = batch["mask"][rows].bool()  # [b, T]: the trimmed columns are all padding
        return torch.zeros(full.shape, dtype=flat.dtype, device=full.device).masked_scatter(full, flat)
    return scatter(0), scatter(1), scatter(2)


@torch.no_grad()
def batch_logps(model, batch: dict, args, extra=None):
    """No-grad log-probs, entropies (and extra) over the whole batch, micro-batch by micro-batch."""
    model.eval()
    if len(batch["mask"]) == 0:  # DAPO can keep no group at all
        zero = batch["mask"].float()
        return zero, zero, zero if extra is not None else None
    mbs = micro_batches(batch, torch.arange(len(batch["mask"]), device=batch["mask"].device), args.micro_batch_size)
    parts = [token_logps_and_entropy(model, batch, mb, args, extra=extra) for mb in mbs]
    order = torch.cat(mbs).argsort()  # back to the batch's row order

    def joined(k):  # output k of every micro-batch, in the batch's row order ([B, T]), or None
        return torch.cat([p[k] for p in parts])[order] if parts[0][k] is not None else None
    return joined(0), joined(1), joined(2)


# =====================================================================================
# Reward
# =====================================================================================
def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """[B] -> [B], DAPO Sec. 3.4 (soft overlong punishment): 0 up to L_max - L_cache tokens, then
    ((L_max - L_cache) - len) / L_cache, falling linearly to -1 at L_max, and -1 beyond."""
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
    grades = [tasks.grade(t, a, args.grader_timeout, args.answer_extraction) for t, a in zip(texts, answers)]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32)  # [B]
    parsed = torch.tensor([g.parsed for g in grades], dtype=torch.float32)  # [B]
    rewards = 2 * correct - 1 + overlong_penalty(lengths.cpu(), args.max_new_tokens, args.overlong_cache)
    return rewards, correct, parsed


def mixed_groups(correct: torch.Tensor, G: int) -> torch.Tensor:
    """[B] -> [P] bool: True for groups whose completions are neither all right nor all wrong."""
    c = correct.view(-1, G)
    return c.min(1).values != c.max(1).values


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
        kept.append({k: [v[i] for i in rows.tolist()] if isinstance(v, list) else v[rows.to(v.device)]
                     for k, v in b.items()})
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
    the micro-batch loop, so the sum over micro-batches equals the unsplit token-mean. Padding
    is selected away (torch.where), never multiplied by 0, so an inf there cannot become NaN."""
    return torch.where(mask.bool(), l, 0.0).sum() / num_tokens


def dapo_loss(logp, old_logp, advantages, mask, num_tokens, clip_low=0.2, clip_high=0.28):
    """DAPO policy loss (Sec. 3.1 clip-higher, Sec. 3.3 token-level loss; no KL term), aggregated
    token-mean. Copy it with token_mean; it needs nothing but torch.

    logp       [B, T]  log-probs of the sampled tokens under the policy being trained (grad)
    old_logp   [B, T]  the same under the policy that sampled the batch (no grad)
    advantages [B]     one advantage per completion, broadcast to its tokens
    mask       [B, T]  1 on completion tokens through the first EOS
    num_tokens         valid tokens in the whole mini-batch (sum of its mask)

    >>> logp = torch.log(torch.tensor([[0.5, 0.7, 0.5], [0.5, 0.5, 0.5]]))  # o_1: 3 tokens, o_2: 1
    >>> old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))  # token 2 of o_1: ratio 1.4
    >>> A, m = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> round(dapo_loss(logp, old, A, m, num_tokens=4).item(), 4)  # (-1 - 1.28 - 1 + 1) / 4
    -0.57
    """
    A = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    pg = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A)  # clip-higher
    return token_mean(pg, mask, num_tokens)


@torch.no_grad()
def dapo_stats(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28) -> dict:
    """What to watch: the share of tokens whose (asymmetric) clip is active."""
    A, m = advantages[:, None], mask.bool()
    ratio = torch.exp(logp - old_logp)
    clipped = ((ratio > 1 + clip_high) & (A > 0)) | ((ratio < 1 - clip_low) & (A < 0))
    return {"clip_frac": ((clipped & m).sum() / m.sum().clamp(min=1)).item()}


# =====================================================================================
# Evaluation, samples, metrics
# =====================================================================================
@torch.no_grad()
def evaluate(model, tokenizer, problems, args, eos_ids, device) -> dict:
    """Held-out accuracy, greedy and sampled at the training temperature, and the share cut off."""
    out = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        cfg = GenerationConfig(do_sample=sample, temperature=args.temperature if sample else None,
                               top_p=args.top_p if sample else None, top_k=0 if sample else None,
                               max_new_tokens=args.max_new_tokens, eos_token_id=eos_ids,
                               pad_token_id=tokenizer.pad_token_id, use_cache=True)
        correct, cut, n = 0, 0, args.gen_batch_size or 128
        model.eval()
        for i in tqdm(range(0, len(problems), n), desc=f"eval ({name})", leave=False, dynamic_ncols=True):
            chunk = problems[i:i + n]
            enc = tokenizer([p["prompt"] for p in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            with autocast(args):
                ids = model.generate(**enc, generation_config=cfg)[:, enc["input_ids"].shape[1]:]
            texts = decode_completions(tokenizer, ids, completion_mask(ids, eos_ids))
            correct += sum(tasks.grade(t, p["answer"], args.grader_timeout, args.answer_extraction).correct
                           for t, p in zip(texts, chunk))
            cut += (~torch.isin(ids, torch.tensor(eos_ids, device=ids.device)).any(1)).sum().item()
        out[f"eval/{name}_acc"] = correct / len(problems)
        out[f"eval/{name}_truncated_frac"] = cut / len(problems)  # cut off at --max-new-tokens
    return out


def show_samples(step, batch, rewards, k=2):
    tqdm.write(f"--- samples at step {step} ---")
    for p, t, r in list(zip(batch["prompts"], batch["texts"], rewards.tolist()))[:k]:
        tqdm.write(f"[reward {r:+.2f}] {p[-80:]!r} -> {t[:300]!r}")


def rollout_metrics(batch, rewards, correct, parsed, entropy, G) -> dict:
    m = batch["mask"].bool()
    return {"reward": rewards.mean().item(), "accuracy": correct.mean().item(),
            "unparsable_frac": 1 - parsed.mean().item(),
            "zero_std_frac": (rewards.view(-1, G).std(1) == 0).float().mean().item() if len(rewards) else 1.0,
            "entropy": (torch.where(m, entropy, 0.0).sum() / m.sum().clamp(min=1)).item(),
            "completions": len(m), "completion_len": m.sum(1).float().mean().item(),
            "completion_len_max": m.sum(1).max().item() if len(m) else 0,
            "truncated_frac": batch["truncated"].float().mean().item()}


# =====================================================================================
# Training loop
# =====================================================================================
def train(args: Args) -> dict:
    run = harness.Run(args, ALGO, resolve_args)  # run folder, --resume, seeding, logging, Ctrl-C / SIGTERM
    args, device = run.args, run.device
    tokenizer, ctx = load_tokenizer(args.model, args.trust_remote_code)
    train_rows, eval_rows = load_data(args, tokenizer, ctx)  # a bad dataset fails before any model loads
    policy = load_model(run.weights(), device, args, trainable=True)  # pi_theta
    eos_ids = eos_token_ids(policy, tokenizer)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args)
    sampler = tasks.PromptSampler(len(train_rows), args.seed)
    start = run.attach({"": policy}, tokenizer, dict(optimizer=optimizer, scheduler=scheduler, sampler=sampler))
    if start == 0 and eval_rows:
        run.log(0, evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))

    P, G = args.prompts_per_step, args.group_size
    for step in run.steps(start):
        clock = common.Stopwatch(device)  # seconds of each phase, logged as time/<phase>
        # 1. DAPO: dynamic sampling. Rounds of P prompts x G completions, each scored (with the
        #    overlong penalty); groups with mixed outcomes are kept until there are P of them
        sampled = []

        def sample_round():
            rows = [train_rows[i] for i in sampler.take(P)]
            b = generate_rollouts(policy, tokenizer, [r["prompt"] for r in rows], G, args, eos_ids, device)
            clock.lap("generate")
            answers = [r["answer"] for r in rows for _ in range(G)]
            b["rewards"], b["correct"], b["parsed"] = reward_fn(b["texts"], answers, b["mask"].sum(1), args)
            clock.lap("reward")
            sampled.append(b)
            return b

        batch, ds_info = dynamic_sampling(sample_round, P, G, args.max_gen_rounds)

        # 2. The group-relative advantage A_i on the kept groups (one value per completion)
        advantages = group_advantages(batch["rewards"], G).to(device)  # [B]
        run.observe("rollout", batch=batch, correct=batch["correct"], advantages=advantages)  # tools/diagnostics.py
        clock.lap("reward")

        # 3. Log-probs under the sampling policy (fixed for this batch); DAPO: no reference model
        old_logp, old_entropy, _ = batch_logps(policy, batch, args)  # [B, T] each
        clock.lap("old_logp")

        # 4. Updates: the batch is shuffled into num_mini_batches mini-batches, one optimizer step
        #    each; a mini-batch's gradient is accumulated over micro-batches
        policy.train()
        stats = []
        for _ in range(args.ppo_epochs if len(advantages) else 0):  # DAPO: no kept group, no update
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                num_tokens = batch["mask"][mini].sum().item()  # DAPO: token-mean over the mini-batch
                for mb in micro_batches(batch, mini, args.micro_batch_size):
                    logp, _, _ = token_logps_and_entropy(policy, batch, mb, args, with_entropy=False)  # [b, T]
                    loss = dapo_loss(logp, old_logp[mb], advantages[mb], batch["mask"][mb], num_tokens,
                                     args.clip_low, args.clip_high)
                    loss.backward()  # gradients add up over micro-batches to those of the mini-batch
                    loss_sum += loss.item()
                    run.observe("update", rows=mb, logp=logp, old_logp=old_logp[mb])
                    stats.append(dapo_stats(logp, old_logp[mb], advantages[mb], batch["mask"][mb],
                                            args.clip_low, args.clip_high))
                stats.append({"loss": loss_sum,
                              **common.optimizer_step(optimizer, scheduler, params, args.max_grad_norm, loss_sum)})
        clock.lap("update")

        # 5. Metrics (DAPO: reward and accuracy over every sampled completion, kept or not), samples,
        #    held-out evaluation, checkpoint
        rewards, correct, parsed = (torch.cat([b[k] for b in sampled]) for k in ("rewards", "correct", "parsed"))
        metrics = {**rollout_metrics(batch, rewards, correct, parsed, old_entropy, G), **common.reduce_stats(stats),
                   "kept_groups": ds_info["kept_groups"], "dropped_groups": ds_info["dropped_groups"],
                   "gen_rounds": ds_info["rounds"],
                   "lr": scheduler.get_last_lr()[0], **clock.metrics(tokens=batch["mask"].sum().item())}
        if step % args.sample_every == 0 or step == start + 1:
            show_samples(step, batch, batch["rewards"])
            run.write_samples(step, tokenizer, batch, batch["rewards"], advantages, {"entropy": old_entropy})
        if eval_rows and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate(policy, tokenizer, eval_rows, args, eos_ids, device))
        run.end_step(step, metrics)  # log, progress bar, checkpoint when due or when stopped
    return run.finish()


def main(argv=None):
    args = common.parse_args(Args, argv)
    with harness.user_errors():
        return train(args)


if __name__ == "__main__":
    main()
