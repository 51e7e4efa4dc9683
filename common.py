"""What every script's RL step uses: the run's flags and presets, the data and its prompts, the
grader, the optimizer step. The run's machinery (folder, checkpoints, resume, logging) is runner's.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import decimal
import hashlib
import itertools
import json
import math
import random
import re
import signal
import sys
import threading
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data"  # the bundled data sets, written by tools/make_data.py


class UserError(Exception):
    """A problem with what the user asked for. Scripts print it as one line and exit 2."""


def first_line(e: Exception) -> str:
    """The first line of an exception's message, for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def warn(msg: str) -> None:
    """A warning on stderr that does not break the progress bar."""
    tqdm.write(f"warning: {msg}", file=sys.stderr)


# =====================================================================================
# Flags: a dataclass per script, every default in sight; a preset overrides the unpassed ones
# =====================================================================================
ANSWER_EXTRACTIONS = ("boxed", "math_verify")
TEMPLATES = ("qwen_math", "tiny", "plain", "chat")
# The flags a --resume may change, because they do not change what is learned.
RESUMABLE = ("steps", "device", "save_every", "keep_checkpoints", "sample_every", "tensorboard")
RESUMABLE += ("threads", "resume")


def arg(default, help: str, **metadata):
    """A dataclass field with its --help text: `lr: float = arg(2e-4, "AdamW learning rate")`."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def flag(name: str) -> str:
    """The command-line spelling of a dataclass field: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


@dataclasses.dataclass
class RunArgs:
    """The run's flags, the same in every script, at the bundled tiny run's values; a script's
    Args adds its algorithm's. A preset (PRESETS) changes the flags the user did not pass."""

    # --- model and data ---
    model: str = arg("tiny", "'tiny' (bundled), a hub id, a short Qwen name, or a local folder")
    dataset: str = arg("tiny", "tiny, words (bundled), math, dapo-math, a hub id, or a data file")
    problem_column: str | None = arg(None, "column of the problem (default: known, or 'problem')")
    answer_column: str | None = arg(None, "column of the answer (default: known, or 'answer')")
    template: str = arg("tiny", "prompt template", choices=list(TEMPLATES))
    eval_dataset: str = arg("tiny", "held-out set for periodic evaluation, or 'none'")
    answer_extraction: str = arg(
        "boxed",
        "final answer: the last \\boxed{}, or math-verify's from free text",
        choices=list(ANSWER_EXTRACTIONS),
    )
    trust_remote_code: bool = arg(False, "allow custom model code from the hub")
    preset: str = arg(
        "auto",
        "the table of values for the flags not passed (below); auto: tiny for the bundled model, "
        "gpu for another model on CUDA, cpu for another model on a CPU",
        choices=["auto", "tiny", "cpu", "gpu"],
    )
    # --- rollouts ---
    prompts_per_step: int = arg(16, "P, prompts per rollout batch")
    group_size: int = arg(8, "G, completions sampled per prompt")
    max_new_tokens: int = arg(40, "completion length cap")
    max_prompt_tokens: int | None = arg(
        None, "longer prompts are dropped (default: context - max_new_tokens)"
    )
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same one")
    top_p: float = arg(1.0, "nucleus sampling; keep 1.0: log-probs describe what was sampled")
    gen_batch_size: int | None = arg(None, "completions per generate() call (default: all)")
    # --- optimisation ---
    steps: int = arg(160, "rollout batches to train on")
    lr: float = arg(2e-4, "AdamW learning rate; under --lora-rank the preset's lora_lr")
    warmup_steps: int = arg(4, "linear lr warm-up in optimizer steps, then constant")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping")
    num_mini_batches: int = arg(2, "optimizer steps per rollout batch (mini-batches)")
    ppo_epochs: int = arg(1, "passes over the rollout batch")
    micro_batch_size: int = arg(64, "completions per forward/backward (grads accumulate)")
    optim: str = arg("adamw", "adamw, or adamw8bit (bitsandbytes)", choices=["adamw", "adamw8bit"])
    gradient_checkpointing: bool | None = arg(None, "recompute activations (default: on CUDA)")
    bf16: bool | None = arg(None, "bf16 autocast over fp32 weights (default: on CUDA)")
    # --- LoRA (PEFT) ---
    lora_rank: int = arg(0, "LoRA rank r: adapters on a frozen base; 0: full fine-tuning")
    lora_alpha: float = arg(32.0, "LoRA alpha: the adapters' update is scaled by alpha / r")
    lora_target_modules: str = arg(
        "all-linear", "modules that get adapters: all-linear, or a list such as q_proj,v_proj"
    )
    # --- run ---
    seed: int = arg(1, "seed for data order, sampling and init")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = arg(None, "torch threads (default: OMP_NUM_THREADS, else torch's)")
    output_dir: str = arg("runs", "runs are written to <output_dir>/<run_name>/")
    run_name: str | None = arg(None, "default: <algo>-<model>-s<seed>-<date>")
    eval_every: int = arg(40, "held-out evaluation every N steps, and first and last")
    eval_n: int = arg(256, "held-out problems per evaluation (the same for every seed)")
    save_every: int = arg(80, "checkpoint every N steps, and at the end")
    keep_checkpoints: int = arg(2, "checkpoints kept (only the newest keeps the optimizer)")
    sample_every: int = arg(20, "print completions and write samples/step-N.html every N steps")
    grader_timeout: int = arg(5, "seconds allowed per answer parse / comparison")
    tensorboard: bool = arg(True, "also log to TensorBoard when it is installed")
    resume: str | None = arg(
        None,
        "a run folder or checkpoint to continue, in place, with its saved flags (only "
        + ", ".join(flag(k) for k in RESUMABLE[:-1])
        + " may change)",
    )


