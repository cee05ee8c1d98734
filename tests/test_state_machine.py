"""A property-based search for lost or mixed-up weights: random phase sequences against a reference.

Hypothesis drives one `Scheduler` over three exclusive groups (one of them with a tied weight) and a
resident-policy group through random steps: nested phases entered and left (also by an exception),
forwards, in-place edits under ``no_grad``, SGD steps, ``load_state_dict``, ``.data`` replacement,
exceptions inside phases, ``prefetch``, ``offload_all`` and ``refresh``.  A deep copy of every
module, never offloaded, receives the same edits.  After every step the invariants are checked:

* at most one exclusive group is resident, and it is ``scheduler.current``;
* the innermost active exclusive phase's group is the resident one; resident-policy groups always
  are;
* every tensor of an offloaded (or prefetched, LOADING) group points into its host master, every
  tensor of a resident group into its device storage (a tensor the user gave new storage may sit
  in that storage until the group's next transition);
* every parameter and buffer equals the reference bit for bit, and tied weights stay tied.

The machine runs twice (conftest.py's ``switch_interval``): with the default GIL switch interval,
and with 1 us while a second thread reads the scheduler's public view throughout (an `Observer`:
never two exclusive groups in one snapshot) - the machine itself is one thread, so only a second
one makes the short interval interleave anything.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn

from residency import PhaseError, ResidencyState, Scheduler
from residency.core.enums import PhaseStatus

from _helpers import on_host_master
from conftest import make_block, run_block, twin

EXCLUSIVE = ("a", "b", "tied")
RESIDENT = "vae"
GROUPS = (*EXCLUSIVE, RESIDENT)
WIDTH = {"a": 16, "b": 24, "tied": 16, RESIDENT: 8}


class TiedBlock(nn.Module):
    """Two square layers sharing one weight Parameter, and a buffer."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.second.weight = self.first.weight
        self.register_buffer("scale", torch.rand(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def build(name: str) -> nn.Module:
    if name == "tied":
        return TiedBlock(WIDTH[name], seed=3)
    return make_block(WIDTH[name], seed={"a": 1, "b": 2, RESIDENT: 4}[name])


def forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return run_block(module, x)


def tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN; `torch.equal` would say no)."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return False
    as_int = _SAME_WIDTH_INT.get(ours.dtype)
    if as_int is None:
        return torch.equal(ours, theirs)
    return torch.equal(ours.detach().view(as_int), theirs.detach().view(as_int))


class Boom(Exception):
    """Raised inside phases on purpose."""


# Every test here runs twice: with the default GIL switch interval and with 1 us (conftest.py).
pytestmark = pytest.mark.usefixtures("switch_interval")

#: How long the observer thread may take to stop (never reached when green).
JOIN_SECONDS = 30


class Observer:
    """A second thread that reads the public view of `scheduler` until stopped, holding no phase:
    each `resident_groups()` snapshot has at most one exclusive group."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.problems: list[str] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        exclusive = set(EXCLUSIVE)
        try:
            while not self._stop.is_set():
                resident = self.scheduler.resident_groups()
                self.scheduler.device_nbytes
                self.reads += 1
                if len(exclusive.intersection(resident)) > 1:
                    self.problems.append(f"observer saw two exclusive groups: {resident}")
                    return
        except BaseException as error:  # handed to the machine's teardown
            self.problems.append(f"observer: {error!r}")

    def stop(self) -> None:
        """Stop the thread; raise if it is stuck or saw a problem."""
        self._stop.set()
        self._thread.join(JOIN_SECONDS)
        assert not self._thread.is_alive(), "the observer thread is stuck"
        assert not self.problems, self.problems


class PhaseMachine(RuleBasedStateMachine):
    #: Whether an `Observer` reads the scheduler from a second thread (the 1 us run).
    observed = False

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = Scheduler("cpu")
        self.observer: Observer | None = None
        self.modules = {name: build(name) for name in GROUPS}
        self.plain = {name: twin(m) for name, m in self.modules.items()}
        generator = torch.Generator().manual_seed(0)  # failures replay exactly
        self.inputs = {name: torch.randn(3, WIDTH[name], generator=generator) for name in GROUPS}
        for name in EXCLUSIVE:
            self.scheduler.add(name, self.modules[name])
        self.scheduler.add(RESIDENT, self.modules[RESIDENT], policy="resident")
        if self.observed:
            self.observer = Observer(self.scheduler)
        #: Phases entered by `enter` and not yet left, outermost first.
        self.stack: list = []
        #: Per group: data_ptr of each tensor the test gave new storage (not yet taken over).
        self.replaced: dict[str, set[int]] = {name: set() for name in GROUPS}
        self.records_seen = 0

    def teardown(self) -> None:
        """Leave the phases still active one by one, checking the invariants after each."""
        try:
            while self.stack:
                self.stack.pop().__exit__(None, None, None)
                self.close_leaving_phases()
                self.one_exclusive_group_and_it_is_the_innermost()
                self.every_tensor_lives_where_its_group_is()
            self.no_weight_lost_or_mixed_up()
        finally:
            while self.stack:  # after a failure: leave what is left so that close() can run
                try:
                    self.stack.pop().__exit__(None, None, None)
                except Exception:
                    pass
            try:
                if self.observer is not None:
                    self.observer.stop()
            finally:
                self.scheduler.close()

    # -- helpers -------------------------------------------------------------------------------

    def innermost_exclusive(self) -> str | None:
        for phase in reversed(self.stack):
            if phase.group.exclusive:
                return phase.group.name
        return None

    def check_forward(self, name: str) -> None:
        with torch.no_grad():
            ours = forward(self.modules[name], self.inputs[name])
            theirs = forward(self.plain[name], self.inputs[name])
        same = same_bits(ours, theirs)
        assert same, f"the output of {name!r} differs from the reference"

    def both(self, name: str):
        return self.modules[name], self.plain[name]

    # -- phases --------------------------------------------------------------------------------

    @rule(name=st.sampled_from(GROUPS))
    def enter(self, name):
        phase = self.scheduler.resident(name)
        phase.__enter__()
        self.stack.append(phase)
        assert self.scheduler[name].is_resident

    @precondition(lambda self: self.stack)
    @rule(by_exception=st.booleans())
    def leave_innermost(self, by_exception):
        phase = self.stack.pop()
        if by_exception:
            error = Boom("raised in the body")
            assert not phase.__exit__(Boom, error, error.__traceback__)
        else:
            phase.__exit__(None, None, None)
        self.close_leaving_phases()

    def close_leaving_phases(self) -> None:
        """Phases whose exit was refused (misnested) close once the phases inside them are left."""
        while self.stack and self.stack[-1].status is not PhaseStatus.ACTIVE:
            phase = self.stack.pop()
            assert phase.status is PhaseStatus.EXITED_LATE, repr(phase)
            phase.__exit__(None, None, None)  # leaving it again does nothing
            assert phase.status is PhaseStatus.EXITED

    @precondition(lambda self: len(self.stack) >= 2)
    @rule(data=st.data())
    def leave_out_of_order_is_refused(self, data):
        index = data.draw(st.integers(0, len(self.stack) - 2))
        current = self.scheduler.current
        with pytest.raises(PhaseError, match="leave phases in the reverse order"):
            self.stack[index].__exit__(None, None, None)
        assert self.scheduler.current == current
        assert self.stack[index].status is PhaseStatus.LEAVING

    @precondition(lambda self: self.stack)
    @rule()
    def reenter_is_refused(self):
        with pytest.raises(PhaseError, match="a phase is not reusable"):
            self.stack[-1].__enter__()

    @rule(name=st.sampled_from(GROUPS))
    def forward_in_a_phase(self, name):
        with self.scheduler.resident(name):
            assert self.scheduler[name].is_resident
            self.check_forward(name)

    @precondition(lambda self: self.stack)
    @rule()
    def forward_in_the_active_phase(self):
        self.check_forward(self.stack[-1].group.name)
        self.check_forward(RESIDENT)

    @rule(name=st.sampled_from(GROUPS), partial=st.booleans())
    def exception_inside_a_phase(self, name, partial):
        with pytest.raises(Boom):
            with self.scheduler.resident(name):
                if partial:
                    self.check_forward(name)
                raise Boom("raised in the body")

    # -- edits (each made on the scheduler's modules and on the reference alike) ---------------

    @rule(
        name=st.sampled_from(GROUPS),
        factor=st.sampled_from([0.5, 2.0, -1.0]),
        inside=st.booleans(),
    )
    def edit_in_place(self, name, factor, inside):
        def edit():
            with torch.no_grad():
                for module in self.both(name):
                    for _, tensor in tensors_of(module):
                        tensor.mul_(factor)

        if inside:
            with self.scheduler.resident(name):
                edit()
        else:
            edit()

    @rule(name=st.sampled_from(GROUPS), foreach=st.booleans())
    def sgd_step(self, name, foreach):
        def step():
            for module in self.both(name):
                module.zero_grad(set_to_none=True)
                forward(module, self.inputs[name]).square().mean().backward()
                torch.optim.SGD(module.parameters(), lr=0.01, foreach=foreach).step()

        if name == RESIDENT:
            step()
        else:
            with self.scheduler.resident(name):
                step()

    @rule(name=st.sampled_from(GROUPS), seed=st.integers(0, 2**16))
    def load_state_dict(self, name, seed):
        generator = torch.Generator().manual_seed(seed)
        state = {
            key: torch.randn(value.shape, generator=generator) * 0.2
            for key, value in self.plain[name].state_dict().items()
        }
        for module in self.both(name):
            module.load_state_dict(state)

    @rule(name=st.sampled_from(GROUPS), seed=st.integers(0, 2**16), data=st.data())
    def replace_data(self, name, seed, data):
        """``tensor.data = new`` with a same-shape, same-layout tensor, LoRA-fuse style.

        (Other strides are a case of their own: see the plain tests below.)
        """
        ours, theirs = (dict(tensors_of(m)) for m in self.both(name))
        key = data.draw(st.sampled_from(sorted(ours)))
        generator = torch.Generator().manual_seed(seed)
        new = torch.randn(ours[key].shape, generator=generator)
        ours[key].data = new
        theirs[key].data = new.clone()
        self.replaced[name].add(new.data_ptr())

    # -- scheduler calls -----------------------------------------------------------------------

    @rule()
    def offload_all(self):
        if self.innermost_exclusive() is not None:
            with pytest.raises(PhaseError, match="while a phase is active"):
                self.scheduler.offload_all()
        else:
            self.scheduler.offload_all()
            assert self.scheduler.current is None

    @rule(name=st.sampled_from(GROUPS))
    def prefetch(self, name):
        resident_before = self.scheduler[name].is_resident
        started = self.scheduler.prefetch(name)
        if name == RESIDENT or resident_before:
            assert not started
        if started:
            assert self.scheduler[name].state is ResidencyState.LOADING

    @rule(name=st.sampled_from(GROUPS))
    def refresh(self, name):
        if name == self.innermost_exclusive():
            with pytest.raises(PhaseError, match=f"cannot refresh group {name!r} while a phase"):
                self.scheduler.refresh(name)
            return
        try:
            self.scheduler.refresh(name)
        except PhaseError as refused:  # a suspended outer phase of the group: refusing is fine
            assert any(p.group.name == name for p in self.stack), refused
            assert f"refresh group {name!r}" in str(refused)
        else:
            self.replaced[name].clear()

    # -- invariants ----------------------------------------------------------------------------

    def _forget_replacements_taken_over(self) -> None:
        """A transition of a group takes over (writes back, adopts) the storage the user gave it."""
        log = self.scheduler.transitions
        fresh = log.count - self.records_seen
        self.records_seen = log.count
        for record in list(log)[len(log) - min(fresh, len(log)):]:
            for name in (record.from_group, record.to_group):
                if name in self.replaced:
                    self.replaced[name].clear()

    @invariant()
    def one_exclusive_group_and_it_is_the_innermost(self):
        scheduler = self.scheduler
        resident = [n for n in EXCLUSIVE if scheduler[n].is_resident]
        assert len(resident) <= 1, f"two exclusive groups resident: {resident}"
        assert scheduler.current == (resident[0] if resident else None)
        innermost = self.innermost_exclusive()
        if innermost is not None:
            assert scheduler.current == innermost
        assert scheduler[RESIDENT].is_resident
        assert sorted(scheduler.resident_groups()) == sorted([*resident, RESIDENT])

    @invariant()
    def every_tensor_lives_where_its_group_is(self):
        self._forget_replacements_taken_over()
        loading = [n for n in GROUPS if self.scheduler[n].state is ResidencyState.LOADING]
        assert len(loading) <= 1, f"more than one group prefetched: {loading}"
        for name in GROUPS:
            group = self.scheduler[name]
            if group.is_resident:
                buffer = group.device_storage.buffer
                spans = [(buffer.data_ptr(), buffer.data_ptr() + buffer.numel())]
            else:
                spans = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in group.host_master.chunks]
            for tensor in group.tensors:
                pointer = tensor.data_ptr()
                if pointer in self.replaced[name]:
                    continue
                assert any(lo <= pointer < hi for lo, hi in spans), (
                    f"a tensor of {name!r} ({group.state.value}) points outside its storage"
                )

    @invariant()
    def no_weight_lost_or_mixed_up(self):
        for name in GROUPS:
            ours, theirs = (tensors_of(m) for m in self.both(name))
            assert [k for k, _ in ours] == [k for k, _ in theirs]
            for (key, tensor), (_, reference) in zip(ours, theirs):
                same = same_bits(tensor, reference)
                assert same, f"{name}.{key} differs from the reference"
        tied = self.modules["tied"]
        assert tied.second.weight is tied.first.weight


# [Note: no shrinking in CI]
# Shrinking a failing 30-step run can take minutes, over the CI budget; the failing sequence is
# printed unshrunk.  To get a minimal one, add Phase.shrink to `phases` and run this file alone.
MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)


class ObservedPhaseMachine(PhaseMachine):
    observed = True


def test_random_phase_sequences_lose_and_mix_up_nothing(switch_interval):
    if switch_interval >= 1e-3:
        run_state_machine_as_test(PhaseMachine, settings=MACHINE_SETTINGS)
    else:
        # The observer contends for the lock on every step (~15k reads a second): fewer examples
        # keep the run near the default one's time.
        run_state_machine_as_test(
            ObservedPhaseMachine, settings=settings(MACHINE_SETTINGS, max_examples=40)
        )


@pytest.mark.fast
def test_the_observer_reads_and_reports(switch_interval):
    """The observer itself: it reads while phases change, and a problem it saw fails `stop`."""
    machine = ObservedPhaseMachine()
    try:
        for name in (*EXCLUSIVE, *EXCLUSIVE):
            with machine.scheduler.resident(name):
                pass
        deadline = time.monotonic() + 30
        while machine.observer.reads < 3 and time.monotonic() < deadline:
            threading.Event().wait(0.001)
        assert machine.observer.reads >= 3
        machine.observer.problems.append("planted")
        with pytest.raises(AssertionError, match="planted"):
            machine.observer.stop()
        machine.observer.problems.clear()
    finally:
        machine.observer = None
        machine.teardown()


# -- cases the machine finds, kept as plain tests (each one step sequence, named) ------------------


def _two_groups():
    scheduler = Scheduler("cpu")
    modules = {"a": make_block(16, seed=1), "b": make_block(16, seed=2)}
    plain = {name: twin(m) for name, m in modules.items()}
    for name, module in modules.items():
        scheduler.add(name, module)
    return scheduler, modules, plain


def _assert_same(module: nn.Module, reference: nn.Module) -> None:
    for (key, ours), (_, theirs) in zip(tensors_of(module), tensors_of(reference)):
        same = same_bits(ours, theirs)
        assert same, f"{key} differs from the reference"


def _mul_in_place(module, _):
    with torch.no_grad():
        module[0].weight.mul_(2.0)


def _replace_data(module, new):
    module[0].weight.data = new.clone()


def _load_state_dict(module, new):
    state = dict(module.state_dict())
    state["0.weight"] = new
    module.load_state_dict(state)


_EDITS = pytest.mark.parametrize(
    "edit", [_mul_in_place, _replace_data, _load_state_dict],
    ids=["mul_no_grad", "data_replaced", "load_state_dict"],
)


@pytest.mark.fast
@_EDITS
def test_an_edit_made_while_a_group_is_prefetched_is_not_lost(edit):
    scheduler, modules, plain = _two_groups()
    new = torch.randn(16, 16)
    x = torch.randn(2, 16)
    with scheduler.resident("a"):
        if not scheduler.prefetch("b"):
            pytest.skip("prefetch did not start")
        for module in (modules["b"], plain["b"]):
            edit(module, new)
    with scheduler.resident("b"):
        _assert_same(modules["b"], plain["b"])
        same = torch.equal(forward(modules["b"], x), forward(plain["b"], x))
        assert same, "the output differs from the reference"
    scheduler.close()


@pytest.mark.fast
@_EDITS
def test_an_edit_made_while_a_group_is_prefetched_survives_the_cancel(edit):
    scheduler, modules, plain = _two_groups()
    new = torch.randn(16, 16)
    with scheduler.resident("a"):
        if not scheduler.prefetch("b"):
            pytest.skip("prefetch did not start")
        for module in (modules["b"], plain["b"]):
            edit(module, new)
    scheduler.offload_all()  # cancels the prefetch
    _assert_same(modules["b"], plain["b"])
    with scheduler.resident("b"):
        _assert_same(modules["b"], plain["b"])
    scheduler.close()


class SharedStorage(nn.Module):
    """A weight and a buffer that views its first row (two tensors, one storage)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("first_row", self.weight.detach()[0])


@pytest.mark.fast
@pytest.mark.parametrize("while_", ["resident", "offloaded"])
def test_new_storage_for_one_of_two_tensors_sharing_storage_leaves_the_other_alone(while_):
    """Eager semantics: after ``weight.data = new`` the old view keeps the old values.

    The untied tensors are adopted at the next phase change - the group is re-packed into a new
    host master, never refused - and neither tensor's values are mixed up.
    """
    scheduler = Scheduler("cpu")
    shared, other = SharedStorage(), make_block(8, seed=6)
    old_row = shared.first_row.clone()
    scheduler.add("shared", shared)
    scheduler.add("other", other)
    packed = scheduler["shared"].host_master
    with scheduler.resident("shared" if while_ == "resident" else "other"):
        shared.weight.data = torch.zeros(4, 4)
    for name in ("other", "shared", "other"):
        with scheduler.resident(name):
            assert torch.equal(shared.weight, torch.zeros(4, 4)), "the new storage was lost"
            kept = torch.equal(shared.first_row, old_row)
            assert kept, f"the untouched view changed in {name!r}'s phase"
    group = scheduler["shared"]
    assert group.host_master is not packed, "the untied tensors were not adopted (re-packed)"
    assert on_host_master(group) and shared.weight.data_ptr() != shared.first_row.data_ptr()
    scheduler.close()


@pytest.mark.fast
def test_new_storage_with_other_strides_keeps_its_layout():
    """``weight.data = w.T.contiguous().T``: same shape and values, other strides.

    The layout picks the matmul kernel, so a changed layout changes the output's last bits.
    The new layout is adopted at the next phase change (the group is re-packed into a new host
    master with it), never refused.
    """
    scheduler, modules, plain = _two_groups()
    packed = scheduler["b"].host_master
    new = torch.randn(16, 16).T.contiguous().T
    with scheduler.resident("b"):
        modules["b"][0].weight.data = new
        plain["b"][0].weight.data = new.clone()
    for name in ("a", "b", "a", "b"):
        with scheduler.resident(name):
            ours, theirs = modules["b"][0].weight, plain["b"][0].weight
            assert torch.equal(ours, theirs)
            for batch in (1, 3, 8, 33):
                x = torch.randn(batch, 16)
                same = torch.equal(forward(modules["b"], x), forward(plain["b"], x))
                assert same, f"outputs differ for a batch of {batch}"
            assert ours.stride() == theirs.stride(), "the layout the user chose was changed"
    assert scheduler["b"].host_master is not packed, "the new layout was not adopted (re-packed)"
    scheduler.close()
