"""Every rank runs rank 0's plan: a rank whose own planning broke a near tie the other way (a
4-rank tiny Mixtral once got two TP roles for its router and failed in gloo) runs rank 0's
decisions, and an error while planning on one rank ends every rank with it instead of leaving
the others waiting in a collective."""

from runtime.launch import spawn


def _worker(rank: int, world: int) -> list:
    import autopar
    import autopar.execution.parallelize as par
    from autopar import models

    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    real = par._choose_plan

    def other(model, inputs, loss_fn, plan, layout, cluster):  # rank 1 would pick TP+SP
        return real(model, inputs, loss_fn, plan, autopar.Layout(tp=world, sp=True), cluster)

    par._choose_plan = other if rank else real
    pm = autopar.parallelize(models.build("tiny-llama", seed=1), world, example_inputs=batch,
                             layout=autopar.Layout(dp=world, zero=1))
    pm(*batch).backward()  # ranks on different plans would fail or hang here
    ran = pm.plan.layout.short()

    def broken(*args, **kwargs):
        raise autopar.InputError("planning failed here")

    par._choose_plan = broken if rank == 0 else real
    failures = []
    try:
        autopar.parallelize(models.build("tiny-llama", seed=1), world, example_inputs=batch)
        failures.append("no error")
    except autopar.InputError as exc:
        if "planning failed here" not in str(exc):
            failures.append(("unhelpful error", str(exc)))
    par._choose_plan = real
    return ran, failures


def test_ranks_run_rank0s_plan_and_share_its_errors():
    results = spawn(_worker, 2, timeout_s=300)
    assert [r[1] for r in results] == [[], []]
    assert results[0][0] == results[1][0] == "dp2 zero1 mb2 ga1 fp32", results
