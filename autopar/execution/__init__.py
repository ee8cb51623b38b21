"""Execution: `autopar.parallelize` turns a plan into a module that runs on process groups."""
