"""The real-model studies on SmolLM2-135M-Instruct: docs/study/PLAN-real.md (why TEPO does not
learn), docs/study/PLAN-length.md (every script with a length term in its reward) and
docs/study/PLAN-clip-real.md (TEPO's clip range with the length term). This tool
applies the plans' rules, as numbers, to the runs; tools/study.py runs them:

    python tools/study.py --jobs 2 --eval-every 15 --eval-n 128 --out runs/study-real \\
        --extra "--model models/SmolLM2-135M-Instruct --device cpu --save-every 15" \\
        --runs tepo-seq-mean:1,tepo-seq-mean:2,...      # the plan's order
    python tools/study_real.py                          # -> docs/study/real/

It reads the finished runs in --out (runs/<config>-s<seed>/metrics.jsonl), the runs already
landed in --docs (results.csv, steps.csv: a session's run folder does not outlive it, so each
finished run is committed, and a later session's call keeps it) and the earlier runs the plan
does not rerun (docs/study/real/recorded.csv), and writes to --docs: results.csv (one row
per run and held-out evaluation), steps.csv (one row per training step, with the diagnostics of
tools/diagnostics.py), summary.md (per-seed tables, and the plan's verdict, attribution and
adoption, each with the rule that produced it) and curves.png. Unfinished runs are left out and
named; a rule whose runs are not all in says "pending".
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runner  # noqa: E402
from common import UserError, arg  # noqa: E402
from tools.study import OLD_NAMES, save_small  # noqa: E402

# The plan's numbers (docs/study/PLAN-real.md, "The rules")
SEEDS = (1, 2, 3)
GAIN = 0.05  # a seed "gains" at >= this much held-out greedy accuracy, step 0 -> 60
OF = 2  # in at least 2 of the 3 seeds
STABLE_DROP = 0.05  # stable: step 60 >= step 30 - this
LAST_STEPS = range(51, 61)  # the cut-off share over these training steps
CONFIGS = (
    "grpo", "tepo", "tepo-seq-mean", "tepo-seq-ppo", "dapo", "grpo-no-kl", "erpo", "sapo",
    "tepo-len", "grpo-len", "erpo-len", "sapo-len", "tepo-len-ppo", "tepo-len-token",
    "tepo-len-token-kl0", "tepo-len-token-klall",
)  # fmt: skip
STEP_COLUMNS = (
    "reward",
    "accuracy",
    "entropy",
    "completion_len",
    "truncated_frac",
    "clip_frac",
    "kl",
    "mask_frac",
    "right_cut_off_frac",
    "grad_mass_cut_token_mean",
    "grad_mass_cut_seq_mean",
    "clip_frac_pos_adv",
    "clip_frac_neg_adv",
    "clip_frac_cut",
    "clip_frac_ended",
    "clip_frac_mini1",
    "clip_frac_mini2",
    "explained_var",
    "peak_rss_mb",
    # PLAN-kl-real.md: equal-reward groups, the KL on and off the KL term's mask, and under
    # tepo-len-token-klall (whose mask is every valid token) TEPO's own mask, computed unused
    "zero_std_frac",
    "masked_kl",
    "kl_off_mask",
    "tepo_mask_frac",
    "tepo_masked_kl",
    "kl_off_tepo_mask",
)
ONE_SEED = ("erpo", "sapo")  # seed 1 each, for the README's table (the plan's step 3)
TINY = ("tepo", "tepo-seq-mean")  # adoption: today's default, the candidate (seeds 6-10)
TINY_MARGIN = 0.02
# PLAN-length.md's numbers: each script beside itself with the length term (--overlong-cache 16)
LENGTH = {"tepo": "tepo-len", "grpo": "grpo-len", "erpo": "erpo-len", "sapo": "sapo-len"}
COMMAND_GAIN = 0.10  # if adopted, `python tepo.py --model ... --device cpu` (tepo-len seed 1)
CLAIM_FRAC = 0.9  # TEPO's claim: steps to 0.9 x the baseline's mean step-60 greedy accuracy
CLAIM_RATIO = 0.6  # "about half": at most 0.6 x the baseline's steps
EVAL_STEPS = (15, 30, 45, 60)  # the evaluations after step 0; a run that never reaches: > 60
# PLAN-clip-real.md's numbers: tepo-len against itself with PPO's clip range
CLIP = ("tepo-len-ppo", "tepo-len-token")
CLIP_BASE = "tepo-len"
BETTER = 0.05  # better: mean paired gain difference >= this (and > 0 in 2 of 3 seeds)
SAMPLED_TIE = 0.01  # both better, mean differences within this: the step-60 sampled accuracy
# The cpu preset each run used: every run before 2026-12-06 ran at the first; the second is
# docs/memory.md's choice by measurement (issue 56), checked by seed 1 of every script and seeds
# 1-3 of tepo.py's default (with the length term), PLAN-real's rule as above
FIRST_PRESET = "micro-batch 16"
PRESET = "micro-batch 2"  # common.PRESETS["cpu"] today
PRESET_RUNS = ("dapo", "sapo-len", "grpo-len", "erpo-len", "tepo-len-token")


@dataclass
class Args:
    out: str = arg("runs/study-real", "the study folder tools/study.py ran the plan's runs in")
    docs: str = arg("docs/study/real", "where results.csv, steps.csv, summary.md, curves.png go")
    tiny: str = arg("runs/study-real-tiny", "the tiny task's confirmation runs (adoption rule)")


# =====================================================================================
# Reading: the runs' held-out evaluations and training steps
# =====================================================================================
def _f(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def read_results(path: Path, sources=None) -> dict:
    """{(config, seed, preset): {step: row}} from recorded.csv or results.csv (the rows whose
    source is in `sources`, all if None; rows without a preset ran at FIRST_PRESET)."""
    runs = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if sources is not None and r["source"] not in sources:
                continue
            row = {
                "greedy": _f(r["greedy_acc"]),
                "sampled": _f(r["sampled_acc"]),
                "cut_off_share": _f(r["cut_off_share"]),
                "greedy_cut_off_share": _f(r["greedy_cut_off_share"]),
                "source": r["source"],
            }
            key = (r["config"], int(r["seed"]), r.get("preset") or FIRST_PRESET)
            runs.setdefault(key, {})[int(r["step"])] = row
    return runs


def read_steps(path: Path) -> dict:
    """{(config, seed, preset): [training rows]} from a steps.csv that write_csvs wrote."""
    steps = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            row = {"step": int(r["step"]), **{k: _f(r.get(k)) for k in STEP_COLUMNS}}
            key = (r["config"], int(r["seed"]), r.get("preset") or FIRST_PRESET)
            steps.setdefault(key, []).append(row)
    return steps


def cut_off_share(rows: list[dict], steps) -> float | None:
    """The mean truncated_frac of the training steps in `steps` (None if none was logged)."""
    vals = [
        r["truncated_frac"]
        for r in rows
        if r["step"] in steps and r.get("truncated_frac") is not None
    ]
    return sum(vals) / len(vals) if vals else None


def evals_of(rows: list[dict]) -> dict:
    """{step: row} of a run's held-out evaluations; the cut-off share over the 10 training
    steps up to each (empty at step 0)."""
    out = {}
    for r in rows:
        if r.get("eval/greedy_acc") is None:
            continue
        s = r["step"]
        out[s] = {
            "greedy": r["eval/greedy_acc"],
            "sampled": r.get("eval/sampled_acc"),
            "cut_off_share": cut_off_share(rows, range(s - 9, s + 1)) if s else None,
            "greedy_cut_off_share": r.get("eval/greedy_truncated_frac"),
            "source": "run",
        }
    return out


def preset_of(run: Path) -> str:
    """The cpu preset a run used, from its saved flags (args.json): its micro-batch, with
    activation checkpointing and a generate() batch other than 64 where it had them.

    >>> import json, tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "args.json").write_text(json.dumps({"micro_batch_size": 4, "gen_batch_size": 32}))
    >>> preset_of(d), preset_of(d / "none")
    ('micro-batch 4, generate 32', 'micro-batch 16')
    """
    try:
        flags = json.loads((run / "args.json").read_text())
    except (OSError, ValueError):
        return FIRST_PRESET  # the made-up runs of the tests; every real run saves its flags
    label = f"micro-batch {flags.get('micro_batch_size', 16)}"
    if flags.get("gradient_checkpointing"):
        label += ", checkpointing"
    if flags.get("gen_batch_size", 64) != 64:
        label += f", generate {flags['gen_batch_size']}"
    return label


def read_runs(out: Path) -> tuple[dict, dict, list[str]]:
    """(evaluations {(config, seed, preset): {step: row}}, training rows {(config, seed, preset):
    [rows]}, unfinished run names) of the runs in a tools/study.py folder."""
    evals, steps, unfinished = {}, {}, []
    for d in sorted((out / "runs").glob("*-s*")) if (out / "runs").is_dir() else []:
        config, _, seed = d.name.rpartition("-s")
        if not seed.isdigit() or not (d / "metrics.jsonl").is_file():
            continue
        if not (d / "summary.json").is_file():
            unfinished.append(d.name)
            continue
        rows = runner.read_metrics(d)
        preset = preset_of(d)
        evals[config, int(seed), preset] = evals_of(rows)
        steps[config, int(seed), preset] = [r for r in rows if r["step"] > 0]
    return evals, steps, unfinished


# =====================================================================================
# The plan's rules
# =====================================================================================
def gains(evals: dict, config: str) -> dict[int, float]:
    """{seed: greedy(60) - greedy(0)} over the plan's seeds that have both evaluations."""
    out = {}
    for s in SEEDS:
        e = evals.get((config, s), {})
        if 0 in e and 60 in e:
            out[s] = e[60]["greedy"] - e[0]["greedy"]
    return out


