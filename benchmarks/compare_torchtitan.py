"""Our benchmark and the torchtitan peer, back to back on the same GPUs in one invocation, and their ratio.

    python benchmarks/compare_torchtitan.py config/train8B_fsdp.yaml --nproc 2 \
        --peer_script ../shared/peers/torchtitan_peer.py --model.vocab_size=128256 \
        --peer_ac selective_op --peer_mbs 8 --steps 5 --warmup 2 --json results.jsonl

Run it with python: it runs `torchrun benchmarks/benchmark.py CONFIG ...` and `torchrun PEER_SCRIPT ...` one after
the other (`--rounds N`: N times each), the peer given our config's model, compile, FP8 recipe, checkpointing policy
and micro-batch where it has them (peer_arguments), ours without document masking, which the peer lacks. One table
shows tokens/s and peak memory per GPU of each and their ratio; a run that fails is reported there."""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from config import Config, ConfigError, FSDPConfig, TrainConfig, check_batch_split, load_config
from fsdp_utils.observability.trackers import redacted_argument
from safe_io.nofollow import append_line, results_log_problem
from safe_io.urls import scrub

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "benchmarks" / "benchmark.py"
DEFAULT_LAUNCHER = "torchrun --standalone --nproc_per_node={nproc}"
# Set for both runs where the user left them unset: NVLink multicast (NVLS) off, as docs/benchmarks.md's commands
# run; the allocator's expandable segments, which benchmark.py turns on by itself and the peer would not.
# Both allocator names: torch reads the newer one, older releases the other.
ENVIRONMENT = {"NCCL_NVLS_ENABLE": ("0", ("NCCL_NVLS_ENABLE",)),
               "PYTORCH_ALLOC_CONF": ("expandable_segments:True", ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))}
# Our policies that torchtitan has under the same name; `selective` is its selective_<every n layers>.
SAME_AC = ("none", "full", "selective_op")
PEER_AC = re.compile(r"none|full|selective_op|selective_[1-9]\d*")
# The peer's result line, e.g. "TT torchtitan-0.2.2 params=8030M ... world2: 13544 tok/s/GPU, MFU 41.0% (...),
# peak mem 81.1 GiB"; each figure a decimal number (a line with "1.2.3 tok/s/GPU" is not a result).
NUMBER = r"\d+(?:\.\d+)?"
TT_LINE = re.compile(rf"^TT .*?: (?P<tps>{NUMBER}) tok/s/GPU, MFU (?P<mfu>{NUMBER})%.*peak mem (?P<mem>{NUMBER}) GiB")
# A line that states an error: a Python exception (under torchrun prefixed "[rankN]:") or an "error:" line.
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]*(?:Error|Exception)|error)\b.*)")
TAIL_LINES = 200
T = TypeVar("T")


