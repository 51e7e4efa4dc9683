"""A side-by-side study of the training scripts on the bundled tiny task, to test TEPO's headline
claim, "reducing convergence time by 50% compared with GRPO/DAPO" (its abstract). The abstract
does not define convergence time; here it is the steps, and the wall-clock seconds, a run takes
to first reach a fixed held-out accuracy (our reading).

    python tools/study.py                    # every default config x seeds 1,2,3, one run at a time
    python tools/study.py --jobs 2           # two runs at once, each with half the CPU cores
    python tools/study.py --configs grpo,dapo,tepo --seeds 1,2,3,4,5 --steps 320
    python tools/study.py --no-run           # only re-aggregate what is already in runs/study
    python tools/study.py --extra "--device cuda"  # flags given to every run alike

The second study (docs/study/PLAN.md, fixed before its runs) is two commands. Development, seeds
1-5, all five configs; its summary picks the new default and prints the threshold to fix:

    python tools/study.py --jobs 2 --configs grpo,dapo,tepo-seq-ppo,tepo,tepo-token-ratio
        --seeds 1,2,3,4,5 --out runs/study2-dev

It picked (b), then tepo.py's default, the config `tepo`. Confirmation, seeds 6-10, the
baselines and the chosen default only, at the development threshold; its summary gives the
verdict by the plan's rule:

    python tools/study.py --jobs 2 --configs grpo,dapo,tepo --seeds 6,7,8,9,10
        --out runs/study2-confirm --threshold 0.470

(Both ran under older names, which their data in docs/study/ keeps: see OLD_NAMES.)

The full default study is 27 runs of 160 steps: 67 minutes at --jobs 2 on a quiet 2-core CPU
(measured on 2026-12-01; its results are in docs/study/).

Each (config, seed) is one ordinary run of a training script, in its own process:

    python <script>.py --seed S --output-dir runs/study/runs --run-name <config>-s<S>
        --eval-every 10 --eval-n 128 --save-every 100000 --sample-every 100000
        --tensorboard false [the config's flags] [--extra flags] [--steps N]

with the scripts' own defaults for everything else, so every algorithm gets the same model,
data, batch size, learning rate and step count: nothing is tuned for one method against another.
The study is resumable: run the same command again. A finished run (its folder has summary.json)
is skipped; a stopped one continues with `<script>.py --resume <folder>` (Ctrl-C or SIGTERM on
the study lets every running run finish its step and save first); a run killed so hard that it
saved no checkpoint is moved aside to `<run>.incomplete-<k>` and started again. A run that fails
is reported with the end of its log, the others go on, and the exit code is 1.

Outputs, in runs/study/ (--out):
    runs/<config>-s<seed>/   the runs themselves (metrics.jsonl, summary.json, checkpoints)
    logs/<run>.log           everything each run printed
    results.csv              one row per run and held-out evaluation: config, seed, step, seconds,
                             greedy_acc, sampled_acc
    steps.csv                one row per run and training step: config, seed, step, seconds,
                             reward, accuracy, entropy, mask_frac, completion_len,
                             truncated_frac, clip_frac, kl, and TEPO's kl_* split of where the
                             KL sits (empty cell = not logged by that script, e.g. mask_frac
                             outside TEPO)
    curves.png               held-out sampled accuracy against step and against seconds, the
                             baselines and the TEPO configs in separate panels; entropy and
                             TEPO's mask_frac against step (mean over seeds, min-max band)
    intervals.png            every other config against GRPO and DAPO, paired by seed: mean
                             ratio of steps and difference in final accuracy, 95% intervals
    kl_diagnosis.png         for each TEPO config, where its KL to the reference sits: by the
                             advantage's sign, on and off the mask, by position; and truncation
    summary.md               final accuracy, steps and seconds to a threshold, ratios to GRPO and
                             DAPO, and the verdict on the claim, with the rule that produced it;
                             with both baselines and a PLAN.md candidate, the plan's statistics
                             paired by seed (bootstrap intervals, its pick of the new default
                             when all three candidates ran, its verdict when one TEPO config ran)

"seconds" is wall-clock time since the run's step-0 row (logged right after the first held-out
evaluation), so it counts every later evaluation, equally for all configs, and not the start-up.
Where the study resumed a run, the stopped interval is not counted: that one step is charged the
median duration of the run's other steps of its kind (with or without an evaluation). With
--jobs > 1 runs share the CPU, so seconds compare fairly only between runs that ran side by side;
steps are exact whatever the machine does.

Default configs (erpo and sapo only where their scripts exist):
    grpo, dapo                 the baselines
    tepo                       TEPO as the studies of the tiny task ran it: predicted entropy test,
                               the sequence ratio clipped at 3e-4 / 4e-4 (PLAN.md's (b); the first
                               study, docs/study/summary.md, ran it and its ablations at 0.2 / 0.28;
                               tepo.py's default is tepo-token-ratio since PLAN-clip-real.md)
    tepo-observed              --entropy-test observed: the mask tests the entropy's observed fall
    erpo, sapo                 the other objectives of this project, for reference
    tepo-token-ratio           ablation: per-token ratios instead of the sequence ratio, clipped
                               at PPO's 0.2 / 0.28 (PLAN.md's candidate (c))
    tepo-no-kl                 ablation: --kl-coef 0, no masked KL term at all
    tepo-mask-ref              ablation: observed test against the reference model's entropy
Not in the default list, only by --configs (every TEPO config spells out its ratio and clip, so
that it runs the same whatever tepo.py's default is):
    tepo-seq-ppo               (a): the sequence ratio clipped at PPO's 0.2 / 0.28 (first reading)
    tepo-seq-mean, grpo-no-kl  docs/study/PLAN-real.md: GRPO's aggregation (retired: tepo.py no
                               longer has --loss-agg; its runs are read, not started); GRPO
                               without its KL
    tepo-len, grpo-len,        docs/study/PLAN-length.md: each script with dapo.py's length term
    erpo-len, sapo-len         in its reward (--overlong-cache 16)
    tepo-len-ppo,              docs/study/PLAN-clip-real.md: tepo-len at PPO's clip range, on the
    tepo-len-token             sequence ratio and per token (tepo.py's default since)
    tepo-len-token-kl0,        docs/study/PLAN-kl-real.md: tepo-len-token with --kl-coef 0, and
    tepo-len-token-klall       with the KL term on every valid token: not a flag of tepo.py but
                               its kl_mask replaced from outside (ARMS: such a run starts as
                               `python tools/study.py --arm CONFIG tepo.py [flags]`)
On a real model the cpu preset has the length term on since PLAN-length's adoption: the real-model
runs named grpo, tepo, erpo, sapo, tepo-seq-*, grpo-no-kl in docs/study/real ran before it, with
it off; repeat one with --extra "... --overlong-cache 0".
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

# the repository: the scripts and common.py live there
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runner  # noqa: E402
from common import UserError, arg  # noqa: E402


# =====================================================================================
# Arguments
# =====================================================================================
@dataclass
class Args:
    configs: str | None = arg(
        None,
        "comma list of configs (default: every config whose script "
        "exists; they are listed at the top of tools/study.py)",
    )
    seeds: str = arg("1,2,3", "comma list of seeds; every config runs every seed")
    runs: str | None = arg(
        None,
        "explicit config:seed pairs, run in this order, instead of every "
        "config x every seed, e.g. tepo-seq-mean:1,dapo:2",
    )
    steps: int | None = arg(
        None,
        "training steps per run (default: the scripts' own, 160 on the "
        "tiny task); a finished run with fewer steps is continued to this many",
    )
    jobs: int = arg(1, "runs at once; each gets max(1, cores // jobs) torch threads")
    out: str = arg("runs/study", "study folder: runs/, logs/, results.csv, curves.png, summary.md")
    threshold_frac: float = arg(
        0.9, "threshold = this x GRPO's final mean held-out sampled accuracy (unless --threshold)"
    )
    threshold: float | None = arg(
        None,
        "a fixed held-out sampled accuracy threshold in (0, 1] "
        "instead of --threshold-frac's; PLAN.md fixes it from the "
        "development seeds for the confirmation seeds (their summary "
        "prints the exact value)",
    )
    no_run: bool = arg(False, "start no run: only aggregate the finished runs already in --out")
    eval_every: int = arg(10, "held-out evaluation every N steps (and at the first and last)")
    eval_n: int = arg(128, "held-out problems per evaluation")
    extra: str = arg(
        "",
        'more flags given to every run alike, e.g. --extra "--device cuda" '
        "(one flag alone: --extra=--bf16)",
    )


PPO_CLIP = ["--clip-low", "0.2", "--clip-high", "0.28"]  # PPO's range, as DAPO's
# PLAN.md's (b): the sequence ratio at GSPO's range, tepo.py's default from the second study until
# PLAN-clip-real.md's. Every TEPO config spells out its ratio and clip, so that a name means what
# its recorded runs ran whatever tepo.py's default is.
SEQ = ["--ratio-level", "sequence"]
SEQ_GSPO = [*SEQ, "--clip-low", "3e-4", "--clip-high", "4e-4"]
TOKEN_PPO = ["--ratio-level", "token", *PPO_CLIP]  # PLAN.md's (c), tepo.py's default since
# name -> (script, the flags that make this config); every other flag is the scripts' default
CONFIGS = {
    "grpo": ("grpo", []),
    "dapo": ("dapo", []),
    "tepo": ("tepo", SEQ_GSPO),  # PLAN.md (b)
    "tepo-observed": ("tepo", [*SEQ_GSPO, "--entropy-test", "observed"]),
    "erpo": ("erpo", []),
    "sapo": ("sapo", []),
    "tepo-token-ratio": ("tepo", TOKEN_PPO),  # (c)
    "tepo-no-kl": ("tepo", [*SEQ_GSPO, "--kl-coef", "0"]),
    "tepo-mask-ref": (
        "tepo",
        [*SEQ_GSPO, "--entropy-test", "observed", "--entropy-baseline", "ref"],
    ),
    "tepo-seq-ppo": ("tepo", [*SEQ, *PPO_CLIP]),  # PLAN.md (a)
    "tepo-seq-mean": ("tepo", [*SEQ_GSPO, "--loss-agg", "seq-mean-token-mean"]),  # retired
    "grpo-no-kl": ("grpo", ["--kl-coef", "0"]),  # PLAN-real.md: GRPO without its KL term
    # PLAN-length.md: each script with dapo.py's length term (cpu value), seeds 1-3
    "tepo-len": ("tepo", [*SEQ_GSPO, "--overlong-cache", "16"]),
    "grpo-len": ("grpo", ["--overlong-cache", "16"]),
    "erpo-len": ("erpo", ["--overlong-cache", "16"]),
    "sapo-len": ("sapo", ["--overlong-cache", "16"]),
    # PLAN-clip-real.md: tepo-len with PPO's clip range, on the sequence ratio and per token
    "tepo-len-ppo": ("tepo", ["--overlong-cache", "16", *SEQ, *PPO_CLIP]),
    "tepo-len-token": ("tepo", ["--overlong-cache", "16", *TOKEN_PPO]),
    # PLAN-kl-real.md: tepo-len-token without its KL term, and with it on every valid token (ARMS)
    "tepo-len-token-kl0": ("tepo", ["--overlong-cache", "16", *TOKEN_PPO, "--kl-coef", "0"]),
    "tepo-len-token-klall": ("tepo", ["--overlong-cache", "16", *TOKEN_PPO]),
}
DEFAULT_CONFIGS = list(CONFIGS)[:9]  # the first study's; the later ones only by --configs or --runs
# One name per run. A config's old name, as PLAN.md, PLAN-real.md and the data of the second study
# (docs/study/dev/, confirm/) still spell it, reads as its name today: `tepo-seq-gspo` spelled out
# GSPO's clip 3e-4 / 4e-4 (PLAN.md's (b)), which is `tepo`. (The second
# study's development data also has a `tepo`: tepo.py's default then, (a), today `tepo-seq-ppo`.)
OLD_NAMES = {"tepo-seq-gspo": "tepo"}
# Configs whose flags the scripts no longer have: their finished runs are still read, none starts.
RETIRED = {
    "tepo-seq-mean": "runs tepo.py's --loss-agg, which docs/study/PLAN-real.md's study rejected "
    "and tepo.py no longer has (it is at commit 872b399: run it there)",
}
# every run goes through it: the studies' diagnostics
DIAGNOSTICS = ROOT / "tools" / "diagnostics.py"
STUDY = ROOT / "tools" / "study.py"
# A run of an ARMS config starts (and resumes) as `python tools/study.py --arm CONFIG SCRIPT.py
# [the script's flags]`: the diagnostics' run, with the arm's change made from outside
ARM_FLAG = "--arm"


def kl_on_every_token(tepo) -> list:
    """PLAN-kl-real.md's tepo-len-token-klall, as (owner, name, wrap) triples for
    diagnostics.patched: tepo.py's kl_mask replaced by one that returns every valid token,
    mask.bool(), so the KL term (its coefficient unchanged) is on all of them, as GRPO's is; the
    lesson gains no flag for a study arm. tepo_stats then logs truthfully mask_frac 1 and
    masked_kl = kl (diagnostics: kl_off_mask 0, no token is off M); so that the arm can be read
    beside tepo-len-token, TEPO's own mask is still computed, unused, and tepo_stats gains its
    share and the KL on and off it: tepo_mask_frac, tepo_masked_kl, kl_off_tepo_mask."""
    import torch

    own = {}  # TEPO's own mask for the micro-batch whose M was built last

    def kl_mask(original):
        def every_valid_token(advantages, entropy_falls, mask):
            own["M"] = original(advantages, entropy_falls, mask)
            return mask.bool()

        return every_valid_token

    def tepo_stats(original):
        def wrapper(**terms):  # tepo.py passes its terms by name: a change of that fails here
            out = original(**terms)
            M, m, ref_logp = own["M"], terms["mask"].bool(), terms["ref_logp"]
            if M.shape != m.shape:
                raise RuntimeError(f"TEPO's mask {tuple(M.shape)} is not this micro-batch's")
            with torch.no_grad():
                other = m & ~M
                out["tepo_mask_frac"] = (M.sum() / m.sum().clamp(min=1)).item()
                if ref_logp is not None:  # as tepo_stats's masked_kl, diagnostics' kl_off_mask
                    kl = tepo.k3_kl(ref_logp, terms["logp"].detach())
                    on, off = torch.where(M, kl, 0.0).sum(), torch.where(other, kl, 0.0).sum()
                    out["tepo_masked_kl"] = (on / M.sum().clamp(min=1)).item()
                    out["kl_off_tepo_mask"] = (off / other.sum().clamp(min=1)).item()
            return out

        return wrapper

    return [(tepo, "kl_mask", kl_mask), (tepo, "tepo_stats", tepo_stats)]


# Configs whose change is made from outside the script, by a function of the script module that
# returns what to patch (tools/diagnostics.py's way of reading a script)
ARMS = {"tepo-len-token-klall": kl_on_every_token}
BASELINES = ("grpo", "dapo")  # the claim compares TEPO with these two
# PLAN.md's candidate readings (a), (b), (c) for tepo.py's default; (a) stays without evidence.
# (b), picked, was tepo.py's default until PLAN-clip-real.md chose (c) on the real model.
CANDIDATES = ("tepo-seq-ppo", "tepo", "tepo-token-ratio")
ACC_TIE = 0.01  # PLAN.md: final sampled accuracies within this of each other do not decide
CLAIMED = "tepo"  # the config the verdict is about: (b), tepo.py's default when it ran
CLAIM_RATIO = 0.6  # "about half the time": at most 0.6x the baseline's steps (or seconds)
FIXED_FLAGS = ["--save-every", "100000", "--sample-every", "100000", "--tensorboard", "false"]


def script_available(script: str) -> bool:
    """Does <script>.py exist and define train()? (Read, not imported: importing loads torch.)"""
    path = ROOT / f"{script}.py"
    return path.is_file() and re.search(r"^def train\(", path.read_text(), re.M) is not None


def resolve_configs(names: str | None) -> list[str]:
    if names is None:
        return [c for c in DEFAULT_CONFIGS if script_available(CONFIGS[c][0])]
    out = [OLD_NAMES.get(c.strip(), c.strip()) for c in names.split(",") if c.strip()]
    for c in out:
        if c not in CONFIGS:
            raise UserError(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
        if not script_available(CONFIGS[c][0]):
            raise UserError(f"config {c!r} needs {CONFIGS[c][0]}.py with a train() function")
    if not out or len(set(out)) < len(out):
        raise UserError(f"--configs must list distinct configs, not {names!r}")
    return out


def resolve_seeds(seeds: str) -> list[int]:
    try:
        out = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds must be a comma list of integers, not {seeds!r}") from None
    if not out or len(set(out)) < len(out):
        raise UserError(f"--seeds must list distinct seeds, not {seeds!r}")
    return out


def check_args(args: Args) -> None:
    runner.check_args(
        args,
        {
            f"--jobs must be at least 1, not {args.jobs}": args.jobs >= 1,
            f"--threshold-frac must be in (0, 1], not {args.threshold_frac}": 0
            < args.threshold_frac
            <= 1,
            f"--threshold must be in (0, 1], not {args.threshold}": args.threshold is None
            or 0 < args.threshold <= 1,
        },
    )  # --steps, --eval-every, --eval-n >= 1: checked by name in runner.check_args


def run_name(config: str, seed: int) -> str:
    return f"{config}-s{seed}"


# =====================================================================================
# Planning: what each run needs (skip, start, resume, restart)
# =====================================================================================
def plan_run(run_dir: Path, steps: int | None) -> str:
    """'skip': finished (summary.json), with at least `steps` steps when given;
    'resume': stopped with a checkpoint, or finished with fewer steps than asked;
    'restart': started but left no checkpoint (killed hard): moved aside, then started anew;
    'fresh': nothing there yet (or only the args.json of a start that failed)."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        done = json.loads(summary.read_text()).get("steps", 0)
        return "resume" if steps is not None and done < steps else "skip"
    if (run_dir / "latest").is_file() or any(run_dir.glob("checkpoint-*/trainer_state.pt")):
        return "resume"
    return "restart" if run_dir.is_dir() and runner.started(run_dir) else "fresh"


