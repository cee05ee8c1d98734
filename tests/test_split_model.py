"""Split models: one part on the device at a time, shared tensors resident, identical outputs.

The models hold tensors directly (``pos_embed``, ``scale_shift_table``, a gate on a module that also
contains the parts), as real DiTs do: the model minus its parts is one resident group.
"""

from __future__ import annotations

import copy
from operator import attrgetter

import pytest
import torch
from torch import nn

from residency import NoOffload, Scheduler
from residency.group.residency import Policy
from residency.options.vllm_omni import OffloadConfig
from residency.pipelines.discovery import SupportsComponentDiscovery, register_groups, group_components
from residency.core.errors import ConfigError, RegistrationError
from residency.pipelines.split import SplitModel, split_parts

from _helpers import on_device, on_host_master
from conftest import make_block, run_block

WIDTH = 16
CONFIG = {"mode": "module", "components": ["dit", "text_encoder"]}


class SplitTransformer(SplitModel, nn.Module):
    _split_parts = {"reasoner": "reasoner", "generator": ("generator", "head")}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(10)
        self.embed = nn.Embedding(8, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.reasoner = make_block(WIDTH, seed=11)
        self.generator = make_block(WIDTH, seed=12)
        torch.manual_seed(13)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.pos_embed = nn.Parameter(torch.randn(WIDTH))  # held directly, as DiTs do
        self.register_buffer("scale_shift_table", torch.randn(2, WIDTH))

    def forward(self, tokens, latents, observe=lambda part: None):
        hidden = self.norm(self.embed(tokens) + self.pos_embed)
        with self.scheduler.resident("reasoner"):
            context = run_block(self.reasoner, hidden)
            observe("reasoner")
        with self.scheduler.resident("generator"):
            shift, scale = self.scale_shift_table
            out = self.head(run_block(self.generator, latents + context)) * (1 + scale) + shift
            observe("generator")
        return out


class Trunk(nn.Module):
    """Holds a tensor directly and also contains both parts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(20)
        self.gate = nn.Parameter(torch.randn(WIDTH))
        self.reasoner = make_block(WIDTH, seed=21)
        self.generator = make_block(WIDTH, seed=22)


class NestedSplit(SplitModel, nn.Module):
    """Parts one level down, inside a module that holds a tensor of its own."""

    _split_parts = {"reasoner": "trunk.reasoner", "generator": "trunk.generator"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(23)
        self.pos_embed = nn.Parameter(torch.randn(WIDTH))
        self.trunk = Trunk()

    def forward(self, tokens, latents, observe=lambda part: None):
        hidden = latents * self.trunk.gate + self.pos_embed + tokens[:, None]
        with self.scheduler.resident("reasoner"):
            context = run_block(self.trunk.reasoner, hidden)
            observe("reasoner")
        with self.scheduler.resident("generator"):
            out = run_block(self.trunk.generator, latents + context)
            observe("generator")
        return out


#: Each model class with the paths of the tensors it holds directly (on itself, or on a module
#: that also contains a part), outside every part.
HELD_DIRECTLY = {
    SplitTransformer: ("pos_embed", "scale_shift_table"),
    NestedSplit: ("pos_embed", "trunk.gate"),
}


class SplitPipeline(SupportsComponentDiscovery, nn.Module):
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder",)
    _vae_modules = ("vae",)

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = make_block(WIDTH, seed=1)
        self.transformer = SplitTransformer()
        self.vae = make_block(WIDTH, seed=2)

    def generate(self, tokens, scheduler, observe=lambda part: None, steps=3):
        with scheduler.resident("text_encoder"):
            latents = run_block(self.text_encoder, torch.ones(len(tokens), WIDTH,
                                                              device=tokens.device))
        observe("text_encoder")
        for _ in range(steps):
            latents = self.transformer(tokens, latents, observe)
        return run_block(self.vae, latents)


def _inside(tensor, group) -> bool:
    """Whether `tensor` reads `group`'s device buffer."""
    storage = group.device_storage  # None before the group's first load
    buffer = None if storage is None else storage.buffer
    start = buffer.data_ptr() if buffer is not None else -1
    return start <= tensor.data_ptr() < start + (buffer.numel() if buffer is not None else 0)


TOKENS = torch.tensor([1, 4, 2, 7])


@pytest.mark.fast
def test_an_unattached_split_model_runs_with_offloading_off():
    model = SplitTransformer()
    assert isinstance(model.scheduler, NoOffload)
    assert model.scheduler is model.scheduler  # one fallback per model, kept
    assert isinstance(SplitTransformer().scheduler, NoOffload)
    assert SplitTransformer().scheduler is not model.scheduler  # no shared state between models
    assert split_parts(model) == {"reasoner": ("reasoner",), "generator": ("generator", "head")}
    assert split_parts(nn.Linear(2, 2)) == {}
    out = model(TOKENS, torch.zeros(4, WIDTH))
    assert out.shape == (4, WIDTH)


@pytest.mark.fast
def test_parts_become_exclusive_groups_and_shared_tensors_stay_resident():
    pipe = SplitPipeline()
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert {n: scheduler[n].policy.value for n in scheduler} == {
        "reasoner": "exclusive",
        "generator": "exclusive",
        "text_encoder": "exclusive",
        "transformer": "resident",
        "vae": "resident",
    }
    model = pipe.transformer
    assert model.scheduler is scheduler
    assert scheduler["generator"].modules == (model.generator, model.head)
    shared = scheduler["transformer"]
    assert shared.modules == (model,)  # the model minus its parts
    assert shared.excluded == (model.reasoner, model.generator, model.head)
    assert shared.tensors == (model.pos_embed, model.scale_shift_table, model.embed.weight,
                              model.norm.weight, model.norm.bias)
    assert on_device(shared)  # the directly held tensors, embeddings and norms: on the device
    with scheduler.resident("transformer.head") as group:
        assert group.name == "generator"
    with scheduler.resident("transformer.reasoner") as group:
        assert group.name == "reasoner"
    scheduler.close()


@pytest.mark.fast
@pytest.mark.parametrize("model_cls", [SplitTransformer, NestedSplit])
def test_one_part_on_the_device_at_a_time_and_outputs_bit_identical(model_cls):
    pipe = _pipeline_with(model_cls)
    plain = copy.deepcopy(pipe)  # never offloaded; its split model falls back to NoOffload
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    held = [attrgetter(path)(pipe.transformer) for path in HELD_DIRECTLY[model_cls]]
    assert {id(t) for t in scheduler["transformer"].tensors} >= {id(t) for t in held}
    seen = []

    def observe(phase):
        expected = {phase, "transformer", "vae"}
        assert set(scheduler.resident_groups()) == expected
        for name in scheduler:
            group = scheduler[name]
            assert on_device(group) == (name in expected), name
            assert on_host_master(group) == (name not in expected), name
        assert all(_inside(t, scheduler["transformer"]) for t in held)  # resident throughout
        seen.append(phase)

    with torch.no_grad():
        for _ in range(2):
            out = pipe.generate(TOKENS, scheduler, observe)
            assert torch.equal(out, plain.generate(TOKENS, NoOffload()))
    assert seen == (["text_encoder"] + ["reasoner", "generator"] * 3) * 2
    assert isinstance(plain.transformer.scheduler, NoOffload)
    scheduler.close()


@pytest.mark.gpu
def test_on_the_accelerator_parts_take_turns_and_outputs_are_bit_identical():
    device = torch.accelerator.current_accelerator()
    pipe = SplitPipeline()
    plain = copy.deepcopy(pipe).to(device)
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device=device)
    tokens = TOKENS.to(device)

    def observe(phase):
        assert set(scheduler.resident_groups()) == {phase, "transformer", "vae"}
        for name in scheduler:
            on_device = {t.device.type for t in scheduler[name].tensors} == {device.type}
            assert on_device == scheduler[name].is_resident, name

    with torch.no_grad():
        out = pipe.generate(tokens, scheduler, observe)
        assert torch.equal(out, plain.generate(tokens, NoOffload()))
    scheduler.close()


