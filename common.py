"""Plumbing shared by grpo.py, dapo.py, tepo.py, erpo.py, sapo.py and eval.py. Nothing here is RL.

What lives here, and only this: argument parsing and checks, the bundled tiny model's location
and its arithmetic task, prompt templates, dataset loading, the grading machinery (math-verify
behind a time bound), the run folder (resume, Ctrl-C / SIGTERM, atomic checkpoints, logging,
the progress bar, per-token HTML samples), the optimizer step, prompt sampling and seeding.
Everything that teaches an RL algorithm (rollouts, rewards, advantages, losses, the training
loop) is written out in each algorithm script instead, on purpose.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import zlib
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
def arg(default, help: str, **metadata):
    """A dataclass field with its --help text: `lr: float = arg(1e-6, "AdamW learning rate")`."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def parse_args(cls, argv=None):
    """The command line as an instance of the dataclass `cls`. Both --max-new-tokens and
    --max_new_tokens work; an unknown flag prints the usage line and exits 2."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls)
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


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


def check_args(args, rules: dict[str, bool] | None = None) -> None:
    """Every flag is checked before anything loads. The common flags are checked here by name;
    `rules` adds a script's own, as {"message if it fails": condition}."""

    def flag(name):
        return "--" + name.replace("_", "-")

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
    if getattr(args, "answer_extraction", "boxed") not in ANSWER_EXTRACTIONS:
        raise UserError(f"--answer-extraction must be one of {', '.join(ANSWER_EXTRACTIONS)}")
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


# =====================================================================================
# Model names
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


def is_tiny(model_name: str) -> bool:
    """The bundled tiny model, or a checkpoint trained from it (same shapes in config.json):
    both get the tiny presets."""
    path = Path(resolve_model_name(model_name))
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
# The bundled tiny task: short multi-step arithmetic ending in \boxed{}
# =====================================================================================
TINY_MAX_OPERAND = 9


def tiny_example(a: int, o1: str, b: int, o2: str, c: int) -> dict:
    """'7+5-8' -> steps '7+5=12', '12-8=4', then '\\boxed{4}' (left to right)."""
    s1 = a + b if o1 == "+" else a - b
    s2 = s1 + c if o2 == "+" else s1 - c
    problem = f"{a}{o1}{b}{o2}{c}"
    solution = f"{a}{o1}{b}={s1}\n{s1}{o2}{c}={s2}\n\\boxed{{{s2}}}"
    return {"problem": problem, "solution": solution, "answer": str(s2)}


def tiny_is_heldout(problem: str) -> bool:
    """A fixed hash of the problem text decides its split, so train and held-out are disjoint."""
    return zlib.crc32(problem.encode()) % 8 == 0


