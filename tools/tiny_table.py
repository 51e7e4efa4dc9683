"""The README's tiny-task table, measured: each script's default command, run as a user runs it,
one at a time, on a quiet machine; wall time and held-out accuracy at the first and last step.

    python tools/tiny_table.py                      # -> docs/results/tiny.csv (about 15 minutes)
    python tools/tiny_table.py --scripts tepo       # one row; the others are kept

Each row records the date, the CPU, the torch threads and the commit it ran on, beside the
command; tests/test_readme.py checks the README's table against this file.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runner  # noqa: E402
from common import UserError, arg  # noqa: E402

SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
COLUMNS = (
    "script", "command", "wall_s", "sampled_first", "sampled_last", "greedy_first",
    "greedy_last", "date", "cpu", "threads", "commit", "timed",
)  # fmt: skip


@dataclasses.dataclass
class Args:
    scripts: str = arg(",".join(SCRIPTS), "which scripts to run, comma-separated")
    out: str = arg("docs/results/tiny.csv", "the table to write (rows of other scripts kept)")


def cpu_name() -> str:
    """The CPU's model name, widest vector instructions and core count: the figures depend on them
    (PyTorch rounds differently with AVX2 than with AVX-512)."""
    name, isa = platform.processor() or platform.machine(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        name = next(
            (x.split(":", 1)[1].strip() for x in text.splitlines() if "model name" in x), name
        )
        isa = ", AVX-512" if " avx512f" in text else ", AVX2" if " avx2" in text else ""
    return f"{name}{isa}, {os.cpu_count()} cores"


def run_one(script: str, folder: Path) -> dict:
    """`python <script>.py` (its output folder moved aside), timed from start to exit."""
    command = [sys.executable, str(ROOT / f"{script}.py"), "--output-dir", str(folder)]
    start = time.perf_counter()
    subprocess.run([*command, "--run-name", script], check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rows = [r for r in runner.read_metrics(folder / script) if "eval/greedy_acc" in r]
    first, last = rows[0], rows[-1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return {
        "script": script,
        "command": f"python {script}.py",
        "wall_s": round(wall),
        "sampled_first": first["eval/sampled_acc"],
        "sampled_last": last["eval/sampled_acc"],
        "greedy_first": first["eval/greedy_acc"],
        "greedy_last": last["eval/greedy_acc"],
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "threads": json.loads((folder / script / "args.json").read_text())["threads"],
        "commit": commit or "unknown",
        "timed": "the whole process",
    }


def main(argv=None) -> int:
    a = runner.parse_args(Args, argv, __doc__)
    with runner.user_errors():
        scripts = [s.strip() for s in a.scripts.split(",") if s.strip()]
        if not scripts or set(scripts) - set(SCRIPTS):
            raise UserError(f"--scripts takes names from {', '.join(SCRIPTS)}, not {a.scripts!r}")
        out = Path(a.out)
        kept = {}
        if out.is_file():
            with open(out) as f:
                kept = {r["script"]: r for r in csv.DictReader(f)}
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for s in scripts:  # the file is written after each run: a stopped tool keeps its rows
                kept[s] = run_one(s, Path(tmp))
                with open(out, "w", newline="") as f:
                    w = csv.DictWriter(f, COLUMNS)
                    w.writeheader()
                    w.writerows(kept[s] for s in SCRIPTS if s in kept)
                print(f"wrote {out}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
