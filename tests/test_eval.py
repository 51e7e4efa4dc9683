"""eval.py: pass@k, grading through common.grade, an end-to-end run on a tiny model, decoding that
ignores the model's generation_config.json, --resume and its settings check, benchmark labels,
--answer-extraction, and one-line errors. CPU only, offline; under a minute."""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import runner  # noqa: E402
import eval as ev  # noqa: E402  (eval.py; the module name only shadows the builtin inside `ev.`)
from common import UserError, grade  # noqa: E402


def tiny_test(n: int) -> list[dict]:
    """The first n problems of the bundled tiny set's held-out split, as its file holds them:
    what eval.py's tiny benchmark is with --eval-n n."""
    lines = (ROOT / "data" / "tiny" / "test.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


# =====================================================================================
# pass@k
# =====================================================================================
def test_pass_at_k_hand_values():
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert ev.pass_at_k(8, 0, 4) == 0.0  # no correct sample
    assert ev.pass_at_k(8, 8, 4) == 1.0  # all correct
    assert ev.pass_at_k(4, 0, 4) == 0.0  # n = k
    assert ev.pass_at_k(4, 1, 4) == 1.0  # n = k, one correct
    assert ev.pass_at_k(4, 2, 3) == 1.0  # n - c < k
    for n, c, k in [(16, 3, 4), (64, 10, 8), (200, 7, 32)]:  # against the binomial formula
        assert ev.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    # large n stays finite and exact to float precision
    assert ev.pass_at_k(100_000, 1, 1) == pytest.approx(1e-5)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)  # k > n


def test_compute_metrics_by_hand():
    def row(i, s, correct, parsed=True, tokens=10, truncated=False):
        return {
            "idx": i,
            "sample": s,
            "correct": correct,
            "parsed": parsed,
            "tokens": tokens,
            "truncated": truncated,
        }

    # problem 0: 1 of 2 correct; problem 1: 0 of 2, one unparsed and truncated
    rows = [
        row(0, 0, True),
        row(0, 1, False),
        row(1, 0, False),
        row(1, 1, False, parsed=False, tokens=30, truncated=True),
    ]
    m = ev.compute_metrics(rows, n_problems=2, n=2, ks=[1, 2, 4], greedy=False)
    assert m["avg@2"] == m["accuracy"] == 0.25
    assert m["pass@1"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert "pass@4" not in m  # k > n is not reported
    assert m["unparsed"] == 1 and m["unparsed_frac"] == 0.25 and m["truncated_frac"] == 0.25
    assert m["mean_completion_tokens"] == 15
    g = ev.compute_metrics([row(0, 0, True), row(1, 0, False)], 2, 1, [1], greedy=True)
    assert g["greedy_pass@1"] == 0.5 and "avg@1" not in g


def test_clean_gold():
    assert ev.clean_gold(["$\\frac{1}{2}$"], "olympiadbench") == "\\frac{1}{2}"
    assert ev.clean_gold(["$3$", "$-1$"], "olympiadbench") == "3, -1"
    assert ev.clean_gold("She pays 3 * 4 = 12.\n#### 1,234", "gsm8k") == "1234"
    assert ev.clean_gold(27.0, "amc23") == "27"
    assert ev.clean_gold(" \\$5 ", "math500") == "\\$5"  # an escaped dollar is not a math delimiter


def test_named_benchmarks_read_their_columns(monkeypatch):
    """Offline stand-ins with the hub layouts (olympiadbench's final_answer is a list of
    '$...$' strings, gsm8k's answer a worked solution, amc23's answer a float)."""
    import datasets

    tables = {
        "math-ai/olympiadbench": {
            "question": ["Find x.", "Find all y."],
            "final_answer": [["$\\frac{1}{2}$"], ["$1$", "$-1$"]],
        },
        "openai/gsm8k": {"question": ["How many?"], "answer": ["2 * 600 = 1200\n#### 1,200"]},
        "math-ai/amc23": {"question": ["What?"], "answer": [27.0]},
        "HuggingFaceH4/aime_2024": {"problem": ["P"], "answer": ["073"]},
        "math-ai/minervamath": {"problem": ["renamed column"], "answer": ["1"]},
    }
    asked = []

    def fake_load(path, name=None, split=None):
        asked.append((path, name, split))
        return datasets.Dataset.from_dict(tables[path])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    args = ev.Args()
    assert ev.load_benchmark("olympiadbench", args)[2] == [
        {"problem": "Find x.", "answer": "\\frac{1}{2}"},
        {"problem": "Find all y.", "answer": "1, -1"},
    ]
    assert ev.load_benchmark("gsm8k", args)[2] == [{"problem": "How many?", "answer": "1200"}]
    assert ev.load_benchmark("amc23", args)[2] == [{"problem": "What?", "answer": "27"}]
    assert ev.load_benchmark("aime24", args)[2][0]["answer"] == "073"
    assert asked[1] == ("openai/gsm8k", "main", "test") and asked[3][2] == "train"
    with pytest.raises(UserError, match="no column 'question'"):  # the hub layout changed
        ev.load_benchmark("minerva", args)
    args.eval_n = 1
    assert len(ev.load_benchmark("olympiadbench", args)[2]) == 1


# =====================================================================================
# Grading through common.grade
# =====================================================================================
@pytest.mark.parametrize(
    "completion, gold, correct, parsed",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True, True),
        ("\\boxed{10\\%}", "0.1", True, True),
        ("\\boxed{42}", "42", True, True),
        ("first \\boxed{41}, no wait: \\boxed{42}", "42", True, True),  # the last box counts
        ("\\boxed{x^2+1}", "1+x^2", True, True),
        ("\\boxed{43}", "42", False, True),
        ("\\boxed{\\frac{1}{3}}", "0.5", False, True),
        ("the answer is 42", "42", False, False),  # no box: unparsed
        ("\\boxed{}", "42", False, False),
    ],
)
def test_grade_cases(completion, gold, correct, parsed):
    g = grade(completion, gold)
    assert (g.correct, g.parsed) == (correct, parsed)


def test_grade_adversarial_is_bounded_and_never_executes(tmp_path):
    marker = tmp_path / "pwned"
    attacks = [
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        f"\\boxed{{exec(\"open('{marker}', 'w')\")}}",
        "\\boxed{9^{9^{9^{9^{9}}}}}",
        "\\boxed{" + "{" * 500 + "1" + "}" * 500 + "}",
    ]
    for text in attacks:
        t0 = time.time()
        g = grade(text, "1", timeout_s=2)
        # gold parse + prediction parse + comparison, each bounded by the timeout
        assert time.time() - t0 < 3 * 2 + 3, text
        assert not g.correct
    assert not marker.exists()


