"""Rollouts: rolling and canary updates gated on the engines' metrics, with rollback.

`machine` decides (pure), `observe` reduces the live Deployments and reads the canary through
`metrics`, `gateway` weights an HTTPRoute, `controller` wires them into a reconcile, `status`
writes the decision into the InferenceService status.
"""
