"""Real chat models on a CPU: the word-problem task (split, grading, the chat prompt), the preset
picked by model and device, and a short run of a real architecture (a Llama built from a config)
on the cpu preset. The learning check on SmolLM2-135M-Instruct is opt-in (RUN_SLOW=1): it needs
the model folder that tools/build_smollm2.py makes, and an hour of two cores."""

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

import common
import runner
import grpo
import tepo
from common import UserError
from tools import make_data

ROOT = Path(__file__).resolve().parent.parent
SMOLLM = ROOT / "models" / "SmolLM2-135M-Instruct"


# =====================================================================================
# The word problems
# =====================================================================================
def _bundled(name: str, split: str) -> list[dict]:
    """data/<name>/<split>.jsonl as written: problem, solution and answer."""
    path = common.DATA / name / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_word_problem_splits_are_disjoint_deterministic_and_graded():
    train, test = _bundled("words", "train"), _bundled("words", "test")
    assert len(train) > 5000 and len(test) > 500
    # disjoint by a hash of the text
    assert not {e["problem"] for e in train} & {e["problem"] for e in test}
    assert make_data.word_problems("test", 5, seed=3) == make_data.word_problems("test", 5, seed=3)
    # the seed shuffles
    assert make_data.word_problems("test", 5, seed=3) != make_data.word_problems("test", 5, seed=4)
    assert make_data.word_problems("test") == test  # the files hold the generator's seed 0
    assert all(make_data.tiny_is_heldout(e["problem"]) for e in test)
    steps = {e["solution"].count("\n") for e in train}
    assert steps == {1, 2, 3}  # one to three steps
    assert len({e["problem"].split()[0] for e in train}) == len(make_data.NAMES)  # several names
    for e in train[:200]:  # the worked solution is right, and its answer is a whole number
        *lines, last = e["solution"].split("\n")
        for line in lines:
            lhs, rhs = line.split(" = ")
            a, op, b, *rest = lhs.split(" ")
            value = {
                "+": int(a) + int(b),
                "-": int(a) - int(b),
                "*": int(a) * int(b),
                "/": int(a) // int(b),
            }[op]
            if rest:  # n + b * m
                value = int(a) + int(b) * int(rest[1])
            assert value == int(rhs) >= 0, line
        assert last == f"The answer is {e['answer']}." and int(e["answer"]) >= 0
        assert common.grade(e["solution"], e["answer"], extraction="math_verify").correct
        assert not common.grade(
            e["solution"].replace(f"is {e['answer']}.", f"is {int(e['answer']) + 1}."),
            e["answer"],
            extraction="math_verify",
        ).correct
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        make_data.word_problems("validation")
    with pytest.raises(UserError, match="the bundled set 'words' has splits train and test"):
        common.load_problems("words", "validation")


def test_the_words_dataset_in_the_scripts_and_eval():
    assert common.load_problems("words", "test", limit=3) == [
        {"problem": e["problem"], "answer": e["answer"]} for e in _bundled("words", "test")[:3]
    ]
    import eval as ev

    label, source, rows = ev.load_benchmark("words", ev.Args(eval_n=4))
    assert label == "words" and source == "data/words/test.jsonl" and len(rows) == 4
    assert rows == common.load_problems("words", "test", limit=4)