def tiny_task(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Up to n problems of one split ('train': 3500 in all, 'test': 500), shuffled by seed."""
    if split not in ("train", "test"):
        raise UserError(f"the tiny task has splits 'train' and 'test', not {split!r}")
    r = range(TINY_MAX_OPERAND + 1)
    every = [
        tiny_example(a, o1, b, o2, c) for a in r for o1 in "+-" for b in r for o2 in "+-" for c in r
    ]
    out = [e for e in every if tiny_is_heldout(e["problem"]) == (split == "test")]
    random.Random(f"tiny-{split}-{seed}").shuffle(out)
    return out[:n]


# =====================================================================================
# Prompt templates
# =====================================================================================
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("qwen_math", "tiny", "plain")


def build_prompt(tokenizer, problem: str, template: str) -> str:
    """Text of the prompt. qwen_math: the Qwen2.5-Math system prompt through the chat
    template (as in the Dr. GRPO and Qwen harnesses); tiny: the bare problem as a user turn;
    plain: the problem text followed by the qwen_math instruction, no chat template."""
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    if template == "qwen_math":
        if not has_chat:
            return f"{problem}\n{QWEN_MATH_SYSTEM}\n"
        msgs = [
            {"role": "system", "content": QWEN_MATH_SYSTEM},
            {"role": "user", "content": problem},
        ]
    elif template == "tiny":
        if not has_chat:
            return f"{problem}\n"
        msgs = [{"role": "user", "content": problem}]
    elif template == "plain":
        return f"{problem}\n{QWEN_MATH_SYSTEM}\n"
    else:
        raise UserError(f"unknown --template {template!r}; choose from {', '.join(TEMPLATES)}")
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# =====================================================================================
# Datasets
# =====================================================================================
# Short name -> (hub id, config, problem column, answer column, answer is a full solution
# whose last \boxed{} holds the answer)
HUB_DATASETS = {
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "problem", "solution", True),
    "dapo-math": ("open-r1/DAPO-Math-17k-Processed", "en", "prompt", "solution", False),
}
for _short, _spec in list(HUB_DATASETS.items()):
    HUB_DATASETS[_spec[0]] = _spec  # the full hub id works too


def load_problems(
    dataset: str,
    split: str = "train",
    problem_column: str | None = None,
    answer_column: str | None = None,
    answer_from_boxed: bool | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[dict]:
    """A list of {'problem', 'answer'} from: 'tiny' (generated), a short name or hub id in
    HUB_DATASETS, any other hub id, or a local .jsonl/.json/.parquet file."""
    if dataset == "tiny":
        return [
            {"problem": e["problem"], "answer": e["answer"]} for e in tiny_task(split, limit, seed)
        ]
    import datasets as hf_datasets  # heavy import, only when needed

    config, boxed = None, False
    p_col, a_col = "problem", "answer"
    if dataset in HUB_DATASETS:
        hub_id, config, p_col, a_col, boxed = HUB_DATASETS[dataset]
    p_col, a_col = problem_column or p_col, answer_column or a_col
    boxed = boxed if answer_from_boxed is None else answer_from_boxed
    path = Path(dataset).expanduser()
    try:
        if path.suffix in (".jsonl", ".json", ".parquet"):
            if not path.is_file():
                raise UserError(f"dataset file {dataset!r} does not exist")
            if path.stat().st_size == 0 or (
                path.suffix != ".parquet" and not path.read_text().strip()
            ):
                raise UserError(f"dataset file {dataset!r} is empty")
            kind = "parquet" if path.suffix == ".parquet" else "json"
            ds = hf_datasets.load_dataset(kind, data_files=str(path), split="train")
        elif path.exists():
            raise UserError(f"dataset {dataset!r}: expected a .jsonl, .json or .parquet file")
        else:
            hub_id = HUB_DATASETS[dataset][0] if dataset in HUB_DATASETS else dataset
            ds = hf_datasets.load_dataset(hub_id, config, split=split)
    except UserError:
        raise
    except Exception as e:  # hub errors, bad files: one line, not a deep traceback
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load dataset {dataset!r} (split {split!r}): {msg}") from None
    missing = [c for c in (p_col, a_col) if c not in ds.column_names]
    if missing:
        raise UserError(
            f"dataset {dataset!r} has no column {missing[0]!r} (columns: "
            f"{', '.join(ds.column_names)}); set --problem-column / --answer-column"
        )
    rows, dropped = [], 0
    for p, a in zip(ds[p_col], ds[a_col]):
        if a is not None:  # a null answer must not be graded as the text "None"
            a = last_boxed(str(a)) if boxed else str(a).strip()
        if p and a:
            rows.append({"problem": str(p), "answer": a})
        else:
            dropped += 1
    if not rows:
        raise UserError(f"dataset {dataset!r} has no rows with both a problem and an answer")
    if dropped:
        print(
            f"{dataset}: dropped {dropped} of {len(rows) + dropped} rows with no problem or no answer"
        )
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    return rows


class PromptSampler:
    """Endless shuffled passes over a list of problems; its state saves and restores exactly."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        idx = list(range(self.n))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(idx)
        return idx

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append(self._perm[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation()


# =====================================================================================
# Grading machinery: math-verify behind a time bound, never executing model text.
# What the reward *means* is written out in each script's reward_fn.
# =====================================================================================
def boxed_answers(text: str) -> list[str]:
    """Contents of every \\boxed{...} (or \\fbox{...}) in order, braces matched; unclosed ones skipped."""
    out, pos = [], 0
    while True:
        starts = [i for i in (text.find("\\boxed{", pos), text.find("\\fbox{", pos)) if i >= 0]
        if not starts:
            return out
        i = text.index("{", min(starts)) + 1
        depth, j = 1, i
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            out.append(text[i : j - 1].strip())
        pos = i


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces matched; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
        j += 1
    return None  # unclosed box


_INT = re.compile(r"-?\d{1,30}")
MAX_ANSWER_CHARS = 1000  # longer "answers" are refused before any parsing
MAX_TEXT_CHARS = 20000  # math_verify extraction reads at most the last this many characters
MAX_BOXES = 10  # an answer spread over more boxes than this is not joined
ANSWER_EXTRACTIONS = ("boxed", "math_verify")


@dataclasses.dataclass
class Grade:
    correct: bool
    parsed: bool  # False when no answer could be extracted or parsed
    pred: str | None


def _verify_latex(
    gold: str, pred: str, timeout_s: int, free_text: bool = False
) -> tuple[bool, bool]:
    """math-verify on `pred`, read as the content of a box, or (free_text) as a whole completion
    whose final answer math-verify finds itself."""
    from math_verify import parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)
    pred_parsed = parse(pred if free_text else f"\\boxed{{{pred}}}", parsing_timeout=timeout_s)
    if not pred_parsed:
        return False, False
    if not gold_parsed:
        return False, True
    # gold first: math-verify's comparison is deliberately asymmetric
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s)), True


