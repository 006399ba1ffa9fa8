"""What both checkpoint formats share: the run's checkpoint settings (`CheckpointContext`) with the collective steps
around every save and load (the disk-space check, the end of a save, the model and tokenizer checks), the metadata
every checkpoint records, and the interface the manager calls (`CheckpointFormat`)."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model import ModelConfig
from model.config import ROPE_SCALING_FIELDS
from safe_io import nofollow
from safe_io.journal import Journal

from ..distributed import DistEnv, agree, barrier
from .contents import Contents, Snapshot
from .errors import CheckpointError, CheckpointMismatch, first_line
from .io import model_config_of
from .names import FORMAT_VERSION, size_of
from .retention import apply_retention, complete_checkpoints, remove_incomplete

log = logging.getLogger(__name__)


def write_cause(err: BaseException) -> str:
    """A failed write's first line, with the likely cause where torch's words hide it."""
    cause = first_line(err)
    if "unexpected pos" in cause:  # torch.save's only word for a write that stopped short
        cause = f"{cause}: a write stopped short (a full disk, a quota or a file size limit?)"
    return cause


def write_error(final: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(f"{final}: cannot write checkpoint ({write_cause(err)}); nothing was written, the previous "
                           f"checkpoints are as they were")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor data this rank holds in a (nested) state dict: what it will write."""
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if hasattr(obj, "local_shards"):  # FSDP1's ShardedTensor
        return sum(tensor_bytes(shard.tensor) for shard in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def _adapters_only(where: object, lora: dict) -> CheckpointMismatch:
    return CheckpointMismatch(f"{where}: holds LoRA adapters (train.lora.rank={lora.get('rank')}) and no base weights; "
                              "resume it with the same train.lora, or merge it with scripts/export_hf.py --merge_lora")


def _model_kind(model_config: dict) -> str:
    """llama (our model: its config has no "type"), or hf and which Hugging Face model_type."""
    kind = str(model_config.get("type", "llama"))
    return f"{kind} ({model_config['model_type']})" if model_config.get("model_type") is not None else kind


def _weight_shape(cfg: ModelConfig) -> dict:
    """What our model's weights, and the function they compute, depend on: its dimensions resolved (n_kv_heads
    None is n_heads, ffn_hidden_dim None is derived) and its rotary settings, without max_seq_len and init_std."""
    return {"vocab_size": cfg.vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.num_kv_heads, "ffn_hidden_dim": cfg.hidden_dim, "rope_theta": cfg.rope_theta,
            "rope_scaling_factor": cfg.rope_scaling_factor, **{n: getattr(cfg, n) for n in ROPE_SCALING_FIELDS},
            "norm_eps": cfg.norm_eps, "tie_embeddings": cfg.tie_embeddings}


@dataclasses.dataclass
class CheckpointContext:
    """The run's checkpoint settings, and the steps every save and load takes whatever the format.
    Every method that is a collective says so; every rank calls those."""

    dir: Path
    env: DistEnv
    fmt: str
    keep_last_n: int
    model_config: dict
    tokenizer_sha256: str | None = None  # recorded in every checkpoint; a resume with another is refused
    allow_tokenizer_change: bool = False
    lora: dict | None = None  # a LoRA run: its adapters' settings and base (parallel/lora.py lora_record)
    stats: list[dict] = dataclasses.field(default_factory=list)  # one row per committed save (benchmarks/benchmark.py)
    journal: Journal = dataclasses.field(init=False)  # what the saves made in `dir`: all they ever remove

    def __post_init__(self) -> None:
        self.journal = Journal(self.dir)

    def metadata(self, snapshot: Snapshot) -> dict:
        """What a checkpoint records besides its parts' states (a sharded one's meta.json, less its files)."""
        tokenizer = {"tokenizer_sha256": self.tokenizer_sha256} if self.tokenizer_sha256 else {}
        lora = {"lora": self.lora} if self.lora else {}
        return {"format_version": FORMAT_VERSION, "world_size": self.env.world_size, "model_config": self.model_config,
                "train_state": snapshot.train_state, **tokenizer, **lora}

    def begin_save(self) -> None:
        """Collective, before a save writes: rank 0 makes the folder and removes what interrupted saves left."""
        error = None
        if self.env.is_main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                remove_incomplete(self.journal)
            except OSError as err:  # the journal is not a file the run can read (a link, a FIFO, ...)
                error = CheckpointError(str(err) if isinstance(err, nofollow.UnsafePath) else first_line(err))
        agree(self.env, error)

    def check_space(self, final: Path, state_dicts: dict | None, *, estimate: int | None = None) -> None:
        """Collective: stop before writing when the checkpoint `final` will not fit on the disk: a write that fails
        half-way costs the time of writing it, and a full disk hurts everything else writing there. At the
        start of the run (`estimate`: this rank's share of the state, as state_bytes counts it; `final`: the output
        directory) the same check stops the run before its first step."""
        if estimate is not None:  # every rank's share: the full checkpoint holds them all, the sharded one too
            mine = estimate
        else:  # full: rank 0 writes what it holds (other ranks may hold a copy too); sharded: every rank its shard
            mine = tensor_bytes(state_dicts) if self.fmt == "sharded" or self.env.is_main else 0
        total = torch.tensor([mine], dtype=torch.int64, device=self.env.device)
        dist.all_reduce(total)
        error = None
        if self.env.is_main:
            previous = complete_checkpoints(self.dir)
            # The previous checkpoint of this run is the best guess; before the first, the tensors plus 1%
            # for torch.save's framing (an overestimate where HYBRID_SHARD replicas each count their shard).
            needed = size_of(previous[0][1]) if previous else int(total.item() * 1.01)
            free = shutil.disk_usage(self.dir).free
            if needed > free:
                if estimate is not None:
                    keep = "stopped before the first training step"
                else:
                    keep = "stopped before writing, " + (f"{previous[0][1].name} stays the newest checkpoint"
                                                         if previous else "no checkpoint was written")
                # Retention removes a checkpoint only once the next is complete: the disk holds one more meanwhile.
                both = (f" (checkpoint.keep_last_n={self.keep_last_n} removes {previous[0][1].name} only once the "
                        f"next checkpoint is complete: the disk must hold both)") if previous and self.keep_last_n \
                    else ""
                it = "a checkpoint" if estimate is not None else "it"
                error = CheckpointError(
                    f"{final}: not enough disk space to save {it} ({needed / 2**20:,.1f} MiB needed{both}, "
                    f"{free / 2**20:,.1f} MiB free in {self.dir}); {keep}. Free some space and resume with "
                    "--resume_from latest")
        agree(self.env, error)

    def end_save(self, final: Path, *, start: float, crc_s: float, mode: str | None = "sync") -> None:
        """Collective, once `final` is in place: retention, the log line and the save's stats row (an
        asynchronous save, `mode` None, writes its own row)."""
        barrier(self.env)  # the checkpoint is in place for every rank before anyone deletes older ones
        seconds = time.perf_counter() - start
        if self.env.is_main:
            apply_retention(self.journal, final, keep_last_n=self.keep_last_n)
            log.info("saved checkpoint %s (%.1f MiB) in %.2f s (CRC32 %.2f s)", final, size_of(final) / 2**20, seconds,
                     crc_s)
        if mode is not None:
            self.stats.append({"name": final.name, "mode": mode, "blocked_s": seconds, "total_s": seconds})

    def check_model(self, meta: dict, path: Path) -> None:
        """The checkpoint's model is this one: the same type (ours or a Hugging Face one, and which), then
        the same shape; then the same tokenizer. Checked before anything else, so a foreign model is not
        blamed on the optimizer."""
        saved_config = meta["model_config"]
        here, there = _model_kind(self.model_config), _model_kind(saved_config)
        if here != there:
            raise CheckpointMismatch(f"{path}: model type differs from the checkpoint: model.type={here} here, "
                                     f"{there} in the checkpoint")
        if here == "llama":
            model_config_of(meta, path)  # each field's type first: a string "128" is not a shape that differs
        for key, value in self.model_config.items():
            if saved_config.get(key, value) != value:
                raise CheckpointMismatch(f"{path}: model shape differs from the checkpoint: model.{key}={value} here, "
                                         f"{saved_config[key]} in the checkpoint")
        self._check_lora(meta.get("lora"), path)
        self._check_tokenizer(meta, path)

    def check_weights(self, meta: dict, path: Path) -> None:
        """model.init_from: the checkpoint's weights fit this model. Only what they depend on must agree (for our
        model: not max_seq_len, init_std, or how the MLP width is given), then the tokenizer as for a resume."""
        where = f"model.init_from={path}"
        if (lora := meta.get("lora")) is not None:
            raise _adapters_only(where, lora)
        saved_config = meta["model_config"]
        here, there = _model_kind(self.model_config), _model_kind(saved_config)
        if here != there:
            raise CheckpointMismatch(f"{where}: model.type={here} here, {there} in the checkpoint")
        mine, theirs = self.model_config, saved_config
        if here == "llama":
            mine, theirs = _weight_shape(ModelConfig(**mine)), _weight_shape(model_config_of(meta, path))
        for key, value in mine.items():
            if theirs.get(key, value) != value:
                hint = " (0 takes the tokenizer's; give the checkpoint's)" if key == "vocab_size" else ""
                raise CheckpointMismatch(f"{where}: the model differs from the checkpoint's: model.{key}={value} "
                                         f"here{hint}, {theirs[key]} in the checkpoint")
        self._check_tokenizer(meta, path)
    def _check_lora(self, saved: dict | None, path: Path) -> None:
        """A LoRA checkpoint resumes only as LoRA, with the same adapters, on the same base."""
        here = self.lora
        if saved is None and here is None:
            return
        if here is None:
            assert saved is not None
            raise _adapters_only(path, saved)
        if saved is None:
            raise CheckpointMismatch(f"{path}: a checkpoint of a whole model, not of LoRA adapters; resume it without "
                                     "train.lora, or fine-tune from it as the base (model.init_from)")
        for key in ("rank", "alpha", "targets"):
            if saved.get(key) != here[key]:
                raise CheckpointMismatch(f"{path}: train.lora.{key}={here[key]} here, {saved.get(key)} in the "
                                         "checkpoint")
        base, saved_base = here["base"], saved.get("base") or {}
        if saved_base.get("fingerprint") != base["fingerprint"]:
            where = lambda b: ", ".join(f"{k}={v}" for k, v in b.items())  # noqa: E731
            raise CheckpointMismatch(f"{path}: its adapters belong to another base model ({where(saved_base)}; this "
                                     f"run's base: {where(base)}); resume on the base it was trained on")

    def _check_tokenizer(self, meta: dict, path: Path) -> None:
        """The checkpoint was trained with this run's tokenizer (a checkpoint without a tokenizer record says
        nothing, and loads)."""
        saved = meta.get("tokenizer_sha256")
        if (saved is None or self.tokenizer_sha256 is None or saved == self.tokenizer_sha256
                or self.allow_tokenizer_change):
            return
        raise CheckpointMismatch(
            f"{path}: trained with another tokenizer (sha256 {saved[:8]}, this run's is {self.tokenizer_sha256[:8]}); "
            f"use the run's tokenizer, or set checkpoint.allow_tokenizer_change=true for a deliberate vocabulary swap")


class CheckpointFormat:
    """One on-disk format: how a checkpoint of a step is named, written (every rank; a complete checkpoint or
    a CheckpointError on every rank, the previous checkpoints as they were) and read back."""

    def __init__(self, context: CheckpointContext):
        self.context = context
        self.env = context.env

    def path_of(self, step: int) -> Path:
        raise NotImplementedError

    def save(self, contents: Contents, snapshot: Snapshot, *, start: float) -> Path:
        """Write and commit the checkpoint of `contents` at snapshot.step (`snapshot` taken); `start`: when the save
        began, for its duration."""
        raise NotImplementedError

    def load(self, contents: Contents, path: Path) -> tuple[dict, dict]:
        """Restore the tensor parts of `contents` from `path` (already checked); returns its metadata and its per-rank
        parts (contents.Contents.restore_plain restores those and the train state)."""
        raise NotImplementedError

    def load_weights(self, contents: Contents, path: Path) -> dict:
        """Only the model's weights from `path` (already checked; model.init_from); returns its metadata."""
        raise NotImplementedError
