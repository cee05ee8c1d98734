"""Block discovery for layer mode (residency.modules.blocks): which blocks stream, in which order, which
are kept; tiny real diffusers DiTs, a vLLM-Omni-style `_offload_plan`, declared ClassVars, every
refusal's message, and purity (nothing moved, nothing added)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from residency.modules.blocks import (
    Block,
    ModelBlocks,
    find_block_lists,
    model_blocks,
    pipeline_blocks,
)
from residency.core.errors import ConfigError

from _tiny_pipelines import _sd_unet, tiny_flux, tiny_wan22, tiny_wan_expert

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """A stand-in with the shape of vLLM-Omni 0.30's ``offloader/offload_plan.py`` dataclass."""

    on_demand_component_paths: frozenset[str] = dataclasses.field(default_factory=frozenset)
    block_attrs: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    offload_submodules: dict[str, str] = dataclasses.field(default_factory=dict)
    resident_dit_paths: frozenset[str] = dataclasses.field(default_factory=frozenset)
    encoder_component_types: dict[str, str] = dataclasses.field(default_factory=dict)
    encoder_block_attrs: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    encoder_dlo_weight_replication: frozenset[str] = dataclasses.field(default_factory=frozenset)


def wan_expert(num_layers: int = 3):
    """A tiny WanTransformer3DModel as tests/_tiny_pipelines.py builds it, with more layers."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=num_layers,
        rope_max_seq_len=32,
    ).eval()


@pytest.fixture(scope="module")
def flux():
    """A tiny FluxTransformer2DModel as the builder makes it, with 2 double and 3 single blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


@pytest.fixture(scope="module")
def experts():
    torch.manual_seed(0)
    return {"transformer": wan_expert(), "transformer_2": wan_expert()}


def unique_nbytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- small models with declarations ---------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


class Declared(nn.Module):
    """Declares its lists the vLLM-Omni way, in forward order (not registration order)."""

    _layerwise_offload_blocks_attrs = ["stack.late", "early"]

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Module()
        self.stack.late = nn.ModuleList(Layer() for _ in range(2))
        self.early = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(4, 2)


class OldStyle(nn.Module):
    _layerwise_offload_blocks_attr = "layers"  # 0.30's deprecated singular

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