def torchtitan_ffn_width(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's Llama FeedForward width: int(2 * 4 * dim / 3), times the multiplier (truncated), rounded up
    to a multiple of multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def ffn_arguments(dim: int, hidden: int, *, multiple_of: int = 256) -> tuple[float | None, int]:
    """(--ffn_dim_multiplier or None, --multiple_of) with which torchtitan builds our FFN width `hidden`: no
    multiplier where the rounding alone gives it, else the multiplier of fewest decimals. Rounding candidates:
    ours first, then the powers of two that divide `hidden`, largest first."""
    candidates = [m for m in (multiple_of, *(2**k for k in range(10, -1, -1))) if hidden > 0 and hidden % m == 0]
    multiples = list(dict.fromkeys(candidates))
    base = int(2 * 4 * dim / 3)
    multipliers: list[float | None] = [None, *(round(hidden / base, digits) for digits in range(1, 7))]
    multipliers.append((hidden + 0.5) / base)  # exact: int() of it times base is `hidden`
    for multiplier in multipliers:
        for rounding in multiples:
            if (multiplier is None or multiplier > 0) and torchtitan_ffn_width(dim, multiplier, rounding) == hidden:
                return multiplier, rounding
    raise ConfigError([f"model FFN width {hidden} (dim {dim}): no --ffn_dim_multiplier / --multiple_of gives it "
                       "in torchtitan's FeedForward"])


def peer_activation_checkpointing(f: FSDPConfig, override: str | None) -> str:
    """The peer's --ac: --peer_ac if given, else our fsdp.activation_checkpointing under torchtitan's name."""
    if override is not None:
        if not PEER_AC.fullmatch(override):
            raise ConfigError([f"--peer_ac {override}: expected none, full, selective_op or selective_N"])
        return override
    policy = f.activation_checkpointing
    if policy in SAME_AC:
        return policy
    if policy == "selective":
        return f"selective_{f.ac_every_n_layers}"
    raise ConfigError([f"fsdp.activation_checkpointing={policy} has no torchtitan equivalent: pass --peer_ac "
                       "(none, full, selective_op or selective_N)"])


def peer_float8(cfg: Config) -> list[str]:
    """The peer's FP8 flags for our train.float8: tensorwise with the FP8 all-gather of the weights and their
    precomputed scales, as ours does under FSDP2; rowwise without (torchtitan has no rowwise all-gather)."""
    recipe = cfg.train.float8
    if recipe == "none":
        return []
    flags = ["--float8", "--float8_recipe", recipe]
    if recipe == "tensorwise" and cfg.fsdp.version == 2:
        flags += ["--float8_fsdp_all_gather", "--float8_precompute_scale"]
    return flags


def peer_micro_batch(t: TrainConfig, override: int | None) -> int:
    """The peer's micro-batch: --peer_mbs if given, else our train.micro_batch_size (a number)."""
    if override is not None:
        if override < 1:
            raise ConfigError([f"--peer_mbs {override}: must be at least 1"])
        return override
    if t.micro_batch_size == "auto":
        raise ConfigError(["train.micro_batch_size=auto is searched by our run only: pass --peer_mbs (or a numeric "
                           "--train.micro_batch_size=N for both)"])
    return int(t.micro_batch_size)


def peer_accumulation(global_batch: int, mbs: int, nproc: int) -> int:
    """Micro-batches the peer accumulates per step to train ours' global batch (`--peer_global_batch ours`)."""
    if global_batch % (mbs * nproc):
        raise ConfigError([f"--peer_global_batch ours: train.global_batch_size={global_batch} is not a multiple of "
                           f"the peer's micro-batch {mbs} x {nproc} GPU(s)"])
    return global_batch // (mbs * nproc)


def unmatched_features(cfg: Config) -> list[str]:
    """What of ours the peer's model has not: comparing then would compare different models."""
    problems = []
    if cfg.model.type != "llama":
        problems.append(f"model.type={cfg.model.type}: the peer builds torchtitan's Llama only")
    if cfg.model.tie_embeddings:
        problems.append("model.tie_embeddings=true: torchtitan's Llama has no tied embeddings")
    if cfg.train.lora.rank:
        problems.append(f"train.lora.rank={cfg.train.lora.rank}: the peer trains every weight")
    return problems


def collect(derive: Callable[[], T], problems: list[str]) -> T | None:
    """derive(), or None with its ConfigError's problems added to `problems`."""
    try:
        return derive()
    except ConfigError as err:
        problems += err.problems
        return None


def peer_arguments(cfg: Config, *, peer_ac: str | None, peer_mbs: int | None, steps: int, warmup: int,
                   nproc: int = 1, same_global_batch: bool = False) -> list[str]:
    """The peer script's arguments that build and train our config's model; with `same_global_batch`, the
    peer accumulates micro-batches up to ours' global batch (else it steps after each). Raises ConfigError
    with every problem."""
    problems = unmatched_features(cfg)
    m = cfg.model
    ffn = collect(lambda: ffn_arguments(m.dim, m.hidden_dim, multiple_of=m.multiple_of), problems)
    mbs = collect(lambda: peer_micro_batch(cfg.train, peer_mbs), problems)
    ac = collect(lambda: peer_activation_checkpointing(cfg.fsdp, peer_ac), problems)
    accumulate = 1
    if same_global_batch and mbs is not None:
        accumulate = collect(lambda: peer_accumulation(cfg.train.global_batch_size, mbs, nproc), problems) or 1
    if ffn is None or mbs is None or ac is None or problems:
        raise ConfigError(problems)
    multiplier, multiple_of = ffn
    args = ["--dim", str(m.dim), "--layers", str(m.n_layers), "--heads", str(m.n_heads),
            "--kv_heads", str(m.num_kv_heads), "--vocab", str(m.vocab_size or cfg.data.vocab_size),
            "--rope_theta", repr(float(m.rope_theta)), "--norm_eps", repr(float(m.norm_eps)),
            "--seq", str(cfg.data.seq_len)]
    if multiplier is not None:
        args += ["--ffn_dim_multiplier", repr(multiplier)]
    args += ["--multiple_of", str(multiple_of), "--ffn", str(m.hidden_dim), "--mbs", str(mbs), "--ac", ac]
    if accumulate > 1:
        args += ["--grad_accum", str(accumulate)]
    if cfg.train.compile:
        args.append("--compile")
    return [*args, *peer_float8(cfg), "--steps", str(steps), "--warmup", str(warmup)]


def our_overrides(overrides: list[str]) -> tuple[list[str], bool]:
    """(our overrides, whether document masking was switched off here): the peer does not mask documents."""
    if any(o.startswith("--data.document_masking") for o in overrides):
        return overrides, False
    return [*overrides, "--data.document_masking=false"], True


def child_environment(environ: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(the environment of both runs, the variables set here) from ours, with ENVIRONMENT where unset."""
    env = dict(environ)
    added = []
    for name, (value, names) in ENVIRONMENT.items():
        if not any(n in env for n in names):
            env.update(dict.fromkeys(names, value))
            added.append(f"{name}={value}")
    return env, added


def parse_peer(lines: list[str]) -> dict | None:
    """The peer's tokens/s per GPU, MFU and peak memory from its last `TT ...` line; None without one."""
    for line in reversed(lines):
        if match := TT_LINE.match(line.strip()):
            return {"tokens_per_sec_per_gpu": float(match["tps"]), "mfu": float(match["mfu"]) / 100,
                    "peak_mem_gib": float(match["mem"])}
    return None


def is_figure(value: object) -> bool:
    """A measured figure: a finite number, not below zero."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def parse_ours(text: str) -> dict | None:
    """Our run's row from benchmark.py's --json record (its last line; the row named "ours"); None without one,
    or where its tokens/s, peak memory or MFU is not a figure."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        record = json.loads(lines[-1])
    except (ValueError, RecursionError):
        return None
    rows = record.get("rows") if isinstance(record, dict) else None
    rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    row = next((r for r in rows if r.get("name") == "ours"), rows[0] if rows else None)
    if row is None or not (is_figure(row.get("tokens_per_sec_per_gpu")) and is_figure(row.get("peak_mem_gib"))
                           and (row.get("mfu") is None or is_figure(row["mfu"]))):
        return None
    keys = ("tokens_per_sec_per_gpu", "mfu", "peak_mem_gib", "step_s", "micro_batch", "grad_accum")
    return {**{k: row.get(k) for k in keys}, "device": record.get("device")}


def failure(returncode: int, lines: list[str]) -> str:
    """Why a run gave no result, for its table cell: "out of memory", or the exit status and the line that says
    why (the last exception or error line, torchrun's own summary left out; else the last line)."""
    errors = [m[1] for line in lines if (m := ERROR_LINE.match(line.strip())) and "ChildFailedError" not in line]
    said = [line.strip() for line in lines if line.strip().strip("=-*")]
    last = errors[-1] if errors else (said[-1] if said else "(no output)")
    if returncode and re.search(r"out of memory|OutOfMemoryError", last, re.IGNORECASE):
        return "out of memory"
    what = "failed" if returncode else "no result"
    return f"{what}, exit {returncode}, last line: {scrub(last)[:200]}"


def run_child(command: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run one benchmark, its output shown as it comes; (exit status, its last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
    except OSError as err:
        return 127, [f"error: cannot start {command[0]}: {err}"]
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(scrub(line))
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))
    return proc.wait(), list(tail)


def run_side(side: str, command: list[str], env: dict[str, str], json_path: Path | None) -> dict:
    """One run of ours or the peer: its figures, or {"error": ...}; "exit" is its exit status."""
    print(f"\n=== {side}: {shown(command)}", flush=True)
    returncode, lines = run_child(command, env)
    if side == "ours":
        result = parse_ours(json_path.read_text()) if json_path is not None and json_path.exists() else None
    else:
        result = parse_peer(lines)
    if result is None:
        return {"error": failure(returncode, lines), "exit": returncode}
    return {**result, "exit": returncode}


def summarise(runs: list[dict]) -> dict:
    """Median tokens/s and MFU over the rounds that ran, the highest peak memory; the error where none ran."""
    done = [r for r in runs if "error" not in r]
    failed = [r["error"] for r in runs if "error" in r]
    if not done:
        return {"error": failed[-1], "rounds": runs}
    mfus = [r["mfu"] for r in done if r.get("mfu") is not None]
    summary = {"tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec_per_gpu"] for r in done),
               "mfu": statistics.median(mfus) if mfus else None,
               "peak_mem_gib": max(r["peak_mem_gib"] for r in done), "rounds": runs}
    if failed:
        summary["failed_rounds"] = failed
    return summary