_POOL: concurrent.futures.ProcessPoolExecutor | None = None


@atexit.register
def _close_pool() -> None:
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)


def _verify_in_subprocess(
    gold: str, pred: str, timeout_s: int, free_text: bool
) -> tuple[bool, bool]:
    """Off the main thread SIGALRM cannot interrupt math-verify, so a worker process runs it
    and is killed if it overruns."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ProcessPoolExecutor(max_workers=1)
    fut = _POOL.submit(_verify_latex, gold, pred, 0, free_text)  # 0: no alarm inside the worker
    try:
        return fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        for p in list(getattr(_POOL, "_processes", {}).values()):
            p.kill()
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None
        return False, True


def math_equal(
    gold: str, pred: str, timeout_s: int = 5, free_text: bool = False
) -> tuple[bool, bool]:
    """(correct, parsed): math_verify.verify(gold, pred), bounded to about `timeout_s` seconds per
    parse and per comparison wherever it runs. Plain integers on both sides are compared
    directly (math-verify gives the same verdict, 1000x faster)."""
    if not free_text and _INT.fullmatch(pred) and _INT.fullmatch(gold.strip()):
        return int(pred) == int(gold.strip()), True
    try:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM"):
            return _verify_latex(gold, pred, timeout_s, free_text)
        return _verify_in_subprocess(gold, pred, timeout_s, free_text)
    except Exception:  # math-verify raises on some malformed input: a wrong answer, not a crash
        return False, False


def grade(completion: str, gold: str, timeout_s: int = 5, extraction: str = "boxed") -> Grade:
    """Is the completion's final answer equal to `gold`?
    boxed: the last \\boxed{}; when it is wrong and the completion has several boxes, their
    contents joined by ", " (an answer given as \\boxed{(2, 2)} and \\boxed{(6, 2)}), so a
    self-correction (\\boxed{5} ... no, \\boxed{7}) still counts only its last box.
    math_verify: math-verify's own extraction of the final answer from the text ("The answer
    is: 42", "#### 42"), for models that do not box their answers."""
    if extraction == "math_verify":
        correct, parsed = math_equal(gold, completion[-MAX_TEXT_CHARS:], timeout_s, free_text=True)
        return Grade(correct, parsed, None)
    boxes = boxed_answers(completion)
    pred = last_boxed(completion)
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return Grade(False, False, pred)
    correct, parsed = math_equal(gold, pred, timeout_s)
    if not correct and 1 < len(boxes) <= MAX_BOXES and boxes[-1] == pred:
        joined = ", ".join(boxes)
        if len(joined) <= MAX_ANSWER_CHARS:
            correct = math_equal(gold, joined, timeout_s)[0]
            pred = joined if correct else pred
    return Grade(correct, parsed, pred)


