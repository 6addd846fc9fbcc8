"""The InferenceService status at runtime, built as the typed models of `api.status`.

`conditions` owns condition transitions (the one place that sets lastTransitionTime),
`progress` reads an observed Deployment, `compute` turns a plan or a refusal into the status,
`patch` reduces it to the fields that changed.
"""
