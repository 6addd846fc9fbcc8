"""LocalCluster: a real Kubernetes control plane on loopback, with KWOK fake nodes.

Components: etcd, kube-apiserver (Node and RBAC authorization), kube-controller-manager,
kube-scheduler and kwok (which plays the kubelet of every fake node: node heartbeats and leases,
pod readiness, completion and deletion). Every listener binds to 127.0.0.1 on a free port, pods get
addresses from 127.64.0.0/16, and all state and logs live in one state folder.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from .certs import generate_pki
from .components import (
    ADMIN,
    CLIENTS,
    FIRST_SERVICE_IP,
    LOOPBACK,
    ComponentSpec,
    Ports,
    component_specs,
    kubeconfig,
    kubeconfig_path,
)
from .nodes import DEFAULT_NODES, FakeNode
from .paths import default_bin_dir, default_stage_dir, missing_tools
from .process import (
    ClusterError,
    ProcessRecord,
    process_start_ticks,
    spawn,
    terminate,
    wait_healthy,
)

STATE_FILE = "cluster.json"
PORT_RACE_ATTEMPTS = 3


class LocalCluster:
    """A local control plane. Use as a context manager, or call ``start()`` and ``stop()``.

    ``state_dir`` holds certificates, kubeconfigs, etcd data and one log per component; when it is
    None a temporary folder is used and removed by ``stop()``. ``detached`` processes outlive this
    Python process (the CLI's ``up``); attached ones are terminated when it exits.
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        bin_dir: Path | None = None,
        *,
        nodes: Sequence[FakeNode] = DEFAULT_NODES,
        detached: bool = False,
        startup_timeout: float = 180.0,
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir is not None else default_bin_dir()
        self.stage_dir = default_stage_dir(self.bin_dir)
        self._owns_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else Path()
        self.nodes = tuple(nodes)
        self.detached = detached
        self.startup_timeout = startup_timeout
        self.startup_seconds: float | None = None
        self._server: str | None = None
        self._kubeconfig: Path | None = None
        self._records: list[ProcessRecord] = []
        self._children: list[subprocess.Popen[bytes]] = []
        self._owns_processes = True

    # ---- construction from an existing cluster -------------------------------------------------

    @classmethod
    def connect(cls, kubeconfig: Path, bin_dir: Path | None = None) -> LocalCluster:
        """A handle on an already running cluster; ``stop()`` leaves it running."""
        kubeconfig = Path(kubeconfig)
        if not kubeconfig.is_file():
            raise ClusterError(f"kubeconfig {kubeconfig} does not exist")
        config = yaml.safe_load(kubeconfig.read_text())
        try:
            server = str(config["clusters"][0]["cluster"]["server"])
        except (KeyError, IndexError, TypeError) as err:
            raise ClusterError(f"kubeconfig {kubeconfig} names no cluster server") from err
        cluster = cls(state_dir=kubeconfig.parent, bin_dir=bin_dir)
        cluster._owns_state_dir = False
        cluster._owns_processes = False
        cluster._server = server
        cluster._kubeconfig = kubeconfig
        return cluster

    @classmethod
    def from_state(cls, state_dir: Path) -> LocalCluster | None:
        """The cluster recorded in ``state_dir`` by a detached start, or None if none was."""
        state_file = Path(state_dir) / STATE_FILE
        if not state_file.is_file():
            return None
        state = json.loads(state_file.read_text())
        cluster = cls(state_dir=Path(state_dir), bin_dir=Path(state["bin_dir"]), detached=True)
        cluster._server = state["server"]
        cluster._kubeconfig = Path(state["kubeconfig"])
        cluster.startup_seconds = state.get("startup_seconds")
        cluster._records = [ProcessRecord(**p) for p in state["processes"]]
        return cluster

    # ---- public surface ------------------------------------------------------------------------

    @property
    def server(self) -> str:
        """The API server URL (``https://127.0.0.1:<port>``)."""
        if self._server is None:
            raise ClusterError("the cluster is not started; call start() first")
        return self._server

    @property
    def kubeconfig(self) -> Path:
        """Path of the admin kubeconfig (cluster-admin via the system:masters group)."""
        if self._kubeconfig is None:
            raise ClusterError("the cluster is not started; call start() first")
        return self._kubeconfig

    @property
    def processes(self) -> list[ProcessRecord]:
        return list(self._records)

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def is_running(self) -> bool:
        """True when every component process is alive (always True for a connected cluster)."""
        if not self._owns_processes:
            return True
        return bool(self._records) and not self.stopped_components()

    def stopped_components(self) -> list[ProcessRecord]:
        """Components of a started cluster whose process has exited (see their ``log``)."""
        return [r for r in self._records if not r.is_alive()]

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs the cluster's kubectl against this cluster; output is captured as text.

        ``kubeconfig`` replaces the admin kubeconfig (for example one from
        ``write_token_kubeconfig``). With ``check`` a non-zero exit raises ClusterError carrying
        kubectl's stderr.
        """
        config = kubeconfig if kubeconfig is not None else self.kubeconfig
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={config}", *args]
        try:
            result = subprocess.run(
                argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError as err:
            raise ClusterError(
                f"kubectl not found in {self.bin_dir}; run `bash hack/controlplane/build.sh`"
            ) from err
        if check and result.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} failed (exit {result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        """Waits until the CRDs (``crd/NAME``) are Established. A CRD applied a moment ago may
        have no conditions yet, and ``kubectl wait`` then fails at once instead of waiting
        ("accessor error"): that failure is retried until ``timeout``; any other raises."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, int(deadline - time.monotonic()))
            result = self.kubectl(
                "wait", "--for=condition=Established", f"--timeout={left}s", *crds, check=False
            )
            if result.returncode == 0:
                return
            output = result.stderr.strip() or result.stdout.strip()
            if "accessor error" not in output or time.monotonic() > deadline:
                raise ClusterError(
                    f"{', '.join(crds)} not Established within {timeout:.0f} s: {output}"
                )
            time.sleep(0.2)

    def kubectl_json(self, *args: str) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def add_nodes(self, nodes: Sequence[FakeNode], timeout: float = 120.0) -> None:
        """Registers more KWOK fake nodes on the running cluster and waits until they are Ready.

        For a test that needs more capacity than the default nodes (the scale test); remove them
        again with ``remove_nodes``. ``self.nodes`` (the nodes ``start()`` registers) is unchanged.
        """
        if not nodes:
            return
        manifest = {"apiVersion": "v1", "kind": "List", "items": [n.manifest() for n in nodes]}
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest), timeout=timeout)
        self._wait_nodes_ready([n.name for n in nodes], max(1, int(timeout)))

    def remove_nodes(self, names: Sequence[str], timeout: float = 120.0) -> None:
        """Deletes fake nodes added with ``add_nodes`` (pods still bound to them are collected)."""
        if names:
            self.kubectl(
                "delete", "node", "--ignore-not-found", "--wait=true", *names, timeout=timeout
            )

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that should talk to this cluster (a kopf operator, helm).

        ``KUBECONFIG`` points at the admin kubeconfig and the cluster's ``bin_dir`` comes first on
        ``PATH``, so a plain ``kubectl`` is the matching version. ``base`` defaults to os.environ.
        """
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join(p for p in (str(self.bin_dir), env.get("PATH", "")) if p)
        return env

    def write_token_kubeconfig(self, token: str, path: Path) -> Path:
        """Writes a kubeconfig that authenticates with ``token`` only (no client certificate).

        For acting as a ServiceAccount (``kubectl create token``) to test RBAC for real.
        """
        admin = yaml.safe_load(self.kubeconfig.read_text())
        admin["users"] = [{"name": "token", "user": {"token": token}}]
        admin["contexts"][0]["context"]["user"] = "token"
        path.write_text(yaml.safe_dump(admin, sort_keys=False))
        path.chmod(0o600)
        return path

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Starts every component, waits until all are healthy and the fake nodes are Ready.

        Raises ClusterError (naming the component and quoting its log) on any failure, after
        stopping whatever had already started.
        """
        missing = missing_tools(self.bin_dir, self.stage_dir)
        if missing:
            raise ClusterError(
                "control-plane binaries are missing ("
                + ", ".join(str(m) for m in missing[:3])
                + (", ..." if len(missing) > 3 else "")
                + "); build them with `bash hack/controlplane/build.sh` (or `make install`)"
            )
        if self._owns_state_dir:
            self.state_dir = Path(tempfile.mkdtemp(prefix="davit-cluster-"))
        started = time.monotonic()
        for attempt in range(PORT_RACE_ATTEMPTS):
            try:
                self._start_components(started + self.startup_timeout)
                self._register_nodes(started + self.startup_timeout)
                break
            except ClusterError as err:
                self._stop_processes()
                # Free ports are picked before the components bind them; another process may
                # take one in between. Only that case is worth a second try.
                if "address already in use" not in str(err) or attempt + 1 == PORT_RACE_ATTEMPTS:
                    raise
            except BaseException:
                self._stop_processes()
                raise
        self.startup_seconds = time.monotonic() - started
        self._write_state()
        return self

    def stop(self) -> None:
        """Stops the components (newest first). A connected cluster is left running."""
        if not self._owns_processes:
            return
        self._stop_processes()
        if self._owns_state_dir and self.state_dir == Path():
            return  # never started: there is no temporary folder yet
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = Path()

    # ---- internals -----------------------------------------------------------------------------

    def _start_components(self, deadline: float) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)  # a fresh cluster every start
        ports = Ports.pick()
        pki = generate_pki(
            self.state_dir / "pki", list(CLIENTS), serving_ips=[LOOPBACK, "::1", FIRST_SERVICE_IP]
        )
        self._server = f"https://{LOOPBACK}:{ports.apiserver}"
        for identity in CLIENTS:
            path = kubeconfig_path(self.state_dir, identity)
            path.write_text(yaml.safe_dump(kubeconfig(self.server, pki, identity), sort_keys=False))
            path.chmod(0o600)
        self._kubeconfig = kubeconfig_path(self.state_dir, ADMIN)

        cluster_tls = ssl.create_default_context(cafile=str(pki.ca_cert))
        cluster_tls.load_cert_chain(
            str(pki.client_cert(ADMIN.file_stem)), str(pki.client_key(ADMIN.file_stem))
        )
        # kube-controller-manager and kube-scheduler serve /healthz with a self-signed
        # certificate they generate at startup; the probe only talks to 127.0.0.1.
        self_signed = ssl.create_default_context()
        self_signed.check_hostname = False
        self_signed.verify_mode = ssl.CERT_NONE
        contexts = {"none": None, "cluster": cluster_tls, "self-signed": self_signed}

        for spec in component_specs(self.bin_dir, self.stage_dir, self.state_dir, pki, ports):
            self._launch(spec, contexts[spec.tls], deadline)

    def _launch(self, spec: ComponentSpec, context: ssl.SSLContext | None, deadline: float) -> None:
        log = self.log_dir / f"{spec.name}.log"
        child = spawn(spec.name, list(spec.argv), log, detached=self.detached)
        self._children.append(child)
        record = ProcessRecord(
            name=spec.name,
            pid=child.pid,
            start_ticks=process_start_ticks(child.pid) or 0,
            log=str(log),
            health_url=spec.health_url,
        )
        self._records.append(record)
        wanted = spec.healthy_body

        def accept(body: str) -> bool:
            return wanted is None or wanted in body.replace(" ", "")

        wait_healthy(record, context, deadline, lambda: child.poll() is None, accept)

    def _register_nodes(self, deadline: float) -> None:
        # Nodes first: kwok initializes them while the controller manager is still starting its
        # controllers, which is most of the startup time.
        if self.nodes:
            items = [n.manifest() for n in self.nodes]
            manifest = {"apiVersion": "v1", "kind": "List", "items": items}
            self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        # Pods are refused until the namespace's "default" ServiceAccount exists; waiting for it
        # proves the controller manager is working, not only serving /healthz.
        probe = ("get", "serviceaccount", "default", "--namespace=default")
        while self.kubectl(*probe, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise ClusterError(
                    "kube-controller-manager did not create the default ServiceAccount; see "
                    f"{self.log_dir / 'kube-controller-manager.log'}"
                )
            time.sleep(0.2)
        if not self.nodes:
            return
        self._wait_nodes_ready(
            [n.name for n in self.nodes], max(1, int(deadline - time.monotonic()))
        )

    def _wait_nodes_ready(self, names: list[str], timeout_s: int) -> None:
        result = self.kubectl(
            "wait",
            "--for=condition=Ready",
            "node",
            *names,
            f"--timeout={timeout_s}s",
            check=False,
            timeout=timeout_s + 10,
        )
        if result.returncode != 0:
            raise ClusterError(
                f"fake nodes did not become Ready: {result.stderr.strip()}; see "
                f"{self.log_dir / 'kwok.log'}"
            )

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "bin_dir": str(self.bin_dir),
            "startup_seconds": self.startup_seconds,
            "processes": [vars(r) for r in self._records],
        }
        (self.state_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def _stop_processes(self) -> None:
        errors = []
        for record in reversed(self._records):
            try:
                terminate(record)
            except ClusterError as err:
                errors.append(str(err))
        for child in self._children:
            child.poll()  # reap, so no zombie stays behind
        self._records.clear()
        self._children.clear()
        if errors:
            raise ClusterError("; ".join(errors))
