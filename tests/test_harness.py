"""The run harness's promises that a careful user meets: a changed flag on --resume, a second
process on a run folder in use, a disk that fills up while a checkpoint is written, a model folder
without its tokenizer files. Each is one line, and no work is lost."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import common
import runner
import eval as ev
import grpo
import tepo
from common import UserError

ROOT = Path(__file__).resolve().parent.parent
FAST = [
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "8",
    "--eval-dataset",
    "none",
    "--device",
    "cpu",
    "--tensorboard",
    "false",
]


# =====================================================================================
# --resume keeps the run's arguments
# =====================================================================================
def test_a_changed_flag_on_resume_is_one_line_naming_it_and_its_saved_value(
    tmp_path, one_line_error
):
    grpo.main([*FAST, "--steps", "1", "--output-dir", str(tmp_path), "--run-name", "r"])
    run = tmp_path / "r"
    err = one_line_error(grpo.main, ["--resume", str(run), "--lr", "0.5"])
    assert "--lr 0.5 (the run has 0.0002)" in err and "--steps" in err  # names what may change
    err = one_line_error(grpo.main, ["--resume", str(run), "--steps", "2", "--group-size", "4"])
    assert "--group-size 4 (the run has 2)" in err
    assert [r["step"] for r in runner.read_metrics(run)] == [1]  # nothing ran, nothing was lost
    # the same value as saved is not a change; RESUMABLE flags are applied
    grpo.main(
        [
            "--resume",
            str(run),
            "--steps",
            "2",
            "--lr",
            "2e-4",
            "--save-every",
            "5",
            "--device",
            "cpu",
        ]
    )
    state = runner.load_trainer_state(runner.find_checkpoint(run))
    assert state["step"] == 2 and state["args"]["save_every"] == 5 and state["args"]["lr"] == 2e-4


def test_changed_flags_compares_given_flags_only():
    saved = grpo.Args(lr=2e-4, steps=3, group_size=2, model="tiny")
    assert runner.changed_flags(grpo.Args(), saved) == []  # nothing given
    # resumable
    assert runner.changed_flags(grpo.Args(steps=9, device="cpu"), saved) == []
    # equal to the saved value
    assert runner.changed_flags(grpo.Args(lr=2e-4), saved) == []
    assert runner.changed_flags(grpo.Args(kl_coef=0.0, lr=1e-3), saved) == [
        "--lr 0.001 (the run has 0.0002)",
        "--kl-coef 0.0 (the run has 0.04)",
    ]


def test_a_run_of_another_script_is_refused_on_resume_naming_both(tmp_path, one_line_error):
    """Issue 52: tepo.py --resume on a grpo run accepted most of its flags and would have trained
    it with TEPO's objective. One line naming both scripts, and the folder as it was."""
    grpo.main([*FAST, "--steps", "1", "--output-dir", str(tmp_path), "--run-name", "g"])
    run = tmp_path / "g"
    assert json.loads((run / "args.json").read_text())["algo"] == "grpo"
    state = runner.load_trainer_state(runner.find_checkpoint(run))
    assert state["args"]["algo"] == "grpo"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for resume in (run, run / "checkpoint-1"):
        err = one_line_error(tepo.main, ["--resume", str(resume), "--steps", "2"])
        assert err == (
            f"error: {resume} is a run of grpo.py, not of tepo.py: continue it with "
            f"python grpo.py --resume {resume}"
        ), err
    # a run stopped before its first checkpoint (args.json only) is refused the same way
    _stopped_before_its_first_checkpoint(
        [*FAST, "--steps", "2", "--output-dir", str(tmp_path), "--run-name", "k"]
    )
    err = one_line_error(tepo.main, ["--resume", str(tmp_path / "k")])
    assert "is a run of grpo.py, not of tepo.py" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert not (run / ".lock").exists() and not runner._ACTIVE_RUNS
    # the script that made it goes on
    grpo.main(["--resume", str(run), "--steps", "2"])
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2]


