"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) that resume on any layout.

A checkpoint folder ``DIR`` holds one sub-folder per save (``step-000010``) and a file
``latest`` naming the last complete one. A save is written to a temporary folder, renamed
into place once complete, and only then does ``latest`` (replaced atomically with
``os.replace``) point at it, after which all but the ``keep`` newest intact saves are removed
(:func:`~.manifest.beyond_kept`: the manifest decides, and a damaged one never pushes out an
intact one; neither the save just written nor the one the run resumed from is removed), by
global rank 0 in a thread of its own (:class:`Rotation`) while the ranks train on: a save
interrupted midway leaves the last good checkpoint as it was, and the next save removes what
it left (``.partial-*`` of a process that is gone). A save that cannot be written (a full
disk) removes its partial folder and raises OutputError naming every rank that failed and why
(DCP gathers every rank's failure; ``torch.save`` on a full disk says only "unexpected pos",
so a disk left with under a MiB is named full) and the save that is kept.

Each save ends with a manifest (``manifest.json``: every file's size and SHA-256), written
last and atomically before the folder is renamed into place; :func:`verify` checks a save
against it and names the damaged file (:class:`CheckpointDamaged`). A save without one (an
older dhelix's) loads with a warning.

What is saved is layout-free: every parameter and both AdamW moments under the parameter's
full (unsharded) name and shape, with the step, the seed, the global batch size (the data
position is the step: step k reads the k-th global batch; a data blend's position, where each
source stands, is stored beside it) and the torch RNG state. The shards
are joined into full tensors (:func:`.harness.gather_full`, every parameter on the rank that
writes it) and every rank writes its share of the parameters, in parallel, through DCP over a
process group of its own whose timeout is :data:`SAVE_TIMEOUT_S`: a slow disk never trips the
training collectives' ``--timeout``. Loading reads the full tensors on every rank and keeps its
own shard (:meth:`.weights.ShardSpec.take`), so a run saved with tp 2 × pp 2 resumes on one
rank or on dp 2. The shards are joined rather than saved in place because a column-parallel
weight's shard is several non-contiguous blocks of the full tensor (:mod:`.weights`), which
neither DTensor's placements nor a single DCP chunk describe.

:func:`export_weights` writes the full weights as one ``torch.save`` file whose keys are
:class:`~.reference.ReferenceModel`'s ``state_dict`` keys.

One module, though over 500 lines, because it is one thing: a DCP checkpoint's save and load
(the rotation of old saves and a failed save's report are parts of the save; the manifests are
:mod:`.manifest`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

from dhelix.dsl.core.errors import OutputError
from dhelix.dsl.core.wording import join_words
from dhelix.dsl.core.outputfile import write_atomically, write_text_atomically

from dhelix.interpreter.verify.harness import gather_full
from .manifest import (LATEST, META, CheckpointDamaged, CheckpointError, beyond_kept,  # noqa: F401 (API)
                       intact_saves, saves_in, verified_intact, verify, write_manifest)

FORMAT = 1
#: The timeout of the process group that saves go through (a day): a save is never cut short
#: by the collectives' ``--timeout``; a rank that dies meanwhile ends the run through its
#: launcher instead.
SAVE_TIMEOUT_S = 24 * 3600.0
#: Test-only: seconds global rank 0 waits before it writes its share of a save (a slow disk).
SLOW_SAVE_ENV = "DHELIX_TEST_SLOW_SAVE"
#: Test-only: the global ranks (``1,3``) whose writes of a save fail as on a full disk
#: (torch.save's "unexpected pos", inside DCP).
FULL_DISK_ENV = "DHELIX_TEST_FULL_DISK"


@contextlib.contextmanager
def _single_process():
    # no_dist=True is the intent (each rank reads the full tensors alone); DCP still warns.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_group():
    """The process group that saves and exports wait in (gloo, :data:`SAVE_TIMEOUT_S`); create
    it on every rank, in the same order, before the first save. Collective over the world."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=SAVE_TIMEOUT_S))


def _owned_state(executor, optimizer) -> dict:
    """This rank's share of the layout-free state (:func:`.harness.owned_names`): full fp32
    weights and both moments; collective over the world."""
    plan, comm = executor.weights, executor.comm
    moments = optimizer.moments()
    flat = executor.flat  # ZeRO-3 pieces are gathered over dp first
    params = gather_full(plan, comm, optimizer.masters(), flat, owned=True)  # fp32, whatever the compute dtype
    first = gather_full(plan, comm, {name: pair[0] for name, pair in moments.items()}, flat, owned=True)
    second = gather_full(plan, comm, {name: pair[1] for name, pair in moments.items()}, flat, owned=True)
    return {"model": params, "exp_avg": first, "exp_avg_sq": second}


def save(root: str, executor, optimizer, *, step: int, seed: int, global_sequences: int, group=None,
         schedule: dict | None = None, keep: int = 1, program: dict | None = None,
         data: dict | None = None, rotation: Rotation | None = None) -> Path | None:
    """Save the run after ``step`` steps under ``root``, keeping the ``keep`` newest saves;
    returns the new save's folder on global rank 0 (None elsewhere). Every rank writes its
    share of the tensors, waiting for the others only in ``group`` (:func:`save_group`; None:
    the default group).
    ``schedule`` (the learning-rate schedule's settings) is stored beside the seed, for a
    resume to compare; ``program`` (its ``path`` and ``text``), so that ``dhelix generate CK``
    needs nothing else; ``data``, a data blend's sources and position (:func:`.data.saved_data`;
    None: the step is the data position). ``rotation`` removes the older saves afterwards on global rank 0
    (:class:`Rotation`; None: at once). Collective over the world. OutputError when it cannot be written,
    naming every rank that failed and why (the partial save is removed; the last good one is kept and named)."""
    import torch.distributed as dist

    state = _owned_state(executor, optimizer)
    first = dist.get_rank() == 0
    root_path = Path(root)
    final = root_path / f"step-{step:06d}"
    if first:
        state["rng"] = torch.get_rng_state()
    if first and rotation is not None:
        rotation.join()  # the last save's removals are done before this one begins
    try:
        partial = _begin_save(root_path, final, group)
        if first and os.environ.get(SLOW_SAVE_ENV):
            time.sleep(float(os.environ[SLOW_SAVE_ENV]))
        _write_shards(state, partial, group)
        if first:
            meta = {"format": FORMAT, "step": step, "seed": seed, "global_sequences": global_sequences,
                    "optimizer_steps": optimizer.steps, "schedule": schedule or {},
                    "shapes": {name: list(spec.full) for name, spec in
                               ((n, executor.weights.spec(n)) for n in executor.weights.names())}}
            if program is not None:
                meta["program"] = program
            if data is not None:
                meta["data"] = data
            _finish_save(meta, partial, final, root_path)
    except (Exception, _checkpoint_exception()) as exc:  # DCP wraps each rank's failure
        failed = _write_failures(exc, dist.get_rank(), root_path)
        if not failed:
            raise
        if "partial" in locals():
            shutil.rmtree(partial, ignore_errors=True)
        kept = saves_in(root_path) if root_path.is_dir() else []
        raise OutputError(f"cannot save the checkpoint of step {step} to '{root}': {_by_reason(failed)}",
                          notes=["the partial save was removed",
                                 f"the last good save, {kept[-1].name}, is kept" if kept
                                 else "there is no earlier save"]) from None
    dist.barrier(group=group)  # rank 0 has renamed the save into place: it is complete
    if not first:
        return None
    (rotation or Rotation(background=False)).start(root_path, final, keep)
    return final


class Rotation:
    """Removes the saves that ``--keep`` drops (:func:`~.manifest.beyond_kept`) after each save,
    on global rank 0, in a thread of its own (``background``): the other ranks are in the next
    step's collectives meanwhile, and a slow delete (a save of many files) must never hold them
    up nor be what their timeout blames. A new save and the end of the run :meth:`join` it.
    Never removed: the save just written and ``resumed``, the save the run resumed from. Saves
    verified once (their hashes read: the manifest decides) are remembered for the run."""

    def __init__(self, resumed: Path | None = None, *, background: bool = True):
        self.resumed, self.background = resumed, background
        self._thread: threading.Thread | None = None
        self._intact: dict[Path, bool] = {}

    def start(self, root: Path, written: Path, keep: int) -> None:
        """Remove what keeping the ``keep`` newest intact saves of ``root`` drops, ``written``
        (just saved, intact) counted first; in the background unless made otherwise."""
        self.join()
        self._intact[written] = True
        if not self.background:
            self._remove(root, written, keep)
            return
        self._thread = threading.Thread(target=self._remove, args=(root, written, keep), name="dhelix-keep",
                                        daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait until the removal under way (if any) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _remove(self, root: Path, written: Path, keep: int) -> None:
        protected = [self.resumed] if self.resumed is not None else []
        for old in beyond_kept(root, keep, written=written, protected=protected, intact=self._checked):
            shutil.rmtree(old, ignore_errors=True)
            self._intact.pop(old, None)

    def _checked(self, folder: Path) -> bool:
        if folder not in self._intact:
            self._intact[folder] = verified_intact(folder)
        return self._intact[folder]


#: What torch's zip writer says when a write of ``torch.save`` failed (a full disk): the
#: system's reason is not in it.
_WRITE_FAILED = ("unexpected pos", "failed writing", "write failed")
#: Free bytes under which a disk whose write failed is taken to be full.
_FULL_DISK_BYTES = 1 << 20


def _write_failures(exc: BaseException, rank: int, root: Path) -> dict[int, str]:
    """Each failed rank's reason (rank → the system's words) when every failure in ``exc``
    (DCP's CheckpointException holds every rank's; another error is this ``rank``'s own) is
    one of writing the save; {} when one is not (a bug, raised as it is). A failure of
    ``torch.save``'s writer carries no reason: a disk left with under a MiB is full."""
    failures = getattr(exc, "failures", None) or {rank: exc}
    reasons = {}
    for failed, error in sorted(failures.items()):
        error = error[0] if isinstance(error, tuple) else error
        reason = _write_reason(error, root)
        if reason is None:
            return {}
        reasons[failed] = reason
    return reasons


def _write_reason(error: BaseException, root: Path) -> str | None:
    seen = error
    while seen is not None:  # an OSError anywhere in the chain (OutputError from a file write)
        if isinstance(seen, OSError):
            return seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    found = [text.find(words) for words in _WRITE_FAILED if words in text]
    if not isinstance(error, RuntimeError) or not found:
        return None
    try:
        if shutil.disk_usage(root).free < _FULL_DISK_BYTES:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    return f"a write failed (torch: {text[min(found):].splitlines()[0][:200]})"


def _by_reason(failed: dict[int, str]) -> str:
    """``failed`` (rank → reason) in words: "No space left on device (ranks 1, 2 and 3)"."""
    ranks: dict[str, list[int]] = {}
    for rank, reason in failed.items():
        ranks.setdefault(reason, []).append(rank)
    return "; ".join(f"{reason} ({'rank' if len(of) == 1 else 'ranks'} {join_words(map(str, of))})"
                     for reason, of in ranks.items())


def _begin_save(root: Path, final: Path, group) -> Path:
    """Global rank 0 creates ``root``, removes what interrupted saves left, and names the
    partial folder of this save; every rank gets that name (through ``group``)."""
    import torch.distributed as dist

    name = [None]
    if dist.get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            name[0] = f".partial-{final.name}-{os.getpid()}"
        except OSError as exc:
            name[0] = exc  # the others raise it too rather than wait for a save that never comes
    dist.broadcast_object_list(name, src=0, group=group)
    if isinstance(name[0], OSError):
        raise name[0]
    return root / name[0]


def _write_shards(state: dict, partial: Path, group) -> None:
    """Every rank writes its ``state`` into ``partial`` through DCP over ``group`` (global
    rank 0 also writes DCP's metadata)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    writer = None
    if str(dist.get_rank()) in os.environ.get(FULL_DISK_ENV, "").split(","):
        writer = _full_disk_writer(partial)
    dcp.save(state, checkpoint_id=str(partial), process_group=group, storage_writer=writer)


def _full_disk_writer(partial: Path):
    """Test-only (:data:`FULL_DISK_ENV`): DCP's file writer whose writing fails as
    ``torch.save`` fails on a full disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    return FullDisk(str(partial))


def _finish_save(meta: dict, partial: Path, final: Path, root: Path) -> None:
    """Write ``meta`` and the manifest into ``partial`` (the manifest last), rename it to
    ``final`` and point ``latest`` at it (atomically)."""
    (partial / META).write_text(json.dumps(meta, indent=1) + "\n")
    write_manifest(partial)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    write_text_atomically(root / LATEST, final.name + "\n")


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _remove_stale(root: Path) -> None:
    """Remove what interrupted saves left in ``root`` (``.partial-*`` folders, ``.latest-*``
    files) whose writing process is gone."""
    for leftover in [*root.glob(".partial-step-*"), *root.glob(f".{LATEST}.partial-*")]:
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process writes one save at a time: its leftover is stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(root: str) -> Path:
    """The save that ``root`` means: the one its ``latest`` names, or ``root`` itself when it
    is one save of a checkpoint folder (``DIR/step-000010``); CheckpointError when neither, or when
    ``latest`` does not name one of its saves (garbage, a folder that is gone)."""
    root_path = Path(root)
    pointer = root_path / LATEST
    if not pointer.is_file() and (root_path / META).is_file():
        return root_path
    if not pointer.is_file():
        raise CheckpointError(f"'{root}' is not a dhelix checkpoint: it has no '{LATEST}' file",
                              notes=["give a folder that a run saved its checkpoints in"])
    try:
        name = pointer.read_bytes()[:256].decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        name = f"<unreadable: {getattr(exc, 'strerror', None) or type(exc).__name__}>"
    saves = saves_in(root_path)
    if name not in {save.name for save in saves}:
        shown = name if len(name) <= 40 and name.isprintable() else f"{name[:40]!r}…"
        raise CheckpointError(f"the checkpoint '{root}' is damaged: its '{LATEST}' file names no save of it ({shown})",
                              notes=[f"resume from one of its saves, such as {saves[-1]}, or from the newest intact "
                                     "one" if saves else "it holds no save (step-*)"])
    return root_path / name


def latest(root: str) -> tuple[Path, dict]:
    """The save that ``root`` means (:func:`resolve`) and its metadata; CheckpointError when
    there is none or it cannot be read."""
    folder = resolve(root)
    try:
        meta = json.loads((folder / META).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')}, expected {FORMAT}")
        meta["step"], meta["shapes"]  # noqa: B018 - the keys every reader needs
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # a broken JSON, a missing file, DCP's unpickling of its metadata
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(f"the checkpoint '{folder}' is corrupt: {first}",
                              notes=["resume from another save, or start the run again"]) from None
    return folder, meta


def check_fits(root: str, meta: dict, plan, global_sequences: int | None) -> None:
    """CheckpointError when the checkpoint's parameters or global batch differ from the
    run's (``plan``: its WeightPlan; ``global_sequences`` None: the parameters only)."""
    mine = {name: list(plan.spec(name).full) for name in plan.names()}
    theirs = meta["shapes"]
    wrong = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
    if wrong:
        shown = "; ".join(f"{n}: checkpoint {theirs.get(n, 'absent')}, model {mine.get(n, 'absent')}"
                          for n in wrong[:4])
        raise CheckpointError(f"the checkpoint '{root}' does not fit this model ({len(wrong)} parameters "
                              f"differ: {shown})", notes=["resume with the model it was saved from"])
    if global_sequences is not None and meta["global_sequences"] != global_sequences:
        raise CheckpointError(
            f"the checkpoint '{root}' was trained with {meta['global_sequences']} sequences a step, this run "
            f"has {global_sequences} (dp · microbatches · micro_batch)",
            notes=["set microbatches so that the global batch is the same; the data position is the step"])


def load(root: str, executor, optimizer, global_sequences: int) -> dict:
    """Load the last save under ``root`` into this rank's shards of the weights and the
    optimizer moments and restore the RNG; returns the metadata (``step``: steps done)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder, meta = latest(root)
    plan = executor.weights
    check_fits(root, meta, plan, global_sequences)
    names = list(executor.params)
    state = {key: {name: torch.empty(plan.spec(name).full) for name in names}
             for key in ("model", "exp_avg", "exp_avg_sq")}
    state["rng"] = torch.get_rng_state()
    try:
        with _single_process():
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        exc = _first_failure(exc)
        raise CheckpointError(f"the checkpoint '{folder}' cannot be read: "
                              f"{(str(exc).splitlines() or [''])[0][:300] or type(exc).__name__}",
                              notes=["it is corrupt or incomplete; resume from another save"]) from None
    index = executor.index

    def mine(name, full):
        spec = plan.spec(name)
        parts = plan.program.mesh.size(spec.axis) if spec.axis else 1
        return executor.flat.take(name, spec.take(full, index.get(spec.axis, 0) if spec.axis else 0, parts))

    optimizer.load_state({name: mine(name, state["model"][name]) for name in names},
                         {name: (mine(name, state["exp_avg"][name]), mine(name, state["exp_avg_sq"][name]))
                          for name in names}, meta["optimizer_steps"])
    torch.set_rng_state(state["rng"])
    return meta


def read_weights(root: str, plan) -> tuple[dict[str, torch.Tensor], dict]:
    """The full fp32 weights of the last save under ``root`` (keyed like ``plan.names()``)
    and its metadata, in this one process (no torch.distributed); CheckpointError when it
    cannot be read or does not fit ``plan``'s program."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    verify(resolve(root))  # a save without a manifest (an older dhelix's) loads as it is
    folder, meta = latest(root)
    check_fits(root, meta, plan, None)
    state = {"model": {name: torch.empty(plan.spec(name).full) for name in plan.names()}}
    try:
        with _single_process():
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as exc:
        exc = _first_failure(exc)
        raise CheckpointError(f"the checkpoint '{folder}' cannot be read: "
                              f"{(str(exc).splitlines() or [''])[0][:300] or type(exc).__name__}",
                              notes=["it is corrupt or incomplete"]) from None
    return state["model"], meta


def _first_failure(exc):
    """The error a rank met inside DCP's CheckpointException (which wraps each rank's)."""
    failures = getattr(exc, "failures", None)
    if failures:  # rank → (exception, traceback)
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return inner if isinstance(inner, BaseException) else exc
    return exc


def export_weights(path: str, executor, optimizer) -> None:
    """Write the full fp32 weights (the masters) to ``path`` on global rank 0 as a
    ``torch.save`` file keyed like :class:`~.reference.ReferenceModel`'s ``state_dict``;
    collective. A regular file is written beside and renamed into place (a device, such as
    /dev/null, directly). OutputError when it cannot be written (nothing left behind)."""
    full = gather_full(executor.weights, executor.comm, optimizer.masters(), executor.flat)
    if full is None:
        return
    weights = {name.replace(".", "__"): t.float().contiguous() for name, t in full.items()}
    write_atomically(path, lambda target: _torch_save(weights, target), what="the weights")


def _torch_save(state: dict, path: Path) -> None:
    """``torch.save`` of ``state`` to ``path``, raising the OSError of a failed write."""
    with open(path, "wb") as file:
        writer = _Writer(file)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


class _Writer:
    """A file for ``torch.save`` that keeps the OSError of a failed write (torch reports it
    as a RuntimeError of its zip writer, "unexpected pos …", without the system's reason)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = exc
            raise
