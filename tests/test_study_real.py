"""tools/study_real.py: the real-model plan's rules (docs/study/PLAN-real.md) by hand, and the whole
tool on a made-up study folder."""

import doctest
import json

from tools import study_real as sr

# recorded.csv's header
RECORDED = "config,seed,step,greedy_acc,sampled_acc,cut_off_share,greedy_cut_off_share,source\n"


def _recorded(docs, configs, greedy=(0.1, 0.1, 0.2, 0.2, 0.3)):
    """recorded.csv with seeds 1-3 of each config: held-out greedy `greedy` at steps 0-60."""
    docs.mkdir()
    (docs / "recorded.csv").write_text(
        RECORDED
        + "".join(
            f"{c},{s},{k},{g},0.05,,,recorded\n"
            for c in configs
            for s in (1, 2, 3)
            for k, g in zip((0, 15, 30, 45, 60), greedy)
        )
    )


def _run(folder, name, greedy, cut=0.5, finished=True, diag=None):
    """A fake finished run: held-out greedy at steps 0/15/30/45/60, truncated_frac `cut` at every
    training step."""
    d = folder / "runs" / name
    d.mkdir(parents=True)
    rows = []
    for step in range(61):
        r = {"step": step}
        if step:
            r.update(truncated_frac=cut, **(diag or {}))
        if step % 15 == 0:
            r.update(
                {
                    "eval/greedy_acc": greedy[step // 15],
                    "eval/sampled_acc": 0.05,
                    "eval/greedy_truncated_frac": 0.25,
                }
            )
        rows.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (d / "summary.json").write_text(json.dumps({"steps": 60}))


def test_doctests():
    assert doctest.testmod(sr).failed == 0


def test_the_rules_by_hand():
    grpo = 43 / 384  # the recorded GRPO gains 24, 13 and 6 of 128
    # 2 of 3, mean 0.036 < 0.056
    assert sr.classify({1: 7 / 128, 2: 7 / 128, 3: 0.0}, grpo) == "weak"
    assert sr.classify({1: 7 / 128, 2: 8 / 128, 3: 7 / 128}, grpo) == "learns"  # mean 0.057
    assert sr.classify({1: 6 / 128, 2: 6 / 128, 3: 0.5}, grpo) == "fails"  # 6/128 < 0.05 twice
    assert (
        sr.attribution({"tepo-seq-ppo": "learns", "tepo-seq-mean": "weak"}, None, None)
        == "the clip"
    )
    assert (
        sr.attribution({"tepo-seq-ppo": "fails", "tepo-seq-mean": "learns"}, False, None)
        == "the aggregation, not through the cut-off completions"
    )
    assert sr.attribution({"tepo-seq-ppo": "fails"}, None, None) == "pending"
    assert sr.attribution(
        {"tepo-seq-ppo": "fails", "tepo-seq-mean": "fails"}, None, "learns"
    ).startswith("neither alone; grpo-no-kl learns")
    finals = {"tepo": [0.5] * 5, "tepo-seq-mean": [0.48] * 5}
    assert sr.adoption("learns", True, finals).startswith("adopted")  # -0.02 is allowed
    finals["tepo-seq-mean"] = [0.47] * 5
    assert sr.adoption("learns", True, finals).startswith("not adopted")
    assert sr.adoption("learns", False, finals) == "not adopted: tepo-seq-mean learns, not stable"
    assert sr.adoption("learns", True, {}).startswith("pending")


def test_the_tool_on_a_study_folder(tmp_path, capsys):
    out, docs = tmp_path / "study", tmp_path / "docs"
    docs.mkdir()
    (docs / "recorded.csv").write_text(
        RECORDED
        + "".join(
            f"{c},{s},{k},{g},0.05,{cut if k == 60 else ''},,recorded\n"
            for c, gs, cut in (
                ("grpo", (0.1, 0.1, 0.2, 0.2, 0.3), 0.4),
                ("tepo", (0.1, 0.1, 0.1, 0.1, 0.1), 0.9),
            )
            for s in (1, 2, 3)
            for k, g in zip((0, 15, 30, 45, 60), gs)
        )
    )
    diag = {"grad_mass_cut_token_mean": 0.6, "grad_mass_cut_seq_mean": 0.4, "clip_frac_cut": 0.1}
    for s in (1, 2, 3):  # the aggregation learns and cuts off less; the clip does not learn
        _run(out, f"tepo-seq-mean-s{s}", (0.1, 0.15, 0.2, 0.25, 0.3), cut=0.5, diag=diag)
        _run(out, f"tepo-seq-ppo-s{s}", (0.1, 0.1, 0.1, 0.1, 0.12))
    _run(out, "dapo-s1", (0.1,) * 5, finished=False)
    assert sr.main(["--out", str(out), "--docs", str(docs), "--tiny", str(tmp_path / "none")]) == 0
    text = (docs / "summary.md").read_text()
    assert "| tepo-seq-mean | +0.200, +0.200, +0.200 | +0.200 | learns | yes |" in text
    assert "| tepo-seq-ppo | +0.020, +0.020, +0.020 | +0.020 | fails | yes |" in text
    assert "**Attribution**: the aggregation." in text
    assert "pending (the tiny task's confirmation seeds 6-10)" in text
    assert "| tepo-seq-mean | 1 | 50.0% | - | 60.0% / 40.0% | - / - | 10.0% / - |" in text
    assert "Unfinished, left out: dapo-s1." in text
    rows = (docs / "results.csv").read_text().splitlines()
    assert rows[0] == (
        "config,seed,preset,step,greedy_acc,sampled_acc,cut_off_share,greedy_cut_off_share,source"
    )
    assert (
        "tepo-seq-mean,1,micro-batch 16,60,0.3,0.05,0.5,0.25,run" in rows
    )  # cut off over steps 51-60
    assert (
        "tepo-seq-mean,1,micro-batch 16,0,0.1,0.05,,0.25,run" in rows
    )  # no training step before step 0
    assert "grpo,1,micro-batch 16,60,0.3,0.05,0.4,,recorded" in rows
    assert (docs / "steps.csv").read_text().count("\n") == 1 + 6 * 60


def test_missing_recorded_runs_is_one_line(tmp_path, one_line_error):
    assert "recorded runs are missing" in one_line_error(sr.main, ["--docs", str(tmp_path)])


def test_landed_runs_outlive_their_run_folder(tmp_path):
    """A session's run folder is gone in the next session: the runs it landed in results.csv and
    steps.csv stay, a rerun finished in --out replaces its landed copy, and a recorded row keeps
    its own source."""
    docs, first, second = tmp_path / "docs", tmp_path / "first", tmp_path / "second"
    docs.mkdir()
    (docs / "recorded.csv").write_text(
        RECORDED
        + "".join(
            f"grpo,{s},{k},{0.1 + k / 300},,,,recorded\n"
            for s in (1, 2, 3)
            for k in (0, 15, 30, 45, 60)
        )
        + "tepo-seq-mean,2,0,0.1,,,,console\ntepo-seq-mean,2,60,0.1,,,,console\n"
    )
    _run(first, "tepo-seq-mean-s1", (0.1, 0.2, 0.3, 0.3, 0.4), cut=0.2)
    _run(first, "dapo-s1", (0.1, 0.1, 0.1, 0.1, 0.2))
    args = ["--docs", str(docs), "--tiny", str(tmp_path / "none")]
    assert sr.main(["--out", str(first), *args]) == 0
    landed = {f: (docs / f).read_text() for f in ("results.csv", "steps.csv", "summary.md")}
    assert sr.main(["--out", str(tmp_path / "empty"), *args]) == 0  # the next session
    assert {f: (docs / f).read_text() for f in landed} == landed
    assert "tepo-seq-mean,2,micro-batch 16,60,0.1,,,,console" in landed["results.csv"]
    _run(second, "dapo-s1", (0.1, 0.1, 0.1, 0.1, 0.3), cut=0.7)  # rerun: it replaces
    assert sr.main(["--out", str(second), *args]) == 0
    rows = (docs / "results.csv").read_text().splitlines()
    new, old = "dapo,1,micro-batch 16,60,0.3,0.05,0.7,0.25,run", "dapo,1,micro-batch 16,60,0.2"
    assert new in rows and not any(r.startswith(old) for r in rows)
    assert "tepo-seq-mean,1,micro-batch 16,60,0.4,0.05,0.2,0.25,run" in rows  # landed, kept
    assert (docs / "steps.csv").read_text().count("\n") == 1 + 2 * 60


def test_one_seed_configs_and_a_moot_cut_off_rule(tmp_path):
    """erpo and sapo run once, outside the rules: the verdict table says whether seed 1 gained
    0.05, never "pending"; the cut-off rule is only needed if tepo-seq-mean learns."""
    out, docs = tmp_path / "study", tmp_path / "docs"
    docs.mkdir()
    (docs / "recorded.csv").write_text(
        RECORDED
        + "".join(
            f"grpo,{s},{k},{0.1 + k / 300},,,,recorded\n"
            for s in (1, 2, 3)
            for k in (0, 15, 30, 45, 60)
        )
    )
    for s in (1, 2, 3):  # neither learns; tepo's cut-off shares are not there at all
        _run(out, f"tepo-seq-mean-s{s}", (0.1, 0.1, 0.1, 0.1, 0.1))
        _run(out, f"tepo-seq-ppo-s{s}", (0.1, 0.1, 0.1, 0.1, 0.1))
    _run(out, "erpo-s1", (0.1, 0.1, 0.1, 0.1, 0.14))
    _run(out, "sapo-s1", (0.1, 0.1, 0.2, 0.2, 0.2))
    assert sr.main(["--out", str(out), "--docs", str(docs), "--tiny", str(tmp_path / "no")]) == 0
    text = (docs / "summary.md").read_text()
    assert "| erpo | +0.040 | +0.040 | seed 1 only, no rule: does not gain 0.05 | - |" in text
    assert "| sapo | +0.100 | +0.100 | seed 1 only, no rule: gains 0.05 | - |" in text
    assert "at least 2 of 3 seeds: not needed: tepo-seq-mean fails.)" in text
    assert "pending" not in text.replace("grpo-no-kl pending", "")


def test_the_length_plan_on_a_study_folder(tmp_path):
    """PLAN-length.md's rules on made-up runs: tepo-len learns and is stable (adopted; seed 1
    gains 0.26 >= 0.10), erpo-len fails, sapo-len is weak; TEPO's claim against grpo-len and
    dapo."""
    out, docs = tmp_path / "study", tmp_path / "docs"
    docs.mkdir()
    (docs / "recorded.csv").write_text(
        RECORDED
        + "".join(
            f"{c},{s},{k},{g},0.05,{cut if k == 60 else ''},,recorded\n"
            for c, gs, cut in (
                ("grpo", (0.1, 0.1, 0.2, 0.2, 0.3), 0.4),
                ("tepo", (0.1, 0.1, 0.1, 0.1, 0.1), 0.9),
            )
            for s in (1, 2, 3)
            for k, g in zip((0, 15, 30, 45, 60), gs)
        )
    )
    _run(out, "erpo-s1", (0.1, 0.1, 0.1, 0.1, 0.12), cut=0.9)
    _run(out, "sapo-s1", (0.1, 0.1, 0.1, 0.1, 0.05), cut=0.9)
    for s in (1, 2, 3):
        _run(out, f"tepo-len-s{s}", (0.1, 0.4, 0.4, 0.4, 0.36), cut=0.1)  # T reached at 15
        _run(out, f"grpo-len-s{s}", (0.1, 0.2, 0.2, 0.35, 0.4), cut=0.2)  # T = 0.36 at 60
        _run(out, f"dapo-s{s}", (0.1, 0.4, 0.4, 0.4, 0.4), cut=0.0)
        _run(out, f"erpo-len-s{s}", (0.1, 0.1, 0.1, 0.1, 0.13), cut=0.8)
        gains = (0.16, 0.17, 0.1)[s - 1]  # 2 of 3 gain 0.05 but the mean 0.043 < 0.056: weak
        _run(out, f"sapo-len-s{s}", (0.1, 0.1, 0.1, 0.1, gains), diag={"explained_var": 0.25})
    assert sr.main(["--out", str(out), "--docs", str(docs), "--tiny", str(tmp_path / "no")]) == 0
    text = (docs / "summary.md").read_text()
    assert "## The length term (docs/study/PLAN-length.md)" in text
    assert "| tepo | 1 | +0.000 / +0.260 | 90% / 10% |" in text
    assert "| erpo | 2 | - / +0.030 | - / 80% |" in text  # erpo ran seed 1 only
    assert "tepo-len learns where tepo failed: the length signal is what tepo lacked here" in text
    assert "erpo-len fails too: the length signal alone does not make erpo learn here." in text
    assert "sapo-len is weak: the length signal moves sapo" in text
    assert (
        "**Adoption**: adopted: the cpu preset turns on --overlong-cache 16 for every script"
        in text
    )
    assert "gains +0.260: it meets the plan's 0.10" in text
    # grpo-len's mean step-60 accuracy 0.4 -> T = 0.36: tepo-len 15 steps, grpo-len 60: 0.25
    assert "against grpo-len: supported: at most 0.6 x grpo-len's steps in 3 of 3 seeds" in text
    assert "seed 1: tepo-len 15, grpo-len 60 steps: 0.25" in text
    # dapo: T = 0.36 reached at step 15, as tepo-len: a ratio of 1 -> refuted
    assert "against dapo: refuted: at least dapo's steps in 3 of 3 seeds (T = 0.360)" in text
    assert "seed 1: +0.25 over steps 1-15, +0.25 over 46-60" in text
    assert "explained_var" in (docs / "steps.csv").read_text().splitlines()[0]


def test_tiny_finals_read_runs_made_under_a_config_s_old_name(tmp_path):
    """tools/study.py names today's default `tepo`; runs made when it was `tepo-seq-gspo` count."""
    for name, seeds in (("tepo-seq-gspo", range(6, 9)), ("tepo", range(9, 11))):
        for s in seeds:
            d = tmp_path / "runs" / f"{name}-s{s}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"last_eval": {"eval/sampled_acc": s / 10}}))
    finals = sr.tiny_finals(tmp_path)
    assert finals["tepo"] == [0.6, 0.7, 0.8, 0.9, 1.0]
    assert finals["tepo-seq-mean"] == []


def test_the_clip_plan_on_a_study_folder(tmp_path):
    """PLAN-clip-real.md's rule on made-up runs: tepo-len-token beats tepo-len (paired gains
    +0.10 in every seed, learns, stable); tepo-len-ppo is worse (-0.06 in every seed). The decision
    is then one reading for both beds; the clip fractions stand beside the gains."""
    out, docs = tmp_path / "study", tmp_path / "docs"
    _recorded(docs, ("grpo",))
    clip = {"clip_frac": 0.1, "clip_frac_mini1": 0.0, "clip_frac_mini2": 0.2}
    for s in (1, 2, 3):
        _run(out, f"tepo-len-s{s}", (0.1, 0.1, 0.2, 0.2, 0.2), diag={"clip_frac": 0.15})
        _run(out, f"tepo-len-token-s{s}", (0.1, 0.2, 0.3, 0.3, 0.3), diag=clip)
        _run(out, f"tepo-len-ppo-s{s}", (0.1, 0.1, 0.14, 0.14, 0.14), diag=clip)
    assert sr.main(["--out", str(out), "--docs", str(docs), "--tiny", str(tmp_path / "no")]) == 0
    text = (docs / "summary.md").read_text()
    assert "## TEPO's clip on the real model (docs/study/PLAN-clip-real.md)" in text
    # the baseline's second mini-batch: 2 x its clip_frac (its runs predate clip_frac_mini2)
    assert "| tepo-len | 1 | +0.100 | - | 15.0% / 15.0% | 30.0% / 30.0% | 50% |" in text
    assert "| tepo-len-token | 2 | +0.200 | +0.100 | 10.0% / 10.0% | 20.0% / 20.0% | 50% |" in text
    assert "- **tepo-len-token** against tepo-len: better (mean difference +0.100)." in text
    assert "- **tepo-len-ppo** against tepo-len: worse (mean difference -0.060)." in text
    assert "**Decision**: tepo-len-token is better: one reading for both beds" in text
    assert "clip_frac_mini2" in (docs / "steps.csv").read_text().splitlines()[0]


def test_the_clip_decision_by_hand():
    def evals(sampled):
        return {(c, s): {60: {"sampled": sampled[c]}} for c in sr.CLIP for s in (1, 2, 3)}

    same = {c: 0.2 for c in sr.CLIP}
    pending = {"tepo-len-ppo": (None, 0.0), "tepo-len-token": ("better", 0.1)}
    assert sr.clip_decision(evals(same), pending) == "pending"
    neither = {c: ("no difference these seeds can see", 0.02) for c in sr.CLIP}
    assert sr.clip_decision(evals(same), neither).startswith("neither candidate is better")
    # both better: the larger mean difference decides; within 0.01, the sampled accuracy
    both = {"tepo-len-ppo": ("better", 0.12), "tepo-len-token": ("better", 0.06)}
    assert sr.clip_decision(evals(same), both).startswith("tepo-len-ppo is better: the scale")
    close = {"tepo-len-ppo": ("better", 0.065), "tepo-len-token": ("better", 0.06)}
    sampled = {"tepo-len-ppo": 0.2, "tepo-len-token": 0.3}
    assert sr.clip_decision(evals(sampled), close).startswith("tepo-len-token is better")


def test_runs_at_a_new_preset_keep_apart_from_the_first(tmp_path):
    """A run's preset comes from its saved flags: runs at today's preset land beside the first
    preset's with the same config and seed, in their own rows and their own section, with their
    whole-run peak memory; the plans' rules read only the first preset's runs."""
    out, docs = tmp_path / "study", tmp_path / "docs"
    _recorded(docs, ("grpo", "dapo"))
    for s in (1, 2, 3):
        _run(out, f"tepo-len-token-s{s}", (0.1, 0.2, 0.2, 0.3, 0.2), diag={"peak_rss_mb": 2000.0})
    _run(out, "dapo-s1", (0.1, 0.1, 0.1, 0.1, 0.12), diag={"peak_rss_mb": 2861.0})
    for d in (out / "runs").iterdir():
        (d / "args.json").write_text('{"micro_batch_size": 2, "gen_batch_size": 64}')
    assert sr.PRESET == "micro-batch 2"
    assert sr.main(["--out", str(out), "--docs", str(docs), "--tiny", str(tmp_path / "no")]) == 0
    rows = (docs / "results.csv").read_text().splitlines()
    assert "dapo,1,micro-batch 16,60,0.3,0.05,,,recorded" in rows
    assert "dapo,1,micro-batch 2,60,0.12,0.05,0.5,0.25,run" in rows
    text = (docs / "summary.md").read_text()
    # the plans' table: dapo seed 1 at the first preset only
    assert "| dapo | 1 | 0.100, 0.100, 0.200, 0.200, 0.300 | +0.200 |" in text
    section = text[text.index("## The cpu preset at micro-batch 2") :]
    # 2861 MB of 2^20 bytes: 3.00 GB of 10^9
    assert "| dapo | 1 | 0.100, 0.100, 0.100, 0.100, 0.120 | +0.020 | +0.200 | 3.00 |" in section
    assert (
        "| tepo-len-token | 3 | 0.100, 0.200, 0.200, 0.300, 0.200 | +0.100 | - | 2.10 |" in section
    )
    # gains 0.1 in 3 of 3, mean 0.1 >= GRPO's mean 0.2 / 2: learns
    assert "tepo-len-token at micro-batch 2, PLAN-real's rule: learns." in section
    assert "preset" in (docs / "steps.csv").read_text().splitlines()[0]
