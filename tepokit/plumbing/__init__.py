"""The run directory and the process around it: logs and checkpoints, stop signals, non-finite values, live
trackers, the hub, one-line errors."""
