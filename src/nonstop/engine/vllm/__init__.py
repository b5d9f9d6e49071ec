"""vLLM as the engine (`engine.kind: vllm`, docs/vllm.md). Importing the package loads no vLLM:
setup.py imports it when an engine starts (the `vllm` extra, its own venv on a CPU machine).

- setup.py     starting vLLM in the engine process: `require_vllm`, `start_engine`,
               `NonstopWorkerExtension` (in-place weight reload), `VllmSetupError`;
- engine.py    `VllmEngineWorker`: the same actor calls as EngineWorker over vLLM's scheduler;
- sequence.py  the in-flight state of its requests and completions;
- routes.py    `RouteRecorder`: the experts every token vLLM computes was routed to (Keep Routing).
"""
