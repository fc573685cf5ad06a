"""``ropekv replay``: real bugs engines shipped, replayed on their buggy and fixed releases side by side."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..replay.corpus import default_corpus_path, load_corpus
from ..replay.run import replay
from ..replay.table import format_table
from ..replay.venvs import default_root
from .options import writable_path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="replay real engine bugs: each buggy release must fail with its bug class, each fixed one pass",
        description="For every entry of a replay corpus (TOML; docs/replay.md): install the buggy and the fixed "
        "release of the engine into cached venvs (pinned; pip's cache reused), run ropekv's check of the entry's "
        "case on a tiny generated model in each, and print one table. Exit 0: every entry replays (buggy FAILS "
        "with the expected class, fixed PASSES); 1: some entry does not (the reason is printed under the table); "
        "2: a bad corpus or flag.",
    )
    p.add_argument(
        "--corpus", metavar="FILE", help=f"a corpus file of your own (default: ropekv's, {default_corpus_path().name})"
    )
    p.add_argument(
        "--venvs",
        metavar="DIR",
        help=f"where the venvs and tiny models are cached (default {default_root()})",
    )
    p.add_argument("--entries", metavar="NAME[,NAME...]", help="replay only these entries")
    p.add_argument("--json", metavar="FILE", help="also write every side's result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    out = writable_path(args.json, "--json")
    corpus = load_corpus(args.corpus).select(args.entries.split(",") if args.entries else None)
    root = Path(args.venvs) if args.venvs else default_root()
    start = time.monotonic()

    def log(line: str) -> None:
        if not args.quiet:
            print(f"replay {time.monotonic() - start:6.0f}s {line}", file=sys.stderr, flush=True)

    outcomes = replay(corpus, root, log=log)
    print(format_table(outcomes))
    if out is not None:
        out.write_text(json.dumps({"corpus": corpus.source, "entries": [o.to_dict() for o in outcomes]}, indent=2))
    return 0 if all(o.replayed for o in outcomes) else 1
