"""``pslaunch manifest``: the job's own command line in, the same job as Kubernetes YAML out
(issue 37, item 4). The spec is built as for a run (:func:`.job.build_spec`, on the k8s backend's
rules); the objects are ``launcher.backends.k8s``'s pure builders (:func:`~launcher.backends.k8s.job_manifest`).
Nothing is created and nothing connects back: the YAML is for a cluster's own pipeline."""

from __future__ import annotations

import os
from typing import Any, Sequence

import click

from ..backends import k8s
from ..errors import ConfigError
from .clickutil import JobCommand, invoke
from .common import configure_logging
from .job import build_spec
from .run import add_job_options

MANIFEST_HELP = """Print the job as Kubernetes YAML instead of running it, for a cluster that
applies its objects through its own pipeline. Give it the job's own options and
command (those of a run, --k8s-image required); nothing of pslaunch runs the job.

\b
--format plain (the default): a Secret (the job's secret, PSLAUNCH_SECRET),
a headless Service and one Pod per process (restartPolicy Never, hostname and
subdomain, labels pslaunch.io/job, role, rank), each running COMMAND directly
with its role's variables: DMLC_PS_ROOT_URI (or a torch job's MASTER_ADDR) is
the scheduler's (rank 0's) Pod name, scheduler.<job> (worker-0.<job>).
--format pytorchjob: a Kubeflow PyTorchJob (--tracker torch; Master + Worker).
--format mxjob: a Kubeflow MXJob (a ps job; Scheduler, Server, Worker).
A job that has no such form (--tracker rabit or xgboost, --max-restarts,
mxjob for a torch job, ...) is one line naming why, exit 2.

\b
The YAML holds the job's secret in its Secret (a new one each time): apply it,
keep it out of a repository. The launcher's own options (--ui, --log-dir, ...)
are accepted and do nothing here. See docs/k8s.md ("pslaunch manifest").

\b
Examples:
    pslaunch manifest --k8s-image registry.example/train:1 -n 2 -s 1 \\
        python3 train.py --kv-store dist_sync | kubectl apply -f -
    pslaunch manifest --format pytorchjob --k8s-image registry.example/ddp:1 \\
        -n 4 --tracker torch --jobname ddp python3 ddp.py > ddp.yaml
    pslaunch manifest --format mxjob --k8s-image registry.example/mx:1 \\
        --k8s-namespace team-a -n 2 -s 2 python3 train_mnist.py
"""


@click.command(name="pslaunch manifest", help=MANIFEST_HELP, cls=JobCommand,
               context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100,
                                     allow_interspersed_args=False))
@click.option("--format", "fmt", type=click.Choice(k8s.MANIFEST_FORMATS), default="plain", show_default=True,
              help="plain: a Secret, a headless Service and one Pod per process; pytorchjob or mxjob: a Kubeflow "
                   "job (the operator's then: restarts, MASTER_ADDR/RANK or DMLC_*, the Pods' names).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def manifest_command(**kw: Any) -> None:
    launcher, k8s_name = kw.get("launcher"), k8s.K8sBackend.name
    if launcher not in (None, k8s_name):
        raise ConfigError(f"pslaunch manifest prints Kubernetes objects; drop --launcher {launcher}")
    if not kw.get("k8s_image"):
        raise ConfigError("pslaunch manifest needs --k8s-image IMAGE: the image the Pods run (with the job's "
                          "Python and program)")
    spec = build_spec({**kw, "launcher": k8s_name}, dict(os.environ))
    # (the job's id and secret: new ones each time, as a run makes them; the builders are pure)
    job, objects = k8s.job_manifest(spec, kw["fmt"], job_id=os.urandom(6).hex(), secret=os.urandom(32).hex())
    click.echo(k8s.manifest_yaml(job, kw["fmt"], objects), nl=False)


add_job_options(manifest_command)


def main(args: Sequence[str]) -> int:
    """``pslaunch manifest ARGS``: returns the exit code (the YAML on stdout)."""
    configure_logging("WARNING")
    return invoke(manifest_command, list(args), "pslaunch manifest", "pslaunch manifest --help")
