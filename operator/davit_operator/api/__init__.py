"""The InferenceService API: identity constants, spec and status models (the schema source)."""

GROUP = "serving.davit.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("infsvc",)
CRD_NAME = f"{PLURAL}.{GROUP}"
FIELD_MANAGER = "davit-operator"