def test_a_torn_last_line_of_metrics_is_dropped_and_resume_rewrites_the_file(tmp_path, capsys):
    """Issue 52: a kill (or a full disk) in the middle of an append leaves metrics.jsonl with a
    last line cut short; reading it raised JSONDecodeError, and --resume with it failed."""
    grpo.main(
        [
            *FAST,
            "--steps",
            "2",
            "--save-every",
            "1",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "t",
        ]
    )
    run, path = tmp_path / "t", tmp_path / "t" / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"step": 3, "time": 17000, "lo')  # step 3's append, cut short
    capsys.readouterr()
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2]
    err = capsys.readouterr().err
    assert f"warning: {path}, line 3: cut short" in err and "left out" in err
    grpo.main(["--resume", str(run), "--steps", "3"])
    assert "line 3: cut short" in capsys.readouterr().err  # said once more as --resume reads it
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # every line whole again
    assert path.read_text().startswith(whole)
    runner.read_metrics(run)
    assert "cut short" not in capsys.readouterr().err


# =====================================================================================
# One process per run folder
# =====================================================================================
def test_a_second_process_on_a_folder_in_use_gets_one_line(tmp_path, one_line_error):
    run = tmp_path / "r"
    first = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "grpo.py"),
            *FAST,
            "--steps",
            "100000",
            "--save-every",
            "1",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "r",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "latest").is_file():
            time.sleep(0.2)
        assert (run / "latest").is_file(), "the first run never saved"
        err = one_line_error(grpo.main, ["--resume", str(run)])  # e.g. a job launched twice
        assert f"is in use by process {first.pid}" in err
        err = one_line_error(grpo.main, [*FAST, "--output-dir", str(tmp_path), "--run-name", "r"])
        assert f"is in use by process {first.pid}" in err
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.kill()  # SIGKILL: no chance to release anything itself
        first.wait()
    done = runner.load_trainer_state(runner.find_checkpoint(run))["step"]
    grpo.main(["--resume", str(run), "--steps", str(done + 1)])  # the lock died with the process


def test_the_lock_is_released_when_a_run_ends_or_fails_to_start(tmp_path, one_line_error):
    """...and its .lock file goes with it: a finished run's folder kept one naming its dead
    process."""
    lock = tmp_path / "r" / ".lock"
    grpo.main([*FAST, "--steps", "1", "--output-dir", str(tmp_path), "--run-name", "r"])
    assert not lock.exists()
    one_line_error(grpo.main, ["--resume", str(tmp_path / "r"), "--lr", "1"])  # fails after locking
    assert not lock.exists()
    grpo.main(["--resume", str(tmp_path / "r"), "--steps", "2"])  # so the folder is free again
    assert not runner._ACTIVE_RUNS and not lock.exists()


def test_a_lock_removed_as_its_holder_ends_is_not_held_twice(tmp_path, monkeypatch):
    """A second process that opened .lock just before the first removed it, and locked it just
    after, holds a file no longer in the folder: it must take the one now there, so that a third
    process finds the folder in use."""
    import fcntl

    first = runner.lock_run_folder(tmp_path)
    real_flock = fcntl.flock

    def first_ends_in_between(f, op):  # the second process, between its open and its flock
        first.close()
        monkeypatch.setattr(fcntl, "flock", real_flock)
        return real_flock(f, op)

    monkeypatch.setattr(fcntl, "flock", first_ends_in_between)
    second = runner.lock_run_folder(tmp_path)
    try:
        assert os.path.samestat(os.fstat(second.file.fileno()), os.stat(tmp_path / ".lock"))
        with pytest.raises(UserError, match=f"in use by process {os.getpid()}"):
            runner.lock_run_folder(tmp_path)  # the third
    finally:
        second.close()
    assert not (tmp_path / ".lock").exists()


