"""Hugging Face causal LMs (model.type: hf) in the same loop: building and sharding
(the model's tokenizer, `data.tokenizer: hf`, lives in data/hf_tokenizer.py).

Loading a pretrained model on many ranks never holds a full copy per rank: rank 0 reads the weights
into CPU memory, every rank wraps a meta-device skeleton, and once it is sharded (FSDP1 or FSDP2) the
weights reach every rank's shards by a rank-0 broadcast of the full state dict (Rank0Weights)."""
from __future__ import annotations

import inspect
import logging
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from config import Config, ConfigError, read_yaml_file
from config.model_checks import MAX_DIM, MAX_FFN_HIDDEN_DIM, MAX_LAYERS, MAX_VOCAB_SIZE
from data.errors import DataError
from data.jsonfile import read_json_file
from model.documents import document_ids, document_positions
from model.loss import IGNORE_INDEX, reduce_loss

from ..checkpoint.contents import MODEL
from ..checkpoint.errors import CheckpointError
from ..checkpoint.io import read_meta, verify
from ..checkpoint.safe_read import dcp_load, load_full
from ..distributed import DistEnv
from .lora import has_adapters
from .weights import BuiltModel, GiB, ModelMemoryError, WeightInit, too_large

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # imported only for model.type=hf

log = logging.getLogger(__name__)


class HFModelError(ValueError):
    """model.hf_path or model.hf_config cannot be used; the message names which, and why."""


class HFFiles(Protocol):
    """Where a Hugging Face model is described: a folder (hf_path) or a config.json (hf_config), one of them set.
    The config's model section is one; so is the base a checkpoint names (HFSource)."""

    hf_path: str
    hf_config: str


@dataclass
class HFSource:
    """HFFiles that are not the run's model section (a checkpoint's base, a folder to evaluate), with `where`,
    how messages name it."""

    hf_path: str = ""
    hf_config: str = ""
    where: str = ""


class CausalLMAdapter(nn.Module):
    """Gives a transformers causal LM our model's interface: forward(tokens, targets) -> mean loss.
    With `eos_id` (data.document_masking), position ids restart after each EOS: transformers then treats
    the window as packed sequences and masks attention at their boundaries."""

    lm: Any  # a transformers PreTrainedModel (transformers is imported only for model.type=hf)

    def __init__(self, lm: nn.Module, *, eos_id: int | None = None):
        super().__init__()
        self.lm = lm
        self.eos_id = eos_id

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                loss_reduction: str = "mean") -> torch.Tensor:
        position_ids = None if self.eos_id is None else document_positions(document_ids(tokens, self.eos_id))
        logits = self.lm(input_ids=tokens, position_ids=position_ids, use_cache=False).logits  # (B, T, V)
        if targets is None:
            return logits
        # Our targets are already shifted by one; fp32 for a stable log-sum-exp. Reduced as our model does:
        # IGNORE_INDEX targets (a fine-tuning prompt) do not count.
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                                ignore_index=IGNORE_INDEX)
        return reduce_loss(total, targets, loss_reduction)


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers' keyword for a model's dtype: `dtype`, or `torch_dtype` in the releases before 4.56 that
    pyproject.toml still admits (newer ones warn about it)."""
    from packaging.version import Version
    from transformers import __version__

    return {"dtype": dtype} if Version(__version__) >= Version("4.56") else {"torch_dtype": dtype}


def _field(model_cfg: HFFiles) -> str:
    return f"model.hf_path={model_cfg.hf_path}" if model_cfg.hf_path else f"model.hf_config={model_cfg.hf_config}"


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def config_json(model_cfg: HFFiles) -> Path:
    """The config.json that model.hf_path's folder holds, or that model.hf_config names (or its folder holds)."""
    path = Path(model_cfg.hf_path or model_cfg.hf_config)
    return path / "config.json" if path.is_dir() else path


