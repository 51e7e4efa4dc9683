"""--overlong-cache in grpo.py, tepo.py, erpo.py and sapo.py: DAPO's soft overlong punishment
added to the 0/1 outcome at DAPO's weight, r = correct + 0.5 * penalty (reward shaping, no part of
any objective; docs/study/PLAN-length.md). On in the cpu preset since that plan's adoption, off
in the others, where the reward is the outcome bit for bit; the same text in the four scripts,
and the same helper as dapo.py's."""

import importlib
import inspect

import pytest
import torch

import runner

FOUR = ("grpo", "tepo", "erpo", "sapo")


def _mod(name):
    return importlib.import_module(name)


def test_the_penalty_by_hand_at_the_ramps_edges():
    import grpo

    # L_max = 64, L_cache = 16 (the cpu preset's cap, dapo's cpu cache): the ramp is (48, 64]
    lengths = torch.tensor([1, 47, 48, 49, 56, 63, 64])
    pen = grpo.overlong_penalty(lengths, 64, 16)
    assert pen.tolist() == pytest.approx([0, 0, 0, -1 / 16, -8 / 16, -15 / 16, -1], abs=1e-7)


@pytest.mark.parametrize("name", FOUR)
def test_reward_is_the_outcome_plus_half_the_penalty(name):
    mod = _mod(name)
    texts = ["\\boxed{4}", "\\boxed{5}", "\\boxed{4}", "\\boxed{5}", "\\boxed{4}", "no box"]
    lengths = torch.tensor([10, 10, 56, 56, 64, 64])
    args = mod.Args(max_new_tokens=64, overlong_cache=16)
    r, c, p = mod.reward_fn(texts, ["4"] * 6, lengths, args)
    # correct:  1, 0, 1,    0,    1,   0;  penalty: 0, 0, -0.5, -0.5, -1, -1
    assert c.tolist() == [1, 0, 1, 0, 1, 0] and p.tolist() == [1, 1, 1, 1, 1, 0]
    assert r.tolist() == pytest.approx([1, 0, 0.75, -0.25, 0.5, -0.5], abs=1e-7)


@pytest.mark.parametrize("name", FOUR)
@pytest.mark.parametrize("cache", [None, 0])
def test_off_is_the_outcome_bit_for_bit(name, cache):
    mod = _mod(name)
    texts = ["\\boxed{4}", "\\boxed{5}", "no box", "\\boxed{4}"]
    r, c, _ = mod.reward_fn(
        texts,
        ["4"] * 4,
        torch.tensor([64, 64, 3, 40]),
        mod.Args(max_new_tokens=64, overlong_cache=cache),
    )
    assert torch.equal(r, c) and r.data_ptr() != c.data_ptr()  # a copy, as before the flag


def test_a_group_all_wrong_learns_from_length_alone():
    """With the length term a group with no right answer still has a signal (shorter is
    better); without it the group is all equal: A = 0, no NaN."""
    import grpo

    texts, lengths = ["\\boxed{5}"] * 4, torch.tensor([20, 52, 60, 64])
    for cache, moves in ((16, True), (0, False)):
        args = grpo.Args(max_new_tokens=64, overlong_cache=cache)
        A = grpo.group_advantages(grpo.reward_fn(texts, ["4"] * 4, lengths, args)[0], 4)
        assert torch.isfinite(A).all() and (A.abs().sum() > 0) == moves
        if moves:
            assert A[0] > A[1] > A[2] > A[3]


def test_one_text_in_the_four_scripts_and_dapos_helper():
    import dapo

    for fn in ("overlong_penalty", "reward_fn"):
        texts = {name: inspect.getsource(getattr(_mod(name), fn)) for name in FOUR}
        assert len(set(texts.values())) == 1, f"{fn} differs between {FOUR}: keep it one text"
    grpo = _mod("grpo")
    assert inspect.getsource(dapo.overlong_penalty) == inspect.getsource(grpo.overlong_penalty)


@pytest.mark.parametrize("name", FOUR)
def test_the_cpu_preset_turns_it_on_the_others_leave_it_off(name):
    """PLAN-length.md's adoption: tepo-len learned and was stable on the real model."""
    mod = _mod(name)
    got = {
        p: mod.resolve_args(mod.Args(preset=p, device="cpu", run_name="x")).overlong_cache
        for p in ("tiny", "cpu", "gpu")
    }
    assert got == {"tiny": 0, "cpu": 16, "gpu": 0}


@pytest.mark.parametrize("name", [*FOUR, "dapo"])
def test_a_preset_cache_that_does_not_fit_the_cap_shrinks(name, capsys):
    mod = _mod(name)
    args = mod.resolve_args(mod.Args(preset="cpu", device="cpu", run_name="x", max_new_tokens=12))
    assert args.overlong_cache == 2  # a fifth of the cap, as dapo.py did alone before
    assert "--overlong-cache set to 2" in capsys.readouterr().out


def test_dapos_presets_keep_their_own():
    import dapo

    got = {
        p: dapo.resolve_args(dapo.Args(preset=p, device="cpu", run_name="x")).overlong_cache
        for p in ("tiny", "cpu", "gpu")
    }
    assert got == {"tiny": 8, "cpu": 16, "gpu": 600}


@pytest.mark.parametrize("value", ["40", "-1"])
def test_a_cache_outside_the_cap_is_one_line(value, one_line_error, tmp_path):
    import tepo

    last = one_line_error(tepo.main, ["--overlong-cache", value, "--output-dir", str(tmp_path)])
    assert "--overlong-cache" in last and "--max-new-tokens 40" in last


@pytest.mark.parametrize("name", FOUR)
def test_a_run_with_the_length_term(name, tmp_path):
    """One step of each script on the tiny model with the term on: the logged reward is the
    accuracy plus half the mean penalty, so below it wherever a completion reaches the ramp."""
    mod = _mod(name)
    small = [
        "--prompts-per-step",
        "8" if name == "sapo" else "2",
        "--group-size",
        "1" if name == "sapo" else "4",
        "--micro-batch-size",
        "8",
        "--num-mini-batches",
        "2",
        "--eval-dataset",
        "none",
        "--sample-every",
        "100",
        "--tensorboard",
        "false",
    ]
    mod.main(
        [
            "--steps",
            "1",
            "--overlong-cache",
            "30",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "len",
            *small,
        ]
    )
    row = runner.read_metrics(tmp_path / "len")[-1]
    assert row["reward"] <= row["accuracy"]
    assert (row["reward"] < row["accuracy"]) == (row["completion_len_max"] > 10)
