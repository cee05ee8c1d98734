"""The simulated accelerator itself (tests/simdevice): that it is a faithful, asynchronous device.

The checks run in one Python process of their own with the simulator loaded (loading it renames
PrivateUse1 for the whole process; this pytest process stays a CPU process), each check a function
run in turn; the test of that name reports its outcome. The protection check, which ends its process,
runs in a process of its own. A build failure skips these tests with the compiler's message, except
under CI (CI=true), where it fails them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_PRELUDE = """\
import sys
sys.path.insert(0, {repo!r})
import torch
from tests import simdevice
sim = simdevice.load()
"""

_RUNNER = """
import json, traceback
_defaults = simdevice.get_controls()
_results = {}
for _name, _check in list(globals().items()):
    if not _name.startswith("test_"):
        continue
    try:
        _check()
        _results[_name] = "ok"
    except BaseException:
        _results[_name] = traceback.format_exc()
    finally:
        torch.accelerator.synchronize()
        simdevice.load(**_defaults)
print("RESULTS " + json.dumps(_results))
"""

_CHECKS: dict[str, str] = {}


def _run(body: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = _PRELUDE.format(repo=str(REPO)) + body
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _skip_or_fail(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    """Run every check in one sim process (building the simulator first if needed, cached)."""
    script = "".join(f"def {name}():\n{textwrap.indent(body, '    ')}\n" for name, body in _CHECKS.items())
    done = _run(script + _RUNNER, timeout=900)
    if "SimBuildError" in done.stderr:
        _skip_or_fail(f"the simulated device did not build:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"the check process died (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1][len("RESULTS "):])


def sim_check(body: str):
    """Register `body` as a check run in the sim process; the decorated test reports its outcome."""

    def register(function):
        _CHECKS[function.__name__] = textwrap.dedent(body).strip("\n") + "\n"

        def test(outcomes):
            assert outcomes[function.__name__] == "ok", outcomes[function.__name__]

        test.__name__ = function.__name__
        test.__doc__ = function.__doc__
        return test

    return register


@sim_check("""
        assert sim == torch.device("sim", 0)
        assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
        assert torch.accelerator.current_accelerator() == torch.device("sim")
        assert torch.accelerator.current_stream().stream_id == 0
        side = torch.Stream("sim")
        assert side.device == sim and side.stream_id != 0
        event = torch.Event("sim")
        event.record(side)
        torch.accelerator.synchronize()
        assert event.query() and side.query()
        free, total = torch.accelerator.get_memory_info()
        assert total == simdevice.get_controls()["capacity"] and free <= total
        x = torch.ones(4).sim()                       # a generated method
        assert x.is_sim and x.device == sim
        assert simdevice.load(compute_delay=0.0) == sim    # idempotent
    """)
def test_the_device_generic_api_reaches_the_simulator():
    pass


@sim_check("""
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
            host = (torch.randn(37, 19, generator=g) * 100).to(dtype)
            pinned = host.pin_memory()
            assert pinned.is_pinned() and not host.is_pinned()
            device = host.to(sim)                                   # pageable H2D
            from_pinned = pinned.to(sim, non_blocking=True)         # asynchronous H2D
            on_device = device.clone()                              # D2D
            strided = device.t().contiguous()                       # non-contiguous source on device
            back = torch.empty_like(host).pin_memory()
            back.copy_(from_pinned, non_blocking=True)              # asynchronous D2H
            torch.accelerator.synchronize()
            for d in (device, from_pinned, on_device):
                assert torch.equal(d.cpu(), host), dtype
            assert torch.equal(strided.cpu(), host.t().contiguous())
            assert torch.equal(back, host)
            assert device.data_ptr() != from_pinned.data_ptr() and simdevice.is_device_pointer(device.data_ptr())
    """)
def test_copies_are_bit_exact_in_every_direction():
    pass


@sim_check("""
        copy_stream = torch.Stream("sim")
        src = torch.arange(1000, dtype=torch.float32).pin_memory()
        dst = torch.zeros(1000, device=sim)
        done = torch.Event("sim")
        copy_stream.wait_stream(torch.accelerator.current_stream())   # dst's zero fill first
        with simdevice.hold(copy_stream):
            with copy_stream:
                dst.copy_(src, non_blocking=True)
                done.record(copy_stream)
            assert not done.query()
            assert torch.equal(dst.cpu(), torch.zeros(1000))   # read on the default stream: not copied yet
        done.synchronize()
        assert torch.equal(dst.cpu(), src)
    """)
def test_an_asynchronous_copy_runs_only_when_its_stream_runs():
    pass


@sim_check("""
        simdevice.load(asynchronous=True, compute_delay=0.001)
        copy_stream = torch.Stream("sim")
        src = torch.full((256,), 3.0).pin_memory()
        def step(wait: bool) -> torch.Tensor:
            buffer = torch.zeros(256, device=sim)
            copied = torch.Event("sim")
            copy_stream.wait_stream(torch.accelerator.current_stream())   # the zero fill first
            with simdevice.hold(copy_stream):
                with copy_stream:
                    buffer.copy_(src, non_blocking=True)
                    copied.record(copy_stream)
                if wait:
                    torch.accelerator.current_stream().wait_event(copied)
                out = buffer * 2                 # queued on the default stream
                if not wait:
                    out = out.cpu()              # the default stream ran it on the old bytes
            return out.cpu()
        assert torch.equal(step(wait=False), torch.zeros(256))
        assert torch.equal(step(wait=True), torch.full((256,), 6.0))
    """)
def test_a_missing_wait_event_gives_wrong_bits_and_the_wait_fixes_it():
    pass


@sim_check("""
        stream = torch.accelerator.current_stream()
        start, end = torch.Event("sim", enable_timing=True), torch.Event("sim", enable_timing=True)
        x = torch.ones(8, device=sim)
        with simdevice.controls(compute_delay=0.05):
            with simdevice.hold(stream):
                start.record(stream)
                y = x + 1
                end.record(stream)
                assert not start.query() and not end.query() and not stream.query()
            end.synchronize()
        assert start.query() and end.query()
        assert start.elapsed_time(end) >= 45.0
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        assert simdevice.get_controls()["compute_delay"] == 0.0   # restored
    """)
def test_events_query_synchronize_and_time():
    pass


@sim_check("""
        stream = torch.accelerator.current_stream()
        start, end = torch.Event("sim", enable_timing=True), torch.Event("sim", enable_timing=True)
        with simdevice.count_host_syncs() as counted:
            with simdevice.hold(stream):
                start.record(stream)
                simdevice.busy(0.05)
                end.record(stream)
                assert not end.query() and not stream.query()   # queued, the host did not wait
        assert counted[0] == 0
        end.synchronize()
        assert start.elapsed_time(end) >= 45.0
        try:
            simdevice.busy(-1.0)
        except RuntimeError as refused:
            assert "busy seconds must be finite and >= 0" in str(refused)
        else:
            raise AssertionError("a negative busy time was queued")
    """)
def test_a_busy_kernel_keeps_its_stream_busy_without_a_host_wait():
    pass


@sim_check("""
        stream = torch.accelerator.current_stream()
        host = torch.ones(2**20, dtype=torch.uint8).pin_memory()
        on_device = host.to(sim)
        def timed(copy) -> float:
            start, end = torch.Event("sim", enable_timing=True), torch.Event("sim", enable_timing=True)
            start.record(stream)
            copy()
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end)
        with simdevice.controls(copy_bandwidth=2**20 / 0.1, device_copy_bandwidth=2**20 / 0.01):
            over_the_link = timed(lambda: on_device.copy_(host, non_blocking=True))   # 100 ms
            # A busy host only adds to a measured time: the least of several is the rate's own.
            within_the_device = min(timed(lambda: on_device.clone()) for _ in range(5))  # 10 ms
        assert over_the_link >= 90.0, over_the_link
        assert 9.0 <= within_the_device < 60.0, within_the_device
    """)
def test_copies_within_the_device_have_their_own_bandwidth():
    pass


@sim_check("""
        side = torch.Stream("sim")
        a = torch.empty(4096, device=sim); pa = a.data_ptr(); del a
        b = torch.empty(4096, device=sim)
        assert b.data_ptr() == pa                                # same stream: reused
        pb = b.data_ptr(); del b
        with side:
            c = torch.empty(4096, device=sim)
        assert c.data_ptr() != pb                                # another stream: not reused
        del c
        d = torch.empty(4096, device=sim); pd = d.data_ptr()
        with simdevice.hold(side):
            with side:
                e = d * 2                                        # side reads d, later
            d.record_stream(side)
            del d
            f = torch.empty(4096, device=sim)
            assert f.data_ptr() != pd                            # deferred until side ran
        side.synchronize()
        g = torch.empty(4096, device=sim)
        assert g.data_ptr() == pd
        stats = torch.accelerator.memory_stats()
        assert stats["allocated_bytes.all.current"] == torch.accelerator.memory_allocated() > 0
        assert torch.accelerator.max_memory_allocated() >= torch.accelerator.memory_allocated()
        reserved = torch.accelerator.memory_reserved()
        del e, f, g
        torch.accelerator.empty_cache()
        assert torch.accelerator.memory_reserved() < reserved
    """)
def test_allocator_reuse_is_stream_aware_and_respects_record_stream():
    pass


@sim_check("""
        torch.accelerator.empty_cache()
        capacity = torch.accelerator.memory_reserved() + (1 << 20)   # 1 MiB beyond what is held now
        with simdevice.controls(capacity=capacity):
            kept = torch.empty(100_000, device=sim)              # 400 kB
            try:
                torch.empty(300_000, device=sim)                 # 1.2 MB more
            except torch.OutOfMemoryError as error:
                assert "capacity" in str(error)
            else:
                raise AssertionError("no OutOfMemoryError")
            free, total = torch.accelerator.get_memory_info()
            assert total == capacity and free == total - torch.accelerator.memory_reserved()
            torch.empty(100_000, device=sim)                     # still room for this
    """)
def test_allocation_beyond_capacity_raises_out_of_memory():
    pass


@sim_check("""
        assert torch.accelerator.get_memory_info()[1] > 0
        with simdevice.controls(memory_info=False):
            try:
                torch.accelerator.get_memory_info()
            except NotImplementedError as error:
                assert "getMemoryInfo is not implemented" in str(error)
            else:
                raise AssertionError("memory info answered while turned off")
        assert torch.accelerator.get_memory_info()[1] > 0
    """)
def test_memory_info_can_be_turned_off():
    pass


def test_protection_kills_a_host_read_of_device_memory():
    body = """
        import ctypes
        simdevice.load(protect=True)
        x = torch.arange(1000, dtype=torch.float32, device=sim)
        lin = torch.nn.Linear(8, 4)
        ref = lin(torch.ones(2, 8))
        assert torch.equal(lin.to(sim)(torch.ones(2, 8, device=sim)).cpu(), ref)   # the device may
        assert torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32))
        torch.accelerator.synchronize()
        print("device work ran", flush=True)
        ctypes.string_at(x.data_ptr(), 4)                       # the host may not
        print("host read device memory", flush=True)
    """
    done = _run(textwrap.dedent(body))
    if "SimBuildError" in done.stderr:
        _skip_or_fail(done.stderr[-4000:])
    assert "device work ran" in done.stdout, done.stderr
    assert "host read device memory" not in done.stdout
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr)


@sim_check("""
        pinned = torch.ones(1000).pin_memory()
        pageable = torch.ones(1000)
        x = torch.ones(1000, device=sim)
        stream = torch.accelerator.current_stream()
        event = torch.Event("sim")
        def count(action) -> int:
            with simdevice.count_host_syncs() as counted:
                action()
            return counted[0]
        assert count(lambda: x.sum().item()) == 1
        assert count(lambda: torch.nonzero(x)) == 1                          # data-dependent shape
        assert count(lambda: torch.equal(x, x)) == 1                         # a host value
        assert count(torch.accelerator.synchronize) == 1
        assert count(stream.synchronize) == 1
        assert count(lambda: (event.record(), event.synchronize())) == 1
        assert count(lambda: x.copy_(pageable)) == 1                         # pageable H2D
        assert count(lambda: x.copy_(pinned, non_blocking=False)) == 1       # blocking H2D
        assert count(lambda: x.cpu()) == 1                                   # D2H into pageable memory
        assert count(lambda: x.copy_(pinned, non_blocking=True)) == 0        # asynchronous H2D
        assert count(lambda: pinned.copy_(x, non_blocking=True)) == 0        # asynchronous D2H
        assert count(lambda: (x * 2 + x).clone()) == 0                       # compute and D2D
        assert count(lambda: event.query()) == 0
        start = simdevice.host_syncs()
        torch.accelerator.synchronize()
        assert simdevice.host_syncs() == start + 1
    """)
def test_the_host_sync_counter_counts_every_host_wait_and_nothing_else():
    pass


@sim_check("""
        import threading, time
        stream = torch.accelerator.current_stream()
        x = torch.ones(1024, device=sim)
        torch.accelerator.synchronize()
        assert simdevice.waiting_threads() == set()
        listed = []
        with simdevice.hold(stream):
            y = x * 2                                            # queued, not run
            waiter = threading.Thread(target=stream.synchronize)
            waiter.start()
            deadline = time.monotonic() + 60                     # bounded: the waiter must block
            while waiter.ident not in simdevice.waiting_threads() and time.monotonic() < deadline:
                time.sleep(0.001)
            listed = simdevice.waiting_threads()
            assert threading.get_ident() not in listed           # this thread queues, never waits
        waiter.join(timeout=60)
        assert waiter.ident in listed and not waiter.is_alive()
        assert simdevice.waiting_threads() == set()              # gone once the wait returned
        stream.synchronize()                                     # nothing queued: never listed
        event = torch.Event("sim")
        with simdevice.hold(stream):
            event.record(stream)
            side = torch.Stream("sim")
            side.wait_event(event)                               # the device waits, not the host
            assert simdevice.waiting_threads() == set()
        torch.accelerator.synchronize()
        assert torch.equal(y.cpu(), torch.full((1024,), 2.0))
    """)
def test_waiting_threads_lists_a_thread_only_while_its_host_wait_blocks():
    pass


@sim_check("""
        nbytes = (24 << 20) + 123                                # larger than any cached block
        before = simdevice.pinned_bytes()
        pinned = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        held = simdevice.pinned_bytes()
        assert held >= before + 2 * nbytes, (before, held)
        del pinned
        assert simdevice.pinned_bytes() == held                  # freed blocks stay cached
        again = torch.empty(nbytes, dtype=torch.uint8).pin_memory()   # ... and are reused
        assert simdevice.pinned_bytes() == held
    """)
def test_pinned_bytes_reads_the_pinned_allocator_cache_included():
    pass


@sim_check("""
        torch.accelerator.synchronize()
        before = torch.accelerator.memory_stats()["requested_bytes.all.current"]
        x = torch.empty(1000, dtype=torch.uint8, device=sim)     # rounded up to a 1024-byte block
        stats = torch.accelerator.memory_stats()
        assert stats["requested_bytes.all.current"] == before + 1000
        assert torch.accelerator.memory_allocated() >= 1024
        del x
        assert torch.accelerator.memory_stats()["requested_bytes.all.current"] == before
    """)
def test_requested_bytes_go_up_and_down_with_each_allocation():
    pass


@sim_check("""
        x = torch.arange(24, dtype=torch.float32, device=sim)
        stream = torch.accelerator.current_stream()
        torch.accelerator.synchronize()
        with simdevice.hold(stream):
            views = [x.view(4, 6), x.view(4, 6)[1:3], x.view(4, 6).t(), x.reshape(2, 12),
                     x.as_strided((3,), (2,), 1), x.unfold(0, 4, 4), x[None], x.view(2, 3, 4).permute(2, 0, 1)]
            assert stream.query()                                # nothing was queued
        for v in views:
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        host = torch.arange(24, dtype=torch.float32)
        expected = [host.view(4, 6), host.view(4, 6)[1:3], host.view(4, 6).t(), host.reshape(2, 12),
                    host.as_strided((3,), (2,), 1), host.unfold(0, 4, 4), host[None],
                    host.view(2, 3, 4).permute(2, 0, 1)]
        for v, e in zip(views, expected):
            assert torch.equal(v.cpu(), e)
        y = torch.zeros(2, device=sim)
        y.resize_(10)
        assert y.shape == (10,) and torch.equal(y[:2].cpu(), torch.zeros(2))
    """)
def test_views_are_metadata_only():
    pass


@sim_check("""
        # The same op again and again: the Meta results are reused ([Note: the Meta results cache]
        # in sim.cpp); shapes, strides, in place, out= and a shape a host tensor decides stay right.
        g = torch.Generator().manual_seed(0)
        for rows in (3, 5, 3, 5):
            host = torch.randn(rows, 8, generator=g)
            x = host.to(sim)
            for _ in range(2):
                y = torch.nn.functional.layer_norm(x, (8,))
                assert y.shape == (rows, 8) and y.stride() == (8, 1)
                assert torch.equal(y.cpu(), torch.nn.functional.layer_norm(host, (8,)))
                t = x.t().contiguous().t()          # column-major: the same sizes, other strides
                assert (t * 2).stride() == t.stride() and torch.equal((t * 2).cpu(), host * 2)
            out = torch.empty(0, device=sim)
            torch.add(x, 1.0, out=out)               # out= resized by the Meta kernel
            assert out.shape == (rows, 8) and torch.equal(out.cpu(), host + 1.0)
            z = x.clone()
            assert z.mul_(3.0) is z and torch.equal(z.cpu(), host * 3.0)
            for keep in (rows - 1, 1, rows - 1):    # a host mask decides the shape
                mask = torch.arange(rows) < keep
                assert torch.equal(x[mask].cpu(), host[mask])
            assert torch.equal(torch.add(x, 1.0, alpha=2).cpu(), host + 2.0)
            assert torch.equal(torch.add(x, 1.0, alpha=3).cpu(), host + 3.0)
    """)
def test_an_op_run_again_gets_its_shapes_right_from_reused_meta_results():
    pass


@sim_check("""
        weight = torch.nn.Parameter(torch.randn(16, 8))
        kept = weight.detach().clone()
        on_device = weight.data.to(sim)
        weight.data = on_device
        assert weight.device == sim and weight.data_ptr() == on_device.data_ptr()
        assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
        assert torch.equal(weight.detach().cpu(), kept)
        on_host = torch.empty(16, 8).pin_memory()
        on_host.copy_(weight.detach(), non_blocking=True)
        torch.accelerator.synchronize()
        weight.data = on_host
        assert weight.device.type == "cpu" and weight.data_ptr() == on_host.data_ptr()
        assert torch.equal(weight.detach(), kept)
    """)
def test_data_assignment_repoints_between_host_and_device():
    pass


@sim_check("""
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 16))
        inp = torch.randn(5, 32)
        expected = model(inp)
        model(inp).sum().backward()
        expected_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        image = torch.randn(2, 3, 8, 8)
        conv_expected = conv(image)
        conv_expected.square().sum().backward()
        conv_grad = conv.weight.grad.clone()
        conv.zero_grad(set_to_none=True)
        model.to(sim)
        conv.to(sim)
        for asynchronous in (False, True):
            with simdevice.controls(asynchronous=asynchronous, compute_delay=0.0005 if asynchronous else 0.0):
                out = model(inp.to(sim))
                out.sum().backward()
                assert torch.equal(out.cpu(), expected.detach()), asynchronous
                for p, g in zip(model.parameters(), expected_grads):
                    assert torch.equal(p.grad.cpu(), g), asynchronous
                model.zero_grad(set_to_none=True)
                conv_out = conv(image.to(sim))
                conv_out.square().sum().backward()
                assert torch.equal(conv_out.cpu(), conv_expected.detach()), asynchronous
                assert torch.equal(conv.weight.grad.cpu(), conv_grad), asynchronous
                conv.zero_grad(set_to_none=True)
                with torch.no_grad():
                    assert torch.equal(torch.nn.functional.linear(inp.to(sim), model[0].weight,
                                                                  model[0].bias).cpu(),
                                       torch.nn.functional.linear(inp, model[0].weight.cpu(),
                                                                  model[0].bias.cpu()))
    """)
def test_a_small_model_on_the_device_equals_the_cpu_bit_for_bit_in_both_modes():
    pass