def move_aside(run_dir: Path) -> Path:
    k = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.incomplete-{k}")).exists():
        k += 1
    run_dir.rename(aside)
    return aside


def checkpoint_step(run_dir: Path) -> int:
    return int(runner.find_checkpoint(run_dir).name.split("-")[-1])


def read_resumes(path: Path) -> set[int]:
    """Steps after which the study resumed a run (one per line)."""
    return {int(s) for s in path.read_text().split()} if path.is_file() else set()


@dataclass
class Job:
    name: str
    cmd: list[str]
    log: Path
    append: bool = False  # a resume adds to the run's log instead of replacing it
    proc: subprocess.Popen | None = None


def resolve_runs(runs: str) -> list[tuple[str, int]]:
    """--runs "a:1,b:2" -> [("a", 1), ("b", 2)], each config known and each seed an integer.

    >>> resolve_runs("tepo-no-kl:1, dapo:2")
    [('tepo-no-kl', 1), ('dapo', 2)]
    """
    pairs = []
    for item in (x.strip() for x in runs.split(",") if x.strip()):
        config, _, seed = item.rpartition(":")
        config = OLD_NAMES.get(config, config)
        if config not in CONFIGS or not seed.lstrip("-").isdigit():
            raise UserError(
                f"--runs takes config:seed pairs with a known config, not {item!r} "
                f"(configs: {', '.join(CONFIGS)})"
            )
        pairs.append((config, int(seed)))
    if not pairs:
        raise UserError("--runs is empty")
    return pairs


