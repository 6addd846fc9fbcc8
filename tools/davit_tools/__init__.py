"""Development tooling for Davit, never shipped in an image or a published distribution.

- `devcluster`: the local control plane (etcd, kube-apiserver, controller manager, scheduler,
  KWOK fake nodes) built from Go modules, used by the tests and the demo.
- `demo`: the operator half of `make demo`.
- `bench`: GPU benchmark suites, kernel timing, the memory check and the scheduler benchmark;
  `workloads` names the workloads (W1, W2, ...) their figures refer to.
"""
