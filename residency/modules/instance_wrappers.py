"""Per-instance wrappers: a callable set as one module's own method, over what the module ran.

    wrapper = MyWrapper(block, "forward", attached=stream)   # reads what block.forward runs now
    wrapper.install()                                         # block(x) now calls wrapper(x)
    wrapper.reachable()                                       # still reached from block.forward?
    wrapper.remove()                                          # block as it was; repeatable

`InstanceWrapper` is the one mechanism behind residency's two per-instance wrappers: the
diffusers adapter's `PhaseEntry` (a component's ``forward``/``encode``/``decode`` run inside its
group's phase) and layer mode's block forwards (`residency.placement.layers`).  It owns what they share -
setting the attribute over what was there, finding it again through chains of wrappers,
removing it, being detached, and deep copies - and a subclass adds only its ``__call__``, which
runs ``self.__wrapped__`` inside whatever `attached` stands for.

[Note: per-instance wrappers]
* What is wrapped.  A wrapper wraps what ``module.<name>(...)`` runs when it is made: the class's
  method bound to the module (`replaced` is False), or an instance attribute already there -
  another library's wrapper (diffusers' hook registry, ``functools.wraps``), `replaced` True.
  Detached wrappers of ours sitting on top are looked through, so pass-throughs never pile up.
  What is wrapped is ``__wrapped__`` (``functools.update_wrapper``'s word): ``inspect.signature``
  follows it, and so does every chain walk.
* Chains.  A wrapper set over ours later holds ours as its ``__wrapped__``, and so on: `chain`
  walks from a module's attribute down those links, outermost first, at most `MAX_CHAIN` deep and
  stopping at a link already seen.  A wrapper is *reachable* when it is on that chain: calling
  the module still runs it.  A library that set its wrapper below ours and removes it later
  puts back the method it saw (diffusers' ``disable_cache``), which drops ours; `unreachable`
  finds those, and the owner sets a fresh one.
* Removal restores exactly what was there when this is the attribute (the wrapped object put
  back, or the attribute deleted so the class's method shows through); under another wrapper it
  cannot be taken out by generic code, so it stays there, *detached*.  Either way it is detached
  afterwards: `attached` is None and a call passes straight through to ``__wrapped__``.  A
  removal is repeatable (an interrupt between its two steps leaves a wrapper off the module, not
  yet detached, which no call of the module reaches; the repeat detaches it: see [Note:
  interrupts] in `residency.scheduler.scheduler`).
* Deep copies.  ``copy.deepcopy`` of a wrapper is a deep copy of what it wraps, so a copied module
  is plain: its own class method bound to the copy (or a copy of the other wrapper), never a
  wrapper of ours, never what `attached` holds (a scheduler, its lock, a block stream).
* `attached` lives in a slot, not in ``__dict__``: a wrapper set on top copies the ``__dict__`` of
  the one it wraps (``functools.update_wrapper``) and must not carry it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

from torch import nn

__all__ = ["MAX_CHAIN", "InstanceWrapper", "chain", "unreachable"]

#: How many links deep `chain` follows ``__wrapped__``.
MAX_CHAIN = 64


def chain(entry_point: object) -> Iterator[object]:
    """`entry_point` and every callable under it through ``__wrapped__``, outermost first.

        any(link is wrapper for link in chain(vars(module).get("forward")))

    At most `MAX_CHAIN` links; a link met a second time ends the walk (a cycle).
    """
    seen: set[int] = set()
    link = entry_point
    while link is not None and id(link) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(link))
        yield link
        link = getattr(link, "__wrapped__", None)


def unreachable(wrappers: Sequence[InstanceWrapper]) -> list[int]:
    """The indices of `wrappers` a call of their module no longer reaches (dropped by another
    library: see [Note: per-instance wrappers]).

    The common case - each one still its module's attribute - costs one dictionary lookup per
    wrapper; only the others' chains are walked.
    """
    return [
        index for index, wrapper in enumerate(wrappers)
        if wrapper.module.__dict__.get(wrapper.name) is not wrapper and not wrapper.reachable()
    ]


def _wrapped_method(module: nn.Module, name: str) -> tuple[object, bool]:
    """(what ``module.<name>(...)`` runs now, whether that is an instance attribute), looking
    through detached wrappers of ours on top."""
    current = module.__dict__.get(name)
    if current is None:
        return getattr(module, name, None), False  # the class's method, bound
    replaced = True
    while isinstance(current, InstanceWrapper) and current.attached is None:
        current, replaced = current.__wrapped__, current.replaced
    return current, replaced


class InstanceWrapper:
    """A callable set as module attribute `name` over what a call ran before (see [Note:
    per-instance wrappers]); subclasses give ``__call__``.

        class Counting(InstanceWrapper):
            __slots__ = ()
            def __call__(self, *args, **kwargs):
                if self.attached is not None:
                    self.attached.append(args)
                return self.__wrapped__(*args, **kwargs)

        counting = Counting(block, "forward", attached=[])
        counting.install()
        ...
        counting.remove()          # block.forward is the class's method again

    Fields, written by this class only: `module`, `name`, ``__wrapped__`` and `replaced` are set
    when it is made and never change; `attached` (what a call runs inside: the subclass's) goes
    from its value to None, once, at `remove`.
    """

    __slots__ = ("module", "name", "replaced", "attached", "__wrapped__")

    def __init__(self, module: nn.Module, name: str, attached: object) -> None:
        method, replaced = _wrapped_method(module, name)
        #: The module whose attribute this is.
        self.module = module
        #: The attribute: "forward", "encode", ...
        self.name = name
        #: What a call ran before: the class's method bound to `module`, or another wrapper.
        self.__wrapped__ = method
        #: Whether ``__wrapped__`` was an instance attribute, which `remove` puts back.
        self.replaced = replaced
        #: What a call runs inside (the subclass's); None once detached: a pass-through.
        self.attached = attached

    @property
    def method(self) -> object:
        """What a call ran before this was set (``__wrapped__``)."""
        return self.__wrapped__

    def install(self) -> None:
        """Become ``module.<name>``."""
        setattr(self.module, self.name, self)

    def reachable(self) -> bool:
        """Whether calling the module still runs this: it is the attribute, or a wrapper set over
        it leads to it through ``__wrapped__``."""
        return any(link is self for link in chain(self.module.__dict__.get(self.name)))

    def remove(self) -> None:
        """Put back what this replaced if this is the attribute (else it stays under the other
        wrapper); detached either way.  Repeatable."""
        module = self.module
        if module.__dict__.get(self.name) is self:
            if self.replaced:
                setattr(module, self.name, self.__wrapped__)
            else:
                delattr(module, self.name)  # the class's method shows through again
        self.attached = None

    def __deepcopy__(self, memo: dict) -> object:
        return copy.deepcopy(self.__wrapped__, memo)
