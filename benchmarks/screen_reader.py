"""The screen reader's test of reading (docs/results/screen-reader-design.md): the reader that
`prepare: screen_reader` builds (the row-tiled tower and its cell reader, 300 steps on the distinct
pages of 100 expert train episodes) reads every distinct page of 40 test-split expert episodes that
no train episode shows (129 pages), each from its own screen and from another page's.

    OMP_NUM_THREADS=2 python benchmarks/screen_reader.py      # builds the reader on first use (~10 min)
    python benchmarks/screen_reader.py --table benchmarks/results/screen_reader.json

Saved to benchmarks/results/screen_reader.json: per page the share of its text cells read right,
the character accuracy (1 - CER) of the text read and the share of its lines read exactly, from its
own screen and from another page's; the most frequent misreadings; the reader's build record. The table: each mean with its t
interval over the pages, and the design's verdict (reads: text cells >= 0.90 from the page's own
screen and < 0.10 from another page's).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path

import torch
from record import Summary, save_result

from turnopd.analysis.frontier import t_interval
from turnopd.loaders.screens import screen_pixel_values
from turnopd.models import prepare_model, read_build_info, vlm
from turnopd.models.screen_reader import ScreenReader, load_screen_reader, reading_pages, reading_test

OPTIONS = {"episodes": 100, "eval_episodes": 40, "steps": 300}  # the design's build
MEASURES = {"cell_accuracy": "text cells read right", "char_accuracy": "characters (1 - CER)",
            "lines_exact": "lines read exactly"}
OWN, OTHER = 0.90, 0.10  # the design's bar on text cells


@torch.no_grad()
def confusions(reader: ScreenReader, pages: list[vlm.PageShot], top: int = 12) -> list[list]:
    """The most frequent misreadings over the pages' text cells: [character, read as, count]."""
    counts: collections.Counter = collections.Counter()
    for page in pages:
        read = reader(screen_pixel_values([page.pixels], reader.processor)).argmax(-1)[0]
        truth = vlm.cell_labels([page], reader.processor)[0]
        wrong = (truth != ord(" ")) & (read != truth)
        counts.update(zip(truth[wrong].tolist(), read[wrong].tolist(), strict=True))
    return [[chr(a), chr(b), n] for (a, b), n in counts.most_common(top)]


def table(record: dict) -> str:
    """The design's table from a saved result: each measure's mean [t 95% over pages], own screen
    and another page's; then the verdict."""
    pages = record["samples"][0]["pages"]

    def cell(key: str) -> str:
        d = t_interval([page[key] for page in pages])
        return f"{d.value:.3f} [{d.lo:.3f}, {d.hi:.3f}]"

    lines = [f"| {len(pages)} held-out pages | own screen [t 95% over pages] | another page's screen |", "| --- | ---: | ---: |"]
    lines += [f"| {label} | {cell(key)} | {cell(key + '_swapped')} |" for key, label in MEASURES.items()]
    own, other = (statistics.fmean(page[key] for page in pages) for key in ("cell_accuracy", "cell_accuracy_swapped"))
    verdict = "reads" if own >= OWN and other < OTHER else "does not read"
    lines += ["", f"By the design's bar (text cells >= {OWN:.2f} from the page's own screen, < {OTHER:.2f} from "
                  f"another page's): **{verdict}** ({own:.3f} / {other:.3f})."]
    if "confusions" in record["samples"][0]:
        lines += ["", "Most frequent misreadings (character -> read as, text cells of the held-out pages): " + ", ".join(
            f"`{a}` -> `{b}` {n}" for a, b, n in record["samples"][0]["confusions"]) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", metavar="FILE", help="print the table of a saved result and run nothing")
    for key, value in OPTIONS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value,
                            help=f"default {value}, the design's (other values build a scratch reader)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())), end="")
        return
    options = {key: getattr(args, key) for key in OPTIONS}
    folder = prepare_model("screen_reader", None if options == OPTIONS else Path(tempfile.mkdtemp()) / "reader", **options)
    build = read_build_info(folder)
    _, held_out = reading_pages(options["episodes"], options["eval_episodes"])
    reader = load_screen_reader(folder)
    pages = reading_test(reader, held_out)
    summaries = [Summary.of(f"{label}, {screen}", [page[key + suffix] for page in pages], "fraction")
                 for key, label in MEASURES.items()
                 for suffix, screen in (("", "own screen"), ("_swapped", "another page's screen"))]
    samples = [{"reader": str(folder), "build": build, "pages": pages, "confusions": confusions(reader, held_out)}]
    save_result("screen_reader", f"the screen reader on {len(pages)} held-out WebShop pages: own screen vs another "
                "page's", summaries, samples)
    print(table({"samples": samples}), end="")


if __name__ == "__main__":
    main()
