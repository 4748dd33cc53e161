"""The torch.distributed runtime for lowered dhelix schedules."""
