"""The library's accelerator path on the simulated device with its memory protected, in one process.

Run by tests/test_protected_device.py as ``python tests/_protected_run.py SCENARIO``: device memory is
PROT_NONE outside the device's own workers, so any host read or write of device bytes - a missing
copy, a host-side ``torch.equal`` across devices, a view read on the host - ends the process with
SIGSEGV.  Compute runs on the stream's worker, later than the host queues it, with delays; a
missing wait shows as wrong bits.  Each scenario prints ``ok <scenario>`` when every output equals
the never-offloaded model's, bit for bit, and every edit reached the host.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simdevice  # noqa: E402

from residency import Scheduler  # noqa: E402


def _stack(seed: int, width: int = 256, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))  # on the device: the comparison runs on its worker


def module_mode(device: torch.device) -> None:
    """Swaps with edits by three paths (in place, ``.data``, a device kernel) and a prefetch."""
    models = {name: _stack(seed) for seed, name in enumerate(["encoder", "dit", "vae"])}
    plain = {name: copy.deepcopy(m).to(device) for name, m in models.items()}
    scheduler = Scheduler(device)
    scheduler.add("encoder", models["encoder"])
    scheduler.add("dit", models["dit"])
    scheduler.add("vae", models["vae"], policy="resident")
    x = torch.randn(8, 256, device=device)
    for step in range(3):
        with scheduler.resident("encoder"):
            assert _same(models["encoder"](x), plain["encoder"](x)), step
            scheduler.prefetch("dit")
        with scheduler.resident("dit"):
            assert _same(models["dit"](x), plain["dit"](x)), step
            with torch.no_grad():
                models["dit"][0][0].weight.mul_(1.5)                  # in place
                models["dit"][1][0].weight.data.add_(0.25)           # through .data
                torch.add(models["dit"][2][0].bias, 1.0, out=models["dit"][2][0].bias)  # a kernel
                plain["dit"][0][0].weight.mul_(1.5)
                plain["dit"][1][0].weight.data.add_(0.25)
                torch.add(plain["dit"][2][0].bias, 1.0, out=plain["dit"][2][0].bias)
        assert _same(models["vae"](x), plain["vae"](x)), step
    scheduler.close()
    torch.accelerator.synchronize()
    for name, model in models.items():  # every edit on the host, where the user's modules are
        for mine, theirs in zip(model.parameters(), plain[name].parameters(), strict=True):
            assert mine.device.type == "cpu" and torch.equal(mine, theirs.cpu()), name


class _Dit(nn.Module):
    """Repeated blocks in a ModuleList, as a DiT has them (what layer mode streams)."""

    def __init__(self, seed: int, depth: int = 6) -> None:
        super().__init__()
        self.blocks = _stack(seed, depth=depth)
        self.blocks = nn.ModuleList(list(self.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def layer_mode(device: torch.device) -> None:
    """A DiT whose blocks stream through the two slots, evicted by another group between steps."""
    dit, other = _Dit(7), _stack(8)
    plain = copy.deepcopy(dit).to(device)
    scheduler = Scheduler(device)
    scheduler.add("dit", dit, layers=True)
    scheduler.add("other", other)
    x = torch.randn(8, 256, device=device)
    for step in range(3):
        with scheduler.resident("dit"):
            assert _same(dit(x), plain(x)), step
            assert _same(dit(x), plain(x)), step
        with scheduler.resident("other"):
            other(x)
    scheduler.close()
    torch.accelerator.synchronize()
    for mine, theirs in zip(dit.parameters(), plain.parameters(), strict=True):
        assert mine.device.type == "cpu" and torch.equal(mine, theirs.cpu())


SCENARIOS = {"module": module_mode, "layer": layer_mode}


def main(scenario: str) -> None:
    device = simdevice.load(asynchronous=True, protect=True, compute_delay=2e-5,
                            copy_bandwidth=4e9)
    SCENARIOS[scenario](device)
    print(f"ok {scenario}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
