"""Score a model or a checkpoint on math benchmarks: greedy pass@1, or avg@n and pass@k.

    python eval.py                                    # bundled tiny model, tiny task, CPU, offline
    python eval.py --model runs/<run>/checkpoint-200  # a checkpoint saved by grpo.py, dapo.py...
                                                      # (a LoRA run's adapters too: merged on load)
    python eval.py --model runs/<run>                 # the run's latest whole checkpoint, named
    python eval.py --model Qwen2.5-Math-1.5B \\
        --benchmarks math500,aime24,amc23,minerva,olympiadbench,gsm8k
    python eval.py --model Qwen2.5-Math-1.5B --benchmarks aime24,amc23 \\
        --n 16 --temperature 0.6 --top-p 0.95 --pass-k 1,4,16
    python eval.py --model Qwen2.5-Math-1.5B --benchmarks my.jsonl \\
        --problem-column question --answer-column answer

Per benchmark: prompts go through the template (common.build_prompt); Hugging Face `generate` runs
batches of similar-length prompts (left padding) and stops on every EOS id the model uses (tokenizer
EOS, generation_config EOS list, `<|im_end|>`); common.grade checks the completion's answer against
the gold answer with math-verify (gold first, time-bounded, never eval()). --answer-extraction picks
the answer: `boxed` (the default) the last \\boxed{} (common.grade has a rule for several boxes);
`math_verify` math-verify's own extraction of the final answer from the whole text (for models that
end with "The answer is: 42" or "#### 42").

Decoding follows eval.py's flags and nothing else: transformers fills every field a GenerationConfig
leaves unset from the model's generation_config.json (Qwen instruct models ship sampling with top_k,
top_p and a repetition penalty), so on load it is replaced by one with only its special tokens.

Metrics: greedy (the default, --temperature 0) gives `greedy_pass@1`; sampling (--temperature > 0,
--n N) gives `avg@N` (mean accuracy over all samples) and `pass@k` for each k <= N in --pass-k, with
the unbiased estimator 1 - C(N-c, k) / C(N, k) (Chen et al. 2021). Always: `accuracy` (mean over
samples), unparsed (no answer extracted that math-verify could parse), truncated (no EOS in budget).

Context: prompt tokens + --max-new-tokens must fit max_position_embeddings. Every prompt of every
benchmark is checked before anything is generated, and one that does not fit is an error saying how
far to lower --max-new-tokens (nothing is silently dropped, so scores stay comparable).

Defaults follow the model: the tiny model, and checkpoints trained from it (same architecture in
config.json), get --benchmarks tiny --template tiny --max-new-tokens 48; anything else gets math500,
qwen_math and 3000 (Qwen2.5-Math has a 4096-token context).

Outputs in --output-dir (default runs/eval/<model-name>/); <tag> is `greedy` or `n16-t0.6-p0.95`:
    <benchmark>.<tag>.json    model, benchmark, decoding settings, answer extraction, grader
                              version, date, counts; written with "complete": false before the
                              first sample, then again with the metrics and "complete": true
    <benchmark>.<tag>.jsonl   one row per sample: problem, gold, completion, extracted answer,
                              correct
    results.<tag>.md          the markdown table printed at the end
<benchmark> is the short name (math500), `org__name-<split>` for a hub dataset id, or the file name
plus a short hash of its full path for a local file (`test-1a2b3c`), so two files called test.jsonl
in different folders never overwrite each other's results. One eval.py at a time writes a folder
(it is locked, as a training run's), and a folder holds one model's results: another model's there
are refused (give it another --output-dir); the same model's are replaced by a run without
--resume, which says so.

--resume keeps the rows already in <benchmark>.<tag>.jsonl (same problem and gold at the same
position) and generates only the rest. Mixing rows made with other settings would make one score of
two evaluations, so it refuses, naming the setting, when the earlier run's .json records another
--model, --template, --max-new-tokens, --temperature, --top-p, --n, --answer-extraction or grader
version (--seed, --gen-batch-size, --dtype and --device may change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

# Before torch loads OpenMP: its idle threads then sleep instead of spinning, so a run keeps its
# pace beside another job (tools/bench.py, docs/speed.md). An OMP_WAIT_POLICY already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm import tqdm

import common
import runner
from common import (
    BUNDLED,
    ROOT,
    TEMPLATES,
    UserError,
    arg,
    build_prompt,
    first_line,
    flag,
    gold_text,
    grade,
    load_problems,
)
from runner import (
    TINY_MODEL_DIR,
    check_model_folder,
    is_tiny,
    resolve_device,
    resolve_model_name,
)


# =====================================================================================
# Benchmarks: short name -> where it lives on the hub and which columns hold what
# =====================================================================================
@dataclass(frozen=True)
class Benchmark:
    hub_id: str
    config: str | None
    split: str
    problem_column: str
    answer_column: str


# Config, split and columns checked against the sources cited in tests/fixtures/hub/<hub id>/
# README.md (an excerpt of each set, loaded as the hub set by tests/test_benchmarks.py)
BENCHMARKS = {
    "math500": Benchmark("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
    "aime24": Benchmark("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),
    "amc23": Benchmark("math-ai/amc23", None, "test", "question", "answer"),
    "minerva": Benchmark("math-ai/minervamath", None, "test", "question", "answer"),
    "olympiadbench": Benchmark("math-ai/olympiadbench", None, "test", "question", "final_answer"),
    "gsm8k": Benchmark("openai/gsm8k", "main", "test", "question", "answer"),
}
KNOWN = ", ".join(["tiny", "words", *BENCHMARKS])
# --eval-n picks the same problems whatever --seed is, so runs stay comparable (common.load_problems
# samples files and hub sets with this seed too; of a bundled set it takes the first rows)
SUBSET_SEED = 0


# The flags are spelled as the training scripts spell the same settings (--eval-n, --gen-batch-size;
# eval.py's first spellings, --limit and --batch-size, still work). A flag left unset (None) says
# in its help what it then follows; the parser adds each default once, as "(default: ...)".
@dataclass
class Args:
    model: str = arg(
        "tiny",
        "'tiny' (the bundled model), a checkpoint folder such as "
        "runs/<run>/checkpoint-N, a run folder (its latest checkpoint), a hub id, or a short "
        "Qwen name such as Qwen2.5-Math-1.5B",
    )
    benchmarks: str | None = arg(
        None,
        f"comma-separated list of: {KNOWN}, a .jsonl/.json/.parquet "
        "file, or a hub dataset id (org/name); unset: tiny for the tiny "
        "model, else math500",
    )
    split: str = arg(
        "test",
        "split of a hub dataset id given in --benchmarks (the named benchmarks know their own)",
    )
    problem_column: str | None = arg(
        None, "problem column of a file or hub dataset id in --benchmarks; unset: 'problem'"
    )
    answer_column: str | None = arg(
        None, "gold-answer column of a file or hub dataset id in --benchmarks; unset: 'answer'"
    )
    eval_n: int | None = arg(
        None,
        "problems per benchmark: a fixed random subset of this many, "
        "the same whatever --seed; unset: all (also --limit)",
        aliases=["--limit"],
    )
    template: str | None = arg(
        None,
        f"prompt template, one of {', '.join(TEMPLATES)}; unset: tiny "
        "for the tiny model, else qwen_math",
    )
    n: int = arg(1, "samples per problem (needs --temperature > 0 when > 1)")
    temperature: float = arg(0.0, "0 = greedy decoding; > 0 = sampling")
    top_p: float = arg(1.0, "nucleus sampling threshold (sampling only)")
    pass_k: str = arg(
        "1,2,4,8,16,32,64,128,256", "k values for pass@k; only those <= --n are reported"
    )
    answer_extraction: str = arg(
        "boxed",
        "which answer is graded: boxed = the last \\boxed{} of "
        "the completion; math_verify = math-verify's own extraction of "
        "the final answer from the whole text (for models that answer "
        "'The answer is: 42' or '#### 42')",
        choices=list(common.ANSWER_EXTRACTIONS),
    )
    max_new_tokens: int | None = arg(
        None, "generation budget per sample; unset: 48 for the tiny model, else 3000"
    )
    gen_batch_size: int = arg(
        64, "completions per generate() call (also --batch-size)", aliases=["--batch-size"]
    )
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = arg("auto", "auto (bf16 on cuda, fp32 on cpu), bf16, fp16 or fp32")
    seed: int = arg(0, "seed for sampling (reset before each benchmark)")
    trust_remote_code: bool = arg(False, "allow model code from the hub")
    output_dir: str | None = arg(None, "where results go; unset: runs/eval/<model-name>/")
    resume: bool = arg(
        False,
        "keep samples already in the JSONL of an earlier run with the same "
        "decoding tag and generate only the rest; refused if that run used another "
        "--model, --template, --max-new-tokens, --temperature, --top-p, --n or "
        "--answer-extraction",
    )


def clean_gold(value, benchmark: str, row: int = 0) -> str:
    """A benchmark's gold answer as one LaTeX string: common.gold_text's rule for strings,
    numbers and lists (the same as in training), then the benchmark's own wrapping removed."""
    if isinstance(value, (list, tuple)):  # olympiadbench: a list, several for multi-answer problems
        return ", ".join(clean_gold(v, benchmark, row) for v in value)
    text = gold_text(value, f"benchmark {benchmark!r}, row {row}") or ""
    if benchmark == "gsm8k":  # a worked solution ending in '#### 1,234'
        text = text.split("####")[-1].strip().replace(",", "")
    while len(text) >= 2 and text[0] == text[-1] == "$":  # olympiadbench writes '$x=3$'
        text = text[1:-1].strip()
    return text


