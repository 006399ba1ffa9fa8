"""The GPUs and links the planner knows: memory, dense peak FLOP/s (from the MFU table of
fsdp_utils/observability/peak_flops.py, not repeated here), HBM bandwidth, and the bus bandwidth a ring collective
reaches within a node (NVLink) and between nodes (the network). Memory is what torch reports (H100 and H200 as our
records read it, the others from their datasheets), HBM bandwidth the datasheets'; the link figures are stated
assumptions (docs/planning.md), not measurements of ours."""
from __future__ import annotations

from dataclasses import dataclass

from ...observability.peak_flops import GPUPeak, match_gpu

GIB = 2**30


@dataclass(frozen=True)
class GPUSpec:
    key: str
    """The name --gpu takes, e.g. h100."""
    peak: GPUPeak
    """Dense bf16 and FP8 peaks: the MFU table's row."""
    memory_gib: float
    """What torch reports as the card's total memory."""
    hbm_tb_s: float
    """HBM bandwidth, TB/s (datasheet)."""
    nvlink_gb_s: float
    """Bus bandwidth of an all-gather or reduce-scatter among GPUs of one node, GB/s per GPU (assumed: nccl-tests'
    usual figure for the NVLink generation)."""
    network_gb_s: float
    """Bus bandwidth of such a collective across nodes, GB/s per GPU (assumed: the NIC per GPU at 90% of its line
    rate)."""
    gpus_per_node: int = 8
    calibrated: bool = False
    """Whether our records measured this GPU (H100, H200); the others are scaled from them by peak and bandwidth."""

    @property
    def name(self) -> str:
        return self.peak.model


def _peak(name: str) -> GPUPeak:
    peak = match_gpu(name)
    assert peak is not None, f"{name} is not in the peak FLOP/s table"
    return peak


# 400 Gb/s InfiniBand (or RoCE) per GPU is the usual H100/H200 cluster (eight NICs a node); A100 clusters usually have
# 200 Gb/s HDR per GPU. 0.9 of the line rate is what NCCL's ring collectives reach across nodes.
_NIC_EFFICIENCY = 0.9
GPUS: dict[str, GPUSpec] = {spec.key: spec for spec in (
    GPUSpec("h100", _peak("H100 SXM"), memory_gib=79.1, hbm_tb_s=3.35, nvlink_gb_s=360.0,
            network_gb_s=400 / 8 * _NIC_EFFICIENCY, calibrated=True),
    GPUSpec("h200", _peak("H200 SXM"), memory_gib=139.8, hbm_tb_s=4.8, nvlink_gb_s=360.0,
            network_gb_s=400 / 8 * _NIC_EFFICIENCY, calibrated=True),
    GPUSpec("a100-80gb", _peak("A100 SXM 80GB"), memory_gib=79.2, hbm_tb_s=2.04, nvlink_gb_s=230.0,
            network_gb_s=200 / 8 * _NIC_EFFICIENCY),
    GPUSpec("a100-40gb", _peak("A100 SXM 40GB"), memory_gib=39.4, hbm_tb_s=1.56, nvlink_gb_s=230.0,
            network_gb_s=200 / 8 * _NIC_EFFICIENCY),
    GPUSpec("b200", _peak("B200"), memory_gib=178.0, hbm_tb_s=8.0, nvlink_gb_s=720.0,
            network_gb_s=400 / 8 * _NIC_EFFICIENCY),
)}


def gpu_spec(key: str) -> GPUSpec:
    """The GPU named `key` (h100, h200, a100-80gb, ...; case and '_' for '-' do not matter); ValueError naming the
    known ones otherwise."""
    normal = key.strip().lower().replace("_", "-")
    if normal in ("h100-80gb", "h100-sxm"):
        normal = "h100"
    if normal in ("h200-141gb", "h200-sxm"):
        normal = "h200"
    if normal not in GPUS:
        raise ValueError(f"unknown GPU {key!r}: one of {', '.join(GPUS)}")
    return GPUS[normal]


def gpu_for_device(device_name: str) -> GPUSpec | None:
    """The spec of a torch.cuda.get_device_name() string (matched as the MFU table matches it), or None for a GPU the
    planner does not know."""
    peak = match_gpu(device_name)
    return next((spec for spec in GPUS.values() if peak is not None and spec.peak == peak), None)
