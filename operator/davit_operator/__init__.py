"""Davit operator: reconciles InferenceService objects into engine Deployments.

Data flows one way: spec -> plan -> desired objects -> apply -> observe -> status.
`api` holds the schema, `catalog` the versioned release data, `planning` and `builders` are pure,
`kube` is the only API-server client, `delivery` fetches models into the cache (`fetch` is
the program its Jobs run), `status` and `rollout` turn observations into status and
decisions, `reconcile` runs plan / apply / report, and `handlers` wires it into kopf.

A module imports only modules of its own layer or lower ones:

Layers (lowest first): fetch, api, catalog, planning, model_config, builders, kube, metrics,
    profiling, delivery, status, rollout, reconcile, handlers, cli
"""

__version__ = "0.1.0"