def safe(text: str) -> str:
    """Only characters that are harmless in a file name (a split may be 'test[:100]')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def file_label(path: Path) -> str:
    """'data/a/test.jsonl' -> 'test-1a2b3c': the file name stays readable and the hash of the full
    path keeps a/test.jsonl and b/test.jsonl apart, in one run or in two into the same folder."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:6]
    return f"{safe(path.stem)}-{digest}"


def load_benchmark(name: str, args: Args) -> tuple[str, str, list[dict]]:
    """(label used in file names, where it came from, [{'problem', 'answer'}])."""
    if name in BUNDLED:  # the held-out split of a bundled set (tiny, words), always the same
        problems = load_problems(name, "test", limit=args.eval_n)
        return name, str((common.DATA / name / "test.jsonl").relative_to(ROOT)), problems
    import datasets  # heavy, so only imported once a hub or file data set is asked for

    datasets.disable_progress_bars()  # benchmarks are small; the bars would only clutter stderr
    if name in BENCHMARKS:
        b = BENCHMARKS[name]
        try:
            ds = datasets.load_dataset(b.hub_id, b.config, split=b.split)
        except Exception as e:  # offline, renamed, gated: one line, not a traceback
            raise UserError(
                f"cannot load benchmark {name!r} ({b.hub_id}, split {b.split!r}): {first_line(e)}"
            ) from None
        missing = [c for c in (b.problem_column, b.answer_column) if c not in ds.column_names]
        if missing:
            raise UserError(
                f"benchmark {name!r} ({b.hub_id}) has no column {missing[0]!r} "
                f"(columns: {', '.join(ds.column_names)})"
            )
        rows = [
            {"problem": str(p), "answer": clean_gold(a, name, n)}
            for n, (p, a) in enumerate(zip(ds[b.problem_column], ds[b.answer_column]), 1)
        ]
        rows = [r for r in rows if r["problem"].strip() and r["answer"]]
        if not rows:
            raise UserError(
                f"benchmark {name!r} ({b.hub_id}) has no rows with a problem and an answer"
            )
        if args.eval_n is not None and args.eval_n < len(rows):
            rows = random.Random(SUBSET_SEED).sample(rows, args.eval_n)
        return name, f"{b.hub_id} ({b.split})", rows
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".json", ".parquet") or "/" in name:  # a file or a hub id
        rows = load_problems(
            name,
            args.split,
            args.problem_column,
            args.answer_column,
            limit=args.eval_n,
        )
        if path.suffix:
            return file_label(path), str(path.resolve()), rows
        return f"{safe(name.replace('/', '__'))}-{safe(args.split)}", f"{name} ({args.split})", rows
    raise UserError(f"unknown benchmark {name!r}; known: {KNOWN}, or a .jsonl/.json/.parquet file")


