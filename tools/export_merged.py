"""A LoRA checkpoint as a plain model folder: its adapters merged into the base weights.

    python tools/export_merged.py runs/<run>/checkpoint-<step> merged/      # then:
    python eval.py --model merged/   # or AutoModelForCausalLM.from_pretrained("merged/"), vLLM, ...

A checkpoint of a run with --lora-rank holds only the adapters (adapter_config.json,
adapter_model.safetensors, PEFT's format) and the tokenizer; adapter_config.json names the base
model. This loads the base in fp32, adds the adapters, folds B A * alpha / r into each adapted
weight (PEFT's merge_and_unload) and saves the result with the tokenizer. eval.py also scores
an adapter checkpoint directly; the merged folder is for tools that know no PEFT.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import UserError, first_line  # noqa: E402
from runner import user_errors  # noqa: E402


def export_merged(checkpoint: str, out: str) -> Path:
    """Merge the adapters of `checkpoint` into their base and save a plain model folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, out_dir = Path(checkpoint), Path(out)
    config = ckpt / "adapter_config.json"
    if not config.is_file():
        raise UserError(
            f"{ckpt} holds no LoRA adapters (no adapter_config.json): it is already a "
            f"plain model folder"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file, not a folder: pick a new folder")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} exists and is not empty: pick another folder")
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError("merging LoRA adapters needs peft: pip install peft") from None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, ckpt).merge_and_unload()
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
    except Exception as e:  # the base moved, a truncated file, a hub error
        raise UserError(f"cannot load {ckpt} and its base {base!r}: {first_line(e)}") from None
    # written beside, then renamed into place: a kill or a full disk never leaves a half-written
    # model folder that eval.py or from_pretrained would then load
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except Exception as e:  # a full disk, a read-only folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out_dir}: {first_line(e)}") from None
    return out_dir


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(
            __doc__.strip().splitlines()[0] + "\n\nusage: python tools/export_merged.py "
            "CHECKPOINT OUT_DIR",
            file=sys.stderr if len(argv) != 2 else sys.stdout,
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    with user_errors():  # a UserError: one line, exit 2
        print(f"merged model written to {export_merged(*argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
