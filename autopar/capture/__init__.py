"""Capture: the single-device training step as one joint forward + backward aten graph."""