# =====================================================================================
# Model
# =====================================================================================
def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    dtypes = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in dtypes:
        raise UserError(f"unknown --dtype {name!r}; use auto, bf16, fp16 or fp32")
    return dtypes[name]


def round_trips(tok) -> bool:
    probe = "12 + 3 = 15\n\\boxed{15}"
    return tok.decode(tok(probe, add_special_tokens=False)["input_ids"]) == probe


def load_model(path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    adapter = Path(path) / "adapter_config.json"  # a LoRA checkpoint: its base, plus its adapters
    base = (
        json.loads(adapter.read_text()).get("base_model_name_or_path")
        if adapter.is_file()
        else path
    )
    for folder in dict.fromkeys([path, base]):  # weights cut short: one line naming the file
        damage = runner.damaged_weights(Path(folder)) if Path(folder).is_dir() else None
        if damage:
            raise UserError(f"cannot load model {path!r}: {damage}")
    if adapter.is_file() and base and not Path(base).is_dir():  # adapters on a hub model
        check_model_folder(base)  # in the local cache, or the hub within reach
    try:
        tok = AutoTokenizer.from_pretrained(
            path, padding_side="left", trust_remote_code=trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # missing folder, unknown hub id, offline, remote code, a bad file
        hint = " (the bundled tiny model is not built yet?)" if Path(path) == TINY_MODEL_DIR else ""
        hint += f" (the base model of its LoRA adapters, {base!r})" if adapter.is_file() else ""
        raise UserError(f"cannot load model {path!r}{hint}: {first_line(e)}") from None
    if adapter.is_file():
        model = load_adapters(model, path, base)
    # generate() fills every field its GenerationConfig leaves unset (None) from
    # model.generation_config, i.e. from the model's generation_config.json, which may ask for
    # sampling, top_k, top_p, a repetition penalty... Keep only its special-token ids, so decoding
    # is exactly what evaluate() sets and the results JSON records.
    shipped = model.generation_config
    model.generation_config = GenerationConfig(
        eos_token_id=shipped.eos_token_id,
        pad_token_id=shipped.pad_token_id,
        bos_token_id=shipped.bos_token_id,
    )
    if not round_trips(tok):
        # e.g. transformers 5 loads every qwen2 folder with Qwen2Tokenizer (byte-level BPE), which
        # silently drops the newlines and spaces of a char-level WordLevel tokenizer.json
        print(
            f"warning: the tokenizer of {path} ({type(tok).__name__}) does not round-trip text; "
            f"prompts may not be what the model was trained on",
            file=sys.stderr,
        )
    return model.to(device).eval(), tok


def load_adapters(model, path: str, base: str):
    """The base model with the LoRA adapters in `path`, merged (it generates at full speed). The
    adapters must fit it exactly: PEFT refuses other shapes in a traceback, and loads adapters
    for other layers (a model with more or fewer layers) with no more than a warning."""
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError:
        raise UserError(f"{path} holds LoRA adapters, which need peft: pip install peft") from None
    from safetensors import safe_open

    def misfit(why: str) -> UserError:
        return UserError(
            f"the LoRA adapters in {path} do not fit the model in {base}, the base "
            f"folder they name ({why}): is it still the model they were trained "
            f"from?"
        )

    try:
        model = PeftModel.from_pretrained(model, path)
    except Exception as e:  # another architecture or other shapes
        mismatch = re.search(
            r"size mismatch for (\S+): copying a param with shape (.+?) from "
            r"checkpoint, the shape in current model is (.+?)\.?$",
            str(e),
            re.M,
        )
        if mismatch is None:
            raise misfit(first_line(e)) from None
        name, saved, here = (re.sub(r"torch\.Size\((.*)\)", r"\1", x) for x in mismatch.groups())
        raise misfit(
            f"{name.removeprefix('base_model.model.')} is {saved} in the adapters, "
            f"{here} in the model"
        ) from None
    weights = Path(path) / "adapter_model.safetensors"
    if weights.is_file():  # the same shapes, but adapters for other layers than the model's
        with safe_open(str(weights), "pt") as f:
            saved = set(f.keys())
        places = set(get_peft_model_state_dict(model))
        extra, missing = sorted(saved - places), sorted(places - saved)
        if extra:
            raise misfit(
                f"{len(extra)} of their weights have no place in it, e.g. "
                f"{extra[0].removeprefix('base_model.model.')}"
            )
        if missing:
            raise misfit(
                f"{len(missing)} of its adapter weights have none saved, e.g. "
                f"{missing[0].removeprefix('base_model.model.')}"
            )
    return model.merge_and_unload()


# ----- As the training scripts: their skeleton's functions, the same text (tests/test_skeleton.py)
def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS, the model's (Qwen lists
    <|endoftext|> and <|im_end|>), and <|im_end|> whenever the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T] long: 1 up to and including the first EOS, 0 after. Built by position,
    never by `token != pad`: Qwen base models pad with their EOS, and the EOS must be trained."""
    eos = torch.tensor(eos_ids, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)  # [B, T]
    T = completion_ids.shape[1]
    no_eos = torch.full_like(is_eos[:, 0], T, dtype=torch.long)  # no EOS: valid to its end
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)  # [B]: the first 1
    positions = torch.arange(T, device=completion_ids.device)[None, :]  # [1, T]
    return (positions <= first_eos[:, None]).long()


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Text of each completion up to its first EOS; what generate() padded after it is dropped."""
    return [
        tokenizer.decode(ids[:n], skip_special_tokens=True)
        for ids, n in zip(completion_ids.tolist(), mask.sum(1).tolist())
    ]