def test_grade_bounded_off_the_main_thread():
    """SIGALRM works only on the main thread; common.grade must still bound the time elsewhere."""
    out = {}

    def work():
        t0 = time.time()
        out["attack"] = grade("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=2)
        out["attack_s"] = time.time() - t0
        out["normal"] = grade("\\boxed{\\frac{1}{2}}", "0.5", timeout_s=2)

    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive(), "grade hung off the main thread"
    assert out["attack_s"] < 3 * 2 + 5 and not out["attack"].correct
    assert out["normal"].correct  # and it still grades correctly afterwards


DEGENERATE = {  # texts a policy could learn to emit; the box-by-box scan took (2-core EPYC):
    "3000 nested boxes": "\\boxed{" * 3000 + "1" + "}" * 3000,  # 3.7 s
    "3000 unclosed boxes": "\\boxed{" * 3000,  # 3.3 s
    "50,000 small boxes (650 kB)": "so \\boxed{1} " * 50_000,  # ~9 s (100,000: 36 s)
}


@pytest.mark.parametrize("name", DEGENERATE)
def test_degenerate_completions_are_graded_quickly(name):
    """Finding the boxes is linear in the completion: 0.1 s at most here; 2 s leaves room for a
    loaded machine. Gold 2 is wrong, so every box is read for the several-boxes rule."""
    t0 = time.perf_counter()
    g = grade(DEGENERATE[name], "2")
    assert time.perf_counter() - t0 < 2, name
    assert not g.correct and not g.timed_out


@pytest.mark.parametrize("name", DEGENERATE)
def test_degenerate_completions_stay_within_the_time_bound_in_free_text(name):
    """--answer-extraction math_verify: math-verify reads the last MAX_TEXT_CHARS characters
    (0.6 s for the nested boxes here, 2.8 s beside three busy processes), each parse bounded."""
    t0 = time.perf_counter()
    g = grade(DEGENERATE[name], "2", timeout_s=2, extraction="math_verify")
    assert time.perf_counter() - t0 < 3 * 2 + 3, name  # gold, prediction, comparison
    assert not g.correct


def _boxed_answers_box_by_box(text: str) -> list[str]:
    """The grader's former reading (quadratic in the length), kept as the reference."""
    out, pos = [], 0
    while True:
        starts = [i for i in (text.find("\\boxed{", pos), text.find("\\fbox{", pos)) if i >= 0]
        if not starts:
            return out
        i = text.index("{", min(starts)) + 1
        depth, j = 1, i
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            out.append(text[i : j - 1].strip())
        pos = i


def test_boxes_are_read_as_before():
    import random

    rng = random.Random(0)
    atoms = ["\\boxed{", "\\fbox{", "{", "}", "1", " x", "\\boxed", "\\frac{1}{2}"]
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        spans = common.boxed_spans(text)
        assert [text[i:j].strip() for i, j in spans] == _boxed_answers_box_by_box(text), text


def test_grades_that_run_out_of_time_are_counted():
    common.take_timeouts()
    deep = "\\boxed{" + "(" * 60 + "1" + ")" * 60 + "}"  # math-verify parses it for seconds
    assert grade(deep, "1", timeout_s=1).timed_out
    assert not grade("\\boxed{\\frac{1}{2}}", "0.5", timeout_s=1).timed_out
    assert common.take_timeouts() == 1 and common.take_timeouts() == 0


# =====================================================================================
# Gold answers: read as written, never through a float
# =====================================================================================
BIG = 123456789012345678901234567890


def test_numeric_gold_answers_keep_every_digit(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from decimal import Decimal

    lines = tmp_path / "big.jsonl"
    lines.write_text(
        json.dumps({"problem": "p", "answer": BIG}) + "\n" + '{"problem": "q", "answer": 12}\n'
    )
    array = tmp_path / "big.json"
    array.write_text(
        '[{"problem": "p", "answer": 3.14159265358979323846}, {"problem": "q", "answer": 0.5}]'
    )
    assert [r["answer"] for r in common.load_problems(str(lines))] == [str(BIG), "12"]
    assert [r["answer"] for r in ev.load_benchmark(str(lines), ev.Args())[2]] == [str(BIG), "12"]
    assert [r["answer"] for r in common.load_problems(str(array))] == [
        "3.14159265358979323846",
        "0.5",
    ]
    # a parquet column holds it as a decimal or as text (pandas cannot write it as an integer)
    for name, column in [
        ("decimal", pa.array([Decimal(BIG), Decimal(12)], pa.decimal128(38, 0))),
        ("text", pa.array([str(BIG), "12"])),
        ("int64", pa.array([2**62 + 1, 12])),
    ]:
        pq.write_table(
            pa.table({"problem": ["p", "q"], "answer": column}), tmp_path / f"{name}.parquet"
        )
        want = str(2**62 + 1) if name == "int64" else str(BIG)
        assert common.load_problems(str(tmp_path / f"{name}.parquet"))[0]["answer"] == want
    # a float column has lost the digits before we read it: refused in one line naming file and
    # row, in training and in eval.py alike (never graded against made-up digits)
    pq.write_table(
        pa.table({"problem": ["p", "q"], "answer": [1.5, float(BIG)]}), tmp_path / "f.parquet"
    )
    with pytest.raises(UserError, match=r"f\.parquet', row 2: the answer 1\.2345678901234568e\+29"):
        common.load_problems(str(tmp_path / "f.parquet"))
    with pytest.raises(UserError, match="benchmark 'amc23', row 7: .* 2\\*\\*53 or more"):
        ev.clean_gold(float(BIG), "amc23", 7)
    assert ev.clean_gold(27.0, "amc23") == "27"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "answer": 1}\n{"problem": "q", answer: 2}\n')
    with pytest.raises(UserError, match="line 2: not JSON"):
        common.load_problems(str(bad))


# =====================================================================================
# A tiny model to run on
# =====================================================================================
def build_random_model(path: Path) -> Path:
    """A random 2-layer Qwen2 with a byte-level tokenizer (one token per byte), as a
    save_pretrained folder; it round-trips through AutoTokenizer unchanged."""
    from tokenizers import pre_tokenizers
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens=specials[1:])
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg)
    # Qwen-like shipped defaults that eval.py must not inherit (it records its own decoding)
    model.generation_config = GenerationConfig(
        eos_token_id=[0, 2],
        pad_token_id=0,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        repetition_penalty=1.05,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (runner.TINY_MODEL_DIR / "config.json").is_file():
        return runner.TINY_MODEL_DIR
    return build_random_model(tmp_path_factory.mktemp("model") / "random-tiny")


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine are far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_argv(model_dir, out, *extra):
    return [
        "--model",
        str(model_dir),
        "--benchmarks",
        "tiny",
        "--template",
        "tiny",
        "--device",
        "cpu",
        "--eval-n",
        "16",
        "--max-new-tokens",
        "40",
        "--gen-batch-size",
        "8",
        "--output-dir",
        str(out),
        *extra,
    ]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# =====================================================================================
# End to end
# =====================================================================================
def test_end_to_end_greedy(model_dir, tmp_path, one_thread):
    assert ev.main(tiny_argv(model_dir, tmp_path)) == 0
    res = json.loads((tmp_path / "tiny.greedy.json").read_text())
    for key in (
        "model",
        "benchmark",
        "metrics",
        "decoding",
        "grader",
        "date",
        "n_problems",
        "n_samples",
        "n_samples_per_problem",
        "samples_file",
    ):
        assert key in res, key
    assert res["benchmark"] == "tiny" and res["n_problems"] == 16 and res["n_samples"] == 16
    assert res["source"] == "data/tiny/test.jsonl"  # the bundled set's held-out split
    assert res["grader"] == "math-verify " + version("math-verify")
    datetime.fromisoformat(res["date"])
    dec = res["decoding"]
    assert dec["greedy"] is True and dec["n"] == 1 and dec["max_new_tokens"] == 40
    assert dec["template"] == "tiny" and dec["top_k"] is None and dec["stop_token_ids"]
    assert dec["tokenizer"] and dec["dtype"] == "float32" and dec["device"] == "cpu"
    m = res["metrics"]
    assert set(m) >= {
        "accuracy",
        "greedy_pass@1",
        "unparsed",
        "unparsed_frac",
        "truncated_frac",
        "mean_completion_tokens",
    }

    rows = read_jsonl(tmp_path / "tiny.greedy.jsonl")
    gold = {i: p["answer"] for i, p in enumerate(tiny_test(16))}
    assert sorted(r["idx"] for r in rows) == list(range(16))
    assert all(r["sample"] == 0 for r in rows)
    for r in rows:
        assert set(r) >= {
            "problem",
            "gold",
            "completion",
            "pred",
            "parsed",
            "correct",
            "tokens",
            "truncated",
        }
        assert r["gold"] == gold[r["idx"]]
        g = grade(r["completion"], r["gold"])
        assert (g.correct, g.parsed, g.pred) == (r["correct"], r["parsed"], r["pred"])
        assert 1 <= r["tokens"] <= 40 and (not r["truncated"] or r["tokens"] == 40)
    assert m["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 16)
    assert m["unparsed"] == sum(not r["parsed"] for r in rows)
    table = (tmp_path / "results.greedy.md").read_text()
    assert "| tiny | 16 |" in table and "greedy_pass@1" in table


def test_loaded_tokenizer_round_trips(model_dir):
    """The model eval.py runs on keeps every character of a prompt through its tokenizer."""
    model, tok = ev.load_model(str(model_dir), torch.device("cpu"), torch.float32, False)
    assert ev.round_trips(tok) and tok.padding_side == "left" and not model.training
    text = common.build_prompt(tok, "7+5-8", "tiny")
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_round_trip_check_catches_a_char_tokenizer_loaded_as_qwen2(tmp_path):
    """transformers 5 loads any qwen2 folder with Qwen2Tokenizer, which drops the newlines and
    spaces of a char-level WordLevel tokenizer.json; eval.py must notice."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    chars = ["<|endoftext|>", "\n"] + [chr(i) for i in range(32, 127)]
    vocab = {t: i for i, t in enumerate(chars)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    assert ev.round_trips(tok)  # as built
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(chars)).save_pretrained(tmp_path)
    assert not ev.round_trips(AutoTokenizer.from_pretrained(tmp_path))  # as transformers reloads it


def test_generate_cuts_at_the_first_eos_by_position(model_dir):
    """Completions end at the first stop id, whichever it is; pad ids after it (equal to EOS in
    Qwen base models) are not counted; no stop id at all means truncated."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    a, b, c = (
        tok("12", add_special_tokens=False)["input_ids"]
        + tok("+", add_special_tokens=False)["input_ids"]
    )
    prompt = [[a, b], [a, b], [a, b]]
    completions = [[c, a, im_end, b, eos], [c, eos, eos, eos, eos], [c, a, b, c, a]]

    class Stub:  # stands in for the model: returns prompt + fixed completions
        device, generation_config = torch.device("cpu"), None

        def generate(self, input_ids, attention_mask, generation_config):
            return torch.cat([input_ids, torch.tensor(completions)], dim=1)

    out = ev.generate(Stub(), tok, prompt, sorted({eos, im_end}))
    assert out[0] == (tok.decode([c, a]), 3, False)
    assert out[1] == (tok.decode([c]), 2, False)
    assert out[2] == (tok.decode([c, a, b, c, a]), 5, True)


def test_generation_defaults_are_not_inherited(model_dir, tmp_path, one_thread, monkeypatch):
    seen = {}
    real = ev.generate

    def spy(model, tok, prompt_ids, stop_ids):
        seen["cfg"] = model.generation_config
        return real(model, tok, prompt_ids, stop_ids)

    monkeypatch.setattr(ev, "generate", spy)
    argv = tiny_argv(model_dir, tmp_path, "--n", "2", "--temperature", "0.9", "--top-p", "0.8")
    assert ev.main(argv) == 0
    cfg = seen["cfg"]
    assert cfg.do_sample and cfg.temperature == 0.9 and cfg.top_p == 0.8 and cfg.top_k == 0
    assert cfg.repetition_penalty in (None, 1.0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert set(cfg.eos_token_id) >= {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert (tmp_path / "tiny.n2-t0.9-p0.8.jsonl").is_file()


def test_metrics_with_an_oracle_generator(model_dir, tmp_path, one_thread, monkeypatch):
    """Generation replaced by an oracle that is right on the first sample of every problem with
    an even answer and wrong otherwise: avg@4, pass@k and the JSONL must agree with that."""
    problems = tiny_test(16)
    answers = {p["problem"]: p["answer"] for p in problems}
    calls = {}

    def oracle(model, tok, prompt_ids, stop_ids):
        out = []
        for text in tok.batch_decode(prompt_ids, skip_special_tokens=True):
            problem = max((p for p in answers if p in text), key=len)
            first = calls.setdefault(problem, 0) == 0
            calls[problem] += 1
            ans = int(answers[problem])
            good = first and ans % 2 == 0
            out.append((f"so \\boxed{{{ans if good else ans + 1}}}", 7, False))
        return out

    monkeypatch.setattr(ev, "generate", oracle)
    argv = tiny_argv(model_dir, tmp_path, "--n", "4", "--temperature", "1", "--pass-k", "1,2,4,8")
    assert ev.main(argv) == 0
    res = json.loads((tmp_path / "tiny.n4-t1-p1.json").read_text())
    even = sum(int(p["answer"]) % 2 == 0 for p in problems)
    assert 0 < even < 16
    m = res["metrics"]
    assert m["avg@4"] == pytest.approx(even / 64)  # one right sample of 4 per even problem
    assert m["pass@1"] == pytest.approx(even / 64)
    assert m["pass@2"] == pytest.approx(even * 0.5 / 16)  # 1 - C(3,2)/C(4,2) = 0.5
    assert m["pass@4"] == pytest.approx(even / 16)
    assert "pass@8" not in m and m["unparsed"] == 0
    rows = read_jsonl(tmp_path / "tiny.n4-t1-p1.jsonl")
    assert len(rows) == 64 and len({(r["idx"], r["sample"]) for r in rows}) == 64
    assert sum(r["correct"] for r in rows) == even


def test_resume_skips_done_samples(model_dir, tmp_path, one_thread, monkeypatch):
    assert ev.main(tiny_argv(model_dir, tmp_path)) == 0
    path = tmp_path / "tiny.greedy.jsonl"
    full = read_jsonl(path)
    # a crash after 11 rows, the last one half written
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:11]) + "\n" + lines[11][:20])

    generated = []
    real = ev.generate

    def counting(model, tok, prompt_ids, stop_ids):
        generated.extend(prompt_ids)
        return real(model, tok, prompt_ids, stop_ids)

    monkeypatch.setattr(ev, "generate", counting)
    assert ev.main(tiny_argv(model_dir, tmp_path, "--resume")) == 0
    assert len(generated) == 5
    rows = read_jsonl(path)
    assert len(rows) == 16 and sorted(r["idx"] for r in rows) == list(range(16))
    assert rows[:11] == full[:11]  # kept as they were
    # exactly the missing ones
    assert {r["idx"] for r in rows[11:]} == {r["idx"] for r in full[11:]}
    assert json.loads((tmp_path / "tiny.greedy.json").read_text())["n_samples"] == 16

    generated.clear()
    assert ev.main(tiny_argv(model_dir, tmp_path, "--resume")) == 0  # nothing left to do
    assert generated == [] and len(read_jsonl(path)) == 16


