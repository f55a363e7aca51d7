"""What the RL step calls, and nothing else: the forward pass and log-probs, the sampler and its fast twins, the
reward parser, a mini-batch's metrics, the clock, and the update's one observer (taps.py)."""
