"""The diffusers adapter on tiny real pipelines built in code: Wan2.2 (two experts), Flux.

Every comparison is against the same pipeline never offloaded, call by call: a diffusers pipeline
carries state between calls, so the n-th offloaded call is compared with the n-th plain call.
"""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch

pytest.importorskip("diffusers")

import residency.adapters.diffusers as adapter
import residency.adapters.pipeline_calls as pipeline_calls_module
from _helpers import in_buffer
from _tiny_pipelines import flux_call, tiny_flux, tiny_wan22, wan22_call
from residency.adapters.diffusers import (
    ENTRY_POINTS,
    CallBoundary,
    PhaseEntry,
    disable_offload,
    enable_offload,
    offload_scheduler,
)

from residency import ConfigError, PhaseError, RegistrationError, Scheduler, SchedulerClosedError

ALL_COMPONENTS = {"mode": "module", "components": ["dit", "text_encoder", "vae"]}



def frames(pipe, seed: int, prompt: str = "a cat on the moon") -> torch.Tensor:
    return pipe(**wan22_call(seed, prompt)).frames


def images(pipe, seed: int, prompt: str = "a red dog") -> torch.Tensor:
    return pipe(**flux_call(seed, prompt)).images


def instance_entry_points(pipe) -> list[str]:
    """Every instance-level forward/encode/decode left on any module of the pipeline."""
    return [
        ".".join(filter(None, (name, path, attribute)))
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
        for attribute in ENTRY_POINTS
        if attribute in vars(module)
    ]


def module_attributes(pipe) -> dict[str, set[str]]:
    """The instance attribute names of every module of the pipeline, by dotted path."""
    return {
        ".".join(filter(None, (name, path))): set(vars(module))
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
    }


# -- bit-identical outputs ------------------------------------------------------------------------


def test_wan22_bit_identical_call_by_call_and_both_experts_take_turns():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    calls = [(0, "a cat on the moon"), (1, "a red dog"), (0, "a cat on the moon")]
    for seed, prompt in calls:
        assert torch.equal(frames(pipe, seed, prompt), frames(plain, seed, prompt))
    assert scheduler["transformer"].exclusive and scheduler["transformer_2"].exclusive
    assert not scheduler["vae"].exclusive  # "vae" not selected: it stays resident
    changes = [(r.from_group, r.to_group) for r in scheduler.transitions]
    assert changes.count(("transformer", "transformer_2")) == len(calls)
    assert changes.count(("transformer_2", "text_encoder")) == len(calls) - 1
    disable_offload(pipe)


def test_wan22_with_every_component_offloaded():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    for seed in (3, 4):
        assert torch.equal(frames(pipe, seed), frames(plain, seed))
    assert scheduler["vae"].exclusive
    assert ("transformer_2", "vae") in [(r.from_group, r.to_group) for r in scheduler.transitions]
    disable_offload(pipe)


@pytest.mark.fast
def test_the_scheduler_of_a_disabled_pipeline_points_to_enable_offload():
    """After disable_offload, the scheduler it closed advises enable_offload(pipe), the verb a
    diffusers user needs, not a new Scheduler; enabling again works."""
    plain, pipe = tiny_flux(), tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    disable_offload(pipe)
    for refused_call in (lambda: scheduler.resident("transformer").__enter__(),
                         lambda: scheduler.add("extra", torch.nn.Linear(2, 2))):
        with pytest.raises(SchedulerClosedError) as refused:
            refused_call()
        assert str(refused.value) == (
            "this scheduler was closed; its modules are back in host memory. Offloading was "
            "disabled on this FluxPipeline (disable_offload); call enable_offload(pipe) to "
            "offload it again, and use the scheduler that call returns")
    assert enable_offload(pipe, device="cpu") is not scheduler
    assert torch.equal(images(pipe, 0), images(plain, 0))
    disable_offload(pipe)


