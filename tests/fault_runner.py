"""Run ``adapterpack ARGS`` as the console does, raising ``RuntimeError("injected fault")`` at the
AT-th call into adapterpack's own code (0: only count), in a process of its own: a fault leaves
no state behind in the test's process (torch's tracers and exporters keep global state).

    python tests/fault_runner.py AT REPORT.json ARGS...

REPORT.json gets {"calls": N, "where": "file.py:function" or null}. The error boundary, which
reports faults, is not counted: a fault in it has a test of its own.
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path

SOURCE = str(Path(__file__).resolve().parents[1] / "src" / "adapterpack")
REPORTER = str(Path(SOURCE) / "cli" / "boundary.py")


def main() -> None:
    at, report = int(sys.argv[1]), Path(sys.argv[2])
    state = {"calls": 0, "where": None}

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(SOURCE) and name != REPORTER:
            state["calls"] += 1
            if state["calls"] == at:
                state["where"] = f"{Path(name).name}:{frame.f_code.co_name}"
                raise RuntimeError("injected fault")
        return None

    atexit.register(lambda: report.write_text(json.dumps(state)))
    sys.argv = ["adapterpack", *sys.argv[3:]]
    from adapterpack.cli.app import main as cli_main

    sys.settrace(hook)
    cli_main()


if __name__ == "__main__":
    main()