# The presets: what changes from the defaults above (the bundled tiny run) for a real model on a
# CPU, and for the real run on one CUDA GPU; each value's reason is in docs/real-models.md. lora_lr:
# the lr under --lora-rank. overlong_cache: reward shaping of ours, in no paper's objective (on for
# the cpu preset by PLAN-length's rule). A script changes these only where its algorithm needs.
PRESETS = {
    "tiny": dict(lora_lr=1e-3),
    "cpu": dict(
        dataset="words",
        template="chat",
        eval_dataset="words",
        answer_extraction="math_verify",
        lora_rank=16,
        prompts_per_step=4,
        max_new_tokens=64,
        steps=60,
        lr=3e-5,
        lora_lr=3e-4,
        warmup_steps=2,
        micro_batch_size=2,  # docs/memory.md: the fastest step under 3 GB, by measurement
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
        prompts_per_step=32,
        max_new_tokens=3000,
        steps=500,
        lr=1e-6,
        lora_lr=1e-5,
        warmup_steps=10,
        num_mini_batches=4,
        micro_batch_size=4,
        gen_batch_size=None,  # all P x G in one generate() call; a CUDA run lowers it to fit
        eval_every=100,  # in-training evaluation, light: final figures come from eval.py
        eval_n=256,
        save_every=50,
    ),
}


def presets(every: dict | None = None, **changes: dict) -> dict[str, dict]:
    """The house's PRESETS with a script's changes: `every` in all three, or by preset name.

    >>> presets(gpu=dict(num_mini_batches=8))["gpu"]["num_mini_batches"]
    8
    """
    every = every or {}
    return {name: {**base, **every, **changes.get(name, {})} for name, base in PRESETS.items()}


# =====================================================================================
# Data: problems with reference answers, and the prompt the model sees
# =====================================================================================
BUNDLED = ("tiny", "words")  # data/<name>/<split>.jsonl, shuffled once: a subset is its first rows
# Short name -> (hub id, config, problem column, answer column, answer is a full solution whose
# last \boxed{} holds the answer). Each layout's source: tests/fixtures/hub/<hub id>/README.md
HUB_DATASETS = {
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", "problem", "solution", True),
    "dapo-math": ("open-r1/DAPO-Math-17k-Processed", "en", "prompt", "solution", False),
}
HUB_DATASETS |= {spec[0]: spec for spec in HUB_DATASETS.values()}  # the full hub id works too


