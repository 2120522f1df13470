"""Deterministic generator of grade-school math word problems (GSM8K-style).

Every problem is produced by a template from a seeded ``random.Random``; the
answer is a short worked solution whose last line is ``#### <number>``.
Numbers are kept small (operands mostly 1-2 digits, all results < 1000) so a
tiny model can learn the arithmetic.

    python -m phalanx.demo.data --out DIR [--seed 0] [--train 60000]

writes ``DIR/{train,validation,test}.jsonl`` with ``question`` / ``answer``
fields.  The splits share no question text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

NAMES = [
    ("Tom", "he", "his"), ("Anna", "she", "her"), ("Ben", "he", "his"), ("Lily", "she", "her"),
    ("Sam", "he", "his"), ("Mia", "she", "her"), ("Jack", "he", "his"), ("Emma", "she", "her"),
    ("Leo", "he", "his"), ("Zoe", "she", "her"), ("Max", "he", "his"), ("Ella", "she", "her"),
    ("Noah", "he", "his"), ("Ava", "she", "her"), ("Liam", "he", "his"), ("Chloe", "she", "her"),
    ("Omar", "he", "his"), ("Sara", "she", "her"), ("Ravi", "he", "his"), ("Nina", "she", "her"),
    ("Carlos", "he", "his"), ("Maria", "she", "her"), ("Kenji", "he", "his"), ("Yuki", "she", "her"),
]
OBJECTS = [
    "apples", "oranges", "pencils", "marbles", "stickers", "cookies", "books", "cards",
    "shells", "eggs", "candies", "toy cars", "balloons", "stamps", "beads", "flowers",
    "crayons", "cupcakes", "rocks", "buttons",
]
CONTAINERS = ["boxes", "bags", "packs", "baskets", "jars", "crates", "trays", "bins"]
ITEMS = [  # (singular, plural)
    ("notebook", "notebooks"), ("pen", "pens"), ("toy", "toys"), ("ticket", "tickets"),
    ("sandwich", "sandwiches"), ("shirt", "shirts"), ("ball", "balls"), ("game", "games"),
    ("plant", "plants"), ("cake", "cakes"), ("hat", "hats"), ("book", "books"),
]
VEHICLES = ["car", "bus", "train", "truck", "bike", "boat"]
TASKS = ["puzzle", "lap", "chore", "song", "lesson", "drawing", "game", "workout"]
PLACES = ["garden", "farm", "park", "field", "orchard"]
PLANTS = ["trees", "plants", "flowers", "bushes", "rows of corn"]


class _Ctx:
    """Random draws for one problem."""

    def __init__(self, rng: random.Random):
        self.r = rng

    def person(self, exclude: tuple | None = None):
        while True:
            p = self.r.choice(NAMES)
            if p != exclude:
                return p

    def n(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def pick(self, seq):
        return self.r.choice(seq)


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


# Each template returns (question, solution_without_final_line, answer) or None
# when the draw violates a constraint (then another draw is made).
Template = Callable[[_Ctx], "tuple[str, str, int] | None"]


def t_boxes_give(c: _Ctx):
    (nm, he, _), obj, box = c.person(), c.pick(OBJECTS), c.pick(CONTAINERS)
    a, b = c.n(2, 9), c.n(2, 12)
    x = a * b
    d = c.n(1, x - 1)
    r = x - d
    q = f"{nm} has {a} {box} of {obj}. Each of the {box} holds {b} {obj}. {_cap(he)} gives away {d} {obj}. How many {obj} does {nm} have left?"
    s = f"{nm} has {a} {box} of {b} {obj}, so {a} * {b} = {x} {obj}. {_cap(he)} gives away {d}, so {x} - {d} = {r}."
    return q, s, r


def t_buy_total(c: _Ctx):
    (nm, he, _), (it, its), (it2, _p2) = c.person(), c.pick(ITEMS), c.pick(ITEMS)
    if it == it2:
        return None
    a, b, d = c.n(2, 9), c.n(2, 25), c.n(1, 50)
    x = a * b
    r = x + d
    q = f"{nm} buys {a} {its} for ${b} each and one {it2} for ${d}. How much money does {he} spend in total?"
    s = f"The {its} cost {a} * {b} = ${x}. Adding the {it2}, {x} + {d} = ${r}."
    return q, s, r


def t_change(c: _Ctx):
    (nm, he, _), (_it, its) = c.person(), c.pick(ITEMS)
    a, b = c.n(2, 9), c.n(2, 15)
    x = a * b
    m = x + c.n(1, 99)
    r = m - x
    q = f"{nm} has ${m}. {_cap(he)} buys {a} {its} that cost ${b} each. How much money does {he} have left?"
    s = f"The {its} cost {a} * {b} = ${x}. {nm} has {m} - {x} = ${r} left."
    return q, s, r


def t_share(c: _Ctx):
    (nm, _he, _), obj = c.person(), c.pick(OBJECTS)
    b, qv = c.n(2, 9), c.n(2, 12)
    a = b * qv
    d = c.n(1, 20)
    r = qv + d
    q = f"{nm} has {a} {obj} and shares them equally among {b} friends. Then each friend finds {d} more {obj}. How many {obj} does each friend have now?"
    s = f"Each friend gets {a} / {b} = {qv} {obj}. After finding more, each has {qv} + {d} = {r}."
    return q, s, r


def t_pages(c: _Ctx):
    (nm, he, _) = c.person()
    a, b, d = c.n(3, 25), c.n(2, 9), c.n(1, 60)
    x = a * b
    r = x + d
    q = f"{nm} reads {a} pages every day for {b} days. Then {he} reads {d} more pages. How many pages does {nm} read in all?"
    s = f"In {b} days {nm} reads {a} * {b} = {x} pages. Then {x} + {d} = {r} pages."
    return q, s, r


def t_minutes(c: _Ctx):
    (nm, he, _), task = c.person(), c.pick(TASKS)
    a, b, d = c.n(2, 15), c.n(2, 9), c.n(1, 45)
    x = a * b
    r = x + d
    q = f"Each {task} takes {nm} {a} minutes. {_cap(he)} does {b} of them and then rests for {d} minutes. How many minutes does this take in total?"
    s = f"The {task}s take {a} * {b} = {x} minutes. With the rest, {x} + {d} = {r} minutes."
    return q, s, r


def t_three_days(c: _Ctx):
    (nm, he, _), obj = c.person(), c.pick(OBJECTS)
    a, b, d = c.n(1, 99), c.n(1, 99), c.n(1, 99)
    x = a + b
    r = x + d
    q = f"{nm} collected {a} {obj} on Monday, {b} on Tuesday and {d} on Wednesday. How many {obj} did {he} collect in total?"
    s = f"On Monday and Tuesday {nm} collected {a} + {b} = {x}. Adding Wednesday, {x} + {d} = {r} {obj}."
    return q, s, r


def t_times_as_many(c: _Ctx):
    (n1, _, _) = c.person()
    (n2, _, _) = c.person(exclude=None)
    if n1 == n2:
        return None
    obj = c.pick(OBJECTS)
    a, b = c.n(2, 30), c.n(2, 6)
    x = a * b
    r = a + x
    q = f"{n1} has {a} {obj}. {n2} has {b} times as many {obj} as {n1}. How many {obj} do they have together?"
    s = f"{n2} has {a} * {b} = {x} {obj}. Together they have {a} + {x} = {r}."
    return q, s, r


def t_fewer(c: _Ctx):
    (n1, _, _), (n2, _, _) = c.person(), c.person()
    if n1 == n2:
        return None
    obj = c.pick(OBJECTS)
    a = c.n(10, 99)
    b = c.n(1, a - 1)
    x = a - b
    r = a + x
    q = f"{n1} has {a} {obj}. {n2} has {b} fewer {obj} than {n1}. How many {obj} do they have together?"
    s = f"{n2} has {a} - {b} = {x} {obj}. Together they have {a} + {x} = {r}."
    return q, s, r


def t_more(c: _Ctx):
    (n1, _, _), (n2, _, _) = c.person(), c.person()
    if n1 == n2:
        return None
    obj = c.pick(OBJECTS)
    a, b = c.n(5, 99), c.n(1, 50)
    x = a + b
    r = a + x
    q = f"{n1} has {a} {obj}. {n2} has {b} more {obj} than {n1}. How many {obj} do they have altogether?"
    s = f"{n2} has {a} + {b} = {x} {obj}. Altogether they have {a} + {x} = {r}."
    return q, s, r


def t_travel(c: _Ctx):
    veh = c.pick(VEHICLES)
    a, b, d = 5 * c.n(2, 12), c.n(2, 9), c.n(1, 99)
    x = a * b
    r = x + d
    q = f"A {veh} travels at {a} miles per hour for {b} hours and then goes {d} more miles. How many miles does the {veh} travel in total?"
    s = f"In {b} hours it travels {a} * {b} = {x} miles. Then {x} + {d} = {r} miles."
    return q, s, r


def t_rows(c: _Ctx):
    place, pl = c.pick(PLACES), c.pick(PLANTS)
    a, b = c.n(2, 12), c.n(2, 12)
    x = a * b
    d = c.n(1, x - 1)
    r = x - d
    q = f"A {place} has {a} rows with {b} {pl} in each row. {d} of the {pl} are removed. How many {pl} are left in the {place}?"
    s = f"The {place} has {a} * {b} = {x} {pl}. After removing {d}, {x} - {d} = {r} are left."
    return q, s, r


def t_groups(c: _Ctx):
    b, qv = c.n(2, 9), c.n(2, 15)
    a = b * qv
    d = c.n(1, 9)
    r = qv + d
    q = f"There are {a} students split equally into {b} groups. Then {d} new students join each group. How many students are in each group now?"
    s = f"Each group has {a} / {b} = {qv} students. Now each group has {qv} + {d} = {r}."
    return q, s, r


def t_wages(c: _Ctx):
    (nm, he, _) = c.person()
    a, b, d = c.n(5, 20), c.n(2, 9), c.n(1, 50)
    x = a * b
    r = x + d
    q = f"{nm} earns ${a} per hour and works {b} hours this week. {_cap(he)} also gets a ${d} bonus. How much does {he} earn this week?"
    s = f"For the hours {nm} earns {a} * {b} = ${x}. With the bonus, {x} + {d} = ${r}."
    return q, s, r


def t_bags(c: _Ctx):
    (nm, he, _), obj = c.person(), c.pick(OBJECTS)
    bag, qv = c.n(2, 9), c.n(2, 12)
    x = bag * qv
    d = c.n(1, 30)
    a = x + d
    q = f"{nm} has {a} {obj}. {_cap(he)} loses {d} of them and puts the rest into bags of {bag}. How many bags does {he} fill?"
    s = f"{nm} has {a} - {d} = {x} {obj} left. That fills {x} / {bag} = {qv} bags."
    return q, s, qv


def t_half(c: _Ctx):
    (n1, he, _), (n2, _, _), obj = c.person(), c.person(), c.pick(OBJECTS)
    if n1 == n2:
        return None
    x = c.n(2, 60)
    a = 2 * x
    b = c.n(1, 50)
    r = x + b
    q = f"{n1} had {a} {obj}. {_cap(he)} gave half of them to {n2} and then bought {b} more. How many {obj} does {n1} have now?"
    s = f"{n1} gave away {a} / 2 = {x}, so {x} are left. Then {x} + {b} = {r} {obj}."
    return q, s, r


def t_hours_minutes(c: _Ctx):
    (nm, he, _) = c.person()
    a, b = c.n(2, 9), c.n(1, 59)
    x = a * 60
    r = x + b
    act = c.pick(["practices piano", "plays soccer", "studies", "paints", "swims", "bakes"])
    q = f"{nm} {act} for {a} hours and {b} minutes. How many minutes is that?"
    s = f"{a} hours is {a} * 60 = {x} minutes. Then {x} + {b} = {r} minutes."
    return q, s, r


def t_rope(c: _Ctx):
    b, qv = c.n(2, 9), c.n(2, 12)
    a = b * qv
    d = c.n(1, qv - 1)
    r = qv - d
    unit = c.pick(["meters", "feet", "yards"])
    q = f"A rope is {a} {unit} long. It is cut into pieces that are {b} {unit} long each. {d} of the pieces are used. How many pieces are left?"
    s = f"There are {a} / {b} = {qv} pieces. After using {d}, {qv} - {d} = {r} pieces are left."
    return q, s, r


def t_packs_three(c: _Ctx):
    (nm, he, _), obj, box = c.person(), c.pick(OBJECTS), c.pick(CONTAINERS)
    a, b, d = c.n(2, 9), c.n(2, 12), c.n(1, 30)
    x = a * b
    y = x + d
    e = c.n(1, y - 1)
    r = y - e
    q = f"{nm} buys {a} {box} of {obj} with {b} {obj} in each. {_cap(he)} also finds {d} {obj}. Then {he} gives {e} {obj} to a friend. How many {obj} does {nm} have now?"
    s = f"The {box} hold {a} * {b} = {x} {obj}. With the ones found, {x} + {d} = {y}. After giving some away, {y} - {e} = {r}."
    return q, s, r


def t_savings(c: _Ctx):
    (nm, he, _), (it, _its) = c.person(), c.pick(ITEMS)
    a, w = c.n(2, 20), c.n(2, 9)
    x = a * w
    cost = c.n(x + 1, x + 99)
    r = cost - x
    q = f"{nm} wants a {it} that costs ${cost}. {_cap(he)} saves ${a} every week for {w} weeks. How much more money does {he} need?"
    s = f"{nm} saves {a} * {w} = ${x}. {_cap(he)} still needs {cost} - {x} = ${r}."
    return q, s, r


def t_temperature(c: _Ctx):
    a = c.n(20, 90)
    b = c.n(1, a - 10)
    d = c.n(1, 20)
    x = a - b
    r = x + d
    q = f"In the morning it was {a} degrees. By night the temperature dropped by {b} degrees. The next day it rose by {d} degrees. What was the temperature then?"
    s = f"At night it was {a} - {b} = {x} degrees. Then {x} + {d} = {r} degrees."
    return q, s, r


def t_legs(c: _Ctx):
    a, b = c.n(1, 20), c.n(1, 20)
    x, y = a * 2, b * 4
    r = x + y
    place = c.pick(["farm", "zoo", "yard"])
    two, four = c.pick(["chickens", "ducks", "geese"]), c.pick(["cows", "dogs", "goats", "pigs"])
    q = f"A {place} has {a} {two} and {b} {four}. How many legs do the animals have in total?"
    s = f"The {two} have {a} * 2 = {x} legs. The {four} have {b} * 4 = {y} legs. In total {x} + {y} = {r} legs."
    return q, s, r


def t_tickets(c: _Ctx):
    (nm, he, _) = c.person()
    ad, ch = c.n(5, 20), c.n(2, 12)
    na, nc = c.n(1, 5), c.n(1, 6)
    x, y = ad * na, ch * nc
    r = x + y
    q = f"Adult tickets cost ${ad} and child tickets cost ${ch}. {nm} buys {na} adult tickets and {nc} child tickets. How much does {he} pay?"
    s = f"Adult tickets cost {na} * {ad} = ${x}. Child tickets cost {nc} * {ch} = ${y}. {_cap(he)} pays {x} + {y} = ${r}."
    return q, s, r


TEMPLATES: list[Template] = [
    t_boxes_give, t_buy_total, t_change, t_share, t_pages, t_minutes, t_three_days,
    t_times_as_many, t_fewer, t_more, t_travel, t_rows, t_groups, t_wages, t_bags, t_half,
    t_hours_minutes, t_rope, t_packs_three, t_savings, t_temperature, t_legs, t_tickets,
]

ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_answer(text: str) -> str | None:
    """The number after the first ``####`` (commas removed), or None."""
    m = ANSWER_RE.search(text)
    return m.group(1).replace(",", "") if m else None


