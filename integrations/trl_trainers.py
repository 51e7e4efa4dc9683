"""TEPO and ERPO as TRL GRPOTrainer subclasses: many GPUs (accelerate, DeepSpeed, FSDP) and vLLM.

The objectives are imported unchanged from tepo.py and erpo.py (tepo.tepo_loss, tepo.kl_mask,
tepo.entropy_change_c, tepo.tepo_stats; erpo.entropy_gate, erpo.bucket_normalize,
erpo.token_advantages, erpo.erpo_loss, ...). These classes only feed them the tensors TRL already
computes, and override as little of GRPOTrainer as they can:

  _generate_and_score_completions  after TRL's rollouts, rewards and advantages: one no-grad pass
                                   of the policy that just sampled, through TRL's own log-prob
                                   code, for old_logp and old_entropy (and TEPO's c, ERPO's A_it)
  _prepare_inputs                  counts the valid tokens / completions of every optimizer step
  _compute_loss                    TRL's log-prob pass, then tepo_loss / erpo_loss

Written against TRL 1.16 (see requirements-trl.txt), which names these methods so. The
sampling-policy pass is one no-grad forward per generation batch; when TRL computes old log-probs
itself (more than one optimizer step per generation batch), that forward runs twice, TRL's and
this one: a known cost of overriding little.

What maps to what (tepo.py / erpo.py flag -> TRL GRPOConfig field):

  rollout batch of P*G completions   generation batch: generation_batch_size
                                     = per_device_train_batch_size * num_processes
                                       * steps_per_generation
  --group-size G                     num_generations
  --num-mini-batches                 steps_per_generation / gradient_accumulation_steps
                                     (optimizer steps per generation batch)
  --micro-batch-size                 per_device_train_batch_size
  --ppo-epochs                       num_iterations
  --max-new-tokens                   max_completion_length
  TEPO --clip-low / --clip-high      epsilon / epsilon_high (defaults 0.2 / 0.28 here)
  ERPO --clip-low/-high, --kl-coef   epsilon (epsilon_high must stay unset), beta (0.04 here)
  --lr, --warmup-steps               learning_rate, warmup_steps
  the advantage A_i                  TRL's: (r - group mean) / (group std + 1e-4), std with Bessel's
                                     correction, as group_advantages in the scripts
  the completion mask                completion_mask (times tool_mask): through the first EOS
  old_logp, old_entropy              this module's pass right after generation (see above)
  ref_logp                           ref_per_token_logps (TRL loads the reference when beta > 0)
  logp, entropy                      _compute_loss's pass (log-probs of logits / temperature)

One optimizer step of tepo.py sees one mini-batch; in TRL it sees one accumulation window:
gradient_accumulation_steps micro-batches on every process. TEPO's token-mean divides by the
valid tokens of that whole window, so each generation batch's windows are counted once, over all
processes (one all-reduce), and each micro-batch's loss is divided by (window tokens /
num_processes): summing over the window's micro-batches and averaging gradients over processes
(what DDP, FSDP and DeepSpeed do) then gives exactly the unsplit token-mean. ERPO's
seq-mean-token-mean is normalised the same way by the window's completions. TRL's own 'dapo'
loss divides by the generation batch's average instead, the same only when
steps_per_generation == gradient_accumulation_steps. This needs steps_per_generation to be a
multiple of gradient_accumulation_steps (checked).

Not supported, and refused rather than silently ignored: TRL options that change the loss
(loss_type other than the default label, importance_sampling_level: use TEPO's ratio_level,
top_entropy_quantile, off_policy_mask_threshold, delta, entropy_coef, use_adaptive_entropy,
use_bias_correction_kl) and vLLM's importance-sampling correction
(vllm_importance_sampling_correction: the scripts' losses have no per-token weight for it; with
vLLM, old_logp is the trainer's recomputation, as in most trainers). Text models only.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import maybe_gather_lm_head_ctx

ROOT = str(Path(__file__).resolve().parents[1])  # tepo.py and erpo.py live at the root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import erpo  # noqa: E402
import tepo  # noqa: E402

# Keys this module adds to TRL's batch dicts
OLD_ENTROPY, ENTROPY_CHANGE = "old_entropy", "entropy_change_c"
WINDOW_TOKENS, WINDOW_SEQS = "window_num_tokens", "window_num_seqs"
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "token_type_ids",
    "mm_token_type_ids",
    "num_images",
)
C_CHUNK = 256  # positions per lm_head call for c: 256 x 152k vocab x 4 B = 156 MB per copy


# =====================================================================================
# Configs
# =====================================================================================
def _refuse_unused_options(cfg: GRPOConfig, loss_type: str) -> None:
    """TRL options that would change TRL's loss do nothing here: refuse them instead."""
    unused = {
        "loss_type": cfg.loss_type != loss_type,
        "importance_sampling_level": cfg.importance_sampling_level != "token",
        "top_entropy_quantile": cfg.top_entropy_quantile != 1.0,
        "off_policy_mask_threshold": cfg.off_policy_mask_threshold is not None,
        "delta": cfg.delta is not None,
        "entropy_coef": cfg.entropy_coef != 0.0,
        "use_adaptive_entropy": cfg.use_adaptive_entropy,
        "use_bias_correction_kl": cfg.use_bias_correction_kl,
        "vllm_importance_sampling_correction": cfg.use_vllm
        and cfg.vllm_importance_sampling_correction,
    }
    bad = [k for k, v in unused.items() if v]
    if bad:
        raise ValueError(
            f"{type(cfg).__name__}: {', '.join(bad)} change TRL's own loss, which "
            f"this trainer replaces; leave them at their defaults "
            f"(loss_type='{loss_type}')"
        )