def read_json_rows(path: Path, name: str) -> list[dict]:
    """A JSON Lines file, or one JSON array (or object), every number as written: an integer
    exact at any size, a decimal as its own text (read by pyarrow, a column with one integer
    beyond 2**63 became floats, and 12 beside it was graded as '12.0')."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        whole = json.loads(text, parse_float=str)
        rows = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:  # JSON Lines: one object a line
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            try:
                rows += [json.loads(line, parse_float=str)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise UserError(f"dataset file {name!r}, line {n}: not JSON ({e.msg})") from None
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise UserError(f"dataset file {name!r}: row {n} is not a JSON object: {r!r:.60}")
    return rows


def _table(dataset: str, split: str, config: str | None) -> list[dict]:
    """Rows of a bundled set, a local .jsonl/.json/.parquet file, or a hub data set."""
    path = Path(dataset).expanduser()
    if dataset in BUNDLED:
        path = DATA / dataset / f"{split}.jsonl"
        if not path.is_file():
            raise UserError(f"the bundled set {dataset!r} has splits train and test, not {split!r}")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        if path.exists():
            raise UserError(f"dataset {dataset!r}: expected a .jsonl, .json or .parquet file")
        import datasets  # heavy: only for hub sets and parquet files

        return datasets.load_dataset(dataset, config, split=split).to_list()
    if not path.is_file():
        raise UserError(f"dataset file {dataset!r} does not exist")
    if path.stat().st_size == 0 or (path.suffix != ".parquet" and not path.read_text().strip()):
        raise UserError(f"dataset file {dataset!r} is empty")
    if path.suffix == ".parquet":
        import datasets

        return datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()
    return read_json_rows(path, dataset)


def gold_text(value, where: str) -> str | None:
    """A gold answer as the text the grader reads, by one rule for every JSON type, in training and
    in eval.py: text stripped; a number as written (27.0 or a parquet Decimal("27") -> "27"); a list
    as its items joined by ", ", as \\boxed{4, 6} answers both; null: no answer (its row dropped).
    Refused in one line: true / false, an object, a float not finite or of 2**53 or more."""
    if value is None or isinstance(value, str):
        return value.strip() if value is not None else None
    if isinstance(value, (list, tuple)):
        return ", ".join(t for v in value if (t := gold_text(v, where))) or None
    if isinstance(value, bool) or not isinstance(value, (int, float, decimal.Decimal)):
        raise UserError(f"{where}: the answer {value!r:.60} is not text, a number or a list")
    big = isinstance(value, float) and abs(value) >= 2**53  # a Decimal keeps every digit
    if not isinstance(value, int) and (big or not math.isfinite(value)):
        raise UserError(
            f"{where}: the answer {value!r} is not finite or is a float of 2**53 or more, whose "
            f"last digits may be lost: store answers as text"
        )
    return str(int(value) if value == int(value) else value)


def load_problems(
    dataset: str, split: str = "train", problem_column=None, answer_column=None, limit=None
) -> list[dict]:
    """[{'problem', 'answer'}] from a bundled set (tiny, words), a short name or hub id in
    HUB_DATASETS, any other hub id, or a local .jsonl/.json/.parquet file; `limit` problems at
    most, the same ones whatever the run's seed."""
    default = (dataset, None, "problem", "answer", False)  # a hub id or file not in the table
    hub_id, config, p_col, a_col, boxed = HUB_DATASETS.get(dataset, default)
    p_col, a_col = problem_column or p_col, answer_column or a_col
    try:
        table = _table(hub_id, split, config)
    except UserError:
        raise
    except Exception as e:  # hub errors, bad files: one line, not a deep traceback
        raise UserError(f"cannot load dataset {dataset!r} (split {split!r}): {first_line(e)}")
    columns = list(dict.fromkeys(k for r in table for k in r))
    for c in (p_col, a_col):
        if c not in columns:
            raise UserError(
                f"dataset {dataset!r} has no column {c!r} (columns: {', '.join(columns)}); set "
                f"--problem-column / --answer-column"
            )
    rows = []
    for n, r in enumerate(table, 1):
        p, a = r.get(p_col), gold_text(r.get(a_col), f"dataset {dataset!r}, row {n}")
        a = last_boxed(a) if boxed and a else a
        if p and a:
            rows.append({"problem": str(p), "answer": a})
    if not rows:
        raise UserError(f"dataset {dataset!r} has no rows with both a problem and an answer")
    if len(rows) < len(table):
        print(
            f"{dataset}: dropped {len(table) - len(rows)} of {len(table)} rows with no problem "
            f"or no answer"
        )
    if limit is not None and limit < len(rows):
        rows = rows[:limit] if dataset in BUNDLED else random.Random(0).sample(rows, limit)
    return rows


QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
CHAT_INSTRUCTION = "Write the calculation, then: The answer is <number>."  # "step by step" rambled