def test_context_length_and_argument_errors(model_dir, tmp_path):
    with pytest.raises(UserError, match="max_position_embeddings"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, tmp_path, "--max-new-tokens", "100000")))
    with pytest.raises(UserError, match="temperature"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, tmp_path, "--n", "4")))  # greedy, n > 1
    with pytest.raises(UserError, match="template"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, tmp_path, "--template", "nope")))
    with pytest.raises(UserError, match="has no config.json"):
        # no model there
        ev.evaluate(ev.parse_args(["--model", str(tmp_path), "--benchmarks", "tiny"]))


@pytest.mark.skipif(
    not (runner.TINY_MODEL_DIR / "config.json").is_file(), reason="bundled tiny model not built"
)
def test_defaults_for_the_bundled_tiny_model(tmp_path, one_thread):
    assert ev.main(["--limit", "8", "--device", "cpu", "--output-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "tiny.greedy.json").read_text())
    assert res["benchmark"] == "tiny" and res["decoding"]["template"] == "tiny"
    assert res["decoding"]["max_new_tokens"] == 48 and res["n_problems"] == 8


# =====================================================================================
# One-line errors from the command line
# =====================================================================================
def run_cli(*args, cwd=ROOT):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(proc, *needles):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_unknown_benchmark():
    proc = run_cli("--benchmarks", "math501")
    assert_one_line_error(proc, "math501", "math500", "olympiadbench", "gsm8k")


def test_cli_missing_column(tmp_path):
    data = tmp_path / "probs.jsonl"
    data.write_text('{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "4"}\n')
    proc = run_cli("--benchmarks", str(data), "--problem-column", "question")
    assert_one_line_error(proc, "question")


# =====================================================================================
# Decoding follows eval.py's settings, never the model's generation_config.json
# =====================================================================================
# What a Qwen-style generation_config.json may ask for, exaggerated so that greedy output changes
# if any of it leaks in: generate() fills every field its GenerationConfig leaves unset from it.
SHIPPED = {
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.9,
    "repetition_penalty": 1.5,
    "no_repeat_ngram_size": 2,
}


@pytest.fixture
def shipped_model_dir(model_dir, tmp_path):
    """The test model (the bundled tiny one when built) whose generation_config.json asks for
    sampling with top-k 20, top-p 0.9, a repetition penalty and no repeated bigrams."""
    import shutil

    path = tmp_path / "shipped-model"
    shutil.copytree(model_dir, path)
    cfg_path = path / "generation_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg_path.write_text(json.dumps({**cfg, **SHIPPED}))
    return path


@pytest.fixture
def processors(monkeypatch):
    """Every LogitsProcessorList that generate() builds, i.e. what actually shapes the logits."""
    from transformers.generation.utils import GenerationMixin

    seen, real = [], GenerationMixin._get_logits_processor

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        seen.append(list(out))
        return out

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    return seen


def argmax_decode(model, tok, prompt: list[int], stop: set[int], max_new: int) -> list[int]:
    """Greedy decoding by hand, one full forward per token: the reference for greedy eval."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            t = model(torch.tensor([ids])).logits[0, -1].argmax().item()
            out.append(t)
            if t in stop:
                break
            ids.append(t)
    return out


def test_greedy_ignores_the_shipped_generation_config(
    shipped_model_dir, tmp_path, one_thread, processors
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    assert ev.main(tiny_argv(shipped_model_dir, out, "--limit", "6")) == 0
    assert processors and all(p == [] for p in processors)  # nothing reshapes the logits
    rows = read_jsonl(out / "tiny.greedy.jsonl")
    tok = AutoTokenizer.from_pretrained(shipped_model_dir)
    model = AutoModelForCausalLM.from_pretrained(shipped_model_dir, dtype=torch.float32).eval()
    assert model.generation_config.repetition_penalty == 1.5  # the shipped file is as written
    stop = set(ev.stop_token_ids(tok, model))
    for r in rows:
        prompt = tok(common.build_prompt(tok, r["problem"], "tiny"))["input_ids"]
        ref = argmax_decode(model, tok, prompt, stop, 40)
        assert r["completion"] == tok.decode(ref, skip_special_tokens=True), r["problem"]
        assert r["tokens"] == len(ref)


@pytest.mark.parametrize(
    "top_p, expected",
    [
        ("1", {"TemperatureLogitsWarper": ("temperature", 0.7)}),  # top-p 1 and no top-k: no cut
        (
            "0.8",
            {"TemperatureLogitsWarper": ("temperature", 0.7), "TopPLogitsWarper": ("top_p", 0.8)},
        ),
    ],
)
def test_sampling_uses_only_the_requested_warpers(
    shipped_model_dir, tmp_path, one_thread, processors, top_p, expected
):
    argv = tiny_argv(
        shipped_model_dir,
        tmp_path,
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--n",
        "2",
        "--temperature",
        "0.7",
        "--top-p",
        top_p,
    )
    assert ev.main(argv) == 0
    assert processors
    for procs in processors:  # no top-k 20, no shipped top-p, no penalties
        assert {type(p).__name__ for p in procs} == set(expected)
        for p in procs:
            attr, value = expected[type(p).__name__]
            assert getattr(p, attr) == pytest.approx(value)


# =====================================================================================
# --resume only continues the same evaluation
# =====================================================================================
def constant_generate(text="so \\boxed{0}", log=None):
    """Stands in for generation: every completion is `text`; `log` collects the prompts."""

    def gen(model, tok, prompt_ids, stop_ids):
        if log is not None:
            log.extend(prompt_ids)
        return [(text, 5, False) for _ in prompt_ids]

    return gen


@pytest.mark.parametrize(
    "first, second, needle",
    [
        ((), ("--max-new-tokens", "20"), "--max-new-tokens 40 (now 20)"),
        ((), ("--template", "plain"), "--template tiny (now plain)"),
        ((), ("--answer-extraction", "math_verify"), "--answer-extraction boxed (now math_verify)"),
        (
            ("--max-new-tokens", "20", "--template", "plain"),
            (),
            "--template plain (now tiny), --max-new-tokens 20 (now 40)",
        ),
    ],
)
def test_resume_refuses_other_settings(
    model_dir, tmp_path, monkeypatch, capsys, one_line_error, first, second, needle
):
    monkeypatch.setattr(ev, "generate", constant_generate())
    assert ev.main(tiny_argv(model_dir, tmp_path, *first)) == 0
    before = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != ".lock"}
    capsys.readouterr()
    err = one_line_error(ev.main, tiny_argv(model_dir, tmp_path, *second, "--resume"))
    assert err.startswith("error: --resume: ") and needle in err, err
    assert str(tmp_path / "tiny.greedy.jsonl") in err
    # nothing touched (nor is a .lock left: it goes when eval.py ends)
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != ".lock"} == before


def test_resume_refuses_another_model(model_dir, tmp_path, monkeypatch, one_line_error):
    import shutil

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    monkeypatch.setattr(ev, "generate", constant_generate())
    out = tmp_path / "out"
    assert ev.main(tiny_argv(model_dir, out)) == 0
    err = one_line_error(ev.main, tiny_argv(other, out, "--resume"))
    assert f"--model {Path(model_dir).resolve()} (now {other.resolve()})" in err


def test_check_resume_compares_every_recorded_setting(tmp_path):
    """Against a results JSON written by hand: each setting that changes the score is named with
    its old and new values; seed, batch size, dtype and device are not compared."""
    stem = tmp_path / "bench.n4-t0.6-p0.95"
    Path(f"{stem}.jsonl").write_text('{"idx": 0}\n')
    dec = {
        "greedy": False,
        "n": 4,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 0,
        "max_new_tokens": 100,
        "template": "plain",
        "seed": 0,
        "batch_size": 8,
        "dtype": "float32",
        "device": "cpu",
    }
    old = {
        "model": "org/model",
        "decoding": dec,
        "answer_extraction": "boxed",
        "grader": "math-verify 1.0",
    }
    Path(f"{stem}.json").write_text(json.dumps(old))
    ev.check_resume(stem, old)  # the same settings: fine
    ev.check_resume(
        stem,
        {
            **old,
            "decoding": {**dec, "seed": 1, "batch_size": 2, "dtype": "bfloat16", "device": "cuda"},
        },
    )
    changes = [
        ("decoding", "n", 5, "--n 4 (now 5)"),
        ("decoding", "temperature", 0.7, "--temperature 0.6 (now 0.7)"),
        ("decoding", "top_p", 1.0, "--top-p 0.95 (now 1.0)"),
        ("decoding", "max_new_tokens", 50, "--max-new-tokens 100 (now 50)"),
        ("decoding", "template", "qwen_math", "--template plain (now qwen_math)"),
        (None, "model", "org/other", "--model org/model (now org/other)"),
        (None, "answer_extraction", "math_verify", "(now math_verify)"),
        (None, "grader", "math-verify 2.0", "grader math-verify 1.0 (now math-verify 2.0)"),
    ]
    for where, key, value, needle in changes:
        new = {**old, "decoding": {**dec}}
        (new["decoding"] if where else new)[key] = value
        with pytest.raises(UserError, match=re.escape(needle)):
            ev.check_resume(stem, new)
    # a JSON from before --answer-extraction existed was graded on the last \boxed{}
    Path(f"{stem}.json").write_text(
        json.dumps({k: v for k, v in old.items() if k != "answer_extraction"})
    )
    ev.check_resume(stem, old)
    with pytest.raises(UserError, match="answer-extraction boxed"):
        ev.check_resume(stem, {**old, "answer_extraction": "math_verify"})
    # samples without the JSON that says how they were made cannot be resumed
    Path(f"{stem}.json").unlink()
    with pytest.raises(UserError, match="missing or unreadable"):
        ev.check_resume(stem, old)
    Path(f"{stem}.json").write_text('{"model": "org/mo')  # half written
    with pytest.raises(UserError, match="missing or unreadable"):
        ev.check_resume(stem, old)
    Path(f"{stem}.jsonl").write_text("")  # nothing to resume: nothing to check
    ev.check_resume(stem, old)


def test_resume_after_a_crash_checks_the_settings_written_up_front(
    model_dir, tmp_path, monkeypatch, one_line_error
):
    """The settings are on disk before the first sample, so a run killed mid-way is checked too."""
    calls = []

    def crash_on_second_batch(model, tok, prompt_ids, stop_ids):
        calls.append(len(prompt_ids))
        if len(calls) == 2:
            raise RuntimeError("killed")
        return [("\\boxed{0}", 5, False) for _ in prompt_ids]

    monkeypatch.setattr(ev, "generate", crash_on_second_batch)
    with pytest.raises(RuntimeError, match="killed"):
        ev.main(tiny_argv(model_dir, tmp_path))
    res = json.loads((tmp_path / "tiny.greedy.json").read_text())
    assert res["complete"] is False and res["metrics"] is None
    assert res["decoding"]["max_new_tokens"] == 40 and res["answer_extraction"] == "boxed"
    assert len(read_jsonl(tmp_path / "tiny.greedy.jsonl")) == 8  # one batch of 8

    err = one_line_error(
        ev.main, tiny_argv(model_dir, tmp_path, "--max-new-tokens", "30", "--resume")
    )
    assert "--max-new-tokens 40 (now 30)" in err
    generated = []
    monkeypatch.setattr(ev, "generate", constant_generate("\\boxed{0}", generated))
    assert ev.main(tiny_argv(model_dir, tmp_path, "--resume")) == 0
    assert len(generated) == 8
    res = json.loads((tmp_path / "tiny.greedy.json").read_text())
    assert res["complete"] is True and res["n_samples"] == 16 and res["metrics"]["accuracy"] >= 0


def test_cli_resume_with_other_settings_is_one_line(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"idx": 0, "sample": 0, "problem": "1+1", "gold": "2"}]
    (out / "tiny.greedy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "tiny.greedy.json").write_text(
        json.dumps(
            {
                "model": str(Path(model_dir).resolve()),
                "answer_extraction": "boxed",
                "grader": "math-verify " + version("math-verify"),
                "decoding": {
                    "greedy": True,
                    "n": 1,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "max_new_tokens": 40,
                    "template": "tiny",
                },
            }
        )
    )
    proc = run_cli(*tiny_argv(model_dir, out, "--max-new-tokens", "20", "--resume"))
    assert_one_line_error(proc, "--resume", "--max-new-tokens 40 (now 20)")


# =====================================================================================
# Benchmark labels: files with the same name never share outputs
# =====================================================================================
def write_problems(path: Path, problems: list[tuple[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in problems))
    return path


def test_same_file_name_in_two_folders(model_dir, tmp_path, monkeypatch):
    a = write_problems(tmp_path / "a" / "test.jsonl", [("1+1", "2"), ("2+2", "4")])
    b = write_problems(tmp_path / "b" / "test.jsonl", [("3+3", "6"), ("4+4", "8"), ("5+5", "10")])
    monkeypatch.setattr(ev, "generate", constant_generate("\\boxed{4}"))

    def argv(out, benchmarks):
        return [
            "--model",
            str(model_dir),
            "--benchmarks",
            benchmarks,
            "--template",
            "tiny",
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
            "--output-dir",
            str(out),
        ]

    def by_source(out):
        found = {}
        for path in out.glob("*.greedy.json"):
            res = json.loads(path.read_text())
            assert path.name == res["benchmark"] + ".greedy.json"
            found[res["source"]] = res
        return found

    # in one run
    assert ev.main(argv(tmp_path / "one", f"{a},{b}")) == 0
    found = by_source(tmp_path / "one")
    assert set(found) == {str(a.resolve()), str(b.resolve())}
    ra, rb = found[str(a.resolve())], found[str(b.resolve())]
    assert ra["benchmark"] != rb["benchmark"]
    assert ra["benchmark"].startswith("test-") and rb["benchmark"].startswith("test-")  # readable
    assert (ra["n_problems"], rb["n_problems"]) == (2, 3)
    assert ra["metrics"]["accuracy"] == 0.5 and rb["metrics"]["accuracy"] == 0  # own problems
    for res in (ra, rb):
        assert len(read_jsonl(res["samples_file"])) == res["n_problems"]
    table = (tmp_path / "one" / "results.greedy.md").read_text()
    assert f"| {ra['benchmark']} | 2 |" in table and f"| {rb['benchmark']} | 3 |" in table
    # in two runs into the same folder: the second keeps the first's results
    assert ev.main(argv(tmp_path / "two", str(a))) == 0
    assert ev.main(argv(tmp_path / "two", str(b))) == 0
    found = by_source(tmp_path / "two")
    assert [found[str(p.resolve())]["n_problems"] for p in (a, b)] == [2, 3]
    # the label depends on the file, not on how its path is spelled
    monkeypatch.chdir(tmp_path)
    assert ev.load_benchmark("a/test.jsonl", ev.Args())[0] == ra["benchmark"]
    assert ev.load_benchmark(str(a), ev.Args())[0] == ra["benchmark"]


def test_one_benchmark_named_twice_is_an_error(model_dir, tmp_path, monkeypatch):
    a = write_problems(tmp_path / "a.jsonl", [("1+1", "2")])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="twice"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, tmp_path, "--benchmarks", f"a.jsonl,{a}")))
    with pytest.raises(UserError, match="tiny twice"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, tmp_path, "--benchmarks", "tiny,tiny")))


def test_hub_dataset_labels_carry_the_split(monkeypatch):
    monkeypatch.setattr(ev, "load_problems", lambda *a, **kw: [{"problem": "p", "answer": "1"}])
    args = ev.Args()
    assert ev.load_benchmark("org/data", args)[0] == "org__data-test"
    args.split = "train"
    assert ev.load_benchmark("org/data", args)[0] == "org__data-train"
    args.split = "test[:10%]"  # a datasets slice: no brackets, colons or % in file names
    label = ev.load_benchmark("org/data", args)[0]
    assert label.startswith("org__data-test") and re.fullmatch(r"[\w.-]+", label)


# =====================================================================================
# --answer-extraction
# =====================================================================================
def test_answer_extraction_reaches_grade(model_dir, tmp_path, monkeypatch):
    seen = []
    real = ev.grade

    def spy(completion, gold, *a, **kw):
        seen.append(kw.get("extraction"))
        return real(completion, gold, *a, **kw)

    monkeypatch.setattr(ev, "grade", spy)
    monkeypatch.setattr(ev, "generate", constant_generate())
    assert ev.main(tiny_argv(model_dir, tmp_path / "mv", "--answer-extraction", "math_verify")) == 0
    assert seen == ["math_verify"] * 16
    res = json.loads((tmp_path / "mv" / "tiny.greedy.json").read_text())
    assert res["answer_extraction"] == "math_verify"
    seen.clear()
    assert ev.main(tiny_argv(model_dir, tmp_path / "boxed")) == 0  # the default
    assert seen == ["boxed"] * 16
    assert (
        json.loads((tmp_path / "boxed" / "tiny.greedy.json").read_text())["answer_extraction"]
        == "boxed"
    )


def test_answer_extraction_grades_unboxed_answers(model_dir, tmp_path, monkeypatch):
    """A model that never boxes: 'The answer is: <gold>' on even problems, '#### <gold + 1>' on
    odd ones. boxed extraction finds nothing; math_verify finds both and grades them."""
    problems = tiny_test(16)
    answers = {p["problem"]: p["answer"] for p in problems}

    def unboxed(model, tok, prompt_ids, stop_ids):
        out = []
        for text in tok.batch_decode(prompt_ids, skip_special_tokens=True):
            problem = max((p for p in answers if p in text), key=len)
            ans = int(answers[problem])
            out.append((f"The answer is: {ans}" if ans % 2 == 0 else f"#### {ans + 1}", 5, False))
        return out

    monkeypatch.setattr(ev, "generate", unboxed)
    even = sum(int(p["answer"]) % 2 == 0 for p in problems)
    assert 0 < even < 16
    assert ev.main(tiny_argv(model_dir, tmp_path / "boxed")) == 0
    m = json.loads((tmp_path / "boxed" / "tiny.greedy.json").read_text())["metrics"]
    assert m["accuracy"] == 0 and m["unparsed"] == 16
    assert ev.main(tiny_argv(model_dir, tmp_path / "mv", "--answer-extraction", "math_verify")) == 0
    m = json.loads((tmp_path / "mv" / "tiny.greedy.json").read_text())["metrics"]
    assert m["accuracy"] == pytest.approx(even / 16) and m["unparsed"] == 0


def test_cli_unknown_answer_extraction():
    proc = run_cli("--answer-extraction", "regex")
    assert proc.returncode == 2 and "invalid choice: 'regex'" in proc.stderr


# =====================================================================================
# One-line errors during a run
# =====================================================================================
def test_out_of_memory_is_one_line_and_resumable(model_dir, tmp_path, monkeypatch, one_line_error):
    calls = []

    def oom_on_second_batch(model, tok, prompt_ids, stop_ids):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return [("\\boxed{0}", 5, False) for _ in prompt_ids]

    monkeypatch.setattr(ev, "generate", oom_on_second_batch)
    err = one_line_error(ev.main, tiny_argv(model_dir, tmp_path))
    assert err.startswith("error: out of memory") and "--gen-batch-size 8" in err
    assert "--resume" in err and "8 samples done" in err
    assert len(read_jsonl(tmp_path / "tiny.greedy.jsonl")) == 8  # kept for --resume
    monkeypatch.setattr(ev, "generate", constant_generate())
    assert ev.main(tiny_argv(model_dir, tmp_path, "--gen-batch-size", "4", "--resume")) == 0
    assert json.loads((tmp_path / "tiny.greedy.json").read_text())["n_samples"] == 16


def test_output_dir_that_cannot_be_made(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "generate", constant_generate())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot create --output-dir"):
        ev.evaluate(ev.parse_args(tiny_argv(model_dir, blocker / "out")))


# =====================================================================================
# Damaged or mismatched weights, an output folder that cannot be written, non-finite flags:
# one line each, before any work
# =====================================================================================
needs_tiny = pytest.mark.skipif(
    not (runner.TINY_MODEL_DIR / "config.json").is_file(), reason="bundled tiny model not built"
)


def copy_of_tiny(path: Path) -> Path:
    shutil.copytree(runner.TINY_MODEL_DIR, path, ignore=shutil.ignore_patterns("build.py"))
    return path


@pytest.fixture
def lora_checkpoint(tmp_path):
    """(adapters, base): LoRA adapters saved as the training scripts save them (PEFT's format,
    the tokenizer beside), naming their base, a copy of the bundled tiny model, by full path."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = copy_of_tiny(tmp_path / "base")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    model.peft_config["default"].base_model_name_or_path = str(base)
    model.save_pretrained(tmp_path / "checkpoint-1")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "checkpoint-1")
    return tmp_path / "checkpoint-1", base


def cut_short(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def small_argv(model, out):
    return [
        "--model",
        str(model),
        "--benchmarks",
        "tiny",
        "--template",
        "tiny",
        "--eval-n",
        "2",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--output-dir",
        str(out),
    ]


@needs_tiny
def test_a_training_run_folder_scores_its_latest_whole_checkpoint(
    tmp_path, monkeypatch, capsys, one_line_error
):
    """`--model runs/<run>` (the run, not a checkpoint) said "no config.json". It stands for the
    run's latest whole checkpoint, named before anything else; a run with none says so."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "runs" / "grpo-tiny"
    run.mkdir(parents=True)
    (run / "args.json").write_text("{}")  # a run stopped before its first checkpoint
    err = one_line_error(ev.main, small_argv(run, tmp_path / "e0"))
    assert err == (
        f"error: {run} is a training run folder with no whole checkpoint yet: nothing to score "
        f"(its run saves one every --save-every steps)"
    )
    model = AutoModelForCausalLM.from_pretrained(runner.TINY_MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(runner.TINY_MODEL_DIR)
    for step in (1, 2):  # as a training run saves them
        runner.save_checkpoint(run, step, {"": model}, tok, {"step": step})
    monkeypatch.setattr(ev, "generate", constant_generate())
    for out, scored in ((tmp_path / "e1", "checkpoint-2"), (tmp_path / "e2", "checkpoint-1")):
        capsys.readouterr()
        assert ev.main(small_argv(run, out)) == 0
        assert capsys.readouterr().out.splitlines()[0] == (
            f"{run} is a training run folder: scoring its latest whole checkpoint, {run / scored}"
        )
        assert json.loads((out / "tiny.greedy.json").read_text())["model"] == str(run / scored)
        # then checkpoint-2 is cut short (no trainer_state.pt): the newest whole one is scored
        (run / "checkpoint-2" / "trainer_state.pt").unlink(missing_ok=True)


@needs_tiny
def test_cut_short_weights_are_one_line_naming_the_file(tmp_path, lora_checkpoint, one_line_error):
    weights = cut_short(copy_of_tiny(tmp_path / "full") / "model.safetensors")
    err = one_line_error(ev.main, small_argv(weights.parent, tmp_path / "e1"))
    assert f"the weights file {weights} is cut short" in err
    adapters = cut_short(lora_checkpoint[0] / "adapter_model.safetensors")
    err = one_line_error(ev.main, small_argv(adapters.parent, tmp_path / "e2"))
    assert f"the weights file {adapters} is cut short" in err


@needs_tiny
@pytest.mark.parametrize("layers, width", [(4, 64), (2, 128), (6, 128)])  # tiny: 4 layers of 128
def test_adapters_whose_base_folder_holds_another_model_are_one_line(
    layers, width, lora_checkpoint, tmp_path, one_line_error
):
    """Other widths were a state_dict traceback; other depths loaded, the adapters of missing
    layers dropped (or layers left without theirs) with no more than a warning."""
    from transformers import AutoConfig, AutoModelForCausalLM

    adapters, base = lora_checkpoint
    config = AutoConfig.from_pretrained(base)
    config.num_hidden_layers, config.layer_types = layers, ["full_attention"] * layers
    config.hidden_size, config.intermediate_size = width, 3 * width
    AutoModelForCausalLM.from_config(config).save_pretrained(base)  # the base folder, overwritten
    err = one_line_error(ev.main, small_argv(adapters, tmp_path / "e"))
    assert f"the LoRA adapters in {adapters} do not fit the model in {base}" in err


@pytest.fixture
def read_only_dir(tmp_path):
    """An existing folder this process cannot write: read-only permissions, or for root (whom
    permissions do not stop) a read-only file system mounted on it."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    mounted = False
    if os.access(folder, os.W_OK):
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                capture_output=True,
            ).returncode
            == 0
        )
        if not mounted:
            folder.chmod(0o755)
            pytest.skip("cannot make a folder that this user cannot write")
    yield folder
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    folder.chmod(0o755)