# =====================================================================================
# Logging
# =====================================================================================
def _json_value(v):
    """Strict JSON, and no rounding to 0: floats keep 6 significant digits; NaN and inf become null."""
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    return v


class RunLogger:
    """Metrics to runs/<name>/metrics.jsonl always, and to TensorBoard when it is installed."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # tensorboard not installed
                self.tb = None

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: _json_value(v) for k, v in metrics.items()})
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


SUMMED_STATS = ("skipped_updates",)


def reduce_stats(rows: list[dict]) -> dict:
    """Average per-micro-batch statistics; keys ending in _min / _max keep the extreme, counts add up."""
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


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    step is skipped (weights untouched) with a warning, and counted in skipped_updates."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        optimizer.zero_grad(set_to_none=True)
        warn(f"non-finite loss ({loss}) or gradient norm ({grad_norm}): update skipped")
        return {"grad_norm": float("nan"), "skipped_updates": 1}
    optimizer.step()
    scheduler.step()
    return {"grad_norm": grad_norm, "skipped_updates": 0}


def _write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg)


def warn(msg: str) -> None:
    """A warning on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(f"warning: {msg}", file=sys.stderr)


# =====================================================================================
# Checkpoints: written to a temporary folder, renamed into place, then pointed to
# =====================================================================================
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


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # not supported on every filesystem


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-")[-1])
    except ValueError:
        return -1


def save_checkpoint(
    run_dir: Path,
    step: int,
    models: dict,
    tokenizer,
    trainer_state: dict,
    optimizer_state: dict | None = None,
    keep: int = 2,
) -> Path:
    """runs/<name>/checkpoint-<step>/: the policy as save_pretrained (safetensors, loadable by
    from_pretrained and eval.py) with its tokenizer; other models (a critic) in subfolders named
    by their key in `models` ("" is the folder itself); trainer_state.pt (step, RNG, sampler,
    scheduler, args); optimizer.pt, which only the newest checkpoint keeps (it is 2x the
    weights). A kill at any moment leaves a complete checkpoint that `latest` points to."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"checkpoint-{step}", run_dir / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, model in models.items():
        model.save_pretrained(tmp / name, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(
        trainer_state, tmp / "trainer_state.pt"
    )  # written last: its presence marks a whole folder
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    trash = run_dir / f".trash-checkpoint-{step}"
    if final.exists():  # re-saving a step: move the old folder aside, never delete it first
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync(run_dir)
    pointer = run_dir / ".latest.tmp"
    with open(pointer, "w") as fh:
        fh.write(final.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer, run_dir / "latest")  # the pointer moves only once the folder is whole
    _fsync(run_dir)
    shutil.rmtree(trash, ignore_errors=True)
    ckpts = sorted(run_dir.glob("checkpoint-*"), key=_step_of)
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for old in ckpts[-keep:-1] if keep > 1 else []:
        (old / "optimizer.pt").unlink(missing_ok=True)  # only the newest keeps the optimizer
    return final


def clean_leftovers(run_dir: Path) -> None:
    """After a kill: drop half-written folders; put back an old folder a re-save had moved aside."""
    run_dir = Path(run_dir)
    for tmp in run_dir.glob(".tmp-checkpoint-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for trash in run_dir.glob(".trash-checkpoint-*"):
        final = run_dir / trash.name.replace(".trash-", "")
        if final.exists():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(trash, final)
    (run_dir / ".latest.tmp").unlink(missing_ok=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder whose `latest` file names one (or, if that one is
    gone, the newest whole checkpoint in it)."""
    path = Path(path)
    if (path / "latest").is_file():
        target = path / (path / "latest").read_text().strip()
        if not (target / "trainer_state.pt").is_file():
            whole = [p for p in path.glob("checkpoint-*") if (p / "trainer_state.pt").is_file()]
            target = max(whole, key=_step_of) if whole else target
        path = target
    if not (path / "trainer_state.pt").is_file():
        raise UserError(
            f"no checkpoint at {str(path)!r} (expected a run folder with a 'latest' "
            f"file, or a checkpoint-N folder with trainer_state.pt)"
        )
    return path


def load_trainer_state(ckpt: Path, name: str = "trainer_state.pt") -> dict:
    try:
        return torch.load(Path(ckpt) / name, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"checkpoint {str(ckpt)!r} is unreadable ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'corrupt file'})"
        ) from None


