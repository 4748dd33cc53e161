"""The element types a model may be trained in and their sizes.

One table for every stage: the checker accepts these names in ``model { dtype = … }``, a
hardware profile lists its peak FLOPS under them, and the cost model and the simulator
size tensors with :func:`dtype_bytes`. The interpreter maps the ones it can run to torch
dtypes (``dhelix.interpreter.ops.weights``).
"""

from __future__ import annotations

from dhelix.dsl.core.errors import DhelixError

#: Bytes per element of each dtype, in the order messages list them.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

#: The dtype names.
DTYPES = tuple(DTYPE_BYTES)

#: The dtypes the interpreter executes (fp8 is priced by the planner, not run).
RUNNABLE_DTYPES = ("fp32", "bf16", "fp16")

#: The dtype of main gradients, whatever the model's: the backward adds each micro-batch's
#: weight gradients into fp32 buffers, and data parallelism reduces those (Megatron-LM's
#: ``main_grad``, accumulated and all-reduced in fp32 for bf16 models), so the memory model
#: holds this many bytes per gradient element, and data parallelism sends them unless
#: ``train { grad_reduce_dtype }`` names a 16-bit dtype (the option's default is this). ZeRO-3
#: pieces keep their gradients in the model dtype.
MAIN_GRAD_DTYPE = "fp32"

#: FP8 training (Transformer Engine's and torchao's float8 recipes) runs its GEMMs in fp8 and
#: keeps every other tensor — activations between ops, attention, norms, the collectives that
#: move them, the weights' master copies — in bf16: the dtype of all but the GEMMs.
FP8_REST = "bf16"


def tensor_dtype(dtype: str, gemm: bool) -> str:
    """The dtype a model trained in ``dtype`` computes and moves an op's tensors in: the
    model's, but under fp8 only for a GEMM's (``gemm``) and :data:`FP8_REST` elsewhere."""
    return FP8_REST if dtype == "fp8" and not gemm else dtype


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`DTYPES`); raises DhelixError naming
    the known dtypes for any other name."""
    if dtype not in DTYPE_BYTES:
        raise DhelixError(f"unknown dtype '{dtype}'", notes=[f"dtypes: {', '.join(DTYPES)}"])
    return DTYPE_BYTES[dtype]
