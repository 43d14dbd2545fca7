"""Slipstream: LLM serving for mixed short/long traffic on Kubernetes.

The package is assembled from the repository's top-level folders, which are the
architecture: ``slipstream.agent`` (engine, scheduler, server, ...), ``slipstream.kernels``,
``slipstream.crds`` and ``slipstream.operator``. They are symlinked under ``src/slipstream``
so that type checkers and editable installs see one ordinary package. The top-level
``operator/`` folder deliberately has no ``__init__.py``: run from the repository root, a
regular package of that name would shadow Python's standard ``operator`` module.
"""

__version__ = "0.1.0"
