"""Pure builders: Plan -> Kubernetes objects as plain, deterministic dicts.

Every object carries the owner reference, the common labels (`metadata`), and only fields the
operator means to own: server-side apply makes the operator the manager of exactly these fields,
and drift detection compares exactly these (`digest` records what was wanted). `deployment`
builds the engine Deployment of either rollout track, `service` and `budget` what stands in
front of it, `children` the whole set, `profile_job` the memory-profiling Job.
"""
