"""The pre-run cost check (cost.check_cost, issue 53): on CUDA a run prints the memory and time
it expects, the figures of docs/memory.md and docs/speed.md from the same function, and a run the
GPU cannot hold stops before any model loads, in one line naming the flag that would make it fit.
No GPU here: the device's size is faked."""

import importlib
import re
import shutil
import types
from pathlib import Path

import pytest
import torch

import common
import runner
from tools import cost
from tools.bench import QWEN_MATH_1_5B

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
QWEN = dict(QWEN_MATH_1_5B, context=4096)  # the docs' model: 1.54 B parameters, context 4096


def gpu_args(name: str, **flags):
    mod = importlib.import_module(name)
    args = mod.resolve_args(mod.Args(preset="gpu", device="cpu", run_name="x"))
    for k, v in flags.items():
        setattr(args, k, v)
    critic = QWEN if hasattr(args, "critic_model") else None  # SAPO: a critic from --model
    return args, critic, mod.needs_reference(args)


def printed(capsys, name: str, total: float = 85e9, gpu: str = "NVIDIA A100-SXM4-80GB", **flags):
    args, critic, ref = gpu_args(name, **flags)
    cost.check_cost(args, QWEN, critic, ref, int(total), gpu)
    return capsys.readouterr().out


def test_the_printed_estimate_is_the_docs_figure(capsys):
    """Each script's peak, full and LoRA r=64, as docs/memory.md's table states it; GRPO's 500
    steps as docs/speed.md states them (38 h on an H100, 48 h on an A100)."""
    table = (ROOT / "docs" / "memory.md").read_text()
    for name in SCRIPTS:
        row = re.search(rf"^\| {name} \| .*\*\*([\d.]+)\*\* \| .*\*\*([\d.]+)\*\* \|", table, re.M)
        full, lora = row.groups()
        assert f"estimate: {full} GB of GPU memory" in printed(capsys, name)
        assert f"estimate: {lora} GB of GPU memory" in printed(capsys, name, lora_rank=64)
    speed = (ROOT / "docs" / "speed.md").read_text()
    assert "500\nsteps take 38-48 h" in speed
    assert "38 h for 500 steps on an H100" in printed(capsys, "grpo", gpu="NVIDIA H100 80GB HBM3")
    assert "48 h for 500 steps on an A100" in printed(capsys, "grpo")


@pytest.mark.parametrize(
    "name, total, flags, fix",
    [
        ("grpo", 24e9, {}, "it would fit with --lora-rank 64"),  # docs/memory.md's 24 GB GPU
        ("dapo", 10e9, dict(lora_rank=64), "it would fit with --gen-batch-size 32"),
        ("sapo", 40e9, {}, "it would fit with --lora-rank 64"),
        ("sapo", 24e9, {}, "--lora-rank 64 and a --critic-model of at most 0.70 B parameters"),
        ("grpo", 6e9, {}, "does not fit even with --lora-rank 64 and --gen-batch-size 1"),
    ],
)
def test_a_run_too_big_for_the_gpu_is_one_line_naming_the_flag(name, total, flags, fix):
    args, critic, ref = gpu_args(name, **flags)
    with pytest.raises(common.UserError) as e:
        cost.check_cost(args, QWEN, critic, ref, int(total), "NVIDIA A100-SXM4-80GB")
    message = str(e.value)
    assert "\n" not in message and fix in message, message
    assert f"the GPU has {total / 1e9:.1f} GB" in message


@pytest.fixture
def qwen_folder(tmp_path):
    """A folder with Qwen2.5-Math-1.5B's config.json (no weights: nothing may load them) and the
    tiny tokenizer's files."""
    from transformers import Qwen2Config

    from tools.build_rehearsal import CONFIG

    folder = tmp_path / "qwen-config"
    shutil.copytree(runner.TINY_MODEL_DIR, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    q = QWEN_MATH_1_5B
    sizes = dict(hidden_size=q["hidden"], intermediate_size=q["intermediate"])
    sizes |= dict(num_hidden_layers=q["layers"], num_attention_heads=q["heads"])
    Qwen2Config(**CONFIG, **sizes, num_key_value_heads=q["kv_heads"]).save_pretrained(folder)
    return folder


def test_the_shapes_come_from_the_models_config(qwen_folder):
    shapes = cost.model_shapes(str(qwen_folder))
    assert {k: v for k, v in shapes.items() if k != "params"} == {
        k: v for k, v in QWEN.items() if k != "params"
    }
    assert shapes["params"] == 1_543_714_304  # counted on the meta device; the docs say 1.54 B


@pytest.mark.parametrize("name, fix", [("grpo", "--lora-rank 64"), ("sapo", "--critic-model")])
def test_on_cuda_the_check_runs_before_any_model_loads(
    name, fix, qwen_folder, tmp_path, monkeypatch, capsys
):
    """Through the script's own main on a faked 24 GB CUDA device: the estimate is printed, the
    run stops in one line naming the flag, and no model was loaded and no run folder left."""
    mod = importlib.import_module(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = types.SimpleNamespace(total_memory=24 * 10**9, name="NVIDIA L4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(mod, "load_model", no_load)
    argv = ["--model", str(qwen_folder), "--device", "cuda", "--preset", "gpu"]
    with pytest.raises(SystemExit) as e:
        mod.main(argv + ["--output-dir", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "GB of GPU memory (this GPU has 24.0)" in out and " h for 500 steps on an A100" in out
    assert err.startswith("error: this run needs about") and fix in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
