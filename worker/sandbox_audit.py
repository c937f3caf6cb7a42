"""Denied-path auditing for sandboxed stdio servers: what a server tried and the sandbox refused.

Inside bubblewrap a path that is not bound simply does not exist (``ENOENT``) and a read-only bind
answers ``EROFS``: the server sees an error and nobody else notices. An audited sandbox runs under
strace (``worker/sandbox.py::launch``), outermost: outside the server's namespaces and rlimits, so
the server can neither see, signal nor starve it, and strace's ``PTRACE_O_EXITKILL`` plus bwrap's
``--die-with-parent`` take the server down with it. ``--seccomp-bpf`` stops the server only at the
traced syscalls, and ``-e status=failed`` prints only the failed ones. strace writes to a FIFO in a
private directory of the worker's (never bound into the sandbox, and opened close-on-exec), so the
server cannot write to the audit channel. Strings are printed as hex (``-xx``): a path holding
quotes or newlines cannot forge a line.

Each failed syscall is classified (:func:`classify`); what counts as a violation:

- ``hidden_path``: a path that exists on the worker's side (``lstat`` from the worker) but is not
  visible in the sandbox: outside every bound root and the sandbox's own ``/tmp``, ``/dev/shm``, and
  ``/proc`` minus other processes (``/proc/<pid>/…`` counts as outside: the worker's processes live
  there). Paths are normalised (relative ones against the ``*at`` directory strace reports, else the
  process's working directory) and symlinks under bound roots are followed as the sandbox would.
  A path absent on both sides is a probe for something that exists nowhere (the interpreter looking
  for optional files) and is not counted; neither are the few files every libc looks up
  (:data:`LIBC_PROBES`).
- ``read_only`` / ``permission_denied``: ``EROFS``, ``EACCES`` or ``EPERM`` on any path, except the
  interpreter's own bytecode cache (``__pycache__``) and, for a read identity, ``EROFS`` on the
  writer's data it sees read-only (a program with no read-only mode tries read-write first).
- ``network_denied``: a failed ``connect``/``sendmsg`` to an IP address, or to an abstract unix
  socket, when the server has no network (or one not on its egress allowlist).
- ``denied_syscall``: any failed :data:`DENIED_SYSCALLS` (ptrace, mount, namespaces, modules, …).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from worker.sandbox import Roots

DENIED_SYSCALLS = frozenset({
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "bpf", "perf_event_open", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "open_by_handle_at", "name_to_handle_at", "fsopen",
    "fsmount", "move_mount", "open_tree", "mount_setattr",
})
#: ``sendto`` is left out: it is every asyncio loop's wake-up (7 per call of the sor server), and
#: an unconnected datagram goes nowhere from a sandbox without network.
NETWORK_SYSCALLS = ("connect", "sendmsg", "sendmmsg")
#: The file syscalls that open, run, create or change something. Pure lookups (stat, access,
#: readlink, statfs, xattr reads) are left out: they read and change nothing, and they are most of
#: an interpreter's file syscalls (the sor server: 96 newfstatat per call), each a tracer stop.
FILE_SYSCALLS = (
    "open", "openat", "openat2", "creat", "execve", "execveat", "chdir", "mkdir", "mkdirat", "rmdir", "unlink",
    "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmodat",
    "chown", "lchown", "fchownat", "truncate", "utime", "utimes", "utimensat", "futimesat", "mknod", "mknodat",
    "setxattr", "lsetxattr", "removexattr", "lremovexattr", "acct", "quotactl",
)
#: What strace traces (``-e trace=``).
TRACE = ",".join([*FILE_SYSCALLS, *NETWORK_SYSCALLS, *sorted(DENIED_SYSCALLS)])
#: Files the C libraries look up on behalf of any program (loader, time zone, name service, OpenSSL's
#: configuration). Absent in the sandbox; reading them is the library's habit, not the server's
#: intent. Excused for reads only, never for a write.
SYSTEM_PROBES = frozenset({
    "/etc/ld.so.preload", "/etc/ld.so.nohwcap", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd",
    "/etc/group", "/etc/host.conf", "/etc/gai.conf", "/etc/resolv.conf", "/etc/hosts", "/etc/services",
    "/etc/protocols", "/var/run/nscd/socket", "/run/nscd/socket", "/etc/locale.alias", "/etc/ssl/openssl.cnf",
})
#: Folders whose files runtimes read to size themselves (CPU and memory limits); reads only.
SYSTEM_PROBE_DIRS = ("/sys/fs/cgroup/", "/sys/devices/system/cpu/")
#: Syscalls that change the file system; open/openat count when their flags ask to write.
WRITING = frozenset({
    "creat", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link",
    "linkat", "symlink", "symlinkat", "chmod", "fchmodat", "chown", "lchown", "fchownat", "truncate", "utime",
    "utimes", "utimensat", "futimesat", "mknod", "mknodat", "setxattr", "lsetxattr", "removexattr",
    "lremovexattr",
})
_WRITE_FLAGS = re.compile(r"\bO_(WRONLY|RDWR|CREAT|TRUNC|APPEND)\b")
NOT_FOUND = {"ENOENT", "ENOTDIR", "ELOOP"}
DENIED = {"EROFS": "read_only", "EACCES": "permission_denied", "EPERM": "permission_denied"}
SYMLINK_HOPS = 40

_LINE = re.compile(r"^(\d+) +(\w+)\((.*)\) += (-?\d+|\?) (E[A-Z0-9]+)")
_HEX = re.compile(r'"((?:\\x[0-9a-f]{2})*)"')
_FD = re.compile(r'^(AT_FDCWD|\d+)(?:<"?((?:\\x[0-9a-f]{2})*)"?>)?$')
_PROC_PID = re.compile(r"^/proc/\d+(/|$)")
_FAMILY = re.compile(r"sa_family=(AF_\w+)")
_OPEN, _CLOSE = "{[(<", "}])>"
_TWO_PATHS = {"rename", "renameat", "renameat2", "link", "linkat"}
_LINK_LAST = {"symlink", "symlinkat"}


def strace_args(output: str) -> list[str]:
    """strace's options (before ``--``) for an audited sandbox writing to ``output``."""
    return ["-f", "--seccomp-bpf", "-qq", "-y", "-xx", "-s", "4096", "-e", "signal=none", "-e", "status=failed",
            "-e", f"trace={TRACE}", "-o", output]


