"""Python imports this module when a process starts, if its PYTHONPATH holds this folder (the `site` module
imports any `sitecustomize` it finds). test_tepo_trl_distributed.py launches the documented torchrun command
with it, so that each process of an --engine trl run writes down what its reward function scored: an account
of each process's own share of the rollout, to check the run's logged global metrics against, without a hook in
the code under test.

Only when $TEPO_RECORD_SCORES names a directory: each call of tepokit.core.reward.score_completions made by TRL's
reward function (tepo_trl.task_rewards' correct_answer, not the evaluation's calls) appends one JSON row to
$TEPO_RECORD_SCORES/process_<RANK>.jsonl: the process id, the completions, their gold answers and scores."""
import json
import os
import sys

RECORD_DIR = os.environ.get("TEPO_RECORD_SCORES")

if RECORD_DIR:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as train_small.py sets it, before torch starts
    from tepokit.core import reward       # imported before train_small.py and tepo_trl import its score_completions

    score_completions = reward.score_completions

    def recorded_score_completions(texts, golds):
        strict, lenient = score_completions(texts, golds)
        if sys._getframe(1).f_code.co_name == "correct_answer":        # the caller: TRL's reward function
            row = {"pid": os.getpid(), "texts": list(texts), "golds": [None if g is None else str(g) for g in golds],
                   "strict": strict.tolist(), "lenient": lenient.tolist()}
            with open(os.path.join(RECORD_DIR, f"process_{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        return strict, lenient

    reward.score_completions = recorded_score_completions
