"""The console's step lines and the tqdm progress bar on one terminal (issue 28 item 6): a step
line never lands on the bar's line; the bar is cleared first and drawn again below it."""

from __future__ import annotations

import io
import re

from tqdm import tqdm

from rlhf_megatron.records.metrics import ConsoleSink


def test_step_line_starts_its_own_line_while_a_bar_is_drawn():
    terminal = io.StringIO()  # stdout and stderr of one terminal
    bar = tqdm(total=3, desc="train", file=terminal, mininterval=0, ascii=True)
    try:
        bar.update(1)
        ConsoleSink(keys=["reward/mean"], stream=terminal).log(1, {"reward/mean": 0.5})
        bar.update(1)
    finally:
        bar.close()
    text = terminal.getvalue()
    # What a terminal shows: each \r returns to the start of the line, \n starts a new one.
    segments = re.split(r"[\r\n]", text)
    assert "step 1 | reward/mean 0.5" in segments, text
    line_at = text.index("step 1 | reward/mean 0.5")
    assert text[line_at - 1] in "\r\n", text  # not appended to the bar's text
    assert "2/3" in text[line_at:], text  # the bar is drawn again after the line


def test_without_a_bar_the_line_is_printed_as_before(capsys):
    ConsoleSink(keys=["kl"]).log(2, {"kl": 0.25})
    assert capsys.readouterr().out == "step 2 | kl 0.25\n"
