"""The environment mode (config `env`): `EnvMode` (mode.py), the episode runner (episodes.py) and
the producer of episode groups (episode_flow.py).

The runner and the producer are also what the own-policies mode plays (modes/own_policies/) and
where the agents mode takes its per-role baselines (modes/api_agents/); they import this package's
modules, never the other way round. Nothing is re-exported: importers name the module.
"""
