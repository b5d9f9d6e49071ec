"""Neutral message types shared by the generation side and the learning side.

This module imports no model code and no torch: engines, trainers, the buffer, the
orchestrator and the scoring actors all speak in these types, so neither side needs to import the
other. Messages cross process boundaries by pickling, so they hold plain Python lists, not tensors.

Invariants of a `Sample`: `completion_ids`, `logprobs`, `versions` and `loss_mask` have one
entry per completion token; `logprobs[t]` is the behaviour logprob log mu(a_t) of the
distribution the engine actually sampled from (after temperature); `versions[t]` is the
policy_version of the weights that produced token t. When the engine truncated the distribution
(top-k / top-p / min-p), `sampling_mask[t]` lists the token ids it kept, and `logprobs[t]` is
normalised over exactly that set (a `KeptIds`). When the model is a mixture of experts, `routes`
holds the experts the engine's router chose for every input token (Keep Routing, a `Routes`). Both
compact per-token records are in kept.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from nonstop.kept import KeptIds, Routes

if TYPE_CHECKING:
    from nonstop.config import LoraConfig

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    """How an engine samples one completion. temperature 0 means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0: off)."""
    min_p: float = 0.0
    """Keep tokens with probability >= min_p x the most likely token's (0.0: off)."""
    stop: list[str] = field(default_factory=list)
    """Finish (reason 'stop') once the completion's text contains one of these strings; needs an
    engine with a tokenizer. The completing token is kept; servers cut the text at the string."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Finish (reason 'stop') after sampling one of these tokens (the model's EOS always stops)."""

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(slots=True)
class GenerationRequest:
    """One prompt to complete `n` times (a GRPO group when n > 1)."""

    request_id: int
    prompt_ids: list[int]
    n: int
    params: SamplingParams


@dataclass(slots=True)
class Sample:
    """One prompt and one completion with per-token behaviour metadata and its reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    loss_mask: list[bool] = field(default_factory=list)
    sampling_mask: KeptIds | list[list[int]] | None = None
    """Keep Sampling Mask: when top-k/top-p/min-p truncated the distribution, the sorted ids of the
    tokens kept at each completion position (the support the behaviour logprob is normalised over)."""
    routes: Routes | None = None
    """Keep Routing: the experts the engine routed each input token to (MoE models only)."""
    reward: float = 0.0
    text: str = ""
    token_rewards: list[float] | None = None
    """Per completion token, rewards of process steps (at the last token of each step, 0 elsewhere);
    the trainer turns them into token-level advantages (trainer/token_advantages.py)."""
    teacher_logprobs: list[float] | None = None
    """Per completion token, log pi_teacher(a_t) of the distillation teacher at the sampling temperature."""
    teacher: str | None = None
    """Identity and version of the teacher that scored `teacher_logprobs` ('path@version')."""
    advantage: float | None = None
    """Set by the producer when it computes advantages itself (episodes: per-role baselines); the
    trainer then uses it as is instead of the group-relative advantage of the rewards."""
    role: str = ""
    """Which role of a multi-agent episode wrote the model tokens of this sample ('' single-turn)."""
    episode: int = 0
    """Index of the episode within its group: the samples of one episode (one per role) share it."""
    policy: str = ""
    """Which policy wrote the model tokens: '' the run's shared policy, else the role whose own policy
    it is (env.policies); only that policy's trainer trains on the sample."""
    index: int = 0
    """Which of its request's n completions this is (set where the group is made, generate.py); with
    `episode` and `role` it names the sample within its group (`sample_id`)."""

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [True] * len(self.completion_ids)

    @property
    def sample_id(self) -> str:
        """The sample's name within its group, the same on every path it takes (buffer, trainer,
        a resume): 'episode.completion', and '/role' in a multi-agent episode."""
        return f"{self.episode}.{self.index}" + (f"/{self.role}" if self.role else "")

    @property
    def min_version(self) -> int:
        """Version of the oldest model token; environment tokens (loss mask False) carry no version."""
        model = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(model) if model else -1


@dataclass(slots=True)
class Group:
    """The samples of one prompt; atomic in the rollout buffer."""

    prompt_index: int
    prompt: str
    answer: str
    samples: list[Sample]
    epoch: int = 0  # which pass over the train split drew this prompt (the ledger's key with prompt_index)
    extra: dict[str, Any] = field(default_factory=dict)
    """The dataset row's fields besides prompt and answer, handed to reward functions."""
    messages: tuple[dict[str, str], ...] | None = None
    """The row's chat messages when it gave them (`prompt` is then their rendering): TRL rewards get
    them as the prompt (scoring/calls.py)."""

    @property
    def min_version(self) -> int:
        """Version of the oldest token in the group (drives the max-lag rule)."""
        versions = [v for v in (s.min_version for s in self.samples) if v >= 0]
        return min(versions) if versions else -1

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)


def shared_prefix_len(prompts: list[list[int]] | list[tuple[int, ...]]) -> int:
    """Tokens that begin every one of two or more distinct prompts (a chat template's head and a
    shared system prompt), at most the shortest less one, so that each prompt keeps a token of its
    own; 0 for fewer than two prompts. The trainer's packed forward computes these once for all
    (trainer/packed.py); the FLOP count and the micro-batch budget count them so (observe/flops.py,
    trainer/micro.py)."""
    if len(prompts) < 2:
        return 0
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts[1:]):
        n += 1
    return n


