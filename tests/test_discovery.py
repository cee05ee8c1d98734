"""Component discovery: grouping rules, exclusion after each phase, aliases, and every error."""

from __future__ import annotations

import copy
from typing import ClassVar, Protocol, runtime_checkable

import pytest
import torch
from torch import nn

from residency import NoOffload, Scheduler
from residency.options.vllm_omni import OffloadConfig
from residency.pipelines.discovery import (
    ComponentGroups,
    SupportsComponentDiscovery,
    register_groups,
    group_components,
)
from residency.options.budget import AutoOptions
from residency.core.errors import ConfigError, RegistrationError, UnknownGroupError

from _helpers import on_device, on_host_master
from conftest import make_block, run_block

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)

WIDTH = 16
PHASES = ("text_encoder", "transformer", "transformer_2", "vae")


class PromptAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = make_block(WIDTH, seed=2)


class TwoExpertPipeline(SupportsComponentDiscovery, nn.Module):
    """Two DiTs, two encoders (one at a dotted path), a VAE and a resident module."""

    _dit_modules = ("transformer", "transformer_2")
    _encoder_modules = ("text_encoder", "prompt_adapter.encoder")
    _vae_modules = ("vae",)
    _resident_modules = ("time_embed",)

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = make_block(WIDTH, seed=1)
        self.prompt_adapter = PromptAdapter()
        self.transformer = make_block(WIDTH, seed=3)
        self.transformer_2 = make_block(WIDTH, seed=4)
        self.vae = make_block(WIDTH, seed=5)
        torch.manual_seed(6)
        self.time_embed = nn.Embedding(4, WIDTH)

    def generate(self, prompt, scheduler, after_phase=lambda phase: None) -> torch.Tensor:
        with scheduler.resident("text_encoder"):
            context = run_block(self.text_encoder, prompt)
            context = context + run_block(self.prompt_adapter.encoder, prompt)
        after_phase("text_encoder")
        latents = torch.zeros_like(prompt)
        for step, expert in enumerate(("transformer", "transformer", "transformer_2")):
            with scheduler.resident(expert):
                t = self.time_embed(torch.tensor([step]))
                latents = run_block(getattr(self, expert), latents + context + t)
            after_phase(expert)
        with scheduler.resident("vae"):
            image = run_block(self.vae, latents)
        after_phase("vae")
        return image


def _check_placement(scheduler: Scheduler, expected: set[str]) -> None:
    assert set(scheduler.resident_groups()) == expected
    for name in scheduler:
        group = scheduler[name]
        if name in expected:
            assert on_device(group) and not on_host_master(group), name
        else:
            assert on_host_master(group) and not on_device(group), name


@pytest.fixture
def pipe() -> TwoExpertPipeline:
    return TwoExpertPipeline().eval()


ALWAYS = {"time_embed"}


@pytest.mark.parametrize(
    ("components", "resident_after"),
    [
        (["dit", "text_encoder"], {
            "text_encoder": {"text_encoder", "vae"},
            "transformer": {"transformer", "vae"},
            "transformer_2": {"transformer_2", "vae"},
            "vae": {"transformer_2", "vae"},
        }),
        (["dit", "text_encoder", "vae"], {
            "text_encoder": {"text_encoder"},
            "transformer": {"transformer"},
            "transformer_2": {"transformer_2"},
            "vae": {"vae"},
        }),
        (["dit"], {
            "text_encoder": {"text_encoder", "vae"},
            "transformer": {"transformer", "text_encoder", "vae"},
            "transformer_2": {"transformer_2", "text_encoder", "vae"},
            "vae": {"transformer_2", "text_encoder", "vae"},
            # the second call: a resident-policy phase leaves the exclusive group where it is
            "again text_encoder": {"transformer_2", "text_encoder", "vae"},
        }),
        (["text_encoder"], {
            "text_encoder": {"text_encoder", "transformer", "transformer_2", "vae"},
            # the DiTs are resident-policy: the encoder group, the only exclusive one, stays
            "transformer": {"text_encoder", "transformer", "transformer_2", "vae"},
            "transformer_2": {"text_encoder", "transformer", "transformer_2", "vae"},
            "vae": {"text_encoder", "transformer", "transformer_2", "vae"},
        }),
    ],
    ids=["dit+text_encoder", "dit+text_encoder+vae", "dit", "text_encoder"],
)
def test_exactly_the_expected_groups_are_resident_after_each_phase(
    pipe, components, resident_after
):
    plain = copy.deepcopy(pipe)
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": components},
                                        device="cpu")
    seen = []

    def after_phase(phase):
        again = f"again {phase}" if phase in seen else phase
        _check_placement(scheduler, resident_after.get(again, resident_after[phase]) | ALWAYS)
        seen.append(phase)

    prompt = torch.randn(3, WIDTH)
    with torch.no_grad():
        for _ in range(2):  # the second call runs from the state the first one left
            image = pipe.generate(prompt, scheduler, after_phase)
            assert torch.equal(image, plain.generate(prompt, NoOffload()))
    assert seen == ["text_encoder", "transformer", "transformer", "transformer_2", "vae"] * 2
    scheduler.close()


