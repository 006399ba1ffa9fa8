"""Measure training throughput and memory of a config, and optionally of a Hugging Face reference.

    torchrun --nproc_per_node=2 benchmarks/benchmark.py config/train300M_fsdp.yaml --peer
    torchrun --nproc_per_node=2 benchmarks/benchmark.py config/train90M_fsdp.yaml --compare_auto --peer --rounds 2
    torchrun --nproc_per_node=2 benchmarks/benchmark.py config/train1B_fsdp.yaml --fsdp.version=2 \
        --float8 tensorwise --document_masking --doc_len 1024

Ours: train_fsdp.py's model, wrapping and step (build_run, train_step) on random tokens; `--peer`: transformers'
LlamaForCausalLM of the same dimensions with FSDP2, bf16 with fp32 reduction, per-layer compile, fused AdamW, after
ours. `--float8`, `--lora`, `--muon`, `--grid`, `--document_masking` and `--compare_auto` add runs of ours (--help).
Prints tokens/s per GPU, MFU (attention counted as full causal attention), step time, the optimizer step's time and
its state's memory per GPU, and peak memory of each run, and their ratios; `--search_without_estimate` runs the auto
search without the estimate's order (beside it, the search as it was); `--save_modes` measures sharded checkpoint saves
instead (bench_saves). docs/benchmarks.md shows how."""
from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from config import (
    CheckpointConfig,
    Config,
    ConfigError,
    check_batch_split,
    load_config,
)
from config.checks import float8_size_problem
from config.numbers import integer, integer_in
from fsdp_utils.checkpoint import CheckpointError, CheckpointManager, Contents
from fsdp_utils.checkpoint.base import tensor_bytes
from fsdp_utils.checkpoint.contents import TorchStateDicts
from fsdp_utils.checkpoint.names import size_of
from fsdp_utils.distributed import (
    DistEnv,
    destroy_distributed,
    init_distributed,
    prefer_expandable_segments,
    read_torchrun_env,
)
from fsdp_utils.observability.metrics import detect_peak_flops
from fsdp_utils.observability.trackers import redacted_argument
from fsdp_utils.parallel.build import describe_model
from fsdp_utils.parallel.float8 import float8_output_problems, float8_problems
from fsdp_utils.parallel.fsdp import fsdp_adapter
from fsdp_utils.parallel.parallelize import compile_options
from fsdp_utils.train.build_run import BuiltRun, build_run
from fsdp_utils.train.memory import max_over_ranks
from fsdp_utils.train.microbatch import describe_choice
from fsdp_utils.train.step import train_step
from model.float8_projection import FLOAT8_ALIGNMENT
from safe_io.nofollow import append_line, results_log_problem

ROOT = Path(__file__).resolve().parents[1]

# The document separator of the random tokens (--doc_len); any id serves.
EOS_ID = 0


