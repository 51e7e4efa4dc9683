"""tools/same_metrics.py, issue 29's check that a refactor changes no number: its comparison by
hand, and one short run of the whole tool against HEAD (the working tree's numbers must be HEAD's
wherever the code they run is the same)."""

import subprocess
import sys
from pathlib import Path

from tools import same_metrics

ROOT = Path(__file__).resolve().parent.parent


def test_compare_reports_changed_added_and_removed_figures():
    base = [{"step": 0, "eval/greedy_acc": 0.5}, {"step": 1, "loss": 0.25, "kl": 0.1}]
    assert same_metrics.compare(base, base) == ([], set(), set())
    new = [{"step": 0, "eval/greedy_acc": 0.5}, {"step": 1, "loss": 0.5, "clip_frac": 0.0}]
    assert same_metrics.compare(base, new) == (["step 1: loss 0.25 -> 0.5"], {"kl"}, {"clip_frac"})
    assert same_metrics.compare(base, base[:1])[0][0].startswith("steps logged differ")
    assert same_metrics.timing("time/generate") and not same_metrics.timing("loss")


def test_the_tool_finds_no_change_against_head():
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "same_metrics.py"),
        "--base",
        "HEAD",
        "--scripts",
        "grpo",
        "--steps",
        "1",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "grpo: 2 rows, same" in done.stdout and "every shared figure is the same" in done.stdout
