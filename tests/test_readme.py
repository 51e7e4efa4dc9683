"""The README's presets table is the code's: every cell equals the default declared in
common.RunArgs (or a script's Args) and the override in common.PRESETS, so a changed preset
cannot leave the front page behind."""

import csv
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import common
import grpo

ROOT = Path(__file__).resolve().parent.parent


def readme_presets() -> dict[str, tuple[str, str, str]]:
    text = (ROOT / "README.md").read_text()
    table = text.split("| flag | default (tiny) | cpu | gpu |")[1].split("\n\n")[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        flag, tiny, cpu, gpu = [c.strip() for c in line.strip("|").split("|")]
        rows[re.sub(r"`| \(.*\)", "", flag)] = (tiny, cpu, gpu)
    return rows


def same(cell: str, value) -> bool:
    if value is None:
        return cell.split(" (")[0] == "all"
    if isinstance(value, float):
        return float(cell) == value
    return cell == str(value)


def test_the_readme_presets_table_is_the_code():
    rows = readme_presets()
    defaults = {f.name: f.default for f in dataclasses.fields(grpo.Args)}
    names = {common.flag(k) for p in ("cpu", "gpu") for k in common.PRESETS[p] if k != "lora_lr"}
    assert names <= set(rows), f"flags a preset changes that the README omits: {names - set(rows)}"
    for flag, cells in rows.items():
        if flag == "--lr under --lora-rank":
            values = [common.PRESETS[p]["lora_lr"] for p in ("tiny", "cpu", "gpu")]
        else:
            k = flag[2:].replace("-", "_")
            tiny = defaults[k]
            values = [tiny, *(common.PRESETS[p].get(k, tiny) for p in ("cpu", "gpu"))]
        for cell, value, preset in zip(cells, values, ("tiny", "cpu", "gpu")):
            assert same(cell, value), f"README says {flag} = {cell} on {preset}; the code {value}"


@pytest.mark.parametrize("script", ["grpo", "dapo", "tepo", "erpo", "sapo"])
def test_help_shows_what_how_and_the_algorithms_flags_first(script):
    """--help opens with what the script does and its commands, lists its own flags before the
    run's, shows a default beside every flag that has one, and the presets last."""
    out = subprocess.run(
        [sys.executable, str(ROOT / f"{script}.py"), "--help"], capture_output=True, text=True
    ).stdout
    lines = out.splitlines()
    assert lines[2].startswith(script.upper()), lines[:3]  # the docstring's first line
    assert f"python {script}.py\n" in out or f"python {script}.py " in out
    assert f"python {script}.py --model Qwen2.5-Math-1.5B" in out
    own = out.index(f"{script} flags:")
    assert own < out.index("the run's flags") < out.index("presets:")
    assert out.index("  --clip-low") < out.index("  --model MODEL")
    assert out.count("(default: None)") <= 5
    assert "(default: 0.0002)" in out  # --lr's, where it is declared


# ----- every figure in the README's results tables is its results file's -----------------------
def readme_table(header: str) -> list[list[str]]:
    """The rows of the README table whose header row starts with `header`, as cells."""
    text = (ROOT / "README.md").read_text()
    assert header in text, f"the README has no table {header!r}"
    table = text.split(header)[1].split("\n\n")[0].strip().splitlines()[2:]  # past the rule
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]


def csv_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_tiny_table_is_docs_results_tiny_csv():
    measured = {r["command"]: r for r in csv_rows(ROOT / "docs/results/tiny.csv")}
    rows = readme_table("| default command |")
    assert {r[0].strip("`") for r in rows} == set(measured) and len(rows) == 5
    for command, wall, greedy, sampled in rows:
        r = measured[command.strip("`")]
        minutes, seconds = divmod(int(r["wall_s"]), 60)
        assert wall == f"{minutes} min {seconds} s", command
        assert greedy == f"{float(r['greedy_first']):.3f} -> {float(r['greedy_last']):.3f}"
        assert sampled == f"{float(r['sampled_first']):.3f} -> {float(r['sampled_last']):.3f}"
    tepo = measured["python tepo.py"]  # the opening's figures are the same run's
    text = (ROOT / "README.md").read_text()
    assert f"about {round(int(tepo['wall_s']) / 60)} minutes" in text.splitlines()[8]
    assert f"(greedy {float(tepo['greedy_first']):.3f} -> {float(tepo['greedy_last']):.3f})" in text