def random_batches(vocab_size: int, *, micro_batch: int, seq_len: int, device: torch.device, seed: int,
                   doc_len: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of random (inputs, targets) batches, generated on the device. Without doc_len no token is
    EOS_ID (every window inside one long document, as in a corpus of long texts); with doc_len, an EOS_ID at each
    position with probability 1 / doc_len (geometric document lengths of that mean)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    while True:
        tokens = torch.randint(EOS_ID + 1, vocab_size, (micro_batch, seq_len + 1), device=device, generator=gen)
        if doc_len:
            ends = torch.rand(tokens.shape, device=device, generator=gen) < 1 / doc_len
            tokens = tokens.masked_fill(ends, EOS_ID)
        yield tokens[:, :-1], tokens[:, 1:]


def timed_step(step_fn: Callable[[], None], env: DistEnv) -> float:
    """One step's seconds, the ranks aligned by a barrier before it and the GPU waited for after it."""
    dist.barrier()
    start = time.perf_counter()
    step_fn()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return time.perf_counter() - start


def time_steps(step_fn: Callable[[], None], env: DistEnv, *, warmup: int, steps: int) -> list[float]:
    """Run warmup + timed steps; return each timed step's seconds."""
    for _ in range(warmup):
        step_fn()
    return [timed_step(step_fn, env) for _ in range(steps)]


class OptimizerClock:
    """The optimizer step's time inside each training step, from hooks around `optimizer.step` (grad scaler's and
    FP8's post-step work included): CUDA events on GPUs, read once the timed steps have synchronized, wall time on
    the CPU."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple] = []
        self.started: object = None
        optimizer.register_step_pre_hook(self._start)
        optimizer.register_step_post_hook(self._end)

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, *_) -> None:
        self.started = self._now()

    def _end(self, *_) -> None:
        self.spans.append((self.started, self._now()))

    def seconds(self, first: int, count: int) -> list[float]:
        """Steps first to first + count (0-based, in the order run)."""
        spans = self.spans[first:first + count]
        if self.cuda:
            return [start.elapsed_time(end) / 1e3 for start, end in spans]  # type: ignore[union-attr]
        return [end - start for start, end in spans]  # type: ignore[operator]


def bench_ours(cfg: Config, env: DistEnv, args: argparse.Namespace, *, micro_batch: int | str,
               grad_accum: int | None) -> dict:
    """micro_batch "auto": searched as train_fsdp.py does; grad_accum None: what the global batch needs. Besides the
    step times: the timed steps' optimizer step times and the optimizer state's bytes on the fullest GPU."""
    step, run = build_ours(cfg, env, args, micro_batch=micro_batch, grad_accum=grad_accum)
    clock = OptimizerClock(run.optimizer, env.device)
    measured = measure(step, env, args)
    return {**measured, "micro_batch": run.split.micro_batch_size, "grad_accum": run.split.grad_accum,
            "optim_times": clock.seconds(args.warmup, args.steps),
            "optim_state_bytes": max_over_ranks(tensor_bytes(dict(run.optimizer.state)), env)}


def run_config(cfg: Config, env: DistEnv, *, micro_batch: int | str, grad_accum: int | None) -> Config:
    """The config of one of ours: train.micro_batch_size set to `micro_batch`; with `grad_accum` (a numeric
    micro-batch), the global batch is the step that makes."""
    c = copy.deepcopy(cfg)
    c.train.micro_batch_size = micro_batch
    if grad_accum is not None and micro_batch != "auto":
        c.train.global_batch_size = int(micro_batch) * grad_accum * env.world_size
    return c


def build_ours(cfg: Config, env: DistEnv, args: argparse.Namespace, *, micro_batch: int | str,
               grad_accum: int | None) -> tuple[Callable[[], None], BuiltRun]:
    """(step function, the run) of train_fsdp.py's model, wrapping, optimizer, micro-batch plan and step: built by
    build_run as train_fsdp.py builds it, on random tokens. The ablations are its parameters:
    --fused_projections (one matmul per fused q/k/v and gate/up weight, split after, instead of one per slice; same
    weights and results), --unfused_adamw (the multi-tensor AdamW)."""
    run_cfg = run_config(cfg, env, micro_batch=micro_batch, grad_accum=grad_accum)
    vocab_size, signature, _ = describe_model(run_cfg, run_cfg.data.vocab_size)
    try:
        check_batch_split(run_cfg.train, env.world_size)  # before the build: a split that cannot work costs no model
        run = build_run(run_cfg, env, vocab_size=vocab_size, model_signature=signature, eos_id=EOS_ID,
                        use_cache=False, fused_matmul=True if args.fused_projections else None,
                        fused_adamw=not args.unfused_adamw, search_estimate=not args.search_without_estimate)
    except ConfigError as err:
        raise SystemExit(f"error: {err.problems[0]}") from None
    if env.is_main:
        for line in describe_choice(run.choice, run_cfg, world_size=env.world_size):
            print(line, flush=True)
    batches = random_batches(vocab_size, micro_batch=run.split.micro_batch_size, seq_len=cfg.data.seq_len,
                             device=env.device, seed=env.rank, doc_len=args.doc_len)

    def step() -> None:
        # The training loop's own step (fsdp_utils/train/step.py), its one host sync included.
        train_step(run.model, run.optimizer, batches, fsdp=run.fsdp, grad_accum=run.split.grad_accum,
                   grad_clip=cfg.train.grad_clip, world_size=env.world_size, scaler=run.scaler)

    return step, run


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(run, baseline) pairs whose tokens/s ratio is printed: each of ours against the reference, each
    FP8 run, LoRA run and grid pair against ours, and each masked run against the same run unmasked."""
    pairs = [(name, "hf_llama_fsdp2") for name in names if name != "hf_llama_fsdp2" and "hf_llama_fsdp2" in names]
    pairs += [(name, "ours") for name in names
              if name.startswith(("ours_fp8", "ours_lora", "ours_muon", GRID)) and "ours" in names]
    return pairs + [(name, name.removesuffix(DOCMASK)) for name in names
                    if name.endswith(DOCMASK) and name.removesuffix(DOCMASK) in names]


def measure(step_fn: Callable[[], None], env: DistEnv, args: argparse.Namespace) -> dict:
    """Time the warm-up and timed steps, then (--profile) profile a few more."""
    times = time_steps(step_fn, env, warmup=args.warmup, steps=args.steps)
    if args.profile:
        profile_steps(step_fn, env)
    return {"times": times}


def profile_steps(step_fn: Callable[[], None], env: DistEnv, num_steps: int = 3) -> None:
    """Print the GPU kernels that took the most time over a few steps (rank 0), to see where time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step_fn()
        torch.cuda.synchronize(env.device)
    if env.is_main:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def bench_peer(cfg: Config, env: DistEnv, args: argparse.Namespace, *, micro_batch: int, grad_accum: int) -> dict:
    """transformers LlamaForCausalLM + FSDP2 + per-layer compile: what users would otherwise run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                         num_key_value_heads=m.num_kv_heads,
                         max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                         tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(cfg.run.seed)
    with torch.device(env.device):
        model = LlamaForCausalLM(hf_cfg)
    model.config.use_cache = False
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if cfg.train.compile:  # tuned as ours is, if train.compile_tuning: like for like
            layer.compile(options=compile_options(cfg.train.compile_tuning))
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True)
    t = cfg.train
    batches = random_batches(m.vocab_size, micro_batch=micro_batch, seq_len=cfg.data.seq_len, device=env.device,
                             seed=env.rank)

    def step() -> None:
        total = None
        for micro in range(grad_accum):
            x, y = next(batches)
            model.set_requires_gradient_sync(micro == grad_accum - 1)
            loss = model(input_ids=x, labels=y).loss / grad_accum
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total.item()

    return {**measure(step, env, args), "micro_batch": micro_batch, "grad_accum": grad_accum}


