"""What one training step costs, phase by phase, for every algorithm script (and TRL's GRPOTrainer).

    python tools/bench.py                  # every script, TRL, cost curves: minutes on 2 cores
    python tools/bench.py --scripts grpo,tepo --no-trl --no-curves
    python tools/bench.py --steps 20 --threads 4   # more timed steps, more torch threads
    python tools/bench.py --device cuda    # the same tiny preset on a GPU
    python tools/bench.py --estimate-only  # the real run's throughput, estimated (no GPU needed)
    python tools/bench.py --scripts tepo --no-trl --no-curves --profile-steps 3  # where a step goes

A step here is one step of each script's own train(), on its tiny preset (the bundled
~0.8M-parameter model, 16 prompts x 8 completions, 40 new tokens, 2 optimizer steps per batch,
the script's reference model if it uses one, CPU, fp32), with no held-out evaluation. Nothing
here copies a training loop: the benchmark runs train() itself, with the script's functions
wrapped from outside for the run (PhaseTimer), so that the return of each ends a phase of the
step (a lap: the time since the previous lap is the phase's), logged as time/<phase>:

    generate   sample the completions (generate_rollouts; DAPO: every dynamic-sampling round)
    reward     grade them (reward_fn) and the group advantage (group_advantages)
    old_logp   log-probs and entropies under the policy that sampled (batch_logps; TEPO: its
               own pass over sampled_logits, with c)
    ref_logp   log-probs under the frozen reference model (reference_logps; scripts with one)
    advantage  ERPO's token advantages (token_advantages); SAPO's segments and critic values
               (segment_batch)
    update     the optimizer steps: forward, loss, backward, AdamW (common.optimizer_step; SAPO:
               the critic's too, critic_step)

"step" is the wall time of the whole step up to its metrics (samples, logging and checkpoints
come after it). tokens/s is the completion tokens the step trained on (the script's `tokens`),
up to each EOS, per second of the step (DAPO: the kept groups only).

Then the first script's steps run under torch.profiler (--profile-steps), split by kind of op:
matrix multiplies (with their GFLOP and GFLOP/s, next to this machine's 2048^3 matrix multiply
peak), attention, other ops (elementwise, copies, sampling; the largest are listed) and what the
ops leave of the wall time (Python; on CUDA also the kernel launches the GPU waits for). It shows
whether a step is bound by arithmetic or by overhead, so what kind of change could speed it up.

Then, when TRL is installed, TRL's GRPOTrainer does exactly grpo.py's work (same model folder,
prompts, G, length cap, sampling settings, reward function, reference model with beta 0.04,
optimizer steps per rollout batch), interleaved step by step with grpo.py's train() in this
process so that machine noise hits both alike; bench.py checks that the work matched and prints
the line `project/TRL step time`. Then grpo.py's step time against --max-new-tokens, G and
prompts per step (bench_curves.csv / .png). Everything is printed and written to --out: bench.md
(the tables, with the machine, torch version, threads and date), bench_steps.csv (every step).

Timings on a shared machine are noisy: compare medians, read the min-max spread, and prefer the
interleaved ratio to absolute times.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import inspect
import io
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every script sets it before torch loads

import torch

# the repository: the scripts and common.py live there
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import runner  # noqa: E402
from common import UserError, arg  # noqa: E402
from tools import cost  # noqa: E402
from tools.diagnostics import patched  # noqa: E402
from tools.study import script_available  # noqa: E402

SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
PHASES = ("generate", "reward", "old_logp", "ref_logp", "advantage", "update")
# The script's functions whose return ends a phase, by name (a script lacks some); a call made
# inside another timed call (batch_logps in reference_logps) is part of that one
LAPS = {
    "generate_rollouts": "generate",
    "reward_fn": "reward",
    "group_advantages": "reward",
    "batch_logps": "old_logp",
    "sampled_logits": "old_logp",  # TEPO's own pass: ends when train() has read its last logits
    "reference_logps": "ref_logp",
    "token_advantages": "advantage",  # ERPO
    "segment_batch": "advantage",  # SAPO
    "critic_step": "update",  # SAPO: after the policy's optimizer step
}


# =====================================================================================
# Arguments
# =====================================================================================
@dataclass
class Args:
    scripts: str | None = arg(
        None,
        "comma list of scripts to time (default: each of "
        f"{', '.join(SCRIPTS)} whose file defines train())",
    )
    steps: int = arg(8, "timed steps per script, after the warm-up")
    warmup: int = arg(1, "untimed steps first (lazy initialisation, allocator, caches)")
    threads: int = arg(2, "torch threads (torch.set_num_threads)")
    device: str = arg("cpu", "cpu, auto, cuda or cuda:N")
    seed: int = arg(1, "seed of every run")
    prompts_per_step: int | None = arg(None, "P for every script (default: each tiny preset's)")
    group_size: int | None = arg(None, "G for every script (default: each tiny preset's)")
    max_new_tokens: int | None = arg(None, "length cap for every script (default: the preset's)")
    out: str = arg("runs/bench", "folder for bench.md, bench_steps.csv, bench_curves.csv / .png")
    no_trl: bool = arg(False, "skip the comparison with TRL's GRPOTrainer")
    trl_steps: int | None = arg(None, "interleaved grpo.py / TRL step pairs (default: --steps)")
    no_curves: bool = arg(False, "skip the cost curves")
    curve_script: str = arg(
        "grpo", "the script whose step time the curves sweep", choices=list(SCRIPTS)
    )
    curve_max_new_tokens: str = arg("20,40,80,160", "comma list of --max-new-tokens for the curves")
    curve_group_sizes: str = arg("2,4,8,16", "comma list of G for the curves")
    curve_prompts: str = arg("4,8,16,32", "comma list of prompts per step for the curves")
    curve_steps: int = arg(3, "timed steps per curve point (after one warm-up step)")
    profile_steps: int = arg(
        2,
        "steps of the first script run under torch.profiler to split a step "
        "into matrix multiplies, attention, other ops and Python (0 skips)",
    )
    estimate_only: bool = arg(False, "only print the real run's estimated throughput, and exit")
    no_threads_check: bool = arg(
        False, "skip timing the tiny default (tepo.py) with 1 and 2 threads, quiet and busy"
    )
    threads_steps: int = arg(6, "threads check: timed steps of each run, after one warm-up step")
    threads_model: str | None = arg(
        None,
        "threads check: also time the cpu preset on this local model folder "
        "(e.g. models/SmolLM2-135M-Instruct; 2 timed steps a setting, minutes each)",
    )
    memory_model: str | None = arg(
        None,
        "the cpu preset's memory and step time on this local model folder, one row for each "
        "of CPU_SETTINGS (e.g. models/SmolLM2-135M-Instruct; minutes a row)",
    )
    memory_steps: int = arg(2, "memory rows: steps of each run; the first and last evaluate")


def int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma list of integers, not {text!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"{flag} must list integers >= 1, not {text!r}")
    return out


def resolve_scripts(names: str | None) -> list[str]:
    if names is None:
        return [s for s in SCRIPTS if script_available(s)]
    out = [s.strip() for s in names.split(",") if s.strip()]
    for s in out:
        if s not in SCRIPTS:
            raise UserError(f"unknown script {s!r}; choose from {', '.join(SCRIPTS)}")
        if not script_available(s):
            raise UserError(f"{s}.py does not define train() (yet)")
    if not out or len(set(out)) < len(out):
        raise UserError(f"--scripts must list distinct scripts, not {names!r}")
    return out


def check(args: Args) -> None:
    """Every flag is checked before anything loads."""
    runner.check_args(
        args,
        {
            f"--steps must be at least 1, not {args.steps}": args.steps >= 1,
            f"--warmup must be >= 0, not {args.warmup}": args.warmup >= 0,
            f"--threads must be at least 1, not {args.threads}": args.threads >= 1,
            f"--curve-steps must be at least 1, not {args.curve_steps}": args.curve_steps >= 1,
            f"--profile-steps must be >= 0, not {args.profile_steps}": args.profile_steps >= 0,
            f"--trl-steps must be at least 1, not {args.trl_steps}": args.trl_steps is None
            or args.trl_steps >= 1,
            f"--curve-script must be one of {', '.join(SCRIPTS)}": args.curve_script in SCRIPTS,
            f"--threads-steps must be at least 1, not {args.threads_steps}": args.threads_steps
            >= 1,
            f"--memory-steps must be at least 2, not {args.memory_steps}": args.memory_steps >= 2,
        },
    )
    for k in ("threads_model", "memory_model"):
        folder = getattr(args, k)
        if folder and not (Path(folder) / "config.json").is_file():
            raise UserError(f"{common.flag(k)} {folder}: no model folder (config.json)")
    resolve_scripts(args.scripts)
    if not args.no_curves and not script_available(args.curve_script):
        raise UserError(f"--curve-script {args.curve_script}: its file does not define train()")
    for name in ("curve_max_new_tokens", "curve_group_sizes", "curve_prompts"):
        int_list(getattr(args, name), "--" + name.replace("_", "-"))
    runner.resolve_device(args.device)


# =====================================================================================
# Machine
# =====================================================================================
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(args: Args) -> dict:
    import transformers

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    device = runner.resolve_device(args.device)
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def machine_line(m: dict) -> str:
    where = f"{m['gpu']} (host: {m['cpu']})" if m["gpu"] else m["cpu"]
    load = f", load average {m['load']:.1f} at the start" if m["load"] is not None else ""
    return (
        f"{where}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
        f"{m['threads']} torch threads, Python {m['python']}, {m['date']}{load}"
    )


# =====================================================================================
# Timing: each script's own train(), its functions wrapped from outside to time its phases
# =====================================================================================
class Clock:
    """Adds the wall time of each `with clock("phase"):` block to clock.times["phase"] (for TRL's
    phases and the matrix-multiply peak). On CUDA it synchronises at both ends."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, defaultdict(float)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = self.now()
        try:
            yield
        finally:
            self.times[phase] += self.now() - t0


