"""The `jpaged` command pauses Python's cyclic garbage collector while it starts and resumes it once started, the
start-up's objects frozen out of later collections; a process that did not pause it is left alone."""

from __future__ import annotations

import gc
import subprocess
import sys

from jpaged import start_up_collector


def test_resume_without_a_pause_leaves_the_collector_alone():
    frozen = gc.get_freeze_count()
    start_up_collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def _states_in_a_fresh_process(command: str) -> list[str]:
    """The `jpaged` entry point run on a stand-in `command` (its parser replaced), the collector's state printed as
    the arguments are parsed and as the command runs."""
    program = (
        "import argparse, gc, sys\n"
        "from jpaged.entrypoints import cli, launch\n"
        "def state(when):\n"
        "    print(when, gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "def parser():\n"
        "    state('parsing')\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--log-level', default='warning')\n"
        f"    p.set_defaults(command={command!r}, model_tag=None, run=lambda args: state('running') or 0)\n"
        "    return p\n"
        "cli.build_parser = parser\n"
        "sys.argv = ['jpaged']\n"
        "assert launch.main() == 0\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_command_starts_paused_and_runs_resumed_with_the_start_ups_objects_frozen():
    assert _states_in_a_fresh_process("plan") == ["parsing False False", "running True True"]


def test_serve_runs_paused_until_the_server_is_ready():
    """The server resumes it once ready (server/startup.py's loader), not before its engine has started."""
    assert _states_in_a_fresh_process("serve") == ["parsing False False", "running False False"]
