"""Rebuild the bundled tiny model in this folder, from scratch, on CPU.

    python tiny_model/build.py            # a few minutes on 2 CPU cores

What it makes (an ordinary Hugging Face folder, loadable offline with
`AutoModelForCausalLM.from_pretrained("tiny_model")` and `AutoTokenizer.from_pretrained(...)`):
- a character-level tokenizer: byte-level BPE with no merges, so every ASCII character is one
  token, plus Qwen's special tokens `<|endoftext|>` (also the pad token, as in Qwen base models),
  `<|im_start|>` and `<|im_end|>`, and a Qwen-style chat template;
- a small Qwen2 model (~0.8M parameters), randomly initialised, then warmed up by
  supervised training on the tiny task's *train* split (tools/make_data.py's tiny_task) until
  its sampled accuracy (temperature 1) on held-out problems first reaches TARGET_ACC. It is stopped
  early on purpose, and its warm-up data is noisy on purpose: each intermediate result is
  off by 1 or 2 with probability NOISE (the final line then follows the wrong value). So the
  model learns a spread-out answer distribution whose mode is usually right; sampled at
  temperature 1 it is often wrong, which leaves RL (rewarding right answers) room to show.
- generation_config.json with both end ids, like Qwen: `<|im_end|>` and `<|endoftext|>`.
"""

import random
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from tools.make_data import tiny_task  # noqa: E402

OUT = Path(__file__).resolve().parent
SEED = 0
TARGET_ACC = 0.25  # stop warm-up once sampled held-out accuracy reaches this
NOISE = 0.3  # chance that each intermediate result of a warm-up solution is off by 1 or 2
EVAL_N = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins that byte-level BPE (GPT-2, Qwen) uses for the bytes 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte, so one per ASCII character. Written
    in Qwen's own format, because transformers loads any qwen2 folder with Qwen2Tokenizer."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def noisy_solution(ex: dict, rng: random.Random) -> str:
    """The worked solution, with each of its two results nudged by +-1 or +-2 w.p. NOISE."""
    a, o1, b, o2, c = (ex["problem"][k] for k in range(5))
    nudge = lambda v: v + rng.choice((-2, -1, 1, 2)) if rng.random() < NOISE else v  # noqa: E731
    s1 = nudge(int(a) + int(b) if o1 == "+" else int(a) - int(b))
    s2 = nudge(s1 + int(c) if o2 == "+" else s1 - int(c))
    return f"{a}{o1}{b}={s1}\n{s1}{o2}{c}={s2}\n\\boxed{{{s2}}}"


def encode_batch(tokenizer, examples, im_end, rng=None):
    """Prompt through the chat template, then the solution and <|im_end|>; loss on the latter."""
    rows, labels = [], []
    for ex in examples:
        p = tokenizer(common.build_prompt(tokenizer, ex["problem"], "tiny"))["input_ids"]
        c = tokenizer(noisy_solution(ex, rng) if rng else ex["solution"])["input_ids"] + [im_end]
        rows.append(p + c)
        labels.append([-100] * len(p) + c)
    T = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    lab = torch.tensor([l + [-100] * (T - len(l)) for l in labels])
    att = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, att, lab


@torch.no_grad()
def sampled_accuracy(model, tokenizer, problems, eos_ids, temperature=1.0):
    model.eval()
    tokenizer.padding_side = "left"
    correct = 0
    for i in range(0, len(problems), 128):
        chunk = problems[i : i + 128]
        enc = tokenizer(
            [common.build_prompt(tokenizer, p["problem"], "tiny") for p in chunk],
            return_tensors="pt",
            padding=True,
        )
        out = model.generate(
            **enc,
            do_sample=temperature > 0,
            temperature=temperature or None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=40,
            eos_token_id=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(
            out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        correct += sum(common.grade(t, p["answer"]).correct for t, p in zip(texts, chunk))
    model.train()
    return correct / len(problems)


def main():
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos_ids = [im_end, tokenizer.eos_token_id]
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    train = tiny_task("train", seed=SEED)
    heldout = tiny_task("test", EVAL_N, seed=SEED + 1)  # not the order of data/tiny/test.jsonl
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(SEED)
    step, acc = 0, 0.0
    bar = tqdm(desc="warm-up", unit="step")
    while acc < TARGET_ACC:
        ids, att, lab = encode_batch(tokenizer, rng.sample(train, 64), im_end, rng)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % (100 if acc < 0.1 else 20) == 0:  # look closely near the target
            acc = sampled_accuracy(model, tokenizer, heldout, eos_ids)
            tqdm.write(f"step {step:5d}  loss {loss.item():.3f}  sampled held-out acc {acc:.3f}")
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", sampled_acc=f"{acc:.3f}")
        if step > 20_000:
            raise SystemExit("warm-up did not reach the target accuracy")

    bar.close()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=40,
    )
    model.save_pretrained(OUT, safe_serialization=True)
    tokenizer.save_pretrained(OUT)
    reloaded = AutoTokenizer.from_pretrained(OUT)
    probe = common.build_prompt(tokenizer, "7-2+9", "tiny") + "7-2=5\n5+9=14\n\\boxed{14}<|im_end|>"
    assert reloaded(probe)["input_ids"] == tokenizer(probe)["input_ids"], (
        "saved tokenizer reloads differently"
    )
    print(
        f"saved to {OUT} after {step} warm-up steps; sampled acc {acc:.3f}, "
        f"greedy acc {sampled_accuracy(model, tokenizer, heldout, eos_ids, 0.0):.3f}"
    )


if __name__ == "__main__":
    main()
