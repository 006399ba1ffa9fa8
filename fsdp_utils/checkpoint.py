"""The checkpoint manager: full (one file, gathered to rank 0 on the CPU) or sharded (one file per
rank, torch.distributed.checkpoint), atomic saves, retention, and resume from a path or `latest`.

Every rank calls every method: state dicts and DCP reads and writes are collectives.

A checkpoint counts only once complete. Full: written to `.tmp-fsdp_cpt{step}.pth`, then renamed.
Sharded: written into `.tmp-fsdp_sharded_cpt{step}/`, all ranks wait, rank 0 writes `meta.json` (the
list of files and their sizes) last, then renames the folder. Names starting `.tmp-` are never loaded
and are removed by the next save.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .distributed import DistEnv, barrier

log = logging.getLogger(__name__)

FULL_RE = re.compile(r"^fsdp_cpt(\d+)\.pth$")
SHARDED_RE = re.compile(r"^fsdp_sharded_cpt(\d+)$")
TMP_PREFIX = ".tmp-"
# Module names that wrappers insert into parameter names; checkpoints hold the plain model's names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of a different model: `latest` does not fall back past it to an older one."""


@dataclasses.dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs, as plain data."""

    step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # global sample index of the next batch (the data position)
    tokens_seen: int = 0
    grad_scaler: dict | None = None
    rng: list | None = None  # per rank: {"cpu": ByteTensor, "cuda": ByteTensor | None}


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename folder `src` to `dst`. os.replace cannot replace a non-empty folder, so an existing `dst` (a
    checkpoint of the same step, e.g. a corrupt one that `latest` fell back from) is first renamed to a
    `.tmp-` name, which the next save removes should we stop before deleting it here."""
    if dst.exists():
        old = dst.with_name(f"{TMP_PREFIX}replaced-{dst.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old)
    else:
        os.replace(src, dst)


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
        raise CheckpointError(f"{path}: the optimizer state has no parameter groups") from None
    here = _param_group_fqns(model, optimizer)
    if saved != here:
        sizes = lambda groups: "/".join(str(len(g)) for g in groups)  # noqa: E731
        raise CheckpointMismatch(
            f"{path}: the optimizer's parameter groups differ from the checkpoint's ({sizes(here)} parameters "
            f"per group here, {sizes(saved)} in the checkpoint): saved by a different optimizer setup")


def _size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _first_line(err: BaseException) -> str:
    """`Type: first line of the message` (at most 200 characters); for a DCP failure, its first rank's error."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank, failure = min(err.failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_first_line(inner)}"
    if isinstance(err, pickle.UnpicklingError):  # its message suggests weights_only=False: not for a damaged file
        return "UnpicklingError: the data does not decode"
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."


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


def read_sharded_meta(path: Path) -> dict:
    """meta.json of a complete sharded checkpoint, after checking that every file it lists has its size."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a complete sharded checkpoint (no meta.json: an interrupted save or another folder)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path}: incomplete or corrupt checkpoint ({err})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{meta_path}: not a checkpoint's meta.json (no list of files)")
    for name, size in meta["files"].items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            raise CheckpointError(f"{path / name}: corrupt checkpoint (expected {size} bytes, found {actual})")
    return meta


