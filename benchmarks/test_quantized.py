"""Bytes moved for int8 vs bf16 groups: a torchao int8 weight-only group moves its int8 bytes.

Two groups of the same Linear stack, one bf16 and its twin quantized with torchao's
``Int8WeightOnlyConfig``; each transition's record says how many bytes it copied.  The case times the
swap into the int8 group against the copy floor of its bytes, and stores both byte counts and their
ratio (``bytes_ratio``) in ``benchmark.extra_info``.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.figures import record
from benchmarks.floor import CopyFloor, FloorSamples, synchronize

#: Eight 1024x1024 bf16 Linears: 16 MiB, large enough that per-row scales are a small share.
_WIDTH, _DEPTH = 1024, 8


def _stack(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_DEPTH)]).to(torch.bfloat16)


def test_bytes_moved_int8_vs_bf16(benchmark, scheduler, device):
    """A swap into the int8 group moves about half the bytes of a swap into the bf16 one."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized = _stack()
    quantize_(quantized, Int8WeightOnlyConfig())
    scheduler.add("bf16", _stack())
    scheduler.add("int8", quantized)

    def enter(name: str) -> int:
        with scheduler.resident(name):
            pass
        synchronize(device)
        return scheduler.transitions[-1].nbytes

    enter("int8")
    bf16_nbytes, int8_nbytes = enter("bf16"), enter("int8")
    floor = FloorSamples(CopyFloor(int8_nbytes, device))

    def back_to_bf16() -> None:  # pytest-benchmark reads a setup's return value as arguments
        enter("bf16")
        floor.before_round()

    benchmark.pedantic(lambda: enter("int8"), setup=back_to_bf16, rounds=5)
    assert scheduler.transitions[-1].nbytes == int8_nbytes
    bytes_ratio = int8_nbytes / bf16_nbytes
    assert bytes_ratio < 0.55, f"the int8 group moved {bytes_ratio:.2f}x the bf16 bytes"
    record(benchmark, case="bytes_moved_int8_vs_bf16", nbytes=int8_nbytes, floor_s=floor.median(),
           bf16_nbytes=bf16_nbytes, int8_nbytes=int8_nbytes, bytes_ratio=bytes_ratio)
