"""The pre-run cost check (cost.check_cost, issue 53): on CUDA a run prints the memory and time
it expects, the figures of docs/memory.md and docs/speed.md from the same function, and a run the
GPU cannot hold stops before any model loads, in one line naming the flag that would make it fit.
No GPU here: the device's size is faked."""

import importlib
import json
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


def printed(capsys, name: str, total: float = 200e9, gpu: str = "NVIDIA A100-SXM4-80GB", **flags):
    args, critic, ref = gpu_args(name, **flags)
    cost.check_cost(args, QWEN, critic, ref, int(total), gpu)
    return capsys.readouterr().out


def test_the_printed_estimate_is_the_docs_figure(capsys):
    """Each script's peak, full and LoRA r=64, as docs/memory.md's table states it."""
    table = (ROOT / "docs" / "memory.md").read_text()
    for name in SCRIPTS:
        row = re.search(rf"^\| {name} \| .*\*\*([\d.]+)\*\* \| .*\*\*([\d.]+)\*\* \|", table, re.M)
        full, lora = row.groups()
        assert f"estimate: {full} GB of GPU memory" in printed(capsys, name)
        assert f"estimate: {lora} GB of GPU memory" in printed(capsys, name, lora_rank=64)
    out = printed(capsys, "tepo", gpu="NVIDIA H100 80GB HBM3")
    assert "h for 500 steps on an H100 80GB (generate" in out and "calls of 256 rows" in out


@pytest.mark.parametrize(
    "name, total, flags, fix",
    [
        ("grpo", 24e9, {}, "it would fit with --lora-rank 64"),  # docs/memory.md's 24 GB GPU
        ("dapo", 10e9, dict(lora_rank=64, gen_batch_size=64), "would fit with --gen-batch-size 32"),
        ("sapo", 40e9, {}, "it would fit with --lora-rank 64"),
        (
            "sapo",
            24e9,
            {},
            "--lora-rank 64 and --gen-batch-size 128 and a --critic-model of at most 0.13 B",
        ),
        ("grpo", 6e9, {}, "does not fit even with --lora-rank 64 and --gen-batch-size 1"),
    ],
)
def test_a_run_too_big_for_the_gpu_is_one_line_naming_the_flag(name, total, flags, fix):
    args, critic, ref = gpu_args(name, **flags)
    with pytest.raises(common.UserError) as e:
        cost.check_cost(args, QWEN, critic, ref, int(total), "NVIDIA A100-SXM4-80GB")
    message = str(e.value)
    assert "\n" not in message and fix in message, message
    assert (
        f"the GPU has {total / 1e9:.1f} GB, {cost.usable(total) / 1e9:.1f} for the run" in message
    )


def test_a_smaller_gpu_gets_fewer_rows_per_generate_call_said_in_one_line(capsys):
    """All P x G rows in one call where they fit; where only the KV cache does not fit and the
    user gave no --gen-batch-size, the check halves it until the estimate fits: LoRA on 24 GB,
    KV of 117 MB a row (28,672 B x 4,096 positions), 8.3 GB besides: 128 rows."""
    args, critic, ref = gpu_args("tepo", lora_rank=64)
    cost.check_cost(args, QWEN, critic, ref, 24 * 2**30, "NVIDIA L4")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("--gen-batch-size set to 128: 256 rows of KV cache in one generate()")
    assert args.gen_batch_size == 128 and "in calls of 128 rows" in out[1]
    args, critic, ref = gpu_args("tepo")
    cost.check_cost(args, QWEN, critic, ref, 80 * 2**30, "NVIDIA H100 80GB HBM3")
    assert args.gen_batch_size is None and "calls of 256 rows" in capsys.readouterr().out


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
    assert {k: v for k, v in shapes.items() if k not in ("params", "source")} == {
        k: v for k, v in QWEN.items() if k != "params"
    }
    assert shapes["params"] == 1_543_714_304  # counted on the meta device; the docs say 1.54 B
    assert shapes["source"] == str(qwen_folder)


