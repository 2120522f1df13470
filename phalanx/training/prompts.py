"""Prompt sets for self-distillation: the built-in generated chat prompts and user JSONL files.

Owns: `builtin_prompts` (a seeded, templated set of single-turn chat requests across many kinds of
task: questions, explanations, lists, poems, rewriting, simple maths, code, advice, definitions,
comparisons, stories, emails, ...), its fixed train / held-out split (`split_of`: a prompt's split is
a hash of its text, so it never depends on how many prompts were asked for), and
`read_prompt_file` (a JSONL of prompts or chat conversations; bad rows are skipped, counted and
reported with their line numbers).
Does not own: answering the prompts (``training.distill``).

The generated prompts are phalanx's own (this file is their whole source; no dataset is downloaded)
and fall under the project's licence. Every prompt is a conversation: a list of
``{"role": ..., "content": ...}`` messages ending with a user turn.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

Conversation = list[dict[str, str]]

# ---------------------------------------------------------------------------------------------
# Vocabulary of the templates

TOPICS = [
    "photosynthesis", "gravity", "volcanoes", "the water cycle", "black holes", "climate change", "the immune system",
    "electricity", "magnetism", "plate tectonics", "the solar system", "DNA", "evolution", "vaccines", "the internet",
    "machine learning", "blockchain", "renewable energy", "nuclear power", "the stock market", "inflation",
    "the Roman Empire", "the French Revolution", "the Industrial Revolution", "ancient Egypt", "the Renaissance",
    "World War II", "the Cold War", "democracy", "the printing press", "the moon landing", "rainforests", "deserts",
    "coral reefs", "honeybees", "dinosaurs", "the human brain", "sleep", "nutrition", "exercise", "meditation",
    "jazz music", "classical music", "impressionist painting", "the Olympic Games", "chess", "football", "coffee",
    "tea", "bread baking", "fermentation", "recycling", "electric cars", "airplanes", "bridges", "skyscrapers",
    "satellites", "the printing of money", "taxes", "supply and demand", "social media", "video games", "smartphones",
    "batteries", "earthquakes", "hurricanes", "rainbows", "tides", "the seasons", "glaciers", "the ozone layer",
    "antibiotics", "the heart", "memory", "language learning", "public speaking", "time management", "friendship",
    "the history of writing", "mathematics", "prime numbers", "probability", "statistics", "geometry", "algebra",
    "computer programming", "databases", "operating systems", "encryption", "cloud computing", "robots", "3D printing",
]

AUDIENCES = ["a five-year-old", "a high school student", "a beginner", "a busy manager", "my grandmother",
             "a university student", "someone who has never heard of it", "a curious teenager"]

THINGS = [
    "fruits that are high in vitamin C", "countries in South America", "famous scientists", "healthy breakfast ideas",
    "ways to save energy at home", "programming languages", "board games for families", "planets in our solar system",
    "benefits of reading", "hobbies you can start at home", "tips for better sleep", "animals that live in the ocean",
    "ways to reduce stress", "musical instruments", "things to pack for a camping trip", "classic novels",
    "ways to stay motivated", "uses of a computer", "common kitchen herbs", "ideas for a rainy day",
    "qualities of a good leader", "birds that cannot fly", "renewable energy sources", "European capitals",
    "ways to learn a new language", "vegetables that grow well in pots", "inventions that changed the world",
    "tips for writing a good essay", "sports played with a ball", "questions to ask in a job interview",
    "ways to be more productive", "dog breeds", "things to do in a big city", "causes of air pollution",
    "reasons to drink water", "famous paintings", "types of clouds", "mammals that live in cold climates",
    "snacks for a long trip", "skills every programmer needs",
]

SUBJECTS = [
    "the sea", "autumn leaves", "a cup of coffee", "the moon", "a rainy morning", "a lost cat", "the city at night",
    "friendship", "a mountain", "winter", "a garden", "the first day of school", "a candle", "the stars", "a train journey",
    "spring", "an old library", "a thunderstorm", "the desert", "a robot", "the wind", "a river", "sunrise", "a snowman",
    "a lighthouse", "homework", "a bicycle", "a butterfly", "the ocean floor", "a birthday", "silence", "a forest",
]

CHARACTERS = ["a young wizard", "a curious robot", "a brave mouse", "an old fisherman", "a lonely dragon",
              "a detective", "a space explorer", "a talking tree", "a little girl", "a clumsy knight", "a baker",
              "a shy penguin", "a time traveller", "a street musician", "a retired teacher"]

EVENTS = ["finds a mysterious map", "loses their way home", "learns to fly", "makes an unexpected friend",
          "discovers a hidden door", "wins a competition", "has to save the village", "forgets something important",
          "meets their hero", "builds a machine", "solves a puzzle", "goes on a journey to the sea"]

SENTENCES = [
    "me and him goes to the store yesterday", "The meeting was cancelled because nobody came to it on time.",
    "I think that we should maybe try to do the project in a different way.", "their going to be late for the show",
    "The cat sat on the mat and looked at the bird outside the window.", "She dont like apples but she likes bananas.",
    "We need to finish the report by Friday or the client will be unhappy.", "the weather is very nice today isnt it",
    "Our company has increased its profits significantly over the last year.", "I has three brother and one sister.",
    "Please send me the documents as soon as possible.", "The movie was long but it was very interesting.",
    "He runned to the bus stop but the bus had already leave.", "Learning to code takes time and patience.",
    "Can you tell me where the nearest train station is?", "The children played in the park until it got dark.",
]

STYLES = ["more formal", "more casual", "shorter", "more polite", "more exciting", "simpler", "more persuasive"]

LANGUAGES = ["French", "Spanish", "German", "Italian"]

CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "returns the largest number in a list",
    "counts the vowels in a sentence", "computes the factorial of a number", "checks if a word is a palindrome",
    "sorts a list of names alphabetically", "converts Celsius to Fahrenheit", "sums the even numbers in a list",
    "removes duplicates from a list", "reads a text file and counts its lines", "returns the Fibonacci numbers up to n",
    "finds the average of a list of numbers", "merges two dictionaries", "capitalizes every word in a sentence",
    "checks if two strings are anagrams", "returns the number of words in a string", "finds the smallest element of an array",
]

PROG_LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "C++", "Ruby"]

CODE_QUESTIONS = [
    "declare a variable", "write a for loop", "read input from the user", "define a function", "handle errors",
    "create a list", "write an if statement", "print text to the screen", "create a class", "import a library",
    "write a comment", "concatenate two strings",
]

CODE_SNIPPETS = [
    "for i in range(5):\n    print(i * i)",
    "def add(a, b):\n    return a + b",
    "x = [1, 2, 3]\nprint(sum(x) / len(x))",
    "names = ['Ann', 'Bob']\nfor n in names:\n    print('Hello', n)",
    "let total = 0;\nfor (let i = 1; i <= 10; i++) { total += i; }\nconsole.log(total);",
    "def is_even(n):\n    return n % 2 == 0",
    "s = 'hello'\nprint(s[::-1])",
    "count = 0\nwhile count < 3:\n    count += 1\nprint(count)",
]

GOALS = [
    "improve my memory", "get better at public speaking", "save money every month", "learn to cook",
    "make new friends in a new city", "stay focused while studying", "start running", "sleep better",
    "prepare for a job interview", "learn to play the guitar", "write a good resume", "stop procrastinating",
    "eat healthier", "keep my house organized", "learn a new language quickly", "become a better listener",
    "reduce my screen time", "take better photos with my phone", "grow vegetables on my balcony",
    "stay calm during exams", "manage a small team", "read more books",
]

SITUATIONS = [
    "buying a used car", "choosing a university", "adopting a dog", "moving to another country",
    "starting a small business", "planning a wedding", "renting an apartment", "changing careers",
    "buying a laptop", "planning a trip to Japan", "choosing a password", "asking for a raise",
]

TERMS = [
    "an algorithm", "a metaphor", "gross domestic product", "a noun", "an atom", "a democracy", "an ecosystem",
    "a variable in programming", "a verb", "photosynthesis", "a hypothesis", "inflation", "a virus", "a molecule",
    "an adjective", "a budget", "a carbon footprint", "an operating system", "a peninsula", "a haiku", "a prime number",
    "a fraction", "a synonym", "a galaxy", "a compiler", "an equation", "a mammal", "a continent", "a recipe", "empathy",
    "a neural network", "a spreadsheet", "a website", "a symphony", "an election", "a volcano", "a vaccine", "a rhyme",
]

PAIRS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("a lake", "a sea"), ("a list", "a tuple in Python"),
    ("speed", "velocity"), ("a simile", "a metaphor"), ("an alligator", "a crocodile"), ("RAM", "storage"),
    ("a democracy", "a monarchy"), ("baking soda", "baking powder"), ("a frog", "a toad"), ("HTML", "CSS"),
    ("a star", "a planet"), ("mass", "weight"), ("a credit card", "a debit card"), ("an emu", "an ostrich"),
    ("affect", "effect"), ("a hurricane", "a tornado"), ("a comet", "an asteroid"), ("a rabbit", "a hare"),
    ("a compiler", "an interpreter"), ("saving", "investing"), ("a novel", "a short story"), ("jam", "jelly"),
]

PLACES = ["a busy market", "a quiet beach at sunset", "a medieval castle", "a space station", "a small mountain village",
          "a rainforest", "a library at midnight", "a train station in the morning", "a bakery", "an underwater city",
          "a snowy forest", "a school playground", "a desert oasis", "a futuristic city"]

RECIPIENTS = ["my manager", "a teacher", "a customer", "my landlord", "a colleague", "a friend", "the city council",
              "a hotel", "my neighbour", "a professor"]

EMAIL_TOPICS = ["asking for a day off", "a delayed delivery", "a broken heater", "thanking them for their help",
                "rescheduling a meeting", "a noise complaint", "a job application", "a booking change",
                "inviting them to a party", "a question about homework", "a late payment", "a new project idea"]

FOODS = ["pancakes", "a simple tomato soup", "scrambled eggs", "a fruit salad", "guacamole", "banana bread",
         "a vegetable stir fry", "chocolate chip cookies", "lemonade", "a cheese sandwich", "rice pudding",
         "hummus", "a smoothie", "pasta with garlic and oil"]

PEOPLE = ["Anna", "Ben", "Carlos", "Dina", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kofi", "Lena", "Maya", "Noah"]
OBJECTS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "cards", "shells", "balloons"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a friendly teacher who explains things simply.",
    "You are a concise assistant. Keep answers short.", "You are an expert programmer.",
    "You are a creative writer.", "You are a patient tutor for children.",
]


def _maths(rng: random.Random) -> str:
    kind = rng.randrange(8)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    p, o = rng.choice(PEOPLE), rng.choice(OBJECTS)
    if kind == 0:
        return f"What is {a} + {b}?"
    if kind == 1:
        return f"What is {a} times {c}?"
    if kind == 2:
        return f"{p} has {a + b} {o} and gives {b} to a friend. How many {o} does {p} have left?"
    if kind == 3:
        return f"Solve for x: {c}x + {a} = {c * b + a}."
    if kind == 4:
        return f"What is {c * 10}% of {a * 10}?"
    if kind == 5:
        return f"A train travels at {a} km per hour for {c} hours. How far does it go?"
    if kind == 6:
        return f"If a pizza is cut into {c} slices and {p} eats {rng.randint(1, c - 1)}, what fraction is left?"
    return f"What is the square root of {c * c}? Explain how you know."


def _request(rng: random.Random) -> str:
    """One generated request: a kind of task at random, then its template and fillers."""
    kind = rng.randrange(NUM_KINDS)
    t, n = rng.choice(TOPICS), rng.choice([3, 4, 5, 5, 6, 7, 10])
    if kind == 0:  # questions
        return rng.choice([f"What is {t}?", f"How does {t} work?", f"Why is {t} important?", f"Tell me about {t}.",
                           f"What are the main facts about {t}?", f"Can you give me an overview of {t}?"])
    if kind == 1:  # explanations
        aud = rng.choice(AUDIENCES)
        return rng.choice([f"Explain {t} to {aud}.", f"Explain {t} in simple terms.", f"Explain {t} in one paragraph.",
                           f"Give a short explanation of {t} for {aud}."])
    if kind == 2:  # lists
        th = rng.choice(THINGS)
        return rng.choice([f"List {n} {th}.", f"Give me {n} {th}.", f"Name {n} {th} and say one thing about each.",
                           f"What are {n} {th}?"])
    if kind == 3:  # poems
        subj = rng.choice(SUBJECTS)
        return rng.choice([f"Write a haiku about {subj}.", f"Write a short poem about {subj}.",
                           f"Write a four-line rhyming poem about {subj}.", f"Write a limerick about {subj}.",
                           f"Write a haiku about {t}."])
    if kind == 4:  # rewriting
        sent = rng.choice(SENTENCES)
        return rng.choice([f"Rewrite this sentence to be {rng.choice(STYLES)}: \"{sent}\"",
                           f"Fix the grammar in this sentence: \"{sent}\"",
                           f"Translate into {rng.choice(LANGUAGES)}: \"{sent}\"", f"Paraphrase: \"{sent}\""])
    if kind == 5:
        return _maths(rng)
    if kind == 6:  # code
        lang, task, snippet = rng.choice(PROG_LANGS), rng.choice(CODE_TASKS), rng.choice(CODE_SNIPPETS)
        return rng.choice([f"Write a {lang} function that {task}.", f"How do I {rng.choice(CODE_QUESTIONS)} in {lang}?",
                           f"Write a short {lang} program that {task}.", f"What does this code do?\n\n{snippet}",
                           f"Explain this code line by line:\n\n{snippet}"])
    if kind == 7:  # advice
        goal = rng.choice(GOALS)
        return rng.choice([f"How can I {goal}?", f"Give me {n} tips to {goal}.",
                           f"What should I consider when {rng.choice(SITUATIONS)}?",
                           f"I want to {goal}. Where should I start?"])
    if kind == 8:  # definitions
        term = rng.choice(TERMS)
        return rng.choice([f"What is {term}?", f"Define {term} in simple words.",
                           f"What is the meaning of {term}? Give an example."])
    if kind == 9:  # comparisons
        x, y = rng.choice(PAIRS)
        return rng.choice([f"What is the difference between {x} and {y}?", f"Compare {x} and {y}.",
                           f"How are {x} and {y} alike, and how are they different?"])
    if kind == 10:  # stories and descriptions
        who, place = rng.choice(CHARACTERS), rng.choice(PLACES)
        return rng.choice([f"Write a short story about {who} who {rng.choice(EVENTS)}.", f"Describe {place}.",
                           f"Write the opening paragraph of a story set in {place}.",
                           f"Tell me a short story for children about {who}."])
    if kind == 11:  # messages
        to, about = rng.choice(RECIPIENTS), rng.choice(EMAIL_TOPICS)
        return rng.choice([f"Write an email to {to} about {about}.", f"Write a short, polite message to {to} about {about}."])
    if kind == 12:  # recipes
        food = rng.choice(FOODS)
        return rng.choice([f"How do I make {food}?", f"Give me a simple recipe for {food}.",
                           f"What ingredients do I need for {food}?"])
    return rng.choice([f"Summarize the history of {t} in a few sentences.", f"Give me three fun facts about {t}.",
                       f"What are the pros and cons of {t}?", f"What would happen if {t} did not exist?"])


NUM_KINDS = 14


@dataclass(frozen=True)
class PromptSet:
    """Conversations for training and the held-out ones (never trained on), from the same source."""

    train: list[Conversation]
    held_out: list[Conversation]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason) of bad file rows


def split_of(conv: Conversation, held_out_fraction: float) -> str:
    """'held_out' or 'train' for a conversation, from a hash of its text (stable across runs,
    independent of how many prompts there are)."""
    h = hashlib.sha256(json.dumps(conv, sort_keys=True).encode()).digest()
    return "held_out" if int.from_bytes(h[:8], "big") / 2**64 < held_out_fraction else "train"


def builtin_prompts(num: int, seed: int = 0, system_fraction: float = 0.15) -> list[Conversation]:
    """`num` distinct generated conversations (a user request, some with a system prompt first)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Conversation] = []
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 50 * num + 1000:
            raise ValueError(f"the built-in generator ran out of distinct prompts after {len(out)} (asked for {num})")
        text = _request(rng)
        if text in seen:
            continue
        seen.add(text)
        conv: Conversation = [{"role": "user", "content": text}]
        if rng.random() < system_fraction:
            conv.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        out.append(conv)
    return out


