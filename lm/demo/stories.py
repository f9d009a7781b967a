"""A seeded, procedural generator of simple children's stories: the synthetic default corpus of ``lm demo``.

Every story is synthetic: a plot template (a lost toy, a new friend, a fear faced, a rainy day...)
filled with a cast, objects and places drawn from small word lists by a ``random.Random``. The
register follows TinyStories: a named child, a problem, dialogue in quotes, a resolution and
often a small moral, in words a young child knows. The lists are small on purpose, so that a tiny
model can learn the text in minutes, and the templates many, so that it still has something to learn.

>>> import random
>>> generate_story(random.Random(0)) == generate_story(random.Random(0))
True

Command line: ``python -m lm.demo.stories --bytes 2000000 --out stories.txt [--seed S] [--overwrite]``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from lm.io import atomic_write

SEPARATOR = "\n<|endoftext|>\n"

# ----------------------------------------------------------------------------- grammar helpers


def article(word: str) -> str:
    """'a' or 'an' for the word that follows, by how it sounds.

    >>> article("apple"), article("ball"), article("umbrella"), article("unicorn")
    ('an', 'a', 'an', 'a')
    """
    w = word.lower()
    if w.startswith(("uni", "use", "one", "eu")):
        return "a"
    if w.startswith(("hour", "honest")):
        return "an"
    return "an" if w[:1] in "aeiou" else "a"


def a(phrase: str) -> str:
    """The phrase with its indefinite article: ``a("old hat") == "an old hat"``."""
    return f"{article(phrase)} {phrase}"


def cap(text: str) -> str:
    """First letter upper-cased, the rest untouched."""
    return text[:1].upper() + text[1:]


def say(rng: random.Random, speaker: str, line: str, verb: str | None = None) -> str:
    """One sentence of dialogue with its attribution, punctuated the way books do it.

    ``line`` is the spoken text with its own end mark. A statement's full stop becomes a comma when
    the attribution follows it: ``"I am hungry," said Tom.``
    """
    if verb is None:
        end = line[-1]
        verb = "asked" if end == "?" else rng.choice(["said", "said", "shouted"]) if end == "!" else "said"
    where = rng.random()
    if where < 0.3:
        return f'{cap(speaker)} {verb}, "{line}"'
    spoken = line[:-1] + "," if line.endswith(".") else line
    # "said Tom" reads well, "said she" and "said softly Tom" do not
    if where < 0.65 and speaker not in ("he", "she", "they") and " " not in verb:
        return f'"{spoken}" {verb} {speaker}.'
    return f'"{spoken}" {speaker} {verb}.'


# ----------------------------------------------------------------------------- the cast


@dataclass(frozen=True)
class Character:
    """A named character; ``kind`` is what they are ("girl", "bunny") and fixes the pronouns."""

    name: str
    kind: str
    female: bool

    @property
    def he(self) -> str:
        return "she" if self.female else "he"

    @property
    def him(self) -> str:
        return "her" if self.female else "him"

    @property
    def his(self) -> str:
        return "her" if self.female else "his"

    @property
    def himself(self) -> str:
        return "herself" if self.female else "himself"

    @property
    def He(self) -> str:  # noqa: N802 - reads like the sentence it starts
        return cap(self.he)

    @property
    def His(self) -> str:  # noqa: N802
        return cap(self.his)


@dataclass(frozen=True)
class Parent:
    """A grown-up in the story: ``title`` is how the child calls them ("Mom"), ``role`` the noun ("mom")."""

    title: str
    female: bool

    @property
    def role(self) -> str:
        return self.title.lower()

    @property
    def he(self) -> str:
        return "she" if self.female else "he"

    @property
    def his(self) -> str:
        return "her" if self.female else "his"


GIRLS = ["Lily", "Mia", "Emma", "Sara", "Anna", "Lucy", "Zoe", "Amy", "Ella", "Rose", "Ava", "Ruby", "Daisy",
         "Sophie", "Grace", "Nora", "Kate", "Molly", "Ivy", "Hannah", "Julia", "Maya", "Chloe", "Sue"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Jack", "Leo", "Tim", "Joe", "Finn", "Jake", "Noah", "Oscar", "Luke",
        "Danny", "Alex", "Owen", "Henry", "Billy", "Ryan", "Adam", "Eli", "Mark", "Bob", "Peter"]
ANIMAL_HEROES = [("bunny", ["Hop", "Fluffy", "Snowy", "Bun"]), ("bear", ["Teddy", "Cubby", "Honey", "Bumble"]),
                 ("puppy", ["Spot", "Buddy", "Patch", "Lucky"]), ("kitten", ["Tiger", "Kitty", "Milo", "Mittens"]),
                 ("duck", ["Quack", "Dot", "Puddle", "Waddle"]), ("mouse", ["Pip", "Squeak", "Tiny", "Nibbles"]),
                 ("fox", ["Red", "Rusty", "Foxy", "Sly"]), ("frog", ["Hopper", "Ribbit", "Green", "Jumpy"])]
PARENTS = [Parent("Mom", True), Parent("Dad", False), Parent("Grandma", True), Parent("Grandpa", False)]


def make_cast(rng: random.Random) -> tuple[Character, Character, Parent]:
    """A hero, a friend of the same sort (children with children, animals with animals) and a grown-up."""
    if rng.random() < 0.8:
        female = rng.random() < 0.5
        hero = Character(rng.choice(GIRLS if female else BOYS), "girl" if female else "boy", female)
        f_female = rng.random() < 0.5
        names = [n for n in (GIRLS if f_female else BOYS) if n != hero.name]
        friend = Character(rng.choice(names), "girl" if f_female else "boy", f_female)
    else:
        (kind, names), (f_kind, f_names) = rng.sample(ANIMAL_HEROES, 2)
        hero = Character(rng.choice(names), kind, rng.random() < 0.5)
        friend = Character(rng.choice(f_names), f_kind, rng.random() < 0.5)
    parent = rng.choice(PARENTS[:2] if hero.kind not in ("girl", "boy") else PARENTS)
    return hero, friend, parent


# ----------------------------------------------------------------------------- things and places

# noun -> adjectives that suit it
OBJECTS = {
    "ball": ["red", "blue", "big", "bouncy", "yellow"],
    "kite": ["red", "yellow", "big", "pretty", "green"],
    "teddy bear": ["soft", "brown", "old", "fluffy", "little"],
    "doll": ["pretty", "small", "old", "pink", "little"],
    "toy car": ["red", "fast", "blue", "shiny", "little"],
    "hat": ["blue", "big", "funny", "green", "warm"],
    "book": ["new", "big", "old", "blue", "picture"],
    "blanket": ["soft", "warm", "pink", "blue", "old"],
    "toy boat": ["red", "little", "wooden", "blue", "white"],
    "drum": ["loud", "red", "little", "shiny", "new"],
    "balloon": ["red", "big", "orange", "purple", "yellow"],
    "robot": ["shiny", "silver", "little", "funny", "new"],
    "truck": ["big", "yellow", "red", "green", "toy"],
    "crayon": ["purple", "orange", "green", "red", "blue"],
    "umbrella": ["yellow", "red", "big", "pink", "green"],
    "shell": ["pretty", "white", "shiny", "pink", "little"],
    "train": ["toy", "blue", "long", "red", "wooden"],
    "scarf": ["warm", "red", "long", "soft", "striped"],
}
FOODS = ["apple", "cookie", "banana", "orange", "sandwich", "cupcake", "carrot", "piece of cake", "ice cream cone"]
HIDING_SPOTS = ["under the bed", "behind the couch", "in the toy box", "under the table", "behind the door",
                "in the closet", "under a pillow", "in the laundry basket", "next to the plant", "in the dog's bed"]
OUTSIDE_SPOTS = ["in the tall grass", "under a big tree", "behind a bush", "near the fence", "under the slide",
                 "in the sandbox", "next to a flower pot", "by the little pond"]

# place -> (preposition, things to see, things to do there as (now, past))
PLACES = {
    "park": (
        "at",
        ["ducks on the pond", "a big green tree", "kids on the swings", "a man with balloons"],
        [("play on the swings", "played on the swings"), ("run on the grass", "ran on the grass"),
         ("feed the ducks", "fed the ducks"), ("go down the slide", "went down the slide")],
    ),
    "beach": (
        "at",
        ["big blue waves", "a little crab", "white birds in the sky", "shells in the sand"],
        [("build a sand castle", "built a sand castle"), ("splash in the water", "splashed in the water"),
         ("look for shells", "looked for shells"), ("dig a big hole", "dug a big hole")],
    ),
    "zoo": (
        "at",
        ["a tall giraffe", "a big gray elephant", "funny monkeys", "a sleepy lion"],
        [("look at the animals", "looked at the animals"), ("feed the goats", "fed the goats"),
         ("watch the monkeys", "watched the monkeys"), ("see the penguins", "saw the penguins")],
    ),
    "farm": (
        "on",
        ["a pink pig", "a brown cow", "a white horse", "little yellow chicks"],
        [("feed the hens", "fed the hens"), ("pet the lambs", "petted the lambs"),
         ("ride on a tractor", "rode on a tractor"), ("pick apples", "picked apples")],
    ),
    "forest": (
        "in",
        ["tall trees", "a red squirrel", "a little stream", "pretty mushrooms"],
        [("look for pine cones", "looked for pine cones"), ("walk on the path", "walked on the path"),
         ("climb a log", "climbed a log"), ("listen to the birds", "listened to the birds")],
    ),
    "lake": (
        "by",
        ["a family of ducks", "little fish", "a green frog", "a small boat"],
        [("throw stones in the water", "threw stones in the water"), ("catch little fish", "caught little fish"),
         ("sail a toy boat", "sailed a toy boat"), ("have a picnic", "had a picnic")],
    ),
    "playground": (
        "at",
        ["a big red slide", "a sandbox", "a tall climbing frame", "swings"],
        [("go down the slide", "went down the slide"), ("play in the sandbox", "played in the sandbox"),
         ("swing high", "swung high"), ("play tag", "played tag")],
    ),
    "garden": (
        "in",
        ["red roses", "a fat bee", "a little snail", "a butterfly"],
        [("pick flowers", "picked flowers"), ("water the plants", "watered the plants"),
         ("dig in the dirt", "dug in the dirt"), ("look for bugs", "looked for bugs")],
    ),
}
COUNT_WORDS = ["two", "three", "four", "five", "six", "seven"]
ORDINALS = {"three": "third", "four": "fourth", "five": "fifth", "six": "sixth", "seven": "seventh"}


def at(place: str) -> str:
    """'at the park', 'on the farm'."""
    return f"{PLACES[place][0]} the {place}"


def pick_object(rng: random.Random) -> tuple[str, str]:
    noun = rng.choice(list(OBJECTS))
    return noun, rng.choice(OBJECTS[noun])


def opening(rng: random.Random, hero: Character) -> str:
    """The first sentence or two: who the story is about, sometimes with what they like."""
    little = rng.choice(["little ", "little ", "", "small "])
    first = rng.choice([
        f"Once upon a time, there was {a(little + hero.kind)} named {hero.name}.",
        f"Once upon a time, there was {a(little + hero.kind)} named {hero.name}.",
        f"There once was {a(little + hero.kind)} called {hero.name}.",
        f"{hero.name} was {a(little + hero.kind)} who lived in {a(rng.choice(['small', 'little', 'yellow', 'cozy']))}"
        f" house {rng.choice(['near the woods', 'by the sea', 'in a big town', 'on a quiet street', 'near a farm'])}.",
    ])
    if rng.random() < 0.4:
        first += " " + rng.choice([
            f"{hero.He} loved to sing songs.", f"{hero.He} liked to run very fast.", f"{hero.He} loved to dance.",
            f"{hero.He} had a big smile.", f"{hero.He} liked to draw pictures.", f"{hero.He} loved to play outside.",
            f"{hero.His} favorite color was {rng.choice(['red', 'blue', 'green', 'yellow', 'purple', 'pink'])}.",
            f"{hero.He} was always asking questions.", f"{hero.He} liked to help {hero.his} friends.",
        ])
    return first


def one_day(rng: random.Random) -> str:
    return rng.choice(["One day", "One day", "One sunny day", "One morning", "One afternoon", "One bright day"])


def ending(rng: random.Random, hero: Character) -> str:
    return rng.choice([f"{hero.name} smiled.", f"{hero.name} felt very happy.", "It was a good day.",
                       f"{hero.name} went to bed with a big smile.", "And they all lived happily ever after.",
                       f"That night, {hero.name} slept well.", "It was the best day ever."])


# ----------------------------------------------------------------------------- plots
# Each plot takes (rng, hero, friend, parent) and returns paragraphs, each a list of sentences.

Story = list[list[str]]


def lost_object(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    noun, adj = pick_object(rng)
    h = hero
    p1 = [opening(rng, h), f"{h.He} had {a(adj + ' ' + noun)}.",
          rng.choice([f"{h.He} loved {h.his} {noun} very much.", f"It was {h.his} favorite toy.",
                      f"{h.He} took it everywhere {h.he} went."])]
    if rng.random() < 0.5:
        p1.append(rng.choice([f"Every day, {h.he} played with it in the garden.",
                              f"At night, {h.he} kept it next to {h.his} bed."]))
    spots = rng.sample(HIDING_SPOTS, 4)
    p2 = [f"{one_day(rng)}, {h.name} could not find {h.his} {noun}.",
          f"{h.He} looked {spots[0]}. {h.He} looked {spots[1]}. It was not there.",
          say(rng, h.name, f"Where is my {noun}?", "asked"),
          f"{h.He} felt {rng.choice(['sad', 'very sad', 'worried', 'upset'])}.",
          f"{h.name} ran to {h.his} {parent.role}. " + say(rng, h.he, f"{parent.title}, I lost my {noun}!", "cried"),
          say(rng, parent.title, rng.choice(["Don't worry. We will find it together.",
                                             "Let's look for it together.", "Do not be sad. We can find it."]))]
    finder = rng.choice(["hero", "parent"] if hero.kind == "puppy" else ["hero", "parent", "dog"])
    if finder == "hero":
        found = [f"They looked {spots[2]}, but it was not there.",
                 f"Then {h.name} saw something {adj} {spots[3]}.", say(rng, h.name, "Look!", "shouted"),
                 f"It was {h.his} {noun}!"]
    elif finder == "parent":
        found = [f"They looked {spots[2]}. They looked everywhere.",
                 f"Then {h.his} {parent.role} smiled. " + say(rng, parent.he, f"Is this your {noun}?", "asked"),
                 f"{cap(parent.he)} was holding the {adj} {noun}. It had been {spots[3]} all the time!"]
    else:
        found = ["Just then, the dog came in with something in its mouth.",
                 f"It was the {adj} {noun}! The dog wanted to play with it too.",
                 f"{h.name} laughed and patted the dog."]
    p3 = found + [f"{h.name} hugged {h.his} {noun}.", say(rng, h.name, f"Thank you, {parent.title}!")]
    p4 = [rng.choice([f"From that day on, {h.name} always put {h.his} {noun} away after playing.",
                      f"{h.name} learned to keep {h.his} things in a safe place.",
                      f"{h.name} was happy to have {h.his} {noun} back."])]
    if rng.random() < 0.4:
        p4.append(ending(rng, h))
    return [p1, p2, p3, p4]


def new_friend(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    place = rng.choice(["park", "beach", "zoo", "farm", "lake", "playground"])
    _, sights, games = PLACES[place]
    (game, _), (_, game2_past) = rng.sample(games, 2)
    game_past = dict(games)[game]
    h, f = hero, friend
    p1 = [f"{one_day(rng)}, {h.name} went to the {place} with {h.his} {parent.role}.",
          f"{h.He} liked to {game} there."]
    where = rng.choice(["alone on a bench", "by a tree", "all alone", "near the gate"])
    p2 = [f"{h.name} saw {a(f.kind)} {where}.",
          f"The {f.kind} looked {rng.choice(['sad', 'lonely', 'shy', 'a little sad'])}.",
          f"{h.name} walked over. " + say(rng, h.he, f"Hi, I am {h.name}. What is your name?"),
          say(rng, f"the {f.kind}", f"My name is {f.name}.", rng.choice(["said", "said softly", "whispered"])),
          say(rng, h.name, f"Do you want to {game} with me?", "asked"),
          f"{f.name} smiled a big smile. " + say(rng, f.he, rng.choice(["Yes, please!", "Yes, I would love to!"]))]
    p3 = [f"They {game_past} together. Then they {game2_past}.",
          rng.choice(["They laughed and laughed.", "They had so much fun.", "They played until the sun went down."]),
          f"When it was time to go home, {f.name} asked, \"Can we play again tomorrow?\"",
          say(rng, h.name, rng.choice(["Yes! You are my friend now.", "Yes, we are friends now!"]))]
    p4 = [rng.choice([f"{h.name} was glad {h.he} had said hello.", f"{h.name} and {f.name} became best friends."])]
    if rng.random() < 0.6:
        p4.append(rng.choice(["A kind word can make a new friend.", "It is good to be kind to someone who is alone.",
                              "Saying hello is the first step to a new friend."]))
    return [p1, p2, p3, p4]


def _fear_slide(rng, h, parent):
    return ("the big slide",
            ["At the playground, there was a big slide. It was very tall.",
             f"{h.name} wanted to go down the slide, but {h.he} was scared.",
             say(rng, h.name, "It is too high!", "said")],
            [say(rng, parent.title, "I will stand at the bottom. I will catch you."),
             f"{h.name} climbed up the steps, one by one. {h.He} sat at the top and took a deep breath.",
             "Whoosh! Down went " + h.name + f"! {h.He} landed right in {h.his} {parent.role}'s arms.",
             say(rng, h.name, "Again! Again!", "shouted")])


def _fear_dark(rng, h, parent):
    return ("the dark",
            [f"Every night, {h.name} was scared of the dark.",
             f"One night, {h.he} saw a big shadow on the wall.",
             say(rng, h.name, f"{parent.title}! There is a monster in my room!", "cried")],
            [f"{h.His} {parent.role} came in and turned on the light.",
             "The monster was only a coat on the door!",
             say(rng, parent.title, "See? There is nothing to be scared of."),
             f"{cap(parent.he)} gave {h.name} a little night light. Now {h.his} room was not so dark."])


def _fear_water(rng, h, parent):
    return ("the water",
            [f"{h.name} went to the lake with {h.his} {parent.role}.",
             f"The water looked deep and cold. {h.name} did not want to go in.",
             say(rng, h.name, "What if I sink?", "asked")],
            [say(rng, parent.title, "I will hold your hands. Just kick your feet."),
             f"{h.name} held on tight and kicked {h.his} feet. Splash, splash!",
             f"Soon {h.he} was floating! The water was not so scary after all.",
             say(rng, h.name, "Look, I can swim!", "shouted")])


def _fear_dog(rng, h, parent):
    return ("the big dog",
            [f"Next door lived a big dog named {rng.choice(['Max', 'Rex', 'Bear', 'Duke', 'Spot'])}.",
             f"The dog was very big and it barked a lot. {h.name} was scared of it.",
             say(rng, h.name, "What if it bites me?", "asked")],
            [say(rng, parent.title, "He is a kind dog. He just wants to say hello."),
             f"{h.name} held out {h.his} hand very slowly.",
             "The big dog sniffed it and licked it. It wagged its tail!",
             f"{h.name} giggled. " + say(rng, h.he, "He likes me!")])


def _fear_thunder(rng, h, parent):
    return ("thunder",
            ["One night, there was a big storm. Boom! The thunder was very loud.",
             f"{h.name} hid under {h.his} blanket. {h.He} was very scared.",
             say(rng, h.name, f"{parent.title}, the sky is so loud!", "cried")],
            [f"{h.His} {parent.role} sat on the bed and held {h.his} hand.",
             say(rng, parent.title, "Thunder is just a big noise. It cannot hurt you."),
             "They counted each boom together. Soon the storm went far away.",
             f"{h.name} was not scared anymore. {h.He} fell asleep."])


FEARS = [_fear_slide, _fear_dark, _fear_water, _fear_dog, _fear_thunder]


def scared_then_brave(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    thing, setup, resolve = rng.choice(FEARS)(rng, hero, parent)
    p1 = [opening(rng, hero), f"{hero.He} was {rng.choice(['a happy', 'a kind', 'a good', 'a curious'])} "
                              f"{hero.kind}, but {hero.he} was afraid of {thing}."]
    p4 = [rng.choice([f"{hero.name} felt very proud.", f"{hero.name} was so proud of {hero.himself}."])]
    if rng.random() < 0.6:
        p4.append(rng.choice(["Being brave is not about never being scared.",
                              "Sometimes things are not as scary as they look.",
                              f"{hero.He} learned that it is good to be brave."]))
    return [p1, setup, resolve, p4]


def sharing(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    noun, adj = pick_object(rng)
    h, f = hero, friend
    p1 = [opening(rng, h),
          f"{h.name} got {a('new ' + noun)} from {h.his} {parent.role}. It was {adj} and "
          f"{rng.choice(['very nice', 'so much fun', 'just right'])}.",
          f"{h.He} did not want anyone else to touch it."]
    p2 = [f"{one_day(rng)}, {h.his} friend {f.name} came to play.",
          say(rng, f.name, f"Can I play with your {noun}?", "asked"),
          say(rng, h.name, rng.choice([f"No, it is my {noun}!", "No! It is mine!"]), "said"),
          f"{f.name} {rng.choice(['looked sad', 'sat down quietly', 'walked away slowly'])}."]
    p3 = [f"{h.name} played with the {noun} all alone. But it was not fun anymore.",
          f"{h.He} looked at {f.name}. {h.He} felt bad inside.",
          f"{h.name} walked to {f.name}. " + say(rng, h.he, rng.choice(
              [f"I am sorry. Let's play with my {noun} together.", f"You can have a turn with my {noun}."])),
          f"{f.name}'s face lit up. " + say(rng, f.he, "Thank you!")]
    p4 = [rng.choice([f"They took turns with the {noun}. It was much more fun with two.",
                      f"They played with the {noun} together all afternoon."]),
          rng.choice(["Sharing made them both happy.", f"{h.name} learned that sharing is caring.",
                      "Things are more fun when you share them."])]
    return [p1, p2, p3, p4]


def _animal_bird(rng, h, parent):
    return ("a little bird",
            ["It was lying on the grass. Its wing was hurt, and it could not fly.",
             say(rng, h.name, "Poor little bird!", "said")],
            [f"{h.name} picked it up very gently and carried it home.",
             f"{h.His} {parent.role} found a small box and put a soft cloth inside.",
             f"Every day, {h.name} gave the bird seeds and water.",
             "After a few days, the bird's wing was better. It flapped its wings and flew up into the sky.",
             say(rng, h.name, "Goodbye, little bird!", "shouted")])


def _animal_kitten(rng, h, parent):
    return ("a little kitten",
            ["It was stuck up in a tall tree. \"Meow! Meow!\" it cried.",
             say(rng, h.name, "The kitten cannot get down!", "said")],
            [f"{h.name} ran to get {h.his} {parent.role}.",
             f"{h.His} {parent.role} brought a ladder and climbed up the tree.",
             f"{cap(parent.he)} held the kitten close and brought it down.",
             f"The kitten purred and rubbed its head on {h.name}'s hand.",
             say(rng, h.name, "You are safe now, little kitten.", "whispered")])


def _animal_duckling(rng, h, parent):
    return ("a little duckling",
            ["It was all alone and it was crying. \"Quack! Quack!\" It had lost its mom.",
             say(rng, h.name, "Don't cry. I will help you find your mom.", "said")],
            [f"{h.name} walked with the duckling to the pond. The duckling waddled behind {h.him}.",
             "At the pond, they saw a big mother duck. She was looking everywhere.",
             "The duckling ran to its mom as fast as it could. The mother duck gave a happy quack.",
             say(rng, h.name, "Now you are home!", "said")])


def _animal_puppy(rng, h, parent):
    dog = rng.choice(["Buddy", "Coco", "Lucky", "Pepper", "Biscuit"])
    return ("a little puppy",
            ["It was sitting all alone by the road. It looked lost and scared.",
             f"The puppy had a tag on its neck. The tag said \"{dog}\"."],
            [f"{h.name} and {h.his} {parent.role} walked down the street with {dog}.",
             "Soon they saw a boy who was calling and calling.",
             say(rng, "the boy", f"{dog}! That is my puppy!", "shouted"),
             f"{dog} jumped into the boy's arms and licked his face.",
             say(rng, "the boy", "Thank you for finding my puppy!")])


ANIMALS_IN_NEED = [_animal_bird, _animal_kitten, _animal_duckling, _animal_puppy]


def helping_an_animal(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    animal, problem, rescue = rng.choice(ANIMALS_IN_NEED)(rng, hero, parent)
    where = rng.choice(["in the garden", "at the park", "outside", "in the yard", "by the river"])
    p1 = [opening(rng, hero), f"{one_day(rng)}, {hero.name} was playing {where} when {hero.he} saw {animal}."]
    p4 = [rng.choice([f"{hero.name} felt warm and happy inside.", f"{hero.name} was glad {hero.he} could help."])]
    if rng.random() < 0.6:
        p4.append(rng.choice(["It feels good to help others.", "Even a small friend needs help sometimes.",
                              "When we are kind to animals, they are kind to us."]))
    return [p1, problem, rescue, p4]


def trip(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    place = rng.choice(["beach", "zoo", "farm", "forest", "lake"])
    _, sights, games = PLACES[place]
    s1, s2, s3 = rng.sample(sights, 3)
    _, game_past = rng.choice(games)
    h = hero
    p1 = [opening(rng, h),
          f"{one_day(rng)}, {h.his} {parent.role} said, \"Today we are going to the {place}!\"",
          f"{h.name} {rng.choice(['jumped up and down', 'clapped', 'ran to get ready', 'cheered'])}."]
    p2 = [f"{at(place).capitalize()}, {h.name} saw {s1} and {s2}.",
          say(rng, h.name, f"Look, {parent.title}! Look at that!", "shouted"),
          f"Then they saw {s3}. {h.name} laughed.",
          f"They {game_past}. It was so much fun."]
    food = rng.choice(FOODS)
    problem = rng.random()
    if problem < 0.5:
        p3 = [f"Later, {h.his} {parent.role} got {h.him} {a(food)}.",
              f"But oh no! {h.name} dropped the {food} on the ground.",
              f"{h.His} eyes filled with tears.",
              *rng.choice([
                  [say(rng, parent.title, "It is okay. We can share mine."),
                   f"{h.name} smiled again. Sharing made the {food} taste even better."],
                  [say(rng, parent.title, "Don't be sad. Accidents happen."),
                   f"{parent.title} got {h.him} a new {food}, and {h.name} held it with both hands."],
              ])]
    else:
        p3 = [f"After a while, {h.name} felt very tired. {h.His} legs hurt.",
              say(rng, h.name, "I can't walk anymore.", "said"),
              f"{h.His} {parent.role} laughed and lifted {h.him} up onto {parent.his} shoulders.",
              f"From up high, {h.name} could see the whole {place}!"]
    p4 = [f"On the way home, {h.name} fell asleep in the car.",
          rng.choice([f"{h.He} dreamed about the {place}.", "It was the best day ever.", ending(rng, h)])]
    return [p1, p2, p3, p4]


RAINY_GAMES = [
    ("build a fort", ["They took blankets and pillows and built a big fort in the living room.",
                      "Inside the fort, they read stories with a flashlight."]),
    ("paint pictures", ["They got out paper and paints.",
                        "{name} painted a big yellow sun, because there was no sun outside."]),
    ("bake cookies", ["They mixed flour, sugar and eggs in a big bowl.",
                      "Soon the house smelled sweet and warm. The cookies were yummy."]),
    ("play hide and seek", ["{name} hid behind the curtain. Then {he} hid under the table.",
                            "Every time {he} was found, {he} giggled and giggled."]),
]


def rainy_day(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h = hero
    place = rng.choice(["park", "beach", "playground", "lake"])
    game, lines = rng.choice(RAINY_GAMES)
    p1 = [opening(rng, h), f"{h.He} wanted to go to the {place} today.",
          f"But when {h.he} looked out the window, it was raining. Drip, drop, drip!",
          say(rng, h.name, rng.choice(["Oh no! Now I can't go out.", "Rain, rain, go away!"]), "said"),
          f"{h.He} felt {rng.choice(['sad', 'grumpy', 'bored'])}."]
    p2 = [say(rng, parent.title, f"Let's {game}!"), say(rng, h.name, rng.choice(["Yes!", "Okay!", "That sounds fun!"]))]
    p3 = [line.format(name=h.name, he=h.he) for line in lines]
    p4 = [f"After a while, the rain stopped. {h.name} looked outside.",
          "There was a big rainbow in the sky! It had red, orange, yellow, green and blue.",
          say(rng, h.name, "This was a fun day after all!")]
    if rng.random() < 0.5:
        p4.append("Rainy days can be fun too.")
    return [p1, p2, p3, p4]


def birthday(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h, f = hero, friend
    age = rng.choice(list(ORDINALS))
    noun, adj = pick_object(rng)
    cake = rng.choice(["chocolate", "strawberry", "banana", "lemon", "vanilla"])
    p1 = [f"Today was {h.name}'s {ORDINALS[age]} birthday!",
          f"{h.He} woke up early and ran to the kitchen.",
          f"{h.His} {parent.role} was making a big {cake} cake.",
          say(rng, parent.title, f"Happy birthday, {h.name}! You are {age} years old today.")]
    p2 = [f"In the afternoon, {h.his} friends came to the party.",
          f"{f.name} gave {h.name} {a(adj + ' ' + noun)}.", say(rng, h.name, f"I love it! Thank you, {f.name}!")]
    if rng.random() < 0.5:
        pool = GIRLS + BOYS if h.kind in ("girl", "boy") else [n for _, names in ANIMAL_HEROES for n in names]
        other = rng.choice([n for n in pool if n not in (h.name, f.name)])
        p2 += [f"But {other} did not bring a gift. {other} looked sad.",
               say(rng, other, "I am sorry. I do not have a present for you.", "said"),
               say(rng, h.name, "That's okay! You came to my party. That is the best present.")]
    p3 = [f"Then it was time for the cake. It had {age} candles on top.",
          "Everyone sang the birthday song.",
          f"{h.name} made a wish and blew out the candles. Whoosh!"]
    p4 = [rng.choice([f"{h.name} had the best birthday ever.", f"It was a happy day for {h.name}."])]
    if rng.random() < 0.5:
        p4.append("Friends make every day special.")
    return [p1, p2, p3, p4]


def planting(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h = hero
    plant, grown = rng.choice([("sunflower", "a tall yellow sunflower"), ("tomato", "a plant with red tomatoes"),
        ("flower", "a pretty pink flower"), ("pumpkin", "a big orange pumpkin"), ("bean", "a long green bean plant")])
    p1 = [opening(rng, h), f"{one_day(rng)}, {h.his} {parent.role} gave {h.him} a tiny {plant} seed.",
          say(rng, parent.title, "If you plant it and give it water, it will grow.")]
    p2 = [f"{h.name} dug a little hole in the garden and put the seed inside.",
          f"Every morning, {h.he} gave it water. But nothing happened.",
          say(rng, h.name, "When will it grow?", "asked"),
          say(rng, parent.title, "You have to wait. Good things take time.")]
    p3 = [f"{h.name} waited and waited. {h.He} kept giving it water.",
          f"Then one morning, {h.he} saw a small green leaf in the dirt!",
          say(rng, h.name, f"{parent.title}, come and see! It is growing!", "shouted"),
          f"Day by day, the little plant grew. At last it was {grown}."]
    p4 = [f"{h.name} was so happy. {h.He} had grown it all by {h.himself}."]
    if rng.random() < 0.6:
        p4.append(rng.choice(["Waiting is hard, but it is worth it.", "Good things come to those who wait."]))
    return [p1, p2, p3, p4]


def helping_at_home(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h = hero
    jobs = [
        ("make a cake", "the bag of flour fell over. Flour went everywhere!", "they put the cake in the oven"),
        ("wash the dog", "the dog shook its fur. Water went everywhere!", "the dog was clean and shiny"),
        ("clean the house", "the bucket tipped over. Soapy water went all over the floor!", "the house was clean"),
        ("make pancakes", "a pancake flipped too high and landed on the floor!", "they had a big stack of pancakes"),
    ]
    if hero.kind == "puppy":
        jobs = [job for job in jobs if "dog" not in job[0]]
    job, mess, fixed = rng.choice(jobs)
    p1 = [opening(rng, h), f"{one_day(rng)}, {h.his} {parent.role} said, \"Will you help me {job}?\"",
          say(rng, h.name, rng.choice(["Yes, I can help!", "Oh yes, I love to help!"]))]
    p2 = [f"They worked together. {h.name} was a very good helper.",
          f"But then {mess}", f"{h.name} looked at {h.his} {parent.role}. Was {parent.he} mad?"]
    p3 = [f"{h.His} {parent.role} started to laugh, and {h.name} laughed too.",
          say(rng, parent.title, "It is okay. We can clean it up together."),
          f"They cleaned up the mess. In the end, {fixed}."]
    p4 = [say(rng, parent.title, f"Thank you for helping me, {h.name}."), f"{h.name} felt proud and happy."]
    if rng.random() < 0.5:
        p4.append(rng.choice(["Helping is fun, even when things go wrong.",
                              "It is okay to make a mess, as long as you help clean it up."]))
    return [p1, p2, p3, p4]


def snowy_day(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h, f = hero, friend
    color = rng.choice(["red", "blue", "green", "yellow", "purple", "pink"])
    p1 = [opening(rng, h), f"One winter morning, {h.name} woke up and looked out the window. Everything was white!",
          say(rng, h.name, rng.choice(["It snowed!", "Snow! Look at all the snow!"]), "shouted")]
    p2 = [f"{h.He} put on {h.his} warm coat, {h.his} boots and {h.his} {color} hat.",
          f"Then {h.he} ran outside. {h.His} friend {f.name} was already there."]
    if rng.random() < 0.5:
        p2.append(say(rng, f.name, "Let's make a snowman!"))
        p3 = ["They rolled a big ball of snow for the body and a small ball for the head.",
              "They gave the snowman a carrot nose and two little stones for eyes.",
              f"{h.name} put {h.his} {color} hat on its head. " + say(rng, h.he, "Now he looks happy!")]
    else:
        p2.append(say(rng, f.name, "Let's ride the sled down the hill!"))
        p3 = ["They pulled the sled to the top of the hill. It was very high.",
              "Then they sat down and held on tight. Whoosh! Down they went, faster and faster!",
              f"At the bottom, they fell in the soft snow. {h.name} and {f.name} laughed and laughed."]
    p4 = [f"When their hands were cold, they went inside. {h.His} {parent.role} made them hot cocoa.",
          rng.choice(["Their noses were cold, but their hearts were warm.", "It was the best snow day ever."])]
    return [p1, p2, p3, p4]


BREAKABLE = ["toy car", "robot", "doll", "truck", "train", "toy boat", "drum"]


def broken_toy(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h = hero
    noun = rng.choice(BREAKABLE)
    adj = rng.choice(OBJECTS[noun])
    p1 = [opening(rng, h), f"{h.He} had {a(adj + ' ' + noun)}. {h.He} played with it every day."]
    accident = rng.choice([f"threw the {noun} up high", f"dropped the {noun} on the floor",
                           f"played with the {noun} too hard"])
    p2 = [f"{one_day(rng)}, {h.name} {accident}.",
          f"Crack! The {noun} broke into two pieces.",
          say(rng, h.name, f"Oh no! My {noun} is broken!", "cried"),
          f"Big tears rolled down {h.his} face."]
    fixer = rng.choice(["glue", "tape"])
    p3 = [f"{h.His} {parent.role} came and looked at the pieces.",
          say(rng, parent.title, rng.choice(["Let me see. Maybe we can fix it.", "Don't cry. We can fix it."])),
          f"They got some {fixer}. {h.name} held the pieces very still, and {h.his} {parent.role} put them together.",
          "They waited for the glue to dry." if fixer == "glue" else "They wrapped the tape round and round.",
          say(rng, parent.title, "There! It is as good as new.")]
    p4 = [f"{h.name} hugged {h.his} {parent.role}. " + say(rng, h.he, f"Thank you, {parent.title}!"),
          rng.choice([f"From then on, {h.name} was very gentle with {h.his} {noun}.",
                      "Some things can be fixed with a little help.",
                      f"{h.name} learned to take good care of {h.his} toys."])]
    return [p1, p2, p3, p4]


def cannot_sleep(rng: random.Random, hero: Character, friend: Character, parent: Parent) -> Story:
    h = hero
    why = rng.choice([f"{h.He} was thinking about the trip to the {rng.choice(['zoo', 'beach', 'farm'])} tomorrow.",
                      "Outside, the wind went whoo, whoo.", f"{h.His} room was too dark and too quiet.",
                      f"{h.His} tummy felt funny.", "A little owl was hooting outside the window."])
    p1 = [opening(rng, h), f"One night, {h.name} could not sleep. {why}",
          f"{h.He} turned to the left. {h.He} turned to the right. {h.His} eyes stayed wide open."]
    p2 = [f"{h.He} got out of bed and went to find {h.his} {parent.role}.",
          say(rng, h.name, f"{parent.title}, I can't sleep.", "said")]
    if rng.random() < 0.5:
        dream = "the moon and the stars"
        p2.append(say(rng, parent.title, "Let's look at the sky together."))
        p3 = ["They looked out the window. The moon was big and round, and the sky was full of stars.",
              say(rng, h.name, "Hello, moon!", "whispered"),
              "They counted the stars. One, two, three, four, five..."]
    else:
        animal = rng.choice(["bunny", "bear", "owl", "elephant", "little fish"])
        dream = rng.choice([f"a big trip with the {animal}", f"the {animal} and its big trip"])
        p2.append(say(rng, parent.title, "Come here. I will make you some warm milk."))
        p3 = [f"{h.name} sat on {h.his} {parent.role}'s lap and drank the warm milk.",
              f"Then {h.his} {parent.role} read {h.him} a story about {a(animal)} who went on a big trip.",
              say(rng, h.name, "Read it again, please!", "whispered")]
    if rng.random() < 0.5:
        p3.append(f"After that, {h.his} {parent.role} sang a soft song about a sleepy "
                  f"{rng.choice(['bunny', 'bear', 'duck', 'owl', 'sheep'])}.")
    p3.append(f"{h.name}'s eyes got heavy, and {h.he} gave a big yawn.")
    p4 = [f"{h.His} {parent.role} carried {h.him} back to bed and tucked {h.him} in.",
          say(rng, parent.title, f"Good night, {h.name}. Sweet dreams.", "whispered"),
          f"Soon {h.name} was fast asleep, dreaming about {dream}."]
    return [p1, p2, p3, p4]


PLOTS: list[Callable[[random.Random, Character, Character, Parent], Story]] = [
    lost_object, new_friend, scared_then_brave, sharing, helping_an_animal, trip, rainy_day, birthday, planting,
    helping_at_home, snowy_day, broken_toy, cannot_sleep,
]


# ----------------------------------------------------------------------------- public API


def generate_story(rng: random.Random) -> str:
    """One synthetic children's story (about 80-250 words), deterministic given the state of ``rng``.

    Paragraphs are separated by a blank line; the text has no trailing newline.
    """
    hero, friend, parent = make_cast(rng)
    plot = rng.choice(PLOTS)
    paragraphs = plot(rng, hero, friend, parent)
    return "\n\n".join(" ".join(sentences) for sentences in paragraphs if sentences)


_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def write_corpus(path: str | os.PathLike, num_bytes: int, seed: int = 0) -> dict:
    """Write synthetic stories to ``path``, each followed by ``"\\n<|endoftext|>\\n"``, until it holds >= num_bytes.

    The file is written atomically. Returns statistics, labelled synthetic:
    ``{"synthetic": True, "generator": "lm.demo.stories", "seed", "stories", "bytes", "distinct_words"}``.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    rng = random.Random(seed)
    words: set[str] = set()
    stories = size = 0
    with atomic_write(path, "w", encoding="utf-8") as f:
        while size < num_bytes:
            story = generate_story(rng)
            chunk = story + SEPARATOR
            f.write(chunk)
            size += len(chunk.encode("utf-8"))
            stories += 1
            words.update(_WORD.findall(story.lower()))
    return {"synthetic": True, "generator": "lm.demo.stories", "seed": seed, "stories": stories, "bytes": size,
            "distinct_words": len(words)}


