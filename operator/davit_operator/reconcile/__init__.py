"""One level-based reconcile of an InferenceService, in three steps.

`plan` decides what the object wants (spec -> Plan -> rollout decision -> desired children),
`apply` writes the children that differ, `report` computes the status and puts only the changed
fields into kopf's patch; `reconciler` runs the three under the object's lock. `runtime` is the
per-process state, `memo` the per-object state, `indexes` the typed watch caches.
"""
