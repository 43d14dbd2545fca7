"""Pure-Python scheduling: request state, block manager, batch packing, policies, predictor.

Nothing here imports torch, zmq or a web framework (an import-linter contract enforces it),
so the live engine and the discrete-event simulator run exactly this code.
"""
