"""Train LeNet or an MLP on MNIST, data parallel across devices and machines.

The command line of MXNet's ``example/image-classification/train_mnist.py``,
with its defaults, plus ``--cpus``, ``--work-load-list``, ``--data-dir``,
``--seed``, ``--threads``, ``--plot`` and ``--metrics-file``. One process::

    python -m trainer.train_mnist --network lenet --kv-store local --num-epochs 2

Two workers and a server on this machine::

    pslaunch -n 2 -s 1 --launcher local python scripts/train_mnist.py --network lenet --kv-store dist_sync

Under the launcher the same command serves every role: a scheduler or server
runs the parameter-server role and exits 0 (at once, with a note, when the
kv-store is not a ``dist_*`` one). Log lines follow MXNet's (``Epoch[e] Batch
[a-b]\\tSpeed: ...``, ``Epoch[e] Validation-accuracy=...``), each behind
``Node[rank]``; the last line on stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Callable, Iterator, NoReturn, Sequence

import pscontract as pc
from trainer.metrics import MetricsFile, check_metrics_path, metrics_path

log = logging.getLogger("trainer.train_mnist")

PROG = "train_mnist"
KV_TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async", "dist_allreduce")
OPTIMIZERS = ("sgd", "nag", "adam")


class UsageError(Exception):
    """A command-line mistake: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _int_at_least(minimum: int, rule: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else ``"<value> <rule>"``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} {rule}")
        return value
    return parse