RewardKind = Literal["sample", "group", "steps"]
"""How a reward function is called (scoring/calls.py): per sample, per group, or per step."""


@dataclass(slots=True)
class RewardRow:
    """What a reward function may read about one sample (picklable: it travels to worker processes)."""

    prompt: str
    completion: str
    answer: str
    extra: dict[str, Any]
    steps: list[str] | None = None
    completion_ids: list[int] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    """The row's chat messages when it gave them (TRL's conversational format): a TRL reward then
    gets them as the prompt, and the completion as one assistant message."""


@dataclass(slots=True)
class Failure:
    reason: str  # raised | not_finite | bad_output
    message: str


Outcome = float | list[float] | Failure | None
"""A reward function's result for one sample: a float, one float per step (process rewards),
None (not applicable), or a Failure saying why."""


@dataclass(slots=True)
class TensorSpec:
    """Name, shape, dtype (as a string such as 'float32') and byte offset of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ShmOptions:
    """Options of the shared-memory transport."""

    name: str
    """Name of the segment the trainer creates and engines attach to."""
    device_path: Literal["host", "auto", "ipc"] = "host"
    """Resolved at plan time: 'host' (no GPU slots), 'auto' (GPU slots, used when every engine mapped
    them), 'ipc' (GPU slots always; an engine that cannot map them fails at attach)."""
    device: str = "cpu"
    """The trainer's device: where the GPU slots are allocated (device_path other than 'host')."""
    kind: ClassVar[Literal["shm"]] = "shm"


@dataclass(frozen=True, slots=True)
class BroadcastOptions:
    """Options of the broadcast transport."""

    host: str
    """Address of trainer rank 0's store and process group."""
    port: int
    bucket_bytes: int
    """Size of each broadcast slice."""
    per_tensor: bool = False
    """One broadcast per parameter instead of fixed-size slices."""
    rejoin_timeout_s: float = 300.0
    """After a send failed on a dead engine: how long to wait for its replacement to register."""
    device_path: Literal["auto", "host", "nccl"] = "host"
    """transport.device_path as asked: the backend (gloo or NCCL) is settled at the rendezvous."""
    device: str = "cpu"
    """The trainer's device (its member of an NCCL group sends from there)."""
    member: str = "cpu"
    """What the trainer says of its device at the rendezvous: 'cpu' or 'cuda/<GPU uuid>'."""
    delta: bool = False
    """Send each version as the words that changed since the one before (transport/delta.py)."""
    kind: ClassVar[Literal["broadcast"]] = "broadcast"


@dataclass(frozen=True, slots=True)
class FilesOptions:
    """Options of the files transport."""

    dir: str
    """Folder shared by trainer and engines."""
    keep: int
    """Versions the trainer keeps on disk."""
    owned: bool = False
    """The trainer made the folder and removes it when it closes."""
    notify_at: tuple[str, int] | None = None
    """(host, port) of the trainer's HTTP version notification; None: engines watch the marker only."""
    delta: bool = False
    """Write each version as the words that changed since the one before (transport/delta.py), and the
    full version every `full_every` versions."""
    full_every: int = 50
    kind: ClassVar[Literal["files"]] = "files"


TransportOptions = ShmOptions | BroadcastOptions | FilesOptions


@dataclass(frozen=True, slots=True)
class TransportHandle:
    """Everything an engine needs to attach to a trainer's weight transport (picklable).

    `options` holds the fields of one transport kind; the rest applies to every kind."""

    layout: list[TensorSpec]
    total_bytes: int
    options: TransportOptions
    num_engines: int
    """Engine ranks 1..num_engines the trainer planned for (the trainer is rank 0)."""
    timeout_s: float
    connect_timeout_s: float
    first_engines: int | None = None
    """Engine ranks 1..first_engines attach at the start; the others join later (broadcast welcomes
    them into a rebuilt group). None: all num_engines at the start."""
    checksum: bool = False
    lora: LoraConfig | None = None
    """With LoRA only the adapters travel, and the engine merges them into its base."""
    next_version: int = 1
    """The first version the trainer will publish (above 1 after a resume)."""

    @property
    def kind(self) -> Literal["shm", "broadcast", "files"]:
        return self.options.kind


@dataclass(slots=True)
class StepResult:
    """What a trainer step reports back to the orchestrator."""

    policy_version: int
    metrics: dict[str, Any]


@dataclass(slots=True)
class AheadResult:
    """What a forward run ahead of its step reports back (TrainerClient.forward_ahead)."""

    groups: int  # groups whose forward the trainer now holds for its next step
    forward_s: float  # the trainer's own time for it (the call's round trip also holds the messages' time)


@dataclass(slots=True)
class PublishResult:
    """What a trainer's publish reports: the version the engines can now load, and its cost."""

    policy_version: int
    publish_s: float
    publish_bytes: int
    """What the publish moved: a delta's bytes where it sent one, else the full version's."""
    full_bytes: int = 0
    """The full version's bytes (the layout in the wire dtype); 0: nothing planned."""
    pending: bool = False
    """The send goes on in the trainer (trainer.publish_overlap): engines can load the version once
    `TrainerClient.published()` returns; publish_s is then the launch's time and publish_bytes 0."""
