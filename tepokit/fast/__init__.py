"""The fast twins of the RL step (--fast, the default), each tested equal to the plain path: the sampler and its
log-probs, CUDA graphs, and the step's settings resolved once."""
