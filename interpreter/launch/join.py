"""A rank joining its world: torchrun's (:func:`torchrun_rank`, :func:`run_rank` in place),
the local launcher's (:func:`run_rank` from :mod:`.spawn`'s rank processes), or a stand-in
world of the program's size, alone (:func:`run_as_rank`). A rank runs the ``work`` given
(:data:`Work`) with a heartbeat and its device; a collective that fails because a peer did
becomes a :class:`~.failure.RankFailure` (:mod:`.failure`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.lifetime import die_with_parent

from dhelix.interpreter.training.summary import describe_mesh

from .failure import RankFailure, blame_stalled, lost_a_peer
from .store import client, env_address, host_env_store

if TYPE_CHECKING:
    from dhelix.interpreter.training.train import RunOptions

#: What a rank runs in the joined world: ``work(options, device, heartbeat)`` → its result on
#: global rank 0 (picklable: it travels to the parent), None elsewhere; it calls
#: ``heartbeat.beat(step, index, action)`` as it moves on (:class:`.heartbeat.Heartbeat`).
#: Module-level, so that a spawned rank can unpickle it.
Work = Callable[["RunOptions", object, object], object]


def torchrun_rank(program) -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None. Raises
    DhelixError when torchrun's world is not the size of ``program``'s mesh."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = program.mesh.world
    if int(os.environ["WORLD_SIZE"]) != world:
        raise DhelixError(f"the mesh has {world} ranks ({describe_mesh(program.mesh)}) but torchrun "
                          f"started {os.environ['WORLD_SIZE']}",
                          notes=["start torchrun with nnodes × nproc-per-node equal to the mesh size"])
    return int(os.environ["RANK"]), world


def run_rank(options: "RunOptions", rank: int, world: int, work: Work, *, address: tuple[str, int] | None = None,
             gpus_per_node: int | None = None, replan: Callable | None = None, prefix: str = "", host=None):
    """Join the world as ``rank`` through the TCP store at ``address`` (the local launcher's)
    or, without one, torchrun's ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); run ``work``
    with a heartbeat (:mod:`.heartbeat`), leave; returns its result (on global rank 0; None
    elsewhere). ``options`` gives the backend, the seed and the collective timeout. Under
    torchrun with ``gpus_per_node`` (the cluster block's), the nodes the ranks run on are
    checked against it first (:mod:`.topology`), or with ``options.topology`` measured they
    decide: ``replan(options, measured gpus_per_node)`` (the command's, which compiles the
    run for them) gives the options to run. ``prefix``: the store keys of this world's, for a
    process that joins several worlds one after another on the same store (`tune --measure`
    under torchrun: one per candidate). ``host``: the ``env://`` store this process hosts
    already (:func:`.store.host_env_store`, hosted for the compile handed over by rank 0);
    None: hosted here when this rank must host it. Raises
    what ``work`` raises (the executor's DhelixError: rank, action, schedule grid) and
    RankFailure when a collective fails because a peer did."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .heartbeat import Heartbeat

    device = _rank_device(options, rank, world)
    torch.manual_seed(options.seed)
    timeout = timedelta(seconds=options.timeout)
    torchrun = address is None
    if address is None:
        die_with_parent(os.getppid(), prctl=False)  # torchrun's agent may start us from any thread
        address = env_address()
        if host is None:
            host = host_env_store(address, rank, options.timeout)
    # Beating before joining: a rank that hangs while the world forms is named too.
    heartbeat = Heartbeat(client(address, options.timeout, prefix), rank).start()
    try:
        measured, emulated = None, ""
        if torchrun and gpus_per_node is not None:
            from .topology import check_placement, emulated_nodes, exchange, measured_per_node

            places = exchange(client(address, options.timeout, prefix), rank, world)
            if getattr(options, "topology", "declared") == "measured":
                assert replan is not None, "a measured topology comes with its replan"
                measured = measured_per_node(places)
                options = replan(options, measured)
            else:
                emulated = emulated_nodes(places, gpus_per_node)
                if not emulated:
                    check_placement(places, gpus_per_node)
        dist.init_process_group(options.backend, store=client(address, options.timeout, prefix), rank=rank,
                                world_size=world, timeout=timeout)
        try:
            result = work(options, device, heartbeat)
        finally:
            dist.destroy_process_group()
        if result is not None and measured is not None:
            from .topology import describe_measured

            result = attrs.evolve(result, gpus_per_node=measured,
                                  topology=describe_measured(measured, world, gpus_per_node))
        elif result is not None and emulated:
            result = attrs.evolve(result, topology=emulated)
        return result
    except (RuntimeError, ValueError) as exc:  # a peer's failure seen through a collective
        raise blame_stalled(RankFailure(f"rank {rank}: {type(exc).__name__}: {exc}", rank=rank,
                                        secondary=lost_a_peer(exc)), address, world, prefix) from None
    except DhelixError as exc:
        if lost_a_peer(exc):
            exc.secondary = True
        raise blame_stalled(exc, address, world, prefix) from None
    finally:
        heartbeat.stop()
        del host


def _rank_device(options: "RunOptions", rank: int, world: int):
    """This rank's device: its local GPU under NCCL, else the CPU with its share of the
    cores."""
    import torch

    if options.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return torch.device("cpu")


def run_as_rank(options: "RunOptions", work: Work):
    """Run rank ``options.as_rank`` of the program's world alone in this process, in a stand-in
    world of the program's size (:mod:`dhelix.interpreter.ops.standin`): on this machine's GPU
    under ``nccl``, else on the CPU with the share of its cores a run gives each of a node's
    ranks; returns what ``work`` returns (a run's result, a profile's samples)."""
    import torch
    import torch.distributed as dist

    from dhelix.interpreter.ops.standin import join_standin_world

    mesh, rank = options.compiled.program.mesh, options.as_rank
    assert mesh is not None and rank is not None, "a model's program, one rank of it"
    world = mesh.world
    if options.backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        # The cores the rank would have here beside its node's other ranks, as a run gives each
        # of its local ranks (_rank_device): a rank timed alone on all of them would price its
        # ops faster than any run of the program on this machine executes them.
        program = options.compiled.program
        per_node = program.cluster.gpus_per_node if program.cluster is not None else world
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, min(per_node, world))))
        device = torch.device("cpu")
    torch.manual_seed(options.seed)
    join_standin_world(rank, world)
    try:
        return work(options, device, None)
    finally:
        dist.destroy_process_group()
