"""The saves of a checkpoint folder and their manifests (no torch: ``dhelix checkpoint verify``).

A save folder (``DIR/step-000010``) ends with ``manifest.json``: every other file's size and
SHA-256, written last (to a temporary file made durable, then renamed over the manifest) and
before the folder is renamed into place. :func:`verify` checks a save against it and names
the first file that is missing, of another size or of other bytes (:class:`CheckpointDamaged`).
:func:`beyond_kept` is what ``--keep`` removes; :class:`FolderLock`, the lock of the one run
saving in a folder; :func:`inside_checkpoint`, whether an output would land in a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable

from dhelix.dsl.core.errors import DhelixError, DhelixWarning
from dhelix.dsl.core.outputfile import write_text_atomically

MANIFEST = "manifest.json"
#: The save's own metadata (step, seed, shapes), written by :mod:`.checkpoint`.
META = "dhelix.json"
#: The file of a checkpoint folder naming its last complete save (written by :mod:`.checkpoint`).
LATEST = "latest"
#: The manifest's format (its ``format`` field).
MANIFEST_FORMAT = 1


class CheckpointError(DhelixError):
    """A checkpoint that cannot be read or does not fit this run."""


class CheckpointDamaged(CheckpointError):
    """A save whose files differ from its manifest (a file changed, truncated or missing
    since the save completed): the message names the save and the file; ``earlier`` is the
    run's earlier save that is kept (None: none)."""

    earlier: Path | None = None


def saves_in(root: Path) -> list[Path]:
    """The complete saves in the checkpoint folder ``root``, oldest first (by step)."""
    saves = [p for p in root.glob("step-*") if p.is_dir() and p.name[len("step-"):].isdigit()]
    return sorted(saves, key=lambda p: int(p.name[len("step-"):]))


def write_manifest(folder: Path) -> None:
    """Write ``folder``'s manifest: every other file's size and SHA-256, to a temporary file
    made durable and then renamed over ``manifest.json``."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.name == MANIFEST or path.name.startswith(f".{MANIFEST}"):
            continue
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    write_text_atomically(folder / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1,
                                                        sort_keys=True) + "\n", durable=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(folder: Path, hashes: bool = True) -> list[DhelixWarning]:
    """Check the save ``folder`` against its manifest: CheckpointDamaged naming the first
    file that is missing or whose size or SHA-256 differs (``hashes`` False: its size only,
    without reading the files); returns a warning (and checks nothing) for a save without a
    manifest, an older dhelix's."""
    folder = Path(folder)
    listing = folder / MANIFEST
    if not listing.is_file():
        return [DhelixWarning(f"the checkpoint '{folder}' has no manifest ({MANIFEST}; saved by an older dhelix): "
                              "its files are not verified",
                              notes=["it is loaded as it is; a file damaged since the save may load wrong values"])]
    try:
        files = json.loads(listing.read_text())["files"]
        entries = [(str(name), int(entry["size"]), str(entry["sha256"])) for name, entry in sorted(files.items())]
    except Exception as exc:  # broken JSON, a missing key, a wrong type
        raise _damaged(folder, f"the checkpoint '{folder}' is damaged: its manifest '{MANIFEST}' cannot be read "
                               f"({type(exc).__name__})") from None
    for name, size, digest in entries:
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problem = "lies outside the save"
        elif not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != size:
            problem = f"has {path.stat().st_size} bytes where the manifest says {size}"
        elif hashes and _sha256(path) != digest:
            problem = "differs from the manifest's SHA-256 (its bytes changed after the save)"
        else:
            continue
        raise _damaged(folder, f"the checkpoint '{folder}' is damaged: its file '{name}' {problem}")
    return []


def _damaged(folder: Path, message: str) -> CheckpointDamaged:
    """CheckpointDamaged for the save ``folder`` with ``message``, naming the earlier save of
    its run that is kept, if any (``earlier``: for the command to say how to resume it)."""
    earlier = [p for p in saves_in(folder.parent) if p.name < folder.name]
    note = (f"the earlier save '{earlier[-1]}' of this run is kept" if earlier
            else "no earlier save of this run is kept: restore the file from a copy, or start the run again")
    error = CheckpointDamaged(message, notes=[note])
    error.earlier = earlier[-1] if earlier else None
    return error