def stop_token_ids(tok, model) -> list[int]:
    """Every id that ends a completion, as the training scripts stop on them (eos_token_ids):
    Qwen2.5-Math ends text with <|endoftext|> and chat turns with <|im_end|>, and may emit
    either."""
    ids = eos_token_ids(model, tok)
    if not ids:
        raise UserError("the model's tokenizer and generation config name no EOS token")
    return ids


@torch.inference_mode()
def generate(model, tok, prompt_ids: list[list[int]], stop_ids: list[int]):
    """One batch -> [(completion text, completion tokens up to and including EOS, truncated)],
    decoded with model.generation_config (which evaluate() sets)."""
    enc = tok.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**enc, generation_config=model.generation_config)
    ids = out[:, enc["input_ids"].shape[1] :]  # [b, T]
    # Cut at the first EOS by position: after it come pad ids, which may equal EOS.
    mask = completion_mask(ids, stop_ids)  # [b, T]
    stops = torch.tensor(stop_ids, device=ids.device)
    truncated = ~torch.isin(ids, stops).any(1)  # no EOS within the budget
    return list(zip(decode_completions(tok, ids, mask), mask.sum(1).tolist(), truncated.tolist()))


# =====================================================================================
# Metrics
# =====================================================================================
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), written as a
    product so large n neither overflows nor loses precision (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def compute_metrics(rows: list[dict], n_problems: int, n: int, ks: list[int], greedy: bool) -> dict:
    correct = defaultdict(int)
    for r in rows:
        correct[r["idx"]] += bool(r["correct"])
    acc = sum(correct.values()) / len(rows)
    m = {"accuracy": acc}
    if greedy:
        m["greedy_pass@1"] = acc
    else:
        m[f"avg@{n}"] = acc
        for k in (k for k in ks if k <= n):
            m[f"pass@{k}"] = (
                sum(pass_at_k(n, correct[i], k) for i in range(n_problems)) / n_problems
            )
    m["unparsed"] = sum(not r["parsed"] for r in rows)
    m["unparsed_frac"] = m["unparsed"] / len(rows)
    m["truncated_frac"] = sum(r["truncated"] for r in rows) / len(rows)
    m["mean_completion_tokens"] = sum(r["tokens"] for r in rows) / len(rows)
    return m


def markdown_table(results: list[dict]) -> str:
    keys = [k for k in results[0]["metrics"] if k.startswith(("greedy_pass@", "avg@", "pass@"))]
    lines = [
        "| benchmark | problems | " + " | ".join(keys) + " | unparsed | truncated | tokens |",
        "|---" * (len(keys) + 5) + "|",
    ]

    def row(label, problems, ms):
        cells = [f"{100 * sum(m[k] for m in ms) / len(ms):.1f}" for k in keys]
        cells += [
            f"{100 * sum(m[k] for m in ms) / len(ms):.1f}%"
            for k in ("unparsed_frac", "truncated_frac")
        ]
        cells.append(f"{sum(m['mean_completion_tokens'] for m in ms) / len(ms):.0f}")
        return f"| {label} | {problems} | " + " | ".join(cells) + " |"

    for r in results:
        lines.append(row(r["benchmark"], r["n_problems"], [r["metrics"]]))
    if len(results) > 1:  # unweighted mean over benchmarks, as papers report it
        lines.append(
            row("mean", sum(r["n_problems"] for r in results), [r["metrics"] for r in results])
        )
    return "\n".join(lines)


# =====================================================================================
# One benchmark: resume, generate, grade, write
# =====================================================================================
def read_done(path: Path, problems: list[dict], n: int) -> list[dict]:
    """Rows of an earlier run that still match: same problem and gold at the same position."""
    if not path.is_file():
        return []
    keep = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run that was killed mid-write
            continue
        i, s = r.get("idx"), r.get("sample")
        if (
            isinstance(i, int)
            and 0 <= i < len(problems)
            and isinstance(s, int)
            and 0 <= s < n
            and problems[i]["problem"] == r.get("problem")
            and problems[i]["answer"] == r.get("gold")
        ):
            keep[(i, s)] = r
    return list(keep.values())


def resume_settings(result: dict) -> dict:
    """The settings that rows kept by --resume must share with this run, keyed by the flag that
    sets them; `result` is a results JSON or evaluate()'s settings (same layout)."""
    dec = result.get("decoding") or {}
    keys = {
        "--model": model_id(str(result.get("model"))),
        "--template": dec.get("template"),
        "--max-new-tokens": dec.get("max_new_tokens"),
        "--n": dec.get("n"),
        "--temperature": dec.get("temperature"),
        # results from before --answer-extraction existed were all graded on the last \boxed{}
        "--answer-extraction": result.get("answer_extraction", "boxed"),
        "grader": result.get("grader"),
    }
    if not dec.get("greedy", True):  # top_p does nothing in greedy decoding
        keys["--top-p"] = dec.get("top_p")
    return keys


def check_resume(stem: Path, settings: dict) -> None:
    """Refuse to resume rows that were made with other settings: the score would mix two evals."""
    samples, result = Path(f"{stem}.jsonl"), Path(f"{stem}.json")
    if not samples.is_file():
        return  # nothing to resume
    with open(samples) as f:
        if not f.read(4096).strip():
            return  # nothing to resume
    try:
        old = resume_settings(json.loads(result.read_text()))
    except (OSError, ValueError, AttributeError):  # missing, half written, not a JSON object
        raise UserError(
            f"--resume: {samples} has samples but {result}, which records the settings "
            f"they were made with, is missing or unreadable; rerun without --resume "
            f"to start over"
        ) from None
    new = resume_settings(settings)
    diff = [
        f"{k} {old.get(k)} (now {new.get(k)})"
        for k in dict.fromkeys([*old, *new])
        if old.get(k) != new.get(k)
    ]
    if diff:
        raise UserError(
            f"--resume: {samples} was made with {', '.join(diff)}; rerun with those "
            f"settings, or without --resume to start over"
        )


def run_benchmark(
    label: str,
    source: str,
    problems: list[dict],
    prompt_ids: list[list[int]],
    model,
    tok,
    args: Args,
    settings: dict,
    stem: Path,
) -> dict:
    samples_path, result_path = Path(f"{stem}.jsonl"), Path(f"{stem}.json")
    rows = read_done(samples_path, problems, args.n) if args.resume else []
    decoding = settings["decoding"]
    result = {
        "model": settings["model"],
        "model_arg": args.model,
        "benchmark": label,
        "source": source,
        "complete": False,
        "n_problems": len(problems),
        "n_samples_per_problem": args.n,
        "n_samples": len(rows),
        "metrics": None,
        "decoding": decoding,
        "answer_extraction": settings["answer_extraction"],
        "grader": settings["grader"],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "limit": args.eval_n,
        "elapsed_s": None,
        "samples_file": str(samples_path),
    }
    # The settings reach the disk before any sample does, so that a --resume after a crash can
    # check it continues the same evaluation.
    runner.write_text(result_path, json.dumps(result, indent=2) + "\n")  # whole or not at all
    # rewritten, whole or not at all: only the rows that still count stay
    runner.write_text(samples_path, "".join(json.dumps(r) + "\n" for r in rows))
    done = {(r["idx"], r["sample"]) for r in rows}
    todo = [(i, s) for i in range(len(problems)) for s in range(args.n) if (i, s) not in done]
    if rows:
        print(f"{label}: resuming, {len(rows)} samples done, {len(todo)} to go")
    # Longest prompts first: similar lengths share a batch (little padding), and running out of
    # memory happens in the first batch rather than an hour in.
    todo.sort(key=lambda t: (-len(prompt_ids[t[0]]), t))

    random.seed(args.seed)
    torch.manual_seed(args.seed)  # also seeds every CUDA device
    t0, n_tokens, n_correct = time.time(), 0, 0
    bar = tqdm(total=len(todo), desc=label, dynamic_ncols=True)
    with open(samples_path, "a") as f:
        for start in range(0, len(todo), args.gen_batch_size):
            batch = todo[start : start + args.gen_batch_size]
            try:
                outs = generate(
                    model, tok, [prompt_ids[i] for i, _ in batch], decoding["stop_token_ids"]
                )
            except torch.OutOfMemoryError:
                bar.close()
                raise UserError(
                    f"out of memory generating {label} with --gen-batch-size "
                    f"{args.gen_batch_size} and --max-new-tokens "
                    f"{decoding['max_new_tokens']}; lower --gen-batch-size and add "
                    f"--resume to keep the {len(rows)} samples done"
                ) from None
            for (i, s), (text, n_tok, truncated) in zip(batch, outs):
                g = grade(text, problems[i]["answer"], extraction=args.answer_extraction)
                row = {
                    "idx": i,
                    "sample": s,
                    "problem": problems[i]["problem"],
                    "gold": problems[i]["answer"],
                    "completion": text,
                    "pred": g.pred,
                    "parsed": g.parsed,
                    "correct": g.correct,
                    "tokens": n_tok,
                    "truncated": truncated,
                }
                rows.append(row)
                n_tokens, n_correct = n_tokens + n_tok, n_correct + g.correct
            with runner.writing(samples_path.name, samples_path.parent):
                f.writelines(json.dumps(r) + "\n" for r in rows[-len(batch) :])
                f.flush()  # a crash loses at most one batch; --resume picks up from here
            bar.update(len(batch))
            bar.set_postfix(
                acc=f"{n_correct / (start + len(batch)):.3f}",
                tok_s=f"{n_tokens / max(time.time() - t0, 1e-9):.0f}",
            )
    bar.close()

    result.update(
        complete=True,
        n_samples=len(rows),
        elapsed_s=round(time.time() - t0, 2),
        metrics=compute_metrics(rows, len(problems), args.n, settings["ks"], decoding["greedy"]),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    runner.write_text(result_path, json.dumps(result, indent=2) + "\n")  # a kill keeps the old
    return result


# =====================================================================================
# Main
# =====================================================================================
def run_checkpoint(model_path: str) -> str:
    """A training run's folder (runs/<run>: checkpoints, no config.json) stands for its latest
    whole checkpoint, the one --resume would continue from; which one is said before anything
    else. Any other folder or name is itself."""
    folder = Path(model_path)
    is_model = any((folder / f).is_file() for f in ("config.json", "adapter_config.json"))
    if not folder.is_dir() or is_model:
        return model_path
    whole = runner.whole_checkpoints(folder)
    if not whole:
        if (folder / "args.json").is_file() or (folder / "latest").is_file():
            raise UserError(
                f"{model_path} is a training run folder with no whole checkpoint yet: nothing "
                f"to score (its run saves one every --save-every steps)"
            )
        return model_path  # not a run's: check_model_folder says what it lacks
    ckpt = runner.find_checkpoint(folder) if (folder / "latest").is_file() else whole[0]
    print(f"{model_path} is a training run folder: scoring its latest whole checkpoint, {ckpt}")
    return str(ckpt)


def model_label(model_arg: str, model_path: str) -> str:
    """Folder name under runs/eval/: 'tiny', '<run>-checkpoint-N', or the hub name."""
    if model_arg == "tiny":
        return "tiny"
    p = Path(model_path)
    if p.exists():
        p = p.resolve()
        return f"{p.parent.name}-{p.name}" if p.name.startswith("checkpoint") else p.name
    return model_path.rstrip("/").split("/")[-1]


@functools.lru_cache(maxsize=None)
def git_commit() -> str | None:
    """The commit of this code, recorded with the results (read from .git, no git needed)."""
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            return (ROOT / ".git" / head[5:]).read_text().strip()[:12]
        return head[:12]
    except OSError:
        return None


def model_id(model_path: str) -> str:
    """The model as the results record it: a local folder resolved to its full path (the same
    checkpoint given as a relative path, or as 'tiny', is the same model), else the hub id."""
    p = Path(model_path).expanduser()
    return str(p.resolve()) if p.exists() else model_path


def check_writable(out_dir: Path) -> None:
    """Can results be written in out_dir, or can it be made? Asked before any work: an output
    folder that cannot be written would otherwise fail only once the model has generated."""
    here = out_dir
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        if not here.is_dir():
            raise NotADirectoryError(f"{here} is a file")
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        verb = "write in" if here == out_dir else "create"
        why = e.strerror or first_line(e)  # not the probe's file name
        raise UserError(f"cannot {verb} --output-dir {out_dir}: {why}") from None


def check_replace(out_dir: Path, labels: list[str], tag: str, settings: dict, resume: bool):
    """An --output-dir holds one model's results. Another model's there are refused: its files
    would be replaced (same benchmark) or sit beside this one's as if one evaluation. Results of
    the same model that a run without --resume starts over are replaced, and that is said."""
    for path in sorted(out_dir.glob("*.json")):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not (isinstance(old, dict) and "benchmark" in old and "model" in old):
            continue  # not a results file
        other = model_id(str(old["model"]))
        if other != settings["model"]:
            raise UserError(
                f"--output-dir {out_dir} holds results of another model ({other}, in "
                f"{path.name}); give another --output-dir (unset, each model gets its own, "
                f"runs/eval/<model-name>/)"
            )
    for label in labels if not resume else []:
        samples = out_dir / f"{label}.{tag}.jsonl"
        if samples.is_file() and samples.stat().st_size:
            print(f"{label}: replacing the earlier results in {out_dir} (--resume keeps them)")


def evaluate(args: Args) -> list[dict]:
    """Score the model on each benchmark; its --output-dir is locked while eval.py writes it."""
    with contextlib.ExitStack() as held:  # the lock is released however the evaluation ends
        return _evaluate(args, held)


def _evaluate(args: Args, held: contextlib.ExitStack) -> list[dict]:
    model_path = run_checkpoint(resolve_model_name(args.model))
    tiny = is_tiny(model_path)
    names = [
        b.strip()
        for b in (args.benchmarks or ("tiny" if tiny else "math500")).split(",")
        if b.strip()
    ]
    template = args.template or ("tiny" if tiny else "qwen_math")
    max_new = args.max_new_tokens
    if max_new is None:  # (not `or`: --max-new-tokens 0 is an error, not the default)
        max_new = 48 if tiny else 3000
    greedy = args.temperature == 0
    try:
        ks = sorted({int(k) for k in args.pass_k.split(",") if k.strip()})
    except ValueError:
        raise UserError(f"--pass-k must be comma-separated integers, got {args.pass_k!r}") from None
    # Every flag is checked before anything loads, as in the training scripts: each float flag
    # for finiteness (--temperature nan would pass `< 0`), then for its range. An error names the
    # flag as it was typed: --limit and --batch-size are eval.py's first spellings.
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{typed(args, f.name)} must be a finite number, not {value}")
    counts = {"n": args.n, "gen_batch_size": args.gen_batch_size, "max_new_tokens": max_new}
    counts["eval_n"] = args.eval_n
    for message, ok in {
        f"unknown --template {template!r}; choose from {', '.join(TEMPLATES)}": template
        in TEMPLATES,
        f"--benchmarks is empty; known: {KNOWN}": bool(names),
        **{
            f"{typed(args, k)} must be at least 1, not {v}": v is None or v >= 1
            for k, v in counts.items()
        },
        f"--pass-k values must be at least 1, not {ks[0] if ks else 1}": not ks or ks[0] >= 1,
        f"--temperature must be >= 0, not {args.temperature}": args.temperature >= 0,
        f"--top-p must be in (0, 1], not {args.top_p}": 0 < args.top_p <= 1,
        "--n > 1 with greedy decoding gives n identical samples; set --temperature > 0": not (
            greedy and args.n > 1
        ),
        f"--answer-extraction must be one of {', '.join(common.ANSWER_EXTRACTIONS)}, not "
        f"{args.answer_extraction!r}": args.answer_extraction in common.ANSWER_EXTRACTIONS,
    }.items():
        if not ok:
            raise UserError(message)
    check_model_folder(model_path)  # a config and tokenizer files, before any benchmark loads
    out_dir = (
        Path(args.output_dir)
        if args.output_dir
        else Path("runs/eval") / model_label(args.model, model_path)
    )
    check_writable(out_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    settings = {
        "model": model_id(model_path),
        "ks": ks,
        "answer_extraction": args.answer_extraction,
        "grader": f"math-verify {version('math-verify')}",
        "decoding": {
            "greedy": greedy,
            "n": args.n,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": None if greedy else 0,
            "max_new_tokens": max_new,
            "template": template,
            "seed": args.seed,
            "batch_size": args.gen_batch_size,
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
        },
    }

    # Data before the model: a typo in a benchmark name should not cost a model load.
    benches = [load_benchmark(name, args) for name in names]
    labels = [label for label, _, _ in benches]
    twice = next((label for label in labels if labels.count(label) > 1), None)
    if twice is not None:
        raise UserError(f"--benchmarks names {twice} twice")
    tag = "greedy" if greedy else f"n{args.n}-t{args.temperature:g}-p{args.top_p:g}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --output-dir {out_dir}: {first_line(e)}") from None
    lock = runner.lock_run_folder(out_dir, "--output-dir", "--output-dir")  # one eval.py at a time
    if lock is not None:
        held.callback(lock.close)
    if args.resume:  # all benchmarks are checked before the first one generates, not an hour in
        for label in labels:
            check_resume(out_dir / f"{label}.{tag}", settings)
    check_replace(out_dir, labels, tag, settings, args.resume)

    model, tok = load_model(model_path, device, dtype, args.trust_remote_code)
    stop_ids = stop_token_ids(tok, model)
    if tok.pad_token_id is None:  # left padding needs some id; the attention mask hides it
        tok.pad_token = tok.convert_ids_to_tokens(stop_ids[0])

    # Every prompt of every benchmark is tokenized and checked against the context up front.
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    all_ids = []
    for label, _, problems in benches:
        texts = [build_prompt(tok, p["problem"], template) for p in problems]
        # A chat template may already write the BOS token; do not add a second one.
        add_special = not (tok.bos_token and texts[0].startswith(tok.bos_token))
        ids = tok(texts, add_special_tokens=add_special)["input_ids"]
        longest = max(len(x) for x in ids)
        if max_pos is not None and longest + max_new > max_pos:
            over = sum(len(x) + max_new > max_pos for x in ids)
            fix = (
                f"use --max-new-tokens {max_pos - longest} or less"
                if max_pos > longest
                else "the prompt alone is too long for this model"
            )
            raise UserError(
                f"{over} prompt(s) of {label} do not fit the context: {longest} prompt "
                f"tokens + --max-new-tokens {max_new} > max_position_embeddings "
                f"{max_pos}; {fix}"
            )
        all_ids.append(ids)

    from transformers import GenerationConfig

    # Every decoding setting is given here and model.generation_config (neutral since load_model)
    # is replaced by it, so generate() has nothing of the model's own defaults left to merge in.
    gen_config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=not greedy,
        temperature=None if greedy else args.temperature,
        top_p=None if greedy else args.top_p,
        top_k=None if greedy else 0,
        eos_token_id=stop_ids,
        pad_token_id=tok.pad_token_id,
    )
    model.generation_config = gen_config  # generate() decodes with this
    settings["decoding"].update(stop_token_ids=stop_ids, tokenizer=type(tok).__name__)

    print(
        f"model {model_path} on {device} ({settings['decoding']['dtype']}), template {template}, "
        f"{tag}, max {max_new} new tokens, answer extraction {args.answer_extraction} "
        f"-> {out_dir}"
    )
    results = [
        run_benchmark(
            label, source, problems, ids, model, tok, args, settings, out_dir / f"{label}.{tag}"
        )
        for (label, source, problems), ids in zip(benches, all_ids)
    ]

    table = markdown_table(results)
    with runner.writing(f"results.{tag}.md", out_dir):
        (out_dir / f"results.{tag}.md").write_text(table + "\n")
    print(
        f"\n{model_path} ({tag}, answer extraction {args.answer_extraction}, grader "
        f"{settings['grader']})\n\n{table}"
    )
    return results


def parse_args(argv: list[str] | None = None) -> Args:
    """The command line; an unknown flag prints the usage line and one error line, exit 2. The
    first spellings (--limit, --batch-size) are read as the flags they became; how each flag was
    typed is kept in `args.spelled`, for its error to name it so (typed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fields = dataclasses.fields(Args)
    aliases = {flag(a[2:]): f.name for f in fields for a in f.metadata.get("aliases", ())}
    spellings = {flag(f.name): f.name for f in fields} | aliases
    spelled = {}
    for i, a in enumerate(argv):
        if a == "--":  # what follows is no flag
            break
        name, eq, value = a.partition("=")
        name = flag(name[2:]) if a.startswith("--") else name
        if name in spellings:  # the last one typed counts, as its value does
            spelled[spellings[name]] = name
        if name in aliases:
            argv[i] = flag(aliases[name]) + eq + value
    args = runner.parse_args(Args, argv, __doc__)
    args.spelled = spelled
    return args


# the line after "stopped by SIGTERM": every finished batch of samples is on disk, whole
STOPPED = ": the samples written so far are kept; the same command with --resume adds the rest"


def typed(args: Args, name: str) -> str:
    """The flag of field `name` as the user typed it (--limit for eval_n), else its own."""
    return getattr(args, "spelled", {}).get(name, flag(name))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kept = runner.catch_stop_signals(runner.stop_at_once)  # Ctrl-C, SIGTERM, SIGHUP: one line
    try:
        with runner.user_errors(STOPPED):  # as the training scripts: a UserError is one line
            evaluate(args)
    finally:
        runner.restore_signals(kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
