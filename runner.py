"""The run's machinery, which a script touches only at its edges; a reader of the algorithm may
skip this file. What it guarantees: a run is never lost (atomic checkpoints, exact --resume, a
lock on its folder, Ctrl-C and SIGTERM save first) and bad input is one line, never a traceback.

    args = parse_args(Args, argv, __doc__, PRESETS)  # flags with their defaults, presets on top
    run = Run(args, "tepo", resolve_args, needs_reference)  # folder, --resume, seeds, signals
    start = run.attach(models, tokenizer, state)      # what a checkpoint holds
    for step in run.steps(start): ...; run.end_step(step, metrics)  # log, bar, save, stop
    return run.finish()

In order: the command line and its checks; model names and devices; the run's files (log,
checkpoints, lock); the per-token HTML samples; the run itself.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import textwrap
import threading
import time
import typing
from html import escape
from pathlib import Path

import torch
from tqdm import tqdm

from common import RESUMABLE, ROOT, PromptSampler, RunArgs, UserError, first_line
from common import flag, warn

TINY_MODEL_DIR = ROOT / "tiny_model"  # the bundled model, --model tiny


# =====================================================================================
# The command line: --help with every default, each flag checked before anything loads
# =====================================================================================
def _dashed(a: str) -> str:
    """--max_new_tokens=3 -> --max-new-tokens=3; values are left as they are."""
    if not a.startswith("--"):
        return a
    name, eq, value = a.partition("=")
    return name.replace("_", "-") + eq + value


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def _preset_table(presets: dict[str, dict]) -> str:
    lines = ["presets: each changes these flags from the defaults above, unless passed (lora-lr:"]
    lines.append("the lr under --lora-rank); --preset auto picks one by --model and --device")
    wrap = textwrap.TextWrapper(98, subsequent_indent="    ", break_on_hyphens=False)
    for name, table in presets.items():
        pairs = " ".join(f"{flag(k)[2:]}={v}" for k, v in table.items())
        lines.append(wrap.fill(f"  {name}: {pairs}"))
    return "\n".join(lines)


def _opening(doc: str) -> str:
    """A script's docstring up to its block of commands: what it does, how to run it."""
    paragraphs = doc.strip().split("\n\n")
    ends = [i for i, p in enumerate(paragraphs) if p.startswith("    ")] or [1]
    return "\n\n".join(paragraphs[: ends[0] + 1])


def parse_args(cls, argv=None, doc: str = "", presets: dict | None = None):
    """The command line as an instance of the dataclass `cls`: --help opens with `doc` up to its
    commands (what the script does, how to run it), lists the script's own flags
    first, then the run's, each with its default, and ends with the presets. --max-new-tokens
    and --max_new_tokens both work; an unknown flag is the usage line and one error line, exit 2.
    The flags given are kept in `args.given`: a preset changes only the others."""
    # not HfArgumentParser: it lists a script's own flags last and shows "(default: None)" 9 times
    parser = argparse.ArgumentParser(
        description=_opening(doc),
        epilog=_preset_table(presets) if presets else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [flags: see below]",
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(cls)
    base = {f.name for f in dataclasses.fields(RunArgs)} if issubclass(cls, RunArgs) else set()
    own = parser.add_argument_group(f"{Path(sys.argv[0]).stem} flags" if base else "flags")
    run = parser.add_argument_group("the run's flags (the same in every script)")
    redeclared = set(cls.__dict__.get("__annotations__", {}))  # a script's own default for one
    mine = [f for f in dataclasses.fields(cls) if f.name not in base or f.name in redeclared]
    for f in mine + [f for f in dataclasses.fields(cls) if f not in mine]:  # the script's first
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        kw = dict(dest=f.name, default=f.default, help=help.replace("%", "%%"))
        if kind[0] is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="true|false")
        else:
            kw.update(type=kind[0], choices=f.metadata.get("choices"))
        group = own if f in mine else run
        group.add_argument(flag(f.name), **kw)
    argv = [_dashed(a) for a in (sys.argv[1:] if argv is None else argv)]
    args = cls(**vars(parser.parse_args(argv)))
    names = {a.split("=")[0] for a in argv if a.startswith("--")}
    args.given = {f.name for f in dataclasses.fields(cls) if flag(f.name) in names}
    return args


AT_LEAST_ONE = ("prompts_per_step", "max_new_tokens", "max_prompt_tokens", "gen_batch_size")
AT_LEAST_ONE += ("steps", "num_mini_batches", "ppo_epochs", "micro_batch_size", "eval_every")
AT_LEAST_ONE += ("eval_n", "save_every", "keep_checkpoints", "sample_every", "grader_timeout")
AT_LEAST_ONE += ("threads",)


