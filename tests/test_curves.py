"""tools/curves.py: the curves of finished runs as one PNG; a folder that is not a run: one line."""

import json

import pytest

from tools import curves


def fake_run(folder, accs):
    folder.mkdir()
    rows = [{"step": s, "truncated_frac": 1.0 - s / 10} for s in range(1, 11)]
    rows += [
        {"step": s, "eval/greedy_acc": a, "eval/sampled_acc": a / 2}
        for s, a in zip((0, 5, 10), accs)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_running_mean_by_hand():
    assert curves.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_two_runs_make_one_png(tmp_path):
    a = fake_run(tmp_path / "grpo", [0.1, 0.2, 0.3])
    b = fake_run(tmp_path / "tepo", [0.1, 0.15, 0.25])
    runs = curves.load([str(a), str(b)])
    assert sorted(label for label, _ in runs) == ["grpo", "tepo"]
    out = tmp_path / "c.png"
    assert curves.main(["--runs", f"{a},{b}", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_not_a_run_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        curves.main(["--runs", str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path} is not a run folder (no metrics.jsonl)"
