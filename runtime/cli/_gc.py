"""The cycle collector's settings in the processes the CLI owns (a trainer importing us keeps its own).

Kept apart from the commands' shared code so that ``main`` can tune the collector before it imports
the stack: at CPython's default threshold the collector ran ~150 passes while a ``run`` imported its
~65,000 start-up objects (80-100 ms of a 1.1 s start-up on 2 loaded cores).
"""

from __future__ import annotations

import gc

GC_YOUNG_THRESHOLD = 50_000  # allocations between young-generation collections (CPython's default: 700)
# young passes per middle pass (CPython's default: 10): a middle pass walks every object that survived
# the young passes since the last one; at 20,000 rollouts in flight, after 10 of them that was ~630,000
# objects (a ~300 ms pause on an idle core), after 2 of them ~240,000
GC_MIDDLE_THRESHOLD = 2
GC_OLD_THRESHOLD = 50  # middle passes per oldest pass: 2 x 50 young passes, as rare as CPython's 10 x 10


def tune_gc() -> None:
    """Run the cycle collector less often in the processes the CLI owns (a trainer importing us keeps its own).

    Each message allocates a few hundred short-lived objects that reference
    counting frees at once; at CPython's default threshold the collector still
    runs every 700 allocations, and its older-generation passes walk the whole
    heap: about 6% of a model worker's CPU, and its p99 latency spikes. Middle
    passes come after 2 young ones instead of 10, so each walks fewer survivors
    (the longest pauses with many rollouts in flight), and oldest passes after
    50 middle ones, so they stay as rare as before.
    """
    young, _, _ = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), GC_MIDDLE_THRESHOLD, GC_OLD_THRESHOLD)


def freeze_startup() -> None:
    """Take what start-up made (the stack and the environments imported, the config) out of the cycle
    collector's sight, in the processes the CLI owns, once nothing of a batch exists yet.

    Every oldest-generation pass walks every tracked object: ~75,000 of them are
    start-up's and live for the whole process, which at the default 1,024 rollouts
    in flight is as many as the rollouts' own. Frozen objects are still freed by
    reference counting; children forked afterwards share those pages instead of
    writing to each object's header on their first pass. No full collection first:
    it walked all of them again (10-60 ms of start-up on 2 cores, by load) to free
    the ~570 objects of import-time cycles, which now stay, frozen, for the process.
    """
    gc.freeze()