def build_prompt(tokenizer, problem: str, template: str) -> str:
    """Text of the prompt. qwen_math: the Qwen2.5-Math system prompt through the chat template
    (as in the Dr. GRPO and Qwen harnesses); tiny: the bare problem as a user turn; plain: the
    problem and qwen_math's instruction, no chat template; chat: a short system turn (replacing
    a template's default, which costs tokens in every pass) for small chat models that do not box
    their answers (graded with --answer-extraction math_verify)."""
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    system = {"qwen_math": QWEN_MATH_SYSTEM, "chat": CHAT_INSTRUCTION}.get(template)
    if template not in TEMPLATES:
        raise UserError(f"unknown --template {template!r}; choose from {', '.join(TEMPLATES)}")
    if template == "plain" or not has_chat:
        instruction = {"tiny": "", "chat": CHAT_INSTRUCTION}.get(template, QWEN_MATH_SYSTEM)
        return f"{problem}\n{instruction}\n" if instruction else f"{problem}\n"
    msgs = [{"role": "user", "content": problem}]
    if system:
        msgs.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def fingerprint(rows: list[dict]) -> str:
    """A short hash of the problems and answers: --resume refuses a run whose data changed."""
    digest = hashlib.sha256()
    for r in rows:
        digest.update(f"{r['problem']}\0{r['answer']}\0".encode())
    return digest.hexdigest()[:16]


class PromptSampler:
    """Endless shuffled passes over the training rows; its state saves and restores exactly, with
    the rows' count and fingerprint, so that a run cannot resume on other data."""

    def __init__(self, rows: list[dict], seed: int, name: str = "the training data"):
        self.n, self.seed, self.epoch, self.pos, self.name = len(rows), seed, 0, 0, name
        self.data = fingerprint(rows)
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
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "data": self.data}

    def load_state_dict(self, state: dict) -> None:  # runner.check_sampler checks it first
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation()


