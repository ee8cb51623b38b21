"""The terms of a training step's time, one module per technique.

`cost.step.predict` adds them up; each term is a function of the step's facts
(`cost.step_facts.StepFacts`), the cluster and the layout and returns seconds:

- `compute`: every node's roofline time (`node_times`), per pipeline stage forward and backward;
- `recompute`: what the backward rebuilds (a manual mode, or "auto"'s choice), the activation
  memory that keeps, and the recompute seconds per stage;
- `tensor_parallel`: the TP collectives left exposed after Megatron's overlaps;
- `context_parallel`: the ring exchange of K/V not hidden behind attention;
- `expert_parallel`: the dispatch and combine all-to-alls;
- `pipeline_parallel`: the point-to-point transfers and the bubble of the schedule;
- `data_parallel`: the gradient sync and ZeRO's weight gathers (exposed and total);
- `optimizer`: the AdamW step on the local shard.

`common` holds what several terms share (stage assignment, overlap, per-stage parameters).
"""
