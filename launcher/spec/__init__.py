"""Pure descriptions of a job: the frozen :class:`~.job.JobSpec` (and :class:`~.job.Host`),
the hostfile grammar (:mod:`.hosts`), the placement and per-process environment
(:mod:`.plan`), and the launcher's environment policy (:mod:`.env`). Nothing here touches the
network, starts a process or imports a backend."""
