"""How big the benchmark cases are: a tiny scale for CI, a default that fits a small machine, a full one.

    scale = Scale.named("default", torch.device("cpu"))
    for nbytes in scale.sizes:
        ...

Pick it with ``pytest benchmarks/ --bench-scale=tiny`` or ``RESIDENCY_BENCH_SCALE=tiny``.  On an
accelerator the size ladders reach further (``default`` to 4 GiB, ``full`` to 16 GiB).
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["SCALE_NAMES", "GiB", "KiB", "MiB", "Scale", "tensors_for"]

KiB, MiB, GiB = 2**10, 2**20, 2**30

SCALE_NAMES = ("tiny", "default", "full")


def _positive_sizes(instance, attribute, value) -> None:
    if not value or any(v <= 0 for v in value) or list(value) != sorted(value):
        raise ValueError(f"{attribute.name} must be positive and ascending, got {value!r}")


def _positive(instance, attribute, value) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class Scale:
    """The sizes of every case.  Byte counts are of the weights of one group."""

    #: "tiny", "default" or "full".
    name: str = attrs.field(validator=attrs.validators.in_(SCALE_NAMES))
    #: Transition vs group size: one case per size.
    sizes: tuple[int, ...] = attrs.field(converter=tuple, validator=_positive_sizes)
    #: Transition vs tensor count: the fixed bytes, and one case per count.
    count_nbytes: int = attrs.field(validator=_positive)
    tensor_counts: tuple[int, ...] = attrs.field(converter=tuple, validator=_positive_sizes)
    #: The headline swap: two groups of `swap_nbytes` with `swap_tensors` tensors each.
    swap_nbytes: int = attrs.field(validator=_positive)
    swap_tensors: int = attrs.field(validator=_positive)
    #: Eviction of unchanged vs changed weights.
    evict_nbytes: int = attrs.field(validator=_positive)
    evict_tensors: int = attrs.field(validator=_positive)
    #: Cold start (``Scheduler.add``): one case per size.
    cold_sizes: tuple[int, ...] = attrs.field(converter=tuple, validator=_positive_sizes)
    #: The many-module model of the re-entry case and the per-forward peers.
    model_modules: int = attrs.field(validator=_positive)
    #: Calls per round of the re-entry case, and rounds of the microsecond cases.
    reentry_iterations: int = attrs.field(validator=_positive)
    micro_rounds: int = attrs.field(validator=_positive)
    #: Rounds of a copy case: enough to move about `round_budget_nbytes`, within these bounds.
    min_rounds: int = attrs.field(validator=_positive)
    max_rounds: int = attrs.field(validator=_positive)
    round_budget_nbytes: int = attrs.field(validator=_positive)

    def rounds(self, nbytes: int) -> int:
        """Measured rounds for a case moving `nbytes` per call (fewer for big copies)."""
        return max(self.min_rounds, min(self.max_rounds, self.round_budget_nbytes // max(nbytes, 1)))

    @classmethod
    def named(cls, name: str, device: torch.device) -> Scale:
        """The scale called `name` for `device` (accelerators get longer size ladders)."""
        if name not in SCALE_NAMES:
            raise ValueError(f"unknown benchmark scale {name!r}; choose one of {', '.join(SCALE_NAMES)}")
        on_accelerator = device.type != "cpu"
        if name == "tiny":
            return cls(
                name=name, sizes=(64 * KiB, 256 * KiB), count_nbytes=256 * KiB,
                tensor_counts=(10, 100), swap_nbytes=1 * MiB, swap_tensors=16,
                evict_nbytes=256 * KiB, evict_tensors=50, cold_sizes=(64 * KiB, 256 * KiB),
                model_modules=20, reentry_iterations=50, micro_rounds=3, min_rounds=2,
                max_rounds=3, round_budget_nbytes=1 * MiB,
            )
        ladder = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]
        if name == "full":
            ladder += [2 * GiB] + ([4 * GiB, 8 * GiB, 16 * GiB] if on_accelerator else [])
        elif on_accelerator:
            ladder += [2 * GiB, 4 * GiB]
        return cls(
            name=name, sizes=ladder, count_nbytes=64 * MiB,
            tensor_counts=(10, 100, 1_000, 10_000), swap_nbytes=400 * MiB, swap_tensors=400,
            evict_nbytes=64 * MiB, evict_tensors=1_000,
            cold_sizes=(16 * MiB, 64 * MiB, 256 * MiB) + ((1 * GiB,) if name == "full" else ()),
            model_modules=1_000, reentry_iterations=2_000, micro_rounds=30, min_rounds=5,
            max_rounds=40, round_budget_nbytes=4 * GiB,
        )


def tensors_for(nbytes: int) -> int:
    """Tensors in a group of `nbytes` for the size ladder: one per MiB, between 1 and 400."""
    return max(1, min(400, nbytes // MiB))
