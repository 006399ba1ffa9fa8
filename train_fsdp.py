"""Train a decoder-only language model with FSDP.

    torchrun --nproc_per_node=2 train_fsdp.py config/train_tiny_fsdp.yaml        # 2 ranks (gloo on CPU, NCCL on GPU)
    python train_fsdp.py config/train_tiny_fsdp.yaml --train.max_steps=50        # one process
    torchrun --nproc_per_node=8 train_fsdp.py config/train1B_fsdp.yaml --resume_from latest

Reads top to bottom: config, process group, data, model, optimizer, resume, loop, final save, teardown.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import yaml

from config import Config, ConfigError, check_batch_split, launch_problems, load_config, save_config, split_known_args
from data import (BatchPrefetcher, DataError, PreparedData, PrepareSettings, default_dataset_dir, handoff,
                  load_prepared, open_datasets, prepare_for_training)
from data.store import tokenizer_sha256
from model import ModelConfig
from fsdp_utils.checkpoint import CheckpointError, CheckpointManager, CheckpointMismatch, TrainState
from fsdp_utils.checkpoint.format import check_structure
from fsdp_utils.checkpoint.io import install_tokenizer
from fsdp_utils.distributed import DistEnv, Launch, barrier, destroy_distributed, init_distributed, read_torchrun_env
from fsdp_utils.parallel.float8 import float8_problems, precompute_float8_scales
from fsdp_utils.parallel.hf import HFModelError
from fsdp_utils.train.metrics import MetricsWriter, detect_peak_flops, format_duration, peak_memory_gib
from fsdp_utils.train.microbatch import (OutOfMemory, OutOfMemoryGuard, cache_key, memory_hint, memory_probe,
                                   resolve_micro_batch, save_to_cache)
from fsdp_utils.train.optim import build_optimizer, clip_grad_norm, lr_at
from fsdp_utils.train.preemption import StopSignal
from fsdp_utils.parallel.build import build_model
from fsdp_utils.train.run_lock import RunLocked, take_run_lock
from fsdp_utils.train.step import forward_backward
from fsdp_utils.parallel.parallelize import parallelize, resolve_precision

log = logging.getLogger("train")
USER_ERRORS = (ConfigError, DataError, CheckpointError, OutOfMemory, HFModelError)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config, e.g. config/train_tiny_fsdp.yaml")
    parser.add_argument("--resume_from", default=None, help="checkpoint file, sharded folder, or 'latest'")
    args, overrides = split_known_args(parser, argv)
    return args, overrides


def setup_logging(env: DistEnv) -> None:
    # Rank 0 speaks; the others report warnings and errors only, tagged with their rank.
    level = logging.INFO if env.is_main else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{env.rank}] %(message)s", datefmt="%H:%M:%S", force=True)


def prepare_dataset(cfg: Config, env: DistEnv, stop: StopSignal) -> list[tuple[PreparedData, float]]:
    """The prepared folders to train on, with their weights: data.sources as they are, or else data.files
    (the stdlib sources by default), prepared once by rank 0 (later runs reuse them) and opened by all.

    The other ranks wait for rank 0 on a file in the output directory, not in a collective: preparing can
    outlast run.timeout_s. Rank 0's outcome reaches every rank, so a data error ends them all with the
    same message; a stop signal ends a waiting rank at once.
    """
    d = cfg.data
    if d.sources:
        return [(load_prepared(source.path), source.weight) for source in d.sources]
    settings = PrepareSettings.from_config(cfg)
    dataset_dir = d.dataset_dir or default_dataset_dir(settings)
    job_id = [uuid.uuid4().hex if env.is_main else None]
    dist.broadcast_object_list(job_id, src=0)  # quick: every rank arrives here straight after startup
    outcome = handoff.outcome_path(cfg.output_dir, job_id[0])
    if env.is_main:
        error = None
        try:
            prepare_for_training(dataset_dir, settings, named_dir=bool(d.dataset_dir), max_input_mb=d.max_in_job_mb)
        except (DataError, ValueError, OSError) as err:
            error = str(err)
        handoff.publish(outcome, error)
    else:
        error = handoff.wait_for(outcome, dataset_dir=dataset_dir, timeout_s=d.prepare_wait_s,
                                 stop_requested=lambda: stop.name)
    barrier(env)  # quick too: rank 0 is done, and once all are past it nobody reads the outcome file
    if env.is_main:
        outcome.unlink(missing_ok=True)
    if error is not None:
        raise DataError(error)
    return [(load_prepared(dataset_dir), 1.0)]


def describe_model(cfg: Config, tokenizer_vocab: int) -> tuple[int, dict, float]:
    """(vocabulary size, shape signature stored in checkpoints, training FLOPs per token) of the model."""
    if cfg.model.type == "hf":
        from fsdp_utils.parallel.hf import config_signature, load_hf_config

        hf_config = load_hf_config(cfg.model)
        # FLOPs as for the same dimensions of our model (Llama-style layers), for the MFU figure.
        shape = ModelConfig(vocab_size=hf_config.vocab_size, dim=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
                            n_heads=hf_config.num_attention_heads,
                            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                            ffn_hidden_dim=hf_config.intermediate_size)
        return hf_config.vocab_size, config_signature(hf_config), shape.flops_per_token(cfg.data.seq_len)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer_vocab
    plain = ModelConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)})
    return plain.vocab_size, dataclasses.asdict(plain), plain.flops_per_token(cfg.data.seq_len)


def log_parameter_summary(model_cfg) -> None:
    n_total = model_cfg.num_params()
    n_embed = model_cfg.vocab_size * model_cfg.dim * (1 if model_cfg.tie_embeddings else 2)
    per_block = (n_total - n_embed - model_cfg.dim) // model_cfg.n_layers
    log.info("model: %s parameters (%s without embeddings), %d blocks of %s, dim %d, heads %d/%d kv, ffn %d, vocab %d",
             f"{n_total:,}", f"{n_total - n_embed:,}", model_cfg.n_layers, f"{per_block:,}", model_cfg.dim,
             model_cfg.n_heads, model_cfg.num_kv_heads, model_cfg.hidden_dim, model_cfg.vocab_size)


@torch.no_grad()
def evaluate(model, val_data, *, num_samples: int, micro_batch: int, env: DistEnv) -> float:
    """Mean validation loss over the first num_samples sequences of the validation set, in micro-batches,
    whatever the world size: rank r takes batches r, r + W, ...; every rank runs the same number of forward
    passes (FSDP needs them all), a rank past the end weighting its last one by zero. Every batch holds as
    many tokens, so the mean of the batch means is the same for any micro-batch that divides num_samples."""
    model.eval()
    try:
        n = num_samples // micro_batch
        total = torch.zeros((), device=env.device)
        for first in range(0, n, env.world_size):
            k = first + env.rank
            x, y = val_data.batch(min(k, n - 1) * micro_batch, micro_batch)
            loss = model(x.to(env.device), y.to(env.device)).float()
            total += loss if k < n else 0.0 * loss
        dist.all_reduce(total)
    finally:
        model.train()
    return total.item() / n


def train(cfg: Config, env: DistEnv, resume_from: str | None, stop: StopSignal) -> dict:
    t = cfg.train
    check_batch_split(cfg, env.world_size)
    out_dir = cfg.output_dir
    torch.manual_seed(cfg.run.seed)

    # ---- data -----------------------------------------------------------------------------------
    sources = prepare_dataset(cfg, env, stop)
    prepared = sources[0][0]  # the tokenizer and vocabulary (every source of a mixture shares them)
    model_vocab, model_signature, flops_per_token = describe_model(cfg, prepared.vocab_size)
    if model_vocab < prepared.vocab_size:
        raise ConfigError([f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's ({prepared.vocab_size})"])
    train_data, val_data = open_datasets(sources, seq_len=cfg.data.seq_len, seed=cfg.run.seed)

    # ---- model, optimizer, checkpoints ----------------------------------------------------------
    precision = resolve_precision(t.precision, cfg.fsdp.reduce_dtype, env.device)
    built = build_model(cfg, env)  # on the meta device when sharded over several ranks
    model = parallelize(built.module, block_classes=built.block_classes, fsdp=cfg.fsdp, precision=precision,
                        compile=t.compile, env=env, init=built.init, float8=t.float8)
    # The fused AdamW kernel does not accept the sharded grad scaler's inf flag: fp16 uses the foreach one.
    optimizer = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                fused=not precision.use_grad_scaler)
    scaler = None
    if precision.use_grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler()
    c = cfg.checkpoint
    ckpt = CheckpointManager(out_dir, fmt=c.format, keep_last_n=c.keep_last_n, model_config=model_signature, env=env,
                             verify=c.verify, async_save=c.async_save, async_writer=c.async_writer,
                             on_async_error=c.on_async_error, timeout_s=cfg.run.timeout_s,
                             tokenizer_sha256=tokenizer_sha256(prepared.tokenizer_path),
                             allow_tokenizer_change=c.allow_tokenizer_change)

    if env.is_main:
        log.info("resolved config:\n%s", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
        if cfg.model.type == "llama":
            log_parameter_summary(cfg.model)
        else:
            log.info("model: %s from %s", model_signature, cfg.model.hf_path or cfg.model.hf_config)

    # Before any resume: the search's trial steps need the optimizer state empty (they leave it so).
    probe = memory_probe(env.device, env.rank)
    key = cache_key(cfg, model_signature=model_signature, world_size=env.world_size, gpu=probe.name if probe else "cpu",
                    precision=precision.name)
    choice = resolve_micro_batch(cfg, env, model=model, optimizer=optimizer, vocab_size=model_vocab, key=key, probe=probe)
    mb = choice.micro_batch_size
    grad_accum = check_batch_split(cfg, env.world_size, micro_batch=mb)
    if probe is not None:
        probe.begin(mb)  # the memory figures from here on are the training's
    if env.is_main:
        log.info("world size %d on %s, precision %s (reduce %s), FSDP%d %s, grad accumulation %d, micro-batch %d, train %s tokens, val %s tokens",
                 env.world_size, env.device.type, precision.name, str(precision.reduce).replace("torch.", ""),
                 cfg.fsdp.version, cfg.fsdp.sharding_strategy, grad_accum, mb,
                 f"{train_data.num_tokens:,}", f"{val_data.num_tokens:,}")

    state = TrainState()
    if resume_from is None and (existing := ckpt.complete_checkpoints()):
        if not cfg.checkpoint.auto_resume:  # a fresh start would mix its checkpoints with these, and retention delete them
            raise CheckpointMismatch(f"{out_dir} already holds checkpoints of an earlier run (newest {existing[0][1].name}); "
                                     f"resume with --resume_from latest, or give this run another run.output_dir")
        resume_from = "latest"
        log.info("checkpoint.auto_resume: continuing from the newest complete checkpoint in %s", out_dir)
    if resume_from is not None:
        state = ckpt.load(model, optimizer, resume_from)
        if scaler is not None and state.grad_scaler:
            scaler.load_state_dict(state.grad_scaler)
    if env.is_main:  # only now, so a refused resume leaves the output directory as it was
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.yaml")
        # The tokenizer travels with the run, so generate.py and export_hf.py find it next to the checkpoints.
        install_tokenizer(prepared.tokenizer_path, out_dir)
        if choice.how == "search":
            save_to_cache(out_dir, key, choice)
    ckpt.prepare_saving(model, optimizer)  # host memory for the saves checked now, not at the first save

    # ---- loop -----------------------------------------------------------------------------------
    metrics = MetricsWriter(out_dir, tensorboard=cfg.logging.tensorboard) if env.is_main else None
    peak_flops = detect_peak_flops(env.device, cfg.logging.peak_flops)
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    first_step = state.step
    num_eval_samples = t.eval_batches * mb  # the same sequences if an out-of-memory retry halves mb

    def open_batches(micro_batch: int) -> BatchPrefetcher:
        """This rank's micro-batches from the current step on. Global sample index of each: the order is
        the same on any world size and micro-batch (a step's samples are its global batch, split)."""
        step0, sample0, accum = state.step, state.samples_seen, t.global_batch_size // (micro_batch * env.world_size)
        indices = (sample0 + (s - step0) * t.global_batch_size + (m * env.world_size + env.rank) * micro_batch
                   for s in range(step0, t.max_steps) for m in range(accum))
        return BatchPrefetcher(train_data, indices, num_samples=micro_batch, device=env.device)

    batches = open_batches(mb)
    oom = OutOfMemoryGuard(env, probe=probe, retry=t.oom_retry_half, timeout_s=cfg.run.timeout_s, compile=t.compile,
                           model=model, block_classes=built.block_classes)
    inject_nan_at = int(os.environ.get("FSDP_INJECT_NAN_AT_STEP", 0))  # fault injection for the tests
    start_time = last_log_time = time.perf_counter()
    last_log_step, last, num_bad_steps = first_step, {}, 0
    try:
        model.train()
        while state.step < t.max_steps:
            lr = lr_at(state.step, max_lr=t.lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            while True:  # again only after an out-of-memory error, with train.oom_retry_half
                loss_sum, new_mb = oom.attempt(lambda: forward_backward(model, batches, scaler, grad_accum=grad_accum),
                                               step=state.step + 1, phase="training", micro_batch=mb, grad_accum=grad_accum,
                                               model=model, optimizer=optimizer)
                if new_mb == mb:
                    break
                batches.close()
                mb, grad_accum = new_mb, t.global_batch_size // (new_mb * env.world_size)
                batches = open_batches(mb)  # this step's samples again, in smaller micro-batches
            if inject_nan_at == state.step + 1 and env.is_main:
                loss_sum = loss_sum * float("nan")
            if scaler:
                scaler.unscale_(optimizer)
            grad_norm = clip_grad_norm(model, t.grad_clip)  # already the same on every rank
            # One small collective a step: the loss (for the log and the finiteness check) and the stop flag.
            shared = torch.stack([loss_sum, torch.tensor(float(stop.requested), device=env.device)])
            dist.all_reduce(shared)
            loss = shared[0] / env.world_size
            finite = torch.isfinite(loss) if scaler else torch.isfinite(loss) & torch.isfinite(grad_norm)
            if not finite.item():  # the step's only host sync: every rank decides the same way
                num_bad_steps += 1
                optimizer.zero_grad(set_to_none=True)
                msg = f"non-finite loss ({loss.item()}) or gradient norm ({grad_norm.item()}) at step {state.step + 1}"
                if num_bad_steps > t.max_bad_steps:
                    raise NonFiniteError(f"{msg}; stopping before the optimizer step, no checkpoint written "
                                         f"(train.max_bad_steps={t.max_bad_steps} allows skipping such steps)")
                log.warning("%s: skipping the update (%d of train.max_bad_steps=%d)", msg, num_bad_steps, t.max_bad_steps)
            elif scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if t.float8 != "none":  # the new weights' FP8 scales, for the next step's FP8 all-gathers
                precompute_float8_scales(model)
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.samples_seen += t.global_batch_size
            state.tokens_seen += tokens_per_step
            if state.step == first_step + 2 and t.micro_batch_size != "auto":  # a collective: every rank
                hint = memory_hint(probe, env, micro_batch=mb, grad_accum=grad_accum)
                if hint and env.is_main:
                    log.info("%s", hint)

            if state.step % cfg.logging.interval == 0 or state.step == t.max_steps:
                now = time.perf_counter()
                step_time = (now - last_log_time) / (state.step - last_log_step)
                tok_per_gpu = tokens_per_step / env.world_size / step_time
                mfu = flops_per_token * tok_per_gpu / peak_flops if peak_flops else None
                last = {"step": state.step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                        "tokens_per_sec_per_gpu": tok_per_gpu, "mfu": mfu, "peak_mem_gib": peak_memory_gib(env.device)}
                if env.is_main:
                    log.info("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s/gpu | mfu %s | mem %.2f GiB | elapsed %s | eta %s",
                             state.step, t.max_steps, last["loss"], lr, last["grad_norm"], f"{tok_per_gpu:,.0f}",
                             f"{100 * mfu:.1f}%" if mfu is not None else "n/a", last["peak_mem_gib"],
                             format_duration(now - start_time), format_duration(step_time * (t.max_steps - state.step)))
                    metrics.write(last)
                last_log_time, last_log_step = time.perf_counter(), state.step

            if t.eval_interval and (state.step % t.eval_interval == 0 or state.step == t.max_steps):
                while True:
                    val_loss, new_mb = oom.attempt(
                        lambda: evaluate(model, val_data, num_samples=num_eval_samples, micro_batch=mb, env=env),
                        step=state.step, phase="evaluation", micro_batch=mb, grad_accum=grad_accum, model=model,
                        optimizer=optimizer)
                    if new_mb == mb:
                        break
                    batches.close()
                    mb, grad_accum = new_mb, t.global_batch_size // (new_mb * env.world_size)
                    batches = open_batches(mb)  # the next steps at the smaller micro-batch too
                last["val_loss"] = val_loss
                if env.is_main:
                    log.info("step %d | val_loss %.4f", state.step, val_loss)
                    metrics.write({"step": state.step, "val_loss": val_loss})

            ckpt.poll()  # every step, every rank: commits an asynchronous save once all its writes are done
            interval = cfg.checkpoint.interval
            stopping = shared[1].item() > 0
            last = stopping or state.step == t.max_steps
            if last or (interval and state.step % interval == 0):
                state.grad_scaler = scaler.state_dict() if scaler else None
                ckpt.save(model, optimizer, state, last=last)
            if stopping:
                ckpt.finish()
                if env.is_main:
                    log.info("stopped by a signal at step %d after saving; rerun the same command to continue "
                             "(checkpoint.auto_resume), or pass --resume_from latest", state.step)
                break
        ckpt.finish()  # a clean end waits for the save in flight
    finally:
        ckpt.close()
        batches.close()
        if metrics is not None:
            metrics.close()
    return last


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stopped being finite."""


def early_problems(cfg: Config, launch: Launch, resume_from: str | None) -> list[str]:
    """Everything that can be checked before the process group starts, beyond the config itself."""
    problems = launch_problems(cfg, world_size=launch.world_size, local_world_size=launch.local_world_size,
                               num_gpus=torch.cuda.device_count())
    if resume_from not in (None, "latest"):
        try:
            check_structure(Path(resume_from))  # exists, a torch.save file or a folder with all its files
        except CheckpointError as err:
            problems.append(f"--resume_from: {err}")
    problems += float8_problems(cfg.train.float8, run_device=cfg.run.device, local_rank=launch.local_rank)
    return problems


def exit_early(problems: list[str], launch: Launch) -> int:
    """Report problems found before the process group as `error:` lines, once: rank 0 prints them.

    Under torchrun the other ranks then wait to be stopped: torchrun stops every worker as soon as one
    ends, so a rank that ended first could have rank 0 stopped before it printed anything."""
    if launch.rank == 0:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
    elif launch.under_torchrun:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: os._exit(2))
        time.sleep(60)
    return 2


@record  # an uncaught error lands in torchrun's error file, reported with its rank
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    launch = read_torchrun_env()
    # Every problem with the config and the launch is found before any process group starts.
    try:
        cfg = load_config(args.config, overrides)
        problems = early_problems(cfg, launch, args.resume_from)
    except ConfigError as err:
        problems = err.problems
    if problems:
        return exit_early(problems, launch)

    stop = StopSignal(cfg.run.stop_signals, grace_s=cfg.run.preemption_grace_s)  # Ctrl-C from here on saves
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    lock = None
    try:
        setup_logging(env)
        lock = take_run_lock(cfg.output_dir, env)  # before anything is written into the output directory
        train(cfg, env, args.resume_from, stop)
        return 0
    except RunLocked as err:
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except (*USER_ERRORS, NonFiniteError) as err:  # raised alike on every rank
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file this rank could not write (a full disk): said by the rank that met it
        print(f"error: rank {env.rank}: {err}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
        if lock is not None:
            os.close(lock)  # the operating system would release it at exit anyway


if __name__ == "__main__":
    sys.exit(main())