def bench_peer_fitting(cfg: Config, env: DistEnv, args: argparse.Namespace, *, micro_batch: int,
                       grad_accum: int) -> dict:
    """The reference at ours' split, or, where that runs out of memory (it keeps more than ours: the
    whole logits), at half the micro-batch and twice the accumulation, and so on: the same global batch.
    Its model is rebuilt for each try; the out-of-memory error hits every rank alike (same shapes)."""
    while True:
        try:
            return bench_peer(cfg, env, args, micro_batch=micro_batch, grad_accum=grad_accum)
        except torch.OutOfMemoryError:
            if micro_batch % 2:
                raise
        if env.is_main:
            print(f"reference: out of memory at micro-batch {micro_batch}; trying {micro_batch // 2} x "
                  f"{grad_accum * 2}", flush=True)
        micro_batch, grad_accum = micro_batch // 2, grad_accum * 2
        reset_memory(env)


def reset_peak(env: DistEnv) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)


def bench_saves(cfg: Config, env: DistEnv, args: argparse.Namespace) -> list[dict]:
    """Sharded saves of train_fsdp.py's model and optimizer through the checkpoint manager, `--saves` per mode, after
    the timed steps: sync (checkpoint.async_save=false), thread / process (asynchronous with that writer), sync_gpu
    (sync with FSDP1's sharded state dict left on the GPU, to measure the copy it makes), training going on while a
    write is in flight. Per save: the loop's stall, the whole save, the overlapped steps against the others, the GPU
    peaks of the save and of training. Each checkpoint is deleted once measured, --save_dir at the end."""
    auto = cfg.train.micro_batch_size == "auto"
    step_fn, run = build_ours(cfg, env, args, micro_batch=cfg.train.micro_batch_size,
                              grad_accum=None if auto else args.grad_accum or 1)
    model, optimizer = run.model, run.optimizer
    for _ in range(args.warmup):
        step_fn()
    reset_peak(env)
    normal = [timed_step(step_fn, env) for _ in range(args.steps)]
    train_peak = peak_memory_gib(env)
    root = Path(args.save_dir)
    rows = []
    for mode in args.save_modes.split(","):
        sync = mode in ("sync", "sync_gpu")
        section = CheckpointConfig(format="sharded", keep_last_n=0, async_save=not sync,
                                   async_writer="thread" if sync else mode)
        # sync_gpu, for the measurement only: torch's answers, so FSDP1's sharded state dict stays on the GPU.
        contents = Contents(model, optimizer, fsdp=TorchStateDicts() if mode == "sync_gpu" else run.fsdp)
        manager = CheckpointManager(section, root / mode, env=env, contents=contents, model_config={},
                                    timeout_s=cfg.run.timeout_s)
        start = time.perf_counter()
        try:
            manager.prepare_saving()  # the staging arena: once per run, before the first save
        except CheckpointError as err:  # raised on every rank alike (e.g. /dev/shm too small for the process writer)
            if env.is_main:
                print(f"{mode}: not measured: {err}")
            continue
        prepare_s = max_over_ranks(time.perf_counter() - start, env)
        for i in range(args.saves):
            reset_peak(env)
            manager.contents.state.step = i + 1
            manager.save()
            save_peak = peak_memory_gib(env)
            overlapped, overlap_peak = [], None
            if manager.in_flight:
                reset_peak(env)
                while manager.in_flight and len(overlapped) < args.max_overlap_steps:
                    overlapped.append(timed_step(step_fn, env))
                    manager.poll()  # as the training loop does after every step
                overlap_peak = peak_memory_gib(env)
                manager.finish()  # if the write outlasted --max_overlap_steps
            saved = manager.stats[-1]
            size = size_of(root / mode / saved["name"])
            rows.append({
                "mode": mode, "save": i + 1, "stall_s": max_over_ranks(saved["blocked_s"], env),
                "total_s": max_over_ranks(saved["total_s"], env),
                "staging_s": max_over_ranks(saved.get("staging_s", 0.0), env), "prepare_s": prepare_s,
                "normal_step_s": statistics.median(normal),
                "overlapped_step_s": statistics.median(overlapped) if overlapped else None,
                "overlapped_steps": len(overlapped), "write_outlasted_steps": len(overlapped) >= args.max_overlap_steps,
                "train_peak_gib": train_peak, "save_peak_gib": save_peak, "overlap_peak_gib": overlap_peak,
                "micro_batch": run.split.micro_batch_size, "grad_accum": run.split.grad_accum,
                "checkpoint_gb": max_over_ranks(size / 1e9, env),  # the whole folder, as its node sees it
            })
            if env.is_main:  # measured: delete it (a large model's checkpoint takes much disk space)
                shutil.rmtree(root / mode / saved["name"])
            dist.barrier()
        manager.close()
    if env.is_main:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def print_saves(rows: list[dict], cfg: Config, env: DistEnv, args: argparse.Namespace) -> None:
    if not rows:
        return
    m = cfg.model
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    print(f"\n{args.config}: {m.num_params() / 1e9:.2f}B params, seq {cfg.data.seq_len}, micro-batch "
          f"{rows[0]['micro_batch']} x accum {rows[0]['grad_accum']}, world {env.world_size} x {device}, "
          f"{fsdp_adapter(cfg.fsdp, env).describe()}, AC {cfg.fsdp.activation_checkpointing}, "
          f"sharded checkpoint {rows[0]['checkpoint_gb']:.1f} GB")
    print(f"{'mode':<8}{'save':>5}{'stall s':>9}{'save s':>9}{'staging s':>10}{'prepare s':>10}{'step s':>8}"
          f"{'overlap step s (n)':>20}{'peak GiB train':>16}{'save':>7}{'overlap':>9}")
    for r in rows:
        overlap = f"{r['overlapped_step_s']:.3f} ({r['overlapped_steps']})" if r["overlapped_step_s"] else "-"
        peak_overlap = f"{r['overlap_peak_gib']:.2f}" if r["overlap_peak_gib"] is not None else "-"
        print(f"{r['mode']:<8}{r['save']:>5}{r['stall_s']:>9.2f}{r['total_s']:>9.2f}{r['staging_s']:>10.2f}"
              f"{r['prepare_s']:>10.2f}{r['normal_step_s']:>8.3f}{overlap:>20}{r['train_peak_gib']:>16.2f}"
              f"{r['save_peak_gib']:>7.2f}{peak_overlap:>9}")
    sync = [r for r in rows if r["mode"] == "sync"]
    for r in rows:
        if r["mode"] == "sync" or not sync:
            continue
        ratio = r["stall_s"] / sync[-1]["stall_s"]
        slow = r["overlapped_step_s"] / r["normal_step_s"] - 1 if r["overlapped_step_s"] else float("nan")
        print(f"{r['mode']} save {r['save']}: stall {100 * ratio:.1f}% of the synchronous save's (target < 10%), "
              f"steps during the write {100 * slow:+.1f}% against the others (target within 10%)"
              + ("; the write outlasted --max_overlap_steps" if r["write_outlasted_steps"] else ""))
    for r in rows:
        if r["save_peak_gib"] > r["train_peak_gib"] or (r["overlap_peak_gib"] or 0) > r["train_peak_gib"]:
            print(f"{r['mode']} save {r['save']}: raised the peak GPU memory above training's "
                  f"({max(r['save_peak_gib'], r['overlap_peak_gib'] or 0):.2f} > {r['train_peak_gib']:.2f} GiB)")


