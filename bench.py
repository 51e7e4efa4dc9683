"""What one training step costs, phase by phase, for every algorithm script (and TRL's GRPOTrainer).

    python bench.py                        # every script, TRL, cost curves: minutes on 2 cores
    python bench.py --scripts grpo,tepo --no-trl --no-curves
    python bench.py --steps 20 --threads 4 # more timed steps, more torch threads
    python bench.py --device cuda          # the same tiny preset on a GPU
    python bench.py --estimate-only        # the real run's throughput, estimated (no GPU needed)
    python bench.py --scripts tepo --no-trl --no-curves --profile-steps 3   # where tepo's step goes

A step here is what each script's train() does for one rollout batch, on its tiny preset (the
bundled ~0.8M-parameter model, 16 prompts x 8 completions, 40 new tokens, 2 optimizer steps per
batch, the script's reference model if it uses one, CPU, fp32). bench.py builds each script's
arguments with its own resolve_args and calls its own functions in the order its train() calls
them, timing the phases:

    generate   sample the completions (generate_rollouts; DAPO: every dynamic-sampling round)
    reward     grade them (reward_fn) and the group advantage
    old_logp   log-probs and entropies under the policy that sampled (batch_logps)
    ref_logp   log-probs under the frozen reference model (scripts that load one)
    advantage  ERPO's token advantages; SAPO's segments and critic values
    update     the optimizer steps: forward, loss, backward, AdamW (SAPO: the critic's too)

Held-out evaluation, sample printing and checkpoints are not part of a step here. "step" is the
wall time of the whole step, so it can exceed the sum of the phases a little (metrics, DAPO's
group filtering). tokens/s counts every sampled completion token up to its EOS, divided by the
step time (the scripts' `tokens_per_s`, except that DAPO's dropped groups count too).

Then the first script's step runs under torch.profiler (--profile-steps), split by kind of op:
matrix multiplies (with their GFLOP and GFLOP/s, next to this machine's 2048^3 matrix multiply
peak), attention, other ops (elementwise, copies, sampling; the largest are listed) and what the
ops leave of the wall time (Python; on CUDA also the kernel launches the GPU waits for). It shows
whether a step is bound by arithmetic or by overhead, so what kind of change could speed it up.

Then, when TRL is installed, TRL's GRPOTrainer does exactly grpo.py's work (same model folder,
prompts, G, length cap, sampling settings, reward function, reference model with beta 0.04,
optimizer steps per rollout batch), interleaved step by step with grpo.py in this process so that
machine noise hits both alike; bench.py checks that the work matched and prints the line
`project/TRL step time`. Then grpo.py's step time against --max-new-tokens, G and prompts per
step (bench_curves.csv / .png). Everything is printed and written to --out: bench.md (the tables,
with the machine, torch version, threads and date), bench_steps.csv (every timed step).

Timings on a shared machine are noisy: compare medians, read the min-max spread, and prefer the
interleaved ratio to absolute times.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import math
import os
import platform
import re
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

import common
from common import UserError, arg

ROOT = Path(__file__).resolve().parent
SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
PHASES = ("generate", "reward", "old_logp", "ref_logp", "advantage", "update")


# =====================================================================================
# Arguments
# =====================================================================================
@dataclass
class Args:
    scripts: str | None = arg(None, "comma list of scripts to time (default: each of "
                              f"{', '.join(SCRIPTS)} whose file defines train())")
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
    curve_script: str = arg("grpo", "the script whose step time the curves sweep",
                            choices=list(SCRIPTS))
    curve_max_new_tokens: str = arg("20,40,80,160", "comma list of --max-new-tokens for the curves")
    curve_group_sizes: str = arg("2,4,8,16", "comma list of G for the curves")
    curve_prompts: str = arg("4,8,16,32", "comma list of prompts per step for the curves")
    curve_steps: int = arg(3, "timed steps per curve point (after one warm-up step)")
    profile_steps: int = arg(2, "steps of the first script run under torch.profiler to split a step "
                             "into matrix multiplies, attention, other ops and Python (0 skips)")
    estimate_only: bool = arg(False, "only print the real run's estimated throughput, and exit")


def int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma list of integers, not {text!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"{flag} must list integers >= 1, not {text!r}")
    return out


def script_available(name: str) -> bool:
    """Does <name>.py exist and define train()? (Read, not imported.)"""
    path = ROOT / f"{name}.py"
    return path.is_file() and re.search(r"^def train\(", path.read_text(), re.M) is not None


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
    common.check_args(args, {
        f"--steps must be at least 1, not {args.steps}": args.steps >= 1,
        f"--warmup must be >= 0, not {args.warmup}": args.warmup >= 0,
        f"--threads must be at least 1, not {args.threads}": args.threads >= 1,
        f"--curve-steps must be at least 1, not {args.curve_steps}": args.curve_steps >= 1,
        f"--profile-steps must be >= 0, not {args.profile_steps}": args.profile_steps >= 0,
        f"--trl-steps must be at least 1, not {args.trl_steps}":
            args.trl_steps is None or args.trl_steps >= 1,
        f"--curve-script must be one of {', '.join(SCRIPTS)}": args.curve_script in SCRIPTS,
    })
    resolve_scripts(args.scripts)
    if not args.no_curves and not script_available(args.curve_script):
        raise UserError(f"--curve-script {args.curve_script}: its file does not define train()")
    for name in ("curve_max_new_tokens", "curve_group_sizes", "curve_prompts"):
        int_list(getattr(args, name), "--" + name.replace("_", "-"))
    common.resolve_device(args.device)


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
    device = common.resolve_device(args.device)
    return {"cpu": cpu_model(), "cores": cores, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def machine_line(m: dict) -> str:
    where = f"{m['gpu']} (host: {m['cpu']})" if m["gpu"] else m["cpu"]
    load = f", load average {m['load']:.1f} at the start" if m["load"] is not None else ""
    return (f"{where}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
            f"{m['threads']} torch threads, Python {m['python']}, {m['date']}{load}")


# =====================================================================================
# Timing: the phases of one step
# =====================================================================================
class Clock:
    """Adds the wall time of each `with clock("phase"):` block to clock.times["phase"].
    On CUDA it synchronises at both ends, so that a phase is charged for its own kernels."""

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


@dataclass
class Setup:
    """What a script's train() builds before its loop (no run folder, no logging)."""
    name: str
    mod: object
    args: object
    device: torch.device
    tokenizer: object
    rows: list
    policy: object
    ref: object
    eos_ids: list
    params: list
    optimizer: object
    scheduler: object
    sampler: object
    critic: object = None  # SAPO
    critic_params: list = field(default_factory=list)
    critic_optimizer: object = None
    critic_scheduler: object = None


