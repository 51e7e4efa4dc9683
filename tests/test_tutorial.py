"""docs/tutorial.md quotes the code it explains, and a quote must not drift from the code. Every
```python block names the file it quotes in an HTML comment on the line just before its fence
(`<!-- grpo.py -->`); its lines, dedented, must appear in that file one after another (each line
compared with its leading and trailing whitespace stripped), where a line that is exactly `...`
stands for any run of lines (possibly none). A block that quotes no file (a shell command, a
formula) is ```bash or ```text, and every block names its language, so none escapes the check."""

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^\s*```(\S*)\s*$")
SOURCE = re.compile(r"^\s*<!--\s*(\S+)\s*-->\s*$")
GAP = "..."


def unindent(line: str, indent: int) -> str:
    """A line of a block inside a list item, without the fence's indentation."""
    return line[indent:] if line[:indent].strip() == "" else line


def blocks(text: str) -> list[dict]:
    """Every fenced block: its language, the line of its opening fence (1-based), the text of
    the line just before that fence, and its lines (with the fence's indentation removed)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])), None)
        assert end is not None, f"docs/tutorial.md:{i + 1}: a code block is never closed"
        assert not FENCE.match(lines[end]).group(1), (
            f"docs/tutorial.md:{end + 1}: a fence with a language inside the block of line {i + 1}"
        )
        out.append(
            {
                "lang": opening.group(1),
                "line": i + 1,
                "before": lines[i - 1] if i else "",
                "body": [unindent(line, indent) for line in lines[i + 1 : end]],
            }
        )
        i = end + 1
    return out


def quoted_in(quote: list[str], source: list[str]) -> bool:
    """Whether the lines of `quote` appear in `source` one after another, each compared with its
    surrounding whitespace stripped; a line `...` stands for any run of lines (possibly none)."""
    wanted = [line.strip() for line in textwrap.dedent("\n".join(quote)).splitlines()]
    have = [line.strip() for line in source]
    parts, part = [], []
    for line in wanted:
        if line == GAP:
            parts.append(part)
            part = []
        else:
            part.append(line)
    parts.append(part)

    pos = 0  # the earliest place of each part leaves the most room for the parts after it
    for part in parts:
        at = next(
            (i for i in range(pos, len(have) - len(part) + 1) if have[i : i + len(part)] == part),
            None,
        )
        if at is None:
            return False
        pos = at + len(part)
    return True


BLOCKS = blocks(TUTORIAL.read_text())
PYTHON = [b for b in BLOCKS if b["lang"] == "python"]


def test_the_tutorial_quotes_python():
    assert len(PYTHON) >= 10, "docs/tutorial.md should quote the scripts it explains"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"line{b['line']}-{b['lang'] or 'bare'}")
def test_every_block_names_its_language(block):
    assert block["lang"], (
        f"docs/tutorial.md:{block['line']}: a code block without a language; quoted code is "
        f"```python with its file named above it, anything else ```bash or ```text"
    )


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"line{b['line']}")
def test_every_python_block_names_its_file(block):
    source = SOURCE.match(block["before"])
    assert source, (
        f"docs/tutorial.md:{block['line']}: a ```python block without the file it quotes on the "
        f"line before it, as <!-- grpo.py -->"
    )
    assert (ROOT / source.group(1)).is_file(), (
        f"docs/tutorial.md:{block['line']}: {source.group(1)} is no file of this repository"
    )


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"line{b['line']}")
def test_every_python_block_is_in_the_file_it_names(block):
    source = SOURCE.match(block["before"])
    if not source or not (ROOT / source.group(1)).is_file():
        pytest.skip("no file named (test_every_python_block_names_its_file)")
    path = ROOT / source.group(1)
    assert [line for line in block["body"] if line.strip() not in ("", GAP)], (
        f"docs/tutorial.md:{block['line']}: an empty quote"
    )
    assert quoted_in(block["body"], path.read_text().splitlines()), (
        f"docs/tutorial.md:{block['line']}: this block is not in {source.group(1)} as quoted:\n"
        + "\n".join(block["body"])
    )


SOURCE_TEXT = """\
def f(x):
    y = x + 1
    z = y * 2
    return z
"""


@pytest.mark.parametrize(
    "quote, found",
    [
        (["y = x + 1", "z = y * 2"], True),
        (["    y = x + 1", "    z = y * 2"], True),  # dedented, then stripped per line
        (["def f(x):", "...", "return z"], True),  # ... stands for two lines
        (["y = x + 1", "...", "z = y * 2"], True),  # ... for none
        (["...", "return z"], True),
        (["y = x + 1", "return z"], False),  # not one after another
        (["z = y * 2", "y = x + 1"], False),  # out of order
        (["y = x + 2"], False),  # one character changed
        (["return z", "...", "def f(x):"], False),
    ],
)
def test_the_matcher(quote, found):
    assert quoted_in(quote, SOURCE_TEXT.splitlines()) is found


def test_the_reader_of_blocks():
    text = "a\n<!-- grpo.py -->\n```python\nx = 1\n```\n- item:\n   ```bash\n   ls\n   ```\n"
    got = blocks(text)
    assert [(b["lang"], b["line"], b["before"], b["body"]) for b in got] == [
        ("python", 3, "<!-- grpo.py -->", ["x = 1"]),
        ("bash", 7, "- item:", ["ls"]),
    ]
