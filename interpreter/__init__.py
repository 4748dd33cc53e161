"""The torch.distributed runtime for lowered dhelix schedules."""

import warnings

# torch warns at import when NumPy is missing; the interpreter never uses NumPy. Any module of
# this package may be the first to import torch in a process (a spawned rank imports the
# modules of the options it unpickles before it runs anything), so the filter is installed with
# the package.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