def peak_memory_gib(env: DistEnv) -> float:
    return max_over_ranks(torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0,
                          env)


def summarise(name: str, times: list[float], peak_mem_gib: float, split: tuple[int, int], cfg: Config,
              peak_flops: float | None, *, optim_times: Sequence[float] = (),
              optim_state_bytes: float | None = None) -> dict:
    """One run's row; the optimizer's figures are None for the reference, which is not timed inside its step."""
    step_s = statistics.median(times)
    micro_batch, grad_accum = split
    tokens_per_gpu = grad_accum * micro_batch * cfg.data.seq_len / step_s
    flops = cfg.model.flops_per_token(cfg.data.seq_len)
    return {"name": name, "micro_batch": micro_batch, "grad_accum": grad_accum, "step_s": step_s,
            "tokens_per_sec_per_gpu": tokens_per_gpu,
            "mfu": flops * tokens_per_gpu / peak_flops if peak_flops else None, "peak_mem_gib": peak_mem_gib,
            "step_s_min": min(times), "step_s_max": max(times),
            "optim_step_s": statistics.median(optim_times) if optim_times else None,
            "optim_state_gib": optim_state_bytes / 2**30 if optim_state_bytes is not None else None}


def reset_memory(env: DistEnv) -> None:
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)


SAVE_MODES = ("sync", "thread", "process", "sync_gpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=integer, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=integer, default=5, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--grad_accum", type=integer, default=None,
                        help="micro-batches per step (default 1; with auto or --compare_auto: what "
                        "train.global_batch_size needs)")
    parser.add_argument("--compare_auto", action="store_true",
                        help="ours at --fixed_micro_batch and at the auto choice, same global batch (and --peer at "
                        "the auto choice)")
    parser.add_argument("--fixed_micro_batch", type=integer, default=8,
                        help="--compare_auto's fixed micro-batch (default 8)")
    parser.add_argument("--peer", action="store_true", help="also run the Hugging Face + FSDP2 reference")
    parser.add_argument("--peer_only", action="store_true", help="run only the reference")
    parser.add_argument("--float8", default="",
                        help="also run ours with these train.float8 recipes, e.g. tensorwise,rowwise")
    parser.add_argument("--float8_output", action="store_true",
                        help="also run ours with train.float8_output (the output projection and loss in FP8)")
    parser.add_argument("--document_masking", action="store_true",
                        help="also run each of ours with data.document_masking and model.reset_positions")
    parser.add_argument("--doc_len", type=integer, default=None,
                        help="mean document length of the random tokens (an EOS with probability 1/doc_len); "
                        "default 1024 with --document_masking, else no EOS")
    parser.add_argument("--lora", default="",
                        help="also run ours with LoRA at these ranks (train.lora.rank; --train.lora.* sets the rest), "
                             "e.g. 16,64: LoRA against full fine-tuning in one invocation")
    parser.add_argument("--muon", action="store_true",
                        help="also run ours with train.optimizer=muon (needs fsdp.version 2): its optimizer step's "
                             "time and memory against AdamW's in one invocation")
    parser.add_argument("--lora_only", action="store_true",
                        help="with --lora: leave out the full fine-tuning run (for a model it cannot fit)")
    parser.add_argument("--grid", default="",
                        help="also run ours at these fixed pairs of activation checkpointing policy and micro-batch, "
                        "POLICY@MICRO_BATCH, comma-separated (e.g. none@8,selective_op@16), at the global batch; a "
                        "pair that does not fit ends the benchmark out of memory, as training would")
    parser.add_argument("--rounds", type=integer, default=1,
                        help="alternate ours and the reference this many times (noisy machines)")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of each run")
    parser.add_argument("--fused_projections", action="store_true",
                        help="ablation: one q/k/v and one gate/up matmul, split after")
    parser.add_argument("--unfused_adamw", action="store_true",
                        help="ablation: the multi-tensor (foreach) AdamW, not the fused one")
    parser.add_argument("--search_without_estimate", action="store_true",
                        help="the auto search (both autos) in its own order, without the estimate's: with "
                        "--train.auto_micro_batch_margin=0.1, the search before the estimate ordered it")
    parser.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    parser.add_argument("--save_modes", default="", help="measure sharded checkpoint saves instead: any of sync, "
                        "thread, process, sync_gpu, comma-separated (e.g. sync,thread)")
    parser.add_argument("--saves", type=integer, default=1, help="with --save_modes: saves per mode")
    parser.add_argument("--max_overlap_steps", type=integer, default=300,
                        help="with --save_modes: at most this many steps while an asynchronous write is in flight")
    parser.add_argument("--save_dir", default=str(ROOT / "checkpoints" / "benchmark-saves"),
                        help="with --save_modes: where the checkpoints are written (each deleted once measured)")
    return parser


