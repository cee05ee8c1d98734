"""Tensor subclasses are offloaded, not refused (issue 12, points 3 and 4's quantized flows).

torchao's wrapper subclasses (their inner tensors move), diffusers' GGUFParameter and
bitsandbytes' Params4bit/Int8Params (they move as they are, with their quantization state):
each bit-identical to the same model never offloaded, moving the quantized bytes only.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from residency import RegistrationError, Scheduler
from residency.modules.tensors import AttachedSlot, InnerSlot, repoint_group, take_inventory

warnings.filterwarnings("ignore", message=".*kernels.*")


# -- models ---------------------------------------------------------------------------------------


class _Block(nn.Module):
    """A DiT-like block: attention over the tokens, then an MLP, both residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v))
        return x + self.mlp(x)


def _dit(seed: int = 0, width: int = 64, depth: int = 2, config=None) -> nn.Module:
    """A small bf16 DiT-like model, quantized with the torchao `config` (int8 weight-only)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(seed)
    blocks = [_Block(width) for _ in range(depth)]
    model = nn.Sequential(nn.Linear(32, width), *blocks, nn.Linear(width, 32))
    model = model.to(torch.bfloat16).eval()
    if config is not False:
        quantize_(model, config or Int8WeightOnlyConfig())
    return model


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _flux(seed: int = 0) -> nn.Module:
    """A tiny real diffusers FluxTransformer2DModel, bf16, torchao int8 weight-only."""
    from diffusers import FluxTransformer2DModel
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()
    transformer = transformer.to(torch.bfloat16)
    quantize_(transformer, Int8WeightOnlyConfig())
    return transformer


def _flux_inputs(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return dict(
        hidden_states=torch.randn(1, 16, 4, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g).bfloat16(),
        pooled_projections=torch.randn(1, 32, generator=g).bfloat16(),
        timestep=torch.tensor([0.25 * (step + 1)]).bfloat16(),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


def _gguf_model(seed: int = 0) -> nn.Module:
    """An MLP whose Linears are diffusers GGUFLinear over Q8_0 GGUFParameters, as diffusers'
    GGUF loader builds them (`_replace_with_gguf_linear`, then the quantized weights assigned)."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, GGUFLinear, _replace_with_gguf_linear

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            quantized = gguf.quants.quantize(module.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
            state[f"{name}.weight"] = GGUFParameter(
                torch.from_numpy(quantized), quant_type=gguf.GGMLQuantizationType.Q8_0
            )
            state[f"{name}.bias"] = module.bias.detach().clone()
    _replace_with_gguf_linear(model, torch.float32, state)
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            module._parameters["weight"] = state[f"{name}.weight"]
            module._parameters["bias"] = nn.Parameter(state[f"{name}.bias"], requires_grad=False)
    return model.eval()


def _bnb_model(kind: str, seed: int = 0) -> nn.Module:
    """Two bitsandbytes Linears (nf4 Linear4bit or int8 Linear8bitLt), quantized on the CPU."""
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    layers = []
    for plain in (nn.Linear(64, 64), nn.Linear(64, 32)):
        weight = plain.weight.detach().clone()
        if kind == "nf4":
            layer = bnb.nn.Linear4bit(64, plain.out_features, compute_dtype=torch.float32,
                                      quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(64, plain.out_features, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        layer.bias = nn.Parameter(plain.bias.detach().clone(), requires_grad=False)
        layers.append(layer.to("cpu"))  # bitsandbytes quantizes on the move to a device
    return nn.Sequential(layers[0], nn.GELU(), layers[1]).eval()


# -- helpers --------------------------------------------------------------------------------------


def _other(scheduler: Scheduler) -> None:
    scheduler.add("other", nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))


def _inside(tensor: torch.Tensor, memory: torch.Tensor) -> bool:
    start = memory.data_ptr()
    return start <= tensor.data_ptr() < start + memory.numel()


def _in_master(tensor: torch.Tensor, group) -> bool:
    return any(_inside(tensor, chunk) for chunk in group.host_master.chunks)


def _flat(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor is made of (a wrapper's, flattened recursively)."""
    if not hasattr(type(tensor), "__tensor_flatten__") or type(tensor) in (torch.Tensor, nn.Parameter):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [leaf for name in names for leaf in _flat(getattr(tensor, name))]


def _quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every plain tensor the parameters are made of, bytes dequantized to bf16)."""
    stored = dequantized = 0
    for tensor in model.parameters():
        stored += sum(t.nbytes for t in _flat(tensor))
        dequantized += tensor.numel() * 2
    return stored, dequantized


def _swaps(scheduler, name, run, reference, steps: int = 3) -> None:
    """Alternate `name` with the other group; every output bit-identical to the reference."""
    for step in range(steps):
        with scheduler.resident(name):
            assert torch.equal(run(step), reference(step)), f"step {step}"
        with scheduler.resident("other"):
            pass


# -- torchao: traceable wrapper subclasses ----------------------------------------------------------


@pytest.mark.fast
def test_torchao_int8_dit_is_bit_identical_across_swaps_and_moves_the_int8_bytes(scheduler):
    model, reference = _dit(), _dit()
    x = _tokens()
    host_wrapper = model[1].qkv.weight
    group = scheduler.add("dit", model)
    _other(scheduler)
    _swaps(scheduler, "dit", lambda s: model(x + s), lambda s: reference(x + s))
    stored, dequantized = _quantized_bytes(reference)
    assert group.nbytes == stored
    assert stored < 0.6 * dequantized
    with scheduler.resident("dit"):
        pass
    moved = scheduler.transitions[-1].nbytes
    assert stored <= moved <= stored + 64 * group.inventory.tensor_count  # alignment padding only
    assert model[1].qkv.weight is host_wrapper  # the CPU device keeps the wrapper itself


@pytest.mark.fast
def test_torchao_inner_tensors_live_in_the_device_buffer_while_resident_and_in_the_master_after(
    scheduler,
):
    model = _dit()
    group = scheduler.add("dit", model)
    _other(scheduler)
    inner = _flat(model[1].qkv.weight)
    assert [type(t) for t in inner] == [torch.Tensor] * 3
    with scheduler.resident("dit"):
        buffer = group.device_storage.buffer
        assert all(_inside(t, buffer) for t in inner)
    with scheduler.resident("other"):
        assert all(_in_master(t, group) for t in inner)
        assert not any(_inside(t, buffer) for t in inner)


@pytest.mark.fast
def test_torchao_inventory_lists_inner_tensors_with_where_they_are_reached_from():
    model = _dit(depth=1)
    inventory = take_inventory([model])
    slots = [slots[0] for slots in inventory.slots]
    inner = [s for s in slots if isinstance(s, InnerSlot)]
    assert {s.path for s in inner} == {("qdata",), ("scale",), ("zero_point",)}
    assert inner[0].describe() == "inner tensor 'qdata' of the Int8Tensor parameter 'weight' of Linear"
    assert all(s.current() is t for t, (s, *_) in zip(inventory.tensors, inventory.slots))
    assert all(type(t) is torch.Tensor for t, (s, *_) in zip(inventory.tensors, inventory.slots)
               if isinstance(s, InnerSlot))


@pytest.mark.fast
def test_edits_through_inner_tensors_while_resident_survive_eviction(scheduler):
    model, reference = _dit(), _dit()
    x = _tokens()
    group = scheduler.add("dit", model)
    _other(scheduler)
    new_rows = torch.arange(64, dtype=torch.int8).repeat(2, 1)
    with scheduler.resident("dit"):
        model[1].qkv.weight.qdata.data[:2] = new_rows  # through .data: no version counter moves
        model[2].out.weight.scale.data[:4] *= 2
    with torch.no_grad():
        reference[1].qkv.weight.qdata[:2] = new_rows
        reference[2].out.weight.scale[:4] *= 2
    with scheduler.resident("other"):
        assert torch.equal(model[1].qkv.weight.qdata[:2], new_rows)
        assert _in_master(model[1].qkv.weight.qdata, group)
    _swaps(scheduler, "dit", lambda s: model(x + s), lambda s: reference(x + s))


@pytest.mark.fast
def test_torchao_int8_flux_transformer_is_bit_identical_across_swaps(scheduler):
    transformer, reference = _flux(), _flux()
    group = scheduler.add("transformer", transformer)
    _other(scheduler)
    _swaps(scheduler, "transformer", lambda s: transformer(**_flux_inputs(s))[0],
           lambda s: reference(**_flux_inputs(s))[0])
    stored, dequantized = _quantized_bytes(reference)
    assert group.nbytes == stored < 0.75 * dequantized  # norms and embeddings stay bf16


@pytest.mark.fast
def test_torchao_float8_weight_only_is_bit_identical(scheduler):
    from torchao.quantization import Float8WeightOnlyConfig

    model, reference = _dit(config=Float8WeightOnlyConfig()), _dit(config=Float8WeightOnlyConfig())
    x = _tokens()
    assert model[1].qkv.weight.qdata.dtype == torch.float8_e4m3fn
    group = scheduler.add("dit", model)
    _other(scheduler)
    _swaps(scheduler, "dit", lambda s: model(x + s), lambda s: reference(x + s))
    stored, dequantized = _quantized_bytes(reference)
    assert group.nbytes == stored < 0.6 * dequantized


class _Scaled(torch.Tensor):
    """``inner * scale``: a traceable wrapper whose `inner` may itself be one (nested), like an
    AffineQuantizedTensor around its tensor_impl.  Every op but detach runs on the dequantized value."""

    @staticmethod
    def __new__(cls, inner, scale):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=scale.dtype,
                                                   device=inner.device)

    def __init__(self, inner, scale):
        self.inner, self.scale = inner, scale

    def __tensor_flatten__(self):
        return ["inner", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, size, stride):
        return _Scaled(inner["inner"], inner["scale"])

    def dequantize(self) -> torch.Tensor:
        inner = self.inner.dequantize() if isinstance(self.inner, _Scaled) else self.inner
        return inner.to(self.scale.dtype) * self.scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return _Scaled(args[0].inner.detach(), args[0].scale.detach())
        unwrap = lambda t: t.dequantize() if isinstance(t, _Scaled) else t  # noqa: E731
        args, kwargs = torch.utils._pytree.tree_map(unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)


def _nested(seed: int = 0) -> nn.Linear:
    """A Linear whose weight is a wrapper of a wrapper: _Scaled(_Scaled(int8, rows), outer)."""
    torch.manual_seed(seed)
    linear = nn.Linear(16, 8)
    codes = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    weight = _Scaled(_Scaled(codes, torch.rand(8, 1) / 127), torch.rand(1, 16))
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


@pytest.mark.fast
def test_nested_wrappers_move_every_leaf_and_stay_bit_identical(scheduler):
    model, reference = _nested(), _nested()
    x = torch.randn(4, 16)
    group = scheduler.add("nested", model)
    _other(scheduler)
    paths = {s[0].path for s in group.inventory.slots if isinstance(s[0], InnerSlot)}
    assert paths == {("inner", "inner"), ("inner", "scale"), ("scale",)}
    leaves = _flat(model.weight)
    assert len(leaves) == 3
    for step in range(3):
        with scheduler.resident("nested"):
            assert torch.equal(model(x + step), reference(x + step))
            assert all(_inside(t, group.device_storage.buffer) for t in leaves)
        with scheduler.resident("other"):
            assert all(_in_master(t, group) for t in leaves)


@pytest.mark.fast
def test_a_wrapper_gets_a_twin_for_another_device_and_its_own_slot_back():
    """The accelerator path's slot swaps, on the CPU: the twin for a device is rebuilt once around
    the same inner tensors (a CPU tensor cannot be re-pointed to another device type here, so the
    twin's device stays the CPU; the gpu test checks it follows)."""
    model = _dit(depth=1)
    host_wrapper = model[1].qkv.weight
    inventory = take_inventory([model])
    accelerator = torch.device("meta")  # any device the host wrappers are not on
    repoint_group(inventory, [t.data for t in inventory.tensors])  # CPU views: nothing swaps
    assert model[1].qkv.weight is host_wrapper
    inventory.wrappers.follow(accelerator)
    twin = model[1].qkv.weight
    assert twin is not host_wrapper and type(twin) is type(host_wrapper)
    assert isinstance(twin, nn.Parameter) and not twin.requires_grad
    assert all(a is b for a, b in zip(_flat(twin), _flat(host_wrapper)))  # one set of inner tensors
    assert inventory.changed_structure() is None  # the scheduler's own swap is no change
    inventory.wrappers.follow(torch.device("cpu"))
    assert model[1].qkv.weight is host_wrapper
    assert inventory.changed_structure() is None
    inventory.wrappers.follow(accelerator)
    assert model[1].qkv.weight is twin  # built once per device
    model[1].qkv.weight = nn.Parameter(torch.zeros(192, 64), requires_grad=False)
    assert "replaced" in inventory.changed_structure()
    inventory.wrappers.follow(torch.device("cpu"))  # a slot the user replaced stays theirs
    assert model[1].qkv.weight is not host_wrapper


@pytest.mark.fast
def test_groups_without_subclasses_have_no_wrapper_work():
    inventory = take_inventory([nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))])
    assert inventory.wrappers is None
    assert not any(isinstance(s, (InnerSlot, AttachedSlot)) for slots in inventory.slots for s in slots)


@pytest.mark.gpu
def test_wrappers_on_an_accelerator_are_device_twins_while_resident():
    device = torch.accelerator.current_accelerator()
    scheduler = Scheduler(device)
    model, reference = _dit(), _dit().to(device)
    host_wrapper = model[1].qkv.weight
    scheduler.add("dit", model)
    _other(scheduler)
    x = _tokens().to(device)
    for step in range(3):
        with scheduler.resident("dit"):
            resident_wrapper = model[1].qkv.weight
            assert resident_wrapper.device.type == device.type
            assert all(t.device.type == device.type for t in _flat(resident_wrapper))
            assert torch.equal(model(x + step), reference(x + step))
        with scheduler.resident("other"):
            assert model[1].qkv.weight is host_wrapper and host_wrapper.device.type == "cpu"
    scheduler.close()


# -- diffusers GGUF: a Parameter subclass over plain storage -----------------------------------------


@pytest.mark.fast
def test_gguf_quantized_model_is_bit_identical_and_keeps_its_parameters(scheduler):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    model, reference = _gguf_model(), _gguf_model()
    x = torch.randn(4, 64)
    weight = model[0].weight
    quant_type = weight.quant_type
    group = scheduler.add("gguf", model)
    _other(scheduler)
    _swaps(scheduler, "gguf", lambda s: model(x + s), lambda s: reference(x + s))
    with scheduler.resident("gguf"):
        assert model[0].weight is weight and type(weight) is GGUFParameter
        assert weight.quant_type == quant_type and weight.dtype == torch.uint8
        assert _inside(weight, group.device_storage.buffer)
    with scheduler.resident("other"):
        assert _in_master(weight, group)
    stored = sum(p.nbytes for p in reference.parameters())
    dequantized = sum(m.in_features * m.out_features * 4 for m in (reference[0], reference[2]))
    assert group.nbytes == stored < 0.5 * dequantized


# -- bitsandbytes: Parameter subclasses with attached quantization state -----------------------------


def _bnb_stored_bytes(model: nn.Module) -> int:
    """Bytes of the weights, biases and quantization state (CB shares the int8 weight's storage).

    An nf4 state with compressed statistics nests a second state (``state2``: the absmax's own
    absmax and code); a CPU with AVX512-BF16 re-packs the weight at the first forward without it.
    """
    stored = 0
    for layer in (model[0], model[2]):
        stored += layer.weight.nbytes + layer.bias.nbytes
        state = layer.weight.quant_state if hasattr(layer.weight, "quant_state") else layer.state
        stored += state.SCB.nbytes if hasattr(state, "SCB") else _quant_state_bytes(state)
    return stored


def _quant_state_bytes(state) -> int:
    """Bytes of the tensors of a bitsandbytes QuantState, nested states included."""
    stored = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            stored += value.nbytes
        elif type(value).__name__ == "QuantState":
            stored += _quant_state_bytes(value)
    return stored


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bitsandbytes_layers_are_bit_identical_with_their_quantization_state(scheduler, kind):
    model, reference = _bnb_model(kind), _bnb_model(kind)
    x = torch.randn(4, 64)
    # bitsandbytes re-packs nf4 weights for this CPU on the first eval forward (new shape, new
    # absmax) and hands int8's CB/SCB to the module: register what that leaves.
    model(x), reference(x)
    group = scheduler.add("bnb", model)
    _other(scheduler)
    attached = [t for t, s in zip(group.inventory.tensors, group.inventory.slots)
                if isinstance(s[0], AttachedSlot)]
    assert attached  # absmax/code/offset, or CB/SCB
    _swaps(scheduler, "bnb", lambda s: model(x + s), lambda s: reference(x + s))
    with scheduler.resident("bnb"):
        assert all(_inside(t, group.device_storage.buffer) for t in attached)
    with scheduler.resident("other"):
        assert all(_in_master(t, group) for t in attached)
    stored = _bnb_stored_bytes(reference)
    assert group.nbytes == stored < 0.4 * (64 * 64 + 64 * 32) * 4


@pytest.mark.fast
def test_bitsandbytes_int8_registered_before_its_first_forward(scheduler):
    """CB/SCB sit on the Int8Params then, and move to the module's state during the phase."""
    import bitsandbytes as bnb

    model, reference = _bnb_model("int8"), _bnb_model("int8")
    x = torch.randn(4, 64)
    scb = model[0].weight.SCB
    group = scheduler.add("bnb", model)
    _other(scheduler)
    _swaps(scheduler, "bnb", lambda s: model(x + s), lambda s: reference(x + s))
    assert isinstance(model[0].weight, bnb.nn.Int8Params)
    assert model[0].state.SCB is scb and _in_master(scb, group)


@pytest.mark.fast
def test_bitsandbytes_nf4_repacked_while_resident_is_not_silently_lost(scheduler):
    """A first eval forward while resident may re-pack the nf4 weight to a new shape (older
    bitsandbytes; 0.50 quantizes on the move to the CPU already): the next phase change then
    adopts it - a new host master holding the new weight - and never refuses or drops it."""
    model, reference = _bnb_model("nf4"), _bnb_model("nf4")
    x = torch.randn(4, 64)
    group = scheduler.add("bnb", model)
    _other(scheduler)
    packed = group.host_master
    with scheduler.resident("bnb"):
        before = (model[0].weight.data_ptr(), model[0].weight.shape)
        assert torch.equal(model(x), reference(x))
        repacked = (model[0].weight.data_ptr(), model[0].weight.shape) != before
    with scheduler.resident("other"):
        pass
    assert (group.host_master is not packed) == repacked, "a re-packed weight is adopted"
    assert all(_in_master(t, group) for t in _flat(model[0].weight))
    with scheduler.resident("bnb"):
        assert torch.equal(model(x + 1), reference(x + 1))


# -- anything else: refused, naming the class ---------------------------------------------------------


class _Opaque(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: the scheduler cannot see its data."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


class _Tagged(torch.Tensor):
    """A plain-storage subclass that is not a Parameter."""


def _copying_two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    class CopyingTwoTensor(TwoTensor):
        @staticmethod
        def __tensor_unflatten__(inner, meta, size, stride):
            return CopyingTwoTensor(inner["a"].clone(), inner["b"].clone())

    return CopyingTwoTensor(torch.zeros(4, 4), torch.ones(4, 4))


@pytest.mark.fast
@pytest.mark.parametrize(
    "make, where, expected",
    [
        (lambda: _Opaque(torch.zeros(4, 4)), "parameter 'weight' of Linear", "_Opaque"),
        (lambda: torch.zeros(4, 4).as_subclass(_Tagged), "parameter 'weight' of Linear", "_Tagged"),
        (_copying_two_tensor, "parameter 'weight' of Linear", "made new inner tensors"),
    ],
    ids=["dispatch-wrapper", "plain-subclass", "copying-unflatten"],
)
def test_unsupported_subclasses_are_refused_naming_the_class(scheduler, make, where, expected):
    linear = nn.Linear(4, 4)
    linear._parameters["weight"] = make()
    before = linear.bias.data_ptr()
    with pytest.raises(RegistrationError) as refused:
        scheduler.add("g", linear)
    message = str(refused.value)
    assert where in message and expected in message and "exclude=" in message
    if expected != "made new inner tensors":
        assert "traceable wrapper subclass" in message and "nn.Parameter subclass" in message
    assert linear.bias.data_ptr() == before and "g" not in scheduler  # a refused call changes nothing
