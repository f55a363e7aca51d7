"""What the RL step itself calls (train_small.py, rl_step): the forward pass and log-probs, the reward parser,
a mini-batch's metrics, the clock, and the update's one observer (taps.py)."""
