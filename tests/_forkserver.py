"""Run a real command line (``python -m residency ...``, ``python examples/x.py ...``) in a child
forked from an interpreter that has already imported the third-party libraries.

    done = run_python(["-m", "residency", "--size", "tiny"], env=ENV)   # a CompletedProcess
    assert done.returncode == 0, done.stderr

[Note: a fork server for the command-line tests]
A fresh interpreter spends seconds importing torch (and torch._dynamo, diffusers, transformers)
before the command line does anything.  A server process (one per preload list, environment and
folder) imports only those third-party modules - never a module of ours: it checks - then forks a
child per command.  The child does what ``python ARGS`` does: sets ``sys.argv`` and
``sys.path[0]``, runs the module (``runpy._run_module_as_main``, as ``-m`` does) or the script's
code in a fresh ``__main__`` module, with its stdout and stderr on files of its own, turns
``SystemExit`` and an uncaught exception into the exit status as the interpreter does (the
traceback through ``sys.excepthook``), waits for non-daemon threads, runs the atexit handlers
and exits.  So every module of ours is
imported fresh in each child, argument parsing and all, and the test reads the real process's exit
status, stdout and stderr.  Not for a test that measures the process itself (its memory: the
child shares the server's pages) or that changes what can be imported.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: What the servers import before they fork: torch and what loading our modules makes torch load.
TORCH = ("torch", "torch._dynamo", "torch.profiler", "torch.distributed", "attrs")
#: And the diffusers pipelines' libraries, for the commands that load one.
DIFFUSERS = (*TORCH, "diffusers", "transformers")

_SERVER = r"""
import atexit, importlib, json, os, runpy, sys, threading, types
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
ours = sorted(m for m in sys.modules if m == "residency" or m.startswith("residency."))
if ours:
    raise SystemExit(f"the fork server must not import our modules; loaded: {ours}")
requests = sys.stdin
sys.stdin = open(os.devnull)


def _exit_status(error):
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(request):
    os.setpgid(0, 0)  # the test's timeout kills the command and whatever it started
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # not this server's namespace
    try:
        if argv[0] == "-m":  # what python -m does
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:  # what python SCRIPT does
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            main.__file__, main.__cached__ = argv[0], None
            with open(argv[0], "rb") as source:
                code = compile(source.read(), argv[0], "exec")
            exec(code, main.__dict__)
        status = 0
    except SystemExit as error:
        status = _exit_status(error)
    except BaseException as error:
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename == "<string>":
            trace = trace.tb_next  # this server's own frames: a fresh python has none
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        status = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    except SystemExit as error:
        status = _exit_status(error)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)


print(json.dumps({"ready": True}), flush=True)
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _child(request)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Server:
    def __init__(self, preload: tuple[str, ...], env: dict[str, str], cwd: str) -> None:
        self._log = tempfile.TemporaryFile("w+")  # the server's own stderr (its import warnings)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(list(preload))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env, cwd=cwd,
        )
        #: The command running now (its process group), or None.
        self._running: int | None = None
        #: What was read from the server's stdout and not yet taken as a line.
        self._pending = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self._read(timeout=300)  # {"ready": true}

    def _read(self, timeout: float) -> dict:
        """The server's next line.  Read from the pipe's descriptor into a buffer of our own: a
        buffered ``readline`` can take two lines at once (a quick command's pid and its exit
        status), and the selector would then wait for the second, already read, until the
        timeout."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                self.process.wait()
                self._log.seek(0)
                raise RuntimeError(f"the fork server died:\n{self._log.read()[-3000:]}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def run(self, argv: list[str], env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="forkserver-") as folder:
            stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "env": env, "stdout": str(stdout), "stderr": str(stderr)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            self._running = self._read(timeout=60)["pid"]
            try:
                returncode = self._read(timeout=timeout)["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
            self._running = None
            return subprocess.CompletedProcess(
                [sys.executable, *argv], returncode, stdout.read_text(), stderr.read_text()
            )

    def close(self) -> None:
        """Kill the command still running (a timeout, an interrupt), then the server."""
        if self._running is not None:
            try:
                os.killpg(self._running, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self._log):
            stream.close()


#: (preload, environment, folder) -> its server; started on first use, alive for the session.
_servers: dict[tuple, _Server] = {}


def run_python(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 120,
    preload: tuple[str, ...] = TORCH,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` in a child
    of a fork server (see the Note above): the same exit status, stdout and stderr."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    # The server's environment is what torch read at its import (OMP_NUM_THREADS, ...); the child
    # gets the whole of `env` (with this test's PYTEST_CURRENT_TEST, which is no reason for a new
    # server).
    key = (tuple(preload), tuple(sorted(i for i in env.items() if i[0] != "PYTEST_CURRENT_TEST")),
           cwd)
    server = _servers.get(key)
    if server is None or server.process.poll() is not None:
        server = _servers[key] = _Server(tuple(preload), env, cwd)
    try:
        return server.run(list(argv), env, timeout)
    except BaseException:  # a timeout, an interrupt: the next command gets a new server
        _servers.pop(key, None)
        server.close()
        raise


def close_servers() -> None:
    while _servers:
        _servers.popitem()[1].close()


atexit.register(close_servers)