GRID = "grid_"  # the name of a --grid run: grid_selective_op@16


def grid_pairs(text: str) -> list[tuple[str, int]]:
    """--grid's POLICY@MICRO_BATCH list as (policy, micro-batch); ValueError naming an entry that is not one, or
    a --grid given with no pair in it (',,,' would otherwise mean no grid, silently)."""
    pairs = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        policy, _, size = entry.rpartition("@")
        if not policy or (micro_batch := integer_in(size, 1)) is None:
            raise ValueError(f"--grid: {entry!r} is not POLICY@MICRO_BATCH (e.g. selective_op@16)")
        pairs.append((policy, micro_batch))
    if text and not pairs:
        raise ValueError(f"--grid {text!r}: no POLICY@MICRO_BATCH pair in it (e.g. none@8,selective_op@16); leave "
                         "--grid out for no grid")
    return pairs


def checked_grid(args: argparse.Namespace) -> list[tuple[str, int]]:
    """--grid's pairs, once --grid and --json are known to be usable (--json before the runs, not after them);
    ConfigError with the problems otherwise."""
    problems = []
    try:
        grid = grid_pairs(args.grid)
    except ValueError as err:
        grid, problems = [], [str(err)]
    if args.json and (problem := results_log_problem(args.json)):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    return grid