def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_work(
    model_dir, read_only_dir, monkeypatch, one_line_error
):
    monkeypatch.setattr(ev, "load_benchmark", lambda *a, **k: pytest.fail("a benchmark was loaded"))
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    err = one_line_error(ev.main, tiny_argv(model_dir, read_only_dir))
    assert err.startswith(f"error: cannot write in --output-dir {read_only_dir}: ")
    err = one_line_error(ev.main, tiny_argv(model_dir, read_only_dir / "new"))
    assert err.startswith(f"error: cannot create --output-dir {read_only_dir / 'new'}: ")


def test_every_float_flag_must_be_finite_before_any_work(
    model_dir, tmp_path, monkeypatch, one_line_error
):
    monkeypatch.setattr(ev, "load_benchmark", lambda *a, **k: pytest.fail("a benchmark was loaded"))
    floats = [f.name for f in dataclasses.fields(ev.Args) if "float" in str(f.type)]
    assert {"temperature", "top_p"} <= {*floats}
    for field in floats:
        flag = "--" + field.replace("_", "-")
        for value in ("inf", "nan", "-inf"):
            err = one_line_error(ev.main, tiny_argv(model_dir, tmp_path, f"{flag}={value}"))
            assert err == f"error: {flag} must be a finite number, not {float(value)}", err
    err = one_line_error(ev.main, tiny_argv(model_dir, tmp_path, "--temperature=-1"))
    assert err == "error: --temperature must be >= 0, not -1.0"  # the range rules are kept


