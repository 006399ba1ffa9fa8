"""All that differs between FSDP1 (`FullyShardedDataParallel`) and FSDP2 (`fully_shard`), behind one interface
chosen once from fsdp.version (`fsdp_adapter`): the wrap, the gradient sync of accumulation, clipping, ending an
interrupted step, the checkpoints' state-dict options, and whether parameters are whole matrices (Muon). The run
carries it (BuiltRun.fsdp); nothing else asks which FSDP wraps a model (tests/test_architecture.py)."""
from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from ..checkpoint.contents import TorchStateDicts, frozen_names, has_frozen
from ..distributed import DistEnv
from .lora import LoRAAdapter, has_adapters
from .weights import WeightInit

if TYPE_CHECKING:
    from config import FSDPConfig
    from config.sections import ShardingStrategy as StrategyName


def fsdp_adapter(f: FSDPConfig, env: DistEnv) -> FSDPAdapter:
    """The adapter of fsdp.version for this rank; it builds nothing (no process group needed)."""
    return FSDP2(f, env) if f.version == 2 else FSDP1(f, env)


class FSDPAdapter(TorchStateDicts, ABC):
    """What the loop, the optimizer and the checkpoints need from FSDP; the checkpoints' state-dict answers
    (checkpoint/contents.py StateDictAnswers) are torch's unless a version says otherwise. `f`: the fsdp section with
    the sharding strategy that runs (resolve_sharding); `offload`: fsdp.cpu_offload where it applies (on GPUs)."""

    version: ClassVar[int]
    # Whether every parameter is a DTensor of its own whole matrix, sharded by rows (what Muon needs), or flattened
    # with the other parameters of its unit into one 1-D shard.
    per_matrix: ClassVar[bool]

    def __init__(self, f: FSDPConfig, env: DistEnv):
        self.configured, self.env = f, env
        # From here on the strategy is the one that runs: a HYBRID_SHARD group of one rank or of the whole world is
        # NO_SHARD or FULL_SHARD everywhere below, gradient synchronisation included.
        self.f = dataclasses.replace(f, sharding_strategy=resolve_sharding(f, env))
        self.offload = f.cpu_offload and env.device.type == "cuda"  # on the CPU the tensors are there already
        self.sync_every_micro_batch = resolve_grad_sync(self.f) == "every_micro_batch"

    @abstractmethod
    def wrap(self, model: nn.Module, *, auto_wrap_policy: ModuleWrapPolicy, mixed_precision: MixedPrecision,
             compile: bool, init: WeightInit | None) -> nn.Module:
        """Shard the model: each module the policy selects (the `units`) a unit that gathers its weights in
        mixed_precision.param_dtype and reduces gradients in its reduce_dtype, then the root; returns the model to
        train. After FP8, activation checkpointing and compile (`compile`: the model's blocks are compiled); `init`:
        a model built on the meta device, materialised after the wrap."""

    def units(self, model: nn.Module, blocks: list[nn.Module]) -> set[type[nn.Module]]:
        """The module classes the auto-wrap policy makes units of: the blocks' (our DecoderBlock, or a Hugging Face
        model's decoder layer)."""
        return {type(block) for block in blocks}

    @abstractmethod
    def gradient_sync(self, model: nn.Module, *, last: bool) -> AbstractContextManager[None]:
        """Around one micro-batch's forward and backward (`last`: the step's last): with every_micro_batch each
        backward reduce-scatters its gradients, with last_micro_batch (fsdp.grad_sync) only the last reduces."""

    @abstractmethod
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the gradient norm over all shards and ranks; return that norm (before clipping), the same on
        every rank. max_norm <= 0 measures without clipping."""

    @abstractmethod
    def end_interrupted_step(self, model: nn.Module) -> None:
        """Bring FSDP back to its between-steps state, the gradients dropped, after an exception interrupted a forward
        or backward, so that the step can be redone (train/oom_guard.py; tests/test_microbatch.py, bit for bit)."""

    def describe(self) -> str:
        """What runs, for the log: the version, the strategy, the mesh of HYBRID_SHARD, the setting it came from."""
        f, env, strategy = self.configured, self.env, self.f.sharding_strategy
        if strategy == "HYBRID_SHARD":
            group = hybrid_group_size(f, env)
            return f"FSDP{self.version} HYBRID_SHARD ({env.world_size // group} replicas x {group} shards)"
        if strategy != f.sharding_strategy:
            return (f"FSDP{self.version} {strategy} (fsdp.sharding_strategy=HYBRID_SHARD with shard groups of "
                    f"{hybrid_group_size(f, env)} of {env.world_size} ranks)")
        return f"FSDP{self.version} {strategy}"

    def mesh(self) -> DeviceMesh:
        """The ranks' mesh (a collective): (shard,), or (replicate, shard) for HYBRID_SHARD and NO_SHARD."""
        f, env = self.f, self.env
        if f.sharding_strategy == "NO_SHARD":
            return init_device_mesh(env.device.type, (env.world_size, 1), mesh_dim_names=("replicate", "shard"))
        if f.sharding_strategy != "HYBRID_SHARD":
            return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
        group = hybrid_group_size(f, env)
        if env.world_size % group:
            raise ValueError(f"fsdp.hybrid_shard_group_size={group} does not divide the world size {env.world_size}")
        # (replicate, shard): shard inside a group (a node by default), replicate across groups.
        return init_device_mesh(env.device.type, (env.world_size // group, group),
                                mesh_dim_names=("replicate", "shard"))


class FSDP1(FSDPAdapter):
    """FullyShardedDataParallel with an auto-wrap policy and MixedPrecision: each unit one flat parameter."""

    version, per_matrix = 1, False

    def describe(self) -> str:
        if self.env.world_size == 1 and self.f.sharding_strategy not in ("NO_SHARD", "HYBRID_SHARD"):
            # FSDP1 runs any strategy on one process as NO_SHARD (torch says so in a warning).
            return f"FSDP1 NO_SHARD (one process; fsdp.sharding_strategy={self.configured.sharding_strategy})"
        return super().describe()

    def wrap(self, model: nn.Module, *, auto_wrap_policy: ModuleWrapPolicy, mixed_precision: MixedPrecision,
             compile: bool, init: WeightInit | None) -> nn.Module:
        fp32 = {mixed_precision.param_dtype, mixed_precision.reduce_dtype} <= {None, torch.float32}
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=auto_wrap_policy,
            mixed_precision=None if fp32 else mixed_precision,  # fp32 needs no casting
            sharding_strategy=self.strategy(),
            **self.options(model, compile=compile, init=init),
        )

    def units(self, model: nn.Module, blocks: list[nn.Module]) -> set[type[nn.Module]]:
        """The blocks', and LoRA's adapters (train.lora), units of their own because a unit is one flat tensor of one
        dtype (the frozen base is stored in the compute dtype, the adapters in fp32)."""
        return super().units(model, blocks) | ({LoRAAdapter} if has_adapters(model) else set())

    def strategy(self) -> ShardingStrategy:
        """The strategy that runs; one process holds everything whatever the strategy: NO_SHARD, which FSDP1 would
        otherwise switch to itself, with a warning."""
        return ShardingStrategy["NO_SHARD" if self.env.world_size == 1 else self.f.sharding_strategy]

    def options(self, model: nn.Module, *, compile: bool, init: WeightInit | None) -> dict[str, Any]:
        """The rest of FullyShardedDataParallel's arguments from the fsdp section: offload, prefetching, the
        HYBRID_SHARD mesh, the original parameters (compile and LoRA need them), meta-device initialisation unit by
        unit, and for unsharded LoRA the frozen base left out of FSDP."""
        f, env = self.f, self.env
        param_init_fn = (lambda module: init.init_module(module, env.device)) if init is not None else None
        ignored = None
        if has_adapters(model) and (f.sharding_strategy == "NO_SHARD" or env.world_size == 1):
            # Unsharded (NO_SHARD, or any strategy on one rank), a frozen unit is never handed its parameters
            # back after backward (torch reshards such units only when they are sharded). Unsharded, FSDP
            # would only hold the same full copy on every rank: the frozen base is left to the ranks instead.
            if param_init_fn is not None:
                # Materialised by FSDP1, a meta-device module gets new Parameter objects, which ignored_states
                # (naming the meta ones) would miss: FSDP1 would then flatten part of the base and fail at the
                # first state dict. Every rank holds the whole model here anyway, so it is materialised first.
                for module in model.modules():
                    param_init_fn(module)
                param_init_fn = None
            ignored = [p for p in model.parameters() if not p.requires_grad]
        hybrid = self.strategy() == ShardingStrategy.HYBRID_SHARD
        return dict(
            cpu_offload=CPUOffload(offload_params=True) if self.offload else None,
            backward_prefetch=None if f.backward_prefetch == "NONE" else BackwardPrefetch[f.backward_prefetch],
            forward_prefetch=f.forward_prefetch,
            limit_all_gathers=f.limit_all_gathers,
            use_orig_params=f.use_orig_params or compile,
            sync_module_states=f.sync_module_states,
            device_id=env.device,
            param_init_fn=param_init_fn,
            device_mesh=self.mesh() if hybrid else None,
            ignored_states=ignored,
        )

    def gradient_sync(self, model: nn.Module, *, last: bool) -> AbstractContextManager[None]:
        if last or self.sync_every_micro_batch:
            return contextlib.nullcontext()
        return cast(FullyShardedDataParallel, model).no_sync()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # The wrapper's own clipping reduces the norm across ranks.
        return cast(FullyShardedDataParallel, model).clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))

    def end_interrupted_step(self, model: nn.Module) -> None:
        # FSDP ends every step in a callback queued at the start of backward (reshard, reset each unit's per-step
        # state, hand gradients to the optimizer); an exception skips it, and the next step fails (FSDP2: computes
        # wrong gradients). No public API does it: FSDP's own callback, after dropping the gradients.
        from torch.distributed.fsdp import _runtime_utils

        root = cast(FullyShardedDataParallel, model)
        for unit in FullyShardedDataParallel.fsdp_modules(root):
            handle = unit._handle
            if handle is None:
                continue
            flat = handle.flat_param
            flat.grad = None
            if hasattr(flat, "_saved_grad_shard"):
                del flat._saved_grad_shard
            flat._post_backward_called = False  # type: ignore[attr-defined]  # FSDP1 sets it in backward
        _runtime_utils._post_backward_final_callback(root, root)

    def offloads_sharded_state_dict(self) -> bool:
        # FSDP1 cuts each rank's piece of a sharded state dict anew from gathered flat parameters (and optimizer
        # state): on a GPU these copies would pile up until the save is written (docs/checkpoints.md); offloaded,
        # each piece goes to host memory as soon as it is made.
        return self.env.device.type == "cuda"

    def full_save_options(self, model: nn.Module, *, on_gpu: bool) -> tuple[StateDictOptions, list[str]]:
        # Offloaded, FSDP1 gathers the full state dict to rank 0 alone, and torch's ignore_frozen_params fails
        # (KeyError) on the other ranks' empty dicts. FSDP1 gathers every unit anyway: the frozen ones are kept
        # and the caller drops them.
        options, _ = super().full_save_options(model, on_gpu=on_gpu)
        if not (on_gpu and has_frozen(model)):
            return options, []
        return dataclasses.replace(options, ignore_frozen_params=False), sorted(frozen_names(model))


