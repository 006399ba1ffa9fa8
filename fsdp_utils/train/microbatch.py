"""`train.micro_batch_size: auto` and `fsdp.activation_checkpointing: auto`: trial training steps measure the
peak GPU memory of candidate micro-batches (and checkpointing policies), the largest (or fastest) that fits
trains, and the choice is cached in the output directory. docs/fsdp.md describes the search."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import reprlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from config import Config, ConfigError
from safe_io import nofollow
from safe_io.journal import Journal
from safe_io.nofollow import replace_file

from ..distributed import DistEnv, broadcast_decision
from ..parallel.fsdp import FSDPAdapter
from ..parallel.parallelize import CheckpointPolicy, CheckpointSwitch, auto_policies
from .batch import divisors
from .memory import GiB, MemoryProbe, gib, max_over_ranks
from .oom_guard import OutOfMemory
from .planning import Cluster, config_estimates, gpu_for_device
from .planning.points import MEMORY_TOLERANCE
from .step import train_step

log = logging.getLogger(__name__)

CACHE_FILE = "microbatch_cache.json"
CACHE_LIMIT = 16 << 20  # bytes: far more than any cache holds (an entry is about 1 KiB)
# What a warning shows of a value read from the cache: a few items and characters, however large or deep it is.
_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel, _EXCERPT.maxdict, _EXCERPT.maxlist, _EXCERPT.maxstring, _EXCERPT.maxother = 2, 3, 3, 30, 30
TRIAL_GRAPHS = 64  # compiled graphs per block the search may keep: one per policy, micro-batch and block kind


# ---- the search ----------------------------------------------------------------------------------


@dataclasses.dataclass
class MicroBatchChoice:
    micro_batch_size: int
    how: str  # configured, cpu, search or cache
    measured_gib: dict[int, float] = dataclasses.field(default_factory=dict)  # micro-batch -> peak GiB, max over ranks
    capacity_gib: float = 0.0
    budget_gib: float = 0.0
    seconds: float = 0.0
    # fsdp.activation_checkpointing=auto: the chosen policy's name (CheckpointPolicy.name), what each policy
    # tried measured ({policy: {micro-batch: GiB}}) and the tokens/s per rank of the pairs that were timed.
    checkpointing: str | None = None
    tried_gib: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    tokens_per_s: dict[str, float] = dataclasses.field(default_factory=dict)  # "policy@micro-batch" -> tokens/s
    untried: list[str] = dataclasses.field(default_factory=list)  # policies left out after a slower pair
    cached_on: str | None = None  # how == "cache": the date of the cache entry
    # With the estimate (_Ranking): the pair it put first, the pairs it skipped (predicted over the budget by more
    # than its error), and in `untried` the pairs left out once none could beat the fastest measured.
    estimated_first: str | None = None
    skipped: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Predicted:
    """The estimate (fsdp_utils/train/planning/) of a pair of policy and micro-batch: its reserved peak (GiB) and
    tokens/s per GPU."""
    gib: float
    tokens_per_s: float

    def within(self, budget: float, error: float = 0.0) -> bool:
        """Whether the predicted peak is at most `budget` bytes, raised by `error` (a share of it)."""
        return self.gib * GiB <= budget * (1 + error)


# How far the estimate may be off, as the search allows for it. Memory: the largest error tests/test_plan.py allows
# over every measured point (planning.points.MEMORY_TOLERANCE). Speed: the error of the ratio of two pairs' tokens/s
# (the search compares pairs of one run, so an error common to both cancels): 10%, over 3/4 of the pairs the
# records' searches timed (docs/planning.md).
MEMORY_ERROR = MEMORY_TOLERANCE
SPEED_ERROR = 0.10


def climb(candidates: list[int], *, budget: float, resident: float, measure: Callable[[int], float],
          fit: list[int] | None = None, one_point_jump: int | None = None) -> tuple[int | None, dict[int, float]]:
    """(largest candidate whose measured peak fits the budget or None, {size: measured peak}).

    Measures the smallest candidate, then the largest one whose predicted peak fits, and so on from there
    (docs/fsdp.md); `measure(b)` runs a trial step at micro-batch b and returns its peak. With
    one measurement the prediction is the bound (everything above `resident` grows with the micro-batch);
    with two it is their line, whose slope is the activations' alone (the step's fixed buffers cancel out).
    `fit`: sizes safe to run (a policy that keeps more fit them, or ran them), largest first. The first
    measurement is at fit[0] instead of the smallest candidate, so no larger candidate runs before it is
    predicted to fit, and fit[1] gives the second point when the bound from fit[0] allows no candidate.
    `one_point_jump`: from one measurement, no size over this many times the measured one (for a `resident`
    that is an estimate, not a bound)."""
    measured: dict[int, float] = {}
    best, size = None, (fit[0] if fit else candidates[0])
    while True:
        peak = measured[size] = measure(size)
        if peak > budget:
            return best, measured
        best = size if size in candidates else None
        fitting = _predicted_fits(candidates, size, measured, budget=budget, resident=resident)
        if not fitting and fit and len(measured) == 1 and len(fit) > 1:
            measured[fit[1]] = measure(fit[1])
            fitting = _predicted_fits(candidates, size, measured, budget=budget, resident=resident)
        if one_point_jump and len(measured) == 1:
            fitting = [c for c in fitting if c <= size * one_point_jump]
        if not fitting:
            return best, measured
        size = fitting[-1]


def _predicted_fits(candidates: list[int], best: int, measured: dict[int, float], *, budget: float,
                    resident: float) -> list[int]:
    """The candidates above `best` whose predicted peak fits: from the two largest measurements that fit when
    there are two (and they rise), else from the bound of `best`'s."""
    return [c for c in candidates if c > best and _predicted_peak(c, best, measured, resident=resident) <= budget]


