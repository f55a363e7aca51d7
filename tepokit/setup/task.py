"""The task: the built-in arithmetic word problems (offline), or GSM8K-style data from the hub, a local
dataset directory or a .jsonl file, checked once when it loads, and its fingerprint. The prompt and the
answer parsing that gives the reward are the RL step's: tepokit/core/reward.py."""

from __future__ import annotations

import hashlib
import json
import os
import random


from tepokit.core.reward import check_chat_template, encode_prompts, format_prompt, gold_answer
from tepokit.plumbing.errors import fail, first_line, warn
from tepokit.plumbing.hub import cannot_load, use_offline_hub_if_unreachable

NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon"]


ITEMS = ["apple", "pen", "cup", "book", "egg", "coin", "card", "shell"]


# How the sloppy solver of the warm-up corpus misreads each kind of problem: it adds when it should
# multiply or subtract, and subtracts when it should add. One systematic misreading per kind, as
# real students (and real pretraining corpora) have.
MISREAD = {"+": "-", "-": "+", "*": "+"}


def arithmetic_task_size(difficulty: int, ops: str) -> int:
    """How many problems make_arithmetic_task draws at most: half of the distinct questions, so
    that drawing without repeats stays fast."""
    return len(NAMES) * len(ITEMS) * len(ops) * difficulty * difficulty // 2


def make_arithmetic_task(difficulty: int, n_train: int, n_test: int, seed: int, ops: str = "+-*",
                         sft_noise: float = 0.0):
    """One-step word problems with GSM8K-style worked answers ending in `#### <number>`.

    difficulty = the largest operand. Questions are unique, and the test split never shares a
    question with the training split; both are fixed by the seed.
    Columns: question, answer (always right: rewards and evaluation use it), and demonstration
    (what the supervised warm-up imitates): the right worked answer, or, for a fraction
    `sft_noise` of the problems, a MISREADING of the problem worked out correctly, e.g. "7+3=10"
    for "7 bags of 3". The warm-up model thus knows both readings and picks between them almost
    at random; reading the problem right is a behaviour that transfers across problems, so RL
    can learn it within a few thousand prompts (it cannot memorise new arithmetic facts that fast).
    """
    import datasets
    rng = random.Random(f"arithmetic-{seed}-{difficulty}")
    noise_rng = random.Random(f"misread-{seed}")
    seen, rows = set(), []
    while len(rows) < min(n_train + n_test, arithmetic_task_size(difficulty, ops)):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, op = rng.randint(1, difficulty), rng.randint(1, difficulty), rng.choice(ops)
        if op == "+":
            q = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?"
        elif op == "-":
            a, b = max(a, b), min(a, b)
            q = f"{name} has {a} {item}s and gives away {b}. How many are left?"
        else:
            q = f"{name} has {a} bags of {b} {item}s. How many {item}s in all?"
        if q not in seen:
            seen.add(q)
            shown = MISREAD[op] if noise_rng.random() < sft_noise else op
            rows.append({"question": q, "answer": worked_answer(a, op, b), "demonstration": worked_answer(a, shown, b)})
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[n_test:]),
                                 "test": datasets.Dataset.from_list(rows[:n_test])})


# The hidden-type task (--task hidden-type): made for entropy collapse (docs/collapse.md). Every question reads
# the same, "Ann has 7 cups and 3 cups. How many cups?", but each problem has a hidden type: on a share
# --majority of them the right worked answer adds (7+3=10), on the others it multiplies (7*3=21). Nothing in
# the question tells which. The warm-up's demonstrations pick the operator by a fair coin, independent of the
# type, so the start model reads any question either way about half of the time, and the rest of the
# answer (copying the numbers, the arithmetic, `#### n`) is near-deterministic. The decision sits on one
# token, the operator.
HIDDEN_TYPES = {"add": "+", "mul": "*"}     # each type and the operator that solves it, the majority's first
# The cue variant (--cue c): the item word tells the type, right on a share c of the problems. Six of the eight
# items point to adding, two to multiplying, so that the majority's share is 0.75 c + 0.25 (1 - c) (0.70 at
# c = 0.9): always adding still scores 0.70, but following the cue scores c. The questions and the warm-up's
# demonstrations are those of the task without a cue (the same draws), so the start model is the same one:
# it has never seen the cue pay.
CUE_ITEMS = {"add": ITEMS[:6], "mul": ITEMS[6:]}