def launcher(config: str, script: str) -> list[str]:
    """The command a run of `config` starts (or resumes) with, before the script's flags: the
    diagnostics', or for an ARMS config this file's --arm, so that a resume keeps the change."""
    if config in ARMS:
        return [sys.executable, str(STUDY), ARM_FLAG, config, script]
    return [sys.executable, str(DIAGNOSTICS), script]


def run_arm(argv: list[str]) -> int:
    """`--arm CONFIG SCRIPT.py [flags]`: one run of an ARMS config through tools/diagnostics.py,
    the arm's change in place (and undone after)."""
    if len(argv) < 2 or argv[0] not in ARMS or Path(argv[1]).stem != CONFIGS[argv[0]][0]:
        raise UserError(
            f"usage: {ARM_FLAG} CONFIG SCRIPT.py [flags], CONFIG one of {', '.join(ARMS)} "
            f"with its own script, not {' '.join(argv[:2])!r}"
        )
    from tools import diagnostics

    script = importlib.import_module(CONFIGS[argv[0]][0])  # the module diagnostics runs
    changes = ARMS[argv[0]](script)
    missing = [name for owner, name, _ in changes if not hasattr(owner, name)]
    if missing:  # patched() skips a name the owner lacks: the arm would run as its baseline
        raise UserError(f"{argv[0]}: {script.__name__}.py has no {', '.join(missing)}")
    with diagnostics.patched(*changes):
        diagnostics.main(argv[1:])
    return 0


def make_jobs(
    args: Args,
    configs: list[str],
    seeds: list[int],
    out: Path,
    pairs: list[tuple[str, int]] | None = None,
) -> list[Job]:
    """The runs still to do, seed by seed so that with --jobs > 1 the configs share the machine
    alike (or in the order of `pairs`). Moves aside what cannot be resumed, and notes each
    resume's step for the timing. Each run goes through tools/diagnostics.py."""
    jobs = []
    for config, seed in pairs or [(c, s) for s in seeds for c in configs]:
        name = run_name(config, seed)
        run_dir, log = out / "runs" / name, out / "logs" / f"{name}.log"
        resumes = out / "logs" / f"{name}.resumes"
        script = str(ROOT / f"{CONFIGS[config][0]}.py")
        start = launcher(config, script)
        steps = ["--steps", str(args.steps)] if args.steps is not None else []
        action = plan_run(run_dir, args.steps)
        if action == "skip":
            continue
        if config in RETIRED:
            raise UserError(f"{name}: config {config!r} {RETIRED[config]}")
        if action == "resume":
            with open(resumes, "a") as f:
                f.write(f"{checkpoint_step(run_dir)}\n")
            jobs.append(
                Job(
                    name,
                    [*start, "--resume", str(run_dir), *steps],
                    log,
                    append=True,
                )
            )
            continue
        if action == "restart":
            tqdm.write(
                f"{name}: stopped without a checkpoint; moved to "
                f"{move_aside(run_dir).name}, starting again"
            )
        resumes.unlink(missing_ok=True)
        jobs.append(
            Job(
                name,
                [
                    *start,
                    "--seed",
                    str(seed),
                    "--output-dir",
                    str(out / "runs"),
                    "--run-name",
                    name,
                    "--eval-every",
                    str(args.eval_every),
                    "--eval-n",
                    str(args.eval_n),
                    *FIXED_FLAGS,
                    *CONFIGS[config][1],
                    *shlex.split(args.extra),
                    *steps,
                ],
                log,
            )
        )
    return jobs


def check_same_settings(out: Path, args: Args, configs: list[str]) -> None:
    """A study folder holds runs made with one set of flags: mixing would compare unlike runs."""
    path = out / "study.json"
    now = {
        "eval_every": args.eval_every,
        "eval_n": args.eval_n,
        "extra": shlex.split(args.extra),
        "configs": {c: CONFIGS[c][1] for c in configs},
    }
    if path.is_file():
        before = json.loads(path.read_text())
        for key in ("eval_every", "eval_n", "extra"):
            if before[key] != now[key]:
                raise UserError(
                    f"{out} was run with --{key.replace('_', '-')} {before[key]!r}, "
                    f"not {now[key]!r}: use the same, or another --out"
                )
        for c, flags in now["configs"].items():
            if before["configs"].get(c, flags) != flags:
                raise UserError(
                    f"config {c!r} in {out} was run with {before['configs'][c]}: use another --out"
                )
        now["configs"] = {**before["configs"], **now["configs"]}
    path.write_text(json.dumps(now, indent=2))