class FSDP2(FSDPAdapter):
    """fully_shard on each block, the edges (embedding, output projection), then the root, with a
    MixedPrecisionPolicy: every parameter a DTensor of its own, which its state dicts hold live (torch's answers)."""

    version, per_matrix = 2, True

    def wrap(self, model: nn.Module, *, auto_wrap_policy: ModuleWrapPolicy, mixed_precision: MixedPrecision,
             compile: bool, init: WeightInit | None) -> nn.Module:
        policy = MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                      reduce_dtype=mixed_precision.reduce_dtype)
        # FULL_SHARD frees the gathered weights after forward, SHARD_GRAD_OP keeps them until backward.
        reshard = self.f.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
        options: dict[str, Any] = dict(mesh=self.mesh(), reshard_after_forward=reshard, mp_policy=policy)
        if self.offload:
            options["offload_policy"] = CPUOffloadPolicy()
        # The policy's public callable form selects the units as FSDP1's wrap does (recurse=False: "this module?").
        units = [m for m in model.modules() if m is not model
                 and auto_wrap_policy(module=m, recurse=False, nonwrapped_numel=0)]
        for unit in units:
            fully_shard(unit, **options)
        edges = edge_modules(model)
        if edges is not None:
            # The embedding and the output projection as units of their own where they have their own weights, as
            # torchtitan's, so neither stays gathered in the root's unit for the whole step (the embedding's
            # gathered weight goes after its forward and is gathered again at the end of backward; the output
            # projection's, with its gathered gradient, after its backward, the first of the step, and it is kept
            # gathered from forward to backward, as the root's would be).
            embedding, head = edges
            fully_shard(embedding, **options)
            fully_shard(head, **{**options, "reshard_after_forward": False})
        fully_shard(model, **options)
        return model

    def gradient_sync(self, model: nn.Module, *, last: bool) -> AbstractContextManager[None]:
        # Set before every micro-batch; with every_micro_batch on HSDP only the all-reduce across replicas waits for
        # the last.
        sharded = cast(FSDPModule, model)
        if self.sync_every_micro_batch:
            sharded.set_requires_all_reduce(last)
        else:
            sharded.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # The DTensor gradients make the plain utility compute the global norm.
        grads = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def end_interrupted_step(self, model: nn.Module) -> None:
        sharded = cast(FSDPModule, model)
        sharded.set_requires_gradient_sync(True)  # also requires the all-reduce again
        for group in fsdp2_param_groups(sharded):
            if hasattr(group, "_partial_reduce_output"):  # HSDP: reduce-scattered, not yet all-reduced
                group._partial_reduce_output = None
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):
                    param._unsharded_param.grad = None
        sharded._get_fsdp_state()._root_post_backward_final_callback()


