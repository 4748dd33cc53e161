"""The memory probe's running tally: the bytes of the distinct storages that a changing set of
holders (a step's layer runs in flight, the model ends' saved tensors) keep alive.

The probe samples after every layer (:meth:`~.recording.Recorder.memory`). Summing every
holder's storages afresh at each sample cost more than walking the tensors that had changed
(most runs in flight have not changed since the last sample: a run remembers its storages
until its next op, :meth:`~.layer_exec.LayerRun.storages`). :class:`LiveTally` keeps the sum
instead, with a count of the holders of each storage, and at a sample only takes out and puts
back the storages of the holders that changed: the same figure as the sum, exactly (a storage
that two holders share is counted once, as before).
"""

from __future__ import annotations

from typing import Mapping


class LiveTally:
    """The bytes of the distinct storages (data pointer → bytes) of a set of holders, kept
    up to date by :meth:`update`."""

    def __init__(self) -> None:
        #: What was counted for each holder (its key → the storages as it gave them).
        self._counted: dict[object, Mapping[int, int]] = {}
        #: Per storage counted, the holders counting it and its bytes.
        self._holders: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.total = 0

    def update(self, holders: Mapping[object, Mapping[int, int]]) -> int:
        """The bytes of the distinct storages of ``holders`` (key → its storages now), which
        replace those of the last call. A holder's storages are recounted only when they are
        not the very mapping counted last time: a holder gives the same object while nothing
        it holds has changed, a new one otherwise (never one it gave before and changed in
        place). Returns :attr:`total`."""
        counted = self._counted
        changed = []
        found = 0  # the holders counted last time too
        for key, storages in holders.items():
            old = counted.get(key)
            if old is not None:
                found += 1
                if old is storages:
                    continue
            changed.append((key, old, storages))
        gone = [] if found == len(counted) else [key for key in counted if key not in holders]
        # Every storage given up first, then every one taken: a data pointer freed by one
        # holder and reused by another's new storage since the last call is recounted right.
        for key in gone:
            self._drop(counted.pop(key))
        for _, old, _ in changed:
            if old is not None:
                self._drop(old)
        for key, _, storages in changed:
            self._take(storages)
            counted[key] = storages
        return self.total

    def _drop(self, storages: Mapping[int, int]) -> None:
        holders, sizes = self._holders, self._bytes
        for ptr in storages:
            left = holders[ptr] - 1
            if left:
                holders[ptr] = left
            else:
                del holders[ptr]
                self.total -= sizes.pop(ptr)

    def _take(self, storages: Mapping[int, int]) -> None:
        holders, sizes = self._holders, self._bytes
        for ptr, nbytes in storages.items():
            count = holders.get(ptr)
            if count:
                holders[ptr] = count + 1
            else:
                holders[ptr] = 1
                sizes[ptr] = nbytes
                self.total += nbytes
