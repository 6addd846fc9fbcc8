"""kube.py against the real API server: server-side apply, get, delete, credential reload."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from davit_operator.builders.digest import with_hash
from davit_operator.builders.metadata import Owner
from davit_operator.builders.service import service
from davit_operator.catalog.loader import load_catalog
from davit_operator.kube import KubeClient, KubeError, load_credentials, needs_apply
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_cluster import get_json
from tests.operator.isvc_helpers import make_spec, spec_dict

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = pytest.mark.cluster


def test_apply_get_delete_and_no_op_reapply(
    kube_cluster: LocalCluster, kube_namespace: str, isvc_crd: str
) -> None:
    # A real owner: the garbage collector removes children whose owner does not exist.
    owner_doc = {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "direct", "namespace": kube_namespace},
        "spec": spec_dict(),
    }
    kube_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(owner_doc))
    owner_uid = get_json(kube_cluster, "get", "infsvc", "direct", "-n", kube_namespace)["metadata"][
        "uid"
    ]
    plan = make_plan("direct", kube_namespace, make_spec(), load_catalog())
    desired = with_hash(service(plan, Owner(name="direct", uid=owner_uid)))

    async def scenario() -> tuple[dict[str, object], dict[str, object], dict[str, object] | None]:
        client = KubeClient(load_credentials(str(kube_cluster.kubeconfig)))
        try:
            first = await client.apply(desired)
            again = await client.apply(desired)
            fetched = await client.get("Service", kube_namespace, "direct")
            assert fetched is not None and not needs_apply(desired, fetched)
            await client.delete("Service", kube_namespace, "direct", "not-the-uid")
            still = await client.get("Service", kube_namespace, "direct")
            assert still is not None, "a uid precondition protects a same-named object"
            await client.delete("Service", kube_namespace, "direct", str(first["metadata"]["uid"]))  # type: ignore[index]
            gone = await client.get("Service", kube_namespace, "direct")
            return first, again, gone
        finally:
            await client.close()

    first, again, gone = asyncio.run(scenario())
    meta_first, meta_again = first["metadata"], again["metadata"]
    assert meta_first["resourceVersion"] == meta_again["resourceVersion"], (
        "an unchanged apply is a no-op"
    )  # type: ignore[index]
    managers = {m["manager"] for m in meta_first["managedFields"]}  # type: ignore[index]
    assert "davit-operator" in managers
    assert gone is None


def test_refused_object_raises_a_permanent_error(
    kube_cluster: LocalCluster, kube_namespace: str
) -> None:
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "bad", "namespace": kube_namespace},
        "spec": {"ports": [{"port": 99999}]},
    }

    async def scenario() -> KubeError:
        client = KubeClient(load_credentials(str(kube_cluster.kubeconfig)))
        try:
            with pytest.raises(KubeError) as err:
                await client.apply(bad)
            return err.value
        finally:
            await client.close()

    err = asyncio.run(scenario())
    assert err.status == 422 and not err.is_temporary
    assert "spec.ports[0].port" in err.message


def test_rejected_token_is_reloaded(
    kube_cluster: LocalCluster, kube_namespace: str, tmp_path: Path
) -> None:
    kube_cluster.kubectl("create", "serviceaccount", "op", "-n", kube_namespace)
    kube_cluster.kubectl(
        "create",
        "rolebinding",
        "op-edit",
        "--clusterrole=edit",
        f"--serviceaccount={kube_namespace}:op",
        "-n",
        kube_namespace,
    )
    token = kube_cluster.kubectl("create", "token", "op", "-n", kube_namespace).stdout.strip()
    token_config = kube_cluster.write_token_kubeconfig(token, tmp_path / "token.kubeconfig")
    good = load_credentials(str(token_config))
    stale = dataclasses.replace(good, authorization="Bearer expired-token")
    reloads: list[int] = []

    def reload() -> object:
        reloads.append(1)
        return good

    async def scenario() -> dict[str, object] | None:
        client = KubeClient(stale, reload=reload)  # type: ignore[arg-type]
        try:
            return await client.get("Deployment", kube_namespace, "absent")
        finally:
            await client.close()

    assert asyncio.run(scenario()) is None
    assert reloads == [1]

    async def without_reload() -> None:
        client = KubeClient(stale)
        try:
            await client.get("Deployment", kube_namespace, "absent")
        finally:
            await client.close()

    with pytest.raises(KubeError) as err:
        asyncio.run(without_reload())
    assert err.value.status == 401
    assert get_json(kube_cluster, "get", "serviceaccount", "op", "-n", kube_namespace)
