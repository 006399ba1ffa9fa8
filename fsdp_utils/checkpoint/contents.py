"""What a checkpoint holds: its named parts, and for each how its state is taken and how it is restored. Every
writer (full.py, sharded.py, async_save.py), every reader (the formats' loads, io.py, the tools) and the metadata
checks (metadata.py) take the parts from here, as torchtitan's checkpointer takes a mapping of stateful parts.

    model, optimizer  tensors (TENSOR_PARTS): each rank's shard through DCP (sharded), gathered to rank 0 (full)
    rng               one value per rank (PER_RANK_PARTS), gathered; rank 0 writes the list (a full file's "rng", a
                      sharded checkpoint's rng.pt)
    train state       plain data rank 0 writes into the metadata's train_state record: the TrainState's fields (the
                      step, the data position, the learning rate, the run's length), and each part of PLAIN_PARTS
                      (the grad scaler) under its own name

A new part of plain data is one entry of PLAIN_PARTS, its object handed to `Contents` under that name (a checkpoint
saved before lacks it, and it keeps its fresh state); a new optimizer's state is the optimizer part's."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from ..distributed import DistEnv
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, first_line
from .staging import storage_tensors, trainable_parameters

MODEL, OPTIMIZER, RNG = "model", "optimizer", "rng"
TENSOR_PARTS = (MODEL, OPTIMIZER)
PER_RANK_PARTS = (RNG,)
# The parts of plain data besides the train state's fields, each a Stateful (state_dict / load_state_dict): saved (a
# JSON mapping, or None where the run has none) under its name in the train_state record.
PLAIN_PARTS = (
    "grad_scaler",  # torch.amp.GradScaler (fp16): the loss scale and its growth tracker
    "spike_skipper",  # train/spikes.py SpikeSkipper (train.skip_spikes): its window of losses and gradient norms
)

# Module names that wrappers insert into parameter names; checkpoints hold the plain model's names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _field(default: Any, **checks: bool) -> Any:
    """A TrainState field and what metadata.py checks of it beyond its type: `required` (every checkpoint holds it),
    `positive` (a number above 0; else 0 or more)."""
    return dataclasses.field(default=default, metadata=checks)


@dataclasses.dataclass
class TrainState:
    """The train state part: everything besides tensors, RNG and PLAIN_PARTS that an exact resume needs, as plain data.
    Its fields are the train_state record's keys and types (metadata.train_state_problem)."""

    step: int = _field(0, required=True)  # optimizer steps taken
    samples_seen: int = _field(0, required=True)  # the data position: global sample index of the next batch
    tokens_seen: int = 0
    lr: float | None = None  # the learning rate of the last step taken: a resume checks the schedule continues
    max_steps: int = 0  # the run's length, decided once (train/resume.py run_length): a resume keeps it
    epochs: float | None = _field(None, positive=True)  # the train.epochs counted into max_steps; None: not given
    optimizer: str = "adamw"  # the train.optimizer whose state the optimizer part holds (a resume keeps it)

    def advance(self, *, samples: int, tokens: int) -> None:
        """One optimizer step taken, on a global batch of `samples` sequences holding `tokens` tokens."""
        self.step += 1
        self.samples_seen += samples
        self.tokens_seen += tokens

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TrainState:
        """The train state of a (checked) train_state record; a field it lacks (a checkpoint saved before the field
        existed) takes its default."""
        return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})


def optimizer_switch(saved: str, here: str, path: Path) -> str | None:
    """The line for a resume under another train.optimizer than the checkpoint's (one optimizer's state is not the
    other's), or None."""
    if saved == here:
        return None
    return (f"{path}: saved with train.optimizer={saved}, this run has train.optimizer={here}: an optimizer's state "
            f"does not carry over to another; resume with --train.optimizer={saved}, or start a new run from its "
            f"weights with a fresh optimizer (model.init_from)")


