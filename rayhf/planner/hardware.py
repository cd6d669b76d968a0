"""What the planner knows about hardware: device rates and the links between devices.

Plans for clusters that are not at hand use published datasheet figures (cited below); the
emulated CPU devices of this machine use measured rates (``benchmarks/`` writes them). A cluster
is written ``NODESxDEVICESxKIND``, e.g. ``16x8xH100``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

from rayhf.errors import RayhfError


@dataclass(frozen=True)
class DeviceSpec:
    """One device's peak rates; the cost model applies efficiencies to them."""

    name: str
    memory_bytes: float
    flops: float  # dense matmul FLOP/s in the training dtype
    memory_bandwidth: float  # bytes/s
    dtype_bytes: int  # bytes per parameter/activation element in that dtype
    source: str  # where the figures come from
    # dense fp32 FLOP/s (torch's default fp32 matmul on CUDA does not use TF32 tensor cores);
    # 0: the same as ``flops`` (a device whose training dtype is fp32)
    fp32_flops: float = 0.0


# NVIDIA datasheets: H100 SXM5 (nvidia.com/en-us/data-center/h100, "H100 Tensor Core GPU
# Datasheet"): 989 TFLOPS BF16 dense (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4
# 900 GB/s per GPU (both directions). H200 SXM (nvidia.com/en-us/data-center/h200): same
# compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. A100 SXM4 80GB (nvidia.com/en-us/
# data-center/a100, "A100 Datasheet"): 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 3
# 600 GB/s. Inter-node: one 400 Gb/s (NDR) InfiniBand NIC per H100/H200 and one 200 Gb/s (HDR)
# per A100, as in the DGX H100/H200/A100 system datasheets. FP32 (non-tensor) dense: 67 TFLOPS
# on H100 and H200 SXM, 19.5 TFLOPS on A100 (the same datasheets).
DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100-SXM5-80GB", 80e9, 989e12, 3.35e12, 2, "NVIDIA H100 datasheet", 67e12),
    "H200": DeviceSpec("H200-SXM-141GB", 141e9, 989e12, 4.8e12, 2, "NVIDIA H200 datasheet", 67e12),
    "A100": DeviceSpec(
        "A100-SXM4-80GB", 80e9, 312e12, 2.039e12, 2, "NVIDIA A100 datasheet", 19.5e12
    ),
}
# A weight move between processes sharing a GPU, staged through /dev/shm: 0.988 GB in 0.227 s
# on an H200 (docs/benchmarks/gpu_colocated_move.md, "1 process -> 1 other").
GPU_STAGED_BANDWIDTH = 4.35e9
# A GPU's link to its host, each way: PCIe Gen5 x16 on H100/H200 SXM (128 GB/s both ways), Gen4
# x16 on A100 (64 GB/s), as in the datasheets above; and the host memory's share of a GPU in the
# DGX systems: H100/H200, two Xeon 8480C with 8 channels of DDR5-4800 each (614 GB/s) for 8 GPUs;
# A100, two EPYC 7742 with 8 channels of DDR4-3200 each (410 GB/s) for 8 GPUs.
HOST: dict[str, tuple[float, float]] = {  # kind -> (host link, host memory share) bytes/s
    "H100": (64e9, 614e9 / 8),
    "H200": (64e9, 614e9 / 8),
    "A100": (32e9, 410e9 / 8),
}
LINKS: dict[str, tuple[float, float]] = {  # kind -> (intra-node, inter-node) bytes/s per device
    "H100": (450e9, 50e9),  # NVLink 4: 900 GB/s bidirectional; NDR 400 Gb/s
    "H200": (450e9, 50e9),
    "A100": (300e9, 25e9),  # NVLink 3: 600 GB/s bidirectional; HDR 200 Gb/s
}


@dataclass(frozen=True)
class ClusterSpec:
    """``n_nodes`` x ``devices_per_node`` identical devices; device ``d`` is on node
    ``d // devices_per_node``."""

    n_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_bandwidth: float  # bytes/s one device can send to a device on its node
    inter_node_bandwidth: float  # bytes/s one device can send to another node
    link_latency: float = 10e-6  # seconds per collective or message
    host_cores: float = 0.0  # emulated devices: the cores they all share (0: none shared)
    # bytes/s a weight move's large messages reach between processes of one node through shared
    # memory (``rayhf.realloc.shm``); 0: moves take the links (GPUs not shared: NCCL)
    shm_bandwidth: float = 0.0
    # GPUs: bytes/s of a move between role groups that share a device (NCCL refuses them, so
    # their transfer group stages through host memory); 0: the links
    shared_gpu_bandwidth: float = 0.0
    # the same when the move stays on one GPU and goes through CUDA IPC (device copies)
    ipc_bandwidth: float = 0.0
    # an offloaded optimizer (``offload``): bytes/s between a device and host memory, each way,
    # and the host memory's bytes/s that device's share of the node's CPUs reads and writes;
    # 0: the device's own memory bandwidth (emulated devices: host memory already)
    host_link_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def one_node(self, devices: tuple[int, ...] | list[int]) -> bool:
        """Whether ``devices`` are all on one node (none: trivially)."""
        return not devices or self.node_of(min(devices)) == self.node_of(max(devices))

    def bandwidth(self, devices: tuple[int, ...] | list[int]) -> float:
        """Per-device bandwidth of a collective over ``devices`` (the slowest link it uses)."""
        return self.intra_node_bandwidth if self.one_node(devices) else self.inter_node_bandwidth


