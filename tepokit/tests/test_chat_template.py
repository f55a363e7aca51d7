"""Prompts as instruct models expect them (--chat-template, --system-prompt; tepokit/core/reward.py): on a tokenizer
with a chat template the prompt tokens the model sees equal apply_chat_template's of the system prompt and the
question, its end-of-turn token stops sampling, prompt lengths count the template's tokens; without a template
(the built-in tasks) nothing changes."""
import json

import pytest
import torch

import train_small as ts
from tepokit.core.forward import eos_ids_of
from tepokit.core.reward import DEFAULT_SYSTEM_PROMPT, chat_messages, end_of_turn_id, encode_prompts, format_prompt
from tepokit.setup.model import START_MODEL_DIR, load_policy
from tepokit.setup.task import prompt_lengths
from tepokit.tests.helpers import assert_refused_in_one_line, make_model_dir, read_rows, run_main

# Qwen2.5's template, shortened: each message between <|im_start|>role and <|im_end|>, then the assistant's opening.
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QUESTIONS = ["Ann has 3 pens and gets 4 more. How many pens?", "2+2?"]


def make_chat_model_dir(path, template: str | None = TEMPLATE) -> str:
    """A Qwen2 micro model whose tokenizer (one token per character) has the special tokens <|im_start|> and
    <|im_end|> and, unless template is None, a chat template; the model's own end token is <|endoftext|> only."""
    return make_model_dir(path, vocab_size=128, width=32, layers=1, special_tokens=("<|im_start|>", "<|im_end|>"),
                          chat_template=template, extra_chars="'<>|_()", max_positions=512)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model_dir(tmp_path_factory.mktemp("chat") / "model")


def unpadded(batch, row: int) -> list[int]:
    return batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()


@pytest.mark.parametrize("system_prompt", [None, "Answer with '#### n'.", ""])
def test_the_prompt_the_model_sees_is_the_templates_rendering_of_the_system_prompt_and_the_question(chat_dir,
                                                                                                  system_prompt):
    args = ts.Args(model=chat_dir, system_prompt=system_prompt, max_new_tokens=4)
    model, tokenizer = load_policy(chat_dir, args, torch.device("cpu"))
    batch = ts.generate_group(model, tokenizer, QUESTIONS, 2, args, torch.device("cpu"))
    for i, question in enumerate(QUESTIONS):
        messages = ([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt}]
                    if system_prompt != "" else []) + [{"role": "user", "content": question}]
        assert chat_messages(question, system_prompt) == messages
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert unpadded(batch, 2 * i) == unpadded(batch, 2 * i + 1) == list(expected["input_ids"])
    def ids(text):
        return tokenizer(text, add_special_tokens=False).input_ids
    opening, system = ids("<|im_start|>assistant\n"), ids("<|im_start|>system")
    prompt = unpadded(batch, 0)
    assert prompt[-len(opening):] == opening                         # the assistant's turn is open
    assert (prompt[:len(system)] == system) == (system_prompt != "")
    assert prompt_lengths(QUESTIONS, args) == [len(unpadded(batch, 0)), len(unpadded(batch, 2))]   # template's too


def test_off_and_a_tokenizer_without_a_template_give_the_bare_question(chat_dir, tmp_path):
    args = ts.Args(model=chat_dir, chat_template="off")
    _, tokenizer = load_policy(chat_dir, args, torch.device("cpu"))
    bare = tokenizer([format_prompt(q) for q in QUESTIONS]).input_ids
    assert encode_prompts(tokenizer, QUESTIONS, args).input_ids == bare
    assert prompt_lengths(QUESTIONS, args) == [len(ids) for ids in bare]
    builtin = ts.Args()                                   # the built-in tasks: their tokenizer has no template
    _, tokenizer = load_policy(START_MODEL_DIR, builtin, torch.device("cpu"))
    assert tokenizer.chat_template is None
    assert encode_prompts(tokenizer, QUESTIONS, builtin).input_ids == tokenizer([q + "\n" for q in QUESTIONS]).input_ids


