"""Every measurement of a run, taken after the RL step from the record it returns (after_step.py), and the
statistics and summaries of a run."""