# =====================================================================================
# Running: --jobs processes at a time, each logging to its own file
# =====================================================================================
def log_tail(path: Path, n: int = 15) -> str:
    """The last n lines of a log, progress-bar redraws (\\r) split into lines."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return "\n".join("    " + ln for ln in lines[-n:])


def child_env(jobs: int) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cores or 1) // jobs))  # runs side by side must not oversubscribe cores
    return {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _stop(signum, frame):  # SIGTERM on the study: stop like Ctrl-C
    raise KeyboardInterrupt


def run_jobs(jobs: list[Job], n_parallel: int, poll_s: float = 0.5) -> list[str]:
    """Run every job, n_parallel at a time; returns the names of those that failed. On Ctrl-C
    or SIGTERM each running script gets SIGTERM (it saves a checkpoint and stops), the study
    waits for them and exits 130: the same command then resumes them."""
    env, failed, waiting, running = child_env(n_parallel), [], list(jobs), []
    bar = tqdm(total=len(jobs), desc="study", unit="run", dynamic_ncols=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        while waiting or running:
            while waiting and len(running) < n_parallel:
                job = waiting.pop(0)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                with open(job.log, "a" if job.append else "w") as f:
                    f.write(f"$ {shlex.join(job.cmd)}\n")
                    f.flush()
                    job.proc = subprocess.Popen(
                        job.cmd,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=ROOT,
                        env=env,
                    )
                running.append(job)
                bar.set_postfix_str(f"running {', '.join(j.name for j in running)}")
            time.sleep(poll_s)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                bar.update(1)
                if job.proc.returncode != 0:
                    failed.append(job.name)
                    tqdm.write(
                        f"FAILED {job.name} (exit {job.proc.returncode}); the end of "
                        f"{job.log}:\n{log_tail(job.log)}",
                        file=sys.stderr,
                    )
    except KeyboardInterrupt:
        tqdm.write(
            f"stopping: {len(running)} running run(s) finish their step and save a "
            f"checkpoint; run the same command again to continue"
        )
        for job in running:
            job.proc.send_signal(signal.SIGTERM)  # after a terminal's SIGINT, still only a stop
        for job in running:
            job.proc.wait()
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
    return failed


# =====================================================================================
# Reading runs: metrics rows with seconds
# =====================================================================================
def is_eval(row: dict) -> bool:
    return row.get("eval/sampled_acc") is not None


def elapsed_seconds(rows: list[dict], resumed_after: set[int] = frozenset()) -> list[float]:
    """Seconds since the first row (step 0, right after the first evaluation) for each row:
    the sum of the gaps between consecutive rows. The gap into the first step after a resume
    would count the time the run was stopped; it is replaced by the median gap of the run's
    other rows of the same kind (evaluating or not).

    >>> rows = [{"step": 0, "time": 100.0}, {"step": 1, "time": 102.0},
    ...         {"step": 2, "time": 900.0}, {"step": 3, "time": 904.0}]
    >>> elapsed_seconds(rows, resumed_after={1})  # step 2 charged the median of 2 and 4
    [0.0, 2.0, 5.0, 9.0]
    """
    gaps = [0.0] + [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    resumed = [i > 0 and rows[i]["step"] - 1 in resumed_after for i in range(len(rows))]
    for i in (i for i, r in enumerate(resumed) if r):
        same = [
            gaps[j]
            for j in range(1, len(rows))
            if not resumed[j] and is_eval(rows[j]) == is_eval(rows[i])
        ]
        other = [gaps[j] for j in range(1, len(rows)) if not resumed[j]]
        gaps[i] = statistics.median(same or other or [0.0])
    out, total = [], 0.0
    for g in gaps:
        total += g
        out.append(total)
    return out


def load_runs(out: Path, configs: list[str], seeds: list[int]):
    """{(config, seed): rows with "seconds"} for finished runs, and the names of unfinished ones."""
    runs, unfinished = {}, []
    for config in configs:
        for seed in seeds:
            name = run_name(config, seed)
            run_dir = out / "runs" / name
            if not (run_dir / "summary.json").is_file():
                if run_dir.is_dir():
                    unfinished.append(name)
                continue
            rows = runner.read_metrics(run_dir)
            secs = elapsed_seconds(rows, read_resumes(out / "logs" / f"{name}.resumes"))
            runs[config, seed] = [{**r, "seconds": s} for r, s in zip(rows, secs)]
    return runs, unfinished


# =====================================================================================
# Aggregation: final accuracy, time to threshold
# =====================================================================================
def final_eval(rows: list[dict]) -> dict:
    """The last held-out evaluation of a run (the one at its last step)."""
    evals = [r for r in rows if is_eval(r)]
    if not evals:
        raise UserError("a run has no held-out evaluation: was it run with --eval-dataset none?")
    return evals[-1]


def first_reach(rows: list[dict], threshold: float) -> tuple[int, float] | None:
    """(step, seconds) of the first evaluation whose sampled accuracy is >= threshold, or None.

    >>> rows = [{"step": 0, "seconds": 0.0, "eval/sampled_acc": 0.2},
    ...         {"step": 10, "seconds": 31.5, "eval/sampled_acc": 0.5},
    ...         {"step": 20, "seconds": 60.0, "eval/sampled_acc": 0.4}]
    >>> first_reach(rows, 0.45), first_reach(rows, 0.6)
    ((10, 31.5), None)
    """
    for r in rows:
        if is_eval(r) and r["eval/sampled_acc"] >= threshold:
            return r["step"], r["seconds"]
    return None


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (divide by n - 1); None where undefined.

    >>> [round(v, 6) for v in mean_std([0.4, 0.5, 0.6])]
    [0.5, 0.1]
    >>> mean_std([30]), mean_std([])
    ((30.0, None), (None, None))
    """
    if not xs:
        return None, None
    return sum(xs) / len(xs), statistics.stdev(xs) if len(xs) > 1 else None


def threshold_of(runs: dict, threshold_frac: float) -> float | None:
    """threshold_frac x GRPO's final held-out sampled accuracy, averaged over its seeds."""
    finals = [final_eval(rows)["eval/sampled_acc"] for (c, _), rows in runs.items() if c == "grpo"]
    return threshold_frac * mean_std(finals)[0] if finals else None


def aggregate(
    runs: dict, configs: list[str], threshold: float | None, eval_every: int = 10
) -> dict:
    """Per config: seeds, held-out sampled accuracy before training ("start") and at the end,
    final greedy accuracy, and per-seed steps / seconds to the threshold (None: never reached,
    or no threshold), and PLAN.md's censored steps (never reached: last step + eval_every)."""
    stats = {}
    for config in configs:
        seeds = sorted(s for c, s in runs if c == config)
        if not seeds:
            continue
        finals = [final_eval(runs[config, s]) for s in seeds]
        reach = [
            first_reach(runs[config, s], threshold) if threshold is not None else None
            for s in seeds
        ]
        stats[config] = {
            "seeds": seeds,
            "start": [
                next(r for r in runs[config, s] if is_eval(r))["eval/sampled_acc"] for s in seeds
            ],
            "steps": max(runs[config, s][-1]["step"] for s in seeds),
            "sampled": [f["eval/sampled_acc"] for f in finals],
            "greedy": [f["eval/greedy_acc"] for f in finals],
            "reach_steps": [r[0] if r else None for r in reach],
            "reach_seconds": [r[1] if r else None for r in reach],
            "censored_steps": [
                censored_steps(runs[config, s], threshold, runs[config, s][-1]["step"], eval_every)
                if threshold is not None
                else None
                for s in seeds
            ],
            "mask_frac": [run_mean(runs[config, s], "mask_frac") for s in seeds],
            "seconds_per_step": [
                runs[config, s][-1]["seconds"] / max(1, runs[config, s][-1]["step"]) for s in seeds
            ],
        }
    return stats


def run_mean(rows: list[dict], key: str) -> float | None:
    """Mean of `key` over a run's training steps that logged it (None if none did).

    >>> rows = [{"step": 0}, {"step": 1, "mask_frac": 0.1}, {"step": 2, "mask_frac": 0.3}]
    >>> run_mean(rows, "mask_frac")
    0.2
    """
    return mean_std([r[key] for r in rows if r["step"] > 0 and r.get(key) is not None])[0]


def reached_mean(values: list) -> float | None:
    return mean_std([v for v in values if v is not None])[0]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# =====================================================================================
# The verdict: does TEPO reach the threshold in about half of GRPO's / DAPO's time?
# =====================================================================================
VERDICT_RULE = f"""\
For one baseline (GRPO or DAPO) and one measure (steps, or seconds) to the threshold, per seed,
where a run that never reaches the threshold counts as slower than any run that does:
- **confirmed**: every TEPO run reaches the threshold, TEPO's mean is at most {CLAIM_RATIO} x the
  baseline's mean (means over the runs that reached it), and every TEPO run is faster than every
  baseline run (the spreads over seeds do not overlap);
- **refuted**: no TEPO run reaches the threshold, or TEPO's mean is no lower than the baseline's
  (TEPO is not faster at all), or even TEPO's fastest run takes more than {CLAIM_RATIO} x the
  baseline's slowest run that reached it (no pairing of seeds shows the cut);
- **inconclusive**: anything else (the spreads overlap, or TEPO is faster on average but not by
  {CLAIM_RATIO} x, or some TEPO run never reaches the threshold), or the baseline never reaches it.
The claim is about both baselines: it is confirmed when it is confirmed against each baseline
present, refuted when it is refuted against either, and inconclusive otherwise. There is no
verdict without finished `grpo` and `tepo` runs, or when the threshold is not above the mean
accuracy before training (every run would meet it at step 0). The rule is ours (the paper gives
none); {CLAIM_RATIO} x rather than 0.5 x leaves room for the eval-step granularity of the times."""


