"""The demo: local control plane up, operator running, examples applied, status shown.

`python -m davit_tools.demo` starts a temporary local control plane (KWOK fake GPU and CPU
nodes), installs the CRD, runs `davit operator` against it, applies examples plus one spec the
operator must refuse, waits for them to settle, prints what a user would look at (`kubectl get
infsvc`, an InferenceService's status, the Deployment it produced, where the pods run) and tears
everything down. Exit status 0 means every example became Ready and the refusal stalled.

The fake nodes run no containers, so the operator cannot take a memory profile there (its
profiling Job would never report): the demo runs it with `--no-memory-profiling`, and each
status shows the operator's estimate (`memoryPlan.source: estimate`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from davit_operator.api.crdgen import default_crd_path
from davit_tools.devcluster import ClusterError, LocalCluster

EXAMPLES_DIR = default_crd_path().parents[1] / "examples"
DEFAULT_EXAMPLES = ("qwen3-h200-davit.yaml", "vllm-0.33-h200.yaml", "cpu-smollm2.yaml")
NAMESPACE = "davit-demo"

# vLLM 0.34.0's only runner refuses dual-batch overlap combined with pipeline parallelism (its
# wheel's own list; catalog evidence vllm-0.34.0.json), and it no longer ships runner V1, which
# served that combination up to 0.33.0: this one must stall with that explanation.
REFUSED: dict[str, Any] = {
    "apiVersion": "serving.davit.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "dbo-pipeline-on-vllm-034"},
    "spec": {
        "model": {"source": "hf://Qwen/Qwen3-30B-A3B", "revision": "main"},
        "engine": {"type": "vllm", "version": "0.34.0"},
        "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
        "parallelism": {"pipeline": 2, "dualBatchOverlap": True, "expert": {"enabled": True}},
    },
}


def _section(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _settled(items: list[dict[str, Any]], expected: int) -> bool:
    if len(items) < expected:
        return False
    for item in items:
        conditions = {c["type"]: c["status"] for c in item.get("status", {}).get("conditions", [])}
        if conditions.get("Ready") != "True" and conditions.get("Stalled") != "True":
            return False
    return True


def run_demo(example_names: list[str], timeout: float) -> int:
    """Run the demo; returns the process exit status."""
    documents = [yaml.safe_load((EXAMPLES_DIR / name).read_text()) for name in example_names]
    documents.append(REFUSED)
    with tempfile.TemporaryDirectory(prefix="davit-demo-") as tmp:
        _section("starting the local control plane (etcd, kube-apiserver, controllers, KWOK)")
        cluster = LocalCluster(state_dir=Path(tmp) / "cluster")
        try:
            cluster.start()
        except ClusterError as err:
            print(f"demo: the local control plane did not start: {err}", file=sys.stderr)
            return 1
        operator: subprocess.Popen[bytes] | None = None
        try:
            print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout)
            _section("installing the InferenceService CRD")
            cluster.kubectl("apply", "--server-side", "-f", str(default_crd_path()))
            cluster.wait_established("crd/inferenceservices.serving.davit.dev")
            cluster.kubectl("create", "namespace", NAMESPACE)
            _section(f"running `davit operator --namespace {NAMESPACE}`")
            log = (Path(tmp) / "operator.log").open("wb")
            operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "davit_cli",
                    "operator",
                    "--namespace",
                    NAMESPACE,
                    "--kubeconfig",
                    str(cluster.kubeconfig),
                    "--metrics-port",
                    "0",
                    "--liveness",
                    "",
                    "--drift-interval",
                    "2",
                    "--no-memory-profiling",  # fake nodes: no profiling Job can report
                    "--model-cache",  # fake nodes: no fetch Job runs, the pods fetch themselves
                    "emptyDir",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            _section("kubectl apply: " + ", ".join([*example_names, "(one spec to refuse)"]))
            payload = "\n---\n".join(json.dumps(doc) for doc in documents)
            print(
                cluster.kubectl(
                    "apply", "--server-side", "-n", NAMESPACE, "-f", "-", input=payload
                ).stdout
            )
            deadline = time.monotonic() + timeout
            items: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                items = cluster.kubectl_json("get", "infsvc", "-n", NAMESPACE)["items"]
                if _settled(items, len(documents)):
                    break
                if operator.poll() is not None:
                    print("demo: the operator exited", file=sys.stderr)
                    break
                time.sleep(1)
            _section("kubectl get infsvc")
            print(cluster.kubectl("get", "infsvc", "-n", NAMESPACE).stdout)
            first = documents[0]["metadata"]["name"]
            _section(f"status of {first}")
            status = cluster.kubectl_json("get", "infsvc", first, "-n", NAMESPACE)["status"]
            print(yaml.safe_dump(status, sort_keys=False, width=100))
            _section(f"the Deployment {first} (container)")
            try:
                deployment = cluster.kubectl_json("get", "deployment", first, "-n", NAMESPACE)
            except ClusterError as err:
                print(f"no Deployment: {err}")
            else:
                container = deployment["spec"]["template"]["spec"]["containers"][0]
                shown = {
                    "image": container["image"],
                    "command": container["command"] + container["args"],
                    "resources": container["resources"],
                    "nodeSelector": deployment["spec"]["template"]["spec"].get("nodeSelector", {}),
                }
                print(yaml.safe_dump(shown, sort_keys=False, width=100))
            _section("pods and their (fake) nodes")
            print(cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout)
            _section(f"why {REFUSED['metadata']['name']} stalled")
            refused = cluster.kubectl_json(
                "get", "infsvc", REFUSED["metadata"]["name"], "-n", NAMESPACE
            )
            for cond in refused["status"]["conditions"]:
                if cond["type"] == "Stalled":
                    print(f"Stalled={cond['status']} ({cond['reason']}): {cond['message']}")
            expected_ready = {doc["metadata"]["name"] for doc in documents[:-1]}
            ready = {
                item["metadata"]["name"]
                for item in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in item["status"]["conditions"]
                )
            }
            ok = ready == expected_ready and REFUSED["metadata"]["name"] not in ready
            _section(
                "result: " + ("every example Ready, the refusal explained" if ok else "FAILED")
            )
            cluster.kubectl("delete", "infsvc", "--all", "-n", NAMESPACE, "--timeout=60s")
            return 0 if ok else 1
        finally:
            if operator is not None and operator.poll() is None:
                operator.terminate()
                operator.wait(timeout=30)
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m davit_tools.demo", description=__doc__)
    parser.add_argument(
        "examples",
        nargs="*",
        default=list(DEFAULT_EXAMPLES),
        help=f"example files in examples/ (default: {' '.join(DEFAULT_EXAMPLES)})",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to settle")
    args = parser.parse_args(argv)
    missing = [name for name in args.examples if not (EXAMPLES_DIR / name).is_file()]
    if missing:
        known = ", ".join(sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml")))
        print(f"demo: no such example {', '.join(missing)}; known: {known}", file=sys.stderr)
        return 2
    return run_demo(args.examples, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
