"""Stable digests of desired objects: the desired-state hash that lets the apply skip unchanged
children, and the revision of an engine pod template (what the replicas run)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from davit_operator.api.identity import GROUP

DESIRED_HASH_ANNOTATION = f"{GROUP}/desired-hash"
REVISION_LENGTH = 10


def desired_hash(obj: dict[str, Any]) -> str:
    """Stable hash of a desired object (without the hash annotation itself)."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its desired-state hash recorded as an annotation."""
    digest = desired_hash(obj)
    metadata = dict(obj["metadata"])
    metadata["annotations"] = {**metadata.get("annotations", {}), DESIRED_HASH_ANNOTATION: digest}
    return {**obj, "metadata": metadata}


def template_revision(template: dict[str, Any]) -> str:
    """Hash of a pod template (image, command line, env, resources, probes, grace period);
    replica counts and the Deployment's strategy are not part of a revision."""
    return desired_hash(template)[:REVISION_LENGTH]