@pytest.mark.fast
def test_with_dit_unselected_the_whole_model_stays_resident_and_part_names_still_work():
    pipe = SplitPipeline()
    plain = copy.deepcopy(pipe)
    scheduler = Scheduler.from_pipeline(pipe, {"mode": "module", "components": ["text_encoder"]},
                                        device="cpu")
    assert scheduler["transformer"].policy.value == "resident"
    assert scheduler["transformer"].modules == (pipe.transformer,)
    with scheduler.resident("reasoner") as group:
        assert group.name == "transformer"
    with torch.no_grad():
        assert torch.equal(pipe.generate(TOKENS, scheduler), plain.generate(TOKENS, NoOffload()))
    scheduler.close()


@pytest.mark.fast
def test_offloading_off_attaches_a_no_offload():
    pipe = SplitPipeline()
    scheduler = Scheduler.from_pipeline(pipe)
    assert isinstance(scheduler, NoOffload)
    assert pipe.transformer.scheduler is scheduler


@pytest.mark.fast
def test_a_copy_of_an_attached_model_is_detached():
    pipe = SplitPipeline()
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    twin = copy.deepcopy(pipe.transformer)
    assert isinstance(twin.scheduler, NoOffload)
    assert pipe.transformer.scheduler is scheduler
    latents = torch.zeros(4, WIDTH)
    with torch.no_grad():
        assert torch.equal(twin(TOKENS, latents), pipe.transformer(TOKENS, latents))
    scheduler.close()


