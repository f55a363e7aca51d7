"""tepokit/setup/task.py: answer parsing (the reward), the built-in task, dataset files and their validation."""
import contextlib
import io
import json
import os
import re
from decimal import Decimal

import pytest

import train_small as ts
from tepokit.setup.task import load_task, make_arithmetic_task, prompt_lengths, read_dataset
from tepokit.core.reward import gold_answer, parse_lenient, parse_strict, score_completions
from tepokit.tests.helpers import MICRO


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


@pytest.mark.parametrize("answer, gold", [
    ("2+3=5\n#### 5", "5"), ("#### -5", "-5"), ("#### 1,234", "1234"), ("#### 3.50", "3.5"), ("42", "42"),
    ("#### .5", "0.5"), ("#### -.25", "-0.25"), ("  #### 7  \n", "7"), ("#### 1\n#### 2", "2"),
    ("#### 3/4", None), ("#### 1e3", None), ("#### 2,5", None), ("#### 1,23", None), ("#### 7 apples", None),
    ("3/4", None), ("The answer is 4", None), ("#### ", None), ("seven", None), ("", None),
])
def test_gold_answers_are_one_number_or_unreadable(answer, gold):
    """One rule: after the last ####, or the whole answer without one, exactly one number. A fraction, an
    exponent or a decimal comma is unreadable, never read as its last digits."""
    assert gold_answer(answer) == (None if gold is None else Decimal(gold))


def test_unreadable_gold_answers_are_left_out_in_one_warning_never_misread(tmp_path):
    rows = [(f"What is {i} plus 1?", f"#### {i + 1}") for i in range(16)]
    rows[2], rows[5], rows[9], rows[11] = [(f"Q{i}?", a) for i, a in ((2, "#### 3/4"), (5, "#### 1e3"),
                                                                       (9, "#### 2,5"), (11, "#### .5"))]
    task, err = load_with_stderr(dataset=write_jsonl(tmp_path / "d.jsonl", rows), n_test=4)
    assert len(err) == 1 and "3 of 16 (" in err[0] and "answers have no number the reward can read" in err[0], err
    kept = dict(zip(list(task["train"]["question"]) + list(task["test"]["question"]),
                    list(task["train"]["answer"]) + list(task["test"]["answer"])))
    assert {"Q2?", "Q5?", "Q9?"}.isdisjoint(kept) and gold_answer(kept["Q11?"]) == Decimal("0.5")


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


