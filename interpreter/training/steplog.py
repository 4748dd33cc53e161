"""The per-step JSONL log of a run (``dhelix run --log OUT.jsonl``), written by global rank 0.

One JSON object a line, flushed as it is written so that a run stopped midway keeps the
lines of the steps it finished:

* a step: ``{"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "exposed_comm_s",
  "peak_bytes"}`` — ``step`` 1-based (the number of updates done), ``exposed_comm_s`` the
  time rank 0 was blocked on collectives and pipeline receives during the step,
  ``peak_bytes`` rank 0's peak (the CUDA allocator's on a GPU, else the live activations the
  executor tracks);
* an evaluation: ``{"step", "eval_loss", "eval_ppl"}`` (perplexity = exp(loss)).

The file is strict JSON: a value that is not a finite number is written ``null`` and the
line gains ``"nonfinite": {"grad_norm": "inf"}`` (what it was). A line that cannot be written
(a full disk) stops the run with an OutputError naming the log.

Every line is a step or an evaluation: no metadata rows (a table reader such as
``pandas.read_json(lines=True)`` gets one column per figure). When ``tensorboard`` is
installed the same scalars also go to a TensorBoard event folder beside the log
(``OUT.tb/``); without it ``dhelix run``'s last lines say so.

A log that already holds lines is continued by a resumed run and refused otherwise
(:func:`refuse_earlier_log`): an earlier run's log is never truncated nor mixed with another's.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from dhelix.dsl.core.errors import OutputError
from dhelix.dsl.core.outputfile import write_text_atomically


def strict(record: dict) -> dict:
    """``record`` as strict JSON can hold it: a value that is not a finite number (NaN,
    infinity) becomes null, and ``nonfinite`` lists those keys with what they were
    (``{"grad_norm": "inf"}``)."""
    bad = {key: str(value) for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)}
    if not bad:
        return record
    return {**{key: None if key in bad else value for key, value in record.items()}, "nonfinite": bad}


def _step_of(line: str) -> int | None:
    """The ``step`` of a log line; None for a line without one (or not JSON)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def refuse_earlier_log(path: str | Path, continuing: bool) -> None:
    """UsageError when the log ``path`` already holds lines and the run does not continue
    (``continuing``: ``--resume``, ``auto`` included) the run that wrote them: an earlier
    run's log is never truncated (nor appended to, which would mix two runs' steps). An empty
    file, a device or a pipe is written as it is."""
    from dhelix.dsl.core.errors import UsageError

    target = Path(path)
    if continuing or not target.is_file() or target.stat().st_size == 0:
        return
    raise UsageError(f"{path}: the file holds an earlier run's log ({target.stat().st_size} bytes), which this "
                     "run would replace; it is refused, not overwritten nor appended to",
                     notes=["give another file, remove this one, or resume that run (its log is then continued)"])


class StepLog:
    """A JSONL log at ``path`` (None: record nothing, e.g. on ranks other than 0);
    ``tokens`` is the number of tokens of one global batch (for tokens/s). ``resumed``: the
    run continues after that many steps, so its log continues too: the lines already there
    are kept but those of later steps (a run that went on past its last save before it
    stopped), which the resumed run writes again."""

    def __init__(self, path: str | None, tokens: int, resumed: int | None = None):
        self.path, self.tokens, self.resumed = path, tokens, resumed
        self._file = None
        self._board = None
        self.lines = 0

    def __enter__(self) -> "StepLog":
        if self.path is not None:
            try:
                if self.resumed is not None:
                    self._keep_through(self.resumed)
                self._file = open(self.path, "w" if self.resumed is None else "a", encoding="utf-8")
            except OSError as exc:
                raise self._failure(exc) from None
            self._board = self._tensorboard()
        return self

    def _keep_through(self, step: int) -> None:
        """Drop the log's lines of steps after ``step`` (1-based, as logged), in place."""
        path = Path(self.path)
        if not path.is_file():
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                if _step_of(line) is None or _step_of(line) <= step]
        write_text_atomically(path, "".join(kept), what="the log")

    def _failure(self, exc: OSError) -> OutputError:
        return OutputError(f"cannot write the log '{self.path}': {exc.strerror or exc}",
                           notes=[f"the run stopped there; the log holds the lines written before "
                                  f"({self.lines} line(s) this run)"])

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # what did not fit was reported as it was written
                self._file.close()
        if self._board is not None:
            self._board.close()

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package; the command says so
            return None
        return SummaryWriter(str(Path(self.path).with_suffix(".tb")))

    def _write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(strict(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as exc:
            raise self._failure(exc) from None
        self.lines += 1

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, times: dict,
             peak_bytes: int, skipped: bool = False) -> dict:
        """Record step ``step`` (0-based; logged 1-based) from the last entries of ``times``
        (the training loop's per-step times); ``skipped``: its update was not applied (a
        non-finite step), said by ``"skipped": true``. Returns the record."""
        seconds = times["step"][-1]
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_s": seconds,
                  "tokens_per_s": self.tokens / seconds if seconds > 0 else 0.0,
                  "exposed_comm_s": times["collective"][-1] + times["p2p"][-1], "peak_bytes": peak_bytes,
                  **({"skipped": True} if skipped else {})}
        if self._file is not None:
            self._write(record)
            self._scalars(step + 1, {k: v for k, v in record.items()
                                     if k not in ("step", "skipped") and v is not None and math.isfinite(v)})
        return record

    def evaluation(self, step: int, loss: float) -> None:
        """Record the held-out loss after step ``step`` (0-based) and its perplexity."""
        record = {"step": step + 1, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 80.0))}
        if self._file is not None:
            self._write(record)
            self._scalars(step + 1, {k: v for k, v in record.items() if k != "step" and math.isfinite(v)})

    def _scalars(self, step: int, values: dict) -> None:
        if self._board is not None:
            for key, value in values.items():
                self._board.add_scalar(key, value, step)
