"""The agents mode (config `agents`): `AgentsMode` (mode.py) and the run's endpoint with the
producer its agents' groups feed (agents.py). Nothing is re-exported: importers name the module.
"""
