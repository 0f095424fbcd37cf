"""chatcore/openmp.py: a thread hands its OpenMP team back, or keeps its torch ops to itself,
without changing any other thread's. Run in a fresh interpreter: teams are per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chatcore import openmp

SCRIPT = r"""
import json, os, threading, torch
from chatcore import openmp
torch.set_num_threads(2)
x = torch.randn(2048, 2048)
def tasks():
    return len(os.listdir("/proc/self/task"))
def parallel_op():
    (x * 2).sum()
report = {}
parallel_op()
report["with_team"] = tasks()
openmp.release_team()
report["released"] = tasks()
parallel_op()
report["again"] = tasks()
def helper():
    openmp.single_threaded()
    report["helper_threads"] = torch.get_num_threads()
    before = tasks()
    parallel_op()
    report["helper_added"] = tasks() - before
def other():
    report["other_threads"] = torch.get_num_threads()
for target in (helper, other):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
report["main_threads"] = torch.get_num_threads()
print(json.dumps(report))
"""


@pytest.mark.skipif(openmp._libgomp() is None, reason="torch does not run on GNU OpenMP here")
def test_a_thread_releases_its_team_and_a_helper_keeps_to_itself() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["released"] == report["with_team"] - 1  # the team's one worker ended
    assert report["again"] == report["with_team"]  # the next parallel op starts a new team
    assert report["helper_threads"] == 1 and report["helper_added"] == 0
    assert report["other_threads"] == report["main_threads"] == 2
