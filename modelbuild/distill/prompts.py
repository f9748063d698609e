"""Chat prompts for training heads on a converted target, built from offline text: the
CPython standard library's docstrings (questions about its modules, functions and
classes) and general questions (forms x topics). Whole sources are held out: every 8th
stdlib file (``modelbuild.corpus``'s rule) and every 8th topic, so evaluation never
sees a prompt about something the heads trained on. The hand-written held-out set in
``tests/data/heldout_chat_prompts.json`` is a third source none of this overlaps.
"""
from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import asdict, dataclass

from ..corpus import HOLDOUT_EVERY, load_corpus

SYSTEMS = [None, None, None, "You are a concise assistant.", "You are a helpful teacher.",
           "Answer in a few short sentences."]
API_FORMS = [
    "What does `{qualname}` do in Python?",
    "Show a short example of using `{qualname}` in Python.",
    "When would I use `{qualname}`? Explain briefly.",
    "Explain this Python documentation in plain words: \"{summary}\"",
    "Write a small Python function that does this: {summary_lower}",
]
GENERAL_FORMS = [
    "Explain {topic} in simple terms.", "Give me three facts about {topic}.", "What is {topic}?",
    "Why is {topic} important?", "Write a short paragraph about {topic}.", "What are common misconceptions about {topic}?",
    "How would you explain {topic} to a child?", "List the pros and cons of {topic}.",
    "Write a short poem about {topic}.", "What is the history of {topic}, briefly?",
    "Give a step-by-step guide related to {topic}.", "Summarize the key ideas of {topic}.",
]
TOPICS = """photosynthesis|black holes|the water cycle|volcanoes|earthquakes|the immune system|vaccines|climate change|
renewable energy|solar panels|wind turbines|electric cars|the internet|computer networks|encryption|passwords|
machine learning|neural networks|databases|spreadsheets|recycling|composting|gardening|growing tomatoes|baking bread|
making coffee|brewing tea|healthy breakfast|meal planning|running|swimming|yoga|meditation|sleep|stress|
time management|budgeting|saving money|compound interest|inflation|taxes|job interviews|writing a resume|public speaking|
learning a language|reading habits|libraries|museums|the Roman Empire|ancient Egypt|the Renaissance|the printing press|
the Industrial Revolution|the moon landing|the solar system|Mars|Jupiter|comets|stars|galaxies|gravity|magnets|
electricity|batteries|light|sound|rainbows|clouds|thunderstorms|snow|deserts|rainforests|oceans|coral reefs|whales|
dolphins|bees|ants|birds migration|dinosaurs|fossils|evolution|DNA|cells|the heart|the brain|bones|muscles|nutrition|
vitamins|drinking water|hand washing|first aid|fire safety|road safety|bicycles|trains|airplanes|ships|bridges|
skyscrapers|maps|compasses|GPS|clocks|calendars|music|the piano|the guitar|painting|photography|movies|chess|
soccer|basketball|the Olympics|friendship|teamwork|kindness|honesty|curiosity|creativity|volunteering|pets|dogs|cats|
houseplants|cleaning a kitchen|doing laundry|moving house|camping|hiking safety|traveling on a budget|packing a suitcase|
jet lag|mountains|rivers|lakes|islands|the Arctic|penguins|polar bears|elephants|lions|forests|trees|flowers|
mushrooms|honey|chocolate|cheese|rice|pasta|spices|soup|salad|pizza|the metric system|fractions|prime numbers|
geometry|probability|statistics|graphs|algorithms|sorting|recursion|version control|open source software|
operating systems|keyboards|smartphones|email etiquette|online privacy|social media|news literacy|critical thinking|
debates|democracy|elections|courts|human rights|the United Nations|world languages|writing systems|poetry|novels|
fairy tales|myths|folk music|theater|architecture|city planning|public transport|electric grids|water treatment|
agriculture|irrigation|fishing|beekeeping|wool|cotton|paper making|glass|steel|plastic|3D printing|robots|drones|
satellites|telescopes|microscopes|thermometers|weather forecasts|tides|seasons|leap years|time zones""".replace("\n", "")


@dataclass(frozen=True)
class ChatPrompt:
    source: str           # "stdlib:<file>" or "general:<topic>"
    messages: list[dict]

    def key(self) -> str:
        return hashlib.sha256(repr((self.source, self.messages)).encode()).hexdigest()[:16]


def _summary(docstring: str) -> str | None:
    first = docstring.strip().split("\n\n")[0].replace("\n", " ").strip()
    sentence = first.split(". ")[0].rstrip(".")
    return sentence if 12 <= len(sentence) <= 160 and "\\" not in sentence else None


def _documented(module: str, text: str) -> list[tuple[str, str]]:
    """(qualified name, docstring summary) of a file's public functions and classes."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            summary = _summary(ast.get_docstring(node) or "")
            if summary:
                found.append((f"{module}.{node.name}", summary))
    return found


def _with_system(rng: random.Random, question: str) -> list[dict]:
    system = rng.choice(SYSTEMS)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def build_prompts(seed: int = 1234) -> tuple[list[ChatPrompt], list[ChatPrompt]]:
    """(train, heldout) chat prompts, deterministic for a seed and a Python install."""
    rng = random.Random(seed)
    corpus = load_corpus()
    splits: dict[str, list[ChatPrompt]] = {"train": [], "heldout": []}
    for split, files in (("train", corpus.train), ("heldout", corpus.heldout)):
        for item in files:
            module = item.relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            if module.split(".")[-1].startswith("_"):
                continue
            for qualname, summary in _documented(module, item.text):
                form = rng.choice(API_FORMS)
                question = form.format(qualname=qualname, summary=summary,
                                       summary_lower=summary[0].lower() + summary[1:])
                splits[split].append(ChatPrompt(f"stdlib:{item.relpath}", _with_system(rng, question)))
    for index, topic in enumerate(t.strip() for t in TOPICS.split("|")):
        split = "heldout" if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else "train"
        for form in rng.sample(GENERAL_FORMS, 6):
            splits[split].append(ChatPrompt(f"general:{topic}", _with_system(rng, form.format(topic=topic))))
    for prompts in splits.values():
        rng.shuffle(prompts)
    return splits["train"], splits["heldout"]


def as_records(prompts: list[ChatPrompt]) -> list[dict]:
    return [{"key": p.key(), **asdict(p)} for p in prompts]
