"""Plumbing: seeding, checkpoints, logging sinks, memory readings."""