def _unhex(text: str) -> str:
    return bytes.fromhex(text.replace("\\x", "")).decode("utf-8", "replace")


def split_args(text: str) -> list[str]:
    """A syscall's top-level arguments (strings are hex, so no separator hides inside one)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def parse(line: str) -> dict[str, Any] | None:
    """One strace line as {pid, syscall, args, errno}, or None for anything else."""
    m = _LINE.match(line)
    if m is None:
        return None
    return {"pid": int(m.group(1)), "syscall": m.group(2), "args": split_args(m.group(3)), "errno": m.group(5)}


def _string(arg: str) -> str | None:
    m = _HEX.fullmatch(arg)
    return _unhex(m.group(1)) if m else None


def paths(record: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The file names a syscall was given, each with the directory it is relative to when strace
    reported one (the ``*at`` syscalls' directory descriptor), in order."""
    name, args = record["syscall"], record["args"]
    at_style = name.endswith(("at", "at2")) or name in {"statx", "execveat", "open_tree", "mount_setattr"}
    found: list[tuple[str, str | None]] = []
    for i, arg in enumerate(args):
        text = _string(arg)
        if text is None:
            continue
        base = None
        if at_style and i > 0:
            fd = _FD.match(args[i - 1])
            if fd and fd.group(2) is not None:
                base = _unhex(fd.group(2))
        found.append((text, base))
    if name in _LINK_LAST:
        return found[-1:]
    return found[:2] if name in _TWO_PATHS else found[:1]


