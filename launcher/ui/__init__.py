"""The job page and the report: what a person sees of a running or finished job in a browser.

``--ui`` serves the live page (:mod:`.server`, fed by :mod:`.model`'s thread-safe view of the job,
which the supervisor keeps up to date); ``--report FILE.html`` writes the same content at the
job's end as one self-contained static file (:mod:`.report`, no scripts, charts from :mod:`.svg`).
Both read one snapshot, a plain JSON-able dict (its shape: :meth:`.model.JobView.snapshot`).
Standard library only: the core install stays click and PyYAML.
"""
