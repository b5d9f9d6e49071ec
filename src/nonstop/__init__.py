"""nonstop: asynchronous RL post-training of LLMs.

Generation (engines) and learning (trainer) run in separate processes joined by a bounded
rollout buffer; new weights reach the engines through a weight transport without stopping
them; every generated token carries the policy_version that produced it.
"""

__version__ = "0.1.0"
