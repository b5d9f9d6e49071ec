"""What the tests imported from here before it was split by what it supports, re-exported for the
tests and benches whose folders other work is changing (tests/faults, tests/trainer,
tests/transport, bench/faults.py) and for configs that name `support.helpers:<reward>`. New code
imports the modules themselves: actor_classes.py, weights.py, rewards.py, fault_rewards.py and
timelines.py."""

from support.actor_classes import DataParallelRank, Echo, TrainerRankHost  # noqa: F401
from support.fault_rewards import (  # noqa: F401
    cluster_event_reward,
    hang_engine_once_reward,
    interrupt_once_reward,
    kill_an_engine_every_reward,
    kill_engine_0_once_reward,
    kill_engine_once_reward,
    kill_engine_reward,
    kill_trainer_after_two_checkpoints_reward,
    kill_trainer_reward,
    overflow_reward,
)
from support.rewards import (  # noqa: F401
    always_raising_reward,
    length_reward,
    ones_reward,
    raising_reward,
    three_chars_reward,
    zero_reward,
)
from support.timelines import two_step_timeline  # noqa: F401
from support.weights import connect_then_hang, perturbed_model, receive_weights, receive_weights_in  # noqa: F401
