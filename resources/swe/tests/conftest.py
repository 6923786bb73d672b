"""Fixtures for the container tests: a real Docker engine (or a skip) and an image with a repository at
``/testbed``, shared with the suite under ``tests/``."""

from tests.docker import base_image, engine  # noqa: F401
from tests.swe_demo import swe_demo_image  # noqa: F401
