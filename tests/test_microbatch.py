"""train.micro_batch_size: auto, the out-of-memory report and retry, and the memory hint.

GPU memory readings from a formula and out-of-memory errors are injected (tests/fault_injection.py), so
everything but the readings themselves runs for real on the CPU: trial steps, agreement across gloo ranks,
the restore of the weights, the cache, the retry. tests/test_gpu.py has the GPU counterparts."""
from __future__ import annotations

import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from config import ConfigError, check_batch_split, load_config
from fsdp_utils.parallel.parallelize import CheckpointPolicy
from fsdp_utils.train.batch import BatchSplit, divisors
from fsdp_utils.train.microbatch import (
    CACHE_FILE,
    MicroBatchChoice,
    _fitting_pairs,
    _fixed_part,
    auto_policies,
    cache_key,
    climb,
    describe_choice,
    keeps_at_least,
    pair_name,
    read_cache,
    save_to_cache,
)
from tests.fault_injection import FakeProbe
from tests.helpers import RANK_VARIABLES, ROOT, WITH_FAULTS, fault_env, job_env, losses, run_job, run_train

TINY_PRESET = ROOT / "config/train_tiny_fsdp.yaml"
ONE_STEP = ("--train.max_steps=1", "--train.warmup_steps=1")  # a warmup longer than the run is refused
GiB = 2**30


def fake_memory(capacity: float, fixed: float, per_sample, **extra) -> dict:
    """The fault (tests/fault_injection.py) that makes GPU memory readings from a formula on the CPU."""
    return {"fake_gpu_memory": {"capacity_gib": capacity, "fixed_gib": fixed, "per_sample_gib": per_sample, **extra}}


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


# ---- the search's arithmetic ------------------------------------------------------------------------


def test_divisors_and_halving():
    assert divisors(32) == [1, 2, 4, 8, 16, 32]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    # Halved: half the micro-batch, or for an odd size the largest divisor <= half; the same global batch.
    halved = [BatchSplit(b * 4, 2, b).halved() for b in (32, 6, 9, 3, 1)]
    assert [h and h.micro_batch_size for h in halved] == [16, 3, 3, 1, None]
    assert [h.grad_accum for h in halved[:4]] == [4, 4, 6, 6] and halved[0].global_batch_size == 128


def test_batch_split_indices_cover_the_global_batch_once_whatever_the_split():
    # The samples a step trains on are its global batch, split: the same set of first-sample indices for
    # any world size and micro-batch (each index is the first of micro_batch_size consecutive samples).
    def covered(world_size, micro):
        split = BatchSplit(8, world_size, micro)
        return sorted(i + k for rank in range(world_size)
                      for i in split.sample_indices(rank=rank, first_step=2, samples_seen=16, max_steps=4)
                      for k in range(micro))
    assert covered(1, 8) == covered(2, 2) == covered(4, 1) == list(range(16, 32))


def test_climb_jumps_to_the_largest_bounded_candidate():
    # Memory 10 + 2 * b GiB with 10 resident, budget 90: the bound from b = 1 is 10 + 2 * c <= 90, c <= 40,
    # so it jumps straight from 1 to 32, the largest candidate (74 GiB measured), two trial steps in all.
    calls = []

    def measure(b):
        calls.append(b)
        return 10 + 2 * b

    best, measured = climb(divisors(32), budget=90, resident=10, measure=measure)
    assert best == 32 and calls == [1, 32] and measured == {1: 12, 32: 74}


def test_climb_steps_from_measurement_to_measurement():
    # 10 resident + 10 per sample, budget 100: from b = 1 (20) the bound 10 + 10 c allows c <= 9 -> 8 (90);
    # from 8 the bound 10 + 80 * c / 8 allows nothing larger. 8 is the largest size that fits.
    calls = []

    def measure(b):
        calls.append(b)
        return 10 + 10 * b

    best, _ = climb(divisors(32), budget=100, resident=10, measure=measure)
    assert best == 8 and calls == [1, 8]


def test_climb_keeps_the_last_size_that_fit_when_a_measurement_surprises():
    # Resident 1, budget 10. From 1 (3 GiB) the bound 1 + 2 c allows up to 4 (5 GiB); from 4 the bound
    # 1 + 4 * 8 / 4 = 9 allows 8, which then reads 30 (far above the line): over the budget, so 4 it is.
    table = {1: 3.0, 4: 5.0, 8: 30.0}
    best, measured = climb([1, 2, 4, 8], budget=10, resident=1, measure=table.__getitem__)
    assert best == 4 and measured == table


def test_climb_from_sizes_that_fit_measures_only_predicted_candidates():
    # 30 GiB resident, 10 more that do not grow with the micro-batch (buffers), 5 per sample; budget 65. Sizes
    # 2 and 1 fit for sure (a policy that keeps more fit them), so the first step measures 2, not the smallest
    # candidate 4: the bound from 2 (50 GiB) puts 4 at 70, over; the line through 1 (45) and 2 puts 4 at 60:
    # measured, it fits, and 8 (80) is predicted over, so never run (over the GPU's capacity it would end the
    # run). The bound alone measures nothing larger than 2.
    calls = []

    def measure(b):
        calls.append(b)
        return 40 + 5 * b

    best, measured = climb([4, 8, 16], budget=65, resident=30, measure=measure, fit=[2, 1])
    assert best == 4 and calls == [2, 1, 4] and measured == {1: 45, 2: 50, 4: 60}
    calls.clear()
    assert climb([4, 8, 16], budget=65, resident=30, measure=measure, fit=[2])[0] is None and calls == [2]
    # With one size that fits, the bound from it leads: 1 (45) puts 2 at 60 and 4 at 90, so 2 is measured
    # (50), then the line through 1 and 2 puts 4 at 60: measured, 4.
    calls.clear()
    assert climb([2, 4, 8, 16], budget=65, resident=30, measure=measure, fit=[1])[0] == 4 and calls == [1, 2, 4]
    # Without sizes that fit, the first step is at the smallest candidate, as for the first policy.
    calls.clear()
    assert climb([16], budget=200, resident=30, measure=measure) == (16, {16: 120}) and calls == [16]


def test_which_policy_keeps_at_least_what_another_keeps():
    # Where the first fits, the second fits too: the start of the second's search (none keeps the most, full the
    # least; every n-th block's whole forward has no order with the op-level policies).
    none, op, lean, full = auto_policies(2)
    every2 = CheckpointPolicy("selective", 2)  # a candidate where the blocks' matmul roles are not known
    assert all(keeps_at_least(none, p) and keeps_at_least(p, full) for p in (none, op, lean, every2, full))
    assert keeps_at_least(op, lean) and not keeps_at_least(lean, op)
    assert not keeps_at_least(lean, every2) and not keeps_at_least(every2, lean) and not keeps_at_least(op, every2)
    assert not keeps_at_least(full, none)


def test_each_policy_runs_only_sizes_known_or_predicted_to_fit():
    # The policies of fsdp.activation_checkpointing=auto on a 10 GiB GPU (budget 9, 1 resident), read from the
    # fake probe's formula (AC_MEMORY below), which runs out of memory over 10 GiB, as the GPU does. Started from
    # the smallest size larger than what the policy before fit, selective_op_lean would run 8 (10.6 GiB): fatal.
    probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, **AC_MEMORY}, 0)

    class Trials:
        policy = None
        policy_name = None

        def use(self, policy):
            self.policy, self.policy_name = policy, policy.name

        def measure(self, size):
            probe.begin(size, self.policy_name)
            return probe.peak_reserved() / GiB

    tried = {}
    fitting = _fitting_pairs(Trials(), auto_policies(2), divisors(8), budget=9, resident=1, tried=tried)
    assert [(policy.name, best) for policy, best, _ in fitting] == [("none", 2), ("selective_op", 4), ("full", 8)]
    assert {name: {b: round(m, 2) for b, m in sizes.items()} for name, sizes in tried.items()} == {
        "none": {1: 4, 2: 7}, "selective_op": {2: 4, 4: 7}, "selective_op_lean": {4: 5.8, 2: 3.4},
        "full": {4: 4.6, 8: 8.2}}


def test_later_policies_predict_from_the_fixed_part_of_the_first_ones_line():
    # peak = 20 GiB that no micro-batch changes (states and buffers, of which 10 are resident after the first
    # step) + GiB per sample: none 10, selective_op 5, full 1. none's line through 4 and 8 meets 0 at 20, so one
    # measurement of selective_op (at 8, which none fit) gives its slope: 16 is predicted at 100 and run. From the
    # resident 10 alone, its bound (6.25 per sample) would put 16 over the budget and need a second point.
    per_sample = {"none": 10, "selective_op": 5, "selective_op_lean": 5, "full": 1}

    class Trials:
        policy = policy_name = None

        def use(self, policy):
            self.policy, self.policy_name = policy, policy.name

        def measure(self, size):
            return 20 + per_sample[self.policy_name] * size

    tried = {}
    fitting = _fitting_pairs(Trials(), auto_policies(2), divisors(32), budget=100, resident=10, tried=tried)
    assert _fixed_part(tried["none"], 100) == 20
    assert tried["none"] == {1: 30, 4: 60, 8: 100} and tried["selective_op"] == {8: 60, 16: 100}
    assert [(policy.name, best) for policy, best, _ in fitting] == [("none", 8), ("selective_op", 16), ("full", 32)]
    # From one measurement and an estimated fixed part, a jump of at most twice the size: 8 -> 16 -> 32, not 8 -> 32.
    calls = []

    def measure(size):
        calls.append(size)
        return 20 + 5 * size

    assert climb([16, 32], budget=200, resident=20, measure=measure, fit=[8], one_point_jump=2)[0] == 32
    assert calls == [8, 16, 32]
    assert _fixed_part({1: 30, 2: 30}, 100) == 0 and _fixed_part({4: 60, 8: 120}, 100) == 0  # no rising pair that fits