# This machine's emulated CPU devices (one core each), measured here: fp32 matmul 1024^3 on one
# thread 62 GFLOP/s; copy 15 GB/s; gloo all-reduce between two processes over TCP loopback
# 2.0-2.4 ms for messages up to 256 KB and 25 ms for 16 MB (0.7 GB/s). The latency stands for
# what a collective waits inside a run: on 2026-12-05 a quiet pair of processes took 0.32 ms
# while the runs' tp calls waited 1.2-1.5 ms (decision 0100).
CPU_LINK_BANDWIDTH = 0.7e9
CPU_LINK_LATENCY = 2e-3
# A weight move through shared memory, one process to another: 397 MB in 0.087-0.091 s
# (``python benchmarks/realloc_throughput.py``, "1 device -> 1 other device").
CPU_SHM_BANDWIDTH = 4.4e9
# The runtime around the profiled engine ops on this machine, fitted from runs: fitted.json
# beside this module holds the values and their history (``benchmarks/planner_calibration.py``
# rewrites it).
FITTED_FILE = "fitted.json"
_FITTED = json.loads(resources.files("rayhf.planner").joinpath(FITTED_FILE).read_text())
# the driver's cost per call (dispatch, splitting and joining the batch, Ray)
CPU_CALL_OVERHEAD: float = _FITTED["cpu_call_overhead"]
# by the number of devices a call keeps busy: (seconds per call, scale) of in-actor compute
# over the profile
CPU_ACTOR: dict[int, tuple[float, float]] = {
    int(k): (float(v[0]), float(v[1])) for k, v in _FITTED["cpu_actor"].items()
}
# DeepSpeed ZeRO-3 on gloo, seconds per weight tensor per minibatch (beside one all-gather's
# volume)
CPU_ZERO3_PER_TENSOR: float = _FITTED["cpu_zero3_per_tensor"]


def cpu_cluster(
    n_devices: int, memory_gb: float, cores: float = 0.0, shm: bool = True
) -> ClusterSpec:
    """``n_devices`` emulated CPU devices on one node (fp32, gloo) sharing ``cores`` cores (0:
    a core each at least); each device's process runs one torch thread. ``shm``: weight moves
    go through shared memory (``driver.same_host_transport``)."""
    device = DeviceSpec(
        "CPU (emulated)", memory_gb * 1e9, 62e9, 15e9, 4, "measured on this machine"
    )
    shm_bandwidth = CPU_SHM_BANDWIDTH if shm else 0.0
    return ClusterSpec(
        1, n_devices, device, CPU_LINK_BANDWIDTH, CPU_LINK_BANDWIDTH, CPU_LINK_LATENCY, cores,
        shm_bandwidth,
    )  # fmt: skip


def gpu_kind(device_name: str) -> str | None:
    """The ``DEVICES`` kind a GPU's name (``torch.cuda.get_device_name``) is, if any:
    ``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``."""
    return next((kind for kind in DEVICES if kind in device_name.upper()), None)


def gpu_cluster(
    n_devices: int, device_name: str, per_node: int = 8, ipc: bool = False
) -> ClusterSpec | None:
    """A run's ``n_devices`` GPUs named ``device_name``, ``per_node`` to a node (NVLink within
    it, the kind's InfiniBand between): their datasheet entry; None for a kind it lacks.
    ``ipc``: moves on one GPU go through CUDA IPC (``driver.same_host_transport: ipc``)."""
    kind = gpu_kind(device_name)
    if kind is None:
        return None
    per = min(per_node, n_devices)
    if n_devices % per:  # not whole nodes of ``per_node``: taken as one node
        per = n_devices
    intra, inter = LINKS[kind]
    device = DEVICES[kind]
    # CUDA IPC: two device copies a message, each reading and writing it (not yet measured)
    ipc_rate = device.memory_bandwidth / 4 if ipc else 0.0
    return ClusterSpec(
        n_devices // per, per, device, intra, inter,
        shared_gpu_bandwidth=GPU_STAGED_BANDWIDTH, ipc_bandwidth=ipc_rate,
        host_link_bandwidth=HOST[kind][0], host_memory_bandwidth=HOST[kind][1],
    )  # fmt: skip


def parse_cluster(text: str) -> ClusterSpec:
    """``16x8xH100`` -> 16 nodes of 8 H100s."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\w+)", text.strip())
    if m is None or m.group(3) not in DEVICES:
        kinds = ", ".join(DEVICES)
        raise RayhfError(f"--cluster {text!r}: write NODESxDEVICESxKIND with KIND in {kinds}")
    nodes, per_node, kind = int(m.group(1)), int(m.group(2)), m.group(3)
    if nodes < 1 or per_node < 1:
        raise RayhfError(f"--cluster {text!r}: nodes and devices per node must be at least 1")
    intra, inter = LINKS[kind]
    # moves between groups sharing GPUs priced at NVLink, as if NCCL could join them (the
    # runtime stages them through host memory: docs/layouts-and-plans.md, "Known limits")
    link, memory = HOST[kind]
    return ClusterSpec(
        nodes, per_node, DEVICES[kind], intra, inter,
        host_link_bandwidth=link, host_memory_bandwidth=memory,
    )  # fmt: skip
