"""Plumbing shared by grpo.py, dapo.py, tepo.py and eval.py. Nothing here is RL.

What lives here, and only this: the bundled tiny model's location and its arithmetic task,
prompt templates, dataset loading, answer grading (math-verify behind a time bound),
run logging, atomic checkpoints, prompt sampling and seeding. Everything that teaches
an RL algorithm (rollouts, rewards, advantages, losses, the training loop) is written out
in each algorithm script instead, on purpose.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import json
import os
import random
import re
import shutil
import signal
import threading
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TINY_MODEL_DIR = ROOT / "tiny_model"


class UserError(Exception):
    """A problem with what the user asked for. Scripts print it as one line and exit 2."""


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
        raise UserError(f"--device {name} was asked for, but PyTorch sees no CUDA GPU here "
                        f"(torch {torch.__version__}); use --device cpu or auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    return torch.device(name)


# =====================================================================================
# Model names
# =====================================================================================
# Short names a user can type without the organisation, e.g. `--model Qwen2.5-Math-1.5B`.
HUB_ORGS_BY_PREFIX = {"Qwen": "Qwen", "DeepSeek": "deepseek-ai", "deepseek": "deepseek-ai",
                      "Llama": "meta-llama", "OLMo": "allenai", "SmolLM": "HuggingFaceTB"}


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
    raise UserError(f"unknown model {name!r}: give 'tiny', a local folder, a hub id such as "
                    f"'Qwen/Qwen2.5-Math-1.5B', or a short Qwen name such as 'Qwen2.5-Math-1.5B'")


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
    return all(a.get(k) == b.get(k) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"))


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
    every = [tiny_example(a, o1, b, o2, c) for a in r for o1 in "+-" for b in r for o2 in "+-" for c in r]
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
        msgs = [{"role": "system", "content": QWEN_MATH_SYSTEM}, {"role": "user", "content": problem}]
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


def load_problems(dataset: str, split: str = "train", problem_column: str | None = None,
                  answer_column: str | None = None, answer_from_boxed: bool | None = None,
                  limit: int | None = None, seed: int = 0) -> list[dict]:
    """A list of {'problem', 'answer'} from: 'tiny' (generated), a short name or hub id in
    HUB_DATASETS, any other hub id, or a local .jsonl/.json/.parquet file."""
    if dataset == "tiny":
        return [{"problem": e["problem"], "answer": e["answer"]} for e in tiny_task(split, limit, seed)]
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
        raise UserError(f"dataset {dataset!r} has no column {missing[0]!r} (columns: "
                        f"{', '.join(ds.column_names)}); set --problem-column / --answer-column")
    rows = []
    for p, a in zip(ds[p_col], ds[a_col]):
        a = last_boxed(str(a)) if boxed else str(a).strip()
        if p and a:  # drop rows without a usable answer
            rows.append({"problem": str(p), "answer": a})
    if not rows:
        raise UserError(f"dataset {dataset!r} has no rows with both a problem and an answer")
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
# Grading: math-verify on the last \boxed{}, time-bounded, never executing model text
# =====================================================================================
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


@dataclasses.dataclass
class Grade:
    correct: bool
    parsed: bool  # False when no \boxed{} answer could be extracted or parsed
    pred: str | None


def _verify_latex(gold: str, pred: str, timeout_s: int) -> tuple[bool, bool]:
    from math_verify import parse, verify
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout_s)
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


def _verify_in_subprocess(gold: str, pred: str, timeout_s: int) -> tuple[bool, bool]:
    """Off the main thread SIGALRM cannot interrupt math-verify, so a worker process runs it
    and is killed if it overruns."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ProcessPoolExecutor(max_workers=1)
    fut = _POOL.submit(_verify_latex, gold, pred, 0)  # 0: no alarm inside the worker
    try:
        return fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        for p in list(getattr(_POOL, "_processes", {}).values()):
            p.kill()
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None
        return False, True


def grade(completion: str, gold: str, timeout_s: int = 5) -> Grade:
    """Is the last \\boxed{} of `completion` equal to `gold`? math_verify.verify(gold, pred),
    bounded to about `timeout_s` seconds per parse and per comparison wherever it runs.
    Plain integers on both sides are compared directly (math-verify gives the same verdict)."""
    pred = last_boxed(completion)
    if pred is None or not pred or len(pred) > MAX_ANSWER_CHARS:
        return Grade(False, False, pred)
    if _INT.fullmatch(pred) and _INT.fullmatch(gold.strip()):
        return Grade(int(pred) == int(gold.strip()), True, pred)
    try:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM"):
            correct, parsed = _verify_latex(gold, pred, timeout_s)
        else:
            correct, parsed = _verify_in_subprocess(gold, pred, timeout_s)
    except Exception:  # math-verify raises on some malformed input: a wrong answer, not a crash
        correct, parsed = False, False
    return Grade(correct, parsed, pred)


# =====================================================================================
# Logging
# =====================================================================================
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
        row.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def reduce_stats(rows: list[dict]) -> dict:
    """Average per-micro-batch statistics; keys ending in _min / _max keep the extreme."""
    out = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        vals = [float(r[k]) for r in rows if k in r]
        out[k] = min(vals) if k.endswith("_min") else max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# =====================================================================================
# Checkpoints: written to a temporary folder, then renamed into place, then pointed to
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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # not supported on every filesystem


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, trainer_state: dict,
                    keep: int = 2) -> Path:
    """runs/<name>/checkpoint-<step>/: the model as save_pretrained (safetensors, loadable by
    from_pretrained and eval.py), its tokenizer, and trainer_state.pt (optimizer, step, RNG,
    sampler, args). A crash at any point leaves the previous checkpoint intact."""
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    pointer = run_dir / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, run_dir / "latest")  # the pointer moves only once the folder is whole
    _fsync_dir(run_dir)
    ckpts = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder whose `latest` file names one."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        raise UserError(f"no checkpoint at {str(path)!r} (expected a run folder with a 'latest' "
                        f"file, or a checkpoint-N folder with trainer_state.pt)")
    return path


def load_trainer_state(ckpt: Path) -> dict:
    try:
        return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {str(ckpt)!r} is unreadable ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'corrupt file'})") from None


@functools.lru_cache(maxsize=None)
def git_commit() -> str | None:
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            return (ROOT / ".git" / head[5:]).read_text().strip()[:12]
        return head[:12]
    except OSError:
        return None
