"""Draw a training run's profile trace and CUDA memory snapshot as PNGs (matplotlib), for docs and reviews.

    python scripts/render_profile.py trace RUN_DIR/profile/steps3-5/rank0.pt.trace.json --step 4 --out timeline.png
    python scripts/render_profile.py summary RUN_DIR/profile/steps3-5/rank0.pt.trace.json
    python scripts/render_profile.py snapshot RUN_DIR/memory/step5_rank0.pickle --out memory.png

trace: one profiled step's kernels on each CUDA stream, coloured by kind (a CPU run's ops per thread); summary: each
profiled step's GPU time computing, in exposed communication, idle; snapshot: live memory over time, stacked by what
allocated it. For digging: Perfetto (traces), pytorch.org/memory_viz (snapshots)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
import sys
from collections import defaultdict
from pathlib import Path

GIB = 2**30
# Kernel (or op) names -> kind, the first match wins: NCCL before matmuls (NCCL kernels are not GEMMs),
# attention before matmuls (flash kernels contain 'gemm'-like names in some builds).
COMMUNICATION = "communication (NCCL)"
KINDS = [
    (COMMUNICATION, re.compile(r"nccl|all_?gather|reduce_?scatter|all_?reduce|broadcast", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|sm\d\d_xmma|cublas|matmul|aten::mm|aten::addmm|aten::bmm|nvjet", re.I)),
    ("memory copy", re.compile(r"memcpy|memset|aten::copy_|aten::to\b", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
]
OTHER = "elementwise / other"
STEP_RANGE = re.compile(r"train_step#\d+")  # the range StepProfiler puts around each profiled step
COLOURS = {COMMUNICATION: "tab:red", "attention": "tab:purple", "matmul": "tab:blue",
           "memory copy": "tab:gray", "optimizer": "tab:green", OTHER: "tab:orange"}


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return OTHER


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_regular_file(path: Path) -> None:
    """OSError naming what `path` is when it is not a regular file: a FIFO would block the read, a device never
    end it."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise OSError(f"{kind}, not a file")


def is_complete_event(event: object) -> bool:
    """A complete ('X') event with what the drawing reads: a name, and a finite start and duration (us)."""
    return (isinstance(event, dict) and event.get("ph") == "X" and isinstance(event.get("name"), str)
            and is_number(event.get("ts")) and is_number(event.get("dur")))


def load_trace(path: Path) -> list[dict]:
    """The complete ('X') events of a chrome trace (torch.profiler's export_chrome_trace); other events, and
    entries that are not events at all, are left out. ValueError for a file that is not a chrome trace."""
    check_regular_file(path)
    try:
        trace = json.loads(path.read_bytes())
    except RecursionError:
        raise ValueError("not a chrome trace (JSON nested too deeply)") from None
    except ValueError as err:
        raise ValueError(f"not a chrome trace (not JSON: {err})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a chrome trace (expected an object with a traceEvents list)")
    return [e for e in events if is_complete_event(e)]