def check_save(folder: Path) -> tuple[list[DhelixWarning], CheckpointDamaged | None]:
    """What :func:`verify` says of ``folder``: its warnings, or the damage it found."""
    try:
        return verify(folder), None
    except CheckpointDamaged as exc:
        return [], exc


def intact_saves(root: Path):
    """The saves of ``root``, newest first, each as (folder, warnings, damage or None)
    (:func:`check_save`)."""
    for folder in reversed(saves_in(root)):
        yield folder, *check_save(folder)


def describe(folder: Path, *, verified: bool) -> str:
    """One line on an intact save ``folder``: its files and bytes, checked or not."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    how = "intact (size and SHA-256 of each file checked)" if verified else "not verified (no manifest)"
    return f"{how}, {len(files)} files, {size / 1e6:.2f} MB"


def beyond_kept(root: Path, keep: int, *, written: Path | None = None, protected: Iterable[Path] = (),
                intact: Callable[[Path], bool] | None = None) -> list[Path]:
    """The saves of ``root`` that keeping the ``keep`` newest intact ones removes: those older
    than the ``keep``-th newest intact save. ``intact(folder)`` says whether a save is intact
    (default: :func:`verify` with hashes: the manifest decides, never the sizes alone); a damaged
    save is not counted, so it never pushes out an intact one, and one newer than the kept
    intact saves stays for its owner to look at. ``written``, the save a run has just written,
    is counted first (it is intact) and never removed; saves of later steps than it belong to
    another branch (the run resumed from an earlier save) and are neither counted nor removed.
    ``protected`` (the save the run resumed from) is never removed."""
    intact = intact or verified_intact
    spared = {Path(os.path.realpath(p)) for p in [*protected, *([written] if written is not None else [])]}
    saves = saves_in(root)
    if written is not None:
        mine = Path(os.path.realpath(written))
        step = _step(written)
        saves = [s for s in saves if _step(s) < step and Path(os.path.realpath(s)) != mine] + [written]
    counted, removed = 0, []
    for folder in reversed(saves):
        if counted >= keep:
            if Path(os.path.realpath(folder)) not in spared:
                removed.append(folder)
            continue
        if folder == written or intact(folder):
            counted += 1
    return removed[::-1]


def _step(folder: Path) -> int:
    return int(folder.name[len("step-"):])


def verified_intact(folder: Path) -> bool:
    """Whether the save ``folder`` is intact by its manifest (sizes and SHA-256); a save
    without a manifest (an older dhelix's) counts as intact, one that cannot be read not."""
    try:
        verify(folder)
    except (CheckpointDamaged, OSError):
        return False
    return True


def inside_checkpoint(path: str | Path, save: str | Path | None = None) -> Path | None:
    """The checkpoint folder or save that a file written at ``path`` would land in, else
    None: ``save`` (the run's ``--save`` folder, which may not exist yet) or a folder inside
    it, a folder holding saves (``DIR/latest``, ``DIR/x``), or a save or a folder inside one
    (``DIR/step-000010/x``)."""
    target = Path(os.path.realpath(path))
    mine = Path(os.path.realpath(save)) if save else None
    for folder in target.parents:
        if folder == mine or (folder / META).is_file() and folder.name.startswith("step-"):
            return folder
    parent = target.parent
    return parent if saves_in(parent) or (parent / LATEST).is_file() else None


#: The lock file of a checkpoint folder (:class:`FolderLock`), held by the run saving there.
LOCK = ".lock"


class FolderLock:
    """The exclusive lock of the checkpoint folder ``root`` (``root/.lock``, ``flock``: the
    system lets it go when its process ends, however it ends): one run at a time saves
    there. :meth:`acquire` creates ``root`` and takes the lock, or raises CheckpointError
    naming the process that holds it; :meth:`release` lets it go (the file stays: removing
    it would let two runs lock two files of one name)."""

    def __init__(self, root: str | Path):
        self.root, self._fd = Path(root), None

    def acquire(self) -> "FolderLock":
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(f"{self.root}: another run is saving to this folder ({holder} holds its lock "
                                  f"'{self.root / LOCK}')",
                                  notes=["wait until it ends, or give another folder"]) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor lets the flock go
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
