"""The core contract of issue 2: bit-identity, where storage lives, write-back, nesting, errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from residency import (
    NoOffload,
    PhaseError,
    RegistrationError,
    ResidencyError,
    ResidencyState,
    Scheduler,
    SchedulerClosedError,
    UnknownGroupError,
)

from _helpers import in_buffer
from conftest import CountingTransport, make_block, run_block, twin

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


class TiedLM(nn.Module):
    """Embedding and output head share one Parameter; rotary-style non-persistent buffer."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freqs", torch.arange(width, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids)) + self.freqs))


def in_chunks(tensor: torch.Tensor, chunks: list[torch.Tensor]) -> bool:
    pointer = tensor.data_ptr()
    return any(c.data_ptr() <= pointer < c.data_ptr() + c.numel() for c in chunks)


def three_groups(scheduler: Scheduler):
    modules = {name: make_block(seed=i) for i, name in enumerate(["enc", "dit", "vae"])}
    plain = {name: twin(m) for name, m in modules.items()}
    scheduler.add("enc", modules["enc"])
    scheduler.add("dit", modules["dit"])
    scheduler.add("vae", modules["vae"], policy="resident")
    return modules, plain


# -- bit identity and where storage lives ------------------------------------------------------


def test_outputs_are_bit_identical_to_the_model_never_offloaded(scheduler):
    modules, plain = three_groups(scheduler)
    x = torch.randn(3, 32)
    for _ in range(3):
        with scheduler.resident("enc"):
            got_enc = run_block(modules["enc"], x)
        with scheduler.resident("dit"):
            got_dit = run_block(modules["dit"], got_enc)
        got = run_block(modules["vae"], got_dit)
    want = run_block(plain["vae"], run_block(plain["dit"], run_block(plain["enc"], x)))
    assert torch.equal(got, want)


def test_resident_tensors_live_in_device_storage_and_return_to_the_same_host_master(scheduler):
    modules, _ = three_groups(scheduler)
    dit = scheduler["dit"]
    host_ptrs = [v.data_ptr() for v in dit.host_master.views]
    assert [t.data_ptr() for t in dit.tensors] == host_ptrs
    for _ in range(3):
        with scheduler.resident("dit"):
            assert dit.is_resident and dit.state is ResidencyState.RESIDENT
            for tensor in dit.tensors:
                assert in_buffer(tensor, dit.device_storage.buffer)
                assert not in_chunks(tensor, dit.host_master.chunks)
        with scheduler.resident("enc"):
            assert not dit.is_resident
            assert [t.data_ptr() for t in dit.tensors] == host_ptrs


def test_resident_policy_group_is_placed_at_add_and_never_evicted(scheduler):
    modules, _ = three_groups(scheduler)
    vae = scheduler["vae"]
    assert vae.is_resident
    with scheduler.resident("enc"):
        with scheduler.resident("dit"):
            assert vae.is_resident
    scheduler.offload_all()
    assert vae.is_resident
    assert all(in_buffer(t, vae.device_storage.buffer) for t in vae.tensors)
    assert scheduler.resident_groups() == ["vae"]


def test_at_most_one_exclusive_group_is_resident(scheduler):
    three_groups(scheduler)
    for name in ["enc", "dit", "enc", "enc", "dit"]:
        with scheduler.resident(name):
            exclusive = [n for n in scheduler.resident_groups() if scheduler[n].exclusive]
            assert exclusive == [name]
            assert scheduler.current == name


def test_device_storage_is_reused_and_addresses_are_stable(scheduler):
    modules, _ = three_groups(scheduler)
    with scheduler.resident("dit"):
        first = [t.data_ptr() for t in scheduler["dit"].tensors]
        buffer_ptr = scheduler["dit"].device_storage.buffer.data_ptr()
    for _ in range(3):
        with scheduler.resident("enc"):
            assert scheduler["enc"].device_storage.buffer.data_ptr() == buffer_ptr
        with scheduler.resident("dit"):
            assert [t.data_ptr() for t in scheduler["dit"].tensors] == first


def test_load_is_one_bulk_copy_per_chunk_and_unchanged_eviction_copies_nothing():
    transport = CountingTransport()
    scheduler = Scheduler("cpu", transport=transport, chunk_nbytes=4096)
    a, b = make_block(width=32, seed=1), make_block(width=32, seed=2)
    scheduler.add("a", a)
    scheduler.add("b", b)
    chunks = len(scheduler["a"].host_master.chunks)
    assert chunks > 1, "the layout should span several chunks at this chunk size"
    with scheduler.resident("a"):
        pass
    assert transport.to_device_pairs == chunks
    with scheduler.resident("b"):
        pass
    assert transport.to_host_pairs == 0
    assert scheduler.transitions[-1].written_back == 0
    assert transport.device_allocations == 1