def classify(g: dict[int, float], grpo_mean: float) -> str | None:
    """learns / fails / weak (the plan's rules), None until all three seeds are in.

    >>> classify({1: 0.19, 2: 0.10, 3: 0.047}, 0.112), classify({1: 0.02, 2: 0.0, 3: 0.1}, 0.112)
    ('learns', 'fails')
    >>> classify({1: 0.055, 2: 0.055, 3: 0.0}, 0.112), classify({1: 0.2}, 0.112)
    ('weak', None)
    """
    if len(g) < len(SEEDS):
        return None
    up = sum(v >= GAIN for v in g.values())
    if up >= OF and statistics.mean(g.values()) >= grpo_mean / 2:
        return "learns"
    if len(SEEDS) - up >= OF:
        return "fails"
    return "weak"


def stable(evals: dict, config: str) -> bool | None:
    """Step 60 >= step 30 - 0.05 in at least 2 of 3 seeds; None until all three are in.

    >>> e = {("x", s): {30: {"greedy": 0.3}, 60: {"greedy": g}}
    ...      for s, g in ((1, .2), (2, .26), (3, .3))}
    >>> stable(e, "x")
    True
    """
    ok = [
        evals[config, s][60]["greedy"] >= evals[config, s][30]["greedy"] - STABLE_DROP
        for s in SEEDS
        if 30 in evals.get((config, s), {}) and 60 in evals.get((config, s), {})
    ]
    return None if len(ok) < len(SEEDS) else sum(ok) >= OF


