"""The built-in engine against transformers' own greedy decoding on a real pretrained model.

The tiny random models of the other engine tests cannot show a numerical divergence that only a
trained model's sharp, long-range attention exposes (rotary positions beyond a few tokens, GQA
head grouping, the RMSNorm epsilon, tied embeddings, left padding in a batch). SmolLM2-135M-Instruct
in float32, prompted through its chat template, must complete 64 chat prompts exactly as
`model.generate(do_sample=False)` does, token for token; a few may part at a near-tie between two
float32 summation orders, hence the 95% bar rather than 100%.
"""

from __future__ import annotations

import time

import pytest
import torch

from nonstop.config import EngineConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer, stop_token_ids
from nonstop.tasks.chat import renderer
from nonstop.types import GenerationRequest, SamplingParams

MAX_NEW_TOKENS = 32
QUESTIONS = (
    [f"What is {a} + {b}?" for a, b in [(2, 3), (7, 8), (12, 30), (45, 55), (99, 1), (123, 77), (6, 6), (250, 250)]]
    + [f"What is {a} times {b}?" for a, b in [(3, 4), (6, 7), (9, 9), (12, 12), (5, 20), (11, 3), (8, 25), (15, 4)]]
    + [
        f"What is {a} minus {b}?"
        for a, b in [(10, 4), (100, 37), (50, 25), (9, 10), (1000, 1), (64, 32), (7, 7), (81, 9)]
    ]
    + [
        "What is the capital of France?",
        "What is the capital of Japan?",
        "Name a primary colour.",
        "How many days are in a week?",
        "How many legs does a spider have?",
        "What colour is the sky on a clear day?",
        "What is the boiling point of water in Celsius?",
        "Who wrote Romeo and Juliet?",
        "What is the largest planet in the solar system?",
        "Give me a synonym for happy.",
        "What is the opposite of cold?",
        "Translate 'hello' into French.",
        "What gas do plants absorb from the air?",
        "How many continents are there?",
        "What is the square root of 81?",
        "Is 17 a prime number?",
        "Spell the word 'cat' backwards.",
        "What is H2O?",
        "Name a fruit that is yellow.",
        "How many hours are in a day?",
        "What does a thermometer measure?",
        "Write a haiku about the sea.",
        "Tell me a fun fact about octopuses.",
        "What is the freezing point of water in Fahrenheit?",
        "Which animal is known as the king of the jungle?",
        "What is 2 to the power of 10?",
        "Finish the sentence: The early bird...",
        "Suggest a name for a pet goldfish.",
        "What is the plural of mouse?",
        "How many sides does a hexagon have?",
        "Explain photosynthesis in one sentence.",
        "What language is spoken in Brazil?",
        "Count from one to five.",
        "What is the chemical symbol for gold?",
        "Why do we need sleep?",
        "List three kinds of trees.",
        "What is half of 30?",
        "Who painted the Mona Lisa?",
        "What is the speed of light, roughly?",
        "Give one tip for learning to code.",
    ]
)
assert len(set(QUESTIONS)) == len(QUESTIONS) == 64


def _prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Chat prompts under the template's own default system prompt (system_prompt None)."""
    render = renderer(tokenizer, None)
    return [tokenizer(render([{"role": "user", "content": q}]))["input_ids"] for q in questions]


def _hf_greedy(model, prompt: list[int], stops: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy completion, cut after its first stop id (the engine keeps that token
    too), with the gap between the two best logits at each step."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=stops,
        pad_token_id=stops[0],
        output_scores=True,
        return_dict_in_generate=True,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(g[0] - g[1]) for g in (s[0].float().topk(2).values for s in out.scores)]
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], gaps[: i + 1]
    return ids, gaps


def _agreement(folder, questions: list[str], slots: int) -> int:
    """How many of `questions` the engine completes exactly as transformers does; prints the others.

    Fewer slots than prompts: later prompts are admitted while earlier ones decode (mixed steps,
    slots reused and repacked), as in a run. Explicit limits: left unset, the KV cache would be
    sized from the model's 8,192 positions."""
    tokenizer = load_tokenizer(str(folder))
    stops = stop_token_ids(tokenizer, folder)
    model = load_model(str(folder), torch.float32)
    prompts = _prompts(tokenizer, questions)
    settings = EngineConfig(dtype="float32", max_seq_len=256, max_concurrent_seqs=slots)
    engine = TorchEngine(model, stops, tokenizer.pad_token_id, settings=settings)
    params = SamplingParams(MAX_NEW_TOKENS, 0.0)
    t0 = time.perf_counter()
    got = engine.generate([GenerationRequest(i, p, 1, params) for i, p in enumerate(prompts)])
    t1 = time.perf_counter()
    lengths = [len(r[0].completion_ids) for r in got]
    assert sum(lengths) >= 4 * len(prompts), f"completions too short to compare anything: {lengths}"
    matches, report = 0, []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ours = got[i][0].completion_ids
            theirs, gaps = _hf_greedy(model, prompt, stops)
            if ours == theirs:
                matches += 1
                continue
            at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            gap = gaps[at] if at < len(gaps) else float("nan")
            report.append(
                f"prompt {i} {questions[i]!r}: first differs at token {at} (engine {ours[at : at + 3]}, "
                f"hf {theirs[at : at + 3]}, hf top-2 logit gap {gap:.2e}{', a near-tie' if gap < 1e-4 else ''})"
            )
    print(f"engine {t1 - t0:.1f} s, hf {time.perf_counter() - t1:.1f} s; {matches}/{len(prompts)} equal")
    print("\n".join(report))
    return matches


def test_greedy_matches_transformers_on_16_chat_prompts(smollm2_dir):
    """The default tier's share of the check below (every fourth question: sums, products,
    differences and free answers), with admissions during decoding."""
    assert _agreement(smollm2_dir, QUESTIONS[::4], slots=8) >= 15


@pytest.mark.slow
def test_greedy_matches_transformers_on_64_chat_prompts(smollm2_dir):
    """Issue 50: at least 95% of 64 chat prompts complete token for token as HF generate does
    (about 4 minutes on one thread, most of it in transformers' one-prompt-at-a-time decoding)."""
    assert _agreement(smollm2_dir, QUESTIONS, slots=16) >= 61
