"""The S3 source and `davit fetch` against a real S3 server (versitygw, built by
hack/s3server/build.sh): SigV4 credentials, checksums from metadata or ETags, ranged reads with
If-Match, exit statuses and the result document."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from davit_operator.fetch.main import fetch_main
from davit_operator.fetch.result import PERMANENT_EXIT, FetchFailed
from davit_operator.fetch.s3 import S3Source
from davit_operator.fetch.store import Checksum
from tests.e2e.sources import S3Server

pytestmark = pytest.mark.slow

WEIGHTS = bytes(range(256)) * 20_000  # 5 MB: a single-part upload
CONFIG = b'{"model_type": "llama"}\n'
TOKENIZER = b'{"version": "1.0"}\n'


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    client: Any = server.client()
    client.make_bucket("models")
    put = {
        "m/config.json": (CONFIG, {"sha256": hashlib.sha256(CONFIG).hexdigest()}),
        "m/model.safetensors": (WEIGHTS, {"sha256": hashlib.sha256(WEIGHTS).hexdigest()}),
        "m/tokenizer.json": (TOKENIZER, {}),  # no metadata: the ETag (MD5) checks it
        "m/README.md": (b"# not needed\n", {}),
    }
    for key, (data, metadata) in put.items():
        client.put_object("models", key, io.BytesIO(data), len(data), metadata=metadata)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def credentials(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    return s3


def test_checksums_come_from_metadata_or_the_etag(credentials: S3Server) -> None:
    source = S3Source(credentials.endpoint, "models", "m")
    listed = {f.path: f for f in source.files()}
    assert set(listed) == {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    weights = source.describe(listed["model.safetensors"])
    assert weights.checksum == Checksum("sha256", hashlib.sha256(WEIGHTS).hexdigest())
    assert weights.size == len(WEIGHTS) and weights.version
    tokenizer = source.describe(listed["tokenizer.json"])
    assert tokenizer.checksum == Checksum("md5", hashlib.md5(TOKENIZER).hexdigest())


def test_ranged_reads_and_an_object_replaced_meanwhile(credentials: S3Server) -> None:
    source = S3Source(credentials.endpoint, "models", "m")
    listed = {f.path: f for f in source.files()}
    file = source.describe(listed["model.safetensors"])
    start, chunks = source.open(file, 1_000_000)
    assert start == 1_000_000 and b"".join(chunks) == WEIGHTS[1_000_000:]
    client: Any = credentials.client()
    client.put_object("models", "m/config.json", io.BytesIO(b"{}"), 2)
    try:
        config = listed["config.json"]  # listed before the object was replaced
        with pytest.raises(FetchFailed) as err:
            source.open(config, 5)
        assert err.value.failure.reason == "Transient"  # the retry lists it again
    finally:
        client.put_object(
            "models",
            "m/config.json",
            io.BytesIO(CONFIG),
            len(CONFIG),
            metadata={"sha256": hashlib.sha256(CONFIG).hexdigest()},
        )


@pytest.mark.parametrize(
    ("key", "secret", "bucket", "reason"),
    [
        ("access", "wrong-secret-value-123", "models", "Unauthorized"),
        ("nobody", "wrong-secret-value-123", "models", "Unauthorized"),
        (None, None, "no-such-bucket", "RevisionNotFound"),
    ],
)
def test_errors_are_classified(
    s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    key: str | None,
    secret: str | None,
    bucket: str,
    reason: str,
) -> None:
    access = s3.access_key if key in (None, "access") else key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", str(access))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret or s3.secret_key)
    with pytest.raises(FetchFailed) as err:
        S3Source(s3.endpoint, bucket, "m").files()
    assert err.value.failure.reason == reason
    assert err.value.failure.permanent
    assert "wrong-secret-value-123" not in err.value.failure.message


def _fetch(s3: S3Server, cache: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result_file = cache.parent / "result.json"
    code = fetch_main(
        [
            "--source",
            "s3://models/m",
            "--revision",
            "r1",
            "--endpoint",
            s3.endpoint,
            "--cache",
            str(cache),
            "--port",
            "0",
            "--result-file",
            str(result_file),
            *extra,
        ]
    )
    doc: dict[str, Any] = json.loads(result_file.read_text())
    return code, doc


def test_davit_fetch_copies_once_and_reports(credentials: S3Server, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code, doc = _fetch(credentials, cache)
    assert code == 0 and doc["kind"] == "result"
    total = len(WEIGHTS) + len(CONFIG) + len(TOKENIZER)
    assert doc["bytes_total"] == doc["bytes_fetched"] == total
    assert doc["path"] == "s3/models/m/r1" and doc["numFiles"] == 3
    entry = cache / "s3" / "models" / "m" / "r1"
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (entry / "model.safetensors").read_bytes() == WEIGHTS
    assert not (cache / "s3" / "models" / "m" / "r1.partial").exists()
    checks = {f["path"]: f["checksum"].partition(":")[0] for f in doc["files"]}
    assert checks == {
        "config.json": "sha256",
        "model.safetensors": "sha256",
        "tokenizer.json": "md5",
    }
    # Again: everything is there, nothing moves.
    code, again = _fetch(credentials, cache)
    assert code == 0 and again["bytes_fetched"] == 0 and again["commit"] == doc["commit"]


def test_davit_fetch_fails_for_good_on_bad_credentials(
    s3: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-456")
    code, doc = _fetch(s3, tmp_path / "cache")
    assert code == PERMANENT_EXIT
    assert doc["kind"] == "failure" and doc["reason"] == "Unauthorized"
    out = capsys.readouterr()
    assert "Unauthorized" in out.err
    assert "wrong-secret-value-456" not in out.out + out.err + json.dumps(doc)
