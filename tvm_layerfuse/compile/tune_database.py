"""Where the tuning records of a target live (written by ``tune``, applied by ``compile``).

One JSON database (MetaSchedule's ``database_workload.json`` + ``database_tuning_record.json``)
per resolved target, ``-mcpu`` included, under ``$TVM_LAYERFUSE_CACHE/tune`` (default
``~/.cache/tvm_layerfuse/tune``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional


def database_dir(target_dict: Mapping[str, Any], host: Optional[Mapping[str, Any]] = None) -> Path:
    """The tuning database of a target: one folder per resolved target (mcpu included)."""
    key = json.dumps({"target": target_dict, "host": host}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("TVM_LAYERFUSE_CACHE", Path.home() / ".cache" / "tvm_layerfuse"))
    kind = str(target_dict.get("kind", "target"))
    mcpu = str(target_dict.get("mcpu") or target_dict.get("arch") or "")
    return root / "tune" / f"{kind}{'-' + mcpu if mcpu else ''}-{digest}"


def has_database(path: Path) -> bool:
    records = path / "database_tuning_record.json"
    return records.is_file() and records.stat().st_size > 0
