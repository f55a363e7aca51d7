"""The task's prompt and reward, as the RL step reads them: the prompt is the question and a newline (no chat
template), and the answer is parsed from the completion's text with regular expressions only, never eval/exec:
strictly (GSM8K's final `#### <number>`) or leniently (the last number anywhere)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

import torch


def format_prompt(question: str) -> str:
    return question.strip() + "\n"


# ---- answer parsing: regular expressions only, never eval/exec -----------------------------------
# A number: optional minus, digits with optional thousands separators in groups of three ("1,234"), optional
# decimals ("3.50"), or decimals alone (".5"). Nothing else is a number: not a fraction ("3/4"), an exponent
# ("1e3") or a decimal comma ("2,5").
NUMBER = r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
STRICT_ANSWER = re.compile(r"####\s*(" + NUMBER + r")\s*$")      # the number after a final `####`
ONE_NUMBER = re.compile(r"\s*(" + NUMBER + r")\s*")              # exactly one number
ANY_NUMBER = re.compile(NUMBER)


def to_number(text: str | None) -> Decimal | None:
    """'1,234' -> Decimal('1234'); '12.0' == '12'. None when there is no number."""
    if text is None:
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def parse_strict(text: str) -> Decimal | None:
    """The number after a final `#### ` (GSM8K's format), nothing else may follow."""
    m = STRICT_ANSWER.search(text)
    return to_number(m.group(1)) if m else None


def parse_lenient(text: str) -> Decimal | None:
    """The last number anywhere in the text."""
    last = None
    for last in ANY_NUMBER.finditer(text):
        pass
    return to_number(last.group(0)) if last else None


def gold_answer(answer_text: str) -> Decimal | None:
    """A data set's answer as one number, by one rule: the text after the last `####` (GSM8K's format), or the
    whole answer when it has no `####`, must be exactly one NUMBER (spaces around it allowed). Otherwise None,
    never another number: "#### 3/4", "#### 1e3", "#### 2,5" and "The answer is 4" are unreadable (validate_task
    counts them in one warning and leaves their rows out). "#### .5" is 0.5 and "#### 1,234" is 1234."""
    m = ONE_NUMBER.fullmatch(answer_text.rpartition("####")[2])
    return to_number(m.group(1)) if m else None


def score_completions(texts: list[str], golds: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(strict_correct[B], lenient_correct[B]) as float tensors of 0/1."""
    strict = [float(g is not None and parse_strict(t) == g) for t, g in zip(texts, golds)]
    lenient = [float(g is not None and parse_lenient(t) == g) for t, g in zip(texts, golds)]
    return torch.tensor(strict), torch.tensor(lenient)