def attribution(verdicts: dict, less_cut_off: bool | None, no_kl: str | None) -> str:
    """The plan's attribution of why today's TEPO does not learn.

    >>> attribution({"tepo-seq-ppo": "fails", "tepo-seq-mean": "learns"}, True, None)
    'the aggregation'
    >>> attribution({"tepo-seq-ppo": "learns", "tepo-seq-mean": "learns"}, True, None)
    'both'
    >>> attribution({"tepo-seq-ppo": "weak", "tepo-seq-mean": "fails"}, None, "fails")
    'neither alone; grpo-no-kl fails: the KL is implicated'
    """
    clip, agg = verdicts.get("tepo-seq-ppo"), verdicts.get("tepo-seq-mean")
    if clip is None or agg is None:
        return "pending"
    if clip == "learns" and agg == "learns":
        return "both"
    if clip == "learns":
        return "the clip"
    if agg == "learns":
        if less_cut_off is None:
            return "the aggregation (pending: the cut-off shares)"
        return (
            "the aggregation"
            if less_cut_off
            else "the aggregation, not through the cut-off completions"
        )
    if no_kl is None:
        return "neither alone (grpo-no-kl pending)"
    if no_kl == "fails":
        return "neither alone; grpo-no-kl fails: the KL is implicated"
    return f"neither alone; grpo-no-kl {no_kl}: not the KL either, none of the three alone"


def fewer_cut_off(evals: dict, config: str = "tepo-seq-mean") -> bool | None:
    """Its cut-off share over steps 51-60 (the step-60 row's) is below tepo's in at least 2 of
    3 seeds."""
    below = []
    for s in SEEDS:
        mine, theirs = (
            evals.get((c, s), {}).get(60, {}).get("cut_off_share") for c in (config, "tepo")
        )
        if mine is None or theirs is None:
            return None
        below.append(mine < theirs)
    return sum(below) >= OF


def tiny_finals(tiny: Path) -> dict[str, list[float]]:
    """Final held-out sampled accuracy of each adoption config on the tiny task's seeds 6-10."""
    out = {}
    for config in TINY:
        finals = []
        # a run made before a config was renamed has its folder under the old name
        names = [config, *(old for old, new in OLD_NAMES.items() if new == config)]
        for s in range(6, 11):
            for d in (tiny / "runs" / f"{n}-s{s}" / "summary.json" for n in names):
                if d.is_file():
                    finals.append(json.loads(d.read_text())["last_eval"]["eval/sampled_acc"])
                    break
        out[config] = finals
    return out


def adoption(verdict: str | None, is_stable: bool | None, finals: dict) -> str:
    """The plan's adoption rule for --loss-agg seq-mean-token-mean."""
    if verdict is None or is_stable is None:
        return "pending (the tepo-seq-mean runs)"
    if verdict != "learns" or not is_stable:
        return f"not adopted: tepo-seq-mean {verdict}" + ("" if is_stable else ", not stable")
    old, new = (finals.get(c, []) for c in TINY)
    if len(old) < 5 or len(new) < 5:
        return "pending (the tiny task's confirmation seeds 6-10)"
    d = statistics.mean(new) - statistics.mean(old)
    verdict = "adopted" if round(d, 9) >= -TINY_MARGIN else "not adopted"  # no float dust
    return (
        f"{verdict}: on the tiny task (seeds 6-10) its mean final sampled accuracy is "
        f"{statistics.mean(new):.3f} against today's default's {statistics.mean(old):.3f} "
        f"({d:+.3f}; the plan allows -{TINY_MARGIN})"
    )