def load_configs(args: argparse.Namespace, overrides: list[str], *, recipes: list[str],
                 grid: list[tuple[str, int]]) -> tuple:
    """(the config, {FP8 recipe or LoRA rank: its config}, {grid pair: its config}); each variant's config is the
    same overrides plus its own, checked as train_fsdp.py checks it (a grid pair's split over this launch's world
    size too). Raises ConfigError with every problem."""
    cfg = load_config(args.config, overrides)
    fp8_cfgs = {f"ours_fp8_{r}": load_config(args.config, [*overrides, f"--train.float8={r}"]) for r in recipes}
    if args.float8_output:
        fp8_cfgs["ours_fp8_output"] = load_config(args.config, [*overrides, "--train.float8_output=true"])
    ranks = [r.strip() for r in args.lora.split(",") if r.strip()]
    if bad := [r for r in ranks if integer_in(r, 1) is None]:
        raise ConfigError([f"--lora: {bad[0]!r} is not a LoRA rank (a whole number of at least 1)"])
    for rank in map(integer, ranks):
        fp8_cfgs[f"ours_lora_r{rank}"] = load_config(args.config, [*overrides, f"--train.lora.rank={rank}"])
    if args.muon:
        fp8_cfgs["ours_muon"] = load_config(args.config, [*overrides, "--train.optimizer=muon"])
    launch = read_torchrun_env()
    problems = [p for r in dict.fromkeys([cfg.train.float8, *recipes])
                for p in float8_problems(r, run_device=cfg.run.device, local_rank=launch.local_rank)]
    problems += float8_output_problems(cfg.train.float8_output or args.float8_output, run_device=cfg.run.device,
                                       local_rank=launch.local_rank)
    grid_cfgs = {}
    for policy, size in grid:
        try:
            c = load_config(args.config, [*overrides, f"--fsdp.activation_checkpointing={policy}",
                                          f"--train.micro_batch_size={size}"])
            check_batch_split(c.train, launch.world_size)
            grid_cfgs[f"{GRID}{policy}@{size}"] = c
        except ConfigError as err:
            problems += [f"--grid {policy}@{size}: {problem}" for problem in err.problems]
    for c in [cfg, *fp8_cfgs.values(), *grid_cfgs.values()]:
        if c.model.vocab_size == 0:  # no tokenizer here: random tokens over the configured vocabulary
            c.model.vocab_size = c.data.vocab_size
            if c.train.float8_output and c.data.vocab_size % FLOAT8_ALIGNMENT:  # before any run, not at its build
                problems.append(float8_size_problem("data.vocab_size (the model's vocabulary here)",
                                                    c.data.vocab_size))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return cfg, fp8_cfgs, grid_cfgs


def plan_runs(args: argparse.Namespace, cfg: Config, fp8_cfgs: dict, grid_cfgs: dict) -> list[tuple]:
    """(name, function, config, micro-batch, accumulation) of each run, in order: accumulation None
    follows the global batch."""
    auto = cfg.train.micro_batch_size == "auto"
    runs: list[tuple] = []
    if args.compare_auto and not args.peer_only:
        runs += [(f"ours_mb{args.fixed_micro_batch}", bench_ours, cfg, args.fixed_micro_batch, None),
                 ("ours_auto", bench_ours, cfg, "auto", None)]
    elif not args.peer_only and not args.lora_only:
        runs.append(("ours", bench_ours, cfg, cfg.train.micro_batch_size, None if auto else args.grad_accum or 1))
    if not args.peer_only:  # FP8 recipes and LoRA ranks, each named by its variant
        runs += [(name, bench_ours, c, c.train.micro_batch_size, None if auto else args.grad_accum or 1)
                 for name, c in fp8_cfgs.items()]
        runs += [(name, bench_ours, c, c.train.micro_batch_size, None) for name, c in grid_cfgs.items()]
    if args.document_masking:  # each of ours, then the same masked
        runs = [twin for run in runs for twin in (run, (run[0] + DOCMASK, run[1], with_documents(run[2]), *run[3:]))]
    if args.peer or args.peer_only:
        # At the last of ours' micro-batch and accumulation.
        runs.append(("hf_llama_fsdp2", bench_peer, cfg, None, None))
    return runs


