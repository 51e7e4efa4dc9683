"""The plumbing: the bundled model and task, the prompt sampler, checkpoints, grading helpers."""

import json

import pytest
import torch

import common
import runner
from tools import make_data


def test_tiny_model_loads_and_generates_offline(tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert (
        model.config.model_type == "qwen2"
        and sum(p.numel() for p in model.parameters()) < 2_000_000
    )
    # one token per character, and text survives the round trip (spaces and newlines included)
    text = "7+5-8\n7+5=12\n12-8=4 \\boxed{4}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    prompt = common.build_prompt(tok, "7+5-8", "tiny")
    assert prompt == "<|im_start|>user\n7+5-8<|im_end|>\n<|im_start|>assistant\n"
    eos = model.generation_config.eos_token_id
    assert set(eos) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    tok.padding_side = "left"
    enc = tok(
        [
            common.build_prompt(tok, r["problem"], "tiny")
            for r in common.load_problems("tiny", "test", limit=32)
        ],
        return_tensors="pt",
        padding=True,
    )
    out = model.generate(
        **enc, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert sum(common.last_boxed(t) is not None for t in texts) >= 28  # it has learned the format


def test_tiny_task_splits_are_disjoint_and_deterministic():
    train, test = common.load_problems("tiny", "train"), common.load_problems("tiny", "test")
    assert len(train) == 3500 and len(test) == 500
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert make_data.tiny_task("test", 10, seed=3) == make_data.tiny_task("test", 10, seed=3)
    assert make_data.tiny_task("test", 10, seed=3) != make_data.tiny_task("test", 10, seed=4)
    ex = make_data.tiny_example(7, "+", 5, "-", 8)
    assert ex["solution"] == "7+5=12\n12-8=4\n\\boxed{4}" and ex["answer"] == "4"
    assert all(
        common.grade(r["solution"], r["answer"]).correct for r in make_data.tiny_task("test")
    )


def test_the_bundled_files_are_what_make_data_writes():
    # data/<set>/<split>.jsonl: the generators' rows at seed 0, so a subset is the first n rows
    for name, make in make_data.MAKERS.items():
        for split in ("train", "test"):
            path = common.DATA / name / f"{split}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            assert rows == make(split), path
            subset = common.load_problems(name, split, limit=5)
            assert subset == [{"problem": r["problem"], "answer": r["answer"]} for r in rows[:5]]


def test_prompt_sampler_resumes_exactly():
    rows = [{"problem": str(i), "answer": str(i)} for i in range(7)]
    a = common.PromptSampler(rows, seed=5)
    first = a.take(10)  # crosses an epoch boundary
    assert sorted(first[:7]) == list(range(7))
    b = common.PromptSampler(rows, seed=5)
    b.load_state_dict(a.state_dict())
    assert a.take(9) == b.take(9)
    other = [{**r, "answer": "0"} if i == 3 else r for i, r in enumerate(rows)]
    with pytest.raises(common.UserError, match="fingerprint"):  # the same count, other rows
        runner.check_sampler(common.PromptSampler(other, seed=5), a.state_dict())
    with pytest.raises(common.UserError, match="it has 6 rows now, the run had 7"):
        runner.check_sampler(common.PromptSampler(rows[:6], seed=5), a.state_dict())


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{4}", "4"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("no box", None),
        ("\\boxed{unclosed", None),
        ("\\fbox{7}", "7"),
    ],
)
def test_last_boxed(text, expected):
    assert common.last_boxed(text) == expected


def test_integer_fast_path_agrees_with_math_verify():
    for gold, pred in [("4", "4"), ("-3", "-3"), ("4", "5"), ("10", "010"), ("-0", "0")]:
        fast = common.grade(f"\\boxed{{{pred}}}", gold).correct
        slow, _ = common._verify_latex(gold, pred, 5)
        assert fast == slow, (gold, pred)


def test_checkpoint_is_atomic_and_pointer_moves_last(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    runner.save_checkpoint(tmp_path, 1, {"": model}, tok, {"step": 1}, keep=2)
    # a crash while writing step 2 leaves a temporary folder behind: the run resumes from step 1
    (tmp_path / ".tmp-checkpoint-2").mkdir()
    assert runner.find_checkpoint(tmp_path).name == "checkpoint-1"
    for step in (2, 3):
        runner.save_checkpoint(
            tmp_path, step, {"": model}, tok, {"step": step, "t": torch.ones(2)}, keep=2
        )
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    ck = runner.find_checkpoint(tmp_path)
    assert ck.name == "checkpoint-3" and runner.load_trainer_state(ck)["step"] == 3
    assert not list(tmp_path.glob(".tmp-checkpoint-3"))


def test_resolve_model_names(tmp_path):
    assert runner.resolve_model_name("Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"
    assert runner.resolve_model_name("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"
    assert runner.resolve_model_name(str(tmp_path)) == str(tmp_path)
    assert runner.is_tiny("tiny") and not runner.is_tiny("Qwen2.5-Math-1.5B")
    with pytest.raises(common.UserError):
        runner.resolve_model_name("NoSuchThing")
    with pytest.raises(common.UserError):
        runner.resolve_model_name("./missing/folder")


def test_adamw_is_fused_on_cuda(monkeypatch):
    """Issue 66: on CUDA, AdamW's default foreach step makes a ~6 GB temporary at 1.5 B."""
    seen, real = [], torch.optim.AdamW

    def recording(params, *a, fused=None, **k):
        seen.append(fused)
        return real([torch.nn.Parameter(torch.zeros(1))], *a, **k)

    class OnCuda:
        is_cuda = True

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    common.make_optimizer([torch.nn.Parameter(torch.zeros(1))], common.RunArgs())
    common.make_optimizer([OnCuda()], common.RunArgs())
    assert seen == [False, True]
