"""The task and the model a run starts from: the built-in tasks and data sets, the tokenizer, the tiny model and
its warm-up, loading a real model."""
