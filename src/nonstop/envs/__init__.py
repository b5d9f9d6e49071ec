"""Environments: the seam (base.py), the built-ins (guess.py, calculator.py, nim.py), and
lookup by name (registry.py). The episode runner lives in orchestrator/episodes.py."""