def _covered(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def resolve(path: str, roots: Roots, lstat_link: Callable[[str], str | None] | None = None) -> str:
    """``path`` (absolute) normalised as the sandbox resolves it: ``.``/``..`` collapsed, and symlinks
    followed where the sandbox shows the host's files (bound roots, the recreated system links)."""
    readlink = lstat_link or _host_link
    links = dict(roots.symlinks)
    parts = list(PurePosixPath(path).parts[1:])
    current, hops = "/", 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = str(PurePosixPath(current).parent)
            continue
        candidate = str(PurePosixPath(current) / part)
        target = links.get(candidate)
        if target is None and hops < SYMLINK_HOPS and _covered(candidate, roots.bound):
            target = readlink(candidate)
        if target is not None and hops < SYMLINK_HOPS:
            hops += 1
            parts = list(PurePosixPath(target).parts) + parts
            if target.startswith("/"):
                parts, current = parts[1:], "/"
            continue
        current = candidate
    return current


def _host_link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def on_host(path: str) -> bool:
    """Whether something is at ``path`` on the worker's side (unreadable counts as something)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def _bytecode_cache(path: str) -> bool:
    p = PurePosixPath(path)
    return p.name == "__pycache__" or p.parent.name == "__pycache__"


def _proc_cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def writes(record: dict[str, Any]) -> bool:
    """Whether a syscall asked to change the file system."""
    if record["syscall"] in WRITING:
        return True
    return record["syscall"] in ("open", "openat", "openat2") and any(_WRITE_FLAGS.search(a) for a in record["args"])


def _hidden(path: str, roots: Roots, writing: bool, exists: Callable[[str], bool]) -> bool:
    """Whether a path the sandbox reported absent is something of the host's that it hides."""
    if _covered(path, roots.bound):
        return False  # bound at the same place: absent inside means absent on the host too
    if _covered(path, ("/proc", "/dev/pts", "/dev/mqueue")) and not _PROC_PID.match(path):
        return False  # the sandbox's own /proc (itself and its processes) and pseudo-terminals
    if not writing and (path in SYSTEM_PROBES or path.startswith(SYSTEM_PROBE_DIRS)):
        return False
    # Anything else, including the sandbox's own /tmp and an undeclared working directory (which
    # shadow the host's), is hidden when the host has it.
    return exists(path)


def _address(record: dict[str, Any]) -> tuple[str | None, str | None]:
    """(family, address) of a network syscall's destination, or (None, None) when it has none."""
    for arg in record["args"]:
        fam = _FAMILY.search(arg)
        if fam is None:
            continue
        family = fam.group(1)
        if family == "AF_UNIX":
            m = re.search(r'sun_path=(@?)"((?:\\x[0-9a-f]{2})*)"', arg)
            return family, (m.group(1) + _unhex(m.group(2))) if m else None
        strings = [_unhex(s) for s in _HEX.findall(arg)]
        port = re.search(r"htons\((\d+)\)", arg)
        host = next((s for s in strings if s and s != "AF_INET6"), "?")
        return family, f"{host}:{port.group(1) if port else '?'}"
    return None, None


def classify(record: dict[str, Any], roots: Roots, *, exists: Callable[[str], bool] = on_host,
             cwd_of: Callable[[int], str | None] = _proc_cwd,
             lstat_link: Callable[[str], str | None] | None = None) -> dict[str, Any] | None:
    """The violation one failed syscall is, or None when it is ordinary noise."""
    name, err = record["syscall"], record["errno"]
    base = {"syscall": name, "errno": err, "pid": record["pid"]}
    if name in DENIED_SYSCALLS:
        found = [p for p, _ in paths(record)] if name != "mount" else [_string(a) for a in record["args"][1:2]]
        return {"kind": "denied_syscall", **base, **({"path": found[0]} if found and found[0] else {})}
    if name in NETWORK_SYSCALLS:
        family, address = _address(record)
        if family in ("AF_INET", "AF_INET6") or (family == "AF_UNIX" and address and address.startswith("@")):
            if roots.network or address in roots.allowed:  # allowed: an egress allowlist's (worker/sandbox_egress.py)
                return None
            return {"kind": "network_denied", **base, "address": address}
        if family != "AF_UNIX" or not address:
            return None
        candidates = [(address, None)]
    else:
        candidates = paths(record)
    for raw, directory in candidates:
        if not raw:
            continue
        bases = [directory] if directory else [roots.cwd, cwd_of(record["pid"])]
        for where in dict.fromkeys(b for b in bases if b):
            full = raw if raw.startswith("/") else str(PurePosixPath(where) / raw)
            path = resolve(full, roots, lstat_link)
            evidence = {**base, "path": path, **({"given": raw} if raw != path else {})}
            expected = err == "EROFS" and _covered(path, roots.read_only_data)
            if err in DENIED and not expected and not _bytecode_cache(path):
                return {"kind": DENIED[err], **evidence}
            if err in NOT_FOUND and _hidden(path, roots, writes(record), exists):
                return {"kind": "hidden_path", **evidence}
    return None


def context_free(record: dict[str, Any]) -> bool:
    """Whether :func:`classify` decides ``record`` without the process's working directory (every
    path absolute or relative to a directory strace reported): then the same line, from any of
    the sandbox's processes, is the same verdict, and the reader may reuse it (a flood of one
    denied open costs one classification, not one per line)."""
    if record["syscall"] in NETWORK_SYSCALLS:
        family, address = _address(record)
        return family != "AF_UNIX" or not address or address.startswith(("/", "@"))
    return all(raw.startswith("/") or directory for raw, directory in paths(record))
