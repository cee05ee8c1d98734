"""The diffusers adapter next to other per-instance wrappers, and deep copies of offloaded modules.

The other wrapper is diffusers' own FasterCache (``transformer.enable_cache(FasterCacheConfig)``),
which replaces the transformer's ``forward`` through diffusers' hook registry.  Every output is
compared, call by call, with the same pipeline never offloaded (with the same cache).
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch

pytest.importorskip("diffusers")

from _tiny_pipelines import faster_cache, tiny_wan22, wan22_call
from residency.adapters.diffusers import (
    ENTRY_POINTS,
    PhaseEntry,
    disable_offload,
    enable_offload,
    offload_scheduler,
)

ALL_COMPONENTS = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}


def frames(pipe, seed: int) -> torch.Tensor:
    return pipe(**wan22_call(seed)).frames


def with_faster_cache(pipe):
    """`pipe` with diffusers' FasterCache on its high-noise expert (a root-level forward hook)."""
    faster_cache(pipe)
    return pipe


def instance_dicts(pipe, *, skip_entries: bool = False) -> dict[str, dict[str, int]]:
    """Every module's instance attributes, by dotted path, as {name: id(value)}.

    ``skip_entries`` leaves out the PhaseEntry objects set as attributes (what disabling removes).
    """
    return {
        ".".join(filter(None, (name, path))): {
            key: id(value) for key, value in vars(m).items()
            if not (skip_entries and isinstance(value, PhaseEntry))
        }
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, m in component.named_modules()
    }


def entries_in_chain(entry_point) -> list[PhaseEntry]:
    """Every PhaseEntry under `entry_point`, following PhaseEntry.method and __wrapped__."""
    found, current = [], entry_point
    for _ in range(64):
        if isinstance(current, PhaseEntry):
            found.append(current)
            current = current.method
        else:
            current = getattr(current, "__wrapped__", None)
        if current is None:
            break
    return found


def phase_changes(scheduler) -> list[tuple]:
    return [(r.from_group, r.to_group) for r in scheduler.transitions]


# -- a wrapper set after enable_offload -----------------------------------------------------------


def test_a_cache_set_after_enable_offload_composes_and_disable_leaves_it_working():
    plain, pipe = with_faster_cache(tiny_wan22()), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    entry = vars(pipe.transformer)["forward"]
    with_faster_cache(pipe)
    hooked = vars(pipe.transformer)["forward"]
    assert hooked is not entry and entries_in_chain(hooked) == [entry]  # buried under the cache
    assert torch.equal(frames(pipe, 0), frames(plain, 0))
    assert ("text_encoder", "transformer") in phase_changes(scheduler)  # the cache ran in-phase
    assert "offload" not in vars(hooked)  # the cache copied the entry's __dict__: no scheduler

    expected = instance_dicts(pipe, skip_entries=True)  # the cache's wrapper stays
    disable_offload(pipe)
    assert instance_dicts(pipe) == expected  # only the outermost entries went
    assert instance_dicts(pipe).keys() == instance_dicts(plain).keys()
    assert {name for name in ENTRY_POINTS if name in vars(pipe.transformer)} == {"forward"}
    assert vars(pipe.transformer)["forward"] is hooked
    assert entry.offload is None and repr(entry) == "<PhaseEntry 'forward', detached>"
    assert offload_scheduler(pipe) is None
    assert torch.equal(frames(pipe, 1), frames(plain, 1))  # no SchedulerClosedError
    gone = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert gone() is None  # the buried entry holds no scheduler

    scheduler = enable_offload(pipe, device="cpu")  # not "already enabled"
    assert torch.equal(frames(pipe, 2), frames(plain, 2))
    assert ("text_encoder", "transformer") in phase_changes(scheduler)
    disable_offload(pipe)
    for p in (pipe, plain):
        p.transformer.disable_cache()  # diffusers puts back what it wrapped: the detached entry
    assert torch.equal(frames(pipe, 3), frames(plain, 3))


