"""Runs the script named by its first argument (with the rest as its
arguments), except on the ranks DIE_AT_START lists (comma-separated global
ranks): their first start SIGKILLs itself at once — before any store or
connection — as a node that fails while the job starts. A restarted one
(ZEROPP_REJOIN=1) runs the script."""

import os
import runpy
import signal
import sys

if os.environ.get("ZEROPP_REJOIN") != "1" and os.environ.get("RANK") in os.environ.get(
    "DIE_AT_START", ""
).split(","):
    os.kill(os.getpid(), signal.SIGKILL)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
