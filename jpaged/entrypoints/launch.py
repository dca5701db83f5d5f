"""The `jpaged` command's entry point: the collector paused before anything is imported (start_up_collector.py)."""

from __future__ import annotations

import sys

from jpaged import start_up_collector


def main() -> int:
    start_up_collector.pause()
    from jpaged.entrypoints.cli import main as run_command

    return run_command()


if __name__ == "__main__":
    sys.exit(main())
