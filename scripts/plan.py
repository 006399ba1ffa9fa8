r"""Will a config fit on N GPUs, and how fast will it train? Estimates every candidate plan (activation checkpointing
policy x micro-batch x sharding strategy) from the config alone, without a GPU and without building the model:
peak memory per GPU with its breakdown, tokens/s per GPU, which plans fit and which is fastest.

    python scripts/plan.py config/train8B_fsdp.yaml --gpus 2 --gpu h200 --model.vocab_size=128256
    python scripts/plan.py config/train1B_fsdp.yaml --gpus 64 --gpu h100 --train.global_batch_size=1024 --all
    python scripts/plan.py config/train1B_fsdp.yaml --gpus 8,64,512 --gpu h100,h200 \
        --train.global_batch_size=2048 --markdown     # the fastest plan of each, as docs/planning.md shows them
    python scripts/plan.py --calibration              # the constants, their records and the known misses

Takes the same config file and --section.key=value overrides as train_fsdp.py. --gpus counts all GPUs; --nodes
defaults to one node per 8 GPUs. The figures are predictions calibrated on our records (docs/planning.md).
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

GPUS_PER_NODE = 8


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error as one `error:` line."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> _Parser:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config, e.g. config/train1B_fsdp.yaml")
    parser.add_argument("--gpus", default="", help="GPUs in all (a comma-separated list with --markdown)")
    parser.add_argument("--gpu", default="h100", help="GPU kind: h100, h200, a100-80gb, a100-40gb, b200 (a "
                                                       "comma-separated list with --markdown); default h100")
    parser.add_argument("--nodes", type=int, default=0, help="nodes (default: one per 8 GPUs)")
    parser.add_argument("--all", action="store_true", help="every candidate, not each option's fastest micro-batch")
    parser.add_argument("--markdown", action="store_true", help="the fastest plan of each --gpus x --gpu as a "
                                                                "markdown table")
    parser.add_argument("--calibration", action="store_true",
                        help="the calibration constants with their records, and the known misses (markdown)")
    return parser


def _counts(text: str, *, many: bool) -> list[int]:
    """--gpus as a list of positive counts; ValueError naming the value."""
    parts = [p.strip() for p in text.split(",")]
    if not text or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--gpus: expected a positive number of GPUs, got {text!r}")
    if len(parts) > 1 and not many:
        raise ValueError(f"--gpus {text}: a list of GPU counts needs --markdown")
    return [int(p) for p in parts]


def _clusters(args: argparse.Namespace) -> list:
    """The clusters asked for, as Cluster objects; ValueError with one line for a bad --gpus, --gpu or --nodes."""
    from fsdp_utils.train.planning import Cluster, gpu_spec

    counts = _counts(args.gpus, many=args.markdown)
    kinds = [gpu_spec(k) for k in args.gpu.split(",")]
    if len(kinds) > 1 and not args.markdown:
        raise ValueError(f"--gpu {args.gpu}: a list of GPU kinds needs --markdown")
    if args.nodes < 0 or (args.nodes and len(counts) > 1):
        raise ValueError(f"--nodes {args.nodes}: a positive number of nodes, for one --gpus count")
    clusters = []
    for count in counts:
        nodes = args.nodes or -(-count // GPUS_PER_NODE)
        if count % nodes:
            raise ValueError(f"--nodes {nodes} does not divide --gpus {count}: every node runs as many GPUs")
        clusters += [Cluster(kind, count, nodes) for kind in kinds]
    return clusters


def _calibration() -> list[str]:
    from fsdp_utils.train.planning import CALIBRATION, KNOWN_MISSES, calibration_summary, load_points, predict

    predictions = [predict(p) for p in load_points()]
    lines = calibration_summary(predictions) + ["", "| constant | value | unit | record | how |",
                                                "| --- | ---: | --- | --- | --- |"]
    lines += [f"| `{name}` | {c.value:g} | {c.unit} | {c.record} | {c.how} |" for name, c in CALIBRATION.items()]
    lines += ["", "| known miss | record | measured | predicted | why |", "| --- | --- | --- | --- | --- |"]
    for p in predictions:
        if p.point.id in KNOWN_MISSES:
            measured, predicted = [], []
            if p.point.mem_gib is not None:
                measured.append(f"{p.point.mem_gib:.2f} GiB ({p.point.memory})")
                predicted.append(f"{p.predicted_gib:.2f} GiB")
            if p.point.tokens_per_s is not None:
                measured.append(f"{p.point.tokens_per_s:,.0f} tokens/s")
                predicted.append(f"{p.speed.tokens_per_s:,.0f} tokens/s")
            lines.append(f"| {p.point.id} | {p.point.record} | {', '.join(measured)} | {', '.join(predicted)} | "
                         f"{KNOWN_MISSES[p.point.id]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from config import ConfigError, load_config, split_known_args

    args, overrides = split_known_args(_parser(), sys.argv[1:] if argv is None else argv)
    if args.calibration:
        print("\n".join(_calibration()))
        return 0
    if not args.config:
        print("error: give a config file (e.g. config/train1B_fsdp.yaml), or --calibration", file=sys.stderr)
        return 2
    from fsdp_utils.train.planning import describe_cluster, markdown_table, plan_cluster, plan_table

    try:
        clusters = _clusters(args)
        plannings = [plan_cluster(load_config(args.config, overrides), cluster) for cluster in clusters]
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.markdown:
        print("\n".join(markdown_table(plannings)))
        return 0
    planning = plannings[0]
    shown = planning.estimates if args.all else planning.best_per_option()
    print("\n".join(describe_cluster(planning) + [""] + plan_table(planning, shown)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