@pytest.mark.parametrize("name, text, needles", [
    ("d.json", '[{"question": "q", "answer": 42}]', ("row 1", "answer must be text, got int 42")),
    ("d.json", '[{"question": "q", "answer": "#### 1"}, {"answer": "#### 2"}]', ("row 2", "question", "missing")),
    ("d.json", '[{"question": "q", "answer": "#### 1"}, 7]', ("row 2", "needs a JSON object")),
    ("d.json", '[{"question": "q", "answer": "#### 1"},]', ("line 1", "not valid JSON")),
    ("d.json", '{"question": "q", "answer": null}\n', ("line 1", "answer must be text, got NoneType")),
    ("d.json", '{\n  "data": [{"question": "q", "answer": "#### 1"}]\n}\n', ("holds one JSON object (keys: data)",)),
    ("d.jsonl", '{"question": ["q"], "answer": "#### 1"}\n', ("line 1", "question must be text, got list")),
])
def test_every_json_format_gets_the_same_field_checks(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        load_task(ts.Args(dataset=str(path)))
    assert e.value.code == 2 and len(err.getvalue().splitlines()) == 1, err.getvalue()
    assert str(path) in err.getvalue() and all(n in err.getvalue() for n in needles), err.getvalue()


def test_a_dataset_directory_with_numeric_answers_is_refused_in_one_line(tmp_path):
    import datasets
    rows = datasets.Dataset.from_list([{"question": f"q{i}", "answer": i} for i in range(12)])
    datasets.DatasetDict({"train": rows}).save_to_disk(tmp_path / "d")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        load_task(ts.Args(dataset=str(tmp_path / "d")))
    assert e.value.code == 2 and len(err.getvalue().splitlines()) == 1, err.getvalue()
    assert "split train, row 1: answer must be text, got int 0" in err.getvalue()


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_a_utf8_file_with_a_byte_order_mark_is_read(tmp_path, name):
    rows = [{"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"} for i in range(12)]
    text = json.dumps(rows) if name == "d.json" else "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    task = load_task(ts.Args(dataset=str(tmp_path / name), n_test=2))
    assert sorted([*task["train"]["question"], *task["test"]["question"]]) == sorted(r["question"] for r in rows)


# ---- validation on load (tepokit/setup/task.py::validate_task) -------------------------------------------------

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return str(path)


def load_with_stderr(**args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        task = load_task(ts.Args(**args))
    return task, err.getvalue().splitlines()


def refusal(tmp_path, *flags):
    """Exit status and stderr of a whole run refused while loading its data; what it left in tmp_path."""
    before = sorted(os.listdir(tmp_path))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        ts.main([*MICRO, "--steps", "1", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"),
                 *flags])
    assert sorted(os.listdir(tmp_path)) == before                         # nothing created on disk
    return e.value.code, err.getvalue().splitlines()


def test_the_built_in_task_passes_validation_unchanged_and_silently():
    args = ts.Args(n_train=4000, n_test=500)
    task, err = load_with_stderr(n_train=4000, n_test=500)
    made = make_arithmetic_task(args.difficulty, args.n_train, args.n_test, args.seed, args.ops, args.sft_noise)
    assert err == []
    for split in ("train", "test"):
        assert task[split].to_list() == made[split].to_list() and len(task[split]) == len(made[split]) > 0


def test_unreadable_answers_are_counted_in_one_warning_and_left_out(tmp_path):
    rows = [(f"What is {i} plus 1?", f"#### {i + 1}") for i in range(20)]
    rows[3] = ("What is 3 plus 1?", "four")
    rows[7] = ("What is 7 plus 1?", "{eight}, I think")                   # braces are text, not a format
    task, err = load_with_stderr(dataset=write_jsonl(tmp_path / "d.jsonl", rows), n_test=5)
    assert len(err) == 1 and err[0].startswith("train_small.py: warning: dataset ")
    assert "2 of 20 (" in err[0] and "answers have no number the reward can read" in err[0], err
    assert "'four'" in err[0] or "'{eight}, I think'" in err[0]
    kept = list(task["train"]["answer"]) + list(task["test"]["answer"])
    assert len(kept) == 18 and "four" not in kept and all(gold_answer(a) is not None for a in kept)


def test_no_readable_answer_is_refused_in_one_line_and_nothing_is_created(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [(f"Count to {i}.", "seven") for i in range(12)])
    code, err = refusal(tmp_path, "--dataset", path)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"train_small.py: error: dataset {path}: none of the ") and "'seven'" in err[0]
    assert "#### <number>" in err[0]


def test_training_rows_that_ask_a_test_question_are_removed_with_a_count(tmp_path):
    rows = [(f"What is {i} times 2?", f"#### {2 * i}") for i in range(15)] * 2      # every question twice
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    args = ts.Args(dataset=path, n_test=6)
    raw = read_dataset(args)
    test_questions = set(raw["test"]["question"])
    shared = sum(q in test_questions for q in raw["train"]["question"])
    assert shared >= 1                                                     # the split did put copies on both sides
    task, err = load_with_stderr(dataset=path, n_test=6)
    assert len(err) == 1 and f"{shared} of {len(raw['train'])} ({shared} train) training rows ask a question " \
                             "of the test split" in err[0], err
    assert len(task["train"]) == len(raw["train"]) - shared
    assert not set(task["train"]["question"]) & set(task["test"]["question"])
    assert list(task["test"]["question"]) == list(raw["test"]["question"])  # the test split is kept whole


def test_over_long_questions_are_counted_and_cut_so_the_warm_up_stays_within_the_budget(tmp_path, capsys):
    """A 100,000-character question (the built-in tokenizer: one token per character) is counted on loading
    and cut from the left by the warm-up as by generation: a real run with the warm-up goes through."""
    rows = [(f"What is {i} plus 1?", f"#### {i + 1}") for i in range(12)]
    rows[5] = ("Sum the digits: " + "9" * 100_000 + "?", "#### 900000")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task, err = load_with_stderr(dataset=path, n_test=4)
    prompt = len(rows[5][0]) + 1                                          # the prompt ends in a newline
    assert len(err) == 1 and "1 of 12 (" in err[0] and "questions are longer than --max-prompt-tokens=256 " \
                             f"tokens (the longest has {prompt}); they are cut from the left" in err[0], err
    assert prompt == 100_018 and len(task["train"]) + len(task["test"]) == 12          # kept, not dropped
    assert ts.main([*MICRO, "--steps", "1", "--warmup-steps", "5", "--dataset", path, "--n-test", "4",
                    "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "1 of 12" in capsys.readouterr().err


def test_the_count_of_over_long_questions_covers_both_splits(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [(f"Question {i}: " + "x" * 40, f"#### {i}") for i in range(12)])
    task, err = load_with_stderr(dataset=path, max_prompt_tokens=50, n_test=2)
    longest = len("Question 10: " + "x" * 40 + "\n")                       # the two-digit ones: 54 characters
    over = {split: sum(len(q) + 1 > 50 for q in task[split]["question"]) for split in ("train", "test")}
    parts = ", ".join(f"{n} {split}" for split, n in over.items() if n)
    assert len(err) == 1 and f"2 of 12 ({parts}) questions" in err[0], err
    assert f"longer than --max-prompt-tokens=50 tokens (the longest has {longest})" in err[0], err


def test_the_prompt_budget_counts_the_tokens_of_the_model_given(tmp_path):
    """With --model, prompts are measured in that model's tokens (here one per word), not characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path)
    question = "How many apples are left over?"
    assert prompt_lengths([question], ts.Args()) == [len(question) + 1]           # characters and the newline
    assert prompt_lengths([question], ts.Args(model=str(tmp_path))) == [7]        # six words and "?"
