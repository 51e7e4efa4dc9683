"""TEPO through TRL's GRPOTrainer: the way to many GPUs (accelerate, DeepSpeed, FSDP) and vLLM.

    pip install -r requirements.txt -r requirements-trl.txt
    python integrations/train_trl_tepo.py   # bundled tiny model + arithmetic task, CPU, 10 steps

On 8 GPUs, tepo.py's real-run batch geometry (32 prompts x 8 completions per rollout batch, 8
optimizer steps of 32 completions each, micro-batches of 4) with vLLM sharing the GPUs:

    accelerate launch --num_processes 8 integrations/train_trl_tepo.py \\
        --model Qwen/Qwen2.5-Math-1.5B --dataset dapo-math \\
        --use_vllm --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 \\
        --vllm_max_model_length 4096 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 1 \\
        --steps_per_generation 8 --num_generations 8 --max_completion_length 3000 \\
        --learning_rate 1e-6 --max_steps 4000 --save_steps 400 --save_total_limit 2 \\
        --output_dir runs/trl-tepo-qwen2.5-math-1.5b

    python eval.py --model runs/trl-tepo-qwen2.5-math-1.5b/checkpoint-4000

Add `--config_file <accelerate config>` after `accelerate launch` for DeepSpeed ZeRO or FSDP
(TRL ships some: trl/accelerate_configs/zero3.yaml, fsdp2.yaml). vLLM on GPUs of its own
instead, e.g. 4 + 4: `CUDA_VISIBLE_DEVICES=4,5,6,7 trl vllm-serve --model
Qwen/Qwen2.5-Math-1.5B --data_parallel_size 4 --max_model_len 4096`, then
`CUDA_VISIBLE_DEVICES=0,1,2,3 accelerate launch --num_processes 4 ...` with `--vllm_mode server`
and --per_device_train_batch_size 8 (the same 32 per optimizer step).
generation_batch_size = per_device_train_batch_size x processes x steps_per_generation
completions are sampled at a time (256 above), and every optimizer step sees
per_device_train_batch_size x processes x gradient_accumulation_steps of them (32 above), as
tepo.py's mini-batches; keep steps_per_generation a multiple of gradient_accumulation_steps.

Every flag except this script's own (--model, --dataset, --problem_column, --answer_column,
--template, --answer_extraction, --grader_timeout, --max_prompt_tokens) and TEPO's
(--ratio_level, --entropy_test, --entropy_tol, --kl_coef; clips: --epsilon 0.2
--epsilon_high 0.28, our reading) is TRL's own (GRPOConfig and transformers'
TrainingArguments: `--help` lists them all). TRL defaults to bf16 autocast over fp32 weights and
gradient checkpointing, as tepo.py does on CUDA. Leave --beta unset: TEPO's KL coefficient is
--kl_coef. Verified on CPU only (one process end to end; two processes for the cross-process
counting and gathering); never run on a GPU, under DeepSpeed / FSDP or with vLLM (docs/scaling.md).

The reward is tepo.py's: 1 if the last \\boxed{} of the completion equals the answer
(common.grade: math-verify, gold first, time-bounded), else 0. Prompts come from common.build_prompt
(the tiny template for the tiny model, qwen_math otherwise); prompts longer than
--max_prompt_tokens (default: the model's context - max_completion_length) are dropped.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser  # noqa: E402

import common  # noqa: E402
import runner  # noqa: E402
import tepo  # noqa: E402
from integrations.trl_trainers import TEPOConfig, TEPOTrainer  # noqa: E402


@dataclass
class ScriptArgs:
    model: str = field(
        default="tiny",
        metadata={"help": "'tiny' (bundled), a hub id, a short Qwen name, or a local folder"},
    )
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "tiny, math, dapo-math, a hub id, or a .jsonl/.json/.parquet file "
            "(default: tiny for the tiny model, else dapo-math)"
        },
    )
    problem_column: str | None = field(
        default=None,
        metadata={"help": "column holding the problem (default: known, else 'problem')"},
    )
    answer_column: str | None = field(
        default=None, metadata={"help": "column holding the answer (default: known, else 'answer')"}
    )
    template: str | None = field(
        default=None,
        metadata={
            "help": "prompt template: qwen_math, tiny, plain or "
            "chat (default: tiny for the tiny model)"
        },
    )
    answer_extraction: str = field(
        default="boxed",
        metadata={
            "help": "final answer: the last \\boxed{}, or math-verify's own extraction from "
            "free text",
            "choices": list(common.ANSWER_EXTRACTIONS),
        },
    )
    grader_timeout: int = field(
        default=5, metadata={"help": "seconds allowed per answer parse / comparison"}
    )
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={"help": "longer prompts are dropped (default: context - max_completion_length)"},
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "LoRA rank: train adapters on a frozen base (TRL's "
            "peft_config); TRL's reference is then the base with the "
            "adapters off. 0 = full fine-tuning"
        },
    )
    lora_alpha: float = field(
        default=32.0, metadata={"help": "LoRA alpha: the update is scaled by alpha / r"}
    )
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "all-linear (every linear layer of the transformer blocks) or a comma list of "
            "module names"
        },
    )


# TRL defaults that differ from tepo.py's presets. Tiny: tepo.py's tiny preset (16 prompts x 8,
# 2 optimizer steps per rollout batch), CPU-friendly, 10 optimizer steps. Real: lr warm-up then
# constant and 3000-token completions; the batch geometry is given on the command line.
TINY_DEFAULTS = dict(
    output_dir="runs/trl-tepo-tiny",
    per_device_train_batch_size=64,
    num_generations=8,
    steps_per_generation=2,
    gradient_accumulation_steps=1,
    max_completion_length=40,
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    max_steps=10,
    logging_steps=1,
    bf16=False,
    gradient_checkpointing=False,
    save_strategy="no",
    report_to="none",
    seed=1,
)
REAL_DEFAULTS = dict(
    max_completion_length=3000,
    lr_scheduler_type="constant_with_warmup",
    warmup_steps=10,
    logging_steps=1,
    seed=1,
)


def correctness_reward(extraction: str, timeout_s: int):
    """TRL reward function: 1.0 if the completion's final answer equals the `answer` column."""

    def correctness(completions, answer, **kwargs):
        return [
            float(common.grade(c, a, timeout_s, extraction).correct)
            for c, a in zip(completions, answer)
        ]

    return correctness


