"""Sandboxed stdio tool servers: the bubblewrap command line that confines one server.

A stdio MCP server is code the worker did not write and must not trust. Left alone it runs as the
worker's user in the worker's namespaces: it can read ``/proc/<worker>/environ`` (keys, database
URL), connect to Postgres and Redis on loopback, and read every file the worker can. In a sandbox it
gets new user, PID, IPC, UTS and network namespaces (no network unless declared), a non-root uid,
a root filesystem holding only the interpreter and the paths the servers file declares, a fresh
``/proc``, ``/dev`` and ``/tmp``, and rlimits on memory, CPU, open files and processes.

Everything here is pure: it turns a :class:`SandboxSpec` and a command into an argv. The launcher
is ``/bin/sh`` (applies the rlimits with ``ulimit``, opens the status file, then ``exec``s bwrap),
started with :func:`launcher_environment`: bwrap's PID 1 inside the sandbox keeps the environment
it was started with, so the worker's own environment must never reach it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proofline.errors import ConfigurationError
from proofline.settings import Environment
from worker.sandbox_egress import EgressPlan, EgressPolicy

BWRAP = "bwrap"
STRACE = "strace"
#: The wrapper that makes the tracer die with the worker process that started it.
DEATHSIG = str(Path(__file__).with_name("deathsig.py"))
SHELL = "/bin/sh"
#: The uid/gid a sandboxed server runs as (``nobody``/``nogroup``) unless the servers file says otherwise.
DEFAULT_UID = DEFAULT_GID = 65534
#: The fd bwrap writes its JSON status to (child pid, then the exit code); the sandboxed child never
#: inherits it (bwrap closes it before exec), so a server cannot forge its own exit status.
STATUS_FD = 3
#: A path that never exists inside a sandbox (its root is bwrap's own tmpfs). An audited sandbox tries
#: to ``cd`` there just before exec'ing the server: audit lines before that are bwrap's set-up.
AUDIT_MARKER = "/.proofline-audit-start"
#: System directories bound read-only (or recreated as the same symlink) so dynamically linked
#: interpreters run. Nothing under /etc except the loader cache unless the server has network.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates")
#: The sandbox's own filesystems (bwrap's fresh /proc, /dev and tmpfs /tmp): nothing of the host's.
OWN_FILESYSTEMS = ("/tmp", "/proc", "/dev/shm", "/dev/pts", "/dev/mqueue")
#: Exit statuses (128 + signal) of a sandboxed process killed by a limit or a fault: SIGKILL (hard
#: CPU limit, or the kernel), SIGSEGV (a stack or memory limit hit in C code), SIGBUS, SIGXCPU
#: (soft CPU limit), SIGXFSZ, SIGSYS, SIGABRT (allocation failure inside C code).
VIOLATION_SIGNALS = {9: "SIGKILL", 11: "SIGSEGV", 7: "SIGBUS", 24: "SIGXCPU", 25: "SIGXFSZ", 31: "SIGSYS",
                     6: "SIGABRT"}


class AuditPolicy(BaseModel):
    """The ``sandbox.audit`` block, when it is more than on/off: what an audit that lost lines means."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``record``: the call stands and an overflow record says what the audit missed; ``fail_closed``:
    #: a call whose audit lost lines fails (as a call that was sent, when it was). None: ``record``
    #: in development, ``fail_closed`` in production.
    on_overflow: Literal["record", "fail_closed"] | None = None
    #: How long a session being closed waits for strace's output to end (it ends once the server
    #: has exited) before what is still unread is an overflow.
    drain_seconds: float = Field(5.0, ge=0, le=60)

    def fails_closed(self, environment: str) -> bool:
        """Whether an overflow fails the call, in ``environment``."""
        if self.on_overflow is None:
            return environment == Environment.production
        return self.on_overflow == "fail_closed"