# -- errors -------------------------------------------------------------------------------------


def _pipeline_with(model_cls: type) -> SplitPipeline:
    pipe = SplitPipeline()
    pipe.transformer = model_cls()
    return pipe


def _split_class(name: str, parts: dict, base: type = SplitTransformer) -> type:
    return type(name, (base,), {"_split_parts": parts})


@pytest.mark.fast
@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"reasoner": "reasonr", "generator": "generator"},
         r"SplitPipeline: BadSplit._split_parts\['reasoner'\] lists 'transformer.reasonr', which "
         r"does not resolve: BadSplit at 'transformer' has no attribute 'reasonr'\. Did you mean "
         r"'reasoner'\?"),
        ({"reasoner": "reasoner", "generator": ()},
         r"SplitPipeline: BadSplit._split_parts\['generator'\] \(the split model at "
         r"'transformer'\) lists no paths"),
        ({"reasoner": "reasoner", "generator": ("generator", "reasoner.0")},
         r"SplitPipeline: 'transformer.reasoner.0' \(group 'generator'\) is nested inside "
         r"'transformer.reasoner' \(group 'reasoner'\)"),
        ({"text_encoder": "reasoner", "generator": "generator"},
         r"SplitPipeline: two groups would be named 'text_encoder' \(the second from path "
         r"'text_encoder'\)"),
    ],
)
def test_bad_parts_are_refused(parts, message):
    pipe = _pipeline_with(_split_class("BadSplit", parts))
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert isinstance(pipe.transformer.scheduler, NoOffload)  # nothing attached


def _tie_across_the_boundary(model):
    model.head.bias = model.norm.bias  # a generator tensor that is also outside every part


def _tie_two_parts(model):
    model.head.bias = model.reasoner[0].bias


@pytest.mark.fast
@pytest.mark.parametrize(
    ("tie", "message"),
    [
        (_tie_across_the_boundary,
         r"SplitPipeline: 'transformer' \(group 'transformer'\) shares a tensor with "
         r"'transformer.head' \(group 'generator'\); a tensor belongs to one group: list both "
         r"modules in one category \(in a split model: keep the tensor inside one part or "
         r"outside every part\), or untie the weights"),
        (_tie_two_parts,
         r"SplitPipeline: 'transformer.head' \(group 'generator'\) shares a tensor with "
         r"'transformer.reasoner' \(group 'reasoner'\); a tensor belongs to one group"),
    ],
    ids=["part-and-shared", "two-parts"],
)
def test_a_tensor_tied_across_groups_of_a_split_model_is_refused(tie, message):
    pipe = SplitPipeline()
    tie(pipe.transformer)
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers  # nothing moved
    assert isinstance(pipe.transformer.scheduler, NoOffload)


@pytest.mark.fast
def test_tensors_tied_inside_the_shared_region_are_fine():
    pipe = SplitPipeline()
    plain = copy.deepcopy(pipe)
    model = pipe.transformer
    model.norm.bias = model.pos_embed  # both outside every part: one resident group
    plain.transformer.norm.bias = plain.transformer.pos_embed
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    assert model.norm.bias is model.pos_embed and _inside(model.pos_embed, scheduler["transformer"])
    with torch.no_grad():
        assert torch.equal(pipe.generate(TOKENS, scheduler), plain.generate(TOKENS, NoOffload()))
    scheduler.close()


@pytest.mark.fast
@pytest.mark.parametrize(
    ("resident_path", "message"),
    [
        ("transformer.embed",
         r"SplitPipeline: 'transformer.embed' \(group 'transformer.embed'\) is nested inside "
         r"'transformer' \(group 'transformer'\)"),
        ("transformer.generator.0",  # inside the model too, but the shared group excludes it
         r"SplitPipeline: 'transformer.generator.0' \(group 'transformer.generator.0'\) is "
         r"nested inside 'transformer.generator' \(group 'generator'\)"),
    ],
)
def test_a_listed_module_inside_a_split_model_is_refused(resident_path, message):
    pipe = type("SplitPipeline", (SplitPipeline,), {"_resident_modules": (resident_path,)})()
    with pytest.raises(ConfigError, match=message):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")


