"""Measuring the hardware: timing ops and pairs on the ranks for `dhelix profile`."""