def make_hidden_type_task(difficulty: int, n_train: int, n_test: int, seed: int, majority: float = 0.7,
                          cue: float = 0.0):
    """Problems of two hidden types, operands 2..difficulty. Columns: question, answer (the right worked
    answer: reward and evaluation use it), demonstration (what the warm-up imitates: the operator drawn
    by a fair coin), type ("add" on a share `majority` of the problems, "mul" on the others) and cue (the
    type the item word points to, CUE_ITEMS; only with a cue).
    Questions are unique and the test split shares none with the training split; all fixed by the seed.
    Without a cue nothing tells the types apart: returning "+" on every problem scores `majority`, which is
    then the best any policy can do. With cue c > 0 (`majority` is not read) the type is the cue's on a share c
    of the problems: following the cue scores c, the best a policy can do."""
    import datasets
    rng = random.Random(f"hidden-type-{seed}-{difficulty}")
    combos = [(name, item, a, b) for name in NAMES for item in ITEMS
              for a in range(2, difficulty + 1) for b in range(2, difficulty + 1)]
    rng.shuffle(combos)
    rows = []
    for name, item, a, b in combos[:n_train + n_test]:
        draw = rng.random()                     # one draw per problem with or without a cue: the same questions
        pointed = "add" if item in CUE_ITEMS["add"] else "mul"
        if cue:
            kind = pointed if draw < cue else ("mul" if pointed == "add" else "add")
        else:
            kind = "add" if draw < majority else "mul"
        shown = rng.choice(list(HIDDEN_TYPES.values()))          # the warm-up's fair coin
        rows.append({"question": f"{name} has {a} {item}s and {b} {item}s. How many {item}s?",
                     "answer": worked_answer(a, HIDDEN_TYPES[kind], b), "demonstration": worked_answer(a, shown, b),
                     "type": kind, **({"cue": pointed} if cue else {})})
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[n_test:]),
                                 "test": datasets.Dataset.from_list(rows[:n_test])})


def hidden_type_task_size(difficulty: int) -> int:
    """How many distinct problems make_hidden_type_task can draw at this difficulty."""
    return len(NAMES) * len(ITEMS) * max(0, difficulty - 1) ** 2


def worked_answer(a: int, op: str, b: int) -> str:
    c = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={c}\n#### {c}"


def task_seed(args) -> int:
    """The seed of the data (the built-in task and its warm-up, or a data set's held-out split): --task-seed,
    or --seed when it is not given, so that every seed has its own task unless one is fixed."""
    return args.seed if args.task_seed is None else args.task_seed


def load_task(args):
    """A DatasetDict with train/test splits of question/answer records, checked by validate_task."""
    if args.dataset is None and args.task == "hidden-type":
        task = make_hidden_type_task(args.difficulty, args.n_train, args.n_test, task_seed(args), args.majority,
                                     args.cue)
    elif args.dataset is None:
        task = make_arithmetic_task(args.difficulty, args.n_train, args.n_test, task_seed(args), args.ops,
                                    args.sft_noise)
    else:
        task = read_dataset(args)
    return validate_task(task, args)


