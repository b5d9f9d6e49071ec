"""The own-policies mode (config `env.policies`): `OwnPoliciesMode` (mode.py), what a run keeps of
the roles' own policies (policies.py), how they are built (policy_build.py) and the split intake
that feeds their buffers (split_intake.py). Built on the environment mode (modes/environment/).
Nothing is re-exported: importers name the module.
"""
