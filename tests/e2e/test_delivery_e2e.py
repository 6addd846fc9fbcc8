"""Model delivery end to end: the operator fetches hf:// and s3:// models once into a cache
claim with a fetch Job, gates the replicas on it, and keeps serving through failed fetches.

Real parts: the local control plane (its Job controller runs the fetch Jobs' retries and pod
failure policy), the engine kubelet stand-in running `davit fetch` and `davit serve` as
processes, olah serving SmolLM2-135M-Instruct (safetensors, weights in Git LFS) offline from a
local git mirror, versitygw serving the same files over S3 with SigV4 credentials. The cache
claim is a hostPath PersistentVolume the stand-in maps into every pod.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import yaml

from davit_operator.api.crdgen import default_crd_path

from .kubelet import EngineKubelet, cpu_engine_limits, host_path_claim
from .model_store import REPO_ID, smollm2_safetensors
from .sources import HubMirror, S3Server, free_port
from .waiting import wait_until

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODE = "engine-kubelet-delivery"
CACHE_CLAIM = "model-cache"
HF_TOKEN = "hf_e2eDeliveryToken7Qm2Xv9LrT4w"
BAD_S3_SECRET = "wrong-secret-e2e-Zr8Kp3Nq6Vb1"
# Slow enough for the test to see the progress and kill a fetch halfway (270 MB in ~10 s).
FETCH_RATE = 25_000_000


@dataclass
class Delivery:
    cluster: LocalCluster
    namespace: str
    kubelet: EngineKubelet
    hub: HubMirror
    s3: S3Server
    logs: Path

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-n", self.namespace, "-o", "json").stdout)

    def apply(self, doc: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "apply", "--server-side", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(doc)
        )

    def isvc(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.kubectl_json("get", "infsvc", name)
        return obj

    def wait(self, what: str, probe: Callable[[], Any], timeout: float) -> Any:
        return wait_until(what, probe, timeout, self.logs / "operator.log")

    def fetch_jobs(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.kubectl_json(
            "get", "jobs", "-l", "app.kubernetes.io/component=model-fetch"
        )["items"]
        return items

    def fetch_pods_started(self, job: str) -> int:
        """Fetch processes the stand-in started for `job` (running, finished or killed)."""
        prefix = f"{self.namespace}/{job}-"
        logs = list(self.logs.glob(f"{self.namespace}.{job}-*.log"))
        running = [k for k in self.kubelet.containers if k.startswith(prefix)]
        return max(len(logs), len(running))


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


def spec(
    source: str, revision: str, replicas: int = 1, secret: str | None = None
) -> dict[str, Any]:
    model: dict[str, Any] = {"source": source, "revision": revision, "servedName": "smol"}
    if secret:
        model["credentialsSecret"] = secret
    return {
        "model": model,
        "engine": {"type": "davit", "version": "0.1.0"},
        "limits": cpu_engine_limits(),
        "accelerator": {"vendor": "cpu"},
        "replicas": replicas,
        "pod": {"nodeSelector": {"kubernetes.io/hostname": NODE}},
        "rollout": {"strategy": "Rolling", "drainSeconds": 2, "progressDeadlineSeconds": 600},
    }


def document(name: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": body,
    }


def ready_pod_ips(env: Delivery, name: str) -> list[str]:
    pods = env.kubectl_json("get", "pods", "-l", f"serving.davit.dev/inferenceservice={name}")
    ips = []
    for pod in pods["items"]:
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
        ):
            ips.append(status["podIP"])
    return ips


def chat(ip: str) -> str:
    """One greedy chat completion from the replica at `ip`, through the official client."""
    client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=120)
    try:
        completion = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
    finally:
        client.close()
    return str(completion.choices[0].message.content)


def template_revision(env: Delivery, name: str) -> str:
    dep = env.kubectl_json("get", "deployment", name)
    return str(dep["metadata"]["annotations"]["serving.davit.dev/revision"])


@pytest.fixture(scope="module")
def env(kube_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Delivery]:
    model_dir = smollm2_safetensors()
    work = tmp_path_factory.mktemp("delivery")
    logs = work / "logs"
    logs.mkdir()
    hub = HubMirror(model_dir, work / "hub").start()
    s3 = S3Server(work / "s3").start()
    s3.upload("models", "smollm2/v1", model_dir)
    cache_dir = work / "cache"
    cache_dir.mkdir()
    namespace = f"e2e-delivery-{uuid.uuid4().hex[:6]}"
    pv = f"{namespace}-cache"
    kube_cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(default_crd_path())
    )
    kube_cluster.wait_established("crd/inferenceservices.serving.davit.dev")
    kube_cluster.kubectl("create", "namespace", namespace)
    objects = host_path_claim(pv, namespace, CACHE_CLAIM, cache_dir, "10Gi", "ReadWriteMany")
    kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    for secret, data in {
        "hf-creds": {"HF_TOKEN": HF_TOKEN},
        "s3-creds": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
        "s3-bad": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": BAD_S3_SECRET},
    }.items():
        kube_cluster.kubectl(
            "create",
            "secret",
            "generic",
            secret,
            "-n",
            namespace,
            *(f"--from-literal={k}={v}" for k, v in data.items()),
        )
    deadline = time.monotonic() + 60
    while kube_cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode:
        assert time.monotonic() < deadline, "no default ServiceAccount"
        time.sleep(0.2)
    kubelet = EngineKubelet(kube_cluster.kubeconfig, NODE, logs).start()
    liveness = free_port()
    operator_log = (logs / "operator.log").open("ab")
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "davit_cli",
            "operator",
            "--namespace",
            namespace,
            "--kubeconfig",
            str(kube_cluster.kubeconfig),
            "--metrics-port",
            str(free_port()),
            "--liveness",
            f"http://127.0.0.1:{liveness}/healthz",
            "--drift-interval",
            "1",
            "--no-memory-profiling",
            "--model-cache",
            CACHE_CLAIM,
            "--hf-endpoint",
            hub.endpoint,
            "--s3-endpoint",
            s3.endpoint,
            "--fetch-max-bytes-per-second",
            str(FETCH_RATE),
        ],
        stdout=operator_log,
        stderr=subprocess.STDOUT,
    )
    delivery = Delivery(kube_cluster, namespace, kubelet, hub, s3, logs)
    try:
        delivery.wait(
            "operator live",
            lambda: _live(f"http://127.0.0.1:{liveness}/healthz") or operator.poll() is not None,
            60,
        )
        assert operator.poll() is None, (logs / "operator.log").read_text()
        yield delivery
    finally:
        kube_cluster.kubectl(
            "delete", "infsvc", "--all", "-n", namespace, "--wait=false", check=False
        )
        deadline = time.monotonic() + 30
        while delivery.kubectl_json("get", "infsvc")["items"] and time.monotonic() < deadline:
            time.sleep(0.5)
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
        operator_log.close()
        kubelet.stop()
        hub.stop()
        s3.stop()
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        kube_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def _live(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_ready(env: Delivery, name: str, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        obj = env.isvc(name)
        ok = (
            condition(obj, "Ready").get("status") == "True"
            and condition(obj, "ModelReady").get("status") == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            and (obj["status"].get("rollout") or {}).get("phase") == "Complete"
        )
        return obj if ok else None

    result: dict[str, Any] = env.wait(f"{name} Ready", probe, timeout)
    return result


def test_two_replicas_get_one_fetch_then_serve(env: Delivery) -> None:
    env.apply(document("smol", spec(f"hf://{REPO_ID}", "main", replicas=2, secret="hf-creds")))
    fetching = env.wait(
        "ModelReady=False while fetching",
        lambda: (
            condition(env.isvc("smol"), "ModelReady").get("reason") in ("Fetching", "Fetched")
            and env.isvc("smol")
        ),
        120,
    )
    assert condition(fetching, "ModelReady")["reason"] in ("Fetching", "Fetched")
    obj = wait_ready(env, "smol", 600)
    model = obj["status"]["model"]
    assert model["state"] == "Present" and model["cache"] == CACHE_CLAIM
    assert model["commit"] == env.hub.commits["main"]
    assert model["bytesDone"] == model["bytesTotal"] > 250_000_000
    jobs = env.fetch_jobs()
    assert len(jobs) == 1, [j["metadata"]["name"] for j in jobs]
    job = jobs[0]["metadata"]["name"]
    assert env.fetch_pods_started(job) == 1
    # The replicas mount the cache read-only and run offline.
    pod = env.kubectl_json("get", "deployment", "smol")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model-store")
    assert volume["persistentVolumeClaim"] == {"claimName": CACHE_CLAIM, "readOnly": True}
    container = pod["containers"][0]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    assert any(m["name"] == "model-store" and m["readOnly"] for m in container["volumeMounts"])
    # Only the files the engine needs were fetched.
    record = json.loads(env.kubectl_json("get", "configmap", job)["data"]["result.json"])
    assert record["bytes_fetched"] == record["bytes_total"] == model["bytesTotal"], record
    files = {f["path"] for f in record["files"]}
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert "README.md" not in files and not any(f.startswith("onnx/") for f in files)
    ips = ready_pod_ips(env, "smol")
    assert len(ips) == 2
    assert "Paris" in chat(ips[0])


def test_second_service_of_the_same_revision_fetches_nothing(env: Delivery) -> None:
    before = {j["metadata"]["name"] for j in env.fetch_jobs()}
    env.apply(document("smol-b", spec(f"hf://{REPO_ID}", "main")))
    obj = env.wait(
        "smol-b ModelReady",
        lambda: (
            (o := env.isvc("smol-b")) and condition(o, "ModelReady").get("status") == "True" and o
        ),
        60,
    )
    assert obj["status"]["model"]["state"] == "Present"
    assert {j["metadata"]["name"] for j in env.fetch_jobs()} == before
    (job,) = before
    assert env.fetch_pods_started(job) == 1
    env.wait("smol-b Deployment", lambda: env.kubectl_json("get", "deployments")["items"], 30)
    env.cluster.kubectl("delete", "infsvc", "smol-b", "-n", env.namespace, "--wait=false")


def test_killed_fetch_resumes(env: Delivery) -> None:
    env.apply(document("smol-s3", spec("s3://models/smollm2/v1", "r1", secret="s3-creds")))

    def halfway() -> dict[str, Any] | None:
        model = (env.isvc("smol-s3").get("status") or {}).get("model") or {}
        total = model.get("bytesTotal") or 0
        done = model.get("bytesDone") or 0
        return model if total and 0.15 * total < done < 0.7 * total else None

    model = env.wait("the S3 fetch halfway", halfway, 120)
    job = str(model["entry"])
    key = next(k for k in env.kubelet.containers if k.startswith(f"{env.namespace}/{job}-"))
    env.kubelet.containers[key].process.send_signal(signal.SIGKILL)
    obj = env.wait(
        "smol-s3 ModelReady after the kill",
        lambda: (
            (o := env.isvc("smol-s3")) and condition(o, "ModelReady").get("status") == "True" and o
        ),
        240,
    )
    assert obj["status"]["model"]["state"] == "Present"
    result = json.loads(env.kubectl_json("get", "configmap", job)["data"]["result.json"])
    # The second pod continued the partial file: it transferred less than the whole model.
    assert 0 < result["bytes_fetched"] < result["bytes_total"], result
    assert env.fetch_pods_started(job) == 2
    env.cluster.kubectl("delete", "infsvc", "smol-s3", "-n", env.namespace, "--wait=false")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"revision": "does-not-exist"}, "RevisionNotFound"),
        ({"revision": "corrupt"}, "ChecksumMismatch"),
        (
            {"source": "s3://models/smollm2/v1", "revision": "r2", "credentialsSecret": "s3-bad"},
            "Unauthorized",
        ),
    ],
)
def test_failed_fetch_stalls_while_the_running_revision_serves(
    env: Delivery, change: dict[str, Any], reason: str
) -> None:
    before = template_revision(env, "smol")
    body = spec(f"hf://{REPO_ID}", "main", replicas=2, secret="hf-creds")
    body["model"].update(change)
    env.apply(document("smol", body))
    obj = env.wait(
        f"smol Stalled {reason}",
        lambda: (o := env.isvc("smol")) and condition(o, "Stalled").get("reason") == reason and o,
        180,
    )
    assert condition(obj, "Stalled")["status"] == "True"
    model_ready = condition(obj, "ModelReady")
    assert model_ready["status"] == "False" and model_ready["reason"] == reason
    # The message says what failed, why, and what to do about it.
    revision = change["revision"]
    assert f"revision {revision} failed ({reason})" in model_ready["message"], model_ready
    assert "delete Job davit-model-" in model_ready["message"], model_ready
    assert obj["status"]["model"]["state"] == "Failed"
    warnings = env.kubectl_json(
        "get", "events", "--field-selector", "involvedObject.name=smol,type=Warning"
    )["items"]
    assert any(e["reason"] == reason for e in warnings), [e["reason"] for e in warnings]
    # The replicas of the running revision are untouched.
    assert template_revision(env, "smol") == before
    ips = ready_pod_ips(env, "smol")
    assert len(ips) == 2 and "Paris" in chat(ips[1])


def test_revision_rollout_fetches_before_any_replica_switches(env: Delivery) -> None:
    before = template_revision(env, "smol")
    env.apply(document("smol", spec(f"hf://{REPO_ID}", "v2", replicas=2, secret="hf-creds")))

    def under_way() -> dict[str, Any] | None:
        model = (env.isvc("smol").get("status") or {}).get("model") or {}
        fetching = model.get("revision") == "v2" and model.get("state") == "Fetching"
        return model if fetching and (model.get("bytesDone") or 0) > 0 else None

    # While v2 is fetched the fleet is untouched and serving.
    model = env.wait("the v2 fetch under way", under_way, 180)
    assert model["bytesDone"] < model["bytesTotal"], model
    assert template_revision(env, "smol") == before
    ips = ready_pod_ips(env, "smol")
    assert len(ips) == 2 and "Paris" in chat(ips[0])
    entry = str(model["entry"])
    switched_early: list[str] = []

    def at_v2() -> dict[str, Any] | None:
        # The template is read before the entry's record: a template switch seen here was
        # written after the record only if the operator waits for the fetch.
        template = template_revision(env, "smol")
        recorded = (
            env.cluster.kubectl("get", "configmap", entry, "-n", env.namespace, check=False)
        ).returncode == 0
        if template != before and not recorded:
            switched_early.append(template)
        obj = env.isvc("smol")
        ok = (
            template != before
            and condition(obj, "Ready").get("status") == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            and (obj["status"].get("rollout") or {}).get("phase") == "Complete"
            and obj["status"]["model"].get("state") == "Present"
        )
        return obj if ok else None

    obj = env.wait("smol Ready at v2", at_v2, 600)
    assert not switched_early, f"the Deployment switched to {switched_early} before the fetch"
    assert obj["status"]["model"]["revision"] == "v2"
    assert obj["status"]["model"]["commit"] == env.hub.commits["v2"]
    assert obj["status"]["model"]["entry"] == entry
    result = json.loads(env.kubectl_json("get", "configmap", entry)["data"]["result.json"])
    main = next(
        json.loads(cm["data"]["result.json"])
        for cm in env.kubectl_json(
            "get", "configmaps", "-l", "app.kubernetes.io/component=model-fetch"
        )["items"]
        if json.loads(cm["data"]["result.json"]).get("revision") == "main"
    )
    # Blobs are shared across revisions: only the files v2 changed were transferred.
    known = {f["checksum"] for f in main["files"]}
    changed = {f["path"]: f["size"] for f in result["files"] if f["checksum"] not in known}
    assert set(changed) == {"model.safetensors", "generation_config.json"}, changed
    assert result["bytes_fetched"] == sum(changed.values()) < result["bytes_total"], result
    assert "Paris" in chat(ready_pod_ips(env, "smol")[0])


def test_secrets_never_show_up(env: Delivery) -> None:
    secrets = [HF_TOKEN, env.s3.secret_key, BAD_S3_SECRET]
    texts = {
        "inferenceservices": env.cluster.kubectl(
            "get", "infsvc", "-n", env.namespace, "-o", "yaml"
        ).stdout,
        "events": env.cluster.kubectl("get", "events", "-n", env.namespace, "-o", "yaml").stdout,
        "pods": env.cluster.kubectl("get", "pods", "-n", env.namespace, "-o", "yaml").stdout,
        "jobs": env.cluster.kubectl("get", "jobs", "-n", env.namespace, "-o", "yaml").stdout,
        "deployments": env.cluster.kubectl(
            "get", "deployments", "-n", env.namespace, "-o", "yaml"
        ).stdout,
        "replicasets": env.cluster.kubectl(
            "get", "replicasets", "-n", env.namespace, "-o", "yaml"
        ).stdout,
        "configmaps": env.cluster.kubectl(
            "get", "configmaps", "-n", env.namespace, "-o", "yaml"
        ).stdout,
        **{p.name: p.read_text(errors="replace") for p in env.logs.glob("*.log")},
    }
    assert "model-fetch" in texts["jobs"] and "secretKeyRef" in texts["jobs"]
    for what, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a secret value shows up in {what}"
    # The pods reached the secrets only by reference, and the fetches did use them.
    assert "secretKeyRef" in texts["pods"] and "AWS_SECRET_ACCESS_KEY" in texts["pods"]


def test_reconciles_log_nothing_at_warning_level(env: Delivery) -> None:
    """Every scenario above (fetches, two rollouts, three stalled fetches, a second service)
    went through the operator; none of its reconciles logged a warning or an error (kopf's
    "Merge-patching finished with inconsistencies" among them)."""
    log = (env.logs / "operator.log").read_text(errors="replace")
    assert "created fetch Job" in log and "Updating is processed" in log
    noisy = [
        line
        for line in log.splitlines()
        if re.search(r"\] (kopf\.objects|davit_operator\S*) +\[(WARNING|ERROR)", line)
    ]
    assert not noisy, "\n".join(noisy)
