"""`turnopd data status` (where each dataset resolves, with counts) and `turnopd data fetch` (the full
official data, for machines with internet)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from turnopd.core.data import USER_DATA, DataNotFoundError, data_candidates, resolve_data

DATASETS = {
    "alfworld": ("json_2.1.1", "*/*/*/game.tw-pddl"),
    "webshop": (".", "*.json*"),
    "multihop": (".", "*.json"),
}

# What `fetch` cannot do by itself (the official hosts need a browser session or a large mirror):
MANUAL = {
    "webshop": "the 1.18M-product catalog: run WebShop's setup.sh (github.com/princeton-nlp/WebShop) "
               "and convert items_shuffle.json + items_ins_v2.json into products_*.jsonl / items_ins_v2_*.json",
    "multihop": "full HotpotQA / 2WikiMultihopQA / MuSiQue dev sets from their project pages, in the "
                "format of the data folder's multihop (question, answer, golden paragraphs)",
}


def status(args: argparse.Namespace) -> int:
    print("data roots searched, in order: " + ", ".join(map(str, data_candidates(args.data_dir))))
    for name, (sub, pattern) in DATASETS.items():
        try:
            root = resolve_data(name, args.data_dir)
        except DataNotFoundError:
            print(f"{name:9s} missing (turnopd data fetch {name})")
            continue
        print(f"{name:9s} {root} ({sum(1 for _ in (root / sub).glob(pattern))} files matching {sub}/{pattern})")
    return 0


def fetch(args: argparse.Namespace) -> int:
    dest = USER_DATA if args.dest is None else os.path.expanduser(args.dest)
    if args.dataset != "alfworld":
        print(f"{args.dataset}: fetch it by hand: {MANUAL[args.dataset]}; then set $TURNOPD_DATA or the recipe's "
              "data_dir to the folder holding it.", file=sys.stderr)
        return 2
    target = os.path.join(dest, "alfworld")
    print(f"downloading the ALFWorld json_2.1.1 games with alfworld's own downloader into {target} ...")
    env = {**os.environ, "ALFWORLD_DATA": target}
    downloader = os.path.join(os.path.dirname(sys.executable), "alfworld-download")  # alfworld's script
    result = subprocess.run([downloader, "--data-dir", target], env=env)
    if result.returncode:
        print("alfworld-download failed (it needs internet access to github.com)", file=sys.stderr)
    return result.returncode


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="where task data comes from; fetch the full official data")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    s = data_sub.add_parser("status", help="show where each dataset resolves")
    s.add_argument("--data-dir", help="a data root to try first (as a recipe's data_dir)")
    s.set_defaults(func=status)
    f = data_sub.add_parser("fetch", help="download the full official data (needs internet)")
    f.add_argument("dataset", choices=sorted(DATASETS))
    f.add_argument("--dest", help=f"data root to write (default {USER_DATA})")
    f.set_defaults(func=fetch)