class _TimedTrials:
    """Trials whose memory is AC_MEMORY's formula on a 10 GiB GPU and whose pairs time at the given tokens/s,
    recording what ran."""

    def __init__(self, speeds: dict[str, float]):
        self.probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, **AC_MEMORY}, 0)
        self.speeds, self.ran = speeds, []
        self.policy = self.policy_name = None

    def use(self, policy):
        self.policy, self.policy_name = policy, policy.name

    def measure(self, size):
        self.ran.append(f"measure {self.policy_name}@{size}")
        self.probe.begin(size, self.policy_name)
        return self.probe.peak_reserved() / GiB

    def tokens_per_s(self, size):
        self.ran.append(f"time {self.policy_name}@{size}")
        return self.speeds[self.policy_name]


def test_each_pair_is_timed_as_found_and_a_slower_one_ends_the_search():
    # AC_MEMORY on 10 GiB fits none@2, selective_op@4 and full@8 (test above). selective_op@4 trains slower than
    # none@2: the policies after it recompute more for a larger micro-batch, which gains less still, so
    # selective_op_lean and full never run. Each pair is timed right after its last trial.
    trials, tried, speeds, untried = _TimedTrials({"none": 1000.0, "selective_op": 900.0}), {}, {}, []
    fitting = _fitting_pairs(trials, auto_policies(2), divisors(8), budget=9, resident=1, tried=tried, speeds=speeds,
                             untried=untried)
    assert [(policy.name, best) for policy, best, _ in fitting] == [("none", 2), ("selective_op", 4)]
    assert speeds == {"none@2": 1000.0, "selective_op@4": 900.0} and list(tried) == ["none", "selective_op"]
    assert untried == ["selective_op_lean", "full"]
    # The log says so (describe_choice).
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size="auto", global_batch_size=8,
                                                auto_micro_batch_margin=0.1),
                          fsdp=SimpleNamespace(activation_checkpointing="auto"))
    choice = MicroBatchChoice(2, "search", {1: 4.0, 2: 7.0}, 10.0, 9.0, 1.0, checkpointing="none",
                              tried_gib={"none": {1: 4.0, 2: 7.0}, "selective_op": {2: 4.0, 4: 7.0}},
                              tokens_per_s=speeds, untried=untried)
    assert describe_choice(choice, cfg, world_size=1)[0] == (
        "fsdp.activation_checkpointing=auto: tried none: micro-batch 1: 4.00 GiB, 2: 7.00 GiB; selective_op: "
        "micro-batch 2: 4.00 GiB, 4: 7.00 GiB; timed none@2 1,000 tokens/s per rank, selective_op@4 900 tokens/s "
        "per rank: the most tokens/s is none@2; not tried: selective_op_lean, full (more recompute for a larger "
        "micro-batch, after the last larger one was slower)")
    assert trials.ran == ["measure none@1", "measure none@2", "time none@2", "measure selective_op@2",
                          "measure selective_op@4", "time selective_op@4"]
    # Faster at each larger micro-batch: every policy runs, and full@8, the last, is timed too.
    trials, speeds = _TimedTrials({"none": 1000.0, "selective_op": 1100.0, "full": 1200.0}), {}
    fitting = _fitting_pairs(trials, auto_policies(2), divisors(8), budget=9, resident=1, tried={}, speeds=speeds)
    assert [(policy.name, best) for policy, best, _ in fitting] == [("none", 2), ("selective_op", 4), ("full", 8)]
    assert list(speeds) == ["none@2", "selective_op@4", "full@8"]
    # A first pair with nothing left to compete (none fits the whole per-rank batch) is not timed.
    trials, speeds = _TimedTrials({}), {}
    fitting = _fitting_pairs(trials, auto_policies(2), divisors(2), budget=9, resident=1, tried={}, speeds=speeds)
    assert [(policy.name, best) for policy, best, _ in fitting] == [("none", 2)] and speeds == {}
    assert not any(step.startswith("time") for step in trials.ran)


# ---- the search in the estimate's order -------------------------------------------------------------------------


class _PairTrials:
    """Trials whose peaks come from `peaks` ({policy: {micro-batch: GiB}}, each over `capacity` an out-of-memory
    error as on a GPU) and whose pairs time at `speeds` ({"policy@micro-batch": tokens/s}), recording what ran."""

    def __init__(self, peaks: dict, speeds: dict, capacity: float = 10.0):
        self.peaks, self.speeds, self.capacity, self.ran = peaks, speeds, capacity, []
        self.policy = self.policy_name = None

    def use(self, policy):
        self.policy, self.policy_name = policy, policy.name

    def measure(self, size):
        self.ran.append(f"measure {self.policy_name}@{size}")
        peak = self.peaks[self.policy_name][size]
        if peak > self.capacity:
            raise torch.OutOfMemoryError(f"{self.policy_name}@{size} needs {peak} GiB")
        return peak * GiB

    def tokens_per_s(self, size):
        self.ran.append(f"time {self.policy_name}@{size}")
        return self.speeds[f"{self.policy_name}@{size}"]


def _rank(trials, predicted: dict, *, budget: float, resident: float = 1.0, candidates=(1, 2, 4, 8)):
    from fsdp_utils.train.microbatch import Predicted, _Ranking

    ranking = _Ranking(trials, auto_policies(2), list(candidates),
                       {name: Predicted(*value) for name, value in predicted.items()}, budget=budget * GiB,
                       resident=resident * GiB, tried={}, speeds={})
    return ranking, ranking.run()


# A 10 GiB GPU, 1 GiB that no micro-batch changes, and per sequence: none 2.1 GiB, selective_op 1.1, selective_op_lean
# 0.9, full 0.7. Over the GPU: none@8 (17.8 GiB; on a GPU, an out-of-memory error ends the run).
PER_SAMPLE = {"none": 2.1, "selective_op": 1.1, "selective_op_lean": 0.9, "full": 0.7}
PEAKS = {policy: {b: 1 + per_sample * b for b in (1, 2, 4, 8)} for policy, per_sample in PER_SAMPLE.items()}
# The estimate's fastest: none@4, then selective_op@8, selective_op_lean@8, full@8 (each within 10% of the one
# before), none@2; every other pair 100 tokens/s.
SPEEDS = {"none@4": 1200, "selective_op@8": 1150, "selective_op_lean@8": 1100, "full@8": 1000, "none@2": 900}


def _predicted(speeds: dict, gib: dict | None = None) -> dict:
    """(GiB, tokens/s) of every pair: PEAKS (or `gib`'s), `speeds` (every other pair 100 tokens/s)."""
    return {f"{p}@{b}": ((gib or {}).get(f"{p}@{b}", PEAKS[p][b]), speeds.get(f"{p}@{b}", 100.0))
            for p in PEAKS for b in (1, 2, 4, 8)}


def test_the_estimate_orders_the_pairs_and_skips_those_predicted_not_to_fit():
    # Budget 9.5 GiB. none@8 (17.8) is predicted over it by more than the estimate's 10% (10.45): never run.
    # selective_op@8 (9.8) is over by less: a candidate. In the estimate's order:
    # - none@4: from the smallest size (nothing measured yet), whose bound puts 4 at 3.1 + 3 * 2.1 = 9.4: fits; timed,
    #   as selective_op@8 may still beat it;
    # - selective_op@8: from 4 (none fit 4, so it fits too), whose bound puts 8 at 9.8, over; a second point at 2
    #   makes a line that puts it at 9.8 too: not run;
    # - selective_op_lean@8: from 4 (selective_op fit it), 8 predicted at 8.2: run, fits, timed;
    # - full@8 (predicted 1,000 x 1.1 = 1,100) cannot beat none@4's 1,200: the search stops there (and full@8 could
    #   not beat selective_op_lean@8, which keeps more at the same micro-batch: no pair is left out that could).
    trials = _PairTrials(PEAKS, {"none@4": 1180.0, "selective_op_lean@8": 1050.0})
    ranking, fitting = _rank(trials, _predicted(SPEEDS), budget=9.5)
    assert ranking.skipped == ["none@8"]
    assert [pair_name(*pair) for pair in ranking.ranked[:5]] == [
        "none@4", "selective_op@8", "selective_op_lean@8", "full@8", "none@2"]
    assert trials.ran == ["measure none@1", "measure none@4", "time none@4", "measure selective_op@4",
                          "measure selective_op@2", "measure selective_op_lean@4", "measure selective_op_lean@8",
                          "time selective_op_lean@8"]
    assert [(p.name, b) for p, b, _ in fitting] == [("none", 4), ("selective_op_lean", 8)]
    assert ranking.speeds == {"none@4": 1180.0, "selective_op_lean@8": 1050.0}
    assert ranking.untried == []


@pytest.mark.parametrize(("lean", "tried"), [(1090, False), (1091, True)])
def test_the_search_stops_once_no_pair_predicted_can_beat_the_fastest_measured(lean, tried):
    # none@4 found first (predicted 1,200): selective_op_lean@8 is tried where its prediction raised by the estimate's
    # 10% reaches 1,200 (1,091 x 1.1 = 1,200.1), not at 1,090 (1,199). Where nothing can compete, none@4 is not even
    # timed.
    trials = _PairTrials(PEAKS, {"none@4": 1180.0, "selective_op_lean@8": 1050.0})
    ranking, fitting = _rank(trials, _predicted({"none@4": 1200, "selective_op_lean@8": lean}), budget=9.5)
    assert ("measure selective_op_lean@8" in trials.ran) == tried and ("time none@4" in trials.ran) == tried
    assert (ranking.untried[:1] == ["selective_op_lean@8"]) == (not tried)
    assert fitting[0][:2] == (CheckpointPolicy("none"), 4)
    if not tried:  # the log says what was left out, and why
        choice = MicroBatchChoice(4, "search", {1: 3.1, 4: 9.4}, 10.0, 9.5, 1.0, checkpointing="none",
                                  tried_gib={"none": {1: 3.1, 4: 9.4}}, untried=ranking.untried,
                                  estimated_first=pair_name(*ranking.ranked[0]), skipped=ranking.skipped)
        cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size="auto", global_batch_size=8,
                                                    auto_micro_batch_margin=0.05),
                              fsdp=SimpleNamespace(activation_checkpointing="auto"))
        assert describe_choice(choice, cfg, world_size=1)[0] == (
            "fsdp.activation_checkpointing=auto: tried none: micro-batch 1: 3.10 GiB, 4: 9.40 GiB; the estimate put "
            "none@4 first and skipped none@8 (predicted over the budget by more than 10%); none@4 fits, and no pair "
            "predicted to fit could be faster; left out: selective_op_lean@8, selective_op@8, full@8 (predicted slower "
            "than the fastest measured by more than the estimate's 10% error)")