def builtin_prompt_set(num: int, seed: int = 0, held_out_fraction: float = 0.05) -> PromptSet:
    convs = builtin_prompts(num, seed)
    return PromptSet(
        train=[c for c in convs if split_of(c, held_out_fraction) == "train"],
        held_out=[c for c in convs if split_of(c, held_out_fraction) == "held_out"],
    )


# ---------------------------------------------------------------------------------------------
# User files

ROLES = ("system", "user", "assistant")


def _row_conversation(row: object) -> Conversation:
    """A JSONL row as a conversation, or ValueError saying what is wrong with it. Accepted rows:
    {"prompt": str} (also "question" / "text" / "instruction"), {"messages": [{"role", "content"}, ...]},
    or a bare list of messages. A trailing assistant turn is dropped (the target answers itself)."""
    if isinstance(row, dict) and "messages" not in row:
        for key in ("prompt", "question", "text", "instruction"):
            if key in row:
                text = row[key]
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"{key!r} must be a non-empty string, got {text!r:.60}")
                return [{"role": "user", "content": text}]
        raise ValueError(f"an object row needs 'prompt', 'question', 'text', 'instruction' or 'messages'; got keys {sorted(row)}")
    msgs = row.get("messages") if isinstance(row, dict) else row
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("'messages' must be a non-empty list")
    conv: Conversation = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': one of {list(ROLES)}, 'content': str}}, got {m!r:.80}")
        conv.append({"role": m["role"], "content": m["content"]})
    if conv[-1]["role"] == "assistant":
        conv = conv[:-1]
    if not conv or conv[-1]["role"] != "user":
        raise ValueError("the conversation must end with a user turn (or a user turn and the assistant's answer)")
    return conv