# =====================================================================================
# The run: folder, --resume, Ctrl-C / SIGTERM, progress bar, checkpoints, summary
# =====================================================================================
BAR_FIGURES = {
    "reward": "reward",
    "accuracy": "acc",
    "kl": "kl",
    "entropy": "ent",
    "completion_len": "len",
    "tokens_per_s": "tok/s",
}
STALL_STEPS = 5  # steps in a row with (almost) no learning signal before a warning
_ACTIVE_RUNS: list = []


def started(run_dir: Path) -> bool:
    """Has a run already logged or saved something in this folder? (A start that failed before its
    first step leaves only args.json, and may be retried in place.)"""
    metrics = run_dir / "metrics.jsonl"
    return ((metrics.is_file() and metrics.stat().st_size > 0) or (run_dir / "latest").exists()
            or any(run_dir.glob("checkpoint-*")))


class Run:
    """Everything about a training run that is not RL, behind a few calls:

        run = Run(args, "grpo", resolve_args)     # folder, --resume, seeding, signals, logging
        start = run.attach(models=..., tokenizer=..., state=...)  # what a checkpoint holds
        for step in run.steps(start): ...; run.end_step(step, metrics)  # log, bar, save, stop
        return run.finish()                        # summary.json and the closing lines

    A new run refuses an existing folder; --resume DIR continues in DIR itself with the saved
    arguments (only `overridable` ones may change), cuts metrics.jsonl back to the checkpoint's
    step, and cleans what a kill left behind. The first Ctrl-C or SIGTERM finishes the step,
    saves, and exits (130 / 143); a second Ctrl-C stops at once."""

    def __init__(self, args, algo: str, resolve, overridable=("steps", "device", "resume")):
        self.algo, self.ckpt, self.state = algo, None, None
        if args.resume:
            self.ckpt = find_checkpoint(args.resume)
            self.state = load_trainer_state(self.ckpt)
            try:
                saved = type(args)(**self.state["args"])
            except (TypeError, KeyError):
                raise UserError(
                    f"checkpoint {str(self.ckpt)!r} was not written by {algo}.py "
                    f"(its arguments differ)"
                ) from None
            for k in overridable:
                if getattr(args, k) is not None:
                    setattr(saved, k, getattr(args, k))
            self.dir = self.ckpt.parent  # resume writes where it was pointed, even in a copied run
            saved.output_dir, saved.run_name = str(self.dir.parent), self.dir.name
            args = saved
        self.args = args = resolve(args)
        self.device = resolve_device(args.device)
        if self.ckpt is None:
            self.dir = Path(args.output_dir) / args.run_name
            if started(self.dir):
                raise UserError(f"run folder {str(self.dir)!r} already exists: continue it with "
                                f"--resume {self.dir}, or pick another --run-name")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UserError(
                f"cannot write the run folder {str(self.dir)!r}: {e.strerror or e}"
            ) from None
        if self.ckpt is None:
            (self.dir / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        else:
            clean_leftovers(self.dir)
            self._cut_metrics(self.state["step"])
        seed_everything(args.seed)
        self.logger = RunLogger(self.dir, args.tensorboard)
        self.stop_signal, self.bar, self.last_metrics, self._stalled = None, None, None, 0
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        _ACTIVE_RUNS.append(self)

    # --- resume ---------------------------------------------------------------------
    def weights(self, name: str = "", default: str | None = None) -> str:
        """Where to load model `name` from: the checkpoint being resumed, else `default`."""
        if self.ckpt is not None:
            return str(self.ckpt / name)
        return default if default is not None else self.args.model

    def attach(self, models: dict, tokenizer, state: dict) -> int:
        """Register what a checkpoint holds (models by subfolder, "" for the policy; objects with
        state_dict / load_state_dict, those named *optimizer* kept only in the newest checkpoint).
        On --resume load their saved state and the RNG. Returns the step to start after."""
        self.models, self.tokenizer, self.stateful = models, tokenizer, state
        if self.state is None:
            return 0
        opt_file = self.ckpt / "optimizer.pt"
        opt_state = load_trainer_state(self.ckpt, "optimizer.pt") if opt_file.is_file() else None
        for k, obj in state.items():
            if "optimizer" in k:
                if opt_state is None:
                    warn(
                        f"{self.ckpt.name} keeps no optimizer state (only the newest "
                        f"checkpoint does): AdamW moments start from zero"
                    )
                else:
                    obj.load_state_dict(opt_state[k])
            else:
                obj.load_state_dict(self.state[k])
        set_rng_state(self.state["rng"])
        print(f"resumed {self.dir} from {self.ckpt.name} at step {self.state['step']}")
        return self.state["step"]

    def _cut_metrics(self, step: int) -> None:
        """Rows logged after the checkpoint (a crash between saves) would be logged again."""
        path = self.dir / "metrics.jsonl"
        if path.is_file():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)

    # --- the loop ---------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        _write(f"{name}: finishing this step, then saving a checkpoint (Ctrl-C again to abort)")

    def steps(self, start: int):
        from tqdm import tqdm

        self.bar = tqdm(
            range(start + 1, self.args.steps + 1),
            initial=start,
            total=self.args.steps,
            desc=self.algo,
            dynamic_ncols=True,
        )
        return self.bar

    def log(self, step: int, metrics: dict) -> None:
        self.logger.log(step, metrics)
        if "eval/greedy_acc" in metrics:
            _write(
                f"step {step}: held-out greedy acc {metrics['eval/greedy_acc']:.3f}, "
                f"sampled acc {metrics['eval/sampled_acc']:.3f}"
            )

    def end_step(self, step: int, metrics: dict) -> None:
        """Log the step, update the bar, warn if nothing can be learned, save when due or asked."""
        self.log(step, metrics)
        self.last_metrics = metrics
        if self.bar is not None:
            self.bar.set_postfix(
                {
                    short: f"{metrics[k]:.3g}" if abs(metrics[k]) < 1000 else f"{metrics[k]:.0f}"
                    for k, short in BAR_FIGURES.items()
                    if k in metrics
                }
            )
        self._check_signal(metrics)
        if step % self.args.save_every == 0 or step == self.args.steps or self.stop_signal:
            path = self.save(step)
            if self.stop_signal:
                _write(
                    f"stopped: saved {path}; continue with: python {self.algo}.py --resume {self.dir}"
                )
                raise SystemExit(130 if self.stop_signal == signal.SIGINT else 143)

    def _check_signal(self, m: dict) -> None:
        """A run whose rewards never differ within a group learns nothing: say so, and why."""
        silent = m.get("unparsable_frac", 0) >= 0.9 or m.get("zero_std_frac", 0) >= 0.9
        self._stalled = self._stalled + 1 if silent else 0
        if self._stalled == STALL_STEPS:
            warn(
                f"{STALL_STEPS} steps in a row with almost no learning signal "
                f"({m.get('unparsable_frac', 0):.0%} of completions had no parsable answer, "
                f"{m.get('zero_std_frac', 0):.0%} of groups had equal rewards, "
                f"{m.get('truncated_frac', 0):.0%} were cut off). Likely causes: the model does "
                f"not put its answer in \\boxed{{}} (check --template, or use --answer-extraction "
                f"math_verify), completions are cut off (raise --max-new-tokens), or the task is "
                f"far too hard or too easy for the model"
            )

    def save(self, step: int) -> Path:
        for name, model in self.models.items():
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise UserError(
                    f"the weights of {name or 'the policy'} are not finite at step {step}; "
                    f"not saved (the last good checkpoint is kept in {self.dir})"
                )
        small = {k: v.state_dict() for k, v in self.stateful.items() if "optimizer" not in k}
        big = {k: v.state_dict() for k, v in self.stateful.items() if "optimizer" in k}
        trainer_state = {
            "step": step,
            "rng": rng_state(),
            "args": dataclasses.asdict(self.args),
            **small,
        }
        return save_checkpoint(
            self.dir,
            step,
            self.models,
            self.tokenizer,
            trainer_state,
            big,
            self.args.keep_checkpoints,
        )

    def write_samples(
        self, step: int, tokenizer, batch: dict, rewards, advantages, per_token: dict, k: int = 4
    ) -> Path:
        """runs/<run>/samples/step-<N>.html: k completions, each token coloured by one of the
        algorithm's per-token quantities (a menu switches between them), every value on hover."""
        rows = []
        for b in range(min(k, len(batch["texts"]))):
            n = int(batch["mask"][b].sum())
            ids = batch["completion_ids"][b, :n].tolist()
            rows.append(
                {
                    "header": f"reward {float(rewards[b]):+.3f}   advantage {float(advantages[b].float().mean()):+.3f}"
                    if advantages.dim() == 1
                    else f"reward {float(rewards[b]):+.3f}",
                    "prompt": batch["prompts"][b],
                    "tokens": [tokenizer.decode([i]) for i in ids],
                    "values": {
                        name: [float(x) for x in v[b, :n].tolist()] for name, v in per_token.items()
                    },
                }
            )
        path = self.dir / "samples" / f"step-{step}.html"
        write_token_html(path, f"{self.algo} run {self.dir.name}, step {step}", rows)
        return path

    # --- the end ----------------------------------------------------------------------
    def finish(self) -> dict:
        self.close()
        summary = {"run_dir": str(self.dir), "steps": self.args.steps}
        evals = [m for m in read_metrics(self.dir) if "eval/sampled_acc" in m]
        if evals:
            summary.update(
                {
                    "first_eval": {k: v for k, v in evals[0].items() if k.startswith("eval/")},
                    "last_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval/")},
                }
            )
        if self.last_metrics:
            summary["last_step"] = {
                k: _json_value(v) for k, v in self.last_metrics.items() if isinstance(v, float)
            }
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
        print(f"\ndone: {self.args.steps} steps, run folder {self.dir}")
        if evals:
            f, last = evals[0], evals[-1]
            print(
                f"held-out accuracy  greedy {f['eval/greedy_acc']:.3f} -> {last['eval/greedy_acc']:.3f}   "
                f"sampled {f['eval/sampled_acc']:.3f} -> {last['eval/sampled_acc']:.3f}"
            )
        return summary

    def close(self) -> None:
        if self not in _ACTIVE_RUNS:
            return
        _ACTIVE_RUNS.remove(self)
        if self.bar is not None:
            self.bar.close()
        self.logger.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def user_errors():
    """Around a script's main: a UserError is one line on stderr and exit code 2, and whatever
    happens, open runs close (log files, signal handlers)."""
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        for run in list(_ACTIVE_RUNS):
            run.close()


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
            else (int(255 * (1 + s)), int(255 * (1 + s)), 255)
        )
    else:
        s = (v - lo) / (hi - lo) if hi > lo else (1.0 if v else 0.0)
        r, g, b = 255, int(255 - 120 * s), int(255 - 255 * s)
    return f"rgb({r},{g},{b})"


