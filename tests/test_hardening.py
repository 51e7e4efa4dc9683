"""Hardening: never train or save a broken model, never lose or overwrite a run, one-line errors
before any model loads, a run that cannot learn says so, and real-GPU hazards checked on CPU."""

import dataclasses
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import common
import runner

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["grpo", "dapo", "tepo"]
SMALL = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--micro-batch-size",
    "8",
    "--num-mini-batches",
    "2",
    "--sample-every",
    "100",
    "--tensorboard",
    "false",
    "--eval-dataset",
    "none",
]


def _error_of(mod, capsys, argv):
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


def _strict_rows(run_dir):
    """metrics.jsonl must be strict JSON: no bare NaN or Infinity."""

    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=reject) for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------- 1. never train or save a broken model
@pytest.mark.parametrize("name", SCRIPTS)
def test_group_of_one_is_refused(name, tmp_path, capsys):
    mod = importlib.import_module(name)
    err = _error_of(
        mod,
        capsys,
        [
            "--group-size",
            "1",
            "--prompts-per-step",
            "2",
            "--num-mini-batches",
            "1",
            "--steps",
            "1",
            "--eval-dataset",
            "none",
            "--output-dir",
            str(tmp_path),
        ],
    )
    assert err.startswith("error: --group-size must be at least 2")


def test_optimizer_step_skips_non_finite_gradients():
    w = torch.nn.Parameter(torch.ones(3))
    hyper = type("A", (), dict(optim="adamw", lr=0.1, weight_decay=0.0, warmup_steps=0))
    opt, sched = common.make_optimizer([w], hyper)
    (w * torch.tensor([1.0, float("nan"), 1.0])).sum().backward()
    st = common.optimizer_step(opt, sched, [w], 1.0, loss=1.0)
    assert st["skipped_updates"] == 1 and torch.equal(w.data, torch.ones(3)) and w.grad is None
    (w * 2).sum().backward()
    # a non-finite loss alone also skips
    st = common.optimizer_step(opt, sched, [w], 1.0, loss=float("inf"))
    assert st["skipped_updates"] == 1 and torch.equal(w.data, torch.ones(3))
    (w * 2).sum().backward()
    assert common.optimizer_step(opt, sched, [w], 1.0, loss=2.0)["skipped_updates"] == 0
    assert not torch.equal(w.data, torch.ones(3))


