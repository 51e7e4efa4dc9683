"""The small utility module the scripts share: what a reader of grpo.py ... sapo.py needs at hand.

The run's flags (a dataclass per script, every flag checked before anything loads) and the
presets that fill those left unset; model names and model folders; seeding and devices; the
optimizer and its guarded step; per-micro-batch statistics and the seconds of each phase of a
step. Nothing here is RL: rollouts, rewards, advantages, losses and the training loop are
written out in each script, on purpose. What the model is asked and how it is graded lives in
tasks.py; the run folder, checkpoints, logging and samples in harness.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import threading
import time
import typing
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TINY_MODEL_DIR = ROOT / "tiny_model"


class UserError(Exception):
    """A problem with what the user asked for. Scripts print it as one line and exit 2."""


def first_line(e: Exception) -> str:
    """The first line of an exception's message, for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# =====================================================================================
# Arguments: a dataclass per script, parsed by transformers' HfArgumentParser, checked up front
# =====================================================================================
ANSWER_EXTRACTIONS = ("boxed", "math_verify")  # what tasks.grade reads as the final answer
PRESET_NAMES = ("tiny", "cpu", "gpu")  # PRESETS' names (below), for --preset
# The flags a --resume may change, because they do not change what is learned.
RESUMABLE = (
    "steps",
    "device",
    "save_every",
    "keep_checkpoints",
    "sample_every",
    "tensorboard",
    "threads",
    "resume",
)


def arg(default, help: str, **metadata):
    """A dataclass field with its --help text: `lr: float = arg(1e-6, "AdamW learning rate")`."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def parse_args(cls, argv=None):
    """The command line as an instance of the dataclass `cls`. Both --max-new-tokens and
    --max_new_tokens work; an unknown flag prints the usage line and one error line, exit 2."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls)
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


@dataclasses.dataclass
class RunArgs:
    """The run's flags, the same in every script; a script's Args adds its algorithm's. A flag
    left at None takes the preset's value (PRESETS, as the script changes them)."""

    # --- model and data ---
    model: str = arg("tiny", "'tiny' (bundled), a hub id, a short Qwen name, or a local folder")
    dataset: str | None = arg(None, "tiny, words, math, dapo-math, a hub id, or a data file")
    problem_column: str | None = arg(None, "column of the problem (default: known, or 'problem')")
    answer_column: str | None = arg(None, "column of the answer (default: known, or 'answer')")
    template: str | None = arg(None, "prompt template: qwen_math, tiny, plain or chat")
    eval_dataset: str | None = arg(None, "held-out set for periodic evaluation, or 'none'")
    answer_extraction: str | None = arg(
        None,
        "final answer: the last \\boxed{}, or math-verify's from free text",
        choices=list(ANSWER_EXTRACTIONS),
    )
    trust_remote_code: bool = arg(False, "allow custom model code from the hub (off unless passed)")
    preset: str = arg(
        "auto",
        "where unset flags take their values: tiny (the bundled model), cpu, "
        "gpu; auto picks by --model and --device",
        choices=["auto", *PRESET_NAMES],
    )
    # --- rollouts ---
    prompts_per_step: int | None = arg(None, "P, prompts per rollout batch")
    group_size: int | None = arg(None, "G, completions sampled per prompt")
    max_new_tokens: int | None = arg(None, "completion length cap")
    max_prompt_tokens: int | None = arg(
        None, "longer prompts are dropped (default: context - max_new_tokens)"
    )
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    top_p: float = arg(1.0, "nucleus sampling; keep 1.0: log-probs describe what was sampled")
    gen_batch_size: int | None = arg(None, "completions per generate() call (default: all)")
    # --- optimisation ---
    steps: int | None = arg(None, "rollout batches to train on")
    lr: float | None = arg(None, "AdamW learning rate")
    warmup_steps: int | None = arg(None, "linear lr warm-up in optimizer steps, then constant")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping")
    num_mini_batches: int | None = arg(None, "optimizer steps per rollout batch (mini-batches)")
    ppo_epochs: int = arg(1, "passes over the rollout batch")
    micro_batch_size: int | None = arg(None, "completions per forward/backward (grads accumulate)")
    optim: str = arg("adamw", "adamw, or adamw8bit (bitsandbytes)", choices=["adamw", "adamw8bit"])
    gradient_checkpointing: bool | None = arg(None, "recompute activations (default: on CUDA)")
    bf16: bool | None = arg(None, "bf16 autocast over fp32 weights (default: on CUDA)")
    # --- LoRA (PEFT) ---
    lora_rank: int | None = arg(
        None,
        "LoRA rank r: adapters on a frozen base; 0 = full "
        "fine-tuning (the tiny and gpu presets'; the cpu preset's is 16)",
    )
    lora_alpha: float = arg(32.0, "LoRA alpha: the adapters' update is scaled by alpha / r")
    lora_target_modules: str = arg(
        "all-linear",
        "modules that get adapters: all-linear (every "
        "linear layer of the blocks) or a list, e.g. q_proj,v_proj",
    )
    # --- run ---
    seed: int = arg(1, "seed for data order, sampling and init")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = arg(
        None, "torch threads (default: OMP_NUM_THREADS when set, else the preset's, else torch's)"
    )
    output_dir: str = arg("runs", "runs are written to <output_dir>/<run_name>/")
    run_name: str | None = arg(None, "default: <algo>-<model>-s<seed>-<date>")
    eval_every: int | None = arg(None, "held-out evaluation every N steps, and first and last")
    eval_n: int | None = arg(None, "held-out problems per evaluation (the same for every seed)")
    save_every: int | None = arg(None, "checkpoint every N steps, and at the end")
    keep_checkpoints: int = arg(2, "checkpoints kept (only the newest keeps the optimizer)")
    sample_every: int = arg(20, "print completions and write samples/step-N.html every N steps")
    grader_timeout: int = arg(5, "seconds allowed per answer parse / comparison")
    tensorboard: bool = arg(True, "also log to TensorBoard when it is installed")
    resume: str | None = arg(
        None,
        "a run folder or checkpoint to continue, in place, with its "
        "saved flags (only "
        + ", ".join(f"--{k.replace('_', '-')}" for k in RESUMABLE[:-1])
        + " may change)",
    )


