"""tepokit/task.py: answer parsing (the reward), the built-in task, dataset files."""
import contextlib
import io
import re
from decimal import Decimal

import pytest

import train_small as ts
from tepokit.task import gold_answer, load_task, make_arithmetic_task, parse_lenient, parse_strict, score_completions


@pytest.mark.parametrize("text, strict, lenient", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", "72"),     # GSM8K
    ("3+4=7\n#### 7", "7", "7"),
    ("####7", "7", "7"),
    ("#### -5", "-5", "-5"),                                                      # negative
    ("so the loss is -12 dollars", None, "-12"),
    ("#### 1,234", "1234", "1234"),                                               # thousands separator
    ("The total is 1,234,567 and then", None, "1234567"),
    ("#### 3.50", "3.5", "3.5"),
    ("#### 72 apples", None, "72"),                    # strict: nothing may follow the number
    ("#### 12\n#### 13", "13", "13"),
    ("I do not know", None, None),                      # no answer
    ("", None, None),
    ("#### ", None, None),
    ("__import__('os').system('rm -rf /') #### 4", "4", "4"),   # hostile text: only digits are read
    ("print(2+2)", None, "2"),
    ("1,2,3", None, "3"),
])
def test_answer_parsing(text, strict, lenient):
    assert parse_strict(text) == (None if strict is None else Decimal(strict))
    assert parse_lenient(text) == (None if lenient is None else Decimal(lenient))


def test_parsing_long_hostile_text_is_fast():
    text = ("9" * 100_000) + " eval(" * 50_000 + "#### 5"
    assert parse_strict(text) == Decimal(5)
    assert parse_lenient("x" * 1_000_000) is None


def test_score_completions_and_gold():
    gold = gold_answer("2*3=6\n#### 6")
    strict, lenient = score_completions(["2*3=6\n#### 6", "it is 6", "#### 7", "#### 6.0"], [gold] * 4)
    assert strict.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert lenient.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_task_splits_are_fixed_and_disjoint():
    a = make_arithmetic_task(9, 200, 50, seed=3)
    b = make_arithmetic_task(9, 200, 50, seed=3)
    c = make_arithmetic_task(9, 200, 50, seed=4)
    assert list(a["test"]["question"]) == list(b["test"]["question"])
    assert list(a["test"]["question"]) != list(c["test"]["question"])
    assert not set(a["test"]["question"]) & set(a["train"]["question"])
    for q, ans in zip(a["train"]["question"], a["train"]["answer"]):
        assert ans.split("\n")[-1].startswith("#### ") and gold_answer(ans) is not None


def _worked_out(question: str) -> tuple[int, str, int]:
    """(a, op, b) of a built-in question, read independently of train_small's generator."""
    for pattern, op in ((r"has (\d+) \w+s and gets (\d+) more", "+"), (r"has (\d+) \w+s and gives away (\d+)", "-"),
                        (r"has (\d+) bags of (\d+)", "*")):
        m = re.search(pattern, question)
        if m:
            return int(m.group(1)), op, int(m.group(2))
    raise AssertionError(question)


def test_answers_are_right_and_demonstrations_misread_a_fraction_sft_noise():
    arithmetic = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    misread = {"+": "-", "-": "+", "*": "+"}        # the sloppy solver: add <-> subtract, add for multiply
    task = make_arithmetic_task(15, 3000, 100, seed=2, sft_noise=0.3)
    n_misread = 0
    for row in task["train"]:
        a, op, b = _worked_out(row["question"])
        assert gold_answer(row["answer"]) == arithmetic[op](a, b)             # rewards use the right answer
        assert row["answer"] == f"{a}{op}{b}={arithmetic[op](a, b)}\n#### {arithmetic[op](a, b)}"
        if row["demonstration"] != row["answer"]:                                # a misreading, worked out right
            wrong = misread[op]
            assert row["demonstration"] == f"{a}{wrong}{b}={arithmetic[wrong](a, b)}\n#### {arithmetic[wrong](a, b)}"
            n_misread += 1
    # 3000 rows: the misread fraction is 0.3 +- 3 binomial std (0.025)
    assert abs(n_misread / len(task["train"]) - 0.3) < 0.025
    clean = make_arithmetic_task(15, 3000, 100, seed=2, sft_noise=0.0)
    assert list(clean["train"]["demonstration"]) == list(clean["train"]["answer"])
    assert list(clean["train"]["question"]) == list(task["train"]["question"])   # noise never changes the problems


def test_malformed_jsonl_is_reported_by_file_and_line(tmp_path):
    for text, needles in [('{"question": "q", "answer": "#### 1"}\n{"question": "q" "answer": "a"}\n',
                           ("line 2", "not valid JSON")),
                          ('\n{"question": "q"}\n', ("line 2", "question and answer")),
                          ("", ("no rows",))]:
        path = tmp_path / "data.jsonl"
        path.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            load_task(ts.Args(dataset=str(path)))
        assert e.value.code == 2 and len(err.getvalue().splitlines()) == 1
        assert str(path) in err.getvalue() and all(n in err.getvalue() for n in needles), err.getvalue()
        assert "hub" not in err.getvalue()