def uses_ref(name: str, a) -> bool:
    """Whether the script's train() loads the frozen reference model (its own condition)."""
    if name == "grpo":
        return a.beta > 0
    if name == "tepo":
        return (a.kl_coef > 0 and a.kl_target == "ref") or \
            (a.entropy_test == "observed" and a.entropy_baseline == "ref")
    if name == "sapo":
        return a.kl_coef > 0
    return name == "erpo"  # ERPO: always (its progress signal); DAPO: never


def setup(name: str, device: str, seed: int, **overrides) -> Setup:
    """train()'s preamble through the script's own functions: arguments from its resolve_args (its
    tiny preset fills every field left at None), tokenizer, data, policy, reference (if the script
    loads one), critic (SAPO), optimizer, prompt sampler."""
    mod = importlib.import_module(name)
    given = {k: v for k, v in overrides.items() if v is not None}
    a = mod.resolve_args(mod.Args(run_name="bench", device=device, seed=seed, **given))
    common.seed_everything(a.seed)
    dev = common.resolve_device(a.device)
    tokenizer, ctx = mod.load_tokenizer(a.model, a.trust_remote_code)
    rows, _ = mod.load_data(a, tokenizer, ctx)
    policy = mod.load_model(a.model, dev, a, trainable=True)
    ref = mod.load_model(a.model, dev, a, trainable=False) if uses_ref(name, a) else None
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, a)
    s = Setup(name, mod, a, dev, tokenizer, rows, policy, ref, mod.eos_token_ids(policy, tokenizer),
              params, optimizer, scheduler, common.PromptSampler(len(rows), a.seed))
    if name == "sapo":  # SAPO: the critic and its own AdamW
        s.critic = mod.load_critic(a.critic_model or a.model, dev, a, tokenizer)
        s.critic_params = [p for p in s.critic.parameters() if p.requires_grad]
        s.critic_optimizer, s.critic_scheduler = common.make_optimizer(
            s.critic_params, dataclasses.replace(a, lr=a.critic_lr))
    return s


# =====================================================================================
# One training step per script: the calls of its train() loop, in its order
# =====================================================================================
def _sample(s: Setup, clock: Clock) -> tuple[list, dict]:
    """Step 1 of every script: P prompts, G completions each."""
    with clock("generate"):
        rows = [s.rows[i] for i in s.sampler.take(s.args.prompts_per_step)]
        batch = s.mod.generate_rollouts(s.policy, s.tokenizer, [r["prompt"] for r in rows],
                                        s.args.group_size, s.args, s.eos_ids, s.device)
    return rows, batch


def _answers(rows: list, G: int) -> list[str]:
    return [r["answer"] for r in rows for _ in range(G)]


def _optimizer_step(s: Setup, loss_sum: float) -> dict:
    return common.optimizer_step(s.optimizer, s.scheduler, s.params, s.args.max_grad_norm, loss_sum)


def _work(batches: list[dict], optimizer_steps: int, metrics: dict) -> dict:
    """The work a step did: completions sampled, their tokens (through the first EOS), decode
    steps (generate() runs until the longest completion of its batch ends), optimizer steps,
    generation rounds; and the accuracy the script logs for the step."""
    return {"completions": sum(len(b["mask"]) for b in batches),
            "tokens": sum(int(b["mask"].sum()) for b in batches),
            "decode_steps": sum(b["completion_ids"].shape[1] for b in batches),
            "optimizer_steps": optimizer_steps, "rounds": len(batches),
            "accuracy": metrics["accuracy"]}


def step_grpo(s: Setup, clock: Clock) -> dict:
    mod, args, device, G = s.mod, s.args, s.device, s.args.group_size
    rows, batch = _sample(s, clock)
    with clock("reward"):
        rewards, correct, parsed = mod.reward_fn(batch["texts"], _answers(rows, G), args)
        advantages = mod.group_advantages(rewards, G).to(device)
    with clock("old_logp"):
        old_logp, old_entropy, _ = mod.batch_logps(s.policy, batch, args)
    with clock("ref_logp"):
        ref_logp = mod.batch_logps(s.ref, batch, args)[0] if s.ref is not None else None
    n_opt, stats, mask = 0, [], batch["mask"]
    with clock("update"):
        s.policy.train()
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                s.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for mb in mod.micro_batches(batch, mini, args.micro_batch_size):
                    logp, _, _ = mod.token_logps_and_entropy(s.policy, batch, mb, args,
                                                             with_entropy=False)
                    ref_mb = ref_logp[mb] if ref_logp is not None else None
                    loss = mod.grpo_loss(logp, old_logp[mb], ref_mb, advantages[mb], mask[mb],
                                         args.eps, args.beta, num_seqs=len(mini))
                    loss.backward()
                    loss_sum += loss.item()
                    stats.append(mod.grpo_stats(logp, old_logp[mb], ref_mb, advantages[mb],
                                                mask[mb], args.eps))
                stats.append(_optimizer_step(s, loss_sum))
                n_opt += 1
    metrics = mod.rollout_metrics(batch, rewards, correct, parsed, old_entropy, G)
    return _work([batch], n_opt, {**metrics, **common.reduce_stats(stats)})


