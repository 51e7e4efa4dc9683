"""tools/bench.py: a smoke run of the command line (table, CSV, PNG), each script's step as the
benchmark times it in the script's own train() (its functions wrapped), TRL's timer and
report on hand-made inputs, the interleaved TRL comparison (when TRL is installed), and the real-run
estimate on a toy model with hand-computed values. No timing is asserted: timings are noisy."""

import csv
import importlib
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

import common
from tools import cost
import runner
from tools import bench
from common import UserError

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(prompts_per_step=2, group_size=2, max_new_tokens=8)  # 4 completions, 8 tokens


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# =====================================================================================
# The command line, end to end
# =====================================================================================
def test_smoke_cli(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "bench.py"),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-trl",
        "--no-threads-check",
        "--scripts",
        "grpo",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--max-new-tokens",
        "16",
        "--curve-max-new-tokens",
        "8,16",
        "--curve-group-sizes",
        "2",
        "--curve-prompts",
        "2",
        "--curve-steps",
        "1",
        "--profile-steps",
        "1",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    # the table, printed and in bench.md with the machine and the estimate
    assert "| script | P x G | completions |" in p.stdout
    assert "| grpo | 4 x 2 | 8 |" in p.stdout
    assert "project/TRL" not in p.stdout  # --no-trl
    md = (out / "bench.md").read_text()
    assert "| grpo | 4 x 2 | 8 |" in md and f"torch {torch.__version__}" in md
    assert "2 torch threads" in md and "ESTIMATE, NOT MEASURED ON A GPU" in md

    # where the time goes: the four kinds of work, their shares, the machine's matmul peak
    assert "## Where a step's time goes" in md and "| matrix multiply |" in p.stdout
    shares = [
        int(line.split("|")[3].strip().rstrip("%"))
        for line in md.splitlines()
        if line.startswith(("| matrix multiply |", "| attention |", "| other ops |", "| Python |"))
    ]
    assert len(shares) == 4 and 97 <= sum(shares) <= 103  # rounded percentages of one step
    assert "A 2048^3 matrix multiply (fp32) runs at" in md

    # every timed step: the work of grpo.py's step (P*G completions, 2 optimizer steps)
    steps = _csv(out / "bench_steps.csv")
    assert len(steps) == 1 and steps[0]["script"] == "grpo"
    assert int(steps[0]["completions"]) == 8 and int(steps[0]["optimizer_steps"]) == 2
    assert 8 <= int(steps[0]["tokens"]) <= 8 * 16 and int(steps[0]["decode_steps"]) <= 16
    assert float(steps[0]["ref_logp"]) > 0  # GRPO's reference model
    assert float(steps[0]["advantage"]) == 0  # ERPO's / SAPO's phase only

    # the curves: each value of each knob, the others at the run's values (P=4, G=2, T=16)
    rows = _csv(out / "bench_curves.csv")
    knobs = ("prompts_per_step", "group_size", "max_new_tokens")
    points = [(r["sweep"], *(int(r[k]) for k in knobs)) for r in rows]
    assert points == [
        ("max_new_tokens", 4, 2, 8),
        ("max_new_tokens", 4, 2, 16),
        ("group_size", 4, 2, 16),
        ("prompts_per_step", 2, 2, 16),
    ]
    for r in rows:
        assert int(r["completions"]) == int(r["prompts_per_step"]) * int(r["group_size"])
        assert int(r["tokens"]) <= int(r["completions"]) * int(r["max_new_tokens"])
        if r["sweep"] == "max_new_tokens":  # forced to the cap: cost against length
            assert r["forced_length"] == "True"
            assert int(r["decode_steps"]) == int(r["max_new_tokens"])
            assert int(r["tokens"]) == int(r["completions"]) * int(r["max_new_tokens"])
        else:
            assert r["forced_length"] == "False"
        assert int(r["timed_steps"]) == 1 and float(r["step_s"]) > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in p.stdout
    else:
        assert (out / "bench_curves.png").stat().st_size > 0