def test_groups_policies_and_names(pipe):
    scheduler = Scheduler.from_pipeline(pipe, OffloadConfig(mode="module", components=["dit", "text_encoder"]), device="cpu")
    assert {n: scheduler[n].policy.value for n in scheduler} == {
        "transformer": "exclusive",
        "transformer_2": "exclusive",
        "text_encoder": "exclusive",
        "vae": "resident",
        "time_embed": "resident",
    }
    assert scheduler["text_encoder"].modules == (pipe.text_encoder, pipe.prompt_adapter.encoder)
    scheduler.close()


def test_groups_carry_their_category_and_a_category_name_says_which_groups_it_made(pipe):
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]},
                                        device="cpu")
    assert {name: scheduler[name].category for name in scheduler} == {
        "transformer": "dit", "transformer_2": "dit", "text_encoder": "text_encoder", "vae": "vae",
        "time_embed": None,
    }
    with pytest.raises(UnknownGroupError, match=r"^no group named 'dit'\. Groups made from a "
                       r"pipeline are named after their components, not by category; the 'dit' "
                       r"components here are 'transformer', 'transformer_2'\. The groups are "):
        scheduler.resident("dit")
    scheduler.close()


def test_resident_accepts_the_dotted_path_of_any_registered_module(pipe):
    scheduler = Scheduler.from_pipeline(pipe, enable_cpu_offload=True, device="cpu")
    assert "prompt_adapter.encoder" in scheduler
    with scheduler.resident("prompt_adapter.encoder") as group:
        assert group.name == "text_encoder"
        _check_placement(scheduler, {"text_encoder", "vae", "time_embed"})
    with scheduler.resident("transformer_2"):
        _check_placement(scheduler, {"transformer_2", "vae", "time_embed"})
    scheduler.close()


def test_legacy_switch_builds_module_mode_with_dit_and_text_encoder(pipe):
    legacy = Scheduler.from_pipeline(pipe, enable_cpu_offload=True, device="cpu")
    policies = {n: legacy[n].policy.value for n in legacy}
    legacy.close()
    explicit = Scheduler.from_pipeline(
        pipe, {"mode": "module", "components": ["dit", "text_encoder"]}, device="cpu"
    )
    assert policies == {n: explicit[n].policy.value for n in explicit}
    explicit.close()


def test_legacy_switch_with_a_module_mode_config_lets_the_config_decide(pipe):
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]},
                                        enable_cpu_offload=True, device="cpu")
    assert scheduler["text_encoder"].policy.value == "resident"
    assert scheduler["transformer"].policy.value == "exclusive"
    scheduler.close()


def test_legacy_switch_with_a_layer_mode_config_is_refused(pipe):
    with pytest.raises(ConfigError, match=r"enable_cpu_offload=True asks for module mode"):
        Scheduler.from_pipeline(pipe, {"mode": "layer", "components": ["dit"]},
                                enable_cpu_offload=True, device="cpu")


