"""`python -m gym_runtime.cli`. Guarded: a worker process (anyio's run_in_process, multiprocessing) re-runs the
parent's main module as ``__mp_main__``; unguarded, it ran the CLI there and every scoring process failed."""

import sys

from gym_runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
