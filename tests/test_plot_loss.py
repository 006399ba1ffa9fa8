"""scripts/plot_loss.py: the validation table's numbers, and PNGs of the charts (matplotlib) that hold the
curves given."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import plot_loss


def write_metrics(run_dir: Path, train: dict[int, float], val: dict[int, float], extra_rows: list[dict] = ()) -> Path:
    run_dir.mkdir(parents=True)
    rows = ([{"step": s, "loss": v, "lr": 1e-3, "tokens_per_sec_per_gpu": 1000.0 * s} for s, v in train.items()]
            + [{"step": s, "val_loss": v} for s, v in val.items()])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra_rows]))
    return run_dir


@pytest.mark.slow
def test_table_pngs_and_largest_difference(tmp_path, capsys, monkeypatch):
    steps = range(10, 101, 10)
    base = write_metrics(tmp_path / "bf16", {s: 5 - s / 50 for s in steps}, {50: 4.0, 100: 3.0})
    # The second run is 0.5% and 1% above at the two evaluations; it was resumed at step 50, so step 50
    # appears twice and its last row (4.02, not 9.0) counts.
    other = write_metrics(tmp_path / "fp8", {s: 5.02 - s / 50 for s in steps}, {50: 9.0, 100: 3.03},
                          extra_rows=[{"step": 50, "val_loss": 4.02}])
    drawn = []  # what each chart was given, by title
    real_panel = plot_loss._panel

    def spy(ax, title, curves, labels, **kwargs):
        drawn.append((title, [dict(c) for c in curves], list(labels)))
        real_panel(ax, title, curves, labels, **kwargs)

    monkeypatch.setattr(plot_loss, "_panel", spy)
    out, speed = tmp_path / "docs/loss.png", tmp_path / "docs/speed.png"
    assert plot_loss.main([str(base), str(other / "metrics.jsonl"), "--labels", "bf16,fp8", "--out", str(out),
                           "--throughput", str(speed)]) == 0
    printed = capsys.readouterr().out
    assert "| step | bf16 | fp8 | fp8 vs bf16 |" in printed
    assert "| 50 | 4.0000 | 4.0200 | +0.50% |" in printed and "| 100 | 3.0000 | 3.0300 | +1.00% |" in printed
    assert "largest validation-loss difference of fp8 from bf16: +1.00% (step 100)" in printed

    from matplotlib.image import imread

    assert imread(out).shape[:2] == (550, 1800) and imread(speed).shape[:2] == (500, 900)
    charts = {title: (curves, labels) for title, curves, labels in drawn}
    assert charts["train loss"][0][1] == pytest.approx({s: 5.02 - s / 50 for s in steps})
    assert charts["validation loss"][0][1] == {50: 4.02, 100: 3.03}
    assert charts["validation loss vs bf16"][0] == [pytest.approx({50: 0.5, 100: 1.0})]
    # Throughput without the first logged row (start-up), the median in the legend: steps 20..100 at 1000/step.
    speeds, labels = charts["throughput"]
    assert speeds[0] == {s: 1000.0 * s for s in steps if s > 10}
    assert labels == ["bf16 (median 60,000)", "fp8 (median 60,000)"]


def test_label_count_must_match(tmp_path, capsys):
    run = write_metrics(tmp_path / "a", {1: 1.0}, {})
    assert plot_loss.main([str(run), "--labels", "a,b", "--out", str(tmp_path / "x.png")]) == 2
    assert "error: 2 labels for 1 runs" in capsys.readouterr().err


def test_runs_without_a_shared_evaluation_step_say_so(tmp_path, capsys):
    """Evaluations at steps 50, 100 and at 60, 120: nothing to compare, and the output says that instead of
    a difference figure."""
    base = write_metrics(tmp_path / "a", {10: 5.0}, {50: 4.0, 100: 3.0})
    other = write_metrics(tmp_path / "b", {10: 5.0}, {60: 4.1, 120: 3.1})
    assert plot_loss.main([str(base), str(other), "--out", str(tmp_path / "loss.png")]) == 0
    printed = capsys.readouterr().out
    assert "b and a share no evaluation step" in printed
    assert "largest validation-loss difference" not in printed


@pytest.mark.parametrize("given", ["folder", "file"])
def test_the_chart_goes_beside_the_first_runs_metrics_by_default(given, tmp_path, capsys, monkeypatch):
    """Without --out, loss.png is written into the folder of the first run's metrics.jsonl (given as the run's
    folder or as the file), not into the current folder."""
    base = write_metrics(tmp_path / "a", {10: 5.0}, {50: 4.0})
    other = write_metrics(tmp_path / "b", {10: 5.1}, {50: 4.1})
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    first = base if given == "folder" else base / "metrics.jsonl"
    assert plot_loss.main([str(first), str(other)]) == 0
    assert (base / "loss.png").stat().st_size > 0
    assert list(here.iterdir()) == [] and not (other / "loss.png").exists()
    assert capsys.readouterr().out.endswith(f"wrote {base / 'loss.png'}\n")


def test_equal_runs_report_the_step_of_their_zero_difference(tmp_path, capsys):
    """Two runs with the same validation losses at step 50: the largest difference is 0 at step 50."""
    _, worst = plot_loss.val_table(["a", "b"], [{50: 4.0}, {50: 4.0}])
    assert worst == {"b": (0.0, 50)}


def test_help_shows_the_example_as_one_shell_command(capsys):
    """The example's line continuation reaches --help: each continued line ends with a backslash and the
    command's next part starts the following line."""
    with pytest.raises(SystemExit):
        plot_loss.main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("python scripts/plot_loss.py"))
    assert lines[start].endswith(" \\"), lines[start]
    assert lines[start + 1].lstrip().startswith("--title"), lines[start + 1]


