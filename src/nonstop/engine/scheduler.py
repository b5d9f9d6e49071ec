"""Continuous batching: admission, prefill, decode steps, finishing, and the weight-update modes.

Contract:
- `submit(request, on_done, on_fail=None, on_token=None)` validates the request (a prompt longer than the engine's
  limits is a `RequestError` naming the limit, raised before anything is queued) and queues it;
  its group of `n` completions finishes independently of every other request: `on_done` gets
  the n samples (or `on_fail` the exception) as soon as the last one ends;
- `step()` runs exactly one forward pass: one decode step of every live sequence with the
  prompts of newly admitted groups prefilled in the same pass (after an abort: the prefill of
  every aborted sequence's prompt + prefix, alone). A request joins as soon as `n` slots and
  its token reservation (prompt + max_new_tokens per sequence) fit, so no sequence waits for
  the slowest one of some batch; a sequence gives its slot and its share of the reservation
  back when it ends, not when its group does (with a long tail, one long sibling would
  otherwise keep n - 1 idle slots' tokens reserved and hold new groups out);
- the n completions of a prompt share one prefill: the prompt's KV is computed once and copied
  into its siblings' slots;
- with the prefix cache (engine/prefix.py, `engine.prefix_cache_tokens`), a prompt's cached
  whole blocks are copied into its first slot and only the rest is prefilled; so are the whole
  blocks it shares with a prompt admitted earlier in the same pass (copied layer by layer as
  that pass computes them, so prompts admitted together, as after a swap, compute a shared
  system prompt once); each prefilled prompt's blocks are cached after its pass; the cache
  empties whenever new weights go live;
- the weight gate is polled before every forward pass (updates.py `WeightSwaps`); what a waiting
  version does depends on `update_mode` (see docs/engine.md): never_stop and save_resume keep in-flight KV, abort_retry
  recomputes it under the new weights, drain holds admissions until in-flight sequences finish,
  blocking admits static batches and swaps only between them. A token's version is the version
  live during the forward pass that produced its logits, and tokens sampled before a swap keep
  their version and behaviour logprob in every mode;
- with a mixture-of-experts model every sequence records the experts its input tokens were routed
  to (kept.Routes): the prompt's at its prefill (shared by the group), each completion token's
  when it is fed back; a re-prefill after an abort replaces the prefix's routes with the ones
  recomputed under the new weights, since later tokens attend to that recomputed KV;
- `stats["flops"]` adds up each forward pass's FLOPs (observe/flops.py: the tokens it ran, the
  logits it computed and the causal attention pairs) when `flop_model` is set; over
  `stats["busy_s"]` it is the engine's achieved FLOP/s;
- with `group_cancel`, a swap cancels every in-flight group whose oldest token is more than
  `max_lag` versions behind; the group restarts from its prompt (counted in `groups_cancelled`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from nonstop.config import EngineConfig
from nonstop.engine.blocks import reorder_plan
from nonstop.engine.emit import Emitter
from nonstop.engine.prefix import BLOCK, PrefixCache
from nonstop.engine.runner import Runner
from nonstop.engine.sampling import RowParams
from nonstop.engine.sequence import Seq, SeqGroup
from nonstop.engine.updates import WeightGate, WeightSwaps
from nonstop.errors import EngineError
from nonstop.observe.flops import FlopModel, causal_pairs
from nonstop.types import GenerationRequest, Sample

PREFIX_CACHE_SHARE = 8
"""engine.prefix_cache_tokens when unset: the KV cache's tokens (slots x max_seq_len) over this."""


class RequestError(EngineError, ValueError):
    """A request the engine cannot serve; the message names the field or limit."""


