"""The run's cost on a GPU, estimated from the model's shapes: memory and time. A run on CUDA
prints it before any model loads (runner.Run calls check_run), and stops in one line when the GPU
cannot hold it; tools/bench.py and tools/gpu_check.py print the same figures.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import UserError, first_line  # noqa: E402
from runner import check_model_folder, resolve_model_name  # noqa: E402

# 80 GB GPUs: memory bandwidth (bytes/s) and dense bf16 FLOP/s, from the data sheets.
GPUS = {"A100 80GB SXM": (2.04e12, 312e12), "H100 80GB SXM": (3.35e12, 989e12)}


def model_shapes(name: str, trust_remote_code: bool = False) -> dict:
    """What the estimates read of a model: its config's shapes and context, and its parameters
    counted on the meta device (nothing is allocated or downloaded but config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_name(name)
    check_model_folder(path)
    try:
        c = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c, trust_remote_code=trust_remote_code)
    except Exception as e:  # hub errors, missing files: one line, not a deep traceback
        raise UserError(f"cannot load model {name!r} ({path}): {first_line(e)}") from None
    heads, hidden = c.num_attention_heads, c.hidden_size
    return dict(
        params=sum(p.numel() for p in model.parameters()),
        embed=c.vocab_size * hidden,
        layers=c.num_hidden_layers,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or hidden // heads,
        hidden=hidden,
        vocab=c.vocab_size,
        heads=heads,
        intermediate=getattr(c, "intermediate_size", None) or 4 * hidden,
        context=getattr(c, "max_position_embeddings", None) or 4096,
    )


def real_run_estimate(
    P: int,
    G: int,
    max_new_tokens: int = 3000,
    gen_batch_size: int = 64,
    mean_completion: int = 600,
    prompt_len: int = 200,
    ref: bool = True,
    critic: bool = False,
    epochs: int = 1,
    launch_s: float = 0.020,
    mfu: float = 0.4,
    bandwidth: float = 2.04e12,
    flops: float = 312e12,
    *,
    model: dict,
) -> dict:
    """Seconds per training step of a real-run preset from the model's shapes: an ESTIMATE, not
    measured on a GPU. Assumptions:
    generation  HF generate() with its dynamic KV cache and no continuous batching: each call of
                gen_batch_size completions decodes max_new_tokens steps (one completion running
                to the cap keeps its whole batch decoding). A decode step costs the larger of
                (a) memory: the bf16 weights read once (autocast caches the cast of the
                    trainable policy's weights), plus the KV cache at the mean context
                    prompt_len + max_new_tokens / 2 read by attention and copied once by the
                    cache's concatenation (read + write), at `bandwidth`;
                (b) launches: launch_s, eager PyTorch's cost per step (~1,100 kernel launches for
                    28 layers at ~15 us, plus the generate loop's Python).
    training    every forward covers the padded rows, prompt_len + max_new_tokens positions per
                completion (rows are padded to the rollout batch's longest completion), at 2 FLOP
                per non-embedding parameter per position, plus the output layer on the
                mean_completion valid positions; passes: old log-probs 1 forward, reference 1,
                update 4 (forward, checkpoint recompute, backward = 2) per epoch, a critic as
                much again; at `mfu` of the GPU's dense bf16 FLOP/s.
    """
    B = P * G
    kv_per_token = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 2  # K, V in bf16
    batch = min(gen_batch_size, B)
    calls = math.ceil(B / batch)
    kv_bytes = batch * (prompt_len + max_new_tokens / 2) * kv_per_token
    memory_s = (2 * model["params"] + 3 * kv_bytes) / bandwidth
    decode_s = max(memory_s, launch_s)
    generate_s = calls * max_new_tokens * decode_s
    body = 2 * (model["params"] - model["embed"])  # FLOP per position, output layer aside
    head = 2 * model["hidden"] * model["vocab"]  # FLOP per valid completion position
    passes = 1 + int(ref) + 4 * epochs + (1 + 4 * epochs if critic else 0)
    train_s = (
        passes
        * (B * (prompt_len + max_new_tokens) * body + B * mean_completion * head)
        / (mfu * flops)
    )
    return {
        "completions": B,
        "generate_calls": calls,
        "decode_step_s": decode_s,
        "memory_step_s": memory_s,
        "generate_s": generate_s,
        "train_s": train_s,
        "step_s": generate_s + train_s,
        "valid_tokens": B * mean_completion,
        "tokens_per_s": B * mean_completion / (generate_s + train_s),
        "decode_tokens_per_s": batch / decode_s,
    }