def test_reentering_the_resident_group_does_no_tensor_work():
    transport = CountingTransport()
    scheduler = Scheduler("cpu", transport=transport)
    block = make_block()
    scheduler.add("dit", block)
    scheduler.add("enc", make_block(seed=3))
    with scheduler.resident("dit"):
        pass
    copies, transitions = transport.to_device_pairs, scheduler.transitions.count
    ptrs = [t.data_ptr() for t in scheduler["dit"].tensors]
    for _ in range(100):
        with scheduler.resident("dit"):
            with scheduler.resident("dit"):
                pass
    assert (transport.to_device_pairs, scheduler.transitions.count) == (copies, transitions)
    assert [t.data_ptr() for t in scheduler["dit"].tensors] == ptrs


def test_host_master_is_about_one_times_the_weights(scheduler):
    big = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    group = scheduler.add("big", big)
    weights = sum(p.numel() * p.element_size() for p in big.parameters())
    assert group.nbytes == weights
    assert weights <= group.host_master.nbytes <= weights * 1.02


def test_chunked_layout_with_an_oversize_tensor_stays_bit_identical():
    scheduler = Scheduler("cpu", chunk_nbytes=1024)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))  # 16 KiB weight > chunk
    plain = twin(model)
    group = scheduler.add("m", model)
    assert max(c.numel() for c in group.host_master.chunks) == 64 * 64 * 4
    scheduler.add("other", make_block())
    x = torch.randn(2, 64)
    for name in ["m", "other", "m"]:
        with scheduler.resident(name):
            pass
    with scheduler.resident("m"):
        assert torch.equal(model(x), plain(x))


# -- tied and shared weights -----------------------------------------------------------------


def test_tied_weights_stay_tied_and_count_once(scheduler):
    model = TiedLM()
    plain = twin(model)
    group = scheduler.add("lm", model)
    scheduler.add("other", make_block())
    unique = {id(p): p for p in list(model.parameters()) + list(model.buffers())}.values()
    assert group.nbytes == sum(t.numel() * t.element_size() for t in unique)
    ids = torch.tensor([[1, 2, 3]])
    for name in ["lm", "other", "lm"]:
        with scheduler.resident(name):
            assert model.head.weight is model.embed.weight
    with scheduler.resident("lm"):
        assert torch.equal(model(ids), plain(ids))
        with torch.no_grad():
            model.embed.weight[0].fill_(1.5)
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    with scheduler.resident("other"):
        assert torch.equal(model.head.weight[0], torch.full((16,), 1.5))


def test_overlapping_tensors_stay_views_of_one_region(scheduler):
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(4, 8))
    module.register_buffer("row", module.weight.detach()[1])  # overlaps the weight
    group = scheduler.add("shared", module)
    scheduler.add("other", make_block())
    assert group.nbytes == 4 * 8 * 4
    for name in ["shared", "other", "shared"]:
        with scheduler.resident(name):
            assert module.row.data_ptr() - module.weight.data_ptr() == 8 * 4
    with scheduler.resident("shared"):
        with torch.no_grad():
            module.weight[1].fill_(2.0)
        assert torch.equal(module.row, torch.full((8,), 2.0))
    with scheduler.resident("other"):
        assert torch.equal(module.row, torch.full((8,), 2.0))


def test_side_by_side_tensors_of_one_storage_are_packed_apart_with_their_values(scheduler):
    base = torch.randn(20)
    module = nn.Module()
    module.first = nn.Parameter(base[:10])
    module.second = nn.Parameter(base[10:])
    group = scheduler.add("pair", module)
    scheduler.add("other", make_block())
    assert group.nbytes == 20 * 4
    with scheduler.resident("pair"):
        assert torch.equal(torch.cat([module.first, module.second]), base)
        module.first.data = torch.zeros(10)  # new storage for one leaves the other alone
    with scheduler.resident("other"):
        assert torch.equal(module.first, torch.zeros(10))
        assert torch.equal(module.second, base[10:])


# -- nothing is lost: write-back -------------------------------------------------------------