def compare(tepo: list, base: list, claim_ratio: float = CLAIM_RATIO) -> str:
    """The rule above for one baseline and one measure. Each list holds one value per seed
    (steps or seconds to the threshold), None for a run that never reached it.

    >>> compare([40, 50, 40], [100, 90, 110])  # 0.43x, no overlap
    'confirmed'
    >>> compare([40, 100, 40], [100, 90, 110])  # 0.6x on average, but one seed overlaps
    'inconclusive'
    >>> compare([120, 100, None], [100, 90, 110]), compare([None, None], [10, 20])
    ('refuted', 'refuted')
    >>> compare([70, 80, 75], [100, 90, 110])  # faster, but even 70 / 110 > 0.6
    'refuted'
    """
    t = [v for v in tepo if v is not None]
    b = [v for v in base if v is not None]
    if not b:
        return "inconclusive"
    if not t or mean_std(t)[0] >= mean_std(b)[0] or min(t) > claim_ratio * max(b):
        return "refuted"
    if len(t) == len(tepo) and mean_std(t)[0] <= claim_ratio * mean_std(b)[0] and max(t) < min(b):
        return "confirmed"
    return "inconclusive"


def combine(verdicts: list[str]) -> str:
    """The claim names both baselines: confirmed only against each, refuted against either."""
    if "refuted" in verdicts:
        return "refuted"
    return "confirmed" if verdicts and all(v == "confirmed" for v in verdicts) else "inconclusive"


def verdict(stats: dict, threshold: float | None) -> tuple[str | None, str]:
    """(the verdict in steps, or None when there is nothing to judge; a paragraph)."""
    bases = [b for b in BASELINES if b in stats]
    if CLAIMED not in stats and (others := [c for c in stats if CONFIGS[c][0] == "tepo"]):
        return None, (
            f"No verdict by this rule, which judges the config `{CLAIMED}`; for "
            f"`{'`, `'.join(others)}` see the paired statistics below."
        )
    if threshold is None or CLAIMED not in stats or not bases:
        return None, (
            "No verdict: it needs finished runs of `grpo` (for the threshold), of "
            "`tepo`, and of `grpo` or `dapo`."
        )
    t = stats[CLAIMED]
    start = mean_std([a for c in (CLAIMED, *bases) for a in stats[c]["start"]])[0]
    if threshold <= start + 1e-9:  # (float sums: 0.2 six times averages to 0.19999...)
        return None, (
            f"No verdict: the threshold {threshold:.3f} is not above the accuracy "
            f"before training ({start:.3f}), so reaching it says nothing about speed. "
            f"Train longer (--steps) or raise --threshold-frac."
        )
    parts, by_measure = [], {}
    for measure, unit in (("reach_steps", "steps"), ("reach_seconds", "seconds")):
        each = {b: compare(t[measure], stats[b][measure]) for b in bases}
        by_measure[unit] = combine(list(each.values()))
        details = []
        for b in bases:
            r = ratio(reached_mean(t[measure]), reached_mean(stats[b][measure]))
            details.append(
                f"against {b.upper()} {each[b]} (TEPO {_fmt_reach(t[measure])} vs "
                f"{_fmt_reach(stats[b][measure])}, ratio {_fmt_ratio(r)})"
            )
        details = "; ".join(details)
        parts.append(f"In {unit}: **{by_measure[unit]}**: {details}.")
    head = (
        f"Claim (TEPO's abstract): \"reducing convergence time by 50% compared with "
        f'GRPO/DAPO", read here as steps (and seconds) to {threshold:.3f} held-out sampled '
        f"accuracy, over {len(t['seeds'])} TEPO seed(s). "
    )
    tail = (
        " Steps are the measure the machine cannot disturb; seconds also count each "
        "script's cost per step (DAPO regenerates dropped groups, TEPO computes a mask) and "
        "are fair only between runs that shared the machine alike. This is a 0.8M-parameter "
        "model on a toy arithmetic task, not the paper's setting: the verdict says whether "
        "the effect shows at this scale, not whether the paper's numbers hold."
    )
    if missing := [b for b in BASELINES if b not in stats]:
        tail += f" Not compared (no finished runs): {', '.join(missing)}."
    return by_measure["steps"], head + " ".join(parts) + tail


# =====================================================================================
# Paired statistics (docs/study/PLAN.md)
# =====================================================================================
def censored_steps(rows: list[dict], threshold: float, max_steps: int, eval_every: int) -> int:
    """Steps to the threshold, where a run that never reaches it counts as the evaluation after
    its last one (PLAN.md: 160 + 10 = 170): a lower bound on its true steps, so it favours that run.

    >>> rows = [{"step": 0, "seconds": 0.0, "eval/sampled_acc": 0.2},
    ...         {"step": 10, "seconds": 30.0, "eval/sampled_acc": 0.5},
    ...         {"step": 11, "seconds": 33.0}]
    >>> censored_steps(rows, 0.5, 160, 10), censored_steps(rows, 0.6, 160, 10)
    (10, 170)
    """
    reached = first_reach(rows, threshold)
    return reached[0] if reached else max_steps + eval_every


def percentile_interval(means: list[float], level: float = 0.95) -> tuple[float, float]:
    """bootstrap_ci's percentile convention, written once: with the B values sorted,
    m[0] <= ... <= m[B - 1], and k = floor((1 - level) / 2 x B), the interval is
    (m[k], m[B - 1 - k]); B - 1 - k is ceil((1 + level) / 2 x B) - 1. At 95% with B = 10,000:
    m[250] and m[9749], the 251st smallest and the 251st largest.

    >>> percentile_interval(list(range(10000)))
    (250, 9749)
    >>> percentile_interval(list(range(40))), percentile_interval(list(range(20)))
    ((1, 38), (0, 19))
    >>> percentile_interval(list(range(100)), level=0.9)  # (1 - 0.9) / 2 x 100: 4.99999...
    (5, 94)
    """
    m = sorted(means)
    k = math.floor((1 - level) / 2 * len(m) + 1e-9)  # + 1e-9: float products just under an integer
    return m[k], m[len(m) - 1 - k]