class SandboxSpec(BaseModel):
    """The ``sandbox:`` block of one stdio endpoint in the servers file. On unless disabled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    #: Why this server runs unsandboxed; a production worker refuses ``enabled: false`` without it.
    reason: str | None = None
    uid: int = Field(DEFAULT_UID, ge=1, le=2**31)
    gid: int = Field(DEFAULT_GID, ge=1, le=2**31)
    #: A server without network gets only its own loopback (nothing listens there); ``true`` shares
    #: the host's; ``{allow: [HOST:PORT, ...]}`` reaches those destinations only (worker/sandbox_egress.py).
    network: bool | EgressPolicy = False
    #: Paths bound read-only / read-write (relative ones are relative to the servers file).
    ro_paths: tuple[str, ...] = ()
    rw_paths: tuple[str, ...] = ()
    #: The writer's data, bound read-only for a read identity (set by :func:`reader_sandbox`): a
    #: write refused there (``EROFS``) is a program with no read-only mode falling back, as intended;
    #: the audit does not count it.
    read_only_data: tuple[str, ...] = ()
    #: Address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU), open files, processes (RLIMIT_NPROC).
    memory_mb: int = Field(1024, ge=64)
    cpu_seconds: int = Field(3600, ge=1)
    open_files: int = Field(256, ge=16)
    processes: int = Field(64, ge=1)
    #: Denied-path auditing (worker/sandbox_audit.py): None means on where strace is installed; a
    #: block (:class:`AuditPolicy`) asks for it like ``true`` and says what an overflow does.
    audit: bool | AuditPolicy | None = None
    #: Why this server runs without auditing; production refuses to drop it silently without one.
    audit_reason: str | None = None

    @field_validator("network", mode="before")
    @classmethod
    def _network(cls, value: object) -> object:
        # Parsed here so a bad allowlist is one error naming its entry, not one per union member.
        if isinstance(value, dict):
            return EgressPolicy(**value)
        if not isinstance(value, bool | EgressPolicy):
            raise ValueError("sandbox.network must be true, false or {allow: [HOST:PORT, ...]}")
        return value

    @field_validator("audit", mode="before")
    @classmethod
    def _audit(cls, value: object) -> object:
        return AuditPolicy(**value) if isinstance(value, dict) else value

    @property
    def audit_policy(self) -> AuditPolicy:
        """What an overflow of this server's audit does (the defaults unless a block says)."""
        return self.audit if isinstance(self.audit, AuditPolicy) else AuditPolicy()

    @property
    def host_network(self) -> bool:
        """Whether the server shares the host's network namespace (``network: true``)."""
        return self.network is True

    @property
    def egress(self) -> EgressPolicy | None:
        """The allowlist, when ``network`` is one."""
        return self.network if isinstance(self.network, EgressPolicy) else None

    @model_validator(mode="after")
    def _reason_is_text(self) -> SandboxSpec:
        for name in ("reason", "audit_reason"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"sandbox.{name} must say why, not be empty")
        return self


def reader_sandbox(writer: dict, override: dict | None) -> dict:
    """The read identity's sandbox block: the writer's, with every writable path bound read-only,
    then whatever the ``read_identity`` block declares. A read identity never inherits write access."""
    merged = dict(writer)
    merged["ro_paths"] = [*writer.get("ro_paths", ()), *writer.get("rw_paths", ())]
    merged["rw_paths"] = []
    merged["read_only_data"] = [*writer.get("read_only_data", ()), *writer.get("rw_paths", ())]
    merged.update(override or {})
    return merged


def require_policy(server: str, role: str, spec: SandboxSpec, environment: str) -> str | None:
    """Refuse an unsandboxed server in production unless the servers file says why.

    Returns the recorded reason for an unsandboxed server (None when sandboxed)."""
    if spec.enabled:
        return None
    if environment == Environment.production and not spec.reason:
        raise ConfigurationError(
            f"server {server!r} ({role}) runs unsandboxed in production without a reason: set "
            "sandbox: {enabled: false, reason: \"...\"} in the servers file, or sandbox it",
            server=server, role=role)
    return spec.reason or "unsandboxed (development)"


def strace_available() -> bool:
    return shutil.which(STRACE) is not None


def bwrap_binary() -> str:
    """bwrap as found on this process's PATH (an absolute path), else the bare name.

    The launcher runs with :func:`launcher_environment`'s fixed PATH, so it is handed this path:
    the bwrap the worker's checks found (worker/sandbox_probe.py) is the one every sandbox runs."""
    return shutil.which(BWRAP) or BWRAP


def require_audit(server: str, role: str, spec: SandboxSpec, environment: str,
                  available: bool | None = None) -> str | None:
    """Whether a sandboxed server runs audited: None when it does, else why not (recorded).

    ``audit: true`` without strace is refused everywhere; an audit dropped without ``audit_reason``
    (``audit: false``, or the default with strace missing) is refused in production."""
    if not spec.enabled:
        return "unsandboxed"
    available = strace_available() if available is None else available
    asked = spec.audit is True or isinstance(spec.audit, AuditPolicy)
    if asked and not available:
        raise ConfigurationError(f"server {server!r} ({role}) asks for sandbox.audit but strace is not installed",
                                 server=server, role=role)
    if spec.audit is not False and available:
        return None
    if environment == Environment.production and not spec.audit_reason:
        why = "audit: false" if spec.audit is False else "strace is not installed"
        raise ConfigurationError(
            f"server {server!r} ({role}) runs without sandbox auditing in production ({why}) and gives no "
            "reason: install strace, or set sandbox: {audit_reason: \"...\"} in the servers file",
            server=server, role=role)
    return spec.audit_reason or ("audit disabled (development)" if spec.audit is False
                                 else "strace is not installed (development)")