def _edit_and_swap(scheduler, edit):
    block = make_block(seed=7)
    plain = twin(block)
    group = scheduler.add("g", block)
    scheduler.add("other", make_block(seed=8))
    with scheduler.resident("g"):
        edit(block)
    edit(plain)
    with scheduler.resident("other"):
        assert all(in_chunks(t, group.host_master.chunks) for t in group.tensors)
        for mine, theirs in zip(block.state_dict().values(), plain.state_dict().values()):
            assert torch.equal(mine, theirs)
    with scheduler.resident("g"):
        x = torch.randn(2, 32)
        assert torch.equal(run_block(block, x), run_block(plain, x))
    return scheduler.transitions


def _mul_under_no_grad(block):
    with torch.no_grad():
        block[0].weight.mul_(2)


def _optimizer_step(block):
    torch.manual_seed(11)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    run_block(block, torch.randn(2, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _load_state_dict(block):
    block.load_state_dict(make_block(seed=99).state_dict())


def _replace_data(block):  # LoRA-fuse style: new storage, same shape and dtype
    block[0].weight.data = block[0].weight.detach() + 0.25


def _buffer_in_place(block):
    block.scale.add_(1.0)


@pytest.mark.parametrize(
    "edit",
    [_mul_under_no_grad, _optimizer_step, _load_state_dict, _replace_data, _buffer_in_place],
    ids=["mul_no_grad", "optimizer_step", "load_state_dict", "data_replaced", "buffer_in_place"],
)
def test_changes_made_while_resident_survive_eviction(scheduler, edit):
    transitions = _edit_and_swap(scheduler, edit)
    assert any(record.written_back > 0 for record in transitions)


def test_edits_through_dot_data_need_mark_dirty(scheduler):
    block = make_block(seed=3)
    group = scheduler.add("g", block)
    scheduler.add("other", make_block())
    with scheduler.resident("g"):
        block[0].weight.data.mul_(3)  # invisible to the version counter
        expected = block[0].weight.detach().clone()
        group.mark_dirty()
    with scheduler.resident("other"):
        assert torch.equal(block[0].weight, expected)


def test_edits_made_while_offloaded_reach_the_device(scheduler):
    block = make_block(seed=4)
    plain = twin(block)
    scheduler.add("g", block)
    with torch.no_grad():
        block[3].bias.fill_(0.5)
        plain[3].bias.fill_(0.5)
    with scheduler.resident("g"):
        x = torch.randn(2, 32)
        assert torch.equal(run_block(block, x), run_block(plain, x))


def test_an_alias_kept_by_user_code_is_never_overwritten(scheduler):
    a, b = make_block(seed=1), make_block(seed=2)
    scheduler.add("a", a)
    scheduler.add("b", b)
    with scheduler.resident("a"):
        kept = a[0].weight.detach()  # shares the device buffer
        snapshot = kept.clone()
        old_buffer = scheduler["a"].device_storage.buffer.data_ptr()
    with scheduler.resident("b"):
        assert scheduler["b"].device_storage.buffer.data_ptr() != old_buffer
        assert torch.equal(kept, snapshot)
    del kept
    with scheduler.resident("a"):
        pass
    with scheduler.resident("b"):
        pass  # no alias any more: the buffer is reused from here on
    ptr = scheduler["b"].device_storage.buffer.data_ptr()
    with scheduler.resident("a"):
        assert scheduler["a"].device_storage.buffer.data_ptr() == ptr


# -- phases: nesting, exceptions, records ----------------------------------------------------


def test_nested_phase_swaps_and_brings_the_outer_group_back(scheduler):
    modules, plain = three_groups(scheduler)
    x = torch.randn(2, 32)
    with scheduler.resident("enc"):
        with scheduler.resident("dit"):
            assert scheduler.current == "dit"
            inner = run_block(modules["dit"], x)
        assert scheduler.current == "enc"
        assert scheduler["enc"].is_resident and not scheduler["dit"].is_resident
        outer = run_block(modules["enc"], inner)
    assert torch.equal(outer, run_block(plain["enc"], run_block(plain["dit"], x)))
    assert [(r.from_group, r.to_group) for r in scheduler.transitions][-3:] == [
        (None, "enc"), ("enc", "dit"), ("dit", "enc")
    ]


def test_resident_policy_phase_inside_an_exclusive_phase_keeps_it(scheduler):
    three_groups(scheduler)
    with scheduler.resident("dit"):
        with scheduler.resident("vae"):
            assert scheduler.current == "dit"
        assert scheduler.current == "dit"


def test_an_exception_inside_a_phase_propagates_and_leaves_the_scheduler_consistent(scheduler):
    modules, plain = three_groups(scheduler)
    with pytest.raises(ZeroDivisionError):
        with scheduler.resident("enc"):
            with scheduler.resident("dit"):
                1 / 0
    assert scheduler.current == "enc"
    with scheduler.resident("dit"):
        x = torch.randn(2, 32)
        assert torch.equal(run_block(modules["dit"], x), run_block(plain["dit"], x))
    scheduler.offload_all()
    assert scheduler.current is None


def test_transition_records_name_groups_bytes_and_seconds(scheduler):
    three_groups(scheduler)
    with scheduler.resident("enc"):
        pass
    with scheduler.resident("dit"):
        pass
    record = scheduler.transitions[-1]
    assert (record.from_group, record.to_group) == ("enc", "dit")
    assert record.nbytes == scheduler["dit"].host_master.nbytes
    assert record.seconds > 0 and record.written_back == 0
    assert scheduler.transitions.count == len(scheduler.transitions)


def test_the_timed_load_totals_count_every_transition_past_the_limit_and_a_clear():
    """What an auto plan's copy bandwidth is taken from: the loads that moved bytes in a
    measured time, all of them (the kept records are only the newest)."""
    from residency.group.records import TransitionLog, TransitionRecord

    log = TransitionLog(limit=1)
    for nbytes, load_seconds in ((100, 0.5), (0, 0.25), (50, 0.0), (300, 1.5)):
        log.append(TransitionRecord(from_group="a", to_group="b", nbytes=nbytes, written_back=0,
                                    start=0.0, evict_seconds=0.0, load_seconds=load_seconds,
                                    thread="main"))
    log.clear()
    assert (len(log), log.count, log.nbytes) == (0, 4, 450)
    assert (log.timed_nbytes, log.timed_seconds) == (400, 2.0)


def test_offload_all_returns_every_exclusive_group_to_the_host(scheduler):
    three_groups(scheduler)
    with scheduler.resident("dit"):
        with pytest.raises(PhaseError, match="cannot offload all groups while a phase is active"):
            scheduler.offload_all()
    scheduler.offload_all()
    assert scheduler.current is None
    assert scheduler.device_nbytes == scheduler["vae"].device_storage.nbytes
    for name in ["enc", "dit"]:
        assert all(in_chunks(t, scheduler[name].host_master.chunks) for t in scheduler[name].tensors)


def test_a_phase_is_not_reusable(scheduler):
    three_groups(scheduler)
    phase = scheduler.resident("dit")
    assert "new" in repr(phase)
    with phase:
        assert "active" in repr(phase)
    assert "exited" in repr(phase)
    with pytest.raises(PhaseError, match="a phase is not reusable"):
        with phase:
            pass


def test_phases_left_out_of_order_are_refused(scheduler):
    three_groups(scheduler)
    outer, inner = scheduler.resident("enc"), scheduler.resident("dit")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(PhaseError, match="leave phases in the reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)  # closes the outer phase too: its exit was already asked
    outer.__exit__(None, None, None)  # a retried exit does nothing
    assert scheduler.current == "dit"


def test_aliases_enter_their_group(scheduler):
    three_groups(scheduler)
    scheduler.alias("pipe.transformer", "dit")
    assert "pipe.transformer" in scheduler
    with scheduler.resident("pipe.transformer") as group:
        assert group is scheduler["dit"] and scheduler.current == "dit"


# -- registration errors: each refused call changes nothing ----------------------------------


def test_a_near_miss_is_answered_with_the_nearest_name_and_no_add_suggestion(scheduler):
    three_groups(scheduler)
    with pytest.raises(UnknownGroupError) as refused:
        scheduler.resident("ditt")
    assert str(refused.value) == (
        "no group named 'ditt'; did you mean 'dit'? The groups are 'dit', 'enc', 'vae'.")


def test_a_name_near_no_group_suggests_registering_it(scheduler):
    three_groups(scheduler)
    with pytest.raises(UnknownGroupError) as refused:
        scheduler["nothing_like_it"]
    assert str(refused.value) == (
        "no group named 'nothing_like_it'. The groups are 'dit', 'enc', 'vae'. To make a group "
        "of that name, register its modules first: scheduler.add('nothing_like_it', modules).")
    empty = Scheduler("cpu")
    with pytest.raises(UnknownGroupError, match=r"^no group named 'dit'\. No groups are "
                       r"registered yet\. To make a group of that name, register its modules "
                       r"first: scheduler\.add\('dit', modules\)\.$"):
        empty.resident("dit")
    empty.close()


def test_aliases_are_listed_apart_from_the_groups_and_can_be_the_near_miss(scheduler):
    three_groups(scheduler)
    scheduler.alias("pipe.transformer", "dit")
    with pytest.raises(UnknownGroupError) as refused:
        scheduler.resident("pipe.transfomer")
    assert str(refused.value) == (
        "no group named 'pipe.transfomer'; did you mean 'pipe.transformer'? The groups are "
        "'dit', 'enc', 'vae'. The aliases (module paths that enter a group) are "
        "'pipe.transformer' (group 'dit').")


def test_a_category_name_says_which_groups_were_made_for_it(scheduler):
    """Groups made from a pipeline are named after components; asking for "dit" says which,
    without suggesting a group named after the category."""
    scheduler.add("transformer", make_block(seed=1), category="dit")
    scheduler.add("transformer_2", make_block(seed=2), category="dit")
    scheduler.add("text_encoder", make_block(seed=3), category="text_encoder")
    with pytest.raises(UnknownGroupError) as refused:
        scheduler.resident("dit")
    assert str(refused.value) == (
        "no group named 'dit'. Groups made from a pipeline are named after their components, "
        "not by category; the 'dit' components here are 'transformer', 'transformer_2'. The "
        "groups are 'text_encoder', 'transformer', 'transformer_2'.")
    with pytest.raises(UnknownGroupError, match=r"the 'vae' components here are none \(that "
                       r"category was not registered\)\. The groups are "):
        scheduler.resident("vae")


def test_a_name_that_is_not_a_string_is_refused_without_suggesting_it(scheduler):
    three_groups(scheduler)
    with pytest.raises(UnknownGroupError) as refused:
        scheduler.resident(None)
    assert str(refused.value) == (
        "group names are strings, not NoneType (None). The groups are 'dit', 'enc', 'vae'.")
    with pytest.raises(UnknownGroupError, match="group names are strings, not list"):
        scheduler.resident(["dit"])


def test_duplicate_name_is_refused(scheduler):
    scheduler.add("a", make_block())
    with pytest.raises(RegistrationError, match="a group named 'a' is already registered; choose another name"):
        scheduler.add("a", make_block(seed=1))
    assert len(scheduler) == 1


def test_bad_modules_are_refused(scheduler):
    with pytest.raises(RegistrationError, match="the module list is empty; pass at least one nn.Module"):
        scheduler.add("a", [])
    with pytest.raises(RegistrationError, match="hold no parameters or buffers"):
        scheduler.add("a", nn.GELU())
    with pytest.raises(RegistrationError, match="item 1 is a Tensor, not an nn.Module"):
        scheduler.add("a", [make_block(), torch.zeros(2)])
    with pytest.raises(RegistrationError, match="expected an nn.Module or an iterable of them, got str"):
        scheduler.add("a", "text_encoder")
    with pytest.raises(RegistrationError, match="a group name must be a non-empty string"):
        scheduler.add("", make_block())
    assert len(scheduler) == 0


def test_policy_typo_lists_the_accepted_policies(scheduler):
    with pytest.raises(RegistrationError, match="unknown policy 'residnet'; accepted policies are 'exclusive', 'resident'"):
        scheduler.add("a", make_block(), policy="residnet")


def test_meta_tensors_are_refused(scheduler):
    with torch.device("meta"):
        block = nn.Linear(4, 4)
    with pytest.raises(RegistrationError, match="on the meta device and holds no data"):
        scheduler.add("a", block)


def test_a_module_in_two_groups_is_refused_and_nothing_changes(scheduler):
    shared = nn.Linear(8, 8)
    first = nn.Sequential(shared, nn.ReLU())
    scheduler.add("first", first)
    second = nn.Sequential(nn.Linear(8, 8), shared)
    own = second[0].weight
    before = own.data_ptr()
    with pytest.raises(RegistrationError, match="cannot add group 'second': its Linear module already belongs to group 'first'"):
        scheduler.add("second", second)
    assert "second" not in scheduler and own.data_ptr() == before


def test_a_tensor_shared_with_another_group_is_refused(scheduler):
    first = nn.Linear(8, 8)
    scheduler.add("first", first)
    second = nn.Linear(8, 8)
    second.weight = first.weight  # tied across groups
    with pytest.raises(RegistrationError, match="parameter 'weight' of Linear shares storage with group 'first'"):
        scheduler.add("second", second)
    with scheduler.resident("first"):
        assert scheduler.current == "first"


def test_a_closed_scheduler_refuses_use_and_modules_stay_usable():
    scheduler = Scheduler("cpu")
    block = make_block()
    plain = twin(block)
    scheduler.add("a", block)
    with scheduler.resident("a"):
        pass
    scheduler.close()
    x = torch.randn(2, 32)
    assert torch.equal(run_block(block, x), run_block(plain, x))
    closed = ("this scheduler was closed; its modules are back in host memory. Create a new "
              "Scheduler and add the modules again to keep offloading")
    with pytest.raises(SchedulerClosedError) as refused:
        scheduler.resident("a").__enter__()
    assert str(refused.value) == closed
    with pytest.raises(SchedulerClosedError) as refused:
        scheduler.add("b", make_block())
    assert str(refused.value) == closed


def test_every_error_is_a_residency_error():
    for error in [RegistrationError, UnknownGroupError, PhaseError, SchedulerClosedError]:
        assert issubclass(error, ResidencyError)


# -- the offload-off scheduler ---------------------------------------------------------------


def test_no_offload_runs_phase_code_unchanged():
    scheduler = NoOffload()
    block = make_block()
    plain = twin(block)
    x = torch.randn(2, 32)
    with scheduler.resident("anything"):  # no groups added: any name
        assert torch.equal(run_block(block, x), run_block(plain, x))
    scheduler.add("g", block)
    with scheduler.resident("g"):
        assert torch.equal(run_block(block, x), run_block(plain, x))
    assert "g" in scheduler and list(scheduler) == ["g"] and scheduler.current is None


def test_a_no_offload_that_knows_its_groups_refuses_others_as_a_scheduler_does(scheduler):
    three_groups(scheduler)
    scheduler.alias("pipe.transformer", "dit")
    off = NoOffload()
    off.add("enc", make_block(seed=0))
    off.add("dit", make_block(seed=1))
    off.add("vae", make_block(seed=2), policy="resident")
    off.alias("pipe.transformer", "dit")
    with off.resident("pipe.transformer"), off.resident("vae"):
        pass
    assert "pipe.transformer" in off and list(off) == ["enc", "dit", "vae"]
    for name in ("ditt", "pipe.transfomer", "nothing_like_it", "text_encoder", None, ["dit"]):
        with pytest.raises(UnknownGroupError) as theirs:
            scheduler.resident(name)
        with pytest.raises(UnknownGroupError) as ours:
            off.resident(name)
        assert str(ours.value) == str(theirs.value), name
    with pytest.raises(UnknownGroupError) as theirs:
        scheduler.alias("pipe.vae", "vea")
    with pytest.raises(UnknownGroupError) as ours:
        off.alias("pipe.vae", "vea")
    assert str(ours.value) == str(theirs.value)
    off.remove("dit")
    assert "pipe.transformer" not in off
    with pytest.raises(UnknownGroupError, match="did you mean 'enc'"):
        off.resident("en")


def test_default_device_is_the_cpu_without_an_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    assert Scheduler().device == torch.device("cpu")


def test_close_inside_a_phase_is_refused_and_changes_nothing(scheduler):
    three_groups(scheduler)
    with scheduler.resident("dit"):
        with pytest.raises(PhaseError, match="cannot close the scheduler while a phase is active"):
            scheduler.close()
        assert len(scheduler) == 3 and scheduler.current == "dit"


def test_excluded_submodules_can_form_groups_of_their_own(scheduler):
    model = nn.Module()
    model.pos_embed = nn.Parameter(torch.randn(32))  # held directly by the parent
    model.reasoner, model.generator = make_block(seed=1), make_block(seed=2)
    plain = twin(model)
    shared = scheduler.add("shared", model, policy="resident",
                           exclude=[model.reasoner, model.generator])
    scheduler.add("reasoner", model.reasoner)
    scheduler.add("generator", model.generator)
    assert shared.tensors == (model.pos_embed,)
    x = torch.randn(2, 32)
    with scheduler.resident("reasoner"):
        hidden = run_block(model.reasoner, x + model.pos_embed)
    with scheduler.resident("generator"):
        out = run_block(model.generator, hidden)
    expected = run_block(plain.generator, run_block(plain.reasoner, x + plain.pos_embed))
    assert torch.equal(out, expected)
    assert scheduler.resident_groups() == ["shared", "generator"]


def test_exclude_takes_only_submodules(scheduler):
    with pytest.raises(RegistrationError, match="exclude= takes submodules of the modules being added"):
        scheduler.add("a", make_block(), exclude=[nn.Linear(2, 2)])
    assert len(scheduler) == 0


def test_phases_under_inference_mode_do_not_poison_later_loads(scheduler):
    a, b = make_block(seed=1), make_block(seed=2)
    plain = twin(a)
    x = torch.randn(2, 32)
    with torch.inference_mode():
        scheduler.add("a", a)
        scheduler.add("b", b)
        with scheduler.resident("a"):
            run_block(a, x)
        with scheduler.resident("b"):
            run_block(b, x)
    with scheduler.resident("a"):
        with torch.no_grad():
            a[0].weight.add_(1.0)
            plain[0].weight.add_(1.0)
    with scheduler.resident("b"):
        pass
    with scheduler.resident("a"):
        assert torch.equal(run_block(a, x), run_block(plain, x))


def test_an_edit_made_while_offloaded_then_loaded_again_is_kept(scheduler):
    block = make_block(seed=9)
    plain = twin(block)
    scheduler.add("g", block)
    scheduler.add("other", make_block())
    for _ in range(2):
        with torch.no_grad():
            block[0].bias.add_(1.0)
            plain[0].bias.add_(1.0)
        with scheduler.resident("g"):
            pass
        with scheduler.resident("other"):
            pass
    assert torch.equal(block[0].bias, plain[0].bias)


# -- found in review ---------------------------------------------------------------------------


def test_a_phase_made_before_remove_cannot_bring_the_group_back(scheduler):
    three_groups(scheduler)
    phase = scheduler.resident("dit")
    scheduler.remove("dit")
    with pytest.raises(UnknownGroupError, match="was removed or refreshed after this phase was created"):
        with phase:
            pass
    assert scheduler.current is None and "dit" not in scheduler


def test_refresh_keeps_the_group_name_and_its_aliases(scheduler):
    three_groups(scheduler)
    scheduler.alias("pipe.transformer", "dit")
    group = scheduler.refresh("pipe.transformer")
    assert group.name == "dit" and list(scheduler) == ["enc", "vae", "dit"]
    with scheduler.resident("pipe.transformer") as entered:
        assert entered is scheduler["dit"]


def test_close_inside_a_resident_policy_phase_is_refused_and_changes_nothing(scheduler):
    three_groups(scheduler)
    with scheduler.resident("dit"):
        pass
    with scheduler.resident("vae"):
        with pytest.raises(PhaseError, match="cannot close the scheduler with group 'vae' while a phase"):
            scheduler.close()
    assert list(scheduler) == ["enc", "dit", "vae"] and scheduler.current == "dit"
    scheduler.close()
    with pytest.raises(SchedulerClosedError):
        scheduler.resident("dit")


def test_prefetch_counts_the_buffer_it_would_really_allocate():
    small, big = make_block(width=8, seed=1), make_block(width=64, seed=2)
    probe = Scheduler("cpu")
    one_big = probe.add("big", make_block(width=64)).inventory.layout.contiguous_nbytes
    scheduler = Scheduler("cpu", device_memory_limit=one_big + one_big // 2)
    scheduler.add("small", small)
    scheduler.add("big", big)
    with scheduler.resident("big"):
        assert not scheduler.prefetch("small"), "a second buffer is sized for the largest group"
    assert scheduler.device_nbytes <= scheduler.device_memory_limit


def test_aliases_are_checked(scheduler):
    three_groups(scheduler)
    scheduler.alias("pipe.enc", "enc")
    with pytest.raises(RegistrationError, match="'pipe.enc' already leads to group 'enc'"):
        scheduler.alias("pipe.enc", "dit")
    with pytest.raises(RegistrationError, match="'enc' is the name of group 'enc'"):
        scheduler.alias("enc", "dit")
    with pytest.raises(RegistrationError, match="an alias must be a non-empty string"):
        scheduler.alias("", "dit")
    with pytest.raises(RegistrationError, match="a group named 'pipe.enc' is already registered"):
        scheduler.add("pipe.enc", make_block(seed=5))
    with scheduler.resident("pipe.enc") as group:
        assert group.name == "enc"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"chunk_nbytes": 0}, "chunk_nbytes=0; give a positive whole number of bytes"),
        ({"device_memory_limit": "8GB"}, "device_memory_limit='8GB'; give a whole number of bytes"),
        ({"wait_timeout": -5}, "wait_timeout=-5; give a positive number of seconds"),
        ({"record_limit": -1}, r"record_limit=-1; give a whole number of records \(>= 0\)"),
        ({"pin_memory": "no"}, "pin_memory='no'; give True, False, or None"),
        ({"device": "tpu:9"}, "device 'tpu:9' is not"),
    ],
)
def test_scheduler_options_are_checked(options, message):
    from residency import ConfigError

    with pytest.raises(ConfigError, match=message):
        Scheduler(**options)