def load_hf_config(model_cfg: HFFiles, *, where: str | None = None) -> PretrainedConfig:
    """The transformers config of model.hf_path (or model.hf_config); HFModelError in one line, naming `where` (default:
    the field), when it cannot be read or needs the folder's own code (never run, never asked about). The file is read
    by the bounded JSON reader first: transformers' own read fails on deep nesting with a traceback."""
    from transformers import AutoConfig

    where = where or _field(model_cfg)
    path, raw = config_json(model_cfg), {}
    try:
        if path.exists():  # a missing one is said by transformers below
            raw = read_json_file(path)
    except DataError as err:  # "PATH: problem", the path left out where `where` names it already
        raise HFModelError(f"{where}: {str(err).removeprefix(f'{path}: ') if str(path) in where else err}") from None
    if not isinstance(raw, dict):
        raise HFModelError(f"{where}: {path} does not hold a JSON object")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        if raw.get("auto_map"):
            raise HFModelError(f"{where}: its config.json needs the folder's own Python code (auto_map), which is "
                               f"never run; use a model type that transformers includes") from None
        raise HFModelError(f"{where}: cannot read its config.json ({_one_line(err)})") from None


def hf_problems(model_cfg: HFFiles, *, document_masking: bool = False, host_free: int | None = None,
                weights: bool = True) -> list[str]:
    """Config-time check of model.type=hf: the folder's config loads, its sizes fit (size_problem: `host_free`, the
    bytes rank 0's host can still give, if known; `weights`: whether model.hf_path's weight files are read here), and
    with data.document_masking the model can mask packed documents (before any process group starts)."""
    try:
        hf_config = load_hf_config(model_cfg)
    except HFModelError as err:
        return [str(err)]
    if (error := size_problem(model_cfg, hf_config, host_free=host_free, weights=weights)) is not None:
        return [str(error)]
    if document_masking and (reason := packed_sequences_unsupported(hf_config)):
        return [f"data.document_masking: {_field(model_cfg)} {reason}; turn data.document_masking off for it"]
    return []


def packed_sequences_unsupported(hf_config: PretrainedConfig) -> str | None:
    """Why transformers cannot mask this model's packed documents from restarting position ids, or None when
    it can: its forward takes position_ids, its module builds masks with masking_utils (which finds packed
    sequences in them), and its attention implementation is one masking_utils knows."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    try:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]  # a model class (its stubs say otherwise)
    except KeyError:
        return f"({type(hf_config).__name__}) is not a causal LM that transformers includes"
    if "position_ids" not in inspect.signature(cls.forward).parameters:
        return f"({cls.__name__}) takes no position_ids, from which transformers finds packed documents"
    if not hasattr(sys.modules[cls.__module__], "create_causal_mask"):
        return f"({cls.__name__}) does not build its mask with transformers' masking_utils"
    impl = getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"has attention implementation {impl}, for which transformers builds no packed-sequence mask"
    return None


SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
# The largest of each config.json size this library builds: our own model's bounds (config/model_checks.py), past
# any released model's. A larger one is a typo, and a skeleton of that many layers alone is slow to build.
SIZE_LIMITS = {"hidden_size": (MAX_DIM, "2**20"), "intermediate_size": (MAX_FFN_HIDDEN_DIM, "2**22"),
               "num_hidden_layers": (MAX_LAYERS, "2**16"), "vocab_size": (MAX_VOCAB_SIZE, "2**24"),
               "num_attention_heads": (MAX_DIM, "2**20"), "num_key_value_heads": (MAX_DIM, "2**20"),
               "head_dim": (MAX_DIM, "2**20")}
# Weight files hold at least a byte per parameter (fp8), a quantized model's (quantization_config) at least a bit.
MIN_BITS_PER_PARAMETER = 8
MIN_QUANTIZED_BITS_PER_PARAMETER = 1


def describe_size(model_cfg: HFFiles, hf_config: PretrainedConfig, n_params: int | None = None, *,
                  at_least: bool = False) -> str:
    """The config.json values that size the model, for messages: `model.hf_config=...: hidden_size 64, ...`."""
    sizes = ", ".join(f"{k} {getattr(hf_config, k)}" for k in SIZE_KEYS if getattr(hf_config, k, None) is not None)
    count = "" if n_params is None else f": {'at least ' if at_least else ''}{n_params:,} parameters"
    return f"{_field(model_cfg)}: {sizes}{count}"


def _sizes(text_config: PretrainedConfig, key: str) -> list[int] | None:
    """config.json's `key` as a list (one value, or one per layer), or None when the model has no such field."""
    value = getattr(text_config, key, None)
    return None if value is None else value if isinstance(value, list) else [value]


