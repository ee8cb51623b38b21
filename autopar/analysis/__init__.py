"""Analysis: per-node FLOPs and bytes, saved activations, repeated blocks, the cost facts."""