class Repeated(nn.Module):
    """No declaration: one list of repeated blocks, found."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Layer() for _ in range(blocks))


class WithContextEncoder(Repeated):
    """A DiT with a child that has its own block list (an _offload_plan's offload_submodules)."""

    def __init__(self) -> None:
        super().__init__()
        self.context_encoder = nn.Module()
        self.context_encoder.layers = nn.ModuleList(Layer() for _ in range(2))


class Pipeline(nn.Module):
    """A vLLM-Omni-style pipeline: an `_offload_plan` class attribute and its components."""

    _offload_plan = None

    def __init__(self, **components: nn.Module) -> None:
        super().__init__()
        for name, module in components.items():
            setattr(self, name, module)


def pipeline_with(plan: OffloadPlan | None, **components: nn.Module) -> Pipeline:
    kind = type("PlannedPipeline", (Pipeline,), {"_offload_plan": plan})
    return kind(**components)


def undeclared(model: nn.Module) -> nn.Module:
    """`model` rebuilt as a subclass that declares no ``_repeated_blocks``: what finding sees."""
    kind = type(f"Undeclared{type(model).__name__}", (type(model),), {"_repeated_blocks": []})
    return kind.from_config(model.config).eval()


# -- diffusers' _repeated_blocks ------------------------------------------------------------------


def test_flux_streams_the_two_lists_its_repeated_blocks_name_double_then_single(flux):
    plan = model_blocks(flux, path="transformer")
    assert plan.source == "repeated_blocks"
    assert plan.lists == ("transformer_blocks", "single_transformer_blocks")
    assert [b.path for b in plan.streamed] == [
        "transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
        "single_transformer_blocks.1", "single_transformer_blocks.2",
    ]
    assert all(b.module is flux.get_submodule(b.path) for b in plan.blocks)
    assert plan.note == (
        "FluxTransformer2DModel declares _repeated_blocks ['FluxTransformerBlock', "
        "'FluxSingleTransformerBlock'] (diffusers); streaming the lists that hold them: "
        "transformer_blocks (2 x FluxTransformerBlock), single_transformer_blocks "
        "(3 x FluxSingleTransformerBlock)"
    )


def test_a_wan_transformer_whose_two_blocks_hold_under_half_streams_by_its_declaration():
    """Wan's freq_dim 256: the time embedding outweighs 2 blocks, so finding refuses the model;
    its class's ``_repeated_blocks = ["WanTransformerBlock"]`` names the list anyway."""
    model = tiny_wan_expert(num_layers=2, freq_dim=256)
    with pytest.raises(ConfigError, match=r"found only blocks \(2 x WanTransformerBlock\) "
                                          r"holding 49%"):
        find_block_lists(model)
    plan = model_blocks(model, path="transformer")
    assert (plan.source, plan.lists) == ("repeated_blocks", ("blocks",))
    assert [b.module for b in plan.streamed] == list(model.blocks)
    assert plan.note == (
        "WanTransformer3DModel declares _repeated_blocks ['WanTransformerBlock'] (diffusers); "
        "streaming the lists that hold them: blocks (2 x WanTransformerBlock)"
    )
    assert "(repeated_blocks)" in plan.describe() and "note: WanTransformer3DModel declares " \
        "_repeated_blocks" in plan.describe()


def test_the_vllm_omni_class_declaration_wins_over_repeated_blocks():
    model = tiny_wan_expert(num_layers=2)
    kind = type("DeclaredWan", (type(model),), {"_layerwise_offload_blocks_attrs": ["blocks"]})
    plan = model_blocks(kind.from_config(model.config))
    assert plan.source == "class" and plan.note is None


def test_repeated_blocks_spread_over_several_modules_are_not_read_and_a_unet_is_refused():
    """UNet2DConditionModel declares ["BasicTransformerBlock"]: one short list in each attention
    of its down, mid and up blocks, registered in another order than they run."""
    from residency.modules.blocks import repeated_block_lists

    unet = _sd_unet()
    assert type(unet)._repeated_blocks == ["BasicTransformerBlock"]
    assert repeated_block_lists(unet) is None
    with pytest.raises(ConfigError, match="UNet2DConditionModel has no list of repeated blocks"):
        model_blocks(unet, path="unet")


def test_a_repeated_blocks_that_is_not_a_list_of_class_names_is_refused():
    class Odd(Repeated):
        _repeated_blocks = "Block"

    with pytest.raises(ConfigError, match=re.escape(
        "Odd._repeated_blocks is 'Block'; it must be a list of block class names, for example "
        "['WanTransformerBlock']"
    )):
        model_blocks(Odd(blocks=2))


# -- found lists: diffusers DiTs ------------------------------------------------------------------


def test_flux_without_a_declaration_has_its_double_then_single_blocks_found_in_order(flux):
    model = undeclared(flux)
    plan = model_blocks(model, path="transformer")
    assert plan.source == "found"
    assert plan.lists == ("transformer_blocks", "single_transformer_blocks")
    assert [b.path for b in plan.streamed] == [
        "transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
        "single_transformer_blocks.1", "single_transformer_blocks.2",
    ]
    assert all(b.module is model.get_submodule(b.path) for b in plan.blocks)
    assert "found 2 lists of repeated blocks: transformer_blocks (2 x FluxTransformerBlock), " \
           "single_transformer_blocks (3 x FluxSingleTransformerBlock)" in plan.note


def test_sizes_are_unique_bytes_per_block_and_the_rest_is_outside(flux):
    plan = model_blocks(flux, path="transformer", resident_layers=1)
    for block in plan.blocks:
        assert block.nbytes == unique_nbytes(block.module) > 0
    assert plan.nbytes == unique_nbytes(flux)
    assert plan.outside_nbytes == unique_nbytes(flux) - sum(b.nbytes for b in plan.blocks)
    largest = max(plan.streamed, key=lambda b: b.nbytes)
    assert plan.largest_streamed is largest and plan.largest_streamed_nbytes == largest.nbytes
    assert largest.path.startswith("transformer_blocks")  # a double block is the larger
    kept = plan.kept[0].nbytes
    assert plan.device_nbytes() == plan.outside_nbytes + kept + 2 * largest.nbytes


@pytest.mark.parametrize("resident_layers, kept", [(0, 0), (1, 1), (5, 5), (99, 5)])
def test_resident_layers_keeps_the_leading_blocks_and_more_than_all_keeps_all(
    flux, resident_layers, kept
):
    plan = model_blocks(flux, path="transformer", resident_layers=resident_layers)
    assert plan.kept_count == kept and len(plan.streamed) == 5 - kept
    assert [b.path for b in plan.kept] == [b.path for b in plan.blocks[:kept]]
    if resident_layers > 5:
        assert "resident_layers 99 is more than the 5 blocks: all are kept" in plan.note
        assert plan.largest_streamed is None and plan.largest_streamed_nbytes == 0
        assert plan.device_nbytes() == plan.nbytes
    else:
        assert "resident_layers" not in plan.note


def test_describe_gives_source_counts_sizes_and_the_slot(flux):
    text = model_blocks(flux, path="transformer", resident_layers=1).describe()
    assert text.startswith(
        "transformer (FluxTransformer2DModel): 5 blocks in transformer_blocks, "
        "single_transformer_blocks (repeated_blocks); kept 1, streamed 4"
    )
    assert "slot 148.0 KiB (transformer_blocks.1)" in text and "note: " in text


def test_a_unet_has_no_flat_list_of_repeated_blocks_and_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=re.escape(
        "UNet2DConditionModel has no list of repeated blocks to stream (nn.ModuleLists of at "
        "least 2 blocks of one class, in one module, holding at least half its parameter bytes); "
        "found only up_blocks.0.resnets (2 x ResnetBlock2D) holding 29%"
    )) as caught:
        model_blocks(_sd_unet(), path="unet")
    assert "no one module's lists hold half. Declare the block lists on the class " \
           "(_layerwise_offload_blocks_attrs = ['blocks']) or in the pipeline's " \
           "_offload_plan.block_attrs, or offload this model in module mode" in str(caught.value)


