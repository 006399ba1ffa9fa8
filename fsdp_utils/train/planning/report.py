"""What scripts/plan.py prints: the candidate plans of one cluster as a table with the memory breakdown, and the
fastest plan of several clusters as a markdown table (docs/planning.md's tables are this output); and the one line of
the estimate that train_fsdp.py --check prints and a run logs."""
from __future__ import annotations

from config import Config, ConfigError

from .calibration import KNOWN_MISSES
from .hardware import GPUS, gpu_for_device, gpu_spec
from .plan import Cluster, plan_from, settings_from
from .planner import Estimate, Planning, budget_gib, estimate, launch_estimate, plan_problems
from .points import MEMORY_TOLERANCE, SPEED_TOLERANCE, Prediction
from .shape import model_shape

_BREAKDOWN = ("params", "grads", "optimizer", "activations", "loss", "fp8", "buffers", "headroom")
_HEADS = ("params", "grads", "optim", "activ", "loss", "fp8", "buffers", "headroom")


def describe_cluster(planning: Planning) -> list[str]:
    """The header lines: the model, the cluster and its links, the memory budget."""
    shape, cluster, s = planning.shape, planning.cluster, planning.settings
    gpu = cluster.gpu
    links = f"NVLink {gpu.nvlink_gb_s:g} GB/s" + (f", network {gpu.network_gb_s:g} GB/s per GPU"
                                                   if cluster.nodes > 1 else "")
    budget = budget_gib(cluster, s)
    calibrated = "" if gpu.calibrated else " (not in our records: scaled from H100/H200 by peak and bandwidth)"
    precision = "bf16" if s.float8 == "none" else f"FP8 {s.float8}"
    note = [] if s.compiled else ["note: train.compile=false, but the estimate is of compiled blocks (the records "
                                  "measured uncompiled steps 1.5x slower)"]
    return note + [f"model: {shape.params / 1e9:.2f}B parameters, {shape.n_layers} layers, width {shape.dim}, sequence "
                   f"{shape.seq_len}, {shape.flops_per_token / 1e9:.1f} GFLOP a token; {precision}",
                   f"cluster: {cluster.gpus} x {gpu.name}{calibrated}, {cluster.nodes} node{'s' * (cluster.nodes > 1)} "
                   f"({links}); {planning.per_gpu_batch} sequences per GPU a step",
                   f"budget: {budget:.1f} GiB reserved per GPU ({gpu.memory_gib:g} GiB, less what the allocator does "
                   f"not see, times 1 - train.auto_micro_batch_margin={s.margin:g})",
                   "predictions, not measurements: docs/planning.md says how they are made and how far they miss our "
                   "records"]


def plan_table(planning: Planning, estimates: list[Estimate]) -> list[str]:
    """The candidate plans with their memory breakdown (GiB per GPU) and speed, the fastest that fits marked *."""
    fastest = planning.fastest
    head = (f"  {'plan':<36} {'fits':>4} {'GiB':>6}  " + " ".join(f"{h:>7}" for h in _HEADS)
            + f"  {'tok/s/GPU':>9} {'MFU':>5} {'step s':>7} {'comm s':>7} {'exposed':>7}")
    lines = [head]
    for e in estimates:
        mark = "*" if e is fastest else " "
        m, sp = e.memory, e.speed
        parts = " ".join(f"{getattr(m, f):7.2f}" for f in _BREAKDOWN)
        lines.append(f"{mark} {e.plan.label:<36} {'yes' if e.fits else 'no':>4} {m.reserved:6.1f}  {parts}  "
                     f"{sp.tokens_per_s:9,.0f} {100 * sp.mfu:4.1f}% {sp.step_s:7.2f} {sp.comm_s:7.2f} "
                     f"{sp.exposed_comm_s:7.2f}")
    if fastest is None:
        lines.append("no plan fits: use more GPUs, a GPU with more memory, or a shorter data.seq_len")
    else:
        lines.append(f"* fastest that fits: {fastest.plan.label} ({fastest.speed.tokens_per_s:,.0f} tokens/s per GPU)")
    return lines


def markdown_table(plannings: list[Planning]) -> list[str]:
    """The fastest plan of each cluster as a markdown table: a row per GPU count, the GPU kinds side by side, each
    with its plan, memory per GPU (GiB, all that the run takes of the card) and tokens/s per GPU."""
    kinds = list(dict.fromkeys(p.cluster.gpu.name for p in plannings))
    counts = list(dict.fromkeys(p.cluster.gpus for p in plannings))
    by_cluster = {(p.cluster.gpus, p.cluster.gpu.name): p for p in plannings}
    lines = ["| GPUs | " + " | ".join(f"{k}: fastest plan | GiB | tokens/s" for k in kinds) + " |",
             "| ---: | " + " | ".join("--- | ---: | ---:" for _ in kinds) + " |"]
    for count in counts:
        cells = []
        for kind in kinds:
            best = by_cluster[(count, kind)].fastest
            cells.append("none fits | | " if best is None else
                         f"{best.plan.label} | {best.memory.total:.1f} | {best.speed.tokens_per_s:,.0f}")
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return lines