# =====================================================================================
# The house style: the scripts' spellings, each default said once, the scripts' error path
# =====================================================================================
def test_flags_are_spelled_as_the_training_scripts_spell_them():
    import grpo

    ours, theirs = ({f.name for f in dataclasses.fields(a)} for a in (ev.Args, grpo.Args))
    assert {"gen_batch_size", "eval_n", "max_new_tokens", "answer_extraction"} <= ours & theirs
    args = ev.parse_args(["--limit", "3", "--batch-size", "5"])  # eval.py's first spellings
    assert (args.eval_n, args.gen_batch_size) == (3, 5)
    args = ev.parse_args(["--limit=4", "--batch_size=6"])
    assert (args.eval_n, args.gen_batch_size) == (4, 6)
    assert ev.parse_args(["--eval_n", "7"]).eval_n == 7


@pytest.mark.parametrize(
    "typed, error",
    [
        (("--limit", "0"), "--limit must be at least 1, not 0"),
        (("--limit=-2",), "--limit must be at least 1, not -2"),
        (("--eval-n", "0"), "--eval-n must be at least 1, not 0"),
        (("--eval_n", "0"), "--eval-n must be at least 1, not 0"),
        (("--batch-size", "0"), "--batch-size must be at least 1, not 0"),
        (("--batch_size", "0"), "--batch-size must be at least 1, not 0"),
        (("--gen-batch-size", "0"), "--gen-batch-size must be at least 1, not 0"),
        (("--n", "0"), "--n must be at least 1, not 0"),
        (("--max-new-tokens", "0"), "--max-new-tokens must be at least 1, not 0"),  # not 40
        (("--pass-k", "0,4"), "--pass-k values must be at least 1, not 0"),
        (("--eval-n", "5", "--limit", "0"), "--limit must be at least 1, not 0"),  # the last
        (("--limit", "5", "--eval-n", "0"), "--eval-n must be at least 1, not 0"),
    ],
)
def test_a_count_below_one_names_the_flag_as_typed(
    typed, error, model_dir, tmp_path, monkeypatch, one_line_error
):
    """Issue 52: `--limit 0` was answered "--n, --gen-batch-size, --max-new-tokens, --eval-n and
    --pass-k values must be >= 1", naming neither the flag typed nor its value. Checked before
    any work; --limit and --batch-size are the first spellings of --eval-n and --gen-batch-size."""
    monkeypatch.setattr(ev, "load_benchmark", lambda *a, **k: pytest.fail("a benchmark was loaded"))
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert one_line_error(ev.main, tiny_argv(model_dir, tmp_path, *typed)) == f"error: {error}"
    with pytest.raises(UserError, match="^--eval-n must be at least 1, not 0$"):  # args in code
        ev.evaluate(ev.Args(model=str(model_dir), eval_n=0, output_dir=str(tmp_path)))


