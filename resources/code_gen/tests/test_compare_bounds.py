"""Comparing a huge output costs memory linear in the expected output (issue 33, "Gateway and comparer bounds").

Before: the comparison split the whole output into lines and made one ``Decimal`` per token of a line that
differed from the expected one: a 15 MiB line of numbers peaked at 1,073 MB. Now it stops as soon as a line
(or the output) has more tokens (lines) than the expected one, holding one output token at a time, with
NeMo Gym's verdicts unchanged (the differential test against its rule as written).
"""

from __future__ import annotations

import random
import subprocess
import sys
from decimal import Decimal
from typing import Any

import pytest

from gym_runtime.resources.code_gen.grading import compare_stdout

PEAK = """
import sys, tracemalloc
from gym_runtime.resources.code_gen.grading import stdio_judgement
body = {body}
tracemalloc.start()
verdict = stdio_judgement(body, "", {expected!r})
print(tracemalloc.get_traced_memory()[1] - len(body), verdict is None)
"""

MIB = 1 << 20


def peak_above_the_output(body: str, expected: str) -> tuple[int, bool]:
    """Peak bytes a stdout comparison allocates beyond one copy of the output (its decoded text), in a
    fresh interpreter; and whether the output was accepted."""
    script = PEAK.format(body=body, expected=expected)
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), out[1] == "True"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('b"1 " * (2 * 1024 * 1024)', "1 2 3"),  # one 4 MiB line of numbers: 2M Decimals before (~300 MB)
        ('b"7\\n" * (2 * 1024 * 1024)', "7"),  # 2M lines: 2M line strings before (~110 MB)
        ('b"1 2 3 " + b"9" * (4 * 1024 * 1024)', "1 2 3 4"),  # as many tokens, one of them 4 MiB long
    ],
    ids=["long_line", "many_lines", "long_token"],
)
def test_a_huge_wrong_output_costs_memory_linear_in_the_expected_one(body: str, expected: str) -> None:
    peak, accepted = peak_above_the_output(body, expected)
    assert not accepted
    assert peak < 12 * MIB, f"{peak / MIB:.1f} MiB"  # the long token: its copy and its Decimal (~6 MiB)


def test_a_right_output_is_still_accepted_cheaply() -> None:
    expected = " ".join(str(i) for i in range(50_000))
    peak, accepted = peak_above_the_output("b' '.join(b'%d.0' % i for i in range(50_000)) + b'\\n'", expected)
    assert accepted and peak < 2 * MIB + 20 * len(expected)


def reference(prediction: str, gt_out: str) -> bool:
    """NeMo Gym's rule as the comparison was first written here (whole lines, every token a Decimal)."""
    got = [line.strip() for line in prediction.strip().split("\n")]
    want = [line.strip() for line in gt_out.strip().split("\n")]
    if len(got) != len(want):
        return False

    def decimals(line: str) -> list[Decimal] | None:
        try:
            return [Decimal(tok) for tok in line.split()]
        except Exception:
            return None

    for g, w in zip(got, want):
        if g == w:
            continue
        dg, dw = decimals(g), decimals(w)
        if dg is None or dw is None or dg != dw:
            return False
    return True


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # an sNaN compared: NeMo Gym's run fails as "Error during testing"
        return type(e).__name__


def test_verdicts_equal_nemo_gyms_rule_on_random_outputs() -> None:
    rng = random.Random(33)
    words = ["1", "1.0", "01", "1e0", "2", "-0", "0", "x", "NaN", "sNaN", "Inf", "1_0", "10"]
    words += [" ", "\t", "\u00a0", "\u2003"]  # whitespace that str.split knows, and re's \s too
    for _ in range(20_000):

        def text() -> str:
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 3))]
            return rng.choice(["", " ", "\n"]) + "\n".join(lines) + rng.choice(["", "\n", " \n\n", "\u00a0"])

        prediction, gt_out = text(), text()
        ours = outcome(compare_stdout, prediction, "", gt_out)
        ours = ours if isinstance(ours, str) else ours is None
        assert ours == outcome(reference, prediction, gt_out), (prediction, gt_out)


def test_the_message_names_the_line_shortened() -> None:
    wrong = compare_stdout("1\n" + "2 " * 1000 + "\n", "", "1\n2\n")
    assert wrong is not None and wrong["error_message"].startswith("Wrong answer at output_line_idx=1: 2 2 2")
    assert "...(truncated) ..." in wrong["error_message"] and wrong["error_message"].endswith(" != 2")