@lru_cache(maxsize=1)
def interpreter_paths() -> tuple[str, ...]:
    """What this interpreter needs to run: the venv (sys.prefix), the base interpreter's prefix
    (sys.base_prefix) and the source directories of packages installed editable (the project's
    own packages only: never the checkout around them, which holds config and keys)."""
    paths = [sys.prefix, sys.base_prefix]
    for dist in metadata.distributions():
        direct = dist.read_text("direct_url.json")
        if not direct or not json.loads(direct).get("dir_info", {}).get("editable"):
            continue
        for name in (dist.read_text("top_level.txt") or "").split():
            spec = find_spec(name)
            if spec is None:
                continue
            if spec.submodule_search_locations:
                paths.extend(spec.submodule_search_locations)
            elif spec.origin:
                paths.append(spec.origin)
    return tuple(dict.fromkeys(str(Path(p).resolve()) for p in paths))


def _covered(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _resolve(path: str, base_dir: Path) -> str:
    p = Path(path)
    return str((p if p.is_absolute() else base_dir / p).absolute())


@dataclass(frozen=True)
class Launch:
    """How to start one server: the launcher argv, its (minimal) environment, and the folder it
    starts in (worker/stdio_launch.py describes an unsandboxed start this way too)."""

    command: str
    args: list[str]
    env: dict[str, str]
    cwd: str | None = None


def launcher_environment() -> dict[str, str]:
    """The launcher's whole environment. Every variable the mcp SDK's stdio client would copy from
    the worker (HOME, LOGNAME, PATH, SHELL, TERM, USER) is pinned here, so the merge it does adds
    nothing of the worker's; bwrap's PID 1 keeps exactly this."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent", "LOGNAME": "nobody",
            "USER": "nobody", "SHELL": "/bin/false", "TERM": "dumb"}


@dataclass(frozen=True)
class Roots:
    """What exists inside one sandbox, for the audit: host paths bound at the same place (read-only
    or writable), the sandbox's own filesystems (``/tmp``, ``/proc``, ``/dev``, an undeclared
    working directory), and the system symlinks recreated from the host's."""

    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    own: tuple[str, ...] = OWN_FILESYSTEMS
    symlinks: tuple[tuple[str, str], ...] = ()
    read_only_data: tuple[str, ...] = ()
    cwd: str = "/"
    network: bool = False
    #: The addresses (``host:port`` as inside the sandbox) its egress allowlist answers on.
    allowed: tuple[str, ...] = ()

    @property
    def bound(self) -> tuple[str, ...]:
        return self.read_only + self.writable


