"""Identity of the InferenceService API: group, version, kind, resource names, field manager."""

GROUP = "serving.davit.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("infsvc",)
CRD_NAME = f"{PLURAL}.{GROUP}"
FIELD_MANAGER = "davit-operator"