PROG = "python -m lm.demo.stories"


def is_corpus(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a corpus this command wrote, the only file ``--overwrite`` replaces:
    text that ends with :data:`SEPARATOR` and starts with a story, not with it, or an empty file
    (``--bytes 0``). The file holds no marker (it is the corpus itself), so this is the most that can
    be told; a note or a data file of the user's (``precious.txt``) fails it and is never written over.
    Only a regular file is opened: reading a named pipe would wait for a writer."""
    if not os.path.isfile(path):
        return False
    tail = SEPARATOR.encode("utf-8")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - len(tail)))
            end = f.read()
    except OSError:
        return False
    if size == 0:  # --bytes 0 writes an empty file; an empty file holds nothing to lose either
        return True
    if size <= len(tail) or end != tail or head.startswith(tail.lstrip(b"\n")) or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # cut inside a character at 64 KiB: fine; invalid before it: not a corpus
        return len(head) == 1 << 16 and e.start >= len(head) - 3
    return True


def main(argv: list[str] | None = None) -> int:
    """The command line: one line ``python -m lm.demo.stories: error: ...`` and exit 2 for bad input, as
    every ``lm`` command does (:mod:`lm.cli`): a negative ``--bytes`` and an unwritable ``--out`` had
    been tracebacks, and an existing ``--out`` (any file) was replaced without a word."""
    from lm.cli.common import WrittenHelpParser, run_as_command

    parser = WrittenHelpParser(prog=PROG,
                                     description="Write a corpus of synthetic children's stories (procedurally "
                                                 "generated, not human-written), separated by <|endoftext|>.")
    parser.add_argument("--bytes", type=int, default=2_000_000, metavar="N",
                        help="write at least this many bytes, a whole number (default 2000000)")
    parser.add_argument("--out", required=True, metavar="FILE", help="output text file")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out that is a corpus of this command (never anything else)")
    parser.add_argument("--seed", type=int, default=0, help="random seed, in [0, 2**64-1] (default 0)")
    args = parser.parse_args(argv)

    def write() -> None:
        stats = _write(args)
        n = stats["stories"]
        print(f"wrote {n} synthetic {'story' if n == 1 else 'stories'}, {stats['bytes']} bytes, "
              f"{stats['distinct_words']} distinct words to {args.out}")

    return run_as_command(PROG, write)


def _write(args: argparse.Namespace) -> dict:
    """Check the arguments, all before anything is written, then write the corpus."""
    from lm.checks import check_seed
    from lm.io import check_not_empty, check_output_file, writing_out

    if args.bytes < 0:  # write_corpus's own ValueError named num_bytes, a traceback
        raise ValueError(f"--bytes: must be a whole number >= 0, got {args.bytes}")
    seed = check_seed(args.seed, "--seed")  # as `lm demo --seed`: numpy, torch and the trainer take no other
    check_not_empty(args.out, "--out")  # Path('') is the working folder
    out = check_output_file(args.out, overwrite=args.overwrite, recognise=is_corpus,
                            what="a corpus this command wrote (text ending in <|endoftext|>)")
    with writing_out(out, "--out"):  # "[Errno 16] Device or resource busy: '.'" had been a traceback
        return write_corpus(out, args.bytes, seed=seed)


if __name__ == "__main__":
    raise SystemExit(main())