def rss_mb(field: str = "VmHWM") -> float | None:
    """This process's peak (VmHWM) or current (VmRSS) resident memory, MB; None off Linux."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None


def reset_peak() -> None:
    """From now on VmHWM is the peak since this call (Linux 4.0 and later)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


class PhaseTimer:
    """Within `with PhaseTimer(mod, device, on_step):`, each step of mod's train() adds the
    seconds of its phases, time/<phase>, to its metrics, and calls on_step(run, step, metrics)
    with them and time/step before its end_step. The functions in LAPS and common.optimizer_step
    are wrapped, and Run.steps and Run.end_step, then restored; nothing they compute changes.
    Only calls from the thread that entered are timed (TRL's calls of grpo.reward_fn are not
    grpo.py's). On Linux each phase's peak resident memory is added too, mem/<phase> in MB, with
    mem/before (from the previous step's end, or the process's start: loading, the first
    evaluation), mem/after (samples and evaluation, after the last optimizer step) and mem/now
    (resident at the step's end: what the allocator keeps)."""

    def __init__(self, mod, device: torch.device, on_step=None):
        self.clock, self.on_step, self.depth, self.mark = Clock(device), on_step, 0, 0.0
        self.peaks = {}
        self.patches = patched(
            *((mod, name, self.timed(phase)) for name, phase in LAPS.items()),
            (common, "optimizer_step", self.timed("update")),
            (runner.Run, "steps", self.steps),
            (runner.Run, "end_step", self.end_step),
        )

    def __enter__(self):
        self.thread = threading.get_ident()
        self.patches.__enter__()
        return self

    def __exit__(self, *exc):
        return self.patches.__exit__(*exc)

    def lap(self, phase: str) -> None:
        now = self.clock.now()
        self.clock.times[phase] += now - self.mark
        self.mark = now
        peak = rss_mb()
        if peak is not None:
            self.peaks[phase] = max(peak, self.peaks.get(phase, 0.0))
            reset_peak()

    def timed(self, phase: str):
        def wrap(f):
            if inspect.isgeneratorfunction(f):  # its lap: when the caller has read it all

                def generator(*a, **k):
                    yield from f(*a, **k)
                    if self.depth == 0 and threading.get_ident() == self.thread:
                        self.lap(phase)

                return generator

            def call(*a, **k):
                if threading.get_ident() != self.thread:
                    return f(*a, **k)
                self.depth += 1
                try:
                    out = f(*a, **k)
                finally:
                    self.depth -= 1
                if self.depth == 0:
                    self.lap(phase)
                return out

            return call

        return wrap

    def steps(self, f):
        def steps(run, start):
            for step in f(run, start):
                self.lap("before")  # the step starts: the first lap's start
                self.clock.times.pop("before")
                yield step

        return steps

    def end_step(self, f):
        def end_step(run, step, metrics):
            self.lap("after")
            metrics = {**metrics, **{f"time/{p}": s for p, s in self.clock.times.items()}}
            metrics.pop("time/after")
            if self.peaks:
                metrics |= {f"mem/{p}": mb for p, mb in self.peaks.items()}
                metrics["mem/now"] = rss_mb("VmRSS")
            self.clock.times.clear()
            self.peaks.clear()
            if self.on_step is not None:
                self.on_step(run, step, {**metrics, "time/step": self.clock.now() - run.step_start})
            return f(run, step, metrics)

        return end_step


def step_row(metrics: dict) -> dict:
    """One step as the benchmark reports it, from the step's metrics with PhaseTimer's times: the
    seconds of each phase (0 where the script has no such phase) and of the step, and its work.

    >>> m = {"time/generate": 0.5, "time/update": 1.0, "time/step": 1.6, "tokens": 400,
    ...      "completions": 16, "completion_len_max": 30, "optimizer_steps": 2.0}
    >>> r = step_row(m)
    >>> r["generate"], r["advantage"], r["step"], r["tokens_per_s"], r["decode_steps"], r["rounds"]
    (0.5, 0.0, 1.6, 250.0, 30, 1)
    """
    return {
        **{p: metrics.get(f"time/{p}", 0.0) for p in PHASES},
        "step": metrics["time/step"],
        "tokens_per_s": metrics["tokens"] / metrics["time/step"],
        "completions": metrics["completions"],
        "tokens": metrics["tokens"],
        "decode_steps": metrics["completion_len_max"],
        "optimizer_steps": int(metrics.get("optimizer_steps", 0)),
        "rounds": metrics.get("gen_rounds", 1),
    }