def _size_field_problem(model_cfg: HFFiles, text_config: PretrainedConfig) -> str | None:
    """The first size of config.json that is not a positive integer within SIZE_LIMITS."""
    for key, (limit, text) in SIZE_LIMITS.items():
        for value in _sizes(text_config, key) or []:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
                return (f"{_field(model_cfg)}: config.json's {key}={value!r} must be a positive integer of at most "
                        f"{text} = {limit} (past any released model's)")
    return None


def min_parameters(hf_config: PretrainedConfig) -> int:
    """A lower bound of the parameters config.json describes, from its sizes alone (nothing is built): the token
    embedding (and an untied output head of the same size) and per decoder layer the attention's query and output
    projections and two MLP matrices. Norms, biases, key/value projections, a gate and further experts come on
    top; a size the model does not have counts nothing."""
    text = hf_config.get_text_config()
    hidden, vocab = (_sizes(text, "hidden_size") or [0])[0], (_sizes(text, "vocab_size") or [0])[0]
    layers = (_sizes(text, "num_hidden_layers") or [0])[0]
    heads = getattr(text, "num_attention_heads", None)
    heads = heads if isinstance(heads, int) else 0
    head_dim = getattr(text, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) else hidden // heads if heads else 0
    mlp = min(_sizes(text, "intermediate_size") or [0])
    embeddings = vocab * hidden * (1 if getattr(hf_config, "tie_word_embeddings", False) else 2)
    return embeddings + layers * (2 * hidden * heads * head_dim + 2 * hidden * mlp)


def size_problem(model_cfg: HFFiles, hf_config: PretrainedConfig, *, host_free: int | None = None,
                 weights: bool = True) -> HFModelError | ModelMemoryError | None:
    """The model sized from config.json alone, before anything is built: HFModelError for a size out of bounds,
    or (with `weights`, for model.hf_path) weight files that cannot hold min_parameters or name a file outside the
    folder; ModelMemoryError when rank 0's full fp32 copy (hf.Rank0Weights) of min_parameters exceeds
    `host_free`, the bytes rank 0's host can still give (None: not known, or another host)."""
    if (problem := _size_field_problem(model_cfg, hf_config.get_text_config())) is not None:
        return HFModelError(problem)
    n_params = min_parameters(hf_config)
    if weights and model_cfg.hf_path and (problem := _weights_problem(model_cfg, hf_config, n_params)) is not None:
        return HFModelError(problem)
    if host_free is not None and 4 * n_params > host_free:
        return too_large(describe_size(model_cfg, hf_config, n_params, at_least=True), 4 * n_params, host_free,
                         "host memory", f" (rank 0's full copy of at least {4 * n_params / GiB:,.1f} GiB)",
                         "use a smaller model: rank 0 reads all of its weights")
    return None


def _weights_problem(model_cfg: HFFiles, hf_config: PretrainedConfig, n_params: int) -> str | None:
    """model.hf_path's weight files: present, each where its index says, and large enough for n_params."""
    try:
        files = weight_files(Path(model_cfg.hf_path))
        stored = sum(path.stat().st_size for path in files)
    except HFModelError as err:
        return f"{_field(model_cfg)}: {err}"
    except OSError as err:
        return f"{_field(model_cfg)}: cannot read its weight file {err.filename} ({err.strerror or err})"
    if not files:
        return (f"{_field(model_cfg)}: holds no weights ({', '.join(WEIGHT_FILES)}); for a model built from its "
                f"config.json alone, with random weights, set model.hf_config instead")
    bits = (MIN_QUANTIZED_BITS_PER_PARAMETER if getattr(hf_config, "quantization_config", None)
            else MIN_BITS_PER_PARAMETER)
    if 8 * stored >= bits * n_params:
        return None
    per = "a byte" if bits == 8 else "a bit"
    return (f"{describe_size(model_cfg, hf_config, n_params, at_least=True)}, but its weight files hold "
            f"{stored:,} bytes, less than {per} per parameter: the weights are cut short, or config.json describes a "
            f"larger model than they hold")


