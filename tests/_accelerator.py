"""Where the accelerator tests run, and the device-generic checks they share.

Every test marked ``gpu`` needs an accelerator.  Which one it gets (``pytest --accelerator=...``):

* ``auto`` (the default): a real accelerator when this process has one; otherwise the simulated
  device of ``tests/simdevice`` *in a child pytest process* - loading the simulator renames
  PrivateUse1 and makes ``torch.accelerator`` report it for the whole process, so ``Scheduler()``
  and ``default_device()`` would pick it in the CPU tests.  The parent collects the accelerator
  tests as usual, runs them last, and reports for each the outcome the child had (one child for
  the session, started as soon as collection ends, so that it runs beside the CPU tests).
* ``sim``: this process loads the simulator before collection and runs only the accelerator tests
  (what the child runs).
* ``none``: the accelerator tests are skipped.

[Note: one child for the accelerator tests]
The child is ``python -m pytest --accelerator=sim --accelerator-results=FILE <node ids>``; it
writes one line per test phase to FILE (outcome, the failure's text, how long it took), and the
parent turns each into that test's outcome and duration.  The parent starts the child when
collection ends (`start_child`) and moves the accelerator tests to the end of its run, so the child
(the simulator's build, then the tests) runs while the parent runs the CPU tests - on two cores
that hid most of the child's four minutes; the first accelerator test the parent reaches waits for
the child to finish (`ChildRun.wait`).  A session that ends before then (``-x``, Ctrl-C) kills the
child's process group (`stop_child`).  The child runs with ``OMP_NUM_THREADS=1``: the simulator's
stream workers each run CPU kernels, and OpenMP teams on top of them made ops several times slower
on two cores (tests/simdevice/README.md).  A simulator that fails to build skips the accelerator
tests with the compiler's message, except under CI (``CI=true``), where it is an error: CI must
never pass because the accelerator half did not run.  ``RESIDENCY_MIN_ACCELERATOR_TESTS=N`` makes
the session fail when fewer than N accelerator tests passed (``.ci/run`` sets it).  A test also
marked ``harmless_removal`` (a synchronisation-audit experiment that shows a removal harmless:
tests/test_sync_audit.py) runs with them and fails like them, but its pass is not counted toward N:
it checks that a call is not needed, not that one is.

[Note: a second child for the long CPU tests]
On two cores the accelerator child leaves the second core idle for most of the run.  Tests marked
``beside`` (the long interrupt sweeps, the cold-start benchmark's run at the tiny scale, and a few
long tests that run processes of their own, ranks or a report: CPU-bound, no fixture shared with
the parent's tests) run in a second child, ``python -m pytest --accelerator=none ...`` with the parent's
``--sweep`` and ``--soak``, reported the same way; torch keeps its default threads there, so the
code paths swept are the CPU tests' own.  It starts the moment the accelerator child ends (at
once without one): three processes on two cores slowed every test, and the thread tests most.
The parent runs them last and waits for that child once.  The mark goes on as many of the longest
tests as balance the two cores: the accelerator child and these together take about what the
parent's share takes.  Only a session that also has other tests to run delegates them (run alone,
a test marked ``beside`` runs in the parent), and a child never delegates further.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
#: How long the child may run before its tests are reported as failed (a hang is a failure).
CHILD_TIMEOUT_S = 1500

_DELEGATED = pytest.StashKey[set]()  # node ids of the tests the accelerator child runs
_CHILD = pytest.StashKey["ChildRun"]()
_BESIDE = pytest.StashKey["ChildRun"]()  # the child of the tests marked beside
_SIMULATOR_ERROR = pytest.StashKey[str]()


def add_options(parser) -> None:
    parser.addoption(
        "--accelerator", choices=["auto", "sim", "none"], default="auto",
        help="where tests marked gpu run: a real accelerator if present, else the simulated "
             "device in a child process (auto); the simulated device in this process (sim); "
             "nowhere (none)")
    parser.addoption("--accelerator-results", default=None, help=argparse.SUPPRESS)


def configure(config) -> None:
    """Register the ``harmless_removal`` and ``beside`` marks; in a ``--accelerator=sim``
    process, load the simulator before anything is collected."""
    config.addinivalue_line(
        "markers", "harmless_removal: a synchronisation-audit experiment showing a removal "
                   "harmless on the simulated device; not counted toward "
                   "RESIDENCY_MIN_ACCELERATOR_TESTS (tests/_accelerator.py)")
    config.addinivalue_line(
        "markers", "beside: a long CPU test (an interrupt sweep) run in a second child process "
                   "beside the rest of the session ([Note: a second child for the long CPU "
                   "tests] in tests/_accelerator.py)")
    results = config.getoption("--accelerator-results")
    if results is not None:
        config.pluginmanager.register(ResultsWriter(results), "accelerator-results")
    if config.getoption("--accelerator") != "sim":
        return
    sys.path.insert(0, str(TESTS))
    try:
        import simdevice

        simdevice.load()
    except Exception as failure:  # the compiler's message, kept for the skip or the CI error
        if os.environ.get("CI") == "true":
            raise
        config.stash[_SIMULATOR_ERROR] = f"the simulated device did not build: {failure}"


def modify_items(config, items) -> None:
    mode = config.getoption("--accelerator")
    accelerator_tests = [item for item in items if "gpu" in item.keywords]
    if mode == "sim":
        _keep_only(config, items, accelerator_tests)
        error = config.stash.get(_SIMULATOR_ERROR, None)
        if error is not None:
            for item in accelerator_tests:
                item.add_marker(pytest.mark.skip(reason=error))
    elif mode == "none":
        for item in accelerator_tests:
            item.add_marker(pytest.mark.skip(reason="accelerator tests off (--accelerator=none)"))


def _keep_only(config, items, kept) -> None:
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def start_child(session) -> None:
    """Once collection is final (``-k``/``-m`` applied): in an ``auto`` process without an
    accelerator, move the accelerator tests to the end and start their child; move the tests
    marked ``beside`` to the end and start theirs (see the notes)."""
    _start_accelerator_child(session)
    _start_beside(session)


def _start_accelerator_child(session) -> None:
    config = session.config
    if config.getoption("--accelerator") != "auto" or torch.accelerator.is_available():
        return
    delegated = [item for item in session.items if "gpu" in item.keywords]
    config.stash[_DELEGATED] = {item.nodeid for item in delegated}
    if not delegated or config.option.collectonly:
        return
    _move_to_the_end(session, delegated)
    config.stash[_CHILD] = ChildRun(config, [item.nodeid for item in delegated])


def _start_beside(session) -> None:
    """Move the tests marked ``beside`` to the end and start their child, when the session has
    other tests to run meanwhile and is not a child itself (see the note)."""
    config = session.config
    if config.option.collectonly or config.getoption("--accelerator-results") is not None:
        return
    beside = [item for item in session.items
              if "beside" in item.keywords and "gpu" not in item.keywords]
    if not beside or len(beside) == len(session.items):
        return
    _move_to_the_end(session, beside)
    config.stash[_BESIDE] = ChildRun(config, [item.nodeid for item in beside],
                                     accelerator="none", what="long CPU tests",
                                     after=config.stash.get(_CHILD, None))


def _move_to_the_end(session, delegated: list) -> None:
    """Run `delegated` last, in their order: the parent reaches them once their child has had
    the rest of the run to finish them."""
    chosen = {id(item) for item in delegated}
    session.items[:] = [item for item in session.items if id(item) not in chosen] + delegated


def _children(config) -> list[ChildRun]:
    return [child for child in (config.stash.get(_CHILD, None), config.stash.get(_BESIDE, None))
            if child is not None]


def stop_child(session) -> None:
    """At the session's end: a child still running (the session stopped early) is killed."""
    for child in _children(session.config):
        child.stop()


