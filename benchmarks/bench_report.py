"""What every kernel benchmark's JSON carries besides its figures: the machine, the date and
the load average before and after (a shared box shows as a high load), written once here."""
from __future__ import annotations

import json
import os
import platform
import time

import torch


class BenchReport:
    """Start it before measuring; `finish` adds the context, prints the load line and writes
    the JSON (when a path is given)."""

    def __init__(self) -> None:
        self.loadavg_start = os.getloadavg()

    def finish(self, result: dict, json_path: str | None) -> dict:
        result.update(loadavg_start=self.loadavg_start, loadavg_end=os.getloadavg(),
                      machine={"cpu_count": os.cpu_count(), "platform": platform.platform(),
                               "torch": torch.__version__,
                               "torch_threads": torch.get_num_threads()},
                      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        print(f"load average {result['loadavg_start']} -> {result['loadavg_end']}")
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=2)
        return result