# The weight files transformers loads from a model folder, in its order: one safetensors file, a sharded one's
# index, then the same as pickles (torch.load with weights_only).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def weight_files(folder: Path) -> list[Path]:
    """The files transformers reads the weights of `folder` from: the first of WEIGHT_FILES there, or the shards
    its index lists; [] when there is none. HFModelError in one line for an index that is unreadable or names a
    file outside the folder."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / shard for shard in index_shards(folder / name)] if name.endswith(".json") else \
                [folder / name]
    return []


def index_shards(index: Path) -> list[str]:
    """The shard files a sharded checkpoint's index (model.safetensors.index.json) maps its tensors to: plain
    names of files in the index's own folder. HFModelError naming the index otherwise: transformers would join a
    `../x.safetensors` or an absolute path to the folder and read the file there."""
    try:
        content = read_json_file(index)
    except DataError as err:
        raise HFModelError(str(err)) from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HFModelError(f"{index}: no weight_map of tensor names to shard files")
    for name in weight_map.values():
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise HFModelError(f"{index}: names the shard {name!r}, which is not a file of its folder "
                               f"{index.parent}: only files beside the index are read")
    return sorted(set(weight_map.values()))


def config_signature(hf_config: PretrainedConfig) -> dict:
    """The fields that decide parameter shapes, stored in checkpoints to catch a mismatched resume."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return {"type": "hf", **{k: getattr(hf_config, k, None) for k in keys}}


def decoder_layer_classes(lm: nn.Module) -> set[type]:
    """The classes FSDP wraps one by one: the model's own `_no_split_modules` (its decoder layers)."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    classes = {type(m) for m in lm.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(lm).__name__} names no decoder layer class in _no_split_modules; "
                         "cannot auto-wrap it")
    return classes


def _unify_dtypes(lm: nn.Module) -> None:
    """FSDP flattens each unit into one tensor, so all parameters must share a dtype: keep fp32 masters."""
    dtypes = {p.dtype for p in lm.parameters()}
    if dtypes != {torch.float32}:
        log.info("model.type=hf: casting parameters from %s to float32 (FSDP needs one dtype; fp32 master weights)",
                 sorted(str(d).replace("torch.", "") for d in dtypes))
        lm.float()


def build_hf_model(cfg: Config, env: DistEnv, *, on_meta: bool, eos_id: int | None = None) -> CausalLMAdapter:
    """Rank 0 (or every rank when not on_meta) holds real weights on the CPU; the others a meta-device skeleton."""
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(cfg.model)
    if on_meta:
        try:
            with torch.device("meta"):
                lm = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False,
                                                      **dtype_kwarg(torch.float32))
        # No memory is used here: config.json is wrong (a size, an activation or rotary scaling it does not have).
        except (RuntimeError, ValueError, ArithmeticError, LookupError, TypeError) as err:
            raise HFModelError(f"{describe_size(cfg.model, hf_config)}: transformers cannot build this model "
                               f"({_one_line(err)}); correct its config.json") from None
    elif cfg.model.hf_path:
        lm = load_pretrained(cfg.model)
    else:
        torch.manual_seed(cfg.run.seed)
        lm = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, **dtype_kwarg(torch.float32))
    lm.config.use_cache = False
    _unify_dtypes(lm)
    return CausalLMAdapter(lm, eos_id=eos_id)


def load_pretrained(model_cfg: HFFiles) -> nn.Module:
    """The weights of model.hf_path on the CPU; HFModelError in one line for missing, damaged or refused files."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        weight_files(Path(model_cfg.hf_path))  # transformers would read an index's shards from anywhere
    except HFModelError as err:
        raise HFModelError(f"{_field(model_cfg)}: {err}") from None
    try:
        return AutoModelForCausalLM.from_pretrained(model_cfg.hf_path, local_files_only=True, trust_remote_code=False,
                                                    **dtype_kwarg(torch.float32))
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met something other than tensors
        raise HFModelError(f"{_field(model_cfg)}: its pickled weights (.bin) were refused: they hold something other "
                           f"than tensors (loading them would run code) or are damaged; use .safetensors weights "
                           f"from a source you trust") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # missing, truncated, mismatched
        raise HFModelError(f"{_field(model_cfg)}: cannot load the weights ({_one_line(err)})") from None