def calibration_summary(predictions: list[Prediction]) -> list[str]:
    """How far the estimate is from our records: the largest error over the points held to the targets, and the
    known misses."""
    held = [p for p in predictions if p.known_miss is None]
    memory = [abs(p.memory_error) for p in held if p.memory_error is not None]
    speed = [abs(p.speed_error) for p in held if p.speed_error is not None]
    misses = len([p for p in predictions if p.point.id in KNOWN_MISSES])
    return [f"calibration: {len(memory)} measured peaks within {100 * max(memory):.1f}% (target "
            f"{100 * MEMORY_TOLERANCE:.0f}%), {len(speed)} measured tokens/s within {100 * max(speed):.1f}% (target "
            f"{100 * SPEED_TOLERANCE:.0f}%); {misses} known misses (fsdp_utils/train/planning/calibration.py)"]


def prediction_table(predictions: list[Prediction]) -> list[str]:
    """Predicted against measured, point by point (GiB per GPU, allocated or reserved as measured; tokens/s per GPU),
    each miss of the targets marked: ! held to them, ~ a known miss."""
    lines = [f"  {'point':<52} {'memory GiB':>10} {'predicted':>9} {'error':>7}   {'tokens/s':>9} {'predicted':>9} "
             f"{'error':>7}"]
    for p in predictions:
        mark = ("~" if p.known_miss else "!") if p.misses else " "
        mem = (f"{p.point.mem_gib:10.2f} {p.predicted_gib:9.2f} {100 * p.memory_error:+6.1f}%"
               if p.memory_error is not None else " " * 28)
        speed = (f"{p.point.tokens_per_s:9,.0f} {p.speed.tokens_per_s:9,.0f} {100 * p.speed_error:+6.1f}%"
                 if p.speed_error is not None else "")
        lines.append(f"{mark} {p.point.id:<52} {mem}   {speed}".rstrip())
    return lines


def one_line(e: Estimate, cluster: Cluster) -> str:
    """One plan's estimate in a line (for train_fsdp.py --check): memory against the budget, tokens/s per GPU."""
    verdict = "fits" if e.fits else "does not fit"
    return (f"predicted for {e.plan.label} on {cluster.gpus} x {cluster.gpu.name}: {e.memory.reserved:.1f} GiB "
            f"reserved per GPU, {verdict} the budget of {e.budget_gib:.1f} GiB; {e.speed.tokens_per_s:,.0f} tokens/s "
            f"per GPU ({100 * e.speed.mfu:.0f}% MFU)")


ASSUMED_GPU = "h100"  # the GPU of --check's line where the machine it runs on has none


def launch_line(cfg: Config, *, gpus: int, device_name: str | None, nodes: int = 1, vocab_size: int | None = None,
                micro_batch: int | None = None, checkpointing: str | None = None) -> str:
    """The estimate for `cfg` on `gpus` GPUs of `device_name` (torch.cuda's name; None: no GPU here, an H100 assumed),
    in one line: train_fsdp.py --check prints it for the config as launched (where it says auto, the estimate's
    fastest plan that fits), and a run logs it for the plan it chose (`micro_batch`, `checkpointing`), beside what it
    then measures."""
    assumed = device_name is None
    gpu = gpu_spec(ASSUMED_GPU) if device_name is None else gpu_for_device(device_name)
    if gpu is None:
        return f"estimate: none for the {device_name} (the planner knows {', '.join(GPUS)}: docs/planning.md)"
    cluster = Cluster(gpu, gpus, nodes)
    auto = [name for name, value in (("train.micro_batch_size", cfg.train.micro_batch_size),
                                     ("fsdp.activation_checkpointing", cfg.fsdp.activation_checkpointing))
            if value == "auto"]
    try:
        if micro_batch is None and auto:
            e = launch_estimate(cfg, cluster, vocab_size=vocab_size)
        else:
            if problems := plan_problems(cfg, cluster):
                raise ConfigError(problems)
            plan = plan_from(cfg, gpus=gpus, micro_batch=micro_batch, checkpointing=checkpointing)
            e = estimate(model_shape(cfg, vocab_size), cluster, plan, settings_from(cfg))
    except ConfigError as err:
        return f"estimate: none ({err.problems[0]})"
    notes = []
    if micro_batch is None and auto:
        notes.append(f"{' and '.join(auto)}=auto: " + ("the fastest plan predicted to fit" if e.fits else
                                                        "no plan is predicted to fit; the one of least memory"))
    if assumed:
        notes.append(f"no GPU here: for the {gpu.name}")
    return f"estimate: {one_line(e, cluster)}" + "".join(f"; {note}" for note in notes)
