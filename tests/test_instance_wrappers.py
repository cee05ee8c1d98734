"""The per-instance wrapper mechanism itself (`residency.modules.instance_wrappers`), on plain modules.

Its two users are tested where they act: the diffusers adapter's `PhaseEntry` in
tests/test_adapter_wrappers.py and tests/test_diffusers_adapter.py, layer mode's block forwards in
tests/test_layer_mode.py.  Here: a wrapper over a class method and over another wrapper, removal
in either order, reachability through chains and past the limit, deep copies, detached wrappers.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from residency.modules.instance_wrappers import MAX_CHAIN, InstanceWrapper, chain, unreachable
from residency.placement.layers import _BlockForward

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


class Counting(InstanceWrapper):
    """Appends each call's first argument to `attached` (a list), then runs what it wraps."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        if self.attached is not None:
            self.attached.append(args[0])
        return self.__wrapped__(*args, **kwargs)


def other_wrapper(method):
    """Another library's wrapper: a function with ``__wrapped__`` (functools.wraps)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **kwargs)
    return wrapper


def counting(module: nn.Module, name: str = "forward") -> tuple[Counting, list]:
    calls: list = []
    wrapper = Counting(module, name, calls)
    wrapper.install()
    return wrapper, calls


def class_method_of(module: nn.Module) -> bool:
    forward = module.forward
    return forward.__self__ is module and forward.__func__ is type(module).forward


x = torch.ones(1, 4)


# -- setting and removing -------------------------------------------------------------------------


def test_over_a_class_method_it_runs_the_method_and_removal_deletes_the_attribute():
    module = nn.Linear(4, 4)
    expected = module(x)
    wrapper, calls = counting(module)
    assert vars(module)["forward"] is wrapper and not wrapper.replaced
    assert wrapper.method.__self__ is module and wrapper.method.__func__ is nn.Linear.forward
    assert torch.equal(module(x), expected) and calls == [x]
    wrapper.remove()
    assert "forward" not in vars(module) and class_method_of(module)
    assert wrapper.attached is None
    assert torch.equal(module(x), expected) and calls == [x]  # removed: not called


def test_over_another_wrapper_removal_puts_that_very_object_back():
    module = nn.Linear(4, 4)
    theirs = other_wrapper(module.forward)
    module.forward = theirs
    wrapper, calls = counting(module)
    assert wrapper.method is theirs and wrapper.replaced and wrapper.__wrapped__ is theirs
    module(x)
    assert calls == [x]
    wrapper.remove()
    assert vars(module)["forward"] is theirs


def test_a_wrapper_set_on_top_stays_and_ours_under_it_only_calls_through():
    module = nn.Linear(4, 4)
    expected = module(x)
    wrapper, calls = counting(module)
    theirs = other_wrapper(module.forward)  # set over ours
    module.forward = theirs
    assert wrapper.reachable() and list(chain(theirs))[:2] == [theirs, wrapper]
    wrapper.remove()
    assert vars(module)["forward"] is theirs, "generic code cannot take ours out from under it"
    assert wrapper.attached is None
    assert torch.equal(module(x), expected) and calls == [], "a detached wrapper passes through"


def test_the_other_wrapper_removed_first_puts_ours_back_and_ours_then_leaves_the_class_method():
    module = nn.Linear(4, 4)
    wrapper, calls = counting(module)
    theirs = other_wrapper(module.forward)
    module.forward = theirs
    module.forward = theirs.__wrapped__  # their removal: what they saw, which is ours
    assert vars(module)["forward"] is wrapper
    wrapper.remove()
    assert "forward" not in vars(module) and class_method_of(module)


def test_removal_is_repeatable_and_finishes_an_interrupted_one():
    module = nn.Linear(4, 4)
    wrapper, _ = counting(module)
    del module.forward  # as if a removal stopped after its first step
    assert wrapper.attached is not None
    wrapper.remove()
    assert wrapper.attached is None and "forward" not in vars(module)
    wrapper.remove()
    assert wrapper.attached is None and "forward" not in vars(module)


def test_a_detached_wrapper_on_top_is_looked_through_so_wrappers_do_not_pile_up():
    module = nn.Linear(4, 4)
    theirs = other_wrapper(module.forward)
    module.forward = theirs
    first, _ = counting(module)
    over = other_wrapper(module.forward)
    module.forward = over
    first.remove()  # buried: detached in place
    module.forward = first  # `over` removed, putting back what it saw: the detached wrapper
    second, calls = counting(module)
    assert second.method is theirs and second.replaced, "wraps what the detached one wrapped"
    module(x)
    assert calls == [x]
    second.remove()
    assert vars(module)["forward"] is theirs


def test_any_method_name_can_be_wrapped():
    module = nn.Linear(4, 4)
    module.encode = other_wrapper(lambda value: value * 2)  # an instance attribute
    wrapper, calls = counting(module, "encode")
    assert module.encode(3) == 6 and calls == [3]
    wrapper.remove()
    assert module.encode(3) == 6 and not isinstance(vars(module)["encode"], InstanceWrapper)


# -- finding ---------------------------------------------------------------------------------------


def test_a_wrapper_dropped_by_the_one_below_it_is_unreachable_and_found():
    modules = [nn.Linear(4, 4) for _ in range(3)]
    for module in modules:
        module.forward = other_wrapper(module.forward)  # another library's, set first
    wrappers = [counting(module)[0] for module in modules]
    assert unreachable(wrappers) == []
    modules[1].forward = modules[1].forward.__wrapped__.__wrapped__  # theirs removed: ours dropped
    assert not wrappers[1].reachable()
    assert unreachable(wrappers) == [1]


def test_a_wrapper_is_reachable_through_a_chain_up_to_the_limit_and_not_past_it():
    module = nn.Linear(4, 4)
    wrapper, _ = counting(module)
    for _ in range(MAX_CHAIN - 1):  # ours is the chain's last link
        module.forward = other_wrapper(module.forward)
    assert len(list(chain(vars(module)["forward"]))) == MAX_CHAIN
    assert wrapper.reachable() and unreachable([wrapper]) == []
    module.forward = other_wrapper(module.forward)
    assert not wrapper.reachable() and unreachable([wrapper]) == [0]


def test_a_cycle_of_wrappers_ends_the_walk():
    def first():
        pass

    def second():
        pass

    first.__wrapped__, second.__wrapped__ = second, first
    assert list(chain(first)) == [first, second]
    assert list(chain(None)) == []


# -- deep copies -----------------------------------------------------------------------------------


def test_a_deep_copy_of_a_wrapped_module_is_plain_and_carries_nothing_attached():
    module = nn.Sequential(nn.Linear(4, 4))
    expected = module(x)
    attached = [torch.zeros(3)]  # stands for what a wrapper runs inside (a scheduler, a stream)
    wrapper = Counting(module[0], "forward", attached)
    wrapper.install()
    twin = copy.deepcopy(module)
    forward = vars(twin[0]).get("forward")
    assert not isinstance(forward, InstanceWrapper)
    assert forward.__self__ is twin[0] and forward.__func__ is nn.Linear.forward
    assert twin[0].weight.data_ptr() != module[0].weight.data_ptr()
    assert torch.equal(twin(x), expected) and attached == [attached[0]], "the copy calls nothing"


def test_a_deep_copy_over_another_callable_wrapper_copies_that_wrapper():
    class Scaling:  # another library's wrapper object, with state of its own
        def __init__(self, method):
            self.__wrapped__, self.factor = method, torch.tensor(2.0)

        def __call__(self, value):
            return self.__wrapped__(value) * self.factor

    module = nn.Linear(4, 4)
    module.forward = Scaling(module.forward)
    wrapper, _ = counting(module)
    twin = copy.deepcopy(module)
    copied = vars(twin)["forward"]
    assert type(copied) is Scaling and copied is not wrapper.method
    assert copied.__wrapped__.__self__ is twin
    assert torch.equal(twin(x), module(x))


# -- its two users ---------------------------------------------------------------------------------


def test_the_block_forwards_and_the_adapter_entries_keep_only_their_call():
    """One mechanism: neither user sets, finds, removes or copies by itself."""
    pytest.importorskip("diffusers")
    from residency.adapters.diffusers import PhaseEntry

    mechanism = {"install", "remove", "reachable", "detach", "restore", "__deepcopy__",
                 "method", "_original"}
    for user in (PhaseEntry, _BlockForward):
        assert issubclass(user, InstanceWrapper)
        assert not mechanism & set(vars(user)), user.__name__


def test_a_compile_mark_an_interrupt_left_unmade_is_made_by_the_next_wrapper(monkeypatch):
    """The two torch.compile marks of each user are made one by one when its first wrapper is
    made ([Note: the block forwards under torch.compile]): with the first made and the second
    not (an interrupt between them), the next wrapper makes the second."""
    pytest.importorskip("diffusers")
    import types

    from residency.adapters import diffusers as adapter

    stream = types.SimpleNamespace(name="dit", parts=[types.SimpleNamespace(name="blocks.0")])
    users = [
        (_BlockForward, "_exit", _BlockForward._exit_eagerly,
         lambda: _BlockForward(stream, 0, nn.Linear(2, 2))),
        (adapter.PhaseEntry, "_exit_phase", adapter._exit_phase,
         lambda: adapter.PhaseEntry(object(), "dit", nn.Linear(2, 2), "forward")),
    ]
    for user, second, eager, make in users:
        make()  # the first wrapper: both marks made
        monkeypatch.setattr(user, second, staticmethod(eager) if user is adapter.PhaseEntry
                            else eager)  # as if interrupted before the second mark
        assert getattr(user, second) is eager
        make()
        assert getattr(user, second) is not eager, f"{user.__name__}.{second} left unmarked"
        assert getattr(user, second).__wrapped__ is eager
