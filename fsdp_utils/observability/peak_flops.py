"""Peak tensor-core FLOP/s per GPU model, for MFU: the GPU is matched on its exact model (SXM, PCIe and NVL
parts differ by up to a third), and a GPU not in the table gets no MFU rather than a guessed one.

Every figure is the vendor datasheet's dense rate (without 2:4 structured sparsity, which datasheets print
first and which is twice the dense rate), with fp32 accumulation where the datasheet gives both (GeForce
cards halve the fp32-accumulate rate; training accumulates in fp32). FP16 runs at the bf16 rate on every
GPU here. docs/observability.md has the same table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

T = 1e12


@dataclass(frozen=True)
class GPUPeak:
    model: str
    """The table's row, e.g. 'H100 SXM'."""
    bf16: float
    """Dense bf16 (= fp16) tensor FLOP/s."""
    fp8: float | None
    """Dense fp8 tensor FLOP/s; None where the GPU has no fp8 tensor cores."""


# (pattern, peak): the pattern must match the whole normalised name (normalise_gpu_name), so 'A10' is
# not 'A10G' and an H100 MIG slice ('... MIG 1g.10gb') matches nothing: a slice has a fraction of the peak.
GPU_PEAKS: tuple[tuple[str, GPUPeak], ...] = (
    (r"H100( SXM\d?)?( \d+GB)?( HBM3E?)?", GPUPeak("H100 SXM", 989.4 * T, 1978.9 * T)),
    (r"H100 PCIE( \d+GB)?", GPUPeak("H100 PCIe", 756.5 * T, 1513 * T)),
    (r"H100 NVL( \d+GB)?", GPUPeak("H100 NVL", 835.5 * T, 1670.5 * T)),
    (r"H200( SXM\d?)?( \d+GB)?( HBM3E)?", GPUPeak("H200 SXM", 989.5 * T, 1979 * T)),
    (r"H200 NVL( \d+GB)?", GPUPeak("H200 NVL", 835.5 * T, 1670.5 * T)),
    (r"GH200( \d+GB?)?( HBM3E?)?", GPUPeak("GH200", 989.5 * T, 1979 * T)),
    (r"A100 SXM4? 40GB", GPUPeak("A100 SXM 40GB", 312 * T, None)),
    (r"A100 SXM4? 80GB", GPUPeak("A100 SXM 80GB", 312 * T, None)),
    (r"A100 PCIE 40GB|A100 40GB PCIE", GPUPeak("A100 PCIe 40GB", 312 * T, None)),
    (r"A100 PCIE 80GB|A100 80GB PCIE", GPUPeak("A100 PCIe 80GB", 312 * T, None)),
    (r"A30", GPUPeak("A30", 165 * T, None)),
    (r"A10", GPUPeak("A10", 125 * T, None)),
    (r"L40S", GPUPeak("L40S", 362.05 * T, 733 * T)),
    (r"L40", GPUPeak("L40", 181.05 * T, 362 * T)),
    (r"L4", GPUPeak("L4", 121 * T, 242.5 * T)),
    (r"B200", GPUPeak("B200", 2250 * T, 4500 * T)),
    (r"GB200", GPUPeak("GB200", 2500 * T, 5000 * T)),
    (r"RTX A6000", GPUPeak("RTX A6000", 154.8 * T, None)),
    (r"GEFORCE RTX 4090", GPUPeak("GeForce RTX 4090", 165.2 * T, 330.3 * T)),
    (r"GEFORCE RTX 3090", GPUPeak("GeForce RTX 3090", 71 * T, None)),
)


def normalise_gpu_name(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'A100 SXM4 80GB': upper case, the vendor prefix dropped, '-' and '_' read
    as spaces, runs of spaces collapsed."""
    words = re.sub(r"[-_\s]+", " ", name.upper()).split()
    if words and words[0] == "NVIDIA":
        words = words[1:]
    if words and words[0] == "TESLA":
        words = words[1:]
    return " ".join(words)


def match_gpu(name: str) -> GPUPeak | None:
    """The table's row for a torch.cuda.get_device_name() string, or None when no row matches exactly."""
    normal = normalise_gpu_name(name)
    for pattern, peak in GPU_PEAKS:
        if re.fullmatch(pattern, normal):
            return peak
    return None


def resolve_peak_flops(device: torch.device, *, override_flops: float = 0.0,
                       device_name: str | None = None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s for MFU, or None; one line saying where it came from). The override
    (logging.peak_tflops) wins; then the table; a CPU or an unknown GPU gets None and says so."""
    if override_flops > 0:
        return override_flops, f"peak {override_flops / T:,.1f} TFLOP/s per GPU for MFU (logging.peak_tflops)"
    if device.type != "cuda":
        return None, "MFU omitted: no peak FLOP/s for a CPU (set logging.peak_tflops to compute one)"
    name = device_name if device_name is not None else torch.cuda.get_device_name(device)
    peak = match_gpu(name)
    if peak is None:
        return None, (f"MFU omitted: GPU '{name}' is not in the peak FLOP/s table (docs/observability.md); set "
                      "logging.peak_tflops to its dense bf16 TFLOP/s")
    fp8 = f", fp8 {peak.fp8 / T:,.1f}" if peak.fp8 else ""
    return peak.bf16, (f"GPU '{name}' is {peak.model}: MFU against its dense bf16 peak {peak.bf16 / T:,.1f} "
                       f"TFLOP/s{fp8} (datasheet, without sparsity)")
