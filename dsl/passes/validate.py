"""Validation of a lowered schedule before anything runs; every problem is reported at once.

Checks, in order (the dry run only when the others pass, since a broken schedule would just
look stuck):

1. ranges: micro-batches in ``0..m-1`` (under fold bidir in the stage's model copy's share),
   chunks in ``0..v-1``, transfer peers are other ranks;
2. counts: every micro-batch runs exactly one F and one B on every stage, and one W when the
   schedule splits its backward (has any W);
3. order and inputs, per rank: B after its own F, W after its B; an F whose previous stage is
   on another rank comes after a RECV of that activation (on the same rank: after that F);
   a B likewise after the gradient of the next stage; a SEND after the action producing it
   and addressed to the rank of the stage that consumes it;
4. transfers: each SEND has exactly one matching RECV on its peer and vice versa;
5. deadlock: a dry run steps all ranks. Sends are eager (buffered without bound, like
   ``isend``); a RECV blocks until its SEND has run. The dry run succeeds when every rank
   reaches its end; otherwise the ranks wait for each other in a cycle.

Each error is a :class:`ScheduleError` naming the rank, step (0-based index in the rank's
list), micro-batch and chunk, with the rank × step grid (failing step marked ``>…<``) and a
note on what to do.
"""

from __future__ import annotations

from collections import defaultdict, deque

from dhelix.dsl.core.errors import ErrorCollector, ScheduleError
from dhelix.dsl.core.schedule import Compute, Interleaved, Lowered, Transfer, format_grid
from dhelix.dsl.core.wording import join_words

#: At most this many errors are shown; a last one says how many more there were.
MAX_ERRORS = 20


def validate_lowered(lowered: Lowered) -> None:
    """Raise ScheduleError (or an ErrorGroup) if ``lowered`` cannot run; return None if it can."""
    checker = _Checker(lowered)
    checker.check_ranges()
    checker.check_counts()
    checker.check_order()
    checker.check_matching()
    if not checker.errors:
        dry_run(lowered)
    checker.raise_if_any()


def transfer_key(lowered: Lowered, rank: int, transfer: Transfer) -> tuple | None:
    """What a SEND/RECV carries: (data, micro-batch, producing stage); None if off the placement.

    A SEND and a RECV match when their keys are equal.
    """
    return _key(lowered.stage_index, rank, transfer)


def _key(stage_index: dict[tuple[int, int], int], rank: int, transfer: Transfer) -> tuple | None:
    """:func:`transfer_key` with the schedule's stage index (slot -> stage) at hand."""
    stage = stage_index.get((rank, transfer.chunk))
    if stage is None:
        return None
    if transfer.kind == "RECV":
        stage += -1 if transfer.data == "F" else 1
    return (transfer.data, transfer.microbatch, stage)


def check_fifo(lowered: Lowered) -> list[str]:
    """The pairs of ranks whose sends and receives come in different orders (empty: none).

    Each problem names the sender, the receiver and the first position that differs. A
    backend that matches point-to-point messages in posting order needs an empty list.
    """
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for rank, row in enumerate(lowered.actions):
        for action in row:
            if isinstance(action, Transfer):
                pair = (rank, action.peer) if action.kind == "SEND" else (action.peer, rank)
                book = sent if action.kind == "SEND" else received
                book[pair].append((transfer_key(lowered, rank, action), str(action)))
    problems = []
    for pair in sorted(set(sent) | set(received)):
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        for position, (send, recv) in enumerate(zip(sends, recvs)):
            if send[0] != recv[0]:
                problems.append(f"rank {pair[0]} sends {send[1]} as message {position} to rank "
                                f"{pair[1]}, which receives {recv[1]} there")
                break
    return problems


def dry_run(lowered: Lowered) -> list[tuple[int, int]]:
    """Step every rank with eager sends and blocking receives; return the (rank, step) order.

    Each action appears after everything it waits for, so the order is a valid execution.
    Raises ScheduleError naming the cycle of waiting ranks if some rank never finishes.
    """
    rows = lowered.actions
    stage_index = lowered.stage_index
    position = [0] * lowered.ranks
    sent: set = set()
    waiting: dict = {}
    ready = deque(range(lowered.ranks))
    order: list[tuple[int, int]] = []
    while ready:
        rank = ready.popleft()
        while position[rank] < len(rows[rank]):
            action = rows[rank][position[rank]]
            if isinstance(action, Transfer):
                key = _key(stage_index, rank, action)
                if action.kind == "RECV" and key not in sent:
                    waiting[key] = rank
                    break
                if action.kind == "SEND":
                    sent.add(key)
                    if key in waiting:
                        ready.append(waiting.pop(key))
            order.append((rank, position[rank]))
            position[rank] += 1
    if any(position[rank] < len(rows[rank]) for rank in range(lowered.ranks)):
        raise _deadlock(lowered, position)
    return order


