"""Slipstream: LLM serving for mixed short/long traffic on Kubernetes.

The package is assembled from the repository's top-level folders, which are the
architecture: ``slipstream.agent`` (engine, scheduler, server, ...), ``slipstream.kernels``,
``slipstream.crds``, ``slipstream.decisions`` and ``slipstream.operator``. Their files live
here, under ``src/slipstream``, and each top-level folder of the checkout is a link into it,
so import-graph tools, type checkers and editable installs all see one ordinary package.
``operator/`` deliberately has no ``__init__.py``: run from the repository root, a regular
package of that name would shadow Python's standard ``operator`` module.
"""

__version__ = "0.1.0"
