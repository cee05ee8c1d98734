import torch

from residency import Scheduler

from conftest import make_block, run_block, twin


def test_swap_round_trip_is_bit_identical(scheduler: Scheduler):
    a, b = make_block(seed=1), make_block(seed=2)
    plain_a, plain_b = twin(a), twin(b)
    scheduler.add("a", a)
    scheduler.add("b", b)
    x = torch.randn(4, 32)
    with scheduler.resident("a"):
        out_a = run_block(a, x)
    with scheduler.resident("b"):
        out_b = run_block(b, x)
    assert torch.equal(out_a, run_block(plain_a, x))
    assert torch.equal(out_b, run_block(plain_b, x))