# =====================================================================================
# PLAN-length.md's rules
# =====================================================================================
def failed_before(evals: dict, script: str, verdict: str | None) -> bool | None:
    """Did the script fail on PLAN-real? tepo by the rule over 3 seeds; erpo and sapo ran seed 1
    only, and failed there if it did not gain 0.05."""
    if script in ONE_SEED:
        g = gains(evals, script)
        return None if 1 not in g else g[1] < GAIN
    return None if verdict is None else verdict == "fails"


def length_attribution(script: str, failed: bool | None, verdict: str | None) -> str:
    """What X-len's verdict says of why X failed (PLAN-length.md, "Attribution").

    >>> length_attribution("tepo", True, "learns")
    'tepo-len learns where tepo failed: the length signal is what tepo lacked here'
    >>> length_attribution("erpo", True, "weak")
    "erpo-len is weak: the length signal moves erpo, by less than half of GRPO's gain"
    """
    name = LENGTH[script]
    if failed is None or verdict is None:
        return "pending"
    if not failed:
        return f"no attribution: {script} did not fail"
    if verdict == "learns":
        return (
            f"{name} learns where {script} failed: the length signal is what {script} lacked here"
        )
    if verdict == "weak":
        return f"{name} is weak: the length signal moves {script}, by less than half of GRPO's gain"
    text = f"{name} fails too: the length signal alone does not make {script} learn here"
    if script == "tepo":
        text += (
            "; what is left: dynamic sampling (DAPO's other difference), then the clip range "
            "and the masked KL, which no run of this plan separates"
        )
    return text


def length_adoption(verdict: str | None, is_stable: bool | None) -> str:
    """The cpu preset turns the length term on for every script if tepo-len learns and is
    stable."""
    if verdict is None or is_stable is None:
        return "pending (the tepo-len runs)"
    if verdict == "learns" and is_stable:
        return "adopted: the cpu preset turns on --overlong-cache 16 for every script"
    return f"not adopted: tepo-len {verdict}" + ("" if is_stable else ", not stable")


def steps_to(e: dict, threshold: float) -> int | None:
    """The first evaluation step from 15 on whose greedy accuracy is >= threshold, else None.

    >>> steps_to({0: {"greedy": .5}, 15: {"greedy": .2}, 30: {"greedy": .4}}, .38)
    30
    """
    return next((k for k in EVAL_STEPS if k in e and e[k]["greedy"] >= threshold), None)


def claim(evals: dict, baseline: str, baseline_verdict: str | None) -> tuple[str, list[str]]:
    """TEPO's claim against one baseline (PLAN-length.md): (verdict, per-seed lines). A
    baseline that never reaches the threshold counts as > 60 steps, so tepo-len reaching it at
    step 15 or 30 is a ratio below 0.5.

    >>> e = {(c, s): {0: {"greedy": .1}, **{k: {"greedy": g} for k, g in zip(EVAL_STEPS, gs)}}
    ...      for s in (1, 2, 3) for c, gs in (("tepo-len", (.4, .4, .4, .4)),
    ...                                       ("grpo-len", (.1, .2, .4, .4)))}
    >>> claim(e, "grpo-len", "learns")[0]
    "supported: at most 0.6 x grpo-len's steps in 3 of 3 seeds (T = 0.360)"
    """
    finals = [evals[baseline, s][60]["greedy"] for s in SEEDS if 60 in evals.get((baseline, s), {})]
    mine = [evals.get(("tepo-len", s), {}) for s in SEEDS]
    if len(finals) < len(SEEDS) or any(60 not in e for e in mine):
        return "pending", []
    threshold = CLAIM_FRAC * statistics.mean(finals)
    start = max(evals[c, s][0]["greedy"] for c in ("tepo-len", baseline) for s in SEEDS)
    lines, up, down = [], 0, 0
    for s, e in zip(SEEDS, mine):
        t, b = steps_to(e, threshold), steps_to(evals[baseline, s], threshold)
        if t is not None and b is not None:
            ratio = t / b
            up += ratio <= CLAIM_RATIO
            down += ratio >= 1
            shown = f"{ratio:.2f}"
        elif t is not None:  # the baseline needs more than 60 steps
            up += t / max(EVAL_STEPS) < CLAIM_RATIO
            shown = f"< {t / max(EVAL_STEPS):.2f}"
        else:
            down += b is not None
            shown = "tepo-len not reached" if b is not None else "neither reached"
        lines.append(f"seed {s}: tepo-len {t or '> 60'}, {baseline} {b or '> 60'} steps: {shown}")
    where = f"(T = {threshold:.3f})"
    if baseline_verdict != "learns":
        return f"inconclusive: {baseline} does not learn by the rules {where}", lines
    if threshold <= start:
        return f"inconclusive: T is not above the step-0 accuracy {where}", lines
    n = len(SEEDS)
    if up >= OF:
        return (
            f"supported: at most {CLAIM_RATIO} x {baseline}'s steps in {up} of {n} seeds {where}",
            lines,
        )
    if down >= OF:
        return f"refuted: at least {baseline}'s steps in {down} of {n} seeds {where}", lines
    return f"inconclusive: neither rule holds in 2 of {n} seeds {where}", lines


