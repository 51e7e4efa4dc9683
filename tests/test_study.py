"""tools/study.py: a smoke study end to end (2 steps, one seed, grpo and tepo, small batches),
skipping finished runs, continuing a run with --steps, stopping on SIGTERM, failures, and the
aggregation and verdict rule on hand-made metrics with hand-computed values."""

import csv
import doctest
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import study
from common import UserError

ROOT = Path(__file__).resolve().parent.parent
SMALL = "--prompts-per-step 2 --group-size 4 --micro-batch-size 8 --num-mini-batches 2"


def _study(out, *flags, configs="grpo,tepo"):
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "study.py"),
        "--configs",
        configs,
        "--seeds",
        "1",
        "--eval-every",
        "1",
        "--eval-n",
        "16",
        "--out",
        str(out),
        "--extra",
        SMALL,
        *flags,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# =====================================================================================
# End to end: real runs of grpo.py and tepo.py
# =====================================================================================
def test_smoke_study_skip_and_continue(tmp_path):
    out = tmp_path / "study"
    p = _study(out, "--steps", "2", "--jobs", "2")  # side by side, one torch thread each on 2 cores
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 run(s) to do, 0 already finished, 2 at a time" in p.stdout

    # results.csv: the evaluations at steps 0, 1, 2 of each run, accuracies out of 16 problems
    rows = _csv(out / "results.csv")
    assert [(r["config"], r["seed"], r["step"]) for r in rows] == [
        (c, "1", s) for c in ("grpo", "tepo") for s in ("0", "1", "2")
    ]
    for c in ("grpo", "tepo"):
        secs = [float(r["seconds"]) for r in rows if r["config"] == c]
        assert secs[0] == 0 and secs[0] < secs[1] < secs[2]
    for r in rows:
        for k in ("greedy_acc", "sampled_acc"):
            assert float(r[k]) * 16 == round(float(r[k]) * 16) and 0 <= float(r[k]) <= 1
    # steps.csv: one row per training step; mask_frac only where TEPO logs it
    steps = _csv(out / "steps.csv")
    assert [(r["config"], r["step"]) for r in steps] == [
        ("grpo", "1"),
        ("grpo", "2"),
        ("tepo", "1"),
        ("tepo", "2"),
    ]
    assert all(r["entropy"] for r in steps)
    assert [bool(r["mask_frac"]) for r in steps] == [False, False, True, True]

    # summary.md: threshold = 0.9 x GRPO's final sampled accuracy (one seed: its own)
    summary = (out / "summary.md").read_text()
    grpo_final = float([r for r in rows if r["config"] == "grpo"][-1]["sampled_acc"])
    assert f"**Threshold**: {0.9 * grpo_final:.3f}" in summary
    assert "| grpo | 1 | 2 |" in summary and "| tepo | 1 | 2 |" in summary
    assert "## Verdict" in summary and "### The rule" in summary
    try:
        import matplotlib  # noqa: F401

        assert (out / "curves.png").stat().st_size > 10_000
    except ImportError:
        assert "matplotlib is not installed" in p.stdout
    for c in ("grpo", "tepo"):
        log = (out / "logs" / f"{c}-s1.log").read_text()
        assert log.startswith("$ ") and "--eval-n 16" in log.splitlines()[0]

    # the same command again: nothing is run, nothing in the runs changes
    run = out / "runs" / "grpo-s1"
    before = {f: (run / f).stat().st_mtime_ns for f in ("summary.json", "metrics.jsonl")}
    p = _study(out, "--steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "0 run(s) to do, 2 already finished" in p.stdout
    assert before == {f: (run / f).stat().st_mtime_ns for f in ("summary.json", "metrics.jsonl")}

    # more steps: the finished run is continued from its last checkpoint, not started again
    p = _study(out, "--steps", "3", configs="grpo")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert (out / "logs" / "grpo-s1.resumes").read_text().split() == ["2"]
    assert "--resume" in (out / "logs" / "grpo-s1.log").read_text()
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_errors_are_one_line(tmp_path, capsys):
    for argv, message in (
        (["--configs", "grpo,nope"], "unknown config 'nope'"),
        (["--seeds", "1,x"], "--seeds must be a comma list"),
        (["--threshold-frac", "1.5"], "--threshold-frac must be in (0, 1]"),
        # --no-run: a broken check trains nothing
        (["--threshold", "0", "--no-run"], "--threshold must be in (0, 1]"),
        (["--threshold", "1.01", "--no-run"], "--threshold must be in (0, 1]"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--no-run"], "no runs in"),
    ):
        with pytest.raises(SystemExit) as e:
            study.main([*argv, "--out", str(tmp_path / "empty")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err, err


# =====================================================================================
# Planning and running, with stand-in folders and stand-in processes
# =====================================================================================
def _fake_checkpoint(run_dir, step):
    (run_dir / f"checkpoint-{step}").mkdir(parents=True)
    (run_dir / f"checkpoint-{step}" / "trainer_state.pt").write_bytes(b"")
    (run_dir / "latest").write_text(f"checkpoint-{step}\n")


def test_plan_run(tmp_path):
    d = tmp_path / "r"
    assert study.plan_run(d, None) == "fresh"  # nothing there
    d.mkdir()
    (d / "args.json").write_text("{}")
    assert study.plan_run(d, None) == "fresh"  # a start that failed before its first step
    (d / "metrics.jsonl").write_text('{"step": 0}\n')
    assert study.plan_run(d, None) == "restart"  # killed hard, no checkpoint
    _fake_checkpoint(d, 5)
    assert study.plan_run(d, None) == "resume"
    (d / "summary.json").write_text(json.dumps({"steps": 5}))
    assert study.plan_run(d, None) == "skip"
    assert study.plan_run(d, 5) == "skip"
    assert study.plan_run(d, 4) == "skip"
    assert study.plan_run(d, 6) == "resume"  # asked for more steps


def test_make_jobs(tmp_path):
    out = tmp_path / "s"
    (out / "logs").mkdir(parents=True)
    runs = out / "runs"
    (runs / "grpo-s2").mkdir(parents=True)
    (runs / "grpo-s2" / "metrics.jsonl").write_text('{"step": 0}\n')  # to restart
    (out / "logs" / "grpo-s2.resumes").write_text("3\n")  # belonged to the run moved aside
    _fake_checkpoint(runs / "tepo-observed-s1", 7)  # to resume
    (runs / "grpo-s1").mkdir()
    (runs / "grpo-s1" / "summary.json").write_text(json.dumps({"steps": 160}))  # to skip
    args = study.Args(configs="grpo,tepo-observed", seeds="1,2", extra="--lr 1e-3")
    jobs = study.make_jobs(args, ["grpo", "tepo-observed"], [1, 2], out)
    assert [j.name for j in jobs] == ["tepo-observed-s1", "grpo-s2", "tepo-observed-s2"]
    resume, fresh = jobs[0].cmd, jobs[2].cmd
    diag = str(ROOT / "tools" / "diagnostics.py")  # every run goes through the diagnostics hook
    assert resume[1:] == [diag, str(ROOT / "tepo.py"), "--resume", str(runs / "tepo-observed-s1")]
    assert jobs[0].append and not jobs[2].append
    assert (out / "logs" / "tepo-observed-s1.resumes").read_text() == "7\n"
    assert fresh[1:] == [
        diag,
        str(ROOT / "tepo.py"),
        "--seed",
        "2",
        "--output-dir",
        str(runs),
        "--run-name",
        "tepo-observed-s2",
        "--eval-every",
        "10",
        "--eval-n",
        "128",
        "--save-every",
        "100000",
        "--sample-every",
        "100000",
        "--tensorboard",
        "false",
        *study.SEQ_GSPO,
        "--entropy-test",
        "observed",
        "--lr",
        "1e-3",
    ]
    assert (runs / "grpo-s2.incomplete-1" / "metrics.jsonl").is_file()  # moved aside
    assert not (runs / "grpo-s2").exists() and not (out / "logs" / "grpo-s2.resumes").exists()
    _fake_checkpoint(runs / "grpo-s1", 160)
    args.steps = 200
    jobs = study.make_jobs(args, ["grpo"], [1], out)
    assert jobs[0].cmd[-2:] == ["--steps", "200"] and "--resume" in jobs[0].cmd  # continued
    # --runs: exactly these pairs, in this order
    pairs = study.resolve_runs("tepo-no-kl:3,dapo:1")
    jobs = study.make_jobs(study.Args(), [], [], tmp_path / "p", pairs)
    assert [j.name for j in jobs] == ["tepo-no-kl-s3", "dapo-s1"]
    assert jobs[0].cmd[-2:] == ["--kl-coef", "0"]
    # a retired config (its flag is gone from the script): read, never started
    with pytest.raises(UserError, match="tepo-seq-mean-s1: .*872b399"):
        study.make_jobs(study.Args(), [], [], tmp_path / "p", [("tepo-seq-mean", 1)])
    with pytest.raises(UserError, match="config:seed"):
        study.resolve_runs("nope:1")
    with pytest.raises(UserError, match="config:seed"):
        study.resolve_runs("dapo")


def test_configs_and_settings(tmp_path):
    assert study.resolve_configs("tepo,grpo") == ["tepo", "grpo"]
    default = study.resolve_configs(None)
    assert default[:4] == ["grpo", "dapo", "tepo", "tepo-observed"]
    assert default[-3:] == ["tepo-token-ratio", "tepo-no-kl", "tepo-mask-ref"]
    for name in ("erpo", "sapo"):
        assert (name in default) == study.script_available(name)
    # candidates: only by --configs
    assert "tepo-seq-ppo" not in default
    # PLAN.md's (b) is tepo.py's default, `tepo`: its old name, in the plans and the second
    # study's data, reads as it
    assert "tepo-seq-gspo" not in study.CONFIGS
    assert study.resolve_configs("grpo,tepo-seq-gspo") == ["grpo", "tepo"]
    assert study.resolve_runs("tepo-seq-gspo:6,dapo:6") == [("tepo", 6), ("dapo", 6)]
    with pytest.raises(UserError, match="distinct"):
        study.resolve_configs("tepo,tepo-seq-gspo")
    # every TEPO config with its ratio and clip spelled out, whatever tepo.py's default is
    seq, ppo = ["--ratio-level", "sequence"], ["--clip-low", "0.2", "--clip-high", "0.28"]
    gspo = [*seq, "--clip-low", "3e-4", "--clip-high", "4e-4"]
    assert study.CONFIGS["tepo"] == ("tepo", gspo)
    assert study.CONFIGS["tepo-seq-ppo"] == ("tepo", [*seq, *ppo])
    assert study.CONFIGS["tepo-token-ratio"] == ("tepo", ["--ratio-level", "token", *ppo])
    for name, (script, flags) in study.CONFIGS.items():
        if script == "tepo":
            assert "--ratio-level" in flags and "--clip-low" in flags, name
    assert study.CANDIDATES == ("tepo-seq-ppo", "tepo", "tepo-token-ratio")
    assert study.resolve_seeds("3,1") == [3, 1]
    args = study.Args()
    study.check_same_settings(tmp_path, args, ["grpo"])
    study.check_same_settings(tmp_path, args, ["grpo", "tepo"])  # adding a config is fine
    with pytest.raises(UserError, match="--eval-n"):
        study.check_same_settings(tmp_path, study.Args(eval_n=64), ["grpo"])
    with pytest.raises(UserError, match="--extra"):
        study.check_same_settings(tmp_path, study.Args(extra="--lr 1"), ["grpo"])


def _job(tmp_path, name, code):
    return study.Job(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_run_jobs_reports_failures_and_goes_on(tmp_path, capsys):
    jobs = [
        _job(tmp_path, "bad", "import sys; print('line 1'); print('boom'); sys.exit(3)"),
        _job(tmp_path, "good", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"),
        _job(tmp_path, "after", "print('ran')"),
    ]
    assert study.run_jobs(jobs, 2, poll_s=0.05) == ["bad"]
    err = capsys.readouterr().err
    assert "FAILED bad (exit 3)" in err and "boom" in err
    cores = len(os.sched_getaffinity(0))
    assert f"threads {max(1, cores // 2)}" in (tmp_path / "good.log").read_text()
    assert "ran" in (tmp_path / "after.log").read_text()  # the study went on
    assert (tmp_path / "bad.log").read_text().startswith("$ ")


def test_study_exit_code_after_a_failure(tmp_path, monkeypatch, capsys):
    out = tmp_path / "s"
    _write_run(out, "grpo-s1", reach=None)
    monkeypatch.setattr(study, "make_jobs", lambda *a: [_job(tmp_path, "x", "raise SystemExit(1)")])
    assert study.main(["--configs", "grpo", "--seeds", "1", "--out", str(out)]) == 1
    assert "1 run(s) failed: x" in capsys.readouterr().err
    assert (out / "summary.md").is_file()  # the aggregation still ran


def test_sigterm_stops_running_jobs_with_a_save(tmp_path):
    """SIGTERM on the study: each running script gets SIGTERM (save and stop); exit 130."""
    child = (
        "import pathlib, signal, sys, time; p = pathlib.Path(sys.argv[1]); "
        "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('saved'), sys.exit(143))); "
        "p.with_suffix('.up').write_text(''); time.sleep(120)"
    )
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tools import study\n"
        f"from pathlib import Path\nt = Path({str(tmp_path)!r})\n"
        f"jobs = [study.Job(f'j{{i}}', [sys.executable, '-c', {child!r}, str(t / f'j{{i}}.txt')],"
        f" t / f'j{{i}}.log') for i in range(3)]\n"
        f"study.run_jobs(jobs, 2, poll_s=0.05)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not all((tmp_path / f"j{i}.up").exists() for i in (0, 1)):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert [(tmp_path / f"j{i}.txt").read_text() for i in (0, 1)] == ["saved", "saved"]
    assert not (tmp_path / "j2.log").exists()  # the third never started
    assert "run the same command again" in output


# =====================================================================================
# Aggregation on hand-made metrics
# =====================================================================================
def _rows(reach, steps=150, every=10, dt=3.0, lo=0.2, hi=0.6):
    """A run logged every step, dt seconds apart; held-out sampled accuracy lo until step
    `reach` (None: never), hi from there on; greedy 0.1 above it."""
    rows = []
    for step in range(steps + 1):
        r = {"step": step, "time": 1000.0 + dt * step, "seconds": dt * step}
        if step:
            r.update(entropy=0.5, reward=0.25)
        if step % every == 0:
            acc = hi if reach is not None and step >= reach else lo
            r.update({"eval/sampled_acc": acc, "eval/greedy_acc": acc + 0.1})
        rows.append(r)
    return rows


def _runs(**reach_by_config):
    return {
        (c, s): _rows(r)
        for c, reaches in reach_by_config.items()
        for s, r in zip((1, 2, 3), reaches)
    }


def _write_run(out, name, reach, resumes=None):
    d = out / "runs" / name
    d.mkdir(parents=True)
    rows = [{k: v for k, v in r.items() if k != "seconds"} for r in _rows(reach)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"steps": 150}))
    if resumes:
        (out / "logs").mkdir(exist_ok=True)
        (out / "logs" / f"{name}.resumes").write_text(resumes)


def test_elapsed_seconds():
    t = [0.0, 2.0, 5.0, 15.0, 500.0, 502.0, 600.0, 610.0]  # times of steps 0..7
    rows = [{"step": s, "time": x} for s, x in enumerate(t)]
    for s in (0, 3, 7):  # evaluations at 0, 3 and 7
        rows[s]["eval/sampled_acc"] = 0.5
    assert study.elapsed_seconds(rows) == [0, 2, 5, 15, 500, 502, 600, 610]
    # resumed after steps 3 and 5: steps 4 and 6 get the median of the other training gaps
    # (2, 3, 2): 2. The evaluating gaps (10 at steps 3 and 7) are not theirs to use.
    assert study.elapsed_seconds(rows, {3, 5}) == [0, 2, 5, 15, 17, 19, 21, 31]
    # resumed after step 3: step 4, an evaluation, gets the other evaluating gap, 5 (not 2)
    rows2 = [{"step": s, "time": x} for s, x in enumerate([0.0, 2.0, 7.0, 9.0, 99.0])]
    for s in (0, 2, 4):
        rows2[s]["eval/sampled_acc"] = 0.5
    assert study.elapsed_seconds(rows2, {3}) == [0, 2, 7, 9, 14]


def test_first_reach_and_mean_std():
    rows = _rows(reach=40)
    assert study.first_reach(rows, 0.54) == (40, 120.0)
    assert study.first_reach(rows, 0.6) == (40, 120.0)  # at the threshold counts
    assert study.first_reach(rows, 0.61) is None
    assert study.first_reach(_rows(reach=None), 0.54) is None
    assert study.mean_std([40, 50, 60]) == (50, 10)
    m, s = study.mean_std([1, 2])
    assert m == 1.5 and abs(s - 0.5**0.5) < 1e-12
    assert study.mean_std([7]) == (7, None) and study.mean_std([]) == (None, None)


def test_threshold_and_aggregate():
    runs = {
        ("grpo", 1): _rows(90, hi=0.5),
        ("grpo", 2): _rows(100, hi=0.6),
        ("grpo", 3): _rows(110, hi=0.7),
        ("tepo", 1): _rows(None),
    }
    thr = study.threshold_of(runs, 0.9)
    assert abs(thr - 0.9 * 0.6) < 1e-12
    stats = study.aggregate(runs, ["grpo", "dapo", "tepo"], thr)
    assert list(stats) == ["grpo", "tepo"]  # no dapo runs
    g = stats["grpo"]
    # seed 1 tops out at 0.5 < 0.54: never reached
    assert g["reach_steps"] == [None, 100, 110] and g["reach_seconds"] == [None, 300.0, 330.0]
    assert g["sampled"] == [0.5, 0.6, 0.7] and g["start"] == [0.2] * 3 and g["steps"] == 150
    assert g["mask_frac"] == [None] * 3 and g["seconds_per_step"] == [3.0] * 3
    masked = [
        {**r, "mask_frac": 0.1 * (r["step"] % 3)} if r["step"] else r for r in _rows(None, steps=6)
    ]
    assert study.aggregate({("tepo", 1): masked}, ["tepo"], thr)["tepo"]["mask_frac"][
        0
    ] == pytest.approx(0.1)
    assert stats["tepo"]["reach_steps"] == [None]
    assert study.threshold_of({("tepo", 1): _rows(10)}, 0.9) is None


def test_compare_rule():
    base = [90, 100, 110]
    assert study.compare([40, 50, 60], base) == "confirmed"  # 0.5x, no overlap
    assert study.compare([55, 60, 65], base) == "confirmed"  # exactly 0.6x
    assert study.compare([60, 61, 65], base) == "inconclusive"  # 0.62x
    assert study.compare([20, 30, 95], base) == "inconclusive"  # 0.48x, but 95 > 90: overlap
    assert study.compare([40, 50, None], base) == "inconclusive"  # one TEPO run never got there
    assert study.compare([40, 50, 60], [90, None, None]) == "confirmed"  # unreached = slowest
    assert study.compare([100, 100, 100], base) == "refuted"  # as slow as the baseline
    assert study.compare([67, 70, 80], base) == "refuted"  # 0.72x, and 67 / 110 = 0.61 > 0.6
    assert study.compare([65, 70, 80], base) == "inconclusive"  # 65 / 110 = 0.59: seeds overlap
    assert study.compare([70, None, None], [100, 100, 100]) == "refuted"  # 0.7x at best
    assert study.compare([None, None, None], base) == "refuted"
    assert study.compare([40, 50, 60], [None, None, None]) == "inconclusive"
    assert study.combine(["confirmed", "confirmed"]) == "confirmed"
    assert study.combine(["confirmed", "inconclusive"]) == "inconclusive"
    assert study.combine(["confirmed", "refuted"]) == "refuted"
    assert study.combine([]) == "inconclusive"


@pytest.mark.parametrize(
    "tepo,dapo,expected",
    [
        ([40, 50, 60], [110, 120, 130], "confirmed"),
        ([40, 50, 60], [30, 40, 50], "refuted"),  # faster than GRPO, slower than DAPO
        ([50, 60, 100], [110, 120, 130], "inconclusive"),
        ([None, None, None], [110, 120, 130], "refuted"),
    ],
)
def test_verdict(tepo, dapo, expected):
    runs = _runs(grpo=[90, 100, 110], dapo=dapo, tepo=tepo)
    thr = study.threshold_of(runs, 0.9)
    v, text = study.verdict(study.aggregate(runs, ["grpo", "dapo", "tepo"], thr), thr)
    assert v == expected and f"In steps: **{expected}**" in text


def test_no_verdict():
    runs = _runs(grpo=[90, 100, 110], tepo=[40, 50, 60])
    stats = study.aggregate(runs, ["grpo", "tepo"], 0.2)  # the accuracy before training
    assert study.verdict(stats, 0.2)[0] is None and "not above" in study.verdict(stats, 0.2)[1]
    stats = study.aggregate(_runs(grpo=[90]), ["grpo"], 0.54)  # no TEPO run
    v, text = study.verdict(stats, 0.54)
    assert v is None and text.startswith("No verdict")


def test_summary_and_csv_from_disk(tmp_path, capsys):
    """--no-run aggregates finished runs on disk; the table shows hand-computed figures."""
    out = tmp_path / "s"
    for c, reaches in (("grpo", [90, 100, 110]), ("dapo", [110, 120, 130]), ("tepo", [40, 50, 60])):
        for seed, reach in zip((1, 2, 3), reaches):
            _write_run(out, f"{c}-s{seed}", reach)
    (out / "runs" / "tepo-observed-s1").mkdir()  # started, not finished: left out, and said so
    assert (
        study.main(["--configs", "grpo,dapo,tepo,tepo-observed", "--out", str(out), "--no-run"])
        == 0
    )
    summary = (out / "summary.md").read_text()
    # threshold 0.9 x 0.6 = 0.54; TEPO 50 ± 10 steps = 150 ± 30 s; 50 / 100 = 0.50x GRPO,
    # 50 / 120 = 0.42x DAPO, the same in seconds
    assert "**Threshold**: 0.540" in summary
    assert (
        "| tepo | 3 | 150 | 0.600 ± 0.000 | 0.700 ± 0.000 | 50 ± 10 (3/3 reached) | "
        "150 ± 30 (3/3 reached) | 0.50x | 0.42x | 0.50x | 0.42x |"
    ) in summary
    assert "| grpo | 3 | 150 | 0.600 ± 0.000 | 0.700 ± 0.000 | 100 ± 10 (3/3 reached)" in summary
    assert "before training (step 0, the same model for every config): 0.200 ± 0.000" in summary
    assert "- tepo: s1 40, s2 50, s3 60" in summary
    assert "| grpo | - | 3.00 ± 0.00 |" in summary  # 450 s over 150 steps; GRPO has no mask
    assert "In steps: **confirmed**" in summary and "In seconds: **confirmed**" in summary
    assert "Unfinished, left out: tepo-observed-s1" in summary
    assert "No finished runs: tepo-observed" in summary
    res = _csv(out / "results.csv")
    assert len(res) == 9 * 16  # 9 runs x evaluations at steps 0, 10, ..., 150
    assert res[5] == {
        "config": "grpo",
        "seed": "1",
        "step": "50",
        "seconds": "150",
        "greedy_acc": "0.3",
        "sampled_acc": "0.2",
    }
    steps = _csv(out / "steps.csv")
    assert len(steps) == 9 * 150 and steps[0]["mask_frac"] == "" and steps[0]["entropy"] == "0.5"
    assert "verdict" in capsys.readouterr().out


def test_resumes_on_disk_are_not_counted(tmp_path):
    """A resume noted in logs/<run>.resumes: the stopped interval does not count as seconds."""
    out = tmp_path / "s"
    _write_run(out, "grpo-s1", reach=30, resumes="4\n")
    path = out / "runs" / "grpo-s1" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows[5:]:
        r["time"] += 1000.0  # stopped for 1000 s after step 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, unfinished = study.load_runs(out, ["grpo"], [1])
    assert unfinished == [] and [r["seconds"] for r in runs["grpo", 1]][:7] == [
        0,
        3,
        6,
        9,
        12,
        15,
        18,
    ]


# =====================================================================================
# PLAN.md's paired statistics, on hand-made values
# =====================================================================================
def test_censored_steps():
    rows = _rows(reach=40, steps=160)
    assert study.censored_steps(rows, 0.54, 160, 10) == 40
    assert study.censored_steps(rows, 0.6, 160, 10) == 40  # at the threshold counts
    assert study.censored_steps(rows, 0.61, 160, 10) == 170  # never reached: 160 + 10
    assert study.censored_steps(_rows(None, steps=160), 0.54, 160, 10) == 170
    assert study.censored_steps(_rows(None, steps=150, every=5), 0.54, 150, 5) == 155
    runs = {("grpo", 1): _rows(40, steps=160), ("grpo", 2): _rows(None, steps=160)}
    g = study.aggregate(runs, ["grpo"], 0.54, eval_every=10)["grpo"]
    assert g["censored_steps"] == [40, 170] and g["reach_steps"] == [40, None]
    assert study.aggregate(runs, ["grpo"], None)["grpo"]["censored_steps"] == [None, None]


def test_percentile_convention():
    # sorted means m, k = floor((1 - level) / 2 x B): (m[k], m[B - 1 - k])
    assert study.percentile_interval(list(range(10000))) == (250, 9749)
    assert study.percentile_interval(list(range(9999, -1, -1))) == (250, 9749)  # sorted first
    assert study.percentile_interval(list(range(40))) == (1, 38)  # 0.025 x 40 = 1
    assert study.percentile_interval(list(range(20))) == (0, 19)  # 0.025 x 20 = 0.5 -> 0
    assert study.percentile_interval(list(range(100)), 0.9) == (5, 94)  # 4.999... in floats -> 5
    assert study.percentile_interval([3.0]) == (3.0, 3.0)


def test_bootstrap_ci():
    assert study.bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)  # each end has p 1/4 > 2.5%
    assert study.bootstrap_ci([2, 2, 2]) == (2.0, 2.0)
    assert study.bootstrap_ci([7]) == (7.0, 7.0)
    # resampled means of [0, 0, 0, 1] are j/4, j ~ Binomial(4, 1/4): P(mean = 0) = 81/256 puts
    # m[250] at 0; P(mean >= 0.75) = 13/256 = 5.1% > 2.5% > P(mean = 1) = 1/256 puts m[9749] at 0.75
    assert study.bootstrap_ci([0, 0, 0, 1]) == (0.0, 0.75)
    # three values: each end (all three draws alike) has p 1/27 = 3.7% > 2.5%: the min and the max
    assert study.bootstrap_ci([-20, -30, -40]) == (-40.0, -20.0)
    assert study.bootstrap_ci([0.5, 2 / 3, 0.5]) == (0.5, 2 / 3)
    # five values: each end has p 1 / 3125, far under 2.5%: strictly inside [min, max]
    lo, hi = study.bootstrap_ci([1, 2, 3, 4, 5])
    assert 1 < lo < 3 < hi < 5
    assert study.bootstrap_ci([1, 2, 3, 4, 5]) == (lo, hi)  # random.Random(0): the same each time
    # the resampling itself: one resample is random.Random(seed).choices(values, k=len(values))
    values = [1.0, 2.0, 4.0, 8.0, 16.0]
    for seed in (0, 1):
        one = sum(random.Random(seed).choices(values, k=5)) / 5
        assert study.bootstrap_ci(values, n_boot=1, seed=seed) == (one, one)
    one, other = (study.bootstrap_ci(values, n_boot=1, seed=s) for s in (0, 1))
    assert one != other
    with pytest.raises(ValueError):
        study.bootstrap_ci([])


def test_paired_differences_ratios():
    pairs = study.paired({3: 30, 1: 10, 2: 20}, {2: 4, 3: 5, 4: 6, 1: 0})
    assert pairs == [(10, 0), (20, 4), (30, 5)]  # the common seeds, in seed order
    assert study.paired({1: 1}, {2: 2}) == []
    # seed order, not a set's order ({8, 1, 3} iterates 8 first)
    assert study.paired({8: 80, 1: 10, 3: 30}, {3: 3, 1: 1, 8: 8}) == [(10, 1), (30, 3), (80, 8)]
    assert study.differences(pairs) == [10, 16, 25]
    assert study.ratios(pairs[1:]) == [5.0, 6.0]
    assert study.ratios(pairs) is None  # a baseline at the threshold at step 0: no ratio
    assert study.by_seed({"seeds": [2, 5], "x": [0.1, 0.2]}, "x") == {2: 0.1, 5: 0.2}


def test_claim_verdict_and_combine():
    assert study.claim_verdict(0.3, 0.7) == "confirmed"
    assert study.claim_verdict(0.6, 0.9) == "refuted"
    assert study.claim_verdict(0.4, 1.1) == "inconclusive"
    assert study.claim_verdict(0.5, 0.9) == "confirmed"  # lo == 0.5: a halving is in the interval
    assert study.claim_verdict(0.3, 1.0) == "inconclusive"  # hi == 1: not faster with confidence
    assert study.claim_verdict(0.5, 1.0) == "inconclusive"
    assert study.claim_verdict(0.500001, 1.2) == "refuted"  # lo > 0.5, whatever hi
    assert study.claim_verdict(0.2, 0.45) == "confirmed"  # a halving beaten
    assert study.combine_claim(["confirmed", "confirmed"]) == "confirmed"
    assert study.combine_claim(["confirmed", "inconclusive"]) == "inconclusive"
    assert study.combine_claim(["confirmed", "refuted"]) == "refuted"
    assert study.combine_claim(["inconclusive", "refuted"]) == "refuted"
    assert study.combine_claim(["inconclusive", "inconclusive"]) == "inconclusive"
    assert study.combine_claim([]) == "inconclusive"


def test_one_config_name_per_run():
    """No two configs are one run: the same script with the same flags, once the script's own
    defaults fill what a config leaves out."""
    import dataclasses
    import importlib

    import runner

    seen = {}
    for name, (script, flags) in study.CONFIGS.items():
        if not study.script_available(script):
            continue
        Args = importlib.import_module(script).Args
        if name in study.RETIRED:  # retired because the script no longer takes its flags
            with pytest.raises(SystemExit):
                runner.parse_args(Args, flags)
            continue
        args = runner.parse_args(Args, flags)
        run = (script, dataclasses.astuple(args), study.ARMS.get(name))  # an arm: a change too
        assert run not in seen, f"configs {seen.get(run)!r} and {name!r} are one run"
        seen[run] = name


def _st(steps, acc=0.6):
    """Hand-made aggregate() entry: per-seed censored steps, final sampled accuracy acc."""
    acc = acc if isinstance(acc, list) else [acc] * len(steps)
    return {"seeds": list(range(1, len(steps) + 1)), "censored_steps": steps, "sampled": acc}


def test_candidate_scores_take_the_larger_ratio():
    # X: ratios to GRPO 0.2, 0.5 (mean 0.35), to DAPO 0.1, 1.0 (0.55): score 0.55, the larger.
    # Y: 0.7, 0.35 and 0.35, 0.7: score 0.525. By the larger Y is ahead; by the smaller (0.35 vs
    # 0.525) or the mean over both (0.45 vs 0.525), X would be.
    stats = {
        "grpo": _st([100, 200]),
        "dapo": _st([200, 100]),
        "tepo-seq-ppo": _st([20, 100]),
        "tepo": _st([70, 70]),
        "tepo-token-ratio": _st([200, 200]),
    }
    scores = study.candidate_scores(stats)
    assert scores == pytest.approx({"tepo-seq-ppo": 0.55, "tepo": 0.525, "tepo-token-ratio": 1.5})
    assert study.candidate_scores({"grpo": _st([100]), "tepo-seq-ppo": _st([50])}) == {
        "tepo-seq-ppo": None
    }


BASE = {"grpo": _st([100, 100, 100]), "dapo": _st([100, 100, 100])}


def test_pick_default_lowest_score_when_the_interval_excludes_0():
    # scores: (a) 0.9, (b) 0.6, (c) 0.8; (b) - (c) = -30, -20, -10: CI [-30, -10], no 0.
    # token's accuracy is far higher, but the accuracy does not decide here.
    stats = {
        **BASE,
        "tepo-seq-ppo": _st([90, 90, 90], 0.5),
        "tepo": _st([50, 60, 70], 0.5),
        "tepo-token-ratio": _st([80, 80, 80], 0.7),
    }
    name, why = study.pick_default(stats)
    assert name == "tepo", why
    assert "tepo-seq-ppo 0.900, tepo 0.600, tepo-token-ratio 0.800" in why
    assert "-20.0 [95% CI -30.0, -10.0] excludes 0" in why


def test_pick_default_accuracy_decides_when_the_interval_contains_0():
    # scores: (b) 0.7 (best), (c) 0.8, (a) 0.9; (b) - (c) = 0, -10, -20: the resampled
    # mean is 0 only when all three draws are seed 1 (p 1/27 = 3.7% > 2.5%), so CI [-20, 0]
    # holds 0 at its end. Then token's accuracy, 0.05 higher, wins; tepo's, higher still, is not
    # one of the two best and does not count.
    stats = {
        **BASE,
        "tepo-seq-ppo": _st([90, 90, 90], 0.9),
        "tepo": _st([80, 70, 60], 0.5),
        "tepo-token-ratio": _st([80, 80, 80], 0.55),
    }
    name, why = study.pick_default(stats)
    assert name == "tepo-token-ratio", why
    assert "[95% CI -20.0, +0.0] contains 0" in why
    assert "tepo 0.500, tepo-token-ratio 0.550" in why


def test_pick_default_a_stays_when_accuracies_are_within_0_01():
    # scores: (b) 0.6, (c) 0.617, (a) 0.9 (last); (b) - (c) = -5, -5, +5: CI [-5, 5].
    # Accuracies 0.60 and 0.61: within 0.01 (the end included), so (a) stays, last or not.
    stats = {
        **BASE,
        "tepo-seq-ppo": _st([90, 90, 90], 0.9),
        "tepo": _st([50, 60, 70], 0.6),
        "tepo-token-ratio": _st([55, 65, 65], 0.61),
    }
    name, why = study.pick_default(stats)
    assert name == "tepo-seq-ppo", why
    assert "contains 0" in why and "(a) `tepo-seq-ppo` stays" in why
    stats["tepo-token-ratio"] = _st([55, 65, 65], 0.6101)  # just over 0.01: the higher wins
    assert study.pick_default(stats)[0] == "tepo-token-ratio"


def test_pick_default_without_a_rule_to_apply():
    stats = {**BASE, "tepo-seq-ppo": _st([90, 90, 90]), "tepo": _st([50, 60, 70])}
    assert study.pick_default(stats) == (None, "no pick: no finished runs of tepo-token-ratio")
    stats["tepo-token-ratio"] = _st([80, 80, 80])
    stats["grpo"] = _st([0, 100, 100])  # at the threshold at step 0: no ratio
    name, why = study.pick_default(stats)
    assert name is None and "step 0" in why


def _study_runs(**reach_by_config):
    """160-step runs, evaluated every 10, one per seed 1, 2, 3 (None: never reaches 0.6)."""
    return {
        (c, s): _rows(r, steps=160)
        for c, reaches in reach_by_config.items()
        for s, r in zip((1, 2, 3), reaches)
    }


def _summary(tmp_path, runs, threshold=None, **args):
    configs = list(dict.fromkeys(c for c, _ in runs))
    thr = threshold if threshold is not None else study.threshold_of(runs, 0.9)
    stats = study.aggregate(runs, configs, thr, eval_every=10)
    study.write_summary(
        tmp_path,
        study.Args(configs=",".join(configs), threshold=threshold, **args),
        stats,
        thr,
        [],
        configs,
    )
    return (tmp_path / "summary.md").read_text()


def test_summary_paired_section_development(tmp_path):
    # threshold 0.9 x 0.6 = 0.54. Censored steps: grpo 40, 60, 80; dapo 80, 120, 170 (never);
    # (a) 20, 30, 40; (b) 170 (never, final 0.2), 30, 40; (c) 20, 40, 40. With three seeds
    # each end of an interval has p 1/27 > 2.5%: the intervals are [min, max] of per-seed values.
    runs = _study_runs(
        grpo=[40, 60, 80],
        dapo=[80, 120, None],
        **{
            "tepo-seq-ppo": [20, 30, 40],
            "tepo": [None, 30, 40],
            "tepo-token-ratio": [20, 40, 40],
        },
    )
    summary = _summary(tmp_path, runs)
    # the first study's content
    assert "## Verdict" in summary and "| tepo-seq-ppo | 3 | 160 |" in summary
    assert "## Paired by seed (docs/study/PLAN.md)" in summary
    assert "`--threshold 0.54`" in summary or "`--threshold 0.5399999999999999`" in summary
    # (a) - grpo = -20, -30, -40; ratios 0.5 each; accuracies alike
    assert (
        "| tepo-seq-ppo | grpo | 3 | 0 / 0 | -30.0 [-40.0, -20.0] | 0.500 [0.500, 0.500] | "
        "+0.000 [+0.000, +0.000] |" in summary
    )
    # (a) - dapo = -60, -90, -130 (mean -93.3); ratios 0.25, 0.25, 40/170 = 0.235 (mean 0.245)
    assert (
        "| tepo-seq-ppo | dapo | 3 | 0 / 1 | -93.3 [-130.0, -60.0] | 0.245 [0.235, 0.250] |"
        in summary
    )
    # (b) - grpo = 130, -30, -40 (mean 20); ratios 4.25, 0.5, 0.5 (mean 1.75); acc -0.4, 0, 0
    assert (
        "| tepo | grpo | 3 | 1 / 0 | +20.0 [-40.0, +130.0] | 1.750 [0.500, 4.250] | "
        "-0.133 [-0.400, +0.000] |" in summary
    )
    assert "| seed | grpo | dapo | tepo-seq-ppo | tepo | tepo-token-ratio |" in summary
    assert "| 1 | 40 / 0.600 | 80 / 0.600 | 20 / 0.600 | 170* / 0.200 | 20 / 0.600 |" in summary
    assert "| 3 | 80 / 0.600 | 170* / 0.200 | 40 / 0.600 | 40 / 0.600 | 40 / 0.600 |" in summary
    # scores: (a) max(0.5, 0.245) = 0.5; (b) max(1.75, 0.870) = 1.75; (c): to grpo 0.5, 0.667,
    # 0.5 (0.556), to dapo 0.272: 0.556. The two best: (a) and (c), (a) - (c) = 0, -10, 0:
    # CI [-10, 0] holds 0; accuracies 0.6 and 0.6: (a) stays.
    assert "**New default by PLAN.md's rule** (seeds 1, 2, 3): `tepo-seq-ppo`. Scores" in summary
    assert "tepo-seq-ppo 0.500, tepo 1.750, tepo-token-ratio 0.556" in summary
    assert "(a) `tepo-seq-ppo` stays" in summary
    assert 'Verdict on "50% faster" by PLAN.md\'s rule' not in summary  # three TEPO configs


def test_summary_paired_section_confirmation(tmp_path):
    # fixed threshold 0.54; tepo 30, 50, 60 against grpo 80, 120, 170: ratios 0.375, 0.417, 0.353,
    # CI [0.353, 0.417]: confirmed. Against dapo 40, 60, 80: 0.75, 0.833, 0.75, CI [0.75, 0.833]:
    # lo > 0.5, refuted. The claim: refuted (refuted against one, whatever the other).
    runs = _study_runs(grpo=[80, 120, None], dapo=[40, 60, 80], tepo=[30, 50, 60])
    summary = _summary(tmp_path, runs, threshold=0.54)
    assert "**Threshold**: 0.540 held-out sampled accuracy fixed by --threshold 0.54." in summary
    assert "| tepo | dapo | 3 | 0 / 0 | -13.3 [-20.0, -10.0] | 0.778 [0.750, 0.833] |" in summary
    assert "| tepo | grpo | 3 | 0 / 1 | -76.7 [-110.0, -50.0] | 0.382 [0.353, 0.417] |" in summary
    assert (
        '**Verdict on "50% faster" by PLAN.md\'s rule** (`tepo`, seeds 1, 2, 3): '
        "against GRPO **confirmed** (ratio 0.382 [0.353, 0.417]); against DAPO **refuted** "
        "(ratio 0.778 [0.750, 0.833]). The claim: **refuted**."
    ) in summary
    assert "New default by PLAN.md's rule" not in summary  # one candidate only
    assert "No verdict by this rule" not in summary  # the first study's rule judges `tepo` too
    # another TEPO config alone: the first study's rule says where this study's verdict is
    runs = _study_runs(grpo=[80, 120, None], dapo=[40, 60, 80], **{"tepo-seq-ppo": [30, 50, 60]})
    summary = _summary(tmp_path, runs, threshold=0.54)
    assert (
        "No verdict by this rule, which judges the config `tepo`; for `tepo-seq-ppo` see the "
        "paired statistics below."
    ) in summary
    assert '**Verdict on "50% faster" by PLAN.md\'s rule** (`tepo-seq-ppo`, seeds' in summary
    # all faster than half of both: confirmed against each, and so the claim
    runs = _study_runs(grpo=[40, 60, 80], dapo=[80, 120, None], tepo=[20, 20, 30])
    assert "The claim: **confirmed**." in _summary(tmp_path, runs, threshold=0.54)


def test_console_prints_the_plans_verdict(tmp_path, capsys):
    """The last console line gives PLAN.md's verdict when the study has one, not the first
    study's (here inconclusive: TEPO's mean steps are not 0.6x DAPO's). The command is the
    second study's confirmation as PLAN.md wrote it, under (b)'s old name: it reads as `tepo`."""
    out = tmp_path / "s"
    # threshold 0.5 fixed; reached at tepo 30, 50, 60 / grpo 80, 120, 150 / dapo 40, 60, 80:
    # ratios to DAPO 0.75, 0.833, 0.75, lo > 0.5: refuted against DAPO, and so the claim
    for config, reaches in {
        "grpo": [80, 120, 150],
        "dapo": [40, 60, 80],
        "tepo": [30, 50, 60],
    }.items():
        for seed, reach in zip((1, 2, 3), reaches):
            _write_run(out, f"{config}-s{seed}", reach)
    assert (
        study.main(
            [
                "--configs",
                "grpo,dapo,tepo-seq-gspo",
                "--out",
                str(out),
                "--no-run",
                "--threshold",
                "0.5",
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        "verdict on 'TEPO halves GRPO/DAPO's convergence time' (steps): refuted "
        "(`tepo`, docs/study/PLAN.md's rule)"
    ), last
    # the first rule's paragraph
    assert "In steps: **inconclusive**" in (out / "summary.md").read_text()


def test_summary_without_the_paired_section(tmp_path):
    runs = _study_runs(grpo=[40, 60, 80], tepo=[20, 30, 40])  # no dapo
    assert "Paired by seed" not in _summary(tmp_path, runs)
    runs = _study_runs(grpo=[40, 60, 80], dapo=[80, 120, None], erpo=[20, 30, 40])  # no candidate
    assert "Paired by seed" not in _summary(tmp_path, runs)


def test_fixed_threshold_from_disk(tmp_path):
    """--threshold replaces --threshold-frac x GRPO's mean, also with no grpo run at all."""
    out = tmp_path / "s"
    for seed, reach in zip((1, 2, 3), [40, 50, 60]):
        _write_run(out, f"tepo-s{seed}", reach)
    assert (
        study.main(["--configs", "tepo", "--out", str(out), "--no-run", "--threshold", "0.5"]) == 0
    )
    summary = (out / "summary.md").read_text()
    assert "**Threshold**: 0.500 held-out sampled accuracy fixed by --threshold 0.5." in summary
    assert "- tepo: s1 40, s2 50, s3 60" in summary


def test_doctests():
    assert doctest.testmod(study).failed == 0


def test_kl_diagnosis_figure_only_for_tepo_configs_that_logged_it(tmp_path):
    kl = {
        "kl_pos_adv": 0.1,
        "kl_neg_adv": 0.2,
        "masked_kl": 0.3,
        "kl_off_mask": 0.05,
        "kl_first_quarter": 0.01,
        "kl_last_quarter": 0.4,
        "truncated_frac": 0.5,
    }
    runs = {
        ("grpo", 1): _rows(40),
        ("tepo", 1): [{**r, **kl} for r in _rows(40)],
        ("tepo", 2): [{**r, **kl} for r in _rows(50)],
    }
    assert study.plot_kl_diagnosis(tmp_path, {("grpo", 1): _rows(40)}, ["grpo"]) is False
    assert not (tmp_path / "kl_diagnosis.png").exists()
    assert study.plot_kl_diagnosis(tmp_path, runs, ["grpo", "tepo"]) is True
    assert (tmp_path / "kl_diagnosis.png").read_bytes()[:4] == b"\x89PNG"


def test_intervals_figure_needs_both_baselines(tmp_path):
    stats = {**BASE, "tepo": _st([90, 90, 90], 0.5), "tepo-token-ratio": _st([50, 60, 70], 0.7)}
    assert study.plot_intervals(tmp_path, {"grpo": BASE["grpo"], "tepo": stats["tepo"]}) is False
    assert not (tmp_path / "intervals.png").exists()
    assert study.plot_intervals(tmp_path, stats) is True
    assert (tmp_path / "intervals.png").read_bytes()[:4] == b"\x89PNG"


def test_curves_put_baselines_and_tepo_configs_in_separate_panels_and_stay_small(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    from PIL import Image

    runs = {
        (c, s): _rows(r)
        for c, r in (("grpo", 40), ("dapo", 30), ("tepo", 20), ("tepo-seq-ppo", 50))
        for s in (1, 2)
    }
    drawn = []  # (panel title, labels of its lines), captured as the figure is saved
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *a, **kw):
        drawn.extend((ax.get_title(), [ln.get_label() for ln in ax.lines]) for ax in fig.axes)
        return real_savefig(fig, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert study.plot_curves(tmp_path, runs, ["grpo", "dapo", "tepo", "tepo-seq-ppo"], 0.5) is True
    acc = {t: labels for t, labels in drawn if t.startswith("held-out sampled acc")}
    assert acc["held-out sampled acc: baselines and other scripts"] == [
        "grpo",
        "dapo",
        "threshold 0.500",
    ]
    assert acc["held-out sampled acc: TEPO configs"] == [
        "grpo (reference)",
        "tepo",
        "tepo-seq-ppo",
        "threshold 0.500",
    ]
    png = tmp_path / "curves.png"
    assert png.stat().st_size < 300_000
    with Image.open(png) as im:
        assert im.mode == "P"  # quantized to a palette by save_small


# =====================================================================================
# docs/study/PLAN-kl-real.md: tepo-len-token without its KL, and with it on every valid token
# =====================================================================================
KL0, KLALL = "tepo-len-token-kl0", "tepo-len-token-klall"


def test_kl_study_configs_and_how_they_start(tmp_path):
    base = study.CONFIGS["tepo-len-token"]
    assert study.CONFIGS[KL0] == ("tepo", [*base[1], "--kl-coef", "0"])  # flags only
    assert study.CONFIGS[KLALL] == base  # the same flags: the change is made from outside
    assert list(study.ARMS) == [KLALL]
    assert study.resolve_runs(f"{KL0}:1,{KLALL}:1") == [(KL0, 1), (KLALL, 1)]
    out, tepo_py, diag = (
        tmp_path / "s",
        str(ROOT / "tepo.py"),
        str(ROOT / "tools" / "diagnostics.py"),
    )
    _fake_checkpoint(out / "runs" / f"{KLALL}-s2", 15)  # a stopped klall run: its resume
    (out / "logs").mkdir(parents=True)
    pairs = [(KL0, 1), (KLALL, 1), (KLALL, 2)]
    kl0, klall, resumed = (j.cmd for j in study.make_jobs(study.Args(), [], [], out, pairs))
    assert kl0[1:3] == [diag, tepo_py] and kl0[-2:] == ["--kl-coef", "0"]
    arm = [str(ROOT / "tools" / "study.py"), "--arm", KLALL, tepo_py]
    assert klall[1:5] == arm and klall[-len(base[1]) :] == base[1]
    assert resumed[1:] == [*arm, "--resume", str(out / "runs" / f"{KLALL}-s2")]  # still the arm
    with pytest.raises(UserError, match="--arm CONFIG"):
        study.run_arm([KL0, tepo_py])  # kl0 is flags, not an arm


def test_klall_replaces_the_mask_by_every_valid_token():
    import torch

    import tepo
    from tools import diagnostics

    A = torch.tensor([1.0, -1.0, 0.5])
    falls = torch.tensor([[True, False, True], [True, True, True], [False, False, True]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # padding after EOS
    changes = study.kl_on_every_token(tepo)
    assert all(hasattr(owner, name) for owner, name, _ in changes)  # else run_arm refuses
    own = tepo.kl_mask(A, falls, mask)
    assert own.tolist() == [[True, False, False], [False] * 3, [False] * 3]
    logp, ref = -torch.rand(3, 3), -torch.rand(3, 3)
    terms = dict(logp=logp, old_logp=logp, ref_logp=ref, advantages=A, mask=mask)
    with diagnostics.patched(*changes):
        M = tepo.kl_mask(A, falls, mask)
        assert M.dtype == torch.bool and torch.equal(M, mask.bool())
        stats = tepo.tepo_stats(**terms, M=M, entropy=torch.ones(3, 3))
    assert tepo.kl_mask(A, falls, mask).tolist() == own.tolist()  # put back after
    kl, m = tepo.k3_kl(ref, logp), mask.bool()
    assert stats["mask_frac"] == 1.0 and stats["masked_kl"] == pytest.approx(stats["kl"])
    assert stats["tepo_mask_frac"] == pytest.approx(1 / 6)  # TEPO's own: 1 of 6 valid tokens
    assert stats["tepo_masked_kl"] == pytest.approx(kl[0, 0].item())
    assert stats["kl_off_tepo_mask"] == pytest.approx(kl[m & ~own].mean().item())


def test_klall_arm_runs_and_pairs_with_tepo_len_token_at_step_1(tmp_path):
    """One tiny step of each, as the study starts them: the arm's KL term is on every valid token
    (mask_frac 1, nothing off it), TEPO's own mask is logged beside it, and step 1's rollout, made
    before any update, is the baseline's (the plan's pairing check)."""
    out = tmp_path / "s"
    small = "--prompts-per-step 4 --group-size 4 --micro-batch-size 8 --num-mini-batches 2"
    args = study.Args(steps=1, eval_every=100, eval_n=8, extra=small)
    (out / "logs").mkdir(parents=True)
    jobs = study.make_jobs(args, [], [], out, [("tepo-len-token", 1), (KLALL, 1)])
    assert study.run_jobs(jobs, 2) == [], study.log_tail(jobs[1].log)
    import runner

    base, arm = (
        runner.read_metrics(out / "runs" / f"{c}-s1")[1] for c in ("tepo-len-token", KLALL)
    )
    assert arm["mask_frac"] == 1.0 and arm["kl_off_mask"] == 0.0
    assert arm["masked_kl"] == pytest.approx(arm["kl"])
    assert 0 < arm["tepo_mask_frac"] < 1 and arm["tepo_mask_frac"] == base["mask_frac"]
    assert "tepo_mask_frac" not in base
    for k in ("reward", "accuracy", "completion_len", "truncated_frac", "zero_std_frac"):
        assert arm[k] == base[k], k