def test_the_chat_template_uses_the_models_own_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runner.TINY_MODEL_DIR)
    text = common.build_prompt(tok, "Tom has 3 apples.", "chat")
    assert text == tok.apply_chat_template(
        [
            {"role": "system", "content": common.CHAT_INSTRUCTION},
            {"role": "user", "content": "Tom has 3 apples."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    tok.chat_template = None
    assert (
        common.build_prompt(tok, "Tom has 3 apples.", "chat")
        == f"Tom has 3 apples.\n{common.CHAT_INSTRUCTION}\n"
    )


# =====================================================================================
# Presets: by model and device, or --preset
# =====================================================================================
@pytest.fixture(scope="module")
def real_llama(tmp_path_factory):
    """A random Llama (SmolLM2's architecture, tiny widths) with the bundled tokenizer and its
    chat template, in a local folder: a real model that is not the tiny one, offline."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    tok = AutoTokenizer.from_pretrained(runner.TINY_MODEL_DIR)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("mod", [grpo, tepo])
def test_the_preset_is_picked_by_model_and_device(mod, real_llama, monkeypatch):
    def resolved(**kw):
        return mod.resolve_args(mod.Args(run_name="x", **kw))

    tiny, cpu = resolved(device="cpu"), resolved(model=str(real_llama), device="cpu")
    assert (tiny.preset, tiny.dataset, tiny.lora_rank) == ("tiny", "tiny", 0)
    assert (cpu.preset, cpu.dataset, cpu.template, cpu.answer_extraction) == (
        "cpu",
        "words",
        "chat",
        "math_verify",
    )
    assert cpu.lora_rank == 16 and cpu.lr == mod.PRESETS["cpu"]["lora_lr"]
    # --lora-rank 0 given: full fine-tuning at the preset's lr (the preset fills only the flags
    # not passed, even where the value passed is the default's)
    argv = ["--model", str(real_llama), "--device", "cpu", "--run-name", "x", "--lora-rank", "0"]
    full = mod.resolve_args(runner.parse_args(mod.Args, argv))
    assert (full.preset, full.lora_rank, full.lr) == ("cpu", 0, mod.PRESETS["cpu"]["lr"])
    assert mod.resolve_args(runner.parse_args(mod.Args, argv[:-2])).lora_rank == 16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: the real run's preset
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: True)
    gpu = resolved(model=str(real_llama), device="auto")
    assert (gpu.preset, gpu.max_new_tokens, gpu.lora_rank, gpu.lr) == ("gpu", 3000, 0, 1e-6)
    assert resolved(device="auto").preset == "tiny"  # the tiny model keeps its preset on a GPU
    # --preset overrides the choice; flags given override the preset
    forced = resolved(model=str(real_llama), device="cpu", preset="gpu", max_new_tokens=7)
    assert (forced.preset, forced.dataset, forced.max_new_tokens) == (
        "gpu",
        mod.PRESETS["gpu"]["dataset"],
        7,
    )
    # the tiny model on the cpu preset
    assert resolved(preset="cpu", device="cpu").dataset == "words"


def test_a_bad_preset_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        grpo.main(["--preset", "huge", "--output-dir", str(tmp_path)])
    assert e.value.code == 2 and "--preset: invalid choice: 'huge'" in capsys.readouterr().err


def test_a_bad_preset_in_code_is_a_user_error():
    with pytest.raises(
        UserError, match="unknown --preset 'huge'; choose from auto, tiny, cpu, gpu"
    ):
        grpo.resolve_args(grpo.Args(preset="huge", run_name="x", device="cpu"))


def test_a_real_architecture_trains_on_the_cpu_preset(real_llama, tmp_path):
    """Two steps of the cpu preset (word problems, the chat template, math_verify grading, LoRA
    rank 16) on a Llama, sized down; then a resume: the path a real chat model takes on a CPU."""
    small = [
        "--model",
        str(real_llama),
        "--device",
        "cpu",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-n",
        "4",
        "--eval-every",
        "2",
        "--tensorboard",
        "false",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "r",
    ]
    tepo.main([*small, "--steps", "1"])
    tepo.main(["--resume", str(tmp_path / "r"), "--steps", "2"])
    args = json.loads((tmp_path / "r" / "args.json").read_text())
    assert (args["preset"], args["dataset"], args["lora_rank"]) == ("cpu", "words", 16)
    rows = runner.read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/greedy_acc" in rows[-1]
    assert (runner.find_checkpoint(tmp_path / "r") / "adapter_config.json").is_file()


# =====================================================================================
# The learning check on SmolLM2-135M-Instruct (opt-in: RUN_SLOW=1, about an hour)
# =====================================================================================
@pytest.mark.skipif(
    os.environ.get("RUN_SLOW") != "1" or not (SMOLLM / "config.json").is_file(),
    reason="opt-in: RUN_SLOW=1 and models/SmolLM2-135M-Instruct (python tools/build_smollm2.py)",
)
@pytest.mark.parametrize("name", ["grpo", "dapo", "tepo", "erpo", "sapo"])
def test_smollm2_learns_on_the_cpu_preset(name, tmp_path):
    """The README's real-model command for every script, seed 1 (the study's -len runs,
    docs/study/PLAN-length.md): 10 greedy points or more in 60 steps."""
    mod = importlib.import_module(name)
    mod.main(
        [
            "--model",
            str(SMOLLM),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "learn",
        ]
    )
    evals = [r for r in runner.read_metrics(tmp_path / "learn") if "eval/greedy_acc" in r]
    assert evals[-1]["eval/greedy_acc"] >= evals[0]["eval/greedy_acc"] + 0.10, evals
