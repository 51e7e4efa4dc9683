"""The studies' diagnostics (tools/diagnostics.py), through wrappers around the script's functions:
hand values for each figure, and a diagnosed run logs the same training numbers as a plain one."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import runner
import grpo
import tepo
from tools import diagnostics


def _group(lengths, right, cut):
    """One group: completions of these lengths, right or not, cut off or not; GRPO's advantage."""
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    correct = torch.tensor(right, dtype=torch.float32)
    A = grpo.group_advantages(correct, len(lengths))
    return {"mask": mask, "truncated": torch.tensor(cut)}, correct, A


def test_gradient_mass_on_cut_off_completions_by_hand():
    # the group: one right answer of 25 tokens, five wrong ones cut off at 64, two of 30.
    # A_right = (1 - 1/8) / sqrt(1/8) = 2.4749, A_wrong = -(1/8) / sqrt(1/8) = -0.35355 (eps aside)
    batch, correct, A = _group(
        [25] + [64] * 5 + [30] * 2, [1] + [0] * 7, [False] + [True] * 5 + [False] * 2
    )
    f = diagnostics.rollout_figures(batch, correct, A)
    a_r, a_w = 0.875 / math.sqrt(1 / 8), 0.125 / math.sqrt(1 / 8)
    # each token weighs 1 / N_tokens
    token = 5 * 64 * a_w / (25 * a_r + 5 * 64 * a_w + 2 * 30 * a_w)
    seq = 5 * a_w / (a_r + 7 * a_w)  # each completion weighs 1 / N_seq, its tokens 1 / (L_i N_seq)
    assert f["grad_mass_cut_token_mean"] == pytest.approx(token, rel=1e-4)  # 0.577
    assert f["grad_mass_cut_seq_mean"] == pytest.approx(seq, rel=1e-4)  # 0.357
    assert round(token, 2) == 0.58 and round(seq, 2) == 0.36
    assert f["right_cut_off_frac"] == 0.0
    # per-token advantages: |A_it| summed over the completion's tokens
    A_it = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    batch2 = {
        "mask": torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
        "truncated": torch.tensor([True, False]),
    }
    f = diagnostics.rollout_figures(batch2, torch.tensor([1.0, 1.0]), A_it)
    assert f["grad_mass_cut_token_mean"] == pytest.approx(2 / 4)  # the padded 0 counts nothing
    assert f["grad_mass_cut_seq_mean"] == pytest.approx(2 / (2 + 1))
    assert f["right_cut_off_frac"] == 0.5


def test_equal_group_gives_no_gradient_mass_and_no_nan():
    batch, correct, A = _group([3, 5], [0, 0], [False, True])
    f = diagnostics.rollout_figures(batch, correct, A)
    # nothing to share out, no right answer: no figure, no NaN
    assert A.abs().sum() == 0 and f == {}