def test_the_real_model_table_is_the_studys_results_csv():
    """Seed 1 of each script (seeds 1-3 of tepo.py) at the cpu preset, micro-batch 2, once its
    run has finished, with the run's whole-run peak; the last column is the mean gain of seeds
    1-3 at micro-batch 16."""
    study = ROOT / "docs/study/real"
    greedy = {
        (r["config"], r["preset"], int(r["seed"]), int(r["step"])): float(r["greedy_acc"])
        for r in csv_rows(study / "results.csv")
    }
    peaks: dict[tuple, float] = {}
    for r in csv_rows(study / "steps.csv"):
        if r["peak_rss_mb"]:
            key = (r["config"], r["preset"], int(r["seed"]))
            peaks[key] = max(peaks.get(key, 0.0), float(r["peak_rss_mb"]))
    rows = readme_table("| cpu preset | greedy, step 0 -> 60")
    # each command's config: dapo has its length term built in; tepo.py's default is per-token
    # ratios at 0.2 / 0.28 since PLAN-clip-real.md
    configs = {"dapo.py": "dapo", "tepo.py": "tepo-len-token"}
    now = "micro-batch 2"
    landed = {c for (c, preset, seed, step) in greedy if (preset, seed, step) == (now, 1, 60)}
    landed -= {"tepo-len-token-kl0", "tepo-len-token-klall"}  # PLAN-kl-real's arms: no command
    shown = set()
    for command, acc, gain, peak, before in rows:
        script = command.split("`")[1]
        config = configs.get(script, script.removesuffix(".py") + "-len")
        shown.add(config)
        seeds = (1, 2, 3) if "seeds 1 / 2 / 3" in command else (1,)
        first = {greedy[config, now, s, 0] for s in seeds}
        assert len(first) == 1, "the seeds start from the same model"
        last = [greedy[config, now, s, 60] for s in seeds]
        assert acc == f"{first.pop():.3f} -> " + " / ".join(f"{v:.3f}" for v in last)
        gains = [greedy[config, now, s, 60] - greedy[config, now, s, 0] for s in seeds]
        assert gain == f"{sum(gains) / len(seeds):+.3f}", script
        gb = [peaks[config, now, s] * 2**20 / 1e9 for s in seeds]
        assert peak == " / ".join(f"{v:.2f}" for v in gb), script
        old = [
            greedy[config, "micro-batch 16", s, 60] - greedy[config, "micro-batch 16", s, 0]
            for s in (1, 2, 3)
        ]
        assert before == f"{sum(old) / 3:+.3f}", script
    assert shown == landed, "the table shows every finished run at the preset, and only those"


def test_the_tiny_claim_table_is_the_confirmation_summary():
    summary = (ROOT / "docs/study/confirm/summary.md").read_text()
    for row in readme_table("| tiny task, seeds 6-10 |"):
        for cell in row[1:]:
            assert cell in ("", "1") or cell in summary, f"{row[0]}: {cell} is not in its file"


def test_tiny_table_keeps_the_rows_it_does_not_rerun(tmp_path, monkeypatch):
    from tools import tiny_table

    out = tmp_path / "tiny.csv"

    def fake(script, folder):
        return {c: f"{script}-{c}" for c in tiny_table.COLUMNS} | {"script": script}

    monkeypatch.setattr(tiny_table, "run_one", fake)
    assert tiny_table.main(["--scripts", "tepo,grpo", "--out", str(out)]) == 0
    monkeypatch.setattr(tiny_table, "run_one", lambda s, f: fake(s, f) | {"wall_s": "new"})
    assert tiny_table.main(["--scripts", "tepo", "--out", str(out)]) == 0
    rows = csv_rows(out)
    assert [r["script"] for r in rows] == ["grpo", "tepo"]  # the scripts' order, grpo kept
    assert [r["wall_s"] for r in rows] == ["grpo-wall_s", "new"]
