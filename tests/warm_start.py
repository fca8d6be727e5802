"""Warm starts for the suite's own Python processes.

Most integration tests start ``python -m recommendation...`` processes, and each used
to spend about 4 s of CPU loading TensorFlow before reading its first flag (the suite
took 810 s of pytest on 2 cores so, 688 s with warm starts). A starter is a process,
one per environment, that has loaded `official` and TensorFlow as every entry point
does first (no op run, no TensorFlow runtime started) and then forks a child for each
such command. The child takes the command's standard streams, folder, environment,
session and arguments and runs the module as ``python -m`` does; it exits as
``python`` exits (its status, its traceback, death by a signal). It is a process of
its own: its pid is signalled, killed and waited on as any child's (the waiting goes
through a pidfd and the starter, its parent). What differs from a cold start is only
what loading prints: TensorFlow's lines about oneDNN and CUDA come once, from the
starter, into a file shown only if the starter fails (so that nothing follows
pytest's summary).

`install` routes `subprocess.Popen` through a starter for ``sys.executable -m
<module of this project> ...`` with nothing else changed about the process (no shell,
preexec_fn, pass_fds, user or group); every other command, and every command of a test
marked ``cold_start`` (tests of start-up itself: what is set before TensorFlow loads,
what it prints while loading), is exec'd as before.

    python tests/warm_start.py <socket fd>     the starter (started by `install`'s hook)
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("recommendation", "official")
# Read by the programs while they run, never while TensorFlow loads: a command whose
# environment differs from a starter's in these alone can still start from it.
_RUNTIME_VARIABLES = frozenset(
    {"PYTEST_CURRENT_TEST", "TF_CONFIG", "REDIS_PASSWORD", "REDIS_USERNAME"}
)
_MOST_STARTERS = 6
# Always exec'd: a process that tells whether the process that started it is alive by
# its parent pid (a warm child's parent is its starter).
_COLD_MODULES = frozenset({"recommendation.producer.data_async_generation"})


# -- the wire: a length-prefixed JSON message, with file descriptors beside it ---------


def _send(channel: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(channel, [struct.pack("!I", len(data)) + data], list(fds))


def _receive(channel: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors sent with it; (None, []) at the end."""
    head, fds, _, _ = socket.recv_fds(channel, 4, 8)
    if not head:
        return None, []
    while len(head) < 4:
        head += channel.recv(4 - len(head))
    (length,) = struct.unpack("!I", head)
    data = b""
    while len(data) < length:
        chunk = channel.recv(length - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# -- the starter ----------------------------------------------------------------------


class _Child:
    """What a forked child runs: one command, as ``python -m`` would."""

    def __init__(self, request: dict, fds: list[int], loaded_environment: dict) -> None:
        self.request = request
        self.fds = fds
        self.loaded_environment = loaded_environment

    def run(self) -> None:
        request = self.request
        if request["new_session"]:
            os.setsid()
        elif request["process_group"] >= 0:
            os.setpgid(0, request["process_group"])
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        for fd in set(self.fds) - {0, 1, 2}:
            os.close(fd)
        if request["cwd"] is not None:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # What `official` set while it loaded, as it would set it in this process.
        for name, value in self.loaded_environment.items():
            os.environ.setdefault(name, value)
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        module, *arguments = request["argv"]
        sys.argv = [module, *arguments]
        sys.path[0] = os.getcwd()
        import runpy

        runpy._run_module_as_main(module, alter_argv=True)


def serve(channel: socket.socket, loaded_environment: dict) -> _Child:
    """Answers the suite's requests until one forks a child; returns in that child."""
    while True:
        request, fds = _receive(channel)
        if request is None:
            os._exit(0)  # the test process has ended
        if request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            _send(channel, {"status": status})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            return _Child(request, fds, loaded_environment)
        for fd in fds:
            os.close(fd)
        _send(channel, {"pid": pid})


# -- the suite's side -------------------------------------------------------------------


class Starter:
    """A starter process for one environment, and the requests sent to it."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self._channel = ours
        self._lock = threading.Lock()
        # Its output (TensorFlow's loading lines, a traceback): shown only if it fails.
        self._log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            cwd=_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        theirs.close()
        ready, _ = _receive(ours)
        if not ready:
            raise RuntimeError(
                f"the warm starter ({__file__}) ended before it was ready: {self._output()}"
            )

    def start(self, request: dict, fds: list[int]) -> int:
        with self._lock:
            _send(self._channel, {"op": "start", **request}, fds)
            answer, _ = _receive(self._channel)
        if answer is None:
            raise RuntimeError(f"the warm starter ended: {self._output()}")
        return answer["pid"]

    def reap(self, pid: int) -> int:
        """The wait status of child `pid`, which has ended."""
        with self._lock:
            _send(self._channel, {"op": "wait", "pid": pid})
            answer, _ = _receive(self._channel)
        return answer["status"]

    def close(self) -> None:
        self._channel.close()
        self.process.wait()
        self._log.close()

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:]


class _WarmWait:
    """`Popen`'s waitpid for a child of a starter: its pidfd says when it has ended, the
    starter (its parent) reaps it and passes on its status."""

    def __init__(self, starter: Starter, pid: int) -> None:
        self.starter = starter
        self.pidfd = os.pidfd_open(pid)
        self.status: int | None = None

    def __call__(self, pid: int, flags: int) -> tuple[int, int]:
        if self.status is None:
            if not select.select([self.pidfd], [], [], 0 if flags & os.WNOHANG else None)[0]:
                return 0, 0
            self.status = self.starter.reap(pid)
            os.close(self.pidfd)
        return pid, self.status


_starters: dict[tuple, Starter] = {}
_starters_lock = threading.Lock()
enabled = True  # False within a test marked cold_start


def _starter_for(env: dict[str, str]) -> Starter:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _RUNTIME_VARIABLES))
    with _starters_lock:
        if key not in _starters:
            if len(_starters) >= _MOST_STARTERS:
                _starters.pop(next(iter(_starters))).close()
            loading = {k: v for k, v in env.items() if k not in _RUNTIME_VARIABLES}
            _starters[key] = Starter(loading)
        return _starters[key]


def _module(args, executable, preexec_fn, pass_fds, cwd, env, shell, extra) -> str | None:
    """The module of a command a starter can start, else None."""
    if not enabled or shell or preexec_fn is not None or pass_fds or any(extra):
        return None
    if executable is not None or isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = list(args)
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m":
        return None
    if not isinstance(args[2], str) or args[2].split(".")[0] not in _PACKAGES:
        return None
    if args[2] in _COLD_MODULES:
        return None
    if not all(isinstance(arg, str) for arg in args):
        return None
    if cwd is not None and not os.path.isdir(cwd):
        return None  # exec'd, so that Popen raises as it does
    environment = os.environ if env is None else env
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in environment.items()):
        return None
    return args[2]


def install() -> None:
    """Routes `subprocess.Popen` through the starters for commands they can start."""
    execute = subprocess.Popen._execute_child

    def _execute_child(
        self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
        restore_signals, gid, gids, uid, umask, start_new_session, process_group,
    ):  # fmt: skip
        extra = (gid, gids, uid, umask is not None and umask >= 0)
        module = _module(args, executable, preexec_fn, pass_fds, cwd, env, shell, extra)
        if module is None:
            return execute(
                self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group,
            )  # fmt: skip
        environment = dict(os.environ if env is None else env)
        starter = _starter_for(environment)
        fds = [p2cread, c2pwrite, errwrite]
        fds = [fd if fd != -1 else standard for fd, standard in zip(fds, (0, 1, 2), strict=True)]
        request = {
            "argv": list(args)[2:],
            "cwd": None if cwd is None else os.fsdecode(cwd),
            "env": environment,
            "new_session": bool(start_new_session),
            "process_group": -1 if process_group is None else process_group,
        }
        self.pid = starter.start(request, fds)
        self._child_created = True
        waitpid = _WarmWait(starter, self.pid)
        self._try_wait = lambda flags: waitpid(self.pid, flags)
        self._internal_poll = lambda _deadstate=None: subprocess.Popen._internal_poll(
            self, _deadstate, _waitpid=waitpid
        )
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    subprocess.Popen._execute_child = _execute_child


def _load_and_serve(fd: int) -> _Child:
    """Loads what every entry point loads first, then serves; returns in a child."""
    channel = socket.socket(fileno=fd)
    before = dict(os.environ)
    import official  # noqa: F401  (first, as in every entry point: it sets the environment)

    # isort: split
    import tensorflow  # noqa: F401

    loaded = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _send(channel, {"ready": True})
    return serve(channel, loaded)


if __name__ == "__main__":
    _load_and_serve(int(sys.argv[1])).run()
