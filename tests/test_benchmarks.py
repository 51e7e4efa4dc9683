"""eval.py's named benchmarks, each read by eval.load_benchmark from an excerpt of its hub set (a
few real rows in the hub's config, split, file and columns; tests/fixtures/hub/<hub id>/README.md
cites the source) that datasets loads offline as the hub set itself; every gold answer, read as
eval.py reads it, grades correct against itself (tools/gold_check.py checks the full sets)."""

import re

import pytest

import eval as ev
from tools import build_rehearsal, gold_check

# name: (rows, the first problem's start, the gold answers as eval.py reads them)
EXCERPTS = {
    "math500": (5, "What is $8 + 15$?", ["23", "27", "5", "6", "6"]),
    "aime24": (3, "Find the number of ways to place a digit", ["045", "025", "033"]),
    "amc23": (4, "Cities $A$ and $B$ are $45$ miles apart", ["27", "36", "-1", "3159"]),
    "minerva": (
        4,
        "Each of the two Magellan telescopes",
        [
            "1.6",
            "4.5e33",
            "np.arcsin(10/13)",
            "\\frac{2 \\pi c^{2} R^{2}}{\\lambda^{5}\\left[e^{h c /(\\lambda k T)}-1\\right] "
            "d^{2}}",
        ],
    ),
    "olympiadbench": (
        5,
        "Given a positive integer $n$, determine the largest real number $\\mu$",
        [
            "\\frac{1}{2 n+2}",
            "(1,8,19), (2,7,13), (4,5,7)",
            "69$,$84",
            "2",
            "$(-\\infty, 0) \\cup\\{1\\}$.",
        ],
    ),
    "gsm8k": (3, "Janet’s ducks lay 16 eggs per day.", ["18", "3", "2125"]),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """datasets.load_dataset(hub id, config) reads the excerpts, offline, as downloaded hub sets."""
    import datasets

    sets = {b.hub_id: b.config for b in ev.BENCHMARKS.values()}
    cache = build_rehearsal.datasets_cache(tmp_path_factory.mktemp("datasets"), sets)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        yield


@pytest.mark.parametrize("name", list(ev.BENCHMARKS))
def test_benchmark_loads_from_its_hub_layout_and_its_golds_grade_correct(name, hub):
    b = ev.BENCHMARKS[name]  # offline, datasets takes the only config cached for any config
    readme = (build_rehearsal.FIXTURES / b.hub_id / "README.md").read_text()
    assert (b.config or "default") in (re.findall(r"config_name: (\S+)", readme) or ["default"])
    _, source, rows = ev.load_benchmark(name, ev.Args())
    n, first, golds = EXCERPTS[name]
    assert source == f"{b.hub_id} ({b.split})"
    assert len(rows) == n and rows[0]["problem"].startswith(first)
    assert [r["answer"] for r in rows] == golds
    assert gold_check.failures(rows) == []


def test_gold_check_reads_a_copy_as_eval_does(capsys):
    copy = build_rehearsal.FIXTURES / "openai/gsm8k/main/test-00000-of-00001.jsonl"
    assert gold_check.main([f"gsm8k={copy}"]) == 0
    assert "gsm8k: 3/3 gold answers grade correct" in capsys.readouterr().out
    assert gold_check.failures([{"problem": "p", "answer": "\\frac{1}{"}]) != []  # unparsable