@dataclass
class TEPOConfig(GRPOConfig):
    """GRPOConfig plus TEPO's flags (tepo.py's, same names and defaults). TRL's beta is not TEPO's
    KL coefficient: it is set from kl_coef and only tells TRL to load the reference."""

    epsilon: float = field(
        default=0.2,
        metadata={
            "help": "TEPO --clip-low: the ratio is clipped below at 1 - "
            "epsilon (our reading: DAPO's; with ratio_level sequence pass GSPO's 3e-4)"
        },
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={
            "help": "TEPO --clip-high: the ratio is clipped above at 1 + epsilon_high "
            "(our reading: DAPO's; with ratio_level sequence pass GSPO's 4e-4)"
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "no dropout: the ratio must be exactly 1 before the first update"},
    )
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "not supported by TEPO's loss (must stay False)"}
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "not used by TEPO's loss, whose k3 KL has no ratio weight (must stay False)"
        },
    )
    ratio_level: str = field(
        default="token",
        metadata={
            "help": "token: per-token ratios (our reading of TEPO); sequence: the geometric-mean "
            "ratio carried to every token",
            "choices": ["sequence", "token"],
        },
    )
    entropy_test: str = field(
        default="predicted",
        metadata={
            "help": "KL mask's 'entropy decreasing': predicted from the sign of c (our reading of "
            "Lemma 3.2) or observed since sampling",
            "choices": ["predicted", "observed"],
        },
    )
    entropy_tol: float | None = field(
        default=None,
        metadata={
            "help": "observed test: the entropy must have fallen by more than this (default 1e-3, "
            "0.05 under bf16: above recomputation noise)"
        },
    )
    kl_coef: float = field(
        default=0.04,
        metadata={"help": "coefficient of the masked KL term (our reading: GRPO's beta)"},
    )

    def __post_init__(self):
        super().__post_init__()
        _refuse_unused_options(self, "dapo")
        need_ref = self.kl_coef > 0  # the masked KL pulls towards the reference model
        level, test, tol = self.ratio_level, self.entropy_test, self.entropy_tol
        checks = {
            f"ratio_level must be 'sequence' or 'token', not {level!r}": level
            in ("sequence", "token"),
            f"entropy_test must be 'predicted' or 'observed', not {test!r}": test
            in ("predicted", "observed"),
            f"kl_coef must be >= 0, not {self.kl_coef}": self.kl_coef >= 0,
            f"epsilon (clip low) must be in [0, 1), not {self.epsilon}": 0 <= self.epsilon < 1,
            f"entropy_tol must be >= 0, not {tol}": tol is None or tol >= 0,
            f"TEPO's KL coefficient is kl_coef; leave beta unset (got beta={self.beta})": self.beta
            in (0.0, self.kl_coef if need_ref else 0.0),
        }
        for msg, ok in checks.items():
            if not ok:
                raise ValueError(msg)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.beta = self.kl_coef if need_ref else 0.0  # TRL loads the reference iff beta != 0
        if self.entropy_tol is None:
            self.entropy_tol = 0.05 if self.bf16 else 1e-3