def fsdp2_param_groups(model: FSDPModule) -> list:
    """Every FSDP2 parameter group of a model sharded with fully_shard (torch's internals: no public API)."""
    groups: list = []
    for state in model._get_fsdp_state()._state_ctx.all_states:
        # A list of groups in recent torch versions, one group (or None) before.
        found = getattr(state, "_fsdp_param_groups", None)
        groups += found if found is not None else [g for g in [state._fsdp_param_group] if g is not None]
    return groups


def edge_modules(model: nn.Module) -> tuple[nn.Module, list[nn.Module]] | None:
    """(input embedding, [final norm, output projection]) of our Transformer or a Hugging Face causal LM whose
    output projection has its own weight; None when it is tied to the embedding (one weight for the first and
    the last op of the step: it stays in the root's unit) or the model has no such parts."""
    lm = getattr(model, "lm", model)  # a Hugging Face model inside its adapter (parallel/hf.py)
    if hasattr(lm, "tok_embeddings"):  # ours
        embedding, norm, output = lm.tok_embeddings, lm.norm, lm.output
    elif hasattr(lm, "get_input_embeddings") and hasattr(lm, "get_output_embeddings"):
        embedding, output = lm.get_input_embeddings(), lm.get_output_embeddings()  # type: ignore[operator]
        norm = getattr(getattr(lm, "model", None), "norm", None)
    else:
        return None
    if not isinstance(embedding, nn.Module) or not isinstance(output, nn.Module) or output.weight is embedding.weight:
        return None
    return embedding, [m for m in (norm, output) if isinstance(m, nn.Module)]


