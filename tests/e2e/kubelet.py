"""A kubelet stand-in that runs real `davit serve` processes for the pods bound to its node.

KWOK plays the kubelet of the fake GPU nodes but runs nothing: its pods are Ready at once and
vanish at once when deleted. Rollout tests need the real thing on both ends: a replica counts as
ready only when its engine answers `/ready`, and a deleted replica goes through pre-stop delay,
SIGTERM, the engine's drain and the grace period before it disappears. So this stand-in
registers its own Node (not annotated for KWOK, so KWOK leaves it alone), keeps its Lease fresh,
and for every pod scheduled onto it:

- assigns a loopback pod IP (127.65.x.y), marks the pod Running, and starts the container's own
  command line with the container's environment, the pod IP in place of `--host 0.0.0.0`, and
  every path under a volume mount mapped to the volume's host directory (a PersistentVolume's
  hostPath for a PVC, a private temporary directory for an emptyDir);
- runs the container's readiness probe (HTTP GET on the pod IP) and reports `Ready` in the pod's
  status, as the kubelet does;
- on deletion: the pre-stop sleep, SIGTERM, up to the termination grace period for the process
  to exit (the engine drains in between), SIGKILL after it, then removes the pod object;
- for a pod with `restartPolicy: Never` (a Job's), reports the exit as the kubelet does: phase
  Succeeded or Failed, the exit code, and the termination message the process wrote to its
  `terminationMessagePath` (a file of its own here, passed where the command names that path);
- resolves `env[].valueFrom.secretKeyRef` from the Secret, as the kubelet does.

The container image is not pulled: the process is the locally installed engine, which is the
one these tests exercise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 5.0
POLL_SECONDS = 0.3


def cpu_engine_limits() -> dict[str, Any]:
    """`spec.limits` for the CPU engines this kubelet runs (a new dict: tests change fields).

    An explicit KV size: no memory search at startup, 64 MiB instead of gigabytes per engine on
    a shared CPU machine. A 256-token step budget (the tests' prompts are under 64 tokens): the
    startup profile's dummy forward of a full step takes about 1 s on two cores instead of 8 s
    at the default 2,048, in every engine start."""
    return {"kvCacheMemoryBytes": 64 << 20, "maxNumBatchedTokens": 256}


def host_path_claim(
    pv: str, namespace: str, claim: str, path: Path, size: str, access_mode: str
) -> list[dict[str, Any]]:
    """A PersistentVolume on a host folder (this stand-in mounts hostPath volumes as they are)
    bound in advance to the claim `claim` in `namespace`, and that claim."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": [access_mode],
                "storageClassName": "",
                "hostPath": {"path": str(path)},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": [access_mode],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": size}},
            },
        },
    ]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    """One pod's engine process and what the kubelet knows about it."""

    namespace: str
    name: str
    uid: str
    ip: str
    process: subprocess.Popen[bytes]
    log_path: Path
    scratch: Path
    readiness: tuple[str, int] | None
    termination_log: Path | None = None
    run_once: bool = False  # restartPolicy Never: the exit is final (Succeeded / Failed)
    ready: bool = False
    terminating: bool = False
    next_probe: float = 0.0
    exited: threading.Event = field(default_factory=threading.Event)


