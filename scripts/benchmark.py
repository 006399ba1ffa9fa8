"""Measure training throughput and memory of a config, and optionally of a Hugging Face reference.

    torchrun --nproc_per_node=2 scripts/benchmark.py config/train300M_fsdp.yaml --peer
    torchrun --nproc_per_node=1 scripts/benchmark.py config/train1B_fsdp.yaml --train.micro_batch_size=2
    torchrun --nproc_per_node=2 scripts/benchmark.py config/train1B_fsdp.yaml --fsdp.version=2 --float8 tensorwise,rowwise --peer

Ours: the exact model, wrapping and step of train_fsdp.py (forward/backward per micro-batch, clipping
over all shards, fused AdamW, the per-step loss all-reduce), on random tokens so no data is needed.
`--peer`: transformers' LlamaForCausalLM of the same dimensions, FSDP2 `fully_shard` on each decoder
layer, bf16 parameters with fp32 reduction, per-layer torch.compile, fused AdamW; same sequence length,
micro-batch and world size, run in the same invocation after ours. `--float8 RECIPES`: ours again with
train.float8 set to each recipe (FP8 matmuls through torchao; needs fsdp.version 2), between ours and
the reference, which stays bf16. Prints tokens/s per GPU, MFU (against the bf16 peak), step time and peak
memory per GPU for each, and the ratios: ours and each FP8 run against the reference, each FP8 run
against ours.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from config import ConfigError, load_config  # noqa: E402
from fsdp_utils.distributed import destroy_distributed, init_distributed, read_torchrun_env  # noqa: E402
from fsdp_utils.float8 import float8_problems, precompute_float8_scales  # noqa: E402
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


def bench_ours(cfg, env, args) -> dict:
    t = cfg.train
    precision = resolve_precision(t.precision, cfg.fsdp.reduce_dtype, env.device)
    built = build_model(cfg, env)
    if args.fused_projections:
        # Ablation: one matmul per fused weight (q/k/v, gate/up), its output split afterwards, instead of
        # one matmul per slice. Same weights and results. (FP8 runs use it anyway.)
        for module in built.module.modules():
            if isinstance(module, (Attention, FeedForward)):
                module.fused_matmul = True
    model = parallelize(built.module, block_classes=built.block_classes, fsdp=cfg.fsdp, precision=precision,
                        compile=t.compile, env=env, init=built.init, float8=t.float8)
    optimizer = build_optimizer(model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                fused=not args.unfused_adamw)
    batches = random_batches(cfg.model.vocab_size, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len, device=env.device, seed=env.rank)

    def step():
        loss = forward_backward(model, batches, None, grad_accum=args.grad_accum)
        clip_grad_norm(model, t.grad_clip)
        dist.all_reduce(loss)
        optimizer.step()
        if t.float8 != "none":  # as train_fsdp.py: the new weights' FP8 scales for the next all-gathers
            precompute_float8_scales(model)
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return measure(step, env, args)


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(run, baseline) pairs whose tokens/s ratio is printed: every run against the reference, and each
    FP8 run against ours in bf16."""
    pairs = [(name, "hf_llama_fsdp2") for name in names if name != "hf_llama_fsdp2" and "hf_llama_fsdp2" in names]
    return pairs + [(name, "ours") for name in names if name.startswith("ours_fp8") and "ours" in names]


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
    parser.add_argument("--float8", default="", help="also run ours with these train.float8 recipes, e.g. tensorwise,rowwise")
    parser.add_argument("--rounds", type=int, default=1, help="alternate ours and the reference this many times (noisy machines)")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of each run")
    parser.add_argument("--fused_projections", action="store_true", help="ablation: one q/k/v and one gate/up matmul, split after")
    parser.add_argument("--unfused_adamw", action="store_true", help="ablation: the multi-tensor (foreach) AdamW, not the fused one")
    parser.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    args, overrides = parser.parse_known_args()
    recipes = [r for r in args.float8.split(",") if r]
    try:
        cfg = load_config(args.config, overrides)
        # Each FP8 run's config: the same overrides plus its recipe, checked as train_fsdp.py checks it.
        fp8_cfgs = {r: load_config(args.config, [*overrides, f"--train.float8={r}"]) for r in recipes}
        problems = [p for r in recipes for p in float8_problems(r, run_device=cfg.run.device, local_rank=read_torchrun_env()[1])]
        if problems:
            raise ConfigError(problems)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    for c in [cfg, *fp8_cfgs.values()]:
        if c.model.vocab_size == 0:  # no tokenizer here: random tokens over the configured vocabulary
            c.model.vocab_size = c.data.vocab_size
    env = init_distributed(device=cfg.run.device, timeout_s=cfg.run.timeout_s)
    try:
        peak = detect_peak_flops(env.device, cfg.logging.peak_flops)
        runs = ([("ours", bench_ours, cfg)] if not args.peer_only else []) + \
            [(f"ours_fp8_{r}", bench_ours, c) for r, c in fp8_cfgs.items()] + \
            ([("hf_llama_fsdp2", bench_peer, cfg)] if args.peer or args.peer_only else [])
        times = {name: [] for name, _, _ in runs}
        memory = dict.fromkeys(times, 0.0)
        round_step_s = {name: [] for name in times}  # each round's median step time
        # Rounds alternate the runs, so a machine whose speed drifts between invocations (seen at
        # short steps) affects both alike; each round builds its model afresh.
        for _ in range(args.rounds):
            for name, bench, run_cfg in runs:
                reset_memory(env)
                round_times = bench(run_cfg, env, args)["times"]
                times[name] += round_times
                memory[name] = max(memory[name], peak_memory_gib(env))
                round_step_s[name].append(statistics.median(round_times))
            torch._dynamo.reset()  # recompile from the caches rather than pile up guards on old modules
        rows = {name: summarise(name, times[name], memory[name], cfg, args, peak) for name in times}
        ablations = [name for name in ("fused_projections", "unfused_adamw") if getattr(args, name)]
        if env.is_main:
            m = cfg.model
            device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
            print(f"\n{args.config}: {m.num_params() / 1e6:.0f}M params, seq {cfg.data.seq_len}, micro-batch "
                  f"{cfg.train.micro_batch_size} x accum {args.grad_accum}, world {env.world_size} x {device}, "
                  f"FSDP{cfg.fsdp.version} {cfg.fsdp.sharding_strategy}, AC {cfg.fsdp.activation_checkpointing}, "
                  f"compile {cfg.train.compile}, cpu_offload {cfg.fsdp.cpu_offload}"
                  + "".join(f", {name}" for name in ablations))
            print(f"{'run':<22}{'tok/s/gpu':>12}{'MFU':>8}{'step s':>9}{'peak GiB':>10}")
            for r in rows.values():
                mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
                print(f"{r['name']:<22}{r['tokens_per_sec_per_gpu']:>12,.0f}{mfu:>8}{r['step_s']:>9.3f}{r['peak_mem_gib']:>10.2f}")
            ratios = {}
            for name, base in ratio_pairs(list(rows)):
                per_round = [b / n for n, b in zip(round_step_s[name], round_step_s[base])]
                overall = rows[name]["tokens_per_sec_per_gpu"] / rows[base]["tokens_per_sec_per_gpu"]
                ratios[f"{name} / {base}"] = {"all_rounds": overall, "per_round": per_round}
                rounds_note = f" (all rounds' steps; per round: {', '.join(f'{r:.3f}' for r in per_round)})" if args.rounds > 1 else ""
                print(f"ratio {name} / {'reference' if base == 'hf_llama_fsdp2' else base} tokens/s: {overall:.3f}{rounds_note}")
            if args.json:
                record = {"config": args.config, "overrides": overrides, "float8": recipes, "world_size": env.world_size,
                          "device": device, "params": m.num_params(), "ablations": ablations, "rows": list(rows.values()),
                          "rounds": args.rounds, "ratios": ratios}
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
        return 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
