"""Split models: one part on the device at a time, shared tensors resident, identical outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from residency import NoOffload, Scheduler
from residency.config import OffloadConfig
from residency.discovery import SupportsComponentDiscovery, plan_components
from residency.errors import ConfigError
from residency.split import SplitModel, split_parts

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

    def forward(self, tokens, latents, observe=lambda part: None):
        hidden = self.norm(self.embed(tokens))
        with self.scheduler.resident("reasoner"):
            context = run_block(self.reasoner, hidden)
            observe("reasoner")
        with self.scheduler.resident("generator"):
            out = self.head(run_block(self.generator, latents + context))
            observe("generator")
        return out


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


def _on_device(group) -> bool:
    buffer = group.device_storage.buffer
    start = buffer.data_ptr() if buffer is not None else -1
    end = start + (buffer.numel() if buffer is not None else 0)
    return all(start <= t.data_ptr() < end for t in group.tensors)


def _on_host_master(group) -> bool:
    return [t.data_ptr() for t in group.tensors] == [v.data_ptr() for v in group.host_master.views]


TOKENS = torch.tensor([1, 4, 2, 7])


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
    assert scheduler["transformer"].modules == (model.embed, model.norm)
    assert _on_device(scheduler["transformer"])  # embeddings and norms on the device now
    with scheduler.resident("transformer.head") as group:
        assert group.name == "generator"
    with scheduler.resident("transformer.reasoner") as group:
        assert group.name == "reasoner"
    scheduler.close()


def test_one_part_on_the_device_at_a_time_and_outputs_bit_identical():
    pipe = SplitPipeline()
    plain = copy.deepcopy(pipe)  # never offloaded; its split model falls back to NoOffload
    scheduler = Scheduler.from_pipeline(pipe, CONFIG, device="cpu")
    seen = []

    def observe(phase):
        expected = {phase, "transformer", "vae"}
        assert set(scheduler.resident_groups()) == expected
        for name in scheduler:
            group = scheduler[name]
            assert _on_device(group) == (name in expected), name
            assert _on_host_master(group) == (name not in expected), name
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


def test_offloading_off_attaches_a_no_offload():
    pipe = SplitPipeline()
    scheduler = Scheduler.from_pipeline(pipe)
    assert isinstance(scheduler, NoOffload)
    assert pipe.transformer.scheduler is scheduler


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


class DirectParameter(SplitTransformer):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(WIDTH))


def test_a_tensor_held_directly_by_a_split_model_is_refused():
    pipe = _pipeline_with(DirectParameter)
    with pytest.raises(ConfigError, match=r"SplitPipeline: the split model at 'transformer' holds "
                                          r"parameter 'pos' directly on 'transformer', which also "
                                          r"contains parts; a tensor shared by the parts must "
                                          r"live in a submodule that holds no part"):
        Scheduler.from_pipeline(pipe, CONFIG, device="cpu")


class TwoSplitPipeline(SplitPipeline):
    _dit_modules = ("transformer", "transformer_2")

    def __init__(self) -> None:
        super().__init__()
        self.transformer_2 = SplitTransformer()


def test_two_split_models_with_the_same_part_names_are_refused_when_their_parts_swap():
    with pytest.raises(ConfigError, match=r"TwoSplitPipeline: two groups would be named "
                                          r"'reasoner' \(the second from path "
                                          r"'transformer_2.reasoner'\)"):
        Scheduler.from_pipeline(TwoSplitPipeline(), CONFIG, device="cpu")


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


def test_a_part_name_that_is_also_a_module_path_is_refused():
    with pytest.raises(ConfigError, match=r"P: 'reasoner' would lead to two groups, "
                                          r"'transformer' and 'text_encoder'; give split-model "
                                          r"parts names that are unique in the pipeline"):
        plan_components("P", {"transformer": SplitTransformer()}, {"reasoner": nn.Linear(2, 2)},
                        {}, {}, OffloadConfig(mode="module", components=("text_encoder",)))