# =====================================================================================
# Signals: SIGHUP (the terminal closed) saves as SIGTERM does
# =====================================================================================
def test_sighup_saves_and_exits_129(tmp_path, terminal_signals):
    """Issue 52: a run started in a terminal that closes (or over ssh that drops) got SIGHUP and
    died where it was, losing every step since the last checkpoint."""
    run = tmp_path / "hup"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "grpo.py"),
            *FAST,
            "--steps",
            "100000",
            "--save-every",
            "100000",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "hup",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=terminal_signals,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (
            (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()
        ):
            time.sleep(0.2)
        proc.send_signal(signal.SIGHUP)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 129, out[-2000:]
    assert "SIGHUP: stopped" in out or "SIGHUP: finishing this step's update" in out, out[-2000:]
    assert f"continue with: python grpo.py --resume {run}" in out
    assert "Traceback" not in out and not (run / ".lock").exists()
    state = runner.load_trainer_state(runner.find_checkpoint(run))
    # the last step logged, or (a stop after its update) the next, its figures saved with it
    assert state["step"] == runner.read_metrics(run)[-1]["step"] + ("row" in state) >= 1


# =====================================================================================
# A run that ends before its model and data load leaves no folder
# =====================================================================================
def test_a_model_that_fails_to_load_leaves_no_run_folder(tmp_path, one_line_error):
    """A failed model load left runs/<run>/ with .lock, args.json and an empty metrics.jsonl."""
    broken = tmp_path / "broken"
    shutil.copytree(runner.TINY_MODEL_DIR, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    runs = tmp_path / "runs"
    err = one_line_error(grpo.main, [*FAST, "--model", str(broken), "--output-dir", str(runs)])
    assert "cannot load model" in err
    assert not list(runs.iterdir())  # the run folder the start made is gone
    # a folder that was there before the run is kept, as is what someone else put in it
    (runs / "mine").mkdir()
    (runs / "mine" / "notes.txt").write_text("mine")
    argv = [*FAST, "--model", str(broken), "--output-dir", str(runs), "--run-name", "mine"]
    one_line_error(grpo.main, argv)
    assert sorted(p.name for p in (runs / "mine").iterdir()) == [
        "args.json",
        "metrics.jsonl",
        "notes.txt",
    ]


def test_ctrl_c_while_the_model_loads_stops_at_once_and_leaves_no_folder(
    tmp_path, monkeypatch, capsys, terminal_sigint
):
    """The first Ctrl-C said "finishing this step, then saving" while the model was still
    loading, then trained a whole step: there is no step to finish yet."""
    real = grpo.load_model

    def interrupted_load(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(grpo, "load_model", interrupted_load)
    with pytest.raises(SystemExit) as e:
        grpo.main([*FAST, "--steps", "3", "--output-dir", str(tmp_path), "--run-name", "c"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # what was there
    assert e.value.code == 130
    printed = capsys.readouterr()
    assert "Ctrl-C: stopped before the first step; nothing was saved" in printed.out + printed.err
    assert not (tmp_path / "c").exists() and not runner._ACTIVE_RUNS


def test_a_stop_signal_started_ignored_stays_ignored(tmp_path, monkeypatch):
    """Issue 67: a process started with SIGINT ignored (`cmd &`, nohup for SIGHUP, some CI
    runners) keeps it ignored, by the shell's convention: the run installs no handler for it, and
    restores the others' as they were."""
    seen = {}
    real = grpo.load_model

    def spy(*a, **k):
        seen.update({s: signal.getsignal(s) for s in runner.STOP_SIGNALS})
        return real(*a, **k)

    monkeypatch.setattr(grpo, "load_model", spy)
    before = {s: signal.getsignal(s) for s in runner.STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        grpo.main([*FAST, "--steps", "1", "--output-dir", str(tmp_path), "--run-name", "bg"])
        assert seen[signal.SIGINT] is signal.SIG_IGN  # not the run's
        assert seen[signal.SIGTERM] not in (before[signal.SIGTERM], signal.SIG_IGN)  # the run's
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# =====================================================================================
# A full disk while saving: one line, the previous checkpoint and `latest` intact
# =====================================================================================
def _tiny_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(runner.TINY_MODEL_DIR),
        AutoTokenizer.from_pretrained(runner.TINY_MODEL_DIR),
    )


def _assert_previous_checkpoint_intact(run_dir: Path, step: int):
    assert (run_dir / "latest").read_text().strip() == f"checkpoint-{step}"
    assert runner.load_trainer_state(runner.find_checkpoint(run_dir))["step"] == step
    assert not list(run_dir.glob(".tmp-checkpoint-*")) and not list(run_dir.glob(".trash-*"))


def test_a_write_error_while_saving_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    model, tok = _tiny_model_and_tokenizer()
    runner.save_checkpoint(
        tmp_path, 1, {"": model}, tok, {"step": 1}, {"optimizer": {"m": torch.ones(10)}}
    )

    # what safetensors raises when the disk is full, half-way through
    def full(self, folder, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 100)
        raise RuntimeError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(UserError) as e:
        runner.save_checkpoint(
            tmp_path, 2, {"": model}, tok, {"step": 2}, {"optimizer": {"m": torch.ones(10)}}
        )
    msg = str(e.value)
    assert "\n" not in msg
    assert "cannot write checkpoint-2" in msg
    assert "No space left on device" in msg
    assert "previous checkpoint and 'latest' are kept" in msg
    _assert_previous_checkpoint_intact(tmp_path, 1)
    assert (tmp_path / "checkpoint-1" / "optimizer.pt").is_file()  # the newest whole one keeps it


def test_every_harness_write_is_one_line(tmp_path, monkeypatch):
    log = runner.RunLogger(tmp_path, tensorboard=False)
    monkeypatch.setattr(log, "file", _Full())
    with pytest.raises(
        UserError, match=r"cannot write step 3 to metrics.jsonl in .*No space left on device"
    ):
        log.log(3, {"loss": 1.0})
    monkeypatch.setattr(Path, "write_text", _Full().write)
    with pytest.raises(UserError, match=r"cannot write summary.json in .*No space left on device"):
        runner.write_text(tmp_path / "summary.json", "{}")


class _Full:
    def write(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def _small_disk(path: Path, size: str) -> bool:
    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_a_really_full_disk_during_a_run(tmp_path, one_line_error):
    """On a 14 MB disk: the first checkpoint (a 3.2 MB model and its 6.4 MB of AdamW moments) fits,
    the second does not. The run
    stops with one line and resumes from the first checkpoint once there is room."""
    disk = tmp_path / "disk"
    if shutil.which("mount") is None or not _small_disk(disk, "14m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        err = one_line_error(
            grpo.main,
            [
                *FAST,
                "--steps",
                "2",
                "--save-every",
                "1",
                "--keep-checkpoints",
                "2",
                "--output-dir",
                str(disk),
                "--run-name",
                "r",
            ],
        )
        assert "cannot write checkpoint-2" in err, err
        assert "not enough disk space (it needs about" in err, err
        assert "the previous checkpoint and 'latest' are kept" in err
        _assert_previous_checkpoint_intact(disk / "r", 1)
        shutil.copytree(disk / "r", tmp_path / "r")  # room elsewhere: the run goes on from step 1
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # lazy: never leave a mount behind
    grpo.main(["--resume", str(tmp_path / "r")])
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


# =====================================================================================
# A model folder without tokenizer files
# =====================================================================================
@pytest.fixture()
def no_tokenizer(tmp_path):
    folder = tmp_path / "copied"
    folder.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(runner.TINY_MODEL_DIR / f, folder / f)
    return folder


def test_a_folder_without_tokenizer_files_is_one_line(
    no_tokenizer, tmp_path, capsys, one_line_error
):
    err = one_line_error(grpo.main, ["--model", str(no_tokenizer), "--output-dir", str(tmp_path)])
    assert "has no tokenizer files" in err
    err = one_line_error(
        ev.main, ["--model", str(no_tokenizer), "--output-dir", str(tmp_path / "e")]
    )
    assert "has no tokenizer files" in err


# =====================================================================================
# --resume in the cases a careful user still met: no dead end, no traceback, no silent no-op
# =====================================================================================
def _stopped_before_its_first_checkpoint(argv):
    """grpo.main(argv), stopped as by a kill -9 after step 1 is logged, before any save."""

    def killed(run, step, metrics):  # end_step's first act, then the kill
        run.log(step, metrics)
        raise RuntimeError("killed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner.Run, "end_step", killed)
        with pytest.raises(RuntimeError, match="killed"):
            grpo.main(argv)


def test_a_run_stopped_before_its_first_checkpoint_is_no_dead_end(tmp_path, capsys, one_line_error):
    argv = [*FAST, "--steps", "2", "--output-dir", str(tmp_path), "--run-name", "k"]
    _stopped_before_its_first_checkpoint(argv)
    run = tmp_path / "k"
    assert [r["step"] for r in runner.read_metrics(run)] == [1]
    assert not (run / ".lock").exists()  # an exception ends it too
    assert not list(run.glob("checkpoint-*"))
    err = one_line_error(grpo.main, argv)  # the same command again: it names the one that works
    assert "stopped before its first checkpoint" in err and f"--resume {run}" in err
    grpo.main(["--resume", str(run)])
    assert "starting it again from step 0 with its saved arguments" in capsys.readouterr().out
    grpo.main([*argv[:-1], "u"])  # the same run, never stopped
    rows, whole = runner.read_metrics(run), runner.read_metrics(tmp_path / "u")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole]
    assert runner.find_checkpoint(run).name == "checkpoint-2"


def test_training_data_changed_before_resume_is_one_line(tmp_path, one_line_error):
    rows = common.load_problems("tiny", "train", limit=16)
    data = tmp_path / "train.jsonl"

    def write(rs):
        data.write_text("".join(json.dumps(r) + "\n" for r in rs))

    write(rows)
    grpo.main(
        [
            *FAST,
            "--dataset",
            str(data),
            "--steps",
            "2",
            "--prompts-per-step",
            "4",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "d",
        ]
    )
    run = tmp_path / "d"
    write(rows[:3])  # rows removed: the saved position in the data lies past its end
    err = one_line_error(grpo.main, ["--resume", str(run), "--steps", "3"])
    assert "no longer matches the run: it has 3 rows now, the run had 16" in err
    write([*rows[:-1], {**rows[-1], "answer": "999"}])  # as many rows, one answer changed
    err = one_line_error(grpo.main, ["--resume", str(run), "--steps", "3"])
    assert "no longer matches the run" in err and "rows differ" in err
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2]  # nothing was lost
    write(rows)  # the data the run was trained on: it goes on
    grpo.main(["--resume", str(run), "--steps", "3"])
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2, 3]


def test_the_changed_data_line_names_the_data_set(tmp_path, one_line_error):
    data = tmp_path / "train.jsonl"
    rows = common.load_problems("tiny", "train", limit=8)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*FAST, "--dataset", str(data), "--steps", "1", "--output-dir", str(tmp_path)]
    grpo.main([*argv, "--run-name", "d"])
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    err = one_line_error(grpo.main, ["--resume", str(tmp_path / "d"), "--steps", "2"])
    assert f"the training data ({data}) no longer matches the run" in err


def test_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    grpo.main(
        [
            *FAST,
            "--steps",
            "2",
            "--save-every",
            "1",
            "--keep-checkpoints",
            "3",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "n",
        ]
    )
    run = tmp_path / "n"
    files = ("metrics.jsonl", "summary.json", "args.json", "latest")
    before = {f: (run / f).read_bytes() for f in files}
    cases = (
        (run, [], 2),
        (run, ["--steps", "2"], 2),
        (run, ["--steps", "1"], 2),
        (run / "checkpoint-1", ["--steps", "1"], 1),
    )  # an older checkpoint, at its own step
    for resume, extra, at in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            grpo.main(["--resume", str(resume), *extra])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "nothing to train" in out, out
        assert f"at step {at} already" in out and "give a larger --steps" in out
    assert {f: (run / f).read_bytes() for f in files} == before  # untouched


def test_cut_short_adapters_on_resume_name_the_file_and_the_intact_checkpoint(
    tmp_path, one_line_error
):
    pytest.importorskip("peft")
    grpo.main(
        [
            *FAST,
            "--steps",
            "2",
            "--save-every",
            "1",
            "--lora-rank",
            "4",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "l",
        ]
    )
    run = tmp_path / "l"
    bad = run / "checkpoint-2" / "adapter_model.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # a copy that stopped half-way
    err = one_line_error(grpo.main, ["--resume", str(run), "--steps", "3"])
    assert f"the weights file {bad} is cut short" in err
    first = run / "checkpoint-1"
    assert f"{first}, is intact: continue from it with --resume {first}" in err
    grpo.main(["--resume", str(first), "--steps", "2"])  # as the error says
    assert runner.find_checkpoint(run).name == "checkpoint-2"
    assert runner.damaged_weights(run / "checkpoint-2") is None
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2]


def test_hand_edited_saved_flags_are_checked_as_the_command_line(tmp_path, one_line_error):
    """--resume reads the saved flags (args.json of a run stopped before its first checkpoint, or
    a checkpoint's trainer_state.pt): a value of the wrong type ("lr": "1e-5") ended in
    `TypeError: must be real number, not str` deep in the checks. Now one line naming the field."""
    _stopped_before_its_first_checkpoint(
        [*FAST, "--steps", "1", "--output-dir", str(tmp_path), "--run-name", "e"]
    )
    saved = tmp_path / "e" / "args.json"  # and no checkpoint: --resume reads it
    good = json.loads(saved.read_text())
    for field, value, needle in (
        ("lr", "1e-5", "lr must be a number, not '1e-5'"),
        ("steps", 2.5, "steps must be a whole number, not 2.5"),
        ("steps", True, "steps must be a whole number, not True"),
        ("tensorboard", "no", "tensorboard must be true or false, not 'no'"),
        ("model", None, "model must be a string, not None"),
        ("optim", "sgd", "optim must be one of adamw, adamw8bit, not 'sgd'"),
        ("lr", -1, "--lr must be > 0, not -1"),  # then the command line's range checks
    ):
        saved.write_text(json.dumps({**good, field: value}))
        err = one_line_error(grpo.main, ["--resume", str(tmp_path / "e")])
        assert needle in err, err
        if field != "lr" or value != -1:
            assert err.startswith(f"error: {saved}: "), err
    saved.write_text(json.dumps({**good, "lr": 1}))  # an int for a float, as --lr 1 is
    grpo.main(["--resume", str(tmp_path / "e")])
    assert runner.load_trainer_state(runner.find_checkpoint(tmp_path / "e"))["args"]["lr"] == 1.0


@pytest.mark.parametrize("at", [2, 1])
def test_a_second_ctrl_c_while_saving_is_one_line_and_the_checkpoint_stays_whole(
    at, tmp_path, monkeypatch, capsys, terminal_sigint
):
    """Ctrl-C, then Ctrl-C again while checkpoint-<at> is being written: the process stops at
    once (exit 130) with one line, not a KeyboardInterrupt traceback; the checkpoint before it is
    whole (or there is none yet), `latest` names it, nothing half-written is left, and --resume
    goes on from it (from step 0 when there is none)."""
    argv = [*FAST, "--steps", "3", "--save-every", "1", "--output-dir", str(tmp_path)]
    run = tmp_path / "c"
    real_save = torch.save

    def interrupted(obj, f, *a, **k):  # the user's two Ctrl-C, half-way through checkpoint-<at>
        if str(f).endswith("trainer_state.pt") and obj["step"] == at:
            Path(f).write_bytes(b"\0" * 10)
            signal.raise_signal(signal.SIGINT)  # the first: in the end step's save, heard after
            signal.raise_signal(signal.SIGINT)  # the second: stop now
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", interrupted)
    try:
        grpo.main([*argv, "--run-name", "c"])
    except KeyboardInterrupt:
        pytest.fail("a second Ctrl-C while saving ended in a KeyboardInterrupt traceback")
    except SystemExit as e:
        code = e.code
    else:
        pytest.fail("the run went on after two Ctrl-C")
    assert code == 130
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    saved = (
        f"the last checkpoint saved, whole, is {run / 'checkpoint-1'} (step 1); continue"
        if at == 2
        else "no checkpoint was saved before it; start it again from step 0"
    )
    assert last == (
        f"stopped by a second Ctrl-C while saving checkpoint-{at}: {saved} with: "
        f"python grpo.py --resume {run}"
    ), last
    assert at == 1 or (run / "latest").read_text().strip() == "checkpoint-1"
    assert not list(run.glob(".tmp-*")) and not list(run.glob(".trash-*"))
    assert not (run / f"checkpoint-{at}").exists()
    monkeypatch.setattr(torch, "save", real_save)
    grpo.main(["--resume", str(run)])
    assert [r["step"] for r in runner.read_metrics(run)] == [1, 2, 3]
    assert runner.find_checkpoint(run).name == "checkpoint-3"


# =====================================================================================
# A stop signal in rollouts or an evaluation stops at once, and --resume redoes it exactly
# =====================================================================================
TIMES = ("time", "time/step", "tokens_per_s")


def _figures(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMES} for r in runner.read_metrics(run_dir)]


@pytest.mark.parametrize("where, sig", [("rollouts", "SIGTERM"), ("evaluation", "SIGHUP")])
def test_a_stop_mid_rollout_or_evaluation_saves_at_once_and_resumes_exactly(
    where, sig, tmp_path, monkeypatch, capsys
):
    """Issue 67: SIGTERM waited for the step to end, minutes at the gpu preset, past a spot
    machine's grace. In step 3's rollouts (or its evaluation) a signal now stops at once and saves
    step 2 (or step 3 with its figures), and the resumed run's metrics equal an unstopped run's."""
    flags = [*FAST, "--eval-dataset", "tiny", "--eval-n", "4", "--eval-every", "3"]
    flags += ["--steps", "4", "--save-every", "100", "--output-dir", str(tmp_path)]
    tepo.main([*flags, "--run-name", "whole"])
    slow, real = ("generate_rollouts", "evaluate")[where == "evaluation"], None
    real = getattr(tepo, slow)
    calls = []

    def slowed(*a, **k):  # the third rollout (or the evaluation after step 3) takes a minute
        calls.append(1)
        if len(calls) == (3 if where == "rollouts" else 2):
            timer = threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, sig)))
            timer.start()
            time.sleep(60)
        return real(*a, **k)

    monkeypatch.setattr(tepo, slow, slowed)
    began = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        tepo.main([*flags, "--run-name", "cut"])
    assert time.perf_counter() - began < 30  # saved before the slowed call would have ended
    assert e.value.code == 128 + getattr(signal, sig)
    saved = 2 if where == "rollouts" else 3
    printed = capsys.readouterr()
    said = "in step 3's rollouts" if where == "rollouts" else "after step 3's update"
    assert f"stopped {said}; saving step {saved}" in printed.out + printed.err
    assert f"continue with: python tepo.py --resume {tmp_path / 'cut'}" in printed.err
    assert runner.load_trainer_state(runner.find_checkpoint(tmp_path / "cut"))["step"] == saved
    assert [r["step"] for r in runner.read_metrics(tmp_path / "cut")] == [0, 1, 2]
    monkeypatch.setattr(tepo, slow, real)
    tepo.main(["--resume", str(tmp_path / "cut")])
    assert _figures(tmp_path / "cut") == _figures(tmp_path / "whole")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# =====================================================================================
