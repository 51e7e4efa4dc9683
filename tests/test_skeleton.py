"""The algorithm scripts repeat one skeleton on purpose. Every function or class they share
by name must be identical, so `diff grpo.py tepo.py` shows the algorithm and nothing else;
only the names listed here may differ, because they ARE the algorithm."""

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [p for p in ("grpo.py", "dapo.py", "tepo.py", "erpo.py", "sapo.py") if (ROOT / p).exists()]

# script -> the shared names it may define its own way
ALGORITHM_SPECIFIC = {
    "dapo.py": {"Args", "resolve_args", "train", "reward_fn"},  # DAPO flags, +-1 and overlong shaping
    "tepo.py": {"Args", "resolve_args", "train"},               # TEPO flags, the mask in the loop
    "erpo.py": {"Args", "resolve_args", "train"},               # ERPO flags, token advantages
    "sapo.py": {"Args", "resolve_args", "train", "reward_fn", "load_model"},  # critic, G = 1, segments
}
SKELETON = ("Args", "resolve_args", "load_tokenizer", "load_model", "eos_token_ids", "load_data",
            "completion_mask", "decode_completions", "generate_rollouts", "token_logps_and_entropy",
            "batch_logps", "reward_fn", "evaluate", "train", "main")


def top_level_defs(path: Path) -> dict:
    tree = ast.parse(path.read_text())
    return {n.name: ast.dump(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_grpo_defines_the_skeleton():
    defs = top_level_defs(ROOT / "grpo.py")
    for name in (*SKELETON, "group_advantages", "k3_kl", "grpo_loss", "grpo_stats"):
        assert name in defs, name


@pytest.mark.parametrize("other", [s for s in SCRIPTS if s != "grpo.py"])
def test_shared_definitions_are_identical_to_grpo(other):
    base, defs = top_level_defs(ROOT / "grpo.py"), top_level_defs(ROOT / other)
    for name in SKELETON:
        assert name in defs, f"{other} lacks {name}"
    allowed = ALGORITHM_SPECIFIC.get(other, set())
    differ = [n for n in sorted(set(base) & set(defs)) if base[n] != defs[n] and n not in allowed]
    assert not differ, f"{other} changes shared code that is not its algorithm: {differ}"


@pytest.mark.parametrize("a,b", list(itertools.combinations([s for s in SCRIPTS if s != "grpo.py"], 2)))
def test_helpers_shared_by_other_scripts_are_identical(a, b):
    """E.g. token_mean in dapo.py and tepo.py: one helper, one text."""
    da, db = top_level_defs(ROOT / a), top_level_defs(ROOT / b)
    allowed = ALGORITHM_SPECIFIC.get(a, set()) | ALGORITHM_SPECIFIC.get(b, set())
    differ = [n for n in sorted(set(da) & set(db)) if da[n] != db[n] and n not in allowed]
    assert not differ, f"{a} and {b} define {differ} differently"
