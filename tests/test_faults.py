"""Faults and misuse: each leaves the scheduler usable and every weight intact (issue 7, part 3).

Faults are injected through the `Transport` the scheduler is given (dependency injection, no
patching): an allocation that runs out of memory, a `KeyboardInterrupt` after a copy and before the
tensors are re-pointed, pinning that fails.  Module changes made behind the scheduler's back
(`.to()`, `.half()`, LoRA injection, new parameters) are adopted at the next phase change (issue 12:
the group is re-packed) - never run silently with weights in the wrong place.  Misuse gets a
`ResidencyError` whose message is tested.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from residency import (
    DeviceMemoryError,
    PhaseError,
    RegistrationError,
    ResidencyError,
    ResidencyState,
    Scheduler,
    SchedulerClosedError,
)
from residency.device.transport import Completion, CpuTransport

from conftest import make_block, run_block, twin


class FaultyTransport(CpuTransport):
    """A CPU transport with switches for the faults a real device produces."""

    def __init__(self) -> None:
        super().__init__("cpu")
        #: This many coming device allocations raise out-of-memory.
        self.oom_next = 0
        #: This many coming loads raise KeyboardInterrupt after copying, in to_device / in wait().
        self.interrupt_after_copy = 0
        self.interrupt_in_wait = 0
        #: This many coming write-backs raise KeyboardInterrupt after copying.
        self.interrupt_after_write_back = 0
        #: Host allocations with pin=True raise, like cudaHostAlloc under a low `ulimit -l`.
        self.pinning_fails = False

    def allocate_device(self, nbytes):
        if self.oom_next:
            self.oom_next -= 1
            raise torch.OutOfMemoryError(f"injected: tried to allocate {nbytes} bytes")
        return super().allocate_device(nbytes)

    def allocate_host(self, nbytes, *, pin):
        if pin and self.pinning_fails:
            raise RuntimeError("injected: cudaHostAlloc failed")
        return super().allocate_host(nbytes, pin=False)  # no pinning without an accelerator

    def to_device(self, pairs):
        done = super().to_device(pairs)
        if self.interrupt_after_copy:
            self.interrupt_after_copy -= 1
            raise KeyboardInterrupt
        if self.interrupt_in_wait:
            self.interrupt_in_wait -= 1
            return _InterruptingCompletion()
        return done

    def to_host(self, pairs):
        done = super().to_host(pairs)
        if self.interrupt_after_write_back:
            self.interrupt_after_write_back -= 1
            raise KeyboardInterrupt
        return done


class _InterruptingCompletion(Completion):
    """The copy is done; the interrupt lands while the phase waits for it."""

    def wait(self) -> None:
        raise KeyboardInterrupt


# -- helpers -----------------------------------------------------------------------------------


def host_spans(group):
    return [(c.data_ptr(), c.data_ptr() + c.numel()) for c in group.host_master.chunks]


def device_span(group):
    buffer = group.device_storage.buffer
    assert buffer is not None, f"group {group.name!r} is resident without device storage"
    return [(buffer.data_ptr(), buffer.data_ptr() + buffer.numel())]


def assert_placed(scheduler: Scheduler, *, changed: str | None = None) -> None:
    """At most one exclusive group resident; each group's tensors live where its state says.

    `changed` names a group whose tensors the user replaced and the scheduler refused: not checked.
    """
    exclusive = [scheduler[n] for n in scheduler if scheduler[n].exclusive]
    resident = [g.name for g in exclusive if g.is_resident]
    assert len(resident) <= 1, f"two exclusive groups resident: {resident}"
    assert scheduler.current == (resident[0] if resident else None)
    for name in scheduler:
        if name == changed:
            continue
        group = scheduler[name]
        assert group.state in (ResidencyState.OFFLOADED, ResidencyState.RESIDENT), group
        spans = device_span(group) if group.is_resident else host_spans(group)
        for tensor in group.tensors:
            pointer = tensor.data_ptr()
            assert any(lo <= pointer < hi for lo, hi in spans), (
                f"a tensor of {name!r} ({group.state.value}) points outside its storage"
            )


def assert_same_weights(module: nn.Module, reference: nn.Module) -> None:
    ours = [*module.named_parameters(), *module.named_buffers()]
    theirs = dict([*reference.named_parameters(), *reference.named_buffers()])
    assert [k for k, _ in ours] == list(theirs)
    for key, tensor in ours:
        same = torch.equal(tensor.detach().cpu(), theirs[key].detach().cpu())
        assert same, f"{key} differs from the reference"


def assert_runs_correctly(scheduler, name, module, reference, x, *, changed=None) -> None:
    with scheduler.resident(name):
        assert scheduler[name].is_resident
        same = torch.equal(run_block(module, x), run_block(reference, x))
        assert same, f"the output of {name!r} differs from the reference"
    assert_placed(scheduler, changed=changed)


@pytest.fixture
def transport():
    return FaultyTransport()


@pytest.fixture
def small_and_big(transport):
    """Groups 'a' (small) and 'b' (bigger), their never-offloaded references, and an input each."""
    scheduler = Scheduler("cpu", transport=transport)
    modules = {"a": make_block(16, seed=1), "b": make_block(64, seed=2)}
    plain = {name: twin(m) for name, m in modules.items()}
    for name, module in modules.items():
        scheduler.add(name, module)
    inputs = {"a": torch.randn(3, 16), "b": torch.randn(3, 64)}
    yield scheduler, modules, plain, inputs
    scheduler.close()


# -- the device runs out of memory during an onload --------------------------------------------


@pytest.mark.fast
def test_out_of_memory_on_onload_names_the_group_and_bytes_and_leaves_it_offloaded(
    small_and_big, transport
):
    scheduler, modules, plain, inputs = small_and_big
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], inputs["a"])
    scheduler.offload_all()  # frees device storage: the next load allocates
    transport.oom_next = 2  # the allocation and its one retry
    body_ran = False
    with pytest.raises(DeviceMemoryError, match=r"group 'b' needs (\d+) bytes") as caught:
        with scheduler.resident("b"):
            body_ran = True
    assert not body_ran
    needed = int(caught.value.args[0].split("needs ")[1].split(" bytes")[0])
    assert needed >= scheduler["b"].nbytes
    assert isinstance(caught.value, (ResidencyError, MemoryError))
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert scheduler["b"].state is ResidencyState.OFFLOADED
    assert_placed(scheduler)
    for name in modules:
        assert_same_weights(modules[name], plain[name])
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], inputs["a"])


@pytest.mark.fast
def test_one_failed_device_allocation_is_retried_once(small_and_big, transport):
    """The allocation is tried again (after the accelerator's cache is emptied: on the CPU there
    is none); the phase runs as if nothing failed."""
    scheduler, modules, plain, inputs = small_and_big
    scheduler.offload_all()
    transport.oom_next = 1
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])
    assert transport.oom_next == 0 and scheduler.current == "b"


@pytest.mark.fast
def test_out_of_memory_in_a_nested_phase_brings_the_outer_group_back(small_and_big, transport):
    scheduler, modules, plain, inputs = small_and_big
    with scheduler.resident("a"):
        kept = modules["a"][0].weight.detach()  # an alias: the next load must allocate afresh
        transport.oom_next = 2  # the allocation and its one retry
        with pytest.raises(DeviceMemoryError, match="group 'b' needs"):
            with scheduler.resident("b"):
                pytest.fail("the body of a phase that could not load ran")
        assert scheduler.current == "a"
        assert torch.equal(run_block(modules["a"], inputs["a"]), run_block(plain["a"], inputs["a"]))
        assert_placed(scheduler)
    assert torch.equal(kept, plain["a"][0].weight)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])


#: A width-16 block (~3 KiB packed) fits; a width-64 block (~34 KiB) does not.
_LIMIT = 8 * 2**10


@pytest.mark.fast
def test_device_memory_limit_refuses_a_group_that_cannot_fit_and_changes_nothing():
    small, big = make_block(16, seed=1), make_block(64, seed=2)
    plain_small = twin(small)
    scheduler = Scheduler("cpu", device_memory_limit=_LIMIT)
    scheduler.add("small", small)
    pointers = [t.data_ptr() for t in big.state_dict().values()]
    with pytest.raises(
        RegistrationError,
        match=r"cannot add group 'big': it needs \d+ bytes of device memory.*device_memory_limit",
    ):
        scheduler.add("big", big)
    assert list(scheduler) == ["small"]
    assert [t.data_ptr() for t in big.state_dict().values()] == pointers
    assert_runs_correctly(scheduler, "small", small, plain_small, torch.randn(2, 16))
    scheduler.close()


@pytest.mark.fast
def test_device_memory_limit_still_holds_after_refresh_grows_a_group():
    """A group that grows (LoRA) and is refreshed must not get more device memory than the limit."""
    block = make_block(16, seed=1)
    scheduler = Scheduler("cpu", device_memory_limit=_LIMIT)
    scheduler.add("a", block)
    block.add_module("adapter", nn.Linear(64, 64))  # ~16 KiB more, over the limit
    try:
        scheduler.refresh("a")
    except RegistrationError as refused:
        assert "device_memory_limit" in str(refused) and "'a'" in str(refused)
    else:
        with pytest.raises(DeviceMemoryError, match=r"group 'a' needs \d+ bytes"):
            with scheduler.resident("a"):
                pass
    storages = [scheduler[n].device_storage for n in scheduler]
    held = {id(s): s.nbytes for s in storages if s is not None}
    assert sum(held.values()) <= scheduler.device_nbytes <= _LIMIT
    scheduler.close()


# -- KeyboardInterrupt between the copy and the re-pointing ------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("where", ["interrupt_after_copy", "interrupt_in_wait"])
def test_keyboard_interrupt_during_a_load_leaves_the_group_cleanly_offloaded(
    small_and_big, transport, where
):
    scheduler, modules, plain, inputs = small_and_big
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], inputs["a"])
    setattr(transport, where, 1)
    with pytest.raises(KeyboardInterrupt):
        with scheduler.resident("b"):
            pytest.fail("the body of a phase that could not load ran")
    assert scheduler["b"].state is ResidencyState.OFFLOADED
    assert_placed(scheduler)
    for name in modules:
        assert_same_weights(modules[name], plain[name])
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], inputs["a"])


@pytest.mark.fast
@pytest.mark.parametrize("where", ["interrupt_after_copy", "interrupt_in_wait"])
def test_keyboard_interrupt_during_a_nested_load_brings_the_outer_group_back(
    small_and_big, transport, where
):
    scheduler, modules, plain, inputs = small_and_big
    with scheduler.resident("a"):
        setattr(transport, where, 1)
        with pytest.raises(KeyboardInterrupt):
            with scheduler.resident("b"):
                pytest.fail("the body of a phase that could not load ran")
        assert scheduler.current == "a"
        assert torch.equal(run_block(modules["a"], inputs["a"]), run_block(plain["a"], inputs["a"]))
        assert_placed(scheduler)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])


@pytest.mark.fast
def test_keyboard_interrupt_during_write_back_loses_no_change(small_and_big, transport):
    scheduler, modules, plain, inputs = small_and_big
    with scheduler.resident("a"), torch.no_grad():
        modules["a"][0].weight.mul_(2.0)
    with torch.no_grad():
        plain["a"][0].weight.mul_(2.0)
    transport.interrupt_after_write_back = 1
    with pytest.raises(KeyboardInterrupt):
        with scheduler.resident("b"):
            pass
    assert_placed(scheduler)
    assert_same_weights(modules["a"], plain["a"])
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], inputs["b"])
    assert not scheduler["a"].is_resident
    assert_same_weights(modules["a"], plain["a"])  # now read from the host master
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], inputs["a"])


# -- pinning fails -----------------------------------------------------------------------------


def _pinning_warnings(caught):
    return [
        w for w in caught if issubclass(w.category, RuntimeWarning) and "pinn" in str(w.message)
    ]


@pytest.mark.fast
def test_failed_pinning_falls_back_to_pageable_memory_with_one_warning(transport):
    transport.pinning_fails = True
    block = make_block(32, seed=1)
    plain = twin(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = Scheduler("cpu", pin_memory=True, transport=transport, chunk_nbytes=1024)
        group = scheduler.add("a", block)
    assert len(group.host_master.chunks) > 1  # several chunks, still one warning
    assert len(_pinning_warnings(caught)) == 1, [str(w.message) for w in caught]
    assert "pageable" in str(_pinning_warnings(caught)[0].message)
    assert not group.host_master.pinned
    assert_runs_correctly(scheduler, "a", block, plain, torch.randn(2, 32))
    scheduler.close()


@pytest.mark.fast
def test_failed_pinning_warns_once_per_scheduler_not_once_per_group(transport):
    transport.pinning_fails = True
    blocks = [make_block(32, seed=i) for i in range(3)]
    plain = [twin(b) for b in blocks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = Scheduler("cpu", pin_memory=True, transport=transport)
        for i, block in enumerate(blocks):
            scheduler.add(f"g{i}", block)
    assert len(_pinning_warnings(caught)) == 1, [str(w.message) for w in caught]
    for i, block in enumerate(blocks):
        assert not scheduler[f"g{i}"].host_master.pinned
        assert_runs_correctly(scheduler, f"g{i}", block, plain[i], torch.randn(2, 32))
    scheduler.close()


# -- modules changed after `add` ---------------------------------------------------------------

_REFRESH_HINT = r"scheduler\.refresh\('a'\)"


def _to_half(module):
    return module.half()


def _to_double(module):
    return module.to(torch.float64)


@pytest.fixture
def two_groups(scheduler):
    modules = {"a": make_block(32, seed=1), "b": make_block(32, seed=2)}
    plain = {name: twin(m) for name, m in modules.items()}
    for name, module in modules.items():
        scheduler.add(name, module)
    return scheduler, modules, plain


@pytest.mark.fast
@pytest.mark.parametrize("retype", [_to_half, _to_double], ids=["half", "to_float64"])
@pytest.mark.parametrize("while_", ["offloaded", "resident"])
def test_a_dtype_change_is_adopted_at_the_next_phase_change(two_groups, retype, while_, caplog):
    scheduler, modules, plain = two_groups
    x = torch.randn(3, 32)
    with scheduler.resident("a" if while_ == "resident" else "b"):
        pass
    retype(modules["a"])
    retype(plain["a"])
    other = "b" if while_ == "resident" else "a"  # the next phase change touches 'a' either way
    with caplog.at_level("INFO", logger="residency"):
        with scheduler.resident(other):
            assert_placed(scheduler)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], x)
    xa = x.to(plain["a"][0].weight.dtype)
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], xa)
    with scheduler.resident("a"):
        assert all(t.dtype == xa.dtype for t in scheduler["a"].tensors)
        assert scheduler["a"].host_master.views[0].dtype == xa.dtype  # re-packed in the new dtype
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], x)
    assert_same_weights(modules["a"], plain["a"])
    adopted = [r.message for r in caplog.records if "re-packed" in r.message]
    assert len(adopted) == 1 and "group 'a' changed (the " in adopted[0], adopted


@pytest.mark.fast
@pytest.mark.parametrize("while_", ["offloaded", "resident"])
def test_moving_a_module_to_the_device_it_is_on_is_harmless(two_groups, while_):
    scheduler, modules, plain = two_groups
    with scheduler.resident("a" if while_ == "resident" else "b"):
        modules["a"].to("cpu")
        modules["a"].to(torch.device("cpu"), torch.float32)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], torch.randn(2, 32))
    assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], torch.randn(2, 32))
    assert_same_weights(modules["a"], plain["a"])


@pytest.mark.gpu
def test_moving_a_registered_module_between_host_and_device_is_adopted():
    device = torch.accelerator.current_accelerator()
    modules = {"a": make_block(32, seed=1), "b": make_block(32, seed=2)}
    plain = {name: twin(m).to(device) for name, m in modules.items()}
    scheduler = Scheduler(device)
    for name, module in modules.items():
        scheduler.add(name, module)
    x = torch.randn(3, 32, device=device)

    with scheduler.resident("a"):
        pass
    modules["a"].to("cpu")  # while resident: the weights leave the device behind our back
    for name in ("b", "a"):  # each move is adopted at the next phase change, never refused
        with scheduler.resident(name):
            pass
    modules["b"].to(device)  # while offloaded: the weights arrive on the device behind our back
    with scheduler.resident("b"):
        pass
    for name in ("a", "b", "a"):
        with scheduler.resident(name):
            group = scheduler[name]
            assert all(t.device.type == device.type for t in group.tensors)
            assert torch.equal(run_block(modules[name], x), run_block(plain[name], x))
    scheduler.close()


class LoraLinear(nn.Module):
    """What LoRA injection does to a model: the original layer plus two new low-rank parameters."""

    def __init__(self, base: nn.Linear, rank: int = 4, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank, generator=generator) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def _inject_lora(block):
    block[0] = LoraLinear(block[0], seed=7)


def _add_parameter(block):
    block[3].register_parameter("gate", nn.Parameter(torch.zeros(())))


def _replace_parameter(block):
    block[0].weight = nn.Parameter(block[0].weight.detach() * 0.5)


def _load_with_assign(block):
    state = {k: v.clone() + 1.0 for k, v in block.state_dict().items()}
    block.load_state_dict(state, assign=True)


@pytest.mark.fast
@pytest.mark.parametrize(
    "change",
    [_inject_lora, _add_parameter, _replace_parameter, _load_with_assign],
    ids=["lora_injection", "new_parameter", "replaced_parameter", "load_state_dict_assign"],
)
@pytest.mark.parametrize("while_", ["offloaded", "resident", "inside_its_phase"])
def test_new_or_replaced_parameters_are_adopted_at_the_next_phase_change(two_groups, change, while_):
    scheduler, modules, plain = two_groups
    x = torch.randn(3, 32)
    if while_ == "inside_its_phase":
        with scheduler.resident("a"):
            change(modules["a"])
            change(plain["a"])
            # the user's own new tensors run fine inside the phase
            assert torch.equal(run_block(modules["a"], x), run_block(plain["a"], x))
    else:
        with scheduler.resident("a" if while_ == "resident" else "b"):
            pass
        change(modules["a"])
        change(plain["a"])
    with scheduler.resident("b"):
        assert torch.equal(run_block(modules["b"], x), run_block(plain["b"], x))
        assert_placed(scheduler)  # 'a' is offloaded (new parameters join it at its next load)
    with scheduler.resident("a"):
        assert torch.equal(run_block(modules["a"], x), run_block(plain["a"], x))
        assert_placed(scheduler)  # the new parameters live in device storage too
        assert scheduler["a"].tensors == tuple(dict.fromkeys(_tensors_of(modules["a"])))
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], x)
    assert_placed(scheduler)  # ...and return to the host master
    assert_same_weights(modules["a"], plain["a"])


def _tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [t for m in module.modules() for t in [*m._parameters.values(), *m._buffers.values()]
            if t is not None]


@pytest.mark.fast
def test_refresh_is_refused_inside_the_groups_own_phase(two_groups):
    scheduler, modules, _ = two_groups
    with scheduler.resident("a"):
        _inject_lora(modules["a"])
        refused = "cannot refresh group 'a' while a phase of it is active"
        with pytest.raises(PhaseError, match=refused):
            scheduler.refresh("a")
    scheduler.refresh("a")


# -- misuse ------------------------------------------------------------------------------------


@pytest.mark.fast
def test_phases_exited_out_of_order_are_refused_and_change_nothing(two_groups):
    scheduler, modules, plain = two_groups
    outer, inner = scheduler.resident("a"), scheduler.resident("b")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(PhaseError, match="leave phases in the reverse order of entering them"):
        outer.__exit__(None, None, None)
    assert scheduler.current == "b"
    assert "active" in repr(outer) and "active" in repr(inner)
    inner.__exit__(None, None, None)  # the outer phase, whose exit was refused, closes with it
    assert scheduler.current == "b" and "exited" in repr(outer)
    outer.__exit__(None, None, None)  # a retried exit does nothing
    assert_placed(scheduler)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], torch.randn(2, 32))


@pytest.mark.fast
def test_a_phase_entered_twice_is_refused(two_groups):
    scheduler, _, _ = two_groups
    phase = scheduler.resident("a")
    with phase:
        with pytest.raises(PhaseError, match="already entered; a phase is not reusable"):
            phase.__enter__()
        assert scheduler.current == "a"
    with pytest.raises(PhaseError, match="already entered; a phase is not reusable"):
        phase.__enter__()
    with pytest.raises(PhaseError, match="is exited, not active"):
        phase.__exit__(None, None, None)
    with pytest.raises(PhaseError, match="is new, not active"):
        scheduler.resident("b").__exit__(None, None, None)
    with scheduler.resident("b"):
        assert scheduler.current == "b"


@pytest.mark.fast
def test_a_phase_exited_on_another_thread_is_refused(two_groups):
    scheduler, _, _ = two_groups
    phase = scheduler.resident("a")
    phase.__enter__()
    errors = []

    def leave_elsewhere():
        try:
            phase.__exit__(None, None, None)
        except PhaseError as error:
            errors.append(error)

    thread = threading.Thread(target=leave_elsewhere, name="intruder", daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1
    assert "was left on thread 'intruder', which did not enter it" in str(errors[0])
    assert "active" in repr(phase) and scheduler.current == "a"
    phase.__exit__(None, None, None)
    with scheduler.resident("b"):
        assert scheduler.current == "b"


@pytest.mark.fast
@pytest.mark.parametrize("action", ["refresh", "remove"])
def test_refresh_or_remove_of_a_group_whose_phase_is_suspended_is_refused_or_consistent(
    two_groups, action
):
    """The outer phase of a nest is still active: its group must not come back as a ghost."""
    scheduler, modules, plain = two_groups
    x = torch.randn(2, 32)
    with scheduler.resident("a"):
        with scheduler.resident("b"):
            try:
                getattr(scheduler, action)("a")
                done = True
            except PhaseError as refused:
                assert f"{action} group 'a' while a phase of it is active" in str(refused)
                done = False
        if action == "remove" and done:  # a removed group is never made resident again
            assert "a" not in scheduler and scheduler.current is None
        else:
            assert scheduler.current == "a" and scheduler["a"].is_resident
        assert_placed(scheduler)
        assert torch.equal(run_block(modules["a"], x), run_block(plain["a"], x))
    assert_placed(scheduler)
    assert_runs_correctly(scheduler, "b", modules["b"], plain["b"], x)
    if "a" in scheduler:
        assert_runs_correctly(scheduler, "a", modules["a"], plain["a"], x)


@pytest.mark.fast
def test_a_closed_scheduler_refuses_every_call_and_leaves_modules_on_the_host():
    scheduler = Scheduler("cpu")
    modules = {"a": make_block(seed=1), "b": make_block(seed=2), "v": make_block(seed=3)}
    plain = {name: twin(m) for name, m in modules.items()}
    scheduler.add("a", modules["a"])
    scheduler.add("b", modules["b"])
    scheduler.add("v", modules["v"], policy="resident")
    early = scheduler.resident("b")
    with scheduler.resident("a"), torch.no_grad():
        modules["a"][0].bias.add_(1.0)
    with torch.no_grad():
        plain["a"][0].bias.add_(1.0)
    buffers = [scheduler[n].device_storage.buffer for n in ("a", "v")]  # kept: no reuse
    scheduler.close()
    scheduler.close()  # closing twice is fine
    closed = "this scheduler was closed"
    with pytest.raises(SchedulerClosedError, match=closed):
        scheduler.add("c", make_block(seed=4))
    with pytest.raises(SchedulerClosedError, match=closed):
        scheduler.resident("a")
    with pytest.raises(SchedulerClosedError, match=closed):
        early.__enter__()
    with pytest.raises(SchedulerClosedError, match=closed):
        scheduler.offload_all()
    with pytest.raises(SchedulerClosedError, match=closed):
        scheduler.refresh("a")
    with pytest.raises(SchedulerClosedError, match=closed):
        scheduler.remove("a")
    x = torch.randn(2, 32)
    for name, module in modules.items():
        assert_same_weights(module, plain[name])
        assert torch.equal(run_block(module, x), run_block(plain[name], x))
        for tensor in module.state_dict().values():
            pointer = tensor.data_ptr()
            assert not any(b.data_ptr() <= pointer < b.data_ptr() + b.numel() for b in buffers)


@pytest.mark.fast
def test_close_while_a_phase_is_active_is_refused_and_changes_nothing(scheduler):
    modules = {name: make_block(seed=i) for i, name in enumerate(["a", "b", "c"])}
    plain = {name: twin(m) for name, m in modules.items()}
    for name, module in modules.items():
        scheduler.add(name, module)
    with scheduler.resident("c"):
        with pytest.raises(PhaseError, match="while a phase"):
            scheduler.close()
        assert list(scheduler) == ["a", "b", "c"]
        assert scheduler.current == "c"
    for name in modules:
        assert_runs_correctly(scheduler, name, modules[name], plain[name], torch.randn(2, 32))


@pytest.mark.fast
@pytest.mark.parametrize("change", [_to_half, _inject_lora], ids=["half", "lora_injection"])
def test_close_after_a_module_changed_behind_the_schedulers_back_still_closes(change):
    """close() is not refused for a change: it returns what it can, keeps the user's tensors."""
    scheduler = Scheduler("cpu")
    modules = {"a": make_block(32, seed=1), "b": make_block(32, seed=2)}
    plain = {name: twin(m) for name, m in modules.items()}
    for name, module in modules.items():
        scheduler.add(name, module)
    with scheduler.resident("a"):
        buffer = scheduler["a"].device_storage.buffer
        change(modules["a"])
        change(plain["a"])
    scheduler.close()
    with pytest.raises(SchedulerClosedError):
        scheduler.resident("b")
    for name, module in modules.items():
        assert_same_weights(module, plain[name])
        for tensor in module.state_dict().values():
            pointer = tensor.data_ptr()
            assert not buffer.data_ptr() <= pointer < buffer.data_ptr() + buffer.numel()
    x = torch.randn(2, 32).to(next(plain["a"].parameters()).dtype)
    assert torch.equal(run_block(modules["a"], x), run_block(plain["a"], x))


@pytest.mark.fast
def test_the_same_module_added_twice_is_refused_and_changes_nothing(scheduler):
    block, fresh = make_block(seed=1), make_block(seed=2)
    plain = twin(block)
    scheduler.add("a", block)
    pointers = [t.data_ptr() for t in fresh.state_dict().values()]
    with pytest.raises(RegistrationError, match="a group named 'a' is already registered"):
        scheduler.add("a", block)
    with pytest.raises(RegistrationError, match="Sequential module already belongs to group 'a'"):
        scheduler.add("again", block)
    with pytest.raises(RegistrationError, match="Linear module already belongs to group 'a'"):
        scheduler.add("part", block[0])
    with pytest.raises(RegistrationError, match="already belongs to group 'a'"):
        scheduler.add("mixed", [fresh, block])
    assert list(scheduler) == ["a"]
    assert [t.data_ptr() for t in fresh.state_dict().values()] == pointers
    assert_runs_correctly(scheduler, "a", block, plain, torch.randn(2, 32))
    scheduler.add("fresh", fresh)  # the refused module set can still be registered on its own