def listed(names: list[str], limit: int = 8) -> str:
    """Names for a message: the first few, each cut short, and how many more."""
    shown = ", ".join(name if len(name) <= 40 else name[:37] + "..." for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def step_window(events: list[dict], step: int | None) -> tuple[str, float, float]:
    """(name, start, end) in microseconds of a profiled step's range ('train_step#N'): the chosen step, or the second
    one when there are several (the first can carry the profiler's start-up).

    A GPU trace holds each range twice: on the CPU, where it lasts as long as launching the step's work, and on the GPU
    ('gpu_user_annotation'), spanning the kernels that work ran; the GPU one is the window. A CPU-only trace has the
    first kind only; there the window runs to the next step's start, or to the end of the trace."""
    def ranges(category: str) -> list[tuple[float, float, str]]:
        return sorted((e["ts"], e["dur"], e["name"]) for e in events
                      if STEP_RANGE.fullmatch(e["name"]) and e.get("cat") == category)

    on_gpu = ranges("gpu_user_annotation")
    steps = on_gpu or ranges("user_annotation")
    if not steps:
        raise ValueError("no train_step#N ranges in the trace: was it written by logging.profile_steps?")
    names = [name for _, _, name in steps]
    if step is None:
        index = 1 if len(steps) > 1 else 0
    elif f"train_step#{step}" in names:
        index = names.index(f"train_step#{step}")
    else:
        raise ValueError(f"step {step} is not in the trace (it holds {listed(names)})")
    start, duration, name = steps[index]
    if on_gpu:
        return name, start, start + duration
    end = steps[index + 1][0] if index + 1 < len(steps) else max(e["ts"] + e["dur"] for e in events)
    return name, start, end


def lanes_of(events: list[dict], start: float, end: float) -> tuple[str, dict[str, list[tuple[float, float, str]]]]:
    """('gpu' or 'cpu', lane -> [(start ms from the window's start, duration ms, kind)]): GPU kernels, copies
    and memsets per (device, stream) when the trace has any, else CPU ops per thread; those that start in
    the window, cut at its end (another thread's op can run on into the next step)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    chosen, what = (gpu, "gpu") if gpu else ([e for e in events if e.get("cat") == "cpu_op"], "cpu")
    lanes: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in chosen:
        if start <= e["ts"] < end:
            lane = f"GPU {e['pid']} stream {e['tid']}" if what == "gpu" else f"thread {e['tid']}"
            lanes[lane].append(((e["ts"] - start) / 1e3, min(e["dur"], end - e["ts"]) / 1e3, kind_of(e["name"])))
    return what, dict(sorted(lanes.items()))


def union_ms(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, duration) spans as disjoint, sorted (start, end) intervals."""
    merged: list[tuple[float, float]] = []
    for start, duration in sorted(spans):
        end = start + duration
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def own_ms(spans: list[tuple[float, float, str]]) -> list[float]:
    """Each span's own milliseconds: its duration less the spans nested in it. CPU ops nest (aten::linear
    holds aten::mm), so a thread's own times add up to its busy time where durations would count the inner
    ops twice; kernels on one stream never overlap, and keep their durations."""
    own = [duration for _, duration, _ in spans]
    ends = [start + duration for start, duration, _ in spans]
    open_spans: list[int] = []  # the spans enclosing the current one, innermost last
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1])):  # outer before inner
        start = spans[i][0]
        while open_spans and ends[open_spans[-1]] <= start:
            open_spans.pop()
        if open_spans:
            parent = open_spans[-1]
            own[parent] -= min(ends[i], ends[parent]) - start
        open_spans.append(i)
    return [max(ms, 0.0) for ms in own]  # float rounding can leave a nested op's parent a hair below zero


def lane_figures(spans: list[tuple[float, float, str]]) -> tuple[float, dict[str, float]]:
    """(busy ms, kind -> own ms) of one lane: busy is the union of its spans, so it never exceeds the window
    however the spans nest, and the kinds add up to it."""
    totals = dict.fromkeys(COLOURS, 0.0)
    for (_, _, kind), ms in zip(spans, own_ms(spans), strict=True):
        totals[kind] += ms
    busy = sum(end - start for start, end in union_ms([(s, d) for s, d, _ in spans]))
    return busy, totals


def overlap_summary(lanes: dict[str, list[tuple[float, float, str]]], window_ms: float) -> dict[str, float]:
    """Milliseconds of a GPU step window: 'computing' (any non-NCCL kernel running on any stream), 'exposed
    communication' (NCCL running while nothing else is: the time overlap failed to hide) and 'idle' (no
    kernel at all: the GPU waited for the host). The three add up to the window."""
    spans = [span for lane in lanes.values() for span in lane]
    compute = union_ms([(s, d) for s, d, kind in spans if kind != COMMUNICATION])
    busy = union_ms([(s, d) for s, d, _ in spans])
    computing = sum(end - start for start, end in compute)
    busy_ms = sum(end - start for start, end in busy)
    return {"computing": computing, "exposed communication": busy_ms - computing, "idle": window_ms - busy_ms}


