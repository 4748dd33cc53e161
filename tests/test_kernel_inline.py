"""A kernel's body written into generated code (interpreter/execute/kernel_inline.py): the same
results bit for bit as calling it, early returns and helpers written out, and the shapes it
cannot inline left to a call."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dhelix.interpreter.execute.kernel_inline import inline  # noqa: E402
from dhelix.interpreter.ops.kernels import OPERATOR_KERNELS, KernelCtx  # noqa: E402


def _run_inlined(fn, args: list, values: dict, target: str | None):
    """Run ``fn`` inlined with ``args`` (text) over ``values``; the namespace after."""
    bound: dict = {}

    def bind(value, hint):
        name = f"{hint}_{len(bound)}_"
        bound[name] = value
        return name
    lines = inline(fn, args, target, bind)
    assert lines is not None, fn
    namespace = bound | values
    exec("\n".join(lines), namespace)  # noqa: S102
    return lines, namespace


def test_inlined_kernels_give_the_calls_results_bit_for_bit():
    torch.manual_seed(0)
    x, weight, grad = torch.randn(8, 16), torch.randn(16), torch.randn(8, 16)
    ctx = KernelCtx()
    norm = OPERATOR_KERNELS["rmsnorm"]
    lines, got = _run_inlined(norm.forward, [["x0"], "w", "ctx"], {"x0": x, "w": weight, "ctx": ctx}, "out, saved")
    out, saved = norm.forward([x], weight, KernelCtx())
    assert torch.equal(got["out"], out) and all(torch.equal(a, b) for a, b in zip(got["saved"], saved, strict=True))
    # The device test is the helper's expression, the GPU branch an if with the CPU form its else;
    # the kernel's locals are dropped at the end (its temporaries go as its frame's would).
    text = "\n".join(lines)
    assert "x0.is_cuda" in text and "on_gpu" not in text and "else:" in text and "return" not in text
    assert lines[-1].endswith(" = None") and "k_rstd" in lines[-1] and got["k_rstd"] is None
    _, got = _run_inlined(norm.dgrad, ["g", "s", "w"], {"g": grad, "s": saved, "w": weight}, "grads")
    assert torch.equal(got["grads"][0], norm.dgrad(grad, saved, weight)[0])
    gemm = OPERATOR_KERNELS["gemm"]
    for rows in (16, 17):  # without a bias row and with one (the kernel's early return)
        w = torch.randn(rows, 4)
        _, got = _run_inlined(gemm.forward, [["x0"], "w", "None"], {"x0": x, "w": w}, "out, saved")
        out, saved = gemm.forward([x], w, None)
        assert torch.equal(got["out"], out) and len(got["saved"]) == len(saved)
        acc = torch.randn(rows, 4)
        into = acc.clone()
        g = torch.randn(8, 4)
        _run_inlined(gemm.wgrad_into, ["into", "g", "s"], {"into": into, "g": g, "s": saved}, None)
        gemm.wgrad_into(acc, g, saved)
        assert torch.equal(into, acc)


def test_what_does_not_inline_is_left_to_a_call():
    def bind(value, hint):
        return hint

    def closure_of(y):
        def kernel(x):
            return x + y
        return kernel

    def defaults(x, scale=2):
        return x * scale

    def loop_return(xs):
        for x in xs:
            return x
        return None

    def unknown(x):
        y = x + 1
        return y + nowhere  # noqa: F821 (a name defined nowhere: its call raises NameError)

    assert inline(unknown, ["a"], "b", bind) is None
    assert inline(lambda x: x + 1, ["a"], "b", bind) is None
    assert inline(closure_of(1), ["a"], "b", bind) is None
    assert inline(defaults, ["a", "b"], "c", bind) is None
    assert inline(loop_return, ["a"], "b", bind) is None
    assert inline(OPERATOR_KERNELS["add"].forward, ["a"], "b", bind) is None  # arity differs
