"""The small utility module the scripts share: what a reader of grpo.py ... sapo.py needs at hand.

Arguments (a dataclass per script, every flag checked before anything loads), seeding and
devices, model names, the optimizer and its guarded step, per-micro-batch statistics and the
seconds of each phase of a step. Nothing here is RL: rollouts, rewards, advantages, losses and
the training loop are written out in each script, on purpose. What the model is asked and how
it is graded lives in tasks.py; the run folder, checkpoints and logging in harness.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
import sys
import time
from html import escape
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
PRESET_NAMES = ("tiny", "cpu", "gpu")
# The flags a --resume may change, because they do not change what is learned.
RESUMABLE = (
    "steps",
    "device",
    "save_every",
    "keep_checkpoints",
    "sample_every",
    "tensorboard",
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


def changed_flags(args, saved, defaults) -> list[str]:
    """The flags given on a --resume (not at their defaults) that differ from the saved run's."""

    def flag(k):
        return "--" + k.replace("_", "-")

    return [
        f"{flag(k)} {getattr(args, k)!r} (the run has {getattr(saved, k)!r})"
        for k in (f.name for f in dataclasses.fields(args))
        if k not in RESUMABLE
        and getattr(args, k) != getattr(defaults, k)
        and getattr(args, k) != getattr(saved, k)
    ]


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


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


# =====================================================================================
# Per-token HTML samples: one self-contained file, no network
# =====================================================================================
def _colour(v: float, lo: float, hi: float) -> str:
    """White at 0; red for positive and blue for negative when the range crosses 0, else orange."""
    if lo < 0 < hi:
        s = v / max(abs(lo), abs(hi)) if v else 0.0
        r, g, b = (
            (255, int(255 * (1 - s)), int(255 * (1 - s)))
            if s > 0
            else (int(255 * (1 + s)),) * 2 + (255,)
        )
    else:
        s = (v - lo) / (hi - lo) if hi > lo else (1.0 if v else 0.0)
        r, g, b = 255, int(255 - 120 * s), int(255 - 255 * s)
    return f"rgb({r},{g},{b})"


def token_html(title: str, rows: list[dict]) -> str:
    """rows: {"header", "prompt", "tokens": [str], "values": {name: [float per token]}}. Each
    token is a <span class="tok"> with data-<name> colours and a title listing every value."""
    names = list(rows[0]["values"]) if rows else []
    every = {n: [v for r in rows for v in r["values"][n]] or [0.0] for n in names}
    ranges = {n: (min(vs), max(vs)) for n, vs in every.items()}
    out = [
        f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        ".tok{font-family:monospace;white-space:pre-wrap;border-radius:2px}"
        ".sample{border:1px solid #ccc;padding:.5em;margin:1em 0}.p{color:#666}</style>",
        f"<h2>{escape(title)}</h2><p>Colour by: <select id='q' onchange='paint()'>",
        *[f"<option>{escape(n)}</option>" for n in names],
        "</select> (hover a token for every value)</p>",
    ]
    for r in rows:
        out.append(
            f"<div class='sample'><b>{escape(r['header'])}</b>"
            f"<div class='p'>{escape(r['prompt'][-200:])}</div><div>"
        )
        for t, tok in enumerate(r["tokens"]):
            vals = {n: r["values"][n][t] for n in names}
            data = " ".join(f"data-{escape(n)}='{_colour(v, *ranges[n])}'" for n, v in vals.items())
            tip = ", ".join(f"{n}={v:.4g}" for n, v in vals.items())
            out.append(f"<span class='tok' {data} title='{escape(tip)}'>{escape(tok)}</span>")
        out.append("</div></div>")
    out.append(
        "<script>function paint(){var q=document.getElementById('q').value;"
        "document.querySelectorAll('.tok').forEach(function(e){"
        "e.style.background=e.getAttribute('data-'+q)||''})}paint()</script>"
    )
    return "\n".join(out)