def read_dataset(args):
    """--dataset as a DatasetDict with train and test splits (a seeded fifth held out when it has no test)."""
    import datasets
    path = os.path.expanduser(args.dataset)
    offline_reason = None if os.path.exists(path) else use_offline_hub_if_unreachable()
    try:
        if path.endswith((".jsonl", ".json")):
            data = datasets.Dataset.from_list(read_json_task(path))
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            data = datasets.load_from_disk(path)
        elif os.path.isdir(path):
            data = datasets.load_dataset(path)
        else:
            data = datasets.load_dataset(args.dataset, "main" if args.dataset.endswith("gsm8k") else None)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("dataset", args.dataset, e, offline_reason,
                    "give a local .jsonl file or dataset directory, or run without --dataset for the built-in task")
    if isinstance(data, datasets.Dataset):
        data = datasets.DatasetDict({"train": data})
    if not {"question", "answer"} <= set(data["train"].column_names):
        fail(f"dataset {args.dataset!r} has columns {data['train'].column_names}; need question and answer")
    for split in data:
        check_text_columns(data[split], f"dataset {args.dataset}, split {split}")
    if "test" not in data:   # a fixed, seeded held-out split
        if len(data["train"]) < 10:
            fail(f"dataset {args.dataset!r} has {len(data['train'])} rows and no test split; need at least 10 "
                 "rows (a fifth is held out)")
        data = data["train"].train_test_split(test_size=min(args.n_test, len(data["train"]) // 5),
                                              seed=task_seed(args))
    return data


def validate_task(task, args):
    """The task checked on loading, before any memory is spent on it: each kind of problem counted in one
    warning line; refused in one line (exit 2, before anything is written) when a split would be left empty.

      - answers the reward cannot read (gold_answer is None, e.g. "seven"): such a row scores 0 whatever
        the model writes, so it is left out; refused when no answer of a split can be read.
      - questions longer than --max-prompt-tokens, in the run's tokens (prompt_lengths): counted, and
        kept. They are cut from the left to their last --max-prompt-tokens tokens, by generation (as
        before) and by the warm-up's batches (model.sft_batch), so no batch outgrows the budget and the
        warm-up trains on exactly the prompts RL shows. Cut, not dropped: the end of a question holds
        what is asked, and --max-prompt-tokens is the run's memory bound; raising it keeps them whole.
      - training rows whose question is also in the test split: removed from training, so the
        held-out accuracy measures problems the policy never trained on.
    The built-in task has none of these, and comes back unchanged.
    """
    name = f"dataset {args.dataset}" if args.dataset else "the built-in task"
    answers = {split: list(task[split]["answer"]) for split in ("train", "test")}
    readable = {split: [gold_answer(a) is not None for a in answers[split]] for split in answers}
    for split in answers:
        if not any(readable[split]):
            fail(f"{name}: none of the {len(answers[split])} {split} answers has a number the reward can read "
                 f"(e.g. {answers[split][0][:40]!r}); each answer must end in '#### <number>' (GSM8K's format) "
                 "or be one number")
    example = next((a for split in answers for a, ok in zip(answers[split], readable[split]) if not ok), None)
    drop_rows(task, readable, lambda dropped: f"{name}: {dropped} answers have no number the reward can read "
              f"(e.g. {example[:40]!r}); those rows are left out (they could only score 0)")
    lengths = {split: prompt_lengths(list(task[split]["question"]), args) for split in ("train", "test")}
    over = count_of({split: [n <= args.max_prompt_tokens for n in lengths[split]] for split in lengths})
    if over:
        warn(f"{name}: {over} questions are longer than --max-prompt-tokens={args.max_prompt_tokens} tokens (the "
             f"longest has {max(max(n) for n in lengths.values())}); they are cut from the left to their last "
             f"{args.max_prompt_tokens} tokens (raise --max-prompt-tokens to keep them whole)")
    test_questions = set(task["test"]["question"])
    unseen = [q not in test_questions for q in task["train"]["question"]]
    if not any(unseen):
        fail(f"{name}: every training question is also in the test split; give a test split with other questions")
    drop_rows(task, {"train": unseen}, lambda dropped: f"{name}: {dropped} training rows ask a question of the "
              "test split; removed from training, so the held-out accuracy measures held-out problems")
    return task


def count_of(keep: dict) -> str | None:
    """How many rows keep (split -> flags) marks False, as "3 of 120 (2 train, 1 test)"; None if none."""
    left_out = {split: flags.count(False) for split, flags in keep.items() if not all(flags)}
    if not left_out:
        return None
    parts = ", ".join(f"{n} {split}" for split, n in left_out.items())
    return f"{sum(left_out.values())} of {sum(len(flags) for flags in keep.values())} ({parts})"


def drop_rows(task, keep: dict, warning) -> None:
    """Keep the rows of each split where keep[split] is True; when any is dropped, warn in one line:
    warning(the count_of the dropped rows)."""
    dropped = count_of(keep)
    if dropped:
        warn(warning(dropped))
        for split, flags in keep.items():
            task[split] = keep_rows(task[split], flags) if not all(flags) else task[split]


def keep_rows(split, keep: list[bool]):
    """The rows of a datasets split where keep is True, in memory (a split read from disk gets no cache file)."""
    return split.select([i for i, k in enumerate(keep) if k], keep_in_memory=True)


def prompt_lengths(questions: list[str], args) -> list[int]:
    """Each question's prompt length in the tokens of the run's tokenizer: characters for the built-in model
    (its tokenizer has one token per character), --model's own tokenizer otherwise (loaded alone), its chat
    template's tokens included when the run uses one (tepokit/core/reward.py encode_prompts)."""
    if args.model is None:
        return [len(format_prompt(q)) for q in questions]
    from transformers import AutoTokenizer
    offline_reason = None if os.path.exists(args.model) else use_offline_hub_if_unreachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("the tokenizer of model", args.model, e, offline_reason,
                    "give a local model directory, or run without --model for the built-in tiny model")
    check_chat_template(tokenizer, args.chat_template, args.model)
    return [len(ids) for ids in encode_prompts(tokenizer, questions, args).input_ids]


FIELDS = "text fields question and answer (an answer such as \"2+3=5\\n#### 5\")"


def read_json_task(path: str) -> list[dict]:
    """The question/answer rows of a local .jsonl file (one JSON object per line; blank lines skipped) or .json
    file (a JSON array of objects, or JSON Lines as well). UTF-8, with or without a byte-order mark. A bad row
    is reported as such: file, line or row number, and what is wrong (check_row)."""
    try:
        with open(path, encoding="utf-8-sig") as f:        # -sig: a byte-order mark, if any, is not text
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"dataset {path}: cannot be read as UTF-8 text ({type(e).__name__}: {first_line(e)})")
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"dataset {path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno}); a .json data set "
                 f"is one JSON array of objects with {FIELDS}")
        rows = [check_row(row, f"dataset {path}, row {number}") for number, row in enumerate(array, 1)]
    elif path.endswith(".json") and text.lstrip().startswith("{") and "\n" in text.strip() and (
            one_object := whole_object(text)):
        fail(f"dataset {path}: holds one JSON object (keys: {', '.join(list(one_object)[:5])}); a .json data "
             f"set is a JSON array of objects, or one object per line, with {FIELDS}")
    else:
        rows = []
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"dataset {path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); "
                     f"each line must be one JSON object with {FIELDS}")
            rows.append(check_row(row, f"dataset {path}, line {number}"))
    if not rows:
        fail(f"dataset {path}: no rows; each line must be one JSON object with {FIELDS}")
    return rows