def table(case: str, ours: dict, peer: dict) -> tuple[list[str], float | None, float | None]:
    """(a Markdown table of the comparison, tokens/s ratio ours / peer, memory ours - peer in GiB)."""
    ratio = memory = None
    if "error" not in ours and "error" not in peer:
        if peer["tokens_per_sec_per_gpu"] > 0:  # a peer that reports 0 tok/s has no ratio
            ratio = ours["tokens_per_sec_per_gpu"] / peer["tokens_per_sec_per_gpu"]
        memory = ours["peak_mem_gib"] - peer["peak_mem_gib"]

    def cells(side: dict) -> tuple[str, str]:
        if "error" in side:  # a Markdown cell: its text's own bars escaped
            return side["error"].replace("|", "\\|"), "-"
        return f"{side['tokens_per_sec_per_gpu']:,.0f}", f"{side['peak_mem_gib']:.1f}"

    (ours_tps, ours_mem), (peer_tps, peer_mem) = cells(ours), cells(peer)
    row = [case, ours_tps, peer_tps, "-" if ratio is None else f"{ratio:.3f}", ours_mem, peer_mem,
           "-" if memory is None else f"{memory:+.1f}"]
    header = ["case", "ours tok/s/GPU", "peer tok/s/GPU", "ours / peer", "ours peak GiB", "peer peak GiB",
              "ours - peer GiB"]
    lines = [f"| {' | '.join(header)} |", "| --- |" + " ---: |" * (len(header) - 1), f"| {' | '.join(row)} |"]
    return lines, ratio, memory