def test_no_config_means_offloading_off(pipe):
    plain = copy.deepcopy(pipe)
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    scheduler = Scheduler.from_pipeline(pipe, device="cpu")
    assert isinstance(scheduler, NoOffload)
    assert set(scheduler) == {"transformer", "transformer_2", "text_encoder", "vae", "time_embed"}
    prompt = torch.randn(3, WIDTH)
    with torch.no_grad():
        assert torch.equal(pipe.generate(prompt, scheduler), plain.generate(prompt, NoOffload()))
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers  # nothing moved


def test_offloading_off_refuses_a_typo_with_the_error_offloading_on_raises(pipe):
    """`from_pipeline(pipe, None)` knows the groups: a typo fails with offloading off too."""
    off = Scheduler.from_pipeline(pipe, None, device="cpu")
    refusals = {}
    for name in ("transfomer", "dit", "prompt_adapter.encodr", "nothing_like_it"):
        with pytest.raises(UnknownGroupError) as refused:
            off.resident(name)
        refusals[name] = str(refused.value)
    with off.resident("prompt_adapter.encoder"), off.resident("transformer_2"):
        pass  # an alias and a group name are accepted
    on = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]}, device="cpu")
    for name, message in refusals.items():
        with pytest.raises(UnknownGroupError) as refused:
            on.resident(name)
        assert str(refused.value) == message, name
    on.close()
    assert refusals["transfomer"].startswith(
        "no group named 'transfomer'; did you mean 'transformer'? The groups are "
        "'text_encoder', 'time_embed', 'transformer', 'transformer_2', 'vae'. The aliases "
        "(module paths that enter a group) are 'prompt_adapter.encoder' (group 'text_encoder')")
    assert "did you mean 'prompt_adapter.encoder'?" in refusals["prompt_adapter.encodr"]
    assert "scheduler.add" not in refusals["transfomer"] + refusals["dit"]


def test_pin_memory_false_gives_pageable_host_masters(pipe):
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"],
                                              "pin_memory": False}, device="cpu")
    assert scheduler.pin_memory is False
    assert not any(scheduler[n].host_master.pinned for n in scheduler)
    scheduler.close()


class RecordingScheduler(Scheduler):
    """A scheduler that notes the keywords of each ``add`` and each alias (what discovery asked)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: dict[str, dict] = {}
        self.aliased: dict[str, str] = {}

    def add(self, name, modules, **keywords):
        self.asked[name] = keywords
        return super().add(name, modules, **keywords)

    def alias(self, path, name):
        self.aliased[path] = name
        super().alias(path, name)


def _groups(scheduler) -> dict:
    """Each group's policy, modules, excluded modules (outside the blocks an auto plan packs
    apart: those are the group's own) and category."""
    def excluded(group):
        own = {id(m) for part in group.parts for m in part.modules}
        return tuple(m for m in group.excluded if id(m) not in own)

    return {name: (scheduler[name].policy, scheduler[name].modules, excluded(scheduler[name]),
                   scheduler[name].category) for name in scheduler}


def test_auto_mode_registers_module_modes_groups_on_a_scheduler_with_its_options(pipe):
    auto = RecordingScheduler.from_pipeline(
        pipe, {"mode": "auto", "auto_options": {"device_budget": "1GiB"}}, device="cpu")
    assert auto.auto_options == AutoOptions(device_budget="1GiB")
    asked, aliased, groups = auto.asked, auto.aliased, _groups(auto)
    auto.close()
    module = RecordingScheduler.from_pipeline(
        pipe, {"mode": "module", "components": ["dit", "text_encoder"]}, device="cpu")
    assert module.auto_options is None
    assert (asked, aliased, groups) == (module.asked, module.aliased, _groups(module))
    assert not any("layers" in keywords for keywords in asked.values())  # no streaming asked
    assert set(groups) == {"transformer", "transformer_2", "text_encoder", "vae", "time_embed"}
    module.close()


def test_auto_mode_components_and_pin_memory_mean_what_they_mean_in_module_mode(pipe):
    auto = Scheduler.from_pipeline(pipe, OffloadConfig(mode="auto", components=["dit", "vae"],
                                                       pin_memory=False), device="cpu")
    assert auto.auto_options == AutoOptions()
    assert auto.pin_memory is False
    groups = _groups(auto)
    auto.close()
    module = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit", "vae"]},
                                     device="cpu")
    assert groups == _groups(module)
    assert groups["vae"][0].value == "exclusive" and groups["text_encoder"][0].value == "resident"
    module.close()