def against_base(evals: dict, config: str, verdict: str | None) -> tuple[str | None, float]:
    """PLAN-clip-real.md: is `config` better than, worse than or not told apart from tepo-len?
    (None until both have all three seeds) and its mean paired gain difference.

    >>> e = {(c, s): {0: {"greedy": 0.1}, 30: {"greedy": 0.1 + g}, 60: {"greedy": 0.1 + g}}
    ...      for c, gs in (("tepo-len", (.19, .13, -.03)), ("x", (.3, .1, .2)))
    ...      for s, g in zip((1, 2, 3), gs)}
    >>> against_base(e, "x", "learns")[0], round(against_base(e, "x", "learns")[1], 3)
    ('better', 0.103)
    >>> against_base(e, "x", "weak")[0]
    'no difference these seeds can see'
    """
    g, base = gains(evals, config), gains(evals, CLIP_BASE)
    if len(g) < len(SEEDS) or len(base) < len(SEEDS):
        return None, 0.0
    d = [g[s] - base[s] for s in SEEDS]
    mean = statistics.mean(d)
    if sum(x > 0 for x in d) >= OF and mean >= BETTER and verdict == "learns":
        if stable(evals, config):
            return "better", mean
    if sum(x < 0 for x in d) >= OF and mean <= -BETTER:
        return "worse", mean
    return "no difference these seeds can see", mean


def clip_decision(evals: dict, compared: dict) -> str:
    """The plan's decision from {config: (against_base, mean difference)}."""
    if any(v is None for v, _ in compared.values()):
        return "pending"
    better = [c for c, (v, _) in compared.items() if v == "better"]
    if len(better) == 2:  # the larger mean difference; within SAMPLED_TIE, the sampled accuracy
        (a, da), (b, db) = ((c, compared[c][1]) for c in better)
        if abs(da - db) > SAMPLED_TIE:
            better = [a if da > db else b]
        else:
            sampled = {
                c: statistics.mean(evals[c, s][60]["sampled"] or 0.0 for s in SEEDS) for c in better
            }
            better = [max(sampled, key=sampled.get)]
    if not better:
        return (
            "neither candidate is better: tepo.py keeps GSPO's range on both beds; the narrow clip "
            "is not shown to be what holds TEPO back on the real model"
        )
    if better == ["tepo-len-token"]:
        return (
            "tepo-len-token is better: one reading for both beds, tepo.py's default becomes the "
            "per-token ratio at 0.2 / 0.28 (the tiny task could not tell it from GSPO's range in "
            "steps)"
        )
    return (
        "tepo-len-ppo is better: the scale decides; tepo.py's default stays GSPO's range (the "
        "sequence ratio at PPO's range was clearly worse on the tiny task) and the README's "
        "real-model command for tepo.py gains --clip-low 0.2 --clip-high 0.28"
    )


def clip_section(evals: dict, steps: dict, verdicts: dict) -> list[str]:
    """summary.md's section for PLAN-clip-real.md: gains beside clip fractions, the rule."""
    lines = [
        "",
        "## TEPO's clip on the real model (docs/study/PLAN-clip-real.md)",
        "",
        "| config | seed | gain | difference from tepo-len | clipped, steps 1-60 / 51-60 "
        "| second mini-batch clipped, steps 1-60 / 51-60 | cut off, steps 51-60 |",
        "|---|---|---|---|---|---|---|",
    ]

    def pct(pair):
        return " / ".join("-" if v is None else f"{v:.1%}" for v in pair)

    base = gains(evals, CLIP_BASE)
    every = range(1, 61)
    for config in (CLIP_BASE, *CLIP):
        g = gains(evals, config)
        for s in SEEDS:
            if (config, s) not in evals:
                continue
            rows = steps.get((config, s), [])
            frac = [_step_mean(rows, "clip_frac", r) for r in (every, LAST_STEPS)]
            second = [_step_mean(rows, "clip_frac_mini2", r) for r in (every, LAST_STEPS)]
            if second[0] is None:  # runs before clip_frac_mini2: the first mini-batch never clips
                second = [None if f is None else 2 * f for f in frac]
            diff = f"{g[s] - base[s]:+.3f}" if s in g and s in base and config != CLIP_BASE else "-"
            cut = evals[config, s].get(60, {}).get("cut_off_share")
            lines.append(
                f"| {config} | {s} | {f'{g[s]:+.3f}' if s in g else '-'} | {diff} | {pct(frac)} | "
                f"{pct(second)} | {'-' if cut is None else f'{cut:.0%}'} |"
            )
    compared = {c: against_base(evals, c, verdicts.get(c)) for c in CLIP}
    lines += [
        "",
        "(tepo-len's runs predate `clip_frac_mini2`: its second mini-batch's share is 2 x "
        "`clip_frac`, the first mini-batch being on-policy, with nothing clipped.)",
        "",
    ]
    for c, (v, mean) in compared.items():
        text = "pending" if v is None else f"{v} (mean difference {mean:+.3f})"
        lines.append(f"- **{c}** against tepo-len: {text}.")
    lines += ["", f"**Decision**: {clip_decision(evals, compared)}."]
    return lines


