"""The operator as a real kopf process against the local control plane (KWOK fake nodes)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from tests.operator.isvc_cluster import OperatorProcess, apply_yaml, condition, get_json, wait_for
from tests.operator.isvc_helpers import example_documents, merge

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = pytest.mark.cluster

StartOperator = Callable[..., OperatorProcess]

NODE_PREFIX = {
    "nvidia": "gpu-h200-",
    "amd": "gpu-mi300x-",
    "intel": "gpu-max1550-",
    "cpu": "cpu-",
}
ACCELERATOR_RESOURCE = {
    "nvidia": "nvidia.com/gpu",
    "amd": "amd.com/gpu",
    "intel": "gpu.intel.com/i915",
}


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


CPU_SPEC: dict[str, Any] = {
    "model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "cpu"},
    "pod": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
}
H200_SPEC: dict[str, Any] = {
    "model": {"source": "hf://Qwen/Qwen3-8B", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
}


def services(cluster: LocalCluster, namespace: str) -> dict[str, dict[str, Any]]:
    items = get_json(cluster, "get", "infsvc", "-n", namespace)["items"]
    return {item["metadata"]["name"]: item for item in items}


def wait_ready(
    cluster: LocalCluster, namespace: str, names: list[str], timeout: float = 120.0
) -> dict[str, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def probe() -> dict[str, dict[str, Any]] | None:
        current = services(cluster, namespace)
        for n in names:
            obj = current.get(n, {})
            seen[n] = {
                "Ready": condition(obj, "Ready"),
                "observedGeneration": (obj.get("status") or {}).get("observedGeneration"),
                "generation": obj.get("metadata", {}).get("generation"),
            }
        ok = all(
            seen[n]["Ready"].get("status") == "True"
            and seen[n]["observedGeneration"] == seen[n]["generation"]
            for n in names
        )
        return current if ok else None

    try:
        result: dict[str, dict[str, Any]] = wait_for(f"{names} Ready", probe, timeout=timeout)
    except pytest.fail.Exception as failed:  # say what was seen last, not only "None"
        pytest.fail(f"{failed}; last seen: {seen}")
    return result


def wait_condition(
    cluster: LocalCluster, namespace: str, name: str, kind: str, status: str, timeout: float = 60.0
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        obj = services(cluster, namespace).get(name, {})
        return obj if condition(obj, kind).get("status") == status else None

    result: dict[str, Any] = wait_for(f"{name} {kind}={status}", probe, timeout=timeout)
    return result


def versions(cluster: LocalCluster, namespace: str) -> dict[str, str]:
    """resourceVersion of every InferenceService and child in the namespace."""
    found = {}
    for kind in ("infsvc", "deployments", "services", "poddisruptionbudgets", "replicasets"):
        for item in get_json(cluster, "get", kind, "-n", namespace)["items"]:
            found[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return found


def test_examples_become_ready_on_matching_nodes(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator()
    documents = example_documents()
    apply_yaml(kube_cluster, kube_namespace, list(documents.values()))
    names = [doc["metadata"]["name"] for doc in documents.values()]
    ready = wait_ready(kube_cluster, kube_namespace, names)
    for doc in documents.values():
        name, spec = doc["metadata"]["name"], doc["spec"]
        status = ready[name]["status"]
        vendor = spec["accelerator"]["vendor"]
        artifact = status["artifact"]
        assert artifact["engineType"] == spec["engine"]["type"]
        assert artifact["engineVersion"] == spec["engine"]["version"]
        assert status["runner"]["name"] in ("v1", "v2") and status["runner"]["reason"]
        assert condition(ready[name], "ImageResolved")["status"] == "True"
        assert condition(ready[name], "RunnerSelected")["status"] == "True"
        deployment = get_json(kube_cluster, "get", "deployment", name, "-n", kube_namespace)
        owner = deployment["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == (
            "InferenceService",
            name,
            True,
        )
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == artifact["image"]
        assert container["command"] + container["args"] == status["engineArgs"]
        replicas = spec.get("replicas", 1)
        if vendor != "cpu":
            count = spec.get("parallelism", {}).get("tensor", 1)
            assert container["resources"]["limits"][ACCELERATOR_RESOURCE[vendor]] == str(count)
            product_label = next(iter(deployment["spec"]["template"]["spec"]["nodeSelector"]))
            assert (
                deployment["spec"]["template"]["spec"]["nodeSelector"][product_label]
                == (spec["accelerator"]["product"])
            )
        pods = get_json(
            kube_cluster,
            "get",
            "pods",
            "-n",
            kube_namespace,
            "-l",
            f"serving.davit.dev/inferenceservice={name}",
        )["items"]
        assert len(pods) == replicas, name
        for pod in pods:
            assert pod["spec"]["nodeName"].startswith(NODE_PREFIX[vendor]), (name, pod["spec"])
            assert condition(pod, "Ready")["status"] == "True"
            assert pod["status"]["podIP"].startswith("127.")
        assert status["replicaSummary"] == f"{replicas}/{replicas}"
    by_name = {doc["metadata"]["name"]: doc for doc in documents.values()}
    assert ready["qwen3-32b-vllm"]["status"]["artifact"]["tag"] == "v0.33.0rc3"
    assert ready["qwen3-32b-vllm"]["status"]["artifact"]["releaseTitle"] == "v0.33.0"
    assert ready["smollm2-cpu"]["status"]["runner"]["name"] == "v1"
    assert ready["qwen3-8b"]["status"]["runner"]["name"] == "v2"
    assert by_name["qwen3-8b"]["spec"]["replicas"] == 2
    pdb = get_json(kube_cluster, "get", "pdb", "qwen3-8b", "-n", kube_namespace)
    assert pdb["spec"]["maxUnavailable"] == 1
    table = kube_cluster.kubectl("get", "infsvc", "-n", kube_namespace).stdout
    # ENGINE is the release the spec describes; the tag (v0.33.0rc3) is in status.artifact.
    assert "vllm 0.33.0" in table and "2x NVIDIA-H200" in table and "2/2" in table


def test_runner_selection_and_refusals(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator()
    logits = {"features": {"customLogitsProcessors": ["acme.logits:NoRepeat"]}}
    vllm033 = {"engine": {"type": "vllm", "version": "0.33.0"}}
    v1_on_034 = {"engine": {"type": "vllm", "version": "0.34.0", "runner": "v1"}}
    apply_yaml(
        kube_cluster,
        kube_namespace,
        [
            isvc("plain", H200_SPEC),
            isvc("logits-davit", merge(H200_SPEC, logits)),
            isvc("logits-vllm", merge(merge(H200_SPEC, logits), vllm033)),
            isvc("v1-vllm-034", merge(H200_SPEC, v1_on_034)),
            isvc(
                "cuda129-vllm",
                merge(H200_SPEC, {"engine": {**vllm033["engine"], "variant": "cuda12.9"}}),
            ),
            isvc("tp2-davit", merge(H200_SPEC, {"parallelism": {"tensor": 2}})),
            isvc("tp16-davit", merge(H200_SPEC, {"parallelism": {"tensor": 16}})),
        ],
    )
    ready = wait_ready(
        kube_cluster, kube_namespace, ["plain", "logits-davit", "logits-vllm", "tp2-davit"]
    )
    assert ready["plain"]["status"]["runner"] == {
        "name": "v2",
        "reason": "V2 is the default runner of davit 0.1.0",
    }
    fallback = ready["logits-davit"]["status"]["runner"]
    assert fallback["name"] == "v1"
    assert fallback["reason"].startswith(
        "features.customLogitsProcessors (custom logits processors) is not supported by runner V2"
    )
    assert condition(ready["logits-davit"], "RunnerSelected")["reason"] == "Fallback"
    # The Davit engine's tensor parallelism runs on its runner V1.
    assert ready["tp2-davit"]["status"]["runner"]["name"] == "v1"
    assert "tensor parallelism" in ready["tp2-davit"]["status"]["runner"]["reason"]
    # vLLM 0.33.0's runner V2 builds custom logits processors itself (its wheel says so).
    assert ready["logits-vllm"]["status"]["runner"] == {
        "name": "v2",
        "reason": "V2 is the default runner of vllm 0.33.0",
    }

    stalled = wait_condition(kube_cluster, kube_namespace, "v1-vllm-034", "Stalled", "True")
    message = condition(stalled, "Stalled")["message"]
    assert "vllm 0.34.0 no longer ships runner V1; V1 was last shipped in 0.33.0" in message
    assert condition(stalled, "RunnerSelected")["status"] == "False"
    assert condition(stalled, "Ready")["status"] == "False"

    stalled = wait_condition(kube_cluster, kube_namespace, "cuda129-vllm", "Stalled", "True")
    message = condition(stalled, "Stalled")["message"]
    assert "cuda12.9" in message and "last published in 0.32.0" in message
    assert condition(stalled, "ImageResolved")["status"] == "False"

    # The Davit engine 0.1.0 runs up to 8 GPUs per replica: refused before any pod, vLLM offered.
    stalled = wait_condition(kube_cluster, kube_namespace, "tp16-davit", "Stalled", "True")
    refusal = condition(stalled, "Stalled")
    assert refusal["reason"] == "UnsupportedByEngine"
    assert "davit 0.1.0 does not support parallelism.tensor 16 (at most 8)" in refusal["message"]
    assert "engine.type: vllm and engine.version >= 0.28.0" in refusal["message"]
    assert condition(stalled, "Ready")["status"] == "False"
    for refused in ("v1-vllm-034", "cuda129-vllm", "tp16-davit"):
        missing = kube_cluster.kubectl(
            "get", "deployment", refused, "-n", kube_namespace, check=False
        )
        assert missing.returncode != 0, "a refused spec creates no Deployment"

    events = get_json(kube_cluster, "get", "events", "-n", kube_namespace)["items"]
    warnings = {e["involvedObject"]["name"]: e["reason"] for e in events if e["type"] == "Warning"}
    assert warnings.get("v1-vllm-034") == "RunnerUnavailable"
    assert warnings.get("cuda129-vllm") == "VariantNotPublished"
    assert warnings.get("tp16-davit") == "UnsupportedByEngine"

    # Fixing the spec recovers without restarting anything.
    apply_yaml(kube_cluster, kube_namespace, [isvc("cuda129-vllm", merge(H200_SPEC, vllm033))])
    fixed = wait_ready(kube_cluster, kube_namespace, ["cuda129-vllm"])
    assert fixed["cuda129-vllm"]["status"]["artifact"]["variant"] == "cuda13.0"
    assert condition(fixed["cuda129-vllm"], "Stalled")["status"] == "False"


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("engine type", {"engine": {"type": "tgi"}}, 'Unsupported value: "tgi"'),
    ("runner", {"engine": {"runner": "v3"}}, 'Unsupported value: "v3"'),
    ("variant", {"engine": {"variant": "cuda11.8"}}, 'Unsupported value: "cuda11.8"'),
    ("vendor", {"accelerator": {"vendor": "qualcomm"}}, 'Unsupported value: "qualcomm"'),
    (
        "lm head quantization",
        {"engine": {"lmHeadQuantization": "int4"}},
        'spec.engine.lmHeadQuantization: Unsupported value: "int4"',
    ),
    ("version format", {"engine": {"version": "latest"}}, "spec.engine.version"),
    ("model scheme", {"model": {"source": "gs://bucket/model"}}, "spec.model.source"),
    ("hf revision", {"model": {"revision": None}}, "model.revision is required for hf://"),
    ("negative replicas", {"replicas": -1}, "spec.replicas"),
    ("gpu memory", {"limits": {"gpuMemoryUtilization": 1.5}}, "spec.limits.gpuMemoryUtilization"),
    ("tensor zero", {"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    (
        "count vs parallelism",
        {"accelerator": {"count": 2}, "parallelism": {"tensor": 4}},
        "accelerator.count must equal parallelism.tensor x pipeline x data",
    ),
    (
        "variant vs vendor",
        {"accelerator": {"vendor": "amd", "product": None}, "engine": {"variant": "cuda13.0"}},
        "engine.variant does not run on accelerator.vendor",
    ),
    (
        "cpu with gpus",
        {"accelerator": {"vendor": "cpu", "product": None, "count": 2}},
        "accelerator.count must be 0 or unset when accelerator.vendor is cpu",
    ),
    (
        "strict tag",
        {"engine": {"imagePolicy": "Strict", "image": "ghcr.io/davit-dev/davit-engine:0.1.0-cpu"}},
        "engine.imagePolicy Strict requires engine.image to be pinned by digest",
    ),
    (
        "owned flag",
        {"engine": {"extraArgs": ["--port=9000"]}},
        "engine.extraArgs must not set flags the operator derives",
    ),
    (
        "draft model missing",
        {"features": {"speculative": {"method": "draft_model"}}},
        "features.speculative.draftModel is required when method is draft_model",
    ),
    (
        "spec tokens",
        {"features": {"speculative": {"method": "ngram", "numSpeculativeTokens": 64}}},
        "spec.features.speculative.numSpeculativeTokens",
    ),
    (
        "fly with one token",
        {
            "features": {
                "speculative": {
                    "method": "ngram",
                    "numSpeculativeTokens": 1,
                    "verification": "FLy",
                }
            }
        },
        "features.speculative.verification FLy needs numSpeculativeTokens >= 2",
    ),
    (
        "fly params under strict",
        {"features": {"speculative": {"method": "ngram", "fly": {"windowSize": 1}}}},
        "features.speculative.fly only applies to verification FLy",
    ),
    (
        "fly window too wide",
        {
            "features": {
                "speculative": {
                    "method": "ngram",
                    "numSpeculativeTokens": 3,
                    "verification": "FLy",
                    "fly": {"windowSize": 3},
                }
            }
        },
        "features.speculative.fly.windowSize must be below numSpeculativeTokens",
    ),
    (
        "elastic without ep",
        {"parallelism": {"expert": {"elastic": True}}},
        "parallelism.expert.elastic requires parallelism.expert.enabled: true",
    ),
    (
        "batched tokens",
        {"limits": {"maxNumSeqs": 256, "maxNumBatchedTokens": 128}},
        "limits.maxNumBatchedTokens must be at least limits.maxNumSeqs",
    ),
    (
        "sequence parallel tp1",
        {"parallelism": {"sequenceParallelism": True}},
        "parallelism.sequenceParallelism shards along the tensor-parallel group",
    ),
    (
        "gpu via resources",
        {"pod": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
        "pod.resources cannot request accelerators",
    ),
    ("missing engine", {"engine": None}, "spec.engine: Required value"),
    (
        "toleration value with Exists",
        {"pod": {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}},
        "a toleration with operator Exists matches any value",
    ),
    (
        "gpu memory on cpu",
        {
            "accelerator": {"vendor": "cpu", "product": None},
            "limits": {"gpuMemoryUtilization": 0.5},
        },
        "limits.gpuMemoryUtilization applies to GPU memory",
    ),
    (
        "gguf outside pvc",
        {"model": {"file": "model.gguf"}},
        "model.file names a file on a volume and needs a pvc:// source",
    ),
]


def test_invalid_specs_are_refused_by_the_api_server(
    kube_cluster: LocalCluster, kube_namespace: str, isvc_crd: str
) -> None:
    assert len(INVALID) >= 15
    failures = []
    for label, overrides, expected in INVALID:
        document = isvc("bad", merge(H200_SPEC, overrides))
        result = kube_cluster.kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "-n",
            kube_namespace,
            "-f",
            "-",
            input=json.dumps(document),
            check=False,
        )
        if result.returncode == 0 or expected not in result.stderr:
            failures.append(f"{label}: rc={result.returncode} stderr={result.stderr.strip()}")
    long_name = isvc("x" * 64, H200_SPEC)
    result = kube_cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=json.dumps(long_name),
        check=False,
    )
    if result.returncode == 0 or "metadata.name" not in result.stderr:
        failures.append(f"long name: {result.stderr.strip()}")
    unknown = isvc("bad", merge(H200_SPEC, {"engine": {"flavour": "x"}}))
    result = kube_cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=json.dumps(unknown),
        check=False,
    )
    if (
        result.returncode == 0
        or ".spec.engine.flavour: field not declared in schema" not in result.stderr
    ):
        failures.append(f"unknown field: {result.stderr.strip()}")
    ok = kube_cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=json.dumps(isvc("good", H200_SPEC)),
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert failures == []


def test_more_gpus_than_any_node_explains_itself(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator()
    apply_yaml(
        kube_cluster,
        kube_namespace,
        # vLLM: the Davit engine 0.1.0 refuses more than 8 ranks before placement.
        [
            isvc(
                "huge",
                merge(
                    H200_SPEC,
                    {
                        "engine": {"type": "vllm", "version": "0.33.0"},
                        "parallelism": {"tensor": 16},
                    },
                ),
            )
        ],
    )
    obj = wait_condition(kube_cluster, kube_namespace, "huge", "Stalled", "True")
    stalled = condition(obj, "Stalled")
    assert stalled["reason"] == "NoNodeFits"
    assert (
        "one replica needs 16 nvidia.com/gpu but the largest matching node offers 8"
        in stalled["message"]
    )
    assert condition(obj, "Schedulable")["status"] == "False"
    assert condition(obj, "Ready")["status"] == "False"
    # The Deployment still exists (a cluster autoscaler could act on its pending pod).
    pods = wait_for(
        "a pending pod",
        lambda: get_json(
            kube_cluster,
            "get",
            "pods",
            "-n",
            kube_namespace,
            "-l",
            "serving.davit.dev/inferenceservice=huge",
        )["items"],
        timeout=30,
    )
    assert all(p["status"].get("phase") == "Pending" for p in pods)


def test_idle_reconciles_write_nothing_and_restart_converges(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    operator = start_operator(drift_interval=1.0)
    apply_yaml(
        kube_cluster,
        kube_namespace,
        [isvc("a", merge(H200_SPEC, {"replicas": 2})), isvc("b", CPU_SPEC)],
    )
    wait_ready(kube_cluster, kube_namespace, ["a", "b"])
    time.sleep(2)  # let the last status patch and watch events settle
    before = versions(kube_cluster, kube_namespace)
    writes = operator.metric("davit_operator_child_writes_total")
    status_writes = operator.metric("davit_operator_status_writes_total")
    ticks = operator.metric("davit_operator_reconcile_total", trigger="timer")
    time.sleep(12)
    assert operator.metric("davit_operator_reconcile_total", trigger="timer") >= ticks + 10
    assert versions(kube_cluster, kube_namespace) == before
    assert operator.metric("davit_operator_child_writes_total") == writes
    assert operator.metric("davit_operator_status_writes_total") == status_writes

    operator.stop()
    restarted = start_operator(drift_interval=1.0)
    wait_for(
        "resume handlers",
        lambda: restarted.metric("davit_operator_reconcile_total", trigger="resume") >= 2,
        timeout=30,
    )
    time.sleep(3)
    assert versions(kube_cluster, kube_namespace) == before
    assert restarted.metric("davit_operator_child_writes_total") == 0


def test_drift_is_repaired_and_updates_roll_out(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator(drift_interval=1.0)
    apply_yaml(kube_cluster, kube_namespace, [isvc("svc", merge(H200_SPEC, {"replicas": 2}))])
    wait_ready(kube_cluster, kube_namespace, ["svc"])
    kube_cluster.kubectl(
        "set", "image", "deployment/svc", "engine=someone/else:latest", "-n", kube_namespace
    )

    def image() -> str:
        dep = get_json(kube_cluster, "get", "deployment", "svc", "-n", kube_namespace)
        return str(dep["spec"]["template"]["spec"]["containers"][0]["image"])

    wait_for(
        "the image restored",
        lambda: image() == "ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0",
        timeout=30,
    )

    apply_yaml(
        kube_cluster,
        kube_namespace,
        [isvc("svc", merge(H200_SPEC, {"replicas": 1, "limits": {"maxModelLen": 4096}}))],
    )
    ready = wait_ready(kube_cluster, kube_namespace, ["svc"])
    assert ready["svc"]["status"]["observedGeneration"] == 2
    assert "--max-model-len" in ready["svc"]["status"]["engineArgs"]
    wait_for(
        "the PodDisruptionBudget removed",
        lambda: (
            kube_cluster.kubectl("get", "pdb", "svc", "-n", kube_namespace, check=False).returncode
            != 0
        ),
        timeout=30,
    )
    dep = get_json(kube_cluster, "get", "deployment", "svc", "-n", kube_namespace)
    assert dep["spec"]["replicas"] == 1
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-model-len") + 1] == "4096"

    # A spec error stalls but leaves the running Deployment alone.
    apply_yaml(
        kube_cluster,
        kube_namespace,
        [
            isvc(
                "svc",
                merge(
                    H200_SPEC,
                    {"engine": {"type": "vllm", "version": "0.33.0", "variant": "cuda12.9"}},
                ),
            )
        ],
    )
    stalled = wait_condition(kube_cluster, kube_namespace, "svc", "Stalled", "True")
    assert stalled["status"]["observedGeneration"] == 3
    assert image() == "ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0"
    assert stalled["status"]["artifact"]["engineType"] == "davit"


def test_killed_mid_reconcile_converges_without_duplicates(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    operator = start_operator()
    names = [f"svc-{i}" for i in range(12)]
    apply_yaml(kube_cluster, kube_namespace, [isvc(n, CPU_SPEC) for n in names])
    wait_for(
        "some children",
        lambda: get_json(kube_cluster, "get", "deployments", "-n", kube_namespace)["items"],
        timeout=30,
        interval=0.05,
    )
    operator.stop(signal.SIGKILL)
    at_kill = services(kube_cluster, kube_namespace)
    ready_at_kill = sum(condition(o, "Ready").get("status") == "True" for o in at_kill.values())
    assert ready_at_kill < len(names), "the kill must interrupt the work, not follow it"
    start_operator()
    wait_ready(kube_cluster, kube_namespace, names)
    deployments = get_json(kube_cluster, "get", "deployments", "-n", kube_namespace)["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == sorted(names)
    assert len(get_json(kube_cluster, "get", "services", "-n", kube_namespace)["items"]) == len(
        names
    )
    replicasets = get_json(kube_cluster, "get", "replicasets", "-n", kube_namespace)["items"]
    assert len(replicasets) == len(names), (
        "one template per service: nothing was applied twice differently"
    )
    pods = get_json(kube_cluster, "get", "pods", "-n", kube_namespace)["items"]
    assert len(pods) == len(names)


def test_deleting_the_service_collects_its_children(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator()
    apply_yaml(kube_cluster, kube_namespace, [isvc("gone", merge(CPU_SPEC, {"replicas": 2}))])
    wait_ready(kube_cluster, kube_namespace, ["gone"])
    assert (
        kube_cluster.kubectl("get", "pdb", "gone", "-n", kube_namespace, check=False).returncode
        == 0
    )
    kube_cluster.kubectl("delete", "infsvc", "gone", "-n", kube_namespace, "--timeout=60s")

    def children_left() -> list[str]:
        out = kube_cluster.kubectl(
            "get",
            "deployments,services,poddisruptionbudgets,pods",
            "-n",
            kube_namespace,
            "-l",
            "serving.davit.dev/inferenceservice=gone",
            "-o",
            "name",
        ).stdout.split()
        return out

    wait_for("garbage collection", lambda: not children_left() or None, timeout=60)


def test_child_refused_by_the_api_server_stalls_with_its_message(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    start_operator()
    # valueFrom is passed through untyped; the Deployment's own schema refuses this one.
    bad_env = {"pod": {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"key": "t"}}}]}}
    apply_yaml(kube_cluster, kube_namespace, [isvc("badenv", merge(CPU_SPEC, bad_env))])
    obj = wait_condition(kube_cluster, kube_namespace, "badenv", "Stalled", "True")
    stalled = condition(obj, "Stalled")
    assert stalled["reason"] == "ChildRejected"
    assert "deployments/badenv" in stalled["message"]
    assert "env[1].valueFrom.secretKeyRef.name" in stalled["message"]


def test_cluster_wide_operator_serves_any_namespace(
    kube_cluster: LocalCluster, kube_namespace: str, start_operator: StartOperator
) -> None:
    operator = start_operator(all_namespaces=True)
    apply_yaml(kube_cluster, kube_namespace, [isvc("anywhere", CPU_SPEC)])
    ready = wait_ready(kube_cluster, kube_namespace, ["anywhere"])
    assert ready["anywhere"]["status"]["url"] == f"http://anywhere.{kube_namespace}.svc:8000/v1"
    assert operator.metric("davit_operator_child_writes_total", kind="Deployment") == 1
