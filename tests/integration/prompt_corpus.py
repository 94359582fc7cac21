"""Natural-text prompts of chosen token lengths for the engine reference tests.

Prompts are token-id lists cut from a fixed corpus with the reference tokenizer, so their
lengths are exact. Each prompt starts at a different paragraph, so prompts of the "distinct"
set share no prefix (no accidental prefix-cache hits); the "shared prefix" set deliberately
shares a long one.
"""
from __future__ import annotations

from collections.abc import Callable

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a rag. For thirty years he had trimmed the wick, polished the great lens and "
    "written the weather in a leather logbook that smelled of salt and smoke.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of green "
    "plants, water is split, oxygen is released, and carbon dioxide is fixed into sugars by "
    "the enzymes of the Calvin cycle, which run on the ATP and NADPH made in the light.",
    "In 1869 the first transcontinental railroad in the United States was completed when the "
    "Central Pacific and Union Pacific lines met at Promontory Summit in Utah. A golden spike "
    "was driven to mark the occasion, and telegraph lines carried the news across the nation.",
    "To make a simple bread, mix flour, water, salt and yeast, then knead the dough until it is "
    "smooth and elastic. Let it rise in a warm place for an hour, shape it into a loaf, let it "
    "rise again, and bake it in a hot oven until the crust is brown and sounds hollow.",
    "A binary search tree keeps its keys in sorted order: every key in the left subtree of a "
    "node is smaller than the node's key, and every key in the right subtree is larger. Lookups, "
    "insertions and deletions take time proportional to the height of the tree.",
    "The monsoon arrived late that year. Farmers watched the sky for weeks, and when the first "
    "heavy clouds rolled in from the sea, children ran into the streets to dance in the rain "
    "while their parents hurried to plant rice in the flooded fields.",
    "Jupiter is the largest planet in the solar system, a gas giant more than three hundred "
    "times as massive as Earth. Its Great Red Spot is a storm larger than our whole planet that "
    "has been raging for at least three and a half centuries.",
    "When learning a new language, it helps to listen every day, to speak early even when you "
    "make mistakes, and to read simple stories. Vocabulary grows fastest when new words are met "
    "again and again in different contexts rather than memorised from lists.",
]

SHARED_PREFIX_SUFFIXES = [
    " Question: what did the keeper carry?",
    " Summarise the passage above in one sentence.",
    " Which planet is mentioned above, and why is it notable?",
    " Translate the first sentence into French.",
]

# Token lengths of the "distinct" batch: from a few tokens to ~400, run together.
DISTINCT_PROMPT_LENGTHS = [3, 9, 25, 50, 90, 150, 260, 400]
SHARED_PREFIX_LENGTH = 170  # > 10 full blocks of 16


def _corpus_from(start: int) -> str:
    n = len(PARAGRAPHS)
    # Repeat the rotation twice so even the longest prompt never runs out of text.
    return " ".join(PARAGRAPHS[(start + i) % n] for i in range(2 * n))


def distinct_prompts(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """One prompt per length in DISTINCT_PROMPT_LENGTHS, each from a different paragraph."""
    prompts = []
    for i, length in enumerate(DISTINCT_PROMPT_LENGTHS):
        ids = encode(_corpus_from(i))
        assert len(ids) >= length, "corpus too short for the requested prompt length"
        prompts.append(ids[:length])
    return prompts


def shared_prefix_prompts(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Prompts that share their first SHARED_PREFIX_LENGTH tokens and differ afterwards."""
    prefix = encode(_corpus_from(0))[:SHARED_PREFIX_LENGTH]
    return [prefix + encode(suffix) for suffix in SHARED_PREFIX_SUFFIXES]
