"""The checkpoint manager: full (one file, gathered to rank 0 on the CPU) or sharded (one file per
rank, torch.distributed.checkpoint), atomic checksummed saves, retention, and resume from a path or
`latest`. The format on disk, its safe reading and its error types live in checkpoint_format.

Every rank calls every method: state dicts, DCP reads and writes and the checks around them are
collectives, and every rank reaches the same outcome (an error on one rank is raised on all).

A checkpoint counts only once complete. Full: written to `.tmp-fsdp_cpt{step}.pth` (its CRC32 computed
while writing), then renamed, then its checksum record. Sharded: DCP writes into
`.tmp-fsdp_sharded_cpt{step}/`, each rank hashes the files it wrote, and rank 0 writes `meta.json`
(every file's size and CRC32) last, then renames the folder. Names starting `.tmp-` are never loaded
and are removed by the next save. Saving is two steps, writing and `_commit_*` (checksums, metadata,
rename, retention), so that an asynchronous save can commit once its background write is done.

Asynchronous sharded saves (checkpoint.async_save; the staging and the writer are in async_save.py):
`save` stages the state in host memory and starts the write in the background, then returns; the
loop calls `poll` at the same point of every step, and the save is committed there once every rank's
write is done, with the same steps and guarantees as a synchronous save (see `poll` for why the ranks
agree first). At most one save is in flight: the next `save` waits for it; `finish` (the end of the
run, a stop signal) waits for it too.

Loading checks sizes, then (checkpoint.verify) every file's CRC32, spread over the ranks. With
`latest`, a checkpoint that fails those checks or does not decode is moved aside as `corrupt-<name>`
(never loaded, never deleted) and the previous one is tried.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from .format import (
    CORRUPT_PREFIX, FORMAT_VERSION, FULL_PAYLOAD_KEYS, FULL_RE, META_NAME, RNG_NAME, SHARDED_RE, TMP_PREFIX, CheckpointCorrupt,
    CheckpointError, CheckpointMismatch, CheckpointUnsafe, check_file, check_structure, checksum_records, dcp_load,
    file_record, first_line, full_name, install_full, load_full, load_rng, read_sharded_meta, save_with_checksum, sharded_name,
    sidecar_of, size_of, write_json, write_record)
from .host_memory import check_host_memory, format_size
from .staging import HostStaging, StageStats, arena_bytes, live_storages, state_bytes, storage_tensors
from .writer import BackgroundWriter, resolve_async_save
from ..distributed import DistEnv, barrier

log = logging.getLogger(__name__)

# Module names that wrappers insert into parameter names; checkpoints hold the plain model's names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


class AsyncSaveFailed(CheckpointError):
    """An asynchronous save could not stage or start its write: the same step is saved synchronously."""


_ERRORS = {cls.__name__: cls for cls in (CheckpointError, CheckpointMismatch, CheckpointCorrupt, CheckpointUnsafe,
                                          AsyncSaveFailed)}
_DCP_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclasses.dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs, as plain data."""

    step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # global sample index of the next batch (the data position)
    tokens_seen: int = 0
    grad_scaler: dict | None = None
    rng: list | None = None  # per rank: {"cpu": ByteTensor, "cuda": ByteTensor | None}


