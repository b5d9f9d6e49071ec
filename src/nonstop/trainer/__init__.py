"""Learning side: pure losses, the Trainer (model, optimizer, step) and its actor worker.

- losses.py            pure tensor functions of the objectives: group advantages, the clipped
                       (GRPO-family) and GSPO losses, the KL penalty;
- logprobs.py          `token_logprobs()`: the sampled tokens' logprobs under the LM head, one chunk of
                       logits at a time in the forward and the backward;
- objective.py         `policy_objective()`: one update's loss (policy loss, reference KL, entropy bonus);
- correction.py        `is_weights()`: off-policy importance-sampling corrections;
- token_advantages.py  token-level advantages: process rewards and on-policy distillation;
- layer.py             `project()`, `finish()`: a decoder layer's work around attention, compiled under trainer.compile;
- forward.py           `prompt_shared_hidden()`: the forward with each distinct prompt computed once;
- packed.py            `packed_logprobs()`: the same forward padding-free, real tokens only (trainer.packed);
- routing.py           Keep Routing in the trainer: `RouterHooks` compare or replay the engine's experts;
- ahead.py             `AheadForwards`: forwards run ahead of their step, graph kept, assembled at the step;
- micro.py             `split()`: a batch cut into micro-batches of trainer.micro_batch_tokens forward tokens;
- updates.py           `whole_updates()`, `micro_updates()`: a batch's optimizer updates, at once or by micro-batch;
- batch.py             `Batch`: a batch of groups as tensors, built by the Trainer's `BatchBuilder`;
- compute.py           `ComputeWeights`: the bf16 step's weights, cast once per optimizer step (and published);
- core.py              `Trainer`: one policy-gradient step on a batch of groups, then a new policy_version;
- parallel.py          `ParallelTrainer`: M data-parallel ranks taking exactly the one-rank step;
- checkpointing.py     what a trainer writes into a checkpoint beside its weights, and `load_state()`;
- worker.py            `TrainerWorker`: the trainer actor, owner of the sending end of the weight transport.
"""