def test_a_cache_set_before_enable_offload_is_wrapped_and_put_back_exactly():
    plain, pipe = with_faster_cache(tiny_wan22()), with_faster_cache(tiny_wan22())
    before = instance_dicts(pipe)
    hooked = vars(pipe.transformer)["forward"]
    enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    disable_offload(pipe)
    assert instance_dicts(pipe) == before  # enable then disable: exactly as before
    scheduler = enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    entry = vars(pipe.transformer)["forward"]
    assert isinstance(entry, PhaseEntry) and entry.method is hooked and entry.replaced
    for seed in (0, 1):
        assert torch.equal(frames(pipe, seed), frames(plain, seed))
    changes = phase_changes(scheduler)
    assert ("text_encoder", "transformer") in changes
    assert ("transformer", "transformer_2") in changes

    expected = instance_dicts(pipe, skip_entries=True)
    expected["transformer"]["forward"] = id(hooked)
    disable_offload(pipe)
    assert instance_dicts(pipe) == expected  # calls changed the VAE's caches, not the wrappers
    same_names = {path: names.keys() for path, names in instance_dicts(plain).items()}
    assert {path: names.keys() for path, names in instance_dicts(pipe).items()} == same_names
    assert vars(pipe.transformer)["forward"] is hooked and entry.offload is None
    assert torch.equal(frames(pipe, 2), frames(plain, 2))


def test_a_plain_instance_wrapper_composes_in_either_order():
    plain, pipe = tiny_wan22(), tiny_wan22()
    calls = []

    def counting(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            calls.append(method.__name__)
            return method(*args, **kwargs)
        return wrapper

    pipe.vae.decode = counting(pipe.vae.decode)  # before enable_offload
    decode = vars(pipe.vae)["decode"]
    scheduler = enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    pipe.transformer_2.forward = counting(pipe.transformer_2.forward)  # after
    entry = entries_in_chain(vars(pipe.transformer_2)["forward"])[0]
    assert torch.equal(frames(pipe, 0), frames(plain, 0))
    assert "decode" in calls and "forward" in calls
    assert ("transformer_2", "vae") in phase_changes(scheduler)
    disable_offload(pipe)
    assert vars(pipe.vae)["decode"] is decode and "forward" not in vars(pipe.vae)
    assert entry.offload is None
    assert torch.equal(frames(pipe, 1), frames(plain, 1))


# -- deep copies ----------------------------------------------------------------------------------


def transformer_inputs() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {"hidden_states": torch.randn(1, 4, 2, 4, 4, generator=generator),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 8, 16, generator=generator),
            "return_dict": False}


@pytest.mark.fast
@pytest.mark.parametrize("name", ["transformer", "transformer_2"], ids=["evicted", "resident"])
def test_a_deep_copy_of_an_offloaded_module_is_plain_and_owns_its_weights(name):
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    frames(pipe, 0)  # ends with transformer_2 resident, transformer evicted
    assert scheduler[name].is_resident == (name == "transformer_2")
    module = getattr(pipe, name)
    twin = copy.deepcopy(module)

    assert not entries_in_chain(vars(twin).get("forward"))
    forward = twin.forward
    assert forward.__self__ is twin and forward.__func__ is type(twin).forward
    originals = dict(module.state_dict(keep_vars=True))
    for key, tensor in twin.state_dict(keep_vars=True).items():
        assert torch.equal(tensor, originals[key]), key
        assert tensor.untyped_storage().data_ptr() != originals[key].untyped_storage().data_ptr()
    count = scheduler.transitions.count
    output = twin(**transformer_inputs())[0]
    assert scheduler.transitions.count == count  # the copy enters no phase
    assert torch.equal(output, getattr(plain, name)(**transformer_inputs())[0])
    disable_offload(pipe)
    assert torch.equal(twin(**transformer_inputs())[0], output)  # it does not need the scheduler
