"""dhelix: a schedule language, compiler and interpreter for strand-interleaved training.

The front end, planner and simulator live in :mod:`dhelix.dsl` (no torch); the runtime in
:mod:`dhelix.interpreter`.
"""

__version__ = "0.1.0"
