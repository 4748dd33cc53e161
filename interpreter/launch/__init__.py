"""Starting the ranks: local spawn or a torchrun world, signals, heartbeats and the node topology."""
