"""One module, one scheduler (issue 11; [Note: the one process-wide map] in residency/group/registry.py).

A module registered with one open scheduler is refused by every other - by ``add``, by
``Scheduler.from_pipeline`` and by the diffusers adapter - with the owner named, and the refusal
changes nothing: the weights, where they live, the first scheduler's groups.  Closing the first
scheduler, removing the group, or dropping the scheduler unclosed frees the module.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from residency import HostMemoryError, RegistrationError, Scheduler
from residency.group.registry import owner_of
from residency.app.synthetic import SyntheticWan22
from residency.modules.tensors import data_ptrs

from conftest import make_block, run_block, twin

#: The refusal of a module another scheduler owns, for group `name` and owner group `owner`.
ANOTHER = (
    r"cannot add group '{name}': its {kind} module already belongs to group '{owner}' of another "
    r"scheduler \(<Scheduler on cpu>\)\. A module belongs to one group of one scheduler; remove it "
    r"from '{owner}' or close that scheduler"
)


#: Module mode with the default components (the DiTs and the text encoder exclusive).
MODULE_MODE = {"mode": "module", "components": ["dit", "text_encoder"]}


def another(name: str, owner: str, kind: str = "Sequential") -> str:
    return ANOTHER.format(name=name, owner=owner, kind=kind)


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def fingerprint(module: nn.Module) -> tuple[list[int], list[torch.Tensor]]:
    """Where each tensor lives and what it holds."""
    tensors = tensors_of(module)
    return data_ptrs(tensors), [t.detach().clone() for t in tensors]


def assert_unchanged(module: nn.Module, before) -> None:
    pointers, values = fingerprint(module)
    assert pointers == before[0], "a refused call moved the module's tensors"
    assert all(torch.equal(a, b) for a, b in zip(values, before[1])), "a refused call changed weights"


@pytest.fixture
def first():
    """An open scheduler owning `block` (group 'a', offloaded) and `shared` (group 'r', resident)."""
    scheduler = Scheduler("cpu")
    block, shared = make_block(16, seed=1), make_block(16, seed=2)
    plain = {"a": twin(block), "r": twin(shared)}
    scheduler.add("a", block)
    scheduler.add("r", shared, policy="resident")
    yield scheduler, {"a": block, "r": shared}, plain
    scheduler.close()


@pytest.fixture
def second():
    scheduler = Scheduler("cpu")
    yield scheduler
    scheduler.close()


def assert_first_still_works(first) -> None:
    scheduler, modules, plain = first
    x = torch.randn(3, 16)
    for name in ("a", "r"):
        with scheduler.resident(name), torch.no_grad():
            assert torch.equal(run_block(modules[name], x), run_block(plain[name], x))


# -- add --------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("group", ["a", "r"], ids=["exclusive", "resident-policy"])
def test_a_module_of_another_open_scheduler_is_refused_with_the_owner_named(first, second, group):
    scheduler, modules, _ = first
    module = modules[group]
    before = fingerprint(module)
    with pytest.raises(RegistrationError, match=another("x", group)):
        second.add("x", module)
    assert_unchanged(module, before)
    assert len(second) == 0 and "x" not in second and second.device_nbytes == 0
    assert second.transitions.count == 0
    assert owner_of(module) == (scheduler._registry, group)
    # the refusal left no claim behind: the name is free, another module can take it
    second.add("x", make_block(16, seed=9))
    assert list(second) == ["x"]
    assert_first_still_works(first)


@pytest.mark.fast
def test_a_module_of_another_scheduler_is_refused_while_resident_there_too(first, second):
    scheduler, modules, _ = first
    with scheduler.resident("a"):
        before = fingerprint(modules["a"])
        with pytest.raises(RegistrationError, match=another("x", "a")):
            second.add("x", modules["a"])
        assert_unchanged(modules["a"], before)
        assert scheduler["a"].is_resident
    assert_first_still_works(first)


@pytest.mark.fast
@pytest.mark.parametrize("part", ["submodule", "parent", "among others"])
def test_a_submodule_or_a_parent_of_an_owned_module_is_refused(first, second, part):
    _, modules, _ = first
    block = modules["a"]
    free = make_block(16, seed=7)
    module, kind = {
        "submodule": (block[0], "Linear"),
        "parent": (nn.Sequential(free, block), "Sequential"),
        "among others": ([free, block], "Sequential"),
    }[part]
    before, free_before = fingerprint(block), fingerprint(free)
    with pytest.raises(RegistrationError, match=another("x", "a", kind)):
        second.add("x", module)
    assert_unchanged(block, before)
    assert_unchanged(free, free_before)  # the free module of a refused group is not taken either
    assert owner_of(free) is None and len(second) == 0
    second.add("free", free)


@pytest.mark.fast
def test_the_same_scheduler_names_no_other_scheduler(first):
    scheduler, modules, _ = first
    with pytest.raises(RegistrationError, match="already belongs to group 'a'") as refused:
        scheduler.add("again", modules["a"])
    assert "another scheduler" not in str(refused.value)
    assert "close that scheduler" not in str(refused.value)


# -- what frees a module ----------------------------------------------------------------------------


@pytest.mark.fast
def test_after_the_owner_is_closed_the_module_can_be_added(first, second):
    scheduler, modules, plain = first
    with pytest.raises(RegistrationError, match="another scheduler"):
        second.add("x", modules["a"])
    scheduler.close()
    assert owner_of(modules["a"]) is None
    second.add("x", modules["a"])
    assert owner_of(modules["a"]) == (second._registry, "x")
    x = torch.randn(2, 16)
    with second.resident("x"), torch.no_grad():
        assert torch.equal(run_block(modules["a"], x), run_block(plain["a"], x))
    with pytest.raises(RegistrationError, match=another("y", "x")):
        Scheduler("cpu").add("y", modules["a"])  # now the second one owns it


@pytest.mark.fast
def test_after_the_group_is_removed_the_module_can_be_added(first, second):
    scheduler, modules, _ = first
    scheduler.remove("a")
    assert owner_of(modules["a"]) is None
    second.add("x", modules["a"])
    with pytest.raises(RegistrationError, match=another("y", "r")):
        second.add("y", modules["r"])  # the other group stays owned


@pytest.mark.fast
def test_a_refresh_keeps_the_module_owned(first, second):
    scheduler, modules, _ = first
    scheduler.refresh("a")
    assert owner_of(modules["a"]) == (scheduler._registry, "a")
    with pytest.raises(RegistrationError, match=another("x", "a")):
        second.add("x", modules["a"])


def test_a_scheduler_dropped_without_close_frees_its_modules(second):
    block, plain = make_block(16, seed=3), None
    plain = twin(block)
    dropped = Scheduler("cpu")
    dropped.add("a", block)
    with dropped.resident("a"):
        pass
    registry = weakref.ref(dropped._registry)
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None, "a scheduler without close() is kept alive by something"
    assert registry() is None
    assert owner_of(block) is None
    second.add("x", block)
    x = torch.randn(2, 16)
    with second.resident("x"), torch.no_grad():
        assert torch.equal(run_block(block, x), run_block(plain, x))


@pytest.mark.fast
def test_a_failed_add_gives_its_modules_back(second, monkeypatch):
    block = make_block(16, seed=4)

    def no_memory(*args, **kwargs):
        raise MemoryError("no host memory (test)")

    monkeypatch.setattr("residency.host.memory.HostMaster.pack", no_memory)
    with pytest.raises(HostMemoryError):
        second.add("a", block)
    assert owner_of(block) is None and len(second) == 0
    monkeypatch.undo()
    other = Scheduler("cpu")
    other.add("a", block)  # nobody holds it
    other.close()


def test_the_map_keeps_no_module_alive(second):
    block = make_block(16, seed=5)
    second.add("a", block)
    second.remove("a")
    module = weakref.ref(block)
    del block
    gc.collect()
    assert module() is None


# -- two schedulers at once -------------------------------------------------------------------------


@pytest.mark.fast
def test_two_schedulers_adding_one_module_at_once_one_wins(monkeypatch):
    """Force the race: both schedulers' checks pass before either claims (a barrier after the
    check).  Exactly one may register the module."""
    import residency.group.registry as registry_module

    block = make_block(16, seed=6)
    barrier = threading.Barrier(2, timeout=10)
    check = registry_module.Registry.check_claimable

    def check_then_wait(self, *args, **kwargs):
        check(self, *args, **kwargs)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass  # the other thread was refused first: no race to force

    monkeypatch.setattr(registry_module.Registry, "check_claimable", check_then_wait)
    schedulers = [Scheduler("cpu"), Scheduler("cpu")]
    outcomes: list[object] = [None, None]

    def add(index: int):
        try:
            schedulers[index].add("a", block)
            outcomes[index] = "added"
        except RegistrationError as error:
            outcomes[index] = error

    threads = [threading.Thread(target=add, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    try:
        assert sorted(map(str, outcomes)).count("added") == 1, outcomes
    finally:
        for scheduler in schedulers:
            scheduler.close()


# -- from_pipeline and the diffusers adapter ---------------------------------------------------------


@pytest.mark.fast
def test_from_pipeline_refuses_a_pipeline_whose_module_another_scheduler_owns(second):
    pipe = SyntheticWan22.build("tiny")
    second.add("mine", pipe.transformer_2)
    before = [t.detach().clone() for t in tensors_of(pipe)]
    refused = (r"SyntheticWan22: the DiT at 'transformer_2' already belongs to group 'mine' of "
               r"another scheduler \(<Scheduler on cpu>\)\. A module belongs to one scheduler; "
               r"close that scheduler \(or disable its offloading\) first")
    with pytest.raises(RegistrationError, match=refused):
        Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(pipe), before))
    # nothing of the refused plan stays owned: a group registered before the refusal was removed
    for name in ("text_encoder", "transformer", "vae"):
        assert owner_of(getattr(pipe, name)) is None, name
    second.remove("mine")
    scheduler = Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    with pytest.raises(RegistrationError, match="another scheduler"):
        Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    scheduler.close()


@pytest.mark.fast
def test_the_diffusers_adapter_refuses_a_component_another_scheduler_owns(second):
    pytest.importorskip("diffusers")
    from residency.adapters.diffusers import disable_offload, enable_offload

    from _tiny_pipelines import tiny_flux

    pipe = tiny_flux()
    second.add("mine", pipe.transformer)
    before = fingerprint(pipe.transformer)
    with pytest.raises(RegistrationError, match="another scheduler"):
        enable_offload(pipe, device="cpu")
    assert_unchanged(pipe.transformer, before)
    assert owner_of(pipe.text_encoder) is None and owner_of(pipe.vae) is None
    second.remove("mine")
    scheduler = enable_offload(pipe, device="cpu")
    assert owner_of(pipe.transformer)[0] is scheduler._registry
    disable_offload(pipe)
    assert owner_of(pipe.transformer) is None


def _refused_plan(how: str):
    """A pipeline whose last-registered component another scheduler owns, and the call."""
    if how == "from_pipeline":
        pipe = SyntheticWan22.build("tiny")
        owned = pipe.transformer_2
        return pipe, owned, lambda: Scheduler.from_pipeline(pipe, MODULE_MODE, device="cpu")
    pytest.importorskip("diffusers")
    from residency.adapters.diffusers import enable_offload

    from _tiny_pipelines import tiny_wan22

    pipe = tiny_wan22()
    return pipe, pipe.transformer_2, lambda: enable_offload(pipe, device="cpu")


@pytest.mark.fast
@pytest.mark.parametrize("how", ["from_pipeline", "enable_offload"])
def test_a_plan_refused_for_another_schedulers_module_moves_no_tensor(second, how):
    pipe, owned, call = _refused_plan(how)
    second.add("mine", owned)
    components = [m for m in pipe.components.values() if isinstance(m, nn.Module)] if how == (
        "enable_offload"
    ) else [pipe]
    before = [fingerprint(m) for m in components]
    with pytest.raises(RegistrationError, match="another scheduler"):
        call()
    for module, fingerprinted in zip(components, before):
        assert_unchanged(module, fingerprinted)


# -- the one rule of shared bytes (residency.modules.subclasses.overlapping_runs) -------------------------


@pytest.mark.fast
def test_the_one_rule_groups_overlapping_bytes_of_one_storage_only():
    from residency.modules.subclasses import extent, first_shared, overlapping_runs

    flat = torch.arange(32.0)
    weight = flat[:16].view(4, 4)
    extents = [extent(t) for t in (
        weight,              # 0: bytes [0, 64)
        weight.t(),          # 1: the same bytes, another stride
        flat[12:20],         # 2: overlaps 0 ([48, 80)), so it joins 0's run
        flat[24:32],         # 3: side by side in the same storage: a run of its own
        flat[24:24],         # 4: no bytes, at the start of 3: a run of its own
        torch.arange(16.0),  # 5: another storage
    )]
    runs = overlapping_runs(extents)
    assert [run.members for run in runs] == [(0, 1, 2), (3,), (4,), (5,)]
    assert (runs[0].start, runs[0].end) == (0, 80)
    assert first_shared(extents, ["a", "a", "a", "b", "c", "d"]) is None
    assert first_shared(extents, ["a", "a", "b", "b", "c", "d"]) == (0, 2)
    assert first_shared(extents, ["a", "a", "a", "b", "b", "b"]) is None  # 4 holds no bytes


@pytest.mark.fast
def test_meta_tensors_share_bytes_only_with_themselves():
    from residency.modules.subclasses import extent, first_shared

    one, other = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert first_shared([extent(one), extent(other)], ["a", "b"]) is None
    assert first_shared([extent(one), extent(one)], ["a", "b"]) == (0, 1)


@pytest.mark.fast
def test_a_view_of_an_offloaded_groups_host_master_is_refused(first, second):
    scheduler, modules, _ = first
    stolen = modules["a"][0].weight.detach()[:2]  # reads the group's host master
    thief = nn.Linear(16, 2)
    thief.weight = nn.Parameter(stolen, requires_grad=False)
    before = fingerprint(thief)
    with pytest.raises(RegistrationError, match=r"cannot add group 'thief': its parameter "
                                                r"'weight' of Linear shares storage with "
                                                r"group 'a'"):
        scheduler.add("thief", thief)
    assert_unchanged(thief, before)
    assert "thief" not in scheduler
    second.add("thief", thief)  # another scheduler's ownership is by module, not by bytes
    assert_first_still_works(first)


@pytest.mark.fast
def test_a_view_of_a_resident_groups_device_storage_is_refused(first):
    scheduler, modules, _ = first
    with scheduler.resident("a"):
        thief = nn.Linear(16, 16)
        thief.weight = nn.Parameter(modules["a"][0].weight.detach().t(), requires_grad=False)
        with pytest.raises(RegistrationError, match="shares storage with group 'a'"):
            scheduler.add("thief", thief)
    assert "thief" not in scheduler
    assert_first_still_works(first)