# =====================================================================================
# The grader: math-verify behind a time bound, never executing model text
# =====================================================================================
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\{")
_BRACE = re.compile(r"[{}]")


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every \\boxed{...} (or \\fbox{...}), in the order the boxes
    open, braces matched, unclosed ones skipped. One pass over the braces with a stack: linear in
    the text whatever it holds (matching each box by a scan of its own took time quadratic in the
    length: 3.7 s for 3000 nested boxes, 36 s for 100,000 small ones)."""
    box_braces = {m.end() - 1 for m in _BOX_OPENING.finditer(text)}
    open_braces, spans = [], []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            open_braces.append(m.start())
        elif open_braces:  # a "}" with nothing open closes nothing
            start = open_braces.pop()
            if start in box_braces:
                spans.append((start + 1, m.start()))
    return sorted(spans)


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


@dataclasses.dataclass
class Grade:
    correct: bool
    parsed: bool  # False when no answer could be extracted or parsed
    pred: str | None
    timed_out: bool = False  # a parse or comparison ran out of time (then it counts as wrong)


# math-verify calls cut off by the time bound (ever), and grades with one since take_timeouts():
# a grade that runs out of time is wrong, so on a slow or loaded machine rewards can differ
_TIMEOUTS = {"calls": 0, "grades": 0}


def take_timeouts() -> int:
    """How many grades ran out of time since the last call (logged as grader_timeouts)."""
    n, _TIMEOUTS["grades"] = _TIMEOUTS["grades"], 0
    return n


def _parse(text: str, timeout_s: int) -> list:
    """math_verify.parse; a time-out counted, any error read as nothing parsed (as parse does)."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(text, parsing_timeout=timeout_s, raise_on_error=True)
    except (Exception, TimeoutException) as e:  # TimeoutException is a BaseException
        _TIMEOUTS["calls"] += isinstance(e, TimeoutException)
        return []


def _verify(gold_parsed: list, pred_parsed: list, timeout_s: int) -> bool:
    """math_verify.verify, pair by pair as it loops itself, a time-out counted; a pair that
    raises or runs out of time is not equal. Gold first: the comparison is asymmetric."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for g, p in itertools.product(gold_parsed, pred_parsed):
        try:
            if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                return True
        except (Exception, TimeoutException) as e:
            _TIMEOUTS["calls"] += isinstance(e, TimeoutException)
    return False


def _verify_latex(gold: str, pred: str, timeout_s: int, free_text=False) -> tuple[bool, bool]:
    """math-verify on `pred`, read as the content of a box, or (free_text) as a whole completion
    whose final answer math-verify finds itself."""
    gold_parsed = _parse(f"\\boxed{{{gold}}}", timeout_s)
    pred_parsed = _parse(pred if free_text else f"\\boxed{{{pred}}}", timeout_s)
    if not pred_parsed:
        return False, False
    if not gold_parsed:
        return False, True
    return _verify(gold_parsed, pred_parsed, timeout_s), True


_POOL: concurrent.futures.ProcessPoolExecutor | None = None


@atexit.register
def _close_pool() -> None:
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)


def _verify_in_subprocess(gold: str, pred: str, timeout_s: int, free_text) -> tuple[bool, bool]:
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
        _TIMEOUTS["calls"] += 1
        return False, True


def math_equal(gold: str, pred: str, timeout_s: int = 5, free_text=False) -> tuple[bool, bool]:
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
    """Is the completion's final answer equal to `gold`? boxed: the last \\boxed{}; if wrong,
    several boxes' contents joined by ", " (\\boxed{(2, 2)} and \\boxed{(6, 2)}), so that a
    self-correction (\\boxed{5} ... no, \\boxed{7}) counts only its last. math_verify: its own
    extraction from free text ("The answer is: 42"), for models that do not box their answers.
    Time: linear in the completion, then math-verify on at most MAX_ANSWER_CHARS (boxed) or
    MAX_TEXT_CHARS, bounded to about timeout_s per parse and comparison; a grade out of time is
    wrong, and counted (Grade.timed_out, take_timeouts)."""
    calls = _TIMEOUTS["calls"]
    g = _grade(completion, gold, timeout_s, extraction)
    g.timed_out = _TIMEOUTS["calls"] > calls
    _TIMEOUTS["grades"] += g.timed_out
    return g


def _grade(completion: str, gold: str, timeout_s: int, extraction: str) -> Grade:
    if extraction == "math_verify":
        correct, parsed = math_equal(gold, completion[-MAX_TEXT_CHARS:], timeout_s, free_text=True)
        return Grade(correct, parsed, None)
    pred = last_boxed(completion)
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return Grade(False, False, pred)
    correct, parsed = math_equal(gold, pred, timeout_s)
    spans = boxed_spans(completion) if not correct else []
    if 1 < len(spans) <= MAX_BOXES:  # only then is each box's content copied out
        boxes = [completion[i:j].strip() for i, j in spans]
        joined = ", ".join(boxes)
        if boxes[-1] == pred and len(joined) <= MAX_ANSWER_CHARS:
            correct = math_equal(gold, joined, timeout_s)[0]
            pred = joined if correct else pred
    return Grade(correct, parsed, pred)


# =====================================================================================
# The optimizer: AdamW with linear warm-up then constant lr; a non-finite step is skipped
# =====================================================================================
def make_optimizer(params: list, args):
    if args.optim == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError("--optim adamw8bit needs bitsandbytes: pip install bitsandbytes")
        optimizer = bnb.optim.AdamW8bit(params, lr=args.lr, weight_decay=args.weight_decay)
    else:
        fused = params[0].is_cuda  # foreach's temporaries would take ~6 GB at 1.5 B
        optimizer = torch.optim.AdamW(params, args.lr, weight_decay=args.weight_decay, fused=fused)
    warmup = max(1, args.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    return optimizer, scheduler


def optimizer_step(optimizer, scheduler, params: list, max_grad_norm: float, loss: float) -> dict:
    """Clip the gradient norm and step, unless the loss or the gradient is NaN or inf: then the
    step is skipped (weights untouched) with a warning, and counted in skipped_updates. Either
    way the gradients are freed: they would otherwise hold weight-sized memory through the next
    generation."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    skip = not (math.isfinite(grad_norm) and math.isfinite(loss))
    if skip:
        warn(f"non-finite loss ({loss}) or gradient norm ({grad_norm}): update skipped")
    else:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    grad_norm = float("nan") if skip else grad_norm
    return {"grad_norm": grad_norm, "skipped_updates": int(skip), "optimizer_steps": 1}


SUMMED_STATS = ("skipped_updates", "optimizer_steps")


def reduce_stats(rows: list[dict]) -> dict:
    """Average per-micro-batch statistics; _min / _max keys keep the extreme, counts add up."""
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