@pytest.mark.fast
def test_flux_clip_and_t5_share_one_encoder_group():
    plain, pipe = tiny_flux(), tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    encoders = scheduler["text_encoder"]
    assert encoders.modules == (pipe.text_encoder, pipe.text_encoder_2)
    for seed, prompt in ((0, "a red dog"), (1, "blue sky"), (0, "a red dog")):
        assert torch.equal(images(pipe, seed, prompt), images(plain, seed, prompt))
    assert sorted(scheduler) == ["text_encoder", "transformer", "vae"]
    disable_offload(pipe)


@pytest.mark.fast
def test_vae_decode_and_encode_run_in_the_vae_phase():
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    latents = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(5))
    with scheduler.resident("transformer"):
        pass  # make sure the VAE is offloaded before each direct call
    decoded = pipe.vae.decode(latents, return_dict=False)[0]
    assert scheduler.current == "vae"
    assert torch.equal(decoded, plain.vae.decode(latents, return_dict=False)[0])
    with scheduler.resident("transformer"):
        pass
    encoded = pipe.vae.encode(decoded).latent_dist.mean
    assert scheduler.current == "vae"
    assert torch.equal(encoded, plain.vae.encode(decoded).latent_dist.mean)
    disable_offload(pipe)


# -- residency inside each forward ----------------------------------------------------------------


