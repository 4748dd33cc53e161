"""The world's TCP store as a torchrun rank reaches it, and the one compile of a torchrun world.

Under torchrun every process runs the command. Global rank 0 alone compiles
(:func:`from_rank_0`: its command parses, checks, prices and plans) and hands the result — the
:class:`~dhelix.dsl.simulator.runplan.RunPlan`, pickled — to the other ranks through the
store of the ``env://`` world; they wait for it and never parse or run a pass. An error of
rank 0's compile travels the same way, so every rank leaves with it (each node's first rank
prints it, as for any error met before the ranks join) and none waits for a plan that will
not come.

The store is torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``), or — for ranks started
some other way with ``MASTER_ADDR``/``MASTER_PORT`` — hosted on global rank 0
(:func:`host_env_store`), as torch's own env:// rendezvous does. Each attempt of a restarted
torchrun job has keys of its own (:func:`client`). torch is imported only inside the
functions.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Callable, TypeVar

from dhelix.dsl.core.errors import DhelixError

T = TypeVar("T")

#: The keys of the compiled results rank 0 hands over (one per thing compiled: a run, a
#: run for the measured nodes, a profile's measuring plan).
COMPILED_PREFIX = "dhelix/compiled/"
#: How long a rank waits for rank 0's compile: a paper-scale program takes seconds, a
#: search of chunks and orders minutes; past it the rank leaves with a located error.
COMPILE_WAIT_S = 1800.0
#: How long rank 0, after its compile failed, waits for the other ranks to have read the
#: error before it leaves (where it hosts the store, its leaving takes the store with it).
ERROR_READ_S = 30.0
_VALUE, _ERROR = b"v", b"e"


def env_address() -> tuple[str, int]:
    """The ``env://`` world's store address (``MASTER_ADDR``, ``MASTER_PORT``)."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def client(address: tuple[str, int], timeout: float, prefix: str = ""):
    """A client of the TCP store at ``address`` (host, port), its keys under ``prefix``. Under
    torchrun the store outlives a restart (``--max-restarts``): each attempt's keys get a prefix
    of their own, so that an attempt never reads the addresses, heartbeats and compiled plans
    of the ranks of one before it."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(address[0], address[1], None, False, timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = store if attempt == "0" else PrefixStore(f"dhelix/attempt-{attempt}/", store)
    return PrefixStore(prefix, store) if prefix else store


def host_env_store(address: tuple[str, int], rank: int, timeout: float):
    """The TCP store of an ``env://`` world, hosted here when this rank must host it: torchrun's
    agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``); ranks started some other way with
    ``MASTER_ADDR``/``MASTER_PORT`` (a script, another launcher) find it on global rank 0, as
    torch's own env:// rendezvous does. None on the ranks that only connect to it; the caller
    keeps what it returns alive as long as the world needs the store."""
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(address[0], address[1], None, True, timedelta(seconds=timeout), wait_for_workers=False)


def compiled_once(build: Callable[[], T], world: tuple[int, int], key: str, timeout: float) -> tuple[T, object]:
    """(``build()``'s result, the store hosted here or None) for this process, rank
    ``world[0]`` of ``world[1]`` in an ``env://`` world: global rank 0 builds, the others
    receive (:func:`from_rank_0`); the store is hosted here first when this rank must host it
    (:func:`host_env_store`, ``timeout`` its server's), and the caller passes it on to
    :func:`~.join.run_rank`. Without ``MASTER_ADDR``/``MASTER_PORT`` there is no store to
    meet at: every process builds its own."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return build(), None
    address = env_address()
    host = host_env_store(address, world[0], timeout)
    return from_rank_0(build, *world, key, address), host


def from_rank_0(build: Callable[[], T], rank: int, world: int, key: str, address: tuple[str, int], *,
                wait_s: float = COMPILE_WAIT_S) -> T:
    """``build()`` on global ``rank`` 0, handed through the store at ``address`` to the other
    ranks of the ``world``, which return rank 0's result (picklable) without calling ``build``;
    ``key`` names what is compiled. When rank 0's ``build`` raises, rank 0 hands the error over
    (a DhelixError as it is; anything else as a DhelixError naming it), waits up to
    :data:`ERROR_READ_S` for the others to read it, and raises; they raise it too. A rank that
    waits longer than ``wait_s`` raises a DhelixError naming itself and rank 0."""
    store = client(address, wait_s, COMPILED_PREFIX)
    if rank == 0:
        try:
            value = build()
        except Exception as exc:
            store.set(key, _ERROR + _pickled_error(exc))
            _await_readers(store, key, world)
            raise
        store.set(key, _VALUE + pickle.dumps(value))
        return value
    try:
        payload = store.get(key)
    except (RuntimeError, ValueError) as exc:  # the wait timed out, or the store is gone
        raise DhelixError(f"rank {rank}: global rank 0 did not hand over the compiled {key} "
                          f"({type(exc).__name__}: {exc})",
                          notes=[f"rank {rank} waited for it up to {wait_s:.0f} s; rank 0 compiles once for the "
                                 "whole world, and its own output says why it did not finish"]) from None
    store.add(f"{key}/read", 1)
    value = pickle.loads(payload[1:])
    if payload[:1] == _ERROR:
        raise value
    return value


def _pickled_error(exc: Exception) -> bytes:
    """``exc`` for the other ranks: itself when it travels (a DhelixError), else a
    DhelixError with its words (a failure of the compiler, not of the program)."""
    if isinstance(exc, DhelixError):
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
            return payload
        except Exception:  # an error type that does not unpickle: its words travel
            return pickle.dumps(DhelixError(exc.message, exc.span, exc.notes))
    return pickle.dumps(DhelixError(f"global rank 0 failed to compile the run: {type(exc).__name__}: {exc}"))


def _await_readers(store, key: str, world: int) -> None:
    """Wait up to :data:`ERROR_READ_S` until the other ``world - 1`` ranks read ``key``."""
    deadline = time.monotonic() + ERROR_READ_S
    while store.add(f"{key}/read", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