def test_the_fastest_measured_trains_whatever_the_estimate_said():
    # selective_op_lean@8 measured faster than none@4, though predicted slower: it is chosen, and becomes the pair to
    # beat (full@8, predicted 1,000, is under 1,100 / 1.1 no longer: tried? passed over: lean keeps more at 8).
    trials = _PairTrials(PEAKS, {"none@4": 1180.0, "selective_op_lean@8": 1300.0})
    ranking, fitting = _rank(trials, _predicted(SPEEDS), budget=9.5)
    best = max(fitting, key=lambda pair: ranking.speeds[pair_name(pair[0], pair[1])])
    assert pair_name(*best[:2]) == "selective_op_lean@8" and "measure full@8" not in trials.ran


def test_a_pair_predicted_a_little_over_the_budget_is_tried_and_one_that_would_not_fit_the_gpu_never_runs():
    # full@8 predicted at 10 GiB, over the 9.5 budget by less than the estimate's error: tried, it measures 6.6 and
    # fits. selective_op_lean here takes 1.2 GiB a sequence (its 8: 10.6 GiB, over the 10 GiB GPU) but is predicted
    # at 9 GiB and first: its trial at 4 puts 8 at 10.6, so it never runs. Every trial runs at a size known or
    # predicted by measurements to fit; the estimate only orders and skips.
    peaks = {**PEAKS, "selective_op_lean": {b: 1 + 1.2 * b for b in (1, 2, 4, 8)}}
    predicted = _predicted({"selective_op_lean@8": 1500, "full@8": 1400},
                           gib={"full@8": 10.0, "selective_op_lean@8": 9.0})
    trials = _PairTrials(peaks, {"full@8": 1300.0, "selective_op_lean@4": 1000.0})
    ranking, fitting = _rank(trials, predicted, budget=9.5)
    assert ranking.ranked[0] == (CheckpointPolicy("selective_op_lean"), 8) and "full@8" not in ranking.skipped
    assert "measure selective_op_lean@8" not in trials.ran
    assert "measure full@8" in trials.ran and ("full", 8) in [(p.name, b) for p, b, _ in fitting]


def test_the_search_reaches_the_budget_near_the_card_not_a_margin_below_it(monkeypatch):
    # search_micro_batch as training runs it (a stand-in step, the fake GPU's readings of PEAKS), at the margin of the
    # config's default: none@4 reads 9.4 GiB of the 10 GiB GPU, inside 10 * (1 - margin), and trains the most tokens/s
    # (a step of 8 sequences of 4 tokens takes 1 s without checkpointing, 2.5 s with selective_op_lean: 32 x 4 = 128
    # and 32 x 8 / 2.5 = 102 tokens/s). With a margin of 0.1 (a 9 GiB budget) it is over: selective_op_lean@8.
    from config import Config
    from fsdp_utils.parallel.parallelize import CheckpointSwitch
    from fsdp_utils.train import microbatch

    monkeypatch.setattr(microbatch, "train_step", lambda *a, **k: None)
    monkeypatch.setattr(microbatch, "max_over_ranks", lambda value, env: value)
    env = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    spec = {"capacity_gib": 10, "fixed_gib": 1, "policy_per_sample_gib": PER_SAMPLE,
            "step_seconds": {"none": 1, "selective_op": 1.2, "selective_op_lean": 2.5, "full": 3}}
    predicted = {name: microbatch.Predicted(*value) for name, value in _predicted(SPEEDS).items()}
    margin = Config().train.auto_micro_batch_margin
    assert 9.4 <= 10 * (1 - margin)

    def search(margin: float) -> MicroBatchChoice:
        model = torch.nn.Linear(2, 2)
        return microbatch.search_micro_batch(model, torch.optim.AdamW(model.parameters()), fsdp=None, per_rank=8,
                                             seq_len=4, vocab_size=16, grad_clip=1.0, margin=margin, compile=False,
                                             env=env, probe=FakeProbe(spec, 0), switch=CheckpointSwitch(),
                                             predicted=predicted)

    choice = search(margin)
    assert (choice.checkpointing, choice.micro_batch_size) == ("none", 4)
    assert choice.measured_gib == {1: pytest.approx(3.1), 4: pytest.approx(9.4)}
    assert choice.estimated_first == "none@4" and choice.skipped == ["none@8"]
    assert choice.tokens_per_s == {"none@4": 128.0, "selective_op_lean@8": pytest.approx(102.4)}
    lines = describe_choice(choice, SimpleNamespace(
        train=SimpleNamespace(micro_batch_size="auto", global_batch_size=8, auto_micro_batch_margin=margin),
        fsdp=SimpleNamespace(activation_checkpointing="auto")), world_size=1)
    assert lines[0] == (
        "fsdp.activation_checkpointing=auto: tried none: micro-batch 1: 3.10 GiB, 4: 9.40 GiB; selective_op: "
        "micro-batch 2: 3.20 GiB, 4: 5.40 GiB; selective_op_lean: micro-batch 4: 4.60 GiB, 8: 8.20 GiB; the estimate "
        "put none@4 first and skipped none@8 (predicted over the budget by more than 10%); timed none@4 128 tokens/s "
        "per rank, selective_op_lean@8 102 tokens/s per rank: the most tokens/s is none@4")
    assert lines[1].startswith("train.micro_batch_size=auto and fsdp.activation_checkpointing=auto: micro-batch 4 "
                               "(gradient accumulation 2 on 1 ranks), activation checkpointing none; ")
    assert lines[1].endswith(", margin 0.05); search: 6 memory trials, 2 timed, 0 s")
    old = search(0.1)
    assert (old.checkpointing, old.micro_batch_size, old.tokens_per_s) == ("selective_op_lean", 8, {})
    assert old.measured_gib == {4: pytest.approx(4.6), 8: pytest.approx(8.2)}


def test_the_first_step_runs_the_first_policy_the_estimate_fits_where_none_would_run_out_of_memory(monkeypatch):
    # A model that fills the 10 GiB GPU: 8.5 GiB that no micro-batch changes, so none@1 needs 10.6 GiB (on a GPU its
    # step runs out of memory), selective_op@1 9.6 (over the 9.5 GiB budget), selective_op_lean@1 9.4 and full@1 9.2
    # fit, as the estimate says. The search's first step, which allocates the optimizer state, runs
    # selective_op_lean, the first policy the estimate puts within the budget; no policy that keeps more ever runs.
    from fsdp_utils.parallel.parallelize import CheckpointSwitch
    from fsdp_utils.train import microbatch

    switch, steps = CheckpointSwitch(), []

    def step(model, optimizer, batches, **kwargs):  # the GPU's memory, as a formula of the policy and micro-batch
        size = next(iter(batches))[0].shape[0]
        steps.append(f"{switch.policy.name}@{size}")
        if 8.5 + PER_SAMPLE[switch.policy.name] * size > 10:
            raise torch.OutOfMemoryError(f"{steps[-1]} does not fit")

    monkeypatch.setattr(microbatch, "train_step", step)
    monkeypatch.setattr(microbatch, "max_over_ranks", lambda value, env: value)
    env = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    spec = {"capacity_gib": 10, "fixed_gib": 8.5, "policy_per_sample_gib": PER_SAMPLE,
            "step_seconds": {"none": 1, "selective_op": 1.2, "selective_op_lean": 2.5, "full": 3}}
    peaks = {f"{p}@{b}": 8.5 + per_sample * b for p, per_sample in PER_SAMPLE.items() for b in (1, 2, 4, 8)}
    predicted = {name: microbatch.Predicted(*value) for name, value in _predicted(SPEEDS, peaks).items()}
    model = torch.nn.Linear(2, 2)
    choice = microbatch.search_micro_batch(model, torch.optim.AdamW(model.parameters()), fsdp=None, per_rank=8,
                                           seq_len=4, vocab_size=16, grad_clip=1.0, margin=0.05, compile=False,
                                           env=env, probe=FakeProbe(spec, 0), switch=switch, predicted=predicted)
    assert steps[0] == "selective_op_lean@1" and not any(s.startswith(("none@", "selective_op@")) for s in steps)
    assert (choice.checkpointing, choice.micro_batch_size) == ("selective_op_lean", 1)


def test_a_policy_keeping_more_than_the_first_steps_only_where_the_estimate_fits_it():
    # The estimate need not grow with the micro-batch: a step of one micro-batch holds no gradients between them. Here
    # none@1 (two micro-batches) is predicted at 10.6 GiB and none@2 (one) at 9.8, the fastest and within the estimate's
    # error of the 9.5 GiB budget. The first step ran selective_op (none@1 over the budget): none has nothing measured,
    # and no size of it the estimate puts within the budget, so it is never run (none@1 would not fit the GPU).
    import collections

    from fsdp_utils.train.microbatch import Predicted, _Ranking

    peaks = {**PEAKS, "none": {1: 10.6, 2: 9.8, 4: 12.0, 8: 18.0}}
    trials = _PairTrials(peaks, collections.defaultdict(lambda: 1000.0))
    gib = {f"none@{b}": v for b, v in peaks["none"].items()}
    predicted = {name: Predicted(*value) for name, value in _predicted({"none@2": 2000}, gib).items()}
    ranking = _Ranking(trials, auto_policies(2), [1, 2, 4, 8], predicted, budget=9.5 * GiB, resident=1.0 * GiB,
                       tried={}, speeds={}, first=CheckpointPolicy("selective_op"))
    assert pair_name(*ranking.ranked[0]) == "none@2"
    fitting = ranking.run()
    assert not any(step.endswith(("none@1", "none@2")) for step in trials.ran) and fitting


