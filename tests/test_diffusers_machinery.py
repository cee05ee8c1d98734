"""The adapter composes with diffusers' per-module machinery, in either order, bit-identically.

Caches (FirstBlockCache, PyramidAttentionBroadcast), layerwise casting, attention backends, fused
QKV projections and ``compile`` of the denoiser, on a tiny Flux; `disable_offload` leaves the
pipeline as the machinery left it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from _tiny_pipelines import first_block_cache, flux_call, pyramid_attention_broadcast, tiny_flux
from residency.adapters.diffusers import disable_offload, enable_offload


def layerwise_casting(pipe):
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.bfloat16,
                                              compute_dtype=torch.float32)


def attention_backend(pipe):
    pipe.transformer.set_attention_backend("native")


def fused_qkv(pipe):
    pipe.transformer.fuse_qkv_projections()


def compiled(pipe):
    pipe.transformer.compile(backend="eager", dynamic=False)


MACHINERY = {"first_block_cache": first_block_cache,
             "pyramid_attention_broadcast": pyramid_attention_broadcast,
             "layerwise_casting": layerwise_casting, "attention_backend": attention_backend,
             "fused_qkv": fused_qkv, "compile": compiled}


def images(pipe, seed: int) -> torch.Tensor:
    return pipe(**flux_call(seed)).images


def entry_points(pipe) -> dict[str, object]:
    return {f"{name}.{path}.{attribute}": module.__dict__[attribute]
            for name, component in pipe.components.items()
            if isinstance(component, torch.nn.Module)
            for path, module in component.named_modules()
            for attribute in ("forward", "encode", "decode") if attribute in vars(module)}


@pytest.mark.parametrize("machinery", list(MACHINERY))
def test_machinery_first_then_offloading(machinery):
    plain, pipe = tiny_flux(), tiny_flux()
    for each in (plain, pipe):
        MACHINERY[machinery](each)
    before = entry_points(pipe)
    enable_offload(pipe, device="cpu")
    for seed in (0, 1):
        assert torch.equal(images(pipe, seed), images(plain, seed)), seed
    disable_offload(pipe)
    assert entry_points(pipe) == before  # exactly the pipeline as it was
    assert torch.equal(images(pipe, 2), images(plain, 2))


@pytest.mark.parametrize("machinery", list(MACHINERY))
def test_offloading_first_then_machinery(machinery):
    plain, pipe = tiny_flux(), tiny_flux()
    enable_offload(pipe, device="cpu")
    for each in (plain, pipe):
        MACHINERY[machinery](each)
    for seed in (0, 1):
        assert torch.equal(images(pipe, seed), images(plain, seed)), seed
    disable_offload(pipe)
    assert torch.equal(images(pipe, 2), images(plain, 2))