def bootstrap_ci(
    values: list[float], n_boot: int = 10000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """PLAN.md's percentile bootstrap interval of the mean, numpy-free so that it is the same
    everywhere: n_boot resamples of the values with replacement (random.Random(seed).choices,
    as many as there are values), the mean of each, then percentile_interval. With five seeds it
    is wide; that is the point of reporting it.

    >>> bootstrap_ci([0.0, 1.0])  # means 0, 0.5, 1 with p 1/4, 1/2, 1/4: both ends are > 2.5%
    (0.0, 1.0)
    >>> bootstrap_ci([0, 0, 0, 1])  # P(mean >= 0.75) = 13/256 = 5.1% > 2.5% > P(mean = 1) = 0.4%
    (0.0, 0.75)
    >>> bootstrap_ci([-20, -30, -40])  # 3 seeds: each end has p 1/27 = 3.7% > 2.5%: min and max
    (-40.0, -20.0)
    >>> bootstrap_ci([2, 2, 2]), bootstrap_ci([7])
    ((2.0, 2.0), (7.0, 7.0))
    """
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng, n = random.Random(seed), len(values)
    return percentile_interval([sum(rng.choices(values, k=n)) / n for _ in range(n_boot)], level)


def paired(x: dict[int, float], y: dict[int, float]) -> list[tuple[float, float]]:
    """(x_s, y_s) for the seeds both ran, in seed order: a seed fixes the prompt order and the
    sampling for every config alike, so seed s of one config is compared with seed s of another.

    >>> paired({3: 30, 1: 10, 2: 20}, {2: 4, 3: 5, 4: 6})
    [(20, 4), (30, 5)]
    """
    return [(x[s], y[s]) for s in sorted(x.keys() & y.keys())]


def differences(pairs: list[tuple[float, float]]) -> list[float]:
    """d_s = X_s - Y_s per seed.

    >>> differences([(20, 40), (30, 60)])
    [-20, -30]
    """
    return [a - b for a, b in pairs]


def ratios(pairs: list[tuple[float, float]]) -> list[float] | None:
    """r_s = X_s / Y_s per seed; None when a Y_s is 0 (a baseline at the threshold at step 0:
    the threshold is not above the accuracy before training, and there is no ratio).

    >>> ratios([(20, 40), (30, 60)]), ratios([(20, 40), (30, 0)])
    ([0.5, 0.5], None)
    """
    return None if any(b == 0 for _, b in pairs) else [a / b for a, b in pairs]


def by_seed(s: dict, key: str) -> dict[int, float]:
    """One config's per-seed list from aggregate(), as {seed: value}."""
    return dict(zip(s["seeds"], s[key]))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def claim_verdict(lo: float, hi: float) -> str:
    """PLAN.md's verdict on "50% faster" against one baseline, from the 95% bootstrap interval
    [lo, hi] of the mean paired ratio of steps: confirmed if hi < 1 (faster, with confidence) and
    lo <= 0.5 (a halving is within the interval, or beaten); refuted if lo > 0.5; else inconclusive.

    >>> claim_verdict(0.3, 0.7), claim_verdict(0.6, 0.9), claim_verdict(0.4, 1.1)
    ('confirmed', 'refuted', 'inconclusive')
    >>> claim_verdict(0.5, 0.9), claim_verdict(0.3, 1.0)  # lo = 0.5 is within, hi = 1 is not < 1
    ('confirmed', 'inconclusive')
    """
    if hi < 1 and lo <= 0.5:
        return "confirmed"
    return "refuted" if lo > 0.5 else "inconclusive"


def combine_claim(verdicts: list[str]) -> str:
    """PLAN.md: the claim is confirmed if confirmed against both GRPO and DAPO, refuted if refuted
    against either, inconclusive otherwise.

    >>> combine_claim(["confirmed", "confirmed"]), combine_claim(["confirmed", "inconclusive"])
    ('confirmed', 'inconclusive')
    >>> combine_claim(["inconclusive", "refuted"]), combine_claim([])
    ('refuted', 'inconclusive')
    """
    if "refuted" in verdicts:
        return "refuted"
    return "confirmed" if verdicts and all(v == "confirmed" for v in verdicts) else "inconclusive"


def candidate_scores(stats: dict) -> dict[str, float | None]:
    """PLAN.md's rule, step 1: per candidate present, the larger of its mean paired ratio of
    censored steps to GRPO's and to DAPO's (it must be fast against both); None where a ratio is
    undefined or a baseline is missing.

    >>> st = lambda steps: {"seeds": [1, 2], "censored_steps": steps}
    >>> candidate_scores({"grpo": st([100, 200]), "dapo": st([200, 100]),
    ...                   "tepo-seq-ppo": st([20, 100])})
    {'tepo-seq-ppo': 0.55}
    """
    scores = {}
    for c in (c for c in CANDIDATES if c in stats):
        means = []
        for b in BASELINES:
            r = b in stats and ratios(
                paired(by_seed(stats[c], "censored_steps"), by_seed(stats[b], "censored_steps"))
            )
            means.append(_mean(r) if r else None)
        scores[c] = None if None in means else max(means)
    return scores


def pick_default(stats: dict) -> tuple[str | None, str]:
    """PLAN.md's rule for tepo.py's new default, on the development seeds: (the config, or None
    when the rule cannot be applied; the reason). 1. score = candidate_scores; 2. the lowest
    score wins (a tie goes to the earlier of CANDIDATES); 3. if the bootstrap interval of the two
    best candidates' paired difference in censored steps contains 0 (ends included), the one with
    the higher mean final sampled accuracy over the same seeds wins instead, and if those are
    within ACC_TIE (0.01, included), (a) `tepo-seq-ppo` stays: no change without evidence."""
    if missing := [c for c in (*CANDIDATES, *BASELINES) if c not in stats]:
        return None, f"no pick: no finished runs of {', '.join(missing)}"
    scores = candidate_scores(stats)
    if None in scores.values():
        return None, (
            "no pick: a baseline run was at the threshold at step 0 (the threshold is "
            "not above the accuracy before training), so a ratio is undefined"
        )
    ranked = sorted(CANDIDATES, key=lambda c: (scores[c], CANDIDATES.index(c)))
    best, second = ranked[:2]
    steps = differences(
        paired(by_seed(stats[best], "censored_steps"), by_seed(stats[second], "censored_steps"))
    )
    if not steps:
        return None, f"no pick: {best} and {second} have no seed in common"
    lo, hi = bootstrap_ci(steps)
    why = (
        "scores (the larger of the mean paired step ratios to GRPO and to DAPO): "
        + ", ".join(f"{c} {scores[c]:.3f}" for c in CANDIDATES)
        + f"; the two best, {best} and {second}: paired difference in steps {_mean(steps):+.1f} "
        f"[95% CI {lo:+.1f}, {hi:+.1f}]"
    )
    if not lo <= 0 <= hi:
        return best, why + f" excludes 0, so the lowest score wins: `{best}`"
    acc = paired(by_seed(stats[best], "sampled"), by_seed(stats[second], "sampled"))
    a, b = _mean([x for x, _ in acc]), _mean([y for _, y in acc])
    why += f" contains 0, so the final sampled accuracy decides: {best} {a:.3f}, {second} {b:.3f}"
    if abs(a - b) <= ACC_TIE + 1e-9:  # + 1e-9: 0.61 - 0.60 is 0.0100000000000000009 in floats
        return CANDIDATES[0], why + (
            f", within {ACC_TIE}: (a) `{CANDIDATES[0]}` stays (no change without evidence)"
        )
    winner = best if a > b else second
    return winner, why + f": `{winner}`, the higher"


def _fmt_ci(values: list[float] | None, fmt: str) -> str:
    """mean [95% CI lo, hi] of the values, each with the format spec `fmt`; - when undefined."""
    if not values:
        return "-"
    lo, hi = bootstrap_ci(values)
    return f"{_mean(values):{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def paired_section(
    stats: dict, threshold: float | None, eval_every: int
) -> tuple[list[str], str | None]:
    """(summary.md's lines for PLAN.md's analysis, PLAN.md's verdict on the claim or None): no
    lines unless the study has both baselines, a candidate and a threshold; a verdict only when
    one TEPO config ran."""
    if (
        threshold is None
        or any(b not in stats for b in BASELINES)
        or not any(c in stats for c in CANDIDATES)
    ):
        return [], None
    lines = [
        "",
        "## Paired by seed (docs/study/PLAN.md)",
        "",
        "The second study's statistics, fixed in docs/study/PLAN.md before its runs (the "
        "verdict above is the first study's rule). Steps to the threshold "
        f"{threshold:.3f}: the first evaluation at or above it; a run that never reaches it "
        f"counts as its last step + {eval_every} ({160 + eval_every} for 160 steps), a lower "
        "bound that favours it. For a config X against a baseline Y, over the seeds both "
        "ran: the difference d_s = X_s - Y_s (steps; final sampled accuracy) and the ratio "
        "r_s = steps X_s / steps Y_s; mean [95% percentile bootstrap interval: 10,000 "
        "resamples of the seeds with replacement, random.Random(0); the sorted resampled "
        "means at indices 250 and 9749].",
        "",
        "| config | vs | seeds paired | never reached (config / baseline) | steps: mean "
        "difference [95% CI] | steps: mean ratio [95% CI] | final sampled acc: mean "
        "difference [95% CI] |",
        "|" + "---|" * 7,
    ]
    for c in (c for c in stats if c not in BASELINES):
        for b in BASELINES:
            steps = paired(by_seed(stats[c], "censored_steps"), by_seed(stats[b], "censored_steps"))
            never = paired(by_seed(stats[c], "reach_steps"), by_seed(stats[b], "reach_steps"))
            acc = paired(by_seed(stats[c], "sampled"), by_seed(stats[b], "sampled"))
            lines.append(
                f"| {c} | {b} | {len(steps)} | {sum(x is None for x, _ in never)} / "
                f"{sum(y is None for _, y in never)} | "
                f"{_fmt_ci(differences(steps), '+.1f')} | {_fmt_ci(ratios(steps), '.3f')} "
                f"| {_fmt_ci(differences(acc), '+.3f')} |"
            )
    seeds = sorted({s for st in stats.values() for s in st["seeds"]})
    lines += [
        "",
        "Per seed: steps to the threshold (* never reached, counted as above) / final "
        "sampled accuracy:",
        "",
        "| seed | " + " | ".join(stats) + " |",
        "|" + "---|" * (len(stats) + 1),
    ]
    for seed in seeds:
        cells = []
        for st in stats.values():
            if seed not in st["seeds"]:
                cells.append("-")
                continue
            i = st["seeds"].index(seed)
            star = "*" if st["reach_steps"][i] is None else ""
            cells.append(f"{st['censored_steps'][i]}{star} / {st['sampled'][i]:.3f}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    if all(c in stats for c in CANDIDATES):
        name, why = pick_default(stats)
        lines += [
            "",
            f"**New default by PLAN.md's rule** (seeds {', '.join(map(str, seeds))}): "
            + (f"`{name}`. " if name else "")
            + why[0].upper()
            + why[1:]
            + ".",
        ]
    tepos, claim = [c for c in stats if CONFIGS[c][0] == "tepo"], None
    if len(tepos) == 1:
        c, each, parts = tepos[0], [], []
        for b in BASELINES:
            r = ratios(
                paired(by_seed(stats[c], "censored_steps"), by_seed(stats[b], "censored_steps"))
            )
            if not r:
                parts.append(
                    f"against {b.upper()} no verdict (no ratio: a {b} run was at the "
                    f"threshold at step 0)"
                )
                each.append("inconclusive")
                continue
            each.append(claim_verdict(*bootstrap_ci(r)))
            parts.append(f"against {b.upper()} **{each[-1]}** (ratio {_fmt_ci(r, '.3f')})")
        claim = f"{combine_claim(each)} (`{c}`, docs/study/PLAN.md's rule)"
        lines += [
            "",
            f'**Verdict on "50% faster" by PLAN.md\'s rule** (`{c}`, seeds '
            f"{', '.join(map(str, sorted(stats[c]['seeds'])))}): "
            + "; ".join(parts)
            + f". The claim: **{combine_claim(each)}**. Against one baseline, from the 95% "
            "interval [lo, hi] of the mean paired ratio of steps: confirmed if hi < 1 and "
            "lo <= 0.5, refuted if lo > 0.5, inconclusive otherwise; the claim is confirmed "
            "if confirmed against both GRPO and DAPO, refuted if refuted against either. A "
            "verdict about this reading on this task and this model, not the paper's "
            "setting.",
        ]
    return lines, claim


# =====================================================================================
# Outputs: CSVs, summary.md, curves.png
# =====================================================================================
# the KL columns: where the KL sits (TEPO), for PLAN.md's diagnosis
STEP_COLUMNS = (
    "reward",
    "accuracy",
    "entropy",
    "mask_frac",
    "completion_len",
    "truncated_frac",
    "clip_frac",
    "kl",
    "masked_kl",
    "kl_pos_adv",
    "kl_neg_adv",
    "kl_off_mask",
    "kl_first_quarter",
    "kl_last_quarter",
    "kl_token_max",
)


def _cell(v) -> str:
    return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def write_csvs(out: Path, runs: dict) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "step", "seconds", "greedy_acc", "sampled_acc"])
        for (config, seed), rows in runs.items():
            for r in rows:
                if is_eval(r):
                    w.writerow(
                        [
                            config,
                            seed,
                            r["step"],
                            _cell(r["seconds"]),
                            _cell(r["eval/greedy_acc"]),
                            _cell(r["eval/sampled_acc"]),
                        ]
                    )
    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "step", "seconds", *STEP_COLUMNS])
        for (config, seed), rows in runs.items():
            for r in rows:
                if r["step"] > 0:  # step 0 is the first evaluation only
                    w.writerow(
                        [
                            config,
                            seed,
                            r["step"],
                            _cell(r["seconds"]),
                            *(_cell(r.get(k)) for k in STEP_COLUMNS),
                        ]
                    )