def test_cli_limit_zero_is_one_line_naming_it():
    assert_one_line_error(run_cli("--limit", "0"), "error: --limit must be at least 1, not 0")


def test_help_says_each_default_once(capsys):
    for f in dataclasses.fields(ev.Args):  # the parser adds "(default: ...)" to every line
        assert "default" not in f.metadata["help"].lower(), f.name
    with pytest.raises(SystemExit):
        ev.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "unset: tiny for the tiny model, else qwen_math" in text  # no "(default: None)"
    assert "(default: None)" not in text and text.count("(default: ") == sum(
        f.default is not None for f in dataclasses.fields(ev.Args)
    )
    assert "completions per generate() call (also --batch-size) (default: 64)" in text
    assert "the same whatever --seed; unset: all (also --limit)" in text  # the first spellings


def test_errors_take_the_scripts_one_line_path(tmp_path, monkeypatch, one_line_error):
    entered = []
    real = runner.user_errors
    monkeypatch.setattr(runner, "user_errors", lambda *a: entered.append(1) or real(*a))
    err = one_line_error(ev.main, ["--benchmarks", "math501", "--output-dir", str(tmp_path)])
    assert entered and err.startswith("error: unknown benchmark 'math501'")


def test_answer_extractions_come_from_the_one_list_in_common(model_dir, tmp_path, monkeypatch):
    def past_the_checks(*a, **k):
        raise UserError("past the checks")

    monkeypatch.setattr(ev, "load_benchmark", past_the_checks)
    monkeypatch.setattr(common, "ANSWER_EXTRACTIONS", (*common.ANSWER_EXTRACTIONS, "new"))
    with pytest.raises(UserError, match="past the checks"):
        ev.evaluate(
            ev.Args(model=str(model_dir), answer_extraction="new", output_dir=str(tmp_path))
        )
    monkeypatch.setattr(common, "ANSWER_EXTRACTIONS", ("boxed",))
    with pytest.raises(UserError, match="--answer-extraction must be one of boxed, not 'math_v"):
        ev.evaluate(
            ev.Args(model=str(model_dir), answer_extraction="math_verify", output_dir=str(tmp_path))
        )