def check_args(args, rules: dict[str, bool] | None = None) -> None:
    """Every flag is checked before anything loads: every float flag for finiteness (`--lr inf`
    or `--temperature nan` would pass a range check and fail later, in a traceback), the common
    flags here by name; `rules` adds a script's own, as {"message if it fails": condition}."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        v, kinds = getattr(args, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if float in kinds and v is not None and not math.isfinite(v):
            raise UserError(f"{flag(f.name)} must be a finite number, not {v}")
    for k in AT_LEAST_ONE:
        if getattr(args, k, None) is not None and getattr(args, k) < 1:
            raise UserError(f"{flag(k)} must be at least 1, not {getattr(args, k)}")
    for k in ("lr", "temperature", "max_grad_norm", "lora_alpha"):
        if hasattr(args, k) and not getattr(args, k) > 0:
            raise UserError(f"{flag(k)} must be > 0, not {getattr(args, k)}")
    for k in ("weight_decay", "warmup_steps", "lora_rank"):
        if getattr(args, k, 0) < 0:
            raise UserError(f"{flag(k)} must be >= 0, not {getattr(args, k)}")
    if not 0 < getattr(args, "top_p", 1) <= 1:
        raise UserError(f"--top-p must be in (0, 1], not {args.top_p}")
    if getattr(args, "lora_rank", 0) and importlib.util.find_spec("peft") is None:
        raise UserError("--lora-rank needs peft: pip install peft")
    for message, ok in (rules or {}).items():
        if not ok:
            raise UserError(message)


def given_flags(args) -> set[str]:
    """The flags the user passed (parse_args keeps them); for args built in code, those that
    differ from their defaults."""
    if hasattr(args, "given"):
        return args.given
    return {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != f.default}


def resolve_run_args(args, algo: str, presets: dict[str, dict], min_group: int = 2) -> None:
    """What every script's resolve_args does first: the preset's values for the flags not passed
    (--preset, or auto by model and device), the threads, bf16 and gradient checkpointing by
    default on CUDA only, the run's name, and the batch's shape, checked with every common flag."""
    cuda = resolve_device(args.device).type == "cuda"
    given = given_flags(args)
    if args.preset == "auto":
        args.preset = "tiny" if is_tiny(args.model) else "gpu" if cuda else "cpu"
    if args.preset not in presets:
        raise UserError(f"unknown --preset {args.preset!r}; choose from auto, {', '.join(presets)}")
    table = dict(presets[args.preset])
    lora_lr = table.pop("lora_lr")
    for k, v in table.items():
        if k not in given:
            setattr(args, k, v)
    if args.lora_rank and "lr" not in given:
        args.lr = lora_lr
    if "overlong_cache" not in given and args.overlong_cache >= args.max_new_tokens:
        args.overlong_cache = max(1, args.max_new_tokens // 5)  # the preset's is too long
        print(
            f"--overlong-cache set to {args.overlong_cache}: the preset's is not below "
            f"--max-new-tokens"
        )
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if args.threads is None:
        args.threads = int(omp) if omp.isdigit() and int(omp) > 0 else torch.get_num_threads()
    args.bf16 = cuda if args.bf16 is None else args.bf16
    if cuda and args.bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(resolve_device(args.device))
        raise UserError(f"{name} has no bf16 (before Ampere): run with --bf16 false (fp32)")
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = cuda
    if args.run_name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.run_name = f"{algo}-{Path(args.model).name}-s{args.seed}-{stamp}"
    B = args.prompts_per_step * args.group_size
    why = " (a group advantage needs 2 completions)" if min_group == 2 else ""
    rules = {
        f"--group-size must be at least {min_group}{why}, not {args.group_size}": (
            args.group_size >= min_group
        ),
        f"P*G = {B} completions do not split into {args.num_mini_batches} equal mini-batches": (
            args.num_mini_batches >= 1 and B % args.num_mini_batches == 0
        ),
    }
    check_args(args, rules)


# =====================================================================================
# Model names and devices
# =====================================================================================
# Short names a user can type without the organisation, e.g. `--model Qwen2.5-Math-1.5B`.
HUB_ORGS_BY_PREFIX = {"Qwen": "Qwen", "DeepSeek": "deepseek-ai", "deepseek": "deepseek-ai"}
HUB_ORGS_BY_PREFIX |= {"Llama": "meta-llama", "OLMo": "allenai", "SmolLM": "HuggingFaceTB"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TOKENIZER_FILES += ("spiece.model",)


def resolve_model_name(name: str) -> str:
    """'tiny' -> the bundled folder; an existing path -> itself; 'Qwen2.5-Math-1.5B' ->
    'Qwen/Qwen2.5-Math-1.5B'; 'org/name' -> unchanged (a hub id)."""
    if name == "tiny":
        return str(TINY_MODEL_DIR)
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if "/" in name:
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise UserError(f"model folder {name!r} does not exist")
        return name
    for prefix, org in HUB_ORGS_BY_PREFIX.items():
        if name.startswith(prefix):
            return f"{org}/{name}"
    raise UserError(
        f"unknown model {name!r}: give 'tiny', a local folder, a hub id such as "
        f"'Qwen/Qwen2.5-Math-1.5B', or a short Qwen name such as 'Qwen2.5-Math-1.5B'"
    )


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, or None: one HEAD request through
    huggingface_hub's own session, no retries; a name lookup that hangs is no answer."""
    from huggingface_hub import constants, get_session

    answer = []

    def probe():
        try:
            status = get_session().head(constants.ENDPOINT, timeout=timeout).status_code
            answer.append(None if status < 500 else f"HTTP {status}")
        except Exception as e:  # no route, no name, refused, a proxy's error, a timeout
            answer.append(first_line(e))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return answer[0] if answer else f"no answer in {timeout:g} s"


def check_model_folder(path: str) -> None:
    """A local model folder must hold a config (or a LoRA adapter's) and a tokenizer (without it
    transformers loads an empty tokenizer and fails deep in generate). A hub id must be in the
    local cache or the hub within reach: huggingface_hub would first retry each file for ~25 s."""
    from huggingface_hub import constants, try_to_load_from_cache

    folder = Path(path)
    if folder.is_dir():
        if not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise UserError(f"model folder {path!r} has no config.json: is it a model folder?")
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(
                f"model folder {path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}"
                f", ...): copy them from the model it was trained from"
            )
        return
    try:
        cached = isinstance(try_to_load_from_cache(path, "config.json"), str)
    except Exception:  # not a valid repo id: from_pretrained says so
        cached = False
    if constants.HF_HUB_OFFLINE and not cached:
        on = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(v)]
        names = " and ".join(on or ["HF_HUB_OFFLINE"])
        raise UserError(
            f"cannot load model {path!r}: it is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and downloads are off ({names} set); give a local "
            f"model folder, or unset {names} to download it"
        )
    why = None if constants.HF_HUB_OFFLINE else hub_unreachable()
    if why is not None:
        then = "check the connection, or give a local model folder"
        if cached:
            then = "set HF_HUB_OFFLINE=1 to load it from the local cache"
        raise UserError(
            f"cannot load model {path!r}: the Hugging Face hub cannot be reached "
            f"({constants.ENDPOINT}: {why}); {then}"
        )


def is_tiny(model_name: str) -> bool:
    """The bundled tiny model, or a checkpoint trained from it (same shapes in config.json)."""
    path = Path(resolve_model_name(model_name))
    if (path / "adapter_config.json").is_file():  # a LoRA checkpoint: its base decides
        adapter = json.loads((path / "adapter_config.json").read_text())
        path = Path(adapter.get("base_model_name_or_path") or "")
    ref, cfg = TINY_MODEL_DIR / "config.json", path / "config.json"
    if not cfg.is_file():
        return False
    a, b = json.loads(ref.read_text()), json.loads(cfg.read_text())
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
    return all(a.get(k) == b.get(k) for k in keys)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for 'cuda' without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            f"--device {name} was asked for, but PyTorch sees no CUDA GPU here "
            f"(torch {torch.__version__}); use --device cpu or auto"
        )
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    return torch.device(name)


# =====================================================================================
# Stop signals: Ctrl-C, SIGTERM (a scheduler, a preempted cloud machine), SIGHUP (the terminal)
# =====================================================================================
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stop(BaseException):
    """A stop signal that ends what is under way at once (not an Exception: no `except
    Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def catch_stop_signals(handler) -> dict:
    """Install `handler` for each stop signal, but not for one the process was started with
    ignored (nohup, `cmd &`, some CI runners: the convention is that it stays ignored). Returns
    what was there, for restore_signals; off the main thread Python allows no handler."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    kept = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    kept = {sig: h for sig, h in kept.items() if h is not signal.SIG_IGN}
    for sig in kept:
        signal.signal(sig, handler)
    return kept


