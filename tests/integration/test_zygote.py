"""The test kit's zygote (``proofline_kit/zygote.py``): a child it forks must look, from inside and
outside, like the ``python`` process the test asked for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proofline_kit import zygote
from proofline_kit.processes import wait_for

PY = sys.executable
PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_PROBE"),
                  "path0": sys.path[0], "pythonpath": [p for p in sys.path if p.endswith("extra-path")],
                  "forked": "mcp_types" in sys.modules, "product": "proofline.settings" in sys.modules,
                  "main": __name__, "pgid": os.getpgid(0) == os.getpid(), "ppid": os.getppid(),
                  "cmdline": open("/proc/self/cmdline", "rb").read().decode()}))
"""


def _probe(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(zygote.SWITCH, raising=False)
    monkeypatch.setattr(zygote, "_enabled", True)


def test_it_is_off_in_a_process_that_did_not_enable_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "_enabled", False)
    assert type(zygote.spawn([PY, "-c", "pass"])) is subprocess.Popen


def test_a_forked_child_has_the_argv_directory_environment_and_path_it_asked_for(tmp_path: Path) -> None:
    extra = tmp_path / "extra-path"
    extra.mkdir()
    env = {**os.environ, "ZYGOTE_PROBE": "yes", "PYTHONPATH": str(extra)}
    done = zygote.run([PY, "-c", PROBE, "one", "two"], env=env, cwd=tmp_path, capture_output=True, text=True,
                      timeout=60)
    assert done.returncode == 0, done.stderr
    seen = _probe(done.stdout)
    assert seen["forked"], "the child did not come from the preloaded zygote"
    assert not seen["product"], "the zygote must not preload the product's own modules"
    assert seen["ppid"] != os.getpid()
    assert seen["argv"] == ["-c", "one", "two"]
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "yes" and seen["main"] == "__main__"
    assert seen["path0"] == "" and seen["pythonpath"] == [str(extra)]
    assert not seen["pgid"]
    assert "-c" in seen["cmdline"] and "one two" in seen["cmdline"] and "zygote" not in seen["cmdline"]


def test_a_module_and_a_script_run_as_python_would_run_them(tmp_path: Path) -> None:
    (tmp_path / "probe_mod.py").write_text(PROBE)
    as_module = zygote.run([PY, "-m", "probe_mod", "x"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": ""})
    seen = _probe(as_module.stdout)
    assert seen["forked"] and seen["argv"] == [str(tmp_path / "probe_mod.py"), "x"] and seen["path0"] == str(tmp_path)
    script = tmp_path / "sub" / "probe_script.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    as_script = zygote.run([PY, str(script), "y"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    seen = _probe(as_script.stdout)
    assert seen["forked"] and seen["argv"] == [str(script), "y"] and seen["path0"] == str(script.parent)


@pytest.mark.parametrize(("code", "status", "stderr"), [
    ("import sys; sys.exit(7)", 7, ""),
    ("import sys; sys.exit('refused: bad setup')", 1, "refused: bad setup"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM, ""),
])
def test_the_exit_status_is_the_interpreters(code: str, status: int, stderr: str) -> None:
    done = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert stderr in done.stderr
    if status == 1 and "boom" in stderr:
        assert "Traceback" in done.stderr


def test_atexit_runs_threads_are_waited_for_and_output_is_flushed(tmp_path: Path) -> None:
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
            "print('main done', end='')\n")
    done = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.index("main done") < done.stdout.index("thread done") < done.stdout.index("atexit ran")


def test_standard_streams_files_and_passed_descriptors_reach_the_child(tmp_path: Path) -> None:
    log = tmp_path / "log"
    r, w = os.pipe()
    try:
        with open(log, "ab") as handle:
            proc = zygote.spawn([PY, "-u", "-c", f"import os, sys; print('out'); print('err', file=sys.stderr); "
                                 f"os.write({w}, sys.stdin.read().encode())"],
                                stdin=subprocess.PIPE, stdout=handle, stderr=subprocess.STDOUT, pass_fds=(w,),
                                text=True)
        proc.stdin.write("through the pipe")
        proc.stdin.close()
        assert proc.wait(60) == 0
        os.close(w)
        w = -1
        assert os.read(r, 100) == b"through the pipe"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert sorted(log.read_text().split()) == ["err", "out"]


def test_a_new_session_is_a_process_group_the_test_can_signal_and_wait_for() -> None:
    proc = zygote.spawn([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert isinstance(proc, zygote.Forked)
    assert os.getpgid(proc.pid) == proc.pid  # set before spawn returns, as Popen does
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    wait_for(lambda: not os.path.exists(f"/proc/{proc.pid}"), 10, what="the child reaped")


@pytest.mark.parametrize("argv", [
    [PY, "-I", "-c", "pass"],           # an interpreter option the zygote cannot honour
    ["/bin/true"],                      # not Python
])
def test_what_a_fork_cannot_give_exactly_starts_plainly(argv: list[str]) -> None:
    proc = zygote.spawn(argv)
    assert type(proc) is subprocess.Popen
    assert proc.wait(60) == 0


def test_an_interpreter_setting_in_the_environment_starts_plainly() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    proc = zygote.spawn([PY, "-c", "pass"], env=env)
    assert type(proc) is subprocess.Popen
    assert proc.wait(60) == 0


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(zygote.SWITCH, "0")
    done = zygote.run([PY, "-c", "import sys; print('mcp_types' in sys.modules)"], capture_output=True, text=True,
                      timeout=60)
    assert done.stdout.strip() == "False"


def test_a_bad_working_directory_fails_as_popen_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        zygote.spawn([PY, "-c", "pass"], cwd=tmp_path / "missing")


def test_a_test_process_without_standard_input_still_forks_its_children() -> None:
    # CI runs the suite with standard input closed: a child then reads end of file from /dev/null.
    code = ("import sys; from proofline_kit import zygote; zygote.enable(); "
            "r = zygote.run([sys.executable, '-c', 'import sys; print(sys.stdin.read() == \"\", "
            "\"mcp_types\" in sys.modules)'], capture_output=True, text=True, timeout=60); print(r.stdout.strip())")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(zygote.__file__).parents[1],
                          preexec_fn=lambda: os.close(0))  # noqa: PLW1509 - the closed stdin is the point
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True True"


def test_children_that_end_at_once_report_their_status() -> None:
    # Their exit status can arrive in the same read as their pid.
    codes = [zygote.run([PY, "-c", f"raise SystemExit({n % 3})"], timeout=60).returncode for n in range(30)]
    assert codes == [n % 3 for n in range(30)]
