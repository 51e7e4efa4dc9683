"""Curves of one or more finished runs, side by side: held-out accuracy (greedy and sampled), the
share of completions cut off at the length cap and the KL to the reference, against the step.

    python tools/curves.py --runs runs/smol-grpo,runs/smol-tepo --out docs/real-models.png

Each run is one line (its folder name is the label); for several seeds of one config with
bands, use tools/study.py, whose curve() this reuses. Needs matplotlib.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runner  # noqa: E402
from common import UserError, arg  # noqa: E402
from tools.study import curve, save_small  # noqa: E402

PANELS = [
    ("eval/greedy_acc", "held-out greedy accuracy"),
    ("eval/sampled_acc", "held-out sampled accuracy (T = 1)"),
    ("truncated_frac", "completions cut off at the cap (training batches)"),
    ("kl", "KL to the reference (training batches)"),
]


@dataclasses.dataclass
class Args:
    runs: str = arg("", "run folders, comma-separated: runs/a,runs/b")
    out: str = arg("curves.png", "the PNG to write")
    title: str = arg("", "a title over the panels")


def load(run_dirs: list[str]) -> dict:
    """{(label, 0): rows} as tools/study.py's curve() reads them."""
    runs = {}
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").is_file():
            raise UserError(f"{d} is not a run folder (no metrics.jsonl)")
        runs[d.name, 0] = [{**r, "seconds": 0.0} for r in runner.read_metrics(d)]
    return runs


def running_mean(ys: list[float], k: int) -> list[float]:
    return [
        sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
        for i in range(len(ys))
    ]


def plot(runs: dict, out: Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("matplotlib is not installed (pip install matplotlib)") from None
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.4 * len(PANELS), 3.5))
    for ax, (key, name) in zip(axes, PANELS):
        for label, _ in runs:
            c = curve(runs, label, key)
            if c is None:
                continue
            if key.startswith("eval/"):
                ax.plot(c[0], c[1], marker="o", ms=4, label=label)
            else:  # per training batch: noisy, so a running mean over 5 steps
                ax.plot(c[0], running_mean(c[1], 5), label=f"{label} (mean of 5 steps)")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_small(fig, out)
    plt.close(fig)


def main(argv=None) -> int:
    a = runner.parse_args(Args, argv)
    with runner.user_errors():
        if not a.runs:
            raise UserError("give at least one run folder: --runs runs/a,runs/b")
        plot(load(a.runs.split(",")), Path(a.out), a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