def stop_at_once(signum, frame):
    """The handler of a program with no step to finish (eval.py): stop now. The signals that come
    while it stops are not heard (a second Ctrl-C there would be a traceback)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is stop_at_once:
            signal.signal(sig, signal.SIG_IGN)
    raise Stop(signum)


def restore_signals(kept: dict) -> None:
    """Put back what catch_stop_signals found, except where stop_at_once ignores the signals: the
    process is ending, and a second Ctrl-C after a restore would be a traceback."""
    for sig, handler in kept.items():
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


# The figures the progress bar shows, by metric
BAR_FIGURES = {"reward": "reward", "accuracy": "acc", "kl": "kl", "entropy": "ent"}
BAR_FIGURES |= {"completion_len": "len", "tokens_per_s": "tok/s"}
STALL_STEPS = 5  # steps in a row with (almost) no learning signal before a warning
_ACTIVE_RUNS: list = []


# =====================================================================================
# Writing files: a full disk or a read-only folder is one line, never a traceback
# =====================================================================================
def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"


@contextlib.contextmanager
def writing(what: str, where: Path, need: int = 0, kept: str = ""):
    """Around every write of the harness: an error (OSError, or a serializer's I/O error, which
    safetensors and torch.save raise as other types) becomes one line that names what could not
    be written and where; when the disk has less room than `need` bytes, it says so and how much."""
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        try:
            free = shutil.disk_usage(where if where.is_dir() else where.parent).free
        except OSError:
            free = None
        why = first_line(e)
        if need and free is not None and free < need:
            why = f"not enough disk space (it needs about {_mb(need)}, {_mb(free)} free; {why})"
        raise UserError(f"cannot write {what} in {where}: {why}{kept}") from None


def write_text(path: Path, text: str, what: str | None = None) -> None:
    """A small file, whole or not at all: written beside, then renamed over the old one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(what or path.name, path.parent):
        tmp.write_text(text)
        os.replace(tmp, path)


# =====================================================================================
# Logging
# =====================================================================================
def _json_value(v):
    """Strict JSON, no rounding to 0: floats keep 6 significant digits; NaN and inf are null."""
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    return v


class RunLogger:
    """Metrics to runs/<name>/metrics.jsonl always, and to TensorBoard when it is installed."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        with writing("metrics.jsonl", self.run_dir):
            self.file = open(self.run_dir / "metrics.jsonl", "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # tensorboard not installed
                pass

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row |= {k: _json_value(v) for k, v in metrics.items()}
        with writing(f"step {step} to metrics.jsonl", self.run_dir):
            self.file.write(json.dumps(row, allow_nan=False) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk may refuse the last flush: reported
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows. A line cut short (a kill or a full disk in the middle of an append)
    is left out, with a one-line warning; --resume then rewrites the file without it."""
    path, rows = Path(run_dir) / "metrics.jsonl", []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError:
            warn(f"{path}, line {n}: cut short (a kill or a full disk while writing it); left out")
    return rows


# =====================================================================================
# Checkpoints: written to a temporary folder, renamed into place, then pointed to
# =====================================================================================
def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-")[-1])
    except ValueError:
        return -1


def _bytes(obj) -> int:
    """Bytes of the tensors in a model (what save_pretrained writes: the trained weights, under
    LoRA the adapters), or in a (nested) state dict."""
    if isinstance(obj, torch.nn.Module):
        trained = [p for p in obj.parameters() if p.requires_grad] or list(obj.parameters())
        return sum(p.numel() * p.element_size() for p in trained)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(v) for v in obj)
    return 0