def lora_params(rank: int, model: dict) -> int:
    """Adapter parameters with --lora-target-modules all-linear: r x (in + out) for each of q, k, v,
    o, gate, up and down in every layer.

    >>> lora_params(1, dict(layers=28, hidden=1536, heads=12, head_dim=128, kv_heads=2,
    ...                     intermediate=8960))  # Qwen2.5-Math-1.5B: 41,216 a layer and rank
    1154048
    """
    h, f = model["hidden"], model["intermediate"]
    q, kv = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]
    return rank * model["layers"] * (2 * (h + q) + 2 * (h + kv) + 3 * (h + f))


def memory_estimate(
    ref: bool,
    lora_rank: int = 0,
    critic: dict | None = None,
    gen_batch_size: int = 64,
    micro_batch_size: int = 4,
    context: int = 4096,
    chunk: int = 1024,
    *,
    model: dict,
) -> dict:
    """GPU memory of a real run, in bytes, from the model's shapes: an ESTIMATE, not measured.
    Full fine-tuning: fp32 weights, fp32 gradients, AdamW's two fp32 moments, the bf16 copies
    autocast caches of the trainable weights, a frozen fp32 reference when `ref`. LoRA: the base
    in bf16 (never updated), fp32 adapters with their gradients and moments, and no reference (the
    policy with its adapters off). Both: the KV cache of one generate() call (bf16 K and V,
    context positions x gen_batch_size rows), one output-layer chunk (chunk positions x vocabulary
    x 16 bytes: fp32 logits, softmax, gradient), checkpointed activations (one bf16 hidden state
    per layer and position of a micro-batch). A critic (SAPO) is fully trained: fp32 weights,
    gradients, moments, autocast copies and activations. Gradients are freed after each optimizer
    step, so generation holds no gradients. Returns the training and generation phases' sums.

    >>> toy = dict(params=10, layers=1, kv_heads=1, head_dim=1, hidden=1, vocab=1, heads=1,
    ...            intermediate=1)
    >>> m = memory_estimate(ref=True, gen_batch_size=1, micro_batch_size=1, context=1, chunk=1,
    ...                     model=toy)
    >>> m["weights"], m["trained"], m["reference"], m["autocast"], m["kv_cache"], m["train"]
    (40, 120, 40, 20, 4, 238)
    """
    P, L, H = model["params"], model["layers"], model["hidden"]
    if lora_rank:
        n = lora_params(lora_rank, model)
        weights, trained, grads, autocast, reference = 2 * P, 16 * n, 4 * n, 0, 0
    else:
        weights, trained, grads, autocast = 4 * P, 12 * P, 4 * P, 2 * P
        reference = 4 * P if ref else 0
    kv = 2 * L * model["kv_heads"] * model["head_dim"] * 2 * context * gen_batch_size
    head = chunk * model["vocab"] * 16
    acts = micro_batch_size * context * L * H * 2
    critic_train = critic_gen = 0
    if critic is not None:
        Pc = critic["params"]
        activations = micro_batch_size * context * critic["layers"] * critic["hidden"] * 2
        critic_train = 18 * Pc + activations
        critic_gen = 16 * Pc  # weights and moments stay while the policy generates
    out = {
        "weights": weights,
        "trained": trained,
        "reference": reference,
        "autocast": autocast,
        "kv_cache": kv,
        "output_chunk": head,
        "activations": acts,
        "critic": critic_train,
    }
    out["train"] = weights + trained + reference + autocast + head + acts + critic_train
    out["generate"] = weights + trained - grads + reference + autocast + kv + critic_gen
    out["peak"] = max(out["train"], out["generate"])
    return out