def test_a_single_block_list_is_not_found_and_the_message_says_to_declare_it():
    with pytest.raises(ConfigError, match=re.escape(
        "found none (a list of a single block does not count as repeated). Declare the block lists"
    )):
        find_block_lists(Repeated(blocks=1))


def test_one_odd_block_is_allowed_in_a_found_list():
    """SD3's last block is context-only; T5's first carries the relative-attention bias."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=12, d_model=32, d_kv=8, d_ff=37, num_layers=3,
                                 num_heads=4, relative_attention_num_buckets=8))
    plan = model_blocks(t5, path="text_encoder_2")
    assert plan.lists == ("encoder.block",) and len(plan.blocks) == 3
    assert plan.blocks[0].nbytes > plan.blocks[1].nbytes == plan.blocks[2].nbytes


# -- declarations ---------------------------------------------------------------------------------


def test_the_class_declaration_wins_over_finding_and_keeps_its_order():
    model = Declared()
    plan = model_blocks(model, resident_layers=1)
    assert plan.source == "class" and plan.note is None
    assert plan.lists == ("stack.late", "early")
    assert [b.path for b in plan.blocks] == ["stack.late.0", "stack.late.1", "early.0",
                                             "early.1", "early.2"]
    assert [b.path for b in plan.kept] == ["stack.late.0"]
    assert plan.outside_nbytes == unique_nbytes(model.head)


def test_the_deprecated_singular_declaration_is_read():
    plan = model_blocks(OldStyle())
    assert plan.source == "class" and plan.lists == ("layers",)


def test_a_declared_plan_wins_over_the_class_declaration():
    plan = model_blocks(Declared(), path="transformer", declared=("early",))
    assert plan.source == "offload_plan" and plan.lists == ("early",)
    assert plan.outside_nbytes == unique_nbytes(Declared().stack) + unique_nbytes(Declared().head)


# -- a pipeline's _offload_plan -------------------------------------------------------------------


def test_wan22_plan_keeps_blocks_of_the_resident_dit_paths_only(experts):
    plan = OffloadPlan(block_attrs={"transformer": ("blocks",), "transformer_2": ("blocks",)},
                       resident_dit_paths=frozenset({"transformer"}))
    blocks = pipeline_blocks(pipeline_with(plan, **experts), experts, resident_layers=2)
    assert blocks.keeping == ("transformer",)
    first, second = blocks.dits["transformer"], blocks.dits["transformer_2"]
    assert first.source == second.source == "offload_plan"
    assert (first.kept_count, len(first.streamed)) == (2, 1)
    assert (second.kept_count, len(second.streamed)) == (0, 3)
    assert "transformer_2 (WanTransformer3DModel): 3 blocks in blocks (offload_plan)" \
        in blocks.describe()


def test_without_resident_dit_paths_every_dit_keeps_its_leading_blocks(experts):
    """An extension: vLLM-Omni 0.30 refuses resident_layers without resident_dit_paths."""
    blocks = pipeline_blocks(Pipeline(**experts), experts, resident_layers=1)
    assert blocks.keeping == ("transformer", "transformer_2")
    assert [p.kept_count for p in blocks.dits.values()] == [1, 1]
    assert all(p.source == "repeated_blocks" for p in blocks.dits.values())


def test_the_tiny_wan22_pipeline_streams_its_one_block_experts_by_their_declaration():
    """A list of one block is not found (nothing repeats), but ``_repeated_blocks`` names it."""
    pipe = tiny_wan22()
    dits = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    with pytest.raises(ConfigError, match="WanTransformer3DModel has no list of repeated blocks"):
        find_block_lists(pipe.transformer)
    blocks = pipeline_blocks(pipe, dits)
    assert [(p.source, len(p.streamed)) for p in blocks.dits.values()] == [
        ("repeated_blocks", 1), ("repeated_blocks", 1)]
    plan = OffloadPlan(block_attrs={"transformer": ["blocks"], "transformer_2": ["blocks"]})
    blocks = pipeline_blocks(pipeline_with(plan, **dits), dits, resident_layers=0)
    assert [(p.source, len(p.streamed)) for p in blocks.dits.values()] == [
        ("offload_plan", 1), ("offload_plan", 1)]


def test_encoders_stream_where_declared_or_found_and_are_swapped_whole_otherwise(flux):
    pipe = tiny_flux()  # CLIP and T5 of one layer each: nothing repeats
    encoders = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    plan = OffloadPlan(encoder_block_attrs={"text_encoder": ("text_model.encoder.layers",)})
    if not hasattr(pipe.text_encoder, "text_model"):  # transformers 5 flattened CLIPTextModel
        plan = OffloadPlan(encoder_block_attrs={"text_encoder": ("encoder.layers",)})
    blocks = pipeline_blocks(pipeline_with(plan), {"transformer": flux}, encoders)
    assert list(blocks.encoders) == ["text_encoder"]
    assert blocks.encoders["text_encoder"].source == "offload_plan"
    assert blocks.whole["text_encoder_2"].startswith(
        "no repeated blocks found: T5EncoderModel has no list of repeated blocks"
    )
    assert "text_encoder_2: swapped whole (no repeated blocks found" in blocks.describe()


def test_an_on_demand_encoder_is_swapped_whole_even_with_declared_blocks(flux):
    encoder = Repeated()
    plan = OffloadPlan(on_demand_component_paths=frozenset({"text_encoder"}),
                       encoder_block_attrs={"text_encoder": ("blocks",)})
    blocks = pipeline_blocks(pipeline_with(plan), {"transformer": flux},
                                  {"text_encoder": encoder})
    assert blocks.whole == {"text_encoder": "on demand in the pipeline's _offload_plan"}
    assert blocks.encoders == {}


def test_a_found_encoder_streams_and_keeps_no_blocks(flux):
    blocks = pipeline_blocks(Pipeline(), {"transformer": flux},
                                  {"text_encoder": Repeated()}, resident_layers=2)
    assert blocks.encoders["text_encoder"].kept_count == 0
    assert blocks.dits["transformer"].kept_count == 2


def test_offload_submodules_stream_after_the_dits_own_blocks_and_are_never_kept():
    dit = WithContextEncoder()
    plan = OffloadPlan(offload_submodules={"context_encoder": "layers", "absent": "layers"})
    blocks = pipeline_blocks(pipeline_with(plan, transformer=dit), {"transformer": dit},
                                  resident_layers=99)
    result = blocks.dits["transformer"]
    assert result.lists == ("blocks", "context_encoder.layers")
    assert (result.own_count, result.kept_count) == (3, 3)
    assert [b.path for b in result.streamed] == ["context_encoder.layers.0",
                                                 "context_encoder.layers.1"]


# -- refusals -------------------------------------------------------------------------------------


def test_a_declared_attribute_that_does_not_resolve_is_refused_with_the_nearest_name():
    with pytest.raises(ConfigError, match=re.escape(
        "transformer: _offload_plan for 'transformer' names 'blokcs', which does not resolve: "
        "Repeated has no attribute 'blokcs'. Did you mean 'blocks'? Fix _offload_plan for "
        "'transformer'"
    )):
        model_blocks(Repeated(), path="transformer", declared=["blokcs"])


def test_a_declared_attribute_that_is_not_a_module_list_is_refused():
    with pytest.raises(ConfigError, match=re.escape(
        "Declared: Declared._layerwise_offload_blocks_attrs names 'head', which is a Linear, not "
        "an nn.ModuleList of blocks; name the ModuleList that holds the repeated blocks"
    )):
        model_blocks(type("Declared", (Declared,), {"_layerwise_offload_blocks_attrs": ["head"]})())


def test_an_empty_declared_list_is_refused():
    model = Repeated()
    model.blocks = nn.ModuleList()
    with pytest.raises(ConfigError, match=re.escape(
        "names 'blocks', an empty ModuleList; name a list that holds the blocks, or remove it"
    )):
        model_blocks(model, declared=("blocks",))


@pytest.mark.parametrize("declared", ["blocks", {"blocks": 1}, 3])
def test_a_declaration_that_is_not_a_list_of_names_is_refused(declared):
    kind = type("Odd", (Repeated,), {"_layerwise_offload_blocks_attrs": declared})
    with pytest.raises(ConfigError, match=re.escape(
        f"Odd: Odd._layerwise_offload_blocks_attrs is {declared!r}; it must be a list of dotted "
        "attribute names, for example ['transformer_blocks', 'single_transformer_blocks']"
    )):
        model_blocks(kind())


def test_a_dotted_attribute_must_be_a_dotted_name():
    with pytest.raises(ConfigError, match=re.escape(
        "names 'blocks..0', which is not a dotted attribute; write attribute names joined by dots"
    )):
        model_blocks(Repeated(), declared=["blocks..0"])


def test_a_block_list_declared_twice_is_refused():
    with pytest.raises(ConfigError, match=re.escape(
        "gives one block twice, as 'blocks.0' and 'blocks.0'; list each block list once"
    )):
        model_blocks(Repeated(), declared=["blocks", "blocks"])


def test_a_list_inside_a_block_is_refused():
    model = Repeated()
    model.blocks[0].inner = nn.ModuleList([Layer(), Layer()])
    with pytest.raises(ConfigError, match=re.escape(
        "gives the block 'blocks.0.inner.0', which sits inside the block 'blocks.0'; declare "
        "only the outer list of blocks"
    )):
        model_blocks(model, declared=["blocks", "blocks.0.inner"])


def test_a_weight_tied_across_two_blocks_is_refused_naming_both_tensors():
    model = Repeated()
    model.blocks[2].proj.weight = model.blocks[0].proj.weight
    with pytest.raises(ConfigError, match=re.escape(
        "transformer: 'blocks.2.proj.weight' (in block 'blocks.2') shares its bytes with "
        "'blocks.0.proj.weight' (in block 'blocks.0'); tied weights across blocks cannot stream "
        "separately. Untie them (clone one), or declare block lists that keep both tensors in "
        "one block or both outside the blocks"
    )):
        model_blocks(model, path="transformer", declared=["blocks"])


def test_a_block_viewing_bytes_of_the_outside_is_refused():
    model = Repeated()
    with torch.no_grad():
        model.blocks[1].proj.bias = nn.Parameter(model.embed.weight.view(-1)[2:6])
    with pytest.raises(ConfigError, match=re.escape(
        "'blocks.1.proj.bias' (in block 'blocks.1') shares its bytes with 'embed.weight' "
        "(outside the blocks)"
    )):
        model_blocks(model, declared=["blocks"])


def test_a_submodule_shared_by_a_block_and_the_outside_is_refused():
    model = Repeated()
    model.shared = model.blocks[0].proj
    with pytest.raises(ConfigError, match="shares its bytes with 'blocks.0.proj.weight'"):
        model_blocks(model, declared=["blocks"])


def test_disjoint_views_of_one_storage_are_separate_and_counted_by_their_spans():
    model = Repeated(blocks=2)
    flat = torch.zeros(64)
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            block.proj.weight = nn.Parameter(flat[16 * index: 16 * index + 16].view(4, 4))
    plan = model_blocks(model, declared=["blocks"])
    assert [b.nbytes for b in plan.blocks] == [(16 + 4) * 4] * 2


def test_resident_dit_paths_that_name_no_dit_are_refused_when_blocks_are_to_be_kept(experts):
    plan = OffloadPlan(resident_dit_paths=frozenset({"dit"}))
    pipe = pipeline_with(plan, **experts)
    with pytest.raises(ConfigError, match=re.escape(
        "PlannedPipeline: resident_layers is 2, but its _offload_plan's resident_dit_paths "
        "['dit'] names none of its DiTs ['transformer', 'transformer_2']; fix resident_dit_paths, "
        "or set resident_layers to 0"
    )):
        pipeline_blocks(pipe, experts, resident_layers=2)
    assert pipeline_blocks(pipe, experts).keeping == ()


def test_a_plan_field_of_the_wrong_kind_is_refused(flux):
    plan = OffloadPlan(resident_dit_paths="transformer")
    with pytest.raises(ConfigError, match=re.escape(
        "PlannedPipeline._offload_plan.resident_dit_paths is 'transformer'; it must be a set of "
        "paths, as in vLLM-Omni's OffloadPlan"
    )):
        pipeline_blocks(pipeline_with(plan), {"transformer": flux}, resident_layers=1)


def test_block_attrs_given_as_a_string_are_refused(flux):
    plan = OffloadPlan(block_attrs={"transformer": "transformer_blocks"})
    with pytest.raises(ConfigError, match=re.escape(
        "transformer: _offload_plan.block_attrs['transformer'] is 'transformer_blocks'; it must "
        "be a list of dotted attribute names"
    )):
        pipeline_blocks(pipeline_with(plan), {"transformer": flux})


def test_two_models_claiming_one_block_are_refused():
    model = Repeated()
    holder = nn.Module()
    holder.layers = model.blocks
    with pytest.raises(ConfigError, match=re.escape(
        "Pipeline: the block text_encoder.layers.0 is also transformer.blocks.0; declare one "
        "owner for each block list"
    )):
        pipeline_blocks(Pipeline(), {"transformer": model},
                             {"text_encoder": holder})


def test_a_negative_resident_layers_is_refused():
    with pytest.raises(ConfigError, match=re.escape(
        "transformer: resident_layers is -1; give a whole number of at least 0"
    )):
        model_blocks(Repeated(), path="transformer", resident_layers=-1)


def test_a_block_plan_validates_itself():
    model = Repeated()
    block = Block(path="blocks.0", module=model.blocks[0], nbytes=80)
    with pytest.raises(ConfigError, match=re.escape(
        "a ModelBlocks for 'x' keeps 2 of 1 own blocks (1 in all); keep between 0 and 1"
    )):
        ModelBlocks(model_path="x", model=model, source="found", lists=["blocks"], blocks=[block],
                  own_count=1, kept_count=2, outside_nbytes=0)
    with pytest.raises(ConfigError, match="ModelBlocks source 'guess'"):
        ModelBlocks(model_path="x", model=model, source="guess", lists=["blocks"], blocks=[block],
                  own_count=1, kept_count=0, outside_nbytes=0)


# -- meta tensors and purity ----------------------------------------------------------------------


def test_meta_models_are_planned_from_tensor_metadata():
    with torch.device("meta"):
        model = Repeated()
    plan = model_blocks(model)
    assert [b.nbytes for b in plan.blocks] == [(16 + 4) * 4] * 3


def _snapshot(*roots: nn.Module) -> list:
    state = []
    for root in roots:
        for module in root.modules():
            tables = (module._parameters, module._buffers)
            state.append((id(module), sorted(module.__dict__), sorted(vars(type(module))),
                          [(k, id(t), t.data_ptr(), t.device, t._version)
                           for table in tables for k, t in table.items() if t is not None]))
    return state


def test_planning_moves_no_tensor_and_sets_no_attribute(experts):
    dit = WithContextEncoder()
    encoder = Declared()
    plan = OffloadPlan(block_attrs={"transformer": ("blocks",)},
                       offload_submodules={"context_encoder": "layers"},
                       resident_dit_paths=frozenset({"transformer"}))
    pipe = pipeline_with(plan, transformer=dit, transformer_2=experts["transformer_2"],
                         text_encoder=encoder)
    before = _snapshot(pipe)
    pipeline_dict = sorted(pipe.__dict__)
    pipeline_blocks(pipe, {"transformer": dit, "transformer_2": experts["transformer_2"]},
                         {"text_encoder": encoder}, resident_layers=1)
    assert _snapshot(pipe) == before and sorted(pipe.__dict__) == pipeline_dict


def test_block_lists_and_pipeline_components_resolve_by_one_walk():
    """`follow_path` is the one dotted-path walk: model_blocks and discovery both ask it, so a
    block list behind a plain attribute and a misspelt name read the same in both."""
    from residency.modules.blocks import did_you_mean, follow_path
    from residency.pipelines.discovery import resolve_path

    model = Repeated()
    holder = type("Holder", (), {})()
    holder.stack = model.blocks
    model.__dict__["holder"] = holder  # a plain object attribute, not a child module
    assert follow_path(model, "holder.stack") == (model.blocks, "holder.stack", None)
    assert follow_path(model, "holder.stakc") == (holder, "holder", "stakc")
    assert did_you_mean(holder, "stakc") == " Did you mean 'stack'?"
    assert [b.path for b in model_blocks(model, declared=["holder.stack"]).blocks][:1] == [
        "holder.stack.0"]
    with pytest.raises(ConfigError, match=re.escape(
        "names 'holder.stakc', which does not resolve: Holder has no attribute 'stakc'. Did you "
        "mean 'stack'?")):
        model_blocks(model, declared=["holder.stakc"])
    with pytest.raises(ConfigError, match=re.escape(
        "lists 'holder.stakc', which does not resolve: Holder at 'holder' has no attribute "
        "'stakc'. Did you mean 'stack'?")):
        resolve_path("Owner", model, "holder.stakc", listed_in="_dit_modules")


def test_plan_means_one_thing_the_old_names_of_other_things_are_gone():
    """"plan" means where a group's parts are during phases (docs/design.md's glossary); the
    names that used the word for blocks and discovered groups were renamed, and the old ones
    removed."""
    import residency
    from residency.modules import blocks
    from residency.pipelines import discovery

    for gone in ("plan_blocks", "BlockPlan", "ComponentPlan", "plan_components", "apply_plan"):
        assert not hasattr(residency, gone) and not hasattr(blocks, gone)
        assert not hasattr(discovery, gone)
    assert residency.model_blocks(Repeated(), declared=["blocks"]).lists == ("blocks",)
