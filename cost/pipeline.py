"""Pipeline schedules: bubble, activations held in flight, and step time.

Bubble fractions follow the playbook: (p-1)/m for all-forward-all-backward (AFAB) and 1F1B,
(p-1)/(v*m) for interleaved 1F1B with v chunks per rank. Zero-bubble (ZB-H1, Qi et al. 2023,
"Zero Bubble Pipeline Parallelism") splits backward into input- and weight-gradient passes and
fills the bubble with the latter; ZB-H1 "reduces the bubble to about 1/3 of 1F1B's" at 1F1B's
memory, so it is modelled as (p-1)/(3m). The fraction is the playbook's: idle time over useful
time, t_bubble / t_ideal.
"""

from __future__ import annotations

SCHEDULES = ("afab", "1f1b", "interleaved-1f1b", "zero-bubble")
_ALIASES = {"interleaved": "interleaved-1f1b", "zb": "zero-bubble", "zbh1": "zero-bubble"}
ZB_H1_BUBBLE_SHARE = 1 / 3  # Qi et al. 2023: ZB-H1 bubble about a third of 1F1B's


def _schedule(schedule: str) -> str:
    name = _ALIASES.get(schedule, schedule)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {SCHEDULES}")
    return name


def _check(pp: int, microbatches: int, virtual_stages: int) -> None:
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages} must be >= 1"
        )


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle over useful time of a pipeline of ``pp`` stages running ``microbatches``."""
    name = _schedule(schedule)
    _check(pp, microbatches, virtual_stages)
    base = (pp - 1) / microbatches
    if name == "interleaved-1f1b":
        return base / virtual_stages
    if name == "zero-bubble":
        return base * ZB_H1_BUBBLE_SHARE
    return base


def in_flight_microbatches(
    schedule: str, pp: int, microbatches: int, stage: int = 0, virtual_stages: int = 1
) -> float:
    """Micro-batches' worth of this stage's activations that ``stage`` holds at its peak.

    afab: all m (every forward runs before any backward). 1F1B: min(m, pp - stage) (the first
    stage warms up with pp forwards). Zero-bubble: min(m, pp) on every stage: in PyTorch's ZB1P
    order (ScheduleInterleavedZeroBubble, which autopar runs) every stage holds pp micro-batches
    whose weight half has not run yet (the last of 4 stages runs F I F I F I F I W ...; the
    first F F F F I W ...), and a micro-batch's saved values live until its W (measured:
    tests/runtime/test_pipeline_memory.py). Interleaved 1F1B (Megatron-LM's
    get_num_warmup_microbatches): stage r runs 2*(pp-r-1) + (v-1)*pp warm-up chunk forwards plus
    the one in progress, each chunk holding 1/v of the stage's layers, so
    (2*(pp-r-1) + (v-1)*pp + 1) / v; for r = 0 this is pp*(1 + (pp-1)/(pp*v)), the factor of
    Korthikanti et al. 2022. Capped at m. With pp = 1 there is no pipeline: one micro-batch.
    """
    name = _schedule(schedule)
    _check(pp, microbatches, virtual_stages)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in [0, pp={pp})")
    if pp == 1:
        return 1.0
    if name == "afab":
        return float(microbatches)
    if name == "interleaved-1f1b":
        v = virtual_stages
        chunks = 2 * (pp - stage - 1) + (v - 1) * pp + 1
        return float(min(microbatches, chunks / v))
    if name == "zero-bubble":
        return float(min(microbatches, pp))
    return float(min(microbatches, pp - stage))


def pipeline_step_time(
    stage_compute_s: float,
    p2p_s: float,
    pp: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int = 1,
) -> tuple[float, float]:
    """(total, bubble) seconds of one step.

    stage_compute_s: forward + backward time of one micro-batch on the slowest stage.
    p2p_s: time of one point-to-point transfer between adjacent stages (activations forward;
        the gradient going back is the same size). Each micro-batch slot carries one of each,
        v of each under interleaving (the playbook: v times the point-to-point traffic);
        the caller passes what compute leaves exposed (`cost.terms.pipeline_parallel.p2p_exposed`).
    total = (m + bubble slots) * slot, bubble = bubble slots * slot, with
    bubble slots = bubble_fraction * m ((p-1) for 1F1B).
    """
    _check(pp, microbatches, virtual_stages)
    if stage_compute_s < 0 or p2p_s < 0:
        raise ValueError("pipeline_step_time: times must be >= 0")
    if pp == 1:
        return microbatches * stage_compute_s, 0.0
    name = _schedule(schedule)
    v = virtual_stages if name == "interleaved-1f1b" else 1
    slot = stage_compute_s + 2 * v * p2p_s
    bubble_slots = bubble_fraction(name, pp, microbatches, virtual_stages) * microbatches
    return (microbatches + bubble_slots) * slot, bubble_slots * slot