def test_clip_split_by_sign_and_by_cut_off_by_hand():
    # GRPO's token ratio, eps 0.2. Row 0 (A > 0, cut off): ratios e^0.3 (clipped), e^0.1, e^0.25
    # (clipped). Row 1 (A < 0, ended, 2 tokens + padding): e^-0.3 (clipped), e^0; a huge padding
    logp = torch.tensor([[0.3, 0.1, 0.25], [-0.3, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    A = torch.tensor([1.0, -1.0])
    run = SimpleNamespace(algo="grpo", args=grpo.resolve_args(grpo.Args()))
    ctx = {"batch": {"mask": mask, "truncated": torch.tensor([True, False])}, "advantages": A}
    f = diagnostics.update_figures(run, ctx, torch.arange(2), logp, torch.zeros(2, 3))
    assert f["clip_frac_pos_adv"] == pytest.approx(2 / 3)
    assert f["clip_frac_cut"] == pytest.approx(2 / 3)
    assert f["clip_frac_neg_adv"] == pytest.approx(1 / 2)
    assert f["clip_frac_ended"] == pytest.approx(1 / 2)
    assert f["clip_frac_mini1"] == pytest.approx(3 / 5)  # 3 of all 5 valid tokens, either sign
    f = diagnostics.update_figures(run, ctx, torch.arange(2), logp, torch.zeros(2, 3), mini=2)
    assert f["clip_frac_mini2"] == pytest.approx(3 / 5) and "clip_frac_mini1" not in f
    # TEPO with --ratio-level sequence clips the carried sequence ratio: row 0's geometric mean
    # e^0.2167 > 1 + 4e-4 clips all 3 tokens; row 1's e^-0.15 < 1 - 3e-4 clips both
    seq = tepo.Args(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4)
    run = SimpleNamespace(algo="tepo", args=tepo.resolve_args(seq))
    f = diagnostics.update_figures(run, ctx, torch.arange(2), logp, torch.zeros(2, 3))
    assert f["clip_frac_pos_adv"] == 1.0 and f["clip_frac_neg_adv"] == 1.0
    # rows selects a micro-batch out of the rollout batch
    f = diagnostics.update_figures(run, ctx, torch.tensor([1]), logp[1:], torch.zeros(1, 3))
    # no A > 0 or cut-off token: no figure
    assert set(f) == {"clip_frac_neg_adv", "clip_frac_ended", "clip_frac_mini1"}


def _rows(run_dir):
    return [
        {k: v for k, v in r.items() if not (k.startswith("time") or k == "tokens_per_s")}
        for r in runner.read_metrics(run_dir)
    ]


def test_a_diagnosed_run_learns_exactly_what_a_plain_run_learns(tmp_path):
    # tools/diagnostics.py adds figures to metrics.jsonl and changes no training number
    flags = [
        "--steps",
        "2",
        "--prompts-per-step",
        "4",
        "--eval-n",
        "16",
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--tensorboard",
        "false",
        "--output-dir",
        str(tmp_path),
    ]
    tepo.main([*flags, "--run-name", "plain"])
    wrapped = ("reward_fn", "group_advantages", "token_logps", "tepo_loss")
    originals = [getattr(tepo, f) for f in wrapped] + [runner.Run.end_step]
    diagnostics.main(["tepo.py", *flags, "--run-name", "diagnosed"])
    # the originals are back afterwards
    assert [getattr(tepo, f) for f in wrapped] + [runner.Run.end_step] == originals
    plain, diagnosed = _rows(tmp_path / "plain"), _rows(tmp_path / "diagnosed")
    added = {
        "right_cut_off_frac",
        "grad_mass_cut_token_mean",
        "grad_mass_cut_seq_mean",
        "clip_frac_pos_adv",
        "clip_frac_neg_adv",
        "clip_frac_cut",
        "clip_frac_ended",
        "clip_frac_mini1",
        "clip_frac_mini2",
        "kl_pos_adv",
        "kl_neg_adv",
        "kl_off_mask",
        "kl_first_quarter",
        "kl_last_quarter",
        "kl_token_max",
        "peak_rss_mb",
    }
    for p, d in zip(plain, diagnosed, strict=True):
        assert {k: v for k, v in d.items() if k in p} == p  # every plain figure, bit for bit
        assert set(d) - set(p) <= added
    assert added - {"right_cut_off_frac", "clip_frac_cut", "clip_frac_ended"} <= set(diagnosed[1])
    # the first mini-batch is on-policy (ratio 1: nothing clips); the second is one step off
    assert diagnosed[1]["clip_frac_mini1"] == 0.0
    peaks = [r["peak_rss_mb"] for r in diagnosed[1:]]  # the peak so far, each step: never falls
    assert 50 < peaks[0] <= peaks[-1] < 20000
    assert json.loads((tmp_path / "diagnosed" / "args.json").read_text())["run_name"] == "diagnosed"


def test_launcher_refuses_what_is_not_a_script(capsys):
    with pytest.raises(SystemExit) as e:
        diagnostics.main(["nothing.py"])
    assert e.value.code == 2 and "no training script" in capsys.readouterr().err