def test_a_groups_verbs_refuse_a_move_its_state_does_not_allow_and_change_nothing(scheduler):
    """A group's verbs are public for the placements (docs/design.md); one called in the wrong
    state says what it needs and leaves the group as it was."""
    from residency import PhaseError

    model = make_block()
    group = scheduler.add("a", model)
    before = [t.data_ptr() for t in model.state_dict().values()]
    for verb, action, needed in [(group.evict, "evict", "resident"),
                                 (group.finish_load, "finish loading", "loading"),
                                 (group.cancel_load, "cancel loading", "loading")]:
        with pytest.raises(PhaseError, match=f"cannot {action} group 'a': it is offloaded, "
                                             f"and {action} needs it {needed}"):
            verb()
    assert group.state is ResidencyState.OFFLOADED
    assert [t.data_ptr() for t in model.state_dict().values()] == before


def test_a_resident_policy_phase_of_a_removed_group_is_refused(scheduler):
    three_groups(scheduler)
    phase = scheduler.resident("vae")
    scheduler.remove("vae")
    with pytest.raises(UnknownGroupError, match="'vae' was removed or refreshed"):
        with phase:
            pass


class GatedTransport(CountingTransport):
    """Host allocation waits for a gate: `add` is caught in the middle of packing."""

    def __init__(self) -> None:
        super().__init__()
        self.packing = threading.Event()
        self.gate = threading.Event()

    def allocate_host(self, nbytes, *, pin):
        if not self.gate.is_set():
            self.packing.set()
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().allocate_host(nbytes, pin=pin)