def test_without_an_estimate_the_search_measures_in_its_own_order(caplog):
    # A GPU the planner does not know (the tests' fake one): no estimate, the search as before (logged).
    from config import load_config
    from fsdp_utils.train.microbatch import search_estimate

    cfg = load_config(ROOT / "config/train1B_fsdp.yaml", [])
    env = SimpleNamespace(world_size=2, local_world_size=2, is_main=True)
    with caplog.at_level("INFO"):
        assert search_estimate(cfg, env, gpu="fake", vocab_size=32000, policies=auto_policies(2)) is None
    assert "the estimate does not order the search: it does not know the fake" in caplog.text
    predicted = search_estimate(cfg, env, gpu="NVIDIA H100 80GB HBM3", vocab_size=32000, policies=auto_policies(2))
    assert predicted is not None and set(predicted) == {f"{p.name}@{b}" for p in auto_policies(2) for b in divisors(32)}


# The 8B preset's trials on 2 x H200 (benchmarks/records/2026-11-28-2xh200-search-choice-against-grids-8b-and-1b.md
# and the two records before it: the reserved peaks of every pair the searches ran, GiB); pairs no record ran read
# their estimate. 138.0 GiB usable of each card.
EIGHT_B_PEAKS = {"none": {1: 81.87, 2: 87.63, 8: 124.01}, "selective_op": {8: 99.2, 16: 128.05},
                 "selective_op_lean": {8: 86.15, 16: 102.48, 32: 135.57}, "full": {16: 83.07, 32: 96.86}}


def _eight_b_on_two_h200() -> dict:
    from fsdp_utils.train.microbatch import Predicted
    from fsdp_utils.train.planning import Cluster, config_estimates, gpu_spec

    cfg = load_config(ROOT / "config/train8B_fsdp.yaml", ["--model.vocab_size=128256"])
    estimates = config_estimates(cfg, Cluster(gpu_spec("h200"), 2), policies=[p.name for p in auto_policies(2)])
    return {f"{p}@{b}": Predicted(e.memory.reserved, e.speed.tokens_per_s) for (p, b), e in estimates.items()}


@pytest.mark.parametrize(("margin", "reached"), [(None, True), (0.1, False)])
def test_the_8b_preset_on_two_h200_tries_selective_op_at_16_within_the_cards_memory(margin, reached):
    # The estimate of the 8B preset (vocabulary 128,256) on 2 x H200 puts none@8 first and selective_op@16 second
    # (torchtitan's plan); none@16, none@32 and selective_op@32 are predicted far over any budget. Run against the
    # records' trial peaks: none@8 (124.01 GiB) and selective_op@16 (128.05) both fit the budget of the default
    # margin, each is timed, and the faster trains. With the margin of 0.1 (124.2 GiB) selective_op@16 is over:
    # the search the records ran, which never timed it.
    from config import Config
    from fsdp_utils.train.microbatch import _Ranking

    predicted = _eight_b_on_two_h200()
    peaks = {p: {b: EIGHT_B_PEAKS[p].get(b, predicted[f"{p}@{b}"].gib) for b in divisors(32)} for p in EIGHT_B_PEAKS}
    margin = Config().train.auto_micro_batch_margin if margin is None else margin
    trials = _PairTrials(peaks, {"none@8": 14_773.0, "selective_op@16": 15_200.0, "selective_op_lean@16": 13_460.0},
                         capacity=138.0)
    trials.use(auto_policies(2)[0])
    ranking = _Ranking(trials, auto_policies(2), divisors(32), predicted, budget=138.0 * (1 - margin) * GiB,
                       resident=60 * GiB, tried={}, speeds={})
    assert [pair_name(*pair) for pair in ranking.ranked[:2]] == ["none@8", "selective_op@16"]
    assert ranking.skipped == ["none@16", "none@32", "selective_op@32"]
    fitting = ranking.run()
    best = max(fitting, key=lambda pair: ranking.speeds.get(pair_name(pair[0], pair[1]), 0.0))
    if reached:  # 128.05 GiB of 138.0 GiB: within a margin of 0.072 or less
        assert trials.ran[:7] == ["measure none@1", "measure none@2", "measure none@8", "time none@8",
                                  "measure selective_op@8", "measure selective_op@16", "time selective_op@16"]
        assert pair_name(*best[:2]) == "selective_op@16"
    else:
        assert "time selective_op@16" not in trials.ran and pair_name(*best[:2]) == "none@8"

def test_a_pair_timed_right_after_a_whole_step_trial_takes_no_warm_up_step(monkeypatch):
    # A memory trial that ran the pair's whole step (accumulation 2 or less) warmed it up (its graphs, kernels and
    # allocator blocks); after a trial of part of the step, or after anything else, a step warms up first. Steps
    # are counted through train_step.
    from fsdp_utils.train import microbatch

    steps = []
    monkeypatch.setattr(microbatch, "train_step", lambda *a, grad_accum, **k: steps.append(grad_accum))
    probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, "per_sample_gib": 1}, 0)
    env = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    monkeypatch.setattr(microbatch, "max_over_ranks", lambda value, env: value)
    trials = microbatch._Trials(torch.nn.Linear(2, 2), None, fsdp=None, per_rank=8, seq_len=4, vocab_size=16,
                                grad_clip=1.0, compile=False, env=env, probe=probe, switch=None)  # a stand-in step
    trials.measure(4)
    assert steps == [2]  # a memory trial: up to two micro-batches
    assert trials.tokens_per_s(4) == 8 * 4 / (1 / 4) and steps == [2, 2]  # one timed step, accumulation 2
    assert trials.tokens_per_s(4) and steps == [2, 2, 2, 2]  # after a timed step: a warm-up step first
    trials.measure(2)
    trials.measure(4)
    trials.tokens_per_s(2)
    assert steps[-3:] == [2, 4, 4]  # not the last trial's size: warm-up, then the timed step
    trials.measure(2)
    trials.tokens_per_s(2)
    assert steps[-3:] == [2, 4, 4]  # the trial ran 2 of the step's 4 micro-batches: warm-up, then the timed step


def test_the_trials_train_at_learning_rate_zero_and_leave_the_weights_bit_for_bit(monkeypatch):
    # Each trial runs a real AdamW step (weight decay on): at learning rate 0 the weights stay, bit for bit, with
    # no copy of them kept; the rate and an empty state are back afterwards. An optimizer that moves the weights
    # anyway is caught by the fingerprint, as an error rather than a run that trains from other weights.
    from fsdp_utils.train import microbatch

    def adamw_step(model, optimizer, batches, *, grad_accum, **kwargs):
        for x, _ in (next(batches) for _ in range(grad_accum)):
            model(x.float()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    monkeypatch.setattr(microbatch, "max_over_ranks", lambda value, env: value)
    env = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def search():
        probe = FakeProbe({"capacity_gib": 10, "fixed_gib": 1, "per_sample_gib": 1}, 0)
        return microbatch.search_micro_batch(model, optimizer, fsdp=None, per_rank=8, seq_len=4, vocab_size=16,
                                             grad_clip=1.0, margin=0.1, compile=False, env=env, probe=probe)

    monkeypatch.setattr(microbatch, "train_step", adamw_step)
    assert search().micro_batch_size == 8
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert optimizer.param_groups[0]["lr"] == 0.1 and not optimizer.state

    def moves_the_weights(model, optimizer, batches, *, grad_accum, **kwargs):
        with torch.no_grad():
            model.weight.add_(1e-3)

    monkeypatch.setattr(microbatch, "train_step", moves_the_weights)
    with pytest.raises(RuntimeError, match="the trial steps changed the weights"):
        search()


def test_climb_nothing_fits():
    best, measured = climb([1, 2, 4], budget=10, resident=8, measure=lambda b: 12.0)
    assert best is None and measured == {1: 12.0}


def test_fake_probe_reads_per_rank_values():
    spec = {"capacity_gib": 8, "fixed_gib": 1, "per_sample_gib": [0.5, 2], "table_gib": {"4": 7}}
    rank0, rank1 = FakeProbe(spec, 0), FakeProbe(spec, 1)
    for probe in (rank0, rank1):
        probe.begin(2)
    assert rank0.peak_reserved() == 2 * GiB and rank1.peak_reserved() == 5 * GiB  # 1 + 0.5 * 2, 1 + 2 * 2
    rank1.begin(4)
    assert rank1.peak_reserved() == 7 * GiB and rank1.allocated() == 1 * GiB and rank1.capacity() == 8 * GiB


def test_cache_round_trip_and_replace(tmp_path):
    key_a, key_b = {"model": {"dim": 64}, "gpu": "H100"}, {"model": {"dim": 64}, "gpu": "H200"}
    save_to_cache(tmp_path, key_a, MicroBatchChoice(16, "search", {1: 2.0, 16: 30.5}, 79.0, 71.1, 12.0))
    save_to_cache(tmp_path, key_b, MicroBatchChoice(32, "search", {1: 2.0, 32: 60.0}, 139.0, 125.1, 10.0))
    save_to_cache(tmp_path, key_a, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0))  # replaces
    entries = json.loads((tmp_path / CACHE_FILE).read_text())["entries"]
    assert [(e["key"]["gpu"], e["micro_batch_size"]) for e in entries] == [("H200", 32), ("H100", 8)]
    assert read_cache(tmp_path, key_a)["measured_gib"] == {"1": 2.0, "8": 20.0}
    assert read_cache(tmp_path, {"gpu": "A100"}) is None
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert read_cache(tmp_path, key_a) is None  # unreadable: searched again, not a crash
    kept = {}
    for damaged in ('{"entries": [1]}', '{"entries": 1}', "[]"):  # JSON, not a cache: kept aside for this run's entry
        (tmp_path / CACHE_FILE).write_text(damaged)
        assert read_cache(tmp_path, key_a) is None
        save_to_cache(tmp_path, key_a, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0))
        assert read_cache(tmp_path, key_a)["micro_batch_size"] == 8
        kept[f"kept-{len(kept) + 1}-{CACHE_FILE}" if kept else f"kept-{CACHE_FILE}"] = damaged
    assert {name: (tmp_path / name).read_text() for name in kept} == kept