@dataclass
class ERPOConfig(GRPOConfig):
    """GRPOConfig plus ERPO's flags (erpo.py's, same names and defaults). beta is ERPO's KL
    coefficient; it must be > 0 here, since TRL loads the reference model, which ERPO's progress
    signal needs, only then (erpo.py loads it even at beta 0)."""

    beta: float = field(
        default=0.04, metadata={"help": "KL coefficient (> 0: see the class docstring)"}
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "label only: ERPO's loss is seq-mean-token-mean, TRL's 'grpo' aggregation"
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "no dropout: the ratio must be exactly 1 before the first update"},
    )
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "not supported by ERPO's loss (must stay False)"}
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "not used by ERPO's loss, whose k3 KL has no ratio weight (must stay False)"
        },
    )
    gate_gamma: float = field(
        default=5.0,
        metadata={
            "help": "gamma, sharpness of the entropy gate sigmoid(gamma * group-normalised "
            "entropy) (our reading)"
        },
    )
    num_buckets: int = field(
        default=10,
        metadata={
            "help": "K, relative-position buckets in which the progress signal is normalised "
            "(our reading)"
        },
    )
    synthesis: str = field(
        default="gated",
        metadata={
            "help": "token advantage (our reading): gated A_i * (1 + W) + eta * Psi, or additive "
            "A_i + eta * Psi",
            "choices": ["gated", "additive"],
        },
    )
    eta: float = field(
        default=0.2,
        metadata={"help": "weight of the progress term Psi in the token advantage (our reading)"},
    )

    def __post_init__(self):
        super().__post_init__()
        _refuse_unused_options(self, "grpo")
        beta, high = self.beta, self.epsilon_high
        checks = {
            f"ERPO needs the reference model, which TRL loads only when beta > 0 (got {beta})": beta
            > 0,
            f"ERPO clips at 1 +- epsilon; leave epsilon_high unset, not {high}": high
            in (None, self.epsilon),
            f"epsilon must be in [0, 1), not {self.epsilon}": 0 <= self.epsilon < 1,
            f"gate_gamma must be >= 0, not {self.gate_gamma}": self.gate_gamma >= 0,
            f"num_buckets must be at least 1, not {self.num_buckets}": self.num_buckets >= 1,
            f"eta must be >= 0, not {self.eta}": self.eta >= 0,
            f"synthesis must be 'gated' or 'additive', not {self.synthesis!r}": self.synthesis
            in ("gated", "additive"),
        }
        for msg, ok in checks.items():
            if not ok:
                raise ValueError(msg)


# =====================================================================================
# Pure helpers
# =====================================================================================
def loss_mask(inputs: dict) -> torch.Tensor:
    """[B, T] the tokens a loss sees: TRL's completion_mask, times tool_mask in multi-turn runs."""
    m = inputs["completion_mask"]
    return m * inputs["tool_mask"] if inputs.get("tool_mask") is not None else m


def window_sizes(masks: list[torch.Tensor], accumulation_steps: int) -> torch.Tensor:
    """Valid tokens and completions of each optimizer step of one process's generation batch.

    masks: one [b, T] loss mask per micro-batch, in training order (TRL's _buffered_inputs);
    micro-batches [k * A, (k + 1) * A) form optimizer step k, A = accumulation_steps.
    Returns [len(masks) // A, 2] float: (tokens, completions) per step.

    >>> m = [torch.ones(2, 3), torch.tensor([[1, 0, 0], [1, 1, 0]]), torch.zeros(2, 3),
    ...      torch.ones(2, 3)]
    >>> window_sizes(m, 2).tolist()
    [[9.0, 4.0], [6.0, 4.0]]
    """
    if len(masks) % accumulation_steps:
        raise ValueError(
            f"{len(masks)} micro-batches per generation batch do not split into "
            f"optimizer steps of {accumulation_steps}: make steps_per_generation a "
            f"multiple of gradient_accumulation_steps"
        )
    per_mb = torch.stack(
        [torch.stack([m.sum().float(), m.new_tensor(len(m), dtype=torch.float32)]) for m in masks]
    )  # [n, 2]
    return per_mb.view(-1, accumulation_steps, 2).sum(1)


