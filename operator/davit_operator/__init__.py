"""Davit operator: reconciles InferenceService objects into engine Deployments.

Data flows one way: spec -> plan -> desired objects -> apply -> observe -> status.
`api` holds the schema, `catalog` the versioned release data, `planning` and `builders` are pure,
`kube` is the only API-server client and `handlers` wires them into kopf.
"""

__version__ = "0.1.0"
