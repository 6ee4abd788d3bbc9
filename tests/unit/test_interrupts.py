"""A main thread waiting through ``interrupts.wait`` sees Ctrl-C whichever thread the kernel
handed it to; an untimed wait sleeps through it until the item arrives."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
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