def _fmt_ms(xs: list[float], digits: int = 3) -> str:
    mean, std = mean_std(xs)
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _fmt_reach(values: list, digits: int = 0) -> str:
    got = [v for v in values if v is not None]
    return f"{_fmt_ms(got, digits)} ({len(got)}/{len(values)} reached)"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def write_summary(
    out: Path,
    args: Args,
    stats: dict,
    threshold: float | None,
    unfinished: list[str],
    configs: list[str],
) -> tuple[str | None, str | None]:
    """Write summary.md; (the first study's verdict, PLAN.md's verdict), each None if none."""
    lines = [
        "# Study: GRPO, DAPO, TEPO and its variants on the bundled tiny task",
        "",
        f"Seeds {args.seeds}; held-out evaluation every {args.eval_every} steps on "
        f"{args.eval_n} problems; every other setting is each script's default"
        + (f", plus `{args.extra}` for every run" if args.extra else "")
        + ".",
        "Accuracies are at each run's last step, mean ± sample std (n - 1) over seeds.",
        "",
    ]
    if stats:
        lines += [
            "Held-out sampled accuracy before training (step 0, the same model for every "
            f"config): {_fmt_ms([a for s in stats.values() for a in s['start']])}.",
            "",
        ]
    if threshold is not None:
        source = (
            f"fixed by --threshold {args.threshold!r}"
            if args.threshold is not None
            else f"= --threshold-frac {args.threshold_frac} x GRPO's final mean sampled accuracy "
            f"(to fix it for other seeds, as PLAN.md does: `--threshold {threshold!r}`)"
        )
        lines += [
            f"**Threshold**: {threshold:.3f} held-out sampled accuracy {source}. Steps and "
            f"seconds to the threshold are those of the first evaluation at or above it; "
            f"their mean is over the runs that reached it (count shown); ratios divide those "
            f"means by GRPO's and DAPO's.",
            "",
        ]
    else:
        lines += ["**No threshold**: there are no finished `grpo` runs.", ""]
    lines += [
        "| config | runs | steps | final sampled acc | final greedy acc | steps to threshold "
        "| seconds to threshold | steps vs GRPO | steps vs DAPO | seconds vs GRPO "
        "| seconds vs DAPO |",
        "|" + "---|" * 11,
    ]
    for c, s in stats.items():
        rs = [
            _fmt_ratio(ratio(reached_mean(s[m]), reached_mean(stats[b][m])) if b in stats else None)
            for m in ("reach_steps", "reach_seconds")
            for b in BASELINES
        ]
        lines.append(
            f"| {c} | {len(s['seeds'])} | {s['steps']} | {_fmt_ms(s['sampled'])} | "
            f"{_fmt_ms(s['greedy'])} | {_fmt_reach(s['reach_steps'])} | "
            f"{_fmt_reach(s['reach_seconds'])} | " + " | ".join(rs) + " |"
        )
    lines += ["", "Per seed, steps to the threshold (- = never reached):", ""]
    for c, s in stats.items():
        per = ", ".join(
            f"s{seed} {v if v is not None else '-'}"
            for seed, v in zip(s["seeds"], s["reach_steps"])
        )
        lines.append(f"- {c}: {per}")
    lines += [
        "",
        "Per training step, each run's mean over its steps, then mean ± std over seeds: "
        "`mask_frac`, the fraction of valid tokens in TEPO's KL mask (- where a script has "
        "no mask), and wall-clock seconds per step, held-out evaluations included:",
        "",
        "| config | mask_frac | seconds per step |",
        "|---|---|---|",
    ]
    for c, s in stats.items():
        masks = [m for m in s["mask_frac"] if m is not None]
        lines.append(
            f"| {c} | {_fmt_ms(masks, 4) if masks else '-'} | {_fmt_ms(s['seconds_per_step'], 2)} |"
        )
    if missing := [c for c in configs if c not in stats]:
        lines += ["", f"No finished runs: {', '.join(missing)}."]
    if unfinished:
        lines += ["", f"Unfinished, left out: {', '.join(unfinished)}."]
    v, paragraph = verdict(stats, threshold)
    lines += [
        "",
        "## Verdict",
        "",
        paragraph,
        "",
        "### The rule",
        "",
        VERDICT_RULE,
        "",
        "### Time",
        "",
        "Seconds are wall-clock seconds since the run's step-0 row (logged "
        "just after the first evaluation): they include every later held-out evaluation, "
        "equally for all configs, but not start-up; a stop and resume is charged as one "
        "ordinary step. With --jobs > 1 runs shared the CPU. Threshold steps can only be "
        f"multiples of --eval-every ({args.eval_every}) or the last step.",
    ]
    paired_lines, claim = paired_section(stats, threshold, args.eval_every)
    (out / "summary.md").write_text("\n".join(lines + paired_lines + [""]))
    return v, claim


def curve(runs: dict, config: str, key: str, x: str = "step"):
    """Mean over seeds of `key` at each step where it was logged, with min and max, against
    the step or the mean seconds at that step: (xs, mean, lo, hi), or None."""
    at = {}
    for (c, _), rows in runs.items():
        if c == config:
            for r in rows:
                if r.get(key) is not None:
                    at.setdefault(r["step"], []).append((r["seconds"], r[key]))
    if not at:
        return None
    steps = sorted(at)
    xs = [s if x == "step" else sum(p[0] for p in at[s]) / len(at[s]) for s in steps]
    ys = [[p[1] for p in at[s]] for s in steps]
    return xs, [sum(v) / len(v) for v in ys], [min(v) for v in ys], [max(v) for v in ys]