@pytest.mark.parametrize("override", ["--train.float8_output=true", "--train.lora.rank=4", "--train.compile=true",
                                      "--train.loss_chunk_tokens=64", "--fsdp.activation_checkpointing=full"])
def test_a_cached_choice_is_not_reused_by_a_run_of_other_memory(override):
    def key(*overrides):
        cfg = load_config(TINY_PRESET, ["--train.micro_batch_size=auto", "--data.seq_len=32", *overrides])
        return cache_key(cfg, model_signature={"dim": cfg.model.dim}, world_size=2, gpu="H100", precision="bf16")

    plain = key()
    assert key(override) != plain
    assert "float8_output" not in plain and "lora" not in plain  # the entries of runs before these options still match


@pytest.mark.parametrize("field, value", [("micro_batch_size", 0), ("micro_batch_size", -4), ("micro_batch_size", "8"),
                                          ("micro_batch_size", 3), ("measured_gib", {"8": "a lot"}),
                                          ("measured_gib", {"0": 1.0}), ("budget_gib", -1), ("capacity_gib", None),
                                          ("activation_checkpointing", "auto"), ("activation_checkpointing", None)])
def test_a_cache_entry_with_bad_values_is_ignored_with_a_warning(tmp_path, caplog, field, value):
    # per-rank batch 16 // 2 = 8: micro-batch 3 does not divide it
    key = {"model": {"dim": 64}, "gpu": "H100", "global_batch_size": 16, "world_size": 2}
    auto_ac = field == "activation_checkpointing"  # the entry of an fsdp.activation_checkpointing=auto run
    if auto_ac:
        key["fsdp"] = {"activation_checkpointing": "auto"}
    save_to_cache(tmp_path, key, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0,
                                                  checkpointing="selective_op" if auto_ac else None))
    assert read_cache(tmp_path, key)["micro_batch_size"] == 8
    doc = json.loads((tmp_path / CACHE_FILE).read_text())
    doc["entries"][0][field] = value
    (tmp_path / CACHE_FILE).write_text(json.dumps(doc))
    with caplog.at_level("WARNING"):
        assert read_cache(tmp_path, key) is None  # searched again, as without a cache
    assert CACHE_FILE in caplog.text and field in caplog.text


# ---- config -----------------------------------------------------------------------------------------


def test_config_accepts_auto_and_rejects_other_words():
    cfg = load_config(TINY_PRESET, ["--train.micro_batch_size=auto", "--train.global_batch_size=16"])
    assert cfg.train.micro_batch_size == "auto"
    assert check_batch_split(cfg.train, 2) is None  # known after the measurement
    assert check_batch_split(cfg.train, 2, micro_batch=4) == 2  # 16 / (4 * 2)
    with pytest.raises(ConfigError) as info:
        load_config(TINY_PRESET, ["--train.micro_batch_size=max", "--train.auto_micro_batch_margin=1.5"])
    assert info.value.problems == ["train.micro_batch_size must be a positive integer or auto, got 'max'",
                                   "train.auto_micro_batch_margin must be in [0, 1), got 1.5"]


def test_the_split_is_derived_from_the_config_and_refused_when_not_whole():
    cfg = load_config(TINY_PRESET, ["--train.micro_batch_size=auto", "--train.global_batch_size=16"])
    split = BatchSplit.from_config(cfg.train, 2, 4)
    assert (split.per_rank, split.grad_accum) == (8, 2)  # 16 / 2 ranks, then 8 / 4
    with pytest.raises(ConfigError) as info:
        BatchSplit.from_config(cfg.train, 2, 3)  # 16 % (3 * 2) = 4
    assert info.value.problems == [
        "train.global_batch_size=16 is not divisible by train.micro_batch_size * world size = 3 * 2 = 6; pick a "
        "global batch that is a multiple of 6"]


def test_auto_needs_a_global_batch_that_splits_over_the_ranks():
    cfg = load_config(TINY_PRESET, ["--train.micro_batch_size=auto", "--train.global_batch_size=16"])
    with pytest.raises(ConfigError) as info:
        check_batch_split(cfg.train, 3)
    assert info.value.problems == [
        "train.global_batch_size=16 is not divisible by the world size 3 (train.micro_batch_size=auto splits each "
        "rank's share of it); pick a multiple of 3"]


# ---- end to end: auto -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_auto_agrees_across_ranks_and_trains_like_the_same_micro_batch_by_hand(version, corpus, dataset_dir, tmp_path):
    # Global batch 16 on 2 ranks: per-rank batch 8, candidates 1, 2, 4, 8. Budget 10 * (1 - 0.05) = 9.5 GiB.
    # Rank 0 alone (1 + 1 * b) would take 8 (bound 1 + 1 * 8 = 9); rank 1's readings (1 + 2.5 * b) are
    # higher, and the MAX over ranks decides for both: from b = 1 (3.5) the bound 1 + 2.5 c <= 9.5 allows
    # c = 2 (6.0), and from there 1 + 5 * 2 = 11 > 9.5 stops: micro-batch 2 on both ranks.
    common = ["--train.global_batch_size=16", "--train.max_steps=4", f"--fsdp.version={version}"]
    auto = run_train(*common, "--train.micro_batch_size=auto", nproc=2, out_dir=tmp_path / "auto", corpus=corpus,
                     dataset_dir=dataset_dir, faults=fake_memory(10, 1, [1, 2.5]))
    assert "train.micro_batch_size=auto: micro-batch 2 (gradient accumulation 4 on 2 ranks)" in auto.stderr
    assert "micro-batch 1: 3.50 GiB, 2: 6.00 GiB" in auto.stderr  # the max over ranks, as measured
    run_train(*common, "--train.micro_batch_size=2", nproc=2, out_dir=tmp_path / "by_hand", corpus=corpus,
              dataset_dir=dataset_dir)
    # The trial steps ran real optimizer steps; the weights and optimizer state were restored, and the
    # data order and RNG never touched: bit for bit the same losses.
    assert losses(tmp_path / "auto") == losses(tmp_path / "by_hand")
    (entry,) = json.loads((tmp_path / "auto" / CACHE_FILE).read_text())["entries"]
    assert entry["micro_batch_size"] == 2 and entry["key"]["world_size"] == 2 and entry["key"]["gpu"] == "fake"
    assert entry["measured_gib"] == {"1": 3.5, "2": 6.0}


@pytest.mark.slow
def test_auto_result_is_cached_and_reused_on_resume(corpus, dataset_dir, tmp_path):
    out = tmp_path / "out"
    memory = fake_memory(10, 1, 1)  # 1 + b GiB, budget 9.5: the largest candidate 8 fits (bound 9 <= 9.5)
    args = ["--train.global_batch_size=8", "--train.micro_batch_size=auto", "--checkpoint.interval=2"]
    first = run_train(*args, "--train.max_steps=2", out_dir=out, corpus=corpus, dataset_dir=dataset_dir, faults=memory)
    assert "measuring trial steps" in first.stderr
    assert "micro-batch 8 (gradient accumulation 1 on 1 ranks)" in first.stderr
    # Resumed (auto_resume) with different readings: the cache answers, no trial step runs.
    second = run_train(*args, "--train.max_steps=4", out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                       faults=fake_memory(10, 1, 5))
    assert "measuring trial steps" not in second.stderr
    assert re.search(r"micro-batch 8 \(gradient accumulation 1\), from .*microbatch_cache.json .*; no search",
                     second.stderr)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    # A different world size is another entry: searched again.
    third = run_train(*args, "--train.max_steps=6", nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                      faults=memory)
    assert "measuring trial steps" in third.stderr
    sizes = [e["key"]["world_size"] for e in json.loads((out / CACHE_FILE).read_text())["entries"]]
    assert sizes == [1, 2]


@pytest.mark.slow
def test_auto_on_the_cpu_uses_the_fallback(corpus, dataset_dir, tmp_path):
    proc = run_train("--train.global_batch_size=12", "--train.micro_batch_size=auto", "--train.auto_micro_batch_cpu=5",
                     *ONE_STEP, out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir)
    # Divisors of 12 up to 5: 4.
    assert ("train.micro_batch_size=auto on the CPU (no GPU memory to measure): micro-batch 4, the largest divisor of "
            "the per-rank batch 12 up to train.auto_micro_batch_cpu=5") in proc.stderr
    assert "grad accumulation 3, micro-batch 4," in proc.stderr
    assert not (tmp_path / "out" / CACHE_FILE).exists()


@pytest.mark.slow
def test_auto_when_nothing_fits_is_one_error_line(corpus, dataset_dir, tmp_path):
    proc = run_train("--train.micro_batch_size=auto", *ONE_STEP, out_dir=tmp_path / "out", corpus=corpus,
                     dataset_dir=dataset_dir, faults=fake_memory(4, 3, 1), check=False)
    assert proc.returncode == 1
    # 3 + 1 * 1 = 4 GiB at micro-batch 1 against a budget of 4 * 0.95 = 3.8.
    assert error_lines(proc) == [
        "error: train.micro_batch_size=auto: even micro-batch 1 peaks at 4.00 GiB, over the budget of 3.80 GiB "
        "(4.00 GiB usable, train.auto_micro_batch_margin=0.05); turn on fsdp.activation_checkpointing, use more GPUs, "
        "or shorten data.seq_len"]
    assert "Traceback" not in proc.stderr


# ---- end to end: fsdp.activation_checkpointing=auto -------------------------------------------------

# Budget 10 * 0.95 = 9.5 GiB of a 10 GiB GPU, 1 GiB resident, per-rank batch 8 (candidates 1, 2, 4, 8). Per sample:
# none 3 GiB (fits 2: 7 GiB); selective_op 1.5 (starts at none's 2: 4 GiB, then 4: 7, fits; 8 predicted at 13);
# selective_op_lean 1.2 (starts at selective_op's 4: 5.8; its line through 2 puts 8 at 10.6, over the GPU itself);
# full 0.9 (starts at 4: 4.6, then 8: 8.2, fits).
# A timed step takes step_seconds / micro-batch: none@2 0.5 s, selective_op@4 0.25 s, full@8 0.375 s; so
# selective_op@4 trains the most tokens/s (8 sequences of 32 tokens a step).
AC_MEMORY = {"policy_per_sample_gib": {"none": 3, "selective_op": 1.5, "selective_op_lean": 1.2, "full": 0.9},
             "step_seconds": {"none": 1, "selective_op": 1, "full": 3}}