def test_offline_the_shapes_come_from_the_bundled_config(monkeypatch):
    """A hub id not in the local cache: the bundled copy of its public config, no hub asked."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(cost, "check_model_folder", lambda path: pytest.fail("hub asked"))
    shapes = cost.model_shapes("Qwen2.5-Math-1.5B")
    assert shapes["source"] == "tools/configs/Qwen2.5-Math-1.5B.json (bundled copy)"
    assert shapes["params"] == 1_543_714_304
    assert {k: shapes[k] for k in QWEN if k != "params"} == {
        k: v for k, v in QWEN.items() if k != "params"
    }


@pytest.mark.parametrize("name, fix", [("grpo", "--lora-rank 64"), ("sapo", "--critic-model")])
def test_on_cuda_the_check_runs_before_any_model_loads(
    name, fix, qwen_folder, tmp_path, monkeypatch, capsys
):
    """Through the script's own main on a faked 24 GB CUDA device: the estimate is printed, the
    run stops in one line naming the flag, and no model was loaded and no run folder left."""
    mod = importlib.import_module(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: True)
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
    assert "GB of GPU memory (this GPU has 24.0, 21.4 for the run)" in out
    assert " h for 500 steps on an L4 (generate" in out
    assert err.startswith("error: this run needs about") and fix in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_time_estimate_on_a_toy_model():
    """10 parameters (2 of them the embedding), one layer, one KV head of size 1 (4 bytes a cached
    position), 1 B/s and 1 FLOP/s: every figure by hand."""
    toy = dict(params=10, embed=2, layers=1, kv_heads=1, head_dim=1, hidden=1, vocab=2)
    c = dict(cost.CONSTANTS, ops_per_layer=1, ops_per_step=0, host_us_per_op=1e6, kv_passes=1)
    c |= dict(mfu=1.0, prompt_len=0, mean_completion=1, bandwidth=1.0, flops=1.0)
    args = types.SimpleNamespace(prompts_per_step=1, group_size=2, max_new_tokens=2)
    for k, v in dict(
        gen_batch_size=None,
        lora_rank=0,
        num_mini_batches=1,
        micro_batch_size=1,
        ppo_epochs=1,
        steps=1,
        gradient_checkpointing=True,
        eval_every=1,
        eval_n=1,
        eval_dataset="x",
    ).items():
        setattr(args, k, v)
    t = cost.time_estimate(args, toy, "A100 80GB", ref=True, c=c)
    # one call of 2 rows, 2 decode steps: max(1 s host, 2 x 10 B + 2 rows x t positions x 4 B)
    assert t["generate_s"] == (20 + 8) + (20 + 16)
    # lengths [0, 1]; 1 position run, 1 valid; 16 FLOP a position, 4 the output layer: old and
    # ref 2 x 20, the update 4 x 20 (forward, backward 2, the checkpoint's recompute)
    assert cost.completion_lengths(2, 1, 2) == [0, 1]
    assert t["train_s"] == 2 * 20 + 4 * 20
    # evaluations at 0 and 1, greedy and sampled, one call of 1 row: (20 + 4) + (20 + 8)
    assert (t["evaluations"], t["eval_rows"], t["eval_s"]) == (2, 1, 2 * 2 * 52)
    args.lora_rank = 1  # LoRA: no gradient for the base (backward 1); adapters read in bf16 too
    toy |= dict(heads=1, intermediate=1)
    t = cost.time_estimate(args, toy, "A100 80GB", ref=True, c=c)
    assert t["train_s"] == 2 * 20 + 3 * 20
    # 1 x (2 x 2 + 2 x 2 + 3 x 2) = 14 adapter parameters; the host dispatches 1 + 61 ops a step
    assert cost.lora_params(1, toy) == 14 and c["lora_ops_per_layer"] == 61
    assert t["generate_s"] == max(62, 2 * 24 + 8) + max(62, 2 * 24 + 16)


def json_of(capsys, *argv) -> dict:
    assert cost.main(["tepo.py", "--model", "Qwen2.5-Math-1.5B", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_command_line_estimate(capsys, tmp_path):
    """tools/cost.py SCRIPT.py [its flags] --gpu NAME --json, offline (the bundled config): the
    preset's rows in one call, a launch-bound decode step, an unknown GPU said plainly, and a
    gpu_check.json's constants in place of the defaults."""
    s = json_of(capsys, "--gpu", "A100 80GB")
    assert s["gpu"] == "A100 80GB" and s["known_gpu"] and s["gen_rows"] == 256
    assert set(s["phases"]) == {"generate", "train", "eval"} and s["decode_step_ms"] >= 15
    assert s["hours"] == pytest.approx(sum(s["phases"].values()), abs=0.02)
    assert s["model_config"] == "tools/configs/Qwen2.5-Math-1.5B.json (bundled copy)"
    unknown = json_of(capsys, "--gpu", "Tesla T4")
    assert unknown["gpu_note"] == "unknown GPU 'Tesla T4': figures for A100 80GB"
    assert unknown["hours"] == s["hours"]
    measured = tmp_path / "gpu_check.json"
    measured.write_text(json.dumps({"constants": {"host_us_per_op": 0.0}}))
    s = json_of(capsys, "--gpu", "A100 80GB", "--calibration", str(measured))
    assert s["decode_host_ms"] == 0 and s["decode_step_ms"] == s["decode_memory_ms"]
    assert s["constants"]["host_us_per_op"] == 0.0
    lora = json_of(capsys, "--gpu", "L4", "--lora-rank", "64")
    assert lora["gen_rows"] == 128 and lora["gen_rows_note"].startswith("--gen-batch-size set")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope.py"], "unknown script 'nope.py'"),
        (["tepo.py", "--calibration", "missing.json"], "--calibration missing.json: not a"),
        (["tepo.py", "--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_input_to_the_tool_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cost.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and message in err, err


def test_the_readmes_gpu_table_is_the_tools_estimate():
    """The README's per-card table is what tools/cost.py computes now (offline, bundled config)."""
    readme = (ROOT / "README.md").read_text()
    for row in cost.card_table():
        assert row in readme, row