@pytest.mark.parametrize(("line", "problem"), [
    ("[1,2]", "not a metrics row (a JSON object with an integer step)"),
    ("1", "not a metrics row (a JSON object with an integer step)"),
    ('{"step": "3", "loss": 1.0}', "not a metrics row (a JSON object with an integer step)"),
    ('{"step": 3, "loss": "low"}', "loss is not a number"),
    ('{"step": 3, "val_loss": [1]}', "val_loss is not a number"),
    ('{"step": 3, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}", "not a metrics row (JSON nested too deeply)"),
    ('{"step": 3, "loss": 1.0', "not JSON ("),  # a row cut short
], ids=["a list", "a number", "a text step", "a text loss", "a list val_loss", "nested too deeply", "cut short"])
def test_a_bad_row_is_one_error_line_naming_file_and_line(tmp_path, capsys, line, problem):
    run = write_metrics(tmp_path / "run", {1: 2.0}, {})
    with (run / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    assert plot_loss.main([str(run), "--out", str(tmp_path / "loss.png")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {run / 'metrics.jsonl'}, line 2: {problem}"), err
    assert not (tmp_path / "loss.png").exists()


def test_a_fifo_is_refused_without_reading_it(tmp_path, capsys):
    import os

    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    assert plot_loss.main([str(fifo), "--out", str(tmp_path / "loss.png")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {fifo}: not a regular file"]


@pytest.mark.parametrize("points", [1, 2])
def test_a_curve_of_one_point_is_drawn_as_a_marker(points):
    """A run that logged one step: its point is visible in the train-loss chart (a line of one point draws
    nothing); a longer curve stays a plain line there. Checked on the drawn pixels at the point."""
    import numpy as np

    plt = plot_loss._pyplot()
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    curve = {10: 2.0} if points == 1 else {10: 2.0, 20: 1.0}
    plot_loss._panel(ax, "train loss", [curve], ["run"], markers=False)
    fig.canvas.draw()
    (line,) = ax.lines
    assert line.get_marker() == ("o" if points == 1 else "None")
    if points == 1:
        pixels = np.asarray(fig.canvas.buffer_rgba())
        x, y = ax.transData.transform((10, 2.0))
        r, g, b, _ = pixels[int(round(pixels.shape[0] - y)), int(round(x))]
        assert (r, g, b) == (0x1F, 0x77, 0xB4), (r, g, b)  # C0, matplotlib's first colour, at the point
    plt.close(fig)
