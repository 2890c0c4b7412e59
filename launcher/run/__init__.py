"""Running a job, above the backends: the supervisor (:mod:`.supervisor`), signals
(:mod:`.signals`), the scheduler's address and ports (:mod:`.addresses`), reports and dry runs
(:mod:`.report`), and ``pslaunch doctor``'s checks (:mod:`.doctor`)."""
