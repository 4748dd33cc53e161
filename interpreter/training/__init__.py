"""The training run on one rank: the step loop, optimizer, data, checkpoints, step log and run summary."""
