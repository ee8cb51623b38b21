"""Every rank runs rank 0's plan: the others do not plan at all (a near tie broken differently
in another process made a 4-rank tiny Mixtral run two plans and fail in gloo), and an error
while planning on rank 0 ends every rank with it instead of leaving them waiting."""

from runtime.launch import spawn


def _worker(rank: int, world: int) -> list:
    import autopar
    import autopar.execution.parallelize as par
    from autopar import models

    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    failures = []
    real = par._choose_plan
    if rank:  # only rank 0 may plan
        par._choose_plan = lambda *a, **k: failures.append("rank 1 planned") or real(*a, **k)
    pm = autopar.parallelize(models.build("tiny-llama", seed=1), world, example_inputs=batch)
    pm(*batch).backward()
    failures += [] if pm.plan.layout.world_size == world else ["wrong plan"]

    def broken(*args, **kwargs):
        raise autopar.InputError("planning failed here")

    par._choose_plan = broken if rank == 0 else real
    try:
        autopar.parallelize(models.build("tiny-llama", seed=1), world, example_inputs=batch)
        failures.append("no error")
    except autopar.InputError as exc:
        if "planning failed here" not in str(exc):
            failures.append(("unhelpful error", str(exc)))
    par._choose_plan = real
    return failures


def test_ranks_run_rank0s_plan_and_share_its_errors():
    assert spawn(_worker, 2, timeout_s=300) == [[], []]
