"""Measure training throughput and memory of a config, and optionally of a Hugging Face reference.

    torchrun --nproc_per_node=2 scripts/benchmark.py config/train300M_fsdp.yaml --peer
    torchrun --nproc_per_node=1 scripts/benchmark.py config/train1B_fsdp.yaml --train.micro_batch_size=2

Ours: the exact model, wrapping and step of train_fsdp.py (forward/backward per micro-batch, clipping
over all shards, fused AdamW, the per-step loss all-reduce), on random tokens so no data is needed.
`--peer`: transformers' LlamaForCausalLM of the same dimensions, FSDP2 `fully_shard` on each decoder
layer, bf16 parameters with fp32 reduction, per-layer torch.compile, fused AdamW; same sequence length,
micro-batch and world size, run in the same invocation after ours. Prints tokens/s per GPU, MFU, step
time and peak memory per GPU for each, and the ratio.

`--save_modes sync,thread[,process,sync_gpu]`: measure sharded checkpoint saves instead, in one invocation:
after the timed training steps, for each mode, `--saves` saves through the checkpoint manager (sync: as
train_fsdp.py with checkpoint.async_save=false; thread / process: asynchronous, with that writer;
sync_gpu: synchronous with FSDP1's state dict left on the GPU, as before issue 15, to measure the GPU
copy of the state it makes: it may not fit at 8B on 80 GB GPUs), the
training steps going on while an asynchronous write is in flight. Reports per mode the time the loop was
blocked by a save (its stall), the whole save's time, the steps that overlapped a save against the
others, and the peak GPU memory during the save calls and during training. Each checkpoint is deleted
once measured (an 8B one is ~96 GB) and --save_dir at the end.

    torchrun --nproc_per_node=2 scripts/benchmark.py config/train1B_fsdp.yaml --save_modes sync,thread --steps 5
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from config import ConfigError, load_config  # noqa: E402
from fsdp_utils.checkpoint import CheckpointError, CheckpointManager, TrainState  # noqa: E402
from fsdp_utils.distributed import destroy_distributed, init_distributed  # noqa: E402
from fsdp_utils.metrics import detect_peak_flops  # noqa: E402
from fsdp_utils.optim import build_optimizer, clip_grad_norm  # noqa: E402
from fsdp_utils.build import build_model  # noqa: E402
from fsdp_utils.step import forward_backward  # noqa: E402
from fsdp_utils.wrap import parallelize, resolve_precision  # noqa: E402
from model.transformer import Attention, FeedForward  # noqa: E402


def random_batches(vocab_size: int, *, micro_batch: int, seq_len: int, device, seed: int):
    """An endless stream of random (inputs, targets) batches, generated on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), device=device, generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def time_steps(step_fn, *, warmup: int, steps: int, device) -> list[float]:
    """Run warmup + timed steps; return each timed step's seconds (synchronised: the step's last
    .item() already waits for the GPU, a barrier keeps ranks aligned)."""
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def fuse_projections() -> None:
    """Ablation (--fused_projections): one matmul per fused weight (q/k/v, gate/up), its output split
    afterwards, instead of the model's one matmul per slice. Same weights and results; patched before build."""
    def project_qkv(self, x):
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        return q, k, v.contiguous()  # a view would keep the whole fused output alive for backward

    def gate_up(self, x):
        return self.w13(x).chunk(2, dim=-1)

    Attention.project_qkv, FeedForward.gate_up = project_qkv, gate_up


def bench_ours(cfg, env, args) -> dict:
    step, _, _ = build_ours(cfg, env, args)
    return measure(step, env, args)


def build_ours(cfg, env, args):
    """(step function, model, optimizer) of train_fsdp.py's model, wrapping and step."""
    t = cfg.train
    if args.fused_projections:
        fuse_projections()
    precision = resolve_precision(t.precision, cfg.fsdp.reduce_dtype, env.device)
    built = build_model(cfg, env)
    model = parallelize(built.module, block_classes=built.block_classes, fsdp=cfg.fsdp, precision=precision,
                        compile=t.compile, env=env, init=built.init)
    optimizer = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                fused=not args.unfused_adamw)
    batches = random_batches(cfg.model.vocab_size, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len, device=env.device, seed=env.rank)

    def step():
        loss = forward_backward(model, batches, None, grad_accum=args.grad_accum)
        clip_grad_norm(model, t.grad_clip)
        dist.all_reduce(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step, model, optimizer


def measure(step_fn, env, args) -> dict:
    """Time the warm-up and timed steps, then (--profile) profile a few more."""
    times = time_steps(step_fn, warmup=args.warmup, steps=args.steps, device=env.device)
    if args.profile:
        profile_steps(step_fn, env)
    return {"times": times}


def profile_steps(step_fn, env, num_steps: int = 3) -> None:
    """Print the GPU kernels that took the most time over a few steps (rank 0), to see where time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step_fn()
        torch.cuda.synchronize(env.device)
    if env.is_main:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def bench_peer(cfg, env, args) -> dict:
    """transformers LlamaForCausalLM + FSDP2 + per-layer compile: what users would otherwise run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.num_kv_heads,
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
        if cfg.train.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True)
    t = cfg.train
    batches = random_batches(m.vocab_size, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len, device=env.device, seed=env.rank)

    def step():
        total = None
        for micro in range(args.grad_accum):
            x, y = next(batches)
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            loss = model(input_ids=x, labels=y).loss / args.grad_accum
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total.item()

    return measure(step, env, args)


