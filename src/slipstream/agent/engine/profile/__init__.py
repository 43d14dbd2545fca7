"""The step-time profile the time-budget packer plans with: measured at start-up,
fitted, cached, and calibrated against live steps."""
