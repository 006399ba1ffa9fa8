"""FP8 training of the blocks' linear layers through torchao.float8 (`train.float8`; docs/fsdp.md): every
nn.Linear inside a block whose dimensions are multiples of 16 becomes torchao's FP8 linear. torchao is imported only
when FP8 is asked for; `float8_problems` checks for it (TORCHAO_FOR_TORCH) and for FP8 hardware before any process
group starts. With FSDP2 and tensorwise scaling the sharded weights are all-gathered in FP8: after each optimizer step
their scales are computed at once (`precompute_float8_scales`) and each shard is cast once (`cast_float8_shards`) for
every all-gather of the step, and each linear's input is cast once (`CastInputOnce`) for forward and backward."""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from model.transformer import Attention, FeedForward

from ..distributed import pick_device

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig  # torchao is imported only when FP8 is asked for

log = logging.getLogger(__name__)

# torch release -> the torchao release built for it (torchao's compatibility table).
TORCHAO_FOR_TORCH = {"2.11": "0.17"}
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


def torchao_hint(torch_version: str = torch.__version__) -> str:
    """Which torchao to install for this torch, as one clause."""
    major_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    if major_minor in TORCHAO_FOR_TORCH:
        return (f"pip install 'torchao=={TORCHAO_FOR_TORCH[major_minor]}.*' (the torchao release built for "
                f"torch {major_minor}, installed here)")
    pairs = ", ".join(f"torchao {ao}.x for torch {t}" for t, ao in TORCHAO_FOR_TORCH.items())
    return f"install the torchao release built for torch {major_minor} (installed here; {pairs})"


def hardware_problem(recipe: str, *, device_type: str, capability: tuple[int, int] | None,
                     name: str = "") -> str | None:
    """Why FP8 training cannot run on this device, or None. Pure: the tests pass fake capabilities."""
    if device_type == "cpu":
        return (f"train.float8={recipe} needs an NVIDIA GPU with FP8 support (compute capability 8.9 or later: "
                f"Ada, Hopper); this run is on the CPU: set train.float8: none")
    return _capability_problem(f"train.float8={recipe}", "train.float8: none", capability, name)


def _capability_problem(setting: str, off: str, capability: tuple[int, int] | None, name: str) -> str | None:
    """`setting` on a GPU below FP8's compute capability (`off`: how to turn it off), or None."""
    if capability is not None and tuple(capability) >= MIN_CAPABILITY:
        return None
    found = ".".join(map(str, capability)) if capability else "unknown"
    return (f"{setting} needs a GPU with FP8 support (compute capability 8.9 or later: Ada, Hopper); "
            f"{name or 'this GPU'} has {found}: set {off}")


def _rank_device(run_device: str, local_rank: int) -> tuple[str, tuple[int, int] | None, str] | None:
    """(device type, compute capability, name) of this rank's device; None where there is no such device
    (init_distributed reports that)."""
    try:
        device = pick_device(run_device, local_rank)
    except RuntimeError:
        return None
    if device.type != "cuda":
        return device.type, None, ""
    return device.type, torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)


def float8_problems(recipe: str, *, run_device: str, local_rank: int) -> list[str]:
    """Environment checks for train.float8 (the config's own are in config/): torchao is
    installed and this rank's device runs FP8 matmuls. Empty when FP8 is off or can run."""
    if recipe == "none":
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"train.float8={recipe} needs the torchao package, which is not installed: "
                        f"{torchao_hint()}")
    device = _rank_device(run_device, local_rank)
    if device is None:
        return problems
    device_type, capability, name = device
    problem = hardware_problem(recipe, device_type=device_type, capability=capability, name=name)
    return problems + ([problem] if problem else [])


def float8_output_problems(enabled: bool, *, run_device: str, local_rank: int) -> list[str]:
    """train.float8_output on a GPU without FP8 matmuls (on the CPU torch emulates them: the tests run there)."""
    device = _rank_device(run_device, local_rank) if enabled else None
    if device is None or device[0] != "cuda":
        return []
    problem = _capability_problem("train.float8_output=true", "train.float8_output: false", device[1], device[2])
    return [problem] if problem else []


def _convertible(module: nn.Module, _fqn: str) -> bool:
    # FP8 matmuls need both dimensions to be multiples of 16.
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


