"""All-gather from the config, next to diffusers' rank-local caches (issue 15).

A config that all-gathers a component (``module_options``, or ``layer_options`` in layer mode) makes
every load of it a collective, so a diffusers cache, which decides on each rank alone what to skip,
is refused by `enable_offload` up front, naming the cache, the component and the config field
([Note: caches and all-gather] in residency/adapters/diffusers.py); enabled after offloading, it is refused
at the next phase change on every rank that enabled it.  A skip nothing can see ends in the
scheduler's `CollectiveError` on every rank, never a hang: 2 gloo ranks, one of which skips a phase.
Tiny real diffusers pipelines built in code (tests/_tiny_pipelines.py); no downloads.
"""

from __future__ import annotations

import importlib
import os
import time

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from _dist import run_world
from _tiny_pipelines import (
    faster_cache,
    first_block_cache,
    flux_call,
    pyramid_attention_broadcast,
    tiny_flux,
    tiny_wan22,
)
from residency.adapters.diffusers import (
    CACHE_HOOKS,
    disable_offload,
    enable_offload,
    offload_scheduler,
)
from residency.core.errors import ConfigError

DIT_ALLGATHER = {"mode": "module", "components": ["dit", "text_encoder"],
                 "module_options": {"dit": {"weight_transfer": "allgather"}}}
LAYER_ALLGATHER = {"mode": "layer", "components": ["dit"],
                   "layer_options": {"dit": {"weight_transfer": "allgather"}}}


def first_block_cache_by_hand(pipe):
    """The cache's hooks applied directly: no ``_cache_config`` on the transformer."""
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import apply_first_block_cache

    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=0.2))
    assert "_cache_config" not in vars(pipe.transformer)


CACHES = {
    "FirstBlockCache": (tiny_flux, first_block_cache),
    "PyramidAttentionBroadcast": (tiny_flux, pyramid_attention_broadcast),
    "FasterCache": (tiny_wan22, faster_cache),
}


def state(pipe) -> dict:
    """Every instance attribute of every module (by id) and where each tensor's bytes are."""
    modules = {f"{name}.{path}": module for name, component in pipe.components.items()
               if isinstance(component, nn.Module) for path, module in component.named_modules()}
    return {
        "attributes": {path: {k: id(v) for k, v in vars(m).items()} for path, m in modules.items()},
        "tensors": {path: [t.data_ptr() for t in (*m.parameters(False), *m.buffers(False))]
                    for path, m in modules.items()},
    }


# -- refused up front -----------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("config", [DIT_ALLGATHER, LAYER_ALLGATHER], ids=["module", "layer"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_a_cache_with_allgather_is_refused_up_front_and_nothing_changes(cache, config):
    build, enable = CACHES[cache]
    pipe = build()
    enable(pipe)
    before = state(pipe)
    field = "module_options" if config["mode"] == "module" else "layer_options"
    owner = type(pipe).__name__
    with pytest.raises(ConfigError, match=(
        rf"^{owner}: component 'transformer' has diffusers' {cache}, a rank-local cache, and the "
        rf"offload config all-gathers \['dit'\] \({field}: weight_transfer 'allgather'\)\. Such a "
        r"cache decides on each rank alone which blocks or calls to skip, so the ranks could "
        r"skip different loads and their all-gathers would no longer pair \(vLLM-Omni 0\.30 "
        r"refuses a cache_backend with all-gather for the same reason\)\. Disable the cache "
        r"first \(pipe\.transformer\.disable_cache\(\)\), or give \['dit'\] weight_transfer "
        r"'rank-local'$")):
        enable_offload(pipe, config, device="cpu")
    assert offload_scheduler(pipe) is None
    assert state(pipe) == before


@pytest.mark.fast
def test_a_cache_applied_by_hand_is_found_in_the_hook_registries():
    pipe = tiny_flux()
    first_block_cache_by_hand(pipe)
    with pytest.raises(ConfigError, match=r"component 'transformer' has diffusers' "
                                          r"FirstBlockCache, a rank-local cache"):
        enable_offload(pipe, DIT_ALLGATHER, device="cpu")
    assert offload_scheduler(pipe) is None


