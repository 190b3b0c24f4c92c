"""What the GPU diagnostics share: a result header, and one configuration run so that a failure or a
timeout never loses the configurations already measured (the JSON is rewritten after each)."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch


def new_result() -> dict[str, Any]:
    """``{"device", "torch", "date", "configs": []}`` for this GPU, with TF32 off for matmuls (as measured)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "configs": []}


def run_config(result: dict[str, Any], out: str, row: dict[str, Any],
               measure: Callable[[], dict[str, Any]], show: tuple[str, ...] = ("step_ms",)) -> None:
    """Fill ``row`` with ``measure()`` (or the error it raised) and its duration, append it to ``result``,
    print it and rewrite ``out``."""
    t = time.perf_counter()
    try:
        row.update(measure())
    except Exception as e:  # noqa: BLE001 - one failure must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t, 1)
    result["configs"].append(row)
    print(row["model"], row.get("model_kwargs"), row["policy"], *(row.get(k) for k in show), row.get("error", ""),
          f"{row['seconds']} s", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