class Float8Converter:
    """FP8 training as a model converter: `convert(blocks)` before parallelizing swaps the blocks' linear
    layers for torchao's FP8 ones, in place; `register(model, optimizer)` hooks its post-step work (the
    FP8 all-gather weights' scales, computed for all weights at once) onto the optimizer's step, so every
    step that updates the weights, wherever it runs, keeps them current and no loop has to know FP8.

    Our model's fused q/k/v and gate/up weights (wqkv, w13) become FP8 layers that run one FP8 matmul per
    slice (Float8SlicedLinear), as the model runs one matmul per slice in bf16; with the model built with
    `fused_matmul` (one matmul, split after: the benchmark's --fused_projections), plain FP8 layers."""

    def __init__(self, recipe: str, *, float8_all_gather: bool):
        self.recipe, self.float8_all_gather = recipe, float8_all_gather
        self.cast_shards_once = True

    def convert(self, blocks: list[nn.Module]) -> int:
        """Swap the blocks' linear layers; return how many were swapped. With float8_all_gather (FSDP2,
        tensorwise) the weights become torchao tensor subclasses that FSDP2 all-gathers in FP8;
        `state_dict` still gives plain tensors (see _plain_weights)."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.float8_all_gather:
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe, plus that
        cast_input = CastInputOnce() if CastInputOnce.applies_to(config) else None
        linears_before = sum(type(m) is nn.Linear for block in blocks for m in block.modules())
        for block in blocks:
            sliced = _sliced_linears(block)
            convert_to_float8_training(block, config=config,
                                       module_filter_fn=lambda m, fqn, s=sliced: _convertible(m, fqn) and m not in s)
            for parent, name, sizes in sliced.values():
                if all(size % 16 == 0 for size in sizes) and _convertible(getattr(parent, name), name):
                    linear = float8_sliced_linear().from_float(getattr(parent, name), config=config)
                    linear.output_slices = sizes
                    setattr(parent, name, linear)
            if cast_input is not None:
                for module in block.modules():
                    if isinstance(module, Float8Linear):
                        module.register_forward_pre_hook(cast_input)
            if self.float8_all_gather:
                block.register_state_dict_post_hook(_plain_weights)
        converted = linears_before - sum(type(m) is nn.Linear for block in blocks for m in block.modules())
        log.info("FP8 training (%s scaling%s%s): %d of %d linear layers in %d blocks converted; embeddings, norms and "
                 "the output projection keep the compute precision", self.recipe,
                 ", FP8 all-gather" if self.float8_all_gather else "",
                 ", inputs cast once for forward and backward" if cast_input is not None else "",
                 converted, linears_before, len(blocks))
        return converted

    def register(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step: the scales the next step's FP8 all-gathers use."""
        if self.float8_all_gather:
            optimizer.register_step_post_hook(lambda *_: self.refresh(model))

    def refresh(self, model: nn.Module) -> None:
        """After the weights changed outside an optimizer step (a checkpoint loaded, the micro-batch search's
        trial weights put back): scales and FP8 shards of the weights as they are now, not of those before."""
        if self.float8_all_gather:
            precompute_float8_scales(model)
            if self.cast_shards_once:
                cast_float8_shards(model)

    def use_accumulation(self, model: nn.Module, grad_accum: int) -> None:
        """Once the run's micro-batches per step are known: the FP8 shards are cast once per step (CastOncePerStep)
        only where a step gathers each weight for several micro-batches. With one, the kept cast would save a
        single re-cast (the backward's all-gather) and hold a byte per parameter through the step's peak."""
        self.cast_shards_once = grad_accum > 1
        if not self.cast_shards_once:
            uncast_float8_shards(model)


def _sliced_linears(block: nn.Module) -> dict[nn.Linear, tuple[nn.Module, str, tuple[int, ...]]]:
    """The linear layers of our block that the model runs one matmul per slice (not fused_matmul), each with
    its parent, its name there and its slices' sizes along the outputs: q/k/v of wqkv, gate/up of w13."""
    sliced: dict[nn.Linear, tuple[nn.Module, str, tuple[int, ...]]] = {}
    for module in block.modules():
        if isinstance(module, Attention) and not module.fused_matmul:
            kv = module.n_kv_heads * module.head_dim
            sliced[module.wqkv] = (module, "wqkv", (module.n_heads * module.head_dim, kv, kv))
        elif isinstance(module, FeedForward) and not module.fused_matmul:
            sliced[module.w13] = (module, "w13", (module.hidden_dim, module.hidden_dim))
    return sliced


