# ruff: noqa: UP031 - Python 3.5 syntax (no annotations, no f-strings): the ssh wrapper imports this package
"""Everything that runs on a node, and the one place that says where it is.

The programs here run beside the user's command, on the node that runs it:

* :mod:`.agent` is the node agent: it runs a node's processes for the launcher, reports them and
  obeys it, speaking :mod:`.protocol` (frames, and the three transports that carry them);
* :mod:`.ssh_wrapper` is the ssh backend's agent for one host, over one ssh channel (with the
  interface lookup and the tree sync, :mod:`.treesync`, before the processes start);
* :mod:`.mpirank` is every MPI rank of the mpi backend's single ``mpirun``, and :mod:`.task` every
  task of a batch system (sge, yarn, slurm): each works out its one command and hands it to the agent;
* :mod:`.probe` is ``pslaunch doctor``'s checks on a host, sent as the ssh wrapper is;
* :mod:`.watchdog` is the dead-man switch, on the launching host and on the nodes;
* :func:`command` also starts the builtin ps-lite scheduler (``--scheduler builtin``) on the
  launching host, though it lives in :mod:`launcher.trackers.pslite` (it needs pyzmq);
* :mod:`.procgroup` holds the process-group helpers all of them share with the launcher.

Rules (``tests/unit/test_architecture.py`` enforces the first): these modules import only the
standard library, :mod:`pscontract` and each other; what an ssh host runs (:mod:`.protocol`,
:mod:`.agent`, :mod:`.ssh_wrapper`, :mod:`.ssh_loader`, :mod:`.probe`, :mod:`.procgroup`,
:mod:`.treesync`) keeps Python 3.5 syntax (the ssh backend runs it with a host's own
``python3``); the rest need Python 3.7. Nothing here finds a sibling by its own path arithmetic:
:func:`command` starts a node program from this installation, :func:`bundle` packs the node
programs for a host that has no installation (a yarn container, an ssh host).
"""

import os
import sys

#: The directory that holds the ``launcher`` and ``pscontract`` packages of this installation.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The node programs that can be started with :func:`command` (module names in this package).
PROGRAMS = ("watchdog", "mpirank", "task", "pslite")
#: Node programs that need the site packages (the rank wrapper may import mpi4py, the builtin
#: ps-lite scheduler pyzmq).
_SITE = ("mpirank", "pslite")
#: Programs started as node programs but not standard-library-only, so not in this package.
_ELSEWHERE = {"pslite": "launcher.trackers.pslite"}
#: What a bundle holds besides the node package: the contract, and the packages' ``__init__``.
_BUNDLED = ("launcher/__init__.py", "pscontract/__init__.py", "pscontract/netif.py")


def path(name):
    """The file of node module ``name`` (``"ssh_loader"``) in this installation."""
    return os.path.join(ROOT, "launcher", "node", name + ".py")


def command(program, python=""):
    """The argv that runs node program ``program`` from this installation with ``python``.

    ``python -S -c`` with this installation's root first on ``sys.path``: the program does
    not depend on the working directory or on ``PYTHONPATH``, and no site packages are
    imported (they cost start-up time; only the rank wrapper may need one, mpi4py, and the
    ps-lite scheduler needs pyzmq: those two run without ``-S``). Arguments go after it.
    """
    if program not in PROGRAMS:
        raise ValueError("unknown node program %r" % program)
    code = ("import sys; sys.path.insert(0, %r); from %s import main; sys.exit(main())"
            % (ROOT, _ELSEWHERE.get(program, "launcher.node." + program)))
    return [python or sys.executable, *(() if program in _SITE else ("-S",)), "-c", code]


#: The tracker programs (``launcher/trackers/<name>.py``) that run on the launching host with the
#: user's Python: see :func:`tracker_command`.
TRACKER_PROGRAMS = ("xgboost_child", "torch_store")


def tracker_command(program, python):
    """The argv that runs tracker program ``program`` with ``python`` (a Python with xgboost or torch).

    Run as a script, with the site packages and nothing of pslaunch imported (the program is
    self-contained); its own directory on ``sys.path`` holds no module that could shadow one.
    """
    if program not in TRACKER_PROGRAMS:
        raise ValueError("unknown tracker program %r" % program)
    return [python, os.path.join(ROOT, "launcher", "trackers", program + ".py")]


def source(rel):
    """The bytes of a file this installation ships to nodes (``"pscontract/netif.py"``), for :func:`bundle_files`."""
    if rel not in _BUNDLED and not (rel.startswith("launcher/node/") and rel.endswith(".py")):
        raise ValueError("%r is not a node file" % rel)
    with open(os.path.join(ROOT, rel), "rb") as f:
        return f.read()


def bundle_files(main):
    """``{path in the bundle: source bytes}``: the node package, the contract, and a ``__main__.py``
    that runs node program ``main`` (``python3 bundle.zip ARGS``, or the ssh bootstrap's loader)."""
    files = {"__main__.py": ("import sys\nfrom launcher.node.%s import main\nsys.exit(main())\n" % main).encode()}
    names = sorted(n for n in os.listdir(os.path.join(ROOT, "launcher", "node")) if n.endswith(".py"))
    for rel in [*_BUNDLED, *("launcher/node/" + n for n in names)]:
        files[rel] = source(rel)
    return files


def bundle(main):
    """A deterministic runnable zip of the node programs: ``python3 BUNDLE.zip ARGS`` runs ``main``."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in sorted(bundle_files(main).items()):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
    return buf.getvalue()
