"""Benchmarks (`python -m autopar bench ...`): tables, JSON, ratios measured in one run."""
