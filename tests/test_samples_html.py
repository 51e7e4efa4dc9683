"""Per-token HTML samples: one self-contained file that parses, one span per completion token,
coloured by each algorithm quantity, every value on hover, and the right tokens marked."""

import re
from html.parser import HTMLParser

import runner


class Spans(HTMLParser):
    """Collects the token spans (their attributes and text) and any external reference."""

    def __init__(self):
        super().__init__()
        self.spans, self.external, self._in = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class") == "tok":
            self._in = {"attrs": attrs, "text": ""}
        for key in ("src", "href"):
            if key in attrs:
                self.external.append(attrs[key])

    def handle_data(self, data):
        if self._in is not None:
            self._in["text"] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._in is not None:
            self.spans.append(self._in)
            self._in = None


def _parse(path):
    p = Spans()
    p.feed(path.read_text())
    return p


def test_renderer_colours_each_quantity_and_escapes_text(tmp_path):
    rows = [
        {
            "header": "reward +1.000",
            "prompt": "7+5-8 <b>",
            "tokens": ["a", "<", "&"],
            "values": {
                "entropy": [0.0, 1.0, 2.0],
                "kl_mask": [0.0, 1.0, 0.0],
                "adv": [-1.0, 0.0, 1.0],
            },
        }
    ]
    path = tmp_path / "s.html"
    path.write_text(runner.token_html("t", rows))
    p = _parse(path)
    assert p.external == []  # self-contained: no network
    # escaped in the file, text again when parsed
    assert [s["text"] for s in p.spans] == ["a", "<", "&"]
    white = "rgb(255,255,255)"
    # marked tokens
    assert [s["attrs"]["data-kl_mask"] == white for s in p.spans] == [True, False, True]
    assert p.spans[0]["attrs"]["data-entropy"] == white
    assert p.spans[2]["attrs"]["data-entropy"] != white
    # a quantity that crosses 0 is diverging: negative blue, zero white, positive red
    neg, zero, pos = (s["attrs"]["data-adv"] for s in p.spans)
    assert neg == "rgb(0,0,255)" and zero == white and pos == "rgb(255,0,0)"
    assert p.spans[1]["attrs"]["title"] == "entropy=1, kl_mask=1, adv=0"


def test_tepo_run_marks_exactly_the_tokens_of_its_kl_mask(tmp_path):
    """TEPO's page shows the predicted mask: marked iff the completion's advantage is positive
    and c > 0 at that token."""
    import tepo

    tepo.main(
        [
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--micro-batch-size",
            "8",
            "--num-mini-batches",
            "1",
            "--eval-dataset",
            "none",
            "--tensorboard",
            "false",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "h",
        ]
    )
    page = tmp_path / "h" / "samples" / "step-1.html"
    text = page.read_text()
    advantages = [float(a) for a in re.findall(r"advantage ([+-][0-9.]+)", text)]
    assert len(advantages) == 4
    assert "<option>kl_mask</option>" in text
    assert "<option>c</option>" in text
    blocks = text.split("<div class='sample'>")[1:]
    marked = 0
    for adv, block in zip(advantages, blocks):
        for s in _parse_block(block):
            vals = dict(kv.split("=") for kv in s["attrs"]["title"].split(", "))
            expect = adv > 0 and float(vals["c"]) > 0
            assert (float(vals["kl_mask"]) == 1.0) == expect, (adv, vals)
            marked += expect
    assert marked > 0  # the page is not trivially unmarked (seeded)


def _parse_block(block):
    p = Spans()
    p.feed(block)
    return p.spans