@functools.cache
def float8_sliced_linear() -> Any:
    """torchao's FP8 linear layer run as one FP8 matmul per slice of its weight (`output_slices`: sizes along the
    outputs), returning the slices' outputs (model/transformer.py's per_slice_matmuls calls it). Each slice is
    then its own matmul, as in the bf16 model, which the op-level checkpointing policies keep or recompute by
    role (torchtitan's policy recomputes the k and up projections, not q, v and gate). The input is cast to FP8
    once for all slices (CastInputOnce). With the tensorwise FP8 all-gather the whole weight arrives cast with
    one scale, and its slices keep it: their products are the fused product's columns. A class made on first
    use: torchao is imported only when FP8 is asked for."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8SlicedLinear(Float8Linear):
        output_slices: tuple[int, ...]

        def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if torch.is_autocast_enabled():  # as Float8Linear: the output in autocast's precision
                input = input.to(torch.get_autocast_gpu_dtype())
            outputs, start = [], 0
            for size in self.output_slices:
                weight = self.weight.narrow(0, start, size)  # a slice: the FP8 tensors keep their scale
                outputs.append(matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config,
                                                                   self.config))
                start += size
            return tuple(outputs)

    return Float8SlicedLinear


class CastInputOnce:
    """Forward pre-hook of a tensorwise FP8 linear: its input cast to FP8 before the matmul. torchao's matmul keeps an
    FP8 input as it is for backward, whose weight gradient then needs no second cast of the input (an amax reduction
    over the whole activation, then the cast). Tensorwise casts the input for both matmuls with the same scale, so the
    bits are those of torchao's own casts (tests/test_float8.py). Under compile the partitioner may keep the FP8 input
    or recompute it from the input with the kept scale; either way the reduction is not repeated."""

    @staticmethod
    def applies_to(config: Float8LinearConfig) -> bool:
        from torchao.float8.config import ScalingGranularity

        tensorwise = config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
        return tensorwise and config.cast_config_input_for_grad_weight == config.cast_config_input

    def __init__(self):
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        self.is_fp8, self.to_fp8 = tensor_already_casted_to_fp8, hp_tensor_to_float8_dynamic
        self.role = GemmInputRole.INPUT

    def __call__(self, module: Any, args: tuple):  # module: torchao's Float8Linear
        if len(args) != 1 or torch.is_autocast_enabled() or self.is_fp8(args[0]):
            return None  # a keyword input, or autocast (torchao casts to its dtype first): torchao casts as usual
        config = module.config
        return (self.to_fp8(args[0], config.cast_config_input.target_dtype, module.linear_mm_config,
                            gemm_input_role=self.role, round_scales_to_power_of_2=config.round_scales_to_power_of_2),)


def _plain_weights(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook: the FP8 all-gather weights (torchao subclasses, inside FSDP2's DTensors) as plain
    tensors sharing their storage. Checkpoints then hold plain tensors, which load without torchao and
    into a model without FP8 (a sharded checkpoint would otherwise pickle the subclass). Loading copies
    into the parameters, which keep their subclass (tests/test_float8.py checks both)."""
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
            continue
        inner_names, _ = local.__tensor_flatten__()
        plain = getattr(local, inner_names[0])  # the weight itself; a second inner tensor would be its scale
        if isinstance(value, DTensor):
            plain = DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                                       shape=value.shape, stride=value.stride())
        state_dict[key] = plain


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the FP8 scales of all FP8 all-gather weights at once (one all-reduce of
    their maxima), used by the next all-gathers. Does nothing for a model without such weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


class CastOncePerStep:
    """FSDP2's pre-all-gather step for one FP8 all-gather weight, set on its local shard (an instance attribute: FSDP2
    calls it in place of torchao's `fsdp_pre_all_gather`). `refresh()` keeps torchao's own cast of the shard (its FP8
    data and scale); each all-gather after it sends that cast while the weight is unchanged since (its version
    counters), and casts as torchao does otherwise. torchao alone casts at every all-gather (twice per micro-batch and
    weight: forward and backward), each time a few small kernels and some Python at the start of a block, where the GPU
    waits for it. The cast costs one byte per element of the shard, kept for the step."""

    def __init__(self, weight: DTensor):
        self.weight, self.local = weight, weight._local_tensor
        self.torchao_cast = type(self.local).fsdp_pre_all_gather.__get__(self.local)  # type: ignore[attr-defined]
        self.cast: tuple | None = None
        self.versions: tuple[int, int] | None = None

    def _versions(self) -> tuple[int, int]:
        # In-place changes through the DTensor count on it, those to the local shard directly on the shard.
        return self.weight._version, self.local._version

    @torch.no_grad()
    def refresh(self) -> None:
        self.cast = self.torchao_cast(self.weight.device_mesh)
        self.versions = self._versions()

    def __call__(self, mesh):
        if self.cast is not None and self._versions() == self.versions:
            return self.cast
        return self.torchao_cast(mesh)


def uncast_float8_shards(model: nn.Module) -> None:
    """The FP8 all-gather weights back to torchao's cast at every all-gather; their kept casts freed."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, DTensor):
            weight._local_tensor.__dict__.pop("fsdp_pre_all_gather", None)


def cast_float8_shards(model: nn.Module) -> None:
    """After `precompute_float8_scales`: each FP8 all-gather weight's shard cast to FP8 once, for all the
    step's all-gathers (CastOncePerStep)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, DTensor) and getattr(weight._local_tensor, "_precomputed_scale", None) is not None):
            continue  # not an FP8 all-gather weight, or its scale is not computed yet
        local = weight._local_tensor
        stand_in = local.__dict__.get("fsdp_pre_all_gather")
        if not (isinstance(stand_in, CastOncePerStep) and stand_in.weight is weight):
            stand_in = local.fsdp_pre_all_gather = CastOncePerStep(weight)  # type: ignore[attr-defined]
        stand_in.refresh()
