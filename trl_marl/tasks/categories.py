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
# Members of two words; then ALIASES: other names a model uses for members (irregular plurals included).
CATEGORIES["vegetables"] += ["sweet potato", "brussels sprout"]
CATEGORIES["musical instruments"] += ["double bass"]
CATEGORIES["countries"] += ["united states", "united kingdom", "south africa", "new zealand"]
ALIASES = {
    "gray": "grey", "teeth": "tooth", "feet": "foot", "mice": "mouse", "hippopotamus": "hippo",
    "rhinoceros": "rhino", "drums": "drum", "bagpipes": "bagpipe", "usa": "united states", "america": "united states",
    "united states of america": "united states", "uk": "united kingdom",
    "britain": "united kingdom", "great britain": "united kingdom", "holland": "netherlands", "beetroot": "beet",
    "aubergine": "eggplant", "courgette": "zucchini", "maize": "corn", "chimp": "chimpanzee", "bunny": "rabbit",
    "bell pepper": "pepper", "green bean": "bean", "french horn": "horn", "electric guitar": "guitar",
    "bass guitar": "guitar", "acoustic guitar": "guitar", "south korea": "korea", "wolves": "wolf",
}  # fmt: skip

# Categories that no task trains on: the teamwork benchmark's second held-out split (`split="unseen"`), which asks
# whether a team learned a convention or the training categories' options. Their first twelve members share no word
# with a training category's members or aliases (tests/test_teamwork.py checks it).
UNSEEN_CATEGORIES: dict[str, list[str]] = {
    "tools": "hammer screwdriver wrench saw drill pliers chisel shovel rake axe ladder trowel",
    "sports": "football tennis basketball baseball golf hockey cricket rugby volleyball boxing cycling skiing",
    "vehicles": "car bus truck bicycle motorcycle train airplane boat helicopter tractor taxi submarine",
    "furniture": "chair table bed sofa desk shelf cabinet wardrobe dresser stool bench bookcase",
    "flowers": "rose tulip daisy lily sunflower orchid daffodil carnation poppy marigold jasmine peony",
    "kitchen utensils": "spoon fork knife plate bowl cup kettle whisk ladle spatula grater colander",
    "professions": "doctor teacher nurse farmer chef lawyer engineer dentist plumber carpenter baker firefighter",
    "trees": "oak pine maple birch willow cedar elm spruce fir redwood cypress beech",
}  # fmt: skip
UNSEEN_CATEGORIES = {name: members.split() for name, members in UNSEEN_CATEGORIES.items()}

LINES = re.compile(r"\n|\|")
ITEMS = re.compile(r",|;|/|\band\b|\bor\b")
NUMBERING = re.compile(r"^\s*(?:\(?\d+\s*[.):\-–]+|[-•*+]|#+)\s*")
ASIDE = re.compile(r"\([^)]*\)?|\s[-–—]\s.*")
ARTICLE = re.compile(r"^(?:the|a|an)\s+")


def singular(word: str, names: set[str]) -> str:
    """`word` as one of `names` when it is a plural of one (`cherries` → `cherry`, `wolves` → `wolf`), else
    unchanged."""
    for suffix, replacement in (("ies", "y"), ("ves", "f"), ("es", ""), ("s", "")):
        if word not in names and word.endswith(suffix) and word[: -len(suffix)] + replacement in names:
            return word[: -len(suffix)] + replacement
    return word


def normalise(piece: str, members: set[str]) -> str:
    """One listed item as a member is written: lower case, letters only, no article, singular, aliases resolved."""
    piece = ARTICLE.sub("", " ".join(re.sub(r"[^a-z ]", " ", piece.lower()).split()))
    piece = singular(piece, members | set(ALIASES))
    return ALIASES.get(piece, piece)


def line_items(line: str, members: set[str]) -> list[str]:
    """The items of one line of an answer: numbering, markdown and asides (in brackets, after a dash) dropped; of a
    line with a colon, the part before it when it names a member ("apple: a red fruit"), else the part after it
    ("Here are three fruits: ..."); a line ending in ":" (a preamble) has none."""
    line = ASIDE.sub("", NUMBERING.sub("", line.lower().replace("*", "").replace("`", "").replace("_", " "))).strip()
    if line.endswith(":"):
        return []
    items = [
        [item for item in (normalise(piece, members) for piece in ITEMS.split(part)) if item]
        for part in line.split(":", 1)
    ]
    if len(items) == 2 and not any(item in members for item in items[0]):
        return items[1]  # "Here are three fruits: ...", "Fruit 1: apple"
    return items[0]


def listed_items(text: str, category: str) -> list[str]:
    """The items of a listed answer in order, line by line (see `line_items`), each normalised; an item that is not a
    member of `category` is kept as written so that it still takes its place in the list."""
    members = set(CATEGORIES[category])
    return [item for line in LINES.split(text) for item in line_items(line, members)]


def mentioned(text: str, options: list[str]) -> list[str]:
    """The `options` that `text` names (whole words, any case, singular or plural, or by an alias: "gray" names
    `grey`), in the order of `options`."""
    words = re.sub(r"[^a-z]+", " ", text.lower()).split()
    text = " " + " ".join(ALIASES.get(word, word) for word in words) + " "
    return [
        option
        for option in options
        if any(f" {form} " in text for form in (option, option + "s", option + "es", option[:-1] + "ies"))
    ]
