"""Generation side: the Engine protocol, the built-in torch engine and its actor worker.

Nothing in this package imports the trainer: requests and samples are `nonstop.types`, settings
come from `nonstop.config`, and weights arrive through the engine end of `nonstop.transport`.

The built-in engine, from the outside in:
- core.py          the `Engine` protocol and `TorchEngine` (the synchronous driver: `generate`,
                   `submit` / `step` for other drivers), behaviour logprobs, where new weights meet it;
- scheduler.py     `Scheduler`: continuous batching (admission, shared prefill, decode steps,
                   finishing), `RequestError`;
- emit.py          `Emitter`: a forward pass's tokens sampled into their sequences, finish reasons;
- sequence.py      `Seq` and `SeqGroup`: the in-flight state of each completion and of a request;
- sampling.py      `sample()`: per-row temperature/top-k/top-p/min-p, behaviour logprobs, the
                   Keep Sampling Mask;
- runner.py        `KVRunner`: the lean forward over a Llama-family decoder (and its MoE blocks)
                   with a preallocated KV cache;
- layers.py        the decoder blocks' parameters as the runner reads them (MoE routing included),
                   and the check that refuses other models (`UnsupportedModel`);
- blocks.py        attention blocks of a decode step, and `reorder_plan`: which rows to move so
                   blocks of uneven rows stay short;
- prefix.py        `PrefixCache`: the KV of prompt prefixes kept across groups in blocks of 16
                   tokens (a trie, least recently used first out), so a prompt prefills its tail;
- updates.py       `WeightGate`: receiving a new version (poll) apart from applying it (apply);
                   `WeightSwaps`: the scheduler's weight-update modes (when a waiting version goes live);
- aio.py           `AsyncEngine`: one decode loop on the event loop shared by every caller,
                   `TokenEvent` streaming;
- worker.py        `EngineWorker`: the engine actor (a TorchEngine in its own process);
vLLM as the engine (`engine.kind: vllm`):
- vllm/setup.py    starting vLLM in the engine process: `require_vllm`, `start_engine`,
                   `NonstopWorkerExtension` (in-place weight reload), `VllmSetupError`;
- vllm/engine.py   `VllmEngineWorker`: the same actor calls as EngineWorker over vLLM's scheduler;
- vllm/sequence.py the in-flight state of its requests and completions (`VllmSeqGroup`, `VllmSeq`);
- vllm/routes.py   `RouteRecorder`: the experts every token vLLM computes was routed to (Keep Routing).
"""

from nonstop.engine.core import Engine, TorchEngine, WeightReceiver

__all__ = ["Engine", "TorchEngine", "WeightReceiver"]
