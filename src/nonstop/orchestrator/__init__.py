"""The orchestrator: the flow of one training run, in the `nonstop train` process (asyncio)."""
