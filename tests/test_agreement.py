"""Rank agreement (residency.multirank.agreement) with real processes and gloo on the CPU.

Each world (tests/_dist.py) runs several scenarios in turn on one group: every agreement either
succeeds on every rank or raises on every rank with the same message, so the group stays usable
for the next scenario.  Only the timeout tests break their group, each in its own world.
Fingerprints, layouts and refusals that need no group run in this process.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import attrs
import pytest
import torch
import torch.distributed as dist

from residency.multirank.agreement import (
    PhaseLedger,
    TensorDifference,
    TensorLayout,
    WeightsVerdict,
    _as_bytes,
    _fingerprints,
    agree_write_back,
    compare_weights,
    describe_tensors,
    digest_ranges,
)
from residency.device.digests import ChangeDetector, DigestLayout
from residency.core.errors import CollectiveError, ConfigError, RegistrationError

from _dist import run_world


def _outcome(call) -> dict:
    """What a collective call did on this rank, as JSON."""
    started = time.monotonic()
    try:
        value = call()
    except Exception as error:  # the test checks type and message
        return {"raised": type(error).__name__, "message": str(error),
                "seconds": time.monotonic() - started}
    return {"value": value, "seconds": time.monotonic() - started}


def _assert_same_error_everywhere(outcomes: list[dict], kind: type, *phrases: str) -> str:
    assert all(o.get("raised") == kind.__name__ for o in outcomes), outcomes
    messages = {o["message"] for o in outcomes}
    assert len(messages) == 1, messages  # the same message on every rank
    (message,) = messages
    for phrase in phrases:
        assert phrase in message, message
    assert all(o["seconds"] < 5 for o in outcomes), outcomes
    return message


# -- fingerprints and layouts (no group) -----------------------------------------------------------


def _fingerprint(tensor: torch.Tensor) -> str:
    return _fingerprints([_as_bytes(tensor)])[0]


@pytest.mark.fast
def test_a_fingerprint_depends_on_the_values_not_on_where_they_lie():
    values = torch.randn(300, 70, generator=torch.Generator().manual_seed(0))
    strided = values.t().contiguous().t()           # same values, column-major
    offset = torch.cat([torch.zeros(1), values.flatten()])[1:].view(300, 70)  # 4-byte offset
    assert offset.untyped_storage().nbytes() and offset.storage_offset() == 1
    assert _fingerprint(values) == _fingerprint(strided) == _fingerprint(offset)
    assert len(_fingerprint(values)) == 32  # 128 bits


@pytest.mark.fast
@pytest.mark.parametrize("edit", ["bit", "sign", "swap", "longer"])
def test_a_fingerprint_sees_every_small_change(edit):
    values = torch.randn(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    changed = values.clone()
    if edit == "bit":
        changed.view(torch.int64)[17] ^= 1
    elif edit == "sign":  # the word moves by 2**63
        changed[4000] = -changed[4000]
    elif edit == "swap":
        changed[[3, 2900]] = changed[[2900, 3]]
    else:  # a trailing zero: the same digests, another length
        changed = torch.cat([values, torch.zeros(1, dtype=torch.float64)])
    assert _fingerprint(values) != _fingerprint(changed)


@pytest.mark.fast
def test_large_and_empty_tensors_have_fingerprints():
    large = torch.arange(3 * 2**20 // 4 + 5, dtype=torch.int32)  # 3 chunks and a bit
    assert _fingerprint(large) == _fingerprint(large.clone())
    assert _fingerprint(torch.empty(0)) != _fingerprint(torch.zeros(1))
    with pytest.raises(ValueError, match="meta tensor has no bytes"):
        _as_bytes(torch.empty(3, device="meta"))


@pytest.mark.fast
def test_describe_tensors_numbers_the_storages_tied_weights_share_one():
    a, b = torch.zeros(4, 3), torch.ones(3)
    layouts = describe_tensors([("a", a), ("b", b), ("tied", a), ("view", a[1:])])
    assert [layout.region for layout in layouts] == [0, 1, 0, 0]
    assert layouts[3] == TensorLayout(name="view", shape=(3, 3), dtype="torch.float32",
                                      stride=(3, 1), storage_offset=3, region=0)
    assert layouts[0].differences(layouts[2]) == ["name 'a' vs 'tied'"]


@pytest.mark.fast
def test_digest_ranges_covers_the_bytes_and_the_ranges():
    buffer = torch.arange(16384, dtype=torch.int64).view(torch.uint8)
    other = buffer.clone()
    other[70000] ^= 1
    assert digest_ranges(buffer, [(0, 4096)]) == digest_ranges(other, [(0, 4096)])
    assert digest_ranges(buffer, [(65536, 69632), (69632, 73728)]) != digest_ranges(
        other, [(65536, 69632), (69632, 73728)])
    assert digest_ranges(buffer, [(0, 4096)]) != digest_ranges(buffer, [(0, 4095)])
    with pytest.raises(ValueError, match="non-empty, increasing and disjoint.*changed_windows"):
        digest_ranges(buffer, [(4096, 8192), (0, 4096)])


@pytest.mark.fast
def test_agreement_needs_torch_distributed_and_a_gloo_group():
    assert not dist.is_initialized()
    for call in (
        lambda: PhaseLedger(),
        lambda: compare_weights("g", [], []),
        lambda: agree_write_back("g", [], None),
    ):
        with pytest.raises(ConfigError, match=r"call torch\.distributed\.init_process_group"):
            call()


@pytest.mark.fast
def test_a_verdict_names_the_first_differences_and_counts_the_rest():
    differences = [TensorDifference(index=i, name=f"w{i}", ranks=[1], what="bytes")
                   for i in range(7)]
    verdict = WeightsVerdict(name="dit", ranks=[0, 1], same=[False] * 7 + [True],
                             differences=differences)
    assert not verdict.identical
    text = verdict.describe()
    assert text.startswith("7 of the 8 tensors of 'dit' differ between ranks (compared with "
                           "rank 0)")
    assert "'w4' (#4) differs on ranks [1] in bytes" in text and "'w5'" not in text
    assert text.endswith("; and 2 more")
    same = WeightsVerdict(name="vae", ranks=[0, 1], same=[True], differences=[])
    assert same.identical
    assert same.describe() == "the 1 tensors of 'vae' are identical on ranks [0, 1]"


# -- same weights on every rank? -----------------------------------------------------------------


def _weights(seed: int, *, bias_seed: int | None = None, wide: bool = False, tie: bool = False,
             drop: bool = False) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=generator)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(bias_seed or seed + 1))
    head = torch.randn(64, 48 if wide else 32, generator=generator).to(torch.bfloat16)
    named = [("proj.weight", weight), ("proj.bias", bias), ("head.weight", head),
             ("embed.weight", weight if tie else weight.clone())]
    return named[:-1] if drop else named


def _compare(named, group=None, require=None, name="dit"):
    def call():
        verdict = compare_weights(name, describe_tensors(named), [t for _, t in named], group,
                                  require=require)
        return {"identical": verdict.identical, "same": list(verdict.same),
                "describe": verdict.describe(), "ranks": list(verdict.ranks),
                "differences": [[d.index, d.name, list(d.ranks), d.what, d.detail]
                                for d in verdict.differences]}
    return _outcome(call)


def _weights_worker(rank: int, world_size: int, args) -> dict:
    out = {"identical": _compare(_weights(0))}
    # Tensor-parallel shards: rank 2's bias is another slice, rank 1's head is wider.
    out["shards"] = _compare(_weights(0, bias_seed=7 if rank == 2 else None, wide=rank == 1))
    out["required"] = _compare(_weights(0, bias_seed=7 if rank == 2 else None),
                               require="weight_transfer='allgather'" if rank == 0 else None)
    declared = "the pipeline's encoder_dlo_weight_replication"
    out["declared_same"] = _compare(_weights(3), require=declared)
    edited = _weights(3)
    if rank == 1:
        edited[2][1][5, 7] += 1  # one element of one rank's copy
    out["declared_differs"] = _compare(edited, require=declared)
    out["tied"] = _compare(_weights(0, tie=rank == 1))
    out["missing"] = _compare(_weights(0, drop=rank == 2))
    named = _weights(0)
    layouts = describe_tensors(named)[: 3 if rank == 1 else 4]
    out["bad_input"] = _outcome(lambda: compare_weights("dit", layouts, [t for _, t in named]))
    out["other_group"] = _compare(_weights(0), name="vae" if rank == 2 else "dit")
    full = describe_tensors(named)
    plain = [attrs.astuple(layout) for layout in full] if rank == 0 else full
    out["plain_layouts"] = _outcome(lambda: compare_weights("dit", plain, [t for _, t in named]))
    return out


@pytest.fixture(scope="module")
def weights_world(tmp_path_factory):
    return run_world(_weights_worker, 3, tmp_path_factory.mktemp("weights"), timeout=40)


def _scenario(world, name) -> list[dict]:
    assert all(r and "raised" not in r for r in world), world  # no worker died
    return [result[name] for result in world]


def test_identical_weights_are_identical_on_every_rank(weights_world):
    for outcome in _scenario(weights_world, "identical"):
        value = outcome["value"]
        assert value["identical"] and value["same"] == [True] * 4 and value["ranks"] == [0, 1, 2]
        assert value["describe"] == "the 4 tensors of 'dit' are identical on ranks [0, 1, 2]"
    outcome = _scenario(weights_world, "declared_same")[0]
    assert outcome["value"]["identical"], outcome  # a declaration that holds passes


def test_differing_shards_are_detected_and_named_the_same_on_every_rank(weights_world):
    outcomes = _scenario(weights_world, "shards")
    assert len({repr(o["value"]) for o in outcomes}) == 1, outcomes  # one verdict everywhere
    value = outcomes[0]["value"]
    assert not value["identical"] and value["same"] == [True, False, False, True]
    assert value["differences"] == [
        [1, "proj.bias", [2], "bytes", ""],
        [2, "head.weight", [1], "layout",
         "rank 0 vs rank 1: shape (64, 32) vs (64, 48), stride (32, 1) vs (48, 1)"],
    ]
    assert value["describe"].startswith("2 of the 4 tensors of 'dit' differ between ranks")
    assert "'proj.bias' (#1) differs on ranks [2] in bytes" in value["describe"]


def test_tied_weights_on_one_rank_only_are_a_layout_difference(weights_world):
    value = _scenario(weights_world, "tied")[0]["value"]
    assert value["differences"] == [[3, "embed.weight", [1], "layout",
                                     "rank 0 vs rank 1: region 3 vs 0"]]


def test_a_rank_with_fewer_tensors_is_named(weights_world):
    value = _scenario(weights_world, "missing")[0]["value"]
    assert value["differences"] == [[3, "embed.weight", [2], "missing",
                                     "ranks [2] have fewer tensors"]]


def test_required_sharing_of_differing_weights_is_refused_on_every_rank(weights_world):
    """Only rank 0 asks for it; every rank raises, naming the tensor and the demand."""
    _assert_same_error_everywhere(
        _scenario(weights_world, "required"), RegistrationError,
        "weight_transfer='allgather' requires the weights of 'dit' to be the same on every rank",
        "'proj.bias' (#1) differs on ranks [2] in bytes",
        "drop weight_transfer='allgather' for 'dit'", "load the same weights on every rank")


def test_a_declaration_of_replication_is_still_checked(weights_world):
    _assert_same_error_everywhere(
        _scenario(weights_world, "declared_differs"), RegistrationError,
        "the pipeline's encoder_dlo_weight_replication requires the weights of 'dit'",
        "'head.weight' (#2) differs on ranks [1] in bytes")


def test_bad_input_on_one_rank_is_refused_on_every_rank(weights_world):
    _assert_same_error_everywhere(
        _scenario(weights_world, "bad_input"), RegistrationError,
        "comparing the weights of 'dit' was refused on some ranks (global rank: why) {1: ",
        "3 layouts for 4 tensors: pass one per tensor")


def test_layouts_that_are_not_tensor_layouts_are_refused_on_every_rank(weights_world):
    _assert_same_error_everywhere(
        _scenario(weights_world, "plain_layouts"), RegistrationError,
        "{0: 'TypeError: layouts must be TensorLayout objects: use describe_tensors(...)'")


def test_ranks_comparing_different_groups_raise_on_every_rank(weights_world):
    _assert_same_error_everywhere(
        _scenario(weights_world, "other_group"), RegistrationError,
        "the ranks diverged", "2: \"comparing the weights of 'vae'\"",
        "0: \"comparing the weights of 'dit'\"")


# -- the same phases in the same order -------------------------------------------------------------


def _walk(phases: list[str], *, finish: bool = True) -> dict:
    """Enter `phases` in a fresh ledger (inside its with-block); what happened."""
    ledger = PhaseLedger()
    entered = []

    def call():
        with ledger:
            for phase in phases:
                entered.append(ledger.enter(phase).point)
            if not finish:
                raise ValueError("this rank gives up")
        return entered

    outcome = _outcome(call)
    outcome.update(entered=entered, repr=repr(ledger), broken=ledger.broken)
    outcome["after"] = _outcome(lambda: ledger.enter("dit"))  # never a collective
    return outcome


def _ledger_worker(rank: int, world_size: int, args) -> dict:
    out = {"agreed": _walk(["text_encoder", "dit", "dit", "vae"])}
    out["diverged"] = _walk(["text_encoder", "text_encoder" if rank == 1 else "transformer"])
    # FirstBlockCache on rank 2 only: it skips block 1 and asks for block 2 while the others are
    # at block 1.
    blocks = ["block0", "block2"] if rank == 2 else ["block0", "block1", "block2"]
    out["skipped_block"] = _walk(blocks)
    # Rank 1 skips the last phase and leaves: its finish meets the others' phase.
    out["skipped_last"] = _walk(["text_encoder"] if rank == 1 else ["text_encoder", "dit"])
    # Rank 0 fails in its phase: the others learn it at their next step.
    out["failed"] = _walk(["text_encoder"] if rank == 0 else ["text_encoder", "dit"],
                          finish=rank != 0)
    out["unnamed"] = _walk([""])
    out["not_a_group"] = _outcome(lambda: PhaseLedger("node"))
    long = "x" * 300  # longer than a header holds: cut, and ended by a hash of the whole
    out["long_same"] = _walk([long + "a"])
    out["long_different"] = _walk([long + ("b" if rank == 1 else "a")])
    # The same point everywhere, a problem on rank 1 only: it sends a body, the others none.
    out["one_problem"] = _walk([None if rank == 1 else "None"])
    ledger = PhaseLedger()
    out["other_kind"] = _outcome(
        lambda: agree_write_back("dit", [], None) if rank == 0 else ledger.enter("dit").point)
    return out


@pytest.fixture(scope="module")
def ledger_world(tmp_path_factory):
    return run_world(_ledger_worker, 3, tmp_path_factory.mktemp("ledger"), timeout=40)


def test_ranks_entering_the_same_phases_agree(ledger_world):
    for outcome in _scenario(ledger_world, "agreed"):
        assert outcome["value"] == ["phase #0: enter 'text_encoder'", "phase #1: enter 'dit'",
                                    "phase #2: enter 'dit'", "phase #3: enter 'vae'"], outcome
        assert outcome["repr"].endswith(": finished after 5 steps>"), outcome
        assert outcome["after"]["raised"] == "CollectiveError"
        assert "the phase ledger has finished, refusing phase #5: enter 'dit'" in (
            outcome["after"]["message"])
        assert "make a new PhaseLedger" in outcome["after"]["message"]


def test_phase_divergence_raises_on_every_rank_naming_each_request(ledger_world):
    outcomes = _scenario(ledger_world, "diverged")
    _assert_same_error_everywhere(
        outcomes, CollectiveError,
        "the ranks diverged: they asked for different collective steps (global rank: what it "
        "asked for) {0: \"phase #1: enter 'transformer'\", 1: \"phase #1: enter 'text_encoder'\", "
        "2: \"phase #1: enter 'transformer'\"}",
        "enter the same phases, in the same order", "FirstBlockCache",
        "Every rank raised this error")
    for outcome in outcomes:
        assert outcome["broken"] and outcome["repr"].endswith("broken at #1>")
        after = outcome["after"]  # refused at once: no collective that could hang (a bound a
        assert after["raised"] == "CollectiveError" and after["seconds"] < 5  # loaded host meets
        assert "the phase ledger is broken, refusing phase #1: enter 'dit'" in after["message"]
        assert "destroy_process_group" in after["message"]


def test_a_rank_skipping_a_block_raises_on_every_rank_at_its_next_step(ledger_world):
    _assert_same_error_everywhere(
        _scenario(ledger_world, "skipped_block"), CollectiveError,
        "0: \"phase #1: enter 'block1'\"", "2: \"phase #1: enter 'block2'\"")


def test_a_rank_skipping_the_last_phase_raises_on_every_rank_when_it_leaves(ledger_world):
    _assert_same_error_everywhere(
        _scenario(ledger_world, "skipped_last"), CollectiveError,
        "1: 'phase #1: finish (no more phases)'", "0: \"phase #1: enter 'dit'\"")


def test_a_rank_failing_in_a_phase_makes_the_others_raise_at_their_next_step(ledger_world):
    failed, *others = _scenario(ledger_world, "failed")
    assert failed["raised"] == "ValueError" and failed["message"] == "this rank gives up"
    _assert_same_error_everywhere(
        others, CollectiveError, "0: 'phase #1: finish (no more phases) after an error (ValueError)'")


def test_a_phase_without_a_name_is_refused_on_every_rank(ledger_world):
    _assert_same_error_everywhere(
        _scenario(ledger_world, "unnamed"), CollectiveError,
        "phase #0: enter '' was refused on some ranks (global rank: why) {0: \"a phase names a "
        "group by a non-empty string, got ''\", 1:")


def test_long_phase_names_are_compared_whole(ledger_world):
    for outcome in _scenario(ledger_world, "long_same"):
        assert outcome["value"] == ["phase #0: enter '" + "x" * 300 + "a'"], outcome
    message = _assert_same_error_everywhere(
        _scenario(ledger_world, "long_different"), CollectiveError, "the ranks diverged")
    assert message.count("xxxx#") == 3  # each point cut, followed by the hash of the whole


def test_one_rank_with_a_problem_is_heard_by_the_ranks_without_one(ledger_world):
    _assert_same_error_everywhere(
        _scenario(ledger_world, "one_problem"), CollectiveError,
        "phase #0: enter 'None' was refused on some ranks (global rank: why) {1: 'a phase names "
        "a group by a non-empty string, got None'}")


def test_agreement_refuses_anything_but_a_gloo_group(ledger_world):
    for outcome in _scenario(ledger_world, "not_a_group"):
        assert outcome["raised"] == "ConfigError", outcome
        assert "rank agreement runs on a gloo process group" in outcome["message"]
        assert "Pass residency.multirank.node.node_view().group or torch.distributed.new_group(" in (
            outcome["message"])


def test_ranks_at_different_kinds_of_agreement_raise_on_every_rank(ledger_world):
    _assert_same_error_everywhere(
        _scenario(ledger_world, "other_kind"), CollectiveError,
        "0: \"the write-back of 'dit'\"", "1: \"phase #0: enter 'dit'\"")


# -- a rank that never arrives ---------------------------------------------------------------------

#: The group's timeout in the tests where a rank stays away.
SHORT = timedelta(seconds=1.5)


def _absent_worker(rank: int, world_size: int, args) -> dict:
    group = dist.new_group(backend="gloo", timeout=SHORT)
    ledger = PhaseLedger(group)
    ledger.enter("text_encoder")
    if rank == 1:  # skips "dit", busy elsewhere past the timeout, then leaves the ledger
        time.sleep(args["away"])
        if args["exit"]:  # the process ends at once, reporting nothing: its connections close
            os._exit(0)  # (a rank that reports waits for its peers: tests/_dist.py)
        return {"finish": _outcome(ledger.finish)}
    out = {"enter": _outcome(lambda: ledger.enter("dit").point)}
    out["after"] = _outcome(lambda: ledger.enter("vae"))
    time.sleep(args["linger"])  # alive (connections open) while rank 1 comes back
    return out


def test_a_rank_that_skips_a_phase_and_stays_away_ends_in_an_error_on_every_rank(tmp_path):
    """Rank 1 skips "dit" and comes back after the timeout: rank 0 raises at the timeout, rank 1
    at its next step (within one timeout), and nobody hangs."""
    started = time.monotonic()
    args = {"away": 2.0, "linger": 1.5, "exit": False}
    waiting, away = run_world(_absent_worker, 2, tmp_path, timeout=20, args=args)
    enter = waiting["enter"]
    assert enter["raised"] == "CollectiveError", waiting
    assert 1.0 < enter["seconds"] < 4 * SHORT.total_seconds(), enter  # the timeout, not a hang
    assert "rank 0: phase #1: enter 'dit' failed: a rank of the process group died or did not " \
           "arrive within the group's timeout" in enter["message"]
    assert "a rank that skips a phase" in enter["message"]
    assert waiting["after"]["raised"] == "CollectiveError"
    assert waiting["after"]["seconds"] < SHORT.total_seconds()  # no second wait for the timeout
    assert "the phase ledger is broken" in waiting["after"]["message"]
    finish = away["finish"]
    assert finish["raised"] == "CollectiveError", away
    assert finish["seconds"] < SHORT.total_seconds() + 1, finish
    assert time.monotonic() - started < 60  # nobody hangs (run_world's own bound is 20 s a world)


def test_a_rank_that_skips_a_phase_and_exits_makes_the_others_raise_at_once(tmp_path):
    args = {"away": 0.0, "linger": 0.0, "exit": True}
    waiting, away = run_world(_absent_worker, 2, tmp_path, timeout=20, args=args)
    assert away is None  # it ended without a result
    assert waiting["enter"]["raised"] == "CollectiveError", waiting
    # At once: the closed connection ends the wait, not the group's timeout.
    assert waiting["enter"]["seconds"] < SHORT.total_seconds(), waiting
    assert "died or did not arrive" in waiting["enter"]["message"]


# -- write-back to a shared master ----------------------------------------------------------------

CHUNK = 4096
#: (name, start, end) of the tensors packed in the test buffer: 4 tensors of 4 chunks each.
TENSORS = [(f"blocks.{i}.weight", 4 * CHUNK * i, 4 * CHUNK * (i + 1)) for i in range(4)]


def _write_back(rank: int, edit) -> dict:
    """Load a 64 KiB buffer, let `edit` change it, agree on what to write back."""
    buffer = torch.arange(16 * CHUNK // 8, dtype=torch.int64).view(torch.uint8)
    detector = ChangeDetector(DigestLayout(window_nbytes=CHUNK, columns=64))
    detector.remember(buffer)
    edit(buffer)
    changed = detector.changed_windows(buffer)

    def call():
        decision = agree_write_back("dit", changed, digest_ranges(buffer, changed),
                                    tensors=TENSORS)
        return {"ranges": [list(r) for r in decision.ranges], "writer": decision.writer,
                "writes": decision.writes, "rank": decision.rank}
    return _outcome(call)


def _set(index: int, value: int):
    def edit(buffer):
        buffer[index] = value
    return edit


def _write_back_worker(rank: int, world_size: int, args) -> dict:
    out = {"none": _write_back(rank, lambda buffer: None)}
    out["same"] = _write_back(rank, lambda b: (_set(5, 9)(b), _set(9 * CHUNK + 1, 7)(b)))
    out["different_bytes"] = _write_back(rank, _set(5 * CHUNK, 3 if rank == 2 else 4))
    out["one_rank"] = _write_back(rank, _set(13 * CHUNK, 1) if rank == 1 else lambda b: None)
    out["bad_ranges"] = _outcome(lambda: agree_write_back(
        "dit", [(CHUNK, 0)] if rank == 1 else [], None))
    out["no_digest"] = _outcome(lambda: agree_write_back("dit", [(0, CHUNK)], None))
    return out


@pytest.fixture(scope="module")
def write_back_world(tmp_path_factory):
    return run_world(_write_back_worker, 3, tmp_path_factory.mktemp("write_back"), timeout=40)


def test_nobody_changed_anything_so_nothing_is_written(write_back_world):
    for rank, outcome in enumerate(_scenario(write_back_world, "none")):
        assert outcome["value"] == {"ranges": [], "writer": None, "writes": False, "rank": rank}


def test_the_same_edit_on_every_rank_is_written_by_one_rank(write_back_world):
    outcomes = _scenario(write_back_world, "same")
    for rank, outcome in enumerate(outcomes):
        assert outcome["value"] == {"ranges": [[0, CHUNK], [9 * CHUNK, 10 * CHUNK]], "writer": 0,
                                    "writes": rank == 0, "rank": rank}


def test_different_edits_of_the_same_bytes_raise_on_every_rank(write_back_world):
    _assert_same_error_everywhere(
        _scenario(write_back_world, "different_bytes"), CollectiveError,
        "the ranks sharing the host master of 'dit' changed it differently while it was resident",
        "0: '[(20480, 24576)] digest ", "the tensors in those ranges: ['blocks.1.weight']",
        "Nothing was written back: every rank keeps its device copy",
        "every rank must make the same edit")


def test_an_edit_on_one_rank_only_raises_on_every_rank(write_back_world):
    _assert_same_error_everywhere(
        _scenario(write_back_world, "one_rank"), CollectiveError,
        "{0: 'nothing', 1: '[(53248, 57344)] digest ", "2: 'nothing'}",
        "['blocks.3.weight']")


def test_bad_ranges_on_one_rank_are_refused_on_every_rank(write_back_world):
    _assert_same_error_everywhere(
        _scenario(write_back_world, "bad_ranges"), CollectiveError,
        "the write-back of 'dit' was refused on some ranks (global rank: why) {1: 'ValueError: "
        "byte ranges must be non-empty, increasing and disjoint")


def test_changed_ranges_without_their_digest_are_refused_on_every_rank(write_back_world):
    _assert_same_error_everywhere(
        _scenario(write_back_world, "no_digest"), CollectiveError,
        "{0: 'changed ranges need their digest_ranges(...) string, got None', 1: ")