AT_LEAST_ONE = (
    "prompts_per_step",
    "max_new_tokens",
    "max_prompt_tokens",
    "gen_batch_size",
    "steps",
    "num_mini_batches",
    "ppo_epochs",
    "micro_batch_size",
    "eval_every",
    "eval_n",
    "save_every",
    "keep_checkpoints",
    "sample_every",
    "grader_timeout",
    "threads",
)


def flag(name: str) -> str:
    """The command-line spelling of a dataclass field: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def check_finite(args) -> None:
    """Every float flag must be a finite number: `--lr inf` or `--temperature nan` would pass a
    range check (nan fails every comparison, inf passes `> 0`) and fail later, in a traceback."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        v, types = getattr(args, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if float in types and v is not None and not math.isfinite(v):
            raise UserError(f"{flag(f.name)} must be a finite number, not {v}")


def check_args(args, rules: dict[str, bool] | None = None) -> None:
    """Every flag is checked before anything loads: every float flag for finiteness, the common
    flags here by name; `rules` adds a script's own, as {"message if it fails": condition}."""
    check_finite(args)
    for name in AT_LEAST_ONE:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UserError(f"{flag(name)} must be at least 1, not {v}")
    for name in ("lr", "temperature", "max_grad_norm"):
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            raise UserError(f"{flag(name)} must be > 0, not {v}")
    for name in ("weight_decay", "warmup_steps"):
        v = getattr(args, name, None)
        if v is not None and v < 0:
            raise UserError(f"{flag(name)} must be >= 0, not {v}")
    if getattr(args, "top_p", None) is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], not {args.top_p}")
    if (getattr(args, "lora_rank", 0) or 0) < 0 or getattr(args, "lora_alpha", 1) <= 0:
        raise UserError(
            f"--lora-rank must be >= 0 (0: full fine-tuning) and --lora-alpha > 0, not "
            f"{args.lora_rank} and {args.lora_alpha}"
        )
    if (getattr(args, "lora_rank", 0) or 0) > 0 and importlib.util.find_spec("peft") is None:
        raise UserError("--lora-rank needs peft: pip install peft")
    if getattr(args, "answer_extraction", "boxed") not in ANSWER_EXTRACTIONS:
        raise UserError(
            f"--answer-extraction must be one of {', '.join(ANSWER_EXTRACTIONS)}, not "
            f"{args.answer_extraction!r}"
        )
    for message, ok in (rules or {}).items():
        if not ok:
            raise UserError(message)


