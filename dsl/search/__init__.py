"""The schedule search behind `dhelix tune`: from a model and a cluster to the fastest
schedule that fits.

Stages of the search, one module each: :mod:`space` (what may change: mesh factorizations,
micro-batches at a fixed global batch, ZeRO, recomputation, fold and pipeline; what the user
keeps), :mod:`variant` (one choice written into the program's syntax, checked by the same
passes as `dhelix check`, and printed back as a `.dhx` file), :mod:`bound` (a lower bound of
a layout's step and memory, from its layer DAGs alone), :mod:`tune` (branch and bound over
the layouts in order of their bounds, pricing each schedule with the step simulator, plans
cached by what determines them) and :mod:`explain` (why the best beats the runner-up).
"""
