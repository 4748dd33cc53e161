"""The timed communicator (interpreter/execute/recording.py) keeps the real one's interface:
every public collective of Communicator is overridden with the same signature, so a
collective added to the interface cannot run untimed (or with another argument order)."""

from __future__ import annotations

import inspect

from dhelix.interpreter.execute.recording import TimedComm
from dhelix.interpreter.ops.comm import Communicator


def _public_methods(cls) -> dict:
    return {name: member for name, member in vars(cls).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def test_every_public_method_of_the_communicator_is_timed_with_its_signature():
    interface = _public_methods(Communicator)
    timed = {name: getattr(TimedComm, name) for name in interface}
    assert interface, "Communicator lists no public methods"
    for name, method in interface.items():
        assert timed[name] is not method or name in _PASSED_THROUGH, f"TimedComm does not override {name}"
        assert _shape(timed[name]) == _shape(method), name


def _shape(method) -> list:
    """A method's parameters: names, kinds and defaults (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


#: Interface methods that only read the mesh (sizes, indices, lanes): nothing to time.
_PASSED_THROUGH = {"size", "index", "peer", "group_ranks"}