def train_state_record(state: TrainState, plain: Mapping[str, Stateful | None] | None = None) -> dict:
    """A checkpoint's train_state record: the TrainState's fields, then each of PLAIN_PARTS under its name (None where
    `plain` has none)."""
    held = {name: (part.state_dict() if (part := (plain or {}).get(name)) is not None else None)
            for name in PLAIN_PARTS}
    return {**dataclasses.asdict(state), **held}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What rank 0 writes besides the tensors, taken at the checkpoint's step: the train_state record and every rank's
    value of each per-rank part."""

    train_state: dict
    per_rank: dict[str, list | None]

    @property
    def step(self) -> int:
        return self.train_state["step"]


def full_payload(tensors: Mapping[str, Any], per_rank: Mapping[str, Any], meta: Mapping[str, Any]) -> dict:
    """A full checkpoint file's payload: each tensor part's and each per-rank part's state under its name, beside the
    metadata (base.CheckpointContext.metadata)."""
    return {**tensors, **per_rank, **meta}


def parts_of(payload: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """(tensor parts, per-rank parts, metadata) of a full checkpoint's payload (read by safe_read.load_full, which
    checks that each tensor part is there); a per-rank part it lacks is left out."""
    tensors = {name: payload[name] for name in TENSOR_PARTS}
    per_rank = {name: payload[name] for name in PER_RANK_PARTS if name in payload}
    meta = {k: v for k, v in payload.items() if k not in (*TENSOR_PARTS, *PER_RANK_PARTS)}
    return tensors, per_rank, meta


# ---- the tensor parts: taken and restored through torch's state-dict API ---------------------------------------


@contextlib.contextmanager
def quiet_state_dict_warnings() -> Iterator[None]:
    """FSDP1's state dicts warn on every call, at every save and load: the sharded one (ShardedTensor)
    that ShardedTensor is deprecated and that `_get_pg_default_device` will be, and at world size 1 that
    NO_SHARD returns full state dicts. Torch's internals, nothing a user can act on."""
    with warnings.catch_warnings():
        for message in ("Please use DTensor instead", "`_get_pg_default_device` will be deprecated",
                        "Multiple backends are registered with this ProcessGroup",
                        # The prefix common to "will be" and "willbe", both spellings torch has used.
                        "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"):
            warnings.filterwarnings("ignore", message=re.escape(message))
        yield


@contextlib.contextmanager
def must_fit(path: Path) -> Iterator[None]:
    """A failure to set a state read from `path` is a CheckpointMismatch: readable, but not this model's (missing or
    extra tensors, other shapes)."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
        raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None


def is_adapter_key(name: str) -> bool:
    """A LoRA adapter's tensor (parallel/lora.py puts each under a `lora` child of its layer): a base
    checkpoint (model.init_from) does not hold it."""
    return ".lora." in f".{name}"


def plain_name(name: str) -> str:
    """A parameter's name without wrapper prefixes, as the state dicts name it."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PREFIXES)