def make_problem(rng: random.Random) -> dict:
    """One problem dict: question, answer (worked solution + '#### n'), value, template."""
    ctx = _Ctx(rng)
    while True:
        t = rng.choice(TEMPLATES)
        out = t(ctx)
        if out is None:
            continue
        q, s, r = out
        if not (0 <= r < 1000):
            continue
        return {"question": q, "answer": f"{s} #### {r}", "value": r, "template": t.__name__}


def generate(n: int, seed: int = 0) -> list[dict]:
    """``n`` problems with distinct question texts, deterministic in ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < n:
        p = make_problem(rng)
        if p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
    return out


def make_splits(n_train: int = 60000, n_val: int = 400, n_test: int = 400, seed: int = 0) -> dict[str, list[dict]]:
    """Disjoint train / validation / test splits (no shared question text)."""
    probs = generate(n_train + n_val + n_test, seed)
    return {
        "test": probs[:n_test],
        "validation": probs[n_test:n_test + n_val],
        "train": probs[n_test + n_val:],
    }


def write_jsonl(path: Path, rows: list[dict], fields=("question", "answer")) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in fields}) + "\n")


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=60000)
    ap.add_argument("--val", type=int, default=400)
    ap.add_argument("--test", type=int, default=400)
    a = ap.parse_args(argv)
    t0 = time.time()
    splits = make_splits(a.train, a.val, a.test, a.seed)
    out = Path(a.out)
    for name, rows in splits.items():
        write_jsonl(out / f"{name}.jsonl", rows)
        print(f"{name}: {len(rows)} problems -> {out / (name + '.jsonl')}")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
