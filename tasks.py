"""What the model is asked and how its answer is graded: the environment of every script.

The bundled tiny task (short arithmetic for the tiny model), the prompt templates, loading
problems from the hub or a local file, the endless shuffled prompt sampler, and the grader:
the final answer (the last \\boxed{}, or math-verify's own extraction from free text) compared
with the reference by math-verify, gold first, behind a time bound, never executing model text.
What a reward *means* is written out in each script's reward_fn; this module only grades.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import random
import re
import signal
import threading
import zlib
from pathlib import Path

from common import UserError, first_line

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
# Word problems for real chat models: one to three steps in plain English, integer answers
# =====================================================================================
NAMES = ("Tom", "Anna", "Ravi", "Mia", "Leo", "Sara", "Omar", "Yuki", "Ben", "Lena", "Kofi", "Ines")
ITEMS = (
    "apples",
    "marbles",
    "books",
    "stickers",
    "coins",
    "pencils",
    "cookies",
    "stamps",
    "shells",
    "cards",
)


def word_problem(rng: random.Random) -> dict:
    """A person starts with some items, then one to three events change the count; the question
    asks for the count at the end. Every count is whole; half the problems take one step."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    n = rng.randint(2, 20)
    text, steps = [f"{name} has {n} {item}."], []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):  # a 135M model solves few multi-step ones
        kind = rng.choice(("gain", "lose", "bags", "double", "share"))
        if kind == "gain":
            k = rng.randint(1, 10)
            text.append(
                rng.choice(
                    (
                        f"{friend} gives {name} {k} more.",
                        f"Then {name} finds {k} more {item}.",
                        f"{name} buys {k} more {item}.",
                    )
                )
            )
            steps.append(f"{n} + {k} = {n + k}")
            n += k
        elif kind == "lose" and n >= 2:
            k = rng.randint(1, n - 1)
            text.append(
                rng.choice(
                    (
                        f"{name} gives {k} of them to {friend}.",
                        f"Then {name} loses {k} {item}.",
                        f"{name} sells {k} {item}.",
                    )
                )
            )
            steps.append(f"{n} - {k} = {n - k}")
            n -= k
        elif kind == "bags":
            b, m = rng.randint(2, 4), rng.randint(2, 6)
            text.append(f"{name} buys {b} bags with {m} {item} in each bag.")
            steps.append(f"{n} + {b} * {m} = {n + b * m}")
            n += b * m
        elif kind == "double" and n <= 100:
            text.append(f"Then the number of {item} {name} has doubles.")
            steps.append(f"{n} * 2 = {2 * n}")
            n *= 2
        elif kind == "share" and n >= 4:
            d = rng.choice([d for d in (2, 3, 4, 5) if n % d == 0] or [1])
            if d == 1:
                continue
            text.append(
                f"{name} shares the {item} equally with {d - 1} friends and keeps one share."
            )
            steps.append(f"{n} / {d} = {n // d}")
            n //= d
    if not steps:  # every event was skipped: one addition, so each problem has a step
        k = rng.randint(1, 10)
        text.append(f"{friend} gives {name} {k} more.")
        steps.append(f"{n} + {k} = {n + k}")
        n += k
    text.append(f"How many {item} does {name} have now?")
    return {
        "problem": " ".join(text),
        "solution": "\n".join(steps) + f"\nThe answer is {n}.",
        "answer": str(n),
    }


