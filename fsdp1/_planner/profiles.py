"""Calibrations of the GPUs and links people plan jobs for, from their vendors' specifications.

A plan's step costs come from rates; the probe measures those of the machine planning, which for a
GPU job planned on a workstation are the workstation's (and there offload looks free, as the host is
the device). A profile gives a GPU's rates instead: each figure below is the vendor's published
peak, with its source, and what the planner derives from them:

* matmuls at the dense tensor-core peak of bfloat16 and float16, and float32 at the plain FP32 peak
  (torch leaves TF32 off for matmuls by default);
* a collective inside a node sends at NVLink's bandwidth per direction, across nodes at the GPU's
  InfiniBand NIC's (one NIC a GPU, as in NVIDIA's DGX systems);
* the optimizer step reads and writes 28 bytes an element (AdamW in float32: parameter, gradient
  and two moments read, three written) at the device memory's bandwidth, or offloaded at the host
  memory's bandwidth a GPU (the DGX host's DRAM channels shared by its eight GPUs);
* host copies at PCIe's bandwidth per direction; the int8 codec reads and writes 10 bytes a value.

Peaks are never reached, but they are reached in about the same proportion, and a plan's costs are
ratios to the model's bare compute. One figure is not a datasheet's: ``OVERLAP``.
"""

from dataclasses import dataclass
from typing import Dict, Optional

from .cost import Calibration

GIB = 2**30
OPTIMIZER_BYTES_PER_ELEMENT = 28
CODEC_BYTES_PER_VALUE = 10  # encode: 4 read, 1 written (and the scales); decode: 1 read, 4 written
OVERLAP = 0.9
"""The share of a collective that concurrent compute hides: NCCL's kernels take a few of the GPU's
streaming multiprocessors (about 8 to 16 of 108 or 132) while compute runs on the rest. An
assumption, not a specification."""


@dataclass(frozen=True)
class Network:
    """A link between nodes: bytes a second per direction a GPU."""

    bytes_per_s: float
    source: str


NETWORKS: Dict[str, Network] = {
    "ib-200": Network(200e9 / 8, "NVIDIA ConnectX-6 HDR InfiniBand adapter: 200 Gb/s a port "
                                 "(https://www.nvidia.com/en-us/networking/infiniband-adapters/)"),
    "ib-400": Network(400e9 / 8, "NVIDIA ConnectX-7 NDR InfiniBand adapter: 400 Gb/s a port "
                                 "(https://www.nvidia.com/en-us/networking/infiniband-adapters/)"),
}


@dataclass(frozen=True)
class GPUProfile:
    """One GPU's peaks: FLOPs a second by dtype, bytes a second of its memory, of NVLink and of PCIe
    (per direction), of the host memory a GPU, its memory, the network its nodes usually have."""

    memory: int
    matmul_flops: Dict[str, float]
    memory_bytes_per_s: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    host_memory_bytes_per_s: float
    network: str
    source: str

    def calibration(self, name: str, gpus_per_node: int, network: Optional[str] = None) -> Calibration:
        link = NETWORKS[network or self.network]
        return Calibration(
            matmul_flops=dict(self.matmul_flops), collective_bytes=self.nvlink_bytes_per_s, overlap=OVERLAP,
            optimizer_s_per_element=OPTIMIZER_BYTES_PER_ELEMENT / self.memory_bytes_per_s,
            host_optimizer_s_per_element=OPTIMIZER_BYTES_PER_ELEMENT / self.host_memory_bytes_per_s,
            host_copy_bytes=self.pcie_bytes_per_s, codec_s_per_value=CODEC_BYTES_PER_VALUE / self.memory_bytes_per_s,
            inter_node_collective_bytes=min(link.bytes_per_s, self.nvlink_bytes_per_s), gpus_per_node=gpus_per_node,
            measured_on=f"the {name} profile ({gpus_per_node} GPUs a node, {network or self.network} between nodes; "
                        "vendors' peak figures)")


_DGX_A100_HOST = 2 * 204.8e9 / 8  # two AMD EPYC 7742, 8 channels of DDR4-3200 each, for 8 GPUs
_DGX_H100_HOST = 2 * 307.2e9 / 8  # two Intel Xeon Platinum 8480C, 8 channels of DDR5-4800 each, for 8 GPUs
_HOST_SOURCES = ("host: NVIDIA DGX A100 and DGX H100/H200 datasheets (their CPUs), AMD EPYC 7742 and Intel Xeon "
                 "Platinum 8480C specifications (memory bandwidth a socket: 204.8 and 307.2 GB/s)")
_A100 = {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}
_HOPPER = {"float32": 67e12, "bfloat16": 989.5e12, "float16": 989.5e12}  # the datasheet's 1,979 is with sparsity
_A100_SOURCE = ("NVIDIA A100 Tensor Core GPU datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
                "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS "
                "dense, NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions together)")
_H100_SOURCE = ("NVIDIA H100 Tensor Core GPU datasheet (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-"
                "gpu-datasheet), SXM: FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity, 3.35 TB/s, NVLink 900 GB/s, "
                "PCIe Gen5 128 GB/s (both directions together)")
_H200_SOURCE = ("NVIDIA H200 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/), SXM: FP32 67 "
                "TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity, 141 GB at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s")

PROFILES: Dict[str, GPUProfile] = {
    "a100-40gb": GPUProfile(40 * GIB, _A100, 1555e9, 600e9 / 2, 64e9 / 2, _DGX_A100_HOST, "ib-200",
                            f"{_A100_SOURCE}; 40 GB HBM2 at 1,555 GB/s; {_HOST_SOURCES}"),
    "a100-80gb": GPUProfile(80 * GIB, _A100, 2039e9, 600e9 / 2, 64e9 / 2, _DGX_A100_HOST, "ib-200",
                            f"{_A100_SOURCE}; 80 GB HBM2e at 2,039 GB/s (SXM); {_HOST_SOURCES}"),
    "h100-sxm": GPUProfile(80 * GIB, _HOPPER, 3.35e12, 900e9 / 2, 128e9 / 2, _DGX_H100_HOST, "ib-400",
                           f"{_H100_SOURCE}; {_HOST_SOURCES}"),
    "h200": GPUProfile(141 * GIB, _HOPPER, 4.8e12, 900e9 / 2, 128e9 / 2, _DGX_H100_HOST, "ib-400",
                       f"{_H200_SOURCE}; {_HOST_SOURCES}"),
}
ASSUMED = "h100-sxm"
"""The profile a CUDA plan made without CUDA and without a calibration assumes (and says so)."""


def profile(name: str, gpus_per_node: int = 8, network: Optional[str] = None) -> Calibration:
    """The calibration of GPU ``name`` (one of ``PROFILES``) in nodes of ``gpus_per_node`` GPUs joined
    by ``network`` (one of ``NETWORKS``; the GPU's usual one when None)."""
    if name not in PROFILES:
        raise ValueError(f"fsdp1.plan: no profile {name!r}; pass one of {', '.join(sorted(PROFILES))} (or a Calibration "
                         "measured where the job runs).")
    if network is not None and network not in NETWORKS:
        raise ValueError(f"fsdp1.plan: no network {network!r}; pass one of {', '.join(sorted(NETWORKS))}.")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"fsdp1.plan: gpus_per_node={gpus_per_node!r}; pass the GPUs in one node, e.g. 8.")
    return PROFILES[name].calibration(name, gpus_per_node, network)