@pytest.mark.slow
def test_auto_checkpointing_trains_the_fastest_pair_that_fits_like_it_by_hand_and_caches_it(corpus, dataset_dir,
                                                                                          tmp_path):
    common = ["--train.global_batch_size=8", "--checkpoint.interval=2"]
    auto = ["--train.micro_batch_size=auto", "--fsdp.activation_checkpointing=auto"]
    out = tmp_path / "auto"
    first = run_train(*common, *auto, "--train.max_steps=2", out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                      faults=fake_memory(10, 1, 1, **AC_MEMORY))
    # Each policy after none starts at the largest size a policy keeping at least as much fit and runs a larger
    # size only where its line predicts a fit: selective_op_lean at 8 (10.6 GiB) would be over the 10 GiB
    # capacity, an out-of-memory error on a GPU (and in the fake probe), so it never runs.
    assert ("fsdp.activation_checkpointing=auto: tried none: micro-batch 1: 4.00 GiB, 2: 7.00 GiB; selective_op: "
            "micro-batch 2: 4.00 GiB, 4: 7.00 GiB; selective_op_lean: micro-batch 2: 3.40 GiB, 4: 5.80 GiB; "
            "full: micro-batch 4: 4.60 GiB, 8: 8.20 GiB; timed "
            "none@2 512 tokens/s per rank, selective_op@4 1,024 tokens/s per rank, full@8 683 tokens/s per rank: "
            "the most tokens/s is selective_op@4") in first.stderr
    assert "micro-batch 4, activation checkpointing selective_op," in first.stderr
    # A GPU the planner does not know (the fake one): the search in its own order, and no estimate at the start.
    assert "the estimate does not order the search: it does not know the fake" in first.stderr
    assert "estimate: none for the fake (the planner knows h100, h200" in first.stderr
    (entry,) = json.loads((out / CACHE_FILE).read_text())["entries"]
    assert entry["micro_batch_size"] == 4 and entry["activation_checkpointing"] == "selective_op"
    assert entry["tokens_per_s"] == {"none@2": 512, "selective_op@4": 1024, "full@8": 683}
    # Resumed with other readings: the cache answers, policy included; no trial step runs.
    second = run_train(*common, *auto, "--train.max_steps=4", out_dir=out, corpus=corpus, dataset_dir=dataset_dir,
                       faults=fake_memory(10, 1, 5))
    assert "measuring trial steps" not in second.stderr
    assert "micro-batch 4 (gradient accumulation 2), activation checkpointing selective_op, from" in second.stderr
    # The trial steps of every policy left no trace: the same losses as the chosen pair set by hand.
    run_train(*common, "--train.micro_batch_size=4", "--fsdp.activation_checkpointing=selective_op",
              "--train.max_steps=4", out_dir=tmp_path / "by_hand", corpus=corpus, dataset_dir=dataset_dir)
    assert losses(out) == losses(tmp_path / "by_hand")


@pytest.mark.slow
def test_the_search_in_the_estimates_order_agrees_across_ranks_and_trains_like_its_pair_by_hand(corpus, dataset_dir,
                                                                                                tmp_path):
    # The fake GPU named as an H100 the planner knows, bf16: the estimate orders the search (rank 0's, on both ranks).
    # 2 ranks of 4 sequences; AC_MEMORY's readings on 10 GiB (budget 9.5): none fits 2, selective_op 4 (7 GiB),
    # selective_op_lean 4 (5.8), full 4 (4.6); a step at micro-batch 4 takes 1 s with selective_op, 1.5 with
    # selective_op_lean, 3 with full: selective_op@4 trains the most tokens/s, and the losses are its own by hand.
    common = ["--train.global_batch_size=8", "--train.precision=bf16", "--train.max_steps=2"]
    memory = fake_memory(10, 1, 1, **{**AC_MEMORY, "step_seconds": {"none": 1, "selective_op": 1,
                                                                    "selective_op_lean": 1.5, "full": 3}},
                         name="NVIDIA H100 80GB HBM3")
    auto = run_train(*common, "--train.micro_batch_size=auto", "--fsdp.activation_checkpointing=auto", nproc=2,
                     out_dir=tmp_path / "auto", corpus=corpus, dataset_dir=dataset_dir, faults=memory)
    assert "the estimate put " in auto.stderr and "the estimate does not order" not in auto.stderr
    assert "micro-batch 4 (gradient accumulation 1 on 2 ranks), activation checkpointing selective_op;" in auto.stderr
    (entry,) = json.loads((tmp_path / "auto" / CACHE_FILE).read_text())["entries"]
    assert entry["tokens_per_s"]["selective_op@4"] == max(entry["tokens_per_s"].values())
    assert not any(pair.startswith("none@") for pair in entry["tokens_per_s"])
    assert entry["tried_gib"]["none"] == {"1": 4.0, "2": 7.0}  # none@4 (13 GiB) predicted over by its line
    run_train(*common, "--train.micro_batch_size=4", "--fsdp.activation_checkpointing=selective_op", nproc=2,
              out_dir=tmp_path / "by_hand", corpus=corpus, dataset_dir=dataset_dir)
    assert losses(tmp_path / "auto") == losses(tmp_path / "by_hand")


@pytest.mark.slow
def test_auto_checkpointing_at_a_set_micro_batch_takes_the_first_policy_that_fits(corpus, dataset_dir, tmp_path):
    # Micro-batch 4 on a 10 GiB GPU: none would need 13 GiB, more than there is, so it never runs: the trials climb
    # to 4 through its divisors, as the auto search does. none's line through 1 and 2 puts 4 at 13, over the budget
    # of 9; selective_op starts at 2, where none fit, and reaches 4 at 7 GiB: selective_op, without timing.
    at_4 = ["--train.global_batch_size=8", "--train.micro_batch_size=4", "--fsdp.activation_checkpointing=auto"]
    proc = run_train(*at_4, *ONE_STEP, out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir,
                     faults=fake_memory(10, 1, 1, **AC_MEMORY))
    assert ("fsdp.activation_checkpointing=auto: tried none: micro-batch 1: 4.00 GiB, 2: 7.00 GiB; selective_op: "
            "micro-batch 2: 4.00 GiB, 4: 7.00 GiB; selective_op recomputes the least of the policies that fit "
            "micro-batch 4\n") in proc.stderr
    assert "grad accumulation 2, micro-batch 4, activation checkpointing selective_op," in proc.stderr
    # Nothing fits micro-batch 4, full checkpointing included: one error line, with full's figure for 4 predicted
    # from its trials at 2 and 1 (4 itself is never run).
    tight = {"policy_per_sample_gib": {"none": 1, "selective_op": 0.98, "selective_op_lean": 0.96,
                                       "full": 0.9}}

    def failure(out: str, faults: dict) -> list[str]:
        proc = run_train(*at_4, *ONE_STEP, out_dir=tmp_path / out, corpus=corpus, dataset_dir=dataset_dir,
                         faults=faults, check=False)
        assert proc.returncode == 1
        return error_lines(proc)

    assert failure("out2", fake_memory(4.8, 1, 1, **tight)) == [
        "error: fsdp.activation_checkpointing=auto: with full activation checkpointing, micro-batch 4 is predicted at "
        "4.60 GiB from the trials at micro-batch 1: 1.90 GiB, 2: 2.80 GiB, over the budget of 4.56 GiB (4.80 GiB "
        "usable, train.auto_micro_batch_margin=0.05); set a smaller train.micro_batch_size (or auto), use more GPUs, "
        "or shorten data.seq_len"]
    # Micro-batch 1 without checkpointing needs more than the GPU has: the first trial runs out of memory. One error
    # line, which names the way around it (the margin plays no part at the smallest size).
    assert failure("out3", fake_memory(3, 1, 1, **AC_MEMORY)) == [
        "error: fsdp.activation_checkpointing=auto: a trial step at micro-batch 1 with activation checkpointing none "
        "ran out of memory (CUDA out of memory (fake: 4.00 GiB needed, 3.00 GiB there)); set "
        "fsdp.activation_checkpointing=full by hand, use more GPUs, or shorten data.seq_len"]


@pytest.mark.slow
def test_auto_checkpointing_on_the_cpu_is_none(corpus, dataset_dir, tmp_path):
    proc = run_train("--fsdp.activation_checkpointing=auto", *ONE_STEP, out_dir=tmp_path / "out",
                     corpus=corpus, dataset_dir=dataset_dir)
    assert "fsdp.activation_checkpointing=auto on the CPU (no GPU memory to measure): none" in proc.stderr
    assert "activation checkpointing none," in proc.stderr


# ---- the hint ---------------------------------------------------------------------------------------

HINT = "hint: the first steps used at most"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["low_memory_accumulating", "high_memory", "no_accumulation", "auto"])
def test_hint_only_when_memory_is_mostly_unused_and_gradients_accumulate(case, corpus, dataset_dir, tmp_path):
    # One process, global batch 8. Readings 1 + 0.5 * b GiB: micro-batch 2 uses 2 GiB.
    micro_batch, capacity = {"low_memory_accumulating": (2, 100), "high_memory": (2, 6), "no_accumulation": (8, 100),
                             "auto": ("auto", 100)}[case]
    # auto: micro-batch 8 reads 99 GiB (over the 95 GiB budget), so auto keeps 1 with accumulation 8 and
    # 1.5 GiB used: the hint's condition, but auto measured already; it stays quiet.
    memory = fake_memory(capacity, 1, 0.5, table_gib={"8": 99} if case == "auto" else {})
    proc = run_train(f"--train.micro_batch_size={micro_batch}", "--train.max_steps=3", out_dir=tmp_path / "out",
                     corpus=corpus, dataset_dir=dataset_dir, faults=memory)
    hints = [line for line in proc.stderr.splitlines() if HINT in line]
    if case == "auto":
        assert "micro-batch 1 (gradient accumulation 8 on 1 ranks)" in proc.stderr
    if case == "low_memory_accumulating":  # 2 GiB < 100 / 4, accumulation 4
        assert len(hints) == 1 and hints[0].endswith(
            "hint: the first steps used at most 2.00 GiB of this GPU's 100.00 GiB with micro-batch 2 and gradient "
            "accumulation 4: a larger train.micro_batch_size (up to 8), or auto, would likely train faster on the same "
            "samples")
    else:  # 2 GiB >= 6 / 4; accumulation 1; auto measured already
        assert hints == []