def build_for_sharding(cfg: Config, env: DistEnv, *, eos_id: int | None = None) -> BuiltModel:
    """A meta-device skeleton on every rank, wrapped per decoder layer (the model's _no_split_modules);
    its weights arrive from rank 0 once sharded (Rank0Weights). `eos_id`: see CausalLMAdapter."""
    model = build_hf_model(cfg, env, on_meta=True, eos_id=eos_id)
    return BuiltModel(model, decoder_layer_classes(model.lm), Rank0Weights(model, cfg, env))


class Rank0Weights(WeightInit):
    """Rank 0 alone reads the real weights into CPU memory and broadcasts them into every rank's shards
    (FSDP1's sync_module_states would do this only on GPUs)."""

    def __init__(self, model: CausalLMAdapter, cfg: Config, env: DistEnv):
        self.model, self.cfg, self.env = model, cfg, env

    def init_module(self, module: nn.Module, device: torch.device) -> None:
        # Allocate only (the values arrive by the broadcast), then re-tie tied embeddings, which
        # materialising module by module would otherwise split.
        module.to_empty(device=device, recurse=False)
        if getattr(self.model.lm.config, "tie_word_embeddings", False):
            self.model.lm.tie_weights()

    def init_sharded(self, model: nn.Module, device: torch.device) -> None:
        if any(p.is_meta for p in model.parameters()):  # FSDP2: shards still unallocated
            model.to_empty(device=device)
        full_state = buffers = None
        error: list[str | None] = [None]
        if self.env.is_main:
            try:
                real = build_hf_model(self.cfg, self.env, on_meta=False)
                full_state, buffers = real.state_dict(), dict(real.named_buffers())
            except HFModelError as err:
                error = [str(err)]
        # Rank 0's failure reaches every rank, which would otherwise wait in the weights' broadcast.
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise HFModelError(error[0])
        broadcast_from_rank0(model, full_state, buffers, self.env)


@torch.no_grad()
def broadcast_from_rank0(model: nn.Module, full_state: dict | None, buffers: dict | None, env: DistEnv) -> None:
    """Fill the sharded parameters from rank 0's full state dict, and every buffer (rotary tables are
    non-persistent, so not in the state dict) from rank 0's model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if env.is_main:
        assert full_state is not None and buffers is not None, "rank 0 passes its real model's state"
    else:
        full_state, buffers = {}, {}
    # With LoRA adapters (train.lora) the base's state dict lacks them: LoRAInit fills them afterwards.
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                     strict=not has_adapters(model)))
    for name, buf in model.named_buffers():
        if env.is_main:
            # FSDP1 prefixes wrapped modules' names; rank 0's plain model has none.
            buf.copy_(buffers[name.replace("_fsdp_wrapped_module.", "")])
        dist.broadcast(buf, src=0)


# ---- a fine-tuned Hugging Face model's checkpoint, read in one plain process (export, evaluate, generate) ----
RUN_CONFIG_NAME = "config.yaml"  # the resolved config the trainer writes next to its checkpoints
BASE_HINT = "pass --base MODEL_FOLDER (the Hugging Face model folder the run fine-tuned)"


def checkpoint_source(checkpoint: Path, base: Path | None = None) -> HFSource:
    """Where the architecture of a model.type=hf checkpoint is described (hf_path or hf_config, and `where` for
    messages): `base` (a model folder or its config.json) when given, else the model.hf_path or model.hf_config of
    the run's config.yaml next to the checkpoint."""
    if base is not None:
        folder = base.is_dir()
        return HFSource(hf_path=str(base) if folder else "", hf_config="" if folder else str(base),
                        where=f"--base {base}")
    run_config = Path(checkpoint).absolute().parent / RUN_CONFIG_NAME
    try:  # the bounded loader: a copied run folder's config.yaml is input like any other
        model = read_yaml_file(run_config)["model"]
        source = HFSource(hf_path=str(model.get("hf_path") or ""), hf_config=str(model.get("hf_config") or ""))
    except (ConfigError, TypeError, KeyError, AttributeError):
        source = HFSource()
    if not source.hf_path and not source.hf_config:
        raise HFModelError(f"{checkpoint}: a Hugging Face model's checkpoint, but {run_config} does not name its "
                           f"model.hf_path or model.hf_config; {BASE_HINT}")
    source.where = f"{_field(source)} (from {run_config})"
    return source