def read_prompt_file(path: str | Path, held_out_fraction: float = 0.05, strict: bool = False,
                     limit: int | None = None) -> PromptSet:
    """A user's JSONL of prompts or conversations (its first `limit` usable rows, default all).
    Bad rows (not JSON, wrong shape, empty) are skipped and listed in `PromptSet.skipped` with
    their line numbers; `strict` raises ValueError at the first one instead. Duplicates count once.
    Raises ValueError when no usable row remains."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    convs: list[Conversation] = []
    skipped: list[tuple[int, str]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                conv = _row_conversation(json.loads(line))
            except (ValueError, json.JSONDecodeError) as e:
                reason = f"not valid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
                if strict:
                    raise ValueError(f"{path}:{lineno}: {reason}") from None
                skipped.append((lineno, reason))
                continue
            key = json.dumps(conv, sort_keys=True)
            if key not in seen:
                seen.add(key)
                convs.append(conv)
                if limit is not None and len(convs) >= limit:
                    break
    if not convs:
        raise ValueError(f"prompt file {str(path)!r} has no usable row ({len(skipped)} bad rows"
                         + (f", first at line {skipped[0][0]}: {skipped[0][1]}" if skipped else "") + ")")
    return PromptSet(
        train=[c for c in convs if split_of(c, held_out_fraction) == "train"],
        held_out=[c for c in convs if split_of(c, held_out_fraction) == "held_out"],
        skipped=skipped,
    )


def write_jsonl(path: str | Path, convs: list[Conversation]) -> None:
    """Conversations as `{"messages": [...]}` rows (readable by `read_prompt_file`)."""
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
