"""Emitting a forward pass's tokens: `Emitter`, the scheduler's mixin that samples each row from
its logits, appends the token to its sequence with the policy_version live during the pass and
its behaviour logprob (and, when the request truncates sampling, the kept set: ids or a
bitmask, whichever is smaller), and decides which sequences finish (EOS, stop ids or strings,
max_new_tokens).

`Emitter` is a mixin of engine/scheduler.py's `Scheduler`, which holds the attributes declared
below and frees the finished rows (`_release`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nonstop.engine.sampling import RowParams, row_params, sample
from nonstop.engine.sequence import Seq
from nonstop.types import FinishReason


class Emitter:
    # set by Scheduler (engine/scheduler.py); declared here for the type checker only
    eos: frozenset[int]
    detokenize: Callable[[list[int]], str] | None
    policy_version: int
    stats: dict[str, float]
    _release: Callable[[list[Seq]], None]
    _uniform_params: dict[tuple[tuple[float, int, float, float], int], RowParams]

    def _params_of(self, seqs: list[Seq]) -> RowParams:
        """The rows' sampling parameters. A batch whose rows all share one setting and no generator
        of their own (the usual case) reuses the parameters built for that setting at this size:
        the batch changes on most steps, and building them costs about as much as a sampling step
        at a small vocabulary."""
        settings = [s.group.settings for s in seqs]
        generators = [s.generator for s in seqs]
        first = settings[0]
        if settings.count(first) < len(settings) or any(g is not None for g in generators):
            return row_params(settings, generators)
        key = (first, len(seqs))
        params = self._uniform_params.get(key)
        if params is None:
            if len(self._uniform_params) >= 256:  # settings change with the requests: keep a bounded few
                self._uniform_params.clear()
            params = self._uniform_params[key] = row_params(settings, generators)
        return params

    def _emit(self, seqs: list[Seq], logits: torch.Tensor, params) -> None:
        self.stats["forward_passes"] += 1
        tokens, logprobs, kept = sample(logits, params, consume=True)
        kept_rows = self._kept_rows(seqs, kept) if kept is not None else {}
        version, finished, eos = self.policy_version, [], self.eos
        # one .tolist() per tensor per step; the loop touches only Python objects
        for i, (s, tok, lp) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            s.ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            if s.kept is not None:
                ids, bits = kept_rows[i]
                if bits is not None:
                    s.kept.append_bitmask(bits)
                else:
                    assert ids is not None  # _kept_rows gives a row its ids or its bitmask
                    s.kept.append(ids)
            s.pending = tok
            g = s.group
            if g.on_token is not None:
                g.on_token(s.index, tok, lp, version)
            if tok in eos or tok in g.stop_ids:
                reason: FinishReason | None = "stop"
            elif g.stop_strings:
                reason = self._finish_reason(s, tok)
            elif len(s.ids) >= g.max_new_tokens:
                reason = "length"
            else:
                continue
            if reason is not None:
                s.finish = reason
                finished.append(s)
        self.stats["tokens_generated"] += len(seqs)
        if finished:
            self._release(finished)

    @staticmethod
    def _kept_rows(seqs: list[Seq], kept: torch.Tensor) -> dict[int, tuple[list[int] | None, bytes | None]]:
        """Per truncating row, its kept ids (sorted) or, when smaller, its packed bitmask."""
        idx = [i for i, s in enumerate(seqs) if s.kept is not None]
        if not idx:
            return {}
        sub = kept[idx]  # (R, V) bool
        counts = sub.sum(-1).tolist()
        store = seqs[idx[0]].kept
        assert store is not None  # idx holds the rows that keep their sets
        as_bits = [store.id_bytes(c) > store.bitmask_bytes() for c in counts]
        out: dict[int, tuple[list[int] | None, bytes | None]] = {}
        packed = None
        if any(as_bits):
            packed = np.packbits(sub.numpy(), axis=-1, bitorder="little")  # (R, ceil(V / 8))
        listed = [r for r, b in enumerate(as_bits) if not b]
        if listed:
            rows = sub[listed]
            flat = rows.nonzero()[:, 1].tolist()
            ends = rows.sum(-1).cumsum(0).tolist()
            for r, a, b in zip(listed, [0, *ends[:-1]], ends):
                out[idx[r]] = (flat[a:b], None)
        for r, b in enumerate(as_bits):
            if b:
                assert packed is not None  # packed above whenever any row is a bitmask
                out[idx[r]] = (None, packed[r].tobytes())
        return out

    def _finish_reason(self, s: Seq, tok: int) -> FinishReason | None:
        g = s.group
        if tok in self.eos or tok in g.stop_ids:
            return "stop"
        if g.stop_strings and self.detokenize is not None:
            tail = self.detokenize(s.ids[-g.stop_window :])
            if any(x in tail for x in g.stop_strings):
                return "stop"
        if len(s.ids) >= g.request.params.max_new_tokens:
            return "length"
        return None
