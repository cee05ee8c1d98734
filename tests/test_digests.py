"""The change-detection primitive: every bit flip and every swap of two elements is caught.

Small layouts (a window of 256 bytes as 8 rows x 4 words) make exhaustive checks cheap; the default
layouts are checked at their window boundaries.  Speed lives in benchmarks/test_change_detection.py.
"""

from __future__ import annotations

import collections
import itertools
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from residency.device import one_pass
from residency.device.digests import ChangeDetector, DigestLayout, window_digests
from residency.device.one_pass import one_pass_sums

from _accelerator import device as accelerator_device

SMALL = DigestLayout(window_nbytes=256, columns=4)  # 8 rows x 4 int64 words per window
#: One integer dtype per element size: a swap of 2-byte elements is the same bytes for int16 and
#: bfloat16, and integer equality is byte equality (no NaN).
ELEMENT_DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64]


def random_bytes(nbytes: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).to(device)


def remembered(buffer: torch.Tensor, layout: DigestLayout = SMALL) -> ChangeDetector:
    detector = ChangeDetector(layout)
    detector.remember(buffer)
    return detector


def window_range(index: int, nbytes: int, layout: DigestLayout = SMALL) -> tuple[int, int]:
    return index * layout.window_nbytes, min((index + 1) * layout.window_nbytes, nbytes)


def flip_bit(buffer: torch.Tensor, byte: int, bit: int) -> None:
    buffer[byte] ^= 1 << bit


def swap(elements: torch.Tensor, i: int, j: int) -> None:
    elements[i], elements[j] = elements[j].clone(), elements[i].clone()


#: The CPU's ways to digest: the one-pass C kernel (`residency.device.one_pass`) and its fallback,
#: torch's pairs of reductions (one pair per window at one thread, one for all windows at two).
CPU_PATHS = [("one pass", 1), ("one pass", 2), ("pairs", 1), ("pairs", 2)]


def use_cpu_path(monkeypatch, path: str, threads: int) -> None:
    """Digest on the CPU by `path` ("one pass" or "pairs") under `threads` intra-op threads until
    the test ends (the caller restores the thread count; monkeypatch the environment)."""
    if path == "pairs":
        monkeypatch.setenv("RESIDENCY_ONE_PASS", "0")
    one_pass._loaded.cache_clear()  # asked again at the next digest, and after the test
    assert (one_pass_sums() is not None) == (path == "one pass"), "no C compiler for one pass?"
    torch.set_num_threads(threads)


@pytest.fixture(params=CPU_PATHS, ids=[f"{path}-{threads}-thread" for path, threads in CPU_PATHS])
def intra_op_threads(request, monkeypatch):
    """Run by each CPU path under one intra-op thread and under two (`CPU_PATHS`); the same
    digests, the same detection."""
    before = torch.get_num_threads()
    use_cpu_path(monkeypatch, *request.param)
    yield request.param
    torch.set_num_threads(before)
    one_pass._loaded.cache_clear()