def gpu_of(name: str) -> str:
    """The GPU of GPUS a device's name names (an H100 is an H100), else an A100."""
    return next((g for g in GPUS if g.split()[0] in name), "A100 80GB SXM")


def run_cost(args, model: dict, critic: dict | None, ref: bool, gpu: str = "A100 80GB SXM"):
    """A run's (memory_estimate, real_run_estimate) from its flags, on a GPU of GPUS: the KV
    cache of --gen-batch-size rows of the longest prompt allowed (--max-prompt-tokens, else the
    model's context less --max-new-tokens, at most 2048) plus --max-new-tokens; `critic`: SAPO's
    critic model's shapes, or None."""
    P, G, new = args.prompts_per_step, args.group_size, args.max_new_tokens
    gen = min(args.gen_batch_size or P * G, P * G)
    prompt = args.max_prompt_tokens or min(model["context"] - new, 2048)
    mb, (bandwidth, flops) = args.micro_batch_size, GPUS[gpu]
    memory = memory_estimate(ref, args.lora_rank, critic, gen, mb, prompt + new, model=model)
    kw = dict(ref=ref, critic=critic is not None, epochs=args.ppo_epochs, model=model)
    return memory, real_run_estimate(P, G, new, gen, bandwidth=bandwidth, flops=flops, **kw)


def check_cost(args, model: dict, critic: dict | None, ref: bool, total: int, name: str) -> None:
    """Print what the run will cost (run_cost, on the GPU gpu_of(name)); a run whose peak is over
    `total` bytes stops in one line naming what would make it fit: --lora-rank 64 and a smaller
    --critic-model while the training phase does not fit, then a smaller --gen-batch-size."""
    gpu = gpu_of(name)
    memory, t = run_cost(args, model, critic, ref, gpu)
    need = memory["peak"]
    print(
        f"estimate: {need / 1e9:.1f} GB of GPU memory (this GPU has {total / 1e9:.1f}); "
        f"{t['step_s'] / 60:.1f} min a step, {args.steps * t['step_s'] / 3600:.0f} h for "
        f"{args.steps} steps on an {gpu} (docs/memory.md, docs/speed.md)"
    )
    if need <= total:
        return
    a, fixes = argparse.Namespace(**vars(args)), []
    a.gen_batch_size = min(a.gen_batch_size or t["completions"], t["completions"])

    def left(phase: str = "peak") -> float:  # bytes to spare with a's flags
        return total - run_cost(a, model, critic, ref)[0][phase]

    if not a.lora_rank and left("train") < 0:
        a.lora_rank = 64
        fixes.append("--lora-rank 64")
    smaller = critic is not None and left("train") < 0
    if smaller:  # what is left for a critic: 18 bytes a parameter (weights, grads, moments, bf16)
        critic = dict(critic, params=0, layers=0)
    if left() < 0:
        while a.gen_batch_size > 1 and left() < 0:
            a.gen_batch_size //= 2
        fixes.append(f"--gen-batch-size {a.gen_batch_size}")
    room = left()
    if smaller:
        size = f"a --critic-model of at most {room / 18e9:.2f} B parameters" if room > 0 else ""
        fixes.append(f"{size or 'the smallest --critic-model'} (the same tokenizer)")
    raise UserError(
        f"this run needs about {need / 1e9:.1f} GB of GPU memory and the GPU has "
        f"{total / 1e9:.1f} GB (an estimate: docs/memory.md); it "
        f"{'would fit' if room > 0 else 'does not fit even'} with {' and '.join(fixes)}"
    )


def check_run(args, ref: bool, device: torch.device) -> None:
    """Before a CUDA run loads its models: print its cost on this GPU, and stop in one line if
    the GPU cannot hold it (check_cost). `ref`: the run loads a reference model."""
    model = model_shapes(args.model, args.trust_remote_code)
    critic = None
    if hasattr(args, "critic_model"):  # SAPO trains a critic: --critic-model, or --model
        critic = model_shapes(args.critic_model or args.model, args.trust_remote_code)
    props = torch.cuda.get_device_properties(device)
    check_cost(args, model, critic, ref, props.total_memory, props.name)