def test_nan_loss_skips_every_update_and_logs_strict_json(tmp_path, monkeypatch, capsys):
    import grpo

    real = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    grpo.main(["--steps", "1", "--output-dir", str(tmp_path), "--run-name", "nan", *SMALL])
    row = _strict_rows(tmp_path / "nan")[-1]
    assert row["skipped_updates"] == 2 and row["loss"] is None  # NaN is logged as null
    assert "update skipped" in capsys.readouterr().err
    w0 = load_file(str(runner.TINY_MODEL_DIR / "model.safetensors"))
    w1 = load_file(str(runner.find_checkpoint(tmp_path / "nan") / "model.safetensors"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_non_finite_weights_are_never_saved(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    run = type("R", (), {})()  # just enough of a Run for Run.save
    run.models, run.tokenizer, run.stateful, run.dir = {"": model}, tok, {}, tmp_path
    next(model.parameters()).data[0] = float("nan")
    with pytest.raises(common.UserError, match="not finite"):
        runner.Run.save(run, 3)
    assert not list(tmp_path.glob("checkpoint-*"))


def test_a_policy_that_blows_up_is_one_line_naming_the_last_checkpoint(tmp_path, capsys):
    """--lr 1e30: the first update leaves finite weights (saved), too large for softmax, so the next
    rollout's sampling met inf / nan probabilities: a RuntimeError from torch.multinomial, in a
    traceback. Now one line: the cause, the step, the last checkpoint saved."""
    import grpo

    argv = ["--steps", "4", "--save-every", "1", "--lr", "1e30", "--output-dir", str(tmp_path)]
    err = _error_of(grpo, capsys, [*argv, "--run-name", "b", *SMALL])
    last = runner.find_checkpoint(tmp_path / "b")
    step = runner.load_trainer_state(last)["step"]
    assert err.startswith(f"error: the policy blew up at step {step + 1}: "), err
    assert "next-token probabilities are inf or nan" in err and "--lr 1e+30" in err, err
    assert f"the last checkpoint saved, whole, is {last} (step {step})" in err, err
    # any other RuntimeError is no blow-up, and keeps its traceback
    with pytest.raises(RuntimeError, match="probability"):
        with runner.user_errors():
            raise RuntimeError("probability of something else")


def test_logger_keeps_small_floats_and_writes_null_for_nan(tmp_path):
    log = runner.RunLogger(tmp_path, tensorboard=False)
    log.log(1, {"lr": 5e-7, "x": float("nan"), "y": float("inf"), "n": 3, "z": 0.123456789})
    log.close()
    row = _strict_rows(tmp_path)[0]
    assert row["lr"] == 5e-7
    assert row["x"] is None
    assert row["y"] is None
    assert row["n"] == 3
    assert row["z"] == 0.123457


# ---------------------------------------------------------------- 2. never lose or overwrite a run
def test_existing_run_folder_is_refused_and_resume_writes_where_pointed(tmp_path, capsys):
    import grpo

    base = ["--steps", "2", "--save-every", "1", "--output-dir", str(tmp_path), *SMALL]
    grpo.main([*base, "--run-name", "b"])
    before = (tmp_path / "b" / "metrics.jsonl").read_text()
    err = _error_of(grpo, capsys, [*base, "--run-name", "b"])
    assert "already exists" in err and "--resume" in err
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == before  # untouched
    shutil.copytree(tmp_path / "b", tmp_path / "copy")
    grpo.main(["--resume", str(tmp_path / "copy"), "--steps", "3"])
    assert runner.find_checkpoint(tmp_path / "copy").name == "checkpoint-3"
    # the original is untouched
    assert runner.find_checkpoint(tmp_path / "b").name == "checkpoint-2"
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == before
    assert [r["step"] for r in runner.read_metrics(tmp_path / "copy")] == [1, 2, 3]
    # a failed resume leaves the run's arguments alone
    args_before = (tmp_path / "b" / "args.json").read_text()
    err = _error_of(
        grpo, capsys, ["--resume", str(tmp_path / "b"), "--steps", "3", "--device", "nope"]
    )
    assert "unknown --device" in err and (tmp_path / "b" / "args.json").read_text() == args_before


def test_resume_after_a_crash_cuts_metrics_back_to_the_checkpoint(tmp_path):
    import grpo

    grpo.main(
        [
            "--steps",
            "3",
            "--save-every",
            "2",
            "--keep-checkpoints",
            "3",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "c",
            *SMALL,
        ]
    )
    run = tmp_path / "c"
    shutil.rmtree(run / "checkpoint-3")  # as if killed after logging step 3, before saving it
    (run / "latest").write_text("checkpoint-2\n")
    (run / ".tmp-checkpoint-3").mkdir()  # and a half-written folder left behind
    grpo.main(["--resume", str(run), "--steps", "4"])
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2, 3, 4]
    assert not list(run.glob(".tmp-checkpoint-*"))


def test_only_the_newest_checkpoint_keeps_the_optimizer(tmp_path):
    import grpo

    grpo.main(
        [
            "--steps",
            "3",
            "--save-every",
            "1",
            "--keep-checkpoints",
            "2",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "o",
            *SMALL,
        ]
    )
    ckpts = sorted((tmp_path / "o").glob("checkpoint-*"))
    assert [p.name for p in ckpts] == ["checkpoint-2", "checkpoint-3"]
    assert not (ckpts[0] / "optimizer.pt").exists() and (ckpts[1] / "optimizer.pt").is_file()
    # resuming from the older one still works, with a warning, from fresh AdamW moments
    grpo.main(["--resume", str(ckpts[0]), "--steps", "3"])


def test_resave_of_a_step_never_leaves_latest_dangling(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    runner.save_checkpoint(tmp_path, 1, {"": model}, tok, {"step": 1})
    runner.save_checkpoint(tmp_path, 2, {"": model}, tok, {"step": 2})
    # a kill between moving the old checkpoint-2 aside and renaming the new one into place:
    (tmp_path / "checkpoint-2").rename(tmp_path / ".trash-checkpoint-2")
    # latest's target is gone: the newest whole one
    assert runner.find_checkpoint(tmp_path).name == "checkpoint-1"
    runner.clean_leftovers(tmp_path)  # on resume: the old folder is put back
    assert runner.find_checkpoint(tmp_path).name == "checkpoint-2"
    runner.save_checkpoint(tmp_path, 2, {"": model}, tok, {"step": 22})  # a normal re-save
    assert runner.load_trainer_state(runner.find_checkpoint(tmp_path))["step"] == 22
    assert not list(tmp_path.glob(".trash-*")) and not list(tmp_path.glob(".tmp-*"))


def test_sigterm_saves_and_exits(tmp_path):
    run = tmp_path / "term"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "grpo.py"),
            "--steps",
            "200",
            "--save-every",
            "1000",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "term",
            *SMALL,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline and not (
        (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out[-2000:]
    assert "Traceback" not in out and not (run / ".lock").exists()
    state = runner.load_trainer_state(runner.find_checkpoint(run))
    assert state["step"] == runner.read_metrics(run)[-1]["step"] + ("row" in state) >= 1


# ------------------------------------------------------ 3. one-line errors, before any model loads
BAD_FLAGS = [
    (["--lr", "-1"], "--lr must be > 0"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--num-mini-batches", "0"], "--num-mini-batches must be at least 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be at least 1"),
    (["--save-every", "0"], "--save-every must be at least 1"),
    (["--sample-every", "0"], "--sample-every must be"),
    (["--steps", "-1"], "--steps must be at least 1"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
]


@pytest.mark.parametrize("name", [*SCRIPTS, "erpo", "sapo"])
def test_every_flag_is_checked_before_any_model_loads(name, tmp_path, capsys, monkeypatch):
    mod = importlib.import_module(name)
    monkeypatch.setattr(mod, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for flags, message in BAD_FLAGS:
        assert message in _error_of(mod, capsys, [*flags, "--output-dir", str(tmp_path)]), flags
    with pytest.raises(SystemExit) as e:  # unknown flags: the usage line and exit 2
        mod.main(["--no-such-flag", "3", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage:" in err
    assert "--no-such-flag" in err
    assert "Traceback" not in err


def _float_flags(mod) -> list[str]:
    return [f.name for f in dataclasses.fields(mod.Args) if "float" in str(f.type)]


@pytest.mark.parametrize("name", [*SCRIPTS, "erpo", "sapo"])
def test_every_float_flag_must_be_finite_before_any_model_loads(
    name, tmp_path, capsys, monkeypatch
):
    """inf passes `> 0` and nan fails no `< 0`: without their own check, --lr inf, --weight-decay
    nan or --lora-alpha nan got past the range checks and failed later, mostly in a traceback."""
    mod = importlib.import_module(name)
    monkeypatch.setattr(mod, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    floats = _float_flags(mod)
    assert {"lr", "weight_decay", "lora_alpha", "temperature", "max_grad_norm"} <= {*floats}
    for field in floats:
        flag = "--" + field.replace("_", "-")
        for value in ("inf", "nan", "-inf"):
            err = _error_of(mod, capsys, [f"{flag}={value}", "--output-dir", str(tmp_path)])
            assert err == f"error: {flag} must be a finite number, not {float(value)}", err
    err = _error_of(mod, capsys, ["--weight-decay", "-1", "--output-dir", str(tmp_path)])
    assert "--weight-decay must be >= 0" in err  # the range rules are kept


def test_bad_inputs_give_one_line_errors(tmp_path, capsys, monkeypatch):
    import grpo

    out = ["--output-dir", str(tmp_path)]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot write the run folder" in _error_of(
        grpo, capsys, ["--output-dir", str(blocker / "runs")]
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in _error_of(grpo, capsys, ["--dataset", str(empty), *out])
    (tmp_path / "empty_model").mkdir()
    assert "has no config.json" in _error_of(
        grpo, capsys, ["--model", str(tmp_path / "empty_model"), *out]
    )
    # the dataset is checked before the models load
    monkeypatch.setattr(grpo, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    assert "no column 'problem'" in _error_of(grpo, capsys, ["--dataset", str(bad), *out])


def _script(tmp_path, argv, **env):
    """grpo.py run as a user runs it, with `env` (None: unset) over this environment and a
    Hugging Face home of its own: (exit code, stderr lines, seconds)."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": None, **env}
    env = {k: v for k, v in env.items() if v is not None}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "grpo.py"), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr.strip().splitlines(), time.time() - start


@pytest.mark.parametrize(
    "env, says",
    [
        (
            {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": None},
            "it is not in the local Hugging Face cache ({cache}), and downloads are off "
            "(HF_HUB_OFFLINE set); give a local model folder, or unset HF_HUB_OFFLINE",
        ),
        (
            {
                "HF_HUB_OFFLINE": "0",
                "TRANSFORMERS_OFFLINE": None,
                "HF_ENDPOINT": "http://hub.invalid",
            },
            "the Hugging Face hub cannot be reached (http://hub.invalid: ",
        ),
    ],
    ids=["offline", "hub-out-of-reach"],
)
def test_a_hub_name_that_cannot_load_is_one_line_at_once(tmp_path, env, says):
    """Out of the hub's reach a hub name retried each file for ~25 s (12 lines of retries, 51 s
    in all) before its one line; offline (HF_HUB_OFFLINE) the line did not say why."""
    code, err, seconds = _script(
        tmp_path, ["--model", "Qwen2.5-Math-1.5B", "--output-dir", "runs"], **env
    )
    says = says.format(cache=tmp_path / "hf" / "hub")
    assert code == 2 and len(err) == 1, err  # no retries above it
    assert err[0].startswith("error: cannot load model 'Qwen/Qwen2.5-Math-1.5B': ")
    assert says in err[0], err
    assert seconds < 30  # the imports; the hub's retries took 51 s
    assert not list((tmp_path / "runs").iterdir())  # and no run folder is left behind


def test_a_hub_model_in_the_cache_loads_offline_and_out_of_reach_says_how(tmp_path):
    """The check of a hub name passes a model in the local cache on to from_pretrained when
    offline; out of the hub's reach it names the cached copy and how to load it."""
    repo = tmp_path / "hf" / "hub" / "models--local--tiny"
    shutil.copytree(runner.TINY_MODEL_DIR, repo / "snapshots" / "0")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0")
    argv = ["--model", "local/tiny", "--preset", "tiny", "--steps", "1", *SMALL]
    code, err, _ = _script(tmp_path, [*argv, "--output-dir", "runs"], HF_HUB_OFFLINE="1")
    assert code == 0, err[-5:]
    code, err, _ = _script(
        tmp_path,
        [*argv, "--output-dir", "runs2"],
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE=None,
        HF_ENDPOINT="http://hub.invalid",
    )
    assert code == 2 and len(err) == 1, err
    assert "the Hugging Face hub cannot be reached (http://hub.invalid: " in err[0]
    assert err[0].endswith("; set HF_HUB_OFFLINE=1 to load it from the local cache"), err


def test_a_local_folder_never_asks_the_hub(monkeypatch):
    """Only a hub name is checked against the hub; a hub within reach is left to from_pretrained."""
    from huggingface_hub import constants

    asked = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(runner, "hub_unreachable", lambda: asked.append(1))
    runner.check_model_folder(str(runner.TINY_MODEL_DIR))
    assert asked == []
    runner.check_model_folder("Qwen/Qwen2.5-Math-1.5B")  # online, in reach: passed on
    assert asked == [1]


def test_truncated_weights_on_resume_are_a_clear_error(tmp_path, capsys):
    import grpo

    grpo.main(["--steps", "1", "--output-dir", str(tmp_path), "--run-name", "t", *SMALL])
    weights = runner.find_checkpoint(tmp_path / "t") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = _error_of(grpo, capsys, ["--resume", str(tmp_path / "t"), "--steps", "2"])
    assert err.startswith(
        f"error: cannot resume from {weights.parent}: the weights file {weights} is cut short"
    )
    assert err.endswith("no earlier checkpoint of this run is intact")  # the only one


def test_null_answers_are_dropped_and_counted(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [
        {"problem": "1+1", "answer": "2"},
        {"problem": "2+2", "answer": None},
        {"problem": "3+3", "answer": "6"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = common.load_problems(str(data))
    assert [r["answer"] for r in got] == ["2", "6"]
    assert "dropped 1 of 3" in capsys.readouterr().out


# -------------------------------------------------------------- 4. a run that cannot learn says so
def test_a_silent_run_warns_with_the_likely_cause(tmp_path, monkeypatch, capsys):
    import grpo

    monkeypatch.setattr(
        grpo, "reward_fn", lambda texts, answers, lengths, args: (torch.zeros(len(texts)),) * 3
    )
    grpo.main(["--steps", "5", "--output-dir", str(tmp_path), "--run-name", "s", *SMALL])
    err = capsys.readouterr().err
    assert err.count("almost no learning signal") == 1
    assert "--answer-extraction" in err
    assert "--template" in err


def test_grades_that_run_out_of_time_are_counted_in_each_step(tmp_path, monkeypatch, capsys):
    """Every 8th grade gets a completion math-verify takes a minute to parse, under a 1 s bound:
    the step's metrics count the training grades, eval/grader_timeouts the held-out ones, once
    each. The slow parse is made so (a marker math-verify's extraction sleeps on, inside its own
    time bound): deeply nested brackets, used before, parsed within the bound on a quiet machine
    once in a while."""
    import math_verify.parser as mv_parser

    import grpo

    real_grade, real_extract, calls = common.grade, mv_parser.extract_target_from_pred, []

    def slow_on_the_marker(pred, *args, **kwargs):
        if "SLOWMARK" in pred:
            time.sleep(60)  # math-verify's time bound (SIGALRM) must cut this short
        return real_extract(pred, *args, **kwargs)

    def slow_every_8th(text, gold, timeout_s=5, extraction="boxed"):
        calls.append(text)
        if len(calls) % 8 == 1:
            text = "\\boxed{SLOWMARK + 1}"
        return real_grade(text, gold, 1, extraction)

    monkeypatch.setattr(mv_parser, "extract_target_from_pred", slow_on_the_marker)
    monkeypatch.setattr(common, "grade", slow_every_8th)
    argv = ["--steps", "2", "--output-dir", str(tmp_path), "--run-name", "t", *SMALL]
    grpo.main([*argv, "--eval-dataset", "tiny", "--eval-n", "4", "--eval-every", "2"])
    rows = runner.read_metrics(tmp_path / "t")  # grades: 8 at step 0, then 16 and 16 + 8
    assert [r.get("grader_timeouts") for r in rows] == [None, 2, 2]
    assert [r.get("eval/grader_timeouts") for r in rows] == [1, None, 1]
    assert capsys.readouterr().err.count("ran out of --grader-timeout (5 s)") == 1


def test_answer_extraction_option_grades_free_text_answers():
    import grpo

    texts = ["The answer is: 42", "#### 42", "so it is \\boxed{42}", "The answer is: 41"]
    lengths = torch.tensor([len(t) for t in texts])
    boxed = grpo.reward_fn(texts, ["42"] * 4, lengths, grpo.Args())[1]
    free = grpo.reward_fn(texts, ["42"] * 4, lengths, grpo.Args(answer_extraction="math_verify"))[1]
    assert boxed.tolist() == [0, 0, 1, 0] and free.tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize(
    "text,gold,right",
    [
        (
            "\\boxed{(2, 2)} and \\boxed{(6, 2)}",
            "(2, 2), (6, 2)",
            True,
        ),  # an answer in several boxes
        ("\\boxed{3} and \\boxed{5}", "3, 5", True),
        ("\\boxed{5} ... no, \\boxed{7}", "7", True),  # a self-correction counts the last box
        ("\\boxed{7} ... no, \\boxed{5}", "7", False),
        ("\\boxed{5} ... no, \\boxed{7}", "5", False),
        ("\\boxed{3} and \\boxed{5}", "5, 3", True),  # sets compare unordered in math-verify
    ],
)
def test_several_boxes_rule(text, gold, right):
    assert common.grade(text, gold).correct is right


def test_dapo_overlong_cache_must_fit_the_completion_cap(tmp_path, capsys):
    import dapo

    err = _error_of(
        dapo,
        capsys,
        ["--max-new-tokens", "8", "--overlong-cache", "8", "--output-dir", str(tmp_path)],
    )
    assert "--overlong-cache 8 must be" in err
    # preset's 8 > 6
    args = dapo.resolve_args(dapo.Args(max_new_tokens=6, run_name="x", device="cpu"))
    assert 1 <= args.overlong_cache < 6 and "--overlong-cache set to" in capsys.readouterr().out


def test_periodic_eval_uses_the_same_problems_whatever_the_seed():
    import grpo

    tok, ctx = grpo.load_tokenizer("tiny", False)
    a = grpo.load_data(grpo.resolve_args(grpo.Args(seed=1, run_name="x", device="cpu")), tok, ctx)[
        1
    ]
    b = grpo.load_data(grpo.resolve_args(grpo.Args(seed=7, run_name="x", device="cpu")), tok, ctx)[
        1
    ]
    assert [r["problem"] for r in a] == [r["problem"] for r in b] and len(a) == 256


@pytest.mark.parametrize("name", SCRIPTS)
def test_dapo_math_keeps_a_held_out_evaluation(name, tmp_path):
    mod = importlib.import_module(name)
    args = mod.resolve_args(
        mod.Args(model=str(tmp_path), dataset="dapo-math", run_name="x", device="cpu", preset="gpu")
    )
    assert args.eval_dataset == "math"


# --------------------------------------------------------------------- 5. real-GPU hazards, on CPU
@pytest.fixture()
def skewed_tiny(tmp_path):
    """The tiny model with a generation_config.json that would reshape sampling if merged."""
    path = tmp_path / "skewed"
    shutil.copytree(runner.TINY_MODEL_DIR, path, ignore=shutil.ignore_patterns("build.py"))
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(
        do_sample=True, temperature=0.6, top_k=20, top_p=0.9, repetition_penalty=1.5, min_p=0.2
    )
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return path


def test_rollouts_and_greedy_follow_the_script_not_the_model_config(skewed_tiny):
    import grpo

    args = grpo.resolve_args(grpo.Args(run_name="x", device="cpu"))
    tok, _ = grpo.load_tokenizer("tiny", False)
    prompts = [
        common.build_prompt(tok, r["problem"], "tiny")
        for r in common.load_problems("tiny", "test", limit=4)
    ]
    outs = {}
    for name in ("tiny", str(skewed_tiny)):
        model = grpo.load_model(name, torch.device("cpu"), args, trainable=False)
        eos = grpo.eos_token_ids(model, tok)
        torch.manual_seed(0)
        sampled = grpo.generate_rollouts(model, tok, prompts, 4, args, eos, torch.device("cpu"))[
            "completion_ids"
        ]
        rows = [{"prompt": p, "answer": "0"} for p in prompts]
        seen = []
        real_grade = common.grade
        common.grade = lambda text, *a, **k: seen.append(text) or real_grade(text, *a, **k)
        try:
            torch.manual_seed(1)
            grpo.evaluate(model, tok, rows, args, eos, torch.device("cpu"))
        finally:
            common.grade = real_grade
        outs[name] = (sampled, seen[: len(rows)])  # the greedy texts come first
    (s0, g0), (s1, g1) = outs.values()
    assert torch.equal(s0, s1), (
        "the model's generation_config.json changed how rollouts were sampled"
    )
    assert g0 == g1


def test_reference_and_policy_agree_exactly_at_step_0_under_bf16_autocast():
    import grpo

    args = grpo.resolve_args(grpo.Args(run_name="x", device="cpu", bf16=True, micro_batch_size=5))
    tok, _ = grpo.load_tokenizer("tiny", False)
    policy = grpo.load_model("tiny", torch.device("cpu"), args, trainable=True)
    ref = grpo.load_model("tiny", torch.device("cpu"), args, trainable=False)
    prompts = [
        common.build_prompt(tok, r["problem"], "tiny")
        for r in common.load_problems("tiny", "test", limit=3)
    ]
    torch.manual_seed(0)
    batch = grpo.generate_rollouts(
        policy, tok, prompts, 4, args, grpo.eos_token_ids(policy, tok), torch.device("cpu")
    )
    old_logp = grpo.batch_logps(policy, batch, args).logp
    ref_logp = grpo.reference_logps(policy, ref, batch, args).logp
    kl = grpo.k3_kl(ref_logp, old_logp)
    assert kl.abs().max().item() == 0.0
    fp32 = grpo.batch_logps(
        policy, batch, grpo.resolve_args(grpo.Args(run_name="x", device="cpu", bf16=False))
    ).logp
    assert not torch.equal(fp32, old_logp)  # bf16 autocast really was on


def test_chunked_log_probs_match_full_logits_in_value_and_gradient():
    """The output layer runs over chunks of valid positions: values and gradients are those of the
    plain computation from full [B, T, V] logits."""
    import grpo

    args = grpo.resolve_args(grpo.Args(run_name="x", device="cpu", temperature=0.7))
    tok, _ = grpo.load_tokenizer("tiny", False)
    model = grpo.load_model("tiny", torch.device("cpu"), args, trainable=True)
    prompts = [
        common.build_prompt(tok, r["problem"], "tiny")
        for r in common.load_problems("tiny", "test", limit=3)
    ]
    torch.manual_seed(0)
    batch = grpo.generate_rollouts(
        model, tok, prompts, 2, args, grpo.eos_token_ids(model, tok), torch.device("cpu")
    )
    model.train()
    rows, mask = torch.arange(6), batch["mask"].bool()
    assert (~mask).any()  # padding is exercised

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["mask"]], 1)
    T = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0)
    ).logits
    logits = logits[:, -T - 1 : -1].float() / 0.7
    full = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    full_ent = torch.distributions.Categorical(logits=logits).entropy()
    full_loss = torch.where(mask, full, 0.0).sum()
    full_grads = torch.autograd.grad(full_loss, list(model.parameters()))

    for chunk in (7, 10_000):
        logp, ent = grpo.token_logps(model, batch, rows, args, with_entropy=True, chunk=chunk)
        assert torch.allclose(logp[mask], full[mask], atol=1e-5) and torch.all(logp[~mask] == 0)
        assert torch.allclose(ent[mask], full_ent[mask], atol=1e-4) and not ent.requires_grad
        assert torch.all(ent[~mask] == 0)
        grads = torch.autograd.grad(logp.sum(), list(model.parameters()))
        # fp32 noise
        assert all((a - b).norm() <= 1e-4 * b.norm() + 1e-7 for a, b in zip(grads, full_grads))
    assert grpo.token_logps(model, batch, rows, args).entropy is None  # only when asked
    # the no-grad pass over the whole batch (sampled_logits, micro-batch by micro-batch, in
    # chunks): the same values, each in its row and column
    for micro in (1, 4, 64):
        args.micro_batch_size = micro
        logp, ent = grpo.batch_logps(model, batch, args)
        assert torch.allclose(logp[mask], full[mask].detach(), atol=1e-5)
        assert torch.allclose(ent[mask], full_ent[mask].detach(), atol=1e-4)
        assert torch.all(logp[~mask] == 0) and torch.all(ent[~mask] == 0)
        assert not logp.requires_grad


def test_a_model_that_transforms_its_logits_is_refused(tmp_path):
    """Gemma 2 soft-caps its logits after the output layer; the chunked log-prob pass reads
    lm_head(hidden) and would train on other logits than generate samples from."""
    import grpo
    from transformers import Gemma2Config, Gemma2ForCausalLM

    kw = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    for cap, ok in ((0.5, False), (None, True)):
        torch.manual_seed(0)
        Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=cap, **kw)).save_pretrained(
            tmp_path / str(cap)
        )

        def load():
            return grpo.load_model(
                str(tmp_path / str(cap)), torch.device("cpu"), grpo.Args(), False
            )

        if ok:
            assert load() is not None
        else:
            with pytest.raises(common.UserError, match="transforms its logits"):
                load()


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_padding_overflow_cannot_become_nan(agg):
    import dapo
    import grpo

    fn = getattr(grpo, agg, None) or getattr(dapo, agg)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    l = torch.tensor([[1.0, 2.0, math.inf], [3.0, math.nan, -math.inf]])
    out = fn(l, mask, 2)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx((1.5 + 3.0) / 2 if agg == "seq_mean_token_mean" else 6.0 / 2)
