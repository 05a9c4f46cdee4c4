"""Simulation and capacity planning on carpool's own scheduler (no torch here)."""
