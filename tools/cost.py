"""The run's cost on a GPU, estimated from the model's shapes: memory and time. A run on CUDA
prints it before any model loads (runner.Run calls check_run), and stops in one line when the GPU
cannot hold it; tools/bench.py and tools/gpu_check.py print the same figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import UserError, first_line  # noqa: E402
import runner  # noqa: E402
from runner import check_model_folder, resolve_model_name  # noqa: E402

# Known GPUs: memory (bytes, as torch reports it), memory bandwidth (bytes/s) and dense bf16
# FLOP/s (FP32 accumulate, no sparsity), from NVIDIA's data sheets: A100 SXM4 80GB and 40GB, H100
# SXM5, GeForce RTX 4090 (Ada whitepaper, Appendix A), A10 (the A10G is AWS's A10), L4.
GPUS = {
    "A100 80GB": (80 * 2**30, 2.039e12, 312e12),
    "A100 40GB": (40 * 2**30, 1.555e12, 312e12),
    "H100 80GB": (80 * 2**30, 3.35e12, 989e12),
    "RTX 4090": (24 * 2**30, 1.008e12, 165.2e12),
    "A10G": (24 * 2**30, 0.6e12, 125e12),
    "L4": (24 * 2**30, 0.3e12, 121e12),
}
FALLBACK_GPU = "A100 80GB"  # whose figures an unknown GPU gets, said so
# The time estimate's constants and where each comes from. tools/gpu_check.py measures the GPU's
# own and writes them to gpu_check.json; `--calibration FILE` puts them in place of these.
CONSTANTS = dict(
    # Counted (torch's TorchDispatchMode, ops that are not views) in one decode step of Qwen2 in
    # the training path: fp32 weights under bf16 autocast, dynamic cache, left-padded prompts,
    # sampling as the run samples; transformers 5.25, torch 2.13, on a CPU (1, 2 and 28 layers):
    ops_per_layer=50,  # a decoder layer's
    ops_per_step=69,  # the rest: embedding, final norm, output layer, masks, sampling, stop check
    lora_ops_per_layer=61,  # what PEFT's all-linear adapters add to a layer
    # Measured on this project's 2-core CPU: a decode step of that 28-layer model at tiny widths,
    # where dispatching the ops from Python is the whole cost, took 21.0 ms for 1,469 ops (best
    # of 5). A GPU adds the launch itself, its host may be faster: taken as the same (assumption).
    host_us_per_op=14.0,
    # Bytes of KV cache moved per decode step, in cache sizes: DynamicCache's torch.cat reads and
    # writes it, attention reads it. transformers >= 5.23 decodes GQA without copying K and V
    # per head (sdpa_attention.py, pack_gqa); 5.22 and older copy them (6x for 12 / 2 heads).
    kv_passes=3,
    mfu=0.4,  # training: the share of the dense bf16 FLOP/s reached (assumption)
    prompt_len=300,  # tokens of a batch's longest prompt, every row padded to it (assumption)
    mean_completion=600,  # tokens a completion has on average (assumption)
)


CONFIGS = ROOT / "tools" / "configs"  # bundled copies of public configs, for offline estimates


def model_shapes(name: str, trust_remote_code: bool = False) -> dict:
    """What the estimates read of a model: its config's shapes and context, and its parameters
    counted on the meta device (nothing is allocated or downloaded but config.json). A hub id
    that is not in the local cache is read from its bundled copy (tools/configs/<name>.json)
    when there is one, without asking the hub; `source` says which was read."""
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_name(name)
    bundled = CONFIGS / f"{Path(path).name}.json"
    use_bundled = False
    if not Path(path).is_dir() and bundled.is_file():
        try:
            use_bundled = not isinstance(try_to_load_from_cache(path, "config.json"), str)
        except Exception:  # not a valid repo id
            use_bundled = True
    if not use_bundled:
        check_model_folder(path)
    try:
        if use_bundled:
            c = AutoConfig.for_model(**json.loads(bundled.read_text()))
        else:
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
        source=f"{bundled.relative_to(ROOT)} (bundled copy)" if use_bundled else path,
    )


def kv_bytes(model: dict) -> int:
    """Bytes of K and V a token holds in the cache, all layers, bf16."""
    return 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 2


def decode_step(rows: int, context: int, model: dict, bandwidth: float, c: dict, lora_rank=0):
    """(host_s, memory_s) of one decode step of `rows` rows with `context` positions cached.
    host: every op of the step dispatched from Python, one after another (HF generate() reads
    the GPU each step to stop, so the host cannot run ahead); memory: the bf16 weights read once
    (autocast's cached casts, or LoRA's bf16 base and its adapters) and the KV cache moved
    kv_passes times, at `bandwidth`. The step costs the larger of the two.

    >>> toy = dict(params=10, layers=2, kv_heads=1, head_dim=1)
    >>> c = dict(CONSTANTS, ops_per_layer=3, ops_per_step=4, host_us_per_op=1e6, kv_passes=3)
    >>> decode_step(rows=2, context=5, model=toy, bandwidth=1.0, c=c)  # 10 ops; 20 + 3 x 80 B
    (10.0, 260.0)
    """
    per_layer = c["ops_per_layer"] + (c["lora_ops_per_layer"] if lora_rank else 0)
    host = (model["layers"] * per_layer + c["ops_per_step"]) * c["host_us_per_op"] * 1e-6
    weights = 2 * (model["params"] + (lora_params(lora_rank, model) if lora_rank else 0))
    memory = (weights + c["kv_passes"] * rows * context * kv_bytes(model)) / bandwidth
    return host, memory


def generate_s(rows: int, new: int, prompt: int, model, bandwidth, c, lora_rank=0) -> float:
    """Seconds of one generate() call of `rows` rows: `new` decode steps (a row that runs to the
    cap keeps its whole call decoding), the cache growing from prompt + 1 to prompt + new positions.

    >>> toy = dict(params=0, layers=1, kv_heads=1, head_dim=1)  # 4 bytes a cached position
    >>> c = dict(CONSTANTS, ops_per_layer=1, ops_per_step=0, host_us_per_op=2e6, kv_passes=1)
    >>> generate_s(1, 3, 0, toy, 2.0, c)  # steps of max(2, 2) + max(2, 4) + max(2, 6) s
    12.0
    """
    return sum(
        max(decode_step(rows, prompt + t, model, bandwidth, c, lora_rank))
        for t in range(1, new + 1)
    )


def completion_lengths(n: int, mean: float, cap: int) -> list[int]:
    """n completion lengths, an assumed spread: the quantiles (k + 1/2) / n of an exponential
    distribution of mean `mean`, capped at `cap`.

    >>> completion_lengths(4, 100, 150)  # -100 ln(1 - q) for q = 1/8, 3/8, 5/8, 7/8
    [13, 47, 98, 150]
    """
    return [min(cap, round(-mean * math.log(1 - (k + 0.5) / n))) for k in range(n)]


def trimmed_positions(lengths: list[int], size: int, prompt: int) -> int:
    """Positions a pass over completions of these lengths runs: sorted by length, in micro-batches
    of `size` rows, each trimmed to its own longest row (micro_batches, model_inputs).

    >>> trimmed_positions([5, 1, 9, 2], size=2, prompt=10)  # (1, 2) -> 2 x 12; (5, 9) -> 2 x 19
    62
    """
    s = sorted(lengths)
    return sum(
        len(s[i : i + size]) * (prompt + max(s[i : i + size])) for i in range(0, len(s), size)
    )


def evaluations(steps: int, every: int) -> int:
    """Held-out evaluations in a run from step 0: before the first step, every `every` steps and
    at the last.

    >>> evaluations(500, 100), evaluations(10, 4)  # 0, 100, ..., 500; 0, 4, 8, 10
    (6, 4)
    """
    return 1 + len({s for s in range(1, steps + 1) if s % every == 0} | {steps})


def time_estimate(args, model: dict, gpu: str, ref: bool, critic: dict | None = None, c=None):
    """A run's seconds by phase on a GPU of GPUS, from its flags and the model's shapes: an
    ESTIMATE, not measured on a GPU, resting on CONSTANTS (or a calibration's `c`).
    generate  each step's P x G completions in calls of --gen-batch-size rows (default: all),
              each call max_new_tokens decode steps (decode_step, generate_s) after a prompt of
              prompt_len positions; DAPO: one sampling round a step.
    train     a forward costs 2 FLOP per non-embedding parameter per position run, the output
              layer 2 x hidden x vocabulary per valid position; positions are those of the
              length-sorted micro-batches each trimmed to its own longest row, completions spread
              as completion_lengths: the no-grad passes (old log-probs, the reference when `ref`)
              over the whole batch, the update over each mini-batch, forward + backward (2, LoRA
              1: no gradient for the frozen base) + the checkpoint's recompute (1); a critic
              (SAPO) as much again at its own size; at mfu of the GPU's dense bf16 FLOP/s.
    eval      evaluations(), each greedy and sampled over --eval-n problems in calls of
              --gen-batch-size rows (default 128), max_new_tokens decode steps each.
    Left out: prefill, grading, the optimizer step, checkpoint saves (each under ~2% here)."""
    c = c or CONSTANTS
    _, bandwidth, flops = GPUS[gpu]
    bandwidth, flops = c.get("bandwidth", bandwidth), c.get("flops", flops)
    B, new, prompt, lora = (
        args.prompts_per_step * args.group_size,
        args.max_new_tokens,
        c["prompt_len"],
        args.lora_rank,
    )
    rows = min(args.gen_batch_size or B, B)

    def sampling(n: int, per_call: int) -> float:  # n completions in calls of per_call rows
        sizes = [min(per_call, n - i) for i in range(0, n, per_call)]
        return sum(generate_s(r, new, prompt, model, bandwidth, c, lora) for r in sizes)

    lengths = completion_lengths(B, c["mean_completion"], new)
    mini = completion_lengths(B // args.num_mini_batches, c["mean_completion"], new)
    mb = args.micro_batch_size
    body, head = 2 * (model["params"] - model["embed"]), 2 * model["hidden"] * model["vocab"]
    valid = sum(lengths)
    no_grad = 1 + int(ref)
    update = 1 + (1 if lora else 2) + int(bool(args.gradient_checkpointing))
    flop = no_grad * (trimmed_positions(lengths, mb, prompt) * body + valid * head)
    flop += (
        update
        * args.ppo_epochs
        * args.num_mini_batches
        * (trimmed_positions(mini, mb, prompt) * body + sum(mini) * head)
    )
    if critic is not None:
        flop *= 1 + critic["params"] / model["params"]
    eval_rows = min(args.gen_batch_size or 128, args.eval_n)
    n_eval = 0 if args.eval_dataset == "none" else evaluations(args.steps, args.eval_every)
    return dict(
        generate_s=args.steps * sampling(B, rows),
        train_s=args.steps * flop / (c["mfu"] * flops),
        eval_s=n_eval * 2 * sampling(args.eval_n, eval_rows),
        gen_rows=rows,
        gen_calls=math.ceil(B / rows),
        decode_step_s=decode_step(rows, prompt + new // 2, model, bandwidth, c, lora),
        evaluations=n_eval,
        eval_rows=eval_rows,
    )


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


def gpu_of(name: str) -> str | None:
    """The GPU of GPUS a device's name (or a name of GPUS) names, else None.

    >>> gpu_of("NVIDIA A100-SXM4-80GB"), gpu_of("NVIDIA GeForce RTX 4090"), gpu_of("NVIDIA L40S")
    ('A100 80GB', 'RTX 4090', None)
    """
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    for gpu in GPUS:
        model, *size = gpu.lower().split()
        if model in words or model.removeprefix("rtx ") in words:
            if not size or size[0] in words or size[0].removesuffix("gb") + "gb" in words:
                return gpu
    for gpu in GPUS:  # a model named without its memory: the table's first of that model
        if gpu.lower().split()[-1 if gpu.startswith("RTX") else 0] in words:
            return gpu
    return None


def run_cost(args, model: dict, critic: dict | None, ref: bool, gpu: str = FALLBACK_GPU, c=None):
    """A run's (memory_estimate, time_estimate) from its flags, on a GPU of GPUS: the KV cache of
    --gen-batch-size rows (default: all) of the longest prompt allowed (--max-prompt-tokens, else
    the model's context less --max-new-tokens, at most 2048) plus --max-new-tokens; `critic`:
    SAPO's critic model's shapes, or None."""
    P, G, new = args.prompts_per_step, args.group_size, args.max_new_tokens
    gen = min(args.gen_batch_size or P * G, P * G)
    prompt = args.max_prompt_tokens or min(model["context"] - new, 2048)
    mb = args.micro_batch_size
    memory = memory_estimate(ref, args.lora_rank, critic, gen, mb, prompt + new, model=model)
    return memory, time_estimate(args, model, gpu, ref, critic, c)


def summary(args, model, critic, ref, gpu: str | None, c=None, name: str = "") -> dict:
    """What tools/cost.py prints (--json): the run's hours by phase, decode step and memory."""
    on = gpu or FALLBACK_GPU
    memory, t = run_cost(args, model, critic, ref, on, c)
    host, mem = t["decode_step_s"]
    hours = {k: t[f"{k}_s"] / 3600 for k in ("generate", "train", "eval")}
    return dict(
        estimate="ESTIMATE, not measured on a GPU (tools/cost.py: CONSTANTS and their sources)",
        gpu=on,
        known_gpu=gpu is not None,
        gpu_note="" if gpu else f"unknown GPU {name!r}: figures for {FALLBACK_GPU}",
        hours=round(sum(hours.values()), 2),
        phases={k: round(v, 2) for k, v in hours.items()},
        steps=args.steps,
        decode_step_ms=round(1e3 * max(host, mem), 1),
        decode_host_ms=round(1e3 * host, 1),
        decode_memory_ms=round(1e3 * mem, 1),
        gen_rows=t["gen_rows"],
        gen_calls=t["gen_calls"],
        evaluations=t["evaluations"],
        eval_rows=t["eval_rows"],
        peak_gb=round(memory["peak"] / 1e9, 1),
        gpu_gb=round(GPUS[on][0] / 1e9, 1),
        constants=dict(c or CONSTANTS),
    )


def estimate_line(s: dict) -> str:
    """One line of summary()'s figures, as a run prints it before it loads."""
    p = s["phases"]
    return (
        f"{s['hours']:.1f} h for {s['steps']} steps on an {s['gpu']} (generate "
        f"{p['generate']:.1f} h in calls of {s['gen_rows']} rows at {s['decode_step_ms']:.0f} ms "
        f"a decode step, train {p['train']:.1f} h, {s['evaluations']} evaluations "
        f"{p['eval']:.1f} h; an estimate: tools/cost.py, docs/speed.md)"
    )


# What a GPU holds of the peak: PyTorch's caching allocator reserves more than it allocates (a KV
# cache grown by torch.cat each step fragments it), and the CUDA context takes its own. Both an
# assumption until tools/gpu_check.py measures max_memory_reserved: 10% and 0.5 GB.
RESERVE, CUDA_CONTEXT = 1.1, 0.5e9


def usable(total: int) -> float:
    """Bytes of a GPU's `total` the estimated peak may take (RESERVE, CUDA_CONTEXT).

    >>> usable(80 * 2**30) / 1e9  # an 80 GB card
    77.6
    """
    return round((total - CUDA_CONTEXT) / RESERVE / 1e8) * 1e8


def fit_gen_rows(args, model, critic, ref, total: int, c=None) -> str:
    """Where the run's peak is over `total` bytes, the user gave no --gen-batch-size and a smaller
    one alone makes it fit: set args.gen_batch_size to the largest halving of P x G that fits,
    and return the line that says so (else "")."""
    B = args.prompts_per_step * args.group_size
    a = argparse.Namespace(**vars(args))
    a.gen_batch_size = min(a.gen_batch_size or B, B)

    def left(phase: str = "peak") -> float:
        return total - run_cost(a, model, critic, ref, c=c)[0][phase]

    if left() >= 0 or "gen_batch_size" in runner.given_flags(args) or left("train") < 0:
        return ""
    while a.gen_batch_size > 1 and left() < 0:
        a.gen_batch_size //= 2
    if left() < 0:
        return ""
    args.gen_batch_size = a.gen_batch_size
    return (
        f"--gen-batch-size set to {a.gen_batch_size}: {B} rows of KV cache in one generate() "
        f"call do not fit this GPU's {total / 1e9:.1f} GB (an estimate: docs/memory.md)"
    )


def check_cost(args, model, critic, ref, total: int, name: str, c=None) -> None:
    """Print what the run will cost (summary, on the GPU gpu_of(name)); a run whose peak is over
    `total` bytes gets a smaller --gen-batch-size, said in one line, when the user gave none and
    that alone makes it fit (fit_gen_rows), else stops in one line naming what would make it
    fit: --lora-rank 64 and a smaller --critic-model while the training phase does not fit,
    then a smaller --gen-batch-size."""
    gpu, shown, total = gpu_of(name), total, usable(total)
    lowered = fit_gen_rows(args, model, critic, ref, total, c)
    if lowered:
        print(lowered)
    memory = run_cost(args, model, critic, ref, gpu or FALLBACK_GPU, c)[0]
    a, fixes = argparse.Namespace(**vars(args)), []
    B = args.prompts_per_step * args.group_size
    a.gen_batch_size = min(a.gen_batch_size or B, B)

    def left(phase: str = "peak") -> float:  # bytes to spare with a's flags
        return total - run_cost(a, model, critic, ref, c=c)[0][phase]

    s = summary(args, model, critic, ref, gpu, c, name)
    need = memory["peak"]
    if s["gpu_note"]:
        print(s["gpu_note"])
    print(
        f"estimate: {need / 1e9:.1f} GB of GPU memory (this GPU has {shown / 1e9:.1f}, "
        f"{total / 1e9:.1f} for the run); " + estimate_line(s)
    )
    if need <= total:
        return
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
        f"{shown / 1e9:.1f} GB, {total / 1e9:.1f} for the run (an estimate: docs/memory.md); it "
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


# =====================================================================================
# python tools/cost.py SCRIPT.py [its flags] --gpu NAME [--json] [--calibration FILE]
# =====================================================================================
def calibration(path: str | None) -> dict:
    """CONSTANTS with those a gpu_check.json measured (its "constants") in their place."""
    if path is None:
        return dict(CONSTANTS)
    try:
        measured = json.loads(Path(path).read_text())["constants"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--calibration {path}: not a gpu_check.json ({first_line(e)})") from None
    unknown = set(measured) - set(CONSTANTS) - {"bandwidth", "flops"}
    if unknown:
        raise UserError(f"--calibration {path}: unknown constants {', '.join(sorted(unknown))}")
    return {**CONSTANTS, **measured}


def script_args(script: str, argv: list[str]):
    """The script's module and its resolved flags as on one CUDA GPU: the gpu preset unless
    --preset is given, bf16 and gradient checkpointing on unless given."""
    path = Path(script)
    if path.suffix != ".py" or not (ROOT / path.name).is_file():
        names = ", ".join(f"{n}.py" for n in ("grpo", "dapo", "tepo", "erpo", "sapo"))
        raise UserError(f"unknown script {script!r}: give one of {names}")
    mod = importlib.import_module(path.stem)
    args = runner.parse_args(mod.Args, argv, mod.__doc__, mod.PRESETS)
    given = runner.given_flags(args)
    if "preset" not in given:
        args.preset = "gpu"
    for k in ("bf16", "gradient_checkpointing"):
        if k not in given:
            setattr(args, k, True)
    args.run_name = args.run_name or "estimate"
    return mod, mod.resolve_args(args)


# The README's table: tepo.py --model Qwen2.5-Math-1.5B on each card (tests/test_cost.py checks it)
CARDS = [
    ("A100 80GB", []),
    ("H100 80GB", []),
    ("H100 80GB", ["--max-new-tokens", "2048"]),
    ("RTX 4090", ["--lora-rank", "64"]),
    ("A10G", ["--lora-rank", "64"]),
    ("L4", ["--lora-rank", "64"]),
]


def card_table(model_name: str = "Qwen2.5-Math-1.5B") -> list[str]:
    """The README's rows: tepo.py's estimate on each card of CARDS, as tools/cost.py prints it."""
    rows = []
    for gpu, flags in CARDS:
        mod, args = script_args("tepo.py", ["--model", model_name, *flags])
        model, ref = model_shapes(args.model), mod.needs_reference(args)
        fit_gen_rows(args, model, None, ref, usable(GPUS[gpu][0]))
        s, p = summary(args, model, None, ref, gpu), None
        p = s["phases"]
        rows.append(
            f"| {gpu} | {' '.join(flags) or '(none)'} | {s['gen_rows']} | "
            f"{s['decode_step_ms']:.0f} | {p['generate']:.1f} | {p['train']:.1f} | "
            f"{p['eval']:.1f} | **{s['hours']:.1f}** | {s['peak_gb']:.1f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="tools/cost.py",
        description="A run's GPU hours and memory, estimated offline from the script's flags "
        "and the model's shapes. Usage: tools/cost.py SCRIPT.py [its flags] --gpu NAME",
    )
    p.add_argument("script", help="grpo.py, dapo.py, tepo.py, erpo.py or sapo.py")
    p.add_argument(
        "--gpu",
        default=FALLBACK_GPU,
        help=f"one of {', '.join(GPUS)}, or a device name (default: {FALLBACK_GPU})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calibration", help="a gpu_check.json: its measured constants instead")
    ours, rest = p.parse_known_args(argv)
    with runner.user_errors():
        c = calibration(ours.calibration)
        mod, args = script_args(ours.script, rest)
        model = model_shapes(args.model, args.trust_remote_code)
        critic = None
        if hasattr(args, "critic_model"):
            critic = model_shapes(args.critic_model or args.model, args.trust_remote_code)
        ref, gpu = mod.needs_reference(args), gpu_of(ours.gpu)
        total = usable(GPUS[gpu or FALLBACK_GPU][0])
        lowered = fit_gen_rows(args, model, critic, ref, total, c)
        s = summary(args, model, critic, ref, gpu, c, ours.gpu)
        s["gen_rows_note"], s["usable_gb"] = lowered, total / 1e9
        s["script"], s["model"], s["model_config"] = mod.ALGO, args.model, model["source"]
        if ours.json:
            print(json.dumps(s, indent=2))
            return 0
        for note in (s["gpu_note"], lowered):
            if note:
                print(note)
        fits = "fits" if s["peak_gb"] <= total / 1e9 else "does NOT fit"
        print(
            f"{ours.script} on one {s['gpu']}, an ESTIMATE, not measured: {estimate_line(s)}; "
            f"peak {s['peak_gb']:.1f} GB of GPU memory ({fits} the {total / 1e9:.1f} of its "
            f"{s['gpu_gb']:.1f} GB a run may take)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