def bwrap_args(spec: SandboxSpec, *, command: Sequence[str], env: dict[str, str], cwd: str, base_dir: Path,
               runtime_paths: Sequence[str], exists=Path.exists, is_symlink=Path.is_symlink,
               readlink=Path.readlink, roots: list[Roots] | None = None,
               egress: EgressPlan | None = None) -> list[str]:
    """bwrap's arguments (after ``bwrap``) for ``command`` confined by ``spec``.

    With ``egress`` (a running forwarder's plan, for a spec with an allowlist) the forwarder's
    sockets and the sandbox's own name files are bound; without one such a spec has no network.

    ``exists``/``is_symlink``/``readlink`` are injectable so the unit tests describe a filesystem.
    When ``roots`` is a list, the sandbox's :class:`Roots` is appended to it (for the audit)."""
    args = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not spec.host_network:
        args.append("--unshare-net")
    args += ["--uid", str(spec.uid), "--gid", str(spec.gid), "--hostname", "sandbox",
             "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in env.items():
        args += ["--setenv", name, value]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    bound: list[str] = []
    links: list[tuple[str, str]] = []
    for d in SYSTEM_DIRS:
        p = Path(d)
        if is_symlink(p):
            args += ["--symlink", str(readlink(p)), d]
            links.append((d, str(readlink(p))))
        elif exists(p):
            args += ["--ro-bind", d, d]
            bound.append(d)
    extra = SYSTEM_FILES + (NETWORK_FILES if spec.host_network else ())
    files = [f for f in extra if exists(Path(f))]
    for f in files:
        args += ["--ro-bind", f, f]
    if egress is not None:
        args += egress.bwrap_args(exists=lambda p: exists(Path(p)))
        files += egress.inside_paths(exists=lambda p: exists(Path(p)))
    for p in runtime_paths:
        if not _covered(p, bound):
            args += ["--ro-bind", p, p]
            bound.append(p)
    for p in (_resolve(x, base_dir) for x in spec.ro_paths):
        if not exists(Path(p)):
            raise ConfigurationError(f"sandbox ro_paths: {p} does not exist", path=p)
        args += ["--ro-bind", p, p]
        bound.append(p)
    writable: list[str] = []
    for p in (_resolve(x, base_dir) for x in spec.rw_paths):
        if not exists(Path(p)):
            raise ConfigurationError(f"sandbox rw_paths: {p} does not exist", path=p)
        args += ["--bind", p, p]
        writable.append(p)
    own = OWN_FILESYSTEMS
    if not _covered(cwd, bound + writable):
        args += ["--dir", cwd]  # an empty directory on the sandbox's own root: nothing of the host's
        own += (cwd,)
    args += ["--chdir", cwd, "--", *command]
    if roots is not None:
        roots.append(Roots(read_only=(*bound, *files), writable=tuple(writable), own=own, symlinks=tuple(links),
                           read_only_data=tuple(_resolve(x, base_dir) for x in spec.read_only_data),
                           cwd=cwd, network=spec.host_network,
                           allowed=egress.allowed if egress is not None else ()))
    return args


def launch(spec: SandboxSpec, *, command: Sequence[str], env: dict[str, str], cwd: str, base_dir: Path,
           status_path: str | None = None, runtime_paths: Sequence[str] | None = None,
           audit_path: str | None = None, roots: list[Roots] | None = None,
           egress: EgressPlan | None = None, parent_pid: int | None = None) -> Launch:
    """The launcher for one sandboxed server: ``sh`` sets the rlimits (inherited across exec by
    bwrap and the server; no preexec_fn in the worker), opens the status file on fd 3, then execs
    bwrap. The rlimits are hard limits too, so the server cannot raise them again.

    With ``egress`` the server starts behind the in-sandbox relay (worker/egress_relay.py), which
    listens on the allowed addresses and then execs it; under audit the relay is set-up, before the
    marker, like bwrap's own (its relaying, after the marker, is audited).

    With ``audit_path``, strace runs outermost (outside the limits and the namespaces: the server
    cannot see, signal or starve it) and writes the server's failed file, network and privileged
    syscalls to that path (a FIFO the worker reads; worker/sandbox_reader.py). Inside the sandbox a
    ``sh`` first tries to enter :data:`AUDIT_MARKER` (a failed, traced ``chdir`` that marks where
    bwrap's own set-up ends) and then execs the server. strace itself starts under
    :data:`DEATHSIG`, so it dies with ``parent_pid`` (this process unless given), and the server
    with it: a killed worker leaves no tracer behind."""
    if runtime_paths is None:
        runtime_paths = interpreter_paths()
    inner = list(command)
    if audit_path is not None:
        inner = [SHELL, "-c", f'cd {AUDIT_MARKER} 2>/dev/null; exec "$@"', "audited", *command]
    if egress is not None and spec.egress is not None:
        inner = egress.relay_command(sys.executable, inner)
    else:
        egress = None  # a plan without an allowlist (or the reverse) gives no network at all
    bw = bwrap_args(spec, command=inner, env=env, cwd=cwd, base_dir=base_dir, runtime_paths=runtime_paths,
                    roots=roots, egress=egress)
    limits = (f"ulimit -v {spec.memory_mb * 1024} && ulimit -t {spec.cpu_seconds} && "
              f"ulimit -n {spec.open_files} && ulimit -p {spec.processes}")
    if status_path is not None:
        script = f"{limits} && exec {STATUS_FD}>\"$0\" && exec \"$@\""
        argv = [SHELL, "-c", script, status_path, bwrap_binary(), "--json-status-fd", str(STATUS_FD), *bw]
    else:
        argv = [SHELL, "-c", f"{limits} && exec \"$@\"", "sandbox", bwrap_binary(), *bw]
    if audit_path is not None:
        from worker.sandbox_audit import strace_args

        argv = [sys.executable, "-I", "-S", DEATHSIG, str(parent_pid or os.getpid()), STRACE,
                *strace_args(audit_path), "--", *argv]
    return Launch(argv[0], argv[1:], launcher_environment(), cwd)


def read_status(path: str | Path) -> dict[str, int]:
    """bwrap's JSON status lines ({"child-pid": N} ... {"exit-code": N}) merged; {} when absent."""
    status: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return status
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            status.update({k: v for k, v in item.items() if isinstance(v, int)})
    return status


def violation(exit_code: int | None) -> dict[str, object] | None:
    """The evidence for an exit that means the sandbox stopped the server (a signal from a limit)."""
    if exit_code is None or exit_code <= 128:
        return None
    signo = exit_code - 128
    name = VIOLATION_SIGNALS.get(signo)
    if name is None:
        return None
    return {"exit_code": exit_code, "signal": signo, "signal_name": name}


def describe(launch_: Launch) -> str:
    """The launcher command line, quoted, for logs."""
    return shlex.join([launch_.command, *launch_.args])