DOCMASK = "_docmask"


def with_documents(cfg: Config) -> Config:
    """The config with document masking and positions restarting at each document."""
    masked = copy.deepcopy(cfg)
    masked.data.document_masking = masked.model.reset_positions = True
    return masked


def run_saves(cfg: Config, env: DistEnv, args: argparse.Namespace, *, overrides: list[str]) -> None:
    """The --save_modes mode: measure checkpoint saves, print them and append them to --json."""
    rows = bench_saves(cfg, env, args)
    if env.is_main:
        print_saves(rows, cfg, env, args)
        if args.json:
            shown = [redacted_argument(o) for o in overrides]
            append_line(args.json, json.dumps({"config": args.config, "overrides": shown, "world_size": env.world_size,
                                               "fsdp_version": cfg.fsdp.version, "saves": rows}))


def run_rounds(runs: list[tuple], cfg: Config, env: DistEnv,
               args: argparse.Namespace) -> tuple[list[dict], dict[str, list[float]]]:
    """Time every run `--rounds` times: (one summary row per run, {run: each round's median step time})."""
    peak = detect_peak_flops(env.device, cfg.logging.peak_override_flops)
    times: dict[str, list[float]] = {name: [] for name, *_ in runs}
    memory = dict.fromkeys(times, 0.0)
    optim_times: dict[str, list[float]] = {name: [] for name in times}
    optim_state: dict[str, float | None] = dict.fromkeys(times)
    splits = {}  # name -> (micro-batch, accumulation) as run; auto is searched in the first round only
    last_split = (cfg.train.micro_batch_size, args.grad_accum or 1) if args.peer_only else None
    round_step_s: dict[str, list[float]] = {name: [] for name in times}  # each round's median step time
    # Rounds alternate the runs, so a machine whose speed drifts between invocations (most visible at
    # short steps) affects both alike; each round builds its model afresh.
    for _ in range(args.rounds):
        for name, bench, run_cfg, micro_batch, grad_accum in runs:
            reset_memory(env)
            # Each run compiles its own graphs, as its own training process would: after graphs of another
            # micro-batch, dynamo would mark the batch dimension dynamic and the run would time slower kernels.
            torch._dynamo.reset()
            if name in splits:
                micro_batch, grad_accum = splits[name]
            elif bench is bench_peer:
                # Our last bf16 split; with FP8 runs only (--train.float8=tensorwise --peer), the first one's,
                # halved by bench_peer_fitting where the reference does not fit it.
                micro_batch, grad_accum = last_split or next(iter(splits.values()))
            if bench is bench_peer:
                result = bench_peer_fitting(cfg, env, args, micro_batch=micro_batch, grad_accum=grad_accum)
            else:
                result = bench(run_cfg, env, args, micro_batch=micro_batch, grad_accum=grad_accum)
            splits[name] = (result["micro_batch"], result["grad_accum"])
            if bench is bench_ours and run_cfg.train.float8 == "none":
                # The bf16 reference runs at our last bf16 split where there is one: an FP8 run's larger
                # micro-batch may not fit the reference, and its halving after an out-of-memory error relies on
                # every rank running out alike (an error on one rank alone waits out run.timeout_s).
                last_split = splits[name]
            times[name] += result["times"]
            optim_times[name] += result.get("optim_times", [])
            optim_state[name] = result.get("optim_state_bytes")
            memory[name] = max(memory[name], peak_memory_gib(env))
            round_step_s[name].append(statistics.median(result["times"]))
    rows = [summarise(name, times[name], memory[name], splits[name], cfg, peak, optim_times=optim_times[name],
                      optim_state_bytes=optim_state[name]) for name, *_ in runs]
    return rows, round_step_s


