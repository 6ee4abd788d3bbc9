"""A main thread waiting through ``interrupts.wait`` sees Ctrl-C whichever thread the kernel
handed it to; an untimed wait sleeps through it until the item arrives."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import queue, signal, sys, threading, time
    from llmflow import interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    q = queue.Queue()
    ready = threading.Event()

    def worker():
        ready.set()
        time.sleep(4)
        q.put("done")

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    ready.wait()
    threading.Timer(0.3, lambda: signal.pthread_kill(thread.ident, signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        if sys.argv[1] == "sliced":
            interrupts.wait(lambda t: q.get(timeout=t), queue.Empty)
        else:
            q.get()
        print("not interrupted")
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - t0:.2f}")
""")


def _run(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=30,
                          cwd=REPO, env={"PYTHONPATH": checkout_path(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX threads")
def test_a_sliced_wait_sees_ctrl_c_delivered_to_another_thread():
    out = _run("sliced")
    assert out.startswith("interrupted after "), out
    assert float(out.split()[-1]) < 2.0  # the worker would have answered after 4 s


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX threads")
def test_an_untimed_wait_sleeps_through_it_which_is_why_the_slices_exist():
    out = _run("untimed")
    assert out == "not interrupted" or float(out.split()[-1]) >= 3.5, out


PARENT = textwrap.dedent("""
    import os, subprocess, sys
    from llmflow import interrupts

    env = {**os.environ, **interrupts.child_env()}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env)
    print(child.pid, flush=True)
    child.wait()
""")
CHILD = textwrap.dedent("""
    import sys, time
    from llmflow import interrupts

    interrupts.die_with_parent()
    print("armed", flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_calls_die_with_parent_ends_when_its_parent_is_killed(tmp_path):
    import os
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={"PYTHONPATH": checkout_path(REPO), "PATH": "/usr/bin:/bin"})
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "armed"
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/status").read_text()
        except OSError:
            break  # gone (reaped by init)
        if "\nState:\tZ" in state:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its parent's kill -9")


def test_sigterm_raises_terminated_inside_the_block_only():
    script = textwrap.dedent("""
        import os, signal, time
        from llmflow import interrupts

        before = signal.getsignal(signal.SIGTERM)
        try:
            with interrupts.sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        except interrupts.Terminated:
            print("terminated", isinstance(interrupts.Terminated(), KeyboardInterrupt))
        print("restored", signal.getsignal(signal.SIGTERM) == before)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          cwd=REPO, env={"PYTHONPATH": checkout_path(REPO), "PATH": "/usr/bin:/bin"})
    assert done.stdout.split() == ["terminated", "True", "restored", "True"], done.stderr
