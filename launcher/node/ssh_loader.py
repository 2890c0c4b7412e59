# ruff: noqa: UP004, UP031
"""Runs a node program from the node bundle, in memory (Python 3.5 syntax).

:data:`launcher.node.protocol.BOOTSTRAP` runs this file's source; it reads the node bundle (a zip,
length-prefixed) from stdin, makes its modules importable from memory (first on the import path,
so nothing installed on the host can stand in for them) and runs the bundle's ``__main__.py``, as
``python3 bundle.zip`` would: the ssh backend's node agent (:mod:`.ssh_wrapper`) or ``pslaunch
doctor``'s checks (:mod:`.probe`). Nothing is written to the host's disk.
"""

import importlib.abc
import importlib.util
import io
import os
import sys
import zipfile


def _read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(255)
        data += chunk
    return data


class BundleImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules of a zip held in memory."""

    def __init__(self, data):
        z = zipfile.ZipFile(io.BytesIO(data))
        self.files = dict((n, z.read(n)) for n in z.namelist())

    def find_spec(self, name, path=None, target=None):
        base = name.replace(".", "/")
        for filename, package in ((base + "/__init__.py", True), (base + ".py", False)):
            if filename in self.files:
                return importlib.util.spec_from_loader(name, self, origin="pslaunch-bundle/" + filename,
                                                       is_package=package)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        filename = module.__spec__.origin[len("pslaunch-bundle/"):]
        module.__file__ = module.__spec__.origin  # (a path that exists nowhere: nothing is on disk)
        exec(compile(self.files[filename], module.__spec__.origin, "exec"), module.__dict__)


def run():
    importer = BundleImporter(_read(int(_read(10))))
    sys.meta_path.insert(0, importer)
    exec(compile(importer.files["__main__.py"], "pslaunch-bundle/__main__.py", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":  # (the bootstrap runs this source as __main__)
    run()
