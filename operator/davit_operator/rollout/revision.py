"""Revisions: the identity of what the replicas run, independent of how many there are."""

from __future__ import annotations

from typing import Any

from davit_operator.kube import desired_hash

REVISION_LENGTH = 10


def revision_of(deployment: dict[str, Any]) -> str:
    """Hash of a desired Deployment's pod template (image, command line, env, resources,
    probes, grace period); replica counts and strategy are not part of a revision."""
    return desired_hash(deployment["spec"]["template"])[:REVISION_LENGTH]
