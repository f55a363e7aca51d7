"""The task's prompt and rewards, as the RL step reads them.

The prompt: the question and a newline (the built-in tasks, and --chat-template off), or, when the tokenizer has a
chat template (an instruct model's), a system message that states the answer format the reward reads and the
question as the user's message, rendered by the tokenizer's own template (prompt_texts).

The rewards: named functions of (completion text, gold answer), listed in REWARDS; --reward picks a weighted sum of
them (strict,format:0.1). The answer is parsed from the text with regular expressions only, never eval/exec:
strictly (GSM8K's final `#### <number>`) or leniently (the last number anywhere)."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

import torch

from tepokit.plumbing.errors import fail

# The system prompt of a chat-template prompt (--system-prompt replaces it): it asks for the format the `strict` and
# `format` rewards read, which an instruct model does not write unless told (its rewards would all be 0).
DEFAULT_SYSTEM_PROMPT = ("Solve the math problem step by step. Then write the final answer on the last line as "
                         "'#### <number>', for example '#### 42', and nothing after it.")


def format_prompt(question: str) -> str:
    """The prompt without a chat template: the question and a newline."""
    return question.strip() + "\n"


def uses_chat_template(tokenizer, chat_template: str) -> bool:
    """--chat-template: on or auto with a tokenizer that has a template (on without one is refused when the
    tokenizer is loaded: check_chat_template); off, or auto without one, is the bare question."""
    return chat_template != "off" and getattr(tokenizer, "chat_template", None) is not None


def check_chat_template(tokenizer, chat_template: str, where: str) -> None:
    """--chat-template on with a tokenizer that has no template: refused in one line (exit 2)."""
    if chat_template == "on" and getattr(tokenizer, "chat_template", None) is None:
        fail(f"argument --chat-template: 'on', but the tokenizer of {where} has no chat template; "
             "use --chat-template auto or off (the bare question), or a model whose tokenizer has one")


def chat_messages(question: str, system_prompt: str | None) -> list[dict]:
    """The conversation a chat-template prompt renders: the system prompt (unless it is empty) and the question."""
    system = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question.strip()}]


def prompt_texts(questions: list[str], tokenizer, args) -> list[str]:
    """Each question as the model sees it: rendered by the tokenizer's chat template (ending in the assistant
    turn's opening, add_generation_prompt) when --chat-template uses one, else the question and a newline."""
    if not uses_chat_template(tokenizer, args.chat_template):
        return [format_prompt(q) for q in questions]
    return [tokenizer.apply_chat_template(chat_messages(q, args.system_prompt), tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def encode_prompts(tokenizer, questions: list[str], args, **kwargs):
    """The prompts' tokens. A rendered template already holds its special tokens (a BOS too, if the model has one):
    the tokenizer adds none of its own, so the ids equal apply_chat_template's."""
    return tokenizer(prompt_texts(questions, tokenizer, args),
                     add_special_tokens=not uses_chat_template(tokenizer, args.chat_template), **kwargs)


def end_of_turn_id(tokenizer) -> int | None:
    """The token a chat template ends the assistant's turn with (Qwen's <|im_end|>, Llama 3's <|eot_id|>), which
    must stop sampling; None if the template ends it with no special token. Read off the template itself: the
    first token after an assistant reply's text."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    user = [{"role": "user", "content": "1+1?"}]
    try:
        opened = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        replied = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "#### 2"}], tokenize=False)
    except Exception:  # noqa: BLE001 -- a template that cannot render a reply: no end-of-turn token known
        return None
    if not replied.startswith(opened) or "#### 2" not in replied[len(opened):]:
        return None
    after = replied[len(opened):].split("#### 2", 1)[1]
    ids = tokenizer(after, add_special_tokens=False).input_ids
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else None


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


# ---- the rewards: each a function of (completion text, gold answer) -> float --------------------------------
# To add your own, write one and list it here; --reward then takes its name (and a weight: name:0.5).
# A gold answer is a Decimal, or None when the data set's answer is unreadable (such rows are left out).

def correct_strict(text: str, gold) -> float:
    """1 if the completion ends in `#### <the right number>` (GSM8K's format), else 0."""
    return float(gold is not None and parse_strict(text) == gold)


def correct_lenient(text: str, gold) -> float:
    """1 if the last number anywhere in the completion is the right one, else 0."""
    return float(gold is not None and parse_lenient(text) == gold)


def answer_format(text: str, gold) -> float:
    """1 if the completion ends in `#### <a number>`, right or wrong (a format reward, as in open-r1 and
    nano-aha-moment): it gives a signal before the model is ever right."""
    return float(parse_strict(text) is not None)


REWARDS = {"strict": correct_strict, "lenient": correct_lenient, "format": answer_format}


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """--reward "strict,format:0.1" -> [("strict", 1.0), ("format", 0.1)]: names of REWARDS, each with a weight
    (1 unless given). reward_spec_problem has said it is valid."""
    pairs = [item.partition(":") for item in spec.split(",")]
    return [(name.strip(), float(weight) if sep else 1.0) for name, sep, weight in pairs]


def reward_spec_problem(spec: str) -> str | None:
    """What is wrong with a --reward value, or None."""
    names = []
    for item in spec.split(","):
        name, sep, weight = (part.strip() for part in item.partition(":"))
        if name not in REWARDS:
            return f"{name!r} is not a reward; the rewards are {', '.join(REWARDS)}"
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            return f"{name}'s weight {weight!r} is not a finite number"
        names.append(name)
    if len(set(names)) < len(names):
        return "each reward may appear once"
    return None


def weighted_rewards(texts: list[str], golds: list, spec: str) -> tuple[torch.Tensor, dict]:
    """The reward each completion gets, the weighted sum of --reward's rewards [B], and each reward apart:
    {name: [B]}, unweighted."""
    weights = parse_reward_spec(spec)
    parts = {name: torch.tensor([REWARDS[name](t, g) for t, g in zip(texts, golds)]) for name, _ in weights}
    return sum(weight * parts[name] for name, weight in weights), parts
