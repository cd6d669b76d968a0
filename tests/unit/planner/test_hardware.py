"""Cluster specs (``rayhf.planner.hardware``): datasheet devices, their links, and this
machine's emulated CPU devices."""

from __future__ import annotations

import pytest

from rayhf.errors import RayhfError
from rayhf.planner.hardware import (
    CPU_LINK_BANDWIDTH,
    CPU_LINK_LATENCY,
    cpu_cluster,
    parse_cluster,
)


def test_cluster_specs_parse_and_name_their_links():
    c = parse_cluster("16x8xH100")
    assert (c.n_nodes, c.devices_per_node, c.n_devices) == (16, 8, 128)
    assert c.device.memory_bytes == 80e9 and "datasheet" in c.device.source
    assert c.bandwidth((0, 7)) > c.bandwidth((7, 8)), "NVLink within a node beats InfiniBand"
    with pytest.raises(RayhfError, match="NODESxDEVICESxKIND"):
        parse_cluster("16xH100")


def test_unknown_kinds_and_empty_clusters_are_refused():
    for bad in ("2x8xB200", "0x8xH100", "2x0xA100", "2x8"):
        with pytest.raises(RayhfError, match="--cluster"):
            parse_cluster(bad)
    a100 = parse_cluster(" 2x4xA100 ")
    assert a100.device.flops < parse_cluster("2x4xH100").device.flops
    assert [a100.node_of(d) for d in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert a100.bandwidth(()) == a100.intra_node_bandwidth


def test_emulated_cpu_devices_share_one_node_and_the_measured_link():
    c = cpu_cluster(3, 2.5)
    assert (c.n_nodes, c.devices_per_node, c.n_devices) == (1, 3, 3)
    assert c.device.memory_bytes == 2.5e9 and c.device.dtype_bytes == 4
    assert c.bandwidth((0, 2)) == CPU_LINK_BANDWIDTH and c.link_latency == CPU_LINK_LATENCY


def test_a_gpu_s_name_gives_its_datasheet_and_nodes_of_eight():
    from rayhf.planner.hardware import DEVICES, gpu_cluster, gpu_kind

    assert gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_kind("NVIDIA H200") == "H200" and gpu_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpu_kind("Tesla T4") is None and gpu_cluster(2, "Tesla T4") is None
    one = gpu_cluster(1, "NVIDIA H200")
    assert one is not None and (one.n_nodes, one.devices_per_node) == (1, 1)
    assert one.device == DEVICES["H200"]
    many = gpu_cluster(16, "NVIDIA H100 80GB HBM3")
    assert many is not None and (many.n_nodes, many.devices_per_node) == (2, 8)
    assert many.bandwidth([0, 8]) < many.bandwidth([0, 7])  # InfiniBand between nodes
    odd = gpu_cluster(12, "NVIDIA H100 80GB HBM3")
    assert odd is not None and (odd.n_nodes, odd.devices_per_node) == (1, 12)