def test_one_output_dir_holds_one_evaluation_at_a_time_and_one_model(
    model_dir, tmp_path, monkeypatch, capsys, one_line_error
):
    """Two eval.py at once into one --output-dir interleaved their rows (918 for 500 problems
    under a summary of 500), and a second model's evaluation replaced the first's results without
    a word. Now the folder is locked while eval.py writes it, another model's results there are
    refused (its own folder keeps both), and replacing the same model's results is said."""
    monkeypatch.setattr(ev, "generate", constant_generate())
    out = tmp_path / "out"
    out.mkdir()
    held = runner.lock_run_folder(out, "--output-dir", "--output-dir")  # as another eval.py
    try:
        err = one_line_error(ev.main, tiny_argv(model_dir, out))
    finally:
        held.close()
    assert f"--output-dir '{out}' is in use by process {os.getpid()}" in err, err
    assert "give another --output-dir" in err and not (out / "tiny.greedy.jsonl").exists()
    assert ev.main(tiny_argv(model_dir, out)) == 0  # free again: the first evaluation
    assert not (out / ".lock").exists()  # it named a process that had ended
    before = {p.name: p.read_text() for p in out.iterdir() if p.name != ".lock"}

    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    err = one_line_error(ev.main, tiny_argv(other, out))
    assert err.startswith(f"error: --output-dir {out} holds results of another model"), err
    assert str(Path(model_dir).resolve()) in err and "tiny.greedy.json" in err, err
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != ".lock"} == before
    capsys.readouterr()
    assert (
        ev.main(tiny_argv(model_dir, out)) == 0
    )  # the same model again: it starts over, and says so
    assert f"tiny: replacing the earlier results in {out} (--resume keeps them)" in (
        capsys.readouterr().out
    )
    assert len(read_jsonl(out / "tiny.greedy.jsonl")) == 16


