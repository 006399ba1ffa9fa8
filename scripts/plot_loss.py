"""Compare the loss curves of two or more runs: a PNG of train and validation loss against the step, and
a markdown table of the validation loss at each evaluation with each run's difference from the first.

    python scripts/plot_loss.py checkpoints/llama90M-bf16 checkpoints/llama90M-fp8 --labels bf16,fp8-tensorwise \
        --title "90M preset" --out docs/loss_90m.png

Each input is a run's output directory (its metrics.jsonl is read) or a metrics.jsonl file; a step
logged twice (a resumed run) keeps its last row. The PNG is drawn with numpy and written with zlib, so
no plotting package is needed; text is drawn in a built-in 5 x 7 pixel font, lower case.
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from itertools import pairwise
from pathlib import Path

import numpy as np

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (225, 225, 225)
SCALE = 2  # font pixels per glyph pixel

# 5 x 7 glyphs: seven rows of five pixels, top to bottom (1: set). Unknown characters draw as spaces.
_GLYPHS = {
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    "a": "00000 00000 01110 00001 01111 10001 01111",
    "b": "10000 10000 10110 11001 10001 10001 11110",
    "c": "00000 00000 01110 10000 10000 10001 01110",
    "d": "00001 00001 01101 10011 10001 10001 01111",
    "e": "00000 00000 01110 10001 11111 10000 01110",
    "f": "00110 01001 01000 11100 01000 01000 01000",
    "g": "00000 01111 10001 10001 01111 00001 01110",
    "h": "10000 10000 10110 11001 10001 10001 10001",
    "i": "00100 00000 01100 00100 00100 00100 01110",
    "j": "00010 00000 00110 00010 00010 10010 01100",
    "k": "10000 10000 10010 10100 11000 10100 10010",
    "l": "01100 00100 00100 00100 00100 00100 01110",
    "m": "00000 00000 11010 10101 10101 10001 10001",
    "n": "00000 00000 10110 11001 10001 10001 10001",
    "o": "00000 00000 01110 10001 10001 10001 01110",
    "p": "00000 00000 11110 10001 11110 10000 10000",
    "q": "00000 00000 01101 10011 01111 00001 00001",
    "r": "00000 00000 10110 11001 10000 10000 10000",
    "s": "00000 00000 01110 10000 01110 00001 11110",
    "t": "01000 01000 11100 01000 01000 01001 00110",
    "u": "00000 00000 10001 10001 10001 10011 01101",
    "v": "00000 00000 10001 10001 10001 01010 00100",
    "w": "00000 00000 10001 10001 10101 10101 01010",
    "x": "00000 00000 10001 01010 00100 01010 10001",
    "y": "00000 00000 10001 10001 01111 00001 01110",
    "z": "00000 00000 11111 00010 00100 01000 11111",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000",
    "%": "11000 11001 00010 00100 01000 10011 00011",
    "_": "00000 00000 00000 00000 00000 00000 11111",
    "/": "00000 00001 00010 00100 01000 10000 00000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
}
GLYPHS = {ch: np.array([[c == "1" for c in row] for row in rows.split()]) for ch, rows in _GLYPHS.items()}
BLANK = np.zeros((7, 5), dtype=bool)


def read_metrics(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> train loss, step -> validation loss) of one run directory or metrics.jsonl file."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    train, val = {}, {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "loss" in row:
                train[row["step"]] = row["loss"]
            if "val_loss" in row:
                val[row["step"]] = row["val_loss"]
    return train, val


def val_table(labels: list[str], vals: list[dict[int, float]]) -> tuple[str, dict[str, tuple[float, int]]]:
    """Markdown table of validation loss per evaluation step (each run's difference from the first run in
    percent), and per later run its largest absolute relative difference and the step of it."""
    steps = sorted(set().union(*vals))
    head = ["step", *labels, *(f"{label} vs {labels[0]}" for label in labels[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    worst = {label: (0.0, 0) for label in labels[1:]}
    for step in steps:
        cells = [str(step)] + [f"{v[step]:.4f}" if step in v else "-" for v in vals]
        base = vals[0].get(step)
        for label, v in zip(labels[1:], vals[1:], strict=True):
            if base is None or step not in v:
                cells.append("-")
                continue
            diff = (v[step] - base) / base
            cells.append(f"{100 * diff:+.2f}%")
            if abs(diff) > abs(worst[label][0]):
                worst[label] = (diff, step)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), worst


# ---- drawing ----------------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    return [round(first + i * step, 12) for i in range(int(math.ceil((hi - first) / step)) + 1)]


def tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


class Canvas:
    def __init__(self, width: int, height: int):
        self.pixels = np.full((height, width, 3), WHITE, dtype=np.uint8)

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour) -> None:
        h, w, _ = self.pixels.shape
        self.pixels[max(0, y0):min(h, y1), max(0, x0):min(w, x1)] = colour

    def line(self, x0: float, y0: float, x1: float, y1: float, colour, width: int = 2) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs, ys = np.linspace(x0, x1, n).round().astype(int), np.linspace(y0, y1, n).round().astype(int)
        h, w, _ = self.pixels.shape
        for dx in range(width):
            for dy in range(width):
                keep = (xs + dx < w) & (ys + dy < h) & (xs + dx >= 0) & (ys + dy >= 0)
                self.pixels[ys[keep] + dy, xs[keep] + dx] = colour

    def text(self, x: int, y: int, text: str, colour=BLACK, anchor: str = "left") -> None:
        """Draw `text` with its top at y; anchor left, right or centre at x."""
        width = len(text) * 6 * SCALE
        x = x - width if anchor == "right" else x - width // 2 if anchor == "centre" else x
        for i, ch in enumerate(text.lower()):
            glyph = GLYPHS.get(ch, BLANK)
            for gy, gx in zip(*np.nonzero(glyph), strict=True):
                left, top = x + (6 * i + gx) * SCALE, y + gy * SCALE
                self.rect(left, top, left + SCALE, top + SCALE, colour)

    def png(self) -> bytes:
        h, w, _ = self.pixels.shape
        raw = b"".join(b"\x00" + self.pixels[row].tobytes() for row in range(h))  # filter 0 per row

        def chunk(kind: bytes, data: bytes) -> bytes:
            crc = zlib.crc32(kind + data) & 0xFFFFFFFF
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

        header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def draw_panel(canvas: Canvas, box: tuple[int, int, int, int], title: str, series: list[dict[int, float]],
               labels: list[str], *, markers: bool, first_colour: int = 0) -> None:
    """One chart in box (x0, y0, x1, y1): axes with ticks, a line per series, a legend."""
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 90, x1 - 40, y0 + 40, y1 - 50
    canvas.text((left + right) // 2, y0 + 8, title, anchor="centre")
    points = [(s, v) for curve in series for s, v in curve.items() if math.isfinite(v)]
    if not points:
        canvas.text((left + right) // 2, (top + bottom) // 2, "no data", anchor="centre")
        return
    steps, values = zip(*points, strict=True)
    xt, yt = nice_ticks(min(steps), max(steps)), nice_ticks(min(values), max(values))
    to_x = lambda s: left + (s - xt[0]) / (xt[-1] - xt[0]) * (right - left)  # noqa: E731
    to_y = lambda v: bottom - (v - yt[0]) / (yt[-1] - yt[0]) * (bottom - top)  # noqa: E731
    for v in yt:
        canvas.line(left, to_y(v), right, to_y(v), GREY, width=1)
        canvas.text(left - 8, int(to_y(v)) - 7, tick_label(v, yt[1] - yt[0]), anchor="right")
    for s in xt:
        canvas.line(to_x(s), bottom, to_x(s), bottom + 6, BLACK, width=1)
        canvas.text(int(to_x(s)), bottom + 12, tick_label(s, xt[1] - xt[0]), anchor="centre")
    canvas.line(left, top, left, bottom, BLACK, width=1)
    canvas.line(left, bottom, right, bottom, BLACK, width=1)
    canvas.text((left + right) // 2, bottom + 32, "step", anchor="centre")
    for i, curve in enumerate(series):
        colour = COLOURS[(first_colour + i) % len(COLOURS)]
        xy = [(to_x(s), to_y(v)) for s, v in sorted(curve.items()) if math.isfinite(v)]
        for (xa, ya), (xb, yb) in pairwise(xy):
            canvas.line(xa, ya, xb, yb, colour)
        if markers:
            for x, y in xy:
                canvas.rect(int(x) - 3, int(y) - 3, int(x) + 4, int(y) + 4, colour)
        canvas.rect(right - 200, top + 10 + 22 * i, right - 176, top + 16 + 22 * i, colour)
        canvas.text(right - 168, top + 6 + 22 * i, labels[i])


def plot(labels: list[str], runs: list[tuple[dict[int, float], dict[int, float]]], title: str) -> bytes:
    """Three charts side by side: train loss, validation loss, and each later run's validation loss
    relative to the first run's, in percent."""
    canvas = Canvas(1800, 580)
    if title:
        canvas.text(900, 8, title, anchor="centre")
    vals = [val for _, val in runs]
    diffs = [{s: 100 * (v[s] / vals[0][s] - 1) for s in v if s in vals[0]} for v in vals[1:]]
    draw_panel(canvas, (0, 30, 600, 580), "train loss", [train for train, _ in runs], labels, markers=False)
    draw_panel(canvas, (600, 30, 1200, 580), "validation loss", vals, labels, markers=True)
    draw_panel(canvas, (1200, 30, 1800, 580), f"validation loss vs {labels[0]} (%)", diffs, labels[1:], markers=True,
               first_colour=1)
    return canvas.png()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run output directories or metrics.jsonl files; the first is the baseline")
    parser.add_argument("--labels", default="",
                        help="comma-separated names for the runs (default: the directory names)")
    parser.add_argument("--title", default="", help="title above the two charts")
    parser.add_argument("--out", type=Path, default=Path("loss.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [(p if p.is_dir() else p.parent).name for p in args.runs]
    if len(labels) != len(args.runs):
        print(f"error: {len(labels)} labels for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = [read_metrics(path) for path in args.runs]
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(plot(labels, runs, args.title))
    table, worst = val_table(labels, [val for _, val in runs])
    print(table)
    for label, (diff, step) in worst.items():
        print(f"\nlargest validation-loss difference of {label} from {labels[0]}: {100 * diff:+.2f}% (step {step})")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
