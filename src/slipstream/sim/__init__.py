"""Discrete-event simulator driving the real scheduler on a performance model."""
