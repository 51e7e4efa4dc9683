"""Threads chosen on purpose (issue 45): every script and eval.py set OpenMP's passive wait
before torch loads, unless the user set it; --threads, else OMP_NUM_THREADS, else the preset's,
else torch's own; the run says which on its first line and args.json records it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import grpo
import runner

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--eval-dataset", "none"]
SMALL += ["--tensorboard", "false", "--micro-batch-size", "4"]


def _openmp(module: str, env_value: str | None) -> dict:
    """libgomp's settings as it prints them when it loads, in a fresh process importing
    `module`: {"OMP_WAIT_POLICY": ..., "GOMP_SPINCOUNT": ...}."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {module}, torch; torch.ones(2)"
    err = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    ).stderr
    pairs = (line.strip().split(" = ") for line in err.splitlines() if " = " in line)
    return {k: v.strip("'") for k, v in pairs}


@pytest.mark.parametrize("module", ["grpo", "dapo", "tepo", "erpo", "sapo", "eval"])
def test_openmp_threads_sleep_instead_of_spinning(module):
    # libgomp's default spins 300000 rounds at a barrier before it sleeps; passive spins none
    got = _openmp(module, None)
    assert (got["OMP_WAIT_POLICY"], got["GOMP_SPINCOUNT"]) == ("PASSIVE", "0")


def test_a_wait_policy_the_user_set_wins():
    assert _openmp("grpo", "ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"


def _resolved(monkeypatch, omp, argv=()):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    return grpo.resolve_args(grpo.Args(run_name="x", **dict(argv))).threads


def test_threads_flag_then_environment_then_preset(monkeypatch):
    import torch

    assert _resolved(monkeypatch, "1") == 1
    assert _resolved(monkeypatch, "1", [("threads", 3)]) == 3  # --threads wins
    assert _resolved(monkeypatch, None) == torch.get_num_threads()  # the tiny preset leaves it
    assert _resolved(monkeypatch, "") == torch.get_num_threads()  # an empty variable is unset


def test_the_run_says_its_threads_first_and_records_them(tmp_path, capsys, monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        grpo.main(["--steps", "1", "--output-dir", str(tmp_path), "--run-name", "r", *SMALL])
        assert torch.get_num_threads() == 1
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith("grpo: 1 torch thread on cpu"), first
        assert json.loads((tmp_path / "r" / "args.json").read_text())["threads"] == 1
        # a resume chooses again for the machine it runs on, unless --threads says otherwise
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        grpo.main(["--resume", str(tmp_path / "r"), "--steps", "2"])
        assert "grpo: 2 torch threads on cpu" in capsys.readouterr().out
        grpo.main(["--resume", str(tmp_path / "r"), "--steps", "3", "--threads", "1"])
        assert "grpo: 1 torch thread on cpu" in capsys.readouterr().out
        assert runner.read_metrics(tmp_path / "r")[-1]["step"] == 3
    finally:
        torch.set_num_threads(before)


def test_threads_below_one_is_one_line(one_line_error, tmp_path):
    assert "--threads must be at least 1" in one_line_error(
        grpo.main, ["--threads", "0", "--output-dir", str(tmp_path)]
    )