class EngineKubelet:
    """Acts as the kubelet of one node; `start()` registers it, `stop()` kills every process."""

    def __init__(
        self,
        kubeconfig: Path,
        node_name: str,
        log_dir: Path,
        ip_prefix: str = "127.65",
    ) -> None:
        self.node_name = node_name
        self.log_dir = log_dir
        self.api = k8s_config.new_client_from_config(str(kubeconfig))
        # Untyped on purpose: pod fields read here are always set for a scheduled pod.
        self.core: Any = k8s.CoreV1Api(self.api)
        self.coordination: Any = k8s.CoordinationV1Api(self.api)
        self._ips = (f"{ip_prefix}.{i // 250}.{i % 250 + 2}" for i in itertools.count(1))
        self.containers: dict[str, Container] = {}
        self.terminated: list[tuple[str, int | None, float]] = []  # pod, exit code, seconds
        self.errors: list[str] = []
        self._terminations: list[threading.Thread] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # --- node ----------------------------------------------------------------------------

    def start(self) -> EngineKubelet:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "davit.dev/e2e-kubelet": "true",
        }
        try:
            self.core.create_node(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": self.node_name, "labels": labels},
                }
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._heartbeat()
        for target in (self._heartbeat_loop, self._pod_loop):
            thread = threading.Thread(target=target, name=f"kubelet-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _node_status(self) -> dict[str, Any]:
        now = _now()
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
        return {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "engine kubelet stand-in",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "v1.35.0",
                    "kubeProxyVersion": "",
                    "containerRuntimeVersion": "process://",
                    "osImage": "",
                    "kernelVersion": "",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
            }
        }

    def _heartbeat(self) -> None:
        self.core.patch_node_status(self.node_name, self._node_status())
        lease_body = {
            "metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            },
        }
        try:
            self.coordination.patch_namespaced_lease(self.node_name, "kube-node-lease", lease_body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", lease_body)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._heartbeat()
            except ApiException:
                continue  # the next beat retries; the lease lasts LEASE_SECONDS

    # --- pods ----------------------------------------------------------------------------

    def _pod_loop(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={self.node_name}"
                ).items
            except ApiException:
                time.sleep(POLL_SECONDS)
                continue
            seen = set()
            for pod in pods:
                key = f"{pod.metadata.namespace}/{pod.metadata.name}"
                seen.add(key)
                try:
                    self._sync(key, pod)
                except ApiException as exc:
                    # A pod changed or went meanwhile: the next pass sees its new state.
                    self.errors.append(f"{key}: {exc.status} {exc.reason}")
            with self._lock:
                gone = [k for k in self.containers if k not in seen]
            for key in gone:
                self._kill(key)
            time.sleep(POLL_SECONDS)

    def _sync(self, key: str, pod: Any) -> None:
        with self._lock:
            container = self.containers.get(key)
        if pod.metadata.deletion_timestamp is not None:
            if container is None:
                self._remove(pod)
            elif not container.terminating:
                container.terminating = True
                thread = threading.Thread(
                    target=self._terminate, args=(key, container, pod), daemon=True
                )
                self._terminations.append(thread)
                thread.start()
            return
        if container is None:
            if pod.status.phase in ("Succeeded", "Failed"):
                return
            self._run(key, pod)
            return
        if container.process.poll() is not None:
            phase = "Failed"
            if container.run_once and container.process.returncode == 0:
                phase = "Succeeded"
            if container.ready or pod.status.phase != phase:
                container.ready = False
                self._patch_status(pod, container, ready=False, phase=phase)
            return
        if time.monotonic() >= container.next_probe and container.readiness is not None:
            container.next_probe = time.monotonic() + 1.0
            path, port = container.readiness
            try:
                ok = (
                    httpx.get(f"http://{container.ip}:{port}{path}", timeout=2.0).status_code == 200
                )
            except httpx.HTTPError:
                ok = False
            if ok != container.ready:
                container.ready = ok
                self._patch_status(pod, container, ready=ok)

    def _run(self, key: str, pod: Any) -> None:
        spec = pod.spec.containers[0]
        ip = next(self._ips)
        scratch = Path(tempfile.mkdtemp(prefix=f"pod-{pod.metadata.name}-"))
        mounts = self._mount_map(pod, scratch)
        argv = [self._map(arg, mounts) for arg in [*(spec.command or []), *(spec.args or [])]]
        argv = [ip if a == "0.0.0.0" else a for a in argv]
        termination_log = None
        if spec.termination_message_path:
            termination_log = scratch / "termination-log"
            argv = [str(termination_log) if a == spec.termination_message_path else a for a in argv]
        # The "image" is the environment the tests run in: its scripts (`davit`) come first,
        # whether or not that environment is activated.
        path = os.pathsep.join(
            [os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")]
        )
        if argv and shutil.which(argv[0], path=path):
            argv[0] = str(shutil.which(argv[0], path=path))
        env = {"PATH": path, "HOME": str(scratch)}
        for var in spec.env or []:
            if var.value is not None:
                env[var.name] = self._map(var.value, mounts)
            elif var.value_from is not None and var.value_from.secret_key_ref is not None:
                value = self._secret_value(pod.metadata.namespace, var.value_from.secret_key_ref)
                if value is not None:
                    env[var.name] = value
        log_path = self.log_dir / f"{pod.metadata.namespace}.{pod.metadata.name}.log"
        log = log_path.open("ab")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        readiness = None
        probe = spec.readiness_probe
        if probe is not None and probe.http_get is not None:
            port = probe.http_get.port
            if isinstance(port, str):
                port = next(p.container_port for p in spec.ports if p.name == port)
            readiness = (probe.http_get.path, int(port))
        container = Container(
            namespace=pod.metadata.namespace,
            name=pod.metadata.name,
            uid=pod.metadata.uid,
            ip=ip,
            process=process,
            log_path=log_path,
            scratch=scratch,
            readiness=readiness,
            termination_log=termination_log,
            run_once=pod.spec.restart_policy == "Never",
        )
        with self._lock:
            self.containers[key] = container
        self._patch_status(pod, container, ready=False)

    def _secret_value(self, namespace: str, ref: Any) -> str | None:
        """A Secret key's value; None for a missing optional one (a required one that is
        missing raises, and the pod is retried on the next pass, as the kubelet does)."""
        import base64

        try:
            secret = self.core.read_namespaced_secret(ref.name, namespace)
        except ApiException as exc:
            if exc.status == 404 and ref.optional:
                return None
            raise
        data = secret.data or {}
        if ref.key not in data:
            if ref.optional:
                return None
            raise ApiException(status=404, reason=f"secret {ref.name} has no key {ref.key}")
        return base64.b64decode(data[ref.key]).decode()

    def _mount_map(self, pod: Any, scratch: Path) -> list[tuple[str, str]]:
        """(mount path, host directory) for every volume mount, longest path first."""
        volumes = {v.name: v for v in pod.spec.volumes or []}
        mapping = []
        for mount in pod.spec.containers[0].volume_mounts or []:
            volume = volumes[mount.name]
            if volume.persistent_volume_claim is not None:
                claim = self.core.read_namespaced_persistent_volume_claim(
                    volume.persistent_volume_claim.claim_name, pod.metadata.namespace
                )
                pv = self.core.read_persistent_volume(claim.spec.volume_name)
                host = pv.spec.host_path.path
            else:
                host = str(scratch / mount.name)
                Path(host).mkdir(parents=True, exist_ok=True)
            mapping.append((mount.mount_path.rstrip("/"), host))
        return sorted(mapping, key=lambda m: -len(m[0]))

    @staticmethod
    def _map(value: str, mounts: list[tuple[str, str]]) -> str:
        for mount_path, host in mounts:
            if value == mount_path or value.startswith(mount_path + "/"):
                return host + value[len(mount_path) :]
        return value

    def _patch_status(
        self, pod: Any, container: Container, *, ready: bool, phase: str = "Running"
    ) -> None:
        now = _now()
        flag = "True" if ready else "False"
        spec = pod.spec.containers[0]
        state: dict[str, Any] = {"running": {"startedAt": now}}
        if phase in ("Failed", "Succeeded"):
            code = container.process.returncode
            # A signal ends a container with 128 + its number, as a container runtime reports.
            exit_code = 128 - code if code is not None and code < 0 else code
            terminated: dict[str, Any] = {
                "exitCode": exit_code if exit_code is not None else 1,
                "finishedAt": now,
                "reason": "Completed" if phase == "Succeeded" else "Error",
            }
            if container.termination_log is not None and container.termination_log.is_file():
                terminated["message"] = container.termination_log.read_text(errors="replace")[
                    -4096:
                ]
            state = {"terminated": terminated}
        body = {
            "status": {
                "phase": phase,
                "hostIP": "127.0.0.1",
                "podIP": container.ip,
                "podIPs": [{"ip": container.ip}],
                "startTime": pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ")
                if pod.status.start_time
                else now,
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                    {"type": "Ready", "status": flag, "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": spec.name,
                        "image": spec.image,
                        "imageID": "",
                        "ready": ready,
                        "restartCount": 0,
                        "started": phase == "Running",
                        "state": state,
                    }
                ],
            }
        }
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def _terminate(self, key: str, container: Container, pod: Any) -> None:
        """Pre-stop, SIGTERM, grace period, SIGKILL, then the pod object goes."""
        started = time.monotonic()
        grace = pod.spec.termination_grace_period_seconds or 30
        lifecycle = pod.spec.containers[0].lifecycle
        pre_stop = 0
        if lifecycle is not None and lifecycle.pre_stop is not None and lifecycle.pre_stop.sleep:
            pre_stop = lifecycle.pre_stop.sleep.seconds
        time.sleep(min(pre_stop, grace))
        if container.process.poll() is None:
            container.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = container.process.wait(
                timeout=max(grace - (time.monotonic() - started), 0.1)
            )
        except subprocess.TimeoutExpired:
            container.process.kill()
            container.process.wait()
            code = None  # killed at the end of the grace period
        self.terminated.append((key, code, time.monotonic() - started))
        container.exited.set()
        with self._lock:
            self.containers.pop(key, None)
        shutil.rmtree(container.scratch, ignore_errors=True)
        self._remove(pod)

    def _remove(self, pod: Any) -> None:
        try:
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                grace_period_seconds=0,
                body=k8s.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=pod.metadata.uid)
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
        except urllib3.exceptions.HTTPError:
            if not self._stop.is_set():
                raise  # the API server only goes away after stop()

    def _kill(self, key: str) -> None:
        with self._lock:
            container = self.containers.pop(key, None)
        if container is not None and container.process.poll() is None:
            container.process.kill()
            container.process.wait()
            shutil.rmtree(container.scratch, ignore_errors=True)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            keys = list(self.containers)
        for key in keys:
            self._kill(key)
        for thread in [*self._threads, *self._terminations]:
            thread.join(timeout=10)
        try:
            self.core.delete_node(self.node_name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        self.api.close()
