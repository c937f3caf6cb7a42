"""The audit's rules on strace lines (pure: worker/sandbox_audit.py), and its command line.

Each line below is what strace 6 prints with the options the audit uses (``-y -xx``: directory
descriptors annotated, every string in hex).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from worker.sandbox import AUDIT_MARKER, DEATHSIG, SandboxSpec, bwrap_binary, launch
from worker.sandbox_audit import classify, parse, strace_args
from worker.sandbox_reader import Auditor

ROOTS_KW = {"read_only": ("/usr", "/venv", "/srv/tool"), "writable": ("/srv/var",),
            "symlinks": (("/bin", "usr/bin"),), "cwd": "/srv/var", "read_only_data": ("/srv/data",)}


def roots(**kw):  # noqa: ANN201
    from worker.sandbox import Roots

    return Roots(**{**ROOTS_KW, **kw})


def hx(text: str) -> str:
    return "".join(f"\\x{b:02x}" for b in text.encode())


def line(syscall: str, args: str, err: str = "ENOENT", pid: int = 7) -> str:
    return f"{pid} {syscall}({args}) = -1 {err} (whatever)"


def at(path: str, cwd: str = "/srv/var", flags: str = "O_RDONLY|O_CLOEXEC") -> str:
    return line("openat", f'AT_FDCWD<{hx(cwd)}>, "{hx(path)}", {flags}')


HOST = {"/etc/shadow", "/proc/4242/environ", "/work/keys/k.key", "/tmp/host-only", "/etc/passwd", "/dev/kvm"}


def judge(text: str, **kw):  # noqa: ANN201
    return classify(parse(text), kw.pop("r", roots()), exists=lambda p: p in HOST, cwd_of=kw.pop("cwd_of", lambda _: None),
                    lstat_link=kw.pop("links", {}).get)


def test_a_path_with_quotes_and_newlines_cannot_forge_a_line() -> None:
    evil = '/x") = -1 EROFS (no)\n9 openat(AT_FDCWD, "/etc/shadow'
    record = parse(at(evil))
    assert record is not None and record["errno"] == "ENOENT" and record["pid"] == 7
    assert judge(at(evil)) is None  # a path that exists nowhere: not a violation, and not /etc/shadow


def test_hidden_paths_are_those_the_host_has() -> None:
    assert judge(at("/etc/shadow"))["kind"] == "hidden_path"
    assert judge(at("/proc/4242/environ"))["path"] == "/proc/4242/environ"  # another process's
    assert judge(at("/tmp/host-only"))["kind"] == "hidden_path"  # the sandbox's /tmp shadows the host's
    assert judge(at("/dev/kvm"))["kind"] == "hidden_path"
    # Absent everywhere, or the sandbox's own: probes, not violations.
    for quiet in ("/root/lib/python311.zip", "/usr/lib/missing.so", "/proc/self/fd/9", "/srv/var/absent",
                  "/etc/passwd", "/sys/fs/cgroup/cpu.max"):
        assert judge(at(quiet)) is None, quiet
    # A library's lookup is excused for reading only: writing /etc/passwd is not a lookup.
    assert judge(at("/etc/passwd", flags="O_WRONLY|O_APPEND"))["kind"] == "hidden_path"


def test_paths_are_normalised_with_symlinks_and_the_real_directory() -> None:
    # Relative to the directory strace reported, dots collapsed.
    found = judge(at("../../etc/shadow", cwd="/srv/var"))
    assert found["path"] == "/etc/shadow" and found["given"] == "../../etc/shadow"
    # A symlink inside a bound root that points out of the sandbox.
    found = judge(at("/srv/tool/link/shadow"), links={"/srv/tool/link": "/etc"})
    assert found["path"] == "/etc/shadow"
    # The system links the sandbox recreates.
    assert judge(at("/bin/../../etc/shadow"))["path"] == "/etc/shadow"
    # A legacy (non-*at) syscall with a relative path: the declared working directory and the
    # process's actual one are both tried; either escaping is enough.
    legacy = line("open", f'"{hx("shadow")}", O_RDONLY')
    assert judge(legacy) is None
    assert judge(legacy, cwd_of=lambda _: "/etc")["path"] == "/etc/shadow"


def test_denials_writes_network_and_privileged_syscalls() -> None:
    assert judge(line("openat", f'AT_FDCWD<{hx("/")}>, "{hx("/srv/tool/a")}", O_RDWR', "EROFS"))["kind"] == "read_only"
    assert judge(line("mkdir", f'"{hx("/usr/x")}", 0777', "EACCES"))["kind"] == "permission_denied"
    # The interpreter's bytecode cache, and a read identity's fallback on the writer's data: expected.
    assert judge(line("mkdir", f'"{hx("/venv/lib/__pycache__")}", 0777', "EROFS")) is None
    assert judge(line("openat", f'AT_FDCWD<{hx("/")}>, "{hx("/srv/data/db-wal")}", O_RDWR|O_CREAT', "EROFS")) is None
    tcp = line("connect", '3<\\x73>, {sa_family=AF_INET, sin_port=htons(5432), sin_addr=inet_addr("'
               + hx("127.0.0.1") + '")}, 16', "ECONNREFUSED")
    assert judge(tcp) == {"kind": "network_denied", "syscall": "connect", "errno": "ECONNREFUSED", "pid": 7,
                          "address": "127.0.0.1:5432"}
    assert judge(tcp, r=roots(network=True)) is None
    abstract = line("connect", '3, {sa_family=AF_UNIX, sun_path=@"' + hx("dbus") + '"}, 7', "ECONNREFUSED")
    assert judge(abstract)["address"] == "@dbus"
    assert judge(line("ptrace", "PTRACE_ATTACH, 1", "EPERM"))["kind"] == "denied_syscall"
    mount = judge(line("mount", f'"{hx("none")}", "{hx("/mnt")}", "{hx("tmpfs")}", 0, NULL', "EPERM"))
    assert mount["kind"] == "denied_syscall" and mount["path"] == "/mnt"
    # Failures that are not denials (exists already, not a link) say nothing.
    assert judge(line("mkdir", f'"{hx("/srv/var/x")}", 0777', "EEXIST")) is None


def test_the_auditor_ignores_set_up_and_counts_after_the_marker(tmp_path: Path) -> None:
    key = tmp_path / "k.key"  # a real file of the host's (the auditor asks the real file system)
    key.write_text("secret")
    seen: list[dict] = []
    a = Auditor("s", "write", on_violation=seen.append)
    a.roots = roots()
    try:
        fd = os.open(a.path, os.O_WRONLY)  # what strace does; the reader thread is waiting for it
        os.write(fd, (at("/etc/shadow") + "\n").encode())  # bwrap's set-up: before the marker
        # The marker, a violation, and a line strace has not finished writing yet.
        os.write(fd, (line("chdir", f'"{hx(AUDIT_MARKER)}"') + "\n" + at("/etc/shadow") + "\n" + at(str(key))[:-30]).encode())
        found = a.take()
        assert a.armed and [f["path"] for f in found] == ["/etc/shadow"]
        os.write(fd, (at(str(key))[-30:] + "\n").encode())
        assert [f["path"] for f in a.take()] == [str(key)]
        os.write(fd, (at(str(tmp_path / "absent")) + "\n").encode())
        assert a.take() == []  # absent on the host too: nothing hidden
        assert len(seen) == 2 and a.total == 2
        os.close(fd)
    finally:
        a.close()
    assert not Path(a.directory).exists()


def test_the_launcher_puts_strace_outside_everything() -> None:
    out = launch(SandboxSpec(), command=["/venv/bin/python", "-m", "tool"], env={}, cwd="/tmp", base_dir=Path("/"),
                 status_path="/s.json", runtime_paths=[], audit_path="/private/trace", parent_pid=4242)
    argv = [out.command, *out.args]
    # strace starts under the wrapper that ties it to the worker process (dies with pid 4242).
    assert argv[:5] == [sys.executable, "-I", "-S", DEATHSIG, "4242"]
    argv = argv[5:]
    assert argv[: 1 + len(strace_args("/private/trace"))] == ["strace", *strace_args("/private/trace")]
    rest = argv[argv.index("--") + 1:]
    assert rest[0] == "/bin/sh" and "ulimit -v" in rest[2]  # the limits apply to bwrap and below only
    assert rest[rest.index(bwrap_binary()) + 1] == "--json-status-fd"
    inner = rest[len(rest) - rest[::-1].index("--"):]
    assert inner[:2] == ["/bin/sh", "-c"] and AUDIT_MARKER in inner[2] and inner[-3:] == ["/venv/bin/python", "-m",
                                                                                        "tool"]
    options = strace_args("/x")
    assert "status=failed" in options and "--seccomp-bpf" in options and "-xx" in options