def bench_args(name: str, args: Args, out_dir: str, steps: int, **overrides):
    """<name>.py's Args for a benchmark run: its tiny preset (resolve_args fills every field left at
    None), with no held-out evaluation, no TensorBoard, no checkpoint before the last step and
    samples only at the first; P, G and the length cap from bench's flags or `overrides`."""
    mod = importlib.import_module(name)
    given = {
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        **overrides,
    }
    return mod, mod.Args(
        device=args.device,
        seed=args.seed,
        steps=steps,
        output_dir=out_dir,
        run_name="bench",
        eval_dataset="none",
        tensorboard=False,
        save_every=10**9,
        sample_every=10**9,
        **{k: v for k, v in given.items() if v is not None},
    )


def run_script(
    name: str, args: Args, steps: int, warmup: int, label: str = "", on_step=None, **overrides
) -> tuple[object, list[dict]]:
    """Runs <name>.py's own train() for warmup + steps steps in a temporary folder, its output
    held back (shown only if it fails); one line printed per step. Returns the run's resolved
    Args and the timed steps' rows. on_step(step, row) runs after each step (interleaving, the
    profiler), before its end_step logs and saves it (PhaseTimer)."""
    out, rows, resolved = sys.stdout, [], {}

    def hook(run, step, metrics):
        resolved["args"], row = run.args, step_row(metrics)
        tag = "warm-up" if step <= warmup else f"{step - warmup}/{steps}"
        print(
            f"  {label or name} {tag}: {row['step']:.2f} s, {row['completions']} completions, "
            f"{row['tokens']} tokens",
            file=out,
            flush=True,
        )
        if step > warmup:
            rows.append(row)
        if on_step is not None:
            on_step(step, row)

    held = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        mod, a = bench_args(name, args, tmp, warmup + steps, **overrides)
        try:
            with PhaseTimer(mod, runner.resolve_device(args.device), hook):
                with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
                    mod.train(a)
        except BaseException:
            print(held.getvalue()[-3000:], file=out)
            raise
    return resolved["args"], rows


# =====================================================================================
# Summaries
# =====================================================================================
SUMMARY_KEYS = (
    *PHASES,
    "step",
    "tokens_per_s",
    "completions",
    "tokens",
    "decode_steps",
    "optimizer_steps",
    "rounds",
)


def summarize(rows: list[dict]) -> dict:
    """Median of every phase, of the step and of the work over the timed steps; the step's min
    and max, and the number of steps.

    >>> rows = [{k: 1.0 for k in SUMMARY_KEYS} | {"step": t} for t in (3.0, 1.0, 2.0, 10.0)]
    >>> m = summarize(rows)
    >>> m["step"], m["step_min"], m["step_max"], m["n"]
    (2.5, 1.0, 10.0, 4)
    """
    out = {k: statistics.median(r[k] for r in rows) for k in SUMMARY_KEYS}
    out["step_min"], out["step_max"] = min(r["step"] for r in rows), max(r["step"] for r in rows)
    out["n"] = len(rows)
    return out


def fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def script_table(results: dict) -> str:
    """Markdown, one row per script: {name: (its resolved Args, summarize(...))}."""
    head = (
        "| script | P x G | completions | tokens | generate | reward | old logp | ref logp "
        "| advantage | update | step: median (min-max) | tokens/s |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, (a, m) in results.items():
        phases = " | ".join(fmt_s(m[p]) if m[p] > 0 else "-" for p in PHASES)
        lines.append(
            f"| {name} | {a.prompts_per_step} x {a.group_size} | {m['completions']:g} | "
            f"{m['tokens']:g} | {phases} | {fmt_s(m['step'])} ({fmt_s(m['step_min'])}-"
            f"{fmt_s(m['step_max'])}) | {m['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


# =====================================================================================
# Where a step's time goes: torch.profiler, by kind of op
# =====================================================================================
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
OP_KINDS = ("matrix multiply", "attention", "other ops")


def op_kind(name: str) -> str:
    """The kind of work a profiler op does.

    >>> [op_kind(n) for n in ("aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
    ...                      "aten::mul", "aten::linear")]
    ['matrix multiply', 'attention', 'other ops', 'other ops']
    """
    if name in MATMUL_OPS:
        return "matrix multiply"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    return "other ops"  # aten::linear / matmul only dispatch to mm: their self time is overhead


def op_breakdown(events, wall_s: float, steps: int, cuda: bool) -> list[dict]:
    """Seconds, share of the step and GFLOP of each kind of op, per step, from the profiler's
    key_averages(): each op's self time (on CUDA its kernels' time), so nothing is counted twice.
    What the ops do not account for is the Python around them (on CUDA: the GPU waiting for the
    CPU to launch the next kernel)."""
    secs, flops = dict.fromkeys(OP_KINDS, 0.0), dict.fromkeys(OP_KINDS, 0.0)
    for e in events:
        k = op_kind(e.key)
        secs[k] += (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / steps
        flops[k] += (e.flops or 0) / 1e9 / steps
    step = wall_s / steps
    secs["Python and launches" if cuda else "Python"] = max(step - sum(secs.values()), 0.0)
    return [
        {
            "kind": k,
            "s": v,
            "share": v / step,
            "gflop": flops.get(k, 0.0),
            "gflop_per_s": flops[k] / v if k == "matrix multiply" and v > 0 else None,
        }
        for k, v in secs.items()
    ]


def top_other_ops(events, steps: int, cuda: bool, k: int = 6) -> str:
    """The k "other ops" with the most self time per step, as 'name s' pairs."""
    others = [
        (e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / steps)
        for e in events
        if op_kind(e.key) == "other ops"
    ]
    return ", ".join(f"{n} {fmt_s(s)} s" for n, s in sorted(others, key=lambda x: -x[1])[:k])


def matmul_peak(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    """GFLOP/s of an n x n x n matrix multiply on this device (fp32 on CPU, bf16 on CUDA), the
    best of `reps` (a peak: noise only slows it): the ceiling the step's matrix multiplies can
    approach."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    clock, best = Clock(device), float("inf")
    a @ b
    for _ in range(reps):
        t0 = clock.now()
        a @ b
        best = min(best, clock.now() - t0)
    return 2 * n**3 / best / 1e9


def profile_script(name: str, args: Args, steps: int) -> str:
    """<name>.py's train(): one untimed step, then `steps` under torch.profiler (started and
    stopped by run_script's on_step); a markdown table by kind of op."""
    from torch.profiler import ProfilerActivity, profile

    device = runner.resolve_device(args.device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, with_flops=True)

    def on_step(step, row):
        if step == 1:
            prof.__enter__()  # after the warm-up step
        elif step == 1 + steps:
            prof.__exit__(None, None, None)

    _, rows = run_script(name, args, steps, warmup=1, label=f"{name} (profiled)", on_step=on_step)
    wall = sum(r["step"] for r in rows)
    events = prof.key_averages()
    rows = op_breakdown(events, wall, steps, cuda)
    lines = [
        f"{name}.py, {steps} step(s) under torch.profiler (which slows them: read the "
        "shares, not the seconds); self time of each op, per step:",
        "",
        "| kind | s per step | share | GFLOP per step | GFLOP/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kind']} | {fmt_s(r['s'])} | {r['share']:.0%} | "
        f"{r['gflop']:.1f} | {r['gflop_per_s']:.0f} |"
        if r["gflop_per_s"]
        else f"| {r['kind']} | {fmt_s(r['s'])} | {r['share']:.0%} | - | - |"
        for r in rows
    ]
    peak, mm = matmul_peak(device), rows[0]["gflop_per_s"] or 0.0
    lines += [
        "",
        f"Largest other ops, s per step: {top_other_ops(events, steps, cuda)}.",
        "",
        f"A 2048^3 matrix multiply ({'bf16' if cuda else 'fp32'}) runs at {peak:.0f} GFLOP/s "
        f"here; the step's matrix multiplies ran at {mm / peak:.0%} of that. When matrix "
        "multiplies near that rate and elementwise ops fill the step, with little left to "
        "Python, a step gets faster only with fewer FLOPs or fewer passes over memory.",
    ]
    return "\n".join(lines)


# =====================================================================================
# The project against TRL's GRPOTrainer, interleaved
# =====================================================================================
def trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def trl_config_kwargs(a, out_dir: str, rollout_batches: int) -> dict:
    """GRPOConfig fields that make TRL's GRPOTrainer do grpo.py's work (a: grpo.py's resolved
    Args) for `rollout_batches` rollout batches; worked out from TRL 1.16's grpo_config.py and
    grpo_trainer.py. A TRL "step" is one micro-batch (training_step): it generates once every
    steps_per_generation * num_iterations of them, a generation batch of
    per_device_train_batch_size * steps_per_generation completions (one process), and steps the
    optimizer every gradient_accumulation_steps of them. So, with mini = P*G / --num-mini-batches:
        per_device_train_batch_size = micro = --micro-batch-size (at most mini)
        gradient_accumulation_steps = mini / micro
        steps_per_generation        = --num-mini-batches * mini / micro
        num_iterations              = --ppo-epochs
    gives P*G completions and --num-mini-batches optimizer steps per epoch per rollout batch, and
    TRL then computes the old log-probs, as grpo.py does (TRL skips them only when
    gradient_accumulation_steps is a multiple of steps_per_generation * num_iterations).
    loss_type "grpo" is grpo.py's seq-mean-token-mean, scale_rewards "group" its group std;
    bf16 and activation checkpointing as grpo.py resolved them (TRL defaults both to on); AdamW
    (torch), the same lr, warm-up and then constant lr, weight decay, clipping.

    >>> from types import SimpleNamespace as NS
    >>> a = NS(prompts_per_step=16, group_size=8, num_mini_batches=2, micro_batch_size=32,
    ...        ppo_epochs=1, max_new_tokens=40, temperature=1.0, top_p=1.0, kl_coef=0.04,
    ...        clip_low=0.2, clip_high=0.2,
    ...        lr=2e-4, warmup_steps=4, weight_decay=0.0, max_grad_norm=1.0, bf16=False,
    ...        gradient_checkpointing=False, device="cpu", seed=1)
    >>> k = trl_config_kwargs(a, "/tmp/x", rollout_batches=3)
    >>> [k[f] for f in ("per_device_train_batch_size", "gradient_accumulation_steps",
    ...                 "steps_per_generation", "num_iterations", "max_steps")]
    [32, 2, 4, 1, 6]
    """
    mini = a.prompts_per_step * a.group_size // a.num_mini_batches
    micro = min(a.micro_batch_size, mini)
    if mini % micro:
        raise UserError(
            f"TRL needs whole micro-batches: a mini-batch of {mini} completions does "
            f"not split into micro-batches of {micro}"
        )
    ga = mini // micro
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=ga,
        steps_per_generation=a.num_mini_batches * ga,
        num_iterations=a.ppo_epochs,
        num_generations=a.group_size,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=0,
        beta=a.kl_coef,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="grpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=a.lr,
        warmup_steps=a.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm,
        optim="adamw_torch",
        bf16=bool(a.bf16),
        activation_checkpointing=bool(a.gradient_checkpointing),
        use_cpu=runner.resolve_device(a.device).type == "cpu",
        max_steps=rollout_batches * a.num_mini_batches * a.ppo_epochs,
        model_init_kwargs={"dtype": "float32"},
        disable_dropout=True,
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=a.seed,
        dataloader_num_workers=0,
    )


class TRLTimer:
    """Wraps a GRPOTrainer's own methods, on the instance, to time the scripts' phases and count
    its work. TRL computes its old and reference log-probs inside
    _generate_and_score_completions, through _get_per_token_logps_and_entropies without grad;
    the calls with grad are the update's and are left alone."""

    def __init__(self, trainer, device: torch.device):
        self.trainer, self.clock, self.work = trainer, Clock(device), defaultdict(int)
        self._wrap("_generate", "generate", self._count)
        self._wrap("_calculate_rewards", "reward")
        self._wrap("_generate_and_score_completions", "prepare")
        orig = trainer._get_per_token_logps_and_entropies

        def logps(model, *a, **k):
            if torch.is_grad_enabled():
                return orig(model, *a, **k)
            with self.clock("ref_logp" if model is trainer.ref_model else "old_logp"):
                return orig(model, *a, **k)

        trainer._get_per_token_logps_and_entropies = logps

    def _wrap(self, method: str, phase: str, after=None):
        orig = getattr(self.trainer, method)

        def timed(*a, **k):
            with self.clock(phase):
                out = orig(*a, **k)
            if after is not None:
                after(out)
            return out

        setattr(self.trainer, method, timed)

    def _count(self, out):
        ids = out[1]  # _generate returns (prompt_ids, completion_ids, ...), ids through the EOS
        self.work["completions"] += len(ids)
        self.work["tokens"] += sum(len(c) for c in ids)
        self.work["decode_steps"] += max((len(c) for c in ids), default=0)
        self.work["rounds"] += 1

    def take(self, step: float, optimizer_steps: int) -> dict:
        """This step's phases and work (then start afresh). advantage: the rest of
        _generate_and_score_completions; update: the rest of the step."""
        t = self.clock.times
        own = sum(t[p] for p in ("generate", "reward", "old_logp", "ref_logp"))
        row = {
            **{p: t[p] for p in ("generate", "reward", "old_logp", "ref_logp")},
            "advantage": max(0.0, t["prepare"] - own),
            "update": max(0.0, step - t["prepare"]),
            "step": step,
            "optimizer_steps": optimizer_steps,
            **{k: self.work[k] for k in ("completions", "tokens", "decode_steps", "rounds")},
        }
        row["tokens_per_s"] = row["tokens"] / step
        self.clock.times.clear()
        self.work.clear()
        return row


def compare_with_trl(args: Args, steps: int) -> dict:
    """grpo.py and TRL's GRPOTrainer on the same work, one rollout batch each in turn. Both run
    their own training loops, in two threads of this process that hand a baton back and forth:
    grpo.py's train() in one (run_script's on_step passes the baton after each of its steps), TRL's
    trainer.train() in the other (a callback passes it after each rollout batch, i.e. every
    --num-mini-batches x --ppo-epochs optimizer steps). Only one of them runs at any moment."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    grpo, ga = bench_args("grpo", args, "unused", args.warmup + steps)
    a = grpo.resolve_args(ga)
    tokenizer, ctx = grpo.load_tokenizer(a.model, a.trust_remote_code)
    rows, _ = grpo.load_data(a, tokenizer, ctx)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def boxed_reward(completions, answer, completion_ids, **kwargs):  # grpo.py's own reward_fn
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return grpo.reward_fn(completions, answer, lengths, a)[0].tolist()

    project, trl_rows, failed = [], [], []
    project_turn, trl_turn = threading.Semaphore(0), threading.Semaphore(0)
    per_batch = a.num_mini_batches * a.ppo_epochs  # TRL optimizer steps per rollout batch

    def project_step(step, row):  # grpo.py has done a step: TRL's turn
        project.append(row)
        trl_turn.release()
        project_turn.acquire()

    def run_project():
        try:
            run_script("grpo", args, steps, args.warmup, label="grpo.py", on_step=project_step)
        except BaseException as e:  # re-raised below, in the main thread
            failed.append(e)
        finally:
            trl_turn.release()  # never leave TRL waiting

    class Interleave(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.t, self.last = time.perf_counter(), 0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % per_batch:
                return
            trl_rows.append(timer.take(time.perf_counter() - self.t, state.global_step - self.last))
            self.last = state.global_step
            print(
                f"  TRL {len(trl_rows)}/{args.warmup + steps}: {trl_rows[-1]['step']:.2f} s",
                flush=True,
            )
            project_turn.release()  # grpo.py's step, right after TRL's
            trl_turn.acquire()
            self.t = time.perf_counter()

    thread = threading.Thread(target=run_project, daemon=True)
    thread.start()
    trl_turn.acquire()  # grpo.py's first step is done
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL 1.16 on transformers 5's renames
        cfg = GRPOConfig(**trl_config_kwargs(a, tmp, args.warmup + steps))
        trainer = GRPOTrainer(
            model=runner.resolve_model_name(a.model),
            reward_funcs=boxed_reward,
            args=cfg,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Interleave()],
        )
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict
        timer = TRLTimer(trainer, runner.resolve_device(a.device))
        probe = rows[0]["prompt"]
        gen = trainer.generation_config
        checks = {
            "same prompt token ids": trainer.processing_class(text=[probe])["input_ids"][0]
            == tokenizer(probe, add_special_tokens=False)["input_ids"],
            "reference model in both": (trainer.ref_model is not None) == (a.kl_coef > 0),
            "old log-prob pass in both": cfg.gradient_accumulation_steps
            % (cfg.steps_per_generation * cfg.num_iterations)
            != 0,
            "same sampling (do_sample, temperature, top_p, top_k, max_new_tokens)": (
                gen.do_sample,
                gen.temperature,
                gen.top_p,
                gen.top_k or 0,
                gen.max_new_tokens,
            )
            == (True, a.temperature, a.top_p, 0, a.max_new_tokens),
            "same activation checkpointing": bool(trainer.model.is_gradient_checkpointing)
            == bool(a.gradient_checkpointing),
        }
        if not failed:
            trainer.train()
    project_turn.release()  # if TRL stopped early, let grpo.py finish
    thread.join()
    if failed:
        raise failed[0]
    return {
        "project": project[args.warmup :],
        "trl": trl_rows[args.warmup :],
        "checks": checks,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "num_iterations",
                "num_generations",
                "generation_batch_size",
                "beta",
                "loss_type",
            )
        },
    }


def trl_report(c: dict, version: str) -> str:
    """The work check, phase medians side by side, and the ratio line."""
    p, t = summarize(c["project"]), summarize(c["trl"])
    pairs = list(zip(c["project"], c["trl"]))
    n = len(pairs)
    lines = [
        f"TRL {version} GRPOTrainer against grpo.py, {n} interleaved step pairs. TRL config: "
        + ", ".join(f"{k}={v}" for k, v in c["config"].items()),
        "",
        "| per step (median) | grpo.py | TRL |",
        "|---|---|---|",
    ]
    for k in ("completions", "optimizer_steps", "tokens", "decode_steps"):
        lines.append(f"| {k.replace('_', ' ')} | {p[k]:g} | {t[k]:g} |")
    for k in (*PHASES, "step"):
        lines.append(f"| {k}, s | {fmt_s(p[k])} | {fmt_s(t[k])} |")
    lines += [f"| tokens/s | {p['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} |", ""]
    checks = {
        f"{k.replace('_', ' ')} equal in every pair": all(x[k] == y[k] for x, y in pairs)
        for k in ("completions", "optimizer_steps")
    }
    checks.update(c["checks"])
    lines += [f"- {'ok' if v else 'MISMATCH'}: {k}" for k, v in checks.items()]
    gap = abs(p["tokens"] - t["tokens"]) / max(p["tokens"], 1)
    lines += [
        f"- tokens generated (median) differ by {100 * gap:.1f}%: sampled, so equal only in "
        "expectation",
        f"- work matched: {'yes' if all(checks.values()) else 'NO (see MISMATCH above)'}",
        "- TRL's advantage = the rest of its _generate_and_score_completions; its update = "
        "the rest of its step",
        "",
    ]
    ratio = statistics.median(x["step"] / y["step"] for x, y in pairs)
    per_token = statistics.median(
        (x["step"] / max(x["tokens"], 1)) / (y["step"] / max(y["tokens"], 1)) for x, y in pairs
    )
    lines += [
        f"project/TRL step time: {ratio:.2f} (median over {n} interleaved steps)",
        f"project/TRL time per generated token: {per_token:.2f} "
        f"(median over {n} interleaved steps)",
    ]
    return "\n".join(lines)


# =====================================================================================
# Cost curves: step time against the length cap, G and prompts per step
# =====================================================================================
def curve_points(base, sweeps: list[tuple[str, list[int]]]) -> list[tuple[str, dict]]:
    """(sweep, point) for each value of each knob, the other knobs at base's values.

    >>> from types import SimpleNamespace as NS
    >>> pts = curve_points(NS(prompts_per_step=16, group_size=8, max_new_tokens=40),
    ...                    [("max_new_tokens", [20, 40]), ("group_size", [2])])
    >>> [(k, tuple(p.values())) for k, p in pts]
    [('max_new_tokens', (16, 8, 20)), ('max_new_tokens', (16, 8, 40)), ('group_size', (16, 2, 40))]
    """
    knobs = ("prompts_per_step", "group_size", "max_new_tokens")
    return [
        (knob, {**{k: getattr(base, k) for k in knobs}, knob: v})
        for knob, values in sweeps
        for v in values
    ]


@contextlib.contextmanager
def forced_length(mod):
    """Within it, mod's rollouts never stop before --max-new-tokens: its GenerationConfig gets
    min_new_tokens = max_new_tokens, which suppresses EOS until then. The tiny model ends its
    completions after about 25 tokens, so without this every cap above 40 would cost the same;
    with it the length sweep shows cost against completion length (the tokens past the natural
    end are nonsense, and only their cost counts)."""
    orig = mod.GenerationConfig
    mod.GenerationConfig = lambda **kw: orig(**kw, min_new_tokens=kw.get("max_new_tokens") or 0)
    try:
        yield
    finally:
        mod.GenerationConfig = orig


def cost_curves(args: Args, out: Path) -> tuple[list[dict], bool]:
    """One run of the script's train() per point (its tiny preset with one knob changed), one
    warm-up step, then --curve-steps timed steps. The --max-new-tokens sweep forces every
    completion to its cap (forced_length); the G and P sweeps keep natural lengths. Returns the
    CSV's rows and whether the PNG was drawn."""
    name = args.curve_script
    mod, a = bench_args(name, args, "unused", 1)
    base = mod.resolve_args(a)  # the preset's P, G and length cap, or bench's flags
    sweeps = [
        ("max_new_tokens", int_list(args.curve_max_new_tokens, "--curve-max-new-tokens")),
        ("group_size", int_list(args.curve_group_sizes, "--curve-group-sizes")),
        ("prompts_per_step", int_list(args.curve_prompts, "--curve-prompts")),
    ]
    done, rows = {}, []
    for knob, point in curve_points(base, sweeps):
        forced = knob == "max_new_tokens"
        key = (*point.values(), forced)
        if key not in done:
            label = (
                f"{name} P={point['prompts_per_step']} G={point['group_size']} "
                f"T={point['max_new_tokens']}{' (forced length)' if forced else ''}"
            )
            with forced_length(mod) if forced else contextlib.nullcontext():
                done[key] = summarize(
                    run_script(name, args, args.curve_steps, 1, label, **point)[1]
                )
        m = done[key]
        rows.append(
            {
                "script": name,
                "sweep": knob,
                **point,
                "forced_length": forced,
                "completions": m["completions"],
                "tokens": m["tokens"],
                "decode_steps": m["decode_steps"],
                **{f"{p}_s": round(m[p], 4) for p in PHASES},
                "step_s": round(m["step"], 4),
                "step_min_s": round(m["step_min"], 4),
                "step_max_s": round(m["step_max"], 4),
                "tokens_per_s": round(m["tokens_per_s"], 1),
                "timed_steps": m["n"],
            }
        )
    write_csv(out / "bench_curves.csv", rows)
    return rows, plot_curves(out / "bench_curves.png", rows)


def plot_curves(path: Path, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed: no {path.name} (pip install matplotlib); "
            "the CSV is written"
        )
        return False
    knobs = [
        ("max_new_tokens", "--max-new-tokens (every completion forced to it)"),
        ("group_size", "G, completions per prompt"),
        ("prompts_per_step", "P, prompts per step"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (knob, label) in zip(axes, knobs):
        pts = sorted((r for r in rows if r["sweep"] == knob), key=lambda r: r[knob])
        if not pts:
            ax.set_visible(False)
            continue
        x = [r[knob] for r in pts]
        ax.fill_between(
            x, [r["step_min_s"] for r in pts], [r["step_max_s"] for r in pts], alpha=0.2
        )
        ax.plot(x, [r["step_s"] for r in pts], "o-", label="step (median, min-max band)")
        for p in ("generate", "update", "old_logp", "ref_logp"):
            if any(r[f"{p}_s"] > 0 for r in pts):
                ax.plot(x, [r[f"{p}_s"] for r in pts], ".--", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set(xlabel=label, ylabel="seconds per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{rows[0]['script']}.py step time on its tiny preset, one knob at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# =====================================================================================
# The real run: an estimate, not a measurement
# =====================================================================================
# Qwen2.5-Math-1.5B (its config.json): 28 layers, hidden 1536, 2 KV heads of 128, vocabulary
# 151,936, tied embeddings, 1.54 B parameters.
QWEN_MATH_1_5B = dict(
    params=1.54e9,
    embed=151_936 * 1536,
    layers=28,
    kv_heads=2,
    head_dim=128,
    hidden=1536,
    vocab=151_936,
    heads=12,
    intermediate=8960,
)
# Qwen2.5-0.5B (its config.json), the smaller critic the README suggests for SAPO on one GPU.
QWEN_0_5B = dict(params=0.494e9, layers=24, hidden=896)


def real_presets() -> dict[str, tuple[int, int, bool, bool]]:
    """Each script's real-run preset, read from the script: P, G, whether it loads a reference
    model (its needs_reference), whether it trains a critic (it has load_critic)."""
    out = {}
    for name in SCRIPTS:
        a = gpu_preset(name)
        mod = importlib.import_module(name)
        out[name] = (
            a.prompts_per_step,
            a.group_size,
            mod.needs_reference(a),
            hasattr(mod, "load_critic"),
        )
    return out


def gpu_preset(name: str):
    """A script's flags on its gpu preset, as on one CUDA GPU (bf16, gradient checkpointing)."""
    mod = importlib.import_module(name)
    return mod.resolve_args(
        mod.Args(
            preset="gpu", device="cpu", run_name="estimate", bf16=True, gradient_checkpointing=True
        )
    )


def memory_report(presets: dict[str, tuple[int, int, bool, bool]], lora_rank: int = 64) -> str:
    """Each script's real-preset peak for Qwen2.5-Math-1.5B, full fine-tuning against LoRA;
    `presets` are real_presets(): whether a script loads a reference model is its own say."""

    def gb(x):
        return f"{x / 1e9:.1f}"

    def peak(name, ref, critic, rank, total=None):  # total: rows lowered to fit, as a run does
        a, model = gpu_preset(name), dict(QWEN_MATH_1_5B, context=4096)
        a.lora_rank = rank
        if total:
            cost.fit_gen_rows(a, model, critic, ref, cost.usable(total))
        return cost.run_cost(a, model, critic, ref)[0], a.gen_batch_size

    lines = [
        "GPU memory for Qwen2.5-Math-1.5B, real preset (3000 new tokens, all P x G rollouts in "
        "one generate() call, micro-batches of 4): ESTIMATE, NOT MEASURED ON A GPU "
        "(tools/cost.py, memory_estimate); GB.",
        "",
        f"| script | full: train / generate / peak | LoRA r={lora_rank}: train / generate / "
        f"peak | 24 GB with LoRA |",
        "|---|---|---|---|",
    ]
    for name, (_, _, ref, has_critic) in presets.items():
        critic = QWEN_MATH_1_5B if has_critic else None
        (full, _), (lora, _) = peak(name, ref, critic, 0), peak(name, ref, critic, lora_rank)
        small, rows = peak(name, ref, critic, lora_rank, 24 * 2**30)
        fits = f"{gb(small['peak'])} (`--gen-batch-size {rows}`, set by the check)"
        if has_critic:  # SAPO: its critic from a smaller model
            small, rows = peak(name, ref, QWEN_0_5B, lora_rank, 24 * 2**30)
            fits = (
                f"with `--critic-model Qwen/Qwen2.5-0.5B`: {gb(small['peak'])} "
                f"(`--gen-batch-size {rows}`)"
            )
        lines.append(
            f"| {name} | {gb(full['train'])} / {gb(full['generate'])} / "
            f"**{gb(full['peak'])}** | {gb(lora['train'])} / {gb(lora['generate'])} / "
            f"**{gb(lora['peak'])}** | {fits} |"
        )
    return "\n".join(lines)


def estimate_report() -> str:
    """The real run's expected hours (Qwen2.5-Math-1.5B), each script's preset, per GPU."""
    lines = [
        "Real run, Qwen2.5-Math-1.5B, each script's gpu preset: ESTIMATE, NOT MEASURED ON A GPU "
        "(tools/cost.py, time_estimate; its CONSTANTS and their sources). DAPO: one sampling "
        "round per step.",
        "",
        "| GPU | script | rows per generate() | decode step ms (host / memory) | generate h "
        "| train h | eval h | hours |",
        "|---" * 8 + "|",
    ]
    model = dict(QWEN_MATH_1_5B, context=4096)
    for gpu in ("A100 80GB", "H100 80GB"):
        for name, (_, _, ref, critic) in real_presets().items():
            s = cost.summary(gpu_preset(name), model, model if critic else None, ref, gpu)
            p = s["phases"]
            lines.append(
                f"| {gpu} | {name} | {s['gen_rows']} | {s['decode_step_ms']:.1f} "
                f"({s['decode_host_ms']:.1f} / {s['decode_memory_ms']:.1f}) | "
                f"{p['generate']:.1f} | {p['train']:.1f} | {p['eval']:.1f} | {s['hours']:.1f} |"
            )
    return "\n".join(lines + ["", memory_report(real_presets())])


# =====================================================================================
# Main
# =====================================================================================
# =====================================================================================
# Threads: a fresh process per setting, quiet and beside one busy core
# =====================================================================================
# (threads, OpenMP wait policy): libgomp's default lets idle threads spin at each barrier (300k
# rounds) before they sleep, so a thread that another job has descheduled stalls the others;
# passive, the scripts' default since, lets them sleep at once
THREAD_SETTINGS = ((1, "passive"), (2, "default"), (2, "passive"))


@contextlib.contextmanager
def busy_core(busy: bool):
    """A process that keeps one core busy (a spinning loop), as another job on a laptop would."""
    if not busy:
        yield
        return
    import subprocess

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)  # let it take its core
        yield
    finally:
        spin.kill()
        spin.wait()


def fresh_run(what: str, cmd: list[str], env: dict, busy: bool = False) -> tuple[list, int]:
    """One run of `cmd` (a script and its flags) in a fresh process, `env` added to this one's, in
    a temporary folder: its metrics.jsonl rows and the process's peak resident memory (ru_maxrss,
    kB on Linux). A failure is one line naming `what` and the output's last lines."""
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    with tempfile.TemporaryDirectory() as tmp, busy_core(busy):
        with open(Path(tmp) / "log", "w") as log:
            cmd = [*cmd, "--output-dir", tmp, "--run-name", "t"]
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            tail = "\n".join((Path(tmp) / "log").read_text().strip().splitlines()[-3:])
            code = os.waitstatus_to_exitcode(status)
            raise UserError(f"{what} failed (exit {code}): {tail}")
        return runner.read_metrics(Path(tmp) / "t"), usage.ru_maxrss


def step_seconds(cmd: list[str], threads: int, wait: str, busy: bool) -> list[float]:
    """time/step of each step after the first, of one run of `cmd` in a fresh process."""
    env = {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        # an empty value is libgomp's default, and keeps the scripts' setdefault from changing it
        "OMP_WAIT_POLICY": "" if wait == "default" else wait,
    }
    rows, _ = fresh_run(" ".join(cmd[1:3]), cmd, env, busy)
    return [r["time/step"] for r in rows if "time/step" in r][1:]


def threads_report(args: Args) -> str:
    """The tiny default's step (tepo.py, the README's first command), and the cpu preset's on
    --threads-model, with each THREAD_SETTINGS, quiet and beside one busy core: median seconds
    per step. Quiet means nothing else runs; the figures are only as quiet as the machine."""
    runs = [("tiny default", [sys.executable, str(ROOT / "tepo.py")], args.threads_steps + 1)]
    if args.threads_model:
        cpu = [sys.executable, str(ROOT / "tepo.py"), "--model", args.threads_model]
        runs.append(("cpu preset, " + Path(args.threads_model).name, [*cpu, "--device", "cpu"], 3))
    lines = [
        "| run | threads, wait | quiet, s/step | beside a busy core, s/step | busy / quiet |",
        "|---|---|---|---|---|",
    ]
    for name, cmd, steps in runs:
        flags = ["--steps", str(steps), "--eval-dataset", "none", "--sample-every", "100000"]
        flags += ["--save-every", "100000", "--tensorboard", "false"]
        for threads, wait in THREAD_SETTINGS:
            print(f"threads check: {name}, {threads} thread(s), {wait} wait", flush=True)
            quiet, busy = (
                statistics.median(step_seconds([*cmd, *flags], threads, wait, b))
                for b in (False, True)
            )
            lines.append(
                f"| {name} | {threads}, {wait} | {quiet:.2f} | {busy:.2f} | {busy / quiet:.1f}x |"
            )
    return "\n".join(lines)


# =====================================================================================
# The cpu preset's memory and step time: a fresh process per setting
# =====================================================================================
# What governs a cpu-preset step's memory and time (docs/memory.md): the micro-batch (the update's
# activations), activation checkpointing, the generate() batch. The output layer's chunk (1024
# positions) is no setting here: a micro-batch of 16 completions of 64 tokens fills one chunk.
CPU_SETTINGS = {
    "as shipped": [],  # micro-batch 2 since 2026-12-06, chosen by this table (docs/memory.md)
    "micro-batch 16": ["--micro-batch-size", "16"],  # the preset until then
    "micro-batch 4": ["--micro-batch-size", "4"],
    "checkpointing": ["--gradient-checkpointing", "true"],
    "micro-batch 4, checkpointing": ["--micro-batch-size", "4", "--gradient-checkpointing", "true"],
    "micro-batch 4, generate 32": ["--micro-batch-size", "4", "--gen-batch-size", "32"],
}
MEMORY_PHASES = ("before", "generate", "old_logp", "ref_logp", "update", "after")


def phase_run(argv: list[str] | None = None) -> None:
    """`python -c "from tools.bench import phase_run; phase_run()" tepo <flags>`: the script's own
    main under PhaseTimer, so its metrics.jsonl gains time/<phase> and mem/<phase>."""
    argv = sys.argv[1:] if argv is None else argv
    mod = importlib.import_module(argv[0])
    with PhaseTimer(mod, torch.device("cpu")):
        mod.main(argv[1:])


def memory_row(model: str, flags: list[str], steps: int) -> dict:
    """One setting of tepo.py's cpu preset on `model`: a fresh process of one torch thread (as the
    study's runs) for `steps` steps, held out on 64 problems at the start and at the last step
    (one generate() call of 64, as the preset's 128). Its peak resident memory (whole process),
    each phase's peak (PhaseTimer), in GB of 10**9 bytes, and the median time of the steps before
    the last (the last is evaluated)."""
    cmd = [sys.executable, "-c", "from tools.bench import phase_run; phase_run()", "tepo"]
    cmd += ["--model", model, "--preset", "cpu", "--device", "cpu", "--steps", str(steps)]
    cmd += ["--eval-every", str(steps), "--eval-n", "64", "--save-every", str(10**6)]
    cmd += ["--sample-every", str(10**6), "--tensorboard", "false", *flags]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rows, maxrss = fresh_run(f"the cpu preset with {flags}", cmd, env)
    rows = [r for r in rows if "time/step" in r]
    gb = 2**20 / 1e9  # GB a MB of 2**20 bytes
    peak = {p: max(r.get(f"mem/{p}") or 0.0 for r in rows) * gb for p in MEMORY_PHASES}
    # ru_maxrss: the peak since PhaseTimer's last reset of it (kB), so after the last step's end
    return {
        "peak_gb": max(*peak.values(), maxrss / 1024 * gb),
        **{f"{p}_gb": v for p, v in peak.items()},
        "kept_gb": max(r.get("mem/now") or 0.0 for r in rows) * gb,
        "step_s": statistics.median(r["time/step"] for r in rows[:-1]),
        "update_s": statistics.median(r["time/update"] for r in rows[:-1]),
    }


def cpu_memory_report(args: Args) -> str:
    """The cpu preset on --memory-model, each of CPU_SETTINGS: a table in GB and seconds."""
    lines = [
        f"tepo.py's cpu preset on {Path(args.memory_model).name}, one torch thread, "
        f"{args.memory_steps} steps; peak resident memory in GB (10^9 bytes), whole process and "
        "by phase (before: loading and the first evaluation; after: the last step's evaluation); "
        "kept: resident at a step's end; s/step and s of the update: median of the steps before "
        "the last.",
        "",
        "| setting | peak | before | generate | old log-probs | reference | update | after "
        "| kept | s/step | update, s |",
        "|---" * 11 + "|",
    ]
    for name, flags in CPU_SETTINGS.items():
        print(f"memory: {name}", flush=True)
        r = memory_row(args.memory_model, flags, args.memory_steps)
        gbs = " | ".join(f"{r[f'{p}_gb']:.2f}" for p in MEMORY_PHASES)
        lines.append(
            f"| {name} | **{r['peak_gb']:.2f}** | {gbs} | {r['kept_gb']:.2f} | "
            f"{r['step_s']:.1f} | {r['update_s']:.1f} |"
        )
    return "\n".join(lines)


def run(args: Args) -> dict:
    check(args)
    if args.estimate_only:
        print(estimate_report())
        return {}
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # no loading bars / reports for every setup
    transformers.logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine(args)
    print(f"machine: {machine_line(m)}")
    md = ["# Training-step benchmark (bench.py)", "", f"Machine: {machine_line(m)}.", ""]

    # 1. Every script's step, phase by phase, on its tiny preset
    results, step_rows = {}, []
    for name in resolve_scripts(args.scripts):
        print(f"{name}.py: {args.warmup} warm-up + {args.steps} timed steps", flush=True)
        resolved, rows = run_script(name, args, args.steps, args.warmup)
        step_rows += [{"script": name, "step": i + 1, **r} for i, r in enumerate(rows)]
        results[name] = (resolved, summarize(rows))
    table = script_table(results)
    print("\n" + table + "\n")
    cap = next(iter(results.values()))[0].max_new_tokens
    md += [
        f"Each script's tiny preset ({cap} new tokens, CPU unless stated), {args.steps} timed "
        f"steps after {args.warmup} warm-up; seconds per phase (median) and per step.",
        "",
        table,
        "",
    ]
    write_csv(out / "bench_steps.csv", step_rows)
    if args.profile_steps:
        name = next(iter(results))
        print(f"{name}.py under torch.profiler: {args.profile_steps} step(s)", flush=True)
        breakdown = profile_script(name, args, args.profile_steps)
        print("\n" + breakdown + "\n")
        md += ["## Where a step's time goes", "", breakdown, ""]

    # 2. TRL's GRPOTrainer on grpo.py's work, interleaved with it
    if not args.no_trl:
        version = trl_version()
        if version is None:
            msg = (
                "TRL is not installed: no comparison with its GRPOTrainer (pip install trl==1.16.0)"
            )
            print(msg)
            md += [msg, ""]
        else:
            if version != "1.16.0":
                print(f"note: TRL {version} here; the config mapping was worked out for TRL 1.16.0")
            n = args.trl_steps or args.steps
            print(
                f"TRL {version} GRPOTrainer and grpo.py, interleaved: {args.warmup} warm-up + "
                f"{n} pairs",
                flush=True,
            )
            report = trl_report(compare_with_trl(args, n), version)
            print("\n" + report + "\n")
            md += ["## Against TRL's GRPOTrainer", "", report, ""]

    # 3. Cost curves
    if not args.no_curves:
        print(
            f"cost curves ({args.curve_script}.py): {args.curve_steps} timed steps per point",
            flush=True,
        )
        curve, plotted = cost_curves(args, out)
        md += [
            "## Cost curves",
            "",
            f"{args.curve_script}.py, one knob at a time from its tiny "
            f"preset, {args.curve_steps} timed steps per point (bench_curves.csv, "
            "bench_curves.png). In the max_new_tokens sweep every completion is forced to the "
            "cap (EOS suppressed until then), so it shows cost against length; the other "
            "sweeps keep the model's natural lengths.",
            "",
            "| sweep | P | G | max new tokens | completions | tokens | decode steps | step, s "
            "| tokens/s |",
            "|---" * 9 + "|",
        ]
        md += [
            f"| {r['sweep']} | {r['prompts_per_step']} | {r['group_size']} | "
            f"{r['max_new_tokens']} | {r['completions']:g} | {r['tokens']:g} | "
            f"{r['decode_steps']:g} | {fmt_s(r['step_s'])} | {r['tokens_per_s']:.0f} |"
            for r in curve
        ]
        md.append("")

    # 4. Threads: the scripts' step with 1 and 2 torch threads, quiet and beside a busy core
    if not args.no_threads_check:
        report = threads_report(args)
        print("\n" + report + "\n")
        md += ["## Threads, quiet and beside a busy core", "", report, ""]

    # 5. The cpu preset on a real model: memory and time, a fresh process per setting
    if args.memory_model:
        report = cpu_memory_report(args)
        print("\n" + report + "\n")
        md += ["## The cpu preset: memory and step time", "", report, ""]

    # 6. The real run, estimated
    estimate = estimate_report()
    print(estimate)
    md += ["## The real run (estimate, not measured on a GPU)", "", estimate, ""]
    (out / "bench.md").write_text("\n".join(md))
    written = ["bench.md", "bench_steps.csv"]
    if not args.no_curves:
        written += ["bench_curves.csv"] + (["bench_curves.png"] if plotted else [])
    print(f"\nwritten to {out}/: {', '.join(written)}")
    return results


def main(argv=None):
    args = runner.parse_args(Args, argv)
    with runner.user_errors():
        return run(args)


if __name__ == "__main__":
    main()