def step_dapo(s: Setup, clock: Clock) -> dict:
    mod, args, device, G = s.mod, s.args, s.device, s.args.group_size
    sampled = []

    def sample_round():  # DAPO: one dynamic-sampling round, scored
        rows, b = _sample(s, clock)
        with clock("reward"):
            b["rewards"], b["correct"], b["parsed"] = mod.reward_fn(
                b["texts"], _answers(rows, G), b["mask"].sum(1), args)
        sampled.append(b)
        return b

    batch, _ = mod.dynamic_sampling(sample_round, args.prompts_per_step, G, args.max_gen_rounds)
    with clock("reward"):
        advantages = mod.group_advantages(batch["rewards"], G).to(device)
    with clock("old_logp"):
        old_logp, old_entropy, _ = mod.batch_logps(s.policy, batch, args)
    n_opt, stats, mask = 0, [], batch["mask"]
    with clock("update"):
        s.policy.train()
        for _ in range(args.ppo_epochs if len(advantages) else 0):  # no kept group, no update
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                s.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                num_tokens = mask[mini].sum().item()
                for mb in mod.micro_batches(batch, mini, args.micro_batch_size):
                    logp, _, _ = mod.token_logps_and_entropy(s.policy, batch, mb, args,
                                                             with_entropy=False)
                    loss = mod.dapo_loss(logp, old_logp[mb], advantages[mb], mask[mb], num_tokens,
                                         args.clip_low, args.clip_high)
                    loss.backward()
                    loss_sum += loss.item()
                    stats.append(mod.dapo_stats(logp, old_logp[mb], advantages[mb], mask[mb],
                                                args.clip_low, args.clip_high))
                stats.append(_optimizer_step(s, loss_sum))
                n_opt += 1
    rewards, correct, parsed = (torch.cat([b[k] for b in sampled])
                                for k in ("rewards", "correct", "parsed"))
    metrics = mod.rollout_metrics(batch, rewards, correct, parsed, old_entropy, G)
    return _work(sampled, n_opt, {**metrics, **common.reduce_stats(stats)})


def step_tepo(s: Setup, clock: Clock) -> dict:
    mod, args, device, G = s.mod, s.args, s.device, s.args.group_size
    rows, batch = _sample(s, clock)
    with clock("reward"):
        rewards, correct, parsed = mod.reward_fn(batch["texts"], _answers(rows, G), args)
        advantages = mod.group_advantages(rewards, G).to(device)
    with clock("old_logp"):  # TEPO: c comes from the same pass
        old_logp, old_entropy, c = mod.batch_logps(s.policy, batch, args,
                                                   extra=mod.entropy_change_c)
    with clock("ref_logp"):
        ref_logp, ref_entropy, _ = (mod.batch_logps(s.ref, batch, args) if s.ref is not None
                                    else (None, None, None))
    kl_logp = ref_logp if args.kl_target == "ref" else old_logp
    base_entropy = old_entropy if args.entropy_baseline == "old" else ref_entropy
    observed = args.entropy_test == "observed"
    n_opt, stats, mask = 0, [], batch["mask"]
    with clock("update"):
        s.policy.train()
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                s.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                num_tokens = mask[mini].sum().item()
                for mb in mod.micro_batches(batch, mini, args.micro_batch_size):
                    logp, entropy, _ = mod.token_logps_and_entropy(s.policy, batch, mb, args,
                                                                   with_entropy=observed)
                    falls = (entropy < base_entropy[mb] - args.entropy_tol if observed
                             else c[mb] > 0)
                    M = mod.kl_mask(advantages[mb], falls, mask[mb])
                    kl_mb = kl_logp[mb] if kl_logp is not None else None
                    loss = mod.tepo_loss(logp, old_logp[mb], kl_mb, advantages[mb], mask[mb], M,
                                         num_tokens, args.clip_low, args.clip_high, args.kl_coef,
                                         args.ratio_level)
                    loss.backward()
                    loss_sum += loss.item()
                    stats.append(mod.tepo_stats(logp, old_logp[mb], kl_mb, advantages[mb],
                                                mask[mb], M, old_entropy[mb], args.clip_low,
                                                args.clip_high, args.ratio_level))
                stats.append(_optimizer_step(s, loss_sum))
                n_opt += 1
    metrics = mod.rollout_metrics(batch, rewards, correct, parsed, old_entropy, G)
    return _work([batch], n_opt, {**metrics, **common.reduce_stats(stats)})


