"""What `dhelix run` cannot execute though every other command accepts it, said at check time.

The planner and the simulator price every dtype of :data:`~dhelix.dsl.core.dtypes.DTYPES`;
the interpreter has kernels for :data:`~dhelix.dsl.core.dtypes.RUNNABLE_DTYPES` only. ``check``
prints these as located warnings; ``run`` raises them as errors before any rank starts.
"""

from __future__ import annotations

from dhelix.dsl.core.dtypes import RUNNABLE_DTYPES
from dhelix.dsl.core.errors import DhelixWarning
from dhelix.dsl.core.program import Program


def unrunnable(program: Program) -> list[DhelixWarning]:
    """A warning, located at the model block, for each setting of ``program`` that the
    interpreter cannot run (today: a dtype it has no kernels for); [] for a library."""
    model = program.model
    if model is None or model.dtype in RUNNABLE_DTYPES:
        return []
    return [DhelixWarning(
        f"model {model.name}: dtype = {model.dtype} can be checked, planned, drawn and simulated, but not run: "
        f"the interpreter runs {', '.join(RUNNABLE_DTYPES)}", model.span,
        [f"to train it, set dtype = bf16 (or {', '.join(d for d in RUNNABLE_DTYPES if d != 'bf16')})"])]
