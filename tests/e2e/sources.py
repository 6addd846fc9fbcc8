"""Real model sources for the delivery tests, on loopback: a hub mirror and an S3 server.

- `HubMirror` runs olah (a maintained, self-hosted Hugging Face hub mirror from PyPI) offline
  over a local git repository laid out as the hub keeps one: small files in git, weights as
  Git LFS pointers with their objects under `.git/lfs/objects`. olah answers the hub's API
  (revision, tree with LFS sha256, resolve) from it. Two limits of olah's local mirrors shape
  the tests: it does not check tokens (so 401/403 are exercised against the S3 server, whose
  SigV4 authentication is real) and it ignores `Range` (so a resumed hub fetch restarts the
  interrupted file; byte-level resumption is exercised against the S3 server).
- `S3Server` runs versitygw (Apache-2.0; built from Go modules by hack/s3server/build.sh) over
  a POSIX directory with real access keys; objects are uploaded with the MinIO SDK, each with
  its sha256 in the user metadata.

Both are installed by hack/install.sh into the cache outside the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support import unavailable

from .model_store import REPO_ID, cache_root

OLAH_VERSION = "0.5.4"
VERSITYGW_VERSION = "v1.8.0"
LFS_FILES = ("model.safetensors",)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited: {log.read_text()[-3000:]}")
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.TransportError:
            time.sleep(0.3)
    raise RuntimeError(f"{url}: no answer within {timeout} s: {log.read_text()[-3000:]}")


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "davit",
        "GIT_AUTHOR_EMAIL": "davit@example.invalid",
        "GIT_COMMITTER_NAME": "davit",
        "GIT_COMMITTER_EMAIL": "davit@example.invalid",
    }
    out = subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    )
    return out.stdout.strip()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _add_lfs(repo: Path, name: str, content: Path, claimed_oid: str | None = None) -> None:
    """Commit `name` as a Git LFS pointer; the object is `content` (hard-linked when it can
    be). `claimed_oid` makes the pointer name another digest than the content's: a corrupted
    object on the server."""
    oid = claimed_oid or _sha256(content)
    size = content.stat().st_size
    obj = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    obj.parent.mkdir(parents=True, exist_ok=True)
    if not obj.exists():
        try:
            os.link(content, obj)
        except OSError:
            shutil.copyfile(content, obj)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
    (repo / name).write_text(pointer)


def _restamped(weights: Path, out: Path, revision: str) -> Path:
    """A copy of a safetensors file with `revision` in its header metadata: the same tensors in
    a file with another sha256, as a new upload of a model's weights is."""
    with weights.open("rb") as src, out.open("wb") as dst:
        (length,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(length))
        header["__metadata__"] = {**header.get("__metadata__", {}), "revision": revision}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # offsets are relative to the data, which stays aligned
        dst.write(struct.pack("<Q", len(text)) + text)
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


