import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from residency import Scheduler

from conftest import make_block, run_block, twin

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
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


@pytest.mark.fast
def test_the_quickstart_example_runs(capsys):
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    assert "outputs bit-identical to the model never offloaded" in capsys.readouterr().out


_PEAK_SCRIPT = """
import resource, torch
from torch import nn
from residency import Scheduler
torch.set_num_threads(1)
model = nn.Module()
for i in range(16):                       # 16 x 32 MiB = 512 MiB of weights
    model.register_parameter(f"p{i}", nn.Parameter(torch.ones(8 * 2**20)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
Scheduler("cpu", chunk_nbytes=64 * 2**20).add("big", model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert all(torch.equal(p, torch.ones(8 * 2**20)) for p in model.parameters())
print((after - before) * 1024)
"""


def test_registration_never_holds_the_weights_twice():
    """Peak RSS during `add` of 512 MiB grows by about one chunk (64 MiB), not by the weights."""
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True,
                            text=True, check=True, timeout=300)
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 160 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB during add"