def run_delegated(pyfuncitem) -> bool:
    """Report a delegated test's outcome from its child; False if it runs here."""
    for child in _children(pyfuncitem.config):
        if pyfuncitem.nodeid in child.nodeids:
            child.report(pyfuncitem.nodeid)
            return True
    return False


def child_duration(item) -> float | None:
    """How long a delegated test's phases took in its child (None: not delegated, or no
    report), so that ``--durations`` shows the child's figure, not the parent's wait."""
    for child in _children(item.config):
        if child.outcomes is not None and item.nodeid in child.outcomes:
            return child.outcomes[item.nodeid]["duration"]
    return None


class ChildRun:
    """One pytest process for a list of delegated tests (see the notes above): on the simulated
    device (``accelerator="sim"``, one OpenMP thread) or on the CPU (``"none"``), started at
    once or, with `after`, the moment that child ends; `report` waits for it the first time."""

    def __init__(self, config, nodeids: list[str], *, accelerator: str = "sim",
                 what: str = "accelerator tests", after: ChildRun | None = None) -> None:
        #: The node ids it runs, and what they are (for its messages).
        self.nodeids, self.what = frozenset(nodeids), what
        self._folder = tempfile.TemporaryDirectory(prefix=f"residency-{accelerator}-")
        self._results = Path(self._folder.name) / "results.jsonl"
        self._log = open(Path(self._folder.name) / "output.txt", "w+")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN",
                   f"--accelerator={accelerator}", f"--accelerator-results={self._results}",
                   *_passed_on(config), *nodeids]
        threads = {"OMP_NUM_THREADS": "1"} if accelerator == "sim" else {}
        #: When it was asked for: `CHILD_TIMEOUT_S` counts from here (a wait for `after` too).
        self.started = time.monotonic()
        #: Seconds the child ran, and the parent waited for it (once it finished).
        self.ran_s = self.waited_s = None
        self.outcomes: dict[str, dict] | None = None  # read once the child finished
        self.output = ""
        self._process: subprocess.Popen | None = None  # set at launch, under `_launching`
        self._stopped = False  # set by `stop`, under `_launching`: no launch after it
        self._launching = threading.Lock()
        self._ended = threading.Event()  # set the moment the child exits (or will never run)
        launch = functools.partial(subprocess.Popen, command, cwd=config.rootpath,
                                   stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True, env={**os.environ, **threads})
        threading.Thread(target=self._run, args=(launch, after), name=f"{accelerator}-child",
                         daemon=True).start()

    def _run(self, launch, after: ChildRun | None) -> None:
        if after is not None:  # the second core is the other child's until it ends
            after._ended.wait()
        with self._launching:
            if self._stopped:
                self._ended.set()
                return
            self._process = launch()
        launched = time.monotonic()
        self._process.wait()
        self.ran_s = time.monotonic() - launched
        self._ended.set()

    def _kill(self) -> None:
        """Kill the child's process group, or keep it from ever starting."""
        with self._launching:
            self._stopped = True
            process = self._process
        if process is None:
            self._ended.set()
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self._ended.wait()

    def wait(self) -> None:
        """Wait for the child (at most `CHILD_TIMEOUT_S` from when it was asked for) and read its
        outcomes."""
        if self.outcomes is not None:
            return
        waiting_since = time.monotonic()
        remaining = max(1.0, self.started + CHILD_TIMEOUT_S - waiting_since)
        timed_out = ""
        if not self._ended.wait(timeout=remaining):
            timed_out = f"the child timed out after {CHILD_TIMEOUT_S} s\n"
            self._kill()
        self.waited_s = time.monotonic() - waiting_since
        self._log.seek(0)
        self.output = timed_out + self._log.read()
        self.outcomes = _read_outcomes(self._results)
        self._log.close()
        self._folder.cleanup()

    def stop(self) -> None:
        """Kill the child and whatever it started (its own process group), if still running;
        its files go with it unless `wait` read them."""
        if not self._ended.is_set():
            self._kill()
        if self.outcomes is None:
            self._log.close()
            self._folder.cleanup()

    def report(self, nodeid: str) -> None:
        self.wait()
        outcome = self.outcomes.get(nodeid)
        if outcome is None:
            pytest.fail(f"the test did not report from the child process of the {self.what}:\n"
                        f"{self.output[-6000:]}", pytrace=False)
        if outcome["outcome"] == "failed":
            pytest.fail(f"failed in the child process of the {self.what}:\n{outcome['text']}",
                        pytrace=False)
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"])


