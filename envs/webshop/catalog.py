"""WebShop-1k data: the product catalog, WebShop's synthetic goals and this project's split.

Files (in the `webshop` data folder): `products_1k.jsonl` (one {id, contents, product} per line;
`product` is WebShop's product record after its `load_products`, `contents` the text its search
index holds) and `items_ins_v2_1000.json` (per product: attributes, and for 415 products a
synthetic `instruction` with its `instruction_attributes`).

Goals, as WebShop's `get_synthetic_goals`: every product with an instruction gives one goal per
combination of its option values (option names sorted, values in catalog order;
`itertools.product`), 6,910 goals in all. The goal text is the instruction, then
" with <name>: <value>, and <name>: <value>", then ", and price lower than <U> dollars". A
product's price is its single price, or for a price range a uniform draw in it (WebShop's
`generate_product_prices`); its price bound U is the larger of two values drawn from the first four
multiples of 10 above the price (no bound when fewer than two exist). WebShop draws these from the
unseeded global `random`; here they come from `random.Random(GOAL_SEED)` in catalog order, so
goals are the same on every machine.

Split (this project's; WebShop's own "first 500 goals are test" leans on its 12k human goals):
the 415 goal products are shuffled with `random.Random(GOAL_SEED + 1)`; the first 100 are test
products, the other 315 train products, so test goals are on products never seen in training.
`test` holds one goal per test product (its option combination drawn with the same generator):
100 goals. `train` holds every goal of the train products, in a shuffle of the same generator.
A task id is "<asin>/<k>": the k-th option combination of that product's goals.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

PRODUCTS_FILE = "products_1k.jsonl"
ATTRIBUTES_FILE = "items_ins_v2_1000.json"
GOAL_SEED = 233  # WebShop shuffles its goals with random.seed(233)
TEST_PRODUCTS = 100
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price bounds
NO_PRICE_BOUND = 1_000_000.0
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Goal:
    """One WebShop goal: buy product `asin` with `goal_options`, below `price_upper`."""

    task_id: str
    asin: str
    instruction_text: str
    attributes: tuple[str, ...]
    goal_options: dict[str, str]  # option name -> value
    price_upper: float
    name: str  # the product's title (WebShop's goal['name'])
    query: str
    category: str
    product_category: str


@dataclass
class Catalog:
    """Products (WebShop records by asin, in file order), their prices, goals and splits."""

    folder: Path
    products: dict[str, dict[str, Any]]
    contents: list[str]  # the search text of each product, in file order (index ordinals)
    prices: dict[str, float]
    goals: dict[str, Goal]
    splits: dict[str, list[str]]

    @property
    def asins(self) -> list[str]:
        return list(self.products)


def check_files(folder: Path) -> None:
    """Fail with the missing file's path when the data folder is incomplete."""
    for name in (PRODUCTS_FILE, ATTRIBUTES_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"WebShop data file {folder / name} is missing (data folder {folder})")


@lru_cache(maxsize=4)
def load_catalog(folder: Path) -> Catalog:
    """The catalog, goals and splits of the WebShop data in `folder` (cached per process)."""
    check_files(folder)
    attributes = json.loads((folder / ATTRIBUTES_FILE).read_text())
    products: dict[str, dict[str, Any]] = {}
    contents: list[str] = []
    with open(folder / PRODUCTS_FILE) as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{folder / PRODUCTS_FILE} line {number} is not JSON: {err}") from None
            product = row["product"]
            # as WebShop's load_products: attributes and the synthetic instruction come from the
            # attribute file ('DUMMY_ATTR' when a product has none there)
            extra = attributes.get(row["id"], {})
            product["Attributes"] = extra.get("attributes", ["DUMMY_ATTR"])
            product["instruction_text"] = extra.get("instruction")
            product["instruction_attributes"] = extra.get("instruction_attributes")
            products[row["id"]] = product
            contents.append(row["contents"])
    rng = random.Random(GOAL_SEED)
    prices = {asin: product_price(p["pricing"], rng) for asin, p in products.items()}
    goals = synthetic_goals(products, prices, rng)
    return Catalog(folder, products, contents, prices, goals, split_goals(goals, random.Random(GOAL_SEED + 1)))


def product_price(pricing: list[float], rng: random.Random) -> float:
    """WebShop's price of a product: 100 when unknown, the price, or a uniform draw in a range."""
    if not pricing:
        return 100.0
    if len(pricing) == 1:
        return pricing[0]
    return rng.uniform(*pricing[:2])


def price_bound(price: float, rng: random.Random) -> tuple[float, str]:
    """WebShop's price upper bound and its goal text: the larger of two of the first four
    multiples of 10 above `price`; no bound (1e6, no text) when fewer than two exist."""
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return NO_PRICE_BOUND, ""
    _, upper = sorted(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def synthetic_goals(
    products: dict[str, dict[str, Any]], prices: dict[str, float], rng: random.Random
) -> dict[str, Goal]:
    """WebShop's get_synthetic_goals: one goal per option combination of each product that has
    an instruction; the price bound is drawn once per product."""
    goals: dict[str, Goal] = {}
    for asin, product in products.items():
        if product["instruction_text"] is None:
            continue
        price_upper, price_text = price_bound(prices[asin], rng)
        names = sorted(product["options"])
        for k, combination in enumerate(itertools.product(*(product["options"][n] for n in names))):
            goal_options = dict(zip(names, combination, strict=True))
            option_text = ", and ".join(f"{n}: {v}" for n, v in goal_options.items())
            option_text = f" with {option_text}" if option_text else ""
            task_id = f"{asin}/{k}"
            goals[task_id] = Goal(
                task_id=task_id,
                asin=asin,
                instruction_text=f"{product['instruction_text']}{option_text}{price_text}",
                attributes=tuple(product["instruction_attributes"]),
                goal_options=goal_options,
                price_upper=price_upper,
                name=product["Title"],
                query=product["query"],
                category=product["category"],
                product_category=product["product_category"],
            )
    return goals


def split_goals(goals: dict[str, Goal], rng: random.Random) -> dict[str, list[str]]:
    """Test: one goal on each of TEST_PRODUCTS shuffled products; train: all goals of the rest."""
    by_product: dict[str, list[str]] = {}
    for task_id, goal in goals.items():
        by_product.setdefault(goal.asin, []).append(task_id)
    order = list(by_product)
    rng.shuffle(order)
    test = [rng.choice(by_product[asin]) for asin in order[:TEST_PRODUCTS]]
    train = [task_id for asin in order[TEST_PRODUCTS:] for task_id in by_product[asin]]
    rng.shuffle(train)
    return {"train": train, "test": test}
