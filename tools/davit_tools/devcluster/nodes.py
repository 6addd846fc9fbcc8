"""The fake nodes KWOK keeps alive: which accelerators they advertise and how they are labelled.

Capacities and labels follow what the vendors' device plugins and feature-discovery labellers put
on real machines, so placement by resource name, product label and node selector is tested for
real. Nodes carry KWOK's management annotation but no taint, so ordinary pods schedule on them
without tolerations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"


@dataclass(frozen=True)
class FakeNode:
    """One KWOK node: its name, capacity (allocatable is derived) and labels."""

    name: str
    cpu: int
    memory_gib: int
    extended: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    pods: int = 110

    def manifest(self) -> dict[str, Any]:
        capacity = {
            "cpu": str(self.cpu),
            "memory": f"{self.memory_gib}Gi",
            "ephemeral-storage": "3840Gi",
            "pods": str(self.pods),
            **{name: str(count) for name, count in self.extended.items()},
        }
        # A kubelet reserves some CPU and memory for the system; mimic a typical reservation so
        # tests do not accidentally depend on allocatable == capacity.
        allocatable = {
            **capacity,
            "cpu": f"{self.cpu * 1000 - 500}m",
            "memory": f"{self.memory_gib * 1024 - 2048}Mi",
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "annotations": {
                    KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE,
                    "node.alpha.kubernetes.io/ttl": "0",
                },
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **self.labels,
                },
            },
            "spec": {},
            "status": {"capacity": capacity, "allocatable": allocatable},
        }


def cpu_node(name: str) -> FakeNode:
    """A plain 64-core CPU node, like `cpu-0` (110 pods, the kubelet's default)."""
    return FakeNode(
        name=name,
        cpu=64,
        memory_gib=256,
        labels={"node.kubernetes.io/instance-type": "cpu-64"},
    )


def _h200(name: str) -> FakeNode:
    return FakeNode(
        name=name,
        cpu=224,
        memory_gib=2048,
        extended={"nvidia.com/gpu": 8},
        labels={
            "node.kubernetes.io/instance-type": "dgx-h200",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H200",
            "nvidia.com/gpu.memory": "143771",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.family": "hopper",
            "nvidia.com/gpu.compute.major": "9",
            "nvidia.com/gpu.compute.minor": "0",
        },
    )


DEFAULT_NODES: tuple[FakeNode, ...] = (
    _h200("gpu-h200-0"),
    _h200("gpu-h200-1"),
    FakeNode(
        name="gpu-mi300x-0",
        cpu=192,
        memory_gib=2048,
        extended={"amd.com/gpu": 8},
        labels={
            "node.kubernetes.io/instance-type": "mi300x-oam-8",
            "amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM",
            "amd.com/gpu.device-id": "74a1",
            "amd.com/gpu.vram": "192G",
            "amd.com/gpu.cu-count": "304",
            "amd.com/gpu.count": "8",
        },
    ),
    FakeNode(
        name="gpu-max1550-0",
        cpu=224,
        memory_gib=1024,
        extended={"gpu.intel.com/i915": 8},
        labels={
            "node.kubernetes.io/instance-type": "intel-max-1550-8",
            "intel.feature.node.kubernetes.io/gpu": "true",
            "gpu.intel.com/device-id.0380-0bd5.present": "true",
            "gpu.intel.com/family": "Max_Series",
            "gpu.intel.com/product": "Max_1550",
            "gpu.intel.com/tiles": "16",
        },
    ),
    cpu_node("cpu-0"),
)
