"""A pipeline call's start and end (issue 32): `disable_offload` / `enable_offload` during a call
are refused, and `pipeline_calls(pipe)` counts the calls, on tiny real pipelines built in code.

Outputs are compared bit-for-bit with the same pipeline never offloaded, call by call (a
diffusers pipeline carries state between calls, so the n-th offloaded call is compared with the
n-th plain call).  Threads wait on events with a bound; nothing depends on timing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading

import pytest
import torch

pytest.importorskip("diffusers")

from _tiny_pipelines import (
    flux_call,
    kandinsky22_call,
    tiny_flux,
    tiny_kandinsky22,
    tiny_sdxl,
    tiny_wan22,
    unet_call,
    wan22_call,
)
from residency.adapters.diffusers import (
    ENTRY_POINTS,
    CallBoundary,
    CallEnd,
    Ending,
    disable_offload,
    enable_offload,
    offload_scheduler,
    pipeline_calls,
)

from residency import PhaseError, RegistrationError
from residency.adapters.pipeline_calls import CALL_END, CALL_START

#: How long a test thread waits for another before the test fails (never reached when it passes).
BOUND_S = 60.0

FAMILIES = {
    "wan22": (tiny_wan22, wan22_call, "frames"),
    "flux": (tiny_flux, flux_call, "images"),
    "sdxl": (tiny_sdxl, unet_call, "images"),
}


def output(pipe, family: str, seed: int, **extra) -> torch.Tensor:
    _, call, field = FAMILIES[family]
    return getattr(pipe(**call(seed), **extra), field)


def refusal(verb: str, owner: str) -> str:
    why = {"disable": "the rest of the call needs its components where offloading keeps them",
           "enable": "the call has already placed its inputs for the components as they are"}
    return (f"cannot {verb} offloading on this {owner} during one of its calls: {verb}_offload "
            "was called while pipe(...) runs (from a callback such as callback_on_step_end, or "
            f"from another thread), and {why[verb]}. Call {verb}_offload(pipe) after pipe(...) "
            "returns; to end the call early from callback_on_step_end, set pipe._interrupt = "
            "True there")


def state(pipe) -> tuple:
    """What a refused call must leave as it was: the pipeline's and every module's instance
    attributes (by identity), and every component tensor's device and storage."""
    modules = {
        f"{name}.{path}": {key: id(value) for key, value in vars(module).items()}
        for name, component in pipe.components.items() if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
    }
    tensors = [(t.device, t.data_ptr())
               for component in pipe.components.values() if isinstance(component, torch.nn.Module)
               for t in [*component.parameters(), *component.buffers()]]
    return {key: id(value) for key, value in vars(pipe).items()}, modules, tensors


def restored(pipe) -> tuple:
    """What `disable_offload` must put back: each module's own entry points (none, unless another
    wrapper set one; by identity), every component tensor's device, and the pipeline's own
    ``check_inputs`` / ``maybe_free_model_hooks`` (a call itself adds lazy attributes, such as
    the Wan VAE's caches, so the other attributes are not compared)."""
    entry_points = {
        f"{name}.{path}.{attribute}": id(vars(module)[attribute])
        for name, component in pipe.components.items() if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
        for attribute in ENTRY_POINTS if attribute in vars(module)
    }
    devices = [device for device, _ in state(pipe)[2]]
    boundaries = {name: id(vars(pipe)[name])
                  for name in (CALL_START, CALL_END) if name in vars(pipe)}
    return entry_points, devices, boundaries


class Callback:
    """A ``callback_on_step_end`` running `action(pipe)` at one step, recording what it raised."""

    def __init__(self, action, at_step: int = 1) -> None:
        self.action, self.at_step = action, at_step
        self.raised: list[BaseException] = []
        self.seen: list[tuple] = []

    def __call__(self, pipe, step, timestep, kwargs):
        if step == self.at_step:
            before = state(pipe)
            try:
                self.action(pipe)
            except Exception as error:  # the refusal, kept for the test to look at
                self.raised.append(error)
            self.seen.append((before, state(pipe)))
        return kwargs


