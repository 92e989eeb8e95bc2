"""Python processes of the suite started from an interpreter that has already imported torch and
fairseq (about 6 of a fairseq console tool's 7 s of start-up on the 2-core machine, hundreds of
times per suite run).

A server process (this file run as a script) imports ``torch`` (with ``torch._dynamo``, which every
optimizer's construction imports) and ``fairseq`` once and waits
on a Unix socket; :func:`popen` sends it a command line, an environment, a directory and three
file descriptors (``SCM_RIGHTS``), and the server forks a child that becomes that process: its
descriptors 0-2, environment, directory, ``sys.path`` (``PYTHONPATH`` first, as at start-up),
``sys.argv`` and thread count are set as a new interpreter would set them, then it runs the
script or module exactly as ``python`` would (``runpy``, as ``__main__``), and leaves by
``SystemExit`` through a normal interpreter exit (atexit hooks, finalisation). Nothing of the
plugin is imported before the child runs, so ``--user-dir`` imports it as in a fresh process.
The server itself never runs a torch operator, so no thread pool exists when it forks.

:class:`PrewarmedProcess` answers as :class:`subprocess.Popen` does (``pid``, ``args``,
``returncode``, ``poll``, ``wait``, ``kill``); exit statuses come from the server, which is the
children's parent. A command that is not a Python program (or a Python other than this one)
runs as a plain subprocess. Tests that check start-up itself (the seam, SIGKILL restarts, the
prefetch thread at exit) start real processes.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_POLL_SECONDS = 0.02
_MESSAGE_BYTES = 1 << 20


def _python_command(cmd: Sequence[str]) -> list[str] | None:
    """``cmd`` as arguments of this Python (``[script | -m module, args...]``), or ``None`` if it
    is not a script or module run by this very interpreter (``sys.executable``)."""
    first = os.path.abspath(cmd[0])
    if first == sys.executable:
        rest = list(cmd[1:])
        return rest if rest and (rest[0] == "-m" or not rest[0].startswith("-")) else None
    try:
        with open(first, "rb") as script:
            shebang = script.readline().decode(errors="replace")
    except OSError:
        return None
    return list(cmd) if shebang.startswith("#!") and shebang[2:].strip() == sys.executable else None


# --- the server (runs in its own process) ---------------------------------------------------

def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process and run it; never returns."""
    import runpy

    import torch

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # a fresh interpreter's root logger: fairseq's import (text_to_speech.py) called
    # logging.basicConfig here, which a console tool's own basicConfig must not find done
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # resolved from this environment's TMPDIR, as a new interpreter would
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() else (os.cpu_count() or 1))
    args = request["args"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = request["base_path"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
        sys.path[:] = [os.getcwd(), *extra, *base]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = [args[0], *args[1:]]
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base]
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _serve(path: str) -> None:
    import fairseq  # noqa: F401  (the point: imported once, here)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by the first torch.optim.Optimizer a process builds)

    base_path = sys.path[1:]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    finished: dict[int, int] = {}
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, _MESSAGE_BYTES, 3)
        request = json.loads(message)
        while True:  # reap every child that has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            finished[pid] = os.waitstatus_to_exitcode(status)
        if request["op"] == "spawn":
            request["base_path"] = base_path
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _become(request, fds)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
        elif request["op"] == "poll":
            conn.send(json.dumps({"returncode": finished.get(request["pid"])}).encode())
        conn.close()


# --- the client (in the pytest process) -----------------------------------------------------

class _Server:
    """The one server of this pytest process, started on first use, stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dir = ""
        self.path = ""
        atexit.register(self.stop)

    def address(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            return self.path

    def _start(self) -> None:
        self.stop()
        self._dir = tempfile.mkdtemp(prefix="prewarmed-")
        self.path = os.path.join(self._dir, "server.sock")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=subprocess.PIPE, env=env,
                                      stdin=subprocess.DEVNULL)
        ready, _, _ = select.select([self._proc.stdout], [], [], 300)
        line = self._proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self._proc.kill()
            raise RuntimeError(f"the prewarmed server did not start (exit {self._proc.wait()})")

    def stop(self) -> None:
        """End the server (if running) and remove its socket's directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def ask(self, request: dict, fds: Sequence[int] = ()) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.address())
            socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
            return json.loads(conn.recv(_MESSAGE_BYTES))


_SERVER = _Server()


class PrewarmedProcess:
    """A child of the server, as :class:`subprocess.Popen` shows a process (``stdout``: the read
    end of its output pipe, if asked for one)."""

    def __init__(self, args: list[str], pid: int, stdout=None) -> None:
        self.args, self.pid, self.stdout = args, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _SERVER.ask({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(_POLL_SECONDS)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | bytes | None, None]:
        """Read the output pipe to its end, then wait for the exit (``timeout`` for both)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = None
        if self.stdout is not None:
            chunks: list = []
            reader = threading.Thread(target=lambda: chunks.append(self.stdout.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
            out = chunks[0]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen(cmd: Sequence[str | Path], stdout, stderr=subprocess.STDOUT, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None, text: bool = False) -> PrewarmedProcess | subprocess.Popen:
    """Start ``cmd`` with ``stdout`` (an open file, or ``subprocess.PIPE``: read it from the
    returned process's ``stdout``, as text with ``text=True``), ``stderr`` (an open file, or
    ``subprocess.STDOUT``) and stdin from ``/dev/null``: from the server if it is a Python
    program, else as :class:`subprocess.Popen`."""
    args = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    python_args = _python_command(args)
    if python_args is None:
        return subprocess.Popen(args, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                text=text)
    read_end = None
    if stdout == subprocess.PIPE:
        read_end, write_end = os.pipe()
        out_fd = write_end
    else:
        out_fd = stdout.fileno()
    err_fd = out_fd if stderr == subprocess.STDOUT else stderr.fileno()
    try:
        with open(os.devnull, "rb") as devnull:
            answer = _SERVER.ask({"op": "spawn", "args": python_args, "env": env, "cwd": cwd},
                                 [devnull.fileno(), out_fd, err_fd])
    finally:
        if read_end is not None:
            os.close(write_end)  # the child holds the only write end: its exit ends the pipe
    pipe = None if read_end is None else open(read_end, "r" if text else "rb")  # noqa: SIM115
    return PrewarmedProcess(args, answer["pid"], pipe)


def run(cmd: Sequence[str | Path], env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` with ``capture_output=True, text=True`` through :func:`popen`."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(cmd, out, err, env=env, cwd=cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([str(c) for c in cmd], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


if __name__ == "__main__":
    _serve(sys.argv[1])