def report_rounds(rows: list[dict], round_step_s: dict[str, list[float]], cfg: Config, env: DistEnv,
                  args: argparse.Namespace, *,
                  overrides: list[str], recipes: list[str]) -> None:
    """Rank 0: the table of runs, the tokens/s ratios, and the JSON line of --json."""
    ablations = [name for name in ("fused_projections", "unfused_adamw") if getattr(args, name)]
    m = cfg.model
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    global_batch = max(r["micro_batch"] * r["grad_accum"] for r in rows) * env.world_size
    print(f"\n{args.config}: {m.num_params() / 1e6:.0f}M params, seq {cfg.data.seq_len}, global batch "
          f"{global_batch}, world {env.world_size} x {device}, "
          f"{fsdp_adapter(cfg.fsdp, env).describe()}, AC {cfg.fsdp.activation_checkpointing}, "
          f"compile {cfg.train.compile}{' (tuned)' if cfg.train.compile_tuning else ''}, "
          f"cpu_offload {cfg.fsdp.cpu_offload}"
          + (f", documents of {args.doc_len} tokens on average" if args.doc_len else "")
          + "".join(f", {name}" for name in ablations))
    print(f"{'run':<28}{'micro x acc':>12}{'tok/s/gpu':>12}{'MFU':>8}{'step s':>9}{'optim ms':>15}{'optim GiB':>10}"
          f"{'peak GiB':>10}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        split = f"{r['micro_batch']} x {r['grad_accum']}"
        # The optimizer step's median time, with its share of the median step; its state's GiB on the fullest GPU.
        optim = (f"{1e3 * r['optim_step_s']:.1f} ({100 * r['optim_step_s'] / r['step_s']:.0f}%)"
                 if r["optim_step_s"] is not None else "n/a")
        state = f"{r['optim_state_gib']:.2f}" if r["optim_state_gib"] is not None else "n/a"
        print(f"{r['name']:<28}{split:>12}{r['tokens_per_sec_per_gpu']:>12,.0f}{mfu:>8}{r['step_s']:>9.3f}"
              f"{optim:>15}{state:>10}{r['peak_mem_gib']:>10.2f}")
    ratios = {}
    by_name = {r["name"]: r for r in rows}
    for name, base in ratio_pairs(list(by_name)):
        per_round = [b / n for n, b in zip(round_step_s[name], round_step_s[base], strict=True)]
        overall = by_name[name]["tokens_per_sec_per_gpu"] / by_name[base]["tokens_per_sec_per_gpu"]
        ratios[f"{name} / {base}"] = {"all_rounds": overall, "per_round": per_round}
        rounds_note = ""
        if args.rounds > 1:
            rounds_note = f" (all rounds' steps; per round: {', '.join(f'{x:.3f}' for x in per_round)})"
        print(f"ratio {name} / {'reference' if base == 'hf_llama_fsdp2' else base} tokens/s: "
              f"{overall:.3f}{rounds_note}")
    contenders = [name for name in by_name if name == "ours" or name.startswith(GRID)]
    if len(contenders) > 1 and "ours" in contenders:
        fastest = max(contenders, key=lambda name: by_name[name]["tokens_per_sec_per_gpu"])
        share = by_name["ours"]["tokens_per_sec_per_gpu"] / by_name[fastest]["tokens_per_sec_per_gpu"]
        print(f"fastest of ours and the grid: {fastest}; ours / fastest tokens/s: {share:.3f}")
    if args.json:
        record = {"config": args.config, "overrides": list(map(redacted_argument, overrides)), "float8": recipes,
                  "world_size": env.world_size,
                  "device": device, "params": m.num_params(), "ablations": ablations, "rows": rows,
                  "document_masking": args.document_masking, "doc_len": args.doc_len,
                  "rounds": args.rounds, "ratios": ratios}
        append_line(args.json, json.dumps(record))


def main() -> int:
    parser = build_parser()
    prefer_expandable_segments()  # before anything touches the GPU
    args, overrides = parser.parse_known_args()
    recipes = [r for r in args.float8.split(",") if r]
    try:
        grid = checked_grid(args)
        cfg, fp8_cfgs, grid_cfgs = load_configs(args, overrides, recipes=recipes, grid=grid)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    auto = cfg.train.micro_batch_size == "auto"
    if (auto or args.compare_auto) and args.grad_accum is not None:
        parser.error("--grad_accum goes with a numeric micro-batch; with auto or --compare_auto the accumulation "
                     "follows train.global_batch_size")
    if args.peer_only and auto:
        parser.error("--peer_only needs a numeric train.micro_batch_size (auto is found by our own run)")
    if args.lora_only and not args.lora:
        parser.error("--lora_only goes with --lora (the ranks to run)")
    if args.doc_len is None:
        args.doc_len = 1024 if args.document_masking else 0
    elif args.doc_len < 1:
        parser.error("--doc_len must be at least 1")
    runs = plan_runs(args, cfg, fp8_cfgs, grid_cfgs)
    modes = [m for m in args.save_modes.split(",") if m]
    if unknown := [m for m in modes if m not in SAVE_MODES]:
        print(f"error: --save_modes: {', '.join(unknown)} is not one of {', '.join(SAVE_MODES)}", file=sys.stderr)
        return 2
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    try:
        if modes:
            run_saves(cfg, env, args, overrides=overrides)
            return 0
        rows, round_step_s = run_rounds(runs, cfg, env, args)
        if env.is_main:
            report_rounds(rows, round_step_s, cfg, env, args, overrides=overrides, recipes=recipes)
        return 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