def test_estimate_only_and_bad_flags(capsys):
    bench.main(["--estimate-only"])
    text = capsys.readouterr().out
    assert "ESTIMATE, NOT MEASURED ON A GPU" in text and "| A100 80GB | grpo | 256 |" in text
    for argv, message in (
        (["--steps", "0"], "--steps must be at least 1"),
        (["--scripts", "grpo,nope"], "unknown script 'nope'"),
        (["--scripts", "grpo,grpo"], "distinct"),
        (["--curve-group-sizes", "2,x"], "comma list of integers"),
        (["--curve-prompts", "0"], "integers >= 1"),
        (["--profile-steps", "-1"], "--profile-steps must be >= 0"),
        (["--device", "tpu"], "unknown --device"),
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err, argv


# =====================================================================================
# Each script's step, as the benchmark times it in train()
# =====================================================================================
PHASES_OF = {
    "grpo": {"generate", "reward", "old_logp", "ref_logp", "update"},
    "dapo": {"generate", "reward", "old_logp", "update"},
    "tepo": {"generate", "reward", "old_logp", "ref_logp", "update"},
    "erpo": {"generate", "reward", "old_logp", "ref_logp", "advantage", "update"},
    "sapo": {"generate", "reward", "old_logp", "ref_logp", "advantage", "update"},
}


@pytest.mark.parametrize("name", [s for s in bench.SCRIPTS if bench.script_available(s)])
def test_the_benchmark_runs_the_scripts_own_train(name):
    """run_script runs <name>.py's train() (no copy of its loop): the phases it times are the
    ones that script has, they add up to at most the step, and the work is the preset's."""
    args = bench.Args(prompts_per_step=4, group_size=4, max_new_tokens=32)
    originals = _wrapped(name)
    seen = []
    a, rows = bench.run_script(
        name, args, steps=1, warmup=1, on_step=lambda step, row: seen.append(step)
    )
    assert seen == [1, 2] and len(rows) == 1 and a.prompts_per_step == 4  # the warm-up is not kept
    r = rows[0]
    assert {p for p in bench.PHASES if r[p] > 0} == PHASES_OF[name], r
    assert r["step"] >= sum(r[p] for p in bench.PHASES) > 0
    assert r["completions"] == 16 or name == "dapo"  # DAPO: the kept groups' completions
    assert r["optimizer_steps"] == (a.num_mini_batches * a.ppo_epochs if r["completions"] else 0)
    assert 0 <= r["tokens"] <= r["completions"] * 32 and r["decode_steps"] <= 32
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step"], rel=1e-4)
    assert _wrapped(name) == originals  # the script's own functions are back afterwards


def _wrapped(name):
    """What PhaseTimer wraps for a run of <name>.py, as it is now."""
    mod = importlib.import_module(name)
    own = [getattr(mod, f) for f in bench.LAPS if hasattr(mod, f)]
    return own + [common.optimizer_step, runner.Run.steps, runner.Run.end_step]


def test_a_failing_run_restores_the_functions():
    originals = _wrapped("grpo")
    with pytest.raises(UserError, match="--group-size must be at least 2"):
        bench.run_script("grpo", bench.Args(group_size=1), steps=1, warmup=0)
    assert _wrapped("grpo") == originals


# =====================================================================================
# Pieces, on hand-made inputs
# =====================================================================================
def test_op_breakdown_by_kind_with_hand_values():
    """Self times (microseconds) and FLOPs over 2 steps of 1 s each: per step, by kind; what the
    ops leave of the step is Python; GFLOP/s only for matrix multiplies."""
    ev = [
        NS(key="aten::mm", self_cpu_time_total=400_000, flops=60e9, self_device_time_total=0),
        NS(key="aten::addmm", self_cpu_time_total=200_000, flops=20e9, self_device_time_total=0),
        NS(
            key="aten::_scaled_dot_product_flash_attention_for_cpu",
            self_cpu_time_total=200_000,
            flops=0,
            self_device_time_total=0,
        ),
        NS(key="aten::mul", self_cpu_time_total=600_000, flops=1e9, self_device_time_total=0),
        NS(key="aten::linear", self_cpu_time_total=100_000, flops=None, self_device_time_total=0),
    ]
    rows = {r["kind"]: r for r in bench.op_breakdown(ev, wall_s=2.0, steps=2, cuda=False)}
    assert list(rows) == ["matrix multiply", "attention", "other ops", "Python"]
    assert rows["matrix multiply"]["s"] == pytest.approx(0.3)
    assert rows["matrix multiply"]["gflop"] == pytest.approx(40)
    assert rows["matrix multiply"]["gflop_per_s"] == pytest.approx(40 / 0.3)
    assert rows["attention"]["s"] == pytest.approx(0.1) and rows["attention"]["gflop_per_s"] is None
    assert rows["other ops"]["s"] == pytest.approx(0.35)
    assert rows["other ops"]["gflop_per_s"] is None
    assert rows["Python"]["s"] == pytest.approx(0.25)
    assert rows["Python"]["share"] == pytest.approx(0.25)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    # on CUDA the kernels' time counts, and the rest is Python and kernel launches
    cuda = [NS(key="aten::mm", self_cpu_time_total=10, flops=8e9, self_device_time_total=500_000)]
    rows = {r["kind"]: r for r in bench.op_breakdown(cuda, wall_s=1.0, steps=1, cuda=True)}
    assert rows["matrix multiply"]["s"] == pytest.approx(0.5)
    assert rows["Python and launches"]["s"] == pytest.approx(0.5)
    assert "aten::mul 0.300 s" in bench.top_other_ops(ev, steps=2, cuda=False, k=1)


def test_clock_adds_up_per_phase():
    clock = bench.Clock(torch.device("cpu"))
    for _ in range(2):
        with clock("a"):
            time.sleep(0.02)
    with clock("b"):
        pass
    assert clock.times["a"] >= 0.04 and clock.times["b"] < clock.times["a"]


def test_trl_timer_on_a_fake_trainer():
    """Phases by method, reference vs old log-probs by model, grad calls not timed, work counted
    from _generate's completion ids (through the EOS)."""
    policy, ref = object(), object()

    def slow(result, seconds=0.01):
        def f(*a, **k):
            time.sleep(seconds)
            return result

        return f

    trainer = NS(
        ref_model=ref,
        _generate=slow((None, [[1, 2, 3], [4], [5, 6]])),
        _calculate_rewards=slow("r"),
        _generate_and_score_completions=None,
        _get_per_token_logps_and_entropies=slow("logps"),
    )

    def prepare():  # TRL's order: generate, old and ref log-probs (no grad), rewards
        trainer._generate()
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(policy)
            trainer._get_per_token_logps_and_entropies(ref)
        trainer._calculate_rewards()
        time.sleep(0.01)  # advantages and the rest
        return "batch"

    trainer._generate_and_score_completions = prepare
    timer = bench.TRLTimer(trainer, torch.device("cpu"))
    t0 = time.perf_counter()
    assert trainer._generate_and_score_completions() == "batch"
    with torch.enable_grad():
        trainer._get_per_token_logps_and_entropies(policy)  # the update's: not timed
    time.sleep(0.02)  # the update
    row = timer.take(time.perf_counter() - t0, optimizer_steps=2)
    assert (row["completions"], row["tokens"], row["decode_steps"], row["rounds"]) == (3, 6, 3, 1)
    for p in ("generate", "reward", "old_logp", "ref_logp", "advantage"):
        assert 0.01 <= row[p] < 0.05, (p, row[p])
    assert row["update"] >= 0.02 and row["optimizer_steps"] == 2
    assert abs(sum(row[p] for p in bench.PHASES) - row["step"]) < 1e-6
    assert timer.take(1.0, 0)["completions"] == 0  # fresh after take


def _row(step, completions=8, tokens=100, opt=2):
    return {
        **{p: 0.1 for p in bench.PHASES},
        "step": step,
        "tokens_per_s": tokens / step,
        "completions": completions,
        "tokens": tokens,
        "decode_steps": 16,
        "optimizer_steps": opt,
        "rounds": 1,
    }


def test_trl_report_ratio_is_the_median_of_pairs():
    ok = {"same prompt token ids": True}
    c = {
        "project": [_row(2.0), _row(4.0), _row(9.0)],
        "trl": [_row(1.0), _row(4.0), _row(3.0)],
        "checks": ok,
        "config": {"beta": 0.04},
    }
    text = bench.trl_report(c, "1.16.0")
    # per-pair ratios 2, 1, 3: median 2 (the ratio of the medians, 4 / 3, would be 1.33)
    assert "project/TRL step time: 2.00 (median over 3 interleaved steps)" in text
    assert "work matched: yes" in text and "MISMATCH" not in text
    c["trl"][1] = _row(4.0, completions=6)
    text = bench.trl_report(c, "1.16.0")
    assert "MISMATCH: completions equal in every pair" in text and "work matched: NO" in text
    c["trl"][1], c["checks"] = _row(4.0), {"same prompt token ids": False}
    assert "MISMATCH: same prompt token ids" in bench.trl_report(c, "1.16.0")


def test_script_table_rows():
    m = {**bench.summarize([_row(2.0), _row(3.0), _row(7.0)]), "ref_logp": 0.0, "advantage": 0.0}
    table = bench.script_table({"dapo": (NS(prompts_per_step=16, group_size=8), m)})
    head, rule, row = table.splitlines()
    assert head.count("|") == rule.count("|") == row.count("|") == 13
    assert row == (
        "| dapo | 16 x 8 | 8 | 100 | 0.100 | 0.100 | 0.100 | - | - | 0.100 "
        "| 3.000 (2.000-7.000) | 33 |"
    )


def test_trl_config_rejects_partial_micro_batches():
    a = NS(prompts_per_step=16, group_size=8, num_mini_batches=2, micro_batch_size=48)
    with pytest.raises(UserError, match="64 completions does not split into micro-batches of 48"):
        bench.trl_config_kwargs(a, "/tmp/x", 1)


def test_the_estimate_asks_each_script_whether_it_loads_a_reference(monkeypatch):
    """The memory table reads needs_reference from each script, not a table of its own: a script
    that stops loading one gets the row of a script without one."""
    import grpo

    monkeypatch.setattr(grpo, "needs_reference", lambda args: False)
    row = next(r for r in bench.estimate_report().splitlines() if r.startswith("| grpo | "))
    a = bench.gpu_preset("grpo")
    kw = dict(gen_batch_size=256, micro_batch_size=4, context=4096, model=bench.QWEN_MATH_1_5B)
    full, lora = (cost.memory_estimate(False, r, **kw) for r in (0, 64))
    assert a.prompts_per_step * a.group_size == 256 and a.gen_batch_size is None  # all in one call
    assert f"**{full['peak'] / 1e9:.1f}** | " in row and f"**{lora['peak'] / 1e9:.1f}** | " in row
    shown = cost.memory_estimate(True, 0, **kw)["peak"]
    assert shown != full["peak"]  # it would have shown


def test_one_script_available_for_every_tool():
    from tools import study

    assert bench.script_available is study.script_available


# =====================================================================================
# TRL's GRPOTrainer on grpo.py's work (skipped without TRL)
# =====================================================================================
def test_trl_comparison_matches_the_work():
    pytest.importorskip("trl")
    args = bench.Args(warmup=0, **TINY)
    c = bench.compare_with_trl(args, steps=2)
    assert len(c["project"]) == len(c["trl"]) == 2
    assert all(c["checks"].values()), c["checks"]
    for p, t in zip(c["project"], c["trl"]):
        assert p["completions"] == t["completions"] == 4
        assert p["optimizer_steps"] == t["optimizer_steps"] == 2
        assert t["ref_logp"] > 0 and t["old_logp"] > 0 and t["generate"] > 0
        assert 0 < t["tokens"] <= 4 * 8
    assert c["config"]["steps_per_generation"] == 2 and c["config"]["generation_batch_size"] == 4
    text = bench.trl_report(c, "1.16.0")
    assert "work matched: yes" in text
    assert "project/TRL step time: " in text and "(median over 2 interleaved steps)" in text


# =====================================================================================
# Threads: quiet and beside a busy core
# =====================================================================================
def test_step_seconds_times_a_fresh_process_of_the_script():
    secs = bench.step_seconds(
        [sys.executable, str(ROOT / "grpo.py"), "--steps", "3", "--eval-dataset", "none",
         "--prompts-per-step", "2", "--group-size", "2", "--tensorboard", "false"],
        threads=1, wait="passive", busy=False,
    )  # fmt: skip
    assert len(secs) == 2 and all(s > 0 for s in secs)  # the first step is the warm-up


def test_a_busy_core_is_busy_while_it_is_held():
    import time

    t0 = time.process_time()
    with bench.busy_core(True):
        time.sleep(0.5)
    assert time.process_time() - t0 < 0.2  # the spinning is another process's, and it stopped


def test_threads_report_table(monkeypatch):
    seen = []

    def fake(cmd, threads, wait, busy):
        seen.append((threads, wait, busy))
        return [2.0 if busy and wait == "default" else 1.0]

    monkeypatch.setattr(bench, "step_seconds", fake)
    args = bench.Args(threads_steps=2)
    text = bench.threads_report(args)
    assert "| tiny default | 2, default | 1.00 | 2.00 | 2.0x |" in text
    assert "| tiny default | 1, passive | 1.00 | 1.00 | 1.0x |" in text
    assert len(seen) == 2 * len(bench.THREAD_SETTINGS)


# =====================================================================================
# The cpu preset's memory: a fresh process per setting, each phase's peak
# =====================================================================================
def test_memory_row_reads_each_phase_peak_and_the_whole_process(monkeypatch):
    row = bench.memory_row(str(ROOT / "tiny_model"), ["--micro-batch-size", "4"], steps=2)
    phases = [row[f"{p}_gb"] for p in bench.MEMORY_PHASES]
    assert all(0.05 < gb < 10 for gb in phases)  # a Python process with torch: 0.05-10 GB
    assert row["peak_gb"] >= max(phases)  # the whole process holds every phase
    assert row["step_s"] > 0 and 0 < row["update_s"] < row["step_s"]

    monkeypatch.setattr(bench, "memory_row", lambda model, flags, steps: {**row, "step_s": 9.0})
    monkeypatch.setattr(bench, "CPU_SETTINGS", {"micro-batch 4": ["--micro-batch-size", "4"]})
    text = bench.cpu_memory_report(bench.Args(memory_model="tiny_model", memory_steps=2))
    assert f"| micro-batch 4 | **{row['peak_gb']:.2f}** | {row['before_gb']:.2f} |" in text
    assert text.rstrip().endswith(f"| 9.0 | {row['update_s']:.1f} |")


def test_a_fresh_run_that_fails_is_one_line_with_its_output():
    cmd = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(UserError, match=r"^the thing failed \(exit 3\): boom$"):
        bench.fresh_run("the thing", cmd, {})


def test_phase_peaks_come_from_the_process_own_high_water_mark():
    if bench.rss_mb() is None:
        pytest.skip("no /proc/self/status")
    bench.reset_peak()
    before = bench.rss_mb()
    block = bytearray(200 * 2**20)  # 200 MB, touched
    block[::4096] = b"\1" * len(block[::4096])
    del block
    assert bench.rss_mb() - before > 150  # the peak holds what was freed
    bench.reset_peak()
    assert bench.rss_mb() - before < 50  # and starts again from here
