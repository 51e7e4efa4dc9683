"""Does each gold answer of a benchmark, read as eval.py reads it, grade correct against itself?

    python tools/gold_check.py gsm8k=grade-school-math/test.jsonl olympiadbench=ob/test.jsonl ...

Each NAME=FILE is one of eval.py's named benchmarks and a local copy of it (.jsonl, .json or
.parquet) with the hub set's columns; the file is read by eval.load_benchmark itself, in place of
the hub download, so the columns, clean_gold and the filter are eval.py's. Each gold answer is
then graded by common.grade as a completion ending in \\boxed{gold}. Prints the pass count per
benchmark and every failure; exit status 1 if any failed. tests/test_benchmarks.py runs it on the
excerpts in tests/fixtures/hub/.

On full public copies (math-verify 0.9.0), every gold grades correct against itself:
    math500        500/500   github.com/MobileLLM/BudgetThinker evaluation/data/math500 (f0466b9)
    aime24          30/30    github.com/QwenLM/Qwen2.5-Math evaluation/data/aime24 (a45202b)
    amc23           40/40    Qwen2.5-Math evaluation/data/amc23
    minerva        272/272   Qwen2.5-Math evaluation/data/minerva_math; `answer` made as the hub
                             set's: the last \\boxed{} of each solution, `question` its problem
    olympiadbench  675/675   Qwen2.5-Math evaluation/data/olympiadbench/test.jsonl
    gsm8k        1319/1319   github.com/openai/grade-school-math grade_school_math/data/test.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import eval as ev  # noqa: E402


def failures(rows: list[dict]) -> list[dict]:
    """The rows whose gold answer, boxed, does not grade correct against itself."""
    return [r for r in rows if not common.grade(f"\\boxed{{{r['answer']}}}", r["answer"]).correct]


def read_copy(name: str, path: str) -> list[dict]:
    import datasets

    kind = "parquet" if path.endswith(".parquet") else "json"
    table = datasets.load_dataset(kind, data_files=path, split="train")
    with mock.patch.object(datasets, "load_dataset", lambda *a, **k: table):
        return ev.load_benchmark(name, ev.Args())[2]


def main(pairs: list[str]) -> int:
    bad = 0
    for pair in pairs:
        name, path = pair.split("=", 1)
        rows = read_copy(name, path)
        failed = failures(rows)
        bad += len(failed)
        print(f"{name}: {len(rows) - len(failed)}/{len(rows)} gold answers grade correct")
        for r in failed:
            print(f"  FAIL {r['answer']!r}")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