def save_small(fig, path: Path, dpi: int = 90) -> None:
    """Save a figure as a PNG of at most a few hundred KB: 128 colours (octree; median cut was seen
    to turn thin orange lines red) where Pillow, which matplotlib depends on, is there."""
    fig.savefig(path, dpi=dpi)
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)


def plot_curves(out: Path, runs: dict, configs: list[str], threshold: float | None) -> bool:
    """curves.png: held-out sampled accuracy against step and against seconds, the baselines (and
    the other non-TEPO scripts) in one panel and the TEPO configs in the next, with GRPO's mean
    drawn thin and grey among the TEPO configs for reference; entropy and TEPO's KL-mask share
    against step. Mean over seeds, min-max band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no curves.png (pip install matplotlib); "
            "results.csv and summary.md are written"
        )
        return False
    tepos = [c for c in configs if CONFIGS.get(c, (c,))[0] == "tepo"]
    groups = [
        ("baselines and other scripts", [c for c in configs if c not in tepos]),
        ("TEPO configs", tepos),
    ]
    panels = [("eval/sampled_acc", "step", g) for g in groups]
    panels += [("entropy", "step", ("", configs))]
    panels += [("eval/sampled_acc", "seconds", g) for g in groups]
    panels += [("mask_frac", "step", ("", tepos))]
    titles = {
        "eval/sampled_acc": "held-out sampled acc",
        "entropy": "entropy (sampling policy)",
        "mask_frac": "TEPO KL-mask fraction",
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, x, (group, members)) in zip(axes.flat, panels):
        c = curve(runs, "grpo", key, x) if group == "TEPO configs" and "grpo" in configs else None
        if c is not None:
            ax.plot(c[0], c[1], color="0.6", lw=1, ls="--", label="grpo (reference)")
        for config in members:
            c = curve(runs, config, key, x)
            if c is None:
                continue
            i = configs.index(config)
            style = dict(color=colours[i % len(colours)], ls="-" if i < len(colours) else "--")
            ax.plot(c[0], c[1], label=config, **style)
            ax.fill_between(c[0], c[2], c[3], alpha=0.15, color=style["color"])
        if threshold is not None and key == "eval/sampled_acc":
            ax.axhline(threshold, color="k", ls=":", lw=1, label=f"threshold {threshold:.3f}")
        ax.set_title(f"{titles[key]}: {group}" if group else titles[key], fontsize=10)
        ax.set_xlabel("training step" if x == "step" else "wall-clock seconds since step 0")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle("mean over seeds, band = min to max")
    fig.tight_layout()
    save_small(fig, out / "curves.png")
    plt.close(fig)
    return True


def plot_intervals(out: Path, stats: dict) -> bool:
    """intervals.png: for every config but the baselines, paired by seed against GRPO and DAPO,
    the mean ratio of steps to the threshold (left; lines at 1 and at the claimed 0.5) and the
    mean difference in final sampled accuracy (right; line at 0), each with its 95% bootstrap
    interval (PLAN.md). Nothing without both baselines."""
    others = [c for c in stats if c not in BASELINES]
    if not others or any(b not in stats for b in BASELINES):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.8 + 0.55 * len(others)))
    measures = [
        ("censored_steps", ratios, "steps to the threshold: ratio to the baseline", (1.0, 0.5)),
        ("sampled", differences, "final sampled accuracy: difference to the baseline", (0.0,)),
    ]
    for ax, (key, pair, title, refs) in zip(axes, measures):
        for j, b in enumerate(BASELINES):
            ys, xs, los, his = [], [], [], []
            for i, c in enumerate(others):
                v = pair(paired(by_seed(stats[c], key), by_seed(stats[b], key)))
                if v:
                    lo, hi = bootstrap_ci(v)
                    ys.append(i + (0.15 if j else -0.15))
                    xs.append(_mean(v))
                    los.append(_mean(v) - lo)
                    his.append(hi - _mean(v))
            ax.errorbar(xs, ys, xerr=[los, his], fmt="o", capsize=3, label=f"vs {b}")
        for r in refs:
            ax.axvline(r, color="k", ls=":" if r == 0.5 else "-", lw=0.8)
        ax.set_yticks(range(len(others)), others, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7)
    fig.suptitle("paired by seed: mean and 95% bootstrap interval", fontsize=10)
    fig.tight_layout()
    save_small(fig, out / "intervals.png")
    plt.close(fig)
    return True


KL_PANELS = [
    (("kl_pos_adv", "kl_neg_adv"), "KL on completions with A > 0 / A < 0"),
    (("masked_kl", "kl_off_mask"), "KL on the mask / off it"),
    (("kl_first_quarter", "kl_last_quarter"), "KL in the first / last quarter"),
    (("truncated_frac",), "completions cut off at the cap"),
]


def plot_kl_diagnosis(out: Path, runs: dict, configs: list[str]) -> bool:
    """kl_diagnosis.png: for each TEPO config that logged where its KL sits (tepo.py's kl_*
    metrics), one row: the KL split by the advantage's sign, by the mask, by position, and the
    share of completions that stop ending; mean over seeds, min-max band, against the step."""
    tepos = [
        c
        for c in configs
        if any(c == k and "kl_pos_adv" in rows[-1] for (k, _), rows in runs.items())
    ]
    if not tepos:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(
        len(tepos), len(KL_PANELS), figsize=(4.2 * len(KL_PANELS), 2.9 * len(tepos)), squeeze=False
    )
    for row, config in zip(axes, tepos):
        for ax, (keys, title) in zip(row, KL_PANELS):
            for key, ls in zip(keys, ("-", "--")):
                c = curve(runs, config, key)
                if c is not None:
                    ax.plot(c[0], c[1], ls=ls, label=key)
                    ax.fill_between(c[0], c[2], c[3], alpha=0.15)
            ax.set_title(f"{config}: {title}", fontsize=9)
            ax.set_xlabel("training step", fontsize=8)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(
        "where TEPO's KL to the reference sits (mean over seeds, band = min to max)", fontsize=10
    )
    fig.tight_layout()
    save_small(fig, out / "kl_diagnosis.png", dpi=80)
    plt.close(fig)
    return True


# =====================================================================================
# Main
# =====================================================================================
def study(args: Args) -> int:
    check_args(args)
    configs, seeds = resolve_configs(args.configs), resolve_seeds(args.seeds)
    pairs = resolve_runs(args.runs) if args.runs else None
    if pairs:  # the study's runs are exactly these
        configs = list(dict.fromkeys(c for c, _ in pairs))
        seeds = sorted({s for _, s in pairs})
    out = Path(args.out).resolve()
    failed = []
    if not args.no_run:
        out.mkdir(parents=True, exist_ok=True)
        check_same_settings(out, args, configs)
        (out / "logs").mkdir(exist_ok=True)
        jobs = make_jobs(args, configs, seeds, out, pairs)
        skipped = (len(pairs) if pairs else len(configs) * len(seeds)) - len(jobs)
        print(
            f"{len(jobs)} run(s) to do, {skipped} already finished, {args.jobs} at a time; "
            f"logs in {out / 'logs'}"
        )
        failed = run_jobs(jobs, args.jobs)
    if not (out / "runs").is_dir():
        raise UserError(f"no runs in {out}: run the study first (without --no-run)")
    runs, unfinished = load_runs(out, configs, seeds)
    threshold = args.threshold
    if threshold is None:
        threshold = threshold_of(runs, args.threshold_frac)
    stats = aggregate(runs, configs, threshold, args.eval_every)
    write_csvs(out, runs)
    v, claim = write_summary(out, args, stats, threshold, unfinished, configs)
    plotted = plot_curves(out, runs, configs, threshold)
    diagnosed = plot_kl_diagnosis(out, runs, configs)
    drawn = plot_intervals(out, stats)
    print(
        f"wrote {out / 'summary.md'}, results.csv, steps.csv"
        + (", curves.png" if plotted else "")
        + (", kl_diagnosis.png" if diagnosed else "")
        + (", intervals.png" if drawn else "")
    )
    # the second study's verdict when it has one (the first study's rule judges `tepo` only)
    print(
        f"verdict on 'TEPO halves GRPO/DAPO's convergence time' (steps): "
        f"{claim or v or 'no verdict'}"
    )
    if failed:
        print(
            f"{len(failed)} run(s) failed: {', '.join(failed)} (see {out / 'logs'})",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [ARM_FLAG]:  # one run of an arm, as make_jobs starts it
        with runner.user_errors():
            return run_arm(argv[1:])
    args = runner.parse_args(Args, argv)
    with runner.user_errors():
        return study(args)


if __name__ == "__main__":
    sys.exit(main())