# -- disable and enable during a call are refused -------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_disable_from_callback_on_step_end_is_refused_and_the_call_stays_offloaded(family):
    build, _, _ = FAMILIES[family]
    plain, pipe = build(), build()
    before = restored(pipe)
    scheduler = enable_offload(pipe, device="cpu")
    callback = Callback(disable_offload)
    changes_before = scheduler.transitions.count

    assert torch.equal(output(pipe, family, 0, callback_on_step_end=callback),
                       output(plain, family, 0))
    [error] = callback.raised
    assert type(error) is PhaseError and str(error) == refusal("disable", type(pipe).__name__)
    [(inside_before, inside_after)] = callback.seen
    assert inside_after == inside_before  # a refused call changes nothing
    assert offload_scheduler(pipe) is scheduler and "closed" not in repr(scheduler)
    assert scheduler.transitions.count > changes_before  # the call went on by phases

    disable_offload(pipe)  # after the call returns, it works and restores everything
    assert restored(pipe) == before
    assert offload_scheduler(pipe) is None and pipeline_calls(pipe) is None
    assert torch.equal(output(pipe, family, 1), output(plain, family, 1))


def test_disable_after_a_refusal_in_a_wan_expert_switch_still_restores_every_device():
    """The refusal at the last step (after both experts ran), then disable after the call."""
    plain, pipe = tiny_wan22(), tiny_wan22()
    enable_offload(pipe, device="cpu")
    callback = Callback(disable_offload, at_step=3)
    assert torch.equal(output(pipe, "wan22", 0, callback_on_step_end=callback),
                       output(plain, "wan22", 0))
    assert [type(e) for e in callback.raised] == [PhaseError]
    disable_offload(pipe)
    assert not any(name in vars(pipe.transformer) for name in ENTRY_POINTS)
    assert pipe.transformer_2.forward.__func__ is type(pipe.transformer_2).forward
    assert torch.equal(output(pipe, "wan22", 1), output(plain, "wan22", 1))


@pytest.mark.parametrize("family", ["wan22", "flux"])
def test_enable_during_a_call_of_the_plain_pipeline_is_refused_and_changes_nothing(family):
    build, _, _ = FAMILIES[family]
    plain, pipe = build(), build()
    callback = Callback(lambda p: enable_offload(p, device="cpu"))
    assert torch.equal(output(pipe, family, 0, callback_on_step_end=callback),
                       output(plain, family, 0))
    [error] = callback.raised
    assert type(error) is PhaseError and str(error) == refusal("enable", type(pipe).__name__)
    [(inside_before, inside_after)] = callback.seen
    assert inside_after == inside_before
    assert offload_scheduler(pipe) is None and pipeline_calls(pipe) is None

    scheduler = enable_offload(pipe, device="cpu")  # after the call, it works
    assert torch.equal(output(pipe, family, 1), output(plain, family, 1))
    assert scheduler.transitions.count > 0
    disable_offload(pipe)


@pytest.mark.fast
def test_disable_then_enable_in_one_callback_are_both_refused_and_change_nothing():
    plain, pipe = tiny_flux(), tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")

    def both(p):
        try:
            disable_offload(p)
        except PhaseError as error:
            callback.raised.append(error)
        enable_offload(p, device="cpu")

    callback = Callback(both)
    assert torch.equal(output(pipe, "flux", 0, callback_on_step_end=callback),
                       output(plain, "flux", 0))
    # enable on a pipeline still offloaded is refused by that first, as outside a call
    assert [(type(e), str(e).split(";")[0].split(":")[0]) for e in callback.raised] == [
        (PhaseError, "cannot disable offloading on this FluxPipeline during one of its calls"),
        (RegistrationError, "offloading is already enabled on this FluxPipeline")]
    assert offload_scheduler(pipe) is scheduler
    disable_offload(pipe)


