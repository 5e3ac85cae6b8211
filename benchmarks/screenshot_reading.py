"""Does the VLM student read the screen? The test of reading on held-out WebShop pages: each page
with its own screenshot against the same page with another page's (the gap is the reading).

    OMP_NUM_THREADS=2 python benchmarks/screenshot_reading.py                 # the recipe's VLM shape, 100 steps
    python benchmarks/screenshot_reading.py --steps 100 --pages 16 --seeds 0
    python benchmarks/screenshot_reading.py --layouts grid row_tiles         # both screen layouts, side by side
    python benchmarks/screenshot_reading.py --table benchmarks/results/screenshot_reading_layouts.json  # its table
    python benchmarks/screenshot_reading.py --layouts row_tiles --steps 2000 --train-episodes 400 --tag scale

Per seed: a fresh `tiny_vlm` (turnopd.models.vlm.new_tiny_vlm, the shape of
recipes/webshop/screenshot_student_sft.yaml's build: text hidden 128 x 3 layers, a SigLIP tower of
hidden 512 x 1 layer (the default build's is 128), patch 24 = 2 rows x 4 columns of character cells, 576 image tokens a
page) trains its transcription stage with the cell reader (vlm.train_transcription: transcription
loss plus each patch's 8 cells' characters) on the distinct expert pages of 100 train-split episodes, then
vlm.reading_test on --pages test-split pages spread over the distinct pages of 20 test episodes
(none seen in training): the characters the reader gets right from the tower's patch features
(what the projector turns into the image tokens), and the language model's teacher-forced transcription token accuracy, right screen
against swapped. With several --layouts (turnopd.loaders.screens.SCREEN_LAYOUTS: the screen as
drawn, or each patch 8 consecutive cells of a row in reading order) each seed builds, trains and
tests one model per layout, the same init seed, pages and batches. Summaries are medians over the
held-out pages with their range (per-page values in the samples), one set per layout; saved to
benchmarks/results/screenshot_reading.json, with several layouts to screenshot_reading_layouts.json
(docs/screenshots.md; the layout comparison's design: docs/results/reading-layout-design.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from record import Summary, save_result

from turnopd.analysis.frontier import t_interval
from turnopd.loaders.screens import SCREEN_LAYOUTS
from turnopd.models import vlm
from turnopd.models.env_text import env_corpus

SIZE = {"hidden_size": 128, "num_layers": 3, "num_heads": 4, "max_position_embeddings": 4096,
        "vision_hidden_size": 512}  # the tower: hidden 512 (the default build keeps 128), the rest its defaults


def per_page(model, processor, reader, pages: list[vlm.PageShot]) -> list[dict[str, float]]:
    """vlm.reading_test of each page alone (its swapped screen: the next page's)."""
    swapped = vlm.swapped_screens(pages)
    return [{"cell_accuracy": vlm.cell_accuracy(model.model.vision_tower, reader, processor, [page]),
             "cell_accuracy_swapped": vlm.cell_accuracy(model.model.vision_tower, reader, processor, [other]),
             "token_accuracy": vlm.token_accuracy(model, processor, [page]),
             "token_accuracy_swapped": vlm.token_accuracy(model, processor, [other])}
            for page, other in zip(pages, swapped, strict=True)]


def run(seed: int, steps: int, pages: int, layout: str, train_episodes: int = 100) -> dict:
    texts = env_corpus({"name": "webshop", "history_length": 1, "max_turns": 10}, None, 100)  # the tokenizer's
    model, processor = vlm.new_tiny_vlm(texts, seed=seed, screen_layout=layout, **SIZE)
    train = vlm.play_pages("train", train_episodes, seed=seed)
    held_out = vlm.spread(vlm.play_pages("test", 20, seed=seed), pages)
    assert not {p.text for p in train} & {p.text for p in held_out}, "a held-out page was trained on"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reader = vlm.cell_reader_for(model)
        start = time.perf_counter()
        losses = vlm.train_transcription(model, processor, train, steps=steps, batch_size=4, lr=3e-3,
                                         reader=reader, seed=seed, log_every=10)
        seconds = time.perf_counter() - start
    rows = per_page(model, processor, reader, held_out)
    print(f"seed {seed}, {layout}: {len(train)} train pages, {steps} steps in {seconds:.0f} s; held-out means: "
          + ", ".join(f"{k} {sum(r[k] for r in rows) / len(rows):.3f}" for k in rows[0]), flush=True)
    return {"seed": seed, "layout": layout, "train_pages": len(train), "held_out_pages": len(held_out), "steps": steps,
            "train_seconds": round(seconds, 1), "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "parameters": model.num_parameters(), "pages": rows}


READS = 0.05  # docs/results/reading-layout-design.md: a layout reads if its gap's interval lies above this


def layout_table(samples: list[dict]) -> str:
    """The layout comparison's table (docs/results/reading-layout-design.md) from a saved run's samples:
    per layout the reading gap (token accuracy with the page's screen minus another page's), its mean
    with the t interval over the held-out pages, and the means it comes from; then each layout's gap
    minus the first layout's, paired by page (the same seed draws the same pages in the same order)."""
    layouts = list(dict.fromkeys(s["layout"] for s in samples))

    def rows(layout: str) -> list[dict]:
        return [row for s in samples if s["layout"] == layout for row in s["pages"]]

    def gaps(layout: str) -> list[float]:
        return [row["token_accuracy"] - row["token_accuracy_swapped"] for row in rows(layout)]

    def mean(layout: str, key: str) -> float:
        return statistics.fmean(row[key] for row in rows(layout))

    lines = [f"| layout | pages | reading gap [t 95% over pages] | reads (interval above {READS}) | token accuracy, "
             "right / another page's screen | cell reader, right / another page's screen |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for layout in layouts:
        gap = t_interval(gaps(layout))
        lines.append(f"| {layout} | {len(rows(layout))} | {gap.value:+.3f} [{gap.lo:+.3f}, {gap.hi:+.3f}] | "
                     f"{'yes' if gap.lo > READS else 'no'} | {mean(layout, 'token_accuracy'):.3f} / "
                     f"{mean(layout, 'token_accuracy_swapped'):.3f} | {mean(layout, 'cell_accuracy'):.3f} / "
                     f"{mean(layout, 'cell_accuracy_swapped'):.3f} |")
    for layout in layouts[1:]:
        d = t_interval([a - b for a, b in zip(gaps(layout), gaps(layouts[0]), strict=True)])
        lines += ["", f"{layout} - {layouts[0]}, the reading gap paired by page: {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}] "
                      "(t 95% over pages; one init seed, so seed variation is not in it)."]
    return "\n".join(lines) + "\n"


def saved_samples(files: list[str], layouts: list[str] | None = None) -> list[dict]:
    """The samples of saved result files (of `layouts` only, when given; files older than the layouts
    are grid's); from several files (builds of one seed, the same held-out pages) each build's layout
    is labelled with its steps and train pages, so that layout_table pairs them by page."""
    samples = [sample for name in files for sample in json.loads(Path(name).read_text())["samples"]
               if layouts is None or sample.get("layout", "grid") in layouts]
    if len(files) == 1:
        return samples
    return [{**s, "layout": f"{s.get('layout', 'grid')}, {s['steps']} steps on {s['train_pages']} pages"} for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--layouts", nargs="+", choices=SCREEN_LAYOUTS, help="default: grid (with --table: every layout)")
    parser.add_argument("--train-episodes", type=int, default=100, help="expert episodes whose distinct pages train it")
    parser.add_argument("--tag", help="saved as screenshot_reading_<tag>.json (a run that must not replace the others)")
    parser.add_argument("--table", metavar="FILE", nargs="+", help="print the layout table of saved result files "
                        "and run nothing; of several, each build labelled by its steps and pages, paired with the first")
    args = parser.parse_args()
    if args.table:
        print(layout_table(saved_samples(args.table, args.layouts)), end="")
        return
    args.layouts = args.layouts or ["grid"]
    samples = [run(seed, args.steps, args.pages, layout, args.train_episodes)
               for seed in args.seeds for layout in args.layouts]
    labels = {"cell_accuracy": "characters read from the patch features, right screen",
              "cell_accuracy_swapped": "characters read from the patch features, another page's screen",
              "token_accuracy": "transcription token accuracy (teacher-forced), right screen",
              "token_accuracy_swapped": "transcription token accuracy (teacher-forced), another page's screen"}
    summaries = []
    for layout in args.layouts:
        runs = [s for s in samples if s["layout"] == layout]
        rows = [row for sample in runs for row in sample["pages"]]
        tag = f" ({layout})" if len(args.layouts) > 1 else ""
        summaries += [Summary.of(label + tag, [row[key] for row in rows], "fraction") for key, label in labels.items()]
        summaries.append(Summary.of("the language model's reading gap, token accuracy right minus another page's screen"
                                    + tag, [row["token_accuracy"] - row["token_accuracy_swapped"] for row in rows], "fraction"))
        summaries.append(Summary.of("training seconds" + tag, [s["train_seconds"] for s in runs], "s"))
    readings = sum(len(s["pages"]) for s in samples) // len(args.layouts)
    name = (f"screenshot_reading_{args.tag}" if args.tag  # else keep the grid run's file
            else "screenshot_reading" if len(args.layouts) == 1 else "screenshot_reading_layouts")
    save_result(name, f"reading held-out WebShop screenshots: right vs another page's screen "
                f"({readings} held-out page readings{' a layout' if len(args.layouts) > 1 else ''})", summaries, samples)


if __name__ == "__main__":
    main()
