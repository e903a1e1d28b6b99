"""Capacity planning: measure an engine's phases (`profile.py`), simulate a workload on candidate deployments
(`simulator.py`), and recommend one (`plan.py`)."""