def _predicted_peak(size: int, best: int, measured: dict[int, float], *, resident: float) -> float:
    """The peak at `size` predicted from `best`'s measurement: the line through it and the largest smaller one
    that reads lower, else the bound (everything above `resident` grows with the micro-batch)."""
    peak = measured[best]
    slope = (peak - resident) / best if peak > resident else peak / best
    lower = [b for b in measured if b < best and measured[b] <= peak]
    if lower:
        a = max(lower)
        if measured[a] < peak:
            slope = (peak - measured[a]) / (best - a)
    return peak + slope * (size - best)


def _fixed_part(measured: dict[int, float], budget: float) -> float:
    """The part of a step's peak that does not grow with the micro-batch (states, gradient and loss buffers): where
    the line through the two largest measurements that fit meets micro-batch 0; 0 without two that rise. The same
    for every checkpointing policy (only the activations differ), so one measurement of a later policy gives its
    slope, where the bound from the resident states alone would climb in several steps."""
    fits = sorted(b for b, peak in measured.items() if peak <= budget)[-2:]
    if len(fits) < 2 or measured[fits[1]] <= measured[fits[0]]:
        return 0.0
    a, b = fits
    slope = (measured[b] - measured[a]) / (b - a)
    return measured[a] - slope * a


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """A float64 sum of each parameter's local shard: the trial steps must leave every one as it was."""
    with torch.no_grad():
        return torch.stack([_local(p).sum(dtype=torch.float64) for p in model.parameters()])


def _trial_compile_options(compile: bool) -> contextlib.AbstractContextManager:
    """Inductor fuses a norm's backward reductions (mix-order reduction) only where the rows are at least twice
    the columns, among other size tests. With the batch dimension dynamic those tests become guards, so a graph
    compiled at one micro-batch covers only the sizes on the same side of them, and a larger trial compiles once
    more. The trials skip the tests (what inductor's non-strict mode is for), so one dynamic graph per policy covers
    every larger size; the run's own graph compiles after the trials, with them, as training without the search
    would."""
    if not compile:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor

    if not hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):  # a torch without the fusion
        return contextlib.nullcontext()
    return inductor.patch({"triton.mix_order_reduction_non_strict_mode": True})