def test_phases_of_other_groups_run_while_a_group_is_being_packed():
    transport = GatedTransport()
    transport.gate.set()
    scheduler = Scheduler("cpu", transport=transport)
    ready = make_block(seed=1)
    scheduler.add("ready", ready)
    transport.gate.clear()
    slow = make_block(seed=2)
    plain = twin(slow)
    adder = threading.Thread(target=scheduler.add, args=("slow", slow), daemon=True)
    adder.start()
    assert transport.packing.wait(timeout=30)
    with scheduler.resident("ready"):  # would wait for the whole pack if add held the lock
        assert scheduler.current == "ready"
    with pytest.raises(RegistrationError, match="a group named 'slow' is already registered"):
        scheduler.add("slow", make_block(seed=3))
    with pytest.raises(RegistrationError, match="already belongs to group 'slow'"):
        scheduler.add("again", slow)
    transport.gate.set()
    adder.join(timeout=30)
    assert not adder.is_alive()
    x = torch.randn(2, 32)
    with scheduler.resident("slow"):
        assert torch.equal(run_block(slow, x), run_block(plain, x))
    scheduler.close()


@pytest.mark.parametrize("taken", ["enc", "pipe.enc"], ids=["group", "alias"])
def test_a_taken_name_is_refused_in_one_wording_by_scheduler_and_no_offload(scheduler, taken):
    """`arguments.check_name` is the one name check: the registry's and NoOffload's."""
    off = NoOffload()
    for registrar in (scheduler, off):
        registrar.add("enc", make_block(seed=0))
        registrar.alias("pipe.enc", "enc")
    messages = []
    for registrar in (scheduler, off):
        with pytest.raises(RegistrationError) as refused:
            registrar.add(taken, make_block(seed=5))
        messages.append(str(refused.value))
    assert messages[0] == messages[1] == (
        f"a group named {taken!r} is already registered; choose another name, or call "
        f"scheduler.remove({taken!r}) first")
    assert list(scheduler) == ["enc"] and list(off) == ["enc"]