def _deadlock(lowered: Lowered, position: list[int]) -> ScheduleError:
    """The error for a stuck dry run: follow who waits for whom from the first stuck rank."""
    rows = lowered.actions
    stuck = {rank: position[rank] for rank in range(lowered.ranks)
             if position[rank] < len(rows[rank])}
    senders = {transfer_key(lowered, rank, action): (rank, step)
               for rank, row in enumerate(rows) for step, action in enumerate(row)
               if isinstance(action, Transfer) and action.kind == "SEND"}
    rank = min(stuck)
    recv = rows[rank][stuck[rank]]
    assert isinstance(recv, Transfer), "only a RECV blocks"
    message = (f"deadlock: rank {rank}, step {stuck[rank]} waits in {recv} (micro-batch "
               f"{recv.microbatch}, chunk {recv.chunk}) and never gets it")
    notes, seen = [], [rank]
    while True:
        recv = rows[rank][stuck[rank]]
        assert isinstance(recv, Transfer), "only a RECV blocks"
        sender = senders.get(transfer_key(lowered, rank, recv))
        if sender is None:
            notes.append(f"no rank sends what rank {rank} waits for in {recv}")
            break
        peer, step = sender
        blocked = rows[peer][stuck[peer]]
        notes.append(f"rank {peer} sends that in {rows[peer][step]} at step {step}, but first "
                     f"waits at step {stuck[peer]} in {blocked}")
        if peer in seen:
            cycle = " → ".join(map(str, seen[seen.index(peer):] + [peer]))
            notes.append(f"so ranks {cycle} wait for each other in a cycle")
            break
        seen.append(peer)
        rank = peer
    notes.append("reorder so that each rank sends what its peer needs before it waits for "
                 "what that peer sends later: e.g. move the producing action (and its SEND) "
                 "earlier, or the consuming action (and its RECV) later")
    first = min(stuck)
    return ScheduleError(message, rows[first][stuck[first]].span, notes,
                         grid=format_grid(lowered, stuck))