# ---- the fsdp section as it runs, whichever version ---------------------------------------------------------------


def hybrid_group_size(f: FSDPConfig, env: DistEnv) -> int:
    """HYBRID_SHARD's ranks per shard group: fsdp.hybrid_shard_group_size, 0 meaning the processes per node."""
    return f.hybrid_shard_group_size or env.local_world_size


def resolve_sharding(f: FSDPConfig, env: DistEnv) -> StrategyName:
    """The sharding strategy that runs. HYBRID_SHARD with shard groups of one rank replicates everywhere:
    NO_SHARD over the whole world (FSDP1 would otherwise switch to NO_SHARD inside each group of one and
    never reduce across the groups); with one group of the whole world it shards everywhere: FULL_SHARD."""
    if f.sharding_strategy != "HYBRID_SHARD":
        return f.sharding_strategy
    group = hybrid_group_size(f, env)
    if group == 1:
        return "NO_SHARD"
    return "FULL_SHARD" if group == env.world_size else "HYBRID_SHARD"


def resolve_grad_sync(f: FSDPConfig) -> str:
    """fsdp.grad_sync without auto: NO_SHARD's gradients are whole on every rank anyway, so it reduces once a
    step; sharded strategies keep gradients sharded between micro-batches (the reduce-scatter hides behind
    backward, and unsharded fp32 gradients would cost 4 bytes per parameter on every GPU)."""
    if f.grad_sync != "auto":
        return f.grad_sync
    return "last_micro_batch" if f.sharding_strategy == "NO_SHARD" else "every_micro_batch"