class AtenCalls(TorchDispatchMode):
    """Counts the aten operators run inside it, by name: ``calls["sum"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# --- unchanged, determinism, shapes ---------------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 255, 256, 257, 1000, 1024])
def test_an_unchanged_buffer_reports_nothing(nbytes):
    buffer = random_bytes(nbytes)
    assert remembered(buffer).changed_windows(buffer) == []


@pytest.mark.fast
def test_the_same_bytes_give_the_same_digests_in_any_buffer(intra_op_threads):
    buffer = random_bytes(3 * 2**20 + 5)
    layout = DigestLayout.for_device(buffer.device)
    copy = torch.empty(buffer.numel() + 64, dtype=torch.uint8)[64:]
    copy.copy_(buffer)
    assert torch.equal(window_digests(buffer, layout), window_digests(buffer, layout))
    assert torch.equal(window_digests(buffer, layout), window_digests(copy, layout))


@pytest.mark.fast
def test_digests_are_small_and_one_row_per_window():
    layout = DigestLayout.for_device(torch.device("cpu"))
    digests = window_digests(random_bytes(5 * 2**20 + 3), layout)
    assert digests.dtype == torch.int64
    assert digests.shape == (6, layout.rows + layout.columns)
    assert digests.numel() * 8 < 0.01 * 6 * layout.window_nbytes


@pytest.mark.fast
def test_an_empty_buffer_has_no_windows():
    empty = torch.empty(0, dtype=torch.uint8)
    assert window_digests(empty, SMALL).shape == (0, SMALL.digest_words)
    assert remembered(empty).changed_windows(empty) == []


@pytest.mark.fast
def test_the_last_partial_window_counts_its_own_bytes_not_the_padding(intra_op_threads):
    buffer = random_bytes(2 * 256 + 3)
    zeros_beyond = torch.cat([buffer, torch.zeros(256 - 3, dtype=torch.uint8)])
    assert torch.equal(window_digests(buffer, SMALL), window_digests(zeros_beyond, SMALL))
    detector = remembered(buffer)
    buffer[-1] ^= 0x80
    assert detector.changed_windows(buffer) == [(512, 515)]


@pytest.mark.fast
@pytest.mark.parametrize("tail", [8, 1024, 1024 + 8, 4096 - 8, 5000])
def test_a_short_last_window_digests_as_its_zero_padded_full_window(tail, intra_op_threads):
    """Only the rows a short window fills are summed (the layer-mode case: blocks far smaller than
    a window); the digest equals that of the window zero-padded to full size."""
    layout = DigestLayout.for_device(torch.device("cpu"))
    buffer = random_bytes(layout.window_nbytes + tail)
    padded = torch.cat([buffer, torch.zeros(layout.window_nbytes - tail, dtype=torch.uint8)])
    assert torch.equal(window_digests(buffer, layout), window_digests(padded, layout))


# --- bit flips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [256 * 3, 256 * 2 + 13])
def test_every_single_bit_flip_is_detected_in_its_window(nbytes):
    buffer = random_bytes(nbytes, seed=1)
    detector = remembered(buffer)
    for byte, bit in itertools.product(range(nbytes), range(8)):
        flip_bit(buffer, byte, bit)
        assert detector.changed_windows(buffer) == [window_range(byte // 256, nbytes)], (byte, bit)
        flip_bit(buffer, byte, bit)
    assert detector.changed_windows(buffer) == []


@pytest.mark.fast
def test_bit_flips_at_the_default_window_boundaries(intra_op_threads):
    layout = DigestLayout.for_device(torch.device("cpu"))
    window = layout.window_nbytes
    nbytes = 3 * window + 4099  # a last partial window, not a multiple of 8
    buffer = random_bytes(nbytes, seed=2)
    detector = remembered(buffer, layout)
    for byte in (0, window - 1, window, 2 * window - 1, 3 * window, nbytes - 1):
        for bit in (0, 7):
            flip_bit(buffer, byte, bit)
            expected = [window_range(byte // window, nbytes, layout)]
            assert detector.changed_windows(buffer) == expected
            flip_bit(buffer, byte, bit)


# --- swaps ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ELEMENT_DTYPES)
def test_swaps_of_two_different_elements_anywhere_in_a_window_are_detected(dtype):
    buffer = random_bytes(256 * 2)
    elements = buffer.view(dtype)
    per_window = 256 // elements.element_size()
    detector = remembered(buffer)
    step = 1 if elements.element_size() >= 4 else 3  # all pairs of words; a third of the small ones
    for window in range(2):
        indices = range(window * per_window, (window + 1) * per_window, step)
        for i, j in itertools.combinations(indices, 2):
            if elements[i] == elements[j]:
                continue  # the same bytes: swapping them changes nothing
            swap(elements, i, j)
            assert detector.changed_windows(buffer) == [window_range(window, 512)], (dtype, i, j)
            swap(elements, i, j)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", ELEMENT_DTYPES)
def test_swaps_of_neighbours_same_row_and_same_column_in_the_default_layout(dtype,
                                                                          intra_op_threads):
    layout = DigestLayout.for_device(torch.device("cpu"))
    nbytes = 2 * layout.window_nbytes + 1000  # the last window is partial
    buffer = random_bytes(nbytes, seed=3)
    elements = buffer.view(dtype)
    size = elements.element_size()
    row = 8 * layout.columns // size  # elements per row
    detector = remembered(buffer, layout)
    window_elements = layout.window_nbytes // size
    last = elements.numel() - 1
    pairs = [(0, 1), (0, row - 1), (5, 5 + row), (7, 7 + (layout.rows - 1) * row),
             (window_elements - 1, window_elements - 2), (2 * window_elements, last),
             (last - 1, last)]
    for i, j in pairs:
        if elements[i] == elements[j]:
            elements[j] += 1
            detector.remember(buffer)
        swap(elements, i, j)
        window = (i * size) // layout.window_nbytes
        assert detector.changed_windows(buffer) == [window_range(window, nbytes, layout)], (i, j)
        swap(elements, i, j)


@pytest.mark.fast
def test_a_swap_across_a_window_boundary_reports_both_windows_as_one_range(intra_op_threads):
    buffer = random_bytes(256 * 4)
    words = buffer.view(torch.float64)
    detector = remembered(buffer)
    swap(words, 32 - 1, 32)  # the last word of window 0, the first of window 1
    assert detector.changed_windows(buffer) == [(0, 512)]


@pytest.mark.fast
def test_swapping_x_and_minus_x_is_detected():
    """Sign-only differences (2**63 between the words) defeat odd-weighted sums modulo 2**64."""
    buffer = torch.zeros(256 * 2, dtype=torch.uint8)
    values = buffer.view(torch.float64)
    values[3], values[3 + 4] = 1.5, -1.5  # one row apart, same column
    detector = remembered(buffer)
    swap(values, 3, 7)
    assert detector.changed_windows(buffer) == [(0, 256)]
    values[3], values[7] = 1.5, -1.5
    values[10], values[20] = -values[10], -values[20]  # two sign flips of zeros: -0.0
    assert detector.changed_windows(buffer) == [(0, 256)]


@pytest.mark.fast
def test_each_window_digests_as_that_window_alone():
    """All windows are summed in one pair of calls; each one's digest is its own bytes'."""
    buffer = random_bytes(256 * 7 + 100)
    digests = window_digests(buffer, SMALL)
    for index in range(digests.shape[0]):
        alone = buffer[index * 256 : (index + 1) * 256].clone()
        assert torch.equal(digests[index], window_digests(alone, SMALL)[0]), index


# --- cost: a bounded number of calls per buffer ---------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("intra_op_threads", [("one pass", 1), ("one pass", 2), ("pairs", 2)],
                         indirect=True, ids=["one-pass-1-thread", "one-pass-2-threads",
                                             "pairs-2-threads"])
@pytest.mark.parametrize("layout, windows", [(SMALL, 3), (SMALL, 64), (SMALL, 4096),
                                             (DigestLayout.for_device(torch.device("cpu")), 24)])
def test_a_check_costs_the_same_few_calls_whatever_the_window_count(
        intra_op_threads, layout, windows):
    """With more than one intra-op thread each large torch reduction opens a parallel region, and
    each region stalls when other processes share the cores.  So a remember and a check cost a
    fixed number of calls: by the one-pass kernel, one call for the whole windows (no torch sum
    of them) and two sums for the last, shorter one; by torch's pairs at two threads, four sums
    (rows and columns of the whole windows, of the last one), not two per window.  Either gives
    the digests of the one-window-at-a-time path (torch, one thread)."""
    path, _ = intra_op_threads
    sums = 2 if path == "one pass" else 4
    buffer = random_bytes(windows * layout.window_nbytes + layout.window_nbytes // 2 + 3, seed=5)
    detector = ChangeDetector(layout)
    with AtenCalls() as remembering:
        detector.remember(buffer)
    buffer[-1] ^= 0x10  # in the last, shorter window
    buffer[layout.window_nbytes // 2] ^= 0x01  # in the first
    with AtenCalls() as checking:
        changed = detector.changed_windows(buffer)
    assert remembering.calls["sum"] == sums, remembering.calls
    assert checking.calls["sum"] == sums and checking.calls["any"] == 1, checking.calls
    assert changed == [window_range(0, buffer.numel(), layout),
                       window_range(windows, buffer.numel(), layout)]
    these = window_digests(buffer, layout)
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_cpu_path(monkeypatch, "pairs", 1)  # one pair of sums per window
        assert torch.equal(window_digests(buffer, layout), these)


@pytest.mark.fast
def test_the_one_pass_kernel_is_built_into_the_cache_once_and_a_failed_build_falls_back(
        tmp_path, monkeypatch, caplog):
    """Built at the first digest into the user's cache folder (here an empty one), loaded from it
    after; where the compiler fails, the torch path digests the same, with one log line."""
    buffer = random_bytes(5 * SMALL.window_nbytes + 7, seed=3)
    with pytest.MonkeyPatch.context() as pairs:
        use_cpu_path(pairs, "pairs", 1)
        expected = window_digests(buffer, SMALL)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        one_pass._loaded.cache_clear()
        assert torch.equal(window_digests(buffer, SMALL), expected)
        built = list((tmp_path / "residency").glob("one_pass-*.so"))
        assert len(built) == 1 and not list((tmp_path / "residency").glob("*.partial"))
        stamp = built[0].stat().st_mtime_ns
        one_pass._loaded.cache_clear()
        assert one_pass_sums() is not None and built[0].stat().st_mtime_ns == stamp  # not again
        monkeypatch.setenv("CC", "false")  # a compiler that fails: another key, nothing cached
        one_pass._loaded.cache_clear()
        with caplog.at_level("INFO", logger="residency.device.one_pass"):
            assert one_pass_sums() is None
            assert torch.equal(window_digests(buffer, SMALL), expected)
        assert "could not be built" in caplog.text and "false failed" in caplog.text
    finally:
        one_pass._loaded.cache_clear()


@pytest.mark.fast
def test_the_kernel_is_never_built_into_or_loaded_from_a_folder_others_may_write(
        tmp_path, monkeypatch):
    """A library loaded from the cache runs as this process: a cache folder that others may write
    to is passed over for a temporary folder of this user's own, and with none such the torch path
    digests instead."""
    import tempfile

    shared = tmp_path / "cache" / "residency"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert one_pass._cache_folder() == tmp_path / "tmp" / f"residency-{os.getuid()}"
    (tmp_path / "tmp" / f"residency-{os.getuid()}").chmod(0o777)
    with pytest.raises(OSError, match="writable by it alone"):
        one_pass._cache_folder()
    try:
        one_pass._loaded.cache_clear()
        assert one_pass_sums() is None and not list(shared.iterdir())
    finally:
        one_pass._loaded.cache_clear()


# --- edits the version counter cannot see ---------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_an_edit_through_data_of_a_typed_view_is_detected(dtype):
    buffer = random_bytes(256 * 8)
    weight = buffer[256 * 2 : 256 * 4].view(dtype).view(8, -1)
    weight.copy_(torch.randn(weight.shape).to(dtype))
    detector = remembered(buffer)
    weight.data[3] += torch.ones_like(weight[3])  # peft's merge: weight.data += delta
    assert detector.changed_windows(buffer) == [window_range(2, buffer.numel())]


@pytest.mark.fast
def test_several_changed_chunks_give_merged_ranges_in_order():
    buffer = random_bytes(256 * 6 + 10)
    detector = remembered(buffer)
    for byte in (256 * 5 + 3, 256 * 1 + 7, 256 * 2, 256 * 6 + 9):
        buffer[byte] += 1
    assert detector.changed_windows(buffer) == [(256, 768), (1280, 1546)]


@pytest.mark.fast
def test_the_reference_is_the_last_remembered_state():
    buffer = random_bytes(256 * 2)
    detector = remembered(buffer)
    buffer[10] += 1
    detector.remember(buffer)  # the next load brought the edited bytes
    assert detector.changed_windows(buffer) == []
    buffer[10] -= 1  # edited back to the packed bytes: a change from the load, not from the pack
    assert detector.changed_windows(buffer) == [(0, 256)]


@pytest.mark.fast
def test_the_documented_blind_spot_is_a_rectangle_of_cancelling_changes():
    """What the module docstring says can escape: four words, +d/-d in two rows and two columns."""
    buffer = torch.zeros(256, dtype=torch.int64).view(torch.uint8)
    words = buffer.view(torch.int64)
    detector = remembered(buffer)
    columns = SMALL.columns
    words[0], words[1], words[columns], words[columns + 1] = 5, -5, -5, 5
    assert detector.changed_windows(buffer) == []


# --- misuse ---------------------------------------------------------------------------------------

@pytest.mark.fast
def test_changed_chunks_before_remember_raises():
    with pytest.raises(RuntimeError, match="remember"):
        ChangeDetector(SMALL).changed_windows(random_bytes(256))


@pytest.mark.fast
@pytest.mark.parametrize("bad, error", [
    (torch.zeros(8, dtype=torch.float32), TypeError),
    (torch.zeros(2, 8, dtype=torch.uint8), TypeError),
    (torch.zeros(16, dtype=torch.uint8)[::2], ValueError),
    (torch.zeros(16, dtype=torch.uint8)[3:], ValueError),
    ([0] * 8, TypeError),
])
def test_a_buffer_that_is_not_aligned_contiguous_bytes_is_refused(bad, error):
    with pytest.raises(error):
        window_digests(bad, SMALL)
    with pytest.raises(error):
        ChangeDetector(SMALL).remember(bad)


@pytest.mark.fast
def test_a_buffer_of_another_length_is_refused():
    detector = remembered(random_bytes(512))
    with pytest.raises(ValueError, match="remember"):
        detector.changed_windows(random_bytes(256))


@pytest.mark.fast
@pytest.mark.parametrize("window_nbytes, columns", [(0, 4), (256, 0), (100, 4), (256, 64)])
def test_a_layout_that_does_not_tile_a_window_is_refused(window_nbytes, columns):
    with pytest.raises(ValueError):
        DigestLayout(window_nbytes=window_nbytes, columns=columns)


@pytest.mark.fast
def test_take_changes_answers_once_then_counts_every_byte_as_changed():
    """An eviction's question: the changed windows, and the reference forgotten; asked again
    (an eviction cut short after asking, run again), every byte is changed: never too few."""
    buffer = random_bytes(600)
    detector = remembered(buffer)
    buffer[300] ^= 0xFF
    assert detector.take_changes(buffer) == [window_range(1, 600)]
    assert "nothing remembered" in repr(detector)
    assert detector.take_changes(buffer) == [(0, 600)]
    assert detector.take_changes(random_bytes(0)) == []
    detector.remember(buffer)
    assert detector.take_changes(buffer) == []


@pytest.mark.fast
def test_forget_drops_the_reference_and_repr_says_so():
    buffer = random_bytes(600)
    detector = remembered(buffer)
    assert "600 bytes in 3 windows" in repr(detector)
    detector.forget()
    assert "nothing remembered" in repr(detector)
    with pytest.raises(RuntimeError):
        detector.changed_windows(buffer)


# --- accelerator ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_digests_equal_cpu_digests_and_detect_edits_on_the_device():
    device = accelerator_device()
    buffer = random_bytes(9 * 2**20 + 13, seed=4)  # an odd length: no dtype view of it all
    for layout in (DigestLayout.for_device(device), DigestLayout.for_device(torch.device("cpu"))):
        on_device = buffer.to(device)
        assert torch.equal(window_digests(on_device, layout).cpu(), window_digests(buffer, layout))
        detector = remembered(on_device, layout)
        assert detector.changed_windows(on_device) == []
        edited = 4 * 2**20  # in window 4 MiB // window_nbytes
        on_device[edited:edited + 4].view(torch.float32).add_(1.0)
        window = (4 * 2**20) // layout.window_nbytes
        assert detector.changed_windows(on_device) == [window_range(window, buffer.numel(), layout)]
