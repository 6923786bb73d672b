import sys

from gym_runtime.cli import main

sys.exit(main())