@pytest.mark.fast
def test_the_plan_names_the_shared_group_and_the_parts_it_excludes():
    model = SplitTransformer()
    plan = group_components("P", {"transformer": model}, {}, {}, {},
                           OffloadConfig(mode="module", components=("dit",)))
    assert dict(plan.exclusive) == {"reasoner": (("transformer.reasoner", model.reasoner),),
                                    "generator": (("transformer.generator", model.generator),
                                                  ("transformer.head", model.head))}
    assert dict(plan.resident) == {"transformer": (("transformer", model),)}
    assert dict(plan.excluded) == {"transformer": (model.reasoner, model.generator, model.head)}
    assert list(plan.groups()) == [
        ("reasoner", Policy.EXCLUSIVE, (model.reasoner,), ()),
        ("generator", Policy.EXCLUSIVE, (model.generator, model.head), ()),
        ("transformer", Policy.RESIDENT, (model,), (model.reasoner, model.generator, model.head)),
    ]


class PartsOnly(SplitModel, nn.Module):
    _split_parts = {"reasoner": "reasoner", "generator": "generator"}

    def __init__(self) -> None:
        super().__init__()
        self.reasoner, self.generator = make_block(WIDTH, seed=30), make_block(WIDTH, seed=31)


@pytest.mark.fast
def test_a_split_model_with_no_tensor_outside_its_parts_has_no_shared_group():
    model = PartsOnly()
    plan = group_components("P", {"transformer": model}, {}, {}, {},
                           OffloadConfig(mode="module", components=("dit",)))
    assert list(plan.exclusive) == ["reasoner", "generator"]
    assert dict(plan.resident) == {} and dict(plan.excluded) == {}
    scheduler = Scheduler("cpu")
    register_groups(scheduler, plan)
    assert list(scheduler) == ["reasoner", "generator"] and model.scheduler is scheduler
    scheduler.close()


@pytest.mark.fast
def test_register_groups_removes_the_shared_group_too_when_a_later_registration_fails():
    pipe = SplitPipeline()
    plain = copy.deepcopy(pipe)
    dits, encoders, vaes = ({"transformer": pipe.transformer}, {"text_encoder": pipe.text_encoder},
                            {"vae": pipe.vae})
    plan = group_components("SplitPipeline", dits, encoders, vaes, {}, OffloadConfig(mode="module", components=("dit", "text_encoder")))
    assert list(plan.resident) == ["transformer", "vae"]  # the shared group is added before vae
    scheduler = Scheduler("cpu")
    scheduler.add("vae", nn.Linear(2, 2), policy="resident")
    with pytest.raises(RegistrationError, match=r"a group named 'vae' is already"):
        register_groups(scheduler, plan)
    assert list(scheduler) == ["vae"]
    assert "transformer.head" not in scheduler
    assert isinstance(pipe.transformer.scheduler, NoOffload)  # nothing attached
    scheduler.close()
    fresh = Scheduler("cpu")
    register_groups(fresh, plan)  # every module was freed: the same plan applies cleanly
    assert fresh["transformer"].excluded == (pipe.transformer.reasoner, pipe.transformer.generator,
                                             pipe.transformer.head)
    with torch.no_grad():
        assert torch.equal(pipe.generate(TOKENS, fresh), plain.generate(TOKENS, NoOffload()))
    fresh.close()


class TwoSplitPipeline(SplitPipeline):
    _dit_modules = ("transformer", "transformer_2")

    def __init__(self) -> None:
        super().__init__()
        self.transformer_2 = SplitTransformer()


@pytest.mark.fast
def test_two_split_models_with_the_same_part_names_are_refused_when_their_parts_swap():
    with pytest.raises(ConfigError, match=r"TwoSplitPipeline: two groups would be named "
                                          r"'reasoner' \(the second from path "
                                          r"'transformer_2.reasoner'\)"):
        Scheduler.from_pipeline(TwoSplitPipeline(), CONFIG, device="cpu")


@pytest.mark.fast
@pytest.mark.parametrize("config", [None, {"mode": "module", "components": ["text_encoder"]}])
def test_two_resident_split_models_may_share_part_names(config):
    pipe = TwoSplitPipeline()
    scheduler = Scheduler.from_pipeline(pipe, config, device="cpu")
    assert pipe.transformer.scheduler is scheduler and pipe.transformer_2.scheduler is scheduler
    latents = torch.zeros(4, WIDTH)
    with torch.no_grad():
        out = pipe.transformer_2(TOKENS, latents)
    assert torch.equal(out, copy.deepcopy(pipe.transformer_2)(TOKENS, latents))
    if isinstance(scheduler, Scheduler):
        scheduler.close()


@pytest.mark.fast
def test_a_part_name_that_is_also_a_module_path_is_refused():
    with pytest.raises(ConfigError, match=r"P: 'reasoner' would lead to two groups, "
                                          r"'transformer' and 'text_encoder'; give split-model "
                                          r"parts names that are unique in the pipeline"):
        group_components("P", {"transformer": SplitTransformer()}, {"reasoner": nn.Linear(2, 2)},
                        {}, {}, OffloadConfig(mode="module", components=("text_encoder",)))