def parse(argv=None) -> tuple[ScriptArgs, TEPOConfig]:
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model", default="tiny")
    model = peek.parse_known_args(argv)[0].model
    parser = HfArgumentParser((ScriptArgs, TEPOConfig))
    tiny = runner.is_tiny(model)
    defaults = dict(TINY_DEFAULTS if tiny else REAL_DEFAULTS)
    defaults.setdefault("output_dir", f"runs/trl-tepo-{Path(model).name.lower()}")
    parser.set_defaults(**defaults)
    script, cfg = parser.parse_args_into_dataclasses(args=argv)
    script.dataset = script.dataset or ("tiny" if tiny else "dapo-math")
    script.template = script.template or ("tiny" if tiny else "qwen_math")
    return script, cfg


def load_prompts(script: ScriptArgs, tokenizer, max_prompt_tokens: int) -> Dataset:
    """{'prompt', 'answer'} rows; prompts over max_prompt_tokens are dropped and counted."""
    rows = common.load_problems(
        script.dataset,
        "train",
        problem_column=script.problem_column,
        answer_column=script.answer_column,
    )
    prompts = [common.build_prompt(tokenizer, r["problem"], script.template) for r in rows]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    kept = [
        dict(prompt=p, answer=r["answer"])
        for p, r, n in zip(prompts, rows, lengths)
        if n <= max_prompt_tokens
    ]
    if not kept:
        raise common.UserError(f"every prompt is longer than {max_prompt_tokens} tokens")
    if len(kept) < len(rows):
        print(
            f"dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than "
            f"{max_prompt_tokens} tokens"
        )
    return Dataset.from_list(kept)


def lora_config(script: ScriptArgs):
    """PEFT's LoraConfig for TRL's peft_config, as the scripts build it (no adapter dropout: the
    ratio must be 1 before the first update), or None for full fine-tuning."""
    if script.lora_rank < 0:
        raise common.UserError(f"--lora_rank must be >= 0, not {script.lora_rank}")
    if script.lora_rank == 0:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise common.UserError("--lora_rank needs peft: pip install peft") from None
    t = script.lora_target_modules
    return LoraConfig(
        r=script.lora_rank,
        lora_alpha=script.lora_alpha,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=t if t == "all-linear" else [x.strip() for x in t.split(",") if x.strip()],
    )


def main(argv=None):
    script, cfg = parse(argv)
    path = runner.resolve_model_name(script.model)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # fp32 weights (bf16 autocast when --bf16): bf16 weights would round away lr=1e-6 updates
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code
    )
    # stop at every end-of-turn id, as tepo.py does: Qwen's chat turns end in <|im_end|>
    eos_ids = tepo.eos_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = eos_ids
    if cfg.use_vllm:  # vLLM reads its stop ids from the sampling parameters
        cfg.generation_kwargs = {"stop_token_ids": eos_ids, **(cfg.generation_kwargs or {})}
    ctx = getattr(model.config, "max_position_embeddings", None) or 1 << 20
    max_prompt = script.max_prompt_tokens or ctx - cfg.max_completion_length
    train = load_prompts(script, tokenizer, max_prompt)
    trainer = TEPOTrainer(
        model=model,
        args=cfg,
        train_dataset=train,
        processing_class=tokenizer,
        reward_funcs=correctness_reward(script.answer_extraction, script.grader_timeout),
        peft_config=lora_config(script),
    )
    trainer.train()
    trainer.save_model(cfg.output_dir)
    return trainer


if __name__ == "__main__":
    with runner.user_errors():
        main()