# =====================================================================================
# Presets: where a run's unset flags take their values
# =====================================================================================
# Where the flags left unset take their values: tiny, the bundled model; cpu, a real model on a
# CPU (each value's reason: docs/real-models.md); gpu, the real run on one CUDA GPU. These are
# GRPO's; a script changes only what its algorithm needs (presets()). lora_lr replaces lr under
# --lora-rank: about 10x full fine-tuning's for real models (LoRA Without Regret, Thinking Machines
# 2025); 5x for the tiny model (measured: 1e-3 learns, 2e-3 and 5e-3 degrade). overlong_cache,
# the length term in the reward, is reward shaping of ours, no part of any paper's objective: on
# the cpu preset it is on (16), because on a real chat model no script but DAPO learned without it
# and TEPO learned with it (docs/study/PLAN-length.md); off on the tiny and gpu presets. dapo.py's
# reward is built on it and sets its own.
PRESETS = {
    "tiny": dict(
        dataset="tiny",
        template="tiny",
        eval_dataset="tiny",
        answer_extraction="boxed",
        prompts_per_step=16,
        group_size=8,
        max_new_tokens=40,
        steps=160,
        lr=2e-4,
        lora_lr=1e-3,
        warmup_steps=4,
        num_mini_batches=2,
        micro_batch_size=64,
        eval_every=40,
        eval_n=256,
        save_every=80,
        overlong_cache=0,
    ),
    "cpu": dict(
        dataset="words",
        template="chat",
        eval_dataset="words",
        answer_extraction="math_verify",
        lora_rank=16,
        prompts_per_step=4,
        group_size=8,
        max_new_tokens=64,
        steps=60,
        lr=3e-5,
        lora_lr=3e-4,
        warmup_steps=2,
        num_mini_batches=2,
        micro_batch_size=16,
        gen_batch_size=64,
        eval_every=15,
        eval_n=128,
        save_every=15,
        overlong_cache=16,
    ),
    "gpu": dict(
        dataset="math",
        template="qwen_math",
        eval_dataset="math",
        answer_extraction="boxed",
        prompts_per_step=32,
        group_size=8,
        max_new_tokens=3000,
        steps=500,
        lr=1e-6,
        lora_lr=1e-5,
        warmup_steps=10,
        num_mini_batches=4,
        micro_batch_size=4,
        gen_batch_size=64,
        eval_every=50,
        eval_n=500,
        save_every=50,
        overlong_cache=0,
    ),
}


def presets(every: dict | None = None, **changes: dict) -> dict[str, dict]:
    """The house's PRESETS with a script's changes: `every` in all three, or by preset name.

    >>> presets(gpu=dict(num_mini_batches=8))["gpu"]["num_mini_batches"]
    8
    """
    return {
        name: {**base, **(every or {}), **changes.get(name, {})} for name, base in PRESETS.items()
    }