def test_the_end_of_turn_token_stops_sampling(chat_dir):
    """The model's own config names only <|endoftext|>; with the template, <|im_end|> (read off the template)
    ends a completion too: it is in the loss mask, nothing after it is, and a row that wrote it is not cut."""
    args = ts.Args(model=chat_dir, max_new_tokens=40, temperature=1.0)
    model, tokenizer = load_policy(chat_dir, args, torch.device("cpu"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end and im_end in eos_ids_of(model) and 0 in eos_ids_of(model)
    assert im_end not in eos_ids_of(load_policy(chat_dir, ts.Args(model=chat_dir, chat_template="off"),
                                                torch.device("cpu"))[0])
    torch.manual_seed(0)
    for fast in (True, False):
        torch.manual_seed(0)
        batch = ts.generate_group(model, tokenizer, QUESTIONS * 8, 2, ts.Args(model=chat_dir, max_new_tokens=40,
                                                                             fast=fast), torch.device("cpu"))
        ids, mask = batch.completion_ids, batch.completion_mask
        ended = [(row == im_end).nonzero()[0, 0].item() for row in ids if (row == im_end).any()]
        assert len(ended) >= 3                           # the test is not vacuous: some rows did write it
        for row in range(len(ids)):
            hits = (ids[row] == im_end).nonzero()
            if len(hits) and (ids[row, :hits[0, 0]] != 0).all():      # <|im_end|> is this row's first end token
                end = hits[0, 0].item()
                assert mask[row, :end + 1].all() and not mask[row, end + 1:].any() and not batch.truncated[row]
                assert (ids[row, end + 1:] == tokenizer.pad_token_id).all()        # sampling stopped there


def test_chat_template_on_without_a_template_is_refused_in_one_line(tmp_path, capsys):
    plain = make_chat_model_dir(tmp_path / "plain", template=None)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n")
    for data in (["--dataset", str(tmp_path / "data.jsonl")], []):     # refused as the data's prompts are measured,
        capsys.readouterr()                                              # or as the model is loaded
        with pytest.raises(SystemExit) as e:
            ts.main(["--model", plain, *data, "--chat-template", "on", "--out", str(tmp_path / "run")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and "--chat-template" in lines[0], lines
        assert "has no chat template" in lines[0]
    assert_refused_in_one_line(["--chat-template", "on", "--out", str(tmp_path / "run")], "--chat-template",
                               "built-in tokenizer")
    assert not (tmp_path / "run").exists()


def test_a_run_on_a_chat_model_logs_each_reward(chat_dir, tmp_path):
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"question": f"Ann has {i} pens. How many?", "answer": f"#### {i}"}) + "\n")
    run_main(["--model", chat_dir, "--dataset", str(tmp_path / "data.jsonl"), "--reward", "strict,format:0.1",
              "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
              "--n-test", "2", "--pass-k-problems", "1", "--eval-every", "1", "--threads", "1",
              "--out", str(tmp_path / "run")])
    row = read_rows(tmp_path / "run")[1]
    assert {"rewards/strict/mean", "rewards/format/mean"} <= set(row)
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["args"]["chat_template"] == "auto" and config["args"]["reward"] == "strict,format:0.1"


def test_trl_gets_conversations_with_a_template_and_reads_the_assistants_reply(chat_dir):
    """--engine trl: with a template the prompts are conversations (TRL renders them with the same template), and
    the reward reads the text of the assistant's message TRL hands back; without one, the question's text."""
    import tepo
    from tepokit.tools.tepo_trl import task_rewards, trl_prompts
    args = ts.Args(model=chat_dir, reward="strict,format:0.5")
    assert trl_prompts(QUESTIONS, chat_dir, args) == [chat_messages(q, None) for q in QUESTIONS]
    off = ts.Args(model=chat_dir, chat_template="off")
    assert trl_prompts(QUESTIONS, chat_dir, off) == [format_prompt(q) for q in QUESTIONS]
    (reward,) = task_rewards(args, tepo.config_for("grpo"))
    logged, columns = {}, {}
    replies = [[{"role": "assistant", "content": "7\n#### 7"}], [{"role": "assistant", "content": "#### 8"}], "7"]
    got = reward(prompts=None, completions=replies, gold=["7", "7", "7"],
                 log_metric=lambda name, value: logged.__setitem__(name, value),
                 log_extra=lambda name, values: columns.__setitem__(name, values))
    assert got == [1.5, 0.5, 0.0]
    assert logged["rewards/format/mean"] == pytest.approx(2 / 3) and logged["accuracy/strict"] == pytest.approx(1 / 3)
    # completions.jsonl's columns: the gold answers and each reward by name, per completion
    assert columns == {"gold": ["7", "7", "7"], "rewards/strict": [1.0, 0.0, 0.0], "rewards/format": [1.0, 1.0, 0.0]}