def length_section(evals: dict, steps: dict, verdicts: dict) -> list[str]:
    """summary.md's section for PLAN-length.md: attribution, adoption, the claim, the critic."""
    lines = ["", "## The length term (docs/study/PLAN-length.md)", ""]
    lines += [
        "| script | seed | gain without / with the length term | cut off over steps 51-60, "
        "without / with |",
        "|---|---|---|---|",
    ]

    def pair(config: str, seed: int) -> tuple[str, str]:  # (gain, cut-off share), "-" if none
        e = evals.get((config, seed), {})
        gain = f"{e[60]['greedy'] - e[0]['greedy']:+.3f}" if 0 in e and 60 in e else "-"
        cut = e.get(60, {}).get("cut_off_share")
        return gain, "-" if cut is None else f"{cut:.0%}"

    for script, name in LENGTH.items():
        for s in SEEDS:
            if (name, s) not in evals:
                continue
            (g0, c0), (g1, c1) = pair(script, s), pair(name, s)
            lines.append(f"| {script} | {s} | {g0} / {g1} | {c0} / {c1} |")
    lines.append("")
    for script in ("tepo", "erpo", "sapo"):
        failed = failed_before(evals, script, verdicts.get(script))
        text = length_attribution(script, failed, verdicts.get(LENGTH[script]))
        lines.append(f"- **Attribution, {script}**: {text}.")
    tv, ts = verdicts.get("tepo-len"), stable(evals, "tepo-len")
    lines += ["", f"**Adoption**: {length_adoption(tv, ts)}."]
    g = gains(evals, "tepo-len")
    if tv == "learns" and ts and 1 in g:
        ok = "meets" if g[1] >= COMMAND_GAIN else "does not meet"
        lines.append(
            f"The user's command (tepo-len seed 1) gains {g[1]:+.3f}: it {ok} the plan's "
            f"{COMMAND_GAIN:.2f}."
        )
    lines += [
        "",
        "**TEPO's claim** (steps to T = 0.9 x the baseline's mean step-60 greedy "
        "accuracy; tepo-len's steps / the baseline's, paired by seed):",
        "",
    ]
    for baseline in ("grpo-len", "dapo"):
        verdict, per_seed = claim(evals, baseline, verdicts.get(baseline))
        lines.append(
            f"- against {baseline}: {verdict}" + (f" ({'; '.join(per_seed)})" if per_seed else "")
        )
    critic = []
    for s in SEEDS:
        rows = steps.get(("sapo-len", s), [])
        early, late = (_step_mean(rows, "explained_var", r) for r in (range(1, 16), range(46, 61)))
        if early is not None:
            critic.append(f"seed {s}: {early:+.2f} over steps 1-15, {late:+.2f} over 46-60")
    if critic:
        shown = "; ".join(critic)
        lines += ["", f"**SAPO's critic** with the length term, mean explained variance: {shown}."]
    return lines


# =====================================================================================
# Writing
# =====================================================================================
def _c(v) -> str:
    return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def write_csvs(docs: Path, evals: dict, steps: dict) -> None:
    with open(docs / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "config",
                "seed",
                "preset",
                "step",
                "greedy_acc",
                "sampled_acc",
                "cut_off_share",
                "greedy_cut_off_share",
                "source",
            ]
        )
        order = sorted(
            evals, key=lambda k: (k[2], CONFIGS.index(k[0]) if k[0] in CONFIGS else 99, k[1])
        )
        for config, seed, preset in order:
            e = evals[config, seed, preset]
            for step, r in sorted(e.items()):
                w.writerow(
                    [
                        config,
                        seed,
                        preset,
                        step,
                        _c(r["greedy"]),
                        _c(r["sampled"]),
                        _c(r["cut_off_share"]),
                        _c(r["greedy_cut_off_share"]),
                        r["source"],
                    ]
                )
    with open(docs / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "preset", "step", *STEP_COLUMNS])
        for (config, seed, preset), rows in sorted(steps.items(), key=lambda kv: kv[0][2]):
            for r in rows:
                cells = (_c(r.get(k)) for k in STEP_COLUMNS)
                w.writerow([config, seed, preset, r["step"], *cells])