def test_disable_from_another_thread_during_a_call_is_refused():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    inside, go = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def hold(p, step, timestep, kwargs):
        if step == 1:
            inside.set()
            go.wait(BOUND_S)
        return kwargs

    def run():
        results["frames"] = output(pipe, "wan22", 0, callback_on_step_end=hold)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert inside.wait(BOUND_S), "the call never reached its second step"
        with pytest.raises(PhaseError) as refused:
            disable_offload(pipe)  # between two phases of the other thread's call
        assert str(refused.value) == refusal("disable", "WanPipeline")
        assert pipeline_calls(pipe).in_call
        assert offload_scheduler(pipe) is scheduler
    finally:
        go.set()
        worker.join(BOUND_S)
    assert not worker.is_alive()
    assert torch.equal(results["frames"], output(plain, "wan22", 0))
    assert not pipeline_calls(pipe).in_call
    disable_offload(pipe)


def test_a_pipeline_without_check_inputs_is_refused_all_the_same_and_counts_nothing():
    """Kandinsky 2.2's combined pipeline runs its prior and decoder pipelines and calls no
    ``check_inputs`` of its own: its calls are found on the stack, not counted."""
    plain, pipe = tiny_kandinsky22(), tiny_kandinsky22()
    enable_offload(pipe, device="cpu")
    assert CALL_START not in vars(pipe)  # it has no such method to wrap
    calls = pipeline_calls(pipe)
    inside = []
    callback = Callback(lambda p: (inside.append(calls.in_call), disable_offload(pipe)))
    got = pipe(**kandinsky22_call(0), callback_on_step_end=callback).images
    assert torch.equal(got, plain(**kandinsky22_call(0)).images)
    assert [type(e) for e in callback.raised] == [PhaseError] and inside == [True]
    assert "KandinskyV22CombinedPipeline during one of its calls" in str(callback.raised[0])
    assert (calls.started, calls.ended, calls.in_call) == (0, 0, False)
    disable_offload(pipe)


# -- the boundaries, counted -----------------------------------------------------------------------


def test_the_boundaries_count_several_calls_and_outputs_stay_bit_identical():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    calls = pipeline_calls(pipe)
    ends: list[CallEnd] = []
    calls.on_end(ends.append)
    during = []
    moved = scheduler.transitions.nbytes

    def look(p, step, timestep, kwargs):
        during.append((calls.started, calls.ended, calls.in_call))
        return kwargs

    for number, seed in enumerate((0, 1, 0), start=1):
        assert torch.equal(output(pipe, "wan22", seed, callback_on_step_end=look),
                           output(plain, "wan22", seed))
        assert during[-1] == (number, number - 1, True)  # inside the call
        assert (calls.started, calls.ended, calls.in_call) == (number, number, False)
    assert ends == [CallEnd(n, Ending.RETURNED) for n in (1, 2, 3)]
    assert len(during) == 3 * 4  # every step of every call saw it running
    assert repr(calls) == "<PipelineCalls of WanPipeline: 3 started, 3 ended>"
    # each pipe(...) is one call of the scheduler: its bytes sum to the transitions'
    assert [(c.number, c.ending) for c in scheduler.calls] == [(n, "returned") for n in (1, 2, 3)]
    assert scheduler.calls.nbytes == scheduler.transitions.nbytes - moved > 0
    disable_offload(pipe)
    assert ends == [CallEnd(n, Ending.RETURNED) for n in (1, 2, 3)]  # nothing more to tell


@pytest.mark.fast
def test_a_direct_check_inputs_or_maybe_free_call_is_not_a_pipeline_call():
    pipe = tiny_flux()
    enable_offload(pipe, device="cpu")
    calls = pipeline_calls(pipe)
    pipe.check_inputs("a red dog", None, 16, 16)
    pipe.maybe_free_model_hooks()
    assert (calls.started, calls.ended, calls.in_call) == (0, 0, False)
    output(pipe, "flux", 0)
    pipe.maybe_free_model_hooks()
    assert (calls.started, calls.ended) == (1, 1)
    disable_offload(pipe)


def raise_in_callback(error):
    def action(pipe):
        raise error
    return {"callback_on_step_end": lambda p, step, t, kwargs: action(p) if step == 1 else kwargs}


class Raising(Exception):
    pass