def _checkpoint_config(checkpoint: Path, meta: dict, source: HFSource) -> PretrainedConfig:
    """The transformers config of `source`, checked against the shape the checkpoint recorded."""
    try:
        hf_config = load_hf_config(source, where=source.where)
    except HFModelError as err:
        if source.where.startswith("--base"):
            raise
        raise HFModelError(f"{err}; {BASE_HINT}") from None  # the folder may have moved since training
    described = config_signature(hf_config)
    for key, value in meta["model_config"].items():
        if described.get(key) != value:
            raise HFModelError(f"{checkpoint}: {source.where} describes another model ({key}={described.get(key)} "
                               f"there, {value} in the checkpoint); {BASE_HINT}")
    return hf_config


def _checkpoint_weights(checkpoint: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, exactly those of `expected` (meta tensors: names, shapes, dtypes)."""
    if checkpoint.is_dir():
        state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in expected.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "loading in a single process" is what we want
            dcp_load({MODEL: state}, checkpoint, no_dist=True)  # in place; a missing tensor is an error
        return state
    saved = load_full(checkpoint)[MODEL]
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    wrong = sorted(name for name in set(saved) & set(expected) if saved[name].shape != expected[name].shape)
    if missing or extra or wrong:
        what = (f"no {missing[0]}" if missing else f"a tensor the model has no place for, {extra[0]}" if extra
                else f"{wrong[0]} of shape {tuple(saved[wrong[0]].shape)}, not {tuple(expected[wrong[0]].shape)}")
        raise CheckpointError(f"{checkpoint}: does not fit the model its model_config describes ({what})")
    return saved


def load_hf_checkpoint(checkpoint: str | Path, *, base: Path | None = None) -> tuple[CausalLMAdapter, dict, HFSource]:
    """(the fine-tuned model in fp32 on the CPU, in eval mode; the checkpoint's metadata; where its architecture
    came from) for a model.type=hf checkpoint, full or sharded. Its architecture is the config.json of the folder
    the run fine-tuned (checkpoint_source), checked against the shape the checkpoint recorded."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    verify(checkpoint)
    if meta["model_config"].get("type") != "hf":
        raise CheckpointError(f"{checkpoint}: a checkpoint of our model, not of a Hugging Face one")
    if "lora" in meta:
        raise CheckpointError(f"{checkpoint}: holds LoRA adapters, not a model; merge them into the base first: "
                              "scripts/export_hf.py CHECKPOINT OUT_DIR --merge_lora")
    source = checkpoint_source(checkpoint, base)
    hf_config = _checkpoint_config(checkpoint, meta, source)
    with torch.device("meta"):  # names and shapes only
        skeleton = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, **dtype_kwarg(torch.float32))
    expected = {f"lm.{name}": t for name, t in skeleton.state_dict().items()}
    weights = {name.removeprefix("lm."): t for name, t in _checkpoint_weights(checkpoint, expected).items()}
    # transformers builds the model (its non-persistent buffers, rotary tables, included) around these weights.
    lm = type(skeleton).from_pretrained(None, config=hf_config, state_dict=weights, local_files_only=True,
                                        trust_remote_code=False, **dtype_kwarg(torch.float32))
    return CausalLMAdapter(lm.float()).eval(), meta, source
