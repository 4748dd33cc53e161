"""How `dhelix run` and `dhelix profile` start their ranks: the options both share, checked
before any rank starts.

Both commands launch the same way (local ranks by default, or each process of a torchrun
world, :mod:`dhelix.interpreter.launch.spawn`), so the launch options are added and checked here once:

- ``--nproc N``: must be at least 1 and equal the mesh's world size (a usage error, exit 2);
- ``--timeout S``: must be positive (torch's store rejects 0 with C++ frames) and at most a week
  (infinity and NaN are refused);
- ``--backend``: ``nccl`` needs CUDA and one visible GPU per local rank (a usage error rather
  than four tracebacks from ``torch.cuda.set_device``). Not given, it is ``nccl`` when there are
  enough GPUs for the local ranks and ``gloo`` otherwise, so a job on a GPU machine never
  trains on CPU by accident; the summary says which device each rank used.

torch is imported only inside :func:`choose_backend`, when a command launches.
"""

from __future__ import annotations

import os

from dhelix.cli.options import add_options, check_options
from dhelix.dsl.core.errors import UsageError


def add_launch_arguments(parser) -> None:
    """Add ``--nproc``, ``--backend`` and ``--timeout`` (the declared options of the "launch"
    group) to ``parser``."""
    add_options(parser, group="launch")


def check_launch_numbers(args) -> None:
    """Raise UsageError for a ``--timeout`` outside its declared range or an ``--nproc`` below
    1; cheap, so commands call it before reading the program."""
    check_options(args, ["timeout", "nproc"])


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when this process is a rank of a torchrun world, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def local_ranks(args, program, torchrun: bool) -> int:
    """How many ranks this machine runs: torchrun's ``LOCAL_WORLD_SIZE`` under torchrun, else
    ``--nproc`` (which must equal the mesh's world size) or the world size."""
    if torchrun:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    world = program.mesh.world
    nproc = args.nproc if args.nproc is not None else world
    if nproc != world:
        from dhelix.interpreter.training.summary import describe_mesh

        raise UsageError(f"--nproc {nproc} does not match the mesh: it has {world} ranks "
                         f"({describe_mesh(program.mesh)})")
    return nproc


def choose_backend(requested: str | None, local: int) -> str:
    """The backend for ``local`` ranks on this machine: ``requested`` when it can run here
    (UsageError for ``nccl`` without CUDA or with fewer GPUs than local ranks), else nccl when
    every local rank can have a GPU, else gloo."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and gpus == 0:
        raise UsageError("--backend nccl needs CUDA GPUs, and this torch sees none "
                         f"(torch {torch.__version__}, CUDA {'built in' if torch.version.cuda else 'not built in'}); "
                         "use --backend gloo to run on CPU")
    if requested == "nccl" and gpus < local:
        raise UsageError(f"--backend nccl needs one GPU per local rank: {local} rank(s) here but {gpus} GPU(s) "
                         "visible (CUDA_VISIBLE_DEVICES)")
    if requested is not None:
        return requested
    return "nccl" if 0 < local <= gpus else "gloo"


#: Device files one of which exists where a GPU driver is loaded (NVIDIA, ROCm, WSL's).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def backend_without_torch(requested: str | None) -> str | None:
    """The backend :func:`choose_backend` will pick, where it is known without importing
    torch: ``requested``, or gloo where no GPU can be visible (no GPU driver's device file,
    or ``CUDA_VISIBLE_DEVICES`` empty); None where only torch can tell."""
    if requested is not None:
        return requested
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return "gloo"
    return None if any(os.path.exists(path) for path in GPU_DEVICE_FILES) else "gloo"


def available_memory() -> tuple[float, str] | None:
    """The bytes of memory this machine can give a run now (Linux: ``MemAvailable`` of
    /proc/meminfo, else the physical memory) and which figure that is; None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "available"
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "installed"
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(program, local: int, backend: str, *, force: bool = False) -> str | None:
    """Before any rank starts: the simulator's peak memory of a rank (model states plus live
    activations, :mod:`dhelix.dsl.simulator.memory`) against what this machine has — on
    ``gloo``, its memory for the ``local`` ranks together; on ``nccl``, the smallest
    visible GPU for one. Raises DhelixError (at the model block) when it does not fit, naming
    the way out, unless ``force``; then returns the line saying so (None when it fits or
    there is no profile to predict with)."""
    from dhelix.dsl.core.errors import DhelixError
    from dhelix.dsl.simulator.events import peak_memory

    if program.profile is None:
        return None
    peak = peak_memory(program)  # simulate's peak, without planning the SI blocks or timing the step
    if backend == "nccl":
        import torch

        have: float = min(torch.cuda.get_device_properties(i).total_memory for i in range(local))
        need, where = peak, f"the smallest of this machine's {local} GPU(s) has {have / 1e9:.2f} GB"
    else:
        found = available_memory()
        if found is None:
            return None
        have, kind = found
        need = peak * local
        where = f"this machine has {have / 1e9:.2f} GB {kind}"
    if need <= have:
        return None
    message = (f"the simulator predicts {peak / 1e9:.2f} GB per rank at its peak (model states and live "
               f"activations), {need / 1e9:.2f} GB for the {local} rank(s) this machine would run; {where}")
    if force:
        return f"warning: {message}; starting anyway (--force)"
    raise DhelixError(message, program.model.span, [
        "train a smaller model (fewer layers, hidden, ffn, seq or vocab) or fewer micro-batches; run it across "
        "nodes under torchrun; or give --force to start anyway"])
