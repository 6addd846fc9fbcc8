"""The hub source against answers shaped like the hub's: listing, ranges, and how every error
is classified. (The end-to-end tests run it against olah, which checks no token: 401/403 and
gated repositories are covered here.)"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from davit_operator.fetch.hub import HubSource
from davit_operator.fetch.result import FetchFailed
from davit_operator.fetch.store import Checksum, RemoteFile

TOKEN = "hf_unitTestToken_9d8c7b6a5f4e"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = bytes(range(256)) * 8
TREE = [
    {"type": "directory", "oid": "d" * 40, "path": "onnx", "size": 0},
    {"type": "file", "oid": "a" * 40, "path": "config.json", "size": 700},
    {
        "type": "file",
        "oid": "b" * 40,
        "path": "model.safetensors",
        "size": 134,
        "lfs": {"oid": "c" * 64, "size": len(WEIGHTS), "pointerSize": 134},
    },
]

Handler = Callable[[httpx.Request], httpx.Response]


def source(handler: Handler, token: str | None = TOKEN) -> HubSource:
    return HubSource("https://hub.test", "Org/Model", token, transport=httpx.MockTransport(handler))


def failure_of(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(FetchFailed) as err:
        call()
    return err.value.failure.reason, err.value.failure.message


def test_a_revision_resolves_to_its_commit_with_the_token_sent() -> None:
    seen: list[httpx.Request] = []

    def hub(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.url.raw_path == b"/api/models/Org/Model/revision/refs%2Fpr%2F1"
        return httpx.Response(200, json={"id": "Org/Model", "sha": COMMIT})

    assert source(hub).resolve("refs/pr/1") == COMMIT
    assert seen[0].headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Authorization" not in source(hub, token=None)._http.headers


def test_the_listing_gives_lfs_sha256_or_git_blob_ids() -> None:
    def hub(request: httpx.Request) -> httpx.Response:
        assert request.url.params["recursive"] == "true"
        return httpx.Response(200, json=TREE)

    files = source(hub).files(COMMIT)
    assert files == [
        RemoteFile("config.json", 700, Checksum("git-sha1", "a" * 40)),
        RemoteFile("model.safetensors", len(WEIGHTS), Checksum("sha256", "c" * 64)),
    ]


@pytest.mark.parametrize(
    ("status", "headers", "reason"),
    [
        (404, {"x-error-code": "RevisionNotFound", "x-error-message": "Invalid rev id"}, "RevisionNotFound"),
        (404, {"x-error-code": "RepoNotFound"}, "RevisionNotFound"),
        # The hub hides private repositories: 401 RepoNotFound, not Unauthorized.
        (401, {"x-error-code": "RepoNotFound", "x-error-message": "Repository not found"}, "RevisionNotFound"),
        (401, {"x-error-message": "Invalid credentials in Authorization header"}, "Unauthorized"),
        (403, {"x-error-code": "GatedRepo", "x-error-message": "Access to model is restricted"}, "Unauthorized"),
        (404, {}, "RevisionNotFound"),
        (429, {}, "Transient"),
        (500, {}, "Transient"),
        (503, {}, "Transient"),
        (400, {}, "InvalidSource"),
    ],
)  # fmt: skip
def test_errors_are_classified(status: int, headers: dict[str, str], reason: str) -> None:
    def hub(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, text="error page")

    got, message = failure_of(lambda: source(hub).resolve("main"))
    assert got == reason
    assert f"HTTP {status}" in message and "Org/Model revision main" in message
    assert TOKEN not in message
    if reason == "Unauthorized":
        assert "credentials Secret" in message


def test_an_unreachable_hub_and_a_non_json_answer() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    assert failure_of(lambda: source(down).resolve("main"))[0] == "Transient"

    def html(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>a login page</html>")

    assert failure_of(lambda: source(html).resolve("main"))[0] == "InvalidSource"
    assert failure_of(lambda: source(html).files(COMMIT))[0] == "InvalidSource"


def test_ranges_are_asked_for_and_honoured_or_not() -> None:
    file = RemoteFile("model.safetensors", len(WEIGHTS), Checksum("sha256", "c" * 64))

    def ranged(request: httpx.Request) -> httpx.Response:
        assert request.url.path == f"/Org/Model/resolve/{COMMIT}/model.safetensors"
        start = int(request.headers["Range"].removeprefix("bytes=").rstrip("-"))
        return httpx.Response(206, content=WEIGHTS[start:])

    start, chunks = source(ranged).open(COMMIT, file, 1000)
    assert start == 1000 and b"".join(chunks) == WEIGHTS[1000:]

    def whole(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=WEIGHTS)

    start, chunks = source(whole).open(COMMIT, file, 1000)
    assert start == 0 and b"".join(chunks) == WEIGHTS

    def fresh(request: httpx.Request) -> httpx.Response:
        assert "Range" not in request.headers
        return httpx.Response(200, content=WEIGHTS)

    assert source(fresh).open(COMMIT, file, 0)[0] == 0

    def gone(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, headers={"x-error-code": "EntryNotFound"})

    assert failure_of(lambda: source(gone).open(COMMIT, file, 0))[0] == "RevisionNotFound"


def test_the_token_stays_behind_on_a_redirect_to_another_host() -> None:
    """The hub sends LFS downloads to a CDN: the token must not go there."""
    seen: dict[str, httpx.Headers] = {}

    def hub(request: httpx.Request) -> httpx.Response:
        seen[request.url.host] = request.headers
        if request.url.host == "hub.test":
            return httpx.Response(302, headers={"Location": "https://cdn.test/blob/ccc"})
        return httpx.Response(200, content=WEIGHTS)

    file = RemoteFile("model.safetensors", len(WEIGHTS), Checksum("sha256", "c" * 64))
    start, chunks = source(hub).open(COMMIT, file, 0)
    assert b"".join(chunks) == WEIGHTS
    assert seen["hub.test"]["Authorization"] == f"Bearer {TOKEN}"
    assert "Authorization" not in seen["cdn.test"]
    assert TOKEN not in repr(source(hub))