def apply_preset(args, presets: dict[str, dict], cuda: bool) -> None:
    """Fill every field left at None from a script's preset: --preset, or by model and device
    (auto: tiny for the bundled model and checkpoints of it, gpu for another model on CUDA, cpu
    for another model on a CPU). A preset's lora_lr is its lr under --lora-rank."""
    name = args.preset
    if name == "auto":
        name = "tiny" if is_tiny(args.model) else "gpu" if cuda else "cpu"
    if name not in presets:
        raise UserError(f"unknown --preset {args.preset!r}; choose from auto, {', '.join(presets)}")
    args.preset, preset = name, dict(presets[name])
    lora_lr, lora_rank = preset.pop("lora_lr"), preset.pop("lora_rank", 0)
    args.lora_rank = lora_rank if args.lora_rank is None else args.lora_rank
    if args.lora_rank:
        preset["lr"] = lora_lr
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def resolve_run_args(args, algo: str, presets: dict[str, dict], min_group: int = 2) -> None:
    """What every script's resolve_args does first: the preset's values for the flags left unset
    (apply_preset), bf16 and gradient checkpointing by default on CUDA only, the run's name, and
    the batch's shape, checked with every common flag (check_args)."""
    cuda = resolve_device(args.device).type == "cuda"
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if args.threads is None and omp.isdigit() and int(omp) > 0:
        args.threads = int(omp)  # an explicit OMP_NUM_THREADS wins over the preset
    cache_given = args.overlong_cache is not None
    apply_preset(args, presets, cuda)
    if not cache_given and args.overlong_cache >= args.max_new_tokens:  # the preset's is too long
        args.overlong_cache = max(1, args.max_new_tokens // 5)
        print(
            f"--overlong-cache set to {args.overlong_cache}: the preset's exceeds --max-new-tokens"
        )
    if args.threads is None:
        args.threads = torch.get_num_threads()
    args.bf16 = cuda if args.bf16 is None else args.bf16
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = cuda
    if args.run_name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.run_name = f"{algo}-{Path(args.model).name}-s{args.seed}-{stamp}"
    B = args.prompts_per_step * args.group_size
    why = " (a group advantage needs 2 completions)" if min_group == 2 else ""
    group_ok = args.group_size >= min_group
    split_ok = args.num_mini_batches >= 1 and B % args.num_mini_batches == 0
    group_rule = f"--group-size must be at least {min_group}{why}, not {args.group_size}"
    split_rule = (
        f"P*G = {B} completions do not split into {args.num_mini_batches} equal mini-batches"
    )
    check_args(args, {group_rule: group_ok, split_rule: split_ok})


# =====================================================================================
# Model names and folders
# =====================================================================================
# Short names a user can type without the organisation, e.g. `--model Qwen2.5-Math-1.5B`.
HUB_ORGS_BY_PREFIX = {
    "Qwen": "Qwen",
    "DeepSeek": "deepseek-ai",
    "deepseek": "deepseek-ai",
    "Llama": "meta-llama",
    "OLMo": "allenai",
    "SmolLM": "HuggingFaceTB",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


def resolve_model_name(name: str) -> str:
    """'tiny' -> the bundled folder; an existing path -> itself; 'Qwen2.5-Math-1.5B' ->
    'Qwen/Qwen2.5-Math-1.5B'; 'org/name' -> unchanged (a hub id)."""
    if name == "tiny":
        return str(TINY_MODEL_DIR)
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if "/" in name:
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise UserError(f"model folder {name!r} does not exist")
        return name
    for prefix, org in HUB_ORGS_BY_PREFIX.items():
        if name.startswith(prefix):
            return f"{org}/{name}"
    raise UserError(
        f"unknown model {name!r}: give 'tiny', a local folder, a hub id such as "
        f"'Qwen/Qwen2.5-Math-1.5B', or a short Qwen name such as 'Qwen2.5-Math-1.5B'"
    )


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, or None: one HEAD request to it, through
    huggingface_hub's own session (its endpoint, proxies and certificates), with no retries; a
    name lookup that hangs counts as no answer after `timeout` seconds."""
    from huggingface_hub import constants, get_session

    answer = []

    def probe():
        try:
            status = get_session().head(constants.ENDPOINT, timeout=timeout).status_code
            answer.append(None if status < 500 else f"HTTP {status}")
        except Exception as e:  # no route, no name, refused, a proxy's error, a timeout
            answer.append(first_line(e))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"no answer in {timeout:g} s"


def check_hub(name: str) -> None:
    """A hub id loads from the hub, or from the local Hugging Face cache. Offline (HF_HUB_OFFLINE
    or TRANSFORMERS_OFFLINE set) a model not in the cache, or online a hub that cannot be reached,
    is one line at once: huggingface_hub would first retry each file for ~25 s. A hub within reach
    is left to from_pretrained (a name it does not know is its one line)."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not a valid repo id: from_pretrained says so
        cached = False
    if constants.HF_HUB_OFFLINE:
        if not cached:
            on = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(v)]
            names = " and ".join(on or ["HF_HUB_OFFLINE"])
            raise UserError(
                f"cannot load model {name!r}: it is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and downloads are off ({names} set); give a "
                f"local model folder, or unset {names} to download it"
            )
        return
    why = hub_unreachable()
    if why is None:
        return
    then = (
        "it is in the local cache: set HF_HUB_OFFLINE=1 to load it from there"
        if cached
        else "check the connection, or give a local model folder"
    )
    raise UserError(
        f"cannot load model {name!r}: the Hugging Face hub cannot be reached "
        f"({constants.ENDPOINT}: {why}); {then}"
    )


def check_model_folder(path: str) -> None:
    """A local model folder must hold a config (or a LoRA adapter's) and a tokenizer: without its
    tokenizer files (a checkpoint copied without them) transformers loads an empty tokenizer and
    fails deep in generate. Any other name is a hub id, which must be within reach (check_hub)."""
    folder = Path(path)
    if not folder.is_dir():
        check_hub(path)
        return
    if not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise UserError(
            f"model folder {path!r} has no config.json: is it a Hugging Face model folder?"
        )
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(
            f"model folder {path!r} has no tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:2])}, ...): copy them from the model it was "
            f"trained from"
        )


def is_tiny(model_name: str) -> bool:
    """The bundled tiny model, or a checkpoint trained from it (same shapes in config.json):
    both get the tiny presets."""
    path = Path(resolve_model_name(model_name))
    if (path / "adapter_config.json").is_file():  # a LoRA checkpoint: its base decides
        adapter = json.loads((path / "adapter_config.json").read_text())
        path = Path(adapter.get("base_model_name_or_path") or "")
    if path.resolve() == TINY_MODEL_DIR.resolve():
        return True
    ref, cfg = TINY_MODEL_DIR / "config.json", path / "config.json"
    if not (ref.is_file() and cfg.is_file()):
        return False
    a, b = json.loads(ref.read_text()), json.loads(cfg.read_text())
    return all(
        a.get(k) == b.get(k)
        for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
    )


# =====================================================================================
# Seeding and devices
# =====================================================================================
def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for 'cuda' without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            f"--device {name} was asked for, but PyTorch sees no CUDA GPU here "
            f"(torch {torch.__version__}); use --device cpu or auto"
        )
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    return torch.device(name)