@pytest.mark.fast
def test_a_cache_on_a_component_that_is_not_all_gathered_is_refused_too():
    """Skipping a call of the DiT skips a phase: the all-gathered encoder's next load moves."""
    pipe = tiny_flux()
    first_block_cache(pipe)
    config = {"mode": "module", "components": ["dit", "text_encoder"],
              "module_options": {"text_encoder": {"weight_transfer": "allgather"}}}
    with pytest.raises(ConfigError, match=r"component 'transformer' has diffusers' "
                                          r"FirstBlockCache, .* all-gathers \['text_encoder'\] "
                                          r"\(module_options: weight_transfer 'allgather'\)"):
        enable_offload(pipe, config, device="cpu")


@pytest.mark.fast
def test_a_cache_with_rank_local_transfers_is_accepted():
    plain, pipe = tiny_flux(), tiny_flux()
    for each in (plain, pipe):
        first_block_cache(each)
    config = {"mode": "module", "components": ["dit", "text_encoder"],
              "module_options": {"dit": {"weight_transfer": "rank-local"}}}
    enable_offload(pipe, config, device="cpu")
    assert torch.equal(pipe(**flux_call(0)).images, plain(**flux_call(0)).images)
    disable_offload(pipe)


@pytest.mark.fast
def test_the_cache_hooks_are_those_of_the_installed_diffusers():
    """`CACHE_HOOKS` lists every hook name diffusers' cache modules register, each with its cache
    (whose config class is ``<cache>Config``)."""
    import diffusers.hooks

    modules = ["faster_cache", "first_block_cache", "mag_cache", "pyramid_attention_broadcast",
               "sea_cache", "taylorseer_cache", "text_kv_cache"]
    found = {}
    for name in modules:
        module = importlib.import_module(f"diffusers.hooks.{name}")
        for constant, value in vars(module).items():
            if constant.startswith("_") and constant.endswith("_HOOK") and isinstance(value, str):
                found[value] = name
    assert set(found) == set(CACHE_HOOKS), set(found) ^ set(CACHE_HOOKS)
    for hook, cache in CACHE_HOOKS.items():
        assert hasattr(diffusers.hooks, f"{cache}Config"), cache
        assert found[hook].replace("_", "") == cache.lower(), (hook, cache)


# -- two ranks ------------------------------------------------------------------------------------


def _outcome(call) -> dict:
    """What `call` returned (its repr) or raised, and how long it took."""
    started = time.monotonic()
    try:
        return {"value": repr(call()), "seconds": time.monotonic() - started}
    except Exception as error:  # reported to the test, which checks type and message
        return {"raised": type(error).__name__, "message": str(error),
                "seconds": time.monotonic() - started}


def _adapter_worker(rank: int, world_size: int, args) -> dict:
    import sys

    import torch.distributed as dist

    sys.path.insert(0, args["tests"])
    from _tiny_pipelines import flux_call, tiny_flux

    group = dist.group.WORLD
    plain, pipe = tiny_flux(), tiny_flux()
    out = {}
    # Cache first: refused on every rank before any collective, so the ranks stay paired.
    first_block_cache(pipe)
    out["up_front"] = _outcome(lambda: enable_offload(pipe, DIT_ALLGATHER, device="cpu",
                                                      process_group=group))
    dist.barrier()
    pipe.transformer.disable_cache()
    # Offloading first, then the cache: the next phase change is refused, before its load.
    scheduler = enable_offload(pipe, DIT_ALLGATHER, device="cpu", process_group=group)
    first_block_cache(pipe)
    changes = scheduler.transitions.count
    out["afterwards"] = _outcome(lambda: pipe(**flux_call(0)).images)
    out["moved"] = scheduler.transitions.count - changes
    pipe.transformer.disable_cache()
    # Nothing was changed by the refused phase: the ranks go on, paired and bit-identical.
    out["same"] = torch.equal(pipe(**flux_call(1)).images, plain(**flux_call(1)).images)
    disable_offload(pipe)
    return out