def word_problems(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Up to n problems of one split ('train' or 'test', split by a fixed hash of the text as the
    tiny task is, so the two are disjoint), shuffled by seed, from a fixed pool of 12,000 draws."""
    if split not in ("train", "test"):
        raise UserError(f"the word problems have splits 'train' and 'test', not {split!r}")
    rng, pool = random.Random("word-problems"), {}
    for _ in range(12000):
        e = word_problem(rng)
        pool.setdefault(e["problem"], e)
    out = [e for e in pool.values() if tiny_is_heldout(e["problem"]) == (split == "test")]
    random.Random(f"words-{split}-{seed}").shuffle(out)
    return out[:n]


GENERATED = {"tiny": tiny_task, "words": word_problems}  # the tasks made here, by dataset name


# =====================================================================================
# Prompt templates
# =====================================================================================
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
# "step by step" made it ramble
CHAT_INSTRUCTION = "Write the calculation, then: The answer is <number>."
TEMPLATES = ("qwen_math", "tiny", "plain", "chat")


def build_prompt(tokenizer, problem: str, template: str) -> str:
    """Text of the prompt. qwen_math: the Qwen2.5-Math system prompt through the chat
    template (as in the Dr. GRPO and Qwen harnesses); tiny: the bare problem as a user turn;
    plain: the problem text followed by the qwen_math instruction, no chat template; chat: a
    short instruction as the system turn (it replaces a template's default system prompt, which
    costs tokens in every pass) and the problem as the user turn, for small chat models that do
    not box their answers (graded with --answer-extraction math_verify)."""
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
    elif template == "chat":
        if not has_chat:
            return f"{problem}\n{CHAT_INSTRUCTION}\n"
        msgs = [
            {"role": "system", "content": CHAT_INSTRUCTION},
            {"role": "user", "content": problem},
        ]
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
    """A list of {'problem', 'answer'} from: 'tiny' or 'words' (generated), a short name or hub id
    in HUB_DATASETS, any other hub id, or a local .jsonl/.json/.parquet file."""
    if dataset in GENERATED:
        made = GENERATED[dataset](split, limit, seed)
        rows = [{"problem": e["problem"], "answer": e["answer"]} for e in made]
        return _noted(dataset, split, rows)
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
            if path.suffix == ".parquet":
                ds = _hf_load("parquet", data_files=str(path), split="train")
            else:
                ds = _json_columns(path, dataset)
        elif path.exists():
            raise UserError(f"dataset {dataset!r}: expected a .jsonl, .json or .parquet file")
        else:
            hub_id = HUB_DATASETS[dataset][0] if dataset in HUB_DATASETS else dataset
            ds = _hf_load(hub_id, config, split=split)
    except UserError:
        raise
    except Exception as e:  # hub errors, bad files: one line, not a deep traceback
        raise UserError(
            f"cannot load dataset {dataset!r} (split {split!r}): {first_line(e)}"
        ) from None
    missing = [c for c in (p_col, a_col) if c not in ds.column_names]
    if missing:
        raise UserError(
            f"dataset {dataset!r} has no column {missing[0]!r} (columns: "
            f"{', '.join(ds.column_names)}); set --problem-column / --answer-column"
        )
    rows, dropped = [], 0
    inexact = [a for a in ds[a_col] if isinstance(a, float) and abs(a) >= FLOAT_EXACT_BELOW]
    if inexact:  # a float holds 15-17 significant digits
        print(
            f"{dataset}: {len(inexact)} answers are floats of 2**53 or more (e.g. {inexact[0]}): "
            f"an integer answer stored as a float may have lost digits; store answers as text"
        )
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
            f"{dataset}: dropped {dropped} of {len(rows) + dropped} rows with no problem or no "
            f"answer"
        )
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    return _noted(dataset, split, rows)


FLOAT_EXACT_BELOW = 2**53  # a float holds every integer below this; above, digits may be lost


def _hf_load(*args, **kwargs):
    import datasets  # heavy import, only when needed

    return datasets.load_dataset(*args, **kwargs)


class _Columns(dict):
    """Columns by name, as a datasets.Dataset offers them (ds[name], ds.column_names)."""

    @property
    def column_names(self) -> list[str]:
        return list(self)


def _json_columns(path: Path, name: str) -> _Columns:
    """A local JSON Lines file, or one JSON array (or object), as columns, every number as written:
    an integer exact at any size, a decimal as its own text. Read by datasets (pyarrow), a column
    with one integer beyond 2**63 became floats: 123456789012345678901234567890 was graded as
    '1.2345678901234568e+29', and 12 beside it as '12.0'."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        whole = json.loads(text, parse_float=str)
        records = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:  # JSON Lines: one object a line
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            try:
                records += [json.loads(line, parse_float=str)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise UserError(f"dataset file {name!r}, line {n}: not JSON ({e.msg})") from None
    for n, r in enumerate(records, 1):
        if not isinstance(r, dict):
            raise UserError(f"dataset file {name!r}: row {n} is not a JSON object: {r!r:.60}")
    names = dict.fromkeys(k for r in records for k in r)
    return _Columns({c: [r.get(c) for r in records] for c in names})


# The data set and a fingerprint of the rows load_problems last returned, by split: PromptSampler
# saves the training split's with a run, so that --resume can tell the data has changed since.
LOADED: dict[str, tuple[str, str]] = {}


def _noted(dataset: str, split: str, rows: list[dict]) -> list[dict]:
    digest = hashlib.sha256()
    for r in rows:
        digest.update(f"{r['problem']}\0{r['answer']}\0".encode())
    LOADED[split] = (dataset, digest.hexdigest()[:16])
    return rows


class PromptSampler:
    """Endless shuffled passes over a list of problems; its state saves and restores exactly,
    with the number of problems and the fingerprint of the training rows (LOADED["train"])."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self.data = LOADED.get("train")  # (data set, fingerprint) of the rows last loaded to train
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

    def load_state_dict(self, state: dict) -> None:
        """A run resumed on other training data would pick other problems at the saved positions
        (or none: an IndexError): one line instead, as soon as the count or the rows differ."""
        n, data = state.get("n"), state.get("data")
        why = None
        if (n is not None and n != self.n) or state["pos"] > self.n:
            why = f"it has {self.n} rows now, the run had {n if n is not None else 'more'}"
        elif data and self.data and data[1] != self.data[1]:
            why = "its rows differ from those the run was trained on (their fingerprint changed)"
        if why:
            name = f" ({self.data[0]})" if self.data else ""
            raise UserError(
                f"the training data{name} no longer matches the run: {why}; restore "
                f"the data it was trained on, or start a new run"
            )
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
    """math_verify.parse; a time-out counted, and, as parse does itself, any error read as
    nothing parsed."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(text, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        _TIMEOUTS["calls"] += 1
        return []
    except Exception:
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
        except TimeoutException:
            _TIMEOUTS["calls"] += 1
        except Exception:
            pass
    return False


def _verify_latex(
    gold: str, pred: str, timeout_s: int, free_text: bool = False
) -> tuple[bool, bool]:
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
        _TIMEOUTS["calls"] += 1
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
    is: 42", "#### 42"), for models that do not box their answers.
    Time: linear in the completion to find its answer, and math-verify, which sees at most
    MAX_ANSWER_CHARS (boxed) or MAX_TEXT_CHARS (math_verify), bounded to about timeout_s per
    parse and per comparison; a grade that runs out of time is wrong, and counted
    (Grade.timed_out, take_timeouts)."""
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