# ---- out of memory during training --------------------------------------------------------------------


@pytest.mark.slow
def test_out_of_memory_without_retry_is_one_error_line(corpus, dataset_dir, tmp_path):
    proc = run_train("--train.max_steps=4", out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir,
                     check=False, faults={"oom": "3:backward", **fake_memory(80, 1, 0.5)})
    assert proc.returncode == 1
    (line,) = error_lines(proc)
    # The figures come from the (fake) GPU readings: 1 GiB allocated, 1 + 0.5 * 2 reserved and at peak.
    assert line.startswith("error: out of memory at step 3 (training, micro-batch 2 x accumulation 4, rank 0): "
                           "1.00 GiB allocated, 2.00 GiB reserved (peak 2.00 GiB allocated) of 80.00 GiB; "
                           "CUDA out of memory")
    assert "set train.oom_retry_half=true" in line
    assert "Traceback" not in proc.stderr
    assert sorted(losses(tmp_path / "out")) == [1, 2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, dataset_dir):
    """Per FSDP version, losses of steps 1-5 on 2 ranks: steps 1-2 at micro-batch 2, then (resumed from the
    step-2 checkpoint, which resumes exactly) steps 3-5 at micro-batch 1: what a retry at step 3 must give."""
    def make(version: int) -> dict[int, float]:
        out = tmp_path_factory.mktemp(f"reference_fsdp{version}")
        common = [f"--fsdp.version={version}", "--checkpoint.interval=2"]
        run_train(*common, "--train.max_steps=2", nproc=2, out_dir=out, corpus=corpus, dataset_dir=dataset_dir)
        run_train(*common, "--train.max_steps=5", "--train.micro_batch_size=1", nproc=2, out_dir=out, corpus=corpus,
                  dataset_dir=dataset_dir)
        return losses(out)

    made: dict[int, dict[int, float]] = {}

    def get(version: int) -> dict[int, float]:
        if version not in made:
            made[version] = make(version)
        return made[version]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("version,where", [(1, "forward:2"), (1, "backward:2"), (2, "backward:2"), (2, "forward:1")])
def test_out_of_memory_retry_redoes_the_step_with_the_same_samples(version, where, reference, corpus, dataset_dir,
                                                                   tmp_path):
    # Out of memory at step 3 on both ranks, in the 2nd (or 1st) of the step's micro-batches, in forward or
    # backward. The retry drops the interrupted step, resets FSDP and redoes step 3 at micro-batch 1 (the
    # same 8 samples, accumulation 4): bit for bit the reference, so nothing of the interrupted attempt
    # (gradients accumulated without sync, FSDP's per-step state) leaked into the redone step.
    proc = run_train(f"--fsdp.version={version}", "--train.max_steps=5", "--train.oom_retry_half=true", nproc=2,
                     out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir,
                     faults={"oom": f"3:{where}"})
    assert proc.stderr.count("out of memory at step 3 (training, micro-batch 2 x accumulation 2") == 2  # each rank
    assert "train.oom_retry_half: redoing the training of step 3 with micro-batch 1 (accumulation 4" in proc.stderr
    assert losses(tmp_path / "out") == reference(version)


@pytest.mark.slow
def test_out_of_memory_retry_in_evaluation(corpus, dataset_dir, tmp_path):
    common = ["--train.max_steps=4", "--train.eval_interval=2", "--train.eval_samples=4"]
    run_train(*common, nproc=2, out_dir=tmp_path / "plain", corpus=corpus, dataset_dir=dataset_dir)
    proc = run_train(*common, "--train.oom_retry_half=true", nproc=2, out_dir=tmp_path / "retry", corpus=corpus,
                     dataset_dir=dataset_dir, faults={"oom": "2:eval"})
    assert "redoing the evaluation of step 2 with micro-batch 1" in proc.stderr

    def val(out):
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}

    # The same 4 validation sequences, as four batches of 1 instead of two of 2: equal up to float rounding.
    plain, retry = val(tmp_path / "plain"), val(tmp_path / "retry")
    assert plain.keys() == retry.keys() == {2, 4}
    assert all(retry[s] == pytest.approx(plain[s], rel=1e-5) for s in plain)
    # Training went on at micro-batch 1 (steps 3-4): same samples, so the same losses up to rounding.
    assert losses(tmp_path / "retry") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


@pytest.mark.slow
def test_out_of_memory_on_one_rank_only_stops_within_the_timeout(corpus, dataset_dir, tmp_path):
    # Rank 0 alone runs out; rank 1 is already waiting for it in the next all-gather. The retry's meeting
    # of the ranks times out after run.timeout_s, and the job ends with that said, not hung.
    proc = run_train("--train.max_steps=4", "--train.oom_retry_half=true", "--run.timeout_s=10", nproc=2,
                     out_dir=tmp_path / "out", corpus=corpus, dataset_dir=dataset_dir, check=False, timeout=120,
                     faults={"oom": "3:forward:1:0"})
    assert proc.returncode != 0
    (line,) = error_lines(proc)
    assert line.startswith("error: out of memory at step 3 (training, micro-batch 2 x accumulation 2, rank 0)")
    assert "Not every rank ran out of memory" in line and "so the step cannot be redone" in line


# ---- benchmark ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_benchmark_compares_a_fixed_micro_batch_with_auto_and_the_reference():
    # One process, global batch 8: readings 1 + 0.5 * b GiB all fit a 9.5 GiB budget, so auto takes 8 (x 1);
    # the fixed micro-batch 2 needs accumulation 4; the reference runs at the auto choice.
    pytest.importorskip("transformers")
    proc = run_job([str(WITH_FAULTS), str(ROOT / "benchmarks/benchmark.py"), str(TINY_PRESET), "--run.device=cpu",
                    "--model.dim=64", "--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                    "--train.global_batch_size=8", "--compare_auto", "--fixed_micro_batch=2", "--peer", "--steps=1",
                    "--warmup=1"], env=job_env(fault_env(fake_memory(10, 1, 0.5))), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:4] for line in proc.stdout.splitlines() if line.startswith(("ours", "hf_"))}
    assert rows["ours_mb2"] == ["2", "x", "4"]
    assert rows["ours_auto"] == ["8", "x", "1"] and rows["hf_llama_fsdp2"] == ["8", "x", "1"]
    # The Trainer's own description of the choice (describe_choice).
    assert "train.micro_batch_size=auto: micro-batch 8 (gradient accumulation 1 on 1 ranks)" in proc.stdout
    assert "ratio ours_auto / reference tokens/s:" in proc.stdout


@pytest.mark.slow
def test_benchmark_grid_runs_each_pair_at_the_global_batch_beside_the_search():
    # Both autos choose selective_op@4 (AC_MEMORY on a 10 GiB GPU); the grid's fixed pairs run at the same global
    # batch of 8, each with its ratio to ours and the fastest of them named.
    proc = run_job([str(WITH_FAULTS), str(ROOT / "benchmarks/benchmark.py"), str(TINY_PRESET), "--run.device=cpu",
                    "--model.dim=64", "--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                    "--train.global_batch_size=8", "--train.micro_batch_size=auto",
                    "--fsdp.activation_checkpointing=auto", "--grid", "none@2,full@8", "--steps=1", "--warmup=1"],
                   env=job_env(fault_env(fake_memory(10, 1, 1, **AC_MEMORY))), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:4] for line in proc.stdout.splitlines()
            if line.startswith(("ours", "grid_"))}
    assert rows == {"ours": ["4", "x", "2"], "grid_none@2": ["2", "x", "4"], "grid_full@8": ["8", "x", "1"]}
    assert "ratio grid_none@2 / ours tokens/s: " in proc.stdout and "ratio grid_full@8 / ours tokens/s: " in proc.stdout
    assert re.search(r"fastest of ours and the grid: (ours|grid_none@2|grid_full@8); ours / fastest tokens/s: "
                     r"[01]\.\d{3}\n", proc.stdout)



@pytest.mark.parametrize("flag", [False, True])
def test_the_benchmark_searches_without_the_estimate_when_asked(flag, monkeypatch):
    # benchmarks/benchmark.py --search_without_estimate: the search in its own order, for the comparison with the
    # search in the estimate's (the run is built through build_run, which passes it to the search).
    from benchmarks import benchmark

    seen = {}

    def build_run(cfg, env, **kwargs):
        seen.update(kwargs)
        raise ConfigError(["built"])

    monkeypatch.setattr(benchmark, "build_run", build_run)
    argv = [str(TINY_PRESET), *(["--search_without_estimate"] if flag else [])]
    args = benchmark.build_parser().parse_args(argv)
    cfg = load_config(TINY_PRESET, ["--train.micro_batch_size=auto", "--fsdp.activation_checkpointing=auto"])
    with pytest.raises(SystemExit, match="built"):
        benchmark.build_ours(cfg, SimpleNamespace(world_size=1, is_main=True), args, micro_batch="auto",
                             grad_accum=None)
    assert seen["search_estimate"] is not flag

def benchmark_main(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """benchmarks/benchmark.py's main() on the tiny preset with argv, in this process (the script's own start is
    tested where it runs): its exit status and what it printed to stderr. A run it would start fails the test."""
    from benchmarks import benchmark

    def no_run(**_):
        raise AssertionError("the benchmark started a run")

    monkeypatch.setattr(benchmark, "init_distributed", no_run)
    monkeypatch.setattr(benchmark, "prefer_expandable_segments", lambda: None)  # it would set this process's env
    for name in RANK_VARIABLES:  # a job of its own, as the script started alone would be
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["benchmark.py", str(TINY_PRESET), "--run.device=cpu",
                                      "--train.global_batch_size=8", *argv])
    status = benchmark.main()
    out, err = capsys.readouterr()
    assert "tok/s/gpu" not in out
    return status, err


