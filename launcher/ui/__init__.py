"""The job page and the report: what a person sees of a running or finished job in a browser.

``--ui`` serves the live page (``server.py``, fed by ``model.py``'s thread-safe view of the job);
``--report FILE.html`` writes the same content at the job's end as one self-contained static file
(``report.py``, no scripts, charts from ``svg.py``). Both read one snapshot, a plain JSON-able dict
(the contract is in ``model.py`` / the issue's notes). Standard library only: the core install stays
click and PyYAML.
"""
