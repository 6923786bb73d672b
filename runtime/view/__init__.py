"""``gym-runtime view`` and ``diff``: rollouts files indexed (``index``), summarized and filtered (``runs``),
a row laid out (``trajectory``), two runs compared (``diff``), and the read-only pages over them (``server``)."""
