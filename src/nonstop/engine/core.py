"""The built-in torch engine: batched decoding with a KV cache, versioned tokens.

Contract of `TorchEngine.generate(requests)`:
- each request's prompt is completed `n` times; the result holds one list of samples per
  request, in request order;
- rows are decoded together with left padding, an attention mask and explicit position ids,
  with a transformers `DynamicCache`; a finished row (EOS or `max_new_tokens`) is evicted
  from the batch and its cache rows are dropped, so later steps only pay for live rows;
- before every forward pass the engine asks its `WeightSource` for newer weights; when it
  gets them, every token sampled afterwards carries the new policy_version, while tokens
  already sampled keep the version and behaviour logprob they were sampled with;
- the behaviour logprob of a token is log-softmax(logits / temperature) at that token, i.e.
  of the distribution actually sampled from; with top-k / top-p / min-p the distribution is
  renormalised over the kept tokens, and their ids are recorded per token (`sampling_mask`);
  for greedy decoding (temperature 0) it is the untempered log-softmax.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from nonstop.types import GenerationRequest, Sample


def keep_mask(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Tokens kept by top-k, top-p and min-p together: (B, V) tempered logits -> (B, V) bool.

    The most likely token is always kept, so the kept set is never empty."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        keep &= scaled >= kth
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # top-p sees the top-k renormalised
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # probability mass strictly ahead of each token
        keep_sorted = before < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    return keep


class WeightSource(Protocol):
    """Engine-side end of a weight transport."""

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        """If a newer complete version is available, load it into `model` and return it.

        Never blocks on the trainer; returns None when there is nothing new."""
        ...


class Engine(Protocol):
    policy_version: int

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...


class TorchEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        weights: WeightSource | None = None,
        policy_version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.weights = weights
        self.policy_version = policy_version
        self.forward_passes = 0
        self.tokens_generated = 0

    def _refresh_weights(self) -> None:
        if self.weights is not None:
            version = self.weights.maybe_update(self.model)
            if version is not None:
                self.policy_version = version

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        rows: list[tuple[int, GenerationRequest]] = [
            (i, req) for i, req in enumerate(requests) for _ in range(req.n)
        ]
        if not rows:
            return [[] for _ in requests]
        # Rows that share length and temperature decode together; a batch's random generator
        # is seeded by the seed of its first request (per-row generators would cost a sampling
        # call per row).
        results: list[list[Sample]] = [[] for _ in requests]
        by_params: dict[tuple, list[tuple[int, GenerationRequest]]] = {}
        for row in rows:
            p = row[1].params
            by_params.setdefault((p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.min_p), []).append(row)
        for batch in by_params.values():
            for (req_index, _), sample in zip(batch, self._decode(batch)):
                results[req_index].append(sample)
        return results

    def _decode(self, batch: list[tuple[int, GenerationRequest]]) -> list[Sample]:
        params = batch[0][1].params
        prompts = [req.prompt_ids for _, req in batch]
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[r, width - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        unpadded = bool(attention.all())  # every row stays unpadded: rows only leave, never shift
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)

        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        out_ver: list[list[int]] = [[] for _ in range(n)]
        out_mask: list[list[list[int]]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        live = torch.arange(n)  # original row index of each row still in the batch
        cache = DynamicCache(config=self.model.config)
        step_input, step_pos = input_ids, positions

        for _ in range(params.max_new_tokens):
            self._refresh_weights()
            # Without padding the causal mask is implied; building a mask tensor every step
            # costs more than the attention itself on small models.
            out = self.model(
                input_ids=step_input, attention_mask=None if unpadded else attention, position_ids=step_pos,
                cache=cache, use_cache=True, logits_to_keep=1,
            )
            self.forward_passes += 1
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            logits = out.logits[:, -1, :].float()  # (B, V)
            keep = None
            if params.temperature > 0:
                scaled = logits / params.temperature
                if params.truncates:
                    keep = keep_mask(scaled, params.top_k, params.top_p, params.min_p)  # (B, V)
                    scaled = scaled.masked_fill(~keep, float("-inf"))
                logp = torch.log_softmax(scaled, dim=-1)
                tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                tokens = logits.argmax(-1)
            token_lp = logp.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
            if keep is not None:
                for r, row_keep in zip(live.tolist(), keep):
                    out_mask[r].append(row_keep.nonzero().squeeze(-1).tolist())
            self.tokens_generated += len(tokens)
            tok_list, lp_list, live_list = tokens.tolist(), token_lp.tolist(), live.tolist()
            for r, tok, lp in zip(live_list, tok_list, lp_list):
                out_ids[r].append(tok)
                out_lp[r].append(lp)
                out_ver[r].append(self.policy_version)
            done = torch.isin(tokens, self.eos)
            for r in live[done].tolist():
                finish[r] = "stop"
            keep = (~done).nonzero().squeeze(-1)
            if len(keep) == 0:
                break
            if len(keep) < len(live):
                cache.batch_select_indices(keep)
                attention, step_pos, tokens, live = attention[keep], step_pos[keep], tokens[keep], live[keep]
            attention = torch.cat([attention, torch.ones((len(live), 1), dtype=attention.dtype)], dim=1)
            step_pos = step_pos[:, -1:] + 1
            step_input = tokens[:, None]

        return [
            Sample(
                prompt_ids=list(prompts[r]), completion_ids=out_ids[r], logprobs=out_lp[r],
                versions=out_ver[r], finish_reason=finish[r],  # type: ignore[arg-type]
                sampling_mask=out_mask[r] if params.truncates and params.temperature > 0 else None,
            )
            for r in range(n)
        ]