def _passed_on(config) -> list[str]:
    """The options of this run the child needs too."""
    options = [f"--sweep={config.getoption('--sweep')}"]
    if config.getoption("--soak"):
        options.append("--soak")
    return options


def _read_outcomes(path: Path) -> dict[str, dict]:
    """One outcome per test: the first phase that failed or skipped, else its call's pass (a test
    whose call never reported has none); its duration is that of all its phases."""
    outcomes: dict[str, dict] = {}
    durations: dict[str, float] = {}
    if not path.exists():
        return outcomes
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        nodeid = entry["nodeid"]
        durations[nodeid] = durations.get(nodeid, 0.0) + entry["duration"]
        if entry["when"] != "call" and entry["outcome"] == "passed":
            continue
        known = outcomes.get(nodeid)
        if known is None or known["outcome"] == "passed":
            outcomes[nodeid] = entry
    for nodeid, outcome in outcomes.items():
        outcome["duration"] = durations[nodeid]
    return outcomes


class ResultsWriter:
    """In the child: appends each test phase's outcome to the results file, one JSON line each."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        else:
            text = report.longreprtext
        with open(self.path, "a") as results:
            results.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                                      "outcome": report.outcome, "duration": report.duration,
                                      "text": text}) + "\n")


def counts(config) -> tuple[int, int, int]:
    """(passed, failed, skipped) accelerator tests of this session so far; a passed
    ``harmless_removal`` experiment is not among the passed (see the module docstring)."""
    passed, failed, skipped, _ = _tallies(config)
    return passed, failed, skipped


def _tallies(config) -> tuple[int, int, int, int]:
    """(passed, failed, skipped, harmless-removal experiments passed) accelerator tests."""
    stats = config.pluginmanager.get_plugin("terminalreporter").stats

    def marked(kind: str, when: str | None = None, harmless: bool | None = None) -> int:
        return sum(1 for r in stats.get(kind, [])
                   if "gpu" in r.keywords and (when is None or r.when == when)
                   and (harmless is None or ("harmless_removal" in r.keywords) == harmless))

    return (marked("passed", "call", harmless=False), marked("failed"), marked("skipped"),
            marked("passed", "call", harmless=True))


def summarize(terminalreporter, config) -> None:
    """Say where the accelerator tests ran, and whether enough of them did."""
    passed, failed, skipped, harmless = _tallies(config)
    if passed or failed or skipped or harmless:
        terminalreporter.write_line(f"accelerator tests ({_where(config)}): {passed} passed, "
                                    f"{failed} failed, {skipped} skipped; {harmless} harmless-"
                                    "removal experiments passed (not counted)")
    beside = config.stash.get(_BESIDE, None)
    if beside is not None and beside.ran_s is not None:
        terminalreporter.write_line(
            f"{len(beside.nodeids)} long CPU tests (marked beside) ran in a second child process: "
            f"{beside.ran_s:.0f} s beside the rest, then the parent waited {beside.waited_s:.0f} s")
    minimum = _minimum()
    if passed < minimum:
        terminalreporter.write_line(f"FAILED: {passed} accelerator tests passed; "
                                    f"RESIDENCY_MIN_ACCELERATOR_TESTS asks for {minimum}")


def too_few(config) -> bool:
    """Whether fewer accelerator tests passed than RESIDENCY_MIN_ACCELERATOR_TESTS asks."""
    return counts(config)[0] < _minimum()


def _minimum() -> int:
    return int(os.environ.get("RESIDENCY_MIN_ACCELERATOR_TESTS", "0"))


def _where(config) -> str:
    child = config.stash.get(_CHILD, None)
    if child is not None and child.ran_s is not None:
        return (f"simulated device, in a child process: it ran {child.ran_s:.0f} s beside the CPU "
                f"tests, then the parent waited {child.waited_s:.0f} s for it")
    if config.stash.get(_DELEGATED, None) is not None:
        return "simulated device, in a child process"
    if config.getoption("--accelerator") == "sim":
        return "simulated device"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "none"


# -- checks the accelerator tests share -------------------------------------------------------


def device() -> torch.device:
    """The accelerator the tests run on (real, or the simulated ``sim`` device)."""
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None, "an accelerator test ran without an accelerator"
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def require_cuda(why: str) -> None:
    """Skip an accelerator test that only CUDA can run, saying why (a test of a CUDA API)."""
    if device().type != "cuda":
        pytest.skip(f"CUDA only: {why}")


def is_simulated(target: torch.device) -> bool:
    return target.type == "sim"


@contextlib.contextmanager
def no_host_synchronisation():
    """Fail if the body makes the host wait for the device.

    CUDA: its sync-debug mode raises at the waiting call.  The simulated device: its counter of
    host waits (stream, event and device synchronize, reads of device values, copies that are not
    asynchronous) must not move.
    """
    target = device()
    if target.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    if not is_simulated(target):
        pytest.skip(f"no way to count host synchronisations on {target.type}")
    import simdevice

    before = simdevice.host_syncs()
    yield
    assert simdevice.host_syncs() == before, (
        f"{simdevice.host_syncs() - before} host synchronisations where none may happen")


def host_synchronisations(body) -> int:
    """How many times `body()` made the host wait for the device (simulated device only)."""
    import simdevice

    before = simdevice.host_syncs()
    body()
    return simdevice.host_syncs() - before
