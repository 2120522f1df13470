"""Seeded English text prompts of about N tokens for the real-model benchmarks (llama.cpp takes
text, not token ids): each is a few sentences on one topic followed by an instruction, written from
templates here (no dataset is downloaded; the text is this project's own).

    python benchmarks/make_text_prompts.py --out benchmarks/data/text_prompts_128.jsonl --tokens 128 --n 64
"""

from __future__ import annotations

import argparse
import json
import random

TOPICS = ["the ocean", "volcanoes", "the history of bread", "honeybees", "the printing press", "glaciers",
          "the human heart", "solar power", "chess openings", "the Roman roads", "coral reefs", "rainforests",
          "the moon landing", "jazz music", "bicycles", "tea ceremonies", "lighthouses", "the silk road",
          "desert plants", "migratory birds", "clocks", "bridges", "paper money", "the telescope"]
FACTS = [
    "Many people find {t} fascinating because it connects science, history and everyday life.",
    "Researchers have studied {t} for a long time, and new questions keep appearing.",
    "Teachers often use {t} as an example when they explain how complex systems change over time.",
    "In some countries, {t} plays an important part in local traditions and stories.",
    "A short walk through any library shows how many books have been written about {t}.",
    "Understanding {t} requires patience, careful observation and a willingness to ask simple questions.",
    "Some of the most surprising facts about {t} were discovered by accident.",
    "Artists and writers have described {t} in many different ways over the centuries.",
    "The way people think about {t} has changed a great deal in the last hundred years.",
    "Children are usually curious about {t} long before they learn its proper name.",
]
ASKS = ["Write a clear explanation of {t} for a curious student, with three examples.",
        "Summarise what is known about {t} and list the most important open questions.",
        "Describe {t} in a short essay with an introduction, two main points and a conclusion.",
        "Explain why {t} matters today, in plain language, step by step."]


def make(n: int, tokens: int, seed: int, tokenizer) -> list[dict]:  # noqa: ANN001
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = ""
        facts = FACTS[:]
        rng.shuffle(facts)
        k = 0
        while len(tokenizer(text).input_ids) < tokens - 30:
            text += facts[k % len(facts)].format(t=topic) + " "
            k += 1
        text += rng.choice(ASKS).format(t=topic)
        rows.append({"prompt": text, "tokens": len(tokenizer(text).input_ids)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="smollm2-135m-instruct", help="counts tokens (any phalanx model name)")
    args = p.parse_args()
    from phalanx.engine.tokenizer import load_tokenizer

    rows = make(args.n, args.tokens, args.seed, load_tokenizer(args.tokenizer))
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lens = [r["tokens"] for r in rows]
    print(f"{len(rows)} prompts, {min(lens)}-{max(lens)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