def write_token_html(path: Path, title: str, rows: list[dict]) -> None:
    """rows: {"header", "prompt", "tokens": [str], "values": {name: [float per token]}}. Each
    token is a <span class="tok"> with data-<name> values and a title listing them all."""
    from html import escape

    names = list(rows[0]["values"]) if rows else []
    ranges = {
        n: (
            min([v for r in rows for v in r["values"][n]] or [0]),
            max([v for r in rows for v in r["values"][n]] or [0]),
        )
        for n in names
    }
    out = [
        f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        ".tok{font-family:monospace;white-space:pre-wrap;border-radius:2px}"
        ".sample{border:1px solid #ccc;padding:.5em;margin:1em 0}.p{color:#666}</style>",
        f"<h2>{escape(title)}</h2><p>Colour by: <select id='q' onchange='paint()'>",
    ]
    out += [f"<option>{escape(n)}</option>" for n in names]
    out.append("</select> (hover a token for every value)</p>")
    for r in rows:
        out.append(
            f"<div class='sample'><b>{escape(r['header'])}</b><div class='p'>"
            f"{escape(r['prompt'][-200:])}</div><div>"
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))


@functools.lru_cache(maxsize=None)
def git_commit() -> str | None:
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            return (ROOT / ".git" / head[5:]).read_text().strip()[:12]
        return head[:12]
    except OSError:
        return None
