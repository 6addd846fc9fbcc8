"""The InferenceService API: the only schema source (a generator writes the CRD from it).

`identity` names the group, version and kind; `schema` holds the base model the others build on;
`spec`, `rollout` and `status` are the models; `crdgen` writes the CRD.
"""
