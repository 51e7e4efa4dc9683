"""A training script, run as usual, with the studies' diagnostics in its metrics.jsonl.

    python tools/diagnostics.py tepo.py --model models/SmolLM2-135M-Instruct --device cpu
    python tools/diagnostics.py tepo.py --resume runs/<run>     # continue one, still diagnosed

Every flag after the script's name is the script's own. tools/study.py starts (and resumes) each
of its runs this way. The figures below come from the run's own tensors: for the run, the
script's functions are wrapped from outside (diagnosed: what reward_fn, the advantage function,
token_logps and the loss are given or return is read, and runner.Run.end_step adds the figures
to the step's metrics), and restored after. A plain `python tepo.py` logs none of them; nothing
here changes what is learned, and every algorithmic piece is the script's own function.

Per rollout batch ("rollout"):
    right_cut_off_frac          share of the right answers that were cut off at the length cap
    grad_mass_cut_token_mean    share of the gradient mass on cut-off completions under token-mean
                                aggregation: sum over them of |A_i| L_i, over the sum for all (each
                                token weighs 1 / N_tokens, so completion i weighs |A_i| L_i)
    grad_mass_cut_seq_mean      the same under seq-mean-token-mean (token weight 1 / (L_i N_seq):
                                completion i weighs |A_i|); per-token advantages sum |A_it| instead
Per micro-batch of the update ("update"), averaged over the step's micro-batches as the scripts'
own statistics are (the first mini-batch of a rollout batch is on-policy: its ratio is 1 and it
never clips, so with 2 mini-batches the second's clip rates are twice these):
    clip_frac_pos_adv, clip_frac_neg_adv   share of the tokens with A > 0 (A < 0) clipped
    clip_frac_cut, clip_frac_ended         the same over the tokens of cut-off (ended) completions
    clip_frac_mini1, clip_frac_mini2, ...  share of all valid tokens clipped in the rollout batch's
                                first, second, ... mini-batch (each averaged over its own
                                micro-batches: the second's figure stands apart from the first's)
    kl_pos_adv, kl_neg_adv      mean KL to the reference on tokens of completions with A > 0 / A < 0
    kl_off_mask                 (TEPO) mean KL on valid tokens off its KL mask
    kl_first_quarter, kl_last_quarter   mean KL in the first / last quarter of each completion
    kl_token_max                the largest KL of any token
Per step: peak_rss_mb, the process's peak resident memory so far (evaluations included), in MB.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

try:
    import resource
except ImportError:  # not POSIX
    resource = None

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import runner  # noqa: E402

# The function that returns a rollout batch's advantages, by name, and how to read its result
ADVANTAGES = {
    "group_advantages": lambda out: out,  # A_i [B] (ERPO's and SAPO's own come later in a step)
    "token_advantages": lambda out: out[0],  # ERPO: (A_it [B, T], psi)
    "segment_batch": lambda out: out["advantages"],  # SAPO: A_m(t) on every token [B, T]
}
LOSSES = ("grpo_loss", "dapo_loss", "tepo_loss", "erpo_loss")  # SAPO's segment clip: no figures


def clipped_ratio(run, logp, old_logp, mask) -> torch.Tensor:
    """[b, T] the ratio the run's loss clips: TEPO's carried ratio (its own function), else the
    token's."""
    if run.algo == "tepo":
        tepo = importlib.import_module("tepo")
        return torch.exp(tepo.carried_log_ratio(logp, old_logp, mask, run.args.ratio_level))
    return torch.exp(logp - old_logp)


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """[B] one advantage per completion, or [B, T] one per token -> broadcastable to [B, T]."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def rollout_figures(batch: dict, correct: torch.Tensor, advantages: torch.Tensor) -> dict:
    m = batch["mask"].bool()  # [B, T]
    cut = batch["truncated"].bool()  # [B]
    right = correct.to(cut.device).bool()
    out = {}
    if right.any():
        out["right_cut_off_frac"] = ((cut & right).sum() / right.sum()).item()
    abs_a = torch.where(m, per_token(advantages).abs().float(), 0.0)  # [B, T]: |A| on valid tokens
    # [B] each
    mass = {"token_mean": abs_a.sum(1), "seq_mean": abs_a.sum(1) / m.sum(1).clamp(min=1)}
    for name, w in mass.items():
        if w.sum() > 0:
            out[f"grad_mass_cut_{name}"] = (w[cut].sum() / w.sum()).item()
    return out


def update_figures(
    run, context: dict, rows, logp, old_logp, kl_logp=None, M=None, mini: int = 1
) -> dict:
    batch = context["batch"]
    m, cut = batch["mask"][rows].bool(), batch["truncated"][rows].bool()[:, None]  # [b, T], [b, 1]
    A = per_token(context["advantages"][rows])
    lo, hi = run.args.clip_low, run.args.clip_high  # every script's clip, by one name
    r = clipped_ratio(run, logp, old_logp, batch["mask"][rows])
    clipped = ((r > 1 + hi) & (A > 0)) | ((r < 1 - lo) & (A < 0))  # [b, T]
    out = {}
    for name, where in (("pos_adv", A > 0), ("neg_adv", A < 0), ("cut", cut), ("ended", ~cut)):
        where = where & m
        if where.any():
            out[f"clip_frac_{name}"] = (clipped & where).sum().item() / where.sum().item()
    if m.any():  # mini: which optimizer step of the rollout batch this micro-batch belongs to
        out[f"clip_frac_mini{mini}"] = (clipped & m).sum().item() / m.sum().item()
    if kl_logp is not None:
        d = kl_logp - logp
        kl = torch.exp(d) - d - 1  # k3, as the scripts' k3_kl
        # [b, T] in (0, 1] on valid tokens
        position = m.cumsum(1) / m.sum(1, keepdim=True).clamp(min=1)

        def mean_kl(where):  # mean KL over the valid tokens in `where` (0 when there are none)
            where = where & m
            return (torch.where(where, kl, 0.0).sum() / where.sum().clamp(min=1)).item()

        out.update(
            kl_pos_adv=mean_kl(A > 0),
            kl_neg_adv=mean_kl(A < 0),
            kl_first_quarter=mean_kl(position <= 0.25),
            kl_last_quarter=mean_kl(position > 0.75),
            kl_token_max=torch.where(m, kl, 0.0).max().item() if m.any() else 0.0,
        )
        if M is not None:
            out["kl_off_mask"] = mean_kl(~M)
    return out


@contextlib.contextmanager
def patched(*changes):
    """Within it, owner.name is wrap(owner.name) for each (owner, name, wrap) whose owner has that
    name; the originals are put back after, whatever happens."""
    saved = []
    try:
        for owner, name, wrap in changes:
            if hasattr(owner, name):
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, wrap(getattr(owner, name)))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def diagnosed(script):
    """Within it, `script`'s train() logs the figures: its functions and runner.Run.end_step
    wrapped to read the tensors they are given or return (none is changed)."""
    seen, figures = {}, []

    def reward_fn(f):
        def wrapper(*a, **k):
            out = f(*a, **k)
            seen["correct"] = out[1]  # (rewards, correct, parsed)
            return out

        return wrapper

    def advantages(read):
        def wrap(f):
            def wrapper(*a, **k):
                out = f(*a, **k)
                seen["advantages"], seen["new"], seen["mini"] = read(out), True, 1
                return out

            return wrapper

        return wrap

    def token_logps(f):
        def wrapper(model, batch, rows, args, *a, **k):
            if seen.pop("new", False):  # the rollout batch's first update: the batch trained on
                seen["advantages"] = seen["advantages"].to(batch["mask"].device)
                correct = batch.get("correct", seen.get("correct"))  # DAPO: the kept groups'
                with torch.no_grad():
                    figures.append(rollout_figures(batch, correct, seen["advantages"]))
            seen.update(batch=batch, rows=rows, run=SimpleNamespace(algo=script.ALGO, args=args))
            return f(model, batch, rows, args, *a, **k)

        return wrapper

    def loss(f):
        def wrapper(**terms):
            out = f(**terms)
            context = {"batch": seen["batch"], "advantages": seen["advantages"]}
            with torch.no_grad():
                figures.append(
                    update_figures(
                        seen["run"],
                        context,
                        seen["rows"],
                        terms["logp"],
                        terms["old_logp"],
                        terms.get("ref_logp"),
                        terms.get("M"),
                        seen.get("mini", 1),
                    )
                )
            return out

        return wrapper

    def optimizer_step(f):
        def wrapper(*a, **k):
            # the micro-batches after an optimizer step belong to the next mini-batch
            seen["mini"] = seen.get("mini", 1) + 1
            return f(*a, **k)

        return wrapper

    def end_step(f):
        def wrapper(run, step, metrics):
            if figures:  # averaged over the step, as the scripts' own statistics
                metrics = {**metrics, **common.reduce_stats(figures)}
                figures.clear()
            if resource is not None:  # Linux: kB
                metrics["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return f(run, step, metrics)

        return wrapper

    return patched(
        (script, "reward_fn", reward_fn),
        *((script, name, advantages(read)) for name, read in ADVANTAGES.items()),
        (script, "token_logps", token_logps),
        *((script, name, loss) for name in LOSSES),
        (common, "optimizer_step", optimizer_step),
        (runner.Run, "end_step", end_step),
    )


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        print("usage: python tools/diagnostics.py SCRIPT.py [the script's flags]", file=sys.stderr)
        raise SystemExit(2)
    name = Path(argv[0]).stem
    if not (ROOT / f"{name}.py").is_file():
        print(f"error: no training script {argv[0]!r} in {ROOT}", file=sys.stderr)
        raise SystemExit(2)
    script = importlib.import_module(name)
    with diagnosed(script):
        return script.main(argv[1:])


if __name__ == "__main__":
    main()
