"""Processes: spawn, health, supervision, the state dir, the orphan guard."""