# A path from a flag or a file never leaves its folder
# =====================================================================================
def test_a_run_name_that_leaves_the_output_folder_is_one_line(tmp_path, one_line_error):
    """Issue 67: --run-name ../x, an absolute one, or a/../../b trained and wrote outside
    --output-dir, exit 0."""
    out = tmp_path / "runs"
    for name in ["../x", str(tmp_path / "abs"), "a/../../b", "a/b", "..", "."]:
        err = one_line_error(grpo.main, [*FAST, "--output-dir", str(out), "--run-name", name])
        assert f"--run-name {name!r} must be one folder name" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, in --output-dir or beside it


def test_latest_naming_another_runs_checkpoint_is_not_followed(tmp_path, capsys):
    """Issue 67: a `latest` naming a checkpoint of run B (relative or absolute), or a
    checkpoint-N link to one, was followed: --resume A trained and wrote run B holding A's lock
    only, and eval.py --model A scored B's checkpoint. A's own newest whole one is taken."""
    for name in ("a", "b"):
        flags = ["--steps", "2", "--save-every", "1", "--keep-checkpoints", "3"]
        grpo.main([*FAST, *flags, "--output-dir", str(tmp_path), "--run-name", name])
    a, b = tmp_path / "a", tmp_path / "b"
    b_files = {p: p.stat().st_mtime_ns for p in b.rglob("*") if p.is_file()}
    (a / "checkpoint-2").rename(a / "checkpoint-9")  # A's own newest: 9
    (a / "checkpoint-12").symlink_to(b / "checkpoint-2")  # a link is not A's checkpoint
    for latest in ("../b/checkpoint-2", str(b / "checkpoint-2"), "checkpoint-12"):
        (a / "latest").write_text(latest + "\n")
        assert runner.find_checkpoint(a) == a / "checkpoint-9"
        assert "not a checkpoint of this run: not followed" in capsys.readouterr().err
        assert ev.run_checkpoint(str(a)) == str(a / "checkpoint-9")
    assert runner.whole_checkpoints(a) == [a / "checkpoint-9", a / "checkpoint-1"]
    grpo.main(["--resume", str(a), "--steps", "11", "--keep-checkpoints", "1"])
    assert runner.read_metrics(a)[-1]["step"] == 11 and (a / "checkpoint-11").is_dir()
    assert (a / "checkpoint-12").is_symlink() and (b / "checkpoint-2" / "optimizer.pt").is_file()
    assert {p: p.stat().st_mtime_ns for p in b.rglob("*") if p.is_file()} == b_files


