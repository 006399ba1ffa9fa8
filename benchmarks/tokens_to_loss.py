"""Tokens to the same validation loss: train one config with each optimizer at several learning rates and seeds,
then say how many tokens each optimizer needs to reach the best final validation loss of the first.

    python scripts/prepare_data.py config/train90M_fsdp.yaml --data.builtin_corpus=python --data.dataset_dir=/data/py
    python benchmarks/tokens_to_loss.py config/train90M_fsdp.yaml --optimizers adamw,muon \
        --lrs 1e-3,2e-3,4e-3 --seeds 1,2 --concurrent 4 --out /tmp/ttl -- --data.dataset_dir=/data/py \
        --fsdp.version=2 --train.max_steps=200 --train.eval_interval=10 --train.global_batch_size=16

Each run is `train_fsdp.py CONFIG OVERRIDES --train.optimizer=O --train.lr=LR --run.seed=S` in a process of its
own, or under torchrun with `--nproc_per_node` ranks, writing into OUT/<optimizer>-lr<LR>-s<S>/; `--concurrent` of
them run at a time, each on GPUs of its own where the machine has enough (CUDA_VISIBLE_DEVICES). The
overrides after `--` go to every run: a prepared folder (data.dataset_dir) keeps the validation split the same
for every seed (run.seed then draws the weights and the data order only). From each run's metrics.jsonl:
the validation loss at each evaluation against the tokens trained (steps x global batch x sequence length),
tokens/s and peak memory. The best learning rate of an optimizer is the one with the lowest final validation loss
averaged over the seeds; the target is the first optimizer's best; for each optimizer at its best learning rate,
the tokens at which its seed-averaged validation curve first reaches the target (linear between evaluations;
none when it never does), and that over the first optimizer's. Prints a table, writes OUT/summary.json and, with
matplotlib, OUT/val_loss.png (the best runs' curves). `--summarize_only` trains nothing and summarizes the finished
runs in OUT: a sweep made over several calls, its run folders gathered into one.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fsdp_utils.checkpoint.names import sidecar_of, step_in_name

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train_fsdp.py"


@dataclass(frozen=True)
class Run:
    optimizer: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}-lr{self.lr:g}-s{self.seed}"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--optimizers", default="adamw,muon", help="train.optimizer values; the first is the target's")
    parser.add_argument("--lrs", default="1e-3,2e-3,4e-3", help="train.lr values, for every optimizer")
    parser.add_argument("--seeds", default="1,2", help="run.seed values")
    parser.add_argument("--concurrent", type=int, default=1, help="runs at a time")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="ranks of each run (torchrun when above 1)")
    parser.add_argument("--out", required=True, help="a folder for the runs and the summary")
    parser.add_argument("--summarize_only", action="store_true",
                        help="train nothing: summarize the runs already in --out (a sweep made over several calls, "
                             "its run folders gathered into one)")
    parser.add_argument("--keep_checkpoints", action="store_true", help="keep each run's checkpoints (default: "
                        "deleted once the run ends; a 300M run's last checkpoint is several GB)")
    args = parser.parse_args(own)
    try:
        args.lr_list = [float(v) for v in args.lrs.split(",")]
        args.seed_list = [int(v) for v in args.seeds.split(",")]
    except ValueError as err:
        parser.error(f"--lrs takes numbers and --seeds whole numbers, comma-separated ({err})")
    args.optimizer_list = args.optimizers.split(",")
    if args.concurrent < 1 or args.nproc_per_node < 1:
        parser.error("--concurrent and --nproc_per_node must be at least 1")
    return args, overrides


def launcher(nproc: int) -> list[str]:
    """The command before train_fsdp.py: python, or torchrun of `nproc` ranks on this machine (a free port each)."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def gpu_slots(concurrent: int, nproc: int, num_gpus: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of the `concurrent` slots, `nproc` GPUs apiece, where the machine's `num_gpus`
    suffice; else None for every slot (the runs see every GPU, or run on the CPU)."""
    if concurrent * nproc > num_gpus:
        return [None] * concurrent
    return [",".join(str(slot * nproc + i) for i in range(nproc)) for slot in range(concurrent)]


def train(run: Run, config: str, overrides: list[str], out: Path, *, keep_checkpoints: bool, nproc: int = 1,
          slots: queue.Queue | None = None) -> tuple[Run, int, float]:
    """One run of train_fsdp.py: (the run, its exit status, its seconds); its output in out/<name>/train.log. The
    folder is made here, new (an existing one is an error): all in it is the run's, so its checkpoints, which a sweep
    does not need, can go once it ends (`keep_checkpoints` False), leaving the metrics and the config. With `slots`,
    it takes a slot's GPUs for its duration."""
    folder = out / run.name
    folder.mkdir(parents=True)
    cmd = [*launcher(nproc), str(TRAIN), config, *overrides, f"--train.optimizer={run.optimizer}",
           f"--train.lr={run.lr}", f"--run.seed={run.seed}", f"--run.output_dir={folder / 'run'}",
           "--logging.trackers=[]"]
    devices = slots.get() if slots is not None else None
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {})}
    start = time.perf_counter()
    try:
        with (folder / "train.log").open("w") as log:
            status = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        if slots is not None:
            slots.put(devices)
    if not keep_checkpoints:
        delete_checkpoints(folder / "run")
    return run, status, time.perf_counter() - start