def summarize_trace(path: Path) -> str:
    """A line per profiled GPU step: its length, the overlap summary, and each kind's kernel time."""
    events = load_trace(path)
    names = sorted({e["name"] for e in events if e.get("cat") == "gpu_user_annotation"
                    and STEP_RANGE.fullmatch(e["name"])}, key=lambda n: int(n.split("#")[1]))
    if not names:
        raise ValueError("no GPU train_step#N ranges: a GPU run's logging.profile_steps trace is needed")
    lines = []
    for name in names:
        _, start, end = step_window(events, int(name.split("#")[1]))
        _, lanes = lanes_of(events, start, end)
        window = (end - start) / 1e3
        parts = overlap_summary(lanes, window)
        kinds = {kind: sum(d for lane in lanes.values() for _, d, k in lane if k == kind) for kind in COLOURS}
        lines.append(f"{name}: {window:.1f} ms; " + ", ".join(f"{k} {v:.1f} ms ({v / window:.1%})"
                                                            for k, v in parts.items())
                     + "\n    kernel time by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items() if v))
    return "\n".join(lines)


def render_trace(path: Path, out: Path, step: int | None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load_trace(path)
    name, start, end = step_window(events, step)
    what, lanes = lanes_of(events, start, end)
    fig, ax = plt.subplots(figsize=(15, 1.6 + 0.5 * max(3, len(lanes))), dpi=120)
    table = ["| lane | busy ms | " + " | ".join(COLOURS) + " |", "|" + " --- |" * (len(COLOURS) + 2)]
    for y, (lane, spans) in enumerate(lanes.items()):
        # Longest first: CPU ops nest (aten::linear holds aten::mm), so the inner ones are drawn on top.
        ordered = sorted(spans, key=lambda span: -span[1])
        ax.broken_barh([(s, d) for s, d, _ in ordered], (y - 0.4, 0.8),
                       facecolors=[COLOURS[k] for _, _, k in ordered], linewidth=0)
        busy, totals = lane_figures(spans)
        table.append(f"| {lane} | {busy:.2f} | " + " | ".join(f"{v:.2f}" for v in totals.values()) + " |")
    table.append(f"\n{name}: {(end - start) / 1e3:.2f} ms")
    if what == "gpu":
        parts = overlap_summary(lanes, (end - start) / 1e3)
        table.append(", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel(f"ms from the start of {name}")
    unit = "kernels per CUDA stream" if what == "gpu" else "CPU ops per thread (no GPU kernels in this trace)"
    ax.set_title(f"{path.name}: {name}, {unit}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper left", bbox_to_anchor=(1.005, 1), frameon=False, fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return "\n".join(table)


# ---- memory snapshots ----------------------------------------------------------------------------------------

CATEGORIES = ("before recording", "parameters (init, load)", "FSDP gathered weights and gradient buffers",
              "optimizer state and step", "forward (activations)", "backward (gradients, temporaries)", "other")


def category_of(frames: list[dict]) -> str:
    """What allocated a block, from its Python stack (innermost frame first): the optimizer, FSDP's
    communication buffers, the backward pass, the forward pass, weight initialisation, or other."""
    files = [f.get("filename", "") for f in frames]
    names = [f.get("name", "") for f in frames]
    if any("torch/optim/" in f for f in files):
        return "optimizer state and step"
    if any("/fsdp/" in f or "_fully_shard" in f for f in files):
        return "FSDP gathered weights and gradient buffers"
    if any(n in ("backward", "_engine_run_backward") for n in names):
        return "backward (gradients, temporaries)"
    if any(n == "forward" for n in names):
        return "forward (activations)"
    if any(n in ("init_weights", "materialise", "load", "reset_parameters") for n in names):
        return "parameters (init, load)"
    return "other"


def memory_timeline(snapshot: dict, device: int = 0) -> tuple[list[float], dict[str, list[float]]]:
    """(times in s from the first event, category -> live bytes after each event) of one device's allocation history.
    Blocks still live from before the recording started (or whose allocation fell out of the history) are 'before
    recording': the live total at the end, from the snapshot's segments, minus what the history adds up to."""
    trace = device_trace(snapshot, device)
    live: dict[int, tuple[str, int]] = {}
    current = dict.fromkeys(CATEGORIES, 0)
    times: list[float] = []
    series: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            category = category_of(event.get("frames", []))
            live[event["addr"]] = (category, event["size"])
            current[category] += event["size"]
        elif action == "free_completed":
            category, size = live.pop(event["addr"], ("before recording", event["size"]))
            current[category] -= size
        else:
            continue
        times.append(event_time(event, trace, i))
        for c in CATEGORIES:
            series[c].append(current[c])
    end_live = sum(s["allocated_size"] for s in snapshot["segments"] if s.get("device", device) == device)
    before = end_live - sum(current.values())  # live at the end, not accounted for by the history
    series["before recording"] = [v + before for v in series["before recording"]]
    return times, series


def device_trace(snapshot: dict, device: int) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


def event_time(event: dict, trace: list[dict], index: int) -> float:
    """Seconds from the first recorded event (its index where the snapshot has no times)."""
    if "time_us" in event and "time_us" in trace[0]:
        return (event["time_us"] - trace[0]["time_us"]) / 1e6
    return float(index)


def load_snapshot(path: Path) -> dict:
    """A memory snapshot (torch.cuda.memory._dump_snapshot's pickle), unpickled as plain data only: dicts,
    lists, tuples, strings and numbers, which is all the format holds. A snapshot copied from elsewhere is
    as untrusted as any pickle: one that imports anything is refused (CheckpointUnsafe) before it runs."""
    from fsdp_utils.checkpoint.errors import CheckpointError, first_line
    from fsdp_utils.checkpoint.safe_read import RestrictedUnpickler

    check_regular_file(path)
    try:
        with path.open("rb") as f:
            snapshot = RestrictedUnpickler(f, path, allowed=(), holds="a CUDA memory snapshot").load()
    except (OSError, CheckpointError):
        raise
    except Exception as err:  # truncated, garbled, or not a pickle
        raise ValueError(f"not a CUDA memory snapshot ({first_line(err)})") from None
    if problem := snapshot_problem(snapshot):
        raise ValueError(f"not a CUDA memory snapshot ({problem})")
    return snapshot


def snapshot_problem(snapshot: object) -> str | None:
    """What makes unpickled data unusable as a memory snapshot, or None: the fields the drawing reads, of the
    types torch writes them in (a snapshot from elsewhere may hold anything)."""
    if not (isinstance(snapshot, dict) and isinstance(snapshot.get("segments"), list)
            and isinstance(snapshot.get("device_traces"), list)):
        return "expected a dict with segments and device_traces lists"
    if not all(isinstance(s, dict) and is_number(s.get("allocated_size")) for s in snapshot["segments"]):
        return "a segment is not a dict with a numeric allocated_size"
    for device, trace in enumerate(snapshot["device_traces"]):
        if not isinstance(trace, list):
            return f"device_traces[{device}] is not a list of events"
        for index, event in enumerate(trace):
            if problem := event_problem(event):
                return f"device_traces[{device}][{index}] {problem}"
    return None


def event_problem(event: object) -> str | None:
    """What makes one entry of an allocation history unusable, or None."""
    if not (isinstance(event, dict) and isinstance(event.get("action"), str)):
        return "is not an event (a dict with an action)"
    if "time_us" in event and not is_number(event["time_us"]):
        return "has a time_us that is not a number"
    if event["action"] not in ("alloc", "free_completed"):
        return None
    if not (isinstance(event.get("addr"), int) and is_number(event.get("size"))):
        return "has no integer addr and numeric size"
    frames = event.get("frames", [])
    if not (isinstance(frames, list) and all(isinstance(f, dict) and isinstance(f.get("filename", ""), str)
                                             and isinstance(f.get("name", ""), str) for f in frames)):
        return "has frames that are not a list of {filename, name}"
    return None


def render_snapshot(path: Path, out: Path, device: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    snapshot = load_snapshot(path)
    times, series = memory_timeline(snapshot, device)
    shown = [c for c in CATEGORIES if any(series[c])]
    fig, ax = plt.subplots(figsize=(14, 5), dpi=120)
    ax.stackplot(times, [[v / GIB for v in series[c]] for c in shown], labels=shown, step="post")
    totals = [sum(series[c][i] for c in CATEGORIES) for i in range(len(times))]
    table = ["| what | GiB at the peak | largest GiB |", "| --- | --- | --- |"]
    if totals:
        peak = max(range(len(totals)), key=totals.__getitem__)
        ax.axvline(times[peak], color="black", linewidth=0.8, linestyle="--")
        ax.annotate(f"peak {totals[peak] / GIB:.2f} GiB", (times[peak], totals[peak] / GIB), xytext=(5, 5),
                    textcoords="offset points")
        table += [f"| {c} | {series[c][peak] / GIB:.3f} | {max(series[c]) / GIB:.3f} |" for c in shown]
    trace = device_trace(snapshot, device)
    for i, event in enumerate(trace):
        if event["action"] == "oom":
            ax.axvline(event_time(event, trace, i), color="red", label="out of memory")
    ax.set_xlabel("seconds from the first recorded allocation" if trace and "time_us" in trace[0] else "event")
    ax.set_ylabel("live GiB (allocated tensors)")
    ax.set_title(f"{path.name}: GPU {device} memory over time, by what allocated it")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return "\n".join(table)


def main(argv: list[str] | None = None) -> int:
    from config.numbers import integer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("trace", "summary", "snapshot"),
                        help="draw a profile trace (json), summarize one without drawing, or draw a memory snapshot")
    parser.add_argument("path", type=Path, help="the .pt.trace.json or .pickle file")
    parser.add_argument("--out", type=Path, help="the PNG to write (trace, snapshot)")
    parser.add_argument("--step", type=integer, default=None, help="trace: the step to draw (default: the second)")
    parser.add_argument("--device", type=integer, default=0, help="snapshot: the device index whose history to draw")
    args = parser.parse_args(argv)
    if args.kind != "summary" and args.out is None:
        parser.error(f"{args.kind} needs --out (the PNG to write)")
    from fsdp_utils.checkpoint.errors import CheckpointError

    try:
        if args.kind == "summary":
            print(summarize_trace(args.path))
            return 0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.kind == "trace":
            table = render_trace(args.path, args.out, args.step)
        else:
            table = render_snapshot(args.path, args.out, args.device)
    except CheckpointError as err:  # its message names the file
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"error: {args.path}: {err}", file=sys.stderr)
        return 1
    print(table)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