def test_a_cache_is_refused_on_every_rank_before_or_after_enabling(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    results = run_world(_adapter_worker, 2, tmp_path, timeout=120, args={"tests": tests})
    for rank, result in enumerate(results):
        assert result is not None and "raised" not in result, (rank, result)
        assert result["up_front"]["raised"] == "ConfigError", result
        assert "has diffusers' FirstBlockCache" in result["up_front"]["message"]
        assert result["afterwards"]["raised"] == "ConfigError", result
        message = result["afterwards"]["message"]
        assert "FluxPipeline: component 'transformer' has diffusers' FirstBlockCache" in message
        assert ("It was enabled after enable_offload, so this phase is refused before its load, "
                "on this rank. Disable the cache (pipe.transformer.disable_cache()), or "
                "disable_offload(pipe) and enable offloading again with weight_transfer "
                "'rank-local'") in message
        assert result["moved"] == 0, result  # refused before any load
        assert result["same"], result


def _model(seed: int) -> nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def _skip_worker(rank: int, world_size: int, args) -> dict:
    """A pipeline loop over two prompts; on rank 1 a rank-local cache skips the second DiT call."""
    import torch.distributed as dist

    from residency import CollectiveError, Scheduler

    scheduler = Scheduler("cpu", process_group=dist.group.WORLD)
    models = {name: _model(seed) for seed, name in enumerate(["text_encoder", "dit", "vae"])}
    for name, model in models.items():
        scheduler.add(name, model, weight_transfer="allgather")
    x = torch.ones(2, 64)
    entered = []
    started = time.monotonic()
    try:
        for prompt in range(2):
            for name in models:
                if name == "dit" and prompt == 1 and rank == 1:
                    continue  # the cache hit: this rank skips the phase
                with scheduler.resident(name):
                    x = models[name](x)
                entered.append(name)
    except CollectiveError as error:
        return {"raised": "CollectiveError", "message": str(error), "entered": entered,
                "seconds": time.monotonic() - started}
    return {"entered": entered}


def test_a_rank_that_skips_an_all_gathered_phase_makes_every_rank_raise(tmp_path):
    results = run_world(_skip_worker, 2, tmp_path, timeout=60)
    for rank, result in enumerate(results):
        assert result is not None and result.get("raised") == "CollectiveError", (rank, result)
        assert result["entered"] == ["text_encoder", "dit", "vae", "text_encoder"], result
        assert result["seconds"] < 10, result  # at once, not after a timeout
        message = result["message"]
        assert ("the ranks diverged: they asked for different collective steps (global rank: "
                "what it asked for) {0: \"phase #4: enter 'dit'\", 1: \"phase #4: enter "
                "'vae'\"}") in message, message
        assert "FirstBlockCache" in message and "Every rank raised this error" in message


@pytest.mark.fast
def test_allgather_without_a_process_group_is_refused_before_anything_moves():
    """Up front, not after the groups before the first all-gathered one were packed."""
    from residency import ConfigError
    from residency.adapters.diffusers import enable_offload

    pipe = tiny_flux()
    before = {name: [t.data_ptr() for t in module.state_dict(keep_vars=True).values()]
              for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    config = {"mode": "module", "components": ["dit", "text_encoder"],
              "module_options": {"text_encoder": {"weight_transfer": "allgather"}}}
    with pytest.raises(ConfigError, match=r"^FluxPipeline: the offload config gives "
                                          r"\['text_encoder'\] weight_transfer 'allgather', which "
                                          r"splits each copy among the ranks of a node, and no "
                                          r"process_group was given; pass process_group="):
        enable_offload(pipe, config, device="cpu")
    after = {name: [t.data_ptr() for t in module.state_dict(keep_vars=True).values()]
             for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    assert after == before