def test_a_bad_auto_config_is_refused_before_anything_is_registered(pipe):
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    with pytest.raises(ConfigError, match=r"^offload config field 'auto_options': device_budget="
                                          r"'12 parsecs'; give bytes"):
        Scheduler.from_pipeline(pipe, '{"mode": "auto", "auto_options": {"device_budget": '
                                      '"12 parsecs"}}', device="cpu")
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers
    Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["dit"]}).close()  # unowned


def test_the_diffusers_adapter_builds_an_auto_scheduler_with_module_modes_groups():
    pytest.importorskip("diffusers")
    from _tiny_pipelines import tiny_wan22
    from residency.adapters.diffusers import disable_offload, enable_offload

    pipe = tiny_wan22()
    auto = enable_offload(pipe, {"mode": "auto", "auto_options": {"device_budget": 0.5,
                                                                  "headroom": "1MiB"}},
                          device="cpu")
    assert auto.auto_options == AutoOptions(device_budget=0.5, headroom="1MiB")
    groups = _groups(auto)
    disable_offload(pipe)
    module = enable_offload(pipe, {"mode": "module", "components": ["dit", "text_encoder"]},
                            device="cpu")
    assert module.auto_options is None
    assert groups == _groups(module)
    assert groups["transformer"][0].value == "exclusive"
    disable_offload(pipe)


def test_the_diffusers_adapter_names_module_options_where_an_auto_config_all_gathers():
    pytest.importorskip("diffusers")
    from _tiny_pipelines import first_block_cache, tiny_flux
    from residency.adapters.diffusers import enable_offload, offload_scheduler

    pipe = tiny_flux()
    first_block_cache(pipe)
    config = {"mode": "auto", "module_options": {"dit": {"weight_transfer": "allgather"}}}
    with pytest.raises(ConfigError, match=r"component 'transformer' has diffusers' "
                                          r"FirstBlockCache, .* all-gathers \['dit'\] "
                                          r"\(module_options: weight_transfer 'allgather'\)"):
        enable_offload(pipe, config, device="cpu")
    assert offload_scheduler(pipe) is None


def test_layer_mode_refuses_a_dit_without_repeated_blocks_naming_its_path(pipe):
    before = [t.data_ptr() for t in pipe.parameters()]
    with pytest.raises(ConfigError, match=r"^transformer: Sequential has no list of repeated "
                                          r"blocks to stream .* or offload this model in module "
                                          r"mode$"):
        Scheduler.from_pipeline(pipe, '{"mode": "layer", "components": ["dit"]}', device="cpu")
    assert [t.data_ptr() for t in pipe.parameters()] == before  # refused: nothing moved


# -- the pure building blocks -------------------------------------------------------------------


def _categories(pipe):
    return (
        {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2},
        {"text_encoder": pipe.text_encoder, "prompt_adapter.encoder": pipe.prompt_adapter.encoder},
        {"vae": pipe.vae},
        {"time_embed": pipe.time_embed},
    )


def test_group_components_is_pure_and_lists_groups(pipe):
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    plan = group_components("TwoExpertPipeline", *_categories(pipe), OffloadConfig(mode="module", components=["dit", "text_encoder"]))
    assert isinstance(plan, ComponentGroups)
    assert list(plan.exclusive) == ["transformer", "transformer_2", "text_encoder"]
    assert list(plan.resident) == ["vae", "time_embed"]
    assert plan.exclusive["text_encoder"] == (
        ("text_encoder", pipe.text_encoder),
        ("prompt_adapter.encoder", pipe.prompt_adapter.encoder),
    )
    assert dict(plan.aliases) == {"prompt_adapter.encoder": "text_encoder"}
    assert dict(plan.excluded) == {}  # only a split model's shared group leaves modules out
    assert [excluded for *_, excluded in plan.groups()] == [()] * 5
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers


def test_a_member_nested_in_a_member_of_the_same_group_adds_only_an_alias(pipe):
    encoders = {"text_encoder": pipe.text_encoder, "text_encoder.0": pipe.text_encoder[0]}
    plan = group_components("P", {"transformer": pipe.transformer}, encoders, {}, {},
                           OffloadConfig(mode="module", components=["dit", "text_encoder"]))
    groups = {name: modules for name, _, modules, _ in plan.groups()}
    assert groups["text_encoder"] == (pipe.text_encoder,)
    scheduler = Scheduler("cpu")
    register_groups(scheduler, plan)
    with scheduler.resident("text_encoder.0"):
        assert scheduler.current == "text_encoder"
    scheduler.close()


def test_register_groups_removes_what_it_added_when_a_registration_fails(pipe):
    plan = group_components("TwoExpertPipeline", *_categories(pipe), OffloadConfig(mode="module", components=["dit", "text_encoder"]))
    scheduler = Scheduler("cpu")
    scheduler.add("time_embed", nn.Linear(2, 2), policy="resident")
    with pytest.raises(RegistrationError, match=r"a group named 'time_embed' is already"):
        register_groups(scheduler, plan)
    assert list(scheduler) == ["time_embed"]
    assert "prompt_adapter.encoder" not in scheduler
    scheduler.close()


# -- errors: each names the pipeline class and the path -----------------------------------------


def _variant(**declarations) -> TwoExpertPipeline:
    cls = type("BadPipeline", (TwoExpertPipeline,), declarations)
    return cls()


CONFIG = {"mode": "module", "components": ["dit", "text_encoder"]}


@pytest.mark.parametrize(
    ("declarations", "message"),
    [
        ({"_encoder_modules": ("text_encoder", "prompt_adapter.encodr")},
         r"BadPipeline: BadPipeline._encoder_modules lists 'prompt_adapter.encodr', which does "
         r"not resolve: PromptAdapter at 'prompt_adapter' has no attribute 'encodr'\. Did you "
         r"mean 'encoder'\? Fix the path in BadPipeline._encoder_modules"),
        ({"_dit_modules": ("transformer", "transformer2")},
         r"BadPipeline: BadPipeline._dit_modules lists 'transformer2', which does not resolve: "
         r"BadPipeline at the top has no attribute 'transformer2'\. Did you mean "
         r"'transformer_2'\?"),
        ({"_vae_modules": ("vae..decoder",)},
         r"BadPipeline: BadPipeline._vae_modules lists 'vae..decoder', which is not a dotted "
         r"path"),
        ({"_resident_modules": ("transformer.0.weight",)},
         r"BadPipeline: BadPipeline._resident_modules lists 'transformer.0.weight', which is a "
         r"Parameter, not an nn.Module; list module paths only"),
        ({"_resident_modules": ("vae",)},
         r"BadPipeline: the Sequential at 'vae' \(group 'vae'\) is listed twice: it is also "
         r"'vae' \(group 'vae'\); a module belongs to one group: list it once"),
        ({"_resident_modules": ("time_embed", "time_embed")},
         r"BadPipeline: _resident_modules lists 'time_embed' twice; a module belongs to one "
         r"group: list it once"),
        ({"_resident_modules": ("transformer.1",)},
         r"BadPipeline: 'transformer.1' \(group 'transformer.1'\) is nested inside "
         r"'transformer' \(group 'transformer'\); a module belongs to one group: remove "
         r"'transformer.1' from its list, or list it in the same category as 'transformer'"),
        ({"_vae_modules": "vae"},
         r"BadPipeline._vae_modules is 'vae'; it must be a tuple of dotted paths"),
        ({"_encoder_modules": ("prompt_adapter.encoder",), "_resident_modules": ("text_encoder",)},
         r"BadPipeline: two groups would be named 'text_encoder' \(the second from path "
         r"'text_encoder'\)"),
        ({"_encoder_modules": ("text_encoder", "vae"), "_vae_modules": ("time_embed",),
          "_resident_modules": ()},
         r"BadPipeline: 'vae' names group 'vae' and is also a path or part of group "
         r"'text_encoder'"),
    ],
)
def test_declaration_errors(declarations, message):
    pipe = _variant(**declarations)
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers  # nothing changed