# =====================================================================================
# What a CPU cannot meet on its own: a GPU without bf16, a disk too small for a checkpoint
# =====================================================================================
def test_a_gpu_without_bf16_is_one_line_naming_the_flag(monkeypatch):
    """Issue 66: a pre-Ampere GPU (V100, T4) has no bf16, which a CUDA run uses by default."""
    monkeypatch.setattr(runner, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    args = runner.parse_args(grpo.Args, [*FAST, "--device", "cuda"])
    with pytest.raises(UserError, match="V100-SXM2-16GB has no bf16 .*: run with --bf16 false"):
        runner.resolve_run_args(args, "grpo", grpo.PRESETS)
    args = runner.parse_args(grpo.Args, [*FAST, "--device", "cuda", "--bf16", "false"])
    runner.resolve_run_args(args, "grpo", grpo.PRESETS)
    assert args.bf16 is False and args.gradient_checkpointing is True


def test_a_disk_too_small_for_a_checkpoint_is_one_line_before_the_first_step(
    tmp_path, monkeypatch, one_line_error
):
    """Issue 66: the first save found the disk full, hours in (a full-model checkpoint of a 1.5 B
    model with its optimizer is ~18 GB)."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10**6))
    err = one_line_error(grpo.main, [*FAST, "--output-dir", str(tmp_path), "--run-name", "d"])
    assert "a checkpoint of this run needs about" in err and "has 1.0 MB free" in err
    assert not (tmp_path / "d").exists()  # the run never began: its folder is gone