def step_erpo(s: Setup, clock: Clock) -> dict:
    mod, args, device, G = s.mod, s.args, s.device, s.args.group_size
    rows, batch = _sample(s, clock)
    with clock("reward"):
        rewards, correct, parsed = mod.reward_fn(batch["texts"], _answers(rows, G), args)
        advantages = mod.group_advantages(rewards, G).to(device)
    with clock("old_logp"):
        old_logp, old_entropy, _ = mod.batch_logps(s.policy, batch, args)
    with clock("ref_logp"):
        ref_logp = mod.batch_logps(s.ref, batch, args)[0] if s.ref is not None else None
    with clock("advantage"):  # ERPO: the token advantages, once per rollout batch
        m = batch["mask"]
        W = mod.entropy_gate(old_entropy, m, G, args.gate_gamma)
        s_tilde = mod.bucket_normalize(mod.progress_signal(old_logp, ref_logp, m), m, G,
                                       args.num_buckets)
        A_it, psi = mod.token_advantages(advantages, W, s_tilde, m, args.eta, args.synthesis)
    n_opt = 0
    with clock("update"):
        s.policy.train()
        stats = [mod.token_advantage_stats(A_it, advantages, W, psi, m)]
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(advantages), device=device).chunk(args.num_mini_batches):
                s.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for mb in mod.micro_batches(batch, mini, args.micro_batch_size):
                    logp, _, _ = mod.token_logps_and_entropy(s.policy, batch, mb, args,
                                                             with_entropy=False)
                    ref_mb = ref_logp[mb] if ref_logp is not None else None
                    loss = mod.erpo_loss(logp, old_logp[mb], ref_mb, A_it[mb], m[mb],
                                         args.eps, args.beta, num_seqs=len(mini))
                    loss.backward()
                    loss_sum += loss.item()
                    stats.append(mod.erpo_stats(logp, old_logp[mb], ref_mb, A_it[mb], m[mb],
                                                args.eps))
                stats.append(_optimizer_step(s, loss_sum))
                n_opt += 1
    metrics = mod.rollout_metrics(batch, rewards, correct, parsed, old_entropy, G)
    return _work([batch], n_opt, {**metrics, **common.reduce_stats(stats)})


def step_sapo(s: Setup, clock: Clock) -> dict:
    mod, args, device, G = s.mod, s.args, s.device, s.args.group_size
    rows, batch = _sample(s, clock)
    with clock("reward"):
        rewards, correct, parsed = mod.reward_fn(batch["texts"], _answers(rows, G), args)
    with clock("old_logp"):
        old_logp, old_entropy, _ = mod.batch_logps(s.policy, batch, args)
    with clock("ref_logp"):
        ref_logp = mod.batch_logps(s.ref, batch, args)[0] if s.ref is not None else None
    with clock("advantage"):  # SAPO: segments, the critic's old values, GAE over segments
        seg = mod.segment_batch(s.critic, batch, old_logp, old_entropy, ref_logp,
                                rewards.to(device), args)
        seg_id, seg_mask, advantages = seg["seg_id"], seg["seg_mask"], seg["advantages"]
    n_opt, stats = 0, []
    with clock("update"):  # SAPO: one policy and one critic optimizer step per mini-batch
        s.policy.train()
        s.critic.train()
        for _ in range(args.ppo_epochs):
            for mini in torch.randperm(len(rewards), device=device).chunk(args.num_mini_batches):
                s.optimizer.zero_grad(set_to_none=True)
                s.critic_optimizer.zero_grad(set_to_none=True)
                num_tokens = batch["mask"][mini].sum().item()
                num_segments = seg_mask[mini].sum().item()
                loss_sum, value_loss_sum = 0.0, 0.0
                for mb in mod.micro_batches(batch, mini, args.micro_batch_size):
                    m, sid, sm = batch["mask"][mb], seg_id[mb], seg_mask[mb]
                    logp, _, _ = mod.token_logps_and_entropy(s.policy, batch, mb, args,
                                                             with_entropy=False)
                    loss = mod.sapo_policy_loss(logp, old_logp[mb], advantages[mb], sid, sm, m,
                                                num_tokens, args.clip_low, args.clip_high)
                    loss.backward()
                    values = mod.segment_state_values(mod.token_values(s.critic, batch, mb, args),
                                                      sid, sm, m, args.value_at)
                    value_loss = mod.sapo_value_loss(values, seg["old_values"][mb],
                                                     seg["returns"][mb], sm, num_segments,
                                                     args.value_clip)
                    value_loss.backward()
                    loss_sum += loss.item()
                    value_loss_sum += value_loss.item()
                    stats.append({**mod.sapo_stats(logp, old_logp[mb], advantages[mb], sid, sm, m,
                                                   args.clip_low, args.clip_high),
                                  **mod.value_stats(values, seg["old_values"][mb],
                                                    seg["returns"][mb], sm, args.value_clip)})
                stats.append(_optimizer_step(s, loss_sum))
                stats.append(mod.critic_step(s.critic_optimizer, s.critic_scheduler, s.critic_params, args,
                                             value_loss_sum))
                n_opt += 1
    metrics = mod.sapo_metrics(batch, rewards, correct, parsed, old_entropy, seg, old_logp, ref_logp)
    return _work([batch], n_opt, {**metrics, **common.reduce_stats(stats)})


STEP = {"grpo": step_grpo, "dapo": step_dapo, "tepo": step_tepo, "erpo": step_erpo,
        "sapo": step_sapo}


def timed_step(s: Setup) -> dict:
    """One step of s's script: the seconds of each phase and of the whole step, and its work."""
    clock = Clock(s.device)
    t0 = clock.now()
    work = STEP[s.name](s, clock)
    step = clock.now() - t0
    return {**{p: clock.times.get(p, 0.0) for p in PHASES}, "step": step, **work,
            "tokens_per_s": work["tokens"] / step}