@contextlib.contextmanager
def _quiet_state_dict_warnings():
    """FSDP1's state dicts warn on every call, at every save and load: the sharded one (ShardedTensor)
    that ShardedTensor is deprecated and that `_get_pg_default_device` will be, and at world size 1 that
    NO_SHARD returns full state dicts. Torch's internals, nothing a user can act on."""
    with warnings.catch_warnings():
        for message in ("Please use DTensor instead", "`_get_pg_default_device` will be deprecated",
                        "Multiple backends are registered with this ProcessGroup",
                        "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"):  # "will be", "willbe"
            warnings.filterwarnings("ignore", message=re.escape(message))
        yield


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename folder `src` to `dst`. os.replace cannot replace a non-empty folder, so an existing `dst` is
    first renamed to a `.tmp-` name, which the next save removes should we stop before deleting it here."""
    if dst.exists():
        old = dst.with_name(f"{TMP_PREFIX}replaced-{dst.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old)
    else:
        os.replace(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _model_kind(model_config: dict) -> str:
    """llama (our model: its config has no "type"), or hf and which Hugging Face model_type."""
    kind = str(model_config.get("type", "llama"))
    return f"{kind} ({model_config['model_type']})" if model_config.get("model_type") is not None else kind


def _write_cause(err: BaseException) -> str:
    """A failed write's first line, with the likely cause where torch's words hide it."""
    cause = first_line(err)
    if "unexpected pos" in cause:  # torch.save's only word for a write that stopped short
        cause = f"{cause}: a write stopped short (a full disk, a quota or a file size limit?)"
    return cause


def _owner(name: str, index: int, world_size: int) -> int:
    """The rank that hashes file `name` (the index-th of the checkpoint's files): DCP's `__{rank}_{i}.distcp`
    goes to the rank that wrote it (still in its page cache), everything else round-robin."""
    if (m := _DCP_FILE_RE.match(name)) and int(m.group(1)) < world_size:
        return int(m.group(1))
    return index % world_size


def _tensor_bytes(obj) -> int:
    """Bytes of the tensor data this rank holds in a (nested) state dict: what it will write."""
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if hasattr(obj, "local_shards"):  # FSDP1's ShardedTensor
        return sum(_tensor_bytes(shard.tensor) for shard in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return 0


def _param_group_fqns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names of each optimizer group, without wrapper prefixes (as in the state dicts)."""
    names = {}
    for name, param in model.named_parameters():
        parts = [p for p in name.split(".") if p not in WRAPPER_PREFIXES]
        names[id(param)] = ".".join(parts)
    return [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]


def _check_param_groups(saved_optim_sd: dict, model, optimizer, path: Path) -> None:
    """The checkpoint's optimizer groups hold the same parameters as this optimizer's: torch would
    otherwise load mismatched groups without a word and fail (or train wrongly) at the first step."""
    try:
        saved = [list(group["params"]) for group in saved_optim_sd["param_groups"]]
    except (KeyError, TypeError):
        raise CheckpointCorrupt(f"{path}: the optimizer state has no parameter groups") from None
    here = _param_group_fqns(model, optimizer)
    if saved != here:
        sizes = lambda groups: "/".join(str(len(g)) for g in groups)  # noqa: E731
        raise CheckpointMismatch(
            f"{path}: the optimizer's parameter groups differ from the checkpoint's ({sizes(here)} parameters "
            f"per group here, {sizes(saved)} in the checkpoint): saved by a different optimizer setup")


def _rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _gather_rng(env: DistEnv) -> list:
    states = [None] * env.world_size
    dist.all_gather_object(states, _rng_state(env.device))
    return states


def _restore_rng(states: list | None, env: DistEnv) -> None:
    # A run resumed on a different world size has no saved state for the new ranks: they keep their seed.
    if not states or env.rank >= len(states):
        return
    torch.set_rng_state(states[env.rank]["cpu"])
    if env.device.type == "cuda" and states[env.rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[env.rank]["cuda"], env.device)


def _hash_own_files(folder: Path, rank: int, world_size: int) -> tuple[dict, float]:
    """{name: {"size", "crc32"}} of the files of a written checkpoint that this rank hashes, and the
    seconds it took."""
    start = time.perf_counter()
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    mine = {n: file_record(folder / n) for i, n in enumerate(names) if _owner(n, i, world_size) == rank}
    return mine, time.perf_counter() - start


@dataclasses.dataclass
class _InFlight:
    """An asynchronous save whose background write has started and that is not committed yet."""

    tmp: Path
    final: Path
    state: TrainState  # a copy taken when the save started: the loop goes on changing its own
    start: float
    job: concurrent.futures.Future  # (this rank's checksum records, seconds) once the write is done
    staged: StageStats
    staged_state: dict  # the host copy being written: a failed write is redone from it, synchronously
    blocked: float = 0.0  # seconds the training loop spent in this save so far (staging, polls, waits, commit)


class CheckpointManager:
    def __init__(self, output_dir: Path, *, fmt: str, keep_last_n: int, model_config: dict, env: DistEnv,
                 verify: bool = True, async_save: bool | str = False, async_writer: str = "thread",
                 on_async_error: str = "stop", timeout_s: float = 600, tokenizer_sha256: str | None = None,
                 allow_tokenizer_change: bool = False):
        self.dir = Path(output_dir)
        self.fmt = fmt
        self.keep_last_n = keep_last_n
        self.model_config = model_config
        self.tokenizer_sha256 = tokenizer_sha256  # recorded in every checkpoint; a resume with another is refused
        self.allow_tokenizer_change = allow_tokenizer_change
        self.env = env
        self.verify = verify
        self.async_save = resolve_async_save(async_save, fmt=fmt, device=env.device)
        self.async_writer = async_writer
        self.on_async_error = on_async_error
        self.timeout_s = timeout_s
        self._prepared = False
        self._writer: BackgroundWriter | None = None
        self._staging: HostStaging | None = None
        self._in_flight: _InFlight | None = None
        self._async_failed = False  # an asynchronous save of this run failed: the last save is synchronous
        self.stats: list[dict] = []  # one row per committed save: what scripts/benchmark.py reports

    # ---- agreement between ranks ----------------------------------------------------------------
    def _agree(self, error: CheckpointError | None) -> None:
        """Raise on every rank the first rank's error, if any rank had one (a collective)."""
        errors = [None] * self.env.world_size
        dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise _ERRORS.get(first[0], CheckpointError)(first[1])

    def _gather(self, value) -> list:
        values = [None] * self.env.world_size
        dist.all_gather_object(values, value)
        return values

    # ---- finding checkpoints ------------------------------------------------------------------
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint in the output directory, newest first."""
        found = []
        if self.dir.is_dir():
            for path in self.dir.iterdir():
                if m := FULL_RE.match(path.name):
                    found.append((int(m.group(1)), path))
                elif (m := SHARDED_RE.match(path.name)) and (path / META_NAME).is_file():
                    found.append((int(m.group(1)), path))
        return sorted(found, key=lambda item: item[0], reverse=True)

    # ---- saving ------------------------------------------------------------------------------
    def _offload(self, model: torch.nn.Module) -> bool:
        """Whether sharded state dicts are taken with cpu_offload. FSDP1 makes a sharded state dict by
        gathering each flat parameter (and its optimizer state) and cutting this rank's piece anew: new
        tensors, which on a GPU would pile up until the save is written (the model's and the optimizer's
        state once more: +48 GB per GPU at Llama-3-8B dimensions on 2 GPUs, by FSDP1's code; more than
        training's own peak leaves free; scripts/benchmark.py --save_modes sync_gpu measures it).
        With cpu_offload each piece goes to host memory as soon as it is made. FSDP2's state dict holds
        the live sharded tensors (no copies): nothing to offload."""
        return self.env.device.type == "cuda" and bool(FullyShardedDataParallel.fsdp_modules(model))

    def prepare_saving(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """At the start of the run, before the first step (every rank; `save` does it if not done): try
        whatever could make a save impossible, so that a run that cannot save stops now with one line
        instead of after hours of training. Checked: every writing rank can create and write files in the
        output directory, the disk has room for a checkpoint, the node's host memory (and /dev/shm for the
        process writer) can hold what saves stage there; and for asynchronous saves, this very state
        dict is staged once (a state the staging cannot copy turns asynchronous saves off, with a warning:
        synchronous saves still work)."""
        if self._prepared:
            return
        self._prepared = True
        self._check_writable()
        self._check_space(self.dir / "(the first checkpoint)", None, estimate=state_bytes(model, optimizer))
        if self.async_save:
            self._writer = BackgroundWriter(writer=self.async_writer, timeout_s=self.timeout_s)
            self._staging = HostStaging(pin=self.env.device.type == "cuda", share=self._writer.writer == "process")
        if self.fmt != "sharded" or not (self.async_save or self._offload(model)):
            return
        share = self._staging is not None and self._staging.share
        advice = "set checkpoint.async_save=false" if self.async_save else "use fsdp.version=2 (its saves copy nothing)"
        # FSDP1 on GPUs with the process writer: FSDP1's offloaded pieces and their copy in the shared arena.
        copies = 2 if share and self._offload(model) else 1
        where = check_host_memory(copies * arena_bytes(model, optimizer), self.env, advice=advice,
                                  shm_per_rank=arena_bytes(model, optimizer) if share else 0,
                                  what="its share of the weights and optimizer state" + (", twice" if copies == 2 else ""))
        how = f"written in the background ({self._writer.writer} writer)" if self.async_save else "written synchronously"
        if self.env.is_main:
            log.info("sharded checkpoints %s, staged in host memory: %s", how, where)
        # The arena holds copies of whatever may be live training state. FSDP1 on GPUs makes its pieces
        # on the host for each save (see _offload), so there only the process writer needs the arena.
        if self._staging is not None and (share or not self._offload(model)):
            seconds = self._staging.reserve(arena_bytes(model, optimizer))
            if self.env.is_main:
                log.info("checkpoint staging: reserved %s of %shost memory per rank in %.1f s, reused by every save",
                         format_size(self._staging.nbytes), "pinned " if self._staging.pin else "shared " if share else "",
                         seconds)
        if self.async_save:
            self._try_staging(model, optimizer)

    def _check_writable(self) -> None:
        """Every rank that writes checkpoint files (sharded: all; full: rank 0) creates, writes and removes
        a file of its own in the output directory: a read-only folder, a missing permission or an output
        directory that another node cannot see (sharded checkpoints need a shared filesystem) shows now."""
        error = None
        if self.fmt == "sharded" or self.env.is_main:
            probe = self.dir / f"{TMP_PREFIX}write-check-rank{self.env.rank}-{os.getpid()}"
            try:
                if self.env.is_main:
                    self.dir.mkdir(parents=True, exist_ok=True)
                with open(probe, "xb") as f:  # x: never through an existing file or link
                    f.write(b"checkpoint write check\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as err:
                hint = "" if self.dir.is_dir() else (" (the folder does not exist here: sharded checkpoints need "
                                                     "a filesystem every node sees)")
                error = CheckpointError(f"{self.dir}: checkpoints cannot be written there by rank {self.env.rank} on "
                                        f"{socket.gethostname()} ({first_line(err)}){hint}; fix the permissions or "
                                        f"choose another run.output_dir")
            finally:
                probe.unlink(missing_ok=True)  # ours: made just above under a name of this process
        self._agree(error)

    def _try_staging(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Stage this run's state dict once, as a save will. Before the first optimizer step the optimizer
        holds no state: one moment-like tensor (zeros_like of a parameter, as AdamW makes them) per kind of
        parameter stands in for it, so a tensor kind the staging cannot copy shows now too."""
        error = None
        with _quiet_state_dict_warnings():
            options = StateDictOptions(cpu_offload=self._offload(model))
            if optimizer.state:  # resumed
                model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            else:  # get_state_dict would initialise the optimizer's state with a step, and change the training
                model_sd = get_model_state_dict(model, options=options)
                kinds = {}
                for name, p in model.named_parameters():
                    kinds.setdefault(tuple(type(t).__name__ for t in (p, *storage_tensors(p))), (name, p))
                optim_sd = {"state": {name: {"exp_avg": torch.zeros_like(p.detach())} for name, p in kinds.values()}}
            try:
                self._staging.stage({"model": model_sd, "optimizer": optim_sd}, live=live_storages(model, optimizer))
            except Exception as err:
                error = first_line(err)
        errors = [e for e in self._gather(error) if e is not None]
        del model_sd, optim_sd
        if errors:
            self.async_save, self._async_failed = False, True
            if self.env.is_main:
                log.warning("checkpoint.async_save: this run's state cannot be staged in host memory (%s); every save "
                            "of this run is synchronous", errors[0])
            self._staging.close()
        elif self.env.is_main:
            log.info("checkpoint staging tried on this run's state: %.2f s for %s", self._staging.last.seconds,
                     format_size(self._staging.last.copied))

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, *,
             last: bool = False) -> Path:
        """Write a complete checkpoint of step state.step; CheckpointError (on every rank) if it cannot
        be written, leaving the previous checkpoints as they were and no `.tmp-` files behind.

        Asynchronous saves return once the write has started; the checkpoint is complete once `poll`
        or `finish` has committed it. An asynchronous save that cannot stage or start is made
        synchronously at once, and so is a `last` save (the end of the run, a stop signal) once any
        asynchronous save of this run has failed."""
        self.prepare_saving(model, optimizer)
        if self.async_save and not (last and self._async_failed):
            try:
                return self._save_async(model, optimizer, state)
            except AsyncSaveFailed as err:
                self._async_failed = True
                if self.env.is_main:
                    log.warning("%s; saving step %d synchronously instead", err, state.step)
        return self._save_sync(model, optimizer, state)

    def _save_sync(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> Path:
        self._wait_in_flight()
        if self._in_flight is not None:
            self._complete(last=False)
        start = time.perf_counter()
        state.rng = _gather_rng(self.env)
        if self.env.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_incomplete()
        barrier(self.env)
        if self.fmt == "full":
            return self._save_full(model, optimizer, state, start)
        return self._save_sharded(model, optimizer, state, start)

    def _metadata(self, state: TrainState) -> dict:
        plain = dataclasses.asdict(state)
        plain.pop("rng")
        tokenizer = {"tokenizer_sha256": self.tokenizer_sha256} if self.tokenizer_sha256 else {}
        return {"format_version": FORMAT_VERSION, "world_size": self.env.world_size, "model_config": self.model_config,
                "train_state": plain, **tokenizer}

    def _check_space(self, final: Path, state_dicts: tuple | None, *, estimate: int | None = None) -> None:
        """Stop before writing when the checkpoint will not fit on the disk: a write that fails half-way
        costs the time of writing it, and a full disk hurts everything else writing there. At the start
        of the run (`estimate`: this rank's share of the state, as state_bytes counts it) the same check
        stops the run before its first step."""
        if estimate is not None:  # every rank's share: the full checkpoint holds them all, the sharded one too
            mine = estimate
        else:  # full: rank 0 writes what it holds (other ranks may hold a copy too); sharded: every rank its shard
            mine = _tensor_bytes(state_dicts) if self.fmt == "sharded" or self.env.is_main else 0
        total = torch.tensor([mine], dtype=torch.int64, device=self.env.device)
        dist.all_reduce(total)
        error = None
        if self.env.is_main:
            previous = self.complete_checkpoints()
            # The previous checkpoint of this run is the best guess; before the first, the tensors plus 1%
            # for torch.save's framing (an overestimate where HYBRID_SHARD replicas each count their shard).
            needed = size_of(previous[0][1]) if previous else int(total.item() * 1.01)
            free = shutil.disk_usage(self.dir).free
            if needed > free:
                if estimate is not None:
                    keep = "stopped before the first training step"
                else:
                    keep = "stopped before writing, " + (f"{previous[0][1].name} stays the newest checkpoint" if previous
                                                         else "no checkpoint was written")
                error = CheckpointError(
                    f"{final}: not enough disk space to save it ({needed / 2**20:,.1f} MiB needed, {free / 2**20:,.1f} MiB "
                    f"free in {self.dir}); {keep}. Free some space and resume with --resume_from latest")
        self._agree(error)

    def _write_error(self, final: Path, err: BaseException) -> CheckpointError:
        return CheckpointError(f"{final}: cannot write checkpoint ({_write_cause(err)}); nothing was written, the previous "
                               f"checkpoints are as they were")

    def _save_full(self, model, optimizer, state: TrainState, start: float) -> Path:
        # Gather to rank 0 on the CPU: no GPU memory spike, no other rank holds a copy. On the CPU the
        # tensors are already in host memory (and FSDP1's offload path fails there), so no offload.
        on_gpu = self.env.device.type == "cuda"
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
        with _quiet_state_dict_warnings():
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        final = self.dir / full_name(state.step)
        self._check_space(final, (model_sd, optim_sd))
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        error, record, crc_s = None, None, 0.0
        if self.env.is_main:
            payload = {"model": model_sd, "optimizer": optim_sd, "rng": state.rng, **self._metadata(state)}
            try:
                record, crc_s = save_with_checksum(payload, tmp)
            except Exception as err:  # disk full, quota, I/O error: agreed with the other ranks below
                _remove(tmp)
                error = self._write_error(final, err)
        self._agree(error)
        return self._commit_full(tmp, final, record, start=start, crc_s=crc_s)

    def _commit_full(self, tmp: Path, final: Path, record: dict | None, *, start: float, crc_s: float) -> Path:
        """Rank 0 renames the written file into place, then writes its checksum record; retention.
        A collective: an asynchronous save calls it on every rank after its background write."""
        error = None
        if self.env.is_main:
            try:
                install_full(tmp, final)
            except OSError as err:
                _remove(tmp)
                error = self._write_error(final, err)
            else:
                try:
                    write_record(final, record)
                except OSError as err:  # the checkpoint is in place, only its record is missing: it loads unverified
                    log.warning("%s: cannot write its checksum record (%s): it will load unverified", final, first_line(err))
        self._agree(error)
        self._finish(final, start=start, crc_s=crc_s)
        return final

    def _save_sharded(self, model, optimizer, state: TrainState, start: float) -> Path:
        final = self.dir / sharded_name(state.step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        error = None
        with _quiet_state_dict_warnings():
            model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(cpu_offload=self._offload(model)))
            self._check_space(final, (model_sd, optim_sd))
            try:
                dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
            except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
                error = self._write_error(final, err)
        barrier(self.env)  # every rank is done with the folder before it is removed
        if error is not None and self.env.is_main:
            _remove(tmp)
        self._agree(error)
        return self._commit_sharded(tmp, final, state, start=start)

    def _commit_sharded(self, tmp: Path, final: Path, state: TrainState, *, start: float,
                        hashed: tuple[dict, float] | None = None, mode: str | None = "sync") -> Path:
        """Once every shard is written: each rank hashes the files it wrote (an asynchronous save did
        that in the background: `hashed`), rank 0 writes rng.pt and meta.json (every file's size and
        CRC32) and renames the folder into place; retention. A collective: an asynchronous save calls it
        on every rank after its background write."""
        error = None
        if hashed is None:
            try:
                hashed = _hash_own_files(tmp, self.env.rank, self.env.world_size)
            except OSError as err:  # a shard that cannot be read back
                hashed, error = ({}, 0.0), self._write_error(final, err)
        mine, seconds = hashed
        parts = self._gather((mine, seconds, error))
        records = {name: record for part, _, _ in parts for name, record in part.items()}
        crc_s = max(seconds for _, seconds, _ in parts)  # the ranks hash in parallel
        error = next((e for _, _, e in parts if e is not None), None)
        if self.env.is_main:
            try:
                if error is None:
                    records[RNG_NAME], rng_crc_s = save_with_checksum({"rng": state.rng}, tmp / RNG_NAME)
                    crc_s += rng_crc_s
                    write_json(tmp / META_NAME, {**self._metadata(state), "files": dict(sorted(records.items()))})
                    _replace_dir(tmp, final)
            except Exception as err:  # agreed with the other ranks below
                error = self._write_error(final, err)
            if error is not None:
                _remove(tmp)
        self._agree(error)
        self._finish(final, start=start, crc_s=crc_s, mode=mode)
        return final

    def _finish(self, final: Path, *, start: float, crc_s: float, mode: str | None = "sync") -> None:
        barrier(self.env)  # the checkpoint is in place for every rank before anyone deletes older ones
        seconds = time.perf_counter() - start
        if self.env.is_main:
            self._apply_retention(final)
            log.info("saved checkpoint %s (%.1f MiB) in %.2f s (CRC32 %.2f s)", final, size_of(final) / 2**20, seconds, crc_s)
        if mode is not None:  # an asynchronous save's row is written by _complete
            self.stats.append({"name": final.name, "mode": mode, "blocked_s": seconds, "total_s": seconds})

    # ---- asynchronous saves --------------------------------------------------------------------
    #
    # The commit runs collectives (checksum records gathered to rank 0, the agreement on errors,
    # barriers) on the default process group, so every rank must run it at the same point of the
    # program, on the main thread, in step with the training loop's own collectives. A background write
    # ends at a different moment on each rank (a little later on the ranks that wrote more, or on a
    # slower disk), so no rank may commit when its own write is done: `poll`, called by every rank at
    # the same point of every step, all-reduces "my write is done" (MIN over the ranks) and every rank
    # commits at the first step where the flag is 1 everywhere. `save` and `finish` wait for their own
    # write first and then commit, which is safe because every rank calls them at the same step.

    def _save_async(self, model, optimizer, state: TrainState) -> Path:
        self._wait_in_flight()
        if self._in_flight is not None:
            self._complete(last=False)  # the previous save, before this one starts (at most one in flight)
        start = time.perf_counter()
        snapshot = dataclasses.replace(state, rng=_gather_rng(self.env))
        if self.env.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_incomplete()
        barrier(self.env)
        final = self.dir / sharded_name(state.step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        error, staged = None, None
        with _quiet_state_dict_warnings():
            model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(cpu_offload=self._offload(model)))
            self._check_space(final, (model_sd, optim_sd))
            try:
                staged = self._staging.stage({"model": model_sd, "optimizer": optim_sd}, live=live_storages(model, optimizer))
            except Exception as err:  # host memory could not be had, a tensor this staging cannot copy, ...
                error = AsyncSaveFailed(f"{final}: cannot stage the checkpoint in host memory ({first_line(err)})")
        del model_sd, optim_sd
        self._agree(error)
        stage = self._staging.last
        try:
            job = self._writer.start(staged, tmp,
                                     after_write=lambda: _hash_own_files(tmp, self.env.rank, self.env.world_size))
        except (Exception, dcp.CheckpointException) as err:
            error = AsyncSaveFailed(f"{final}: cannot start the background write ({first_line(err)})")
        if error is not None and self.env.is_main:
            _remove(tmp)  # DCP may have made the folder before it failed
        self._agree(error)
        self._in_flight = _InFlight(tmp, final, snapshot, start, job, stage, staged, blocked=time.perf_counter() - start)
        if self.env.is_main:
            log.info("checkpoint %s: staged in host memory in %.2f s (%s copied, %s made for it by the state dict), "
                     "writing it in the background", final.name, stage.seconds, format_size(stage.copied),
                     format_size(stage.passed))
        return final

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save has been started and not committed yet."""
        return self._in_flight is not None

    def poll(self) -> None:
        """Every rank, at the same point of every step: commit the save in flight once every rank's
        background write is done (see above); a failed write is reported here, naming the checkpoint."""
        if self._in_flight is None:  # the same on every rank: saves start at the same step everywhere
            return
        begin = time.perf_counter()
        flag = torch.tensor([int(self._in_flight.job.done())], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        done = bool(flag.item())
        self._in_flight.blocked += time.perf_counter() - begin
        if done:
            self._complete(last=False)

    def finish(self) -> None:
        """At the end of a run (every rank: the last step, or a stop signal): wait for the save in
        flight and commit it. A failure is raised whatever checkpoint.on_async_error says."""
        if self._in_flight is not None:
            self._wait_in_flight()
            self._complete(last=True)

    def close(self) -> None:
        """Release the writer and the staging memory. A save still in flight here (an error ended the run)
        is not committed: it stays a `.tmp-` folder, which the next save removes."""
        if self._in_flight is not None and self.env.is_main:
            log.warning("%s was still being written when the run ended: not committed", self._in_flight.final.name)
        if self._writer is not None:
            self._writer.close()
        if self._staging is not None and self._in_flight is None:
            self._staging.close()

    def _wait_in_flight(self) -> None:
        """Block until this rank's background write is done (logged when it is not done yet)."""
        flight = self._in_flight
        if flight is None:
            return
        begin = time.perf_counter()
        if not flight.job.done():
            if self.env.is_main:
                log.info("waiting for the save of %s, still being written (started %.1f s ago): one save at a time",
                         flight.final.name, begin - flight.start)
            concurrent.futures.wait([flight.job])
            if self.env.is_main:
                log.info("waited %.2f s for the save of %s", time.perf_counter() - begin, flight.final.name)
        flight.blocked += time.perf_counter() - begin

    def _complete(self, *, last: bool) -> None:
        """Every rank, once every rank's write is done: commit the save in flight, or report its failure
        (then stop, or go on per checkpoint.on_async_error unless `last`)."""
        flight, self._in_flight = self._in_flight, None
        begin = time.perf_counter()
        hashed, error = None, None
        try:
            hashed = flight.job.result()
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            error = (f"{flight.final}: the background write failed ({_write_cause(err)}); the previous checkpoints "
                     f"are as they were")
        errors = self._gather(error)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            barrier(self.env)  # every rank is done with the folder before it is removed
            if self.env.is_main:
                _remove(flight.tmp)
            self._async_failed = True
            if self.env.is_main:
                log.warning("%s; writing it again synchronously from its copy in host memory", error)
            try:
                self._write_staged(flight)
                return
            except CheckpointError as err:
                error = f"{error}; the synchronous retry failed too ({err})"
            if self.on_async_error == "continue" and not last:
                if self.env.is_main:
                    log.error("%s; training goes on (checkpoint.on_async_error=continue), the next save tries again", error)
                return
            if not last:
                error += "; stopping (checkpoint.on_async_error=stop). Resume with --resume_from latest"
            raise CheckpointError(error)
        self._commit_sharded(flight.tmp, flight.final, flight.state, start=flight.start, hashed=hashed, mode=None)
        now = time.perf_counter()
        flight.blocked += now - begin
        row = {"name": flight.final.name, "mode": "async", "blocked_s": flight.blocked, "total_s": now - flight.start,
               "staging_s": flight.staged.seconds, "alloc_s": flight.staged.alloc_seconds,
               "copied_bytes": flight.staged.copied, "passed_bytes": flight.staged.passed}
        self.stats.append(row)
        if self.env.is_main:
            log.info("checkpoint %s: written in the background in %.1f s; it held up training for %.2f s in all "
                     "(staging %.2f s, commit %.2f s)", flight.final.name, row["total_s"], flight.blocked,
                     flight.staged.seconds, now - begin)

    def _write_staged(self, flight: _InFlight) -> None:
        """Write the host copy of a save whose background write failed, in the foreground (every rank), and
        commit it: the checkpoint of that step, as if the write had succeeded. CheckpointError if it fails."""
        start = time.perf_counter()
        error = None
        try:
            dcp.save(flight.staged_state, checkpoint_id=str(flight.tmp), process_group=self._writer.group)
        except (Exception, dcp.CheckpointException) as err:
            error = self._write_error(flight.final, err)
        barrier(self.env)
        if error is not None and self.env.is_main:
            _remove(flight.tmp)
        self._agree(error)
        self._commit_sharded(flight.tmp, flight.final, flight.state, start=start, mode="sync-retry")

    def _remove_incomplete(self) -> None:
        for path in self.dir.glob(f"{TMP_PREFIX}*"):
            log.warning("removing incomplete checkpoint %s (an interrupted save)", path)
            _remove(path)

    def _delete(self, path: Path) -> None:
        _remove(path)
        sidecar_of(path).unlink(missing_ok=True)

    def _apply_retention(self, newest: Path) -> None:
        """Keep the keep_last_n newest complete checkpoints, the one just saved counted first whatever
        its step; checkpoints moved aside as corrupt are not counted and never deleted."""
        if self.keep_last_n <= 0:
            return
        others = [path for _, path in self.complete_checkpoints() if path != newest]
        for path in others[self.keep_last_n - 1:]:
            log.info("removing old checkpoint %s (checkpoint.keep_last_n=%d)", path, self.keep_last_n)
            self._delete(path)

    def _move_aside(self, path: Path) -> None:
        """Rename a corrupt checkpoint (and its checksum record) to a name that is never loaded or deleted."""
        target, n = path.with_name(CORRUPT_PREFIX + path.name), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{CORRUPT_PREFIX}{n}-{path.name}")
        os.replace(path, target)
        if sidecar_of(path).exists():
            os.replace(sidecar_of(path), sidecar_of(target))
        log.warning("moved %s aside to %s: it is never loaded or deleted automatically; delete it once inspected",
                    path.name, target.name)

    # ---- loading -----------------------------------------------------------------------------
    def resolve(self, resume_from: str) -> list[Path]:
        """Candidates to try in order: the given path, or for `latest` every complete one, newest first."""
        if resume_from == "latest":
            candidates = [path for _, path in self.complete_checkpoints()]
            if not candidates:
                raise CheckpointError(f"--resume_from latest: no complete checkpoint in {self.dir}")
            return candidates
        path = Path(resume_from)
        if not path.exists():
            raise CheckpointError(f"--resume_from {resume_from}: no such file or directory")
        return [path]

    def load(self, model, optimizer, resume_from: str) -> TrainState:
        """Restore model, optimizer and RNG from `resume_from`; return the training state.

        With `latest`, a corrupt checkpoint is reported, moved aside, and the previous one is tried.
        """
        candidates = self.resolve(resume_from)
        if resume_from != "latest":
            state = self._load_one(model, optimizer, candidates[0])
            newer = [(step, p) for step, p in self.complete_checkpoints() if step > state.step]
            if newer:
                # Continuing here would overwrite, or let retention delete, work that is further along.
                raise CheckpointMismatch(
                    f"--resume_from {candidates[0]} (step {state.step}): {self.dir} already holds the newer "
                    f"{newer[0][1].name}; continue in a fresh run.output_dir, or use --resume_from latest")
            return state
        for i, path in enumerate(candidates):
            try:
                return self._load_one(model, optimizer, path)
            except CheckpointCorrupt as err:
                if i == len(candidates) - 1:
                    raise
                if self.env.is_main:
                    log.warning("%s; falling back to the previous checkpoint", err)
                    self._move_aside(path)
                barrier(self.env)
        raise AssertionError("unreachable")

    def _load_one(self, model, optimizer, path: Path) -> TrainState:
        start = time.perf_counter()
        error = None
        try:
            check_structure(path)
        except CheckpointError as err:
            error = err
        self._agree(error)
        crc_s = self._verify(path) if self.verify else 0.0
        error, meta, rng = None, None, None
        try:
            if path.is_dir():
                meta, rng = self._load_sharded(model, optimizer, path)
            else:
                meta, rng = self._load_full(model, optimizer, path)
        except CheckpointError as err:
            error = err
        self._agree(error)
        state = TrainState(**meta["train_state"])
        state.rng = rng
        _restore_rng(rng, self.env)
        if self.env.is_main:
            log.info("loaded checkpoint %s (%.1f MiB, step %d, saved at world size %d) in %.2f s (CRC32 check %.2f s)",
                     path, size_of(path) / 2**20, state.step, meta["world_size"], time.perf_counter() - start, crc_s)
        return state

    def _verify(self, path: Path) -> float:
        """Check every file's size and CRC32 against the checkpoint's record, the files spread over the
        ranks; CheckpointCorrupt on every rank if any differs. Returns the seconds it took."""
        start = time.perf_counter()
        error, records = None, None
        try:
            records = checksum_records(path)
        except CheckpointError as err:
            error = err
        self._agree(error)
        if records is None:
            if self.env.is_main:
                log.warning("%s has no checksum record (%s): loading it unverified", path, sidecar_of(path).name)
            return 0.0
        folder = path if path.is_dir() else path.parent
        names = sorted(records)
        mine = [n for i, n in enumerate(names) if _owner(n, i, self.env.world_size) == self.env.rank]
        problem = next((p for n in mine if (p := check_file(folder / n, records[n]))), None)
        self._agree(CheckpointCorrupt(problem) if problem else None)
        return time.perf_counter() - start

    def _check_model_config(self, saved: dict, path: Path) -> None:
        """The checkpoint's model is this one: the same type (ours or a Hugging Face one, and which), then
        the same shape. Checked before anything else, so a foreign model is not blamed on the optimizer."""
        here, there = _model_kind(self.model_config), _model_kind(saved)
        if here != there:
            raise CheckpointMismatch(f"{path}: model type differs from the checkpoint: model.type={here} here, "
                                     f"{there} in the checkpoint")
        for key, value in self.model_config.items():
            if saved.get(key, value) != value:
                raise CheckpointMismatch(
                    f"{path}: model shape differs from the checkpoint: model.{key}={value} here, {saved[key]} in the checkpoint")

    def _check_tokenizer(self, meta: dict, path: Path) -> None:
        """The checkpoint was trained with this run's tokenizer (checkpoints from before tokenizers were
        recorded say nothing, and load)."""
        saved = meta.get("tokenizer_sha256")
        if saved is None or self.tokenizer_sha256 is None or saved == self.tokenizer_sha256 or self.allow_tokenizer_change:
            return
        raise CheckpointMismatch(
            f"{path}: trained with another tokenizer (sha256 {saved[:8]}, this run's is {self.tokenizer_sha256[:8]}); "
            f"use the run's tokenizer, or set checkpoint.allow_tokenizer_change=true for a deliberate vocabulary swap")

    def _load_full(self, model, optimizer, path: Path):
        payload = load_full(path)
        meta = {k: v for k, v in payload.items() if k not in FULL_PAYLOAD_KEYS}
        self._check_model_config(meta["model_config"], path)
        self._check_tokenizer(meta, path)
        _check_param_groups(payload["optimizer"], model, optimizer, path)
        try:
            with _quiet_state_dict_warnings():
                set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"],
                               options=StateDictOptions(full_state_dict=True, strict=True))
        except Exception as err:  # readable, but not this model's (missing or extra tensors)
            raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
        return meta, payload.get("rng")

    def _load_sharded(self, model, optimizer, path: Path):
        meta = read_sharded_meta(path)
        self._check_model_config(meta["model_config"], path)
        self._check_tokenizer(meta, path)
        with _quiet_state_dict_warnings():
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp_load(state, path)  # reads in place, resharding to this world size
            rng = load_rng(path)
            _check_param_groups(state["optimizer"], model, optimizer, path)
            try:
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            except (Exception, dcp.CheckpointException) as err:
                raise CheckpointMismatch(f"{path}: does not fit this model ({first_line(err)})") from None
        return meta, rng