def describe_case(config: str, cfg: Config, peer_args: list[str], nproc: int) -> str:
    """One line naming what is compared: config, precision, checkpointing and micro-batch (x accumulated
    micro-batches) of both. ConfigError where our global batch does not split over `nproc` GPUs."""
    peer_ac, peer_mbs = (peer_args[peer_args.index(flag) + 1] for flag in ("--ac", "--mbs"))
    if "--grad_accum" in peer_args:
        peer_mbs += f" x {peer_args[peer_args.index('--grad_accum') + 1]}"
    ac, mbs = cfg.fsdp.activation_checkpointing, str(cfg.train.micro_batch_size)
    if (accumulate := check_batch_split(cfg.train, nproc)) is not None and accumulate > 1:
        mbs += f" x {accumulate}"
    precision = "bf16" if cfg.train.float8 == "none" else f"FP8 {cfg.train.float8}"
    ac_text = f"AC {ac}" + ("" if peer_ac == ac else f" (peer {peer_ac})")
    mbs_text = f"mbs {mbs}" + ("" if peer_mbs == mbs else f" (peer {peer_mbs})")
    return f"{Path(config).stem}, {precision}, {ac_text}, {mbs_text}, {nproc} GPUs"


def gpu_name(ours: dict) -> str | None:
    """The GPUs' name: from our run's record, else torch (asked after both runs, so no context of this
    process sits beside theirs), else nvidia-smi."""
    for run in ours.get("rounds", []):
        if run.get("device"):
            return run["device"]
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def git_commit() -> str | None:
    """The commit measured: HEAD, with "-modified" where tracked files differ from it (a record of a tree that
    was never committed must not name a commit as if it were)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        return head + ("-modified" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("config", help="our config file; --section.key=value overrides after it apply to ours")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes per run)")
    parser.add_argument("--peer_script", required=True, help="the torchtitan peer (torchtitan_peer.py)")
    parser.add_argument("--peer_ac", default=None,
                        help="the peer's --ac (none, full, selective_op, selective_N); default: ours where torchtitan "
                             "has it (needed for ours' selective_op_lean, selective_op_wide and auto)")
    parser.add_argument("--peer_mbs", type=int, default=None,
                        help="the peer's micro-batch; default: ours (needed where ours is auto)")
    parser.add_argument("--peer_global_batch", choices=["own", "ours"], default="own",
                        help="own: the peer steps after each micro-batch (its global batch is --peer_mbs x --nproc); "
                             "ours: it accumulates micro-batches up to our train.global_batch_size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two runs this many times")
    parser.add_argument("--order", choices=["ours_first", "peer_first"], default="ours_first")
    parser.add_argument("--json", default=None, help="append the comparison as one JSON line to this file")
    parser.add_argument("--launcher", default=DEFAULT_LAUNCHER,
                        help="the command that starts each run, the script and its arguments after it; {nproc} "
                             f"becomes --nproc (default: {DEFAULT_LAUNCHER!r}; e.g. a torchrun of another "
                             "environment, or a plain python for one process)")
    return parser


def argument_problems(args) -> list[str]:
    problems = []
    for name, low in (("nproc", 1), ("steps", 1), ("warmup", 0), ("rounds", 1)):
        if getattr(args, name) < low:
            problems.append(f"--{name} {getattr(args, name)}: must be at least {low}")
    for path, what in ((args.config, "config"), (args.peer_script, "--peer_script")):
        if not Path(path).is_file():
            problems.append(f"{what} {path}: no such file")
    launcher = shlex.split(args.launcher.replace("{nproc}", str(args.nproc)))
    if not launcher or shutil.which(launcher[0]) is None:
        problems.append(f"--launcher {args.launcher!r}: {launcher[0] if launcher else 'the command'} not found "
                        "(activate the environment that has torch)")
    if args.json and (problem := results_log_problem(args.json)):
        problems.append(problem)  # now, not after both runs
    return problems


def plan(args, overrides: list[str]) -> dict:
    """Everything both runs need, checked before either starts. Raises ConfigError."""
    problems = argument_problems(args)
    ours_overrides, unmasked = our_overrides(overrides)
    try:
        if not Path(args.config).is_file():
            raise ConfigError([])  # named by argument_problems
        cfg = load_config(args.config, ours_overrides)
        peer_args = peer_arguments(cfg, peer_ac=args.peer_ac, peer_mbs=args.peer_mbs, steps=args.steps,
                                   warmup=args.warmup, nproc=args.nproc,
                                   same_global_batch=args.peer_global_batch == "ours")
    except ConfigError as err:
        problems += err.problems
    if problems:
        raise ConfigError(problems)
    launcher = shlex.split(args.launcher.replace("{nproc}", str(args.nproc)))
    env, env_added = child_environment(dict(os.environ))
    return {"cfg": cfg, "overrides": ours_overrides, "unmasked": unmasked, "peer_args": peer_args,
            "launcher": launcher, "env": env, "env_added": env_added,
            "case": describe_case(args.config, cfg, peer_args, args.nproc),  # ConfigError: main's error line
            "peer_command": [*launcher, args.peer_script, *peer_args]}


def shown(command: list[str]) -> str:
    """A command as printed and recorded: every URL in its arguments without user, password or query string
    (the runs themselves are given them)."""
    return shlex.join(redacted_argument(arg) for arg in command)


def ours_command(args, p: dict, json_path: Path) -> list[str]:
    benchmark = os.path.relpath(BENCHMARK)
    return [*p["launcher"], benchmark, args.config, *p["overrides"], "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--json", str(json_path)]


def print_header(args, p: dict) -> None:
    print(f"compare_torchtitan: {p['case']}; {args.steps} timed steps after {args.warmup} warm-up steps, "
          f"{args.rounds} round(s), {args.order.replace('_', ' ')}", flush=True)
    if p["unmasked"]:
        print("ours: --data.document_masking=false added (the peer does not mask documents; "
              "give --data.document_masking=... to choose)", flush=True)
    if p["env_added"]:
        print(f"environment of both runs: {' '.join(p['env_added'])} (set here: they were unset)", flush=True)


def run_rounds(args, p: dict, tmp: Path) -> tuple[dict, dict, list[str]]:
    """Both runs, --rounds times in --order: (ours' summary, the peer's, ours' last command)."""
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    sides = ["ours", "peer"] if args.order == "ours_first" else ["peer", "ours"]
    command: list[str] = []
    for round_index in range(args.rounds):
        for side in sides:
            if side == "ours":
                json_path = tmp / f"ours_round{round_index}.jsonl"
                command = ours_command(args, p, json_path)
                results["ours"].append(run_side("ours", command, p["env"], json_path))
            else:
                results["peer"].append(run_side("peer", p["peer_command"], p["env"], None))
    return summarise(results["ours"]), summarise(results["peer"]), command


def report(args, p: dict, ours: dict, peer: dict, ours_cmd: list[str]) -> bool:
    """The table and the figures of both sides, and the --json record; False if that record could not be
    appended (it is printed instead, so it is not lost)."""
    lines, ratio, memory = table(p["case"], ours, peer)
    print("\n" + "\n".join(lines))
    print(f"tokens/s: median of {args.rounds} round(s) (ours: each run's median step; peer: its mean over the "
          f"timed steps); peak memory: the highest, allocated, the maximum over ranks")
    for side, summary in (("ours", ours), ("peer", peer)):
        done = [r for r in summary["rounds"] if "error" not in r]
        if done and done[-1].get("micro_batch") is not None:
            print(f"{side}: micro-batch {done[-1]['micro_batch']} x {done[-1]['grad_accum']} accumulated", flush=True)
        if summary.get("mfu") is not None:
            print(f"{side}: MFU {100 * summary['mfu']:.1f}%", flush=True)
        for code in {r["exit"] for r in done if r["exit"]}:
            print(f"{side}: exited {code} after printing its result", flush=True)
        for reason in summary.get("failed_rounds", []):
            print(f"{side}: a round failed: {reason}", flush=True)
    print("commands:")
    print(f"  ours: {shown(ours_cmd)}")
    print(f"  peer: {shown(p['peer_command'])}", flush=True)
    if not args.json:
        return True
    record = {"case": p["case"], "config": args.config, "overrides": [redacted_argument(o) for o in p["overrides"]],
              "peer_args": p["peer_args"], "commands": {"ours": shown(ours_cmd), "peer": shown(p["peer_command"])},
              "environment_set": p["env_added"], "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "order": args.order, "ours": ours, "peer": peer, "ratio": ratio,
              "memory_diff_gib": memory, "gpu": {"name": gpu_name(ours), "count": args.nproc},
              "git_commit": git_commit(),
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        append_line(args.json, json.dumps(record))
    except OSError as err:
        print(f"error: {err}; the record, to keep:\n{json.dumps(record)}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    try:
        p = plan(args, overrides)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {scrub(line)}", file=sys.stderr)
        return 2
    print_header(args, p)
    with tempfile.TemporaryDirectory(prefix="compare_torchtitan_") as tmp:
        ours, peer, ours_cmd = run_rounds(args, p, Path(tmp))
    recorded = report(args, p, ours, peer, ours_cmd)
    return 1 if ("error" in ours and "error" in peer) or not recorded else 0


if __name__ == "__main__":
    sys.exit(main())
