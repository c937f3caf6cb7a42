"""A preloaded interpreter that forks the Python processes a test run starts, instead of each one
starting an interpreter and importing its libraries again.

Why: a whole test run starts well over a thousand Python processes (workers, beat, the system of
record's HTTP server, the audit feed, the witness relays, CLI commands), and each spent most of its
start importing the same libraries (the MCP SDK, Celery, redis, psycopg, SQLAlchemy, pydantic):
0.7 to 2 CPU-seconds per process, about 40 % of the suite's CPU on this 2-core machine. The zygote
imports those libraries once per test process and forks a child per request, as Celery's prefork
pool, gunicorn's ``preload_app`` or Rails' Spring do. A forked child then imports only the product's
own modules, from the checkout, with the environment, working directory, standard streams and
process group the test asked for, and runs ``python -m MODULE``, ``python SCRIPT`` or
``python -c CODE`` as a new interpreter would.

What it is not: it never preloads the product's own modules (they read settings and build state at
import, from the child's environment), and it serves only what a fork can give exactly. Any request
it cannot serve exactly runs as a plain ``subprocess.Popen``: another interpreter than this one, an
interpreter option other than ``-u``, an environment that differs from the zygote's in a variable
read at interpreter start or at import (``PYTHON*`` except ``PYTHONPATH`` and ``PYTHONUNBUFFERED``,
the locale, ``PSYCOPG_IMPL``), a ``PYTHONPATH`` entry that would shadow a preloaded library, or a
``preexec_fn``. It is off unless the process called :func:`enable` (the test suite's conftest
does, so a ``proofline dev`` or a soak started from the kit never forks from one), and
``PROOFLINE_TEST_ZYGOTE=0`` keeps it off: every process is then started plainly.

The child is a real process of its own: its pid, its process group (``start_new_session``), its
exit status, its signals. Its parent is the zygote, not the test, so :class:`Forked` (what
:func:`spawn` returns) reports the exit status the zygote reaped, with the ``subprocess.Popen``
methods the kit and the tests use (``poll``, ``wait``, ``communicate``, ``send_signal``,
``terminate``, ``kill``, ``returncode``, ``pid``, ``args``, the pipes).

Protocol, one Unix stream connection per child: the client sends a 4-byte length and a JSON request
with its standard streams (and any ``pass_fds``) attached (``SCM_RIGHTS``); the zygote answers
``pid N`` once it has forked, then ``exit CODE`` when it has reaped the child, and closes.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.forking import end, exit_status, set_title
from worker.preload import LIBRARIES

#: Libraries imported once in the zygote: the worker's (those its supervisor preloads) and what the
#: kit's servers add. Third-party only: none reads the environment at import.
PRELOAD = (*LIBRARIES, "mcp.server.mcpserver", "h11", "starlette.applications", "uvicorn",
           "sqlalchemy.dialects.postgresql")
#: Environment variables the interpreter or a preloaded library reads at start: a request whose
#: value differs from the zygote's is started plainly.
START_VARIABLES = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "PSYCOPG_IMPL")
#: ``PYTHON*`` variables the zygote's child applies itself.
EMULATED = ("PYTHONPATH", "PYTHONUNBUFFERED")
SWITCH = "PROOFLINE_TEST_ZYGOTE"
_LENGTH = struct.Struct("!I")
MAX_FDS = 64


def _start_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if (k.startswith("PYTHON") and k not in EMULATED) or k in START_VARIABLES or k.startswith("LC_")}


# ------------------------------------------------------------------------------------------------
# The zygote's side
# ------------------------------------------------------------------------------------------------

def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    if len(data) < _LENGTH.size:
        raise ValueError("short request")
    (length,) = _LENGTH.unpack_from(data)
    body = bytearray(data[_LENGTH.size:])
    while len(body) < length:
        more = conn.recv(length - len(body))
        if not more:
            raise ValueError("truncated request")
        body += more
    return json.loads(body), list(fds)


def serve(socket_path: str, ready_fd: int) -> dict[str, Any]:
    """Preload, listen and fork; returns only in a child, with what that child is to run."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a library this install lacks is simply not preloaded
            pass
    # Its own title, which also sets the title machinery up while the environment is still the one
    # the interpreter started with (a child replaces the environment before it sets its title).
    set_title(f"proofline test zygote {socket_path}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(128)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects are never scanned (so never copied) by a child's collections
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r], [], [], 1.0)
        except InterruptedError:
            readable = []
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _reap(children)
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            conn.settimeout(30)
            request, fds = _recv_request(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if threading.active_count() != 1:  # a fork would copy a lock some thread holds
            conn.sendall(b"refused threads\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in children.values():
                other.close()
            listener.close()
            os.close(wake_r)
            os.close(wake_w)
            try:
                _become(request, fds, conn)
            except BaseException as exc:  # noqa: BLE001 - told to the client, as Popen tells a failed exec
                try:
                    conn.sendall(f"error {type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
                finally:
                    os._exit(127)
            return request
        for fd in fds:
            os.close(fd)
        children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
            except OSError:
                pass
            conn.close()


def _become(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the child: the request's process group, descriptors, directory, environment and streams;
    then it tells the client its pid (so a client that has the pid has the group and streams too)."""
    if request["new_session"]:
        os.setsid()
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 512) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, request["targets"], strict=True):
        os.dup2(fd, target, inheritable=True)
    for fd in high:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    encoding, errors = sys.__stdout__.encoding if sys.__stdout__ else "utf-8", "strict"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)),
                                                 encoding=encoding, errors=errors)
    sys.stdout = sys.__stdout__ = _writer(1, encoding, errors, unbuffered, os.isatty(1) or unbuffered)
    sys.stderr = sys.__stderr__ = _writer(2, encoding, "backslashreplace", unbuffered, True)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in _ZYGOTE_PYTHONPATH]
    sys.path[:] = [request["path0"], *extra, *base]
    sys.orig_argv = list(request["argv"])
    main = types.ModuleType("__main__")
    import builtins

    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    set_title(" ".join(request["argv"]))  # ps shows the command asked for, not the zygote's
    conn.sendall(b"pid %d\n" % os.getpid())
    conn.close()


def _writer(fd: int, encoding: str, errors: str, unbuffered: bool, line: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "wb", closefd=False)
    buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffer, encoding=encoding, errors=errors, line_buffering=line, write_through=unbuffered)


_ZYGOTE_PYTHONPATH: frozenset[str] = frozenset()


def _run_request(request: dict[str, Any]) -> None:
    """Run what the child was asked to, as ``python`` would, and end the child.

    The end is the interpreter's, less its teardown of every module: non-daemon threads are waited
    for, ``atexit`` runs, the streams are flushed, and the exit status is the one ``python`` would
    give (``SystemExit``'s code or message, 1 and the traceback for an uncaught exception, death by
    SIGINT for an uncaught ``KeyboardInterrupt``). Tearing down the preloaded libraries' objects
    would touch, and so copy, most of the memory the fork shares, for nothing.
    """
    kind, target, args = request["kind"], request["target"], request["args"]
    code, interrupted = 0, False
    try:
        if kind == "module":
            import runpy

            sys.argv = [target, *args]  # runpy puts the module's file in argv[0], as -m does
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        elif kind == "script":
            import runpy

            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), sys.modules["__main__"].__dict__)  # noqa: S102 - python -c
    except SystemExit as exc:
        code = exit_status(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 130, True
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to an interpreter
        sys.excepthook(*sys.exc_info())
        code = 1
    end(code, interrupted)


def _die_with_parent() -> None:
    """The zygote goes when the test process that started it goes (its children are that process's
    to stop: they run in groups it owns)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    global _ZYGOTE_PYTHONPATH
    socket_path, ready_fd = sys.argv[1], int(sys.argv[2])
    _ZYGOTE_PYTHONPATH = frozenset(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    _die_with_parent()
    _run_request(serve(socket_path, ready_fd))


# ------------------------------------------------------------------------------------------------
# The test's side
# ------------------------------------------------------------------------------------------------

class Forked:
    """A child the zygote forked, seen as a ``subprocess.Popen``."""

    def __init__(self, args: Sequence[str], pid: int, conn: socket.socket, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()

    def _status(self, timeout: float | None) -> int | None:
        """The exit code, waiting up to ``timeout`` (None: for ever; 0: not at all)."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            deadline = None if timeout is None else time.monotonic() + timeout
            while b"\n" not in self._buffer:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self._conn], [], [], left)
                if not ready:
                    return None
                chunk = self._conn.recv(64)
                if not chunk:  # the zygote is gone: the status is lost; the process is what is left
                    if _alive(self.pid):
                        if deadline is not None and time.monotonic() >= deadline:
                            return None
                        time.sleep(0.05)
                        continue
                    self._buffer += b"exit -9\n"
                    break
                self._buffer += chunk
            line = self._buffer.split(b"\n", 1)[0].decode()
            self.returncode = int(line.split()[1])
            self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        results: dict[str, Any] = {}

        def drain(name: str, stream: Any) -> None:
            results[name] = stream.read()
            stream.close()

        threads = [threading.Thread(target=drain, args=(name, stream), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for thread in threads:
            thread.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _Zygote:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socket: str | None = None
        self.failed = False
        self.owner = -1
        self.start_env: dict[str, str] = {}
        self.pythonpath: frozenset[str] = frozenset()

    def address(self) -> str | None:
        with self.lock:
            if self.owner != os.getpid():  # a forked test process starts its own
                self.socket, self.failed, self.owner = None, False, os.getpid()
            if self.socket is None and not self.failed:
                try:
                    self.socket = self._start()
                except (OSError, RuntimeError) as exc:
                    print(f"proofline_kit.zygote: not started ({exc}); processes start plainly", file=sys.stderr)
                    self.failed = True
            return self.socket

    def _start(self) -> str:
        from proofline_kit.processes import own

        folder = tempfile.mkdtemp(prefix="pl-zygote-")
        path = os.path.join(folder, "sock")
        ready_r, ready_w = os.pipe()
        env = dict(os.environ)
        proc = subprocess.Popen([sys.executable, "-c", "import proofline_kit.zygote as z; z.main()", path, str(ready_w)],
                                env=env, cwd=str(Path(__file__).resolve().parent.parent), pass_fds=(ready_w,),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        own(proc)
        os.close(ready_w)
        atexit.register(_remove, folder)
        ready, _, _ = select.select([ready_r], [], [], 120)
        line = os.read(ready_r, 64) if ready else b""
        os.close(ready_r)
        if line != b"ready\n":
            proc.kill()
            raise RuntimeError(f"the zygote did not report ready (exit {proc.poll()})")
        self.start_env = _start_environment(env)
        self.pythonpath = frozenset(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
        return path


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


_zygote = _Zygote()
_enabled = False


def enable() -> None:
    """Fork this process's Python children from a zygote from now on (unless ``PROOFLINE_TEST_ZYGOTE=0``)."""
    global _enabled
    _enabled = os.environ.get(SWITCH, "1") != "0"


def enabled() -> bool:
    return _enabled and os.environ.get(SWITCH, "1") != "0"

_PRELOADED_TOPS = frozenset(name.split(".")[0] for name in PRELOAD)


def _parse(argv: Sequence[str]) -> dict[str, Any] | None:
    """What ``argv`` asks a ``python`` to run, or None when the zygote cannot run it exactly."""
    if not argv or argv[0] != sys.executable:
        return None
    unbuffered, i = False, 1
    while i < len(argv):
        word = argv[i]
        if word == "-u":
            unbuffered, i = True, i + 1
        elif word in ("-m", "-c"):
            if i + 1 >= len(argv):
                return None
            return {"kind": "module" if word == "-m" else "code", "target": argv[i + 1], "args": list(argv[i + 2:]),
                    "unbuffered": unbuffered}
        elif word.startswith("-"):
            return None
        else:
            return {"kind": "script", "target": word, "args": list(argv[i + 1:]), "unbuffered": unbuffered}
    return None


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _shadows(pythonpath: str) -> bool:
    """A ``PYTHONPATH`` entry holding a package of the same name as a preloaded library."""
    for entry in (p for p in pythonpath.split(os.pathsep) if p):
        for top in _PRELOADED_TOPS:
            if os.path.exists(os.path.join(entry, top)) or os.path.exists(os.path.join(entry, top + ".py")):
                return True
    return False


def _stream(spec: Any, mode: str, text: bool, encoding: str | None) -> tuple[int | None, Any, int | None]:
    """(fd to send, parent's end wrapped, fd to close after sending) for one standard stream."""
    if spec is None:
        return None, None, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, None, fd
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        child, mine = (r, w) if mode == "w" else (w, r)
        wrapped = os.fdopen(mine, mode + ("" if text else "b"), encoding=encoding if text else None)
        return child, wrapped, child
    if isinstance(spec, int):
        return spec, None, None
    return spec.fileno(), None, None


def spawn(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None, start_new_session: bool = False,
          pass_fds: Sequence[int] = (), text: bool = False, encoding: str | None = None,
          **popen: Any) -> Any:
    """``subprocess.Popen(argv, ...)``, forked from the zygote when it can run ``argv`` exactly
    (see the module's docstring), started plainly otherwise."""
    argv = [str(a) for a in argv]
    env_used = dict(os.environ if env is None else env)
    text = bool(text or encoding or popen.get("universal_newlines"))

    def plain() -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, pass_fds=pass_fds, text=text or None,
                                encoding=encoding, **popen)

    spec = _parse(argv) if enabled() and not popen.get("preexec_fn") else None
    unknown = set(popen) - {"universal_newlines", "close_fds", "bufsize"}
    if spec is None or unknown:
        return plain()
    address = _zygote.address()
    if (address is None or _start_environment(env_used) != _zygote.start_env
            or _shadows(env_used.get("PYTHONPATH", ""))):
        return plain()
    workdir = os.path.abspath(cwd if cwd is not None else os.getcwd())
    if not os.path.isdir(workdir):
        return plain()  # Popen's own error for a missing directory
    if spec["kind"] == "script":
        spec["target"] = os.path.join(workdir, spec["target"]) if not os.path.isabs(spec["target"]) else spec["target"]
        path0 = os.path.dirname(os.path.realpath(spec["target"]))
    else:
        path0 = workdir if spec["kind"] == "module" else ""
    if spec["kind"] == "script" and not os.path.exists(spec["target"]):
        return plain()
    if stdin is None and not _open(0):
        stdin = subprocess.DEVNULL  # this process has no standard input (CI): the child reads end of file
    for n, spec_n in ((1, stdout), (2, stderr)):
        if spec_n is None and not _open(n):
            return plain()  # an output stream this process has closed: Popen leaves it closed too
    streams = [_stream(stdin, "w", text, encoding), _stream(stdout, "r", text, encoding)]
    if stderr == subprocess.STDOUT:
        streams.append((streams[1][0] if streams[1][0] is not None else 1, None, None))
    else:
        streams.append(_stream(stderr, "r", text, encoding))
    send = [fd if fd is not None else n for n, (fd, _, _) in enumerate(streams)]
    send += list(pass_fds)
    targets = [0, 1, 2, *pass_fds]
    request = {**spec, "argv": argv, "env": env_used, "cwd": workdir, "path0": path0, "new_session": start_new_session,
               "targets": targets}
    body = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        socket.send_fds(conn, [_LENGTH.pack(len(body)) + body], send)
    finally:
        for _, _, close in streams:
            if close is not None:
                os.close(close)
    answer = b""
    while b"\n" not in answer:
        chunk = conn.recv(64)
        if not chunk:
            break
        answer += chunk
    # A child that ends at once has its exit status sent right behind its pid: keep that for wait().
    answer, _, rest = answer.partition(b"\n")
    words = answer.split()
    if len(words) != 2 or words[0] != b"pid":
        conn.close()
        for _, wrapped, _ in streams:
            if wrapped is not None:
                wrapped.close()
        raise OSError(f"the zygote refused {argv!r}: {answer!r}")
    forked = Forked(argv, int(words[1]), conn, streams[0][1], streams[1][1], streams[2][1])
    forked._buffer = rest
    return forked


def run(argv: Sequence[str], *, input: Any = None, capture_output: bool = False, timeout: float | None = None,  # noqa: A002
        check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` over :func:`spawn`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = spawn(argv, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(list(argv), proc.wait(), out, err)
    if check:
        done.check_returncode()
    return done