def raise_from(module_of, where: str):
    """A forward pre-hook on `module_of(pipe)` that raises: an exception from inside a component."""
    def arm(pipe):
        def hook(module, args):
            raise Raising(where)
        return module_of(pipe).register_forward_pre_hook(hook)
    return arm


RAISES = {
    "callback": (lambda pipe: None, raise_in_callback(Raising("callback")), Raising),
    "keyboard interrupt in a callback": (lambda pipe: None,
                                         raise_in_callback(KeyboardInterrupt()), KeyboardInterrupt),
    "component forward": (raise_from(lambda p: p.transformer_2.blocks[0], "expert"), {}, Raising),
    "vae": (raise_from(lambda p: p.vae.decoder, "vae"), {}, Raising),
}


@pytest.mark.parametrize("how", sorted(RAISES))
def test_a_call_that_raises_ends_there_and_the_next_disable_works(how):
    arm, extra, error = RAISES[how]
    plain, pipe = tiny_wan22(), tiny_wan22()
    before = restored(pipe)
    enable_offload(pipe, device="cpu")
    calls = pipeline_calls(pipe)
    ends: list[CallEnd] = []
    calls.on_end(ends.append)
    handles = [arm(p) for p in (pipe, plain)]
    for p in (pipe, plain):  # the same failing call on both, so the next calls compare
        with pytest.raises(error):
            p(**wan22_call(0), **extra)
    for handle in handles:
        if handle is not None:
            handle.remove()

    assert calls.started == 1 and not calls.in_call  # the stack says it is over
    assert ends == [CallEnd(1, Ending.FOUND)]  # found when in_call looked
    assert torch.equal(output(pipe, "wan22", 1), output(plain, "wan22", 1))
    assert (calls.started, calls.ended) == (2, 2)
    assert ends == [CallEnd(1, Ending.FOUND), CallEnd(2, Ending.RETURNED)]
    disable_offload(pipe)
    assert restored(pipe) == before and pipeline_calls(pipe) is None


def test_a_raised_call_is_found_by_the_next_start_or_by_disable():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    calls = pipeline_calls(pipe)
    ends: list[CallEnd] = []
    calls.on_end(ends.append)
    for p in (pipe, plain):
        with pytest.raises(Raising):
            p(**wan22_call(0), **raise_in_callback(Raising("first")))
    assert calls.started == 1 and ends == []  # nothing looked yet
    assert torch.equal(output(pipe, "wan22", 1), output(plain, "wan22", 1))
    assert ends == [CallEnd(1, Ending.FOUND), CallEnd(2, Ending.RETURNED)]  # the start found it
    for p in (pipe, plain):
        with pytest.raises(Raising):
            p(**wan22_call(2), **raise_in_callback(Raising("third")))
    disable_offload(pipe)  # not refused: that call is over; and its end is told first
    assert ends[-1] == CallEnd(3, Ending.FOUND) and calls.ended == 3
    assert [c.ending for c in scheduler.calls] == ["found", "returned", "found"]
    assert torch.equal(output(pipe, "wan22", 3), output(plain, "wan22", 3))


@pytest.mark.fast
def test_inputs_refused_by_check_inputs_end_the_call_there():
    pipe = tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    calls = pipeline_calls(pipe)
    ends: list[CallEnd] = []
    calls.on_end(ends.append)
    with pytest.raises(ValueError, match="divisible by 16"):
        pipe(**{**wan22_call(0), "height": 17})
    assert ends == [CallEnd(1, Ending.RAISED)] and (calls.started, calls.ended) == (1, 1)
    assert [(c.number, c.ending, c.nbytes) for c in scheduler.calls] == [(1, "raised", 0)]
    disable_offload(pipe)


# -- the boundary wrappers on the pipeline --------------------------------------------------------


