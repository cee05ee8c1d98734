"""`OmniOffloadMixin` driven the way vLLM-Omni 0.30's ``ModelLevelOffloadBackend`` drives a pipeline.

`Backend` below is a stand-in for that backend's custom-pipeline path (vllm_omni/diffusion/
offloader/sequential_backend.py): it checks the runtime protocol, passes ``offload_components`` only
when the config names components, and on any failure inside enable calls
``disable_omni_model_cpu_offload()`` before re-raising.
"""

from __future__ import annotations

import ast
import copy
import inspect
from typing import Protocol, runtime_checkable

import pytest
import torch
from torch import nn

from residency import NoOffload, OmniOffloadMixin, Scheduler
from residency.core.errors import ConfigError, PhaseError, RegistrationError, SchedulerClosedError

from _vllm_omni import wheel_source
from conftest import make_block, run_block

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)

WIDTH = 16


@runtime_checkable
class SupportsModelCpuOffload(Protocol):
    """vLLM-Omni 0.30's protocol (offloader/base.py), copied; see the signature test below."""

    def enable_omni_model_cpu_offload(self, *, device, pin_memory, use_hsdp,
                                      offload_components=None) -> None: ...

    def disable_omni_model_cpu_offload(self) -> None: ...


class Backend:
    """The custom-pipeline path of 0.30's ``ModelLevelOffloadBackend``, line for line."""

    def __init__(self, device, *, components=None, pin_memory=True, use_hsdp=False) -> None:
        self.device, self.components = device, components
        self.pin_memory, self.use_hsdp = pin_memory, use_hsdp
        self.enabled = False
        self.pipeline = None

    def enable(self, pipeline) -> None:
        assert isinstance(pipeline, SupportsModelCpuOffload)
        try:
            if self.components is not None:
                pipeline.enable_omni_model_cpu_offload(
                    device=self.device, pin_memory=self.pin_memory, use_hsdp=self.use_hsdp,
                    offload_components=self.components,
                )
            else:
                pipeline.enable_omni_model_cpu_offload(
                    device=self.device, pin_memory=self.pin_memory, use_hsdp=self.use_hsdp,
                )
        except BaseException:
            try:
                pipeline.disable_omni_model_cpu_offload()
            except BaseException:
                pass  # 0.30 logs the clean-up failure and re-raises the first error
            raise
        self.pipeline, self.enabled = pipeline, True

    def disable(self) -> None:
        if self.enabled:
            self.pipeline.disable_omni_model_cpu_offload()
            self.pipeline, self.enabled = None, False