def time_script(s: Setup, steps: int, warmup: int, label: str = "") -> list[dict]:
    """warmup untimed steps, then `steps` timed ones; one line printed per step."""
    rows = []
    for i in range(warmup + steps):
        r = timed_step(s)
        tag = "warm-up" if i < warmup else f"{i - warmup + 1}/{steps}"
        print(f"  {label or s.name} {tag}: {r['step']:.2f} s, {r['completions']} completions, "
              f"{r['tokens']} tokens", flush=True)
        if i >= warmup:
            rows.append(r)
    return rows


# =====================================================================================
# Summaries
# =====================================================================================
SUMMARY_KEYS = (*PHASES, "step", "tokens_per_s", "completions", "tokens", "decode_steps",
                "optimizer_steps", "rounds")


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
    head = ("| script | P x G | completions | tokens | generate | reward | old logp | ref logp "
            "| advantage | update | step: median (min-max) | tokens/s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, (a, m) in results.items():
        phases = " | ".join(fmt_s(m[p]) if m[p] > 0 else "-" for p in PHASES)
        lines.append(f"| {name} | {a.prompts_per_step} x {a.group_size} | {m['completions']:g} | "
                     f"{m['tokens']:g} | {phases} | {fmt_s(m['step'])} ({fmt_s(m['step_min'])}-"
                     f"{fmt_s(m['step_max'])}) | {m['tokens_per_s']:.0f} |")
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
    return [{"kind": k, "s": v, "share": v / step, "gflop": flops.get(k, 0.0),
             "gflop_per_s": flops[k] / v if k == "matrix multiply" and v > 0 else None}
            for k, v in secs.items()]


def top_other_ops(events, steps: int, cuda: bool, k: int = 6) -> str:
    """The k "other ops" with the most self time per step, as 'name s' pairs."""
    others = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6 / steps)
              for e in events if op_kind(e.key) == "other ops"]
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
    return 2 * n ** 3 / best / 1e9


def profile_script(s: Setup, steps: int) -> str:
    """One untimed step, then `steps` under torch.profiler; a markdown table by kind of op."""
    from torch.profiler import ProfilerActivity, profile
    cuda = s.device.type == "cuda"
    timed_step(s)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_flops=True) as prof:
        wall = sum(timed_step(s)["step"] for _ in range(steps))
    events = prof.key_averages()
    rows = op_breakdown(events, wall, steps, cuda)
    lines = [f"{s.name}.py, {steps} step(s) under torch.profiler (which slows them: read the "
             "shares, not the seconds); self time of each op, per step:", "",
             "| kind | s per step | share | GFLOP per step | GFLOP/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {fmt_s(r['s'])} | {r['share']:.0%} | "
              f"{r['gflop']:.1f} | {r['gflop_per_s']:.0f} |" if r["gflop_per_s"] else
              f"| {r['kind']} | {fmt_s(r['s'])} | {r['share']:.0%} | - | - |" for r in rows]
    peak, mm = matmul_peak(s.device), rows[0]["gflop_per_s"] or 0.0
    lines += ["", f"Largest other ops, s per step: {top_other_ops(events, steps, cuda)}.", "",
              f"A 2048^3 matrix multiply ({'bf16' if cuda else 'fp32'}) runs at {peak:.0f} GFLOP/s "
              f"here; the step's matrix multiplies ran at {mm / peak:.0%} of that. When matrix "
              "multiplies near that rate and elementwise ops fill the step, with little left to "
              "Python, a step gets faster only with fewer FLOPs or fewer passes over memory."]
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
    ...        ppo_epochs=1, max_new_tokens=40, temperature=1.0, top_p=1.0, beta=0.04, eps=0.2,
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
        raise UserError(f"TRL needs whole micro-batches: a mini-batch of {mini} completions does "
                        f"not split into micro-batches of {micro}")
    ga = mini // micro
    return dict(
        output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=ga,
        steps_per_generation=a.num_mini_batches * ga, num_iterations=a.ppo_epochs,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_p=a.top_p, top_k=0, beta=a.beta, epsilon=a.eps,
        loss_type="grpo", scale_rewards="group", mask_truncated_completions=False,
        learning_rate=a.lr, warmup_steps=a.warmup_steps, lr_scheduler_type="constant_with_warmup",
        weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm, optim="adamw_torch",
        bf16=bool(a.bf16), activation_checkpointing=bool(a.gradient_checkpointing),
        use_cpu=common.resolve_device(a.device).type == "cpu",
        max_steps=rollout_batches * a.num_mini_batches * a.ppo_epochs,
        model_init_kwargs={"dtype": "float32"}, disable_dropout=True, logging_steps=10**9,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=a.seed,
        dataloader_num_workers=0)


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
        row = {**{p: t[p] for p in ("generate", "reward", "old_logp", "ref_logp")},
               "advantage": max(0.0, t["prepare"] - own), "update": max(0.0, step - t["prepare"]),
               "step": step, "optimizer_steps": optimizer_steps,
               **{k: self.work[k] for k in ("completions", "tokens", "decode_steps", "rounds")}}
        row["tokens_per_s"] = row["tokens"] / step
        self.clock.times.clear()
        self.work.clear()
        return row