def has_frozen(model: torch.nn.Module) -> bool:
    """Whether some parameters do not train (a LoRA run's base): checkpoints then hold only the others."""
    return any(not p.requires_grad for p in model.parameters())


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The names of the parameters that do not train, as state dicts name them (no wrapper prefixes)."""
    return {plain_name(name) for name, p in model.named_parameters() if not p.requires_grad}


def state_dict_options(model: torch.nn.Module, **kwargs: Any) -> StateDictOptions:
    """The options of every state dict a checkpoint saves or loads: frozen parameters (a LoRA run's base,
    which the run loads from its own source) are left out, and loading is strict about the others
    (check_loaded; torch's strict mode would ask for the frozen ones too)."""
    return StateDictOptions(ignore_frozen_params=True, strict=not has_frozen(model), **kwargs)


class StateDictAnswers(Protocol):
    """What the checkpoints ask of the model's FSDP wrapping; the run's FSDP adapter (parallel/fsdp.py) answers."""

    def full_save_options(self, model: torch.nn.Module, *, on_gpu: bool) -> tuple[StateDictOptions, list[str]]:
        """The options of a full state dict gathered to rank 0 (on GPUs through host memory), and the names of the
        frozen parameters the caller drops from it itself ([] when torch does)."""

    def offloads_sharded_state_dict(self) -> bool:
        """Whether sharded state dicts are taken with cpu_offload."""


class TorchStateDicts:
    """The answers for a model that FSDP1 does not wrap (unwrapped, or sharded by FSDP2): torch leaves the frozen
    parameters out, and a sharded state dict holds the live shards, with nothing to offload."""

    def full_save_options(self, model: torch.nn.Module, *, on_gpu: bool) -> tuple[StateDictOptions, list[str]]:
        return state_dict_options(model, full_state_dict=True, cpu_offload=on_gpu), []

    def offloads_sharded_state_dict(self) -> bool:
        return False


def check_loaded(result: Any, model: torch.nn.Module, path: Path) -> None:
    """After a non-strict load (a model with frozen parameters): every trainable tensor came from the
    checkpoint, and the checkpoint held nothing else."""
    frozen = frozen_names(model)
    missing = [k for k in getattr(result, "missing_keys", []) if plain_name(k) not in frozen]
    unexpected = list(getattr(result, "unexpected_keys", []))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointMismatch(f"{path}: does not fit this model ({what})")


class ModelPart:
    """The model's weights: its trainable ones (a LoRA run's frozen base is loaded from its own source)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def take(self, options: StateDictOptions, *, trial: bool = False) -> dict:
        return get_model_state_dict(self.model, options=options)

    def restore(self, saved: dict, options: StateDictOptions, path: Path) -> None:
        if has_frozen(self.model) and not options.full_state_dict:
            # FSDP1 loads a unit's parameters together and warns for each one absent: the frozen ones (which the
            # checkpoint does not hold) go back as they are.
            whole = get_model_state_dict(self.model, options=dataclasses.replace(options, ignore_frozen_params=False))
            saved = {**whole, **saved}
        with must_fit(path):
            result = set_model_state_dict(self.model, saved, options=options)
        check_loaded(result, self.model, path)

    def weights(self) -> dict:
        """What a sharded checkpoint's weights load into for model.init_from: every tensor but LoRA's adapters, which
        start fresh."""
        return {k: v for k, v in get_model_state_dict(self.model).items() if not is_adapter_key(k)}

    def restore_weights(self, saved: dict, path: Path, *, full: bool) -> None:
        """model.init_from: the weights only (`full`: whole tensors on every rank), LoRA's adapters left fresh."""
        with must_fit(path):
            result = set_model_state_dict(self.model, saved, options=StateDictOptions(full_state_dict=full,
                                                                                      strict=False))
        missing = [k for k in result.missing_keys if not is_adapter_key(k)]
        if missing or result.unexpected_keys:
            raise CheckpointMismatch(f"{path}: does not fit this model (missing {missing[:3]}, unexpected "
                                     f"{list(result.unexpected_keys)[:3]})")


class OptimizerPart:
    """The optimizer's state (Muon's and AdamW's alike) and its parameter groups, named by parameter."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def take(self, options: StateDictOptions, *, trial: bool = False) -> dict:
        """`trial` (a staging trial before the first step): torch would initialise a fresh optimizer's state with a
        step, and change the training; one moment-like tensor (zeros_like of a parameter, as AdamW makes them) per kind
        of parameter stands in for it."""
        if trial and not self.optimizer.state:
            kinds: dict[tuple, tuple] = {}
            for name, p in trainable_parameters(self.model):
                kinds.setdefault(tuple(type(t).__name__ for t in (p, *storage_tensors(p))), (name, p))
            return {"state": {name: {"exp_avg": torch.zeros_like(p.detach())} for name, p in kinds.values()}}
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def restore(self, saved: dict, options: StateDictOptions, path: Path) -> None:
        self.check_groups(saved, path)
        if not saved.get("state"):  # no step taken yet (scripts/import_hf.py): a fresh optimizer
            return
        with must_fit(path):
            set_optimizer_state_dict(self.model, self.optimizer, saved, options=options)

    def check_groups(self, saved: dict, path: Path) -> None:
        """The checkpoint's optimizer groups hold the same parameters as this optimizer's: torch would otherwise load
        mismatched groups without a word and fail (or train wrongly) at the first step."""
        try:
            held = [list(group["params"]) for group in saved["param_groups"]]
        except (KeyError, TypeError):
            raise CheckpointCorrupt(f"{path}: the optimizer state has no parameter groups") from None
        names = {id(param): plain_name(name) for name, param in self.model.named_parameters()}
        here = [[names.get(id(p), "?") for p in group["params"]] for group in self.optimizer.param_groups]
        if held != here:
            sizes = lambda groups: "/".join(str(len(g)) for g in groups)  # noqa: E731
            raise CheckpointMismatch(
                f"{path}: the optimizer's parameter groups differ from the checkpoint's ({sizes(here)} parameters "
                f"per group here, {sizes(held)} in the checkpoint): saved by a different optimizer setup")


# ---- the per-rank part: every rank's RNG states ------------------------------------------------------------------


def _rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def gather_rng(env: DistEnv) -> list:
    """Every rank's RNG states, on every rank (a collective)."""
    states: list = [None] * env.world_size
    dist.all_gather_object(states, _rng_state(env.device))
    return states


def restore_rng(states: list | None, env: DistEnv) -> None:
    # A run resumed on a different world size has no saved state for the new ranks: they keep their seed.
    if not states or env.rank >= len(states):
        return
    torch.set_rng_state(states[env.rank]["cpu"])
    if env.device.type == "cuda" and states[env.rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[env.rank]["cuda"], env.device)


# ---- a run's parts --------------------------------------------------------------------------------------------


class Contents:
    """The parts of one run's checkpoints, bound to its objects: the model and its optimizer, the train state the
    loop advances (a fresh one unless given) and, by name, each of PLAIN_PARTS the run has (left out, or None, where
    it has none). `fsdp`: how the model's state dicts are taken, the run's FSDP adapter (needed where FSDP1 may wrap
    the model on a GPU). Taking and restoring tensors and the RNG are collectives: every rank calls them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState | None = None, *,
                 fsdp: StateDictAnswers | None = None, **plain: Stateful | None):
        if unknown := sorted(set(plain) - set(PLAIN_PARTS)):
            raise TypeError(f"not a part of plain data (checkpoint/contents.py PLAIN_PARTS): {', '.join(unknown)}")
        self.model, self.optimizer = model, optimizer
        self.fsdp: StateDictAnswers = fsdp if fsdp is not None else TorchStateDicts()
        self.state = state if state is not None else TrainState()
        self.plain = plain
        self.model_part = ModelPart(model)
        self.tensors: dict[str, ModelPart | OptimizerPart] = {MODEL: self.model_part,
                                                              OPTIMIZER: OptimizerPart(model, optimizer)}

    def take_tensors(self, options: StateDictOptions, *, trial: bool = False) -> dict:
        """Collective: this rank's state dict of each tensor part, under its name: what DCP writes (full: what rank 0
        gathers), or what a sharded load reads into in place."""
        with quiet_state_dict_warnings():
            return {name: part.take(options, trial=trial) for name, part in self.tensors.items()}

    def restore_tensors(self, saved: Mapping[str, dict], options: StateDictOptions, path: Path) -> None:
        """Collective: each tensor part from what the checkpoint `path` holds, in the order torch's set_state_dict
        takes them (the optimizer's state, then the weights)."""
        with quiet_state_dict_warnings():
            for name in reversed(TENSOR_PARTS):
                self.tensors[name].restore(saved[name], options, path)

    def check_optimizer(self, record: Mapping[str, Any], path: Path) -> None:
        """Before any tensor is restored: the checkpoint's train_state `record` was saved by this run's optimizer."""
        if problem := optimizer_switch(TrainState.from_record(record).optimizer, self.state.optimizer, path):
            raise CheckpointMismatch(problem)

    def record(self) -> dict:
        """The train_state record of a checkpoint of now."""
        return train_state_record(self.state, self.plain)

    def snapshot(self, env: DistEnv) -> Snapshot:
        """Collective: what a checkpoint of now holds besides the tensors."""
        return Snapshot(self.record(), {RNG: gather_rng(env)})

    def restore_plain(self, record: Mapping[str, Any], per_rank: Mapping[str, Any], env: DistEnv) -> None:
        """The train state (in place: the loop's own object), each plain part and this rank's RNG from a checkpoint's
        (checked) train_state record and per-rank parts; a part the checkpoint lacks keeps its state."""
        restored = TrainState.from_record(record)
        for f in dataclasses.fields(TrainState):
            setattr(self.state, f.name, getattr(restored, f.name))
        for name, part in self.plain.items():
            if part is not None and record.get(name):
                part.load_state_dict(record[name])
        restore_rng(per_rank.get(RNG), env)