@pytest.mark.parametrize("grid, error", [
    ("none@3", "error: --grid none@3: "),  # 3 does not divide the per-rank batch of 8
    ("sometimes@2", "error: --grid sometimes@2: fsdp.activation_checkpointing='sometimes' is not one of"),
    ("none", "--grid: 'none' is not POLICY@MICRO_BATCH"),
    ("none@٨", "--grid: 'none@٨' is not POLICY@MICRO_BATCH"),  # int() would read the Arabic-Indic 8 as 8
])
def test_benchmark_grid_refuses_a_bad_pair_before_any_run(grid, error, monkeypatch, capsys):
    status, stderr = benchmark_main(monkeypatch, capsys, "--grid", grid)
    assert status == 2 and error in stderr, stderr[-2000:]


def test_an_empty_grid_is_refused_not_read_as_no_grid():
    from benchmarks import benchmark

    for text in (",,,", " , ", ","):
        with pytest.raises(ValueError) as err:
            benchmark.grid_pairs(text)
        assert str(err.value) == (f"--grid {text!r}: no POLICY@MICRO_BATCH pair in it (e.g. none@8,selective_op@16); "
                                  "leave --grid out for no grid")
    assert benchmark.grid_pairs("none@8, ,full@16,") == [("none", 8), ("full", 16)]  # a stray comma is no typo
    assert benchmark.grid_pairs("") == []


@pytest.mark.parametrize("argv, error", [
    (["--grid", ",,,"], "error: --grid ',,,': no POLICY@MICRO_BATCH pair in it"),
    (["--json", "{fifo}"], "error: --json {fifo}: a FIFO, not a file to append results to"),
], ids=["empty grid", "json to a FIFO"])
def test_benchmark_refuses_an_empty_grid_or_a_fifo_destination_in_one_line(tmp_path, argv, error, monkeypatch,
                                                                          capsys):
    """Both before any run: a FIFO given to --json would block the append after all the runs, until a reader
    comes."""
    fifo = tmp_path / "results.jsonl"
    os.mkfifo(fifo)
    argv, error = [a.format(fifo=fifo) for a in argv], error.format(fifo=fifo)
    status, stderr = benchmark_main(monkeypatch, capsys, *argv)
    lines = stderr.splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(error), stderr[-2000:]


def test_benchmark_reference_halves_its_micro_batch_until_it_fits(monkeypatch):
    # The reference keeps the whole logits and may not fit ours' micro-batch: it retries at half the
    # micro-batch and twice the accumulation (the same global batch) until it fits.
    from benchmarks import benchmark

    tried = []

    def fake_peer(cfg, env, args, *, micro_batch, grad_accum):
        tried.append((micro_batch, grad_accum))
        if micro_batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"times": [1.0], "micro_batch": micro_batch, "grad_accum": grad_accum}

    monkeypatch.setattr(benchmark, "bench_peer", fake_peer)
    monkeypatch.setattr(benchmark, "reset_memory", lambda env: None)
    result = benchmark.bench_peer_fitting(None, SimpleNamespace(is_main=False), None, micro_batch=8, grad_accum=1)
    assert tried == [(8, 1), (4, 2), (2, 4)] and (result["micro_batch"], result["grad_accum"]) == (2, 4)


@pytest.mark.slow
def test_benchmark_lora_only_without_ranks_is_one_error_line():
    # It would plan no run of ours (the reference alone, with no split to run at).
    proc = run_job([str(ROOT / "benchmarks/benchmark.py"), str(TINY_PRESET), "--lora_only", "--peer"], env=job_env(),
                   timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith("error: --lora_only goes with --lora (the ranks to run)")


def test_benchmark_reference_after_fp8_runs_only_takes_their_split(monkeypatch):
    # `--train.float8=tensorwise --peer`: no bf16 run of ours to take the split from,
    # so the reference starts from the FP8 run's and halves where it does not fit.
    from benchmarks import benchmark

    def fake_ours(cfg, env, args, *, micro_batch, grad_accum):
        return {"times": [1.0], "micro_batch": 16, "grad_accum": 2}

    peer_splits = []

    def fake_peer(cfg, env, args, *, micro_batch, grad_accum):
        peer_splits.append((micro_batch, grad_accum))
        return {"times": [1.0], "micro_batch": micro_batch, "grad_accum": grad_accum}

    for name, value in {"bench_ours": fake_ours, "bench_peer_fitting": fake_peer, "reset_memory": lambda env: None,
                        "peak_memory_gib": lambda env: 0.0}.items():
        monkeypatch.setattr(benchmark, name, value)
    cfg = load_config(TINY_PRESET, ["--train.float8=tensorwise", "--fsdp.version=2"])
    runs = [("ours", fake_ours, cfg, "auto", None), ("hf_llama_fsdp2", benchmark.bench_peer, cfg, None, None)]
    args = SimpleNamespace(rounds=1, peer_only=False, grad_accum=None)
    rows, _ = benchmark.run_rounds(runs, cfg, SimpleNamespace(device=torch.device("cpu")), args)
    assert peer_splits == [(16, 2)] and [(r["micro_batch"], r["grad_accum"]) for r in rows] == [(16, 2), (16, 2)]


def test_benchmark_runs_compile_static_graphs_whatever_ran_before(monkeypatch):
    # A run after one of another micro-batch must not time dynamic-shape graphs (at 8B they ran 7% slower):
    # each run compiles the same block code afresh, as its own training process would.
    from benchmarks import benchmark

    class Block(torch.nn.Module):
        def forward(self, x):
            return (x * 2).sum(0)

    dynamic = []

    def backend(gm, example_inputs):
        dynamic.append(any(isinstance(a, torch.SymInt) for a in example_inputs))
        return gm.forward

    def fake_ours(cfg, env, args, *, micro_batch, grad_accum):
        block = Block()
        block.compile(backend=backend)
        block(torch.ones(micro_batch, 3))
        return {"times": [1.0], "micro_batch": micro_batch, "grad_accum": grad_accum}

    for name, value in {"reset_memory": lambda env: None, "peak_memory_gib": lambda env: 0.0}.items():
        monkeypatch.setattr(benchmark, name, value)
    cfg = load_config(TINY_PRESET, [])
    runs = [("ours", fake_ours, cfg, 2, 4), ("grid_none@4", fake_ours, cfg, 4, 2),
            ("grid_none@8", fake_ours, cfg, 8, 1)]
    benchmark.run_rounds(runs, cfg, SimpleNamespace(device=torch.device("cpu")),
                         SimpleNamespace(rounds=2, peer_only=False, grad_accum=None))
    assert dynamic == [False] * 6


def cache_warnings(tmp_path, caplog, content: bytes | None = None) -> list[str]:
    """read_cache's warnings for a cache file of this content (None: whatever is already there); the entry
    read must be None: the search runs as without a cache."""
    if content is not None:
        (tmp_path / CACHE_FILE).write_bytes(content)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert read_cache(tmp_path, {"gpu": "H100"}) is None
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_a_deeply_nested_cache_is_ignored_with_one_short_warning(tmp_path, caplog, depth):
    # JSON nested deeper than the parser's recursion allows; the training's search runs as without a cache.
    (warning,) = cache_warnings(tmp_path, caplog, b'{"entries": ' + b"[" * depth + b"]" * depth + b"}")
    assert warning == f"ignoring {tmp_path / CACHE_FILE} (unreadable: nested too deeply); searching again"
    save_to_cache(tmp_path, {"gpu": "H100"}, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0))
    assert read_cache(tmp_path, {"gpu": "H100"})["micro_batch_size"] == 8  # the damaged cache replaced


@pytest.mark.parametrize("value", ["8" * 5000, ["x" * 5000] * 1000, {"8": {"9": [[[["deep" * 2000]]]]}}],
                         ids=["a long string", "a long list", "a deep object"])
def test_a_cache_warning_shows_a_bounded_excerpt_of_the_file(tmp_path, caplog, value):
    """A value of about 5 KB (or 5 MB) in the cache's entry: the warning names the field with a short excerpt."""
    key = {"gpu": "H100"}
    entry = {"key": key, "micro_batch_size": value, "measured_gib": value, "capacity_gib": 1.0, "budget_gib": 1.0}
    (warning,) = cache_warnings(tmp_path, caplog, json.dumps({"entries": [entry]}).encode())
    assert warning.startswith(f"ignoring {tmp_path / CACHE_FILE} (its entry for this run: micro_batch_size ")
    assert len(warning) - len(str(tmp_path)) < 250, warning  # the excerpt: at most three items of 30 characters


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_cache_that_is_not_a_file_is_ignored_never_read_through(tmp_path, caplog, kind):
    """microbatch_cache.json as a link to a valid cache elsewhere, a FIFO (opening it for reading would block),
    or a folder: ignored with one warning naming it; a new search's choice replaces it (a link itself)."""
    key = {"gpu": "H100"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_to_cache(elsewhere, key, MicroBatchChoice(16, "search", {1: 2.0, 16: 30.0}, 79.0, 71.1, 9.0))
    users = (elsewhere / CACHE_FILE).read_bytes()
    out, path = tmp_path / "run", tmp_path / "run" / CACHE_FILE
    out.mkdir()
    {"link": lambda: path.symlink_to(elsewhere / CACHE_FILE), "fifo": lambda: os.mkfifo(path),
     "folder": path.mkdir}[kind]()
    (warning,) = cache_warnings(out, caplog)
    assert warning.startswith(f"ignoring {path} (unreadable: UnsafePath: {path}: a ") and "\n" not in warning
    if kind != "folder":
        save_to_cache(out, key, MicroBatchChoice(8, "search", {1: 2.0, 8: 20.0}, 79.0, 71.1, 9.0))
        assert read_cache(out, key)["micro_batch_size"] == 8 and not path.is_symlink()
    assert (elsewhere / CACHE_FILE).read_bytes() == users