def _step_mean(rows: list[dict], key: str, last=LAST_STEPS) -> float | None:
    vals = [r[key] for r in rows if r["step"] in last and r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summary(evals: dict, steps: dict, unfinished: list[str], finals: dict) -> str:
    g_grpo = gains(evals, "grpo")
    grpo_mean = statistics.mean(g_grpo.values()) if len(g_grpo) == len(SEEDS) else None
    lines = [
        "# SmolLM2-135M-Instruct: the real-model plans' runs and their verdicts",
        "",
        "SmolLM2-135M-Instruct, the cpu preset, 60 steps; held-out greedy and sampled "
        "accuracy on the same 128 problems (docs/study/PLAN-real.md, PLAN-length.md). Written by "
        "`python tools/study_real.py`.",
        "",
        "| config | seed | greedy at steps 0, 15, 30, 45, 60 | gain | sampled, 0 -> 60 "
        "| cut off, steps 51-60 | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for config in CONFIGS:
        for s in (1, 2, 3):
            e = evals.get((config, s))
            if not e:
                continue
            greedy = ", ".join(
                f"{e[k]['greedy']:.3f}" if k in e else "-" for k in (0, 15, 30, 45, 60)
            )
            gain = f"{e[60]['greedy'] - e[0]['greedy']:+.3f}" if 0 in e and 60 in e else "-"
            samp = " -> ".join(
                f"{e[k]['sampled']:.3f}" if k in e and e[k]["sampled"] is not None else "-"
                for k in (0, 60)
            )
            cut = e.get(60, {}).get("cut_off_share")
            src = e.get(0, {}).get("source", "run")
            lines.append(
                f"| {config} | {s} | {greedy} | {gain} | {samp} | "
                f"{'-' if cut is None else f'{cut:.0%}'} | {src} |"
            )
    if grpo_mean is None:
        return "\n".join(lines + ["", "GRPO's gains are not all in: no verdict."]) + "\n"
    lines += [
        "",
        f"GRPO's mean gain {grpo_mean:.3f} (half of it {grpo_mean / 2:.3f}).",
        "",
        "## The verdicts, by the plan's rules",
        "",
        "| config | gains by seed | mean | learns / fails / weak | stable |",
        "|---|---|---|---|---|",
    ]
    verdicts = {}
    for config in CONFIGS:
        g = gains(evals, config)
        if not g:
            continue
        st = stable(evals, config)
        if config in ONE_SEED:  # the plan runs these once, for the README: no rule governs them
            up = "gains" if g.get(1, 0) >= GAIN else "does not gain"
            verdict = f"seed 1 only, no rule: {up} {GAIN}" if 1 in g else "pending"
        else:
            verdicts[config] = classify(g, grpo_mean)
            verdict = verdicts[config] or "pending"
        lines.append(
            f"| {config} | {', '.join(f'{v:+.3f}' for v in g.values())} | "
            f"{statistics.mean(g.values()):+.3f} | {verdict} | "
            f"{'-' if st is None else 'yes' if st else 'no'} |"
        )
    less = fewer_cut_off(evals)
    if verdicts.get("tepo-seq-mean") not in (None, "learns"):  # the rule needs it only if so
        less_text = f"not needed: tepo-seq-mean {verdicts['tepo-seq-mean']}"
    else:
        less_text = "pending" if less is None else "yes" if less else "no"
    attributed = attribution(verdicts, less, verdicts.get("grpo-no-kl"))
    if "KL is implicated" in attributed and verdicts.get("dapo") == "learns":
        attributed += (
            " (the plan's words; dapo, with no KL at all, learns, so these runs do not show the KL"
            " to be the cause: docs/study/PLAN-length.md)"
        )
    lines += [
        "",
        f"**Attribution**: {attributed}.",
        f"(`tepo-seq-mean`'s cut-off share over steps 51-60 below `tepo`'s in at least 2 "
        f"of 3 seeds: {less_text}.)",
        "",
        f"**Adoption** of `--loss-agg seq-mean-token-mean`: "
        f"{adoption(verdicts.get('tepo-seq-mean'), stable(evals, 'tepo-seq-mean'), finals)}.",
        *(
            length_section(evals, steps, verdicts)
            if {c for c, _ in evals} & set(LENGTH.values())
            else []
        ),
        *(clip_section(evals, steps, verdicts) if {c for c, _ in evals} & set(CLIP) else []),
        "",
        "## Diagnostics over steps 51-60 (means of the training steps)",
        "",
        "| config | seed | cut off | right answers cut off | gradient mass on cut-off, "
        "token-mean / seq-mean | clip rate A > 0 / A < 0 | clip rate cut off / ended |",
        "|---|---|---|---|---|---|---|",
    ]
    for (config, s), rows in sorted(steps.items()):
        m = {k: _step_mean(rows, k) for k in STEP_COLUMNS}

        def p(k):
            return "-" if m[k] is None else f"{m[k]:.1%}"

        lines.append(
            f"| {config} | {s} | {p('truncated_frac')} | {p('right_cut_off_frac')} | "
            f"{p('grad_mass_cut_token_mean')} / {p('grad_mass_cut_seq_mean')} | "
            f"{p('clip_frac_pos_adv')} / {p('clip_frac_neg_adv')} | "
            f"{p('clip_frac_cut')} / {p('clip_frac_ended')} |"
        )
    if unfinished:
        lines += ["", f"Unfinished, left out: {', '.join(unfinished)}."]
    return "\n".join(lines) + "\n"


def at(runs: dict, preset: str) -> dict:
    """{(config, seed): value} of the runs made at `preset`."""
    return {(c, s): v for (c, s, p), v in runs.items() if p == preset}


def preset_section(evals: dict, steps: dict, first: dict, preset: str) -> list[str]:
    """summary.md's section for the new cpu preset: each run's gains beside the same config and
    seed at the first preset, its whole-run peak memory, and PLAN-real's rule on tepo.py."""
    lines = [
        "",
        f"## The cpu preset at {preset} (docs/memory.md)",
        "",
        f"The same plans' configs, rerun at the preset chosen by measurement ({preset}; before: "
        f"{FIRST_PRESET}). A script that stops learning here makes the choice wrong: for seed 1 "
        f"a gain under {GAIN}; for tepo-len-token over seeds 1-3, PLAN-real's rule as above. "
        "Peak: the whole run's resident memory, evaluations included (GB of 10^9 bytes).",
        "",
        "| config | seed | greedy at steps 0, 15, 30, 45, 60 | gain | gain at "
        f"{FIRST_PRESET} | peak, GB |",
        "|---|---|---|---|---|---|",
    ]
    for config in PRESET_RUNS:
        for s in SEEDS:
            e = evals.get((config, s))
            if not e:
                continue
            greedy = ", ".join(f"{e[k]['greedy']:.3f}" if k in e else "-" for k in (0, *EVAL_STEPS))
            gain, before = (
                f"{x[60]['greedy'] - x[0]['greedy']:+.3f}" if x and {0, 60} <= set(x) else "-"
                for x in (e, first.get((config, s)))
            )
            rows = steps.get((config, s), [])
            peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb") is not None]
            peak = f"{max(peaks) * 2**20 / 1e9:.2f}" if peaks else "-"
            lines.append(f"| {config} | {s} | {greedy} | {gain} | {before} | {peak} |")
    verdict = classify(
        gains(evals, "tepo-len-token"), statistics.mean(gains(first, "grpo").values())
    )
    lines += ["", f"tepo-len-token at {preset}, PLAN-real's rule: {verdict or 'pending'}."]
    return lines


def plot(docs: Path, evals: dict, steps: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    colours = dict(zip(CONFIGS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (config, s), e in sorted(evals.items()):
        ks = sorted(e)
        first = s == min(x for c, x in evals if c == config)  # one legend entry per config
        axes[0].plot(
            ks,
            [e[k]["greedy"] for k in ks],
            marker="o",
            ms=3,
            alpha=0.8,
            color=colours.get(config),
            label=config if first else None,
        )
    for ax, key, title in (
        (axes[1], "truncated_frac", "cut off (training batches)"),
        (
            axes[2],
            "grad_mass_cut_token_mean",
            "gradient mass on cut-off completions (token-mean weights)",
        ),
    ):
        for (config, s), rows in sorted(steps.items()):
            xs = [r["step"] for r in rows if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            if xs:
                ax.plot(xs, ys, color=colours.get(config), alpha=0.6, lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
    axes[0].set_title("held-out greedy accuracy (128 problems)", fontsize=10)
    axes[0].set_xlabel("training step")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_small(fig, docs / "curves.png")
    plt.close(fig)
    return True


def main(argv=None) -> int:
    a = runner.parse_args(Args, argv)
    with runner.user_errors():
        docs, out = Path(a.docs), Path(a.out)
        recorded = docs / "recorded.csv"
        if not recorded.is_file():
            raise UserError(f"no {recorded}: the plan's recorded runs are missing")
        evals = read_results(recorded)
        steps = {}
        if (docs / "results.csv").is_file():  # the runs that landed before (not the recorded)
            evals.update(read_results(docs / "results.csv", sources=("run",)))
        if (docs / "steps.csv").is_file():
            steps.update(read_steps(docs / "steps.csv"))
        run_evals, run_steps, unfinished = read_runs(out)
        evals.update(run_evals)  # a run finished here replaces its landed copy
        steps.update(run_steps)
        write_csvs(docs, evals, steps)
        first, first_steps = at(evals, FIRST_PRESET), at(steps, FIRST_PRESET)
        text = summary(first, first_steps, unfinished, tiny_finals(Path(a.tiny)))
        if at(evals, PRESET):
            new = preset_section(at(evals, PRESET), at(steps, PRESET), first, PRESET)
            text += "\n".join(new) + "\n"
        (docs / "summary.md").write_text(text)
        drawn = plot(docs, first, first_steps)
        print(
            f"wrote {docs / 'summary.md'}, results.csv, steps.csv"
            + (", curves.png" if drawn else "")
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