@contextlib.contextmanager
def _learning_rate_zero(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The trial steps run the whole optimizer step (its memory and time are a step's) at learning rate 0: AdamW
    multiplies both its update and its weight decay by it, so the weights stay as they were, bit for bit, with no
    host copy of them to restore (train_step skips a step whose gradients are not finite, the one case where 0
    times the update would not be 0)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate


def auto_label(*, auto_size: bool, auto_checkpointing: bool) -> str:
    """Which of the autos a search serves, as its log and error lines name it."""
    return " and ".join(name for name, on in (("train.micro_batch_size=auto", auto_size),
                                              ("fsdp.activation_checkpointing=auto", auto_checkpointing)) if on)


def pair_name(policy: CheckpointPolicy | None, micro_batch: int) -> str:
    """A timed pair of checkpointing policy and micro-batch, as the log and the cache name it: selective_op@16."""
    return f"{policy.name if policy else None}@{micro_batch}"


OP_LEVEL_ORDER = ("selective_op_wide", "selective_op", "selective_op_lean")  # each keeps what the next one does


def keeps_at_least(a: CheckpointPolicy | None, b: CheckpointPolicy | None) -> bool:
    """Whether policy `a` keeps at least what `b` keeps for backward in every block, so that `b` fits where `a` did.
    none keeps the most and full the least; among the op-level policies each keeps what the next in
    OP_LEVEL_ORDER does and more. Every n-th block's whole forward against the op-level policies depends on the
    model: no order. (selective_op_wide also keeps matmul outputs that plain autograd would not; in bf16 none's
    fp32 norm inputs outweigh them, and in fp32 the difference stays within train.auto_micro_batch_margin's
    default.)"""
    if a is None or b is None or a == b:
        return True
    if a.name == "none" or b.name == "full":
        return True
    return a.name in OP_LEVEL_ORDER and b.name in OP_LEVEL_ORDER and \
        OP_LEVEL_ORDER.index(a.name) <= OP_LEVEL_ORDER.index(b.name)


class _Trials:
    """The trial steps of one search: training steps (forward, backward, clipping, optimizer step) on random
    tokens from a private generator, at a micro-batch and, with a switch, an activation checkpointing policy."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, fsdp: FSDPAdapter, per_rank: int,
                 seq_len: int, vocab_size: int, grad_clip: float, compile: bool, env: DistEnv, probe: MemoryProbe,
                 switch: CheckpointSwitch | None):
        self.model, self.optimizer, self.fsdp = model, optimizer, fsdp
        self.env, self.probe, self.switch = env, probe, switch
        self.per_rank, self.seq_len, self.vocab_size, self.grad_clip, self.compile = (per_rank, seq_len, vocab_size,
                                                                                    grad_clip, compile)
        self.gen = torch.Generator(device=env.device).manual_seed(20_000 + env.rank)
        self.policy: CheckpointPolicy | None = None
        self.size = 0  # the micro-batch of the step running (for the out-of-memory message)
        self.warm_pair: str | None = None  # the pair (pair_name) whose whole step the last step was, as a memory trial

    @property
    def policy_name(self) -> str | None:
        return self.policy.name if self.policy else None

    def use(self, policy: CheckpointPolicy | None) -> None:
        """Compiled blocks guard on the switch's policy: a new one compiles its own graphs, and a policy used
        before (to time it after its memory trials) runs the graphs it compiled then."""
        self.policy = policy
        if self.switch is not None and policy is not None:
            self.switch.policy = policy

    def step(self, micro_batch: int, num_micro: int) -> None:
        self.size, self.warm_pair = micro_batch, None
        tokens = (torch.randint(0, self.vocab_size, (micro_batch, self.seq_len + 1), device=self.env.device,
                                generator=self.gen) for _ in range(num_micro))
        # The training step itself: its optimizer step runs the model converters' hooks (FP8 scales) too.
        train_step(self.model, self.optimizer, ((t[:, :-1], t[:, 1:]) for t in tokens), fsdp=self.fsdp,
                   grad_accum=num_micro, grad_clip=self.grad_clip, world_size=self.env.world_size)

    def measure(self, micro_batch: int) -> float:
        """The peak reserved memory of a step, max over the ranks. The accumulation this size would train with,
        up to two micro-batches: the second one's peak includes what the first left (its gradients, unsharded
        with fsdp.grad_sync=last_micro_batch)."""
        self.probe.begin(micro_batch, self.policy_name)
        num_micro = self.per_rank // micro_batch
        self.step(micro_batch, min(2, num_micro))
        if num_micro <= 2:  # the trial was the whole step: timing it needs no other warm-up
            self.warm_pair = pair_name(self.policy, micro_batch)
        return max_over_ranks(self.probe.peak_reserved(), self.env)

    def tokens_per_s(self, micro_batch: int) -> float:
        """Per rank, over one whole step (the accumulation of the per-rank batch), warmed up: right after this
        pair's memory trial where that trial was the whole step (two micro-batches or fewer), the trial was the
        warm-up; otherwise one step warms up first: a step timed right after a partial trial, or after other
        pairs, runs slow (benchmarks/records/ has the figures)."""
        num_micro = self.per_rank // micro_batch
        if self.warm_pair != pair_name(self.policy, micro_batch):
            self.probe.begin(micro_batch, self.policy_name)
            self.step(micro_batch, num_micro)
        return self.per_rank * self.seq_len / max_over_ranks(
            self.probe.time(lambda: self.step(micro_batch, num_micro), repeats=1), self.env)


def search_micro_batch(model: nn.Module, optimizer: torch.optim.Optimizer, *, fsdp: FSDPAdapter, per_rank: int,
                       seq_len: int, vocab_size: int, grad_clip: float, margin: float, compile: bool, env: DistEnv,
                       probe: MemoryProbe, micro_batch: int | None = None,
                       switch: CheckpointSwitch | None = None, every_n: int = 2,
                       predicted: dict[str, Predicted] | None = None) -> MicroBatchChoice:
    """The largest divisor of `per_rank` whose training step fits in memory with `margin` to spare, the same on
    every rank. With a `switch` (fsdp.activation_checkpointing=auto) for each policy of auto_policies in turn,
    then the fitting pair of policy and micro-batch whose full step (the accumulation of the per-rank batch)
    trains the most tokens/s; the switch is left at the chosen policy. With a `micro_batch` set by hand (and a
    switch), the first policy that fits it: the trials climb to it through its divisors, so that, as in the
    auto search, no size runs before it is known or predicted to fit but the smallest. Leaves the weights
    (the trials train at learning rate 0), the optimizer state and the RNGs as they were. With `predicted` (the
    estimate of every pair, by pair_name) and both autos, the pairs are measured in the estimate's order (_Ranking)."""
    candidates = divisors(micro_batch or per_rank)
    policies: list[CheckpointPolicy | None] = [None]
    if switch is not None:
        policies = list(auto_policies(every_n, roles_known=switch.roles_known))
    assert not optimizer.state, "search before the first optimizer step (or a resume): its state is cleared afterwards"
    start = time.perf_counter()
    weights = _fingerprint(model)
    capacity = -max_over_ranks(-probe.capacity(), env)
    budget = capacity * (1 - margin)
    trials = _Trials(model, optimizer, fsdp=fsdp, per_rank=per_rank, seq_len=seq_len, vocab_size=vocab_size,
                     grad_clip=grad_clip, compile=compile, env=env, probe=probe, switch=switch)
    label = auto_label(auto_size=micro_batch is None, auto_checkpointing=switch is not None)

    def nothing_fits(size: int, measured: dict[int, float]) -> OutOfMemory:
        """Nothing fits `size` (auto: the smallest, measured; by hand: the size set, measured or predicted)."""
        what = "with full activation checkpointing, " if switch is not None else ""
        if size in measured:
            figure = f"{'even ' if micro_batch is None else ''}micro-batch {size} peaks at {gib(measured[size])} GiB"
        else:  # the size set by hand, never run: the trials below it put it over the budget
            below = max(measured)
            peak = measured[below] if measured[below] > budget else _predicted_peak(size, below, measured,
                                                                                    resident=resident)
            figure = (f"micro-batch {size} is predicted at {gib(peak)} GiB from the trials at "
                      f"{format_measured({b: m / GiB for b, m in measured.items()})}")
        advice = "use more GPUs" if switch is not None else "turn on fsdp.activation_checkpointing, use more GPUs"
        if micro_batch is not None:
            advice = "set a smaller train.micro_batch_size (or auto), " + advice
        return OutOfMemory(
            f"{label}: {what}{figure}, over the budget of {gib(budget)} GiB ({gib(capacity)} GiB usable, "
            f"train.auto_micro_batch_margin={margin}); {advice}, or shorten data.seq_len")

    rng_devices = [env.device.index] if env.device.type == "cuda" else []
    tried: dict[str, dict[int, float]] = {}
    speeds: dict[str, float] = {}
    untried: list[str] = []
    ranked = predicted is not None and switch is not None and micro_batch is None \
        and all(pair_name(p, c) in predicted for p in policies for c in candidates)
    ranking: _Ranking | None = None
    first = _first_policy(policies, candidates[0], predicted if ranked else None, budget=budget)
    try:
        # Every pair of policy and micro-batch tried keeps its compiled graphs until the run's own are compiled
        # (below): more than torch.compile keeps by default, past which it would run the blocks uncompiled.
        with torch.random.fork_rng(devices=rng_devices), torch._dynamo.config.patch(recompile_limit=TRIAL_GRAPHS), \
                _learning_rate_zero(optimizer):
            with _trial_compile_options(compile):
                trials.use(first)
                probe.begin(candidates[0], trials.policy_name)
                trials.step(candidates[0], min(2, per_rank // candidates[0]))  # allocates the optimizer state
                resident = max_over_ranks(probe.allocated(), env)
                if ranked:
                    assert predicted is not None
                    ranking = _Ranking(trials, [p for p in policies if p is not None], candidates, predicted,
                                       budget=budget, resident=resident, tried=tried, speeds=speeds, first=first)
                    fitting: list[tuple[CheckpointPolicy | None, int, dict[int, float]]] = list(ranking.run())
                else:
                    fitting = _fitting_pairs(trials, policies, candidates, budget=budget, resident=resident,
                                             tried=tried, speeds=speeds if micro_batch is None else None,
                                             untried=untried)
            if micro_batch is not None:  # by hand: only the size set counts (the smaller ones led up to it)
                fitting = [pair for pair in fitting if pair[1] == micro_batch]
            if not fitting:  # the last policy's trials (the one that keeps the least) say by how much
                final = policies[-1].name if policies[-1] else ""
                last = tried.get(final, tried[next(reversed(tried))])
                raise nothing_fits(micro_batch or min(last), last)
            policy, best, measured = max(fitting, key=lambda pair: speeds.get(pair_name(pair[0], pair[1]), 0.0))
            trials.use(policy)
            if compile:
                torch.compiler.reset()  # the trials' graphs go; the run compiles its own, within the usual limit
                best = _compile_the_runs_graphs(trials, best, measured, budget=budget, nothing_fits=nothing_fits,
                                                smaller=candidates if micro_batch is None else [])
    except torch.OutOfMemoryError as err:
        # The run stops: no point restoring the state of a step that an exception interrupted.
        during = f" with activation checkpointing {trials.policy_name}" if switch is not None else ""
        # At the smallest size the model does not fit as the first trial runs it; above it, a prediction missed.
        advice = ("raise train.auto_micro_batch_margin, or set a smaller train.micro_batch_size by hand"
                  if trials.size > candidates[0] else
                  "set fsdp.activation_checkpointing=full by hand, use more GPUs, or shorten data.seq_len"
                  if switch is not None else
                  "turn on fsdp.activation_checkpointing, use more GPUs, or shorten data.seq_len")
        raise OutOfMemory(f"{label}: a trial step at micro-batch {trials.size}{during} ran out of memory "
                          f"({str(err).splitlines()[0]}); {advice}") from None
    if not torch.allclose(_fingerprint(model), weights, rtol=0, atol=0, equal_nan=True):
        raise RuntimeError(f"{label}: the trial steps changed the weights (an optimizer that moves them at learning "
                           "rate 0); set train.micro_batch_size and fsdp.activation_checkpointing by hand")
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)
    probe.begin(best, trials.policy_name)
    tried_gib = {name: {b: m / GiB for b, m in sorted(sizes.items())} for name, sizes in tried.items()}
    if ranking is not None:
        untried = ranking.untried
    return MicroBatchChoice(best, "search", {b: m / GiB for b, m in sorted(measured.items())}, capacity / GiB,
                            budget / GiB, time.perf_counter() - start, checkpointing=trials.policy_name,
                            tried_gib=tried_gib if switch is not None else {}, tokens_per_s=speeds, untried=untried,
                            estimated_first=pair_name(*ranking.ranked[0]) if ranking and ranking.ranked else None,
                            skipped=ranking.skipped if ranking else [])


def _first_policy(policies: list[CheckpointPolicy | None], smallest: int, predicted: dict[str, Predicted] | None, *,
                  budget: float) -> CheckpointPolicy | None:
    """The policy of the search's first step, which allocates the optimizer state at the smallest size: the one that
    keeps the most; with the estimate, the first it puts within the budget (none@1 of a model that fills the GPU
    would run out of memory), or the one it puts lowest where it puts them all over."""
    if predicted is None:
        return policies[0]
    at_smallest = {p: predicted[pair_name(p, smallest)] for p in policies}
    return next((p for p in policies if at_smallest[p].within(budget)), min(policies, key=lambda p: at_smallest[p].gib))


def _compile_the_runs_graphs(trials: _Trials, best: int, measured: dict[int, float], *, budget: float,
                             smaller: list[int], nothing_fits: Callable[[int, dict[int, float]], Exception]) -> int:
    """A trial step at the chosen size that compiles the run's own graphs (static at that size) and checks the
    figure; where it no longer fits, the next smaller of the `smaller` sizes, and so on. Returns the size."""
    while True:
        peak = measured[best] = trials.measure(best)
        if peak <= budget:
            return best
        below = [c for c in smaller if c < best]
        if not below:
            raise nothing_fits(best, measured)
        best = max(below)


def _fitting_pairs(trials: _Trials, policies: list[CheckpointPolicy | None], candidates: list[int], *, budget: float,
                   resident: float, tried: dict[str, dict[int, float]], speeds: dict[str, float] | None = None,
                   untried: list[str] | None = None) -> list[tuple[CheckpointPolicy | None, int, dict[int, float]]]:
    """(policy, the largest micro-batch that fits with it, its measurements) for each policy that fits a larger
    micro-batch than the policies before it (which recompute less: at the same size they are faster). Records
    every policy's measurements in `tried`.

    With `speeds` (the pairs compete: the auto micro-batch), each pair is timed as it is found, its tokens/s
    recorded there, unless it is the first and no later policy can fit more. A pair slower than one before it
    ends the search, the policies after it listed in `untried`: each recomputes more, for a still larger
    micro-batch, which gains less than the last larger one did."""
    fitting: list[tuple[CheckpointPolicy | None, int, dict[int, float]]] = []
    fixed = resident
    for index, policy in enumerate(policies):
        sizes = [c for c in candidates if c > (fitting[-1][1] if fitting else 0)]
        if not sizes:
            break
        if policy is not trials.policy:
            trials.use(policy)
        # It starts from the largest size that a policy keeping at least as much fit (so this one fits it too)
        # and runs a larger size only where predicted to fit. Without one, from the smallest candidate, which the
        # first policy (none, which keeps the most) ran without running out of memory.
        safe = max((best for kept, best, _ in fitting if keeps_at_least(kept, policy)), default=0)
        fit = sorted((c for c in candidates if c <= safe), reverse=True) or candidates[:1]
        # From the first policy's fixed part, one measurement predicts at most twice its size: that part is read
        # from a line of reserved peaks, an estimate (the resident states are a bound), and up to twice the size
        # the prediction errs by no more than the estimate does; further out it underestimates.
        best, measured = climb(sizes, budget=budget, resident=fixed, measure=trials.measure, fit=fit,
                               one_point_jump=2 if fixed > resident else None)
        tried[trials.policy_name or ""] = measured
        if fixed == resident:
            fixed = max(resident, _fixed_part(measured, budget))
        if best is None:
            continue
        fitting.append((policy, best, measured))
        later = policies[index + 1:] if best < candidates[-1] else []
        if speeds is None or (len(fitting) == 1 and not later):
            continue
        name = pair_name(policy, best)
        speeds[name] = trials.tokens_per_s(best)
        if later and speeds[name] < max(speeds.values()):
            if untried is not None:
                untried.extend(str(later_policy.name if later_policy else None) for later_policy in later)
            break
    return fitting


class _Ranking:
    """The search with the estimate (docs/fsdp.md): the pairs of policy and micro-batch, fastest predicted first, less
    those predicted over the budget by more than the estimate's error. Each in turn is measured, through the trials
    that make it safe to run as the search without the estimate makes them (a size known to fit, or predicted to
    fit by the policy's own measurements), and timed; a pair that one keeping at least as much fits at a micro-batch
    at least as large cannot be faster, and is passed over. It stops at the first pair whose predicted tokens/s,
    raised by the estimate's error, is below the prediction for the fastest pair measured."""

    def __init__(self, trials: _Trials, policies: list[CheckpointPolicy], candidates: list[int],
                 predicted: dict[str, Predicted], *, budget: float, resident: float, tried: dict[str, dict[int, float]],
                 speeds: dict[str, float], first: CheckpointPolicy | None = None):
        self.trials, self.policies, self.candidates, self.predicted = trials, policies, candidates, predicted
        self.first = first or policies[0]  # the policy of the search's first step (at the smallest candidate)
        self.budget, self.resident, self.tried, self.speeds = budget, resident, tried, speeds
        pairs = [(policy, size) for policy in policies for size in candidates]
        over = [pair for pair in pairs if not self.guess(*pair).within(budget, MEMORY_ERROR)]
        if len(over) == len(pairs):  # predicted not to fit at all: the trials find out and say so
            over = []
        self.skipped = [pair_name(*pair) for pair in over]
        # Fastest predicted first (a stable sort: ties in the policies' order, smaller micro-batches first).
        self.ranked = sorted((pair for pair in pairs if pair not in over),
                             key=lambda pair: -self.guess(*pair).tokens_per_s)
        self.fitting: list[tuple[CheckpointPolicy, int]] = []
        self.untried: list[str] = []

    def guess(self, policy: CheckpointPolicy, size: int) -> Predicted:
        return self.predicted[pair_name(policy, size)]

    def own(self, policy: CheckpointPolicy) -> dict[int, float]:
        return self.tried.setdefault(policy.name, {})

    def fits(self, policy: CheckpointPolicy) -> list[int]:
        return [size for size, peak in self.tried.get(policy.name, {}).items() if peak <= self.budget]

    def passed_over(self, policy: CheckpointPolicy, size: int) -> bool:
        """Whether a pair measured to fit keeps at least as much at a micro-batch at least as large (it recomputes no
        more for more sequences a pass: at least as fast), or this policy's trials put `size` over the budget."""
        if any(b <= size and peak > self.budget for b, peak in self.tried.get(policy.name, {}).items()):
            return True
        return any(keeps_at_least(kept, policy) and b >= size and (kept, b) != (policy, size)
                   for kept in self.policies for b in self.fits(kept))

    def run(self) -> list[tuple[CheckpointPolicy, int, dict[int, float]]]:
        """(policy, micro-batch, the policy's measurements) of each pair measured to fit that was timed, or is not
        passed over (the one pair found, where nothing competed with it)."""
        for index, (policy, size) in enumerate(self.ranked):
            best = self.best()
            if best is not None and self.beaten(policy, size, best):
                self.untried = [pair_name(*pair) for pair in self.ranked[index:] if not self.passed_over(*pair)]
                break
            if self.passed_over(policy, size) or not self.reach(policy, size):
                continue
            self.fitting.append((policy, size))
            if self.speeds or len(self.fitting) > 1 or self.contested(index):
                self.time_untimed()
        fitting = [(p, b) for p, b in self.fitting if pair_name(p, b) in self.speeds or not self.passed_over(p, b)]
        return [(p, b, self.own(p)) for p, b in fitting]

    def beaten(self, policy: CheckpointPolicy, size: int, best: tuple[CheckpointPolicy, int]) -> bool:
        return self.guess(policy, size).tokens_per_s * (1 + SPEED_ERROR) < self.guess(*best).tokens_per_s

    def best(self) -> tuple[CheckpointPolicy, int] | None:
        """The fastest pair measured (or the one pair that fits, untimed: nothing has competed with it)."""
        if not self.fitting:
            return None
        return max(self.fitting, key=lambda pair: self.speeds.get(pair_name(*pair), 0.0))

    def contested(self, index: int) -> bool:
        """Whether a pair after the one at `index` may still be tried against it (so it must be timed)."""
        found = self.ranked[index]
        return any(not self.beaten(*pair, found) and not self.passed_over(*pair) for pair in self.ranked[index + 1:])

    def time_untimed(self) -> None:
        """Time the pairs found that are not yet, the last found first (right after its trial, which warmed it)."""
        for policy, size in reversed(self.fitting):
            if pair_name(policy, size) not in self.speeds and not self.passed_over(policy, size):
                if policy is not self.trials.policy:
                    self.trials.use(policy)
                self.speeds[pair_name(policy, size)] = self.trials.tokens_per_s(size)

    def reach(self, policy: CheckpointPolicy, size: int) -> bool:
        """Measure (policy, size), through the trials that make it safe to run; whether it fits (False, unmeasured,
        where the policy's own trials predict it over the budget)."""
        own = self.own(policy)
        while size not in own:
            step = self.next_size(policy, size)
            if step is None:
                return False
            if policy is not self.trials.policy:
                self.trials.use(policy)
            own[step] = self.trials.measure(step)
        return own[size] <= self.budget

    def next_size(self, policy: CheckpointPolicy, size: int) -> int | None:
        """The next trial toward (policy, size): that size where it is known or predicted to fit; else the largest
        smaller size that is, not yet measured (a step toward it); with nothing measured, the smallest candidate
        where the search's first step ran it with a policy keeping at least as much, else the smallest size up to
        `size` that the estimate puts within the budget; None where the policy's own line puts it over the budget,
        or where no step is left."""
        own = self.own(policy)
        if any(b < size and peak > self.budget for b, peak in own.items()):
            return None
        fits = self.fits(policy)
        top = max(fits, default=0)
        line = any(b < top and own[b] < own[top] for b in own)
        # As in climb: from the first policy's fixed part, one measurement predicts at most twice its size.
        fixed = self.resident if policy == self.policies[0] else max(
            self.resident, _fixed_part(self.tried.get(self.policies[0].name, {}), self.budget))
        safe = max((b for kept in self.policies if keeps_at_least(kept, policy) for b in self.fits(kept)), default=0)

        def runs(c: int) -> bool:
            if c <= safe:
                return True
            if not fits or (not line and fixed > self.resident and c > 2 * top):
                return False
            return _predicted_peak(c, top, own, resident=fixed) <= self.budget

        if runs(size):
            return size
        if line:  # its own measurements put it over the budget
            return None
        steps = [c for c in self.candidates if c < size and c not in own and runs(c)]
        if steps:
            return max(steps)
        if own:
            return None
        if keeps_at_least(self.first, policy):
            return self.candidates[0]
        return next((c for c in self.candidates if c <= size and self.guess(policy, c).within(self.budget)), None)


def cache_key(cfg: Config, *, model_signature: dict, world_size: int, gpu: str, precision: str) -> dict:
    """What the measured memory depends on. Every fsdp option is in (a few are not memory-relevant: a change to
    one costs a needless search, never a wrong micro-batch)."""
    t = cfg.train
    key = {"model": model_signature, "seq_len": cfg.data.seq_len, "global_batch_size": t.global_batch_size,
           "world_size": world_size, "gpu": gpu, "torch": torch.__version__, "precision": precision,
           "compile": t.compile, "loss_chunk_tokens": t.loss_chunk_tokens, "float8": t.float8,
           "margin": t.auto_micro_batch_margin, "fsdp": dataclasses.asdict(cfg.fsdp)}
    if t.micro_batch_size != "auto":  # fsdp.activation_checkpointing=auto alone: chosen for this micro-batch
        key["micro_batch_size"] = t.micro_batch_size
    if t.lora.rank > 0:  # adapters instead of gradients and optimizer state for every weight
        key["lora"] = dataclasses.asdict(t.lora)
    if t.float8_output:  # FP8 copies of the output weight and the final norm's output
        key["float8_output"] = True
    return json.loads(json.dumps(key))  # as it reads back from the file


def _entry_problem(entry: dict, key: dict) -> str | None:
    """What makes a cache entry unusable (it is a file anyone can edit), or None."""
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0

    size = entry.get("micro_batch_size")
    per_rank = key.get("global_batch_size", 0) // max(key.get("world_size", 1), 1)  # 0: a key without them
    if not (isinstance(size, int) and not isinstance(size, bool) and size > 0 and per_rank % size == 0):
        return f"micro_batch_size {_EXCERPT.repr(size)} is not a divisor of the per-rank batch {per_rank}"
    measured = entry.get("measured_gib")
    if not isinstance(measured, dict) or not all(str(b).isdigit() and int(b) > 0 and number(m)
                                                 for b, m in measured.items()):
        return f"measured_gib {_EXCERPT.repr(measured)} is not {{micro-batch: GiB}}"
    if bad := [k for k in ("capacity_gib", "budget_gib") if not number(entry.get(k))]:
        return f"{bad[0]} {_EXCERPT.repr(entry.get(bad[0]))} is not a size in GiB"
    if key.get("fsdp", {}).get("activation_checkpointing") == "auto":
        try:
            CheckpointPolicy.parse(entry.get("activation_checkpointing"))  # type: ignore[arg-type]
        except (ValueError, AttributeError):
            return f"activation_checkpointing {_EXCERPT.repr(entry.get('activation_checkpointing'))} is not a policy"
    return None


def _cache_entries(path: Path) -> list:
    """The entries of a micro-batch cache file; OSError (UnsafePath for a link, FIFO or device there, never
    opened), ValueError, KeyError, TypeError or RecursionError (JSON nested too deeply) if it is not one."""
    entries = json.loads(nofollow.read_small(path, limit=CACHE_LIMIT))["entries"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise TypeError("its entries are not a list of objects")
    return entries


def read_cache(out_dir: Path, key: dict) -> dict | None:
    """This key's entry of <out_dir>/microbatch_cache.json, or None (no file, no entry, or a bad one: warned
    about, and the search runs as if there were no cache)."""
    path = out_dir / CACHE_FILE
    if not os.path.lexists(path):
        return None
    try:
        entry = next((e for e in _cache_entries(path) if e.get("key") == key), None)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else f"{type(err).__name__}: {err}"
        log.warning("ignoring %s (unreadable: %s); searching again", path, why[:200])
        return None
    if entry is not None and (problem := _entry_problem(entry, key)):
        log.warning("ignoring %s (its entry for this run: %s); searching again", path, problem)
        return None
    return entry


def save_to_cache(out_dir: Path, key: dict, choice: MicroBatchChoice) -> None:
    """Add (or replace) this key's entry in <out_dir>/microbatch_cache.json; rank 0 only. Anything else at that name
    (not a cache) is kept aside as kept-microbatch_cache.json, never written over."""
    path = out_dir / CACHE_FILE
    try:
        entries = [e for e in _cache_entries(path) if e.get("key") != key]
    except FileNotFoundError:
        entries = []
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # not a cache: this one goes beside it
        entries = []
        Journal(out_dir).keep_foreign(path, why="the micro-batch cache")
    entries.append({"key": key, "micro_batch_size": choice.micro_batch_size,
                    "measured_gib": {str(b): round(m, 3) for b, m in choice.measured_gib.items()},
                    "capacity_gib": round(choice.capacity_gib, 3), "budget_gib": round(choice.budget_gib, 3),
                    "search_s": round(choice.seconds, 1),
                    **({"activation_checkpointing": choice.checkpointing,
                        "tried_gib": {p: {str(b): round(m, 3) for b, m in sizes.items()}
                                      for p, sizes in choice.tried_gib.items()},
                        "tokens_per_s": {k: round(v) for k, v in choice.tokens_per_s.items()}}
                       if choice.checkpointing is not None else {}),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    replace_file(path, (json.dumps({"entries": entries}, indent=1) + "\n").encode())


def cpu_micro_batch(per_rank: int, limit: int) -> int:
    """auto without GPU memory to measure: the largest divisor of the per-rank batch up to `limit`."""
    return max(d for d in divisors(per_rank) if d <= limit)


def resolve_micro_batch(cfg: Config, env: DistEnv, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                        fsdp: FSDPAdapter, vocab_size: int, key: dict, probe: MemoryProbe | None,
                        switch: CheckpointSwitch | None = None, use_cache: bool = True,
                        use_estimate: bool = True) -> MicroBatchChoice:
    """train.micro_batch_size as configured, or for auto: the CPU fallback, the cached choice (`use_cache`), or a
    search; with fsdp.activation_checkpointing=auto (`switch`) the policy too, left set in the switch. With both
    autos the search measures in the order of the estimate (`use_estimate`; benchmarks/benchmark.py
    --search_without_estimate turns it off) where the planner knows the GPU and the config.
    `describe_choice` says how it was chosen."""
    t = cfg.train
    configured = t.micro_batch_size if isinstance(t.micro_batch_size, int) else None  # None: auto
    auto_size = configured is None
    if configured is not None and switch is None:
        return MicroBatchChoice(configured, "configured")
    per_rank = t.global_batch_size // env.world_size
    if probe is None:  # the CPU: no GPU memory to measure
        policy = None
        if switch is not None:
            switch.policy = CheckpointPolicy("none")
            policy = switch.policy.name
        if configured is not None:
            return MicroBatchChoice(configured, "configured", checkpointing=policy)
        return MicroBatchChoice(cpu_micro_batch(per_rank, t.auto_micro_batch_cpu), "cpu", checkpointing=policy)
    entry = broadcast_decision(env, read_cache(cfg.output_dir, key) if env.is_main else None) if use_cache else None
    if entry is not None:
        measured = {int(b): m for b, m in entry["measured_gib"].items()}
        if switch is not None:
            switch.policy = CheckpointPolicy.parse(entry["activation_checkpointing"])
        return MicroBatchChoice(entry["micro_batch_size"], "cache", measured, entry["capacity_gib"],
                                entry["budget_gib"], checkpointing=entry.get("activation_checkpointing"),
                                cached_on=entry.get("date", "?"))
    sizes = divisors(per_rank) if configured is None else [configured]
    log.info("%s: measuring trial steps on %s to find %s", auto_label(auto_size=auto_size,
                                                                      auto_checkpointing=switch is not None),
             probe.name, f"the largest micro-batch of {sizes} that fits" if switch is None else
             f"the fastest pair of activation checkpointing policy and micro-batch (of {sizes}) that fits")
    predicted = None
    if use_estimate and auto_size and switch is not None:  # rank 0's, so that every rank searches in one order
        policies = auto_policies(cfg.fsdp.ac_every_n_layers, roles_known=switch.roles_known)
        predicted = broadcast_decision(env, search_estimate(cfg, env, gpu=probe.name, vocab_size=vocab_size,
                                                            policies=policies) if env.is_main else None)
    return search_micro_batch(model, optimizer, fsdp=fsdp, per_rank=per_rank, seq_len=cfg.data.seq_len,
                              vocab_size=vocab_size, grad_clip=t.grad_clip, margin=t.auto_micro_batch_margin,
                              compile=t.compile, env=env, probe=probe, micro_batch=configured, switch=switch,
                              every_n=cfg.fsdp.ac_every_n_layers, predicted=predicted)


def search_estimate(cfg: Config, env: DistEnv, *, gpu: str, vocab_size: int,
                    policies: list[CheckpointPolicy]) -> dict[str, Predicted] | None:
    """The estimate of each pair of the search (by pair_name) on this run's GPUs, or None (logged) where the
    planner does not know the GPU or cannot plan the config (docs/planning.md)."""
    spec = gpu_for_device(gpu)
    problems = [f"it does not know the {gpu}"] if spec is None else []
    estimates = {}
    if spec is not None:
        try:
            estimates = config_estimates(cfg, Cluster(spec, env.world_size, env.world_size // env.local_world_size),
                                         policies=[p.name for p in policies], vocab_size=vocab_size)
        except ConfigError as err:
            problems = err.problems
    if problems:
        if env.is_main:
            log.info("the estimate does not order the search: %s", problems[0])
        return None
    return {f"{policy}@{size}": Predicted(e.memory.reserved, e.speed.tokens_per_s)
            for (policy, size), e in estimates.items()}


def describe_choice(choice: MicroBatchChoice, cfg: Config, *, world_size: int) -> list[str]:
    """How resolve_micro_batch chose, as the training log and the benchmark print it: no line for a micro-batch
    set by hand without fsdp.activation_checkpointing=auto."""
    t = cfg.train
    auto_size, auto_checkpointing = t.micro_batch_size == "auto", cfg.fsdp.activation_checkpointing == "auto"
    per_rank = t.global_batch_size // world_size
    lines = []
    if choice.how in ("configured", "cpu") and choice.checkpointing is not None:
        lines.append("fsdp.activation_checkpointing=auto on the CPU (no GPU memory to measure): "
                     f"{choice.checkpointing}")
    if choice.how == "cpu":
        lines.append(f"train.micro_batch_size=auto on the CPU (no GPU memory to measure): micro-batch "
                     f"{choice.micro_batch_size}, the largest divisor of the per-rank batch {per_rank} up to "
                     f"train.auto_micro_batch_cpu={t.auto_micro_batch_cpu}")
    if choice.how not in ("cache", "search"):
        return lines
    what = auto_label(auto_size=auto_size, auto_checkpointing=auto_checkpointing)
    policy = f", activation checkpointing {choice.checkpointing}" if auto_checkpointing else ""
    if choice.how == "cache":
        return [f"{what}: micro-batch {choice.micro_batch_size} (gradient accumulation "
                f"{per_rank // choice.micro_batch_size}){policy}, from {cfg.output_dir / CACHE_FILE} (measured "
                f"{choice.cached_on}: {format_measured(choice.measured_gib)}, budget {choice.budget_gib:.2f} GiB); "
                "no search"]
    if auto_checkpointing:
        lines.append(f"fsdp.activation_checkpointing=auto: {_why(choice, auto_size=auto_size)}")
    trials = sum(len(sizes) for sizes in choice.tried_gib.values()) or len(choice.measured_gib)
    timed = f", {len(choice.tokens_per_s)} timed" if choice.tokens_per_s else ""
    lines.append(f"{what}: micro-batch {choice.micro_batch_size} (gradient accumulation "
                 f"{per_rank // choice.micro_batch_size} on {world_size} ranks){policy}; peak memory of the trial "
                 f"steps (reserved, max over ranks) {format_measured(choice.measured_gib)}, against a budget of "
                 f"{choice.budget_gib:.2f} GiB ({choice.capacity_gib:.2f} GiB usable, margin "
                 f"{t.auto_micro_batch_margin:g}); search: {trials} memory trials{timed}, {choice.seconds:.0f} s")
    return lines


def _why(choice: MicroBatchChoice, *, auto_size: bool) -> str:
    """What the pairs tried measured and why the search chose as it did."""
    tried = "; ".join(f"{name}: {format_measured(sizes)}" for name, sizes in choice.tried_gib.items())
    timed = ", ".join(f"{pair} {speed:,.0f} tokens/s per rank" for pair, speed in choice.tokens_per_s.items())
    chosen = f"{choice.checkpointing}@{choice.micro_batch_size}"
    ranked = choice.estimated_first is not None
    if timed:
        why = f"timed {timed}: the most tokens/s is {chosen}"
    elif ranked:
        why = f"{chosen} fits, and no pair predicted to fit could be faster"
    else:
        why = (f"{choice.checkpointing} recomputes the least of the policies that fit micro-batch "
               f"{choice.micro_batch_size}" + (", and none fits a larger one" if auto_size else ""))
    if ranked:
        order = f"the estimate put {choice.estimated_first} first"
        if choice.skipped:
            order += (f" and skipped {', '.join(choice.skipped)} (predicted over the budget by more than "
                      f"{100 * MEMORY_ERROR:.0f}%)")
        why = f"{order}; {why}"
    if choice.untried and ranked:
        why += (f"; left out: {', '.join(choice.untried)} (predicted slower than the fastest measured by more than "
                f"the estimate's {100 * SPEED_ERROR:.0f}% error)")
    elif choice.untried:
        why += (f"; not tried: {', '.join(choice.untried)} (more recompute for a larger micro-batch, after the last "
                "larger one was slower)")
    return f"tried {tried}; {why}"


def format_measured(measured_gib: dict[int, float]) -> str:
    """{micro-batch: GiB} as the log writes it: micro-batch 1: 4.00 GiB, 2: 7.00 GiB."""
    return "micro-batch " + ", ".join(f"{b}: {m:.2f} GiB" for b, m in sorted(measured_gib.items()))
