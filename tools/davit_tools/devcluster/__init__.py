"""A real local Kubernetes control plane for tests and demos.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK (fake GPU and CPU nodes),
built from Go modules by ``hack/controlplane/build.sh`` and run on loopback. Importing this
package starts nothing and never imports torch.
"""

from .cluster import LocalCluster
from .nodes import DEFAULT_NODES, FakeNode
from .paths import default_bin_dir, pinned_versions
from .process import ClusterError

__all__ = [
    "DEFAULT_NODES",
    "ClusterError",
    "FakeNode",
    "LocalCluster",
    "default_bin_dir",
    "pinned_versions",
]
