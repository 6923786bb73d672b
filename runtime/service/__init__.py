"""The batch service: what ``run``, ``start``, ``publish``, ``collect``, ``reverify`` and ``Client`` share.

``runner`` composes the workers a config names and runs a batch end to end; ``supervisor`` keeps
worker child processes, and ``ready`` is the line they say they take work with. It sits between the
operations (``ops``) and the workers it starts.
"""
