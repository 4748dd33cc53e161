"""What :func:`~dhelix.dsl.simulator.events.simulate` returns: each pipeline rank's figures
(:class:`RankStats`) and the step's (:class:`Simulation`), with its trace."""

from __future__ import annotations

import attrs

from dhelix.dsl.simulator.memory import ModelStates


@attrs.frozen(kw_only=True)
class RankStats:
    """What one pipeline rank did in the step (times in seconds, memory in bytes)."""

    rank: int
    busy: float
    pipeline_end: float
    end: float
    layer_comm: float
    layer_exposed: float
    pp_comm: float
    pp_exposed: float
    sends: int
    send_bytes: float
    dp_comm: float
    dp_exposed: float
    optimizer: float
    states: ModelStates
    activations: float
    activations_at: float

    @property
    def memory(self) -> float:
        """Peak memory: model states plus the peak of live activations."""
        return self.states.total + self.activations


@attrs.frozen
class Simulation:
    """The result of :func:`simulate`: per-rank figures, step figures and the trace."""

    label: str
    program: str
    pipeline: str
    fold: str
    shape: tuple[int, int, int]  # p, m, v
    si: bool
    zero1: bool
    ranks: tuple[RankStats, ...]
    tokens: float
    flops: float
    world: int
    peak_flops: float
    events: tuple = attrs.field(default=(), repr=False, eq=False)
    counters: tuple = attrs.field(default=(), repr=False, eq=False)
    #: ZeRO-3: the layers' weights and gradients are sharded over dp (FSDP).
    fsdp: bool = False
    #: ZeRO-1's weight all-gather runs under the next step's forward (param_gather = forward).
    gather_under_forward: bool = False
    #: Hybrid sharding: the size of ZeRO-3's shard groups (0: none).
    shard: int = 0
    #: The ZeRO stage (the train block's ``zero``, at least 1 with ``zero1``).
    zero: int = 0
    #: The percent of the optimizer's states in host memory (``train { offload }``; 0: none).
    offload: int = 0
    #: The shortest step the cores of a CPU host shared by more ranks than it has allow
    #: (:mod:`dhelix.dsl.simulator.host_cores`; 0: a core per rank, or not a CPU profile).
    cores_bound: float = 0.0

    @property
    def timeline_time(self) -> float:
        """Seconds from the first forward to the last rank's optimizer step, each rank on a core
        of its own."""
        return max(r.end for r in self.ranks)

    @property
    def step_time(self) -> float:
        """Seconds of the step: the ranks' timelines, at least what the host's shared cores
        allow (:attr:`cores_bound`)."""
        return max(self.timeline_time, self.cores_bound)

    @property
    def pipeline_time(self) -> float:
        """Seconds until the last pipeline action ends (before DP sync and optimizer)."""
        return max(r.pipeline_end for r in self.ranks)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the compute lanes during the pipeline: ``1 - Σ busy / (p · make-span)``."""
        total = len(self.ranks) * self.pipeline_time
        return 1.0 - sum(r.busy for r in self.ranks) / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens of the global batch per second of step time."""
        return self.tokens / self.step_time

    @property
    def tflops_per_gpu(self) -> float:
        """Megatron-counted TFLOP/s per GPU."""
        return self.flops / self.world / self.step_time / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: TFLOPS/GPU over the profile's peak for the model dtype."""
        return self.flops / self.world / self.step_time / self.peak_flops

    @property
    def peak_rank(self) -> RankStats:
        """The rank with the highest peak memory (the lowest such rank on a tie)."""
        return max(self.ranks, key=lambda r: (r.memory, -r.rank))

    def mean(self, field: str) -> float:
        """The average over pipeline ranks of a RankStats field."""
        return sum(getattr(r, field) for r in self.ranks) / len(self.ranks)
