r"""Compare the loss curves of two or more runs: a PNG of train and validation loss against the step, a markdown
table of the validation loss at each evaluation with each run's difference from the first, and optionally a PNG of
the throughput (tokens/s per GPU).

    python scripts/plot_loss.py checkpoints/llama90M-bf16 checkpoints/llama90M-fp8 --labels bf16,fp8-tensorwise \
        --title "90M preset" --out docs/loss_90m.png --throughput docs/throughput_90m.png

Each input is a run's output directory or a metrics.jsonl file; a step logged twice (a resumed run) keeps its last
row. Needs matplotlib (pip install matplotlib)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median

Curve = dict[int, float]


def read_metrics(path: Path, key: str = "") -> tuple[Curve, Curve]:
    """(step -> train loss, step -> validation loss) of one run directory or metrics.jsonl file; with `key`,
    (step -> that column of the training rows, {}). ValueError naming the file and line of a row that is not
    a metrics row, and a file that is not a regular one (a FIFO would block the read)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    train: Curve = {}
    val: Curve = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = parse_row(line, (key,) if key else ("loss", "val_loss"))
        except ValueError as err:
            raise ValueError(f"{path}, line {number}: {err}") from None
        if key:
            if row.get(key) is not None:
                train[row["step"]] = row[key]
            continue
        if row.get("loss") is not None:
            train[row["step"]] = row["loss"]
        if row.get("val_loss") is not None:
            val[row["step"]] = row["val_loss"]
    return train, val


def parse_row(line: str, columns: tuple[str, ...]) -> dict:
    """One metrics.jsonl row: a JSON object with an integer step, whose `columns`, where present, are numbers
    (or null); ValueError saying what is wrong otherwise."""
    try:
        row = json.loads(line)
    except RecursionError:
        raise ValueError("not a metrics row (JSON nested too deeply)") from None
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError("not a metrics row (a JSON object with an integer step)")
    for column in columns:
        value = row.get(column)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{column} is not a number")
    return row


def val_table(labels: list[str], vals: list[Curve]) -> tuple[str, dict[str, tuple[float, int] | None]]:
    """Markdown table of validation loss per evaluation step (each run's difference from the first run in
    percent), and per later run its largest absolute relative difference and the step of it (None when
    the run shares no evaluation step with the first)."""
    steps = sorted(set().union(*vals))
    head = ["step", *labels, *(f"{label} vs {labels[0]}" for label in labels[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    worst: dict[str, tuple[float, int] | None] = dict.fromkeys(labels[1:])
    for step in steps:
        cells = [str(step)] + [f"{v[step]:.4f}" if step in v else "-" for v in vals]
        base = vals[0].get(step)
        for label, v in zip(labels[1:], vals[1:], strict=True):
            if base is None or step not in v:
                cells.append("-")
                continue
            diff = (v[step] - base) / base
            cells.append(f"{100 * diff:+.2f}%")
            found = worst[label]
            if found is None or abs(diff) > abs(found[0]):
                worst[label] = (diff, step)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), worst


# ---- drawing ----------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _panel(ax, title: str, curves: list[Curve], labels: list[str], *, markers: bool, first_colour: int = 0,
           ylabel: str = "") -> None:
    for i, (curve, label) in enumerate(zip(curves, labels, strict=True)):
        points = sorted((s, v) for s, v in curve.items() if math.isfinite(v))
        if points:
            steps, values = zip(*points, strict=True)
            # A curve of one point draws no line: its marker is what shows it.
            ax.plot(steps, values, marker="o" if markers or len(points) == 1 else None, markersize=4, label=label,
                    color=f"C{first_colour + i}")
    if not any(curves):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(curves):
        ax.legend()


def plot(labels: list[str], runs: list[tuple[Curve, Curve]], title: str, out: Path) -> None:
    """Three charts side by side: train loss, validation loss, and each later run's validation loss
    relative to the first run's, in percent."""
    plt = _pyplot()
    vals = [val for _, val in runs]
    diffs = [{s: 100 * (v[s] / vals[0][s] - 1) for s in v if s in vals[0]} for v in vals[1:]]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5), dpi=100)
    _panel(axes[0], "train loss", [train for train, _ in runs], labels, markers=False, ylabel="loss")
    _panel(axes[1], "validation loss", vals, labels, markers=True, ylabel="loss")
    _panel(axes[2], f"validation loss vs {labels[0]}", diffs, labels[1:], markers=True, first_colour=1,
           ylabel="difference (%)")
    axes[2].axhline(0, color="C0", linewidth=0.8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_throughput(labels: list[str], curves: list[Curve], title: str, out: Path) -> None:
    """Tokens/s per GPU against the step, one line per run (the first logged row, which carries start-up
    and compilation, is left out), with each run's median in the legend."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    steady = [dict(sorted(curve.items())[1:]) for curve in curves]
    named = [f"{label} (median {median(curve.values()):,.0f})" if curve else label
             for curve, label in zip(steady, labels, strict=True)]
    _panel(ax, title or "throughput", steady, named, markers=False, ylabel="tokens/s per GPU")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run output directories or metrics.jsonl files; the first is the baseline")
    parser.add_argument("--labels", default="",
                        help="comma-separated names for the runs (default: the directory names)")
    parser.add_argument("--title", default="", help="title above the charts")
    parser.add_argument("--out", type=Path, default=None,
                        help="the loss PNG to write (default: loss.png beside the first run's metrics.jsonl)")
    parser.add_argument("--throughput", type=Path, default=None,
                        help="also write this PNG of tokens/s per GPU against the step")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [(p if p.is_dir() else p.parent).name for p in args.runs]
    if len(labels) != len(args.runs):
        print(f"error: {len(labels)} labels for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = [read_metrics(path) for path in args.runs]
        speeds = [read_metrics(path, "tokens_per_sec_per_gpu")[0] for path in args.runs] if args.throughput else []
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.out is None:
        args.out = (args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent) / "loss.png"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(labels, runs, args.title, args.out)
    table, worst = val_table(labels, [val for _, val in runs])
    print(table)
    for label, found in worst.items():
        if found is None:
            print(f"\n{label} and {labels[0]} share no evaluation step: no validation-loss difference to report")
        else:
            diff, step = found
            print(f"\nlargest validation-loss difference of {label} from {labels[0]}: {100 * diff:+.2f}% "
                  f"(step {step})")
    print(f"\nwrote {args.out}")
    if args.throughput:
        args.throughput.parent.mkdir(parents=True, exist_ok=True)
        plot_throughput(labels, speeds, f"{args.title}: throughput" if args.title else "", args.throughput)
        print(f"wrote {args.throughput}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
