import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist workers share the cores: one that also ran a torch thread per core would
# oversubscribe them (measured: a learning test 4.6x slower beside another one). Each worker,
# and each script it starts as a subprocess, gets cores // workers threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = _threads
    import torch

    torch.set_num_threads(int(_threads))


@pytest.fixture(scope="session")
def tiny_dir():
    import runner

    assert (runner.TINY_MODEL_DIR / "config.json").is_file(), "bundled tiny model is missing"
    return runner.TINY_MODEL_DIR


@pytest.fixture
def one_line_error(capsys):
    """one_line_error(main, argv): main(argv) exits 2 with no traceback; returns its last stderr
    line (progress bars may come before it), which starts with 'error: '."""

    def run(main, argv) -> str:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: "), err
        return last

    return run


@pytest.fixture
def terminal_signals():
    """A preexec_fn that starts a child's stop signals as a terminal does: a child of `pytest &`
    inherits SIGINT ignored (of nohup, SIGHUP), and a run then leaves it so."""

    def reset():
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    return reset


@pytest.fixture
def terminal_sigint():
    """This process's SIGINT as a terminal starts Python, for a test that raises it in-process."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