def compare_with_trl(args: Args, steps: int) -> dict:
    """grpo.py and TRL's GRPOTrainer on the same work, one rollout batch each in turn. TRL's
    trainer runs its own train() loop; after each of its rollout batches (every
    --num-mini-batches x --ppo-epochs optimizer steps) a callback times one grpo.py step. TRL's
    step is the time between two callbacks, less the grpo.py step in between."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = setup("grpo", args.device, args.seed, prompts_per_step=args.prompts_per_step,
              group_size=args.group_size, max_new_tokens=args.max_new_tokens)
    a = s.args
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in s.rows])

    def boxed_reward(completions, answer, **kwargs):  # grpo.py's own reward_fn
        return s.mod.reward_fn(completions, answer, a)[0].tolist()

    project, trl_rows = [], []
    per_batch = a.num_mini_batches * a.ppo_epochs  # TRL optimizer steps per rollout batch

    class Interleave(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.t, self.last = time.perf_counter(), 0

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % per_batch:
                return
            trl_rows.append(timer.take(time.perf_counter() - self.t, state.global_step - self.last))
            self.last = state.global_step
            project.append(timed_step(s))  # grpo.py's step, right after TRL's
            i = len(trl_rows) - 1
            tag = "warm-up" if i < args.warmup else f"{i - args.warmup + 1}/{steps}"
            print(f"  TRL {tag}: {trl_rows[-1]['step']:.2f} s   "
                  f"grpo.py {tag}: {project[-1]['step']:.2f} s", flush=True)
            self.t = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL 1.16 on transformers 5's renames
        cfg = GRPOConfig(**trl_config_kwargs(a, tmp, args.warmup + steps))
        trainer = GRPOTrainer(model=common.resolve_model_name(a.model), reward_funcs=boxed_reward,
                              args=cfg, train_dataset=dataset, processing_class=s.tokenizer,
                              callbacks=[Interleave()])
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict
        timer = TRLTimer(trainer, s.device)
        probe = s.rows[0]["prompt"]
        gen = trainer.generation_config
        checks = {
            "same prompt token ids": trainer.processing_class(text=[probe])["input_ids"][0]
            == s.tokenizer(probe, add_special_tokens=False)["input_ids"],
            "reference model in both": (trainer.ref_model is not None) == (s.ref is not None),
            "old log-prob pass in both": cfg.gradient_accumulation_steps
            % (cfg.steps_per_generation * cfg.num_iterations) != 0,
            "same sampling (do_sample, temperature, top_p, top_k, max_new_tokens)":
                (gen.do_sample, gen.temperature, gen.top_p, gen.top_k or 0, gen.max_new_tokens)
                == (True, a.temperature, a.top_p, 0, a.max_new_tokens),
            "same activation checkpointing":
                bool(trainer.model.is_gradient_checkpointing) == bool(a.gradient_checkpointing),
        }
        trainer.train()
    return {"project": project[args.warmup:], "trl": trl_rows[args.warmup:], "checks": checks,
            "config": {k: getattr(cfg, k) for k in (
                "per_device_train_batch_size", "gradient_accumulation_steps",
                "steps_per_generation", "num_iterations", "num_generations",
                "generation_batch_size", "beta", "loss_type")}}


def trl_report(c: dict, version: str) -> str:
    """The work check, phase medians side by side, and the ratio line."""
    p, t = summarize(c["project"]), summarize(c["trl"])
    pairs = list(zip(c["project"], c["trl"]))
    n = len(pairs)
    lines = [f"TRL {version} GRPOTrainer against grpo.py, {n} interleaved step pairs. TRL config: "
             + ", ".join(f"{k}={v}" for k, v in c["config"].items()), "",
             "| per step (median) | grpo.py | TRL |", "|---|---|---|"]
    for k in ("completions", "optimizer_steps", "tokens", "decode_steps"):
        lines.append(f"| {k.replace('_', ' ')} | {p[k]:g} | {t[k]:g} |")
    for k in (*PHASES, "step"):
        lines.append(f"| {k}, s | {fmt_s(p[k])} | {fmt_s(t[k])} |")
    lines += [f"| tokens/s | {p['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} |", ""]
    checks = {f"{k.replace('_', ' ')} equal in every pair": all(x[k] == y[k] for x, y in pairs)
              for k in ("completions", "optimizer_steps")}
    checks.update(c["checks"])
    lines += [f"- {'ok' if v else 'MISMATCH'}: {k}" for k, v in checks.items()]
    gap = abs(p["tokens"] - t["tokens"]) / max(p["tokens"], 1)
    lines += [f"- tokens generated (median) differ by {100 * gap:.1f}%: sampled, so equal only in "
              "expectation",
              f"- work matched: {'yes' if all(checks.values()) else 'NO (see MISMATCH above)'}",
              "- TRL's advantage = the rest of its _generate_and_score_completions; its update = "
              "the rest of its step", ""]
    ratio = statistics.median(x["step"] / y["step"] for x, y in pairs)
    per_token = statistics.median((x["step"] / max(x["tokens"], 1))
                                  / (y["step"] / max(y["tokens"], 1)) for x, y in pairs)
    lines += [f"project/TRL step time: {ratio:.2f} (median over {n} interleaved steps)",
              f"project/TRL time per generated token: {per_token:.2f} "
              f"(median over {n} interleaved steps)"]
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
    return [(knob, {**{k: getattr(base, k) for k in knobs}, knob: v})
            for knob, values in sweeps for v in values]


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
    """One fresh setup per point (the script's tiny preset with one knob changed), one warm-up
    step, then --curve-steps timed steps. The --max-new-tokens sweep forces every completion to
    its cap (forced_length); the G and P sweeps keep natural lengths. Returns the CSV's rows and
    whether the PNG was drawn."""
    name = args.curve_script
    base = setup(name, args.device, args.seed, prompts_per_step=args.prompts_per_step,
                 group_size=args.group_size, max_new_tokens=args.max_new_tokens).args
    sweeps = [("max_new_tokens", int_list(args.curve_max_new_tokens, "--curve-max-new-tokens")),
              ("group_size", int_list(args.curve_group_sizes, "--curve-group-sizes")),
              ("prompts_per_step", int_list(args.curve_prompts, "--curve-prompts"))]
    done, rows = {}, []
    for knob, point in curve_points(base, sweeps):
        forced = knob == "max_new_tokens"
        key = (*point.values(), forced)
        if key not in done:
            label = (f"{name} P={point['prompts_per_step']} G={point['group_size']} "
                     f"T={point['max_new_tokens']}{' (forced length)' if forced else ''}")
            s = setup(name, args.device, args.seed, **point)
            with forced_length(s.mod) if forced else contextlib.nullcontext():
                done[key] = summarize(time_script(s, args.curve_steps, 1, label))
        m = done[key]
        rows.append({"script": name, "sweep": knob, **point, "forced_length": forced,
                     "completions": m["completions"],
                     "tokens": m["tokens"], "decode_steps": m["decode_steps"],
                     **{f"{p}_s": round(m[p], 4) for p in PHASES}, "step_s": round(m["step"], 4),
                     "step_min_s": round(m["step_min"], 4), "step_max_s": round(m["step_max"], 4),
                     "tokens_per_s": round(m["tokens_per_s"], 1), "timed_steps": m["n"]})
    write_csv(out / "bench_curves.csv", rows)
    return rows, plot_curves(out / "bench_curves.png", rows)


def plot_curves(path: Path, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (pip install matplotlib); "
              "the CSV is written")
        return False
    knobs = [("max_new_tokens", "--max-new-tokens (every completion forced to it)"),
             ("group_size", "G, completions per prompt"), ("prompts_per_step", "P, prompts per step")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (knob, label) in zip(axes, knobs):
        pts = sorted((r for r in rows if r["sweep"] == knob), key=lambda r: r[knob])
        if not pts:
            ax.set_visible(False)
            continue
        x = [r[knob] for r in pts]
        ax.fill_between(x, [r["step_min_s"] for r in pts], [r["step_max_s"] for r in pts],
                        alpha=0.2)
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
QWEN_MATH_1_5B = dict(params=1.54e9, embed=151_936 * 1536, layers=28, kv_heads=2, head_dim=128,
                      hidden=1536, vocab=151_936)
# 80 GB GPUs: memory bandwidth (bytes/s) and dense bf16 FLOP/s, from the data sheets.
GPUS = {"A100 80GB SXM": (2.04e12, 312e12), "H100 80GB SXM": (3.35e12, 989e12)}
# Each script's real-run preset (REAL_DEFAULTS): P, G, reference model, critic
REAL_PRESETS = {"grpo": (32, 8, True, False), "dapo": (16, 16, False, False),
                "tepo": (32, 8, True, False), "erpo": (32, 8, True, False),
                "sapo": (256, 1, True, True)}


def real_run_estimate(P: int, G: int, max_new_tokens: int = 3000, gen_batch_size: int = 64,
                      mean_completion: int = 600, prompt_len: int = 200, ref: bool = True,
                      critic: bool = False, epochs: int = 1, launch_s: float = 0.020,
                      mfu: float = 0.4, bandwidth: float = 2.04e12, flops: float = 312e12,
                      model: dict = QWEN_MATH_1_5B) -> dict:
    """Seconds per training step of a real-run preset from the model's shapes: an ESTIMATE, not
    measured on a GPU. Assumptions:
    generation  HF generate() with its dynamic KV cache and no continuous batching: each call of
                gen_batch_size completions decodes max_new_tokens steps (one completion running
                to the cap keeps its whole batch decoding). A decode step costs the larger of
                (a) memory: the bf16 weights read once (autocast caches the cast of the
                    trainable policy's weights), plus the KV cache at the mean context
                    prompt_len + max_new_tokens / 2 read by attention and copied once by the
                    cache's concatenation (read + write), at `bandwidth`;
                (b) launches: launch_s, eager PyTorch's cost per step (~1,100 kernel launches for
                    28 layers at ~15 us, plus the generate loop's Python).
    training    every forward covers the padded rows, prompt_len + max_new_tokens positions per
                completion (rows are padded to the rollout batch's longest completion), at 2 FLOP
                per non-embedding parameter per position, plus the output layer on the
                mean_completion valid positions; passes: old log-probs 1 forward, reference 1,
                update 4 (forward, checkpoint recompute, backward = 2) per epoch, a critic as
                much again; at `mfu` of the GPU's dense bf16 FLOP/s.

    >>> e = real_run_estimate(P=32, G=8)  # GRPO on an A100 80GB
    >>> e["generate_calls"], round(1e3 * e["memory_step_s"], 1), e["generate_s"]
    (4, 6.1, 240.0)
    >>> round(e["train_s"])
    106
    """
    B = P * G
    kv_per_token = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 2  # K, V in bf16
    batch = min(gen_batch_size, B)
    calls = math.ceil(B / batch)
    kv_bytes = batch * (prompt_len + max_new_tokens / 2) * kv_per_token
    memory_s = (2 * model["params"] + 3 * kv_bytes) / bandwidth
    decode_s = max(memory_s, launch_s)
    generate_s = calls * max_new_tokens * decode_s
    body = 2 * (model["params"] - model["embed"])  # FLOP per position, output layer aside
    head = 2 * model["hidden"] * model["vocab"]  # FLOP per valid completion position
    passes = 1 + int(ref) + 4 * epochs + (1 + 4 * epochs if critic else 0)
    train_s = passes * (B * (prompt_len + max_new_tokens) * body + B * mean_completion * head) \
        / (mfu * flops)
    return {"completions": B, "generate_calls": calls, "decode_step_s": decode_s,
            "memory_step_s": memory_s, "generate_s": generate_s, "train_s": train_s,
            "step_s": generate_s + train_s, "valid_tokens": B * mean_completion,
            "tokens_per_s": B * mean_completion / (generate_s + train_s),
            "decode_tokens_per_s": batch / decode_s}


def estimate_report() -> str:
    """The real run's expected throughput (Qwen2.5-Math-1.5B), for each script's preset."""
    lines = ["Real run, Qwen2.5-Math-1.5B, 3000 new tokens, generate() batches of 64: "
             "ESTIMATE, NOT MEASURED ON A GPU.",
             "Assumptions (bench.py, real_run_estimate): mean completion 600 tokens, prompt 200; "
             "a decode step costs max(memory time, 20 ms of eager launch overhead); training at "
             "40% of the dense bf16 FLOP/s; DAPO: one sampling round per step.", "",
             "| GPU | script | completions | decode step (memory-bound) | generate | train | step "
             "| 500 steps | valid tokens/s | decoded tokens/s |", "|---" * 10 + "|"]
    for gpu, (bandwidth, flops) in GPUS.items():
        for name, (P, G, ref, critic) in REAL_PRESETS.items():
            e = real_run_estimate(P, G, ref=ref, critic=critic, bandwidth=bandwidth, flops=flops)
            lines.append(f"| {gpu} | {name} | {e['completions']} | "
                         f"{1e3 * e['decode_step_s']:.0f} ms ({1e3 * e['memory_step_s']:.1f} ms) | "
                         f"{e['generate_s'] / 60:.1f} min | "
                         f"{e['train_s'] / 60:.1f} min | {e['step_s'] / 60:.1f} min | "
                         f"{500 * e['step_s'] / 3600:.0f} h | {e['tokens_per_s']:.0f} | "
                         f"{e['decode_tokens_per_s']:.0f} |")
    lines += ["", "Generation dominates and is bound by launch overhead, not memory bandwidth: a "
              "static KV cache with CUDA graphs (torch.compile) or vLLM would bring the decode "
              "step towards the memory-bound time in brackets. A real run logs `time/generate`, "
              "`time/train` and `tokens_per_s` in metrics.jsonl: check these numbers there."]
    return "\n".join(lines)


# =====================================================================================
# Main
# =====================================================================================
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
        s = setup(name, args.device, args.seed, prompts_per_step=args.prompts_per_step,
                  group_size=args.group_size, max_new_tokens=args.max_new_tokens)
        rows = time_script(s, args.steps, args.warmup)
        step_rows += [{"script": name, "step": i + 1, **r} for i, r in enumerate(rows)]
        results[name] = (s.args, summarize(rows))
    table = script_table(results)
    print("\n" + table + "\n")
    cap = next(iter(results.values()))[0].max_new_tokens
    md += [f"Each script's tiny preset ({cap} new tokens, CPU unless stated), {args.steps} timed "
           f"steps after {args.warmup} warm-up; seconds per phase (median) and per step.", "",
           table, ""]
    write_csv(out / "bench_steps.csv", step_rows)
    if args.profile_steps:
        name = next(iter(results))
        print(f"{name}.py under torch.profiler: {args.profile_steps} step(s)", flush=True)
        breakdown = profile_script(setup(name, args.device, args.seed, prompts_per_step=args.prompts_per_step,
                                         group_size=args.group_size, max_new_tokens=args.max_new_tokens),
                                   args.profile_steps)
        print("\n" + breakdown + "\n")
        md += ["## Where a step's time goes", "", breakdown, ""]

    # 2. TRL's GRPOTrainer on grpo.py's work, interleaved with it
    if not args.no_trl:
        version = trl_version()
        if version is None:
            msg = ("TRL is not installed: no comparison with its GRPOTrainer "
                   "(pip install trl==1.16.0)")
            print(msg)
            md += [msg, ""]
        else:
            if version != "1.16.0":
                print(f"note: TRL {version} here; the config mapping was worked out for TRL 1.16.0")
            n = args.trl_steps or args.steps
            print(f"TRL {version} GRPOTrainer and grpo.py, interleaved: {args.warmup} warm-up + "
                  f"{n} pairs", flush=True)
            report = trl_report(compare_with_trl(args, n), version)
            print("\n" + report + "\n")
            md += ["## Against TRL's GRPOTrainer", "", report, ""]

    # 3. Cost curves
    if not args.no_curves:
        print(f"cost curves ({args.curve_script}.py): {args.curve_steps} timed steps per point",
              flush=True)
        curve, plotted = cost_curves(args, out)
        md += ["## Cost curves", "", f"{args.curve_script}.py, one knob at a time from its tiny "
               f"preset, {args.curve_steps} timed steps per point (bench_curves.csv, "
               "bench_curves.png). In the max_new_tokens sweep every completion is forced to the "
               "cap (EOS suppressed until then), so it shows cost against length; the other "
               "sweeps keep the model's natural lengths.", "",
               "| sweep | P | G | max new tokens | completions | tokens | decode steps | step, s "
               "| tokens/s |", "|---" * 9 + "|"]
        md += [f"| {r['sweep']} | {r['prompts_per_step']} | {r['group_size']} | "
               f"{r['max_new_tokens']} | {r['completions']:g} | {r['tokens']:g} | "
               f"{r['decode_steps']:g} | {fmt_s(r['step_s'])} | {r['tokens_per_s']:.0f} |"
               for r in curve]
        md.append("")

    # 4. The real run, estimated
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
    args = common.parse_args(Args, argv)
    with common.user_errors():
        return run(args)


if __name__ == "__main__":
    main()
