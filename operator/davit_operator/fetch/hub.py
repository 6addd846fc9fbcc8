"""A Hugging Face hub (or a mirror of one, reached at its endpoint) as a model source.

The revision resolves to a commit (`/api/models/REPO/revision/REV`), the commit's tree
(`/api/models/REPO/tree/COMMIT?recursive=true`) gives every file's size and checksum (the LFS
sha256 for large files, the git blob id otherwise), and each file comes from
`/REPO/resolve/COMMIT/PATH` with a `Range` header when part of it is already there. The token
(`HF_TOKEN`) goes only into the Authorization header; httpx drops that header on a redirect to
another host (the hub sends LFS downloads to a CDN).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from davit_operator.fetch.result import FetchFailed
from davit_operator.fetch.store import Checksum, RemoteFile

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
NOT_FOUND_CODES = frozenset({"RepoNotFound", "RevisionNotFound", "EntryNotFound"})


def _fail_for(response: httpx.Response, what: str) -> FetchFailed:
    code = response.status_code
    detail = response.headers.get("x-error-message") or response.text[:200].strip()
    error_code = response.headers.get("x-error-code", "")
    if error_code in NOT_FOUND_CODES:
        # The hub answers 401 RepoNotFound for a repository it does not show this caller.
        return FetchFailed(
            "RevisionNotFound",
            f"{what}: HTTP {code} {error_code} ({detail}); the repository or revision does not "
            "exist, or it is private or gated and the token gives no access to it",
        )
    if code in (401, 403):
        return FetchFailed(
            "Unauthorized",
            f"{what}: HTTP {code} ({detail}); the token in the credentials Secret is missing, "
            "wrong, or has no access to this repository",
        )
    if code == 404:
        return FetchFailed("RevisionNotFound", f"{what}: HTTP 404 ({detail})")
    if code in (408, 429) or code >= 500:
        return FetchFailed("Transient", f"{what}: HTTP {code} ({detail})")
    return FetchFailed("InvalidSource", f"{what}: HTTP {code} ({detail})")


@dataclass
class HubSource:
    endpoint: str
    repo_id: str
    token: str | None = field(default=None, repr=False)
    # The network by default; tests pass an in-process transport.
    transport: httpx.BaseTransport | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        headers = {"User-Agent": "davit-fetch/0.1.0"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.Client(
            base_url=self.endpoint.rstrip("/"),
            headers=headers,
            timeout=TIMEOUT,
            follow_redirects=True,
            transport=self.transport,
        )

    def close(self) -> None:
        self._http.close()

    def _get_json(self, path: str, what: str, **params: Any) -> Any:
        try:
            response = self._http.get(path, params=params or None)
        except httpx.TransportError as exc:
            raise FetchFailed("Transient", f"{what}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise _fail_for(response, what)
        try:
            return response.json()
        except ValueError as exc:
            raise FetchFailed("InvalidSource", f"{what}: the answer is not JSON") from exc

    def resolve(self, revision: str) -> str:
        """The commit hash `revision` names."""
        what = f"{self.repo_id} revision {revision}"
        doc = self._get_json(
            f"/api/models/{self.repo_id}/revision/{quote(revision, safe='')}", what
        )
        sha = doc.get("sha") if isinstance(doc, dict) else None
        if not isinstance(sha, str) or not sha:
            raise FetchFailed("InvalidSource", f"{what}: the hub named no commit")
        return sha

    def files(self, commit: str) -> list[RemoteFile]:
        """Every file of the commit with its size and checksum."""
        what = f"{self.repo_id} at {commit}"
        items = self._get_json(f"/api/models/{self.repo_id}/tree/{commit}", what, recursive="true")
        if not isinstance(items, list):
            raise FetchFailed("InvalidSource", f"{what}: the file listing is not a list")
        found = []
        for item in items:
            if not isinstance(item, dict) or item.get("type") != "file":
                continue
            lfs = item.get("lfs")
            if isinstance(lfs, dict) and lfs.get("oid"):
                checksum = Checksum("sha256", str(lfs["oid"]).removeprefix("sha256:"))
                size = int(lfs.get("size") or item.get("size") or 0)
            else:
                checksum = Checksum("git-sha1", str(item["oid"]))
                size = int(item.get("size", 0))
            found.append(RemoteFile(path=str(item["path"]), size=size, checksum=checksum))
        return found

    def open(self, commit: str, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        url = f"/{self.repo_id}/resolve/{commit}/{quote(file.path)}"
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        request = self._http.build_request("GET", url, headers=headers)
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise FetchFailed("Transient", f"{file.path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code not in (200, 206):
            response.read()
            response.close()
            raise _fail_for(response, file.path)
        start = offset if response.status_code == 206 else 0

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.iter_bytes(1 << 20)
            except httpx.TransportError as exc:
                raise FetchFailed("Transient", f"{file.path}: {type(exc).__name__}: {exc}") from exc
            finally:
                response.close()

        return start, chunks()
