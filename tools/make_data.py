"""Write the bundled data sets: data/tiny/ (short arithmetic for the bundled tiny model) and
data/words/ (word problems in plain English for small chat models), each a train.jsonl and a
test.jsonl of {"problem", "solution", "answer"} rows, shuffled once (seed 0), so that the first
n rows of a split are its n-problem subset. The scripts load them as any data file.

    python tools/make_data.py           # rewrites data/; the files are committed
    python tools/make_data.py --check   # exit 1 if data/ differs from what this makes
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"


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
        raise ValueError(f"the tiny task has splits 'train' and 'test', not {split!r}")
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
        raise ValueError(f"the word problems have splits 'train' and 'test', not {split!r}")
    rng, pool = random.Random("word-problems"), {}
    for _ in range(12000):
        e = word_problem(rng)
        pool.setdefault(e["problem"], e)
    out = [e for e in pool.values() if tiny_is_heldout(e["problem"]) == (split == "test")]
    random.Random(f"words-{split}-{seed}").shuffle(out)
    return out[:n]


MAKERS = {"tiny": tiny_task, "words": word_problems}


def files() -> dict[Path, str]:
    """Every bundled file's path and its text: one JSON object a line."""
    return {
        DATA / name / f"{split}.jsonl": "".join(json.dumps(r) + "\n" for r in make(split))
        for name, make in MAKERS.items()
        for split in ("train", "test")
    }


def main(argv=None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = [p for p, text in files().items() if not p.is_file() or p.read_text() != text]
    if check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from what tools/make_data.py makes")
        return 1 if stale else 0
    for p, text in files().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)} ({text.count(chr(10))} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