def test_a_kill_while_writing_the_results_keeps_them_whole(model_dir, tmp_path, monkeypatch):
    """Issue 52: the results JSON was written in place, so a kill in the middle of that write
    left half a file, and --resume then refused the samples it records the settings of. Now it
    is written beside and renamed: the file on disk is the old one or the new one, whole."""
    monkeypatch.setattr(ev, "generate", constant_generate("\\boxed{0}", []))
    assert ev.main(tiny_argv(model_dir, tmp_path)) == 0
    result = tmp_path / "tiny.greedy.json"
    before = json.loads(result.read_text())
    real = Path.write_text

    def killed_mid_write(self, text, *a, **k):  # half the text reaches the disk, then the kill
        if self.suffix == ".json" or self.name.endswith(".json.tmp"):
            real(self, text[: len(text) // 2], *a, **k)
            raise KeyboardInterrupt
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", killed_mid_write)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        ev.main(tiny_argv(model_dir, tmp_path, "--resume"))
    monkeypatch.setattr(Path, "write_text", real)
    assert json.loads(result.read_text()) == before  # whole, as it was
    assert ev.main(tiny_argv(model_dir, tmp_path, "--resume")) == 0
    assert json.loads(result.read_text())["complete"] is True


def test_every_json_type_of_gold_answer_is_one_rule_in_training_and_eval(tmp_path):
    """Issue 67: a JSON-lines answer ["4", "6"] trained with gold "['4', '6']" (Python's repr),
    which math-verify reads as an interval, so \\boxed{4, 6} scored 0; and eval.py read a local
    file its own way. One rule (common.gold_text) for string, int, float, list and null, graded
    as written, in training and in eval.py; true/false and an object refused naming file and row."""
    good = tmp_path / "good.jsonl"
    answers = ["x = 3 ", 12, 0.5, ["4", "6"], [1, 2], None]
    good.write_text(
        "".join(json.dumps({"problem": f"p{i}", "answer": a}) + "\n" for i, a in enumerate(answers))
    )
    want = ["x = 3", "12", "0.5", "4, 6", "1, 2"]  # null: no answer, its row dropped
    assert [r["answer"] for r in common.load_problems(str(good))] == want
    assert [r["answer"] for r in ev.load_benchmark(str(good), ev.Args())[2]] == want
    assert grade("so \\boxed{4, 6}", "4, 6").correct  # graded as the user wrote it
    assert not grade("so \\boxed{4}", "4, 6").correct
    for bad, shown in [(True, "True"), ({"value": 4}, "{'value': 4}")]:
        path = tmp_path / "bad.jsonl"
        path.write_text(
            '{"problem": "p", "answer": "1"}\n' + json.dumps({"problem": "q", "answer": bad})
        )
        for load in (common.load_problems, lambda p: ev.load_benchmark(p, ev.Args())):
            with pytest.raises(
                UserError, match=rf"bad\.jsonl', row 2: the answer {re.escape(shown)}"
            ):
                load(str(path))


@pytest.mark.parametrize("signals", [["SIGINT"], ["SIGINT", "SIGINT"], ["SIGTERM"], ["SIGHUP"]])
def test_every_way_eval_is_stopped_is_one_line_and_the_rerun_finishes(
    tmp_path, signals, terminal_signals
):
    """Issue 67: Ctrl-C was a KeyboardInterrupt traceback (user_errors re-raised it outside a
    training run). Ctrl-C, a second Ctrl-C, SIGTERM and SIGHUP each end eval.py in one line,
    nonzero, and --resume keeps what was written and adds the rest."""
    argv = [sys.executable, str(ROOT / "eval.py"), "--model", "tiny", "--benchmarks", "tiny"]
    argv += ["--eval-n", "64", "--n", "4", "--temperature", "1", "--gen-batch-size", "4"]
    argv += ["--device", "cpu", "--output-dir", str(tmp_path)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=terminal_signals,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(tmp_path.glob("*.jsonl")):
            time.sleep(0.1)
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    sig = getattr(signal, signals[0])
    assert proc.returncode == 128 + sig, err[-2000:]
    shown = "Ctrl-C" if sig == signal.SIGINT else signals[0]
    said = [line for line in err.splitlines() if "stopped" in line]  # beside the progress bars
    assert len(said) == 1 and f"stopped by {shown}: the samples written so far are kept" in said[0]
    assert "Traceback" not in err and not (tmp_path / ".lock").exists()
    (done,) = tmp_path.glob("*.jsonl")
    assert ev.main([*argv[2:], "--resume"]) == 0
    rows = read_jsonl(done)
    assert sorted((r["idx"], r["sample"]) for r in rows) == [
        (i, s) for i in range(64) for s in range(4)
    ]