class Probe:
    """Records, from inside a component's forward, which groups are resident (a test-only pre-hook).

    The hook sits on a *submodule*, so it runs inside the component's wrapped entry point.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seen: dict[str, list[tuple]] = {}
        self.handles = []

    def watch(self, label: str, submodule: torch.nn.Module, group: str) -> None:
        weight = next(submodule.parameters())

        def hook(module, args):
            scheduler = self.scheduler
            buffer = scheduler[group].device_storage.buffer
            self.seen.setdefault(label, []).append(
                (scheduler.current, frozenset(scheduler.resident_groups()),
                 in_buffer(weight, buffer))
            )

        self.handles.append(submodule.register_forward_pre_hook(hook))

    def check(self, expected: dict[str, str], resident_policy: set[str]) -> None:
        assert set(self.seen) == set(expected), "every probed forward ran"
        for label, group in expected.items():
            for current, resident, weight_on_device in self.seen[label]:
                assert current == group, label
                assert resident == {group} | resident_policy, label
                assert weight_on_device, f"{label}: weights not in the device storage"


@pytest.mark.fast
def test_inside_each_wan22_forward_exactly_its_group_is_resident():
    pipe = tiny_wan22()
    scheduler = enable_offload(pipe, ALL_COMPONENTS, device="cpu")
    probe = Probe(scheduler)
    probe.watch("text_encoder", pipe.text_encoder.encoder, "text_encoder")
    probe.watch("transformer", pipe.transformer.patch_embedding, "transformer")
    probe.watch("transformer_2", pipe.transformer_2.patch_embedding, "transformer_2")
    probe.watch("vae.decode", pipe.vae.decoder, "vae")
    frames(pipe, 0)
    frames(pipe, 1)
    probe.check({"text_encoder": "text_encoder", "transformer": "transformer",
                 "transformer_2": "transformer_2", "vae.decode": "vae"}, resident_policy=set())
    disable_offload(pipe)


@pytest.mark.fast
def test_inside_each_flux_forward_exactly_its_group_is_resident():
    pipe = tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    probe = Probe(scheduler)
    probe.watch("clip", pipe.text_encoder.encoder, "text_encoder")
    probe.watch("t5", pipe.text_encoder_2.encoder, "text_encoder")
    probe.watch("transformer", pipe.transformer.x_embedder, "transformer")
    images(pipe, 0)
    probe.check({"clip": "text_encoder", "t5": "text_encoder", "transformer": "transformer"},
                resident_policy={"vae"})
    disable_offload(pipe)


# -- the execution device -------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("config", [None, ALL_COMPONENTS], ids=["vae resident", "all offloaded"])
def test_a_component_is_always_on_the_device_so_execution_device_is_right(config):
    pipe = tiny_wan22()
    scheduler = enable_offload(pipe, config, device="cpu")
    on_device = [
        name for name in scheduler
        if scheduler[name].is_resident
        and all(in_buffer(t, scheduler[name].device_storage.buffer)
                for t in scheduler[name].tensors)
    ]
    assert on_device, "no component sits on the device: diffusers would pick the host"
    if config is ALL_COMPONENTS:
        assert scheduler.current == "text_encoder"  # the group pipelines run first
    assert pipe._execution_device == scheduler.device
    frames(pipe, 0)
    assert pipe._execution_device == scheduler.device
    disable_offload(pipe)


# -- disable, and refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, ALL_COMPONENTS], ids=["vae resident", "all offloaded"])
def test_disable_offload_restores_the_pipeline_exactly(config):
    plain, pipe = tiny_wan22(), tiny_wan22()
    scheduler = enable_offload(pipe, config, device="cpu")  # the resident VAE gets no entry
    assert torch.equal(frames(pipe, 0), frames(plain, 0))
    assert instance_entry_points(pipe)  # the wrappers are there while enabled
    buffers = {id(s): s.buffer for s in (scheduler[n].device_storage for n in scheduler)}
    disable_offload(pipe)

    assert instance_entry_points(pipe) == []
    assert offload_scheduler(pipe) is None
    assert pipe.transformer.forward.__func__ is type(pipe.transformer).forward
    tensors = [t for c in (pipe.text_encoder, pipe.transformer, pipe.transformer_2, pipe.vae)
               for t in [*c.parameters(), *c.buffers()]]
    assert {t.device for t in tensors} == {torch.device("cpu")}
    assert not any(in_buffer(t, b) for t in tensors for b in buffers.values())
    assert torch.equal(frames(pipe, 1), frames(plain, 1))  # the second call, plain on both sides
    enable_offload(pipe, device="cpu")  # and it can be offloaded again
    assert torch.equal(frames(pipe, 2), frames(plain, 2))
    disable_offload(pipe)


@pytest.mark.fast
def test_a_second_enable_offload_is_refused_and_changes_nothing():
    pipe = tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    wrapper = vars(pipe.transformer)["forward"]
    with pytest.raises(RegistrationError, match="already enabled on this FluxPipeline.*"
                       r"disable_offload\(pipe\) first"):
        enable_offload(pipe, device="cpu")
    assert offload_scheduler(pipe) is scheduler
    assert vars(pipe.transformer)["forward"] is wrapper
    images(pipe, 0)
    assert scheduler.current == "transformer"
    disable_offload(pipe)


@pytest.mark.fast
def test_accelerates_offload_hook_is_refused_and_changes_nothing():
    accelerate = pytest.importorskip("accelerate")
    pipe = tiny_flux()
    accelerate.cpu_offload_with_hook(pipe.vae, execution_device="cpu")  # what enable_model_cpu_offload sets
    before = module_attributes(pipe)
    pointers = [p.data_ptr() for p in pipe.transformer.parameters()]
    with pytest.raises(RegistrationError, match=r"FluxPipeline: component 'vae' is managed by "
                       r"accelerate's hooks.*Call pipe.remove_all_hooks\(\) first"):
        enable_offload(pipe, device="cpu")
    assert offload_scheduler(pipe) is None
    assert module_attributes(pipe) == before
    assert [p.data_ptr() for p in pipe.transformer.parameters()] == pointers
    pipe.remove_all_hooks()  # what the message says removes it
    enable_offload(pipe, device="cpu")
    disable_offload(pipe)


@pytest.mark.fast
def test_diffusers_group_offloading_is_refused_and_changes_nothing():
    pipe = tiny_wan22()
    pipe.transformer.enable_group_offload(onload_device=torch.device("cpu"),
                                          offload_type="leaf_level")
    before = module_attributes(pipe)
    with pytest.raises(RegistrationError, match=r"WanPipeline: component 'transformer' has "
                       r"diffusers' group offloading.*Load the component again without "
                       r"enable_group_offload"):
        enable_offload(pipe, device="cpu")
    assert offload_scheduler(pipe) is None and module_attributes(pipe) == before


@pytest.mark.fast
def test_a_component_shared_with_an_offloaded_pipeline_is_refused():
    from diffusers import FluxPipeline

    pipe = tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    entries = instance_entry_points(pipe)
    sibling = FluxPipeline(**pipe.components)
    with pytest.raises(RegistrationError, match="FluxPipeline: component '(vae|text_encoder)' is "
                       "already offloaded through another pipeline that shares it.*Call "
                       "disable_offload on that pipeline first"):
        enable_offload(sibling, device="cpu")
    assert offload_scheduler(sibling) is None  # the entries it sees are the other pipeline's
    with pytest.raises(RegistrationError, match="^offloading is not enabled on this FluxPipeline, "
                       "but its component 'vae' is offloaded through another pipeline that "
                       "shares it; call disable_offload on that pipeline$"):
        disable_offload(sibling)
    assert offload_scheduler(pipe) is scheduler and instance_entry_points(pipe) == entries
    disable_offload(pipe)
    enable_offload(sibling, device="cpu")  # once the first lets go, the sibling may
    disable_offload(sibling)


@pytest.mark.fast
def test_a_refused_config_changes_nothing():
    pipe = tiny_flux()
    with pytest.raises(ConfigError, match="'module_options' names 'vae', which is not in "
                                          "components"):
        enable_offload(pipe, {"mode": "module", "components": ["dit"],
                              "module_options": {"vae": {"weight_transfer": "allgather"}}},
                       device="cpu")
    with pytest.raises(ConfigError, match="unknown field 'component'"):
        enable_offload(pipe, '{"mode": "module", "component": ["dit"]}', device="cpu")
    assert offload_scheduler(pipe) is None
    assert instance_entry_points(pipe) == []


@pytest.mark.fast
def test_disable_offload_inside_a_phase_is_refused_and_changes_nothing():
    plain, pipe = tiny_flux(), tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    entries = instance_entry_points(pipe)
    refused = pytest.raises(PhaseError, match=r"^cannot disable offloading on this FluxPipeline "
                            r"while one of its phases is active .*call disable_offload\(pipe\) "
                            r"after the pipeline call returns$")
    with scheduler.resident("transformer"), refused as error:
        disable_offload(pipe)
    assert "clos" not in str(error.value) and error.value.__cause__ is None
    assert offload_scheduler(pipe) is scheduler and instance_entry_points(pipe) == entries
    assert torch.equal(images(pipe, 0), images(plain, 0))
    disable_offload(pipe)


@pytest.mark.fast
def test_disable_without_enable_is_a_registration_error_saying_how_to_turn_it_on():
    with pytest.raises(RegistrationError) as refused:
        disable_offload(tiny_flux())
    assert type(refused.value) is RegistrationError
    assert str(refused.value) == (
        "offloading is not enabled on this FluxPipeline, so there is nothing to disable. "
        "enable_offload(pipe) turns it on; offload_scheduler(pipe) is None while it is off.")


@pytest.mark.fast
@pytest.mark.parametrize("verb", ["enable_offload", "disable_offload", "describe"])
def test_what_is_not_a_pipeline_is_a_config_error_saying_what_to_pass(verb):
    linear = torch.nn.Linear(2, 2)
    weight = linear.weight.data_ptr()
    with pytest.raises(ConfigError) as refused:
        getattr(adapter, verb)(linear)
    assert type(refused.value) is ConfigError
    assert str(refused.value) == (
        f"{verb} takes a diffusers pipeline (a DiffusionPipeline, such as the pipe that "
        "from_pretrained returns), and a Linear is not one: it has no `components` mapping. "
        "Pass the pipeline, not one of its models; for your own model code, use "
        "Scheduler.from_pipeline, or Scheduler.add for a single module")
    assert linear.weight.data_ptr() == weight and "forward" not in vars(linear)


def test_a_dropped_pipeline_leaves_no_adapter_state_behind():
    pipe = tiny_flux()
    scheduler = weakref.ref(enable_offload(pipe, device="cpu"))
    images(pipe, 0)
    gone = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert gone() is None
    assert scheduler() is None  # with its host masters: nothing else held it


@pytest.mark.fast
def test_a_config_that_offloads_no_component_is_refused_and_changes_nothing():
    pipe = Unconditional()
    modules = (pipe.components["transformer"], pipe.components["vae"])
    pointers = [p.data_ptr() for module in modules for p in module.parameters()]
    with pytest.raises(ConfigError, match=r"Unconditional: the offload config selects "
                       r"\['text_encoder'\], which matches none of Unconditional's module "
                       r"components \['transformer', 'vae'\], so nothing would be offloaded.*"
                       r"pipe.to\(device\)"):
        enable_offload(pipe, {"mode": "module", "components": ["text_encoder"]}, device="cpu")
    assert [p.data_ptr() for module in modules for p in module.parameters()] == pointers
    assert not any(vars(module).keys() & set(ENTRY_POINTS) for module in modules)
    assert offload_scheduler(pipe) is None


# -- the adapter's state: its entries, nothing else -----------------------------------------------


@pytest.mark.fast
def test_enable_offload_sets_phase_entries_and_call_boundaries_and_nothing_else():
    plain, pipe = tiny_flux(), tiny_flux()
    pipe_attributes = {name: id(value) for name, value in vars(pipe).items()}
    before = module_attributes(pipe)
    scheduler = enable_offload(pipe, device="cpu")

    set_on_pipe = {name: value for name, value in vars(pipe).items()
                   if pipe_attributes.get(name) != id(value)}
    assert sorted(set_on_pipe) == ["check_inputs", "maybe_free_model_hooks"]  # its call boundaries
    assert all(isinstance(value, CallBoundary) for value in set_on_pipe.values())
    added = {"text_encoder": {"forward"}, "text_encoder_2": {"forward"}, "transformer": {"forward"},
             "vae": {"forward", "encode", "decode"}}  # the VAE's (resident policy) move nothing
    assert module_attributes(pipe) == {
        path: names | added.get(path, set()) for path, names in before.items()
    }
    entry = vars(pipe.transformer)["forward"]
    assert isinstance(entry, PhaseEntry) and entry.scheduler is scheduler
    assert entry.group == "transformer" and vars(pipe.text_encoder_2)["forward"].group == (
        "text_encoder"
    )
    assert repr(entry) == "<PhaseEntry 'forward' of group 'transformer'>"
    assert inspect.signature(pipe.transformer.forward) == inspect.signature(
        plain.transformer.forward
    )
    disable_offload(pipe)
    assert module_attributes(pipe) == before
    assert {name: id(value) for name, value in vars(pipe).items()} == pipe_attributes


@pytest.mark.fast
@pytest.mark.parametrize("module", [adapter, pipeline_calls_module], ids=lambda m: m.__name__)
def test_the_adapter_module_holds_no_registry(module):
    containers = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
                  weakref.WeakSet)
    held = [name for name, value in vars(module).items()
            if not name.startswith("__") and isinstance(value, containers)]
    assert held == []


def test_entries_of_a_dropped_pipeline_belong_to_a_sibling_still_holding_them():
    from diffusers import FluxPipeline

    plain, pipe = tiny_flux(), tiny_flux()
    scheduler = enable_offload(pipe, device="cpu")
    sibling = FluxPipeline(**pipe.components)
    sibling.set_progress_bar_config(disable=True)
    gone = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert gone() is None
    assert offload_scheduler(sibling) is scheduler  # its components still run by phase
    assert torch.equal(images(sibling, 0), images(plain, 0))
    assert scheduler.current == "transformer"
    disable_offload(sibling)  # so the entries can still be removed
    assert instance_entry_points(sibling) == [] and offload_scheduler(sibling) is None
    assert torch.equal(images(sibling, 1), images(plain, 1))


# -- inputs follow the compute device -------------------------------------------------------------


@pytest.mark.fast
def test_tensor_arguments_are_sent_to_the_compute_device():
    from residency.adapters.diffusers import _to_device

    meta = torch.device("meta")
    args = (torch.ones(2), [torch.ones(1), 3], {"mask": torch.ones(1), "n": None}, "text")
    moved = _to_device(args, meta)
    assert moved[0].device == meta and moved[1][0].device == meta and moved[1][1] == 3
    assert moved[2]["mask"].device == meta and moved[2]["n"] is None and moved[3] == "text"
    kept = torch.ones(1, device=meta)
    assert _to_device(kept, meta) is kept  # already there: not copied


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, ALL_COMPONENTS], ids=["vae resident", "all offloaded"])
def test_wan22_on_an_accelerator_matches_the_plain_pipeline_there(config):
    device = torch.accelerator.current_accelerator()
    plain, pipe = tiny_wan22().to(device), tiny_wan22()
    scheduler = enable_offload(pipe, config, device=device)
    assert pipe._execution_device.type == device.type
    for seed in (0, 1):
        assert torch.equal(frames(pipe, seed), frames(plain, seed))
    assert pipe._execution_device.type == device.type
    assert scheduler.transitions.count >= 4
    disable_offload(pipe)


class Unconditional:
    """A pipeline-like object without encoders: only `components` is read."""

    def __init__(self) -> None:
        self.components = {"transformer": torch.nn.Linear(2, 2), "vae": torch.nn.Linear(2, 2),
                           "scheduler": object()}


@pytest.mark.fast
def test_a_pipeline_without_encoders_is_accepted_with_one_line_saying_what_it_does(caplog):
    with caplog.at_level("WARNING", logger="residency"):
        scheduler = enable_offload(Unconditional(), device="cpu")
    assert list(scheduler) == ["transformer", "vae"] and scheduler["transformer"].exclusive
    assert [r.getMessage() for r in caplog.records] == [
        "Unconditional has no encoder: 'transformer' is its only exclusive group, so it has "
        "nothing to take turns with and stays on the device from its first phase on (select "
        "'vae' as well to make it take turns with the VAE)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="residency"):
        scheduler = enable_offload(Unconditional(), {"mode": "module", "components": ["dit", "vae"]},
                                   device="cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "Unconditional has no encoder: its exclusive groups ['transformer', 'vae'] take turns on "
        "the device"
    ]
    assert scheduler["vae"].exclusive


@pytest.mark.gpu
def test_disable_offload_returns_every_component_to_its_accelerator():
    device = torch.accelerator.current_accelerator()
    plain, pipe = tiny_wan22().to(device), tiny_wan22().to(device)
    enable_offload(pipe, device=device)  # the VAE: resident policy, no entry
    assert torch.equal(frames(pipe, 0), frames(plain, 0))
    disable_offload(pipe)
    tensors = [t for c in (pipe.text_encoder, pipe.transformer, pipe.transformer_2, pipe.vae)
               for t in [*c.parameters(), *c.buffers()]]
    assert {t.device.type for t in tensors} == {device.type}
    assert torch.equal(frames(pipe, 1), frames(plain, 1))


@pytest.mark.fast
def test_the_ten_line_example_in_the_docs_prints_the_groups_the_code_gives():
    """docs/diffusers.md's "diffusers in ten lines" prints ``list(scheduler)`` in a comment: the
    order the adapter adds Wan2.2's groups (the order a call uses them)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "diffusers.md").read_text()
    printed = re.search(r"print\(list\(scheduler\)\)\s+# (\[.*\])", text).group(1)
    pipe = tiny_wan22()
    scheduler = enable_offload(pipe, device="cpu")
    assert repr(list(scheduler)) == printed
    disable_offload(pipe)


@pytest.mark.gpu
def test_module_mode_says_what_it_costs_once_as_the_first_call_starts(caplog):
    """Issue 48: where the device would hold every group, one line, at the first ``pipe(...)``
    (the free memory the calls will have), not at ``enable_offload`` and not again."""
    import logging

    device = torch.accelerator.current_accelerator()
    hint = "module mode moves every exclusive group's bytes at every call"
    pipe = tiny_wan22()
    with caplog.at_level(logging.WARNING, logger="residency"):
        enable_offload(pipe, device=device)
        assert not [r for r in caplog.records if hint in r.getMessage()]
        for seed in (0, 1):
            frames(pipe, seed)
    said = [r.getMessage() for r in caplog.records if hint in r.getMessage()]
    assert len(said) == 1 and '{"mode": "auto"} would keep them on the device' in said[0], said
    disable_offload(pipe)
