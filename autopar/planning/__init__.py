"""Planning: `autopar.plan`, the Plan it returns (summary, explain, JSON) and its report helpers."""
