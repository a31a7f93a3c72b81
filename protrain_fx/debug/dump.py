"""Dumps for a user debugging the backend: PROTRAIN_DUMP_DIR=dir (or options={"dump_dir": dir}).

Layout: <dir>/rank<r>/graph<k>/ with forward.py and backward.py (readable Python), joint.py, profile.csv,
profile.json, params.json, blocks.json, plan.json, costs.json (the predicted step split into its terms, and what the
cost models read), planning.json (the planner's inputs besides the profile) and graphs.json (the graphs as profiled,
as profiler/fusion.py reads them: debug/from_dump.py plans the graph again from these three), seconds.json (wall
time of profiling, the hardware profile and the search) and, after a few steps, predicted_vs_measured.json. Graph
numbers count up per rank in compile order.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from protrain_fx.distributed import rank_and_world_size

log = logging.getLogger(__name__)

# the planner's inputs besides the profile (planner/inputs.py) and the graphs as profiled: debug/from_dump.py
# plans the graph again from them
PLANNING_FILE = "planning.json"
GRAPHS_FILE = "graphs.json"


class Dumper:
    """Writes the files of one compiled graph into the next free graph<k> folder of this rank."""

    def __init__(self, dump_dir: str | os.PathLike):
        rank_dir = Path(dump_dir) / f"rank{rank_and_world_size()[0]}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        k = 0
        while True:  # claim a folder atomically: mkdir fails if another graph took it
            try:
                (rank_dir / f"graph{k}").mkdir()
                break
            except FileExistsError:
                k += 1
        self.dir = rank_dir / f"graph{k}"
        log.info("dumping graph files to %s", self.dir)

    def write_text(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def write_json(self, name: str, data: Any) -> None:
        self.write_text(name, json.dumps(data, indent=2, default=str))
