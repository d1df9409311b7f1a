"""Rollouts: one episode of a task through the fleet, recorded as a ``Trajectory``."""
