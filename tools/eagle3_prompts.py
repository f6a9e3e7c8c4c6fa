"""A chat prompt set for an EAGLE-3 head's training answers: requests of MT-Bench's kinds
(writing, roleplay, reasoning, extraction, STEM, humanities, coding) over everyday subjects,
written here as templates times subjects so that no benchmark prompt is among them.

MT-Bench has 80 prompts, 21 of them held out for the bench, which leaves a head too little of
the target's chat prose to learn from; this set gives thousands of distinct requests, drawn in
a seeded order. What the head learns is the target's own answers to them (tools/eagle3_data.py).

No request is a bench prompt, but two subjects are the topics of held-out ones: photosynthesis
(mtbench/143, among `--num-prompts 6`'s chat prompts; 15 of the shipped head's 700 requests) and
inflation (mtbench/151). They stay so that the shipped head's recipe still gives its data; a new
head should drop them.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

TEMPLATES = (
    # writing
    "Write a short blog post about {s}.",
    "Compose a persuasive email to a friend convincing them to try {s}.",
    "Write a four-paragraph essay on the history and future of {s}.",
    "Draft a product announcement for a new service related to {s}.",
    "Write a short story in which {s} plays a central role.",
    "Write a poem about {s}.",
    "Give me a catchy title and a one-paragraph summary for a magazine article about {s}.",
    # roleplay
    "Pretend you are a tour guide. Introduce {s} to a group of curious visitors.",
    "Act as a teacher and explain {s} to a ten-year-old.",
    "You are a skeptical journalist. Ask five probing questions about {s} and answer them.",
    # reasoning and advice
    "What are the pros and cons of {s}? Answer as a list.",
    "Compare {s} with a common alternative and say which you would recommend and why.",
    "What are common misconceptions about {s}, and what is actually true?",
    "Give step-by-step advice for a beginner who wants to learn about {s}.",
    "Plan a one-week schedule for someone who wants to get started with {s}.",
    "What would change in everyday life if {s} disappeared tomorrow? Reason it through.",
    # extraction and structure
    "Summarize the key facts about {s} in a table with two columns.",
    "List ten keywords related to {s}, each with a one-sentence explanation.",
    "Create a short quiz of five multiple-choice questions about {s}, with answers.",
    "Describe {s} as a JSON object with the fields name, summary, facts and related_topics.",
    # STEM and humanities
    "Explain the science behind {s} in simple terms.",
    "How has {s} influenced culture and society? Give concrete examples.",
    "Describe the economics of {s}: who pays, who benefits, and what it costs.",
    "What ethical questions does {s} raise?",
    # coding
    "Write a Python class that models {s}, with a docstring and a short usage example.",
    "Design a small database schema for an app about {s} and explain each table.",
    "Write a Python function that computes a useful statistic about {s}, and explain it.",
    "Outline the REST API of a web service for {s}, with example requests and responses.",
)

SUBJECTS = (
    "a trip to Hawaii",
    "the city of Kyoto",
    "the Roman Empire",
    "the printing press",
    "electric cars",
    "solar power",
    "photosynthesis",
    "black holes",
    "the human immune system",
    "sleep",
    "coffee",
    "bread baking",
    "vegetarian cooking",
    "marathon running",
    "chess",
    "jazz music",
    "classical music",
    "learning a second language",
    "remote work",
    "public libraries",
    "the French Revolution",
    "ancient Egypt",
    "the Silk Road",
    "volcanoes",
    "climate change",
    "recycling",
    "urban gardening",
    "beekeeping",
    "personal budgeting",
    "saving for retirement",
    "small business marketing",
    "job interviews",
    "public speaking",
    "meditation",
    "time management",
    "video games",
    "board games",
    "photography",
    "film noir",
    "Shakespeare's plays",
    "the Olympic Games",
    "soccer",
    "space exploration",
    "the Moon landing",
    "Mars colonization",
    "artificial intelligence",
    "the internet",
    "smartphones",
    "social media",
    "online privacy",
    "cryptography",
    "vaccines",
    "antibiotics",
    "the water cycle",
    "earthquakes",
    "the Amazon rainforest",
    "coral reefs",
    "migratory birds",
    "dogs as pets",
    "cats as pets",
    "horse riding",
    "mountain hiking",
    "camping",
    "sailing",
    "trains",
    "airports",
    "bicycles in cities",
    "architecture of Gothic cathedrals",
    "the Renaissance",
    "impressionist painting",
    "comic books",
    "poetry",
    "journalism",
    "democracy",
    "the stock market",
    "inflation",
    "minimum wage",
    "supply chains",
    "the history of money",
    "chocolate",
    "tea ceremonies",
    "wine making",
    "street food",
    "a wedding",
    "moving to a new city",
    "a job promotion",
    "a family reunion",
    "volunteering",
    "first aid",
    "nutrition labels",
    "3D printing",
    "robots in factories",
    "quantum computing",
    "the periodic table",
    "dinosaurs",
    "the theory of evolution",
    "genetics",
    "the history of medicine",
    "mathematics education",
)


def chat_prompts(count: int, seed: int) -> list[Any]:  # bench.serving.datasets.Prompt
    """`count` distinct one-turn chat prompts, in a seeded order that cycles through the
    templates so that every kind of request is there at any count."""
    from bench.serving.datasets import Prompt

    rng = random.Random(seed)
    by_template = []
    for template in TEMPLATES:
        subjects = list(SUBJECTS)
        rng.shuffle(subjects)
        by_template.append([template.format(s=s) for s in subjects])
    order = [t for column in itertools.zip_longest(*by_template) for t in column if t]
    if count > len(order):
        raise ValueError(f"{count} chat prompts asked for; this set has {len(order)}")
    return [
        Prompt("chat", f"eagle3-chat/{i}", messages=(("user", text),))
        for i, text in enumerate(order[:count])
    ]