def whole_object(text: str) -> dict | None:
    """The JSON object that a whole text is, if it is one (a .json file pretty-printed over several lines)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def check_row(row, where: str) -> dict:
    """{question, answer} of one record, or one line naming `where` it is and what is wrong with it."""
    if not isinstance(row, dict):
        fail(f"{where}: needs a JSON object with {FIELDS}, got {json.dumps(row)[:60]}")
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str):
            got = "missing" if field not in row else f"{type(row[field]).__name__} {json.dumps(row[field])[:40]}"
            fail(f"{where}: {field} must be text, got {got}; each record needs {FIELDS}")
    return {"question": row["question"], "answer": row["answer"]}


def check_text_columns(split, where: str) -> None:
    """The question and answer columns of a data set read by the datasets library hold text in every row."""
    for field in ("question", "answer"):
        values = split[field]
        bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
        if bad is not None:
            fail(f"{where}, row {bad + 1}: {field} must be text, got {type(values[bad]).__name__} "
                 f"{json.dumps(values[bad], default=str)[:40]}; each record needs {FIELDS}")


def task_key(task) -> tuple:
    """What names a loaded task for the values computed from it once (task_fingerprint, the built-in tokenizer):
    each split's fingerprint in the datasets library, which a change to its rows changes."""
    return tuple((split, task[split]._fingerprint) for split in sorted(task))


FINGERPRINTS: dict[tuple, str] = {}      # task_key -> task_fingerprint: reading every record once per task


def task_fingerprint(task) -> str:
    """A content hash of the task's records (every split's questions and answers): the data's identity,
    which a resumed run checks (an edited data set is refused) and the warm-up cache's key includes."""
    key = task_key(task)
    if key not in FINGERPRINTS:
        digest = hashlib.sha256()
        for split in sorted(task):
            for column in ("question", "answer"):
                digest.update(json.dumps([split, column, list(task[split][column])]).encode())
        FINGERPRINTS[key] = digest.hexdigest()[:16]
    return FINGERPRINTS[key]


def dataset_chunks(data, n: int, size: int):
    """The first n records of a dataset, `size` at a time."""
    n = min(n, len(data))
    return [data.select(range(start, min(n, start + size))) for start in range(0, n, size)]