def save_checkpoint(
    run_dir: Path,
    step: int,
    models: dict,
    tokenizer,
    trainer_state: dict,
    optimizer_state: dict | None = None,
    keep: int = 2,
) -> Path:
    """runs/<name>/checkpoint-<step>/: the policy as save_pretrained (safetensors, loadable by
    from_pretrained and eval.py) with its tokenizer; other models (a critic) in subfolders named
    by their key in `models` ("" is the folder itself); trainer_state.pt (step, RNG, sampler,
    scheduler, args); optimizer.pt, which only the newest checkpoint keeps (it is 2x the
    weights). A kill at any moment leaves a complete checkpoint that `latest` points to; a write
    that fails (a full disk) removes the temporary folder and leaves the previous one in place."""
    # not accelerate's save_state: not atomic, folders named by count, LoRA saved as full weights
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"checkpoint-{step}", run_dir / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    need = sum(_bytes(m) for m in models.values()) + _bytes(optimizer_state) + (1 << 20)
    try:
        with writing(
            f"checkpoint-{step}",
            run_dir,
            need,
            kept="; the previous checkpoint and 'latest' are kept",
        ):
            tmp.mkdir(parents=True)
            for name, model in models.items():
                model.save_pretrained(tmp / name, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / "optimizer.pt")
            # written last: its presence marks a whole folder
            torch.save(trainer_state, tmp / "trainer_state.pt")
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
    except UserError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    trash = run_dir / f".trash-checkpoint-{step}"
    if final.exists():  # re-saving a step: move the old folder aside, never delete it first
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync(run_dir)
    with writing("the 'latest' pointer", run_dir, kept=f"; {final.name} is whole"):
        pointer = run_dir / ".latest.tmp"
        with open(pointer, "w") as fh:
            fh.write(final.name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(pointer, run_dir / "latest")  # the pointer moves only once the folder is whole
    _fsync(run_dir)
    shutil.rmtree(trash, ignore_errors=True)
    ckpts = own_checkpoints(run_dir)  # never a linked folder of another run
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for old in ckpts[-keep:-1] if keep > 1 else []:
        (old / "optimizer.pt").unlink(missing_ok=True)  # only the newest keeps the optimizer
    return final


def clean_leftovers(run_dir: Path) -> None:
    """After a kill: drop half-written folders; put back an old folder a re-save had moved aside."""
    run_dir = Path(run_dir)
    for tmp in run_dir.glob(".tmp-checkpoint-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for trash in run_dir.glob(".trash-checkpoint-*"):
        final = run_dir / trash.name.replace(".trash-", "")
        if final.exists():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(trash, final)
    (run_dir / ".latest.tmp").unlink(missing_ok=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder whose `latest` file names one of its own checkpoints
    (or, if that one is gone or `latest` names a folder elsewhere, its newest whole checkpoint:
    a run never trains or scores another run's checkpoint)."""
    path = Path(path)
    if (path / "latest").is_file():
        name = (path / "latest").read_text().strip()
        target = path / name
        own = re.fullmatch(r"checkpoint-\d+", name) and not target.is_symlink()
        if name and not own:
            warn(f"{path / 'latest'} names {name!r}, not a checkpoint of this run: not followed")
        if not own or not (target / "trainer_state.pt").is_file():
            whole = whole_checkpoints(path)
            target = whole[0] if whole else target if own else path
        path = target
    if not (path / "trainer_state.pt").is_file():
        raise UserError(
            f"no checkpoint at {str(path)!r} (expected a run folder with a 'latest' "
            f"file, or a checkpoint-N folder with trainer_state.pt)"
        )
    return path


def load_trainer_state(ckpt: Path, name: str = "trainer_state.pt") -> dict:
    try:  # weights_only: a checkpoint from elsewhere cannot run code as it is unpickled
        return torch.load(Path(ckpt) / name, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"checkpoint {str(ckpt)!r} is unreadable ({type(e).__name__}: "
            f"{first_line(e) if str(e) else 'corrupt file'})"
        ) from None


def damaged_weights(folder: Path, recursive: bool = False) -> str | None:
    """Why the safetensors weights in `folder` cannot be loaded whole (a file cut short by a copy,
    a download or a disk that stopped), or None. safetensors checks each file's size against its
    header, which costs nothing before a model loads and spares the loader's traceback."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    for f in sorted(folder.rglob("*.safetensors") if recursive else folder.glob("*.safetensors")):
        try:
            with safe_open(f, "pt"):
                pass
        except (OSError, SafetensorError) as e:
            return f"the weights file {f} is cut short or is not safetensors ({first_line(e)})"
    return None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# =====================================================================================
# The run folder: a lock for the life of a run, and what counts as a run already started
# =====================================================================================
class FolderLock:
    """A folder's lock (lock_run_folder): close() removes its .lock file and then releases it, so
    a run that ends, however it ends, leaves no .lock naming a dead process. The file goes while
    the lock is still held: a process that opened it just before and locks it just after finds it
    gone from the folder, and locks a new one (lock_run_folder checks which file it holds)."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path

    def close(self) -> None:
        if self.file.closed:
            return
        with contextlib.suppress(OSError):  # unlinked only while it is still this lock's file
            if os.path.samestat(os.fstat(self.file.fileno()), os.stat(self.path)):
                os.unlink(self.path)
        self.file.close()  # releases the lock


def lock_run_folder(run_dir: Path, what: str = "run folder", other: str = "--run-name"):
    """An exclusive lock on run_dir/.lock (a FolderLock), held until the run closes (the system
    drops it if the process dies). A second process on the same folder gets one line naming the
    first; `what` the folder is and which `other` flag picks another (eval.py's --output-dir)."""
    try:  # not filelock: it leaves its .lock file behind, naming no one
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    path = Path(run_dir) / ".lock"
    while True:
        with writing(f"the {what}'s lock file", run_dir):
            f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(
                f"{what} {str(run_dir)!r} is in use by {holder}; wait for it to end or "
                f"stop it, or give another {other}"
            ) from None
        try:  # the file locked is still the folder's: its holder did not remove it as it ended
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        f.close()  # a removed file: lock the one now at that path
    f.seek(0)
    f.truncate()
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(f"process {os.getpid()} on {socket.gethostname()} (since {since})\n")
    f.flush()
    return FolderLock(f, path)


def check_sampler(sampler: PromptSampler, state: dict) -> None:
    """A run resumes on the rows it was trained on: another count or fingerprint is one line."""
    n, data = state.get("n"), state.get("data")
    data = data[1] if isinstance(data, (list, tuple)) else data  # (name, fingerprint) before
    if n not in (None, sampler.n) or state["pos"] > sampler.n or data not in (None, sampler.data):
        why = f"it has {sampler.n} rows now, the run had {n if n is not None else 'more'}"
        if n == sampler.n:
            why = "its rows differ from those the run was trained on (their fingerprint)"
        raise UserError(
            f"the training data ({sampler.name}) no longer matches the run: {why}; restore the "
            f"data it was trained on, or start a new run"
        )


def saved_args(args, algo: str) -> dict:
    """The flags a run saves (args.json, each checkpoint), with the script that made it."""
    return {"algo": algo, **dataclasses.asdict(args)}


def made_by(saved: dict | Path, algo: str, resume: str) -> None:
    """A run is continued by the script that made it: another script would accept most of its
    flags and train it with another objective."""
    if isinstance(saved, Path):
        try:
            saved = json.loads(saved.read_text())
        except (OSError, ValueError):
            return  # no readable args.json: the checkpoint's own flags are checked next
    other = saved.get("algo", algo) if isinstance(saved, dict) else algo
    if other != algo:
        raise UserError(
            f"{resume} is a run of {other}.py, not of {algo}.py: continue it with "
            f"python {other}.py --resume {resume}"
        )


def run_folder_of(resume: str) -> Path:
    """The run folder a --resume path belongs to: itself, or the parent of a checkpoint-N folder."""
    path = Path(resume)
    is_checkpoint = (path / "trainer_state.pt").is_file() and not (path / "latest").is_file()
    return path.parent if is_checkpoint else path


def started(run_dir: Path) -> bool:
    """Has a run already logged or saved something in this folder? (A start that failed before its
    first step leaves only args.json, and may be retried in place.)"""
    metrics = run_dir / "metrics.jsonl"
    return (
        (metrics.is_file() and metrics.stat().st_size > 0)
        or (run_dir / "latest").exists()
        or any(run_dir.glob("checkpoint-*"))
    )


KINDS = {float: "a number", int: "a whole number", bool: "true or false", str: "a string"}


def check_saved(args, source: Path) -> None:
    """The saved flags of a run (its args.json, or a checkpoint's trainer_state.pt) typed as the
    command line types them: a hand-edited "lr": "1e-5" is one line naming the field and the file,
    not a TypeError deep in the checks. An int stands for a float, as in --lr 1. The range checks
    follow, the command line's own (resolve)."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        v, types = getattr(args, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if isinstance(v, int) and not isinstance(v, bool) and float in types and int not in types:
            setattr(args, f.name, v := float(v))
        ok = type(v) in types  # bool is an int, but not for a flag
        choices = f.metadata.get("choices")
        if not ok or (choices and v not in choices):
            kind = f"one of {', '.join(choices)}" if ok else KINDS[types[0]]
            raise UserError(f"{source}: {f.name} must be {kind}, not {v!r}")


def changed_flags(args, saved) -> list[str]:
    """The flags given on a --resume that differ from the saved run's."""
    return [
        f"{flag(k)} {getattr(args, k)!r} (the run has {getattr(saved, k)!r})"
        for k in sorted(given_flags(args) - set(RESUMABLE), key=list(vars(args)).index)
        if getattr(args, k) != getattr(saved, k)
    ]


def own_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint-N folders, oldest first; a link to a folder elsewhere is not one."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if not p.is_symlink()]
    return sorted(found, key=_step_of)


def whole_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint folders, newest first."""
    return [p for p in reversed(own_checkpoints(run_dir)) if (p / "trainer_state.pt").is_file()]


def last_saved(run_dir: Path) -> str:
    """For the one line of a run that stops: the checkpoint --resume would take (whole: only whole
    ones are found), or that there is none."""
    try:
        ckpt = find_checkpoint(run_dir)
    except UserError:
        return "no checkpoint was saved before it"
    return f"the last checkpoint saved, whole, is {ckpt} (step {_step_of(ckpt)})"


def unsaved(path: Path) -> bool:
    """A run folder whose run stopped before its first checkpoint (killed, or a crash): its
    arguments are saved (args.json) but no checkpoint is. --resume starts it again from step 0."""
    path = Path(path)
    return (
        (path / "args.json").is_file()
        and not (path / "latest").exists()
        and not whole_checkpoints(path)
    )


# =====================================================================================
# Per-token HTML samples: one self-contained file, no network
# =====================================================================================
def _colour(v: float, lo: float, hi: float) -> str:
    """White at 0; red for positive and blue for negative when the range crosses 0, else orange."""
    if lo < 0 < hi:
        s = v / max(abs(lo), abs(hi)) if v else 0.0
        c = int(255 * (1 - abs(s)))
        r, g, b = (255, c, c) if s > 0 else (c, c, 255)
    else:
        s = (v - lo) / (hi - lo) if hi > lo else (1.0 if v else 0.0)
        r, g, b = 255, int(255 - 120 * s), int(255 - 255 * s)
    return f"rgb({r},{g},{b})"


def token_html(title: str, rows: list[dict]) -> str:
    """rows: {"header", "prompt", "tokens": [str], "values": {name: [float per token]}}. Each
    token is a <span class="tok"> with data-<name> colours and a title listing every value."""
    names = list(rows[0]["values"]) if rows else []
    every = {n: [v for r in rows for v in r["values"][n]] or [0.0] for n in names}
    ranges = {n: (min(vs), max(vs)) for n, vs in every.items()}
    out = [
        f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        ".tok{font-family:monospace;white-space:pre-wrap;border-radius:2px}"
        ".sample{border:1px solid #ccc;padding:.5em;margin:1em 0}.p{color:#666}</style>",
        f"<h2>{escape(title)}</h2><p>Colour by: <select id='q' onchange='paint()'>",
        *[f"<option>{escape(n)}</option>" for n in names],
        "</select> (hover a token for every value)</p>",
    ]
    for r in rows:
        out.append(
            f"<div class='sample'><b>{escape(r['header'])}</b>"
            f"<div class='p'>{escape(r['prompt'][-200:])}</div><div>"
        )
        for t, tok in enumerate(r["tokens"]):
            vals = {n: r["values"][n][t] for n in names}
            data = " ".join(f"data-{escape(n)}='{_colour(v, *ranges[n])}'" for n, v in vals.items())
            tip = ", ".join(f"{n}={v:.4g}" for n, v in vals.items())
            out.append(f"<span class='tok' {data} title='{escape(tip)}'>{escape(tok)}</span>")
        out.append("</div></div>")
    out.append(
        "<script>function paint(){var q=document.getElementById('q').value;"
        "document.querySelectorAll('.tok').forEach(function(e){"
        "e.style.background=e.getAttribute('data-'+q)||''})}paint()</script>"
    )
    return "\n".join(out)


# =====================================================================================
# The run: folder, --resume, Ctrl-C / SIGTERM, progress bar, checkpoints, summary
# =====================================================================================
class Run:
    """A new run refuses an existing folder; --resume DIR continues in DIR itself with the saved
    arguments (a flag that would change them is an error; RESUMABLE ones may change), cuts
    metrics.jsonl back to the checkpoint's step, and cleans what a kill left behind; a run that
    stopped before its first checkpoint starts again from step 0, and one already at --steps
    trains nothing and says so (exit 0). The folder is locked for the life of the run. A new
    run's folder is made at once (a folder in use or not writable is one line before any model
    loads), but it is removed if the run closes before it attaches its model and data (a model
    that fails to load leaves nothing behind). On CUDA it first prints the run's expected memory
    and time (check_cost; `needs_reference`: the script's), and a run the GPU cannot hold stops
    there, in one line. A stop signal (Ctrl-C, SIGTERM, SIGHUP; exit 130 / 143 / 129) in a step's
    rollouts stops at once and saves the step before, as it was when this one began (weights,
    optimizer, sampler, RNG), so --resume redoes the step as an unstopped run would; in the update
    it waits for the update (`updating` to `updated`); after it (the evaluation) it stops at once
    and saves this step, whose evaluation --resume runs first. Before the run attaches it stops at
    once; a second Ctrl-C stops at once, in one line, leaving the checkpoint on disk whole."""

    def __init__(self, args, algo: str, resolve, needs_reference):
        self.algo, self.ckpt, self.state, self.lock = algo, None, None, None
        self.made, self.models = False, None  # made: this run made its folder (and may remove it)
        self.logger, self.bar, self._previous, self.saving = None, None, {}, None
        self.phase, self.start, self.step, self._row = "loading", 0, 0, None
        _ACTIVE_RUNS.append(self)
        try:
            self._open(args, resolve, needs_reference)
        except BaseException:  # a run that cannot start leaves no lock or handler behind
            self.close()
            raise

    def _open(self, args, resolve, needs_reference) -> None:
        algo = self.algo
        restart = False  # --resume of a run that stopped before its first checkpoint
        if args.resume:
            self.dir = run_folder_of(args.resume)
            made_by(self.dir / "args.json", algo, args.resume)  # before anything is written
            if self.dir.is_dir():
                self.lock = lock_run_folder(self.dir)  # before reading: another run may be pruning
                clean_leftovers(self.dir)  # what a kill while saving left behind
            restart = unsaved(Path(args.resume))
            if restart:
                where = Path(args.resume)
                try:
                    saved = json.loads((where / "args.json").read_text())
                except (OSError, ValueError):
                    raise UserError(f"{where / 'args.json'} is unreadable") from None
            else:
                self.ckpt = where = find_checkpoint(args.resume)
                self.state = load_trainer_state(self.ckpt)
                self._check_weights()
                saved = self.state.get("args")
            made_by(saved, algo, args.resume)
            try:
                saved = type(args)(**{k: v for k, v in saved.items() if k != "algo"})
            except TypeError:
                what = "run folder" if restart else "checkpoint"
                raise UserError(
                    f"{what} {str(where)!r} was not written by {algo}.py (its arguments differ)"
                ) from None
            check_saved(saved, where / ("args.json" if restart else "trainer_state.pt"))
            changed = changed_flags(args, saved)
            if changed:
                raise UserError(
                    f"--resume keeps the run's arguments, but {'; '.join(changed)}: "
                    f"only "
                    f"{', '.join('--' + k.replace('_', '-') for k in RESUMABLE[:-1])} "
                    f"may change; start a new run to change the others"
                )
            for k in given_flags(args) & set(RESUMABLE):
                setattr(saved, k, getattr(args, k))
            if args.threads is None:  # chosen again for this machine (OMP_NUM_THREADS, preset)
                saved.threads = None
            self.dir = where if restart else self.ckpt.parent  # where it was pointed, even a copy
            saved.output_dir, saved.run_name = str(self.dir.parent), self.dir.name
            saved.given = set(vars(saved))  # the run's flags are all kept: no preset changes them
            args = saved
        self.args = args = resolve(args)
        self.device = resolve_device(args.device)
        torch.set_num_threads(args.threads)
        threads = f"{args.threads} torch thread{'s' * (args.threads > 1)}"
        print(f"{algo}: {threads} on {self.device} (--threads or OMP_NUM_THREADS to change)")
        if self.state is not None and args.steps <= self.state["step"] and "row" not in self.state:
            print(
                f"nothing to train: {self.ckpt} is at step {self.state['step']} already, and "
                f"--steps is {args.steps}; give a larger --steps to train further"
            )
            raise SystemExit(0)
        if self.device.type == "cuda":  # what the run will cost, before any model loads
            spec = importlib.util.spec_from_file_location("cost", ROOT / "tools" / "cost.py")
            cost = importlib.util.module_from_spec(spec)  # a tool's estimate, loaded only here
            spec.loader.exec_module(cost)
            cost.check_run(args, needs_reference(args), self.device)
        if self.ckpt is None and not restart:
            name = args.run_name  # one folder in --output-dir, never a path out of it
            if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
                raise UserError(f"--run-name {name!r} must be one folder name, without / or ..")
            self.dir = Path(args.output_dir) / name
            with writing(
                "the run folder", self.dir.parent if self.dir.parent.exists() else Path.cwd()
            ):
                self.made = not self.dir.exists()
                self.dir.mkdir(parents=True, exist_ok=True)
            self.lock = lock_run_folder(self.dir)
            if started(self.dir) and unsaved(self.dir):
                raise UserError(
                    f"run folder {str(self.dir)!r} already exists, but its run stopped "
                    f"before its first checkpoint: start it again from step 0, with "
                    f"its saved arguments, with --resume {self.dir}; or pick another "
                    f"--run-name"
                )
            if started(self.dir):
                raise UserError(
                    f"run folder {str(self.dir)!r} already exists: continue it with "
                    f"--resume {self.dir}, or pick another --run-name"
                )
            write_text(self.dir / "args.json", json.dumps(saved_args(args, algo), indent=2))
        elif restart:
            print(
                f"{self.dir} has no checkpoint (its run stopped before the first): starting it "
                f"again from step 0 with its saved arguments"
            )
            self._cut_metrics(-1)  # the steps logged before the stop are run again
            write_text(self.dir / "args.json", json.dumps(saved_args(args, algo), indent=2))
        else:  # a step saved with its figures ("row") logs them again, after its evaluation
            self._cut_metrics(self.state["step"] - ("row" in self.state))
        random.seed(args.seed)
        torch.manual_seed(args.seed)  # also seeds every CUDA device
        self.logger = RunLogger(self.dir, args.tensorboard)
        self.stop_signal, self.last_metrics, self._stalled = None, None, 0
        self.step_start = time.perf_counter()
        self._said_timeouts = False
        self._previous = catch_stop_signals(self._on_signal)

    # --- resume ---------------------------------------------------------------------
    def _check_weights(self) -> None:
        """A checkpoint whose weights file is cut short is one line naming the file, and the
        newest earlier checkpoint of the run whose files are whole, to resume from instead."""
        damage = damaged_weights(self.ckpt, recursive=True)
        if damage is None:
            return
        step = _step_of(self.ckpt)
        earlier = [p for p in whole_checkpoints(self.ckpt.parent) if _step_of(p) < step]
        intact = next((p for p in earlier if damaged_weights(p, recursive=True) is None), None)
        then = (
            f"the previous checkpoint, {intact}, is intact: continue from it with --resume {intact}"
            if intact
            else "no earlier checkpoint of this run is intact"
        )
        raise UserError(f"cannot resume from {self.ckpt}: {damage}; {then}")

    def weights(self, name: str = "", default: str | None = None) -> str:
        """Where to load model `name` from: the checkpoint being resumed, else `default`."""
        if self.ckpt is not None:
            return str(self.ckpt / name)
        return default if default is not None else self.args.model

    def attach(self, models: dict, tokenizer, state: dict) -> int:
        """Register what a checkpoint holds (models by subfolder, "" for the policy; objects with
        state_dict / load_state_dict, those named *optimizer* kept only in the newest checkpoint).
        On --resume load their saved state and the RNG. Returns the step to start after."""
        need = sum(3 * _bytes(m) for m in models.values())  # weights, and AdamW's 2 moments
        free = shutil.disk_usage(self.dir).free
        if free < need:  # the first save would fail, hours in
            raise UserError(
                f"a checkpoint of this run needs about {_mb(need)} and {self.dir} has {_mb(free)} "
                f"free: free some space, or give another --output-dir"
            )
        self.models, self.tokenizer, self.stateful = models, tokenizer, state
        self.phase = "start"
        if self.state is None:
            return 0
        opt_file = self.ckpt / "optimizer.pt"
        opt_state = load_trainer_state(self.ckpt, "optimizer.pt") if opt_file.is_file() else None
        for k, obj in state.items():
            if isinstance(obj, PromptSampler):
                check_sampler(obj, self.state[k])
            if "optimizer" not in k:
                obj.load_state_dict(self.state[k])
            elif opt_state is None:
                warn(
                    f"{self.ckpt.name} keeps no optimizer state (only the newest checkpoint "
                    f"does): AdamW moments start from zero"
                )
            else:
                obj.load_state_dict(opt_state[k])
        set_rng_state(self.state["rng"])
        print(f"resumed {self.dir} from {self.ckpt.name} at step {self.state['step']}")
        self.start, self._row = self.state["step"], self.state.get("row")
        if self._row is not None and not self.eval_due(self.start):
            self.log(self.start, {})  # a stop before an evaluation that was not due: its figures
        return self.start

    def eval_due(self, step: int) -> bool:
        """Is the held-out evaluation due after `step`? Every --eval-every steps and after the
        last; at the step the run starts from, only if it has not run (step 0 of a new run, or a
        step whose evaluation a stop cut short)."""
        due = step % self.args.eval_every == 0 or step == self.args.steps
        if step == self.start and self.state is not None:
            return due and self._row is not None
        return due

    def _cut_metrics(self, step: int) -> None:
        """Rows logged after the checkpoint (a crash between saves) would be logged again."""
        path = self.dir / "metrics.jsonl"
        if path.is_file():
            keep = [r for r in read_metrics(self.dir) if r["step"] <= step]
            write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in keep))

    # --- the loop ---------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        if self.stop_signal is not None:  # stopping already: only a second Ctrl-C is heard
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.stop_signal, name = signum, signal_name(signum)
        if self.models is None:  # still loading: no step to finish, nothing to save
            tqdm.write(f"{name}: stopped before the first step; nothing was saved")
            raise SystemExit(128 + signum)
        if self.phase in ("update", "end"):  # weights half-updated: the update ends first
            tqdm.write(f"{name}: finishing this step's update, then saving (Ctrl-C again to abort)")
            return
        raise Stop(signum)  # rollouts, evaluation: nothing is lost by dropping them (stopped)

    def _snapshot(self) -> tuple[dict, dict]:
        """What a checkpoint saves beside the weights and optimizer, as it is now."""
        small = {k: v.state_dict() for k, v in self.stateful.items() if "optimizer" not in k}
        return copy.deepcopy(small), rng_state()

    def updating(self) -> None:
        """The update begins: a stop signal from here waits for `updated`."""
        self.phase = "update"

    def updated(self, metrics: dict) -> None:
        """The step's update is done and `metrics` hold its figures: a stop signal from here (the
        evaluation) saves this step at once, its evaluation left to --resume; so does one that
        came during the update."""
        self.phase, self._after = "after", (self._timed(metrics), self._snapshot())
        if self.stop_signal is not None:
            raise Stop(self.stop_signal)

    def stopped(self, signum: int) -> str:
        """A stop signal ended rollouts or an evaluation at once: save the last finished state
        (that of this step after its update, or of the step before, as it was when this one began)
        and return the line that says so."""
        name, step, after = signal_name(signum), self.step, self.phase == "after"
        saved = step if after else step - 1
        if self.phase == "start" or saved == self.start and not after:  # nothing new
            then = "start it again from step 0" if unsaved(self.dir) else "continue"
            return (
                f"{name}: stopped; nothing new to save, {last_saved(self.dir)}; {then} with: "
                f"python {self.algo}.py --resume {self.dir}"
            )
        row, (small, rng) = self._after if after else (None, self._began)
        where = f"after step {step}'s update" if after else f"in step {step}'s rollouts"
        tqdm.write(f"{name}: stopped {where}; saving step {saved}")
        path = self.save(saved, small, rng, row)
        return f"stopped: saved {path}; continue with: python {self.algo}.py --resume {self.dir}"

    def steps(self, start: int):
        """The steps left to train, behind the progress bar; each step's wall time is kept."""
        steps = range(start + 1, self.args.steps + 1)
        self.bar = tqdm(
            steps, initial=start, total=self.args.steps, desc=self.algo, dynamic_ncols=True
        )
        for step in self.bar:
            self.step, self.step_start = step, time.perf_counter()
            self.phase, self._began = "rollout", self._snapshot()  # a stop now saves this state
            if self.stop_signal is not None:  # it came as the last step ended
                raise Stop(self.stop_signal)
            yield step

    def log(self, step: int, metrics: dict) -> None:
        if self._row is not None and step == self.start:  # the figures of a step a stop saved
            metrics, self._row = {**self._row, **metrics}, None
        self.logger.log(step, metrics)
        if "eval/greedy_acc" in metrics:
            tqdm.write(
                f"step {step}: held-out greedy acc {metrics['eval/greedy_acc']:.3f}, "
                f"sampled acc {metrics['eval/sampled_acc']:.3f}"
            )
        timeouts = metrics.get("grader_timeouts", 0) + metrics.get("eval/grader_timeouts", 0)
        if timeouts and not self._said_timeouts:  # once a run: the counts are in metrics.jsonl
            self._said_timeouts = True
            warn(
                f"step {step}: {timeouts} grade(s) ran out of --grader-timeout "
                f"({self.args.grader_timeout} s) and counted as wrong, so rewards and accuracy "
                f"depend on this machine's speed and load (grader_timeouts in metrics.jsonl); "
                f"a larger --grader-timeout makes them less so"
            )

    def end_step(self, step: int, metrics: dict) -> None:
        """Log the step, update the bar, warn if nothing can be learned, save when due or asked."""
        self.phase = "end"
        metrics = self._timed(metrics)
        self.log(step, metrics)
        self.last_metrics = metrics
        if self.bar is not None:
            shown = {s: metrics[k] for k, s in BAR_FIGURES.items() if k in metrics}
            self.bar.set_postfix(
                {s: f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}" for s, v in shown.items()}
            )
        self._check_signal(metrics)
        if step % self.args.save_every == 0 or step == self.args.steps or self.stop_signal:
            path = self.save(step)
            if self.stop_signal:
                tqdm.write(
                    f"stopped: saved {path}; continue with: python {self.algo}.py --resume "
                    f"{self.dir}"
                )
                raise SystemExit(128 + self.stop_signal)

    def _timed(self, metrics: dict) -> dict:
        seconds = time.perf_counter() - self.step_start
        tokens_per_s = metrics.get("tokens", 0) / seconds  # completion tokens sampled
        return {**metrics, "time/step": seconds, "tokens_per_s": tokens_per_s}

    def _check_signal(self, m: dict) -> None:
        """A run whose rewards never differ within a group learns nothing: say so, and why."""
        silent = m.get("unparsable_frac", 0) >= 0.9 or m.get("zero_std_frac", 0) >= 0.9
        self._stalled = self._stalled + 1 if silent else 0
        if self._stalled == STALL_STEPS:
            warn(
                f"{STALL_STEPS} steps in a row with almost no learning signal ("
                f"{m.get('unparsable_frac', 0):.0%} of completions had no parsable answer, "
                f"{m.get('zero_std_frac', 0):.0%} of groups had equal rewards, "
                f"{m.get('truncated_frac', 0):.0%} were cut off). Likely: the answer is not in "
                f"\\boxed{{}} (check --template, or --answer-extraction math_verify), completions "
                f"are cut off (raise --max-new-tokens), or the task is too hard or too easy"
            )

    def save(self, step: int, small=None, rng=None, row: dict | None = None) -> Path:
        """Checkpoint-<step>: the weights and optimizer as they are; the rest (sampler,
        scheduler, RNG) as they are or as given (a stop's snapshot), with the figures of a step
        whose evaluation is still to run (`row`)."""
        for name, model in self.models.items():
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise UserError(
                    f"the weights of {name or 'the policy'} are not finite at step "
                    f"{step}; not saved; {last_saved(self.dir)}"
                )
        if small is None:
            small, rng = self._snapshot()
        big = {k: v.state_dict() for k, v in self.stateful.items() if "optimizer" in k}
        trainer_state = {"step": step, "rng": rng, "args": saved_args(self.args, self.algo)}
        trainer_state |= small | ({"row": row} if row is not None else {})
        self.saving = step  # for the line of a second Ctrl-C
        path = save_checkpoint(
            self.dir,
            step,
            self.models,
            self.tokenizer,
            trainer_state,
            big,
            self.args.keep_checkpoints,
        )
        self.saving = None
        return path

    def write_samples(
        self, step: int, tokenizer, batch: dict, rewards, advantages, per_token: dict, k: int = 4
    ) -> Path:
        """runs/<run>/samples/step-<N>.html: k completions, each token coloured by one of the
        algorithm's per-token quantities (a menu switches between them), every value on hover."""
        rows = []
        for b in range(min(k, len(batch["texts"]))):
            n, ids = int(batch["mask"][b].sum()), batch["completion_ids"][b].tolist()
            header = f"reward {float(rewards[b]):+.3f}" + (
                f"   advantage {float(advantages[b]):+.3f}" if advantages.dim() == 1 else ""
            )
            rows.append(
                {
                    "header": header,
                    "prompt": batch["prompts"][b],
                    "tokens": [tokenizer.decode([i]) for i in ids[:n]],
                    "values": {
                        q: [float(x) for x in v[b, :n].tolist()] for q, v in per_token.items()
                    },
                }
            )
        path = self.dir / "samples" / f"step-{step}.html"
        with writing(path.name, path.parent.parent):
            path.parent.mkdir(exist_ok=True)
        write_text(path, token_html(f"{self.algo} run {self.dir.name}, step {step}", rows))
        return path

    # --- the end ----------------------------------------------------------------------
    def finish(self) -> dict:
        self.close()
        summary = {"run_dir": str(self.dir), "steps": self.args.steps}
        evals = [m for m in read_metrics(self.dir) if "eval/sampled_acc" in m]
        if evals:
            summary["first_eval"] = {k: v for k, v in evals[0].items() if k.startswith("eval/")}
            summary["last_eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
        if self.last_metrics:
            summary["last_step"] = {
                k: _json_value(v) for k, v in self.last_metrics.items() if isinstance(v, float)
            }
        write_text(self.dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False))
        print(f"\ndone: {self.args.steps} steps, run folder {self.dir}")
        if evals:
            f, last = evals[0], evals[-1]
            print(
                f"held-out accuracy  greedy {f['eval/greedy_acc']:.3f} -> "
                f"{last['eval/greedy_acc']:.3f}   sampled {f['eval/sampled_acc']:.3f} -> "
                f"{last['eval/sampled_acc']:.3f}"
            )
        return summary

    # --- a stop that is no UserError -------------------------------------------------------
    def blew_up(self) -> str:
        """The line for a policy whose sampling met inf / nan probabilities (torch.multinomial's
        RuntimeError): its weights, finite when saved, have grown past what softmax can take."""
        step = self.bar.n + 1 if self.bar is not None else 0  # the bar counts the steps done
        return (
            f"the policy blew up at step {step}: its next-token probabilities are inf or nan, "
            f"as a too high learning rate makes them (--lr {self.args.lr:g}); "
            f"{last_saved(self.dir)}; start a new run with a lower --lr"
        )

    def interrupted(self) -> str:
        """The line for a second Ctrl-C, which may land in the middle of a save: what that save
        left half-done is cleaned as --resume would clean it, and the checkpoint it resumes from,
        whole, is named."""
        with contextlib.suppress(OSError):
            clean_leftovers(self.dir)
        during = f" while saving checkpoint-{self.saving}" if self.saving is not None else ""
        then = "start it again from step 0" if unsaved(self.dir) else "continue"
        return (
            f"stopped by a second Ctrl-C{during}: {last_saved(self.dir)}; {then} with: "
            f"python {self.algo}.py --resume {self.dir}"
        )

    def close(self) -> None:
        if self not in _ACTIVE_RUNS:
            return
        _ACTIVE_RUNS.remove(self)
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:
            self.logger.close()
        restore_signals(self._previous)
        if self.lock is None:
            return
        unstarted = self.made and self.models is None
        if unstarted:  # what _open wrote: the run never began, the folder is no run's
            for name in ("args.json", "metrics.jsonl"):
                with contextlib.suppress(OSError):
                    (self.dir / name).unlink()
            shutil.rmtree(self.dir / "tb", ignore_errors=True)
        self.lock.close()  # removes .lock and releases it
        if unstarted:
            with contextlib.suppress(OSError):  # anything else in it (someone's file) keeps it
                self.dir.rmdir()


def _blown_up(e: BaseException) -> bool:
    """torch.multinomial's error for inf, nan or negative probabilities: sampling from a model
    whose logits are no longer finite."""
    return isinstance(e, RuntimeError) and "probability tensor contains either" in str(e)


@contextlib.contextmanager
def user_errors(then: str = ""):
    """Around a script's main: a UserError is one line on stderr and exit code 2, and so is a
    policy that blew up in a run; a stop signal is one line (`then` says what next, outside a
    run) and exit code 128 + its number, as is a second Ctrl-C in a run (130). Whatever happens,
    open runs close (log files, signal handlers, the folder's lock)."""
    try:
        yield
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always one line
        raise SystemExit(2) from None
    except RuntimeError as e:
        if not (_blown_up(e) and _ACTIVE_RUNS):
            raise
        print("error: " + _ACTIVE_RUNS[-1].blew_up(), file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, Stop) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if not _ACTIVE_RUNS:
            print(f"stopped by {signal_name(signum)}{then}", file=sys.stderr)
            raise SystemExit(128 + signum) from None
        run = _ACTIVE_RUNS[-1]
        try:
            line = run.interrupted() if isinstance(e, KeyboardInterrupt) else run.stopped(signum)
        except KeyboardInterrupt:  # a second Ctrl-C, in the stop's save
            line, signum = run.interrupted(), signal.SIGINT
        except UserError as u:  # weights not finite: not saved
            print("error: " + " ".join(str(u).split()), file=sys.stderr)
            raise SystemExit(2) from None
        print(line, file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        for run in list(_ACTIVE_RUNS):
            run.close()