class Scheduler(Emitter, WeightSwaps):
    def __init__(
        self,
        runner: Runner,
        eos_token_ids: list[int],
        cfg: EngineConfig,
        gate: WeightGate | None,
        detokenize: Callable[[list[int]], str] | None = None,
        policy_version: int = 0,
    ) -> None:
        self.runner = runner
        self.eos = frozenset(eos_token_ids)
        self.cfg = cfg
        self.gate = gate
        self.detokenize = detokenize
        self.policy_version = policy_version
        self.max_seq_len = runner.max_seq_len
        self.max_cached_tokens = cfg.max_cached_tokens or runner.num_slots * runner.max_seq_len
        budget = cfg.prefix_cache_tokens
        if budget is None:
            budget = runner.num_slots * runner.max_seq_len // PREFIX_CACHE_SHARE
        # a MoE model records the routes of every prompt token, which a cached prefix would not recompute
        self.prefix = PrefixCache(runner.cache, budget) if budget >= BLOCK and not runner.moe_layers else None
        self.waiting: deque[SeqGroup] = deque()
        self.rows: list[Seq] = []  # rows[i] lives in cache slot i
        self.reprefill: list[Seq] = []
        self.reserved_tokens = 0
        self.draining = False
        self._row_params: RowParams | None = None
        self._uniform_params = {}
        self.flop_model: FlopModel | None = None
        self.stats = {
            "flops": 0.0,
            "forward_passes": 0,
            "prefills": 0,
            "decode_steps": 0,
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "prefix_hit_tokens": 0,
            "swaps": 0,
            "swap_s": 0.0,
            "max_swap_s": 0.0,
            "aborted_seqs": 0,
            "paused_seqs": 0,
            "groups_cancelled": 0,
            "groups_done": 0,
            "reorders": 0,
            "reorder_rows": 0,
            "attention_reads": 0,
            "busy_s": 0.0,
        }

    # -- requests ---------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        p, n = request.params, request.n
        if not request.prompt_ids:
            raise RequestError("prompt_ids: empty prompt")
        if n < 1:
            raise RequestError(f"n: must be at least 1 (got {n})")
        if n > self.runner.num_slots:
            raise RequestError(f"n: {n} completions exceed engine.max_concurrent_seqs ({self.runner.num_slots})")
        if p.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: must be at least 1 (got {p.max_new_tokens})")
        need = len(request.prompt_ids) + p.max_new_tokens
        if need > self.max_seq_len:
            raise RequestError(
                f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {p.max_new_tokens} "
                f"exceeds the engine's max_seq_len of {self.max_seq_len} tokens"
            )
        if n * need > self.max_cached_tokens:
            raise RequestError(
                f"{n} x ({len(request.prompt_ids)} prompt + {p.max_new_tokens} new) tokens exceed "
                f"engine.max_cached_tokens ({self.max_cached_tokens})"
            )
        if p.temperature < 0 or p.top_k < 0 or not 0.0 < p.top_p <= 1.0 or not 0.0 <= p.min_p < 1.0:
            raise RequestError(
                f"sampling parameters out of range: temperature {p.temperature} (>= 0), top_k {p.top_k} "
                f"(>= 0), top_p {p.top_p} (0, 1], min_p {p.min_p} [0, 1)"
            )
        if p.stop and self.detokenize is None:
            raise RequestError("stop: stop strings need an engine with a tokenizer")

    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[list[Sample]], None],
        on_fail: Callable[[BaseException], None] | None = None,
        on_token: Callable[[int, int, float, int], None] | None = None,
    ) -> SeqGroup:
        self.check(request)
        r = self.runner
        shape = (r.moe_layers, r.top_k, r.num_experts) if r.moe_layers else None
        group = SeqGroup(request, on_done, on_fail, on_token, r.vocab_size, shape)
        self.waiting.append(group)
        return group

    def abort(self, group: SeqGroup) -> None:
        """Forget a group (its caller went away): no callback fires."""
        if group in self.waiting:
            self.waiting.remove(group)
            return
        self._evict(group)

    def fail_all(self, error: BaseException) -> None:
        """A step raised: every queued and in-flight group fails with the error; the engine stays usable."""
        groups = list(self.waiting) + list({id(s.group): s.group for s in self.rows}.values())
        self.waiting.clear()
        self.rows, self.reprefill, self.reserved_tokens, self._row_params = [], [], 0, None
        for g in groups:
            if g.on_fail is not None:
                g.on_fail(error)

    def has_work(self) -> bool:
        return bool(self.waiting or self.rows)

    # -- one forward pass -------------------------------------------------------------------

    def step(self) -> None:
        t0 = time.perf_counter()
        self._poll_weights()
        if self.reprefill:
            self._forward([])
        else:
            admitted = self._admit()
            if admitted or self.rows:
                self._forward(admitted)
        self.stats["busy_s"] += time.perf_counter() - t0

    def _admit(self) -> list[SeqGroup]:
        if self.draining or (self.cfg.update_mode == "blocking" and self.rows):
            return []
        admitted, used = [], len(self.rows)
        while self.waiting:
            g = self.waiting[0]
            if used + g.n > self.runner.num_slots or self.reserved_tokens + g.reserve > self.max_cached_tokens:
                break
            self.waiting.popleft()
            admitted.append(g)
            used += g.n
            self.reserved_tokens += g.reserve
            g.held = g.reserve
        return admitted

    def _forward(self, groups: list[SeqGroup]) -> None:
        """One forward pass. Normally: a decode step of every live row, with the prompts of newly
        admitted groups prefilled in the same pass (one prompt per group, its KV copied to the
        siblings; from the end of the longest prefix the prefix cache holds or an earlier prompt
        of the same pass begins with, `PrefixCache.reuse`). After an abort: a prefill of prompt +
        prefix of every aborted row, alone."""
        decoding = [] if self.reprefill else list(self.rows)
        for g in groups:  # every prompt's first sequence in consecutive slots, then the siblings
            g.seqs[0].row = len(self.rows)
            self.rows.append(g.seqs[0])
        for g in groups:
            for s in g.seqs[1:]:
                s.row = len(self.rows)
                self.rows.append(s)
        heads: list[int] = []  # the slot of each prompt's first sequence
        members, prefixes, starts = [], [], []
        shares: list[tuple[int, int, int]] = []  # in-pass copies of a shared prefix (runner.mixed)
        for g in groups:
            prompt, head = g.request.prompt_ids, g.seqs[0].row
            for s in g.seqs:
                s.length = len(prompt)
            earlier = [(e.request.prompt_ids, e.seqs[0].row) for e in groups[: len(heads)]]
            start = self.prefix.reuse(prompt, head, earlier, shares) if self.prefix is not None else 0
            heads.append(head)
            members.append(g.seqs)
            prefixes.append(prompt[start:])
            starts.append(start)
        for s in self.reprefill:
            heads.append(s.row)
            members.append([s])
            prefixes.append(s.group.request.prompt_ids + s.ids)
            starts.append(0)
            s.length = len(prefixes[-1])
        self.reprefill = []
        if self.flop_model is not None:  # decode rows attend to their length + 1 keys, prefixes causally
            self.stats["flops"] += self.flop_model.forward(
                len(decoding) + sum(len(p) for p in prefixes),
                len(decoding) + len(prefixes),
                sum(s.length + 1 for s in decoding) + sum(causal_pairs(a, len(p)) for a, p in zip(starts, prefixes)),
            )
        if decoding:
            tokens, positions = torch.tensor([[s.pending for s in decoding], [s.length for s in decoding]])
            if heads:
                logits = self.runner.mixed(tokens, positions, torch.tensor(heads), prefixes, starts, shares)
            else:
                logits = self.runner.decode(tokens, positions)
            for s in decoding:
                s.length += 1
            self.stats["decode_steps"] += 1
            self.stats["attention_reads"] = self.runner.attention_reads
        else:
            logits = self.runner.prefill(torch.tensor(heads), prefixes, starts, shares)  # (P, V)
        if heads:  # siblings get their prompt's KV (positions past a row's length are never read)
            pairs = [(head, s.row, s.length) for head, seqs in zip(heads, members) for s in seqs[1:]]
            if pairs:
                src, dst, lengths = zip(*pairs)
                self.runner.move(list(src), list(dst), max(lengths))
            if self.prefix is not None:
                for g in groups:
                    self.prefix.store(g.request.prompt_ids, g.seqs[0].row)
            self.stats["prefills"] += 1
            self.stats["prefill_tokens"] += sum(len(p) for p in prefixes)
            self.stats["prefix_hit_tokens"] += sum(starts)
            if any(len(m) > 1 for m in members):  # each sibling samples from its prompt's logits
                repeat = torch.tensor([1] * len(decoding) + [len(m) for m in members])
                logits = logits.repeat_interleave(repeat, dim=0)
        if self.runner.routes is not None:
            self._record_routes(decoding, members, prefixes)
        seqs = decoding + [s for m in members for s in m]
        if heads:  # the batch changed: its parameters are rebuilt (and cached only for plain decode steps)
            self._row_params = None
            params = self._params_of(seqs)
        else:
            if self._row_params is None:
                self._row_params = self._params_of(seqs)
            params = self._row_params
        self._emit(seqs, logits, params)

    def _record_routes(self, decoding: list[Seq], members: list[list[Seq]], prefixes: list[list[int]]) -> None:
        """Hand the pass's routes (decode rows, then each prefilled prefix's tokens) to their sequences."""
        assert self.runner.routes is not None
        data = self.runner.routes.numpy()  # (N, moe_layers, k)
        if data.dtype != np.uint8:
            data = data.astype("<u2")
        for i, s in enumerate(decoding):
            assert s.routes is not None  # a MoE runner gives every sequence its routes
            s.routes.completion += data[i].tobytes()
        at = len(decoding)
        for seqs, prefix in zip(members, prefixes):
            block, at = data[at : at + len(prefix)], at + len(prefix)
            P = len(seqs[0].group.request.prompt_ids)
            prompt = block[:P].tobytes()
            for s in seqs:
                assert s.routes is not None
                s.routes.prompt = prompt
                s.routes.completion = bytearray(block[P:].tobytes())

    def _release(self, seqs: list[Seq]) -> None:
        """Free the rows of finished (or evicted) sequences, keeping live rows packed at the front."""
        gone = {id(s) for s in seqs}
        origin: dict[int, tuple[Seq, int]] = {}  # moved sequence -> (it, the slot its cache is in now)
        for row in sorted((s.row for s in seqs), reverse=True):
            last = self.rows.pop()
            if row < len(self.rows):
                origin.setdefault(id(last), (last, last.row))
                last.row = row
                self.rows[row] = last
        # Every source slot was popped from the end, so it lies past every destination: one copy.
        moves = [(slot, s.row, s.length) for s, slot in origin.values()]
        if moves:
            src, dst, lengths = zip(*moves)
            self.runner.move(list(src), list(dst), max(lengths))
        for s in seqs:
            s.row = -1
        self.reprefill = [s for s in self.reprefill if id(s) not in gone]
        self._row_params = None
        if not self.reprefill:
            self._reorder()
        ended = [s for s in seqs if s.finish is not None]
        for s in ended:  # a finished sequence's slot is free now: so is its share of the reservation
            s.group.held -= s.group.share
            self.reserved_tokens -= s.group.share
        for g in {id(s.group): s.group for s in ended}.values():
            if g.all_finished:
                self.stats["groups_done"] += 1
                g.on_done([s.to_sample() for s in g.seqs])

    def _reorder(self) -> None:
        """Keep rows in attention blocks by descending length, when that pays (engine/blocks.py)."""
        order = reorder_plan([s.length + 1 for s in self.rows])
        if order is None:
            return
        self.runner.permute(order, [s.length for s in self.rows])
        self.stats["reorders"] += 1
        self.stats["reorder_rows"] += sum(r != i for i, r in enumerate(order))
        self.rows = [self.rows[r] for r in order]
        for row, s in enumerate(self.rows):
            s.row = row

    def _evict(self, group: SeqGroup) -> None:
        live = [s for s in group.seqs if s.row >= 0]
        for s in live:
            s.finish = None
        if live:
            self._release(live)
        self.reserved_tokens -= group.held  # what its finished sequences gave back is already off
        group.held = 0
