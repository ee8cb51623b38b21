"""Strategies: how each op can be sharded (DTensor rules), the tensor-parallel recipe and its ILP."""