class CheckpointManager:
    def __init__(self, output_dir: Path, *, fmt: str, keep_last_n: int, model_config: dict, env: DistEnv):
        self.dir = Path(output_dir)
        self.fmt = fmt
        self.keep_last_n = keep_last_n
        self.model_config = model_config
        self.env = env

    # ---- finding checkpoints ------------------------------------------------------------------
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint in the output directory, newest first."""
        found = []
        if self.dir.is_dir():
            for path in self.dir.iterdir():
                if m := FULL_RE.match(path.name):
                    found.append((int(m.group(1)), path))
                elif (m := SHARDED_RE.match(path.name)) and (path / "meta.json").is_file():
                    found.append((int(m.group(1)), path))
        return sorted(found, key=lambda item: item[0], reverse=True)

    # ---- saving ------------------------------------------------------------------------------
    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> Path:
        start = time.perf_counter()
        state.rng = _gather_rng(self.env)
        if self.env.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_incomplete()
        barrier(self.env)
        path = self._save_full(model, optimizer, state) if self.fmt == "full" else self._save_sharded(model, optimizer, state)
        barrier(self.env)  # the checkpoint is in place for every rank before anyone deletes older ones
        if self.env.is_main:
            self._apply_retention()
            size = _size_of(path) / 2**20
            log.info("saved checkpoint %s (%.1f MiB) in %.2f s", path, size, time.perf_counter() - start)
        return path

    def _metadata(self, state: TrainState) -> dict:
        plain = dataclasses.asdict(state)
        plain.pop("rng")
        return {"format_version": FORMAT_VERSION, "world_size": self.env.world_size, "model_config": self.model_config, "train_state": plain}

    def _save_full(self, model, optimizer, state: TrainState) -> Path:
        # Gather to rank 0 on the CPU: no GPU memory spike, no other rank holds a copy. On the CPU the
        # tensors are already in host memory (and FSDP1's offload path fails there), so no offload.
        on_gpu = self.env.device.type == "cuda"
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        final = self.dir / f"fsdp_cpt{state.step}.pth"
        if self.env.is_main:
            tmp = self.dir / f"{TMP_PREFIX}{final.name}"
            payload = {"model": model_sd, "optimizer": optim_sd, "rng": state.rng, **self._metadata(state)}
            with tmp.open("wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        return final

    def _save_sharded(self, model, optimizer, state: TrainState) -> Path:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        final = self.dir / f"fsdp_sharded_cpt{state.step}"
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        barrier(self.env)  # every shard written before the metadata says complete
        if self.env.is_main:
            torch.save({"rng": state.rng}, tmp / "rng.pt")
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / "meta.json").write_text(json.dumps({**self._metadata(state), "files": files}, indent=1))
            _replace_dir(tmp, final)
        return final

    def _remove_incomplete(self) -> None:
        for path in self.dir.glob(f"{TMP_PREFIX}*"):
            log.warning("removing incomplete checkpoint %s (an interrupted save)", path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    def _apply_retention(self) -> None:
        if self.keep_last_n <= 0:
            return
        for _, path in self.complete_checkpoints()[self.keep_last_n :]:
            log.info("removing old checkpoint %s (checkpoint.keep_last_n=%d)", path, self.keep_last_n)
            shutil.rmtree(path) if path.is_dir() else path.unlink()

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

        With `latest`, a checkpoint that fails to load is reported and the previous one is tried.
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
            except CheckpointError as err:
                if i == len(candidates) - 1 or isinstance(err, CheckpointMismatch):
                    raise
                if self.env.is_main:
                    log.warning("%s; falling back to the previous checkpoint", err)
        raise AssertionError("unreachable")

    def _load_one(self, model, optimizer, path: Path) -> TrainState:
        start = time.perf_counter()
        if path.is_dir():
            meta, rng = self._load_sharded(model, optimizer, path)
        else:
            meta, rng = self._load_full(model, optimizer, path)
        state = TrainState(**meta["train_state"])
        state.rng = rng
        _restore_rng(rng, self.env)
        if self.env.is_main:
            log.info("loaded checkpoint %s (%.1f MiB, step %d, saved at world size %d) in %.2f s",
                     path, _size_of(path) / 2**20, state.step, meta["world_size"], time.perf_counter() - start)
        return state

    def _check_model_config(self, saved: dict, path: Path) -> None:
        for key, value in self.model_config.items():
            if key in saved and saved[key] != value:
                raise CheckpointMismatch(
                    f"{path}: model shape differs from the checkpoint: model.{key}={value} here, {saved[key]} in the checkpoint")

    def _load_full(self, model, optimizer, path: Path):
        # Every rank maps the same file (mmap: the page cache is shared, nothing is copied per rank)
        # and keeps only its shard. weights_only: loading never runs pickled code.
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            meta = {k: payload[k] for k in ("format_version", "world_size", "model_config", "train_state")}
            model_sd, optim_sd = payload["model"], payload["optimizer"]
        except Exception as err:  # truncated, corrupt, or not one of ours
            raise CheckpointError(f"{path}: cannot read checkpoint ({_first_line(err)})") from None
        self._check_model_config(meta["model_config"], path)
        _check_param_groups(optim_sd, model, optimizer, path)
        try:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=StateDictOptions(full_state_dict=True, strict=True))
        except Exception as err:  # readable, but not this model's (missing or extra tensors)
            raise CheckpointError(f"{path}: does not fit this model ({_first_line(err)})") from None
        return meta, payload.get("rng")

    def _load_sharded(self, model, optimizer, path: Path):
        meta = read_sharded_meta(path)
        self._check_model_config(meta["model_config"], path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(path))  # reads in place, resharding to this world size
            rng = torch.load(path / "rng.pt", weights_only=True)["rng"]
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            raise CheckpointError(f"{path}: cannot read sharded checkpoint ({_first_line(err)})") from None
        _check_param_groups(state["optimizer"], model, optimizer, path)
        try:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"{path}: does not fit this model ({_first_line(err)})") from None
        return meta, rng
