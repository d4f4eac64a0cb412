"""Run ``adapterpack ARGS`` as the console does, raising ``RuntimeError("injected fault")`` at the
AT-th call into adapterpack's own code (0: only count), in a process of its own: a fault leaves
no state behind in the test's process (torch's tracers and exporters keep global state).

    python tests/fault_runner.py AT REPORT.json ARGS...

REPORT.json gets {"calls": N, "where": "file.py:function" or null}. The error boundary, which
reports faults, is not counted: a fault in it has a test of its own. A fault raised where Python
ignores exceptions (a generator finalised by the garbage collector) is raised again at the next
call, so every run meets its fault.
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
    pending = {"fault": False}

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(SOURCE) and name != REPORTER:
            state["calls"] += 1
            if state["calls"] == at or pending["fault"]:
                pending["fault"] = False
                state["where"] = f"{Path(name).name}:{frame.f_code.co_name}"
                raise RuntimeError("injected fault")
        return None

    def unraisable(found) -> None:
        if isinstance(found.exc_value, RuntimeError) and str(found.exc_value) == "injected fault":
            # A trace function that raises is removed: set it again to raise at the next call.
            pending["fault"] = True
            sys.settrace(hook)
        else:
            sys.__unraisablehook__(found)

    sys.unraisablehook = unraisable

    atexit.register(lambda: report.write_text(json.dumps(state)))
    sys.argv = ["adapterpack", *sys.argv[3:]]
    from adapterpack.cli.app import main as cli_main

    sys.settrace(hook)
    cli_main()


if __name__ == "__main__":
    main()
