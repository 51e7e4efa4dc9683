"""Does a change leave every number a run logs as it was? A few steps of each script's tiny preset,
at a fixed seed, at a base revision and in the working tree, metrics.jsonl compared row by row.

    python tools/same_metrics.py --base HEAD                 # every script, 10 steps
    python tools/same_metrics.py --base main~3 --scripts tepo,grpo --steps 4

The base is checked out with `git worktree` in a temporary folder; both sides run one process
at a time with one torch thread (OMP_NUM_THREADS=1), so the arithmetic is the same on both.
Timings (time/*, tokens_per_s, the wall clock) are left out. Exit 0 when every figure both sides
log is equal; keys only one side logs are listed (a metric added or moved to tools/diagnostics.py),
and do not fail the check. Exit 1 on any other difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runner  # noqa: E402
from common import UserError, arg  # noqa: E402

SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")


@dataclass
class Args:
    base: str = arg("HEAD", "the git revision to compare the working tree with")
    scripts: str = arg(",".join(SCRIPTS), "comma list of scripts")
    steps: int = arg(10, "training steps of each run (the tiny preset, seed 1)")


def timing(key: str) -> bool:
    return key in ("time", "tokens_per_s") or key.startswith("time/")


def run_script(tree: Path, script: str, out: Path, steps: int) -> list[dict]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        str(tree / f"{script}.py"),
        "--steps",
        str(steps),
        "--seed",
        "1",
        "--output-dir",
        str(out),
        "--run-name",
        script,
        "--tensorboard",
        "false",
    ]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise UserError(f"{script}.py failed in {tree} (exit {done.returncode}):\n{tail}")
    return [
        {k: v for k, v in r.items() if not timing(k)} for r in runner.read_metrics(out / script)
    ]


PRESET_PROBE = """
import dataclasses, importlib, json, sys
out = {}
for name in sys.argv[1].split(","):
    m = importlib.import_module(name)
    out[name] = {p: dataclasses.asdict(m.resolve_args(m.Args(preset=p, device="cpu", run_name="x")))
                 for p in ("tiny", "cpu", "gpu")}
print(json.dumps(out))
"""


def resolved_presets(tree: Path, scripts: list[str]) -> dict:
    """{script: {preset: every flag's value after resolve_args}}, as the tree's code has them."""
    done = subprocess.run(
        [sys.executable, "-c", PRESET_PROBE, ",".join(scripts)],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise UserError(
            f"cannot resolve the presets in {tree}: {done.stderr.strip().splitlines()[-1]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(base: list[dict], new: list[dict]) -> tuple[list[str], set[str], set[str]]:
    """(differences, keys only in base, keys only in new) of two runs' metrics rows.

    >>> compare([{"step": 1, "a": 1.0, "b": 2}], [{"step": 1, "a": 1.0, "c": 3}])
    ([], {'b'}, {'c'})
    >>> compare([{"step": 1, "a": 1.0}], [{"step": 1, "a": 1.5}])[0]
    ['step 1: a 1.0 -> 1.5']
    """
    if [r["step"] for r in base] != [r["step"] for r in new]:
        steps = [r["step"] for r in base], [r["step"] for r in new]
        return [f"steps logged differ: {steps[0]} -> {steps[1]}"], set(), set()
    diffs, removed, added = [], set(), set()
    for b, n in zip(base, new):
        removed |= set(b) - set(n)
        added |= set(n) - set(b)
        diffs += [f"step {b['step']}: {k} {b[k]} -> {n[k]}" for k in b if k in n and b[k] != n[k]]
    return diffs, removed, added


def main(argv=None) -> int:
    args = runner.parse_args(Args, argv)
    with runner.user_errors():
        scripts = [s.strip() for s in args.scripts.split(",") if s.strip()]
        if unknown := [s for s in scripts if s not in SCRIPTS]:
            raise UserError(
                f"unknown script(s) {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}"
            )
        runner.check_args(args)
        failed = False
        with tempfile.TemporaryDirectory(prefix="same-metrics-") as tmp:
            tmp = Path(tmp)
            base_tree = tmp / "base"
            added_tree = subprocess.run(
                ["git", "worktree", "add", "--detach", str(base_tree), args.base],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if added_tree.returncode != 0:
                raise UserError(f"cannot check out {args.base!r}: {added_tree.stderr.strip()}")
            try:
                before = resolved_presets(base_tree, scripts)
                after = resolved_presets(ROOT, scripts)
                for script in scripts:
                    for preset in ("tiny", "cpu", "gpu"):
                        diffs, removed, added = compare(
                            [{"step": 0, **before[script][preset]}],
                            [{"step": 0, **after[script][preset]}],
                        )
                        notes = [d.split(": ", 1)[1] for d in diffs]
                        if removed:
                            notes.append(f"only in {args.base}: {', '.join(sorted(removed))}")
                        if added:
                            notes.append(f"new: {', '.join(sorted(added))}")
                        if notes:
                            print(f"{script} --preset {preset}: resolved flags " + "; ".join(notes))
                        failed |= bool(diffs)
                for script in scripts:
                    before = run_script(base_tree, script, tmp / "out-base", args.steps)
                    after = run_script(ROOT, script, tmp / "out-new", args.steps)
                    diffs, removed, added = compare(before, after)
                    status = "same" if not diffs else f"{len(diffs)} difference(s)"
                    print(
                        f"{script}: {len(after)} rows, {status}"
                        + (
                            f"; only in {args.base}: {', '.join(sorted(removed))}"
                            if removed
                            else ""
                        )
                        + (f"; new: {', '.join(sorted(added))}" if added else "")
                    )
                    for d in diffs[:10]:
                        print(f"    {d}")
                    failed |= bool(diffs)
            finally:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(base_tree)],
                    cwd=ROOT,
                    capture_output=True,
                )
        print("every shared figure is the same" if not failed else "numbers changed")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
