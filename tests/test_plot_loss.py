"""scripts/plot_loss.py: the validation table's numbers and a PNG that decodes to the charts drawn."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

from scripts import plot_loss


def write_metrics(run_dir: Path, train: dict[int, float], val: dict[int, float], extra_rows: list[dict] = ()) -> Path:
    run_dir.mkdir(parents=True)
    rows = ([{"step": s, "loss": v, "lr": 1e-3} for s, v in train.items()]
            + [{"step": s, "val_loss": v} for s, v in val.items()])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra_rows]))
    return run_dir


def decode_png(data: bytes) -> np.ndarray:
    """(H, W, 3) pixels of an 8-bit RGB PNG whose rows use filter 0 (what plot_loss writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert not raw[:, 0].any()
    return raw[:, 1:].reshape(height, width, 3)


def test_table_png_and_largest_difference(tmp_path, capsys):
    steps = range(10, 101, 10)
    base = write_metrics(tmp_path / "bf16", {s: 5 - s / 50 for s in steps}, {50: 4.0, 100: 3.0})
    # The second run is 0.5% and 1% above at the two evaluations; it was resumed at step 50, so step 50
    # appears twice and its last row (4.02, not 9.0) counts.
    other = write_metrics(tmp_path / "fp8", {s: 5.02 - s / 50 for s in steps}, {50: 9.0, 100: 3.03},
                          extra_rows=[{"step": 50, "val_loss": 4.02}])
    out = tmp_path / "docs/loss.png"
    assert plot_loss.main([str(base), str(other / "metrics.jsonl"), "--labels", "bf16,fp8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| step | bf16 | fp8 | fp8 vs bf16 |" in printed
    assert "| 50 | 4.0000 | 4.0200 | +0.50% |" in printed and "| 100 | 3.0000 | 3.0300 | +1.00% |" in printed
    assert "largest validation-loss difference of fp8 from bf16: +1.00% (step 100)" in printed

    pixels = decode_png(out.read_bytes())
    assert pixels.shape == (580, 1800, 3)

    def count(colour, x0, x1):
        return int((pixels[:, x0:x1] == colour).all(axis=-1).sum())

    blue, orange = plot_loss.COLOURS[:2]
    # Both runs are drawn in the train and validation charts (lines, markers, legend swatches); the
    # difference chart on the right has the second run only.
    for x0, x1 in ((0, 600), (600, 1200)):
        assert count(blue, x0, x1) > 500 and count(orange, x0, x1) > 500
    assert count(orange, 1200, 1800) > 200 and count(blue, 1200, 1800) == 0


def test_nice_ticks_cover_the_range_in_round_steps():
    assert plot_loss.nice_ticks(0.013, 0.97) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert plot_loss.nice_ticks(10, 1000) == [0, 200, 400, 600, 800, 1000]
    ticks = plot_loss.nice_ticks(2.71, 2.71)  # a flat curve still gets an axis
    assert ticks[0] <= 2.71 <= ticks[-1] and len(ticks) >= 2


def test_label_count_must_match(tmp_path, capsys):
    run = write_metrics(tmp_path / "a", {1: 1.0}, {})
    assert plot_loss.main([str(run), "--labels", "a,b", "--out", str(tmp_path / "x.png")]) == 2
    assert "error: 2 labels for 1 runs" in capsys.readouterr().err
