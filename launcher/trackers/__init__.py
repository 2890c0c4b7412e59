"""Trackers that collective (non parameter-server) jobs talk to while they start.

* :mod:`.rabit` - a tracker for dmlc's rabit protocol (XGBoost up to 2.0,
  anything built on dmlc rabit), written here from the protocol; it runs
  inside the launcher.
* :mod:`.xgboost_child` - a small program, run with the user's Python, that
  starts the tracker shipped in XGBoost 2.1+ (``xgboost.tracker.RabitTracker``)
  and reports its address on stdout: the launcher never imports xgboost.

Each module depends on the standard library only (``xgboost_child`` also on
xgboost, in its own process) and imports nothing else from the launcher.
"""
