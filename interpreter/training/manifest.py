"""The saves of a checkpoint folder and their manifests (no torch: ``dhelix checkpoint verify``).

A save folder (``DIR/step-000010``) ends with ``manifest.json``: every other file's size and
SHA-256, written last (to a temporary file made durable, then renamed over the manifest) and
before the folder is renamed into place. :func:`verify` checks a save against it and names
the first file that is missing, of another size or of other bytes (:class:`CheckpointDamaged`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dhelix.dsl.core.errors import DhelixError, DhelixWarning
from dhelix.dsl.core.outputfile import write_text_atomically

MANIFEST = "manifest.json"
#: The save's own metadata (step, seed, shapes), written by :mod:`.checkpoint`.
META = "dhelix.json"
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


def beyond_kept(root: Path, keep: int) -> list[Path]:
    """The saves of ``root`` that keeping the ``keep`` newest intact ones removes: those older
    than the ``keep``-th newest save whose files are all there at their sizes (hashes are not
    read: this runs after every save). A damaged save is not counted, so it never pushes out
    an intact one; one newer than the kept intact saves stays for its owner to look at."""
    intact, removed = 0, []
    for folder in reversed(saves_in(root)):
        if intact >= keep:
            removed.append(folder)
            continue
        try:
            verify(folder, hashes=False)
        except CheckpointDamaged:
            continue
        intact += 1
    return removed[::-1]