def timed_step(step_fn, env) -> float:
    dist.barrier()
    start = time.perf_counter()
    step_fn()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return time.perf_counter() - start


def max_over_ranks(value: float, env) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reset_peak(env) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)


def bench_saves(cfg, env, args) -> list[dict]:
    """Sharded saves of train_fsdp.py's model and optimizer, per mode (see the module docstring)."""
    step_fn, model, optimizer = build_ours(cfg, env, args)
    for _ in range(args.warmup):
        step_fn()
    reset_peak(env)
    normal = [timed_step(step_fn, env) for _ in range(args.steps)]
    train_peak = peak_memory_gib(env)
    root = Path(args.save_dir)
    rows = []
    for mode in args.save_modes.split(","):
        sync = mode in ("sync", "sync_gpu")
        manager = CheckpointManager(root / mode, fmt="sharded", keep_last_n=0, model_config={}, env=env,
                                    async_save=not sync, async_writer="thread" if sync else mode,
                                    timeout_s=cfg.run.timeout_s)
        if mode == "sync_gpu":
            manager._offload = lambda model: False  # measurement only: the state dict as FSDP1 makes it, on the GPU
        start = time.perf_counter()
        try:
            manager.prepare_saving(model, optimizer)  # the staging arena: once per run, before the first save
        except CheckpointError as err:  # raised on every rank alike (e.g. /dev/shm too small for the process writer)
            if env.is_main:
                print(f"{mode}: not measured: {err}")
            continue
        prepare_s = max_over_ranks(time.perf_counter() - start, env)
        for i in range(args.saves):
            reset_peak(env)
            manager.save(model, optimizer, TrainState(step=i + 1))
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
            size = sum(p.stat().st_size for p in (root / mode / saved["name"]).rglob("*") if p.is_file())
            rows.append({
                "mode": mode, "save": i + 1, "stall_s": max_over_ranks(saved["blocked_s"], env),
                "total_s": max_over_ranks(saved["total_s"], env),
                "staging_s": max_over_ranks(saved.get("staging_s", 0.0), env), "prepare_s": prepare_s,
                "normal_step_s": statistics.median(normal),
                "overlapped_step_s": statistics.median(overlapped) if overlapped else None,
                "overlapped_steps": len(overlapped), "write_outlasted_steps": len(overlapped) >= args.max_overlap_steps,
                "train_peak_gib": train_peak, "save_peak_gib": save_peak, "overlap_peak_gib": overlap_peak,
                "checkpoint_gb": max_over_ranks(size / 1e9, env),  # the whole folder, as its node sees it
            })
            if env.is_main:  # measured: delete it (disk space: an 8B checkpoint is ~96 GB)
                shutil.rmtree(root / mode / saved["name"])
            dist.barrier()
        manager.close()
    if env.is_main:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def print_saves(rows: list[dict], cfg, env, args) -> None:
    if not rows:
        return
    m = cfg.model
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    print(f"\n{args.config}: {m.num_params() / 1e9:.2f}B params, seq {cfg.data.seq_len}, micro-batch "
          f"{cfg.train.micro_batch_size} x accum {args.grad_accum}, world {env.world_size} x {device}, "
          f"FSDP{cfg.fsdp.version} {cfg.fsdp.sharding_strategy}, AC {cfg.fsdp.activation_checkpointing}, "
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


def peak_memory_gib(env) -> float:
    mem = torch.tensor(torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0, device=env.device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return mem.item()


def summarise(name: str, times: list[float], peak_mem_gib: float, cfg, args, peak_flops) -> dict:
    step_s = statistics.median(times)
    tokens_per_gpu = args.grad_accum * cfg.train.micro_batch_size * cfg.data.seq_len / step_s
    flops = cfg.model.flops_per_token(cfg.data.seq_len)
    return {"name": name, "step_s": step_s, "tokens_per_sec_per_gpu": tokens_per_gpu,
            "mfu": flops * tokens_per_gpu / peak_flops if peak_flops else None, "peak_mem_gib": peak_mem_gib,
            "step_s_min": min(times), "step_s_max": max(times)}


def reset_memory(env) -> None:
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--peer", action="store_true", help="also run the Hugging Face + FSDP2 reference")
    parser.add_argument("--peer_only", action="store_true", help="run only the reference")
    parser.add_argument("--rounds", type=int, default=1, help="alternate ours and the reference this many times (noisy machines)")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of each run")
    parser.add_argument("--fused_projections", action="store_true", help="ablation: one q/k/v and one gate/up matmul, split after")
    parser.add_argument("--unfused_adamw", action="store_true", help="ablation: the multi-tensor (foreach) AdamW, not the fused one")
    parser.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    parser.add_argument("--save_modes", default="", help="measure sharded checkpoint saves instead: any of sync, "
                        "thread, process, sync_gpu, comma-separated (e.g. sync,thread)")
    parser.add_argument("--saves", type=int, default=1, help="with --save_modes: saves per mode")
    parser.add_argument("--max_overlap_steps", type=int, default=300,
                        help="with --save_modes: at most this many steps while an asynchronous write is in flight")
    parser.add_argument("--save_dir", default=str(ROOT / "checkpoints" / "benchmark-saves"),
                        help="with --save_modes: where the checkpoints are written (each deleted once measured)")
    args, overrides = parser.parse_known_args()
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if cfg.model.vocab_size == 0:  # no tokenizer here: random tokens over the configured vocabulary
        cfg.model.vocab_size = cfg.data.vocab_size
    modes = [m for m in args.save_modes.split(",") if m]
    if unknown := [m for m in modes if m not in ("sync", "thread", "process", "sync_gpu")]:
        print(f"error: --save_modes: {', '.join(unknown)} is not one of sync, thread, process, sync_gpu", file=sys.stderr)
        return 2
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    try:
        if modes:
            rows = bench_saves(cfg, env, args)
            if env.is_main:
                print_saves(rows, cfg, env, args)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({"config": args.config, "overrides": overrides, "world_size": env.world_size,
                                            "fsdp_version": cfg.fsdp.version, "saves": rows}) + "\n")
            return 0
        peak = detect_peak_flops(env.device, cfg.logging.peak_flops)
        runs = ([("ours", bench_ours)] if not args.peer_only else []) + \
            ([("hf_llama_fsdp2", bench_peer)] if args.peer or args.peer_only else [])
        times = {name: [] for name, _ in runs}
        memory = dict.fromkeys(times, 0.0)
        round_step_s = {name: [] for name in times}  # each round's median step time
        # Rounds alternate the runs, so a machine whose speed drifts between invocations (seen at
        # short steps) affects both alike; each round builds its model afresh.
        for _ in range(args.rounds):
            for name, bench in runs:
                reset_memory(env)
                round_times = bench(cfg, env, args)["times"]
                times[name] += round_times
                memory[name] = max(memory[name], peak_memory_gib(env))
                round_step_s[name].append(statistics.median(round_times))
            torch._dynamo.reset()  # recompile from the caches rather than pile up guards on old modules
        rows = [summarise(name, times[name], memory[name], cfg, args, peak) for name, _ in runs]
        ablations = [name for name in ("fused_projections", "unfused_adamw") if getattr(args, name)]
        if env.is_main:
            m = cfg.model
            device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
            print(f"\n{args.config}: {m.num_params() / 1e6:.0f}M params, seq {cfg.data.seq_len}, micro-batch "
                  f"{cfg.train.micro_batch_size} x accum {args.grad_accum}, world {env.world_size} x {device}, "
                  f"FSDP{cfg.fsdp.version} {cfg.fsdp.sharding_strategy}, AC {cfg.fsdp.activation_checkpointing}, "
                  f"compile {cfg.train.compile}, cpu_offload {cfg.fsdp.cpu_offload}"
                  + "".join(f", {name}" for name in ablations))
            print(f"{'run':<16}{'tok/s/gpu':>12}{'MFU':>8}{'step s':>9}{'peak GiB':>10}")
            for r in rows:
                mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
                print(f"{r['name']:<16}{r['tokens_per_sec_per_gpu']:>12,.0f}{mfu:>8}{r['step_s']:>9.3f}{r['peak_mem_gib']:>10.2f}")
            round_ratios = []
            if len(rows) == 2:
                round_ratios = [peer / ours for ours, peer in zip(*round_step_s.values())]
                per_round = f" (all rounds' steps; per round: {', '.join(f'{r:.3f}' for r in round_ratios)})" if args.rounds > 1 else ""
                print(f"ratio ours / reference tokens/s: {rows[0]['tokens_per_sec_per_gpu'] / rows[1]['tokens_per_sec_per_gpu']:.3f}{per_round}")
            if args.json:
                record = {"config": args.config, "overrides": overrides, "world_size": env.world_size, "device": device,
                          "params": m.num_params(), "ablations": ablations, "rows": rows,
                          "rounds": args.rounds, "round_ratios": round_ratios}
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
        return 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