class _Checker:
    """Runs checks 1–4 over one lowered schedule and collects their errors."""

    def __init__(self, lowered: Lowered):
        self.lowered = lowered
        self.errors: list[ScheduleError] = []
        self.bad: set[tuple[int, int]] = set()  # (rank, step) of actions failing check 1
        # (kind, micro-batch, chunk) → steps, per rank: where each computation runs.
        self.steps: list[defaultdict[tuple[str, int, int], list[int]]] = [
            defaultdict(list) for _ in range(lowered.ranks)]

    def error(self, message: str, rank: int | None, step: int | None, notes=(),
              span=None) -> None:
        marks = {} if rank is None or step is None else {rank: step}
        if span is None and rank is not None and step is not None:
            span = self.lowered.actions[rank][step].span
        if span is None:  # a whole-schedule problem: point at the pipeline's name
            span = self.lowered.span
        self.errors.append(ScheduleError(message, span, notes,
                                         grid=format_grid(self.lowered, marks)))

    def raise_if_any(self) -> None:
        """Raise the first MAX_ERRORS errors (and a count of the rest), if any."""
        collector = ErrorCollector()
        shown = self.errors[:MAX_ERRORS]
        hidden = len(self.errors) - len(shown)
        if hidden:  # said in a note of the last shown error, so every error keeps a location
            last = shown[-1]
            shown[-1] = ScheduleError(last.message, last.span, last.notes + (
                f"{hidden} more schedule errors are not shown; fix these first",), grid=last.grid)
        for error in shown:
            collector.add(error)
        collector.raise_if_any()

    # --- 1. ranges ----------------------------------------------------------------------
    def check_ranges(self) -> None:
        """Micro-batches, chunks and peers in range; failing actions are left out of 2–4.
        An action plainly in range (its stage's micro-batches, a chunk of this rank's, another
        rank) is taken without :meth:`range_problem`, which finds nothing wrong with it."""
        low = self.lowered
        m, v, ranks, stage_index = low.microbatches, low.chunks, low.ranks, low.stage_index
        shares = [(share.start, share.stop) for share in map(low.microbatches_of, range(len(low.stages)))]
        for rank, row in enumerate(low.actions):
            steps = self.steps[rank]
            for step, action in enumerate(row):
                parts: tuple[Compute | Transfer, ...] = action.parts if isinstance(action, Interleaved) else (action,)
                fine = True
                for part in parts:
                    if isinstance(part, Transfer):
                        if part.microbatch < m and part.chunk < v and 0 <= part.peer < ranks and part.peer != rank:
                            continue
                    else:
                        stage = stage_index.get((rank, part.chunk))
                        if stage is not None and part.microbatch < m and part.chunk < v \
                                and shares[stage][0] <= part.microbatch < shares[stage][1]:
                            continue
                    problem = self.range_problem(rank, part)
                    if problem:
                        fine = False
                        self.bad.add((rank, step))
                        self.error(f"rank {rank}, step {step}: {part} {problem[0]}", rank, step,
                                   [problem[1]])
                if fine and not isinstance(action, Transfer):
                    for part in parts:
                        steps[(part.kind, part.microbatch, part.chunk)].append(step)

    def range_problem(self, rank: int, part) -> tuple[str, str] | None:
        """(what is wrong, what to do) for an out-of-range action, or None."""
        low = self.lowered
        if part.microbatch >= low.microbatches:
            return (f"runs micro-batch {part.microbatch}, but m = {low.microbatches} "
                    f"({_allowed(low.microbatches, 'micro-batch', 'micro-batches')})",
                    "each rank runs micro-batches 0..m-1 of every chunk once; remove the extra "
                    "action")
        if part.chunk >= low.chunks:
            return (f"uses chunk {part.chunk}, but v = {low.chunks} "
                    f"({_allowed(low.chunks, 'chunk', 'chunks')})",
                    "fold none gives v = 1 chunk per rank, fold u and fold bidir 2, fold loop(v) v")
        stage = low.stage_of(rank, part.chunk)
        share = low.microbatches_of(stage) if stage is not None else range(low.microbatches)
        if stage is not None and not isinstance(part, Transfer) and part.microbatch not in share:
            return (f"runs micro-batch {part.microbatch} on stage {stage} of model copy "
                    f"{low.copy_of(stage)}, which runs micro-batches "
                    f"{share.start}..{share.stop - 1}",
                    f"the {low.copies} model copies share the m micro-batches: copy c runs "
                    f"c·m/{low.copies} .. (c+1)·m/{low.copies} - 1")
        if isinstance(part, Transfer) and (part.peer >= low.ranks or part.peer == rank):
            return (f"names rank {part.peer}, which is not another rank of the pipeline "
                    f"(p = {low.ranks})", "a transfer goes to another rank 0..p-1")
        return None

    # --- 2. counts ----------------------------------------------------------------------
    def check_counts(self) -> None:
        """One F and one B (and one W when split) per micro-batch and stage."""
        low = self.lowered
        kinds = ("F", "B", "W") if low.split else ("F", "B")
        for stage, (rank, chunk) in enumerate(low.stages):
            steps = self.steps[rank]
            for kind in kinds:
                missing = [mb for mb in low.microbatches_of(stage)
                           if not steps.get((kind, mb, chunk))]
                if missing:
                    self.error(f"{_microbatches(missing)} never run{'s' if len(missing) == 1 else ''}"
                               f" {kind} on stage {stage} (rank {rank}, chunk {chunk})",
                               None, None, [self.count_note(kind)])
                for mb in low.microbatches_of(stage):
                    for again in steps.get((kind, mb, chunk), [])[1:]:
                        first = steps[(kind, mb, chunk)][0]
                        self.error(f"rank {rank}, step {again}: {kind}{mb}.{chunk} (micro-batch "
                                   f"{mb}, chunk {chunk}) runs again; it already ran at step "
                                   f"{first}", rank, again,
                                   ["every micro-batch runs each of F, B (and W) once per stage; "
                                    "remove one of them"])

    def count_note(self, kind: str) -> str:
        if kind == "W":
            return ("this schedule splits the backward (it has W actions), so every B needs "
                    "its W: add the missing Ws, or drop all of them for a full backward")
        return "every micro-batch runs one F and one B on every stage"

    # --- 3. order and inputs ----------------------------------------------------------
    def check_order(self) -> None:
        """Walk each rank in order: what every action needs must already be there. An action
        whose needs are plainly there is taken without :meth:`check_compute` or
        :meth:`check_transfer`, which find nothing wrong with it."""
        low = self.lowered
        stage_index, stages, bad = low.stage_index, low.stages, self.bad
        # (rank, chunk, kind) -> the slot whose F or B feeds it: None for the ends of a copy.
        sources: dict[tuple[int, int, str], tuple[int, int] | None] = {}
        for (rank, chunk), stage in stage_index.items():
            for kind, step in (("F", -1), ("B", 1)):
                source = low.neighbour(stage, step)
                sources[rank, chunk, kind] = None if source is None else stages[source]
        for rank, row in enumerate(low.actions):
            done: set = set()
            received: set = set()
            for step, action in enumerate(row):
                if bad and (rank, step) in bad:
                    continue
                if isinstance(action, Transfer):
                    if action.kind == "RECV":
                        received.add((action.data, action.microbatch, action.chunk))
                    elif (action.data, action.microbatch, action.chunk) not in done:
                        self.check_transfer(rank, step, action, done, received)
                        continue
                    stage = stage_index[rank, action.chunk]
                    other = low.neighbour(stage, 1 if (action.data == "F") == (action.kind == "SEND") else -1)
                    if other is None or stages[other][0] != action.peer:
                        self.check_transfer(rank, step, action, done, received)
                    continue
                computed = action.parts if isinstance(action, Interleaved) else (action,)
                for part in computed:
                    if not self._plainly_ready(rank, part, done, received, sources):
                        self.check_compute(rank, step, action, part, done, received)
                done.update((part.kind, part.microbatch, part.chunk) for part in computed)

    @staticmethod
    def _plainly_ready(rank: int, part: Compute, done: set, received: set, sources: dict) -> bool:
        """Whether what ``part`` needs is there (its own F or B, and its input from the stage
        before, or after for a B), so that :meth:`check_compute` would find nothing wrong."""
        mb, chunk, kind = part.microbatch, part.chunk, part.kind
        if kind == "W":
            return ("B", mb, chunk) in done
        if kind == "B" and ("F", mb, chunk) not in done:
            return False
        source = sources[rank, chunk, kind]
        if source is None:
            return True
        peer, peer_chunk = source
        return (kind, mb, peer_chunk) in done if peer == rank else (kind, mb, chunk) in received

    def check_compute(self, rank, step, action, part: Compute, done, received) -> None:
        low = self.lowered
        mb, chunk = part.microbatch, part.chunk
        stage = low.stage_of(rank, chunk)
        assert stage is not None, "check 1 set aside the actions off the placement"
        own = {"B": "F", "W": "B"}.get(part.kind)
        if own and (own, mb, chunk) not in done:
            self.order_problem(rank, step, action, part, Compute(own, mb, chunk))
            return
        if part.kind == "W":
            return
        source = low.neighbour(stage, -1 if part.kind == "F" else 1)
        if source is None:
            return  # the first forward reads the batch; the last backward starts at the loss
        peer, peer_chunk = low.stages[source]
        if peer == rank:
            if (part.kind, mb, peer_chunk) not in done:
                self.order_problem(rank, step, action, part, Compute(part.kind, mb, peer_chunk))
        elif (part.kind, mb, chunk) not in received:
            what = "activation" if part.kind == "F" else "gradient"
            send = Transfer("SEND", part.kind, mb, peer_chunk, rank)
            recv = Transfer("RECV", part.kind, mb, chunk, peer)
            self.error(f"rank {rank}, step {step}: {part} (micro-batch {mb}, chunk {chunk}) has "
                       f"no input: stage {stage} needs the {what} of stage {source} from rank "
                       f"{peer}, and no {recv} comes before it", rank, step,
                       [f"put {recv} just before {part}, and {send} right after "
                        f"{part.kind}{mb}.{peer_chunk} on rank {peer}"])

    def order_problem(self, rank, step, action, part: Compute, needed: Compute) -> None:
        key = (needed.kind, needed.microbatch, needed.chunk)
        later = self.steps[rank].get(key)
        if not later:
            return  # it never runs on this rank: check 2 reports it
        if later[0] == step and isinstance(action, Interleaved):
            self.error(f"rank {rank}, step {step}: {part} runs in the same SI block as {needed}, "
                       f"which it depends on", rank, step,
                       ["an SI block pairs two independent strands; run them one after the other"])
            return
        self.error(f"rank {rank}, step {step}: {part} (micro-batch {part.microbatch}, chunk "
                   f"{part.chunk}) runs before {needed} (step {later[0]}), which it depends on",
                   rank, step, [f"move {part} after {needed}"])

    def check_transfer(self, rank, step, action: Transfer, done, received) -> None:
        low = self.lowered
        mb, chunk = action.microbatch, action.chunk
        if action.kind == "RECV":
            received.add((action.data, mb, chunk))
        elif (action.data, mb, chunk) not in done:
            producer = Compute(action.data, mb, chunk)
            later = self.steps[rank].get((action.data, mb, chunk))
            if later:
                self.error(f"rank {rank}, step {step}: {action} comes before {producer} (step "
                           f"{later[0]}), which produces what it sends", rank, step,
                           [f"move {action} right after {producer}"])
        stage = low.stage_of(rank, chunk)
        assert stage is not None, "check 1 set aside the actions off the placement"
        forward = action.data == "F"
        step_to = 1 if forward == (action.kind == "SEND") else -1
        other = low.neighbour(stage, step_to)
        if other is None:
            self.bad.add((rank, step))
            end = "last" if step_to > 0 else "first"
            self.error(f"rank {rank}, step {step}: {action} has no peer stage: stage {stage} is "
                       f"the {end} stage", rank, step, [f"remove {action}"])
        elif low.stages[other][0] != action.peer:
            self.bad.add((rank, step))
            actual = low.stages[other][0]
            fix = ("the hand-off stays on this rank: remove it" if actual == rank
                   else f"address it to rank {actual}")
            self.error(f"rank {rank}, step {step}: {action} names rank {action.peer}, but stage "
                       f"{other} (micro-batch {mb}'s {'next' if other > stage else 'previous'} "
                       f"stage) is on rank {actual}", rank, step, [fix])

    # --- 4. matching --------------------------------------------------------------------
    def check_matching(self) -> None:
        """Each SEND has exactly one RECV with the same key, and vice versa."""
        low = self.lowered
        places: dict[str, defaultdict[tuple | None, list[tuple[int, int]]]] = {
            "SEND": defaultdict(list), "RECV": defaultdict(list)}
        stage_index, bad = low.stage_index, self.bad
        for rank, row in enumerate(low.actions):
            for step, action in enumerate(row):
                if isinstance(action, Transfer) and not (bad and (rank, step) in bad):
                    places[action.kind][_key(stage_index, rank, action)].append((rank, step))
        for kind, other in (("SEND", "RECV"), ("RECV", "SEND")):
            for key, where in places[kind].items():
                for rank, step in where[1:]:
                    self.error(f"rank {rank}, step {step}: {low.actions[rank][step]} runs again; "
                               f"it already ran at step {where[0][1]}", rank, step,
                               ["each activation and gradient crosses once; remove one"])
                if key not in places[other]:
                    self.unmatched(*where[0])

    def unmatched(self, rank: int, step: int) -> None:
        low = self.lowered
        action = low.actions[rank][step]
        assert isinstance(action, Transfer), "only transfers match"
        key = transfer_key(low, rank, action)
        assert key is not None, "check 1 set aside the transfers off the placement"
        data, mb, producer = key
        consumer = producer + (1 if data == "F" else -1)
        if action.kind == "SEND":
            peer_chunk = low.stages[consumer][1]
            twin = Transfer("RECV", data, mb, peer_chunk, rank)
            fix = f"add {twin} on rank {action.peer} just before {data}{mb}.{peer_chunk}"
        else:
            peer_chunk = low.stages[producer][1]
            twin = Transfer("SEND", data, mb, peer_chunk, rank)
            fix = f"add {twin} on rank {action.peer} right after {data}{mb}.{peer_chunk}"
        self.error(f"rank {rank}, step {step}: {action} (micro-batch {mb}, chunk {action.chunk}) "
                   f"has no matching {twin} on rank {action.peer}", rank, step, [fix])


def _allowed(count: int, singular: str, plural: str) -> str:
    """'only chunk 0' or 'chunks 0..3'."""
    return f"only {singular} 0" if count == 1 else f"{plural} 0..{count - 1}"


def _microbatches(numbers: list[int]) -> str:
    """'micro-batch 3', 'micro-batches 0..7' or 'micro-batches 1, 4 and 6'."""
    if len(numbers) == 1:
        return f"micro-batch {numbers[0]}"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"micro-batches {numbers[0]}..{numbers[-1]}"
    return "micro-batches " + join_words(numbers)