@pytest.mark.fast
def test_enable_sets_two_boundaries_on_the_pipeline_and_disable_takes_them_off():
    from diffusers import FluxPipeline

    pipe = tiny_flux()
    before = {name: id(value) for name, value in vars(pipe).items()}
    enable_offload(pipe, device="cpu")
    added = {name: value for name, value in vars(pipe).items() if name not in before}
    assert sorted(added) == sorted([CALL_START, CALL_END])
    assert all(isinstance(value, CallBoundary) for value in added.values())
    assert repr(pipe.check_inputs) == "<CallBoundary 'check_inputs': starts a call>"
    assert repr(pipe.maybe_free_model_hooks) == (
        "<CallBoundary 'maybe_free_model_hooks': ends a call>")
    assert inspect.signature(pipe.check_inputs) == inspect.signature(
        FluxPipeline.check_inputs.__get__(pipe))

    sibling = FluxPipeline(**pipe.components)  # built from the same components
    sibling.set_progress_bar_config(disable=True)
    assert not vars(sibling).keys() & {CALL_START, CALL_END}
    assert pipeline_calls(sibling) is None
    sibling(**flux_call(0))
    assert pipeline_calls(pipe).started == 0  # the sibling's call is not this pipeline's

    boundary = vars(pipe)[CALL_START]
    disable_offload(pipe)
    assert {name: id(value) for name, value in vars(pipe).items()} == before
    assert boundary.attached is None and repr(boundary) == (
        "<CallBoundary 'check_inputs', detached>")


@pytest.mark.fast
def test_a_deep_copy_of_an_offloaded_pipeline_has_no_boundary_and_counts_nothing():
    plain, pipe = tiny_flux(), tiny_flux()
    enable_offload(pipe, device="cpu")
    copied = copy.deepcopy(pipe)
    assert isinstance(vars(pipe)[CALL_START], CallBoundary)
    assert not any(isinstance(vars(copied).get(name), CallBoundary)
                   for name in (CALL_START, CALL_END))
    assert pipeline_calls(copied) is None
    assert torch.equal(output(copied, "flux", 0), output(plain, "flux", 0))  # plain, detached
    assert pipeline_calls(pipe).started == 0
    assert torch.equal(output(pipe, "flux", 0), output(tiny_flux(), "flux", 0))
    assert pipeline_calls(pipe).started == 1
    disable_offload(pipe)


@pytest.mark.fast
def test_boundaries_compose_with_a_wrapper_set_before_enable():
    plain, pipe = tiny_flux(), tiny_flux()
    seen = []
    original = pipe.check_inputs

    @functools.wraps(original)
    def counting(*args, **kwargs):
        seen.append(len(args))
        return original(*args, **kwargs)

    pipe.check_inputs = counting
    enable_offload(pipe, device="cpu")
    assert vars(pipe)[CALL_START].method is counting
    assert torch.equal(output(pipe, "flux", 0), output(plain, "flux", 0))
    assert len(seen) == 1 and pipeline_calls(pipe).started == 1
    disable_offload(pipe)
    assert vars(pipe)[CALL_START] is counting  # that very wrapper put back


@pytest.mark.fast
def test_boundaries_compose_with_a_wrapper_set_after_enable():
    plain, pipe = tiny_flux(), tiny_flux()
    enable_offload(pipe, device="cpu")
    boundary = vars(pipe)[CALL_END]
    ended = []

    @functools.wraps(boundary)
    def outer(*args, **kwargs):
        ended.append(True)
        return boundary(*args, **kwargs)

    pipe.maybe_free_model_hooks = outer  # buries the boundary
    calls = pipeline_calls(pipe)
    assert torch.equal(output(pipe, "flux", 0), output(plain, "flux", 0))
    assert ended == [True] and (calls.started, calls.ended) == (1, 1)

    disable_offload(pipe)
    assert vars(pipe)[CALL_END] is outer and boundary.attached is None  # detached under it
    assert torch.equal(output(pipe, "flux", 1), output(plain, "flux", 1))
    assert ended == [True, True] and (calls.started, calls.ended) == (1, 1)

    enable_offload(pipe, device="cpu")  # a new boundary over the other wrapper, counting anew
    assert vars(pipe)[CALL_END].method is outer
    assert torch.equal(output(pipe, "flux", 2), output(plain, "flux", 2))
    assert (pipeline_calls(pipe).started, pipeline_calls(pipe).ended) == (1, 1)
    disable_offload(pipe)