def entropy_change_at(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    chunk: int = C_CHUNK,
) -> torch.Tensor:
    """[N, H] hidden states at N valid positions, [N] the ids sampled there -> tepo.entropy_change_c
    of logits / temperature [N], the output layer run `chunk` positions at a time (the [N, V]
    logits are never built whole). The weight is gathered as TRL's own fused head does (FSDP2
    DTensor, DeepSpeed ZeRO-3)."""
    weight, bias = lm_head.weight, lm_head.bias
    if type(weight).__name__ == "DTensor":  # FSDP2 shards: the whole head, as TRL's fused head does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    with maybe_gather_lm_head_ctx(weight, bias):
        parts = []
        for i in range(0, len(hidden), chunk):
            logits = F.linear(hidden[i : i + chunk].to(weight.dtype), weight, bias).float()
            parts.append(tepo.entropy_change_c(logits / temperature, ids[i : i + chunk]))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


# =====================================================================================
# Shared trainer machinery
# =====================================================================================
class _ScriptObjectiveTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is one of this project's objectives. A subclass sets `prefix` and
    `config_class`, implements `objective_loss`, and may extend `_generate_and_score_completions`
    and `needs_entropy_change`."""

    prefix = "objective"
    config_class = GRPOConfig

    @property
    def needs_entropy_change(self) -> bool:
        """Whether the sampling-policy pass also computes TEPO's c (tepo.entropy_change_c)."""
        return False

    def __init__(self, *args, **kwargs):
        cfg = args[2] if len(args) > 2 else kwargs.get("args")
        if not isinstance(cfg, self.config_class):
            raise TypeError(f"{type(self).__name__} needs args={self.config_class.__name__}(...)")
        super().__init__(*args, **kwargs)
        spg, ga = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        if spg % ga:
            raise ValueError(
                f"steps_per_generation ({spg}) must be a multiple of "
                f"gradient_accumulation_steps ({ga}): here an optimizer step may not "
                f"span two generation batches"
            )
        self._counted = None  # the buffered generation batch whose windows were last counted
        if self.needs_entropy_change:
            cfg = self._policy().config.get_text_config()
            scaled = [
                k
                for k in (
                    "final_logit_softcapping",
                    "logit_scale",
                    "output_multiplier",
                    "lm_head_multiplier",
                    "logits_scaling",
                )
                if getattr(cfg, k, None) not in (None, 1.0)
            ]
            if scaled:
                raise NotImplementedError(
                    f"entropy_test='predicted' computes c from lm_head(h) / temperature; this "
                    f"model also applies {', '.join(scaled)} (use entropy_test='observed')"
                )

    def _policy(self):
        """The transformers model under any PEFT wrapper (the one TRL gave its fused head)."""
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    # --- the sampling policy's pass -------------------------------------------------
    @contextmanager
    def _capture_entropy_change(self, logits_to_keep: int, out: list):
        """While active, every forward of the policy's backbone also computes tepo.entropy_change_c
        at the valid completion positions of its micro-batch and appends it ([b, T]) to `out`: c
        comes from the same hidden states as TRL's log-probs, at no extra forward."""
        policy = self._policy()
        lm_head, T, K = policy.get_output_embeddings(), self.temperature, logits_to_keep

        def hook(module, args, kwargs, output):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            valid = kwargs["attention_mask"][:, -K:].bool()  # [b, K]; TRL's labels: -100 elsewhere
            h = output.last_hidden_state[:, -K - 1 : -1][valid]  # position t predicts token t + 1
            c = entropy_change_at(h, ids[:, -K:][valid], lm_head, T)  # [N]
            out.append(c.new_zeros(valid.shape).masked_scatter(valid, c))

        handle = policy.base_model.register_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _sampling_policy_pass(self, out: dict, with_c: bool):
        """No-grad log-probs and entropies [B, T] (and c, or None) of the completions under the
        policy that has just sampled them, through TRL's own log-prob code: while the weights have
        not moved they equal the training pass's (ratio 1), up to batch-composition rounding."""
        if any(k in out for k in MULTIMODAL_KEYS):
            raise NotImplementedError(f"{type(self).__name__} supports text models only")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        K = out["completion_ids"].size(1)
        a = self.args
        bs = a.per_device_train_batch_size if self.model.training else a.per_device_eval_batch_size
        cs = []
        capture = self._capture_entropy_change(K, cs) if with_c else nullcontext()
        no_ckpt = disable_gradient_checkpointing(self.model, a.gradient_checkpointing_kwargs)
        with torch.no_grad(), no_ckpt, capture:
            logp, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention_mask, K, batch_size=bs, compute_entropy=True
            )
        return logp, entropy, (torch.cat(cs) if with_c else None)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        # TRL computes old log-probs only in some settings; the scripts always need them
        logp, entropy, c = self._sampling_policy_pass(out, with_c=self.needs_entropy_change)
        out["old_per_token_logps"], out[OLD_ENTROPY] = logp, entropy
        if c is not None:
            out[ENTROPY_CHANGE] = c
        return out

    # --- optimizer-step sizes ------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        buffered = self._buffered_inputs
        if self.model.training and buffered is not None and buffered is not self._counted:
            # a new generation batch: count the tokens and completions of each of its optimizer
            # steps over all processes, and give every micro-batch its process's share
            ga = self.args.gradient_accumulation_steps
            sizes = window_sizes([loss_mask(b) for b in buffered], ga)
            sizes = self.accelerator.reduce(sizes.to(self.accelerator.device), reduction="sum")
            sizes = (sizes.clamp(min=1) / self.accelerator.num_processes).tolist()
            for i, b in enumerate(buffered):
                b[WINDOW_TOKENS], b[WINDOW_SEQS] = sizes[i // ga]
            self._counted = buffered
        return inputs

    def _window_size(self, inputs: dict, key: str, mask: torch.Tensor) -> float:
        """This process's share of the optimizer step's tokens (WINDOW_TOKENS) or completions
        (WINDOW_SEQS). Evaluation has no accumulation: the batch itself, over all processes."""
        if key in inputs:
            return inputs[key]
        local = mask.sum() if key == WINDOW_TOKENS else torch.tensor(len(mask), device=mask.device)
        total = self.accelerator.reduce(local.float(), reduction="sum").clamp(min=1)
        return (total / self.accelerator.num_processes).item()

    # --- the loss ------------------------------------------------------------------
    def objective_loss(self, logp: torch.Tensor, entropy: torch.Tensor, inputs: dict):
        """(loss, stats dict of floats) from the training pass's logp and entropy [b, T]."""
        raise NotImplementedError

    def _compute_loss(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        loss, stats = self.objective_loss(logp, entropy, inputs)
        mode = "train" if self.model.training else "eval"
        self._log_stats(stats, mode)
        m = loss_mask(inputs).bool()
        sums = self.accelerator.reduce(
            torch.stack([torch.where(m, entropy.detach(), 0.0).sum(), m.sum().float()]),
            reduction="sum",
        )
        self._metrics[mode]["entropy"].append((sums[0] / sums[1].clamp(min=1)).item())
        if self.aux_loss_enabled:  # MoE load balancing, scaled for accumulation as TRL does
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
        return loss

    def _log_stats(self, stats: dict, mode: str) -> None:
        """Per-micro-batch statistics into TRL's metrics (averaged over each logging interval by
        GRPOTrainer.log), under '<prefix>/'; over processes: the mean, the min of *_min and the
        max of *_max."""
        keys = sorted(stats)
        local = torch.tensor([float(stats[k]) for k in keys], device=self.accelerator.device)
        every = self.accelerator.gather(local).view(-1, len(keys))
        for j, k in enumerate(keys):
            col = every[:, j]
            v = col.min() if k.endswith("_min") else col.max() if k.endswith("_max") else col.mean()
            self._metrics[mode][f"{self.prefix}/{k}"].append(v.item())


# =====================================================================================
# TEPO
# =====================================================================================
class TEPOTrainer(_ScriptObjectiveTrainer):
    """GRPOTrainer with TEPO's loss (tepo.py, our reading): per-token ratios (ratio_level
    sequence: the geometric-mean ratio), clipped epsilon / epsilon_high, token-mean over each step,
    plus kl_coef * M * k3 on the KL mask M = [A > 0] [entropy falls] m. Use with TEPOConfig.

    Logged each step (TRL's logs, 'tepo/' prefix): mask_frac, masked_entropy, other_entropy,
    masked_kl, kl, clip_frac, seq_ratio_min, seq_ratio_max (tepo.tepo_stats), and 'entropy'."""

    prefix, config_class = "tepo", TEPOConfig

    @property
    def needs_entropy_change(self) -> bool:
        return self.args.entropy_test == "predicted"

    def objective_loss(self, logp, entropy, inputs):
        a = self.args
        mask, old, A = loss_mask(inputs), inputs["old_per_token_logps"], inputs["advantages"]
        if a.entropy_test == "observed":  # below the entropy at sampling by more than the tolerance
            falls = entropy.detach() < inputs[OLD_ENTROPY] - a.entropy_tol
        else:  # predicted (our reading of Lemma 3.2): the update lowers the entropy where c > 0
            falls = inputs[ENTROPY_CHANGE] > 0
        terms = dict(
            old_logp=old,
            ref_logp=inputs.get("ref_per_token_logps"),  # None at kl_coef 0: TRL loads no ref
            advantages=A,
            mask=mask,
            M=tepo.kl_mask(A, falls, mask),
            clip_low=self.epsilon_low,
            clip_high=self.epsilon_high,
            ratio_level=a.ratio_level,
        )
        num_tokens = self._window_size(inputs, WINDOW_TOKENS, mask)
        loss = tepo.tepo_loss(logp=logp, **terms, kl_coef=a.kl_coef, num_tokens=num_tokens)
        stats = tepo.tepo_stats(logp=logp.detach(), **terms, entropy=inputs[OLD_ENTROPY])
        return loss, stats


# =====================================================================================
# ERPO
# =====================================================================================
class ERPOTrainer(_ScriptObjectiveTrainer):
    """GRPOTrainer with ERPO's loss (erpo.py, our reading): GRPO's clipped token ratio and k3 KL,
    seq-mean-token-mean, with one advantage per token A_it (entropy gate, bucket-normalised
    progress signal, result-anchored synthesis), computed once per generation batch over whole
    groups (gathered from every process). Use with ERPOConfig.

    Logged (TRL's logs, 'erpo/' prefix): clip_frac, kl (erpo.erpo_stats, each step) and gate_mean,
    gate_high_frac, psi_abs_mean, sign_flip_frac, adv_token_std (erpo.token_advantage_stats, each
    generation batch)."""

    prefix, config_class = "erpo", ERPOConfig

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, T] on each process -> [b * processes, T_max], in TRL's process order (the order its
        rewards are grouped in), padded with 0 on the right."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(x, dim=1, pad_index=0))

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        A_it, stats = self.token_advantages(out, mode)
        out["advantages"] = A_it  # [b, T] in place of TRL's [b]
        for k, v in stats.items():  # already over every process
            self._metrics[mode][f"{self.prefix}/{k}"].append(v)
        return out

    def token_advantages(self, out: dict, mode: str = "train"):
        """ERPO's A_it [b, T] for this process's rows of a scored generation batch, and
        erpo.token_advantage_stats over the whole batch. The statistics need whole groups, which
        may straddle processes: gather every process's rows, compute, keep this process's."""
        a = self.args
        G = self.num_generations if mode == "train" else self.num_generations_eval
        b, T = out["completion_ids"].shape
        m = self._gather_rows(loss_mask(out))
        old, H, ref = (
            self._gather_rows(out[k])
            for k in ("old_per_token_logps", OLD_ENTROPY, "ref_per_token_logps")
        )
        A = self.accelerator.gather(out["advantages"])  # [b * processes]
        W = erpo.entropy_gate(H, m, G, a.gate_gamma)  # (i) the entropy gate
        s = erpo.progress_signal(old, ref, m)  # (ii) the progress signal, bucket-normalised
        s_tilde = erpo.bucket_normalize(s, m, G, a.num_buckets)
        A_it, psi = erpo.token_advantages(A, W, s_tilde, m, a.eta, a.synthesis)  # (iii)
        stats = erpo.token_advantage_stats(A_it, A, W, psi, m)
        rows = slice(self.accelerator.process_index * b, (self.accelerator.process_index + 1) * b)
        return A_it[rows, :T].contiguous(), stats

    def objective_loss(self, logp, entropy, inputs):
        mask, old = loss_mask(inputs), inputs["old_per_token_logps"]
        ref, A_it = inputs["ref_per_token_logps"], inputs["advantages"]
        num_seqs = self._window_size(inputs, WINDOW_SEQS, mask)
        loss = erpo.erpo_loss(
            logp,
            old,
            ref,
            A_it,
            mask,
            self.epsilon_low,
            self.epsilon_low,
            self.beta,
            num_seqs=num_seqs,
        )
        stats = erpo.erpo_stats(
            logp.detach(), old, ref, A_it, mask, self.epsilon_low, self.epsilon_low
        )
        return loss, stats