def delete_checkpoints(run_dir: Path) -> None:
    """Delete the checkpoints (and the full ones' checksum sidecars) in a run folder this script made."""
    for entry in list(run_dir.iterdir()) if run_dir.is_dir() else []:
        if step_in_name(entry) is None:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
            sidecar_of(entry).unlink(missing_ok=True)


def read_run(folder: Path) -> dict:
    """The validation curve (tokens, loss), the median tokens/s per GPU and the peak memory of a finished run."""
    config = folder / "run" / "config.yaml"
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = _tokens_per_step(config)
    curve = [(row["step"] * tokens_per_step, row["val_loss"]) for row in rows if "val_loss" in row]
    speeds = [row["tokens_per_sec_per_gpu"] for row in rows if row.get("tokens_per_sec_per_gpu")]
    return {"curve": curve, "tokens_per_sec_per_gpu": statistics.median(speeds) if speeds else None,
            "peak_mem_gib": max((row.get("peak_mem_gib") or 0.0 for row in rows), default=None)}


def finished(run_dir: Path) -> bool:
    """Whether a run folder's metrics.jsonl holds its config's last step (a run cut short holds fewer)."""
    import yaml

    try:
        last = int(yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(row.get("step") == last for row in rows)


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tokens_per_step(config: Path) -> int:
    import yaml

    cfg = yaml.safe_load(config.read_text())
    return int(cfg["train"]["global_batch_size"]) * int(cfg["data"]["seq_len"])


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The seeds' validation curves averaged point by point (they evaluate at the same steps)."""
    return [(points[0][0], statistics.fmean(loss for _, loss in points)) for points in zip(*curves, strict=True)]


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The tokens at which the curve first reaches `target`, linear between evaluations; None if it never does."""
    previous = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return tokens
            t0, l0 = previous
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def summarize(results: dict[Run, dict], optimizers: list[str]) -> dict:
    """Per optimizer: each learning rate's seed-averaged final validation loss, the best learning rate, and the
    tokens its averaged curve needs to reach the first optimizer's best final loss."""
    by_optimizer: dict[str, dict] = {}
    for optimizer in optimizers:
        curves: dict[float, list] = {}
        for run, result in results.items():
            if run.optimizer == optimizer:
                curves.setdefault(run.lr, []).append(result["curve"])
        averaged = {lr: mean_curve(runs) for lr, runs in curves.items()}
        best_lr = min(averaged, key=lambda lr: averaged[lr][-1][1])
        by_optimizer[optimizer] = {"final_by_lr": {lr: curve[-1][1] for lr, curve in averaged.items()},
                                   "best_lr": best_lr, "curve": averaged[best_lr]}
    target = by_optimizer[optimizers[0]]["curve"][-1][1]
    base_tokens = tokens_to_reach(by_optimizer[optimizers[0]]["curve"], target)
    for entry in by_optimizer.values():
        entry["tokens_to_target"] = tokens_to_reach(entry["curve"], target)
        entry["ratio"] = entry["tokens_to_target"] / base_tokens if entry["tokens_to_target"] and base_tokens else None
    return {"target_val_loss": target, "optimizers": by_optimizer}


def report(results: dict[Run, dict], summary: dict) -> list[str]:
    lines = ["| optimizer | lr | seed | final val loss | tokens/s/GPU | peak GiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for run, r in sorted(results.items(), key=lambda item: (item[0].optimizer, item[0].lr, item[0].seed)):
        speed = f"{r['tokens_per_sec_per_gpu']:,.0f}" if r["tokens_per_sec_per_gpu"] else "n/a"
        lines.append(f"| {run.optimizer} | {run.lr:g} | {run.seed} | {r['curve'][-1][1]:.4f} | {speed} | "
                     f"{r['peak_mem_gib']:.1f} |")
    lines.append(f"target: {summary['target_val_loss']:.4f} (the first optimizer's best final validation loss)")
    for name, entry in summary["optimizers"].items():
        reached = entry["tokens_to_target"]
        lines.append(f"{name}: best lr {entry['best_lr']:g}, final {entry['curve'][-1][1]:.4f}, target reached at "
                     + (f"{reached / 1e6:.2f}M tokens ({entry['ratio']:.2f}x)" if reached else "never"))
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in summary["optimizers"].items():
        tokens, losses = zip(*entry["curve"], strict=True)
        ax.plot([t / 1e6 for t in tokens], losses, marker=".", label=f"{name}, lr {entry['best_lr']:g}")
    ax.axhline(summary["target_val_loss"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("validation loss (mean of the seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    runs = [Run(o, lr, s) for o in args.optimizer_list for lr in args.lr_list for s in args.seed_list]
    if args.summarize_only:
        return summarize_runs(runs, args.optimizer_list, out)
    failed = []
    slots: queue.Queue = queue.Queue()
    for devices in gpu_slots(args.concurrent, args.nproc_per_node, _num_gpus()):
        slots.put(devices)
    with ThreadPoolExecutor(max_workers=args.concurrent) as pool:
        for run, status, seconds in pool.map(
                lambda r: train(r, args.config, overrides, out, keep_checkpoints=args.keep_checkpoints,
                                nproc=args.nproc_per_node, slots=slots), runs):
            print(f"{run.name}: exit {status} in {seconds:.0f} s", flush=True)
            if status != 0:
                failed.append(run.name)
    if failed:
        print(f"error: {len(failed)} runs failed ({', '.join(failed)}): see their train.log in {out}", file=sys.stderr)
        return 1
    return summarize_runs(runs, args.optimizer_list, out)


def summarize_runs(runs: list[Run], optimizers: list[str], out: Path) -> int:
    """Read the finished runs in `out`, print their table and summary, write summary.json and val_loss.png."""
    missing = [run.name for run in runs if not finished(out / run.name / "run")]
    if missing:
        print(f"error: no finished run in {out} for {', '.join(missing)} (metrics.jsonl reaching train.max_steps)",
              file=sys.stderr)
        return 1
    results = {run: read_run(out / run.name) for run in runs}
    summary = summarize(results, optimizers)
    lines = report(results, summary)
    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(
        {"runs": {run.name: result for run, result in results.items()}, **summary}, indent=1))
    try:
        plot(summary, out / "val_loss.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
