"""tests/_forkserver.py: a command run in a child of the fork server ends as it would in a fresh
``python``: the same exit status, stdout and stderr, and nothing of ours imported beforehand."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from _forkserver import run_python

SCRIPT = """
import sys, threading, atexit
print("ours:", sorted(m for m in sys.modules if m.partition(".")[0] == "residency"))
print("argv:", sys.argv[1:], "path0 is the script's folder:", sys.path[0] == {folder!r})
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: print("a thread the exit waits for")).start()
{ending}
"""


@pytest.mark.parametrize(("ending", "status"), [
    ("", 0), ("sys.exit(7)", 7), ("sys.exit('a message')", 1), ("raise ValueError('bad')", 1),
])
def test_a_script_ends_as_in_a_fresh_interpreter(tmp_path, ending, status):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(folder=str(tmp_path), ending=ending))
    argv = [str(script), "--flag", "x y"]
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    forked = run_python(argv, timeout=60, preload=("json",))
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == status
    assert "ours: []" in forked.stdout and "path0 is the script's folder: True" in forked.stdout
    assert "atexit ran" in forked.stdout and "a thread the exit waits for" in forked.stdout


def test_a_module_runs_as_with_dash_m(tmp_path):
    (tmp_path / "tool.py").write_text(
        "import sys\nprint(sys.argv, sys.path[0] == {!r}, __name__)\n"
        "sys.exit('usage: tool: bad flag')\n".format(str(tmp_path)))
    argv = ["-m", "tool", "--flag"]
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path)
    forked = run_python(argv, cwd=tmp_path, timeout=60, preload=("json",))
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (fresh.returncode, fresh.stdout, fresh.stderr) == \
        (1, f"[{str(tmp_path / 'tool.py')!r}, '--flag'] True __main__\n", "usage: tool: bad flag\n")


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    sleeper, pid_file = tmp_path / "sleeper.py", tmp_path / "pid"
    sleeper.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                       "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(sleeper)], timeout=5, preload=("json",))  # time to write its pid
    pid, deadline = int(pid_file.read_text()), time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:  # SIGKILL is delivered asynchronously
        time.sleep(0.05)
    assert not _alive(pid)
    (tmp_path / "quick.py").write_text("print('next')\n")
    done = run_python([str(tmp_path / "quick.py")], timeout=60, preload=("json",))
    assert (done.returncode, done.stdout) == (0, "next\n")


def _alive(pid: int) -> bool:
    """Still running (a zombie - dead, not yet reaped by its parent - is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_that_ends_before_its_pid_is_read_is_not_waited_for(tmp_path):
    """The server's two lines (the child's pid, then its exit status) can both be in the pipe when
    the first is read: the second must come from what was already read, not from a wait on the
    pipe (which timed out after 60 s: a flake of the full run)."""
    import fcntl
    import json
    import termios

    from _forkserver import _Server

    (tmp_path / "quick.py").write_text("pass\n")
    server = _Server(("json",), dict(os.environ), str(tmp_path))
    try:
        request = {"argv": [str(tmp_path / "quick.py")], "env": dict(os.environ),
                   "stdout": str(tmp_path / "out"), "stderr": str(tmp_path / "err")}
        server.process.stdin.write(json.dumps(request) + "\n")
        server.process.stdin.flush()
        both = len('{"pid": 1}\n{"returncode": 0}\n')  # the shortest both lines can be
        deadline = time.monotonic() + 60
        while _unread(server.process.stdout.fileno(), fcntl, termios) < both:
            assert time.monotonic() < deadline, "the server never reported the quick command"
            time.sleep(0.01)
        assert "pid" in server._read(timeout=5)
        assert server._read(timeout=5) == {"returncode": 0}
    finally:
        server.close()


def _unread(fd: int, fcntl, termios) -> int:
    """The bytes waiting in pipe `fd`."""
    import array

    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]