@dataclass
class HubMirror:
    """olah serving REPO_ID offline from a local git mirror. Revisions: `main` (the model),
    `v2` (a new commit: the weights re-uploaded with other header metadata, so another LFS
    object of the same size, and another generation config; the tokenizer and config are
    unchanged), `corrupt` (tokenizer.json stored with content that does not match its LFS
    sha256)."""

    model_dir: Path
    work: Path
    port: int = field(default_factory=free_port)
    commits: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _build_repo(self) -> Path:
        repo = self.work / "mirrors" / "models" / REPO_ID
        repo.mkdir(parents=True)
        _git(repo, "init", "-q", "-b", "main")
        for path in sorted(self.model_dir.rglob("*")):
            rel = path.relative_to(self.model_dir)
            if path.is_dir() or rel.name.startswith("."):
                continue
            if rel.as_posix() in LFS_FILES:
                _add_lfs(repo, rel.as_posix(), path)
            else:
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, repo / rel)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "SmolLM2-135M-Instruct, converted from the GGUF")
        self.commits["main"] = _git(repo, "rev-parse", "HEAD")
        # v2: a new commit of the same model (new weights file, new generation config).
        _git(repo, "checkout", "-q", "-b", "v2")
        _add_lfs(
            repo,
            "model.safetensors",
            _restamped(self.model_dir / "model.safetensors", self.work / "model.v2", "v2"),
        )
        (repo / "generation_config.json").write_text(
            (self.model_dir / "generation_config.json").read_text().replace("{", '{"v": 2,', 1)
        )
        _git(repo, "commit", "-q", "-am", "v2")
        self.commits["v2"] = _git(repo, "rev-parse", "HEAD")
        # corrupt: tokenizer.json kept in LFS whose stored object does not match its pointer.
        _git(repo, "checkout", "-q", "-b", "corrupt", "main")
        damaged = self.work / "tokenizer.damaged"
        data = bytearray((self.model_dir / "tokenizer.json").read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        _add_lfs(
            repo,
            "tokenizer.json",
            damaged,
            claimed_oid=_sha256(self.model_dir / "tokenizer.json"),
        )
        _git(repo, "commit", "-q", "-am", "tokenizer in LFS, object damaged")
        self.commits["corrupt"] = _git(repo, "rev-parse", "HEAD")
        _git(repo, "checkout", "-q", "main")
        return repo

    def start(self) -> HubMirror:
        olah = cache_root() / "olah" / OLAH_VERSION / "venv" / "bin" / "olah-cli"
        if not olah.is_file():
            unavailable(f"olah {OLAH_VERSION} is not installed at {olah} (hack/install.sh)")
        self._build_repo()
        config = self.work / "olah.toml"
        config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            f"port = {self.port}\n"
            f'repos-path = "{self.work / "repos"}"\n'
            f'mirrors-path = ["{self.work / "mirrors"}"]\n'
            'mirror-scheme = "http"\n'
            f'mirror-netloc = "127.0.0.1:{self.port}"\n'
            f'mirror-lfs-netloc = "127.0.0.1:{self.port}"\n'
            "[accessibility]\n"
            "offline = true\n"
        )
        log = self.work / "olah.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(olah), "-c", str(config)], stdout=out, stderr=subprocess.STDOUT
            )
        _wait_http(f"{self.endpoint}/api/models/{REPO_ID}/revision/main", self.process, log, 60)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class S3Server:
    """versitygw over a directory, with one root access key pair."""

    work: Path
    access_key: str = "davit-e2e-access"
    secret_key: str = "davit-e2e-secret-0123456789"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        binary = cache_root() / "s3server" / VERSITYGW_VERSION / "versitygw"
        if not binary.is_file():
            unavailable(f"versitygw {VERSITYGW_VERSION} is not built at {binary} (hack/install.sh)")
        root = self.work / "s3root"
        root.mkdir(parents=True, exist_ok=True)
        (self.work / "s3meta").mkdir(parents=True, exist_ok=True)
        log = self.work / "versitygw.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    str(binary),
                    "--port",
                    f"127.0.0.1:{self.port}",
                    "--access",
                    self.access_key,
                    "--secret",
                    self.secret_key,
                    "posix",
                    "--sidecar",
                    str(self.work / "s3meta"),
                    str(root),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_http(self.endpoint, self.process, log, 30)
        return self

    def client(self) -> object:
        from minio import Minio

        return Minio(
            f"127.0.0.1:{self.port}",
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
        )

    def upload(self, bucket: str, prefix: str, model_dir: Path) -> None:
        """Every file of `model_dir` under `prefix`, with its sha256 as user metadata."""
        client: object = self.client()
        if not client.bucket_exists(bucket):  # type: ignore[attr-defined]
            client.make_bucket(bucket)  # type: ignore[attr-defined]
        for path in sorted(model_dir.rglob("*")):
            if path.is_dir() or path.name.startswith("."):
                continue
            key = f"{prefix}/{path.relative_to(model_dir).as_posix()}"
            client.fput_object(  # type: ignore[attr-defined]
                bucket, key, str(path), metadata={"sha256": _sha256(path)}
            )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
