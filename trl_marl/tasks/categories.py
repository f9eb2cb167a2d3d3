"""Everyday categories and their members, for the `teamwork` tasks: offline data, and the parsing that turns a model's
free-form answer into members.

Each category lists its members in lower case and singular, the best known first (those are the ones the tasks show
as options, and the ones a small model names first). An answer is read leniently about form — numbering, markdown,
articles, plurals, a trailing description ("1. **Lions** (big cats)" is `lion`) — and strictly about content: a piece
is a member or it is not.
"""

import calendar
import re

CATEGORIES: dict[str, list[str]] = {
    "colours": "red blue green yellow black white orange purple pink brown grey violet indigo cyan magenta "
    "turquoise maroon navy beige gold silver lavender teal crimson scarlet tan olive lime ivory cream peach amber "
    "aqua coral khaki charcoal burgundy mauve",
    "fruits": "apple banana orange grape strawberry cherry pear peach mango pineapple lemon watermelon plum kiwi "
    "blueberry raspberry blackberry melon lime grapefruit apricot papaya coconut fig date pomegranate cranberry "
    "avocado tangerine nectarine guava lychee cantaloupe persimmon mandarin clementine",
    "vegetables": "carrot potato tomato onion lettuce broccoli cucumber spinach cabbage pepper corn pea garlic "
    "celery zucchini eggplant cauliflower bean kale asparagus radish beet turnip pumpkin squash leek artichoke "
    "mushroom okra parsnip yam chard arugula",
    "animals": "dog cat lion tiger elephant horse cow monkey bear rabbit giraffe zebra pig sheep goat chicken duck "
    "mouse rat fox wolf deer kangaroo koala panda camel hippo rhino crocodile alligator snake lizard frog turtle "
    "whale dolphin shark fish eagle owl penguin parrot bird squirrel bat cheetah leopard gorilla chimpanzee "
    "donkey ostrich",
    "musical instruments": "piano guitar violin drum flute trumpet saxophone cello clarinet harp trombone tuba "
    "viola oboe bassoon horn harmonica accordion banjo ukulele mandolin xylophone organ keyboard synthesizer "
    "tambourine triangle cymbal bagpipe recorder piccolo sitar",
    "shapes": "circle square triangle rectangle oval star heart diamond pentagon hexagon octagon rhombus trapezoid "
    "parallelogram ellipse cube sphere cylinder cone pyramid prism crescent cross arrow semicircle heptagon",
    "body parts": "head hand foot arm leg eye ear nose mouth finger toe knee elbow shoulder neck hair face tooth "
    "tongue lip chin cheek forehead eyebrow wrist ankle hip chest back stomach belly heart brain lung liver "
    "kidney skin skull spine thumb",
    "countries": "france germany italy spain china japan india brazil canada mexico russia australia egypt "
    "england nigeria kenya argentina chile peru colombia portugal greece turkey poland sweden norway denmark "
    "finland ireland scotland wales netherlands belgium switzerland austria iran iraq israel pakistan "
    "bangladesh thailand vietnam indonesia philippines korea malaysia singapore morocco ghana ethiopia "
    "ukraine hungary cuba jamaica venezuela",
    "planets": "earth mars jupiter saturn venus mercury neptune uranus",
    "months": " ".join(name.lower() for name in calendar.month_name[1:]),
    "days of the week": " ".join(name.lower() for name in calendar.day_name),
}
CATEGORIES = {name: members.split() for name, members in CATEGORIES.items()}
# Members of two words, and irregular plurals, as a model writes them.
CATEGORIES["vegetables"] += ["bell pepper", "green bean", "sweet potato", "brussels sprout"]
CATEGORIES["musical instruments"] += ["double bass", "french horn", "electric guitar", "bass guitar"]
CATEGORIES["countries"] += ["united states", "united kingdom", "south africa", "new zealand", "south korea"]
ALIASES = {
    "gray": "grey", "teeth": "tooth", "feet": "foot", "mice": "mouse", "hippopotamus": "hippo",
    "rhinoceros": "rhino", "drums": "drum", "bagpipes": "bagpipe", "usa": "united states", "america": "united states",
    "uk": "united kingdom", "britain": "united kingdom", "holland": "netherlands", "beetroot": "beet",
    "aubergine": "eggplant", "courgette": "zucchini", "maize": "corn", "chimp": "chimpanzee", "bunny": "rabbit",
}  # fmt: skip

SEPARATORS = re.compile(r",|;|\n|\||/|\band\b|\bor\b")
NUMBERING = re.compile(r"^\s*(?:\d+\s*[.):]|[-•*+])\s*")
DESCRIPTION = re.compile(r"\s(?:-|–|—)\s.*|[:(].*")
ARTICLE = re.compile(r"^(?:the|a|an)\s+")


def singular(word: str, members: set[str]) -> str:
    """`word` as a member of `members` when it is a plural of one (`cherries` → `cherry`), else unchanged."""
    for suffix, replacement in (("ies", "y"), ("es", ""), ("s", "")):
        if word.endswith(suffix) and word[: -len(suffix)] + replacement in members:
            return word[: -len(suffix)] + replacement
    return word


def normalise(piece: str, members: set[str]) -> str:
    """One listed item as a member would be written: lower case, without numbering, markdown, article, trailing
    description or plural."""
    piece = NUMBERING.sub("", piece.lower().replace("*", "").replace("`", "").replace("_", " "))
    piece = DESCRIPTION.sub("", piece)
    piece = re.sub(r"[^a-z ]", " ", piece)
    piece = ARTICLE.sub("", " ".join(piece.split()))
    words = piece.split()
    if not words:
        return ""
    words[-1] = ALIASES.get(words[-1], words[-1])
    return singular(" ".join(words).strip(), members)


def listed_items(text: str, category: str) -> list[str]:
    """The pieces of a listed answer in order (split at commas, new lines, "and", "or"), each normalised; a piece that
    is not a member of `category` is kept as written so that it still takes its place in the list."""
    members = set(CATEGORIES[category])
    pieces = [normalise(piece, members) for piece in SEPARATORS.split(text)]
    return [piece for piece in pieces if piece]


def mentioned(text: str, options: list[str]) -> list[str]:
    """The `options` that `text` names (whole words, any case, singular or plural), in the order of `options`."""
    text = " " + re.sub(r"[^a-z]+", " ", text.lower()) + " "
    return [
        option
        for option in options
        if any(f" {form} " in text for form in (option, option + "s", option + "es", option[:-1] + "ies"))
    ]
