"""The README's presets table is the code's: every cell equals the default declared in
common.RunArgs (or a script's Args) and the override in common.PRESETS, so a changed preset
cannot leave the front page behind."""

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
        return cell == "all"
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
