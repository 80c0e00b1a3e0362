"""lab/probe_step_host_cpu.py (fake ops in its own process) runs on the CPU and reports a time."""
import re
import subprocess
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parent.parent


def test_host_probe_runs_on_the_cpu():
    res = subprocess.run([sys.executable, str(LAB / "probe_step_host_cpu.py"), "--G", "4", "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    match = re.search(r"G=4 stacked: ([0-9.]+) ms of host time per step", res.stdout)
    assert match and float(match.group(1)) > 0, res.stdout