# =====================================================================================
# Optimizer: AdamW with linear warm-up then constant lr; a non-finite step is skipped
# =====================================================================================
def make_optimizer(params: list, args):
    if args.optim == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError(
                "--optim adamw8bit needs bitsandbytes: pip install bitsandbytes"
            ) from None
        optimizer = bnb.optim.AdamW8bit(params, lr=args.lr, weight_decay=args.weight_decay)
    elif args.optim == "adamw":
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    else:
        raise UserError(f"unknown --optim {args.optim!r}; use adamw or adamw8bit")
    warmup = max(1, args.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    return optimizer, scheduler


def optimizer_step(optimizer, scheduler, params: list, max_grad_norm: float, loss: float) -> dict:
    """Clip the gradient norm and step, unless the loss or the gradient is NaN or inf: then the
    step is skipped (weights untouched) with a warning, and counted in skipped_updates. Either
    way the gradients are freed: they would otherwise hold weight-sized memory through the next
    generation."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        optimizer.zero_grad(set_to_none=True)
        warn(f"non-finite loss ({loss}) or gradient norm ({grad_norm}): update skipped")
        return {"grad_norm": float("nan"), "skipped_updates": 1, "optimizer_steps": 1}
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "skipped_updates": 0, "optimizer_steps": 1}


# =====================================================================================
# Statistics of a step: averaged over micro-batches, and the seconds of each phase
# =====================================================================================
SUMMED_STATS = ("skipped_updates", "optimizer_steps")


def reduce_stats(rows: list[dict]) -> dict:
    """Average per-micro-batch statistics; keys ending in _min / _max keep the extreme, counts
    add up."""
    out = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        vals = [float(r[k]) for r in rows if k in r]
        if k in SUMMED_STATS:
            out[k] = sum(vals)
        elif k.endswith("_min") or k.endswith("_max"):
            finite = [v for v in vals if math.isfinite(v)] or vals
            out[k] = min(finite) if k.endswith("_min") else max(finite)
        else:
            out[k] = sum(vals) / len(vals)
    return out


class Stopwatch:
    """Seconds of each phase of a step, for the time/<phase> metrics: `lap("generate")` charges
    the time since the previous lap (or the start) to that phase; laps of one phase add up. On
    CUDA it waits for the GPU first, so a phase is charged for its own kernels."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.times[phase] = self.times.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self, tokens: float) -> dict:
        """time/<phase> for each phase, time/step since the start, and the step's tokens/s."""
        step = self._now() - self.start
        return {
            **{f"time/{k}": v for k, v in self.times.items()},
            "time/step": step,
            "tokens_per_s": tokens / step,
        }


def warn(msg: str) -> None:
    """A warning on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(f"warning: {msg}", file=sys.stderr)