_positive_int = _int_at_least(1, "must be at least 1")
_non_negative_int = _int_at_least(0, "must not be negative")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` once: not when the help already says its default in words, not
    ``(default: None)`` for an option that is simply off unless given, and not for a flag
    (``--no-pin``'s "(default: True)" read as if the flag were on)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # a flag (--resume, --no-pin): its help says what it turns on or off
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    """The command line (MXNet's flags and defaults first, then ours)."""
    p = _Parser(prog=PROG, description="Train LeNet or an MLP on MNIST, data parallel through a kvstore.",
                formatter_class=_DefaultsFormatter)
    g = p.add_argument_group("MXNet's train_mnist options")
    g.add_argument("--network", choices=("mlp", "lenet"), default="mlp", help="the network")
    g.add_argument("--gpus", default=None, help="GPUs to use on this worker, e.g. 0,2 (default: the CPU)")
    g.add_argument("--kv-store", choices=KV_TYPES, default="device", help="the kvstore type")
    g.add_argument("--batch-size", type=_positive_int, default=64,
                   help="samples per batch per worker, split across its devices")
    g.add_argument("--num-epochs", type=_positive_int, default=20, help="epochs to train")
    g.add_argument("--lr", type=_non_negative_float, default=0.05, help="initial learning rate")
    g.add_argument("--lr-factor", type=_non_negative_float, default=0.1,
                   help="the learning rate is multiplied by this at each step epoch")
    g.add_argument("--lr-step-epochs", default="10", help="epochs at which the learning rate drops, e.g. 30,60")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="the optimizer")
    g.add_argument("--mom", type=_non_negative_float, default=0.9, help="momentum (sgd, nag)")
    g.add_argument("--wd", type=_non_negative_float, default=0.0001, help="weight decay")
    g.add_argument("--disp-batches", type=_non_negative_int, default=100,
                   help="log speed and accuracy every this many batches (0: never)")
    g.add_argument("--model-prefix", default=None, help="checkpoint prefix: PREFIX-EPOCH.pt, written by rank 0")
    g.add_argument("--save-period", type=_positive_int, default=1, help="checkpoint every this many epochs")
    g.add_argument("--load-epoch", type=_positive_int, default=None,
                   help="resume from PREFIX-EPOCH.pt (needs --model-prefix)")
    g.add_argument("--num-examples", type=_positive_int, default=60000,
                   help="training samples per epoch (all workers together)")
    o = p.add_argument_group("pslaunch additions")
    o.add_argument("--cpus", type=_positive_int, default=None,
                   help="N CPU replicas on this worker (multi-device training without a GPU)")
    o.add_argument("--work-load-list", default=None,
                   help="relative share of the batch per device, e.g. 3,1 (default: equal)")
    o.add_argument("--data-dir", default=None,
                   help="MNIST IDX files and cache (default: ~/.cache/pslaunch/mnist)")
    o.add_argument("--seed", type=_non_negative_int, default=0, help="seeds the initial weights and the shuffling")
    o.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads per process (default: the cores divided by this job's processes on the host)")
    o.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the workers free to move between cores (by default, when every worker and "
                        "server of the job runs on this host and there are no more workers than cores, "
                        "each worker keeps its own cores)")
    o.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw loss and accuracy per epoch and per --disp-batches interval into this image "
                        "(rank 0's curves; any format matplotlib writes: png, svg, pdf, ...)")
    o.add_argument("--metrics-file", default=None, metavar="FILE.jsonl",
                   help="also write the figures of every logged interval and epoch to this file as JSON lines "
                        "(appended to; rank 0 only, unless the name has {rank} in it: metrics-{rank}.jsonl gives "
                        "each worker its own)")
    o.add_argument("--resume", action="store_true",
                   help="start from the newest complete checkpoint of --model-prefix (its weights, optimizer "
                        "state, epoch and place in the epoch's data order), or from scratch when there is none")
    o.add_argument("--checkpoint-every-batches", type=_non_negative_int, default=0, metavar="K",
                   help="also checkpoint every K batches of an epoch and at every epoch's end, keeping the newest "
                        "within-epoch one (PREFIX-EPOCH-BATCH.pt): a failure costs at most K batches; 0 turns it off")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; raises UsageError with one line."""
    args = build_parser().parse_args(argv)
    args.lr_step_list = _int_list(args.lr_step_epochs, "--lr-step-epochs", minimum=1)
    if args.gpus is not None and args.gpus.strip() == "":
        args.gpus = None  # MXNet: empty means the CPU
    args.gpu_list = _int_list(args.gpus, "--gpus", minimum=0) if args.gpus is not None else None
    if args.gpu_list is not None and len(set(args.gpu_list)) != len(args.gpu_list):
        raise UsageError(f"--gpus {args.gpus}: a GPU is listed twice")
    if args.gpu_list is not None and args.cpus is not None:
        raise UsageError("use --gpus or --cpus, not both")
    args.work_load = None
    if args.work_load_list is not None:
        try:
            args.work_load = tuple(float(v) for v in args.work_load_list.split(","))
        except ValueError:
            raise UsageError(f"--work-load-list {args.work_load_list!r}: expected numbers such as 3,1") from None
        if any(not (w > 0 and w != float("inf")) for w in args.work_load):
            raise UsageError(f"--work-load-list {args.work_load_list}: every share must be a positive number")
        ndev = len(args.gpu_list) if args.gpu_list is not None else (args.cpus or 1)
        if len(args.work_load) != ndev:
            raise UsageError(f"--work-load-list {args.work_load_list} has {len(args.work_load)} entries "
                             f"for {ndev} device(s)")
    ndev = len(args.gpu_list) if args.gpu_list is not None else (args.cpus or 1)
    if ndev > 1:
        from trainer.data import split_batch

        try:
            split_batch(args.batch_size, args.work_load or [1.0] * ndev)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.load_epoch is not None and not args.model_prefix:
        raise UsageError("--load-epoch needs --model-prefix")
    if args.load_epoch is not None and args.load_epoch >= args.num_epochs:
        raise UsageError(f"--load-epoch {args.load_epoch} leaves nothing to do with --num-epochs {args.num_epochs}")
    if args.resume and args.load_epoch is not None:
        raise UsageError("use --resume or --load-epoch, not both")
    for flag, given in (("--resume", args.resume), ("--checkpoint-every-batches", args.checkpoint_every_batches)):
        if given and not args.model_prefix:
            raise UsageError(f"{flag} needs --model-prefix")
    if not 0 < args.lr_factor <= 1:
        raise UsageError(f"--lr-factor {args.lr_factor:g} must be in (0, 1]")
    if args.mom >= 1:
        raise UsageError(f"--mom {args.mom:g} must be below 1")
    return args


def _int_list(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected integers separated by commas") from None
    if any(v < minimum for v in values):
        raise UsageError(f"{flag} {text}: values must be at least {minimum}")
    return values


def default_threads(environ: os._Environ[str] | dict[str, str] | None = None) -> int:
    """The host's cores divided by this job's processes on it (at least 1), or all cores alone."""
    environ = os.environ if environ is None else environ
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = environ.get(pc.LOCAL_PROCS, "").strip()
    try:
        procs = int(local) if local else 1
    except ValueError:
        procs = 1
    return max(1, cores // max(1, procs))


def oversubscribed(threads: int, environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """True when ``threads`` torch threads per process are more than this process's share of the
    host's cores (:func:`default_threads`): the job's threads then outnumber the cores."""
    return threads > default_threads(environ)


def worker_cores(environ: os._Environ[str] | dict[str, str] | None = None) -> list[int] | None:
    """The cores this worker keeps to itself, or None to leave it free.

    A worker of a job whose workers and servers all run on this host (``DMLC_NUM_WORKER`` +
    ``DMLC_NUM_SERVER`` = ``PSLAUNCH_LOCAL_PROCS``), when there are at least two workers and no
    more than the cores: worker ``DMLC_TASK_ID`` = i gets the i-th equal slice of the cores this
    process may use. The scheduler and servers, mostly idle, stay free. Two workers that the
    kernel moved between two cores were slower: dist_sync on 2 cores, mlp by 25%, LeNet by 3-7%.
    """
    environ = os.environ if environ is None else environ
    try:
        workers = int(environ[pc.NUM_WORKER])
        servers = int(environ.get(pc.NUM_SERVER, "0") or 0)
        local = int(environ[pc.LOCAL_PROCS])
        task = int(environ[pc.TASK_ID])
        cores = sorted(os.sched_getaffinity(0))
    except (KeyError, ValueError, AttributeError, OSError):
        return None
    if workers + servers != local or not 2 <= workers <= len(cores) or not 0 <= task < workers:
        return None
    share = len(cores) // workers
    return cores[task * share:(task + 1) * share]


def _role() -> str:
    """This process's role: ``worker`` when run alone or as a launcher worker (of any tracker)."""
    if os.environ.get(pc.ROLE, "worker").strip().lower() == "worker":
        return "worker"
    return pc.ClusterEnv.from_environ(os.environ).role


def _formatter(rank: int | str) -> logging.Formatter:
    """MXNet's log format, ``Node[rank]`` written into the format string as MXNet does.

    The rank is part of the format, not a record attribute set by a filter:
    tqdm's ``logging_redirect_tqdm`` copies a handler's formatter but, before
    tqdm 4.70, not its filters, and every line under the progress bar then failed
    to format.
    """
    return logging.Formatter(f"%(asctime)s Node[{rank}] %(message)s")


#: the logger above every logger of the trainer (``trainer.fit``, ``trainer.kv.client``, ...)
LOGGER = "trainer"


def _setup_logging() -> logging.Handler:
    """MXNet's format and INFO for the trainer's own records, on stderr.

    Only the ``trainer`` logger gets the handler: another library's records (matplotlib's
    "generated new fontManager" the first time it runs on a machine, torch's) keep Python's
    default, where an INFO record is not shown.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter("?"))
    logger = logging.getLogger(LOGGER)
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


#: what the trainer imports beyond the standard library: (module, the package pip installs)
DEPENDENCIES = (("torch", "torch"), ("numpy", "numpy"), ("zmq", "pyzmq"))
INSTALL_HINT = ("pip install '.[trainer]' in your clone of pslaunch (on a GPU machine, install the CUDA build "
                "of torch you want first; the README's Installing says how)")


def missing_dependencies() -> list[str]:
    """The packages of :data:`DEPENDENCIES` this Python cannot find (nothing is imported)."""
    import importlib.util

    return [package for module, package in DEPENDENCIES if importlib.util.find_spec(module) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one process of the job; returns the exit code (also the ``pslaunch-train-mnist`` command)."""
    try:
        args = parse_args(argv)
        role = _role()
    except UsageError as e:
        return _fail(f"{e} (see --help)", 2)
    except pc.ClusterEnvError as e:
        return _fail(str(e), 2)
    missing = missing_dependencies()
    if missing:
        return _fail(f"the trainer needs {', '.join(missing)}, which {sys.executable} lacks: {INSTALL_HINT}")
    try:
        return _run(args, role)
    except ImportError as e:  # found but broken (a torch built for another CUDA, a half-removed package)
        return _fail(f"cannot import {e.name or 'a dependency'}: {' '.join(str(e).split())[:300]}; reinstall it: "
                     f"{INSTALL_HINT}")


def _run(args: argparse.Namespace, role: str) -> int:
    if role in ("scheduler", "server"):
        if not args.kv_store.startswith("dist"):
            print(f"{PROG}: this {role} exits: --kv-store {args.kv_store} trains without parameter servers "
                  "(use dist_sync, dist_device_sync or dist_async to use them)", file=sys.stderr, flush=True)
            return 0
        from trainer import kvstore  # runs the role and exits, as `import mxnet` does

        kvstore.run_role()
    return _worker(args)


def _worker(args: argparse.Namespace) -> int:
    handler = _setup_logging()
    if args.plot:
        try:
            _check_plot(args.plot)
        except UsageError as e:
            return _fail(f"{e} (see --help)", 2)
    if args.metrics_file:
        problem = check_metrics_path(args.metrics_file)
        if problem:
            return _fail(f"{problem} (see --help)", 2)
    threads = args.threads or default_threads()
    cores = worker_cores() if args.pin else None
    if cores:
        os.sched_setaffinity(0, cores)  # before torch starts its threads: they inherit it
    if threads > 1 and oversubscribed(threads):
        # libgomp's threads spin between parallel regions (torch's default, kept on cores of our
        # own: an MLP step is 3.7x faster, LeNet's 1.6x, than with sleeping threads); when the
        # threads outnumber the cores, every step waits for descheduled spinners instead.
        os.environ.setdefault(pc.OMP_WAIT_POLICY, "PASSIVE")
    from trainer.memory import keep_freed_memory

    keep_freed_memory()  # a step's activations and gradients reuse the last step's pages
    import torch

    torch.set_num_threads(threads)
    from trainer import kvstore
    from trainer.data import DataError, load_mnist
    from trainer.fit import FitError, TrainConfig, fit

    try:
        devices = _devices(args, torch)
        cfg = TrainConfig(
            network=args.network, batch_size=args.batch_size, num_epochs=args.num_epochs, lr=args.lr,
            lr_factor=args.lr_factor, lr_step_epochs=tuple(args.lr_step_list), optimizer=args.optimizer,
            mom=args.mom, wd=args.wd, disp_batches=args.disp_batches, model_prefix=args.model_prefix,
            save_period=args.save_period, load_epoch=args.load_epoch, resume=args.resume,
            checkpoint_every_batches=args.checkpoint_every_batches, attempt=_attempt(),
            num_examples=args.num_examples,
            seed=args.seed, devices=tuple(devices), work_load=args.work_load,
            progress=sys.stdout.isatty() and sys.stderr.isatty(),
        )
        with kvstore.create(args.kv_store) as kv:
            handler.setFormatter(_formatter(kv.rank))
            log.info("start with arguments %s", _namespace_text(args))
            log.info("%d torch thread(s), devices %s%s", torch.get_num_threads(), ", ".join(devices),
                     f", cores {','.join(map(str, cores))}" if cores else "")
            data = load_mnist(args.data_dir)
            with _metrics_file(args.metrics_file, kv.rank, cfg.attempt) as metrics:
                summary = fit(cfg, kv, data, plot=args.plot, metrics=metrics)
        print(json.dumps(summary), flush=True)
        return 0
    except UsageError as e:
        return _fail(str(e), 2)
    except (DataError, FitError) as e:
        return _fail(str(e))
    except kvstore.KVStoreError as e:
        return _fail(f"kvstore: {e}")
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


@contextlib.contextmanager
def _metrics_file(template: str | None, rank: int, attempt: int | None) -> Iterator[MetricsFile | None]:
    """This worker's ``--metrics-file``, open for the run, or None when it writes none."""
    path = metrics_path(template, rank) if template else None
    if path is None:
        yield None
        return
    try:
        sink = MetricsFile(path, rank, attempt)
    except OSError as e:
        raise UsageError(f"--metrics-file {path}: cannot open it: {e.strerror or e}") from None
    with sink:
        yield sink


def _attempt() -> int | None:
    """The launcher's attempt number (``PSLAUNCH_ATTEMPT``: 0, then k after k restarts), for the
    log; None outside the launcher or when it is not a number."""
    try:
        return int(os.environ[pc.ATTEMPT])
    except (KeyError, ValueError):
        return None


def _devices(args: argparse.Namespace, torch: object) -> list[str]:
    if args.gpu_list is not None:
        cuda = torch.cuda  # type: ignore[attr-defined]
        if not cuda.is_available():
            raise UsageError(f"--gpus {args.gpus}: CUDA is not available to this torch "
                             f"({torch.__version__}); use --cpus N for CPU replicas")  # type: ignore[attr-defined]
        count = cuda.device_count()
        bad = [g for g in args.gpu_list if g >= count]
        if bad:
            raise UsageError(f"--gpus {args.gpus}: GPU {bad[0]} does not exist ({count} visible)")
        gpus = args.gpu_list
        if args.kv_store == "dist_allreduce":  # --gpus lists the host's GPUs: this worker's by LOCAL_RANK
            from trainer.collective import worker_gpus

            try:
                gpus = worker_gpus(gpus, os.environ)
            except ValueError as e:
                raise UsageError(str(e)) from None
        return [f"cuda:{g}" for g in gpus]
    return ["cpu"] * (args.cpus or 1)


def _check_plot(path: str) -> None:
    """``--plot``: matplotlib is there, writes this format, and the directory takes the file
    (checked before training: finding out after it would waste the run)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install '.[trainer]' in your clone of pslaunch)") from None
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext and ext not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write .{ext} files; name a file ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (e.g. curve.png)")
    if os.path.isdir(path):
        raise UsageError(f"--plot {path} is a directory; name the image file, e.g. {os.path.join(path, 'curve.png')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--plot {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--plot {path}: the directory {parent} is not writable")


def _namespace_text(args: argparse.Namespace) -> str:
    shown = {k: v for k, v in vars(args).items() if k not in ("lr_step_list", "gpu_list", "work_load")}
    return "Namespace(" + ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items())) + ")"


if __name__ == "__main__":
    sys.exit(main())
