"""Calibration: measuring this machine for `Cluster.local()`."""