def test_nested_error_names_both_paths_and_groups():
    pipe = _variant(_resident_modules=("prompt_adapter",))
    with pytest.raises(ConfigError, match=r"BadPipeline: 'prompt_adapter.encoder' \(group "
                                          r"'text_encoder'\) is nested inside 'prompt_adapter' "
                                          r"\(group 'prompt_adapter'\)"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")


def test_a_module_listed_under_two_paths_is_refused():
    pipe = _variant(_vae_modules=("vae", "decoder"))
    pipe.decoder = pipe.vae  # the same module reached twice
    with pytest.raises(ConfigError, match=r"BadPipeline: the Sequential at 'decoder' \(group "
                                          r"'vae'\) is listed twice: it is also 'vae' \(group "
                                          r"'vae'\); a module belongs to one group"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")


def test_groups_sharing_a_tensor_are_refused_before_anything_moves():
    pipe = TwoExpertPipeline()
    pipe.transformer_2[0].weight = pipe.transformer[0].weight  # tied across two DiT groups
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    with pytest.raises(ConfigError, match=r"TwoExpertPipeline: 'transformer_2' \(group "
                                          r"'transformer_2'\) shares a tensor with 'transformer' "
                                          r"\(group 'transformer'\); a tensor belongs to one "
                                          r"group"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers


def test_tensors_shared_inside_one_group_or_with_offloading_off_are_fine():
    pipe = TwoExpertPipeline()
    pipe.prompt_adapter.encoder[0].weight = pipe.text_encoder[0].weight  # both in text_encoder
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    with scheduler.resident("text_encoder"):
        assert pipe.prompt_adapter.encoder[0].weight is pipe.text_encoder[0].weight
    scheduler.close()
    pipe.transformer_2[0].weight = pipe.transformer[0].weight  # across groups: harmless when off
    assert isinstance(Scheduler.from_pipeline(pipe), NoOffload)


def test_a_pipeline_without_declarations_is_refused():
    with pytest.raises(ConfigError, match=r"Sequential does not declare its components: its "
                                          r"class has no _dit_modules, _encoder_modules, "
                                          r"_vae_modules, _resident_modules; list dotted paths "
                                          r"in .*or subclass SupportsComponentDiscovery, which "
                                          r"gives each an empty default"):
        Scheduler.from_pipeline(make_block(), CONFIG, device="cpu")


def test_a_partial_declaration_names_what_is_missing():
    class OnlyDits(nn.Module):
        _dit_modules = ("transformer",)
        _encoder_modules = ("text_encoder",)

    pipe = OnlyDits()
    pipe.transformer, pipe.text_encoder = make_block(WIDTH), make_block(WIDTH)
    with pytest.raises(ConfigError, match=r"OnlyDits does not declare its components: its class "
                                          r"has no _vae_modules, _resident_modules;"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")


@runtime_checkable
class OmniDiscovery(Protocol):
    """vLLM-Omni 0.30's own mixin (vllm_omni/diffusion/models/interface.py), copied: lists."""

    _dit_modules: ClassVar[list[str]]
    _encoder_modules: ClassVar[list[str]]
    _vae_modules: ClassVar[list[str]]
    _resident_modules: ClassVar[list[str]] = []


class OmniPipeline(nn.Module, OmniDiscovery):
    """A vLLM-Omni-style pipeline: it subclasses vLLM-Omni's mixin, not ours."""

    _dit_modules = ["transformer", "transformer_2"]
    _encoder_modules = ["text_encoder", "prompt_adapter.encoder"]
    _vae_modules = ["vae"]
    _resident_modules = ["time_embed"]

    def __init__(self) -> None:
        super().__init__()
        reference = TwoExpertPipeline()
        for name, module in reference.named_children():
            setattr(self, name, module)

    generate = TwoExpertPipeline.generate


def test_a_pipeline_declaring_the_classvars_without_our_mixin_is_discovered():
    pipe = OmniPipeline()
    assert not isinstance(pipe, SupportsComponentDiscovery)
    plain = copy.deepcopy(pipe)
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert {n: scheduler[n].policy.value for n in scheduler} == {
        "transformer": "exclusive", "transformer_2": "exclusive", "text_encoder": "exclusive",
        "vae": "resident", "time_embed": "resident",
    }
    prompt = torch.randn(3, WIDTH)
    with torch.no_grad():
        assert torch.equal(pipe.generate(prompt, scheduler), plain.generate(prompt, NoOffload()))
    assert scheduler.transitions.count > 0
    scheduler.close()


def test_a_diffusers_pipeline_is_pointed_at_the_diffusers_adapter():
    pytest.importorskip("diffusers")
    from _tiny_pipelines import tiny_wan22

    pipe = tiny_wan22()
    pointers = [t.data_ptr() for t in pipe.transformer.state_dict().values()]
    with pytest.raises(ConfigError, match=r"WanPipeline is a diffusers pipeline, which does not "
                                          r"declare its components the vLLM-Omni way; offload it "
                                          r"with residency\.adapters\.diffusers\.enable_offload"
                                          r"\(pipe, config\)"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert [t.data_ptr() for t in pipe.transformer.state_dict().values()] == pointers


# -- all-gathered encoders must be declared replicated (vLLM-Omni 0.30's encoder_dlo_weight_replication)


class _OffloadPlan:
    def __init__(self, replicated):
        self.encoder_dlo_weight_replication = frozenset(replicated)


ALLGATHER_ENCODERS = {"mode": "module", "components": ["dit", "text_encoder"],
                      "module_options": {"text_encoder": {"weight_transfer": "allgather"}}}


def test_allgathered_encoders_not_declared_replicated_are_refused(pipe):
    pipe._offload_plan = _OffloadPlan({"text_encoder"})
    dits, encoders, vaes, residents = _categories(pipe)
    with pytest.raises(ConfigError, match=r"^TwoExpertPipeline: the offload config all-gathers the "
                       r"text encoders, but \['prompt_adapter.encoder'\] are not in its "
                       r"_offload_plan.encoder_dlo_weight_replication \['text_encoder'\]: .* Give "
                       r"text_encoder \"weight_transfer\": \"rank-local\", or declare them "
                       r"replicated$"):
        group_components("TwoExpertPipeline", dits, encoders, vaes, residents,
                        OffloadConfig.from_dict(ALLGATHER_ENCODERS), pipeline=pipe)


def test_allgathered_encoders_declared_replicated_or_undeclared_plan_to_allgather(pipe):
    dits, encoders, vaes, residents = _categories(pipe)
    config = OffloadConfig.from_dict(ALLGATHER_ENCODERS)
    for offload_plan in (None, _OffloadPlan({"text_encoder", "prompt_adapter.encoder"})):
        pipe._offload_plan = offload_plan
        plan = group_components("TwoExpertPipeline", dits, encoders, vaes, residents, config,
                               pipeline=pipe)
        assert dict(plan.weight_transfers) == {"text_encoder": "allgather"}


def test_from_pipeline_refuses_allgather_without_a_process_group_before_packing(pipe):
    before = [t.data_ptr() for t in pipe.parameters()]
    with pytest.raises(ConfigError, match=r"^TwoExpertPipeline: the offload config gives "
                                          r"\['text_encoder'\] weight_transfer 'allgather', .* "
                                          r"no process_group was given"):
        Scheduler.from_pipeline(pipe, ALLGATHER_ENCODERS, device="cpu")
    assert [t.data_ptr() for t in pipe.parameters()] == before


def test_groups_whose_tensors_sit_side_by_side_in_one_storage_are_accepted():
    """Tensors share a tensor only where their bytes overlap (the one rule: a region of its own
    for each, as registration packs them); main refused any two groups of one storage."""
    pipe = TwoExpertPipeline()
    reference = copy.deepcopy(pipe)
    flat = torch.empty(2 * WIDTH * WIDTH)
    with torch.no_grad():
        for index, dit in enumerate((pipe.transformer, pipe.transformer_2)):
            half = flat[index * WIDTH * WIDTH:(index + 1) * WIDTH * WIDTH].view(WIDTH, WIDTH)
            half.copy_(dit[0].weight)
            dit[0].weight = nn.Parameter(half)
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    prompt = torch.randn(2, WIDTH)
    with torch.no_grad():
        expected = reference.generate(prompt, NoOffload())
        assert torch.equal(pipe.generate(prompt, scheduler), expected)
    scheduler.close()


def test_a_wrapper_subclass_whose_inner_tensor_is_tied_across_groups_is_refused():
    from torch.testing._internal.two_tensor import TwoTensor

    pipe = TwoExpertPipeline()
    shared = torch.randn(WIDTH, WIDTH)
    pipe.transformer[0].weight = nn.Parameter(TwoTensor(shared, torch.randn(WIDTH, WIDTH)),
                                              requires_grad=False)
    pipe.transformer_2[0].weight = nn.Parameter(TwoTensor(torch.randn(WIDTH, WIDTH), shared),
                                                requires_grad=False)
    with pytest.raises(ConfigError, match=r"TwoExpertPipeline: 'transformer_2' \(group "
                                          r"'transformer_2'\) shares a tensor with 'transformer' "
                                          r"\(group 'transformer'\)"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert pipe.transformer[0].weight.a.data_ptr() == shared.data_ptr()  # nothing moved


class _InterruptedAfter:
    """A scheduler whose `call` (an ``add`` or an ``alias``) of `name` completes and then raises,
    as a KeyboardInterrupt landing on the line after it would."""

    def __init__(self, scheduler, call: str, name: str) -> None:
        self.scheduler, self.call, self.name = scheduler, call, name

    def __getattr__(self, attribute):
        return getattr(self.scheduler, attribute)

    def __contains__(self, name) -> bool:
        return name in self.scheduler

    def add(self, name, *args, **kwargs):
        self.scheduler.add(name, *args, **kwargs)
        if self.call == "add" and name == self.name:
            raise KeyboardInterrupt

    def alias(self, path, name):
        self.scheduler.alias(path, name)
        if self.call == "alias" and path == self.name:
            raise KeyboardInterrupt


@pytest.mark.parametrize(("call", "name"), [("add", "transformer_2"), ("add", "time_embed"),
                                            ("alias", "prompt_adapter.encoder")])
def test_an_interrupted_register_groups_leaves_no_group_it_added(call, name):
    """Also when the interrupt lands after an ``add`` returned (main lost that group)."""
    pipe, reference = TwoExpertPipeline(), TwoExpertPipeline()
    scheduler = Scheduler("cpu")
    scheduler.add("other", make_block(WIDTH, seed=9))
    plan = group_components("TwoExpertPipeline", {"transformer": pipe.transformer,
                                                 "transformer_2": pipe.transformer_2},
                           {"text_encoder": pipe.text_encoder,
                            "prompt_adapter.encoder": pipe.prompt_adapter.encoder},
                           {"vae": pipe.vae}, {"time_embed": pipe.time_embed},
                           OffloadConfig.from_dict(CONFIG))
    with pytest.raises(KeyboardInterrupt):
        register_groups(_InterruptedAfter(scheduler, call, name), plan)
    assert list(scheduler) == ["other"]  # the group it held before stays
    assert "prompt_adapter.encoder" not in scheduler
    register_groups(scheduler, plan)  # nothing of the first try is left in the way
    prompt = torch.randn(2, WIDTH)
    with torch.no_grad():
        expected = reference.generate(prompt, NoOffload())
        assert torch.equal(pipe.generate(prompt, scheduler), expected)
    scheduler.close()


@pytest.mark.fast
def test_module_mode_says_nothing_of_its_cost_on_the_cpu(caplog):
    """The cost line is for an accelerator that would hold every group (issue 48); the CPU
    moves its bytes within one memory."""
    import logging

    from residency.app.synthetic import SyntheticWan22

    with caplog.at_level(logging.WARNING, logger="residency"):
        scheduler = Scheduler.from_pipeline(
            SyntheticWan22.build("tiny"), {"mode": "module", "components": ["dit"]}, device="cpu")
    scheduler.close()
    assert not [r for r in caplog.records if "module mode moves" in r.getMessage()]

