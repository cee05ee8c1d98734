"""Split models: one transformer whose parts take turns on the device (the Cosmos3 pattern).

A split model names its mutually exclusive parts in a ClassVar and wraps each part's work in a phase
of its `scheduler`:

    class Cosmos3(SplitModel, nn.Module):
        _split_parts = {"reasoner": "reasoner", "generator": ("generator", "generator_head")}

        def forward(self, tokens, latents):
            hidden = self.embed(tokens) + self.pos_embed    # shared: stays on the device
            with self.scheduler.resident("reasoner"):
                context = self.reasoner(hidden)
            with self.scheduler.resident("generator"):
                return self.generator_head(self.generator(latents, context))

`Scheduler.from_pipeline` picks the parts up when the model is a selected DiT of the pipeline: each
part becomes an exclusive group named after the part (so exactly one part is on the device at a
time), the model minus its parts a resident-policy group named by the model's path (added with
``exclude=`` the parts: every tensor outside them, also one held directly on the model such as
``pos_embed`` or ``scale_shift_table``), and it sets the model's `scheduler` attribute.  Until
then `scheduler` is a `NoOffload`, so the model runs unchanged with offloading off.

Rules: part paths are dotted paths relative to the model; parts may not contain each other; a
tensor outside the parts may sit anywhere (directly on the model, on a module that also contains a
part, in a submodule), but one tensor may not be both inside a part and outside it, nor in two
parts (tied weights across that line are refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from residency.group.no_offload import NoOffload

__all__ = ["SplitModel", "split_parts"]


class _SchedulerSlot:
    """The `scheduler` attribute of a split model: a `NoOffload` until a scheduler is attached.

    A non-data descriptor: the first read of an unattached model stores a fresh `NoOffload` in the
    model's own ``scheduler`` attribute; assigning ``model.scheduler = s`` replaces it.
    """

    def __get__(self, model: object, owner: type) -> object:
        if model is None:
            return self
        scheduler = NoOffload()
        vars(model)["scheduler"] = scheduler
        return scheduler


class SplitModel:
    """Mixin for a model with mutually exclusive parts; subclass it beside `nn.Module`.

        class Cosmos3(SplitModel, nn.Module):
            _split_parts = {"reasoner": "reasoner", "generator": "generator"}

            def forward(self, x):
                with self.scheduler.resident("reasoner"):
                    context = self.reasoner(x)
                with self.scheduler.resident("generator"):
                    return self.generator(x, context)

    `_split_parts` maps each part name (its group name) to one dotted path or a tuple of them,
    relative to the model.  A copy (``copy.deepcopy``, pickling) of the model is detached: its
    `scheduler` is a fresh `NoOffload`.  After ``scheduler.close()`` the model still points at the
    closed scheduler; assign a new one (``model.scheduler = NoOffload()``) to run it again.
    """

    #: Part name -> dotted path(s) of the part's modules, relative to the model.
    _split_parts: ClassVar[Mapping[str, str | tuple[str, ...]]] = {}

    #: Where the parts' groups live: set by `Scheduler.from_pipeline` (or by hand); a `NoOffload`
    #: until then, so ``with self.scheduler.resident(part):`` always works.
    scheduler: object = _SchedulerSlot()  # a Scheduler or a NoOffload

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.pop("scheduler", None)  # a scheduler belongs to the original's tensors
        return state


def split_parts(model: object) -> dict[str, tuple[str, ...]]:
    """The parts a model declares, each as a tuple of dotted paths ({} for an unsplit model)."""
    if not isinstance(model, SplitModel):
        return {}
    return {
        name: (paths,) if isinstance(paths, str) else tuple(paths)
        for name, paths in type(model)._split_parts.items()
    }