class OmniWan(OmniOffloadMixin, nn.Module):
    """A vLLM-Omni-style pipeline: list ClassVars, no SupportsComponentDiscovery of ours."""

    _dit_modules = ["transformer", "transformer_2"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _resident_modules = ["time_embed"]

    def __init__(self, *, time_embed_device: str = "cpu") -> None:
        super().__init__()
        self.text_encoder = make_block(WIDTH, seed=1)
        self.transformer = make_block(WIDTH, seed=2)
        self.transformer_2 = make_block(WIDTH, seed=3)
        self.vae = make_block(WIDTH, seed=4)
        torch.manual_seed(5)
        self.time_embed = nn.Embedding(4, WIDTH, device=time_embed_device)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        scheduler = self.omni_scheduler
        with scheduler.resident("text_encoder"):
            context = run_block(self.text_encoder, prompt)
        latents = torch.zeros_like(prompt)
        for step, expert in enumerate(("transformer", "transformer_2")):
            with scheduler.resident(expert):
                t = self.time_embed(torch.tensor([step]))
                latents = run_block(getattr(self, expert), latents + context + t)
        return run_block(self.vae, latents)


def _snapshot(pipe: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in pipe.state_dict().items()
            if not tensor.is_meta}


def _assert_restored(pipe: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    """Every weight on the host and bit-identical to `snapshot`; no scheduler left."""
    assert "_omni_scheduler" not in vars(pipe)
    assert isinstance(pipe.omni_scheduler, NoOffload)
    state = {name: t for name, t in pipe.state_dict().items() if not t.is_meta}
    assert state.keys() == snapshot.keys()
    for name, tensor in state.items():
        assert tensor.device.type == "cpu", name
        assert torch.equal(tensor, snapshot[name]), name


@pytest.fixture
def pipe() -> OmniWan:
    return OmniWan().eval()


def test_the_methods_match_vllm_omni_0_30_protocol():
    tree = ast.parse(wheel_source("vllm_omni/diffusion/offloader/base.py"))
    protocol = next(node for node in ast.walk(tree)
                    if isinstance(node, ast.ClassDef) and node.name == "SupportsModelCpuOffload")
    methods = {f.name: f.args for f in protocol.body if isinstance(f, ast.FunctionDef)}
    assert set(methods) == {"enable_omni_model_cpu_offload", "disable_omni_model_cpu_offload"}
    theirs = [a.arg for a in methods["enable_omni_model_cpu_offload"].kwonlyargs]
    ours = inspect.signature(OmniOffloadMixin.enable_omni_model_cpu_offload).parameters.values()
    assert [p.name for p in ours if p.kind is p.KEYWORD_ONLY] == theirs == [
        "device", "pin_memory", "use_hsdp", "offload_components"]
    assert {p.name: p.default for p in ours if p.kind is p.KEYWORD_ONLY} == {
        "device": inspect.Parameter.empty, "pin_memory": True, "use_hsdp": False,
        "offload_components": None}
    assert [a.arg for a in methods["disable_omni_model_cpu_offload"].args] == ["self"]
    backend = wheel_source("vllm_omni/diffusion/offloader/sequential_backend.py")
    for line in ("if self.config.components is not None:",
                 "offload_components=self.config.components,",
                 "pipeline.disable_omni_model_cpu_offload()"):
        assert line in backend  # the behaviour `Backend` copies


@pytest.mark.parametrize(
    ("components", "exclusive"),
    [
        (frozenset({"dit"}), {"transformer", "transformer_2"}),
        (frozenset({"dit", "text_encoder"}), {"transformer", "transformer_2", "text_encoder"}),
        (frozenset({"text_encoder"}), {"text_encoder"}),
        (None, {"transformer", "transformer_2", "text_encoder"}),  # the legacy switch
    ],
)
def test_the_backend_enables_runs_bit_identical_and_disables(pipe, components, exclusive):
    plain = copy.deepcopy(pipe)
    snapshot = _snapshot(pipe)
    backend = Backend(torch.device("cpu"), components=components)
    backend.enable(pipe)
    scheduler = pipe.omni_scheduler
    assert isinstance(scheduler, Scheduler)
    assert {n for n in scheduler if scheduler[n].policy.value == "exclusive"} == exclusive
    prompt = torch.randn(3, WIDTH)
    with torch.no_grad():
        assert torch.equal(pipe(prompt), plain(prompt))
    assert scheduler.transitions.count >= 2
    backend.disable()
    _assert_restored(pipe, snapshot)
    with torch.no_grad():
        assert torch.equal(pipe(prompt), plain(prompt))  # plain again


def test_pin_memory_false_gives_pageable_host_masters(pipe):
    Backend(torch.device("cpu"), components=frozenset({"dit"}), pin_memory=False).enable(pipe)
    assert pipe.omni_scheduler.pin_memory is False
    pipe.disable_omni_model_cpu_offload()


def test_a_failure_half_way_through_enable_is_undone_by_disable():
    pipe = OmniWan(time_embed_device="meta").eval()  # registered last, after the DiTs are packed
    snapshot = _snapshot(pipe)
    backend = Backend(torch.device("cpu"), components=frozenset({"dit", "text_encoder"}))
    with pytest.raises(RegistrationError, match=r"on the meta device"):
        backend.enable(pipe)
    assert not backend.enabled
    _assert_restored(pipe, snapshot)
    pipe.time_embed = nn.Embedding(4, WIDTH)  # loaded for real: enabling works now
    backend.enable(pipe)
    assert isinstance(pipe.omni_scheduler, Scheduler)
    backend.disable()


@pytest.mark.parametrize(
    ("backend", "error", "message"),
    [
        (Backend(torch.device("cpu"), use_hsdp=True), ConfigError,
         r"OmniWan\.enable_omni_model_cpu_offload got use_hsdp=True: residency cannot offload "
         r"an HSDP-sharded pipeline .*; turn HSDP off for this stage "
         r"\(parallel_config\.use_hsdp=False\) or turn model-level CPU offload off"),
        (Backend(torch.device("cpu"), use_hsdp=1), ConfigError,
         r"got use_hsdp=1 \(int\); give True or False"),
        (Backend(torch.device("cpu"), components=frozenset({"unet"})), ConfigError,
         r"field 'components' contains 'unet'"),
        (Backend(torch.device("cpu"), components=frozenset()), ConfigError,
         r"field 'components' is empty"),
        (Backend(torch.device("cpu"), pin_memory="yes"), ConfigError,
         r"field 'pin_memory' is 'yes'"),
    ],
)
def test_refused_enables_name_the_problem_and_change_nothing(pipe, backend, error, message):
    pointers = [t.data_ptr() for t in pipe.state_dict().values()]
    with pytest.raises(error, match=message):
        backend.enable(pipe)
    assert [t.data_ptr() for t in pipe.state_dict().values()] == pointers
    assert "_omni_scheduler" not in vars(pipe)


def test_enabling_twice_is_refused_and_keeps_the_first(pipe):
    pipe.enable_omni_model_cpu_offload(device=torch.device("cpu"))
    first = pipe.omni_scheduler
    with pytest.raises(RegistrationError, match=r"model-level offload is already enabled on this "
                                                r"OmniWan; call disable_omni_model_cpu_offload\(\) "
                                                r"first, or keep using its omni_scheduler"):
        pipe.enable_omni_model_cpu_offload(device=torch.device("cpu"),
                                           offload_components=frozenset({"dit"}))
    assert pipe.omni_scheduler is first
    with first.resident("transformer"):  # still open and in use
        pass
    pipe.disable_omni_model_cpu_offload()
    with pytest.raises(SchedulerClosedError):
        first.resident("transformer")


def test_disable_when_not_enabled_does_nothing(pipe):
    snapshot = _snapshot(pipe)
    pipe.disable_omni_model_cpu_offload()
    _assert_restored(pipe, snapshot)


def test_disable_inside_a_phase_is_refused_and_keeps_the_scheduler(pipe):
    pipe.enable_omni_model_cpu_offload(device=torch.device("cpu"))
    scheduler = pipe.omni_scheduler
    with scheduler.resident("transformer"):
        with pytest.raises(PhaseError):
            pipe.disable_omni_model_cpu_offload()
    assert pipe.omni_scheduler is scheduler
    with scheduler.resident("text_encoder"):  # still open
        pass
    pipe.disable_omni_model_cpu_offload()


def test_a_copy_of_an_enabled_pipeline_is_plain_and_detached(pipe):
    plain = copy.deepcopy(pipe)
    pipe.enable_omni_model_cpu_offload(device=torch.device("cpu"))
    copied = copy.deepcopy(pipe)
    assert "_omni_scheduler" not in vars(copied)
    prompt = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert torch.equal(copied(prompt), plain(prompt))
    assert all(a.data_ptr() != b.data_ptr()
               for a, b in zip(copied.parameters(), pipe.parameters()))
    pipe.disable_omni_model_cpu_offload()
